"""The gateway side of session memory in a chat request: which session, the window fit, the summariser's lane.

A request names its session with the ``session_id`` body field or the ``X-Session-Id`` header.
An id of the form ``sess_...`` (made by ``POST /v1/sessions``) turns memory on: the key's own
session or a 404 ``session_not_found`` (another key's session looks exactly like a missing one).
Any other string keeps its old meaning, a lane-affinity key only.

:func:`fit_memory` composes before the window precheck and hands the composed messages to it
(with the RAG passages when the request has collections), so the precheck counts exactly what the
lane will see: a composition that does not fit is composed again with a smaller budget.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from gateway.dispatch import LaneFailure, LaneRuntime
from gateway.documents.chat import RagContext, fit_passages, query_text
from gateway.documents.chat import compose as rag_compose
from gateway.errors import APIError
from gateway.keys import KeyRecord
from gateway.limits import Reservation
from gateway.state import Gateway
from gateway.tokencount import count_locally
from gateway.window import Kind, WindowPlan, max_tokens_field, precheck
from memory.compose import Composition, estimate_tokens
from memory.service import Complete, Loaded, MemoryService, SummaryDeferred

__all__ = ["SESSION_HEADER", "MemoryContext", "fit_memory", "is_memory_session", "lane_completer", "prepare",
           "session_ref"]

SESSION_HEADER = "X-Session-Id"
_MAX_ATTEMPTS = 4


def session_ref(request: web.Request, body: dict[str, Any]) -> str | None:
    """The request's session id: the body field, else the header; a non-string is a 400."""
    value = body.get("session_id")
    if value is None:
        value = request.headers.get(SESSION_HEADER) or None
    if value is not None and (not isinstance(value, str) or not value or len(value) > 200):
        raise APIError(400, "invalid session_id: expected a non-empty string of at most 200 characters",
                       param="session_id")
    return value


def is_memory_session(ref: str | None) -> bool:
    return ref is not None and ref.startswith("sess_")


@dataclass
class MemoryContext:
    svc: MemoryService
    loaded: Loaded
    system: str | None  # the request's own system message, if any (else the session's)
    new_messages: list[dict[str, Any]]  # the request's other messages: stored as turns with the reply
    comp: Composition | None = None
    stored: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def header(self) -> str:
        return self.comp.header() if self.comp is not None else ""


async def prepare(svc: MemoryService, key_id: int, sid: str, messages: list[Any]) -> MemoryContext:
    session = await svc.session(key_id, sid)
    if session is None:
        raise APIError(404, f"no session {sid!r}", code="session_not_found", param="session_id")
    system: str | None = None
    new: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict):
            raise APIError(400, "invalid messages: every message must be an object", param="messages")
        if m.get("role") == "system" and system is None and isinstance(m.get("content"), str):
            system = m["content"]
        elif m.get("role") != "system":
            new.append(m)
    if not new:
        raise APIError(400, "a session request needs at least one message that is not a system message",
                       param="messages")
    loaded = await svc.load(session, query_text(messages))
    return MemoryContext(svc, loaded, system, new)


def _reserve(cfg_reserve: int, requested: Any, default: int | None, cap: int | None, n_ctx: int) -> int:
    if isinstance(requested, int) and not isinstance(requested, bool) and requested >= 1:
        want = requested
    else:
        want = min(x for x in (default, cfg_reserve, n_ctx // 4) if x is not None)
    return min(want, cap) if cap is not None else want


async def fit_memory(session: aiohttp.ClientSession, lane: LaneRuntime, body: dict[str, Any], kind: Kind,
                     mem: MemoryContext, rag: RagContext | None, *, cap: int | None, min_clamp: int,
                     timeout: float, request_id: str, default: int | None = None) -> WindowPlan:
    """Compose the session into the lane's window beside the RAG passages and ``max_tokens``; sets
    ``body["messages"]`` (and ``mem.comp``) to what the lane gets."""
    n_ctx = lane.n_ctx
    if n_ctx is None:
        raise LaneFailure(lane.name, "status", "the lane's window (max_model_len) is unknown", 503)
    requested = body.get(max_tokens_field(body, kind))
    reserve = _reserve(mem.svc.cfg.generation_reserve, requested, default, cap, n_ctx)
    rag_est = 0
    if rag is not None and rag.passages:
        block = rag_compose([], rag.passages)[0]["content"]
        rag_est = estimate_tokens(block)
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    tools_est = estimate_tokens(json.dumps(tools)) if tools else 0  # rendered into the prompt by the lane
    budget = n_ctx - reserve - rag_est - tools_est - 16
    plan: WindowPlan | None = None
    for attempt in range(_MAX_ATTEMPTS):
        comp = mem.loaded.compose(mem.svc.cfg, mem.system, mem.new_messages, budget)
        mem.comp = comp
        shrinkable = comp.recent > 0 or comp.retrieved > 0
        try:
            if rag is not None:
                rag.messages = comp.messages
                plan = await fit_passages(session, lane, body, kind, rag, cap=cap, min_clamp=min_clamp,
                                          timeout=timeout, request_id=request_id, default=default)
            else:
                body["messages"] = comp.messages
                plan = await precheck(session, lane, body, kind, cap=cap, min_clamp=min_clamp, timeout=timeout,
                                      request_id=request_id, default=default)
        except APIError as e:
            n_prompt = e.extra.get("n_prompt_tokens")
            if e.code != "context_length_exceeded" or not shrinkable or attempt == _MAX_ATTEMPTS - 1 \
                    or not isinstance(n_prompt, int):
                raise
            budget -= max(32, n_prompt + reserve - int(e.extra.get("n_ctx") or n_ctx))
            continue
        over = plan.longest_prompt + reserve - plan.n_ctx
        if over <= 0 or not shrinkable:
            break
        budget -= max(32, over + 16)  # the estimate was low for this text: compose smaller and count again
    assert plan is not None
    if mem.comp is not None:
        mem.svc.composed(mem.loaded, mem.comp)
    return plan


async def _owner(gw: Gateway, key_id: int) -> KeyRecord:
    """The session's key, whose limits a summary is charged to (a fresh read: a revoked key summarises nothing)."""
    if key_id == 0 and gw.auth is not None:
        return gw.auth.admin_record
    rec = await asyncio.to_thread(gw.keys.get, key_id) if gw.keys is not None else None
    if rec is None or rec.revoked is not None:
        raise RuntimeError(f"the session's key {key_id} is revoked or gone")
    return rec


def lane_completer(gw: Gateway) -> Complete:
    """The summariser's lane call: any ready lane, a plain non-streaming chat completion, charged to the session's
    key as its own chat requests are (a request against ``rpm`` and a ``max_concurrent`` slot while it runs; the
    prompt plus ``max_tokens`` reserved in ``tpm``, settled to the lane's usage). A key at a limit defers the summary
    (:class:`SummaryDeferred` with the limit's wait), it does not fail it."""

    async def complete(messages: list[dict[str, Any]], max_tokens: int, temperature: float, key_id: int) -> str:
        try:
            key = await _owner(gw, key_id)
        except RuntimeError:
            gw.metrics.summaries.labels(result="failed").inc()
            raise
        try:
            ticket = gw.limiter.admit(key)
        except APIError as e:
            gw.metrics.summaries.labels(result="deferred").inc()
            raise SummaryDeferred(e.message, e.retry_after or 1.0) from None
        reservation: Reservation | None = None
        used = 0
        try:
            lane = gw.dispatcher.choose(None, set())
            if lane is None or gw.session is None:
                raise RuntimeError("no lane is ready to summarise")
            payload = {"messages": messages}
            prompt = await count_locally(lane, payload)
            if prompt is None:  # an estimate that leans high; the reservation settles to the lane's usage
                prompt = sum(estimate_tokens(m["content"]) + 4 for m in messages)
            try:
                reservation = gw.limiter.reserve(key, prompt, max_tokens)
            except APIError as e:
                gw.metrics.summaries.labels(result="deferred").inc()
                raise SummaryDeferred(e.message, e.retry_after or 1.0) from None
            body = {**payload, "max_tokens": max_tokens, "temperature": temperature}
            gw.dispatcher.begin(lane)
            try:
                async with gw.session.post(lane.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                           headers={"Content-Type": "application/json"},
                                           timeout=aiohttp.ClientTimeout(total=gw.config.request_timeout_s)) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"lane {lane.name} answered {r.status}: {raw[:200]!r}")
            finally:
                gw.dispatcher.end(lane)
            data = json.loads(raw)
            usage = data.get("usage") or {}
            used = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
            gw.metrics.summary_tokens.inc(used)
            content = data["choices"][0]["message"]["content"]
            if not isinstance(content, str):
                raise RuntimeError(f"lane {lane.name} gave no text")
        except SummaryDeferred:
            raise
        except BaseException:
            gw.metrics.summaries.labels(result="failed").inc()
            raise
        finally:
            gw.limiter.release(ticket)
            if reservation is not None:
                gw.limiter.settle(reservation, used)
        gw.metrics.summaries.labels(result="done").inc()
        return content

    return complete
