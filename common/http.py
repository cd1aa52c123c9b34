"""aiohttp helpers shared by the lanes and the gateway: SSE headers, client-gone checks, JSON
bodies, the access-log middleware shape and process logging."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from common.errors import APIError, Handler, Middleware

__all__ = ["CLIENT_CLOSED", "SSE_HEADERS", "client_gone", "log_request", "make_access_middleware", "read_json",
           "setup_logging", "validate_body"]

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # nginx's "client closed request": what the access log reports for a client that left

C = TypeVar("C")
M = TypeVar("M", bound=BaseModel)


def client_gone(request: web.Request) -> bool:
    """The client closed its connection (or it was never there)."""
    t = request.transport
    return t is None or t.is_closing()


async def read_json(request: web.Request, limit: int | None = None) -> Any:
    """The body as JSON: 413 past ``limit`` (checked on Content-Length before reading; the app's
    ``client_max_size`` applies while reading), 400 when empty or malformed."""
    if limit is not None and request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"the request body is {request.content_length} bytes; the limit is {limit}",
                       code="request_too_large")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the request body is larger than the limit of {request.client_max_size} bytes",
                       code="request_too_large") from None
    if not raw:
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, absurd nesting
        msg = f"request body is not valid JSON: {e}" if isinstance(e, json.JSONDecodeError) else \
            "request body is not valid JSON"
        raise APIError(400, msg, code="invalid_json") from None


def validate_body(model: type[M], body: Any) -> M:
    """A decoded JSON body (or query dict) as ``model``; the first problem is a 400 naming its field."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err.get("loc") or ()
        param = str(loc[0]) if loc else None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field (known: {', '.join(model.model_fields)})"
        raise APIError(400, f"invalid {param or 'body'}: {msg}", param=param) from None


def make_access_middleware(begin: Callable[[web.Request], C],
                           finish: Callable[[web.Request, C, web.StreamResponse | None, int], None]) -> Middleware:
    """The access-log middleware: ``begin(request)`` makes the per-request context; ``finish(request,
    ctx, response, status)`` runs once the answer is known (status 500 after an exception,
    :data:`CLIENT_CLOSED` when the handler was cancelled because the client left)."""

    @web.middleware
    async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        ctx = begin(request)
        resp: web.StreamResponse | None = None
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            finish(request, ctx, resp, status)

    return access_middleware


def log_request(log: logging.Logger, request: web.Request, fields: Iterable[str], dur: float,
                quiet_paths: frozenset[str]) -> None:
    """One access-log line: the fields and the duration; polled paths (``quiet_paths``) at DEBUG."""
    line = " ".join([*fields, f"dur={dur:.3f}"])
    log.log(logging.DEBUG if request.path in quiet_paths else logging.INFO, line)


def setup_logging(level: str) -> None:
    """Process logging for a server: stderr, one format; aiohttp's own access lines off (we write ours)."""
    logging.basicConfig(stream=sys.stderr, level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
