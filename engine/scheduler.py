"""Continuous batching: requests join and leave the running batch at every step.

One `step()`:
  1. apply queued aborts (their blocks are free before this step's forward pass);
  2. decode: one token for every running sequence that has finished its prompt;
     when blocks run out, preempt the newest running sequence (free its blocks,
     requeue it; it is recomputed later, mostly from the prefix cache);
  3. admit waiting requests (FCFS), reusing cached prefix blocks;
  4. prefill chunks for sequences still in their prompt, shortest remaining first, under
     the per-step token budget: a long prompt never holds up a short one for long;
  5. one C forward step over the whole batch; sample the rows that reached the end
     of their known tokens (when every such row is plain greedy, the step returns the engine's
     own greedy picks instead of logits: see device_pick_ok); detokenise, check stops, finish
     and free.

Overlap (default on for a GPU engine, off on the CPU; ``STRATA_OVERLAP`` overrides): a step whose rows are all
plain greedy decodes is launched (``Engine.launch``), and while it runs the next step is launched with
each id read on the device from its pick (``token_src``), before its ids reach the host, when the plan
cannot depend on them (nothing queued, aborted or waiting; stops by count planned exactly; no
preemption). A row that stops on its id wastes that one launched token (dropped at the wait). Each
``step()`` still returns one step's outputs, at that step's wait: no added latency.

The scheduler is driven by one thread (the engine loop); `add` and `abort` may be
called from any thread: they go through a locked inbox.

Per-step Python work does not grow with context length: a request keeps ONE token list
(prompt, then output, appended in place) and the chain digests of its full blocks, extended
only when a block completes; a step touches only the tokens it computes.

Failure: if `step()` raises, the driver calls `fail_all()`: every running, waiting and queued
request ends with an error output, and the scheduler refuses new work (`EngineFailedError`).
A step whose plan is inconsistent (a chunk of n <= 0 tokens, a chunk past the known tokens)
is refused with `SchedulerError` before anything is computed.

Test-only fault injection: the environment variable ``STRATA_TEST_FAULT`` (read once per
scheduler) makes a step raise on purpose, e.g. ``sample_raise_after_n_steps:3`` (the 4th
step that samples raises after its forward pass) or ``detok_raise_after_n_steps:N``. Tests
set it to prove the failure path through a real lane; nothing else may.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from engine.block_manager import BlockManager, KVCapacityError, extend_digests
from engine.constraints import Constraint, GrammarCompiler, apply_mask, mask_words
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling import Sampler, SamplingParams
from engine.step import StepEngine, StepStats

log = logging.getLogger("strata.engine")

FAULT_ENV = "STRATA_TEST_FAULT"
DEVICE_GREEDY_ENV = "STRATA_DEVICE_GREEDY"
OVERLAP_ENV = "STRATA_OVERLAP"
_FAULT_KINDS = ("sample_raise_after_n_steps", "detok_raise_after_n_steps")


class OverloadedError(RuntimeError):
    """The waiting queue is full; the server maps this to 429."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineFailedError(RuntimeError):
    """The engine loop failed: everything in flight was failed and no new request is taken."""


class SchedulerError(RuntimeError):
    """The scheduler refused an inconsistent step (a bug, never bad input): nothing was computed."""


class InjectedFault(RuntimeError):
    """Raised on purpose by the test-only ``STRATA_TEST_FAULT`` switch."""


def device_pick_ok(p: SamplingParams, constrained: bool) -> bool:
    """Whether a row's token is the plain argmax of its raw logits, so that the engine may pick it
    in C or on the GPU (``Engine.forward(greedy=True)``) instead of returning the logits. The
    sampler takes the argmax of the row for ``temperature == 0`` or ``top_k == 1`` (no random
    draw; top_p / min_p do not change an argmax); what disqualifies a row is anything that reads
    or rewrites the logits: ``logit_bias``, repetition / presence / frequency penalties (the
    argmax of the rewritten row), ``logprobs`` (reported from the raw row) and a grammar (its mask
    is applied to the row first). Stop strings, ``stop_token_ids``, ``ignore_eos``, ``max_tokens``
    and ``seed`` act after the pick (or not at all on a greedy row) and do not disqualify."""
    return (p.greedy or p.top_k == 1) and not p.rewrites_row and p.logprobs is None and not constrained


def parse_fault(value: str | None) -> tuple[str, int] | None:
    """``"kind:N"`` -> (kind, N); None when unset. A malformed value is an error, not ignored."""
    if not value:
        return None
    kind, sep, n = value.partition(":")
    if kind not in _FAULT_KINDS or not sep or not n.isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r}: expected one of {', '.join(_FAULT_KINDS)} followed by ':N'")
    return kind, int(n)


class SchedulerConfig(BaseModel):
    max_num_seqs: int = Field(64, ge=1, description="running sequences per step")
    max_batch_tokens: int = Field(256, ge=1, description="tokens per step (decode + prefill chunks)")
    max_waiting: int = Field(256, ge=0, description="requests in the waiting queue")
    max_waiting_tokens: int = Field(262_144, ge=1, description="prompt tokens in the waiting queue")
    prefix_cache: bool = True
    replace_bytes_per_step: int = Field(0, ge=0, description="hybrid placement: expert bytes moved onto the GPU "
                                        "between steps by online re-placement (Engine.replace_experts; 0: off)")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None


@dataclass
class RequestOutput:
    """What one step produced for one request (a streaming delta)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    stop_reason: str | int | None = None  # what ended a "stop": the stop string or stop token id (None: EOS/grammar)


def _table(blocks: Sequence[int] = ()) -> array[int]:
    return array("i", blocks)


# A request's place: queued (never admitted yet: counted against max_waiting), running,
# preempted (back in the waiting queue for recompute: no longer counted), done.
State = Literal["queued", "running", "preempted", "done"]


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # the prompt, then every accepted output token (appended in place)
    n_prompt: int
    params: SamplingParams
    arrival: float
    detok: IncrementalDetokenizer | None
    rng: np.random.Generator
    digests: list[bytes] = field(default_factory=list)  # chain digests of token_ids' full blocks
    blocks: array[int] = field(default_factory=_table)  # block table; int32, so a step copies it as bytes
    n_computed: int = 0  # tokens of token_ids whose K/V are in the cache
    cached_tokens: int = -1  # prefix-cache hit at first admission
    first_token_time: float | None = None
    preemptions: int = 0
    finish_reason: str | None = None
    state: State = "queued"
    # the same tokens as int64, for requests with penalties only: the sampler gets O(1) views
    # of prompt and output instead of converting two Python lists every step
    history: np.ndarray | None = None
    # grammar state of a constrained request (params.grammar): it has consumed exactly the
    # output tokens, so a preemption (recompute of the same tokens) leaves it valid
    constraint: Constraint | None = None

    @property
    def n_total(self) -> int:
        return len(self.token_ids)

    @property
    def n_output(self) -> int:
        return len(self.token_ids) - self.n_prompt

    @property
    def prompt_ids(self) -> list[int]:
        """A copy of the prompt (penalties, tests); the step itself never copies."""
        return self.token_ids[: self.n_prompt]

    @property
    def output_ids(self) -> list[int]:
        """A copy of the output so far."""
        return self.token_ids[self.n_prompt :]


@dataclass
class StepReport:
    """Per-step figures for metrics and logs."""

    stats: StepStats | None
    n_decode: int
    n_prefill: int
    n_running: int
    n_waiting: int
    n_preempted: int
    kv_usage: float
    wall: float
    expert_hist: np.ndarray | None = None


_NO_IDS: list[int] = []


@dataclass(eq=False)
class _Flight:
    """A launched decode step (Engine.launch) not yet waited: its rows in batch order, the position
    each computes, and what its report needs."""

    ticket: int
    rows: list[Request]
    pos: list[int]
    hist: np.ndarray | None


class Scheduler:
    def __init__(self, engine: StepEngine, config: SchedulerConfig | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.blocks: BlockManager = engine.blocks
        self._cache = self.config.prefix_cache and self.blocks.prefix_cache
        self.sampler = Sampler()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: set[str] = set()
        self._n_queued = 0  # requests in state "queued" (changed only by _move)
        self._queued_tokens = 0  # their prompt tokens
        self._failed: str | None = None
        self._eos: set[int] = set()
        try:
            self._eos = set(engine.tokenizer.eot_ids)
        except Exception:  # a model file without a tokenizer: only explicit stop ids
            self._eos = set()
        self.last_report: StepReport | None = None
        env = os.environ if environ is None else environ
        self.fault = parse_fault(env.get(FAULT_ENV))
        # steps whose sampled rows are all plain greedy take the engine's greedy pick (no logits copied
        # back); STRATA_DEVICE_GREEDY=0: every step returns logits and samples them here, as before
        self.device_greedy = env.get(DEVICE_GREEDY_ENV, "1").strip() != "0"
        # overlap: steps of plain greedy decodes are launched, and the next one is launched (its ids the
        # previous picks, on the device) before the previous is waited, so the host's work runs while the GPU
        # computes. Default on for a GPU engine: on an H200 (bench model) scheduler decode goes 354.7 -> 373.0
        # tok/s at 1 sequence, 1,077 -> 1,120 at 8, 2,794 -> 2,894 at 32 (docs/gpu-runs.md). Default off on the CPU, where a launch is the whole step (the same tokens; a
        # stop on an id costs a step). STRATA_OVERLAP=0 / 1 overrides either default.
        default_overlap = "1" if engine.device.kind == "cuda" else "0"
        self.overlap = self.device_greedy and env.get(OVERLAP_ENV, default_overlap).strip() == "1"
        self._flight: _Flight | None = None
        self._fault_steps = 0
        self._mask_pool: ThreadPoolExecutor | None = None  # computes grammar masks during the C step

    # ------------------------------------------------------------ API (any thread)
    def add(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; raises KVCapacityError if it can never fit, OverloadedError if full,
        EngineFailedError once the engine loop has failed."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("empty prompt")
        vocab = self.engine.hparams.n_vocab
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token id out of range [0, {vocab})")
        n_ctx = self.engine.n_ctx
        if len(ids) + 1 > n_ctx:
            raise KVCapacityError(
                f"prompt of {len(ids)} tokens leaves no room in the context window of {n_ctx} tokens "
                f"(KV cache of {self.engine.kv_tokens} tokens)"
            )
        rid = request_id or uuid.uuid4().hex
        detok = None
        if self.engine.has_tokenizer:
            detok = IncrementalDetokenizer(self.engine.tokenizer, params.stop, params.skip_special_tokens)
        rng = params.make_rng()  # seeded: reproducible whatever else is in the batch
        req = Request(rid, ids, len(ids), params, time.monotonic(), detok, rng)
        if params.grammar is not None:  # GrammarError (a ValueError) if it does not compile
            req.constraint = GrammarCompiler.for_tokenizer(self.engine.tokenizer).matcher(params.grammar)
        vocab_bias = [t for t in params.logit_bias if t >= vocab]
        if vocab_bias:
            raise ValueError(f"logit_bias token id {vocab_bias[0]} out of range [0, {vocab})")
        if params.has_penalties:
            req.history = np.zeros(max(2 * len(ids), 64), dtype=np.int64)
            req.history[: len(ids)] = ids
        if self._cache:
            extend_digests(req.digests, ids, self.blocks.block_size)  # once, in the caller's thread
        with self._lock:
            if self._failed is not None:
                raise EngineFailedError(self._failed)
            c = self.config
            if self._n_queued >= c.max_waiting or self._queued_tokens + len(ids) > c.max_waiting_tokens:
                raise OverloadedError(
                    f"server overloaded: {self._n_queued} requests ({self._queued_tokens} prompt tokens) waiting"
                )
            self._n_queued += 1
            self._queued_tokens += len(ids)
            self._inbox.append(req)
        return rid

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.running or self.waiting or self._inbox or self._aborts or self._flight is not None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    @property
    def queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) counted against max_waiting / max_waiting_tokens."""
        with self._lock:
            return self._n_queued, self._queued_tokens

    @property
    def failed(self) -> str | None:
        """Why the scheduler was failed (``fail_all``), or None."""
        return self._failed

    # ------------------------------------------------------------ the one state change
    def _move(self, req: Request, state: State) -> None:
        """Every change of a request's state goes through here, so the waiting-queue counters
        change exactly once per request: when it leaves "queued" (first admission, abort,
        failure), whatever happens to it afterwards (preemption, abort while preempted)."""
        if req.state == "queued" and state != "queued":
            with self._lock:
                self._n_queued -= 1
                self._queued_tokens -= req.n_prompt
        req.state = state

    # ------------------------------------------------------------ the step (loop thread)
    def step(self) -> list[RequestOutput]:
        if self._failed is not None:
            raise EngineFailedError(self._failed)
        t0 = time.monotonic()
        outputs: list[RequestOutput] = []
        self._drain_inbox(outputs)  # an abort of a request in flight: its blocks are free (see _wait_flight)
        if self._flight is not None:  # a launched step: maybe launch the next, then wait for this one
            report = StepReport(None, 0, 0, len(self.running), len(self.waiting), 0, self.blocks.usage, 0.0)
            self._overlap(outputs, report)
        else:
            batch, n_preempted = self._schedule(outputs)
            report = StepReport(None, 0, 0, len(self.running), len(self.waiting), n_preempted, self.blocks.usage, 0.0)
            if batch and self._launchable(batch):
                self._check_plan(batch)
                self._launch(batch, outputs)
                if self._flight is not None:  # else the launch failed and its requests were failed
                    self._overlap(outputs, report)
            elif batch:
                self._run(batch, outputs, report)
        if self.config.replace_bytes_per_step and report.expert_hist is not None:
            # the step's routing into the engine's online statistics; experts move between steps, bounded
            self.engine.replace_experts(report.expert_hist, self.config.replace_bytes_per_step)
        report.n_running, report.n_waiting = len(self.running), len(self.waiting)
        report.kv_usage = self.blocks.usage
        report.wall = time.monotonic() - t0
        self.last_report = report
        return outputs

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Fail every request (running, waiting, not yet seen) with ``reason`` and refuse new
        ones from now on; returns their final outputs. Called by the driver after ``step``
        raised: the scheduler's state may be half-updated, so nothing is computed any more."""
        with self._lock:
            self._failed = reason
            inbox, self._inbox = self._inbox, []
            self._aborts.clear()
        if self._flight is not None:  # the engine must not keep it: wait for it and drop its picks
            self._drop(self._flight)
        reqs = [*self.running, *self.waiting, *inbox]
        self.running = []
        self.waiting.clear()
        outputs = []
        for req in reqs:
            try:
                self.blocks.release(req.blocks)
            except ValueError:  # half-updated by the failed step; the arena is not used again
                pass
            req.blocks = _table()
            outputs.append(self._finish(req, "abort", error=reason))
        return outputs

    def _drain_inbox(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        self.waiting.extend(inbox)
        if not aborts:
            return
        for req in [r for r in self.waiting if r.request_id in aborts]:
            self.waiting.remove(req)
            outputs.append(self._finish(req, "abort"))
        for req in [r for r in self.running if r.request_id in aborts]:
            self.running.remove(req)
            outputs.append(self._finish(req, "abort"))

    def _ensure_blocks(self, req: Request, n_tokens: int) -> bool:
        need = -(-n_tokens // self.blocks.block_size) - len(req.blocks)
        if need <= 0:
            return True
        got = self.blocks.allocate(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and requeue it at the front for recompute."""
        self.running.remove(req)
        self.blocks.release(req.blocks)
        req.blocks = _table()
        req.n_computed = 0
        req.preemptions += 1
        self._move(req, "preempted")
        self.waiting.appendleft(req)

    @staticmethod
    def _decoding(req: Request) -> bool:
        return req.n_total > req.n_prompt and req.n_computed == req.n_total - 1

    def _victim(self, scheduled: set[str], keep: Request) -> Request | None:
        """The newest running request not already in this step's batch."""
        for r in reversed(self.running):
            if r is not keep and r.request_id not in scheduled:
                return r
        return None

    def _grow(self, req: Request, n_tokens: int, scheduled: set[str]) -> tuple[bool, int]:
        """Blocks for n_tokens, preempting newer requests if needed; (ok, preemptions)."""
        n = 0
        while not self._ensure_blocks(req, n_tokens):
            victim = self._victim(scheduled, req)
            if victim is None or self.running.index(victim) < self.running.index(req):
                return False, n
            self._preempt(victim)
            n += 1
        return True, n

    def _schedule(self, outputs: list[RequestOutput]) -> tuple[list[tuple[Request, int]], int]:
        budget = self.config.max_batch_tokens
        batch: list[tuple[Request, int]] = []
        scheduled: set[str] = set()
        preempted = 0
        # 1. decode one token for each running sequence, oldest first
        for req in list(self.running):
            if budget == 0 or req.state != "running" or not self._decoding(req):
                continue
            ok, n = self._grow(req, req.n_total, scheduled)
            preempted += n
            if ok:
                batch.append((req, 1))
                scheduled.add(req.request_id)
                budget -= 1
            elif len(self.running) == 1:  # alone and the whole arena is used: cannot grow
                self.running.remove(req)
                outputs.append(self._finish(req, "length"))
            else:  # older requests hold the blocks: wait for them (recompute later)
                self._preempt(req)
                preempted += 1
        # 2. admit waiting requests (FCFS), reusing cached prefix blocks
        bs = self.blocks.block_size
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.waiting[0]
            ids = req.token_ids
            prefix = self.blocks.take_prefix(ids, req.digests) if self._cache else []
            n_cached = min(len(prefix) * bs, len(ids) - 1)
            req.blocks, req.n_computed = _table(prefix), n_cached
            if not self._ensure_blocks(req, min(len(ids), n_cached + budget)):
                self.blocks.release(req.blocks)
                req.blocks, req.n_computed = _table(), 0
                break
            self.waiting.popleft()
            if req.cached_tokens < 0:  # first admission (not a recompute after preemption)
                req.cached_tokens = n_cached
            self._move(req, "running")
            self.running.append(req)
        # 3. prefill chunks, shortest remaining first: a short prompt is never stuck behind a long one
        prefilling = sorted((r for r in self.running if not self._decoding(r) and r.request_id not in scheduled),
                            key=lambda r: r.n_total - r.n_computed)
        for req in prefilling:
            if budget == 0:
                break
            if req.state != "running":  # preempted for an earlier one in this loop
                continue
            n = min(req.n_total - req.n_computed, budget)
            ok, k = self._grow(req, req.n_computed + n, scheduled)
            preempted += k
            if not ok:
                n = len(req.blocks) * bs - req.n_computed
                if n <= 0:
                    continue
            batch.append((req, n))
            scheduled.add(req.request_id)
            budget -= n
        return batch, preempted

    @staticmethod
    def _check_plan(batch: list[tuple[Request, int]]) -> None:
        for req, n in batch:  # refuse an inconsistent plan before anything is computed
            if n <= 0 or req.n_computed + n > req.n_total or req.state != "running":
                raise SchedulerError(
                    f"refusing a chunk of {n} tokens for request {req.request_id} "
                    f"({req.n_computed} of {req.n_total} tokens computed, state {req.state})"
                )

    # ------------------------------------------------------------ overlap (launch N+1 before wait N)
    def _launchable(self, batch: list[tuple[Request, int]]) -> bool:
        """A step the overlap takes: every row a plain decode (one token, the last known) whose token is
        the engine's greedy pick. Prefill chunks, first tokens after a prompt and rows that need
        logits run synchronously (_run)."""
        return self.overlap and all(
            n == 1 and self._decoding(r) and device_pick_ok(r.params, r.constraint is not None) for r, n in batch)

    def _new_hist(self) -> np.ndarray | None:
        hp = self.engine.hparams
        return np.zeros((hp.n_layer, hp.n_expert), dtype=np.int32) if hp.n_expert else None

    def _launch(self, batch: list[tuple[Request, int]], outputs: list[RequestOutput]) -> None:
        """Launch a planned all-decode step with its known ids (the first of a run of overlapped steps)."""
        rows = [r for r, _ in batch]
        pos = [r.n_computed for r in rows]
        hist = self._new_hist()
        try:
            self.engine.place_kv([r.blocks for r in rows])  # the tiers, between steps
            ticket = self.engine.launch([r.token_ids[p] for r, p in zip(rows, pos, strict=True)], pos, list(range(len(rows))),
                                        [r.blocks for r in rows], list(range(len(rows))), expert_hist=hist)
        except Exception as exc:  # as _run: an engine error fails the requests of this step, not the loop
            self._fail_step(rows, exc, outputs)
            return
        self._flight = _Flight(ticket, rows, pos, hist)

    def _fail_step(self, reqs: list[Request], exc: Exception, outputs: list[RequestOutput]) -> None:
        """An engine error fails the requests of its step (those still running), not the loop."""
        for req in reqs:
            if req.state == "running":
                self.running.remove(req)
                outputs.append(self._finish(req, "abort", error=f"engine error: {exc}"))

    def _drop(self, f: _Flight) -> None:
        """Wait for a launched step whose picks nobody will read (the engine must not keep it)."""
        try:
            self.engine.wait(f.ticket)
        except Exception:
            pass
        self._flight = None

    def _speculate(self, f: _Flight) -> _Flight | None:
        """Launch the step after ``f`` before ``f``'s ids are known, when the plan cannot depend on them:
        nothing queued, aborted or waiting, every running request in ``f``. Each row of ``f`` whose
        token is not its last by count (max_tokens, the context window) continues, its id read on the
        device from ``f``'s pick (token_src); a row that stops on its id (end-of-generation, a stop id or
        string) wastes that one token, dropped at the wait. No preemption: when a row needs a block and
        none is free, nothing is launched (the next step plans synchronously)."""
        with self._lock:
            if self._inbox or self._aborts:
                return None
        if self.waiting:
            return None
        live = {id(r) for r in f.rows if r.state == "running"}
        if any(id(r) not in live for r in self.running):
            return None
        n_ctx = self.engine.n_ctx
        src: list[int] = []
        rows: list[Request] = []
        pos: list[int] = []
        for i, (req, p) in enumerate(zip(f.rows, f.pos, strict=True)):
            if req.state != "running":
                continue
            # after f, the request holds p + 2 tokens (f's pick appended) and p + 2 - n_prompt outputs
            mt = req.params.max_tokens
            if (mt is not None and p + 2 - req.n_prompt >= mt) or p + 2 >= n_ctx:
                continue  # f's token is its last: planned exactly
            if not self._ensure_blocks(req, p + 2):
                return None
            src.append(i)
            rows.append(req)
            pos.append(p + 1)
        if not rows:
            return None
        hist = self._new_hist()
        try:
            self.engine.place_kv([r.blocks for r in rows])
            ticket = self.engine.launch([0] * len(rows), pos, list(range(len(rows))), [r.blocks for r in rows],
                                        list(range(len(rows))), token_src=src, expert_hist=hist, after=f.ticket)
        except Exception as exc:  # another caller's step ran since (StaleSourceError), or an engine error:
            log.debug("overlap: next step not launched (%s)", exc)  # the next step plans synchronously
            return None
        return _Flight(ticket, rows, pos, hist)

    def _overlap(self, outputs: list[RequestOutput], report: StepReport) -> None:
        """One step of the overlapped loop: launch the next step when it can be planned now, wait for the
        one in flight, accept its tokens. The launched next step is in flight when this returns."""
        f = self._flight
        assert f is not None
        nxt = self._speculate(f)
        self._flight = nxt
        try:
            picks = self.engine.wait(f.ticket).tolist()
        except Exception as exc:  # the step failed: its requests end; the next one read its picks: drop it too
            if nxt is not None:
                self._drop(nxt)
            self._fail_step(f.rows, exc, outputs)
            return
        report.stats = self.engine.last_stats
        report.expert_hist = f.hist
        report.n_decode = len(f.rows)
        bs = self.blocks.block_size
        for req, p in zip(f.rows, f.pos, strict=True):
            if req.state != "running":  # aborted while in flight: its pick is dropped
                continue
            req.n_computed = p + 1
            if self._cache and (p + 1) // bs > p // bs:
                self.blocks.register_full(req.blocks, req.token_ids, req.digests, p // bs, (p + 1) // bs)
        self._inject("sample_raise_after_n_steps")
        detok_fault = self._fault_due("detok_raise_after_n_steps")
        now = time.monotonic()
        for req, tok in zip(f.rows, picks, strict=True):
            if req.state != "running":
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            outputs.append(self._accept(req, int(tok), None, detok_fault))

    def _run(self, batch: list[tuple[Request, int]], outputs: list[RequestOutput], report: StepReport) -> None:
        self._check_plan(batch)
        tokens: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        tables: list[array[int]] = []
        logit_rows: list[int] = []
        sample_reqs: list[Request] = []
        for i, (req, n) in enumerate(batch):
            start = req.n_computed
            tokens.extend(req.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            seq.extend([i] * n)
            tables.append(req.blocks)
            if start + n == req.n_total:
                logit_rows.append(len(tokens) - 1)
                sample_reqs.append(req)
            if n == 1 and start == req.n_total - 1:
                report.n_decode += 1
            else:
                report.n_prefill += n
        hist = self._new_hist()
        greedy = self.device_greedy and bool(sample_reqs) and all(
            device_pick_ok(r.params, r.constraint is not None) for r in sample_reqs)
        masks = None if greedy else self._start_masks(sample_reqs)  # grammar masks, computed while the C step runs
        try:
            self.engine.place_kv(tables)  # the tiers, between steps (engine.kv_tiers)
            logits = self.engine.forward(tokens, pos, seq, tables, logit_rows, expert_hist=hist, greedy=greedy)
        except Exception as exc:  # an engine error fails the requests of this step, not the loop
            if masks is not None:
                masks[2].result()
            self._fail_step([r for r, _ in batch], exc, outputs)
            return
        dead = {} if greedy else self._apply_masks(logits, masks, sample_reqs)
        report.stats = self.engine.last_stats
        report.expert_hist = hist
        bs = self.blocks.block_size
        for req, n in batch:
            before = req.n_computed
            req.n_computed += n
            if self._cache and req.n_computed // bs > before // bs:
                self.blocks.register_full(req.blocks, req.token_ids, req.digests, before // bs, req.n_computed // bs)
        if sample_reqs:
            self._inject("sample_raise_after_n_steps")
            if greedy:  # logits holds the picks (int32 [rows]); no row asked for logprobs
                picks: list[int] = logits.tolist()
                res = None
            else:
                res = self.sampler.sample(
                    logits,
                    [r.params for r in sample_reqs],
                    [r.rng for r in sample_reqs],
                    # only rows with penalties read their history, as views: no per-step copy
                    [r.history[: r.n_prompt] if r.history is not None else _NO_IDS for r in sample_reqs],
                    [r.history[r.n_prompt : r.n_total] if r.history is not None else _NO_IDS for r in sample_reqs],
                )
            detok_fault = self._fault_due("detok_raise_after_n_steps")
            now = time.monotonic()
            for i, req in enumerate(sample_reqs):
                if i in dead:  # the grammar admits no token at all: end it rather than hang
                    log.warning("request %s: grammar dead end after %d tokens (%s); finishing with stop",
                                req.request_id, req.n_output, dead[i])
                    self.running.remove(req)
                    outputs.append(self._finish(req, "stop"))
                    continue
                if res is None:
                    tok, lp = picks[i], None
                else:
                    tok = int(res.tokens[i])
                    top = res.top_logprobs[i] if res.top_logprobs else None
                    lp = TokenLogprob(tok, float(res.logprobs[i]), top) if req.params.logprobs is not None else None
                if req.first_token_time is None:
                    req.first_token_time = now
                outputs.append(self._accept(req, tok, lp, detok_fault))

    def _start_masks(self, sample_reqs: list[Request]) -> tuple[list[int], np.ndarray, Future[None]] | None:
        """Submit the grammar masks of this step's constrained rows to the mask thread.

        llguidance drops the GIL while it computes, as the C step does, so the masks are ready
        (or nearly) when the logits are. None when no row is constrained: unconstrained
        batches pay nothing."""
        rows = [i for i, r in enumerate(sample_reqs) if r.constraint is not None]
        if not rows:
            return None
        bits = np.zeros((len(rows), mask_words(self.engine.hparams.n_vocab)), dtype=np.int32)
        cons = [sample_reqs[i].constraint for i in rows]

        def fill() -> None:
            for k, c in enumerate(cons):
                assert c is not None
                c.fill(bits[k])

        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="strata-mask")
        return rows, bits, self._mask_pool.submit(fill)

    def _apply_masks(self, logits: np.ndarray, masks: tuple[list[int], np.ndarray, Future[None]] | None,
                     sample_reqs: list[Request]) -> dict[int, str]:
        """Mask the constrained rows of ``logits`` in place; rows whose grammar is in its error
        state or allows nothing are returned (row -> why), to be finished instead of sampled."""
        dead: dict[int, str] = {}
        if masks is None:
            return dead
        rows, bits, fut = masks
        fut.result()
        for k, i in enumerate(rows):
            c = sample_reqs[i].constraint
            err = c.error if c is not None else None
            if err:
                dead[i] = err
            elif apply_mask(logits[i], bits[k]) == 0:
                dead[i] = "no token allowed"
        return dead

    def _fault_due(self, kind: str) -> bool:
        """The test-only fault switch (``STRATA_TEST_FAULT``): True on every step after the N-th."""
        if self.fault is None or self.fault[0] != kind:
            return False
        self._fault_steps += 1
        return self._fault_steps > self.fault[1]

    def _inject(self, kind: str) -> None:
        if self._fault_due(kind):
            raise InjectedFault(f"{FAULT_ENV}={kind}:{self.fault[1] if self.fault else 0} (test-only fault)")

    def _accept(self, req: Request, tok: int, lp: TokenLogprob | None, detok_fault: bool = False) -> RequestOutput:
        """Append a sampled token, stream its text, and finish the request if it stops."""
        p = req.params
        req.token_ids.append(tok)
        if req.history is not None:
            if req.n_total > len(req.history):  # amortised O(1): double the buffer
                req.history = np.concatenate([req.history, np.zeros_like(req.history)])
            req.history[req.n_total - 1] = tok
        if self._cache:
            extend_digests(req.digests, req.token_ids, self.blocks.block_size)  # only a newly full block
        reason = None
        stop_reason: str | int | None = None
        text = ""
        emitted_ids = [tok]
        if (tok in self._eos and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
            emitted_ids = []  # the stop token itself is not part of the text
            if tok in p.stop_token_ids and not (tok in self._eos and not p.ignore_eos):
                stop_reason = tok
        else:
            if req.detok is not None:
                if detok_fault:
                    raise InjectedFault(f"{FAULT_ENV}=detok_raise_after_n_steps (test-only fault)")
                step = req.detok.push(tok)
                text = step.delta
                if step.stopped:
                    reason = "stop"
                    stop_reason = req.detok.matched_stop
            c = req.constraint
            if c is not None and reason is None:
                if not c.consume(tok):  # cannot happen with the mask applied; never loop on it
                    log.warning("request %s: grammar rejected token %d (%s); finishing with stop",
                                req.request_id, tok, c.error)
                    reason = "stop"
                elif c.done:  # the grammar is complete: only end-of-generation could follow
                    reason = "stop"
        if reason is None:
            if p.max_tokens is not None and req.n_output >= p.max_tokens:
                reason = "length"
            elif req.n_total >= self.engine.n_ctx:
                reason = "length"
        if reason is not None:
            if req.detok is not None:  # release held-back text (a partial stop string, a split character)
                text += req.detok.finish()
            self.running.remove(req)
            self.blocks.release(req.blocks)
            req.blocks = _table()
            req.finish_reason = reason
            self._move(req, "done")
        return RequestOutput(req.request_id, emitted_ids, text, [lp] if lp else [], reason is not None, reason,
                             req.n_prompt, req.n_output, max(req.cached_tokens, 0), stop_reason=stop_reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        self.blocks.release(req.blocks)
        req.blocks = _table()
        req.finish_reason = reason
        self._move(req, "done")
        return RequestOutput(req.request_id, [], "", [], True, reason, req.n_prompt, req.n_output,
                             max(req.cached_tokens, 0), error)

    # ------------------------------------------------------------ convenience
    def run_to_completion(self, max_steps: int = 1_000_000) -> dict[str, list[RequestOutput]]:
        """Step until idle; outputs grouped by request (tests, offline use)."""
        out: dict[str, list[RequestOutput]] = {}
        for _ in range(max_steps):
            if not self.has_work():
                break
            for o in self.step():
                out.setdefault(o.request_id, []).append(o)
        return out


def collect_text(outputs: list[RequestOutput]) -> tuple[list[int], str, str | None]:
    """Concatenate a request's deltas: (token ids, text, finish reason)."""
    ids: list[int] = []
    text = []
    reason = None
    for o in outputs:
        ids.extend(o.token_ids)
        text.append(o.text)
        if o.finished:
            reason = o.finish_reason
    return ids, "".join(text), reason

