"""The per-app state of the gateway (under the typed app key ``GATEWAY``) and the per-request trace."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from pydantic import BaseModel
from sqlalchemy import Engine

from common.errors import APIError
from common.http import read_json, validate_body
from gateway.auth import Authenticator, ClientAddress
from gateway.config import GatewayConfig
from gateway.connections import ConnectionGuard
from gateway.dispatch import Dispatcher
from gateway.keys import KeyRecord, KeyStore
from gateway.limits import Limiter
from gateway.metrics import GatewayMetrics
from gateway.store import RequestLog

__all__ = ["GATEWAY", "PRINCIPAL", "TRACE", "Gateway", "Trace", "body_timeout", "check_text", "json_body", "new_request_id",
           "read_body"]


def new_request_id() -> str:
    return "gw-" + secrets.token_hex(12)


@dataclass
class Gateway:
    config: GatewayConfig
    metrics: GatewayMetrics
    dispatcher: Dispatcher
    limiter: Limiter
    admin_key: str | None  # resolved at create_app time; only its hash is kept after startup
    client_address: ClientAddress  # who a request is from, for the failed-authentication limit
    db: Engine | None = None
    keys: KeyStore | None = None
    auth: Authenticator | None = None
    store: RequestLog | None = None
    session: aiohttp.ClientSession | None = None
    connections: ConnectionGuard | None = None  # python -m gateway installs it on its server
    stopping: bool = False  # SIGTERM received: /readyz answers 503


@dataclass
class Trace:
    """What the access log, the metrics and the request log learn about one request."""

    id: str = field(default_factory=new_request_id)
    t0: float = field(default_factory=time.monotonic)
    time: float = field(default_factory=time.time)
    endpoint: str = ""
    key: KeyRecord | None = None
    log_row: bool = False  # an authenticated generation request: it gets a request-log row
    lane: str | None = None
    model: str | None = None
    stream: bool = False
    error_type: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    streamed_chunks: int = 0  # stream chunks with choices sent to the client (a floor on tokens generated)
    ttft_ms: float | None = None
    clamped_from: int | None = None
    clamped_to: int | None = None
    retried: bool = False
    prompt_text: str | None = None
    response_text: str | None = None
    client_gone: bool = False
    memory: str | None = None  # session memory's composition counts (X-Strata-Memory)
    stages: list[tuple[str, float]] | None = None  # (stage, monotonic time) when config.trace_stages is on

    def mark(self, stage: str) -> None:
        if self.stages is not None:
            self.stages.append((stage, time.monotonic()))

    def row(self, status: int, duration_ms: float) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "key_id": self.key.id if self.key else None, "lane": self.lane,
                "model": self.model, "endpoint": self.endpoint, "stream": self.stream,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "ttft_ms": self.ttft_ms, "duration_ms": duration_ms,
                "status": status, "error_type": self.error_type, "clamped_from": self.clamped_from,
                "clamped_to": self.clamped_to, "retried": self.retried, "prompt_text": self.prompt_text,
                "response_text": self.response_text, "memory": self.memory}


GATEWAY = web.AppKey("strata_gateway", Gateway)
TRACE = web.RequestKey("strata_gateway_trace", Trace)
PRINCIPAL = web.RequestKey("strata_gateway_principal", KeyRecord)

M = TypeVar("M", bound=BaseModel)


def _bad_text(value: Any) -> str | None:
    """Where inside ``value`` a string holds a lone UTF-16 surrogate (``[2].content``), else None. JSON may escape
    one (``"\\ud800"``) and header bytes that are not UTF-8 decode to them; no backend, tokenizer or socket can
    encode them, so they are refused at the door, whatever field they are in."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return ""
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if _bad_text(k) is not None:
                return f".{k!a}"
            if (where := _bad_text(v)) is not None:
                return f".{k}{where}"
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (where := _bad_text(v)) is not None:
                return f"[{i}]{where}"
    return None


def check_text(body: Any) -> None:
    """A 400 naming the field when any string in a decoded body (keys included) is not valid Unicode."""
    if isinstance(body, dict):
        for k, v in body.items():
            if _bad_text(k) is not None:
                raise APIError(400, "the request body has a field name that is not valid Unicode (a lone UTF-16 "
                               "surrogate)", code="invalid_text")
            if (where := _bad_text(v)) is not None:
                raise APIError(400, f"invalid {k}: {k}{where} is not valid Unicode text (a lone UTF-16 surrogate)",
                               param=k, code="invalid_text")
    elif (where := _bad_text(body)) is not None:
        raise APIError(400, f"body{where} is not valid Unicode text (a lone UTF-16 surrogate)", code="invalid_text")


async def read_body(request: web.Request) -> Any:
    """The request's JSON body: at most ``max_body_bytes``, within ``body_timeout_s`` (a slow sender gets 408 and
    its connection closed), valid Unicode in every string."""
    cfg = request.app[GATEWAY].config
    try:
        async with asyncio.timeout(cfg.body_timeout_s):
            body = await read_json(request, cfg.max_body_bytes)
    except TimeoutError:
        raise body_timeout(request, cfg.body_timeout_s) from None
    check_text(body)
    return body


def body_timeout(request: web.Request, timeout_s: float) -> APIError:
    """The 408 for a body that did not arrive in time. The connection closes after it: aiohttp closes one whose
    body was not read to its end, once its lingering time (``LINGER_S``, set by ``python -m gateway``) is over."""
    request.app[GATEWAY].metrics.connections_closed.labels(reason="body_timeout").inc()
    return APIError(408, f"the request body did not arrive within {timeout_s:g}s", code="request_timeout")


async def json_body(request: web.Request, model: type[M]) -> M:
    """The request's JSON body (:func:`read_body`) as ``model`` (a typed 400 otherwise)."""
    return validate_body(model, await read_body(request))
