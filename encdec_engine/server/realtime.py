"""/v1/realtime (websocket): OpenAI's Realtime transcription sessions, as the official `openai` client's
`realtime.connect(extra_query={"intent": "transcription"})` (and the beta `beta.realtime.connect`) speak
them. Each connection is one live session (speech/live/session.py) driven through the shared engine
(speech/live/async_driver.py): its re-decodes are ordinary engine requests, batched with every other session's.

    client                                     server
    session.update / transcription_session.update  ->  session.updated / transcription_session.updated
    input_audio_buffer.append {audio: base64}  ->  input_audio_buffer.speech_started {audio_start_ms, item_id}
                                                   conversation.item.input_audio_transcription.delta (while speaking)
                                                   input_audio_buffer.speech_stopped, .committed, conversation.item.added
                                                   conversation.item.input_audio_transcription.delta, .completed
    input_audio_buffer.commit / .clear         ->  input_audio_buffer.committed / .cleared
    anything wrong                             ->  error {error: {type, code, message, param, event_id}}; the session lives on

Admission: at most `max_realtime_sessions` at once, and `realtime_sessions_per_client` from one client
address (the next gets an error event and close code 1013, try again later); a session holding more than
`max_realtime_buffer_seconds` of audio not yet transcribed (its decodes fell that far behind) gets an error
event and is closed (1013); an append holding more than that alone is refused whole (an error event). A
client that leaves frees its session at once: the decode in flight is aborted, so its KV blocks are free
before the next engine step.

Backpressure: a session's server events wait in its outbox for the client to read them. Past
`OUTBOX_CHARS` of them the client's next event is not read until the client has read enough (its sends
block, as TCP holds them), so a client flooding events it never reads the answers to holds the server to
that much. A client that reads none of them for `realtime_idle_timeout_s`, or that sends no event for as
long while the session owes it no transcription, gets an error event and close code 1008.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable

from fastapi import APIRouter, WebSocket

from encdec_engine.inputs.pcm_stream import AudioChunks, pcm16_samples
from encdec_engine.server import routes
from encdec_engine.server.limits import SessionRefused, client_address
from encdec_engine.server.realtime_protocol import (OPENAI_MODELS, ProtocolError, SessionConfig, apply_update,
                                                    error_event, event, parse_event, server_events, session_object)
from encdec_engine.server.state import ServerState
from encdec_engine.speech.live.async_driver import LiveStream
from encdec_engine.speech.live.events import LiveEvent, TranscriptCompleted, TranscriptDelta
from encdec_engine.speech.live.model import LiveModel
from encdec_engine.speech.live.options import LiveOptions
from encdec_engine.speech.live.session import LiveError, LiveSession

logger = logging.getLogger(__name__)
router = APIRouter()

TRY_AGAIN_LATER = 1013  # websocket close codes (RFC 6455)
POLICY_VIOLATION = 1008
INTERNAL_ERROR = 1011
GOING_AWAY = 1001
OUTBOX_CHARS = 256 * 1024  # server events (their JSON) one session holds for a client that does not read them
CLIENT_EVENTS = ("session.update", "transcription_session.update", "input_audio_buffer.append",
                 "input_audio_buffer.commit", "input_audio_buffer.clear")


@router.websocket(routes.REALTIME)
async def realtime(websocket: WebSocket) -> None:
    st: ServerState = websocket.app.state.server
    beta = websocket.headers.get("openai-beta", "").lower().startswith("realtime")
    await websocket.accept()
    client = client_address(websocket.scope)  # as the gate keys audio memory
    refusal = _refusal(st, websocket)
    if refusal is None:
        try:
            st.realtime.acquire(client)
        except SessionRefused as e:
            refusal = error_event(e.message, None, e.code, type_="rate_limit_error"), TRY_AGAIN_LATER
    if refusal is not None:
        with contextlib.suppress(Exception):  # the client may be gone already
            await websocket.send_text(json.dumps(refusal[0]))
            await websocket.close(refusal[1])
        return
    try:
        await RealtimeConnection(st, websocket, beta).run()
    finally:
        st.realtime.release(client)


def _refusal(st: ServerState, websocket: WebSocket) -> tuple[dict, int] | None:
    """Why this connection cannot be a session here (an error event and a close code), or None."""
    query = websocket.query_params
    if not st.is_audio:
        return error_event(f"{routes.REALTIME} transcribes speech; this server runs the text model {st.model_name!r}",
                           None, "model_not_supported"), POLICY_VIOLATION
    if query.get("intent", "transcription") != "transcription":
        return error_event("only transcription sessions are served here: connect with ?intent=transcription",
                           "intent", "unsupported_intent"), POLICY_VIOLATION
    model = query.get("model")
    if model and model not in st.aliases and model not in OPENAI_MODELS:
        return error_event(f"model {model!r} is not served here; this server serves {st.model_name!r}", "model",
                           "model_not_found"), POLICY_VIOLATION
    if not st.engine.is_running:
        return error_event("the engine is not running", None, "engine_unavailable", type_="server_error"), INTERNAL_ERROR
    return None


class AudioPace:
    """How far a session's audio runs ahead of the wall clock. Its first `burst` seconds may come at any
    speed, then at most `speed` times real time: `add` says how long to wait before reading the client's
    next event (meanwhile its sends block, TCP's backpressure). Nothing is dropped or refused."""

    def __init__(self, speed: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.speed, self.burst, self.clock = speed, burst, clock
        self.start: float | None = None
        self.seconds = 0.0

    def add(self, seconds: float) -> float:
        """Count `seconds` more of audio; the seconds to wait before taking the next event."""
        now = self.clock()
        if self.start is None:
            self.start = now
        self.seconds += seconds
        return max(0.0, (self.seconds - self.burst - self.speed * (now - self.start)) / self.speed)


class RealtimeConnection:
    """One websocket session: client events in, server events out through one queue (so in order)."""

    def __init__(self, st: ServerState, websocket: WebSocket, beta: bool) -> None:
        self.st, self.websocket, self.beta = st, websocket, beta
        self.id = f"sess_{secrets.token_hex(8)}"
        self.config, self.configured = SessionConfig(), False
        self.model = LiveModel(st.engine.engine)
        self.session = LiveSession(self.model, self._options(self.config), f"item_{self.id[5:13]}_")
        self.stream = LiveStream(st.engine, self.session, self._emit, st.metrics.observe_realtime_lag, "realtime",
                                 st.vad)
        self.audio = AudioChunks(self.config.rate)
        self.pace = AudioPace(st.limits.max_realtime_speed, st.limits.max_realtime_buffer_seconds)
        self.wait = 0.0  # seconds before the next event is read (the audio is ahead of `pace`)
        # Events as JSON text, or (close code, reason) as the last item; `outbox_chars` of text waiting.
        self.outbox: asyncio.Queue[str | tuple[int, str]] = asyncio.Queue()
        self.outbox_chars = 0
        self.drained = asyncio.Event()  # the outbox holds under OUTBOX_CHARS: the client's events are read
        self.drained.set()
        self.shutting_down = asyncio.Event()  # the server is shutting down (`finish`)
        self.done = asyncio.Event()  # `run` has ended

    async def run(self) -> None:
        kind = "transcription_session.created" if self.beta else "session.created"
        self._send(event(kind, session=self._session_object()))
        tasks = [asyncio.ensure_future(t) for t in (self._receive(), self._deliver(), self.stream.run(),
                                                    self.shutting_down.wait())]
        receiver, sender, decoder, shutdown = tasks
        self.st.live_sessions.add(self.session)
        self.st.realtime_connections.add(self)
        try:
            await asyncio.wait({receiver, decoder, shutdown}, return_when=asyncio.FIRST_COMPLETED)
            closing = decoder.done()  # the decode loop only ends by raising: the engine stopped
            if shutdown.done() and not closing:
                await self._finish_turns(receiver, decoder)
                closing = True
            elif closing:
                logger.error("realtime session %s stopped", self.id, exc_info=decoder.exception())
                self._send(error_event("the engine stopped; the session is closed", None, "engine_unavailable",
                                       type_="server_error"))
                self._close(INTERNAL_ERROR)
            elif receiver.exception() is not None:
                logger.debug("realtime session %s: receiving failed", self.id, exc_info=receiver.exception())
            else:
                closing = receiver.result()  # True: the session closes itself (an error event, then a close code)
            if closing:
                with contextlib.suppress(Exception):  # the client may be gone already
                    await asyncio.wait_for(asyncio.shield(sender), 5.0)
        finally:
            self.st.live_sessions.discard(self.session)
            self.stream.close()
            self.st.realtime_connections.discard(self)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.done.set()

    async def finish(self) -> None:
        """The server is shutting down: no more client events are read, the open turn ends where its audio
        does, every turn's final transcription is sent, and the session closes with 1001 (going away).
        Returns once the session has ended (the caller bounds the wait)."""
        self.shutting_down.set()
        await self.done.wait()

    async def _finish_turns(self, receiver: asyncio.Task, decoder: asyncio.Task) -> None:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
        self._emit(self.stream.finish())
        while not self.session.idle and not decoder.done():
            await asyncio.sleep(0.05)
        self._close(GOING_AWAY)

    # -- client events -----------------------------------------------------------------------
    async def _receive(self) -> bool:
        """Handle client events until the client leaves (False) or the session must close (True)."""
        while True:
            message = await self._next_message()
            if message is None:
                return True
            if message["type"] == "websocket.disconnect":
                return False
            text = message.get("text")
            event_id = None
            try:
                if text is None:
                    raise ProtocolError("binary messages are not events: send JSON text events", None, "invalid_event")
                client_event = parse_event(text)
                event_id = client_event.get("event_id")
                if client_event["type"] == "input_audio_buffer.append":
                    await self._append(client_event.get("audio"))
                else:
                    self._handle(client_event)
            except ProtocolError as e:
                self._send(error_event(e.message, e.param, e.code, event_id))
            except LiveError as e:
                self._send(error_event(str(e), None, e.code, event_id))
            except Exception:  # the server's fault, not the event's: said, logged, and the session closed
                logger.exception("realtime session %s: an event failed", self.id)
                self._send(error_event("the server failed on this event; the session is closed", None,
                                       "server_error", event_id, "server_error"))
                self._close(INTERNAL_ERROR)
                return True
            if self.session.buffered_seconds > self.st.limits.max_realtime_buffer_seconds:
                self._overflow(event_id)
                return True
            if self.wait > 0:  # audio faster than the server takes it: this client's next events wait
                await asyncio.sleep(self.wait)
                self.wait = 0.0

    async def _next_message(self) -> dict | None:
        """The client's next message, read once the outbox holds under OUTBOX_CHARS; None when the session
        closes instead (an error event and 1008 queued): the client read none of its events, or sent none
        while owed no transcription, for `realtime_idle_timeout_s`."""
        timeout = self.st.limits.realtime_idle_timeout_s
        if not self.drained.is_set():
            try:
                await asyncio.wait_for(self.drained.wait(), timeout)
            except asyncio.TimeoutError:
                self._timed_out("not_reading", f"this client has read none of the server's events for {timeout:g} s "
                                f"while {self.outbox_chars:,} characters of them wait (the server holds at most "
                                f"{OUTBOX_CHARS:,} a session, and reads no more events until they are read)",
                                "client_not_reading")
                return None
        while True:
            try:
                return await asyncio.wait_for(self.websocket.receive(), timeout)
            except asyncio.TimeoutError:
                if not self.session.ending and self.session.in_flight is None:  # the client is owed nothing
                    self._timed_out("idle", f"no client event for {timeout:g} s", "session_idle_timeout")
                    return None

    def _timed_out(self, outcome: str, why: str, code: str) -> None:
        self.st.realtime.timed_out(outcome)
        self._send(error_event(f"{why}, this server's idle timeout (--realtime-idle-timeout): the session is "
                               "closed", None, code))
        self._close(POLICY_VIOLATION, code)

    def _handle(self, client_event: dict) -> None:
        kind = client_event["type"]
        if kind in ("session.update", "transcription_session.update"):
            self._configure(client_event.get("session"), kind == "transcription_session.update")
        elif kind == "input_audio_buffer.commit":
            self._emit(self.stream.commit())
        elif kind == "input_audio_buffer.clear":
            self._emit(self.stream.clear())
        else:
            raise ProtocolError(f"unknown or unsupported event type {kind!r}; a transcription session takes "
                                f"{', '.join(CLIENT_EVENTS)}", "type", "unknown_event")

    def _configure(self, session: object, beta: bool) -> None:
        config = apply_update(self.config, session, beta)
        where = "session.input_audio_transcription" if beta else "session.audio.input.transcription"
        if config.model and config.model not in self.st.aliases and config.model not in OPENAI_MODELS:
            raise ProtocolError(f"model {config.model!r} is not served here; this server serves "
                                f"{self.st.model_name!r}", f"{where}.model", "model_not_found")
        try:
            options = self._options(config)
        except ValueError as e:
            name = "language" if "language" in str(e) or "English-only" in str(e) else "prompt"
            raise ProtocolError(str(e), f"{where}.{name}") from None
        self.session.configure(options)
        if config.rate != self.config.rate:
            self.audio = AudioChunks(config.rate)
        self.config, self.configured = config, True
        kind = "transcription_session.updated" if beta else "session.updated"
        self._send(event(kind, session=self._session_object(beta)))

    def _options(self, config: SessionConfig) -> LiveOptions:
        """LiveOptions of a configuration; ValueError for a language the model cannot take, or a bad prompt."""
        options = LiveOptions(language=config.language, prompt=config.prompt, turn_detection=config.turn_detection,
                              interim_padding_seconds=self.st.limits.realtime_interim_padding_s)
        self.model.tokens.decoder_prompt(options.language)  # an English-only checkpoint refuses other languages
        self.model.prompt_tokens(options.prompt)
        return options

    async def _append(self, audio: object) -> None:
        """Take one append event's audio. An event holding more than the session's buffer bound is refused
        whole, before it is decoded. Any other (an event may hold minutes) goes to the stream a second at a
        time, the event loop free for the other sessions and requests in between; once the session holds more
        than its bound the rest is not taken (`_receive` closes the session), so no more is ever held."""
        if not self.configured:
            raise ProtocolError("configure the session first: send session.update (or transcription_session.update) "
                                "before input_audio_buffer.append", "type", "session_not_configured")
        if not isinstance(audio, str):
            raise ProtocolError("audio must be a base64 string of pcm16 audio", "audio", "invalid_audio")
        bound = self.st.limits.max_realtime_buffer_seconds
        seconds = len(audio) * 3 / 4 / 2 / self.config.rate  # base64: 4 characters for 3 bytes; 2 bytes a sample
        if seconds > bound:
            raise ProtocolError(f"this append holds {seconds:.0f} s of audio, more than a session may hold: this "
                                f"server's bound is {bound:g} s (--max-realtime-buffer-seconds); nothing of it was "
                                "taken: send the audio in shorter appends", "audio", "audio_too_long")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ProtocolError(f"audio is not valid base64: {e}", "audio", "invalid_base64") from None
        try:
            pcm = pcm16_samples(data)  # [num_samples] int16 at the session's rate (a view of `data`)
        except ValueError as e:
            raise ProtocolError(str(e), "audio", "invalid_audio_format") from None
        seconds = len(pcm) / self.config.rate
        self.st.metrics.realtime_audio_seconds += seconds
        self.wait = self.pace.add(seconds)
        rate = self.config.rate
        for start in range(0, max(len(pcm), 1), rate):
            if start:
                await asyncio.sleep(0)
            self._emit(await self.stream.append(self.audio(pcm[start : start + rate])))
            if self.session.buffered_seconds > bound:
                return

    def _overflow(self, event_id: str | None) -> None:
        held = self.session.buffered_seconds
        self.st.realtime.overflowed(held)
        self._send(error_event(f"this session holds {held:.0f} s of audio not yet transcribed, over the server's "
                               f"bound of {self.st.limits.max_realtime_buffer_seconds:g} s: the server is "
                               "overloaded; the session is closed, reconnect later", None, "input_audio_buffer_full",
                               event_id, "rate_limit_error"))
        self._close(TRY_AGAIN_LATER)

    # -- server events -----------------------------------------------------------------------
    def _emit(self, events: list[LiveEvent]) -> None:
        for e in events:
            if isinstance(e, TranscriptDelta):
                self.st.metrics.realtime_events["delta"] += 1
            elif isinstance(e, TranscriptCompleted):
                self.st.metrics.realtime_events["completed"] += 1
            for message in server_events(e, self.beta):
                self._send(message)

    def _send(self, message: dict) -> None:
        text = json.dumps(message)
        self.outbox_chars += len(text)
        if self.outbox_chars >= OUTBOX_CHARS:
            self.drained.clear()
        self.outbox.put_nowait(text)

    def _close(self, code: int, reason: str = "") -> None:
        """Close the websocket with `code` once the events before are sent (nothing is sent after)."""
        self.outbox.put_nowait((code, reason))

    async def _deliver(self) -> None:
        while True:
            item = await self.outbox.get()
            if isinstance(item, tuple):
                await self.websocket.close(*item)
                return
            await self.websocket.send_text(item)  # waits while the client's connection holds unread data
            self.outbox_chars -= len(item)
            if self.outbox_chars < OUTBOX_CHARS:
                self.drained.set()

    def _session_object(self, beta: bool | None = None) -> dict:
        return session_object(self.config, self.id, self.st.model_name, self.beta if beta is None else beta)
