"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Handlers raise :class:`APIError`; the middleware made by :func:`make_error_middleware` turns it,
any aiohttp ``HTTPException`` (404, 405, 413 from ``client_max_size``, ...) and any unexpected
exception (500, generic message; the traceback goes to the server log only) into that shape.
The lanes and the gateway each make one, differing only in where they note the error code
for their access log.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

__all__ = ["HTTP_CODES", "APIError", "Handler", "Middleware", "error_body", "error_response",
           "http_exception_response", "make_error_middleware"]

# HTTP status -> OpenAI error type (the openai client maps statuses to exception classes;
# the type string is what a caller can switch on).
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def _type_for(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class APIError(Exception):
    """An error answer: status, message and the OpenAI fields; ``extra`` lands in the error object."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, retry_after: float | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _type_for(status)
        self.retry_after = retry_after
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code, **self.extra)

    def response(self) -> web.Response:
        return error_response(self.status, self.message, code=self.code, param=self.param, type=self.type,
                              retry_after=self.retry_after, **self.extra)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   type: str | None = None, retry_after: float | None = None,
                   headers: dict[str, str] | None = None, **extra: Any) -> web.Response:
    """The one place an error answer is built."""
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))  # delay-seconds is an integer
    return web.json_response(error_body(message, type or _type_for(status), param, code, **extra), status=status,
                             headers=headers)


def http_exception_response(request: web.Request, e: web.HTTPException) -> web.Response:
    """An aiohttp HTTPException (404, 405, 413, ...) in the OpenAI error shape."""
    message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
    if e.status == 404:
        message = f"no route for {request.method} {request.path}"
    elif e.status == 405:
        message = f"method {request.method} is not allowed on {request.path}"
    elif e.status == 413:
        message = "the request body is too large"
    allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
    return error_response(e.status, message, code=HTTP_CODES.get(e.status), headers=allow)


def make_error_middleware(log: logging.Logger,
                          note: Callable[[web.Request, str, str | None], None]) -> Middleware:
    """The error middleware; ``note(request, code, param)`` records each error answer for the access log."""

    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            note(request, e.code or e.type, e.param)
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:  # redirects and the like are not errors
                raise
            note(request, HTTP_CODES.get(e.status, "http_error"), None)
            return http_exception_response(request, e)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            note(request, "internal_error", None)
            return error_response(500, "internal server error", code="internal_error")

    return error_middleware
