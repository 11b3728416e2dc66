"""Options of a transcription (openai-whisper's and faster-whisper's names), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None  # None: English-only checkpoints use English; multilingual ones detect it
    task: str = "transcribe"  # or "translate" (multilingual checkpoints)
    timestamps: bool = True  # timed segments; False decodes with <|notimestamps|> (one segment per window)
    initial_prompt: str | None = None  # text that conditions the first window (<|startofprev|>)
    condition_on_previous_text: bool = True  # long-form: each window sees the previous window's text
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # fallback sequence
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
    # Token ids never generated; -1 stands for the checkpoint's list (openai-whisper's "-1": non-speech
    # symbols). Whisper's task and start tokens and <|nospeech|> are always added, as openai-whisper does.
    suppress_tokens: tuple[int, ...] | str = (-1,)
    prefix: str | None = None  # text the first window's transcript is forced to start with (faster-whisper)
    hotwords: str | None = None  # text put before the previous text in every prompt (faster-whisper; not with prefix)
    prompt_reset_on_temperature: float = 0.5  # a window kept above this temperature conditions no later window
    max_new_tokens: int | None = None  # tokens generated per window (None: up to the checkpoint's max_length)
    # Ranking of best_of samples and beams: None divides the summed log-probability by the length; a value
    # alpha by ((5 + length) / 6) ** alpha (openai-whisper's MaximumLikelihoodRanker).
    length_penalty: float | None = None
    patience: float | None = None  # openai-whisper's beam patience: only None or 1.0 (conventional search)
    repetition_penalty: float = 1.0  # HF's: logits of tokens already in the decoder sequence shrink
    no_repeat_ngram_size: int = 0  # HF's: no n-gram of this size occurs twice in a window's decoder sequence

    def __post_init__(self) -> None:
        for name in ("beam_size", "best_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        _check_decoding(self)
        object.__setattr__(self, "suppress_tokens", _suppress_tokens(self.suppress_tokens))
        object.__setattr__(self, "clip_timestamps", _clip_timestamps(self.clip_timestamps))
        threshold = self.hallucination_silence_threshold
        if threshold is not None:
            if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold <= 0:
                raise ValueError(f"hallucination_silence_threshold must be a positive number of seconds, "
                                 f"got {threshold!r}")
            if not self.word_timestamps:
                raise ValueError("hallucination_silence_threshold needs word_timestamps=True (it judges words)")

    @property
    def openai_windows(self) -> bool:
        """Whether every input, even one of 30 s or less, takes the long-form path (openai-whisper's
        features and seeking): clips and hallucination skips move within the audio."""
        return bool(self.clip_timestamps) or self.hallucination_silence_threshold is not None


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


def _check_decoding(options: TranscribeOptions) -> None:
    """The decoding options' ranges (openai-whisper's and faster-whisper's)."""
    def number(name: str) -> float | None:
        value = getattr(options, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return value

    if (alpha := number("length_penalty")) is not None and not 0 <= alpha <= 1:
        raise ValueError(f"length_penalty (alpha) must be between 0 and 1, or None for length normalization, "
                         f"got {alpha}")
    if (patience := number("patience")) is not None and patience != 1.0:
        # openai-whisper's patience collects round(beam_size * patience) finished beams; the engine's beam
        # search is HF's, which keeps beam_size of them: only the conventional search (1.0) is the same.
        raise ValueError(f"patience {patience} is not supported: the engine's beam search (Hugging Face's) "
                         f"keeps beam_size finished beams, which is patience 1.0")
    if number("repetition_penalty") <= 0:
        raise ValueError(f"repetition_penalty must be positive, got {options.repetition_penalty}")
    number("prompt_reset_on_temperature")
    for name, low in (("max_new_tokens", 1), ("no_repeat_ngram_size", 0)):
        value = getattr(options, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")
    for name in ("prefix", "hotwords"):
        value = getattr(options, name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be text, got {type(value).__name__}")


def _suppress_tokens(value) -> tuple[int, ...]:
    """"-1", "1,2,-1", [] or a list of ids -> a tuple of ids (-1 kept: the checkpoint's list)."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"suppress_tokens must be comma-separated token ids, got {value!r}") from None
    ids = tuple(value)
    if any(isinstance(t, bool) or not isinstance(t, int) or t < -1 for t in ids):
        raise ValueError(f"suppress_tokens must be token ids (or -1 for the checkpoint's list), got {list(ids)}")
    return ids
