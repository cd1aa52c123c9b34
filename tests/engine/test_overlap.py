"""Overlapping the host with the next step: st_batch.token_src (a token's id taken from the previous
step's greedy pick) and Engine.launch / Engine.wait. On the CPU the launch runs the step at once
(st_forward resolves token_src from its own last picks), so these check the contract the GPU's
stg_step_launch / stg_step_wait keep: the same tokens as explicit ids, launch order, typed errors.
CPU only and cheap (a 2-layer random model); tests/engine/gpu/ runs the GPU's halves against these."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine, StaleSourceError
from engine.native import EngineError, OutOfRangeError, UnsupportedError
from tests.engine.gguf_factory import make_random_gguf

VOCAB = 300


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gguf

    return make_random_gguf(tmp_path_factory.mktemp("overlap") / "tiny.gguf", n_vocab=VOCAB, n_layer=2,
                            weight_type=gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def eng(tiny_path: Path) -> Iterator[Engine]:
    e = Engine.open(tiny_path, threads=1, kv_tokens=1024, block_size=16)
    yield e
    e.close()


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


def test_a_gpu_library_older_than_token_src_is_refused(eng: Engine) -> None:
    """A CUDA library built before st_batch.token_src would read tokens[i] and ignore the field:
    token_src and launch are refused there instead of computing the wrong ids."""

    class OldGpu:
        has_pick = True
        has_overlap = False

    blocks = eng.blocks.allocate(1)
    try:
        eng._gpu = OldGpu()
        with pytest.raises(UnsupportedError, match="predates"):
            eng.forward([0], [0], [0], [blocks], [0], greedy=True, token_src=[0])
        with pytest.raises(UnsupportedError, match="predates"):
            eng.launch([4], [0], [0], [blocks], [0])
        assert not eng.can_launch
    finally:
        eng._gpu = None
        eng.blocks.release(blocks)
    assert eng.can_launch
