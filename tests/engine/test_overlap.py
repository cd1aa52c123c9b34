"""Overlapping the host with the next step: st_batch.token_src (a token's id taken from the previous
step's greedy pick) and Engine.launch / Engine.wait. On the CPU the launch runs the step at once
(st_forward resolves token_src from its own last picks), so these check the contract the GPU's
stg_step_launch / stg_step_wait keep: the same tokens as explicit ids, launch order, typed errors.
CPU only and cheap (a 2-layer random model); tests/engine/gpu/ runs the GPU's halves against these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine, StaleSourceError
from engine.native import EngineError, OutOfRangeError
from engine.sampling import SamplingParams
from engine.scheduler import (
    DEVICE_GREEDY_ENV,
    FAULT_ENV,
    OVERLAP_ENV,
    InjectedFault,
    Scheduler,
    SchedulerConfig,
    collect_text,
)
from tests.engine.gguf_factory import TINY_VOCAB
from tests.engine.sched_helpers import step_into

VOCAB = TINY_VOCAB  # tiny_path's and eng's model (tests/engine/conftest.py)


PROMPTS = [[5, 17, 42], [7, 8], [250, 3, 9, 11]]
STEPS = 6


def prefill(eng: Engine, tables: list[list[int]]) -> list[int]:
    """The prompts of PROMPTS in one step; the greedy pick after each."""
    toks = [t for p in PROMPTS for t in p]
    pos = [i for p in PROMPTS for i in range(len(p))]
    seq = [s for s, p in enumerate(PROMPTS) for _ in p]
    ends = list(np.cumsum([len(p) for p in PROMPTS]) - 1)
    return eng.forward(toks, pos, seq, tables, ends, greedy=True).tolist()


def decode_plain(eng: Engine, tables: list[list[int]], order: list[int]) -> list[list[int]]:
    """Decode STEPS steps with explicit ids (forward, greedy); rows in `order` (sequence indices)."""
    last = prefill(eng, tables)
    lens = [len(p) for p in PROMPTS]
    out: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(STEPS):
        toks = [last[s] for s in order]
        picks = eng.forward(toks, [lens[s] for s in order], order, tables, list(range(len(order))), greedy=True)
        for r, s in enumerate(order):
            out[s].append(int(picks[r]))
            last[s] = int(picks[r])
            lens[s] += 1
    return out


def run_overlapped(eng: Engine, tables: list[list[int]], orders: list[list[int]]) -> list[list[int]]:
    first = prefill(eng, tables)
    lens = [len(p) for p in PROMPTS]
    out: list[list[int]] = [[] for _ in PROMPTS]
    pending: list[tuple[int, list[int]]] = []
    prev: list[int] | None = None

    def drain_one() -> None:
        tk, o = pending.pop(0)
        picks = eng.wait(tk)
        assert picks.dtype == np.int32 and picks.shape == (len(o),)
        for r, s in enumerate(o):
            out[s].append(int(picks[r]))

    for n in range(STEPS):
        order = orders[n]
        if prev is None:
            toks, src = [first[s] for s in order], None
        else:
            toks, src = [0] * len(order), [prev.index(s) for s in order]
        t = eng.launch(toks, [lens[s] for s in order], order, tables, list(range(len(order))), token_src=src)
        for s in order:
            lens[s] += 1
        pending.append((t, order))
        prev = order
        assert eng.in_flight == len(pending)
        if len(pending) == 2:
            drain_one()
    while pending:
        drain_one()
    return out


def with_tables(eng: Engine, fn: Any) -> Any:
    tables = [eng.blocks.allocate(2) for _ in PROMPTS]
    try:
        return fn([list(t) for t in tables])
    finally:
        for t in tables:
            eng.blocks.release(t)


def test_launch_before_wait_with_token_src_gives_the_same_tokens(eng: Engine) -> None:
    """Three sequences, six decode steps: explicit ids through forward against launch(N+1) before
    wait(N) with every id taken from the previous step's picks, rows reordered between steps."""
    want = with_tables(eng, lambda t: decode_plain(eng, t, [0, 1, 2]))
    orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 1, 2], [2, 1, 0], [0, 2, 1]]
    got = with_tables(eng, lambda t: run_overlapped(eng, t, orders))
    assert got == want
    assert all(len(o) == STEPS for o in got)
    assert eng.in_flight == 0


def test_token_src_beside_explicit_ids_and_in_forward(eng: Engine) -> None:
    """A step mixing rows from the previous picks and explicit ids (-1), through forward(token_src=...)
    and through logits (not greedy): the same as the explicit ids."""
    def mixed(tables: list[list[int]]) -> np.ndarray:
        eng.forward([5, 6, 7], [0, 0, 0], [0, 1, 2], tables, [0, 1, 2], greedy=True)
        # sequence 0 from pick 0, sequence 1 an explicit id, sequence 2 from pick 2; logits, not picks
        return eng.forward([0, 123, 0], [1, 1, 1], [0, 1, 2], tables, [0, 1, 2], token_src=[0, -1, 2])

    def explicit(tables: list[list[int]]) -> np.ndarray:
        a = eng.forward([5, 6, 7], [0, 0, 0], [0, 1, 2], tables, [0, 1, 2], greedy=True).tolist()
        return eng.forward([a[0], 123, a[2]], [1, 1, 1], [0, 1, 2], tables, [0, 1, 2])

    got = with_tables(eng, mixed)
    want = with_tables(eng, explicit)
    assert got.shape == (3, VOCAB) and np.array_equal(got, want)


def test_misuse_is_a_typed_error(eng: Engine) -> None:
    blocks = eng.blocks.allocate(1)
    try:
        tb = [blocks]
        eng.forward([4], [0], [0], tb, [0])  # a logits step: no picks left
        with pytest.raises(EngineError, match="no greedy picks") as ei:
            eng.forward([0], [1], [0], tb, [0], greedy=True, token_src=[0])
        assert ei.value.code == 1
        eng.forward([4], [0], [0], tb, [0], greedy=True)  # one pick
        with pytest.raises(OutOfRangeError, match="outside"):
            eng.forward([0], [1], [0], tb, [0], greedy=True, token_src=[1])
        with pytest.raises(OutOfRangeError, match="outside"):
            eng.forward([0], [1], [0], tb, [0], greedy=True, token_src=[-2])
        # a refused step changed nothing: the pick is still there
        assert eng.forward([0], [1], [0], tb, [0], greedy=True, token_src=[0]).shape == (1,)
        with pytest.raises(ValueError, match="one entry per token"):
            eng.forward([0], [1], [0], tb, [0], token_src=[0, 0])
        with pytest.raises(EngineError, match="no launched step"):
            eng.wait(10**9)
        t1 = eng.launch([4], [0], [0], tb, [0])
        t2 = eng.launch([0], [1], [0], tb, [0], token_src=[0], after=t1)
        t3 = eng.launch([0], [2], [0], tb, [0], token_src=[0], after=t2)  # a third: the oldest is waited for it
        assert eng.in_flight == 3
        with pytest.raises(StaleSourceError, match="ran since"):  # t3 ran after t2: t2's picks are gone
            eng.launch([0], [3], [0], tb, [0], token_src=[0], after=t2)
        c = eng.wait(t3)  # out of order: t1 and t2 keep their results for their own wait
        a = eng.wait(t1)
        f = eng.forward([4], [0], [0], tb, [0], greedy=True)  # forward beside launched steps
        b = eng.wait(t2)
        assert a.shape == b.shape == c.shape == f.shape == (1,) and eng.in_flight == 0
        assert a.tolist() == f.tolist()  # the same first step
        for t in (t1, t2, 10**9):
            with pytest.raises(EngineError, match="no launched step"):
                eng.wait(t)
    finally:
        eng.blocks.release(blocks)


# ------------------------------------------------------------ the scheduler's overlapped loop


class _LaunchSpy:
    """Engine.launch wrapped: launches, and those whose ids came from the previous step (token_src)."""

    def __init__(self, eng: Engine) -> None:
        self.launches = self.speculative = self.preempted = 0
        self._fn = eng.launch

    def __call__(self, *a: Any, **kw: Any) -> Any:
        self.launches += 1
        self.speculative += kw.get("token_src") is not None
        return self._fn(*a, **kw)


def sched_run(eng: Engine, reqs: list[tuple[list[int], SamplingParams]], overlap: bool,
              aborts: dict[int, int] | None = None, late: dict[int, int] | None = None,
              config: SchedulerConfig | None = None, environ: dict[str, str] | None = None,
              ) -> tuple[list[tuple[list[int], str, str | None]], _LaunchSpy]:
    """The requests through one scheduler with STRATA_OVERLAP=1 / 0; aborts {request: step}, late
    {request: step it is added at (else at the start)}; every block free at the end."""
    spy = _LaunchSpy(eng)
    eng.launch = spy  # type: ignore[method-assign]
    try:
        env = {OVERLAP_ENV: "1" if overlap else "0", **(environ or {})}
        sched = Scheduler(eng, config or SchedulerConfig(max_batch_tokens=64), environ=env)
        assert sched.overlap == overlap
        late = late or {}
        rids: dict[int, str] = {i: sched.add(p, sp) for i, (p, sp) in enumerate(reqs) if i not in late}
        out: dict[str, list] = {}
        step = 0
        while sched.has_work() or len(rids) < len(reqs):
            for i, s in late.items():
                if s == step:
                    rids[i] = sched.add(*reqs[i])
            for i, s in (aborts or {}).items():
                if s == step:
                    sched.abort(rids[i])
            spy.preempted += step_into(sched, out)
            step += 1
            assert step < 10_000
        assert eng.blocks.num_free == eng.blocks.n_blocks and eng.in_flight == 0
        return [collect_text(out[rids[i]]) for i in range(len(reqs))], spy
    finally:
        del eng.launch


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(3, 40)))] for _ in range(n)]


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams.parse(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_overlap_on_and_off_give_the_same_tokens(eng: Engine) -> None:
    """8 greedy requests of different lengths (max_tokens 1..24: each stop by count planned exactly)."""
    reqs = [(p, greedy(n)) for p, n in zip(prompts(8), [24, 1, 2, 3, 17, 24, 9, 5], strict=True)]
    on, spy = sched_run(eng, reqs, True)
    off, spy_off = sched_run(eng, reqs, False)
    assert on == off
    assert [len(t) for t, _, _ in on] == [24, 1, 2, 3, 17, 24, 9, 5] and all(r == "length" for _, _, r in on)
    assert spy.speculative > 10 and spy_off.launches == 0


def test_stops_on_the_id_mid_batch(eng: Engine) -> None:
    """Requests that stop on an id (stop_token_ids) mid-batch: the overlap launched their next token
    before it knew, and drops it; the tokens and finish reasons are those of the synchronous loop."""
    ps = prompts(6, 3)
    free, _ = sched_run(eng, [(p, greedy(20)) for p in ps], False)
    stops = [[toks[k]] for (toks, _, _), k in zip(free, [2, 5, 9, 0, 14, 19], strict=True)]
    reqs = [(p, greedy(20, stop_token_ids=s)) for p, s in zip(ps, stops, strict=True)]
    on, spy = sched_run(eng, reqs, True)
    off, _ = sched_run(eng, reqs, False)
    assert on == off and spy.speculative > 0
    assert all(r == "stop" for _, _, r in on[:5])


def test_context_window_stop(tiny_path: Path) -> None:
    with Engine.open(tiny_path, threads=1, kv_tokens=1024, block_size=16, max_model_len=48) as small:
        reqs = [(p, greedy(100)) for p in prompts(4, 6)]
        on, spy = sched_run(small, reqs, True)
        off, _ = sched_run(small, reqs, False)
    assert on == off and spy.speculative > 0
    assert all(r == "length" for _, _, r in on)


def test_preemption_aborts_and_late_arrivals(tiny_path: Path) -> None:
    """Too few blocks for 10 requests (preemption, which the overlap never does: it plans such steps
    synchronously), aborts while steps are in flight, requests arriving mid-run; the prefix cache on
    (late requests share a prompt)."""
    ps = prompts(10, 4)
    ps[8] = ps[0] + [1, 2, 3]
    ps[9] = ps[1][:] + ps[0]
    reqs = [(p, greedy(40)) for p in ps]
    with Engine.open(tiny_path, threads=1, kv_tokens=256, block_size=16) as small:
        kw: dict[str, Any] = {"aborts": {2: 3, 7: 9, 5: 30}, "late": {8: 12, 9: 20}}
        on, spy = sched_run(small, reqs, True, **kw)
        off, spy_off = sched_run(small, reqs, False, **kw)
    assert spy.preempted > 0 and spy_off.preempted > 0
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        if i in (2, 7, 5):  # aborted: a prefix of the same tokens (the step it lands on may differ)
            assert a[2] == b[2] == "abort"
            n = min(len(a[0]), len(b[0]))
            assert a[0][:n] == b[0][:n]
        else:
            assert a == b, i
    assert spy.speculative > 0


def test_mixed_batches_run_synchronously(eng: Engine) -> None:
    """A row that needs logits (sampling, logprobs) puts its steps on the synchronous path; the greedy
    rows beside it get the same tokens as with the overlap off."""
    ps = prompts(4, 9)
    reqs = [(p, greedy(12)) for p in ps] + [(ps[0], SamplingParams.parse(temperature=0.8, seed=3, max_tokens=5,
                                                                         ignore_eos=True)),
                                            (ps[1], greedy(3, logprobs=1))]
    on, spy = sched_run(eng, reqs, True)
    off, _ = sched_run(eng, reqs, False)
    assert on == off and spy.launches > 0


def test_a_failing_step_with_one_in_flight(eng: Engine) -> None:
    """The step raises (the test-only fault) while the next is in flight: fail_all waits for it, every
    request ends with the error, every block is free, the engine has nothing in flight."""
    sched = Scheduler(eng, SchedulerConfig(max_batch_tokens=64),
                      environ={OVERLAP_ENV: "1", FAULT_ENV: "sample_raise_after_n_steps:3"})
    for p in prompts(3, 2):
        sched.add(p, greedy(30))
    with pytest.raises(InjectedFault):
        for _ in range(100):
            sched.step()
    assert sched._flight is not None  # the next step was in flight when it raised
    outs = sched.fail_all("boom")
    assert len(outs) == 3 and all(o.finished and o.error == "boom" for o in outs)
    assert eng.in_flight == 0 and eng.blocks.num_free == eng.blocks.n_blocks
    assert not sched.has_work()


def test_overlap_default_and_switch(eng: Engine) -> None:
    """Default off on the CPU (on for a GPU engine: run 70); STRATA_OVERLAP=1 on, 0 off; STRATA_DEVICE_GREEDY=0
    off."""
    assert not Scheduler(eng, environ={}).overlap
    assert not Scheduler(eng, environ={OVERLAP_ENV: "0"}).overlap
    assert Scheduler(eng, environ={OVERLAP_ENV: "1"}).overlap
    assert not Scheduler(eng, environ={OVERLAP_ENV: "1", DEVICE_GREEDY_ENV: "0"}).overlap
