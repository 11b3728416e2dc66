"""Whisper checkpoints without transformers: tokenizer, special tokens, languages; used by speech/ and models/.

    tokenizer.py     Whisper's tokenizer read with `tokenizers` alone
    tokens.py        the special tokens and decoder prompts, from the generation config
    vocab.py         special-token ids for checkpoints whose generation config lacks them
    defaults.py      openai-whisper's decoding defaults (suppressed tokens, ...) for configs lacking them
    languages.py     the languages Whisper knows, in the order of its language tokens
"""
