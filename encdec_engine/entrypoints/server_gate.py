"""What every request passes before an endpoint sees it: the API key, the body size limit, and the
bounded queue of engine requests admitted but not yet running (with `ServerLimits`, their settings)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import HTTPException

from encdec_engine.entrypoints.server_errors import APIError

if TYPE_CHECKING:
    from encdec_engine.entrypoints.server_state import ServerState

_API_PATHS = ("/v1/completions", "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/models")
# What the server tells about itself (load, the API's shape): guarded when ServerLimits.protects_info.
INFO_PATHS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


@dataclass(frozen=True)
class ServerLimits:
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    # /metrics, /docs, /redoc and /openapi.json need the key too (without a key they are not served).
    # None: on when api_key is set.
    protect_info: bool | None = None
    max_queue: int = 256  # engine requests admitted but not yet running; more get 429
    max_upload_mb: float = 25.0  # request body size (OpenAI's audio limit); more get 413
    max_audio_seconds: float = 3600.0  # decoded audio length; more get 413
    preprocess_workers: int = 2  # audio decodes / log-mels computed at once (off the event loop)

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.max_upload_mb <= 0 or self.max_audio_seconds <= 0:
            raise ValueError("max_upload_mb and max_audio_seconds must be positive")
        if self.preprocess_workers < 1:
            raise ValueError(f"preprocess_workers must be at least 1, got {self.preprocess_workers}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no key)")

    @property
    def protects_info(self) -> bool:
        return self.api_key is not None if self.protect_info is None else self.protect_info

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_upload_mb * (1 << 20))


class _BodyTooLarge(HTTPException):
    # An HTTPException so that FastAPI's body reader passes it through instead of making it a 400.
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than this server's limit of {limit / (1 << 20):g} MB")


# -- admission: the bounded waiting queue -----------------------------------
class Ticket:
    """Slots held in the queue until the engine starts the requests (or they end)."""

    def __init__(self, admission: Admission, held: int) -> None:
        self.admission, self.held = admission, held

    def release(self, n: int = 1) -> None:
        n = min(n, self.held)
        self.held -= n
        self.admission.waiting -= n

    def release_all(self) -> None:
        self.release(self.held)

    def add(self, n: int) -> None:
        """Hold n more slots (more engine requests for the same client request); 429 if the queue is full."""
        self.admission.acquire(n)
        self.held += n


class Admission:
    """Counts engine requests admitted but not yet started (event loop only, so exact)."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.waiting = 0

    def acquire(self, n: int) -> Ticket:
        if n > self.max_queue:
            raise APIError(400, f"{n} prompts in one request exceed this server's queue of {self.max_queue}; "
                                "send fewer per request", "prompt")
        if self.waiting + n > self.max_queue:
            raise APIError(429, f"server busy: {self.waiting} requests are already waiting to start "
                                f"(limit {self.max_queue}); retry shortly")
        self.waiting += n
        return Ticket(self, n)


# -- the gate: API key, body size, metrics (pure ASGI, so streaming is timed to the last byte) --
class Gate:
    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, limits = scope["path"], self.state.limits
        endpoint = path if path in _API_PATHS else None
        start, status, done = time.monotonic(), [500], [False]

        async def send_timed(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done[0] = True
            await send(message)

        received = 0

        async def receive_limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limits.max_body_bytes:
                    raise _BodyTooLarge(limits.max_body_bytes)
            return message

        try:
            headers = dict(scope["headers"])
            error = None
            guarded = path.startswith("/v1") or (limits.protects_info and path in INFO_PATHS)
            if limits.protects_info and path in INFO_PATHS and limits.api_key is None:
                error = APIError(404, f"{path} is not served here (--protect-info without an API key)")
            elif limits.api_key is not None and guarded:
                error = _check_api_key(headers.get(b"authorization"), limits.api_key)
            length = headers.get(b"content-length", b"")
            if error is None and length.isdigit() and int(length) > limits.max_body_bytes:
                error = APIError(413, str(_BodyTooLarge(limits.max_body_bytes).detail))
            if error is not None:
                return await error.response()(scope, receive, send_timed)
            await self.app(scope, receive_limited, send_timed)
        finally:
            if endpoint is not None:
                self.state.metrics.observe(endpoint, status[0] if done[0] else 499, time.monotonic() - start)


def _check_api_key(header: bytes | None, api_key: str) -> APIError | None:
    if not header:
        return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, token = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return APIError(401, "invalid API key")
    return None
