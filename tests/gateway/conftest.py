"""Gateway test fixtures: real lanes (the real default model, one engine per lane) on loopback ports,
the real gateway app in-process on a free port, a real SQLite file per module."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.scheduler import SchedulerConfig
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.keys import KeySpec
from gateway.state import GATEWAY, Gateway
from lanes.config import LaneConfig
from tests.lanes.conftest import Lane
from tests.lanes.conftest import running_lane as serve_lane

KV_TOKENS = 1024  # the test window (n_ctx = min(trained 8192, KV))
ADMIN_KEY = "test-admin-key-0123456789"


@pytest.fixture(scope="session")
def gateway_engines() -> Iterator[tuple[Engine, Engine]]:
    """Two real default-model engines (one per lane: two lanes may generate at the same time)."""
    path = build_default_model(default_model_path())
    engines = (Engine.open(path, threads=1, kv_tokens=KV_TOKENS), Engine.open(path, threads=1, kv_tokens=KV_TOKENS))
    for eng in engines:
        _ = eng.tokenizer, eng.chat_template
    yield engines
    for eng in engines:
        eng.close()


@asynccontextmanager
async def running_lane(name: str, engine: Engine, *, shutdown_timeout: float = 2.0) -> AsyncIterator[Lane]:
    """A real lane around an already loaded engine (the lanes' own test server, tests/lanes/conftest.py)."""
    config = LaneConfig(name=name, port=0, kv_tokens=KV_TOKENS, ping_interval_s=0.2,
                        scheduler=SchedulerConfig(max_num_seqs=16, max_batch_tokens=256))
    async with serve_lane(config, lambda cfg, cores: engine, shutdown_timeout=shutdown_timeout) as lane:
        yield lane


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def lane(gateway_engines: tuple[Engine, Engine]) -> AsyncIterator[Lane]:
    """Lane "a" on the first engine, one per test module."""
    async with running_lane("a", gateway_engines[0]) as a:
        yield a


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def lanes(gateway_engines: tuple[Engine, Engine]) -> AsyncIterator[dict[str, Lane]]:
    """Lanes "a" and "b", one on each engine (two may generate at the same time), one pair per test module."""
    async with running_lane("a", gateway_engines[0]) as a, running_lane("b", gateway_engines[1]) as b:
        yield {"a": a, "b": b}


def lane_entries(lanes: dict[str, Lane]) -> list[dict[str, Any]]:
    """The gateway config's ``lanes`` list for these lanes."""
    return [{"name": n, "url": lane.url} for n, lane in lanes.items()]


@dataclass
class GW:
    app: web.Application
    url: str

    @property
    def state(self) -> Gateway:
        return self.app[GATEWAY]

    def key(self, name: str = "user", **kw: Any) -> str:
        """A new API key (created straight in the gateway's database)."""
        assert self.state.keys is not None
        key, _ = self.state.keys.create(KeySpec(name=name, **kw))
        return key


def gateway_config(tmp: Path, lanes: list[dict[str, Any]], **kw: Any) -> GatewayConfig:
    base: dict[str, Any] = {"port": 0, "host": "127.0.0.1", "lanes": lanes, "db_url": f"sqlite:///{tmp / 'gw.db'}",
                            "health_interval_s": 0.5, "ping_interval_s": 1.0, "key_cache_s": 5.0}
    base.update(kw)
    return GatewayConfig(**base)


@asynccontextmanager
async def running_gateway(config: GatewayConfig, env: Mapping[str, str] | None = None) -> AsyncIterator[GW]:
    app = create_app(config, env={"STRATA_ADMIN_KEY": ADMIN_KEY} if env is None else env)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield GW(app, f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}




