"""The model architectures over attention/ and layers/, no serving logic; engine/loader.py builds them.

    registry.py         which model class serves a checkpoint: one registration per family
    interface.py        what the model runner expects of a model
    bart_family.py      BART, mBART, Marian and M2M100/NLLB as one encoder/decoder with switches
    bart.py, mbart.py, marian.py, m2m100.py   each family's switches (norm placement, positions, start token)
    t5.py               T5 and mT5
    whisper.py          Whisper
    encdec_layers.py    the attention and layer the BART family, Whisper and T5 share
    gpt2.py             GPT-2: the decoder-only degenerate case
    llama.py            Llama: decoder-only, RoPE and grouped-query attention
"""
