"""Sampling parameters of one request (vLLM names, Hugging Face semantics)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
_FLOAT32_MAX = 3.4e38

# Caps on list and string fields, far above real use and low enough that one request can neither stall
# the engine's steps (stop strings are scanned on every token, bad words checked on every step) nor
# hold much memory. Over a cap, the field is a ValueError naming it (a 400 from the server).
MAX_STOP_STRINGS = 32  # OpenAI allows 4 stop sequences; vLLM has no cap
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 128
MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300)
MAX_TOKEN_ID_LIST = 1 << 18  # suppress_tokens, begin_suppress_tokens, allowed_token_ids: above any vocabulary
MAX_LOGPROBS = 20  # logprobs and prompt_logprobs top-k (vLLM's default max_logprobs)
MAX_LOGITS_PROCESSORS = 64
MAX_CROSS_ATTENTION_HEADS = 4096  # (layer, head) pairs; the model's own layers x heads bound them further
MAX_SEED = 2**64 - 1  # a generator's seed is an unsigned 64-bit integer
MAX_LENGTH_PENALTY = 10.0  # beam search divides by length ** length_penalty (HF's usual values: 0.6 to 2)
_INT_FIELDS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "no_repeat_ngram_size", "logprobs",
               "prompt_logprobs",
               "truncate_prompt_tokens", "num_beams", "forced_bos_token_id", "forced_eos_token_id",
               "no_speech_token_id")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "length_penalty")
_TOKEN_LIST_FIELDS = ("stop_token_ids", "suppress_tokens", "begin_suppress_tokens", "allowed_token_ids")
_REQUIRED_INT_FIELDS = ("n", "top_k", "min_tokens", "no_repeat_ngram_size", "num_beams")  # never None
_LIST_FIELDS = {"stop": "non-empty strings", "bad_words": "non-blank strings", "logits_processors": "callables",
                "cross_attention_heads": "(layer, head) pairs", **dict.fromkeys(_TOKEN_LIST_FIELDS, "token ids")}


def _non_negative_ints(values) -> bool:
    if isinstance(values, range):  # checked at its ends, not element by element
        return not values or min(values[0], values[-1]) >= 0
    return all(isinstance(t, numbers.Integral) and t >= 0 for t in values)


def _is_sequence(value) -> bool:
    """A list-like field value: list, tuple or range (not a string, dict, set or scalar)."""
    return isinstance(value, (list, tuple, range))


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Field names follow vLLM; where a field also exists in Hugging Face
    `generate` (repetition_penalty, no_repeat_ngram_size, the forced and
    suppressed tokens, beam search) it behaves exactly as there, so greedy and
    beam outputs match `generate` token for token.
    """

    n: int = 1  # sequences returned
    best_of: int | None = None  # sequences sampled, the best `n` returned
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed, same tokens
    max_tokens: int | None = 16  # new tokens; None: up to the model's length limit
    min_tokens: int = 0  # EOS and stop_token_ids are banned before this many
    stop: list[str] | str | None = None  # stop strings (not part of the output text)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # vLLM/OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # vLLM/OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF (CTRL) semantics over prompt + output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, first (HF sequence_bias)
    # Words never generated (vLLM): each is tokenized as written and with a leading space; a word's last
    # token is banned where the decoder sequence ends with the tokens before it (HF bad_words_ids).
    bad_words: list[str] | None = None
    no_repeat_ngram_size: int = 0  # HF semantics over the decoder sequence
    logprobs: int | None = None  # top-k logprobs per output token
    # vLLM: RequestOutput.prompt_logprobs, the raw log-prob of each decoder prompt token given the tokens
    # before it (None for the first), plus the top-k; over allowed_token_ids only when that is set. The
    # prefill computes the whole prompt (no cached prefix).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the last k encoder prompt tokens
    # Hugging Face generation-config processors (used by summarize/transcribe).
    forced_bos_token_id: int | None = None  # forced as the first generated token
    forced_eos_token_id: int | None = None  # forced as the last token at max_tokens
    suppress_tokens: list[int] | None = None  # banned at every step
    begin_suppress_tokens: list[int] | None = None  # banned at the first step
    # Whisper: where suppress_tokens / begin_suppress_tokens is None, ban the checkpoint's (its generation
    # config's), as HF `generate` does. False: only the lists given here.
    use_checkpoint_suppress_tokens: bool = True
    allowed_token_ids: list[int] | range | None = None  # only these may be generated (e.g. language detection)
    # Whisper: report, as RequestOutput.no_speech_prob, this token's probability right after the decoder
    # start token (<|startoftranscript|>) of the prompt, from the raw logits (openai-whisper's no_speech_prob).
    no_speech_token_id: int | None = None
    # RequestOutput.cross_attentions: the prefill's cross-attention probabilities of these (layer, head) pairs
    # of the decoder, [pairs, prompt tokens, encoder positions] (Whisper's alignment heads: word timestamps).
    cross_attention_heads: list[tuple[int, int]] | None = None
    # Extra processors, applied last: callables (output_token_ids, logits[vocab]) -> None editing in place.
    logits_processors: list | None = None
    # Beam search (HF semantics).
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # bad_words as token ids: set on the engine's per-request copy (resolve_bad_words).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, of in _LIST_FIELDS.items():
            value = getattr(self, name)
            if value is not None and not _is_sequence(value):
                raise ValueError(f"SamplingParams.{name} must be a list of {of}, got {type(value).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.top_k, numbers.Integral) and self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            shown = repr(getattr(self, name))
            raise ValueError(f"SamplingParams.{name} {why}, got {shown if len(shown) <= 200 else shown[:200] + '...'}")

        self._check_caps(fail)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if (value is not None or name in _REQUIRED_INT_FIELDS) and not isinstance(value, numbers.Integral):
                fail(name, "must be an integer")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                fail(name, "must be a finite number")
        for name in _TOKEN_LIST_FIELDS:
            ids = getattr(self, name)
            if ids is not None and not _non_negative_ints(ids):
                fail(name, "must be a list of non-negative token ids")
        if not isinstance(self.use_checkpoint_suppress_tokens, bool):
            fail("use_checkpoint_suppress_tokens", "must be True or False")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            fail("allowed_token_ids", "must not be empty (every token would be banned)")
        if self.n < 1:
            fail("n", "must be at least 1")
        if self.best_of < self.n:
            fail("best_of", f"must be >= n ({self.n})")
        if self.temperature < 0.0:
            fail("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            fail("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            fail("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.repetition_penalty <= 0.0:
            fail("repetition_penalty", "must be positive")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                fail(name, "must be in [-2, 2]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    isinstance(t, numbers.Integral) and t >= 0 and isinstance(b, numbers.Real) and math.isfinite(b)
                    and abs(b) <= _FLOAT32_MAX for t, b in self.logit_bias.items()):
                fail("logit_bias", "must map non-negative token ids to finite numbers")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.bad_words is not None:
            if not _is_sequence(self.bad_words) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                fail("bad_words", "must be a list of non-blank strings")
            self.bad_words = list(self.bad_words)
        if self.no_repeat_ngram_size < 0:
            fail("no_repeat_ngram_size", "must be non-negative")
        if self.logprobs is not None and self.logprobs < 0:
            fail("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            fail("prompt_logprobs", "must be non-negative")
        if self.cross_attention_heads is not None:
            pairs = self.cross_attention_heads
            if not pairs or not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, numbers.Integral) and x >= 0 for x in p)
                                    for p in pairs):
                fail("cross_attention_heads", "must be a non-empty list of (layer, head) pairs of non-negative integers")
            self.cross_attention_heads = [(int(layer), int(head)) for layer, head in pairs]
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            fail("truncate_prompt_tokens", "must be at least 1")
        if self.num_beams < 1:
            fail("num_beams", "must be at least 1")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            fail("length_penalty", f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}] (length ** penalty "
                                   "overflows beyond)")
        if self.num_beams > 1:
            if self.n > self.num_beams:
                fail("n", f"must be <= num_beams ({self.num_beams}) in beam search")
            if self.temperature not in (0.0, 1.0) or self.top_k != -1 or self.top_p != 1.0:
                fail("num_beams", "supports deterministic beam search only (no temperature/top-k/top-p)")
        if self.early_stopping not in (True, False, "never"):
            fail("early_stopping", 'must be True, False or "never"')
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            fail("seed", "must be in [0, 2**64 - 1] (an unsigned 64-bit integer)")
        if self.no_speech_token_id is not None and self.no_speech_token_id < 0:
            fail("no_speech_token_id", "must be a non-negative token id")
        if self.num_beams > 1 and (self.stop or self.logprobs is not None):
            fail("num_beams", "cannot be combined with stop strings or logprobs (beam search scores whole beams)")

    def _check_caps(self, fail) -> None:
        """Every list and string field within its cap (see MAX_* above)."""
        caps = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS, "bad_words": MAX_BAD_WORDS,
                "logit_bias": MAX_LOGIT_BIAS, "logits_processors": MAX_LOGITS_PROCESSORS,
                "cross_attention_heads": MAX_CROSS_ATTENTION_HEADS,
                **dict.fromkeys(("suppress_tokens", "begin_suppress_tokens", "allowed_token_ids"), MAX_TOKEN_ID_LIST)}
        for name, cap in caps.items():
            value = getattr(self, name)
            if value is not None and hasattr(value, "__len__") and len(value) > cap:
                raise ValueError(f"SamplingParams.{name} has {len(value)} entries, more than the limit of {cap}")
        for name, cap in (("stop", MAX_STOP_STRING_CHARS), ("bad_words", MAX_BAD_WORD_CHARS)):
            for text in getattr(self, name) or ():
                if isinstance(text, str) and len(text) > cap:
                    raise ValueError(f"SamplingParams.{name} has a string of {len(text)} characters, more than "
                                     f"the limit of {cap}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and value > MAX_LOGPROBS:
                fail(name, f"must be at most {MAX_LOGPROBS}")
        if self.logits_processors is not None and not all(callable(p) for p in self.logits_processors):
            fail("logits_processors", "must be callables (output_token_ids, logits) -> None")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError for a token id or logprobs count the model's vocabulary cannot serve."""
        def fail(name: str, value) -> None:
            raise ValueError(f"SamplingParams.{name} {value!r} is outside the vocabulary (size {vocab_size})")

        for name in ("forced_bos_token_id", "forced_eos_token_id", "no_speech_token_id"):
            value = getattr(self, name)
            if value is not None and value >= vocab_size:
                fail(name, value)
        for name in ("suppress_tokens", "begin_suppress_tokens", "allowed_token_ids", "logit_bias", "stop_token_ids"):
            ids = getattr(self, name) or ()
            if isinstance(ids, range) and (not ids or max(ids[0], ids[-1]) < vocab_size):
                continue  # a range (e.g. every text token) is checked at its ends
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                fail(name, bad)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"SamplingParams.{name} {value} is more than the vocabulary's {vocab_size} tokens")

    def with_checkpoint_suppression(self, generation_config) -> SamplingParams:
        """These params, or a copy that bans the generation config's suppress_tokens and
        begin_suppress_tokens where this request gives none (HF `generate`'s defaults for Whisper)."""
        if not self.use_checkpoint_suppress_tokens:
            return self
        defaults = {name: list(ids) for name in ("suppress_tokens", "begin_suppress_tokens")
                    if getattr(self, name) is None and (ids := getattr(generation_config, name, None))}
        return dataclasses.replace(self, **defaults) if defaults else self

    def resolve_bad_words(self, tokenizer, vocab_size: int) -> SamplingParams:
        """A copy whose bad_words_token_ids are this tokenizer's: each word as written (leading spaces
        stripped) and, where that makes other tokens of the same count, with one leading space (vLLM's
        rule). Words with a token outside the model's vocabulary can never be generated and are left out."""
        if tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer (skip_tokenizer_init=True was set)")
        resolved = []
        for word in self.bad_words or ():
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            resolved.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                resolved.append(spaced)
        copy = dataclasses.replace(self)
        copy.bad_words_token_ids = [ids for ids in resolved if ids and max(ids) < vocab_size]
        return copy

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1

    def all_stop_token_ids(self, eos_token_ids) -> set[int]:
        """Token ids that end a sequence (the EOS ids unless ignored, plus stop_token_ids)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return ids



FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))  # what a request may set
