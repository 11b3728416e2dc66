"""What a live transcription needs to know of the loaded Whisper checkpoint, read once from its engine:
the special tokens, the tokenizer, and the decoding a window gets offline (HF `generate` and
openai-whisper: greedy, the checkpoint's suppressed tokens, timestamp rules), so that a turn's
decodes are requests of the same kind as `LLM.transcribe`'s."""

from __future__ import annotations

import math

from encdec_engine.checkpoints.whisper.tokens import WhisperTokens
from encdec_engine.inputs.prompts import check_unicode
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.speech.timestamp_rules import TimestampRules, timestamp_rules_from_generation_config

# A hypothesis of a window of s seconds gets at most BASE + PER_SECOND * s new tokens: real speech (about
# 3 words, 4-5 tokens a second, timestamps included) never comes near it, and a decode that loops on a
# word cut in half stops early instead of running to the decoder's length.
MAX_TOKENS_BASE = 24
MAX_TOKENS_PER_SECOND = 10


class LiveModel:
    """Token facts and request parameters of one Whisper checkpoint (from an `LLMEngine`)."""

    def __init__(self, engine) -> None:
        if getattr(engine.model, "num_mel_bins", None) is None:
            raise ValueError("live transcription needs a Whisper checkpoint")
        gc = engine.generation_config
        self.tokens = WhisperTokens.from_configs(engine.hf_config, gc)
        self.tokenizer = engine.tokenizer
        self.max_decoder_len = engine.max_decoder_len
        self.encoder_positions = engine.model.max_encoder_len  # a whole 30 s window's (1500)
        self.max_length = getattr(gc, "max_length", None) or self.max_decoder_len
        self.half = self.max_decoder_len // 2 - 1  # openai-whisper's cap on a prompt's previous text
        self.rules: TimestampRules = timestamp_rules_from_generation_config(gc)
        self.suppress = self._suppressed(getattr(gc, "suppress_tokens", None))
        self.begin_suppress = list(getattr(gc, "begin_suppress_tokens", None) or [])
        self._starts_word: dict[int, bool] = {}

    def _suppressed(self, checkpoint: list[int] | None) -> list[int]:
        """openai-whisper's suppress_tokens=-1: the checkpoint's list, plus the task and start tokens and
        <|nospeech|> (the five ids before <|notimestamps|>), as offline transcription bans them."""
        t = self.tokens
        ids = set(checkpoint or []) | {t.sot, *range(t.no_timestamps - 5, t.no_timestamps)} | set(t.task_to_id.values())
        return sorted(ids)

    # -- tokens ---------------------------------------------------------------------------
    def is_text(self, token: int) -> bool:
        return token < self.tokens.eot

    def is_timestamp(self, token: int) -> bool:
        return token >= self.tokens.timestamp_begin

    def starts_word(self, token: int) -> bool:
        """Whether a text token begins a new word (its text starts with a space: "Ġ" in byte-level BPE)."""
        known = self._starts_word.get(token)
        if known is None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            known = self._starts_word[token] = bool(piece) and piece[0] in ("Ġ", " ")
        return known

    def text(self, tokens: list[int]) -> str:
        """The text of tokens, timestamps and special tokens left out."""
        return self.tokenizer.decode([t for t in tokens if t < self.tokens.eot])

    def prompt_tokens(self, text: str | None) -> list[int]:
        """A text prompt as tokens (as offline `initial_prompt`), special-token text refused."""
        if not text or not text.strip():
            return []
        check_unicode(text, "prompt")
        ids = self.tokenizer(" " + text.strip(), add_special_tokens=False)["input_ids"]
        if any(t >= self.tokens.eot for t in ids):
            raise ValueError("prompt contains special-token text (<|...|>); write it without them")
        return ids[-self.half :]

    # -- requests -------------------------------------------------------------------------
    def decode_params(self, prompt_len: int, window_seconds: float) -> SamplingParams:
        """A window's greedy decode, as offline transcription's first try (temperature 0): the checkpoint's
        suppressed tokens, the first-step suppression and the timestamp rules. Its length is capped by
        the window's duration (MAX_TOKENS_*) within HF's limit."""
        room = self.max_decoder_len - prompt_len
        hf = min(self.max_length + min(self.max_decoder_len // 2 - 1, prompt_len), self.max_decoder_len) - prompt_len
        cap = MAX_TOKENS_BASE + math.ceil(MAX_TOKENS_PER_SECOND * window_seconds)
        return SamplingParams(
            temperature=0.0, max_tokens=max(1, min(room, hf, cap)), logprobs=0, skip_special_tokens=True,
            no_speech_token_id=self.tokens.no_speech, suppress_tokens=self.suppress,
            begin_suppress_tokens=self.begin_suppress, logits_processors=[self.rules])

    def detect_params(self) -> SamplingParams:
        """One step over the language tokens (multilingual checkpoints without a language)."""
        return SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=list(self.tokens.lang_to_id.values()))
