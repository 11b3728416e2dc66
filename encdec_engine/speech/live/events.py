"""What a live transcription tells its caller, in order: turns starting and stopping, each turn committed,
its confirmed text as deltas while it is spoken, and its final text. The server maps them one to one onto
OpenAI's Realtime events (`input_audio_buffer.speech_started`, ...); times are milliseconds of the stream
(all audio appended since it began)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeechStarted:
    item_id: str  # the turn's id (OpenAI: the user message item it becomes)
    audio_start_ms: int  # where the turn's audio starts: the first speech frame less the prefix padding


@dataclass(frozen=True)
class SpeechStopped:
    item_id: str
    audio_end_ms: int  # where the turn's audio ends: the silence that ended it included


@dataclass(frozen=True)
class Committed:
    item_id: str
    previous_item_id: str | None  # the turn committed before it (None for the first)


@dataclass(frozen=True)
class Cleared:
    """The uncommitted audio was dropped (its turn, if one had begun, is gone; its deltas stay sent)."""


@dataclass(frozen=True)
class TranscriptDelta:
    item_id: str
    delta: str  # newly confirmed text; the deltas of a turn, joined, are its transcript
    audio_end_ms: int  # the end of the audio the decode that confirmed it had heard


@dataclass(frozen=True)
class TranscriptCompleted:
    item_id: str
    transcript: str  # the turn's final text
    audio_start_ms: int  # the turn's span in the stream
    audio_end_ms: int


@dataclass(frozen=True)
class TranscriptFailed:
    item_id: str
    message: str


LiveEvent = SpeechStarted | SpeechStopped | Committed | Cleared | TranscriptDelta | TranscriptCompleted | TranscriptFailed
