"""The per-app state of a lane (one ``LaneState`` under the typed app key ``STATE``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web

from common.chat_formats import ChatFormat
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from lanes.config import LaneConfig
from lanes.metrics import LaneMetrics

if TYPE_CHECKING:
    from lanes.generation import Run

__all__ = ["STATE", "EngineFactory", "LaneState", "Status"]

EngineFactory = Callable[[LaneConfig, list[int] | None], Engine]
Status = Literal["loading", "ready", "draining", "failed", "stopped"]


@dataclass
class LaneState:
    """Everything the handlers share. ``status`` moves loading -> ready -> draining -> stopped,
    or to failed (the model did not load, or the engine loop failed: ``engine_failed`` is set
    and ``python -m lanes`` exits non-zero so that supervisord restarts the lane);
    ``inflight`` counts generation handlers, ``idle`` is set at zero."""

    config: LaneConfig
    metrics: LaneMetrics
    engine_factory: EngineFactory
    owns_engine: bool  # False for an injected factory: its engine is the caller's to close
    status: Status = "loading"
    error: str | None = None
    engine: Engine | None = None
    aeng: AsyncEngine | None = None
    build_id: str | None = None
    model_info: dict[str, Any] | None = None
    template_error: str | None = None
    chat_format: ChatFormat = "default"  # how chat answers are read (lanes/chat_parsers.py)
    tokenizer_doc: bytes | None = None  # the tokenizer.* metadata as JSON (GET /v1/lane/tokenizer), None: not served
    tokenizer_digest: str | None = None  # its SHA-256, in the model card
    cores: list[int] | None = None
    prior_affinity: set[int] | None = None  # restored at shutdown (matters for in-process use)
    created: int = field(default_factory=lambda: int(time.time()))
    started_mono: float = field(default_factory=time.monotonic)
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    runs: set[Run] = field(default_factory=set)  # generation requests with engine work in flight
    load_task: asyncio.Task[None] | None = None
    engine_failed: asyncio.Event = field(default_factory=asyncio.Event)  # the engine loop failed after load

    def __post_init__(self) -> None:
        self.idle.set()


STATE = web.AppKey("strata_lane_state", LaneState)
