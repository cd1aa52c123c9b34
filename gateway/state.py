"""The per-app state of the gateway (under the typed app key ``GATEWAY``) and the per-request trace."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from pydantic import BaseModel
from sqlalchemy import Engine

from common.http import read_json, validate_body
from gateway.auth import Authenticator, ClientAddress
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.keys import KeyRecord, KeyStore
from gateway.limits import Limiter
from gateway.metrics import GatewayMetrics
from gateway.store import RequestLog

__all__ = ["GATEWAY", "PRINCIPAL", "TRACE", "Gateway", "Trace", "json_body", "new_request_id"]


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


async def json_body(request: web.Request, model: type[M]) -> M:
    """The request's JSON body, at most the gateway's ``max_body_bytes``, as ``model`` (a typed 400 otherwise)."""
    return validate_body(model, await read_json(request, request.app[GATEWAY].config.max_body_bytes))
