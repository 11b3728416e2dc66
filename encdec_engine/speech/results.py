"""What a transcription gives back: a `Transcription` per input, its timed `Segment`s and, with word
timestamps, each segment's `Word`s (openai-whisper's and faster-whisper's fields)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Word:
    """A word of a segment, with its timing from the cross-attention alignment (faster-whisper's Word)."""

    start: float  # seconds from the start of the audio
    end: float
    word: str  # with its leading space, as in the text
    probability: float


@dataclass
class Segment:
    """A timed piece of a transcript (openai-whisper's segment fields)."""

    id: int
    start: float  # seconds from the start of the audio
    end: float  # seconds
    text: str
    tokens: list[int] = field(default_factory=list)
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    words: list[Word] | None = None  # with word_timestamps=True


@dataclass
class Transcription:
    """The transcript of one audio input."""

    text: str
    language: str | None
    segments: list[Segment]
    duration: float  # seconds of audio
    source: str | None = None  # the file name, when the input was a file
    error: str | None = None  # why this input could not be transcribed (the others still are)
    index: int = 0  # the input's position in the call (results streamed in completion order carry it)
