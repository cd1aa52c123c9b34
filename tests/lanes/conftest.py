"""Lane test fixtures: one real default model shared by every app, lanes on real loopback ports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.scheduler import SchedulerConfig
from lanes.config import LaneConfig
from lanes.server import STATE, EngineFactory, create_app

KV_TOKENS = 2048  # the test window (n_ctx = min(trained 8192, KV))


@pytest.fixture(scope="session")
def lane_engine() -> Iterator[Engine]:
    """The real embedded default model, loaded once; apps share it (never two generating at once)."""
    eng = Engine.open(build_default_model(default_model_path()), threads=2, kv_tokens=KV_TOKENS)
    _ = eng.tokenizer, eng.chat_template
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def engine_factory(lane_engine: Engine) -> EngineFactory:
    return lambda config, cores: lane_engine


def lane_config(**kw: Any) -> LaneConfig:
    base: dict[str, Any] = {"port": 0, "kv_tokens": KV_TOKENS, "ping_interval_s": 0.2,
                            "scheduler": SchedulerConfig(max_num_seqs=32, max_batch_tokens=256)}
    base.update(kw)
    return LaneConfig(**base)


@dataclass
class Lane:
    app: web.Application
    url: str  # http://127.0.0.1:PORT

    @property
    def state(self) -> Any:
        return self.app[STATE]


@asynccontextmanager
async def running_lane(config: LaneConfig, factory: EngineFactory | None, *, wait_ready: bool = True,
                       app: web.Application | None = None) -> AsyncIterator[Lane]:
    """A lane app on a free loopback port (a real socket, so real clients and disconnects)."""
    app = app or create_app(config, factory)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    lane = Lane(app, f"http://127.0.0.1:{port}")
    try:
        if wait_ready:
            for _ in range(600):
                if lane.state.status in ("ready", "failed"):
                    break
                await asyncio.sleep(0.05)
            assert lane.state.status == "ready", lane.state.error
        yield lane
    finally:
        await runner.cleanup()


