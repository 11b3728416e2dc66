"""Whisper's tokenizer read with `tokenizers` alone, for loads that never import transformers.

transformers spends about a second importing itself before it reads a file, so a one-file
transcription served by transformers' `WhisperTokenizer` pays that on every start. This class
reads the same `tokenizer.json` into a `tokenizers.Tokenizer` and gives the engine what it calls
of transformers' tokenizer, with the same results (tests/checkpoints/test_whisper_files.py checks encode,
decode, special ids and added tokens against transformers on the layouts it reads):

- transformers rebuilds the backend from the file's vocabulary and merges with Whisper's fixed
  pipeline; this class keeps the file's BPE model (read only when its settings are the ones
  transformers builds with) and added tokens (only when they are the ones transformers adds), and
  sets the same pipeline: no normalizer, a byte-level pre-tokenizer (`add_prefix_space` from
  tokenizer_config.json), a byte-level decoder, no truncation or padding, and a post-processor
  that wraps `add_special_tokens=True` encodings in the prefix tokens (`<|startoftranscript|>`,
  the configured language and task, `<|notimestamps|>` unless timestamps are predicted) and
  `<|endoftext|>`;
- `decode` drops timestamp text (`<|1.24|>`) as transformers does, and with `skip_special_tokens`
  the previous-text prompt (`<|startofprev|> ... <|startoftranscript|>`);
- the special tokens are the named ones of tokenizer_config.json (bos, eos, unk, ...; Whisper's
  default `<|endoftext|>`) and its `extra_special_tokens` / `additional_special_tokens`.

`read_whisper_tokenizer` returns None for a folder that transformers reads by rules this class
does not repeat (see `_layout_problem`); the loader then uses transformers.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers, processors

from encdec_engine.checkpoints.json_files import read_json
from encdec_engine.checkpoints.whisper.languages import LANGUAGES, TO_LANGUAGE_CODE

logger = logging.getLogger(__name__)

WHISPER_TOKENIZER_CLASSES = ("WhisperTokenizer", "WhisperTokenizerFast")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_WHISPER_NAMED_DEFAULTS = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
# The BPE settings WhisperTokenizer builds its model with; a file with others is left to transformers.
_BPE_SETTINGS = {"dropout": None, "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                 "byte_fallback": False, "ignore_merges": False}
_ADDED_TOKEN_FIELDS = ("content", "special", "lstrip", "rstrip", "single_word", "normalized")
_TIMESTAMP_TEXT = re.compile(r"<\|(\d+\.\d+)\|>")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _special_tokens(settings: dict) -> tuple[dict[str, str | None], list[str]]:
    """tokenizer_config.json's named special tokens (bos_token, ...) and its extra ones."""
    named = {key: _token_text(settings.get(key, _WHISPER_NAMED_DEFAULTS.get(key))) for key in _NAMED_SPECIAL}
    extra = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
    return named, [_token_text(t) for t in extra]


class WhisperTextTokenizer:
    """The part of transformers' `WhisperTokenizer` the engine uses, over a `tokenizers.Tokenizer`."""

    def __init__(self, backend: Tokenizer, settings: dict, name_or_path: str) -> None:
        self.backend_tokenizer = backend
        self.name_or_path = name_or_path
        named, extra = _special_tokens(settings)
        for key, token in named.items():
            setattr(self, key, token)
            setattr(self, f"{key}_id", None if token is None else backend.token_to_id(token))
        self.all_special_tokens = list(dict.fromkeys([t for t in named.values() if t is not None] + extra))
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
        """Ids of tokens; a token outside the vocabulary is the unknown token's id, as in transformers."""
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

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
        for BPE tokenizers such as Whisper's (a tokenizer_config.json that overrides this is read by
        transformers)."""
        ids = [int(i) for i in ([token_ids] if isinstance(token_ids, int) else token_ids)]
        if skip_special_tokens:
            ids = self._strip_prompt(ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _TIMESTAMP_TEXT.sub("", text)

    def _strip_prompt(self, ids: list[int]) -> list[int]:
        prompt, start = self.convert_tokens_to_ids("<|startofprev|>"), self.convert_tokens_to_ids("<|startoftranscript|>")
        if not ids or ids[0] != prompt:
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
    """The folder's Whisper tokenizer without transformers, or None when transformers would read it by
    rules this module does not repeat (`_layout_problem`; logged)."""
    config_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_path.is_file()):
        return None
    settings = read_json(config_path)
    if settings.get("tokenizer_class") not in WHISPER_TOKENIZER_CLASSES:
        return None
    try:
        backend = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions on bad files
        raise ValueError(f"{tokenizer_path}: not a tokenizer file `tokenizers` can read ({e})") from e
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.get("add_prefix_space") or False))
    backend.decoder = decoders.ByteLevel()
    backend.no_truncation()  # transformers encodes without them unless a call asks
    backend.no_padding()
    problem = _layout_problem(folder, settings, backend)
    if problem:
        logger.info("%s: the tokenizer has %s; reading it with transformers", folder, problem)
        return None
    for key in ("language", "task"):
        if settings.get(key) is not None and not isinstance(settings[key], str):
            raise ValueError(f"{config_path}: {key} must be a string, got {settings[key]!r}")
    return WhisperTextTokenizer(backend, settings, str(folder))


def _added_token(token: dict) -> tuple:
    return tuple(bool(token.get(k)) if k != "content" else token.get(k) for k in _ADDED_TOKEN_FIELDS)


def _layout_problem(folder: Path, settings: dict, backend: Tokenizer) -> str | None:
    """What in the folder transformers reads by rules this module does not repeat, or None."""
    legacy = [name for name in _LEGACY_FILES if (folder / name).is_file()]
    if legacy and "added_tokens_decoder" not in settings:  # transformers then reads the legacy files
        return f"legacy {' and '.join(legacy)}"
    if settings.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
        return "tokenization-space clean-up forced on"
    model_specific = [k for k, v in settings.items()
                      if k.endswith("_token") and k not in _NAMED_SPECIAL and isinstance(v, (str, dict))]
    if isinstance(settings.get("extra_special_tokens"), dict):  # named ones, e.g. {"sot_token": ...}
        model_specific += list(settings["extra_special_tokens"])
    if model_specific:  # transformers makes them special tokens too, ahead of the extra ones
        return f"model-specific special tokens {model_specific}"
    model = backend.model
    if type(model).__name__ != "BPE":
        return f"a {type(model).__name__} model"
    # transformers rebuilds the model with Whisper's BPE settings whatever the file says; reusing the
    # file's model is only the same when its settings are those.
    differs = [key for key, want in _BPE_SETTINGS.items() if _unset(getattr(model, key, want)) != _unset(want)]
    if differs:
        return f"BPE settings {differs}"
    if "added_tokens_decoder" in settings:  # transformers then takes the added tokens from there
        added = backend.get_added_tokens_decoder()  # ~0.1 s for Whisper's 1,600: only when needed
        ours = {i: _added_token({k: getattr(t, k) for k in _ADDED_TOKEN_FIELDS}) for i, t in added.items()}
        listed = {int(i): _added_token(t) for i, t in settings["added_tokens_decoder"].items()}
        if listed != ours:
            return "added tokens that differ between tokenizer.json and tokenizer_config.json"
    named, extra = _special_tokens(settings)
    # An added token encodes as itself; one only in the BPE vocabulary splits into pieces.
    missing = [t for t in dict.fromkeys([*named.values(), *extra]) if t is not None and
               backend.encode(t, add_special_tokens=False).ids != [backend.token_to_id(t)]]
    if missing:  # transformers adds them as special added tokens
        return f"special tokens {missing[:3]} that are not added tokens"
    return None


def _unset(value):
    return None if value in (None, "") else value
