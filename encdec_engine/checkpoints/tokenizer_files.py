"""Loading a checkpoint's tokenizer from whichever files it ships.

A Whisper `tokenizer.json` with its `tokenizer_config.json` (as transformers 5 writes them, or 4.x
with `added_tokens_decoder`) is read with `tokenizers` alone (checkpoints/whisper/tokenizer.py), sparing
the transformers import, unless it needs rules that module does not repeat. Otherwise transformers reads
every layout we serve: `tokenizer.json` (the fast tokenizer), the slow files `vocab.json` + `merges.txt`
(byte-level BPE: BART, GPT-2, Whisper; special tokens from `tokenizer_config.json` /
`added_tokens.json`), and the SentencePiece layouts the hub publishes without a `tokenizer.json`:

    spiece.model                              T5, mT5
    source.spm + target.spm + vocab.json      Marian (OPUS-MT)
    sentencepiece.bpe.model + vocab.json      M2M100
    sentencepiece.bpe.model                   mBART, mBART-50, NLLB
    tokenizer.model                           Llama

which need the optional `sentencepiece` and `protobuf` packages. Here a folder it cannot serve fails
with an error that names the files and what is missing, instead of transformers' guesses.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from encdec_engine.checkpoints.json_files import read_json
from encdec_engine.checkpoints.whisper.tokenizer import read_whisper_tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
BPE_FILES = ("vocab.json", "merges.txt")
SENTENCEPIECE_MODEL = "tokenizer.model"
# SentencePiece layouts: the file that marks one, every file it needs, whose layout it is.
SENTENCEPIECE_LAYOUTS = (
    ("spiece.model", ("spiece.model",), "T5 / mT5"),
    ("source.spm", ("source.spm", "target.spm", "vocab.json"), "Marian"),
    ("sentencepiece.bpe.model", ("sentencepiece.bpe.model",), "mBART / NLLB / M2M100"),
    (SENTENCEPIECE_MODEL, (SENTENCEPIECE_MODEL,), "Llama"),
)
# Tokenizer classes (tokenizer_config.json) whose SentencePiece layout needs more than its marker.
_EXTRA_FILES = {"M2M100Tokenizer": ("vocab.json",)}
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
    for marker, files, family in SENTENCEPIECE_LAYOUTS:
        if not (folder / marker).is_file():
            continue
        needed = files + _EXTRA_FILES.get(_tokenizer_class(folder), ())
        missing = [f for f in needed if not (folder / f).is_file()]
        if missing:
            raise ValueError(f"{folder / marker}: a {family} SentencePiece tokenizer also needs "
                             f"{' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not in {folder}")
        packages = [name.split(".")[-1] for name in _SENTENCEPIECE_PACKAGES if not _has_module(name)]
        if packages:
            raise ValueError(f"{folder / marker}: reading a SentencePiece tokenizer needs the "
                             f"{' and '.join(packages)} package(s) (pip install 'encdec-engine[sentencepiece]'); "
                             f"or add a {TOKENIZER_JSON}")
        return
    layouts = ", ".join(" + ".join(files) for _, files, _ in SENTENCEPIECE_LAYOUTS)
    raise ValueError(f"{folder}: no tokenizer files ({TOKENIZER_JSON}, {' + '.join(BPE_FILES)} or a SentencePiece "
                     f"layout: {layouts}); point tokenizer= at a folder that has them, or pass "
                     "skip_tokenizer_init=True to work on token ids")


def _tokenizer_class(folder: Path) -> str | None:
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    value = read_json(path).get("tokenizer_class")
    return value if isinstance(value, str) else None


def load_tokenizer(folder: Path):
    """The folder's tokenizer: a Whisper tokenizer.json read directly (checkpoints/whisper/tokenizer.py),
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
