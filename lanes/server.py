"""The lane's aiohttp application: an OpenAI-compatible API around one AsyncEngine.

    app = create_app(LaneConfig(port=8101, cores="auto"))
    web.run_app(app)            # or lanes.__main__ (signals, drain)

The engine loads in a worker thread from a ``cleanup_ctx`` so the server answers at once:
``/health`` says 503 "loading" until the model is ready. Generation itself (engine requests,
disconnects, streaming) lives in :mod:`lanes.generation`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.chat_formats import ChatFormat, format_for_architecture
from common.chat_template import ChatTemplateError
from common.cpus import pin_process
from common.http import CLIENT_CLOSED, log_request, make_access_middleware, read_json
from common.prompt import (
    chat_ids,
    check_messages,
    check_text,
    normalize_messages,
    text_ids,
    tokenizer_document,
)
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from lanes.buildinfo import engine_build_id, model_fingerprint
from lanes.config import LaneConfig
from lanes.errors import APIError, RequestInfo, begin_request, error_middleware
from lanes.generation import generate, json_response
from lanes.metrics import LaneMetrics
from lanes.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_body
from lanes.state import STATE, EngineFactory, LaneState

__all__ = ["STATE", "EngineFactory", "LaneState", "create_app", "drain", "open_engine", "pin_process", "step_config"]

log = logging.getLogger("strata.lanes")

_QUIET_PATHS = frozenset({"/health", "/metrics", "/v1/models"})  # polled by the gateway: DEBUG only
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def step_config(config: LaneConfig) -> LaneConfig:
    """``config`` with the step sizes of the device it names (LaneConfig.with_step_defaults): "auto" resolved
    as Engine.open resolves it (a GPU when one is usable), before the engine's GPU plan counts step buffers."""
    if config.device != "auto":
        return config  # "cpu" and "cuda..." take their defaults in LaneConfig itself
    from engine.cuda_backend import resolve_device

    return config.with_step_defaults(resolve_device("auto").kind == "cuda")


def open_engine(config: LaneConfig, cores: list[int] | None) -> Engine:
    """The default engine factory: the configured model (or the embedded default) on `cores`; the GPU plan's
    step buffers hold the largest step the scheduler sends (LaneConfig.step_tokens)."""
    config = step_config(config)
    return Engine.open(config.model, threads=config.engine_threads(cores), cores=cores,
                       kv_tokens=config.kv_tokens, max_model_len=config.max_model_len,
                       block_size=config.block_size, prefill_chunk=config.prefill_chunk,
                       step_tokens=config.step_tokens(),
                       device=config.engine_device(), gpu_budget_gb=config.gpu_budget_gb, placement=config.placement,
                       rope=config.rope_overrides(), kv_type=config.kv_type, kv_hot_tokens=config.kv_hot_tokens,
                       gpu_kv_budget_gb=config.gpu_kv_budget_gb)


# ---------------------------------------------------------------------------------------- app


def create_app(config: LaneConfig, engine_factory: EngineFactory | None = None) -> web.Application:
    """The lane application. ``engine_factory(config, cores)`` replaces :func:`open_engine`
    (tests share one loaded model); an injected factory's engine is not closed by the app."""
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[_access_log_middleware, error_middleware])
    app[STATE] = LaneState(config=config, metrics=LaneMetrics(config.name),
                           engine_factory=engine_factory or open_engine, owns_engine=engine_factory is None)
    app.cleanup_ctx.append(_engine_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/lane", lane_info)
    app.router.add_get("/v1/lane/tokenizer", tokenizer_info)
    app.router.add_get("/metrics", metrics)
    return app


async def _engine_ctx(app: web.Application) -> Any:
    st = app[STATE]
    # not awaited: the server must listen (and say "loading") while the model loads
    st.load_task = asyncio.create_task(_load_engine(st), name=f"lane-{st.config.name}-load")
    yield
    await _stop_engine(st)


def chat_format_of(engine: Engine) -> ChatFormat:
    """The format chat answers are read in: the one the model's template renders, or, where the GGUF
    has no template (or one that cannot be used), the one its architecture writes."""
    try:
        template = engine.chat_template
    except ChatTemplateError:
        template = None
    if template is not None and not template.is_fallback:
        return template.format
    hp = getattr(engine, "hparams", None)
    return format_for_architecture(getattr(hp, "arch", None))


def _warm_up(engine: Engine) -> tuple[str, dict[str, Any] | None, str | None, tuple[bytes, str] | None]:
    """Slow first-use work done in the loading thread, not in the first request."""
    build = engine_build_id()
    try:
        info: dict[str, Any] | None = model_fingerprint(Path(engine.model_path))
    except OSError as e:
        info = {"path": str(engine.model_path), "error": e.strerror or str(e)}
    _ = engine.tokenizer
    try:
        _ = engine.chat_template
        template_error = None
    except ChatTemplateError as e:  # completions still work; chat answers 400
        template_error = str(e)
    md = getattr(getattr(engine, "model_file", None), "metadata", None)
    doc = tokenizer_document(md) if isinstance(md, Mapping) else None  # the gateway counts with it
    # a prefill step and a decode step now (kernels loaded, step buffers grown, the decode graph captured), not in
    # the first request; a failure here is logged and left to the requests, which report their own errors
    try:
        took = engine.warm_up()
        log.info("lane engine warmed up in %.0f ms", 1e3 * took)
    except Exception as e:  # noqa: BLE001 - any engine error; the lane still serves what it can
        log.warning("lane engine warm-up failed: %s: %s", type(e).__name__, e)
    return build, info, template_error, doc


async def _load_engine(st: LaneState) -> None:
    cfg = st.config
    t0 = time.monotonic()
    try:
        cores = cfg.resolved_cores()
        if cores is not None:
            st.prior_affinity = os.sched_getaffinity(0)
            try:
                pin_process(cores)  # before the engine: its threads inherit the mask
            except OSError as e:
                raise RuntimeError(f"cannot pin to cores {cores}: {e.strerror or e}") from None
        st.cores = cores
        engine = await asyncio.to_thread(st.engine_factory, cfg, cores)
        st.engine = engine
        # the step sizes of the device the engine runs on (device "auto"; a model that only the CPU runs)
        cfg = st.config = cfg.with_step_defaults(getattr(getattr(engine, "device", None), "kind", "cpu") == "cuda")
        st.build_id, st.model_info, st.template_error, doc = await asyncio.to_thread(_warm_up, engine)
        st.chat_format = chat_format_of(engine)
        st.tokenizer_doc, st.tokenizer_digest = doc if doc is not None else (None, None)
        loop = asyncio.get_running_loop()
        st.aeng = AsyncEngine(engine, cfg.scheduler, on_step=st.metrics.on_step,
                              on_failure=lambda exc: loop.call_soon_threadsafe(engine_loop_failed, st, exc))
    except Exception as e:
        st.status = "failed"
        st.error = f"{type(e).__name__}: {e}"
        log.error("lane=%s engine failed to load: %s", cfg.name, st.error)
        return
    st.metrics.attach(st.aeng, st.build_id or "", str(engine.model_path))
    st.created = int(time.time())
    if st.status == "loading":
        st.status = "ready"
    log.info("lane=%s ready in %.1fs model=%s n_ctx=%d cores=%s threads=%d build=%s", cfg.name,
             time.monotonic() - t0, engine.model_path, engine.n_ctx, st.cores, engine.threads, st.build_id)


def engine_loop_failed(st: LaneState, exc: BaseException) -> None:
    """On the event loop, after the engine loop failed everything in flight: /health turns 503
    ``failed`` (the gateway stops sending), new requests get 503 ``engine_failed``."""
    if st.status in ("stopped", "failed"):
        return
    st.status = "failed"
    st.error = f"engine loop failed: {type(exc).__name__}: {exc}"
    log.error("lane=%s %s", st.config.name, st.error)
    st.engine_failed.set()


async def _stop_engine(st: LaneState) -> None:
    if st.load_task is not None:
        await st.load_task  # a loading thread cannot be interrupted; wait for it
    st.status = "stopped"
    aeng = st.aeng
    if aeng is not None:
        for run in list(st.runs):
            run.abort_all()
        deadline = time.monotonic() + 5.0
        while aeng.scheduler.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.to_thread(aeng.shutdown)
        st.aeng = None
    if st.engine is not None and st.owns_engine:
        st.engine.close()
    st.engine = None
    if st.prior_affinity is not None:
        try:
            pin_process(sorted(st.prior_affinity))
        except OSError:
            pass


async def drain(app: web.Application, timeout: float | None = None) -> bool:
    """Stop taking generation requests (health 503) and wait for those in flight.

    Returns True when all finished within ``timeout`` (default ``drain_timeout_s``); otherwise
    the rest are aborted (their clients get an error event / 503) and False is returned.
    """
    st = app[STATE]
    if st.status in ("loading", "ready"):
        st.status = "draining"
    timeout = st.config.drain_timeout_s if timeout is None else timeout
    log.info("lane=%s draining: %d request(s) in flight, timeout %.0fs", st.config.name, st.inflight, timeout)
    if st.idle.is_set():  # nothing in flight (wait_for with timeout 0 would report a timeout)
        return True
    try:
        await asyncio.wait_for(st.idle.wait(), timeout)
        return True
    except TimeoutError:
        log.warning("lane=%s drain timeout: aborting %d request(s)", st.config.name, len(st.runs))
        for run in list(st.runs):
            run.abort_all()  # their handlers notice on the next poll and answer 503 / an error event
        try:
            await asyncio.wait_for(st.idle.wait(), 5.0)
        except TimeoutError:
            pass
        return False


# ---------------------------------------------------------------------------------------- middleware


def _begin(request: web.Request) -> RequestInfo:
    xrid = request.headers.get("X-Request-Id", "")
    return begin_request(xrid if _REQUEST_ID.match(xrid) else "")


def _finish(request: web.Request, info: RequestInfo, resp: web.StreamResponse | None, status: int) -> None:
    """One line per request: ids, status, tokens, TTFT, duration. Never prompt or output text."""
    if info.client_gone:
        status = CLIENT_CLOSED
    st = request.app[STATE]
    fields = [f"lane={st.config.name}", f"{request.method} {request.path}", f"status={status}"]
    if info.xrid:
        fields.append(f"xrid={info.xrid}")
    served = getattr(request.protocol, "_request_count", None)  # aiohttp's count of requests on this connection
    if isinstance(served, int):
        fields.append(f"conn={served}")  # 1: a new connection; more: kept alive (a proxy that keeps its pool)
    if info.error:
        fields.append(f"error={info.error}")
        st.metrics.errors.labels(code=info.error.split(" ", 1)[0]).inc()
    fields += [f"{k}={v}" for k, v in info.fields.items()]
    log_request(log, request, fields, time.monotonic() - info.t0, _QUIET_PATHS)


_access_log_middleware = make_access_middleware(_begin, _finish)


# ---------------------------------------------------------------------------------------- helpers


def _state(request: web.Request) -> LaneState:
    return request.app[STATE]


def _unavailable(st: LaneState) -> APIError:
    if st.status == "loading":
        return APIError(503, "the lane is loading its model; retry shortly", code="loading", retry_after=2)
    if st.status == "draining":
        return APIError(503, "the lane is draining and takes no new requests", code="server_draining",
                        retry_after=5)
    if st.status == "failed":
        if st.aeng is None:
            return APIError(503, "the lane's engine failed to load", code="engine_failed")
        return APIError(503, "the lane's engine failed; the lane is restarting", code="engine_failed",
                        retry_after=5)
    return APIError(503, "the lane is shutting down", code="server_stopping")


def _engine_for_text(st: LaneState) -> Engine:
    """The engine for tokenizer-only endpoints (still served while draining)."""
    if st.engine is None or st.status not in ("ready", "draining"):
        raise _unavailable(st)
    return st.engine


def _check_model(st: LaneState, name: str | None) -> None:
    if name and name != st.config.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist; this lane serves "
                       f"{st.config.served_model_name!r}", code="model_not_found", param="model")


async def _render_chat(st: LaneState, engine: Engine, messages: list[dict[str, Any]],
                       add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
    if st.template_error is not None:
        raise APIError(400, f"the model's chat template cannot be used: {st.template_error}",
                       param="messages", code="chat_template_error")
    check_messages(messages)
    try:
        msgs = normalize_messages(messages)
        # off the event loop: a long conversation takes a while to tokenize
        return await asyncio.to_thread(chat_ids, engine.tokenizer, engine.chat_template, msgs, tools,
                                       add_generation_prompt)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages", code="chat_template_error") from None


# ---------------------------------------------------------------------------------------- handlers


async def _generation_entry(request: web.Request, kind: Literal["chat", "completion"]) -> web.StreamResponse:
    st = _state(request)
    if st.status != "ready":
        raise _unavailable(st)
    st.inflight += 1  # counted before the first await, so a drain that starts now waits for us
    st.idle.clear()
    try:
        body = await read_json(request)
        engine = st.engine
        if st.status != "ready" or engine is None:
            raise _unavailable(st)
        if kind == "chat":
            chat = parse_body(ChatRequest, body)
            if chat.additional_properties_default is None:
                chat.additional_properties_default = st.config.additional_properties_default
            chat.native_tool_calls = st.chat_format != "default"
            chat.check()
            _check_model(st, chat.model)
            tools = chat.tools if chat.tool_mode()[0] != "none" else None
            ids = await _render_chat(st, engine, chat.messages, tools=tools)
            return await generate(request, st, "chat", chat, [ids])
        comp = parse_body(CompletionRequest, body)
        comp.check()
        _check_model(st, comp.model)
        prompts = []
        for p in comp.prompts():
            if isinstance(p, str):
                prompts.append(await asyncio.to_thread(text_ids, engine.tokenizer, p))
            else:
                prompts.append(list(p))
        return await generate(request, st, "completion", comp, prompts)
    finally:
        st.inflight -= 1
        if st.inflight == 0:
            st.idle.set()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generation_entry(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generation_entry(request, "completion")


def _model_card(st: LaneState) -> dict[str, Any]:
    return {"id": st.config.served_model_name, "object": "model", "created": st.created, "owned_by": "strata",
            "max_model_len": st.engine.n_ctx if st.engine else None, "lane": st.config.name,
            "engine_build": st.build_id, "tokenizer_digest": st.tokenizer_digest}


async def list_models(request: web.Request) -> web.Response:
    st = _state(request)
    _engine_for_text(st)
    return json_response({"object": "list", "data": [_model_card(st)]})


async def get_model(request: web.Request) -> web.Response:
    st = _state(request)
    _engine_for_text(st)
    _check_model(st, request.match_info["model"])
    return json_response(_model_card(st))


async def tokenize(request: web.Request) -> web.Response:
    st = _state(request)
    engine = _engine_for_text(st)
    req = parse_body(TokenizeRequest, await read_json(request))
    _check_model(st, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of 'prompt' (a string) or 'messages' (a chat)", param="prompt")
    if req.messages is not None:
        check_text(req.tools, "tools", "tools")
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        ids = await _render_chat(st, engine, req.messages, req.add_generation_prompt, tools=tools)
    else:
        ids = await asyncio.to_thread(text_ids, engine.tokenizer, req.prompt or "", req.add_special_tokens)
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.n_ctx})


async def tokenizer_info(request: web.Request) -> web.Response:
    """The model's ``tokenizer.*`` metadata (tokens, merges, chat template ...) as JSON, for a gateway that
    counts prompts itself (common/prompt.py); its SHA-256 is the card's ``tokenizer_digest``."""
    st = _state(request)
    _engine_for_text(st)
    if st.tokenizer_doc is None:
        raise APIError(404, "this lane's engine serves no tokenizer metadata", code="not_found")
    return web.Response(body=st.tokenizer_doc, content_type="application/json",
                        headers={"X-Strata-Tokenizer-Digest": st.tokenizer_digest or ""})


async def detokenize(request: web.Request) -> web.Response:
    st = _state(request)
    engine = _engine_for_text(st)
    req = parse_body(DetokenizeRequest, await read_json(request))
    _check_model(st, req.model)
    vocab = engine.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
    return json_response({"prompt": engine.tokenizer.decode(req.tokens, skip_special=req.skip_special_tokens)})


async def health(request: web.Request) -> web.Response:
    st = _state(request)
    if st.aeng is not None and st.aeng.loop_error is not None:  # its callback may not have run yet
        engine_loop_failed(st, st.aeng.loop_error)
    body: dict[str, Any] = {"status": st.status, "lane": st.config.name}
    if st.status == "ready" and st.aeng is not None:
        sched = st.aeng.scheduler
        body.update(running=sched.num_running, waiting=sched.num_waiting, kv_usage=sched.blocks.usage,
                    inflight=st.inflight)
        return json_response(body)
    if st.status == "draining":
        body["inflight"] = st.inflight
    if st.error:
        body["error"] = st.error
    return json_response(body, status=503)


def _gpu_info(eng: Any) -> dict[str, Any] | None:
    """The GPU a lane's engine runs on (None on the CPU): name, memory, what the model holds there (hybrid
    placement: the budget and how many routed experts the GPU holds)."""
    gpu = getattr(eng, "_gpu", None)
    if gpu is None:
        return None
    mem = gpu.memory()
    hp = eng.hparams
    return {"index": gpu.info.index, "name": gpu.info.name, "total_bytes": gpu.info.total_bytes,
            "weight_bytes": gpu.weight_bytes, "kv_bytes": gpu.kv_bytes, "scratch_bytes": mem["scratch"],
            "gpu_budget_gb": eng.gpu_budget_gb, "hybrid": eng.resident is not None,
            "resident_experts": mem["resident_experts"], "routed_experts": (hp.n_layer - hp.n_dense_lead) * hp.n_expert}


async def lane_info(request: web.Request) -> web.Response:
    st = _state(request)
    eng = st.engine
    return json_response({
        "name": st.config.name,
        "status": st.status,
        "pid": os.getpid(),
        "cores": sorted(os.sched_getaffinity(0)),
        "configured_cores": st.cores,
        "threads": eng.threads if eng else None,
        "gpu": st.config.gpu,
        "device": str(getattr(eng, "device", "cpu")) if eng else st.config.device,
        "gpu_info": _gpu_info(eng),
        "model": st.model_info,
        "engine_build": st.build_id,
        "served_model_name": st.config.served_model_name,
        "chat_format": st.chat_format,  # how chat answers are read (lanes/chat_parsers.py)
        "n_ctx": eng.n_ctx if eng else None,
        "kv_tokens": eng.kv_tokens if eng else None,
        "inflight": st.inflight,
        "uptime_s": round(time.monotonic() - st.started_mono, 3),
        "error": st.error,
        "config": st.config.model_dump(mode="json"),  # no secrets live in a lane config
    })


async def metrics(request: web.Request) -> web.Response:
    st = _state(request)
    body = generate_latest(st.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
