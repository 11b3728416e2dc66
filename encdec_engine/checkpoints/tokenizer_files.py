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

which need the optional `sentencepiece` and `protobuf` packages (`pip install 'encdec-engine[sentencepiece]'`;
Marian and M2M100 need them even beside a `tokenizer.json`, having no other tokenizer in transformers).
Here a folder it cannot serve fails with a ValueError that names the files and what is missing, instead of
transformers' guesses.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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
INSTALL_SENTENCEPIECE = "pip install 'encdec-engine[sentencepiece]'"
# Layouts transformers can also read from a tokenizer.json, so that adding one is the other way out.
_HAS_FAST_FORM = ("spiece.model", SENTENCEPIECE_MODEL)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def _missing_packages() -> list[str]:
    """The SentencePiece packages this install lacks: [], ["sentencepiece"], ["sentencepiece", "protobuf"]."""
    return [name.split(".")[-1] for name in _SENTENCEPIECE_PACKAGES if not _has_module(name)]


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
        packages = _missing_packages()
        if packages:
            raise ValueError(missing_sentencepiece(folder / marker, packages, marker in _HAS_FAST_FORM))
        return
    layouts = ", ".join(" + ".join(files) for _, files, _ in SENTENCEPIECE_LAYOUTS)
    raise ValueError(f"{folder}: no tokenizer files ({TOKENIZER_JSON}, {' + '.join(BPE_FILES)} or a SentencePiece "
                     f"layout: {layouts}); point tokenizer= at a folder that has them, or pass "
                     "skip_tokenizer_init=True to work on token ids")


def missing_sentencepiece(path: Path, packages: list[str], tokenizer_json_helps: bool = False) -> str:
    """The error for a SentencePiece tokenizer at `path` read without `packages`: what to install."""
    names = " and ".join(packages)
    plural = len(packages) > 1
    return (f"{path}: reading a SentencePiece tokenizer needs the {names} package{'s' if plural else ''}, which "
            f"{'are' if plural else 'is'} not installed: {INSTALL_SENTENCEPIECE}"
            + (f" (or give the folder a {TOKENIZER_JSON})" if tokenizer_json_helps else ""))


@contextmanager
def quiet_marian_normalizer() -> Iterator[None]:
    """Drop MarianTokenizer's "Recommended: pip install sacremoses." warning while a tokenizer loads.

    Without sacremoses the tokenizer sets its Moses punctuation normalizer to the identity and warns; but
    transformers never calls that normalizer (`MarianTokenizer.normalize` has no caller in encode or
    decode), so the ids and text are the same with or without sacremoses and the advice is noise
    (tests/checkpoints/test_sentencepiece_extra.py checks both). Only that message is filtered."""
    # The filters are the process's while the load runs: another thread's warnings of that text are
    # dropped too, and nothing else.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Recommended: pip install sacremoses", category=UserWarning)
        yield


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

    try:
        with quiet_marian_normalizer():
            return AutoTokenizer.from_pretrained(folder)
    except ImportError as e:  # a class with no tokenizers-only form (Marian, M2M100) beside a tokenizer.json
        packages = _missing_packages()
        if not packages or "sentencepiece" not in str(e).lower() and "protobuf" not in str(e).lower():
            raise
        raise ValueError(missing_sentencepiece(folder, packages)) from e


def tokenizer_if_any(folder: Path):
    """The folder's tokenizer, or None when it has none this install can read."""
    try:
        return load_tokenizer(folder)
    except ValueError:
        return None
