"""Errors as the server answers them: OpenAI's `{"error": {...}}` shape with an HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from encdec_engine.engine.async_engine import EngineDeadError
from encdec_engine.entrypoints import protocol as P


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with its HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 499: "client_closed_request",
             500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.TYPES.get(self.status, "error"),
                                                 param=self.param, code=self.status))
        if self.status == 429:
            headers = {"Retry-After": "1", **(headers or {})}
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


def engine_error(e: Exception) -> APIError:
    """The APIError for an exception from handling a request: bad input 400, engine gone 503, else 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine unavailable: {e}")
    return APIError(500, f"internal error: {e}")
