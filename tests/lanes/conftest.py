"""Lane test fixtures: one real default model shared by every app, lanes on real loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.scheduler import SchedulerConfig
from lanes.config import LaneConfig
from lanes.server import STATE, EngineFactory, create_app
from tests.http_helpers import eventually

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
    runner: web.AppRunner  # a test may stop the lane early (cleanup again at the end is a no-op)

    @property
    def state(self) -> Any:
        return self.app[STATE]


@asynccontextmanager
async def running_lane(config: LaneConfig, factory: EngineFactory | None, *, wait_ready: bool = True,
                       app: web.Application | None = None, shutdown_timeout: float = 2.0) -> AsyncIterator[Lane]:
    """A lane app on a free loopback port (a real socket, so real clients and disconnects); the gateway
    tests run their lanes through it too."""
    app = app or create_app(config, factory)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    lane = Lane(app, f"http://127.0.0.1:{port}", runner)
    try:
        if wait_ready:
            await eventually(lambda: lane.state.status, lambda st: st in ("ready", "failed"), 30.0, "the lane loaded")
            assert lane.state.status == "ready", lane.state.error
        yield lane
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def lane(engine_factory: EngineFactory) -> AsyncIterator[Lane]:
    """A lane with the test settings (lane_config()) on the shared engine, one per test module."""
    async with running_lane(lane_config(), engine_factory) as lane:
        yield lane


def engine_steps(lane: Lane) -> int:
    """Engine steps this lane has run (its step histogram's count): progress counted in work, which a busy box
    slows but does not change, where seconds would."""
    for metric in lane.state.metrics.step.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return int(sample.value)
    raise AssertionError("the lane's step histogram has no count")


async def idle_within_steps(lane: Lane, since: int, max_steps: int, what: str, within: float = 120.0) -> int:
    """Wait until the lane runs nothing and holds no KV, then check that at most ``max_steps`` engine steps ran
    since ``since`` (a request left running would have cost its remaining tokens in steps). The wall-clock
    ``within`` only keeps a broken lane from hanging the test. Returns the steps counted."""
    sched = lane.state.aeng.scheduler
    await eventually(lambda: (sched.num_running, sched.num_waiting, sched.blocks.usage),
                     lambda v: v == (0, 0, 0), within, what)
    steps = engine_steps(lane) - since
    assert steps <= max_steps, f"{what}: {steps} engine steps ran first (at most {max_steps} expected)"
    return steps
