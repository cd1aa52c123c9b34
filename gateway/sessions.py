"""HTTP API of sessions (every route per key: another key's session is a 404, never a 403).

    POST   /v1/sessions                {"title", "system", "collections"}  -> 201 the session
    GET    /v1/sessions                ?limit=                             -> the key's sessions, newest activity first
    GET    /v1/sessions/{id}                                               -> the session, its turns and summary
    PATCH  /v1/sessions/{id}           {"title"}                           -> the renamed session
    GET    /v1/sessions/{id}/export                                        -> JSON: the session and its ``turns``
    DELETE /v1/sessions/{id}                                               -> gone: turns, summaries, vectors

Each of them is one of the key's ``session_requests_per_minute`` and holds one of its ``max_concurrent``
slots while it runs (``[limits]``, a key's own values win); turns are added by chat requests, which are
generation requests, and the summaries of old turns are charged to the session's key
(gateway.memory_chat.lane_completer).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.errors import APIError
from gateway.state import GATEWAY, PRINCIPAL, body_timeout, json_body
from memory.config import MemoryConfig
from memory.service import MemoryService
from memory.store import MemoryStore, Session

if TYPE_CHECKING:
    from gateway.documents.embed import Backend, Precision

__all__ = ["MEMORY", "add_routes", "get_memory", "memory_context"]

log = logging.getLogger("strata.memory")

MEMORY = web.AppKey("strata_memory", MemoryService)
_DISABLED = web.AppKey("strata_memory_disabled", str)


def memory_context(cfg: MemoryConfig, embed_model: str, embed_threads: int, embed_batch: int,
                   embed_backend: Backend | None = None, embed_precision: Precision | None = None) -> Any:
    """A cleanup_ctx: the service starts after the gateway's database (append it after the gateway's own).
    The embedding settings are the ``[rag]`` ones; backend and precision None: those of the documents' model
    instance when it exists (one model per process), else the defaults."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        if not cfg.enabled:
            app[_DISABLED] = "session memory is disabled in this gateway's config ([memory] enabled = false)"
            yield
            return
        from gateway.memory_chat import lane_completer

        gw = app[GATEWAY]
        assert gw.db is not None
        try:
            store = await asyncio.to_thread(MemoryStore, gw.db)
        except Exception as e:
            log.error("session memory is off: %s: %s", type(e).__name__, e)
            app[_DISABLED] = "session memory is unavailable on this gateway (its log says why)"
            yield
            return
        embedder = None
        try:
            from gateway.documents.embed import get_embedder

            embedder = await asyncio.to_thread(get_embedder, embed_model, threads=embed_threads,
                                              batch=embed_batch, backend=embed_backend, precision=embed_precision)
        except Exception as e:  # memory still works: summary and recent turns, no retrieval
            log.warning("session memory: no embedding model, older turns are not retrieved: %s: %s",
                        type(e).__name__, e)
        svc = MemoryService(store, cfg, embedder, lane_completer(gw))
        app[MEMORY] = svc
        tasks = [asyncio.create_task(svc.run_sweeper(), name="memory-sweeper")]
        if embedder is not None:
            tasks.append(asyncio.create_task(embedder.warm(), name="memory-embed-warm"))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await svc.drain()
            for t in tasks:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass

    return ctx


def get_memory(request: web.Request) -> MemoryService:
    svc = request.app.get(MEMORY)
    if svc is None:
        raise APIError(503, request.app.get(_DISABLED) or "session memory is not ready", code="memory_unavailable")
    return svc


Handler = Callable[[web.Request], Awaitable[web.Response]]


def _limited(handler: Handler) -> Handler:
    """A session request: a ``max_concurrent`` slot while it runs and one of ``session_requests_per_minute``
    (429 with Retry-After when either is spent)."""

    @functools.wraps(handler)
    async def limited(request: web.Request) -> web.Response:
        limiter = request.app[GATEWAY].limiter
        key = request[PRINCIPAL]
        ticket = limiter.admit(key, generation=False)
        try:
            limiter.rate(key, "session_requests_per_minute", 1, "session requests")
            return await handler(request)
        finally:
            limiter.release(ticket)

    return limited


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/sessions", _limited(create_session))
    r.add_get("/v1/sessions", _limited(list_sessions))
    r.add_get("/v1/sessions/{sid}", _limited(get_session))
    r.add_patch("/v1/sessions/{sid}", _limited(rename_session))
    r.add_get("/v1/sessions/{sid}/export", _limited(export_session))
    r.add_delete("/v1/sessions/{sid}", _limited(delete_session))


def _storable(v: str | None) -> str | None:
    if v is not None and "\x00" in v:  # the databases' text columns cannot hold it
        raise ValueError("must not contain NUL characters")
    return v


class SessionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    title: str | None = Field(None, max_length=256)
    system: str | None = Field(None, max_length=100_000)
    collections: list[str] = Field(default_factory=list, max_length=8)

    storable = field_validator("title", "system")(_storable)


class RenameSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    title: str | None = Field(max_length=256)

    storable = field_validator("title")(_storable)


async def _spec(request: web.Request) -> SessionSpec:
    timeout_s = request.app[GATEWAY].config.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise body_timeout(request, timeout_s) from None
    if not raw.strip():
        return SessionSpec()
    return await json_body(request, SessionSpec)


async def _session(request: web.Request, svc: MemoryService) -> Session:
    sid = request.match_info["sid"]
    s = await svc.session(request[PRINCIPAL].id, sid)
    if s is None:  # another key's session looks exactly like a missing one
        raise APIError(404, f"no session {sid!r}", code="session_not_found", param="session_id")
    return s


async def create_session(request: web.Request) -> web.Response:
    svc = get_memory(request)
    spec = await _spec(request)
    s = await asyncio.to_thread(svc.store.create_session, request[PRINCIPAL].id, title=spec.title,
                                system=spec.system, collections=spec.collections,
                                limit=svc.cfg.max_sessions_per_key)
    if s is None:
        raise APIError(409, f"this key already has {svc.cfg.max_sessions_per_key} sessions; delete some first",
                       code="too_many_sessions")
    return web.json_response(s.public(), status=201)


async def list_sessions(request: web.Request) -> web.Response:
    svc = get_memory(request)
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        raise APIError(400, "invalid limit: expected an integer", param="limit") from None
    if not 1 <= limit <= 1000:
        raise APIError(400, "invalid limit: expected 1 to 1000", param="limit")
    rows = await asyncio.to_thread(svc.store.list_sessions, request[PRINCIPAL].id, limit)
    return web.json_response({"object": "list", "data": [s.public() for s in rows]})


async def _full(svc: MemoryService, s: Session) -> dict[str, Any]:
    ts = await asyncio.to_thread(svc.store.turns, s.pk)
    sm = await asyncio.to_thread(svc.store.summary, s.pk)
    return {**s.public(), "turns": [t.public() for t in ts], "summary": sm.public() if sm is not None else None}


async def get_session(request: web.Request) -> web.Response:
    svc = get_memory(request)
    return web.json_response(await _full(svc, await _session(request, svc)))


async def rename_session(request: web.Request) -> web.Response:
    svc = get_memory(request)
    s = await _session(request, svc)
    spec = await json_body(request, RenameSpec)
    renamed = await asyncio.to_thread(svc.store.rename_session, request[PRINCIPAL].id, s.id, spec.title)
    if renamed is None:  # deleted in between
        raise APIError(404, f"no session {s.id!r}", code="session_not_found", param="session_id")
    return web.json_response(renamed.public())


async def export_session(request: web.Request) -> web.Response:
    svc = get_memory(request)
    s = await _session(request, svc)
    body = {"object": "session.export", "exported": int(time.time()), "session": s.public(), **{
        k: v for k, v in (await _full(svc, s)).items() if k in ("turns", "summary")}}
    return web.json_response(body, headers={"Content-Disposition": f'attachment; filename="{s.id}.json"'})


async def delete_session(request: web.Request) -> web.Response:
    svc = get_memory(request)
    s = await _session(request, svc)
    await svc.delete(request[PRINCIPAL].id, s.id)
    return web.json_response({"id": s.id, "object": "session.deleted", "deleted": True})
