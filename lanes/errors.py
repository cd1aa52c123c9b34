"""The lane's errors: the shared OpenAI shape (common/errors.py) and what the access log learns.

Handlers raise :class:`APIError`; :data:`error_middleware` turns it, aiohttp HTTP exceptions
and unexpected exceptions into ``{"error": {...}}`` answers and notes the code in the
request's :class:`RequestInfo` for the access log.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from common.errors import (
    HTTP_CODES,
    APIError,
    error_body,
    error_response,
    http_exception_response,
    make_error_middleware,
)

__all__ = ["HTTP_CODES", "APIError", "RequestInfo", "begin_request", "error_body", "error_middleware",
           "error_response", "http_exception_response", "request_info"]

log = logging.getLogger("strata.lanes")


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


def _note(request: web.Request, code: str, param: str | None) -> None:
    request_info().error = code + (f" param={param}" if param else "")


error_middleware = make_error_middleware(log, _note)
