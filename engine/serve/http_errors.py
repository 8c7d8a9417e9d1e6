"""Every error the HTTP server answers, in OpenAI's shape.

    {"error": {"message": "max_tokens must be an integer >= 1, got 0",
               "type": "invalid_request_error", "param": "max_tokens", "code": 400,
               "limit": "an integer >= 1"}}

`param` names the offending body field (None when no field is at fault),
`code` is the HTTP status, and `limit` (a kvlife extension) says what the
field must satisfy. Unknown routes (404), wrong methods (405, with
``Allow``), a missing or wrong API key (401) and unexpected failures (500)
answer the same shape: `install_error_handlers` covers what Starlette's
router raises, `error_response` everything the routes answer themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.errors import InvalidRequest

log = structlog.get_logger("kvlife.http")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout", 413: "invalid_request_error", 503: "service_unavailable"}


class HTTPError(Exception):
    """An HTTP-level rejection raised inside a route and answered by `error_response`."""

    def __init__(self, status: int, message: str, param: str | None = None, limit: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.limit, self.headers = status, message, param, limit, headers

    @classmethod
    def invalid(cls, exc: InvalidRequest) -> HTTPError:
        """A 400 for a field error (the message already names the field and the limit)."""
        return cls(400, str(exc), exc.field, exc.limit)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, limit=self.limit, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, limit: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status, "limit": limit}}


def error_response(status: int, message: str, *, param: str | None = None, limit: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, limit=limit), status_code=status, headers=headers)


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path!r}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{request.url.path} does not accept {request.method} (allowed: {allowed})"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("http.unexpected_error", path=request.url.path, error=repr(exc))
    return error_response(500, "internal server error (logged by the server)")


def error_handlers() -> dict[Any, Any]:
    """Starlette `exception_handlers`: router 404/405 and any unexpected exception, as JSON."""
    return {HTTPException: _http_exception, Exception: _unexpected}
