"""The memory scenario waits for the gateway's embedding model (``/readyz`` ``retrieval``) before it measures,
bounded, and says so in the result when it gave up; against a small in-process server (no stack)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.harness.client import Target
from bench.harness.context import Context
from bench.harness.result import ScenarioResult
from bench.harness.scenarios import memory


async def _gateway(states: list[str]) -> AsyncIterator[str]:
    """A server whose /readyz reports ``states`` one poll after another, then the last one for ever."""
    async def readyz(_: web.Request) -> web.Response:
        state = states.pop(0) if len(states) > 1 else states[0]
        return web.json_response({"status": "ready", "lanes": ["a"], "retrieval": state})

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def loading_then_ready() -> AsyncIterator[str]:
    async for url in _gateway(["loading", "loading", "loading", "ready"]):
        yield url


@pytest.fixture
async def always_loading() -> AsyncIterator[str]:
    async for url in _gateway(["loading"]):
        yield url


async def test_waits_until_the_model_is_loaded(loading_then_ready: str, tmp_path: Path) -> None:
    async with Target(loading_then_ready) as t:
        res = ScenarioResult("memory")
        assert await memory.wait_retrieval(Context(t, quick=True, out=tmp_path, progress=False), res) == "ready"
    waited = res.metrics["retrieval_wait_s"]["value"]
    assert 1.0 <= waited < 30, waited  # three polls of "loading", half a second apart
    assert not any("gave up" in n for n in res.notes)


async def test_gives_up_at_the_bound_and_says_so(always_loading: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "RETRIEVAL_WAIT_S", (1.0, 1.0))
    async with Target(always_loading) as t:
        res = ScenarioResult("memory")
        assert await memory.wait_retrieval(Context(t, quick=True, out=tmp_path, progress=False), res) == "loading"
    assert res.metrics["retrieval_wait_s"]["value"] >= 1.0
    assert any(n.startswith("gave up waiting for the gateway's embedding model") for n in res.notes), res.notes
