"""Temperature fallback: whether a decoded window is kept, decoded again hotter, or skipped as
silence (the rules openai-whisper and faster-whisper apply after each window)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from enum import Enum

from encdec_engine.speech.options import TranscribeOptions


def compression_ratio(text: str) -> float:
    """Bytes of the text over bytes of its zlib compression: high when the text repeats itself."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass(frozen=True)
class WindowQuality:
    """What the fallback rules judge a decoded window by."""

    avg_logprob: float  # mean log-probability of the generated tokens
    compression_ratio: float  # of the window's text
    no_speech_prob: float  # probability of <|nospeech|> right after <|startoftranscript|>


class Verdict(Enum):
    KEEP = "keep"
    RETRY = "retry"  # decode the window again at the next temperature
    SKIP = "skip"  # silence: no segment, and no retry


def judge(quality: WindowQuality, options: TranscribeOptions, temperature_index: int) -> Verdict:
    """A window that looped (compression ratio above its threshold) or is improbable (mean
    log-probability below its threshold) is retried at the next temperature, while there is one,
    unless it is also probably silence (no-speech probability above its threshold): no use retrying
    that hotter. Silence whose text is not probable is skipped."""
    improbable = options.logprob_threshold is not None and quality.avg_logprob < options.logprob_threshold
    silence = options.no_speech_threshold is not None and quality.no_speech_prob > options.no_speech_threshold
    looped = (options.compression_ratio_threshold is not None
              and quality.compression_ratio > options.compression_ratio_threshold)
    failed = (looped or improbable) and not (silence and improbable)
    if failed and temperature_index + 1 < len(options.temperatures):
        return Verdict.RETRY
    if silence and not (options.logprob_threshold is not None and quality.avg_logprob > options.logprob_threshold):
        return Verdict.SKIP
    return Verdict.KEEP
