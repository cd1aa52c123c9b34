"""Prometheus metrics of one lane, in a per-app registry (two apps in one test process never mix).

Gauges that describe the engine's state right now (running, waiting, KV usage, prefix-cache
counters) are read from the scheduler and block manager at scrape time, so they are exact
right after a disconnect instead of lagging until some request finishes. Per-request figures
(TTFT, inter-token, end-to-end, tokens, finish reasons) are recorded by the server; per-step
figures (step time, batch tokens, queue time at admission) by the engine loop's callback; a GPU
step's frame profile (engine.step.StepStats: the device computing, copying and waiting on the CPU's
experts, the host computing them and waiting on the device) as one histogram per part, with the resident
experts' share of the routed work and the bytes moved over PCIe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.scheduler import StepReport
    from engine.step import StepStats

__all__ = ["FRAME_PARTS", "LaneMetrics"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_FRAME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12,
                  0.16, 0.25, 0.5, 1, 2.5)
# the frame profile's parts (StepStats fields): total = gpu + pcie + gpu_wait on the device's timeline; the host's
# cpu_experts and cpu_wait run beside them
FRAME_PARTS = (("total", "t_total"), ("gpu", "t_gpu"), ("pcie", "t_pcie"), ("gpu_wait", "t_gpu_wait"),
               ("cpu_experts", "t_cpu_experts"), ("cpu_wait", "t_cpu_wait"))
# the parts a step without its own frame events estimates (StepStats.frame_measured False): the histograms take
# them from measured steps only
ESTIMATED_PARTS = frozenset({"gpu", "pcie"})


@dataclass
class _Live:
    queue_observed: bool = False


class _EngineStateCollector(Collector):
    """Scrape-time view of the scheduler and the KV block manager."""

    def __init__(self, metrics: LaneMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        aeng = self.m.aeng
        running = waiting = 0
        usage = 0.0
        hits = queries = 0
        if aeng is not None:
            sched = aeng.scheduler
            running, waiting = sched.num_running, sched.num_waiting
            usage = sched.blocks.usage
            hits, queries = sched.blocks.hits, sched.blocks.queries
        yield GaugeMetricFamily("strata_requests_running", "Sequences in the running batch", value=running)
        yield GaugeMetricFamily("strata_requests_waiting", "Requests queued for admission", value=waiting)
        yield GaugeMetricFamily("strata_kv_usage_ratio", "Share of KV blocks referenced by sequences (0..1)",
                                value=usage)
        yield CounterMetricFamily("strata_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=hits)
        yield CounterMetricFamily("strata_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=queries)


class LaneMetrics:
    def __init__(self, lane: str) -> None:
        self.lane = lane
        self.registry = CollectorRegistry(auto_describe=True)
        self.aeng: AsyncEngine | None = None
        r = self.registry
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("strata_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("strata_requests", "Finished engine requests by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("strata_request_errors", "Error answers by error code (429 overload, 400 window, ...)",
                              ["code"], registry=r)
        self.preemptions = Counter("strata_preemptions", "Sequences preempted (recomputed later)", registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("strata_inter_token_seconds", "Time between consecutive tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("strata_e2e_request_seconds", "Request arrival to last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue = Histogram("strata_queue_time_seconds", "Submission to first admission into the batch",
                               buckets=_QUEUE_BUCKETS, registry=r)
        self.step = Histogram("strata_step_seconds", "Wall time of one engine step", buckets=_STEP_BUCKETS,
                              registry=r)
        self.batch_tokens = Histogram("strata_batch_tokens", "Tokens in one engine step",
                                      buckets=_BATCH_BUCKETS, registry=r)
        self.last_step = Gauge("strata_last_step_seconds", "The last engine step's frame by part "
                               "(wall = the whole step as the loop saw it)", ["part"], registry=r)
        self.last_step_tokens = Gauge("strata_last_step_tokens", "Tokens in the last engine step", registry=r)
        self.expert_share = Gauge("strata_expert_work_share", "Share of routed-expert token work per device",
                                  ["device"], registry=r)
        self.frame = Histogram("strata_frame_seconds", "A GPU step's frame profile by part: total (the step on the "
                               "GPU) = gpu (computing) + pcie (the CPU experts' inputs and rows copied) + gpu_wait "
                               "(the GPU waiting on the CPU's experts); beside them the host's cpu_experts "
                               "(computing them) and cpu_wait (waiting on the GPU for their inputs)", ["part"],
                               buckets=_FRAME_BUCKETS, registry=r)
        self.resident_hit = Gauge("strata_resident_hit_ratio", "Share of the last GPU step's routed pairs that "
                                  "resident experts computed (1: every expert on the GPU)", registry=r)
        self.pcie_bytes = Counter("strata_pcie_bytes", "Bytes copied over PCIe for the CPU's experts (their "
                                  "inputs and rows)", registry=r)
        self.staged_bytes = Counter("strata_staged_bytes", "Expert weights staged over PCIe", registry=r)
        self.info = Gauge("strata_lane_info", "Lane identity (value 1)", ["lane", "engine_build", "model"],
                          registry=r)
        self.expert_share.labels(device="cpu").set(1.0)  # until a GPU step says otherwise
        self.expert_share.labels(device="gpu").set(0.0)
        for part, _ in FRAME_PARTS:
            self.frame.labels(part=part)  # the series exist before the first GPU step
        for reason in ("stop", "length", "abort"):
            self.requests.labels(finish_reason=reason)  # zero series exist before the first request
        r.register(_EngineStateCollector(self))
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()

    def attach(self, aeng: AsyncEngine, engine_build: str, model: str) -> None:
        self.aeng = aeng
        self.info.labels(lane=self.lane, engine_build=engine_build, model=model).set(1)

    # ------------------------------------------------------------ per request (event loop)
    def submitted(self, rid: str) -> None:
        with self._lock:
            self._live[rid] = _Live()

    def forget(self, rid: str) -> None:
        """A request the engine refused at submission."""
        with self._lock:
            self._live.pop(rid, None)

    def finished(self, rid: str, reason: str | None, prompt_tokens: int, completion_tokens: int,
                 t_arrival: float, t_submit: float, t_first: float | None, t_last: float | None) -> None:
        """Record one engine request (times: time.monotonic(); arrival = the HTTP request's)."""
        with self._lock:
            live = self._live.pop(rid, None)
        if live is not None and not live.queue_observed and t_first is not None:
            # admitted and finished within one step, before the loop callback saw it running
            self.queue.observe(max(0.0, t_first - t_submit - self._last_step_wall))
        self.requests.labels(finish_reason=reason or "abort").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if t_last is not None:
            self.e2e.observe(t_last - t_arrival)

    # ------------------------------------------------------------ per step (engine loop thread)
    _last_step_wall = 0.0

    def _gpu_frame(self, st: StepStats) -> None:
        for part, field in FRAME_PARTS:
            v = float(getattr(st, field))
            if st.frame_measured or part not in ESTIMATED_PARTS:
                self.frame.labels(part=part).observe(v)
            if part != "total":
                self.last_step.labels(part=part).set(v)
        self.resident_hit.set(st.resident_hit_rate)
        self.expert_share.labels(device="gpu").set(st.resident_hit_rate)
        self.expert_share.labels(device="cpu").set(1.0 - st.resident_hit_rate)
        if st.pcie_bytes:
            self.pcie_bytes.inc(st.pcie_bytes)
        if st.staged_bytes:
            self.staged_bytes.inc(st.staged_bytes)

    def on_step(self, report: StepReport) -> None:
        self._last_step_wall = report.wall
        self.step.observe(report.wall)
        self.last_step.labels(part="wall").set(report.wall)
        if report.stats is not None:
            st = report.stats
            self.batch_tokens.observe(st.n_tokens)
            self.last_step_tokens.set(st.n_tokens)
            for part, v in (("total", st.t_total), ("attn", st.t_attn), ("experts", st.t_experts),
                            ("dense", st.t_dense), ("output", st.t_output)):
                self.last_step.labels(part=part).set(v)
            if st.on_gpu:
                self._gpu_frame(st)
        if report.n_preempted:
            self.preemptions.inc(report.n_preempted)
        aeng = self.aeng
        if aeng is None:
            return
        step_start = time.monotonic() - report.wall
        for req in list(aeng.scheduler.running):
            with self._lock:
                live = self._live.get(req.request_id)
                if live is None or live.queue_observed:
                    continue
                live.queue_observed = True
            self.queue.observe(max(0.0, step_start - req.arrival))
