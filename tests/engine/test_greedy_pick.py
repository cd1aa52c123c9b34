"""The engine's own greedy pick (st_batch.out_tokens, Engine.forward(greedy=True)) and the
scheduler's use of it: the same picks as numpy's argmax over the same logits (ties, -inf, NaN,
signed zeros), typed errors, and the same tokens with the pick on and off (STRATA_DEVICE_GREEDY=0)
through batching, mixed batches that fall back to the logits, preemption and aborts. CPU only and
cheap (a 2-layer random model); tests/engine/gpu/ runs the GPU's kernel and steps against these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine
from engine.native import EngineError, OutOfRangeError, ffi, lib, ptr
from engine.sampling import SamplingParams
from engine.scheduler import DEVICE_GREEDY_ENV, Scheduler, SchedulerConfig, collect_text, device_pick_ok
from tests.engine.gguf_factory import TINY_VOCAB
from tests.engine.sched_helpers import step_into

VOCAB = TINY_VOCAB  # tiny_path's and eng's model (tests/engine/conftest.py)


def tricky_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows that exercise the pick's rule: plain random, ties at the maximum, all -inf, -inf
    beside numbers, NaN (one and several), signed zeros, all equal, the maximum last / first."""
    rows = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    t = rng.standard_normal(n).astype(np.float32)
    t[[5, n // 2, n - 1]] = t.max() + 1.0  # a three-way tie: the lowest index wins
    rows.append(t)
    rows.append(np.full(n, -np.inf, np.float32))  # all -inf: index 0
    t = np.full(n, -np.inf, np.float32)
    t[n - 2] = -1e30
    rows.append(t)
    t = rng.standard_normal(n).astype(np.float32)
    t[n // 3] = np.nan  # NaN beats every number (numpy's argmax): its index
    rows.append(t)
    t = rng.standard_normal(n).astype(np.float32)
    t[[7, 3]] = np.nan, -np.nan  # the first NaN, whatever its sign
    t[0] = np.inf
    rows.append(t)
    t = np.full(n, -1.0, np.float32)
    t[4], t[2] = 0.0, -0.0  # -0.0 == +0.0: the first of them
    rows.append(t)
    rows.append(np.full(n, 0.25, np.float32))  # all equal: 0
    t = rng.standard_normal(n).astype(np.float32)
    t[-1] = 100.0
    rows.append(t)
    t = rng.standard_normal(n).astype(np.float32)
    t[0] = np.inf
    rows.append(t)
    return np.stack(rows)


@pytest.mark.parametrize("n", [1, 3, 300, 4097, 151936])
def test_argmax_rows_is_numpys_argmax(n: int) -> None:
    rng = np.random.default_rng(n)
    x = tricky_rows(rng, max(n, 8))[:, :n].copy() if n < 8 else tricky_rows(rng, n)
    out = np.full(x.shape[0], -7, np.int32)
    assert lib.st_argmax_rows(ptr(x, "float *"), x.shape[0], n, ptr(out, "int32_t *")) == 0
    assert out.tolist() == np.argmax(x, axis=1).tolist()


def test_argmax_rows_checks_its_arguments() -> None:
    x = np.zeros((2, 4), np.float32)
    out = np.zeros(2, np.int32)
    assert lib.st_argmax_rows(ptr(x, "float *"), 2, 0, ptr(out, "int32_t *")) == lib.ST_ERANGE
    assert lib.st_argmax_rows(ptr(x, "float *"), 2, 1 << 31, ptr(out, "int32_t *")) == lib.ST_ERANGE
    assert lib.st_argmax_rows(ffi.NULL, 2, 4, ptr(out, "int32_t *")) == lib.ST_EINVAL
    assert lib.st_argmax_rows(ptr(x, "float *"), -1, 4, ptr(out, "int32_t *")) == lib.ST_EINVAL
    assert lib.st_argmax_rows(ffi.NULL, 0, 4, ffi.NULL) == 0  # no rows: nothing to do


def test_forward_greedy_is_argmax_of_the_same_steps_logits(eng: Engine) -> None:
    """Prefill chunks of two sequences and a decode token in one step, the rows' logits then their
    picks from the same inputs (the step rewrites the same K/V): the picks are np.argmax of the logits."""
    blocks = [eng.blocks.allocate(2) for _ in range(3)]
    try:
        rng = np.random.default_rng(3)
        toks = [int(t) for t in rng.integers(0, VOCAB, size=9)]
        pos = [0, 1, 2, 3, 0, 1, 2, 0, 1]
        seq = [0, 0, 0, 0, 1, 1, 1, 2, 2]
        rows = [1, 3, 6, 8]
        logits = eng.forward(toks, pos, seq, blocks, rows)
        picks = eng.forward(toks, pos, seq, blocks, rows, greedy=True)
        assert picks.dtype == np.int32 and picks.shape == (4,)
        assert picks.tolist() == np.argmax(logits, axis=1).tolist()
        none = eng.forward(toks, pos, seq, blocks, [], greedy=True)  # no rows: an empty result
        assert none.shape == (0,)
    finally:
        for b in blocks:
            eng.blocks.release(b)


def test_forward_with_neither_logits_nor_picks_is_a_typed_error(eng: Engine) -> None:
    blocks = eng.blocks.allocate(1)
    try:
        b = eng._io.fill([1], [0], [0], [blocks], [0])
        b.logits = b.out_tokens = b.expert_hist = ffi.NULL
        with pytest.raises(EngineError, match="logits or out_tokens"):
            from engine.native import check

            check(lib.st_forward(eng._model, eng._kv, eng._pool, b, eng._io.stats), "forward")
        with pytest.raises(OutOfRangeError, match="logit index 5 out of range"):
            eng.forward([1], [0], [0], [blocks], [5], greedy=True)
    finally:
        eng.blocks.release(blocks)


def test_block_tables_reused_across_steps_are_padded_exactly(eng: Engine) -> None:
    """The step's host arrays are kept between steps: a row that shrinks, a table that narrows or
    widens, lists and array('i') rows all give the same logits as a fresh engine call would."""
    from array import array

    a, b = eng.blocks.allocate(3), eng.blocks.allocate(3)
    try:
        want = eng.forward([1, 2], [0, 40], [0, 1], [list(a), list(b)], [0, 1])
        eng.forward([3], [0], [0], [array("i", a)], [0])  # one row: the slots' lengths change
        again = eng.forward([1, 2], [0, 40], [0, 1], [array("i", a), array("i", b)], [0, 1])
        assert np.array_equal(want, again)
        io = eng._io
        eng.forward([1, 2], [0, 1], [0, 1], [a[:1], b[:3]], [0, 1])  # row 0 shrinks: its tail is -1 again
        assert io._bt[: 2 * io._w].tolist() == [a[0], -1, -1, *b[:3]]
    finally:
        eng.blocks.release(a)
        eng.blocks.release(b)


def test_which_rows_the_engine_may_pick() -> None:
    ok = SamplingParams.parse
    assert device_pick_ok(ok(temperature=0.0), False)
    assert device_pick_ok(ok(temperature=0.7, top_k=1), False)  # the sampler's argmax, no draw
    assert device_pick_ok(ok(temperature=0.0, top_p=0.5, min_p=0.2), False)  # no effect on an argmax
    assert device_pick_ok(ok(temperature=0.0, stop=["x"], stop_token_ids=[3], ignore_eos=True, seed=5,
                             max_tokens=3), False)
    for bad in (dict(temperature=0.7), dict(temperature=0.0, logit_bias={3: 1.0}),
                dict(temperature=0.0, repetition_penalty=1.1), dict(temperature=0.0, presence_penalty=0.5),
                dict(temperature=0.0, frequency_penalty=0.5), dict(temperature=0.0, logprobs=0),
                dict(temperature=0.0, logprobs=2)):
        assert not device_pick_ok(ok(**bad), False), bad
    assert not device_pick_ok(ok(temperature=0.0), True)  # a grammar masks the row first


class _Spy:
    """Engine.forward wrapped: how many steps asked for the greedy pick and how many for logits."""

    def __init__(self, eng: Engine) -> None:
        self.greedy = self.logits = 0
        self._fn = eng.forward

    def __call__(self, *a: Any, greedy: bool = False, **kw: Any) -> Any:
        if len(a[4]):  # logit rows: a step that samples
            if greedy:
                self.greedy += 1
            else:
                self.logits += 1
        return self._fn(*a, greedy=greedy, **kw)


def run(eng: Engine, reqs: list[tuple[list[int], SamplingParams]], on: bool, aborts: dict[int, int] | None = None,
        config: SchedulerConfig | None = None) -> tuple[list[tuple[list[int], str, str | None]], _Spy, int]:
    """The requests through one scheduler; aborts {request index: step}; (outputs, spy, preemptions)."""
    spy = _Spy(eng)
    eng.forward = spy  # type: ignore[method-assign]
    try:
        sched = Scheduler(eng, config or SchedulerConfig(max_batch_tokens=64),
                          environ={} if on else {DEVICE_GREEDY_ENV: "0"})
        rids = [sched.add(p, sp) for p, sp in reqs]
        out: dict[str, list] = {}
        step = pre = 0
        while sched.has_work():
            for i, s in (aborts or {}).items():
                if s == step:
                    sched.abort(rids[i])
            pre += step_into(sched, out)
            step += 1
        assert eng.blocks.num_free == eng.blocks.n_blocks
        return [collect_text(out[r]) for r in rids], spy, pre
    finally:
        del eng.forward


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(3, 40)))] for _ in range(n)]


def test_scheduler_greedy_pick_on_and_off_give_the_same_tokens(eng: Engine) -> None:
    reqs = [(p, SamplingParams.parse(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in prompts(8)]
    reqs.append((prompts(1, 5)[0], SamplingParams.parse(temperature=0.9, top_k=1, max_tokens=24, ignore_eos=True)))
    on, spy_on, _ = run(eng, reqs, True)
    off, spy_off, _ = run(eng, reqs, False)
    assert on == off
    assert spy_on.greedy > 0 and spy_on.logits == 0  # every sampling step took the engine's pick
    assert spy_off.greedy == 0 and spy_off.logits > 0


def test_mixed_batches_fall_back_to_logits(eng: Engine) -> None:
    """A row that needs logits (sampling, logprobs, a bias) puts its whole step on the logits path;
    the greedy rows beside it still get the same tokens as with the pick on everywhere."""
    plain = SamplingParams.parse(temperature=0.0, max_tokens=12, ignore_eos=True)
    ps = prompts(4, 9)
    alone = run(eng, [(p, plain) for p in ps], True)[0]
    for other in (SamplingParams.parse(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
                  SamplingParams.parse(temperature=0.0, logprobs=1, max_tokens=12, ignore_eos=True),
                  SamplingParams.parse(temperature=0.0, logit_bias={5: 3.0}, max_tokens=12, ignore_eos=True)):
        got, spy, _ = run(eng, [(p, plain) for p in ps] + [(ps[0], other)], True)
        assert got[:4] == alone
        assert spy.logits > 0, other
    got, spy, _ = run(eng, [(p, plain) for p in ps] + [(ps[0], SamplingParams.parse(
        temperature=0.0, logprobs=1, max_tokens=3, ignore_eos=True))], True)
    assert got[:4] == alone and spy.greedy > 0 and spy.logits > 0  # once the logprobs row ends: greedy again


def test_preemption_and_aborts_with_the_pick_on_and_off(tiny_path: Path) -> None:
    params = SamplingParams.parse(temperature=0.0, max_tokens=40, ignore_eos=True)
    reqs = [(p, params) for p in prompts(10, 4)]
    with Engine.open(tiny_path, threads=1, kv_tokens=256, block_size=16) as small:  # 16 blocks: too few for 10
        on, spy, pre_on = run(small, reqs, True, aborts={2: 3, 7: 9})
        off, _, pre_off = run(small, reqs, False, aborts={2: 3, 7: 9})
    assert pre_on > 0 and pre_on == pre_off
    assert on == off and spy.greedy > 0
    assert on[2][2] == "abort" and on[7][2] == "abort"
