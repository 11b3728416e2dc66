"""Options of a transcription (openai-whisper's and faster-whisper's names), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from encdec_engine.checkpoints.whisper.tokens import known_language_code
from encdec_engine.speech.vad_options import VadOptions

# openai-whisper's word timestamps: these marks join the next word (prepend) or the previous one (append).
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"


def fallback_temperatures(start: float = 0.0, increment: float | None = 0.2) -> tuple[float, ...]:
    """openai-whisper's temperature fallback schedule, `numpy.arange(start, 1.0 + 1e-6, increment)` (its
    length and values, rounded to 6 places; numpy is not imported for `encdec --help`), or `start` alone
    without an increment (or above 1, where the schedule is empty). The one schedule of the Python API's
    default, the CLI's flags and the server's `temperature` field."""
    if not math.isfinite(start) or start < 0:
        raise ValueError(f"temperature must be 0 or more, got {start}")
    if increment is None:
        return (float(start),)
    if not math.isfinite(increment) or increment <= 0:
        raise ValueError(f"temperature increment must be above 0 (or None: no fallback), got {increment}")
    count = max(0, math.ceil((1.0 + 1e-6 - start) / increment))
    return tuple(round(start + k * increment, 6) for k in range(count)) or (float(start),)


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None  # None: English-only checkpoints use English; multilingual ones detect it
    task: str = "transcribe"  # or "translate" (multilingual checkpoints)
    timestamps: bool = True  # timed segments; False decodes with <|notimestamps|> (one segment per window)
    initial_prompt: str | None = None  # text that conditions the first window (<|startofprev|>)
    condition_on_previous_text: bool = True  # long-form: each window sees the previous window's text
    temperatures: tuple[float, ...] = fallback_temperatures()  # 0.0, 0.2, ..., 1.0: tried in turn
    compression_ratio_threshold: float | None = 2.4  # above: the window looped, retry hotter
    logprob_threshold: float | None = -1.0  # mean token log-probability below: retry hotter
    no_speech_threshold: float | None = 0.6  # no-speech probability above (and an improbable text): skip
    beam_size: int = 1  # beams per window at temperature 0 (1: greedy, as HF generate's default)
    word_timestamps: bool = False  # words with start, end and probability, from the cross-attention alignment
    best_of: int = 5  # samples per window when temperature > 0
    seed: int = 0  # sampling at temperature > 0 is seeded per window: reruns give the same text
    # Seconds: start,end[,start,end...] of the parts to transcribe ("0,10,20,30" or a list); an odd count's
    # last clip runs to the end of the audio. Empty: everything.
    clip_timestamps: tuple[float, ...] | str = ()
    # Seconds (needs word_timestamps): around a probable hallucination, silence at least this long is skipped.
    hallucination_silence_threshold: float | None = None
    # Audio over 30 s is cut at its quietest moments into windows decoded all at once (as faster-whisper's
    # batched pipeline decodes its chunks): faster for one long file, but no window sees an earlier one's text.
    chunked: bool = False
    # openai-whisper's carry_initial_prompt: initial_prompt leads the context of every window, not only the
    # first; the previous text fills the room left (the decoder's half context), the prompt left-sliced if it
    # fills it alone.
    carry_initial_prompt: bool = False
    prepend_punctuations: str = PREPEND_PUNCTUATIONS  # word timestamps: marks merged into the next word
    append_punctuations: str = APPEND_PUNCTUATIONS  # word timestamps: marks merged into the previous word
    # Token ids never decoded (openai-whisper's and faster-whisper's suppress_tokens): -1 stands for the
    # checkpoint's list (generation_config.suppress_tokens: openai-whisper's non-speech symbols), () for
    # none. "-1,220" strings are parsed. Whisper's task and start tokens and <|nospeech|> are always added,
    # as openai-whisper does.
    suppress_tokens: tuple[int, ...] | str = (-1,)
    # Beam search (beam_size > 1): openai-whisper's patience (arXiv:2204.05424). The engine's beam search
    # is HF's, which keeps beam_size finished candidates: only the conventional search (None or 1.0) runs.
    patience: float | None = None
    # Ranking of best_of samples and beams (openai-whisper's MaximumLikelihoodRanker): None divides the
    # summed log-probability by the length; alpha in [0, 1] by ((5 + length) / 6) ** alpha (Google NMT).
    length_penalty: float | None = None
    prefix: str | None = None  # text the first window's transcript is forced to start with (faster-whisper)
    hotwords: str | None = None  # text put before the previous text in every prompt (faster-whisper; not with prefix)
    prompt_reset_on_temperature: float = 0.5  # a window kept above this temperature conditions no later window
    max_new_tokens: int | None = None  # tokens generated per window (None: up to the checkpoint's max_length)
    repetition_penalty: float = 1.0  # HF's: logits of tokens already in the decoder sequence shrink
    no_repeat_ngram_size: int = 0  # HF's: no n-gram of this size occurs twice in a window's decoder sequence
    # Silero VAD first: only the speech is decoded, joined end to end, and times map back onto the audio
    # (faster-whisper's vad_filter). With chunked, the speech is cut into chunks of at most 30 s instead.
    vad_filter: bool = False
    # VadOptions or a dict of its fields (faster-whisper's names). None: its defaults, or with chunked those
    # of faster-whisper's batched pipeline (speech of at most 30 s, 160 ms of silence ends it).
    vad_parameters: VadOptions | dict | None = None
    # An input longer than this many seconds is refused (its error set) before it is decoded, from its
    # header where the file has one (decoding stops at the limit where the header lies or says nothing).
    max_audio_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("beam_size", "best_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        if self.language is not None:  # "English", "<|en|>" -> "en"; "xx" is refused here, not after a model load
            object.__setattr__(self, "language", known_language_code(self.language))
        object.__setattr__(self, "clip_timestamps", _clip_timestamps(self.clip_timestamps))
        object.__setattr__(self, "suppress_tokens", _token_ids("suppress_tokens", self.suppress_tokens))
        object.__setattr__(self, "temperatures", _temperatures(self.temperatures))
        self._check_openai_options()
        threshold = self.hallucination_silence_threshold
        if threshold is not None:
            if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold <= 0:
                raise ValueError(f"hallucination_silence_threshold must be a positive number of seconds, "
                                 f"got {threshold!r}")
            if not self.word_timestamps:
                raise ValueError("hallucination_silence_threshold needs word_timestamps=True (it judges words)")
        self._resolve_vad()

    def _check_openai_options(self) -> None:
        """openai-whisper's rules for its decoding options, and options that would change nothing refused."""
        if self.carry_initial_prompt and not self.initial_prompt:
            raise ValueError("carry_initial_prompt needs an initial_prompt (it carries that prompt to every window)")
        for name in ("prepend_punctuations", "append_punctuations"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string of punctuation marks, got {value!r}")
            if value != getattr(TranscribeOptions, name) and not self.word_timestamps:
                raise ValueError(f"{name} needs word_timestamps=True (it merges punctuation into timed words)")
        if self.patience is not None:
            if not _is_number(self.patience) or not math.isfinite(self.patience) or self.patience <= 0:
                raise ValueError(f"patience must be a positive number, got {self.patience!r}")
            if self.beam_size < 2:
                raise ValueError("patience needs beam_size of at least 2 (it widens beam search; 1 is greedy)")
            if self.patience != 1.0:
                # openai-whisper collects round(beam_size * patience) finished beams; HF's search keeps beam_size.
                raise ValueError(f"patience {self.patience} is not supported: the engine's beam search (Hugging "
                                 f"Face's) keeps beam_size finished beams, which is patience 1.0")
        if self.length_penalty is not None and not (_is_number(self.length_penalty) and 0 <= self.length_penalty <= 1):
            raise ValueError(f"length_penalty (alpha) must be between 0 and 1 as in openai-whisper, "
                             f"got {self.length_penalty!r}")
        self._check_decoding()

    def _check_decoding(self) -> None:
        """faster-whisper's and HF's decoding options' ranges."""
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be a positive number, got {self.repetition_penalty!r}")
        if not _is_number(self.prompt_reset_on_temperature) or not math.isfinite(self.prompt_reset_on_temperature):
            raise ValueError(f"prompt_reset_on_temperature must be a number, got {self.prompt_reset_on_temperature!r}")
        for name, low in (("max_new_tokens", 1), ("no_repeat_ngram_size", 0)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")
        if self.max_audio_seconds is not None and not (
                _is_number(self.max_audio_seconds) and math.isfinite(self.max_audio_seconds) and self.max_audio_seconds > 0):
            raise ValueError(f"max_audio_seconds must be a positive number of seconds, got {self.max_audio_seconds!r}")
        if self.no_repeat_ngram_size is None:
            raise ValueError("no_repeat_ngram_size must be an integer of at least 0, got None")
        for name in ("prefix", "hotwords"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be text, got {type(value).__name__}")

    @property
    def aligns_words(self) -> bool:
        """Whether decoded windows get their words aligned: asked for, or with VAD and timed segments, where
        the words place each segment on the speech (Whisper starts a window's first segment at its start,
        which after VAD may be noise the VAD heard as speech); the words are then left out of the result."""
        return self.word_timestamps or (self.vad_filter and self.timestamps)

    @property
    def openai_windows(self) -> bool:
        """Whether every input, even one of 30 s or less, takes the long-form path (openai-whisper's
        features and seeking): clips and hallucination skips move within the audio."""
        return bool(self.clip_timestamps) or self.hallucination_silence_threshold is not None or self.vad_filter

    def _resolve_vad(self) -> None:
        """vad_parameters as VadOptions with faster-whisper's defaults (None without vad_filter)."""
        from encdec_engine.inputs.audio import CHUNK_LENGTH  # lazy: numpy (0.07 s); the CLI parses flags without it
        if not self.vad_filter:
            if self.vad_parameters is not None:
                raise ValueError("vad_parameters need vad_filter=True")
            return
        if self.clip_timestamps:
            raise ValueError("vad_filter and clip_timestamps cannot be combined: the VAD chooses what is transcribed")
        if self.vad_parameters is None and self.chunked:
            vad = VadOptions(max_speech_duration_s=CHUNK_LENGTH, min_silence_duration_ms=160)
        else:
            vad = VadOptions.of(self.vad_parameters)
        if self.chunked and vad.max_speech_duration_s > CHUNK_LENGTH:  # a span must fit one window
            vad = replace(vad, max_speech_duration_s=CHUNK_LENGTH)
        object.__setattr__(self, "vad_parameters", vad)


def _clip_timestamps(value) -> tuple[float, ...]:
    """Validated clip boundaries in seconds, ascending: start < end, each clip after the one before."""
    if isinstance(value, str):
        try:
            value = [float(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"clip_timestamps must be comma-separated seconds, got {value!r}") from None
    times = tuple(float(v) for v in value)
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise ValueError(f"clip_timestamps must be non-negative seconds, got {list(times)}")
    # Within a clip start < end; a clip may start where the one before ended.
    if any(b < a or (b == a and i % 2 == 0) for i, (a, b) in enumerate(zip(times, times[1:]))):
        raise ValueError(f"clip_timestamps must ascend (each clip's start < end <= the next start), got {list(times)}")
    return times


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_ids(name: str, value) -> tuple[int, ...]:
    """Token ids from "-1,220" or a sequence; -1 (the checkpoint's list) is the only id below 0."""
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"{name} must be comma-separated token ids (-1: the checkpoint's list), "
                             f"got {value!r}") from None
    ids = tuple(value)
    if any(not isinstance(t, int) or isinstance(t, bool) or t < -1 for t in ids):
        raise ValueError(f"{name} must be token ids of at least 0, or -1 for the checkpoint's list, got {list(ids)}")
    return ids


def _temperatures(value) -> tuple[float, ...]:
    temperatures = (value,) if _is_number(value) else tuple(value)
    if not temperatures or any(not _is_number(t) or not math.isfinite(t) or t < 0 for t in temperatures):
        raise ValueError(f"temperatures must be one or more non-negative numbers, got {value!r}")
    return tuple(float(t) for t in temperatures)
