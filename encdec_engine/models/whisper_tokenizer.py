"""Whisper's tokenizer read with `tokenizers` alone, for loads that never import transformers.

transformers spends about a second importing itself before it reads a file, so a one-file
transcription served by transformers' `WhisperTokenizer` pays that on every start. This class
reads the same `tokenizer.json` into a `tokenizers.Tokenizer` and gives the engine what it calls
of transformers' tokenizer, with the same results (tests/test_whisper_files.py checks encode,
decode, special ids and added tokens against transformers on the layouts it reads):

- the backend is rebuilt the way `WhisperTokenizer` rebuilds it: the file's BPE model and added
  tokens, no normalizer, a byte-level pre-tokenizer (`add_prefix_space` from tokenizer_config.json),
  a byte-level decoder, and a post-processor that wraps `add_special_tokens=True` encodings in the
  prefix tokens (`<|startoftranscript|>`, the configured language and task, `<|notimestamps|>`
  unless timestamps are predicted) and `<|endoftext|>`;
- `decode` drops timestamp text (`<|1.24|>`) as transformers does, and with `skip_special_tokens`
  the previous-text prompt (`<|startofprev|> ... <|startoftranscript|>`);
- the special tokens are the named ones of tokenizer_config.json (bos, eos, unk, ...; Whisper's
  default `<|endoftext|>`) and its `extra_special_tokens` / `additional_special_tokens`.

`read_whisper_tokenizer` returns None for a folder whose layout transformers reads with rules this
class does not repeat (legacy `special_tokens_map.json` or `added_tokens.json` files, added tokens
that differ between tokenizer.json and tokenizer_config.json, a BPE model with other settings); the
loader then uses transformers.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers, processors

from encdec_engine.models.generation_config import read_json
from encdec_engine.models.whisper_languages import LANGUAGES, TO_LANGUAGE_CODE

logger = logging.getLogger(__name__)

WHISPER_TOKENIZER_CLASSES = ("WhisperTokenizer", "WhisperTokenizerFast")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_WHISPER_NAMED_DEFAULTS = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
# The BPE settings WhisperTokenizer builds its model with; a file with others is left to transformers.
_BPE_SETTINGS = {"dropout": None, "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                 "byte_fallback": False, "ignore_merges": False}
_TIMESTAMP_TEXT = re.compile(r"<\|(\d+\.\d+)\|>")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class WhisperTextTokenizer:
    """The part of transformers' `WhisperTokenizer` the engine uses, over a `tokenizers.Tokenizer`."""

    def __init__(self, backend: Tokenizer, settings: dict, name_or_path: str) -> None:
        self.backend_tokenizer = backend
        self.name_or_path = name_or_path
        self.clean_up_tokenization_spaces = bool(settings.get("clean_up_tokenization_spaces") or False)
        named = {key: _token_text(settings.get(key, _WHISPER_NAMED_DEFAULTS.get(key))) for key in _NAMED_SPECIAL}
        for key, token in named.items():
            setattr(self, key, token)
            setattr(self, f"{key}_id", None if token is None else backend.token_to_id(token))
        extra = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
        tokens = [t for t in named.values() if t is not None] + [_token_text(t) for t in extra]
        self.all_special_tokens = list(dict.fromkeys(tokens))
        self.all_special_ids = [backend.token_to_id(t) for t in self.all_special_tokens]
        self.language, self.task = settings.get("language"), settings.get("task")
        self.predict_timestamps = bool(settings.get("predict_timestamps") or False)
        self._transformers = None
        self._set_post_processor()

    # -- what WhisperTokenizer's constructor sets up ------------------------
    def prefix_tokens(self) -> list[int]:
        sot = self.convert_tokens_to_ids("<|startoftranscript|>")
        prefix = [sot]
        if self.language is not None:
            name = self.language.lower()
            code = TO_LANGUAGE_CODE.get(name, name)
            if code not in LANGUAGES:
                raise ValueError(f"{self.name_or_path}: tokenizer_config.json names language {self.language!r}, "
                                 "which Whisper does not know")
            prefix.append(sot + 1 + list(LANGUAGES).index(code))  # by table position, as transformers counts
        if self.task is not None:
            if self.task not in ("transcribe", "translate"):
                raise ValueError(f"{self.name_or_path}: tokenizer_config.json names task {self.task!r}; "
                                 "Whisper's are transcribe and translate")
            prefix.append(self.convert_tokens_to_ids(f"<|{self.task}|>"))
        if not self.predict_timestamps:
            prefix.append(self.convert_tokens_to_ids("<|notimestamps|>"))
        return prefix

    def _set_post_processor(self) -> None:
        ids = self.prefix_tokens()
        names = self.convert_ids_to_tokens(ids)
        template = " ".join(f"{name}:0" for name in names)
        eos = self.eos_token
        self.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{template} $A:0 {eos}:0", pair=f"{template} $A:0 $B:1 {eos}:1",
            special_tokens=[(eos, self.eos_token_id), *zip(names, ids)])

    # -- vocabulary ----------------------------------------------------------
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def add_tokens(self, tokens: list[str]) -> int:
        return self.backend_tokenizer.add_tokens(tokens)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else ()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.backend_tokenizer.decoder.decode(tokens)

    # -- text ----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        encoding = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask}

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """The text of `token_ids`, without timestamp tokens; `skip_special_tokens` also drops the
        previous-text prompt. Tokenization spaces are never cleaned up: transformers ignores that flag
        for BPE tokenizers such as Whisper's."""
        ids = [int(i) for i in ([token_ids] if isinstance(token_ids, int) else token_ids)]
        if skip_special_tokens:
            ids = self._strip_prompt(ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _TIMESTAMP_TEXT.sub("", text)

    def _strip_prompt(self, ids: list[int]) -> list[int]:
        prompt, start = self.convert_tokens_to_ids("<|startofprev|>"), self.convert_tokens_to_ids("<|startoftranscript|>")
        if not ids or prompt is None or ids[0] != prompt:
            return ids
        return ids[ids.index(start):] if start in ids else []

    def transformers_tokenizer(self):
        """transformers' tokenizer of the same files (imported and loaded at the first call), with the
        tokens this one was given since (timestamp tokens a folder lacked) added at the same ids."""
        if self._transformers is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.name_or_path)
            tokenizer.add_tokens(self.convert_ids_to_tokens(list(range(len(tokenizer), len(self)))))
            self._transformers = tokenizer
        return self._transformers

    def __repr__(self) -> str:
        return f"WhisperTextTokenizer({self.name_or_path!r}, vocab={len(self)})"


def read_whisper_tokenizer(folder: Path) -> WhisperTextTokenizer | None:
    """The folder's Whisper tokenizer without transformers, or None when its layout is one transformers
    reads by rules this module does not repeat (see the module docstring)."""
    config_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_path.is_file()):
        return None
    settings = read_json(config_path)
    if settings.get("tokenizer_class") not in WHISPER_TOKENIZER_CLASSES:
        return None
    legacy = [name for name in _LEGACY_FILES if (folder / name).is_file()]
    if legacy and "added_tokens_decoder" not in settings:
        return _not_here(folder, f"legacy {' and '.join(legacy)}")
    try:
        backend = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions on bad files
        raise ValueError(f"{tokenizer_path}: not a tokenizer file `tokenizers` can read ({e})") from e
    model = backend.model
    if type(model).__name__ != "BPE":
        return _not_here(folder, f"a {type(model).__name__} model")
    differs = [key for key, want in _BPE_SETTINGS.items() if _unset(getattr(model, key, want)) != _unset(want)]
    if differs:
        return _not_here(folder, f"BPE settings {differs}")
    if "added_tokens_decoder" in settings:
        added = {i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}  # ~0.1 s
        listed = {int(i): (t["content"], bool(t.get("special"))) for i, t in settings["added_tokens_decoder"].items()}
        if listed != added:
            return _not_here(folder, "added tokens that differ between tokenizer.json and tokenizer_config.json")
    named = [_token_text(settings.get(key, _WHISPER_NAMED_DEFAULTS.get(key))) for key in _NAMED_SPECIAL]
    extra = [_token_text(t) for t in settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []]
    missing = [t for t in named + extra if t is not None and backend.token_to_id(t) is None]
    if missing:
        return _not_here(folder, f"special tokens {missing[:3]} outside the vocabulary")
    for key in ("language", "task"):
        if settings.get(key) is not None and not isinstance(settings[key], str):
            raise ValueError(f"{config_path}: {key} must be a string, got {settings[key]!r}")
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.get("add_prefix_space") or False))
    backend.decoder = decoders.ByteLevel()
    return WhisperTextTokenizer(backend, settings, str(folder))


def _unset(value):
    return None if value in (None, "") else value


def _not_here(folder: Path, why: str) -> None:
    logger.info("%s: the tokenizer has %s; reading it with transformers", folder, why)
    return None
