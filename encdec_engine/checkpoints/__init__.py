"""Reading checkpoints (disk or hub), transformers spared where possible; used by engine/loader.py and above.

    names.py                  model names (tiny.en ... turbo, hub ids, folders) resolved to a checkpoint folder
    hub.py                    the Hugging Face hub: a repository in the standard cache, or downloaded into it
    weights.py                safetensors or .bin weights read into our modules
    model_config.py           a Whisper config.json read without transformers
    generation_config.py      a checkpoint's generation config, every field its file holds
    json_files.py             reading a checkpoint's JSON files
    tokenizer_files.py        a checkpoint's tokenizer loaded from whichever files it ships
    whisper/                  Whisper's tokenizer, special tokens, languages and decoding defaults
    ct2/                      CTranslate2 (faster-whisper) folders imported as Hugging Face checkpoints
"""
