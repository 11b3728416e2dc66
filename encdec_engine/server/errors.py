"""Errors as the server answers them: OpenAI's `{"error": {...}}` shape with an HTTP status.

Internal failures (500, 503) never carry exception text to the client: the body names a request id,
and the server log has the traceback under that id.
"""

from __future__ import annotations

import logging
import re
import uuid

from fastapi.responses import JSONResponse

from encdec_engine.engine.async_engine import EngineDeadError
from encdec_engine.sampling_params import FIELD_NAMES
from encdec_engine.server import protocol as P

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 2000  # of an error message: a field's value quoted back is cut there


def clip(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message`, cut to `limit` characters (saying how long it was): an error that quotes a client's
    value back must not turn a 1 MB field into a 1 MB answer."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... (the message was cut at {limit} of its {len(message):,} characters)"


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with its HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 408: "request_timeout", 413: "request_too_large", 429: "rate_limit_error",
             499: "client_closed_request", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        message = clip(message)
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        if self.status == 429:
            headers = {"Retry-After": "1", **(headers or {})}
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)

    def body(self) -> P.ErrorResponse:
        return P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.TYPES.get(self.status, "error"),
                                                 param=self.param, code=self.status))


def engine_error(e: Exception, request_id: str | None = None) -> APIError:
    """The APIError for an exception from handling a request: bad input 400, engine gone 503, else 500.
    A 503 or 500 names a request id (`request_id`, or a new one) and logs the traceback under it."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e), _field_named(str(e)))
    return internal_error(e, request_id)


def _field_named(message: str) -> str | None:
    """The request field an engine error starts by naming ("max_tokens 30 plus ...", "prompt 0: ...",
    "SamplingParams.n ..."), for the error's `param`; None if it names none."""
    word = re.match(r"(?:SamplingParams\.)?([a-z_]+)", message)
    return word[1] if word and word[1] in _REQUEST_FIELDS else None


_REQUEST_FIELDS = FIELD_NAMES | {"prompt"}


def internal_error(e: BaseException, request_id: str | None = None, where: str = "") -> APIError:
    """A 500 (503 when the engine is gone) whose body names a request id, not the exception."""
    request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
    logger.error("request %s failed%s", request_id, f" on {where}" if where else "", exc_info=e)
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running (shut down or failed); request id {request_id}")
    return APIError(500, f"internal error; request id {request_id} (the server log has the details)")
