"""The state one app serves from (engine, limits, admission queue, metrics) and the request plumbing
the endpoints share: server-sent events and cancelling work when the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from encdec_engine.engine.async_engine import AsyncLLMEngine
from encdec_engine.server import routes
from encdec_engine.server.errors import APIError, engine_error
from encdec_engine.server.limits import Admission, AudioMemory, RealtimeSessions, Reservation, ServerLimits, Ticket
from encdec_engine.server.metrics import Metrics
from encdec_engine.server.uploads import largest_upload_bytes
from encdec_engine.speech.live.async_driver import VadBatch
from encdec_engine.translation.tasks import Translator

T = TypeVar("T")


class ServerState:
    """What one app serves from; kept on `app.state.server`."""

    def __init__(self, engine: AsyncLLMEngine, limits: ServerLimits, served_model_name: str | None) -> None:
        self.engine, self.limits = engine, limits
        core = engine.engine
        self.is_audio = getattr(core.model, "num_mel_bins", None) is not None
        self.model_path = str(core.config.model)
        self.model_name = served_model_name or Path(self.model_path).name or self.model_path
        self.aliases = {self.model_name, self.model_path} | ({"whisper-1"} if self.is_audio else set())
        self.admission = Admission(limits.max_queue)
        largest = largest_upload_bytes(limits.max_body_bytes, limits.max_audio_seconds)
        self.audio_memory = AudioMemory(int(limits.max_audio_memory_mb * (1 << 20)),
                                        limits.max_client_audio_bytes(largest))
        self.metrics = Metrics()
        self.preprocess = asyncio.Semaphore(limits.preprocess_workers)
        self._translator: Translator | None = None
        self.realtime = RealtimeSessions(limits.max_realtime_sessions, limits.realtime_sessions_per_client)
        self.live_sessions: set = set()  # the LiveSessions of the realtime connections open (for the metrics)
        self.realtime_connections: set = set()  # the RealtimeConnections open (finished at shutdown)
        self.vad = VadBatch()  # the realtime sessions' voice detection, in shared calls

    def translator(self) -> Translator:
        """The model's translation convention (made at the first request with a target_language); a 400
        for a model that does not translate by language codes."""
        if self._translator is None:
            try:
                self._translator = Translator(self.engine.engine)
            except ValueError as e:
                raise APIError(400, f"target_language: {e}", "target_language") from None
        return self._translator

    def check_model(self, name: str | None) -> None:
        if name and name not in self.aliases:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_name!r}", "model")

    def require(self, audio: bool, path: str) -> None:
        if audio and not self.is_audio:
            raise APIError(404, f"{path} needs a speech model (Whisper); this server runs the text model "
                                f"{self.model_name!r}: use {routes.COMPLETIONS}")
        if not audio and self.is_audio:
            raise APIError(404, f"{path} needs a text model (BART, T5, a translation model or decoder-only); this "
                                f"server runs the speech "
                                f"model {self.model_name!r}: use {routes.TRANSCRIPTIONS}")


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def sse_error(e: Exception, request_id: str | None = None) -> str:
    return sse(engine_error(e, request_id).body())


class SSEResponse(StreamingResponse):
    """A server-sent event stream that always cleans up: closes its event generator and the engine
    outputs behind it (aborting unfinished requests) and frees its queue slots and audio memory, even
    when the client left before the first byte."""

    def __init__(self, events: AsyncIterator[str], outputs: AsyncIterator | None, ticket: Ticket,
                 reservation: Reservation | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events, self._outputs, self._ticket, self._reservation = events, outputs, ticket, reservation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            if self._outputs is not None:
                await self._outputs.aclose()
            self._ticket.release_all()
            if self._reservation is not None:
                self._reservation.release()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes away first, cancel it (which aborts its engine requests)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "client closed the request")
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
