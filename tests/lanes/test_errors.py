"""Every error case, one table: status, the OpenAI error shape, type / code / param, headers.

Lanes share the real model: "main" (waiting queue of 0, so a valid request is 429, and a
64 KiB body limit), "loading" (its engine factory blocks), "draining", and "failed" (configured
to pin to a CPU that does not exist).
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from engine.engine import Engine
from engine.scheduler import SchedulerConfig
from lanes.server import EngineFactory, drain
from tests.http_helpers import scrape
from tests.lanes.conftest import KV_TOKENS, Lane, lane_config, running_lane

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hello"}]


@dataclass
class Case:
    name: str
    path: str
    body: Any = None  # JSON-encoded unless raw is given
    raw: bytes | None = None
    method: str = "POST"
    lane: str = "main"
    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more fields expected in the error object
    headers: dict[str, str] = field(default_factory=dict)  # response headers expected


CASES = [
    Case("unknown route", "/v1/nope", method="GET", status=404, code="not_found"),
    Case("wrong method", CHAT, method="GET", status=405, code="method_not_allowed", headers={"Allow": "POST"}),
    Case("body too large", CHAT, raw=b'{"x": "' + b"a" * 100_000 + b'"}', status=413, code="request_too_large"),
    Case("malformed json", CHAT, raw=b'{"messages": [', code="invalid_json"),
    Case("empty body", CHAT, raw=b"", code="invalid_json"),
    Case("not an object", CHAT, body=[1, 2], code="invalid_json"),
    Case("missing messages", CHAT, body={"model": "strata-default"}, param="messages"),
    Case("missing prompt", COMP, body={}, param="prompt"),
    Case("unknown model", CHAT, body={"model": "gpt-9", "messages": MSG}, status=404, code="model_not_found",
         param="model"),
    Case("temperature out of range", CHAT, body={"messages": MSG, "temperature": 5}, param="temperature"),
    Case("temperature not a number", CHAT, body={"messages": MSG, "temperature": "hot"}, param="temperature"),
    Case("top_p zero", COMP, body={"prompt": "x", "top_p": 0}, param="top_p"),
    Case("max_tokens zero", CHAT, body={"messages": MSG, "max_tokens": 0}, param="max_tokens"),
    Case("max_completion_tokens negative", CHAT, body={"messages": MSG, "max_completion_tokens": -1},
         param="max_completion_tokens"),
    Case("n too large", CHAT, body={"messages": MSG, "n": 99}, param="n"),
    Case("too many stop strings", COMP, body={"prompt": "x", "stop": [str(i) for i in range(17)]}, param="stop"),
    Case("top_logprobs without logprobs", CHAT, body={"messages": MSG, "top_logprobs": 2}, param="top_logprobs"),
    Case("top_logprobs too many", CHAT, body={"messages": MSG, "logprobs": True, "top_logprobs": 50},
         param="top_logprobs"),
    Case("tool without a function", CHAT, body={"messages": MSG, "tools": [{"type": "function"}]}, param="tools"),
    Case("logit_bias out of range", COMP, body={"prompt": "x", "logit_bias": {"1": 500}}, param="logit_bias"),
    Case("unknown role", CHAT, body={"messages": [{"role": "wizard", "content": "x"}]}, param="messages",
         code="invalid_role"),
    Case("lone surrogate", CHAT, raw=b'{"messages": [{"role": "user", "content": "a \\udc00 b"}]}',
         param="messages", code="invalid_text"),
    Case("prompt + max_tokens over window", CHAT, body={"messages": MSG, "max_tokens": KV_TOKENS},
         code="context_length_exceeded", param="max_tokens", extra={"n_ctx": KV_TOKENS}),
    Case("prompt alone fills window", COMP, body={"prompt": [504] * KV_TOKENS}, code="context_length_exceeded",
         param="prompt", extra={"n_ctx": KV_TOKENS, "n_prompt_tokens": KV_TOKENS}),
    Case("token id out of vocabulary", COMP, body={"prompt": [10**9]}, param="prompt"),
    Case("chat template rejects a message", CHAT, body={"messages": [{"role": "user", "content": 5}]},
         code="chat_template_error", param="messages"),
    Case("image content part", CHAT, body={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         param="messages"),
    Case("queue full", CHAT, body={"messages": MSG, "max_tokens": 4}, status=429, type="rate_limit_error",
         code="server_overloaded", headers={"Retry-After": "1"}),
    Case("tokenize needs prompt or messages", "/tokenize", body={}, param="prompt"),
    Case("detokenize bad id", "/detokenize", body={"tokens": [-1]}, param="tokens"),
    Case("unexpected exception", "/boom", method="GET", status=500, type="server_error", code="internal_error"),
    Case("loading: generation", CHAT, body={"messages": MSG}, lane="loading", status=503, type="service_unavailable",
         code="loading", headers={"Retry-After": "2"}),
    Case("loading: health", "/health", method="GET", lane="loading", status=503),
    Case("loading: models", "/v1/models", method="GET", lane="loading", status=503, type="service_unavailable",
         code="loading"),
    Case("draining: generation", COMP, body={"prompt": "x"}, lane="draining", status=503,
         type="service_unavailable", code="server_draining"),
    Case("draining: health", "/health", method="GET", lane="draining", status=503),
    Case("failed: generation", CHAT, body={"messages": MSG}, lane="failed", status=503, type="service_unavailable",
         code="engine_failed"),
    Case("failed: health", "/health", method="GET", lane="failed", status=503),
]


async def _boom(request: web.Request) -> web.Response:
    raise RuntimeError("secret internal detail")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def lanes(engine_factory: EngineFactory, lane_engine: Engine) -> AsyncIterator[dict[str, Lane]]:
    from lanes.server import create_app

    release = threading.Event()

    def slow_factory(config: Any, cores: Any) -> Engine:
        release.wait(60)
        return lane_engine

    main_cfg = lane_config(max_body_bytes=64 * 1024, scheduler=SchedulerConfig(max_waiting=0))
    main_app = create_app(main_cfg, engine_factory)
    main_app.router.add_get("/boom", _boom)
    async with (running_lane(main_cfg, None, app=main_app) as main,
                running_lane(lane_config(), engine_factory) as draining,
                running_lane(lane_config(), slow_factory, wait_ready=False) as loading,
                running_lane(lane_config(cores=[100_000]), engine_factory, wait_ready=False) as failed):
        assert await drain(draining.app, timeout=1) is True
        assert failed.state.load_task is not None
        await failed.state.load_task  # pinning to a CPU that does not exist fails the load
        try:
            yield {"main": main, "draining": draining, "loading": loading, "failed": failed}
        finally:
            release.set()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_error_table(case: Case, lanes: dict[str, Lane], session: aiohttp.ClientSession) -> None:
    lane = lanes[case.lane]
    data = case.raw if case.raw is not None else (json.dumps(case.body).encode() if case.body is not None else None)
    async with session.request(case.method, lane.url + case.path, data=data,
                               headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        assert r.status == case.status, text
        assert r.headers["Content-Type"].startswith("application/json")
        for k, v in case.headers.items():
            assert r.headers.get(k) == v, (k, dict(r.headers))
    assert "Traceback" not in text and "secret" not in text
    body = json.loads(text)
    if case.path == "/health":
        assert body["status"] == case.lane
        if case.lane == "failed":
            assert "cannot pin to cores [100000]" in body["error"]
        return
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == case.type
    assert err["code"] == case.code
    assert err["param"] == case.param
    for k, v in case.extra.items():
        assert err[k] == v, (k, err)
    if case.code == "context_length_exceeded":
        assert isinstance(err["n_prompt_tokens"], int) and err["n_prompt_tokens"] > 0


async def test_errors_lose_nothing(lanes: dict[str, Lane], session: aiohttp.ClientSession) -> None:
    """After the whole table the lanes hold no engine work and still answer."""
    st = lanes["main"].state
    assert st.aeng.scheduler.num_running == 0 and st.aeng.scheduler.num_waiting == 0 and st.inflight == 0
    async with session.post(lanes["main"].url + "/tokenize", json={"prompt": "still alive"}) as r:
        assert r.status == 200 and (await r.json())["count"] > 0
    m = await scrape(session, lanes["main"].url)
    assert m['strata_request_errors_total{code="server_overloaded"}'] == 1
    assert m['strata_request_errors_total{code="context_length_exceeded"}'] == 2
