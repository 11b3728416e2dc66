"""Options of a live transcription (a stream of audio transcribed while it is spoken), validated on
construction: how turns are detected (OpenAI's `server_vad` parameters, or none: the caller commits each
turn) and the streaming policy (how often the growing buffer is decoded again, how many successive
hypotheses must agree before text is confirmed, when a long turn's buffer is trimmed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from encdec_engine.checkpoints.whisper.tokens import known_language_code

MAX_PROMPT_CHARS = 8192  # as the transcription endpoint's `prompt`


@dataclass(frozen=True)
class TurnDetection:
    """OpenAI's `server_vad`, applied to Silero VAD's speech probability of each 32 ms frame."""

    threshold: float = 0.5  # a frame at or above it is speech; speech ends below threshold - 0.15 (Silero's rule)
    prefix_padding_ms: int = 300  # audio kept before the first speech frame (part of the turn)
    silence_duration_ms: int = 500  # this much silence ends the turn (and is part of it)

    def __post_init__(self) -> None:
        if not _is_number(self.threshold) or not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"turn_detection threshold must be in [0, 1], got {self.threshold!r}")
        for name, most in (("prefix_padding_ms", 10_000), ("silence_duration_ms", 10_000)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
                raise ValueError(f"turn_detection {name} must be an integer number of milliseconds in [0, {most}], "
                                 f"got {value!r}")
        if self.silence_duration_ms < 32:
            raise ValueError(f"turn_detection silence_duration_ms must be at least one VAD frame (32 ms), got "
                             f"{self.silence_duration_ms}")

    @property
    def neg_threshold(self) -> float:
        """Below this probability a frame is silence (Silero's and faster-whisper's default rule)."""
        return max(self.threshold - 0.15, 0.01)


@dataclass(frozen=True)
class LiveOptions:
    language: str | None = None  # None: English-only checkpoints use English; multilingual ones detect it per turn
    task: str = "transcribe"  # or "translate" (multilingual checkpoints)
    prompt: str | None = None  # text that conditions every turn (<|startofprev|>), as OpenAI's `prompt`
    # None: no turn detection; a turn is what was appended between two commits (OpenAI's turn_detection null).
    turn_detection: TurnDetection | dict | None = field(default_factory=TurnDetection)
    # Seconds of new audio before the buffer is decoded again (whisper_streaming's --min-chunk-size, there 1 s).
    # A word is confirmed about two decodes after it is spoken, so this sets the lag while the engine keeps
    # up; a busier engine simply decodes less often, each time over more new audio (the lag grows, nothing
    # is dropped), so a shorter chunk costs idle CPU, not streams. bench_realtime.py, tiny.en fp32, 2 cores:
    # p95 word lag 2.14 / 2.18 / 2.44 s at 1 / 2 / 4 streams with 0.5 s, 1.21 / 1.20 / 2.46 s with 0.3 s,
    # 1.04 / 1.47 / 2.62 s with 0.2 s (there the decodes of 2 and 4 streams already wait on each other);
    # 0.3 s with the first decode at 1.5 s (live/turn.py), the default: 1.47-1.52 / 1.45-1.46 / 2.28-2.40 s
    # over two runs.
    min_chunk_seconds: float = 0.3
    # LocalAgreement-n: words are confirmed once this many successive hypotheses of the growing buffer
    # start with them (whisper_streaming uses 2).
    agreement: int = 2
    # A turn's buffer longer than this many seconds is cut at the end of its last confirmed segment; the
    # text before the cut then conditions the later decodes (whisper_streaming's segment trimming, 15 s).
    trim_seconds: float = 15.0
    # The turn's earlier turns condition it (<|startofprev|>). Off by default: each turn is then decoded as
    # its own audio would be offline, which is what its final text is compared with.
    condition_on_previous_turns: bool = False
    # The interim (partial) decodes' encoder reads the buffer plus this much of the window's padding, rounded up
    # to whole seconds, instead of the whole 30 s window (whisper.cpp's audio_ctx): an interim decode costs what
    # its audio costs. None: every decode reads the whole window. The final decode always reads the whole window.
    # tiny.en, 29 prefixes of the bundled clips (one-off): no padding looped 13 of them (ran on), 1 s or
    # more none did, 9-13% WER from the whole window's text (which is itself a guess at a prefix), 7-12x faster.
    interim_padding_seconds: float | None = 2.0

    def __post_init__(self) -> None:
        if self.language is not None:
            object.__setattr__(self, "language", known_language_code(self.language))
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        if self.prompt is not None and len(self.prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt has {len(self.prompt)} characters; at most {MAX_PROMPT_CHARS}")
        if isinstance(self.turn_detection, dict):  # {"threshold": 0.6, ...}: the fields left out keep their defaults
            unknown = sorted(set(self.turn_detection) - set(TurnDetection.__dataclass_fields__))
            if unknown:
                raise ValueError(f"unknown turn_detection fields {unknown}; known: {list(TurnDetection.__dataclass_fields__)}")
            object.__setattr__(self, "turn_detection", TurnDetection(**self.turn_detection))
        if self.turn_detection is not None and not isinstance(self.turn_detection, TurnDetection):
            raise ValueError(f"turn_detection must be a TurnDetection, a dict of its fields or None, got "
                             f"{type(self.turn_detection).__name__}")
        if not _is_number(self.min_chunk_seconds) or not 0.1 <= self.min_chunk_seconds <= 10.0:
            raise ValueError(f"min_chunk_seconds must be in [0.1, 10], got {self.min_chunk_seconds!r}")
        if not isinstance(self.agreement, int) or isinstance(self.agreement, bool) or not 1 <= self.agreement <= 5:
            raise ValueError(f"agreement must be an integer in [1, 5] (hypotheses that must agree), got "
                             f"{self.agreement!r}")
        if not _is_number(self.trim_seconds) or not 5.0 <= self.trim_seconds <= 25.0:
            raise ValueError(f"trim_seconds must be in [5, 25] (a Whisper window holds 30 s), got {self.trim_seconds!r}")
        padding = self.interim_padding_seconds
        if padding is not None and (not _is_number(padding) or not 0.0 <= padding <= 30.0):
            raise ValueError(f"interim_padding_seconds must be in [0, 30] or None (the whole window), got {padding!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
