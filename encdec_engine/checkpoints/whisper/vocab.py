"""Whisper's special-token ids for checkpoints whose generation config lacks them.

Each id comes from the first source that has it:

1. `generation_config.json` (HF's fields: `no_timestamps_token_id`, `prev_sot_token_id`,
   `is_multilingual`, `lang_to_id`, `task_to_id`);
2. the tokenizer's vocabulary, by token string (`<|notimestamps|>`, `<|startofprev|>`,
   `<|en|>`, `<|transcribe|>`, ...);
3. openai-whisper's layout, which follows from the vocabulary size alone. Its special
   tokens come right after the text vocabulary, in this order::

       <|endoftext|> <|startoftranscript|> <|en|> ... (languages) <|translate|> <|transcribe|>
       <|startoflm|> <|startofprev|> <|nospeech|> <|notimestamps|> <|0.00|> ... <|30.00|>

   English-only vocabularies have 51864 ids (<|endoftext|> = 50256), multilingual ones
   51865 (<|endoftext|> = 50257, 99 languages) or 51866 (large-v3: 100 languages).

`<|startoftranscript|>` and `<|endoftext|>` are the model config's decoder start and EOS ids.
As in HF and openai-whisper, timestamps start right after `<|notimestamps|>` and fill the
vocabulary's tail, and `<|nospeech|>` (`<|nocaptions|>` in the first vocabularies) sits
right before it. The completed fields go into the generation config, where every reader
(`WhisperTokens`, the timestamp rules, word alignment) finds them as in a full checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

from encdec_engine.checkpoints.whisper.defaults import (MAX_INITIAL_TIMESTAMP_INDEX, begin_suppress_tokens,
                                                   suppress_tokens)
from encdec_engine.checkpoints.whisper.languages import LANGUAGES

logger = logging.getLogger(__name__)

_ENGLISH_VOCAB = 51864  # openai-whisper: a vocabulary this large or more is multilingual from 51865 on
_TEXT_VOCAB_END = 51765  # openai-whisper: num_languages = n_vocab - 51765 - is_multilingual


def timestamp_token(index: int) -> str:
    """The token string of timestamp `index` (0.02 s steps), as HF's and openai-whisper's tokenizers spell it."""
    return f"<|{index * 0.02:.2f}|>"


@dataclass(frozen=True)
class WhisperLayout:
    """openai-whisper's special-token ids for a vocabulary of `vocab_size` ids."""

    vocab_size: int

    @property
    def is_multilingual(self) -> bool:
        return self.vocab_size > _ENGLISH_VOCAB

    @property
    def num_languages(self) -> int:
        return self.vocab_size - _TEXT_VOCAB_END - int(self.is_multilingual)

    @property
    def sot(self) -> int:
        return 50257 + int(self.is_multilingual)

    def ids(self) -> dict[str, int]:
        """Token string -> id for every special token before the timestamps."""
        languages = list(LANGUAGES)
        if not 0 < self.num_languages <= len(languages):
            raise ValueError(f"vocab_size {self.vocab_size} is none of openai-whisper's layouts "
                             f"({_ENGLISH_VOCAB}, {_ENGLISH_VOCAB + 1} or {_ENGLISH_VOCAB + 2} ids)")
        names = [f"<|{code}|>" for code in languages[: self.num_languages]]
        names += ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                  "<|notimestamps|>"]
        return {name: self.sot + 1 + i for i, name in enumerate(names)}


class _Sources:
    """Looks ids up in the vocabulary, else in openai-whisper's layout, noting where each came from."""

    def __init__(self, tokenizer, layout: WhisperLayout, folder: str) -> None:
        self.tokenizer, self.layout, self.folder = tokenizer, layout, folder
        self.fields: dict[str, list[str]] = {}  # source -> fields it gave

    @cached_property
    def vocab(self) -> dict[str, int]:  # built only when a field is missing (51,864 entries)
        return self.tokenizer.get_vocab() if self.tokenizer is not None else {}

    def note(self, source: str, field: str) -> None:
        self.fields.setdefault(source, []).append(field)

    def layout_ids(self, field: str, token: str) -> dict[str, int]:
        self.note(f"openai-whisper's layout for vocab_size {self.layout.vocab_size}", field)
        try:
            return self.layout.ids()
        except ValueError as e:
            raise ValueError(f"{self.folder}: cannot find Whisper's {token} id: generation_config.json has no "
                             f"{field}, the tokenizer has no {token} token, and config.json {e}") from e

    def token(self, field: str, token: str, *other_names: str) -> int:
        for name in (token, *other_names):
            if name in self.vocab:
                self.note("the tokenizer vocabulary", field)
                return self.vocab[name]
        return self.layout_ids(field, token)[token]

    def languages(self) -> dict[str, int]:
        found = {f"<|{code}|>": self.vocab[f"<|{code}|>"] for code in LANGUAGES if f"<|{code}|>" in self.vocab}
        if found:
            self.note("the tokenizer vocabulary", "lang_to_id")
            return found
        ids = self.layout_ids("lang_to_id", "<|en|>")
        return {name: i for name, i in ids.items() if name.strip("<|>") in LANGUAGES}


def complete_whisper_generation_config(generation_config, hf_config, tokenizer, folder: str) -> None:
    """Fill the Whisper fields `generation_config` lacks (in place) and log once where they came from.

    `tokenizer` gives the vocabulary and openai-whisper's non-speech tokens (None: no tokenizer).
    A field that no source can give is a ValueError naming the file and the field."""
    gc, layout = generation_config, WhisperLayout(hf_config.vocab_size)
    sources = _Sources(tokenizer, layout, folder)
    if getattr(gc, "no_timestamps_token_id", None) is None:
        gc.no_timestamps_token_id = sources.token("no_timestamps_token_id", "<|notimestamps|>")
    if getattr(gc, "prev_sot_token_id", None) is None:
        gc.prev_sot_token_id = sources.token("prev_sot_token_id", "<|startofprev|>")
    if getattr(gc, "is_multilingual", None) is None:
        gc.is_multilingual = layout.is_multilingual
        sources.note(f"openai-whisper's rule for vocab_size {layout.vocab_size}", "is_multilingual")
    if gc.is_multilingual and not getattr(gc, "lang_to_id", None):
        gc.lang_to_id = sources.languages()
    if gc.is_multilingual and not getattr(gc, "task_to_id", None):
        gc.task_to_id = {task: sources.token("task_to_id", f"<|{task}|>") for task in ("transcribe", "translate")}
    _check_ids(gc, hf_config.vocab_size, folder)
    _complete_decoding_defaults(gc, hf_config, tokenizer, sources)

    heads = ("from generation_config.json" if getattr(gc, "alignment_heads", None)
             else "openai-whisper's default (every head of the upper half of the decoder layers)")
    if not sources.fields:
        logger.info("%s: Whisper special tokens from generation_config.json; alignment heads %s", folder, heads)
        return
    derived = "; ".join(f"{', '.join(dict.fromkeys(fields))} from {source}"
                        for source, fields in sources.fields.items())
    logger.warning("%s: generation_config.json lacks Whisper fields: %s; alignment heads %s", folder, derived, heads)


def _complete_decoding_defaults(gc, hf_config, tokenizer, sources: _Sources) -> None:
    """openai-whisper's suppression and first-timestamp limit where neither config file has them."""
    defaults = "openai-whisper's decoding defaults"
    if getattr(gc, "max_initial_timestamp_index", None) is None:
        gc.max_initial_timestamp_index = MAX_INITIAL_TIMESTAMP_INDEX
        sources.note(defaults, "max_initial_timestamp_index")
    if tokenizer is None:  # the symbol tokens need the tokenizer
        return
    if getattr(gc, "suppress_tokens", None) is None:
        specials = [sources.token("suppress_tokens", f"<|{name}|>") for name in
                    ("transcribe", "translate", "startofprev", "startoflm")]
        specials += [hf_config.decoder_start_token_id,
                     sources.token("suppress_tokens", "<|nospeech|>", "<|nocaptions|>")]
        gc.suppress_tokens = suppress_tokens(tokenizer, specials)
        sources.note(defaults, "suppress_tokens")
    if getattr(gc, "begin_suppress_tokens", None) is None:
        gc.begin_suppress_tokens = begin_suppress_tokens(tokenizer, hf_config.eos_token_id)
        sources.note(defaults, "begin_suppress_tokens")


def _check_ids(gc, vocab_size: int, folder: str) -> None:
    ids = {"no_timestamps_token_id": gc.no_timestamps_token_id, "prev_sot_token_id": gc.prev_sot_token_id}
    ids |= {f"lang_to_id[{k!r}]": v for k, v in (getattr(gc, "lang_to_id", None) or {}).items()}
    ids |= {f"task_to_id[{k!r}]": v for k, v in (getattr(gc, "task_to_id", None) or {}).items()}
    for field, value in ids.items():
        if not isinstance(value, int) or not 0 <= value < vocab_size:
            raise ValueError(f"{folder}: Whisper generation config field {field} = {value!r} is not a token id "
                             f"of the model's vocabulary (config.json vocab_size {vocab_size})")


def add_timestamp_tokens(tokenizer, timestamp_begin: int, vocab_size: int, folder: str) -> None:
    """Give a tokenizer without `<|0.00|>` ... (CTranslate2 exports, older hub checkpoints) the timestamp
    tokens at their ids, so timestamps decode to the same text as with HF's full tokenizer."""
    if tokenizer is None or timestamp_begin >= vocab_size:
        return
    if len(tokenizer) > timestamp_begin:
        if tokenizer.convert_ids_to_tokens(timestamp_begin) != timestamp_token(0):
            logger.warning("%s: the tokenizer has %d tokens but id %d is not %s; timestamp ids decode to no text",
                           folder, len(tokenizer), timestamp_begin, timestamp_token(0))
        return
    if len(tokenizer) < timestamp_begin:
        logger.warning("%s: the tokenizer has %d tokens, fewer than <|notimestamps|> + 1 = %d; timestamp and "
                       "missing special ids decode to no text", folder, len(tokenizer), timestamp_begin)
        return
    # The added tokens take the next ids, len(tokenizer) = timestamp_begin onwards. Not special, as in HF.
    tokenizer.add_tokens([timestamp_token(i) for i in range(vocab_size - timestamp_begin)])
    logger.info("%s: the tokenizer has no timestamp tokens; added %s ... at ids %d ...", folder,
                timestamp_token(0), timestamp_begin)
