"""What every request passes before an endpoint sees it (pure ASGI, so a streamed answer is timed to its
last byte): its Host and Origin headers (origins.py: no web page may use the server through a browser), the
API key, the body's size limit and minimum rate, and for an upload its audio memory, reserved as its bytes
arrive and released when the request ends. A websocket upgrade (/v1/realtime) passes the Host, Origin and
API key checks."""

from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import HTTPException

from encdec_engine.server import routes
from encdec_engine.server.errors import APIError
from encdec_engine.server.limits import ServerLimits, client_address
from encdec_engine.server.origins import refusal
from encdec_engine.server.state import ServerState

_MB = 1 << 20


class _BodyTooLarge(HTTPException):
    # An HTTPException so that FastAPI's body reader passes it through instead of making it a 400.
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than this server's limit of {limit / _MB:g} MB")


class _BodyTooSlow(HTTPException):
    def __init__(self, received: int, seconds: float, limits: ServerLimits) -> None:
        super().__init__(408, f"request body too slow: {received} bytes in {seconds:.0f} s; this server needs "
                              f"{limits.min_body_kb_per_s:g} KB/s after the first {limits.body_grace_s:g} s")


class Gate:
    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, limits = scope["path"], self.state.limits
        endpoint = path if path in routes.METERED_PATHS else None
        start, status, done = time.monotonic(), [500], [False]

        async def send_timed(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done[0] = True
            await send(message)

        received, started, complete = 0, time.monotonic(), [False]
        reservation = self.state.audio_memory.reserve(client_address(scope)) if path in routes.AUDIO_PATHS else None
        if reservation is not None:
            scope.setdefault("state", {})["audio_reservation"] = reservation

        async def receive_limited():
            """The body as it arrives: at the minimum rate (408), within the size limit (413), and for
            an upload, reserved from the audio budget byte by byte (429)."""
            nonlocal received
            if complete[0]:  # the body is in: waiting for a disconnect has no deadline
                return await receive()
            deadline = started + limits.body_grace_s + received / (limits.min_body_kb_per_s * 1024)
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise _BodyTooSlow(received, time.monotonic() - started, limits) from None
            if message["type"] == "http.request":
                body = message.get("body", b"")
                received += len(body)
                if received > limits.max_body_bytes:
                    raise _BodyTooLarge(limits.max_body_bytes)
                if reservation is not None:
                    try:
                        reservation.grow(len(body))
                    except APIError as e:  # raised inside the body reader: as an HTTPException
                        raise HTTPException(e.status, e.message) from None
                complete[0] = not message.get("more_body", False)
                if complete[0] and reservation is not None:
                    reservation.arrived()
            else:
                complete[0] = True
            return message

        try:
            headers = dict(scope["headers"])
            error = _refused(path, headers, limits)
            length = headers.get(b"content-length", b"")
            if error is None and length.isdigit() and int(length) > limits.max_body_bytes:
                error = APIError(413, str(_BodyTooLarge(limits.max_body_bytes).detail))
            if error is not None:
                return await error.response()(scope, receive, send_timed)
            await self.app(scope, receive_limited, send_timed)
        finally:
            if reservation is not None:  # the request is over, answer sent: its audio goes
                reservation.release()
            if endpoint is not None:
                self.state.metrics.observe(endpoint, status[0] if done[0] else 499, time.monotonic() - start)


    async def _websocket(self, scope, receive, send) -> None:
        """A websocket (/v1/realtime) needs a served Host and Origin and the API key on its upgrade request, as
        the openai client sends it (Authorization: Bearer). Refused: a 403 or 401 answer with OpenAI's error
        body where the server can send one on the handshake (the websocket.http.response extension), else the
        handshake closed (1008)."""
        error = _refused(scope["path"], dict(scope["headers"]), self.state.limits)
        if error is None:
            return await self.app(scope, receive, send)
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if "websocket.http.response" in scope.get("extensions", {}):
            body = error.response().body
            await send({"type": "websocket.http.response.start", "status": error.status,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            reason = error.message.encode()[:120].decode(errors="ignore")  # a close reason holds 123 bytes
            await send({"type": "websocket.close", "code": 1008, "reason": reason})


def _refused(path: str, headers: dict[bytes, bytes], limits: ServerLimits) -> APIError | None:
    """The error for a request its headers do not let in (None: let in): a Host or Origin not served (403,
    first, so that a web page learns nothing more), else a missing or wrong API key (401) or guarded info
    without a key (404)."""
    error = refusal(headers, limits.allowed_hosts, limits.allowed_origins)
    if error is not None:
        return error
    guarded = path.startswith(routes.API_PREFIX) or (limits.protects_info and path in routes.INFO_PATHS)
    if limits.protects_info and path in routes.INFO_PATHS and limits.api_key is None:
        return APIError(404, f"{path} is not served here (--protect-info without an API key)")
    if limits.api_key is not None and guarded:
        return _check_api_key(headers.get(b"authorization"), limits.api_key)
    return None


def _check_api_key(header: bytes | None, api_key: str) -> APIError | None:
    if not header:
        return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, token = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return APIError(401, "invalid API key")
    return None
