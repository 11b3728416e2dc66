"""Loading a checkpoint's tokenizer from whichever files it ships.

A Whisper `tokenizer.json` with its `tokenizer_config.json` (as transformers 5 writes them, or 4.x
with `added_tokens_decoder`) is read with `tokenizers` alone (checkpoints/whisper_tokenizer.py), sparing
the transformers import, unless it needs rules that module does not repeat. Otherwise transformers reads
every layout we serve: `tokenizer.json` (the fast tokenizer),
the slow files `vocab.json` + `merges.txt` (byte-level BPE: BART, GPT-2, Whisper;
special tokens from `tokenizer_config.json` / `added_tokens.json`), and a
SentencePiece `tokenizer.model` (Llama), which it converts with the optional
`sentencepiece` and `protobuf` packages. Here a folder it cannot serve fails
with an error that names the files and what is missing, instead of
transformers' guesses.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from encdec_engine.checkpoints.whisper_tokenizer import read_whisper_tokenizer

TOKENIZER_JSON = "tokenizer.json"
BPE_FILES = ("vocab.json", "merges.txt")
SENTENCEPIECE_MODEL = "tokenizer.model"
_SENTENCEPIECE_PACKAGES = ("sentencepiece", "google.protobuf")


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def check_tokenizer_files(folder: Path) -> None:
    """Raise ValueError when `folder` has no tokenizer layout this install can read."""
    if (folder / TOKENIZER_JSON).is_file() or all((folder / f).is_file() for f in BPE_FILES):
        return
    if (folder / SENTENCEPIECE_MODEL).is_file():
        missing = [name.split(".")[-1] for name in _SENTENCEPIECE_PACKAGES if not _has_module(name)]
        if missing:
            raise ValueError(f"{folder / SENTENCEPIECE_MODEL}: reading a SentencePiece tokenizer needs the "
                             f"{' and '.join(missing)} package(s) (pip install 'encdec-engine[sentencepiece]'); "
                             f"or add a {TOKENIZER_JSON}")
        return
    raise ValueError(f"{folder}: no tokenizer files ({TOKENIZER_JSON}, {' + '.join(BPE_FILES)} or "
                     f"{SENTENCEPIECE_MODEL}); point tokenizer= at a folder that has them, or pass "
                     "skip_tokenizer_init=True to work on token ids")


def load_tokenizer(folder: Path):
    """The folder's tokenizer: a Whisper tokenizer.json read directly (checkpoints/whisper_tokenizer.py),
    anything else through `AutoTokenizer`."""
    check_tokenizer_files(folder)
    tokenizer = read_whisper_tokenizer(folder)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def tokenizer_if_any(folder: Path):
    """The folder's tokenizer, or None when it has none this install can read."""
    try:
        return load_tokenizer(folder)
    except ValueError:
        return None
