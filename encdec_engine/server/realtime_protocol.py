"""The OpenAI Realtime transcription protocol's shapes: session configurations as clients send them (the GA
`session.update` with `session.type = "transcription"`, and the beta `transcription_session.update`), the
effective configuration (`SessionConfig`), and the server events built from a live session's events.

A field that cannot apply here is refused with an error naming it, except those that only tune what a
transcription session does not do (responses, noise suppression): those are accepted and echoed back
as off (`null`), so a client sees what the session really does. docs/live.md lists them all.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from encdec_engine.server.errors import clip
from encdec_engine.server.protocol import MAX_AUDIO_PROMPT_CHARS, MAX_LANGUAGE_CHARS, MAX_NAME_CHARS
from encdec_engine.speech.live.events import (Cleared, Committed, LiveEvent, SpeechStarted, SpeechStopped,
                                              TranscriptCompleted, TranscriptDelta, TranscriptFailed)
from encdec_engine.speech.live.options import TurnDetection

RATES = (24000, 16000)  # pcm16 sample rates taken: OpenAI's 24 kHz, and Whisper's own 16 kHz
# OpenAI's transcription models: a client written for OpenAI names one of them; this server's model answers.
OPENAI_MODELS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-4o-mini-transcribe-2025-12-15",
                 "gpt-4o-transcribe-diarize", "gpt-transcribe", "gpt-live-transcribe", "gpt-realtime-whisper")


class ProtocolError(ValueError):
    """A client event that cannot be done: an `error` event naming the field (`param`) and a `code`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# -- what clients send -----------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TurnDetectionIn(_Strict):
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    create_response: bool | None = None  # responses: none in a transcription session (accepted, nothing to do)
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = None  # refused: no input_audio_buffer.timeout_triggered here
    eagerness: str | None = None  # semantic_vad only (refused)


class TranscriptionIn(_Strict):  # the same caps as the HTTP endpoints' fields
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    language: str | None = Field(None, max_length=MAX_LANGUAGE_CHARS)
    prompt: str | None = Field(None, max_length=MAX_AUDIO_PROMPT_CHARS)
    delay: str | None = None  # gpt-realtime-whisper's latency knob (refused: see min_chunk_seconds)
    keywords: list[str] | None = None  # refused (use prompt)
    languages: list[str] | None = None  # refused (one language, or detection per turn)


class FormatIn(_Strict):
    type: str = "audio/pcm"
    rate: StrictInt | None = None  # a number, as OpenAI's schema has it ("24000" was taken)


class AudioInputIn(_Strict):
    format: FormatIn | None = None
    transcription: TranscriptionIn | None = None
    turn_detection: TurnDetectionIn | None = None
    noise_reduction: dict | None = None  # accepted, not applied (echoed as null)


class AudioIn(_Strict):
    input: AudioInputIn | None = None


class SessionIn(_Strict):  # GA: session.update {"session": {"type": "transcription", ...}}
    type: Literal["transcription"]
    audio: AudioIn | None = None
    include: list[str] | None = None


class BetaSessionIn(_Strict):  # beta: transcription_session.update {"session": {...}}
    input_audio_format: str | None = None
    input_audio_transcription: TranscriptionIn | None = None
    turn_detection: TurnDetectionIn | None = None
    input_audio_noise_reduction: dict | None = None  # accepted, not applied
    include: list[str] | None = None
    modalities: list[str] | None = None
    client_secret: dict | None = None  # REST-created sessions only; ignored over the websocket


@dataclass(frozen=True)
class SessionConfig:
    """A session's effective configuration (OpenAI's defaults until the client changes them)."""

    rate: int = 24000  # pcm16 samples per second
    model: str | None = None  # as the client named it
    language: str | None = None
    prompt: str | None = None
    turn_detection: TurnDetection | None = TurnDetection()


def parse_event(text: str) -> dict:
    """A client event: a JSON object with a string `type`."""
    try:
        event = json.loads(text)
    except ValueError as e:
        raise ProtocolError(f"the message is not JSON: {e}", None, "invalid_json") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise ProtocolError("the message is nested too deeply to be an event", None, "invalid_json") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise ProtocolError("an event must be a JSON object with a string 'type'", "type", "missing_type")
    return event


def apply_update(config: SessionConfig, session: Any, beta: bool) -> SessionConfig:
    """The configuration after a session update (only the fields present change; null turns a field off)."""
    prefix = "session"
    if not isinstance(session, dict):
        raise ProtocolError("'session' must be an object", prefix)
    if not beta and session.get("type") != "transcription":
        raise ProtocolError(f"session.type must be 'transcription' (got {session.get('type')!r}): this server "
                            "transcribes; it has no conversation (speech-to-speech) sessions", "session.type")
    try:
        parsed = (BetaSessionIn if beta else SessionIn).model_validate(session)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join([prefix, *map(str, error["loc"])])
        message = "unknown parameter" if error["type"] == "extra_forbidden" else error["msg"]
        raise ProtocolError(f"{where}: {message}", where, "unknown_parameter" if "unknown" in message else
                            "invalid_value") from None
    if beta:
        return _apply(config, parsed.input_audio_format, parsed.input_audio_transcription, parsed.turn_detection,
                      "turn_detection" in parsed.model_fields_set, parsed.include,
                      {"format": "session.input_audio_format", "transcription": "session.input_audio_transcription",
                       "turn_detection": "session.turn_detection", "include": "session.include"})
    audio = parsed.audio.input if parsed.audio is not None and parsed.audio.input is not None else AudioInputIn()
    base = "session.audio.input"
    return _apply(config, audio.format, audio.transcription, audio.turn_detection,
                  "turn_detection" in audio.model_fields_set, parsed.include,
                  {"format": f"{base}.format", "transcription": f"{base}.transcription",
                   "turn_detection": f"{base}.turn_detection", "include": "session.include"})


def _apply(config: SessionConfig, fmt, transcription: TranscriptionIn | None, turn: TurnDetectionIn | None,
           turn_given: bool, include: list[str] | None, where: dict[str, str]) -> SessionConfig:
    changes: dict[str, Any] = {}
    if isinstance(fmt, str):  # beta: "pcm16" (24 kHz), "g711_ulaw", "g711_alaw"
        if fmt != "pcm16":
            raise ProtocolError(f"input_audio_format {fmt!r} is not supported: send 'pcm16' (16-bit PCM, 24 kHz, "
                                "mono, little-endian)", where["format"], "unsupported_format")
        changes["rate"] = 24000
    elif fmt is not None:
        if fmt.type != "audio/pcm":
            raise ProtocolError(f"audio format {fmt.type!r} is not supported: send 'audio/pcm' (16-bit, mono, "
                                "little-endian)", f"{where['format']}.type", "unsupported_format")
        if fmt.rate is not None and fmt.rate not in RATES:
            raise ProtocolError(f"rate {fmt.rate} is not supported: 24000 (OpenAI's) or 16000",
                                f"{where['format']}.rate", "unsupported_format")
        changes["rate"] = fmt.rate or 24000
    if transcription is not None:
        for name in ("delay", "keywords", "languages"):
            if getattr(transcription, name) is not None:
                raise ProtocolError(f"{name} is not supported by this server (Whisper): see docs/live.md",
                                    f"{where['transcription']}.{name}", "unsupported_parameter")
        given = transcription.model_fields_set
        changes.update({name: getattr(transcription, name) for name in ("model", "language", "prompt") if name in given})
    if turn_given:
        changes["turn_detection"] = None if turn is None else _turn_detection(turn, where["turn_detection"])
    if include:
        raise ProtocolError(f"include {include[0]!r} is not supported (no logprobs are returned)", where["include"],
                            "unsupported_parameter")
    return dataclasses.replace(config, **changes)


def _turn_detection(turn: TurnDetectionIn, where: str) -> TurnDetection:
    if turn.type != "server_vad":
        raise ProtocolError(f"turn detection {turn.type!r} is not supported: use 'server_vad' or null (commit by "
                            "hand)", f"{where}.type", "unsupported_parameter")
    for name in ("idle_timeout_ms", "eagerness"):
        if getattr(turn, name) is not None:
            raise ProtocolError(f"{name} is not supported here", f"{where}.{name}", "unsupported_parameter")
    fields = {k: getattr(turn, k) for k in ("threshold", "prefix_padding_ms", "silence_duration_ms")
              if getattr(turn, k) is not None}
    try:
        return TurnDetection(**fields)
    except ValueError as e:
        name = next((k for k in fields if k in str(e)), None)
        raise ProtocolError(str(e), f"{where}.{name}" if name else where) from None


# -- what the server sends ---------------------------------------------------------------------
_event_ids = itertools.count()


def event(type_: str, **fields) -> dict:
    return {"event_id": f"event_{secrets.token_hex(6)}{next(_event_ids):x}", "type": type_, **fields}


def error_event(message: str, param: str | None = None, code: str | None = None, event_id: str | None = None,
                type_: str = "invalid_request_error") -> dict:
    return event("error", error={"type": type_, "code": code, "message": clip(message), "param": param,
                                 "event_id": clip(event_id, 200) if isinstance(event_id, str) else None})


def session_object(config: SessionConfig, session_id: str, model: str, beta: bool) -> dict:
    """The effective configuration as session.created/updated (transcription_session.* for beta) show it."""
    transcription = {"model": config.model or model, "language": config.language, "prompt": config.prompt or ""}
    td = config.turn_detection
    turn = None if td is None else {"type": "server_vad", "threshold": td.threshold,
                                    "prefix_padding_ms": td.prefix_padding_ms,
                                    "silence_duration_ms": td.silence_duration_ms}
    if beta:
        return {"id": session_id, "object": "realtime.transcription_session",
                "input_audio_format": "pcm16" if config.rate == 24000 else "pcm16_16000",
                "input_audio_transcription": transcription, "turn_detection": turn,
                "input_audio_noise_reduction": None, "include": None, "modalities": ["text"]}
    return {"id": session_id, "object": "realtime.transcription_session", "type": "transcription",
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": config.rate}, "transcription": transcription,
                                "turn_detection": turn, "noise_reduction": None}},
            "include": None}


def server_events(e: LiveEvent, beta: bool) -> list[dict]:
    """OpenAI's server events for one live event."""
    if isinstance(e, SpeechStarted):
        return [event("input_audio_buffer.speech_started", audio_start_ms=e.audio_start_ms, item_id=e.item_id)]
    if isinstance(e, SpeechStopped):
        return [event("input_audio_buffer.speech_stopped", audio_end_ms=e.audio_end_ms, item_id=e.item_id)]
    if isinstance(e, Committed):
        item = {"id": e.item_id, "object": "realtime.item", "type": "message", "role": "user",
                "status": "completed", "content": [{"type": "input_audio", "transcript": None}]}
        return [event("input_audio_buffer.committed", item_id=e.item_id, previous_item_id=e.previous_item_id),
                event("conversation.item.created" if beta else "conversation.item.added",
                      previous_item_id=e.previous_item_id, item=item)]
    if isinstance(e, Cleared):
        return [event("input_audio_buffer.cleared")]
    if isinstance(e, TranscriptDelta):
        return [event("conversation.item.input_audio_transcription.delta", item_id=e.item_id, content_index=0,
                      delta=e.delta)]
    if isinstance(e, TranscriptCompleted):
        seconds = round((e.audio_end_ms - e.audio_start_ms) / 1000, 3)
        return [event("conversation.item.input_audio_transcription.completed", item_id=e.item_id, content_index=0,
                      transcript=e.transcript, usage={"type": "duration", "seconds": seconds})]
    if isinstance(e, TranscriptFailed):
        return [event("conversation.item.input_audio_transcription.failed", item_id=e.item_id, content_index=0,
                      error={"type": "server_error", "code": "transcription_failed", "message": e.message,
                             "param": None})]
    raise TypeError(f"not a live event: {e!r}")
