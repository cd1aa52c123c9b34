"""The gateway's aiohttp application: the single public face in front of the lanes.

    app = create_app(load_config("gateway.toml"))
    # python -m gateway runs it (signals, graceful stop); tests use an AppRunner on port 0

Middlewares, outermost first: the access log (one line per request, metrics, the request
log row), the Messages API's error shape on ``/v1/messages*`` (gateway/messages.py), the
OpenAI-shaped error middleware, authentication (``/v1/*``: any key, as ``Authorization:
Bearer`` or ``x-api-key``; ``/v1/admin/*``: an admin key). Background work lives in
``cleanup_ctx``: the database, the request-log writer, the upstream HTTP session, the health
poller and retention.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import make_url

from common.http import CLIENT_CLOSED, log_request, make_access_middleware, validate_body
from gateway.auth import Authenticator, ClientAddress, resolve_admin_key
from gateway.config import REPO_ROOT, GatewayConfig
from gateway.connections import ConnectionGuard, connection_middleware
from gateway.db import open_db, safe_url
from gateway.dispatch import Dispatcher
from gateway.documents.api import RAG, rag_context
from gateway.documents.api import add_routes as add_document_routes
from gateway.errors import ERROR_CODE, APIError, error_middleware
from gateway.journal import Journal
from gateway.keys import KeySpec, KeyStore
from gateway.limits import Limiter
from gateway.messages import add_routes as add_messages_routes
from gateway.messages import messages_error_middleware
from gateway.metrics import GatewayMetrics
from gateway.proxy import chat_completions, completions
from gateway.responses import add_routes as add_responses_routes
from gateway.sessions import MEMORY, memory_context
from gateway.sessions import add_routes as add_session_routes
from gateway.state import GATEWAY, PRINCIPAL, TRACE, Gateway, Trace, json_body
from gateway.store import RequestLog, RequestQuery
from gateway.web import add_routes as add_web_routes

__all__ = ["create_app"]

log = logging.getLogger("strata.gateway")

_QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_RETENTION_EVERY_S = 3600.0


def create_app(config: GatewayConfig, env: Mapping[str, str] | None = None) -> web.Application:
    """The gateway application. Raises ConfigError for a bad admin key source (checked here, before
    anything listens). The database opens when the app starts (``cleanup_ctx``)."""
    admin_key = resolve_admin_key(config, env)
    metrics = GatewayMetrics()
    gw = Gateway(config=config, metrics=metrics, dispatcher=Dispatcher(config, metrics),
                 limiter=Limiter(on_limited=lambda reason: metrics.rate_limited.labels(limit=reason).inc(),
                                 config=config.limits),
                 admin_key=admin_key, client_address=ClientAddress(config.trusted_proxies))
    gw.connections = ConnectionGuard(config, metrics, gw.client_address)
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[_connection_middleware, _access_middleware, messages_error_middleware,
                                       error_middleware, _auth_middleware])
    app[GATEWAY] = gw
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(rag_context(config.rag))  # after _lifecycle: it needs the database
    app.cleanup_ctx.append(memory_context(config.memory, config.rag.embed_model, config.rag.embed_threads,
                                          config.rag.embed_batch))
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/models/{model}", get_model)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics_handler)
    r.add_get("/v1/admin/lanes", admin_lanes)
    r.add_put("/v1/admin/lanes/{name}", admin_set_lane)
    r.add_get("/v1/admin/keys", admin_keys)
    r.add_post("/v1/admin/keys", admin_create_key)
    r.add_delete("/v1/admin/keys/{id}", admin_revoke_key)
    r.add_get("/v1/admin/requests", admin_requests)
    add_document_routes(app)  # /v1/collections..., /v1/embeddings
    add_session_routes(app)  # /v1/sessions...
    add_responses_routes(app)  # /v1/responses... (after _lifecycle: stored responses live in its database)
    add_messages_routes(app)  # /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API)
    add_web_routes(app)  # /, /static/..., /v1/admin/overview
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    cfg = gw.config
    gw.db = await asyncio.to_thread(open_db, cfg.db_url)
    gw.keys = await asyncio.to_thread(KeyStore, gw.db)
    gw.auth = Authenticator(gw.keys, gw.admin_key, cfg.key_cache_s, cfg.log_prompts_default,
                            negative_size=cfg.negative_cache_size, negative_s=cfg.negative_cache_s,
                            fail_limit=cfg.auth_fail_limit, fail_window_s=cfg.auth_fail_window_s,
                            global_fail_limit=cfg.auth_fail_global_limit,
                            on_event=lambda result: gw.metrics.auth_failures.labels(result=result).inc())
    gw.admin_key = None  # only its hash is needed from here on
    gw.store = RequestLog(gw.db, cfg.retention_days, max_queue=cfg.log_queue_max, retry_max_s=cfg.log_retry_max_s,
                          on_drop=lambda reason, n: gw.metrics.log_dropped.labels(reason=reason).inc(n),
                          journal=Journal(journal_dir(cfg)), batch_s=cfg.log_batch_s)
    store = gw.store
    replayed = await asyncio.to_thread(store.replay)  # rows of a gateway that died, before any new one
    if replayed:
        log.warning("request log: %d row(s) from the journal of a gateway that stopped without writing them",
                    replayed)
    gw.metrics.log_queued.set_function(lambda: store.queued)
    gw.store.start()
    # no total timeout: streams are bounded by the gateway's own deadlines
    gw.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                       timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0))
    gw.dispatcher.session = gw.session
    await gw.dispatcher.poll_once()  # know the lanes before the first request
    tasks = [asyncio.create_task(gw.dispatcher.run_polling(), name="gateway-health"),
             asyncio.create_task(_retention(gw), name="gateway-retention")]
    log.info("gateway ready: lanes %s, db %s", ", ".join(f"{lane.name}={lane.url}"
                                                         for lane in gw.dispatcher.lanes.values()),
             safe_url(cfg.db_url))
    yield
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    await gw.dispatcher.tokenizers.close()
    await gw.session.close()
    await asyncio.to_thread(gw.store.close)
    gw.db.dispose()


def journal_dir(cfg: GatewayConfig) -> Path:
    """``log_journal_dir``, else ``request-journal-<port>`` beside a SQLite database file, else under the
    repository's var/ (one per port: two gateways on one machine never share one)."""
    if cfg.log_journal_dir is not None:
        return cfg.log_journal_dir
    # port 0 (tests: any free port) cannot find its journal again after a restart: a directory of its own
    name = f"request-journal-{cfg.port}" if cfg.port else f"request-journal-any-{secrets.token_hex(4)}"
    u = make_url(cfg.db_url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:" and \
            not u.database.startswith("file:"):
        return Path(u.database).resolve().parent / name
    return REPO_ROOT / "var" / name


async def _retention(gw: Gateway) -> None:
    assert gw.store is not None
    while True:
        try:
            n = await asyncio.to_thread(gw.store.purge)
            if n:
                log.info("request log retention: deleted %d row(s) older than %g day(s)", n, gw.config.retention_days)
        except Exception as e:
            log.error("request log retention failed: %s: %s", type(e).__name__, e)
        await asyncio.sleep(_RETENTION_EVERY_S)


# ---------------------------------------------------------------------------------------- middleware


def _endpoint(request: web.Request) -> str:
    """The route (not the raw path) for metrics labels: unknown paths must not grow the label set."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _begin(request: web.Request) -> Trace:
    trace = Trace(endpoint=_endpoint(request))
    if request.app[GATEWAY].config.trace_stages:
        trace.stages = []
    request[TRACE] = trace
    return trace


def _finish(request: web.Request, trace: Trace, resp: web.StreamResponse | None, status: int) -> None:
    """One log line per request (never key material or prompt text), metrics, the request-log row."""
    if resp is not None and not resp.prepared:
        resp.headers.setdefault("X-Request-Id", trace.id)
    if status == CLIENT_CLOSED:  # the handler was cancelled: the client left
        trace.client_gone = True
    if trace.client_gone:
        status = CLIENT_CLOSED
    gw = request.app[GATEWAY]
    dur = time.monotonic() - trace.t0
    error = trace.error_type or request.get(ERROR_CODE)
    trace.error_type = error
    gw.metrics.requests.labels(endpoint=trace.endpoint, lane=trace.lane or "-", status=str(status)).inc()
    gw.metrics.duration.labels(endpoint=trace.endpoint).observe(dur)
    if trace.log_row and gw.store is not None:
        gw.store.record(trace.row(status, round(dur * 1000, 3)))
    fields = [f"id={trace.id}", f"{request.method} {request.path}", f"status={status}"]
    if trace.key is not None:
        fields.append(f"key={trace.key.id}")
    if trace.lane:
        fields.append(f"lane={trace.lane}")
    if error:
        fields.append(f"error={error}")
    if trace.log_row:
        fields += [f"stream={int(trace.stream)}", f"retried={int(trace.retried)}",
                   f"prompt_tokens={trace.prompt_tokens}", f"completion_tokens={trace.completion_tokens}",
                   f"ttft={trace.ttft_ms / 1000:.3f}" if trace.ttft_ms is not None else "ttft=-"]
        if trace.clamped_from is not None:
            fields.append(f"clamp={trace.clamped_from}->{trace.clamped_to}")
    if trace.stages:
        # t0 on the monotonic clock as well: a client on this machine (bench.gateway_overhead) places the stages on its
        # own timeline (both read CLOCK_MONOTONIC)
        fields.append(f"t0={trace.t0:.6f} stages=" +
                      ",".join(f"{name}:{(t - trace.t0) * 1000:.2f}" for name, t in trace.stages))
    log_request(log, request, fields, dur, _QUIET_PATHS)


_access_middleware = make_access_middleware(_begin, _finish)
_connection_middleware = connection_middleware(lambda request: request.app[GATEWAY].connections)


@web.middleware
async def _auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    path = request.path
    needs_admin = path.startswith("/v1/admin/") or (path == "/metrics" and not gw.config.metrics_public)
    if path.startswith("/v1/") or needs_admin:
        assert gw.auth is not None
        address = gw.client_address.of(request.remote, request.headers.get("X-Forwarded-For"))
        authorization = request.headers.get("Authorization")
        if not authorization and request.headers.get("x-api-key"):  # Anthropic-style clients send the key so
            authorization = "Bearer " + request.headers["x-api-key"]
        key = await gw.auth.authenticate(authorization, address)
        request[PRINCIPAL] = key
        request[TRACE].key = key
        if gw.connections is not None:
            gw.connections.keyed(request.protocol)
        if needs_admin and not key.admin:
            raise APIError(403, "this key may not use the admin API", code="insufficient_permissions",
                           type="invalid_request_error")
    return await handler(request)


# ---------------------------------------------------------------------------------------- public handlers


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


def _model_cards(gw: Gateway) -> list[dict[str, Any]]:
    """One card per served model: the window is the smallest among the lanes that take requests for it."""
    cards: dict[str, dict[str, Any]] = {}
    for lane in gw.dispatcher.routable():
        if lane.model is None or lane.n_ctx is None:
            continue
        card = cards.setdefault(lane.model, {"id": lane.model, "object": "model", "created": 0,
                                             "owned_by": "strata", "max_model_len": lane.n_ctx})
        card["max_model_len"] = min(card["max_model_len"], lane.n_ctx)
    return list(cards.values())


async def list_models(request: web.Request) -> web.Response:
    cards = _model_cards(request.app[GATEWAY])
    if not cards:
        raise APIError(503, "no lane is ready; the model list is unknown", code="no_lane_available", retry_after=1)
    return _json({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for card in _model_cards(request.app[GATEWAY]):
        if card["id"] == name:
            return _json(card)
    raise APIError(404, f"the model {name!r} does not exist", code="model_not_found", param="model")


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "alive"})


def _retrieval(app: web.Application) -> str:
    """The embedding model behind document search and memory retrieval: ``ready``, ``loading`` (requests are
    served without it meanwhile: BM25 alone, memory without retrieval) or ``off``. Not part of readiness."""
    for svc in (app.get(RAG), app.get(MEMORY)):
        emb = getattr(svc, "embedder", None)
        if emb is not None:
            return "ready" if emb.ready else "loading"
    return "off"


async def readyz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    ready = [lane.name for lane in gw.dispatcher.routable()]
    retrieval = _retrieval(request.app)
    if gw.stopping or not ready:
        return _json({"status": "stopping" if gw.stopping else "no_lane_ready", "lanes": ready,
                      "retrieval": retrieval}, status=503)
    return _json({"status": "ready", "lanes": ready, "retrieval": retrieval})


async def metrics_handler(request: web.Request) -> web.Response:
    body = generate_latest(request.app[GATEWAY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---------------------------------------------------------------------------------------- admin


class LanePatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    weight: float | None = Field(None, ge=0, le=1e6)
    drain: bool | None = None


async def admin_lanes(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return _json({"object": "list", "data": [lane.describe() for lane in gw.dispatcher.lanes.values()]})


async def admin_set_lane(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    name = request.match_info["name"]
    if name not in gw.dispatcher.lanes:
        raise APIError(404, f"no lane named {name!r} (known: {', '.join(gw.dispatcher.lanes)})",
                       code="lane_not_found")
    patch = await json_body(request, LanePatch)
    lane = gw.dispatcher.set_lane(name, weight=patch.weight, drain=patch.drain)
    assert lane is not None
    return _json(lane.describe())


async def admin_keys(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    assert gw.keys is not None
    keys = await asyncio.to_thread(gw.keys.list)
    return _json({"object": "list", "data": [k.public() for k in keys]})


async def admin_create_key(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    assert gw.keys is not None
    spec = await json_body(request, KeySpec)
    key, rec = await asyncio.to_thread(gw.keys.create, spec, gw.config.log_prompts_default)
    assert gw.auth is not None
    gw.auth.key_created()
    log.info("admin key=%d created key id=%d name=%r admin=%s", request[PRINCIPAL].id, rec.id, rec.name, rec.admin)
    return _json({"key": key, **rec.public()}, status=201)


async def admin_revoke_key(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    assert gw.keys is not None and gw.auth is not None
    try:
        key_id = int(request.match_info["id"])
    except ValueError:
        raise APIError(400, "the key id must be an integer", param="id") from None
    rec = await asyncio.to_thread(gw.keys.revoke, key_id)
    if rec is None:
        raise APIError(404, f"no key with id {key_id}", code="key_not_found")
    gw.auth.forget(key_id)
    log.info("admin key=%d revoked key id=%d", request[PRINCIPAL].id, key_id)
    return _json(rec.public())


async def admin_requests(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    assert gw.store is not None
    q = validate_body(RequestQuery, dict(request.query))
    await gw.store.flush(timeout=2.0)  # read your own writes
    rows = await asyncio.to_thread(gw.store.query, q)
    return _json({"object": "list", "data": rows})
