"""faster-whisper's VAD parameters (`VadOptions`), apart from the model (speech/vad.py) so that options and
the command line's parser load without torch."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class VadOptions:
    """faster-whisper's `VadOptions`: names, meanings and defaults (silero's `get_speech_timestamps`)."""

    threshold: float = 0.5  # speech probability at or above which a frame is speech
    neg_threshold: float | None = None  # below it speech ends (None: threshold - 0.15, at least 0.01)
    min_speech_duration_ms: int = 0  # speech spans shorter than this are dropped
    max_speech_duration_s: float = math.inf  # longer speech is split at its longest pause (>98 ms), else cut
    min_silence_duration_ms: int = 2000  # silence shorter than this does not end speech
    speech_pad_ms: int = 400  # each span widened by this much on both sides (half the gap where spans meet)

    def __post_init__(self) -> None:
        for name in ("threshold", "neg_threshold"):
            value = getattr(self, name)
            if value is None and name == "neg_threshold":
                continue
            if not _is_number(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"vad_parameters {name} must be a probability in [0, 1], got {value!r}")
        if self.neg_threshold is not None and self.neg_threshold > self.threshold:
            raise ValueError(f"vad_parameters neg_threshold ({self.neg_threshold}) must not exceed threshold "
                             f"({self.threshold}): speech ends below it")
        for name in ("min_speech_duration_ms", "min_silence_duration_ms", "speech_pad_ms"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"vad_parameters {name} must be a non-negative number of milliseconds, "
                                 f"got {value!r}")
        longest = self.max_speech_duration_s
        if not _is_number(longest) or not longest * 1000 > 2 * self.speech_pad_ms + 32:
            raise ValueError(f"vad_parameters max_speech_duration_s must be more than a frame (32 ms) plus twice "
                             f"speech_pad_ms, got {longest!r}")

    @classmethod
    def of(cls, value: VadOptions | dict | None, **defaults) -> VadOptions:
        """Options from a VadOptions, a dict of its fields (over `defaults`) or None (the defaults)."""
        if isinstance(value, VadOptions):
            return value
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"vad_parameters must be a dict or a VadOptions, got {type(value).__name__}")
        fields = {**defaults, **(value or {})}
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown vad_parameters {unknown}; known: {list(cls.__dataclass_fields__)}")
        return cls(**fields)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
