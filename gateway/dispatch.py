"""Which lane serves a request: health polling, weights, drain, affinity, least-outstanding, ejection.

A lane can take a new request when its last health poll said ready, the admin has not
drained it, its weight is above 0 and it is not ejected. Among those:

* a request with an affinity key (``session_id``, else ``user``) goes to the lane with the
  highest weighted rendezvous score ``-weight / ln(u)``, ``u`` a hash of (key, lane) in
  (0, 1): the same key keeps its lane while that lane stays routable, a lane that leaves
  moves only its own keys, and weights split keys in proportion;
* any other request goes to the lane with the fewest requests in flight per unit of weight
  (ties broken at random).

A lane that fails ``eject_after_failures`` requests in a row (connection error, timeout,
5xx, a broken stream) is ejected for ``eject_cooldown_s``; if every ready lane is ejected
the ejections are ignored rather than failing everything (panic mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.config import GatewayConfig, LaneEntry
from gateway.metrics import GatewayMetrics
from gateway.tokencount import LocalCounter, TokenizerCache

__all__ = ["Dispatcher", "LaneFailure", "LaneRuntime", "Passthrough", "connection_problem", "rendezvous_score"]

log = logging.getLogger("strata.gateway")

_MODELS_REFRESH_S = 30.0  # /v1/models is re-read this often while a lane stays ready (and on every return)


class LaneFailure(Exception):
    """A lane could not serve the request: ``kind`` is connect, timeout, status (5xx) or stream. ``message`` may
    reach the client: it never holds an address or an exception's text; ``detail`` (the log's and the admin's
    view) may."""

    def __init__(self, lane: str, kind: str, message: str, status: int | None = None, body: bytes | None = None,
                 headers: dict[str, str] | None = None, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.lane = lane
        self.kind = kind
        self.message = message
        self.detail = f"{message} ({detail})" if detail else message
        self.status = status
        self.body = body
        self.headers = headers or {}


class Passthrough(Exception):
    """A lane's 4xx answer, returned to the client unchanged (never retried)."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        super().__init__(f"lane answered {status}")
        self.status = status
        self.body = body
        self.headers = headers


def connection_problem(e: BaseException) -> str:
    """What went wrong with a lane's connection, in words a client may read (no address, no exception text)."""
    if isinstance(e, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "could not connect"
    if isinstance(e, aiohttp.ServerDisconnectedError | ConnectionResetError):
        return "closed the connection"
    return "the connection failed"


def check_lane_status(lane: str, what: str, status: int, raw: bytes, headers: dict[str, str]) -> None:
    """A lane's 5xx is a LaneFailure (may fail over); its 4xx a Passthrough (never retried)."""
    if status >= 500:
        raise LaneFailure(lane, "status", f"{what} answered {status}", status, raw, headers)
    if status >= 400:
        raise Passthrough(status, raw, headers)


@dataclass
class LaneRuntime:
    name: str
    url: str
    weight: float
    draining: bool = False
    ready: bool = False
    health: str = "unknown"  # the lane's /health status, or "unreachable"
    n_ctx: int | None = None  # the lane's max_model_len, from /v1/models
    model: str | None = None
    engine_build: str | None = None
    in_flight: int = 0
    failures: int = 0  # consecutive request failures
    poll_timeouts: int = 0  # consecutive health polls that timed out
    ejected_mono: float = 0.0  # monotonic time the ejection ends
    last_error: str | None = None
    last_poll: float | None = None  # unix time
    models_mono: float = 0.0  # when /v1/models was last read
    tokenizer_digest: str | None = None  # the card's tokenizer_digest (None: the lane serves no tokenizer)
    counter: LocalCounter | None = None  # that tokenizer, once loaded here (gateway/tokencount.py)

    def ejected(self, now: float) -> bool:
        return self.ejected_mono > now

    def takes_new(self) -> bool:
        return self.ready and not self.draining and self.weight > 0

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        ejected_until = time.time() + (self.ejected_mono - now) if self.ejected(now) else None
        return {"name": self.name, "url": self.url, "ready": self.ready, "health": self.health,
                "ejected_until": ejected_until, "weight": self.weight, "draining": self.draining,
                "in_flight": self.in_flight, "engine_build": self.engine_build, "n_ctx": self.n_ctx,
                "model": self.model, "consecutive_failures": self.failures, "last_error": self.last_error,
                "last_poll": self.last_poll, "local_count": self.counter is not None}


def rendezvous_score(key: str, lane: str, weight: float) -> float:
    digest = hashlib.sha256(f"{key}\x00{lane}".encode("utf-8", "surrogatepass")).digest()
    u = (int.from_bytes(digest[:8], "big") + 1) / (2**64 + 2)  # strictly inside (0, 1)
    return -weight / math.log(u)


class Dispatcher:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.lanes: dict[str, LaneRuntime] = {e.name: self._runtime(e) for e in config.lanes}
        self.session: aiohttp.ClientSession | None = None
        self.tokenizers = TokenizerCache()

    def _runtime(self, e: LaneEntry) -> LaneRuntime:
        self.metrics.lane_weight.labels(lane=e.name).set(e.weight)
        self.metrics.lane_ready.labels(lane=e.name).set(0)
        self.metrics.lane_draining.labels(lane=e.name).set(0)
        self.metrics.in_flight.labels(lane=e.name).set(0)
        return LaneRuntime(name=e.name, url=e.url, weight=e.weight)

    # ------------------------------------------------------------ health polling
    async def poll_lane(self, lane: LaneRuntime) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        ready, health, error, timed_out = False, "unreachable", None, False
        try:
            async with self.session.get(lane.url + "/health", timeout=timeout) as r:
                body = await r.json(content_type=None)
                health = str(body.get("status", r.status)) if isinstance(body, dict) else str(r.status)
                fresh = lane.ready and time.monotonic() - lane.models_mono < _MODELS_REFRESH_S
                if r.status == 200 and fresh:
                    ready = True
                elif r.status == 200:
                    # the window and build: on every (re)entry into ready, then now and then
                    async with self.session.get(lane.url + "/v1/models", timeout=timeout) as m:
                        models = await m.json(content_type=None)
                        card = models["data"][0] if m.status == 200 else None
                    n_ctx = card.get("max_model_len") if isinstance(card, dict) else None
                    if isinstance(n_ctx, int) and n_ctx > 0:
                        lane.n_ctx, lane.model = n_ctx, card.get("id")
                        lane.engine_build = card.get("engine_build")
                        digest = card.get("tokenizer_digest")
                        lane.tokenizer_digest = digest if isinstance(digest, str) and digest else None
                        lane.models_mono = time.monotonic()
                        ready = True
                    else:
                        error = f"/v1/models gave no max_model_len (status {m.status})"
                elif isinstance(body, dict) and body.get("error"):
                    error = str(body["error"])[:200]
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"[:200]
            timed_out = isinstance(e, TimeoutError)
        lane.last_poll = time.time()
        lane.poll_timeouts = lane.poll_timeouts + 1 if timed_out else 0
        if timed_out and lane.ready and lane.poll_timeouts < self.config.health_timeouts_to_unready:
            # a slow answer from a lane that was ready: keep it until the timeouts repeat
            log.info("lane=%s health poll timed out (%d of %d before it leaves)", lane.name, lane.poll_timeouts,
                     self.config.health_timeouts_to_unready)
            lane.last_error = error
            return
        if ready != lane.ready or health != lane.health:
            level = logging.INFO if ready else logging.WARNING
            log.log(level, "lane=%s %s health=%s n_ctx=%s build=%s%s", lane.name, "ready" if ready else "not ready",
                    health, lane.n_ctx, lane.engine_build, f" error={error}" if error else "")
        lane.ready, lane.health = ready, health
        if error:
            lane.last_error = error
        self.metrics.lane_ready.labels(lane=lane.name).set(1 if ready else 0)
        if self.config.count_locally:
            self.tokenizers.attach(lane, self.session)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self.poll_lane(lane) for lane in self.lanes.values()))

    async def run_polling(self) -> None:
        """Poll every ``health_interval_s`` (the app polled once already before serving)."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            with contextlib.suppress(Exception):  # a poll never kills the poller
                await self.poll_once()

    # ------------------------------------------------------------ choice
    def routable(self, model: str | None = None) -> list[LaneRuntime]:
        """Lanes that take new requests (for ``model``, when given), ejections ignored when all are ejected."""
        now = time.monotonic()
        cands = [lane for lane in self.lanes.values() if lane.takes_new() and (model is None or lane.model == model)]
        healthy = [lane for lane in cands if not lane.ejected(now)]
        return healthy or cands

    def choose(self, affinity: str | None, exclude: set[str], model: str | None = None) -> LaneRuntime | None:
        cands = [lane for lane in self.routable(model) if lane.name not in exclude]
        if not cands:
            return None
        if affinity:
            return max(cands, key=lambda lane: rendezvous_score(affinity, lane.name, lane.weight))
        best = min(lane.in_flight / lane.weight for lane in cands)
        return random.choice([lane for lane in cands if lane.in_flight / lane.weight == best])

    # ------------------------------------------------------------ outcomes
    def begin(self, lane: LaneRuntime) -> None:
        lane.in_flight += 1
        self.metrics.in_flight.labels(lane=lane.name).set(lane.in_flight)

    def end(self, lane: LaneRuntime) -> None:
        lane.in_flight -= 1
        self.metrics.in_flight.labels(lane=lane.name).set(lane.in_flight)

    def succeeded(self, lane: LaneRuntime) -> None:
        lane.failures = 0

    def failed(self, lane: LaneRuntime, kind: str, message: str) -> None:
        lane.failures += 1
        lane.last_error = message[:200]
        self.metrics.upstream_failures.labels(lane=lane.name, kind=kind).inc()
        if lane.failures >= self.config.eject_after_failures:
            lane.failures = 0
            lane.ejected_mono = time.monotonic() + self.config.eject_cooldown_s
            self.metrics.ejections.labels(lane=lane.name).inc()
            log.warning("lane=%s ejected for %.0fs after %d consecutive failures (last: %s)", lane.name,
                        self.config.eject_cooldown_s, self.config.eject_after_failures, lane.last_error)

    # ------------------------------------------------------------ admin
    def set_lane(self, name: str, weight: float | None = None, drain: bool | None = None) -> LaneRuntime | None:
        lane = self.lanes.get(name)
        if lane is None:
            return None
        if weight is not None:
            lane.weight = weight
            self.metrics.lane_weight.labels(lane=name).set(weight)
        if drain is not None:
            lane.draining = drain
            self.metrics.lane_draining.labels(lane=name).set(1 if drain else 0)
        log.info("lane=%s admin set weight=%s draining=%s (in flight %d)", name, lane.weight, lane.draining,
                 lane.in_flight)
        return lane
