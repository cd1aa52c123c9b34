"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Handlers raise :class:`APIError`; :func:`error_middleware` turns it, any aiohttp
``HTTPException`` (404, 405, 413 from ``client_max_size``, ...) and any unexpected exception
(500, generic message; the traceback goes to the server log only) into that shape.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["APIError", "RequestInfo", "begin_request", "error_body", "error_middleware", "error_response", "request_info"]

log = logging.getLogger("strata.lanes")

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


@dataclass
class RequestInfo:
    """What the access log reports about the request being handled (one per handler task)."""

    t0: float = field(default_factory=time.monotonic)
    xrid: str = ""  # the caller's X-Request-Id, when well-formed
    error: str | None = None  # error code of the answer
    fields: dict[str, Any] = field(default_factory=dict)  # id, tokens, ttft, finish ...
    client_gone: bool = False


# A context variable rather than request[...] storage: every aiohttp handler runs in its own task.
_INFO: contextvars.ContextVar[RequestInfo] = contextvars.ContextVar("strata_request_info")


def request_info() -> RequestInfo:
    """The current request's info (a fresh throwaway one outside a request)."""
    try:
        return _INFO.get()
    except LookupError:
        info = RequestInfo()
        _INFO.set(info)
        return info


def begin_request(xrid: str = "") -> RequestInfo:
    info = RequestInfo(xrid=xrid)
    _INFO.set(info)
    return info


class APIError(Exception):
    """An error answer: status, message and the OpenAI fields; ``extra`` lands in the error object."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, retry_after: float | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
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
    etype = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))  # delay-seconds is an integer
    return web.json_response(error_body(message, etype, param, code, **extra), status=status, headers=headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        request_info().error = (e.code or e.type) + (f" param={e.param}" if e.param else "")
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:  # redirects and the like are not errors
            raise
        request_info().error = HTTP_CODES.get(e.status, "http_error")
        return http_exception_response(request, e)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        request_info().error = "internal_error"
        return error_response(500, "internal server error", code="internal_error")
