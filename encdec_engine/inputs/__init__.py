"""What a request's input is and how it becomes tokens or features; used by the engine, speech/, server/ and cli/.

    prompts.py          prompt types (TextPrompt, TokensPrompt, ...) and parse_prompt, which tags them
    preprocess.py       InputProcessor: a prompt of any format -> decoder tokens and an encoder sequence
    prompt_files.py     prompt files: one JSON prompt per line
    documents.py        text documents for summarization, bounded in size
    audio.py            audio of any format -> float32 mono at 16 kHz
    ffmpeg.py           ffmpeg for the containers libsndfile cannot read
    features.py         the Whisper log-mel, batched in torch
    pcm_stream.py       live audio chunks (PCM16 bytes or arrays, any rate) -> 16 kHz
"""
