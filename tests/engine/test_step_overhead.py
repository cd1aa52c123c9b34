"""Per-step Python work outside the C forward call does not grow with context length.

The C forward call is replaced (for this measurement only) by a stub that writes a fixed
logits row, so what is timed is the scheduler, the sampler, the detokenizer and the step's
argument marshalling. One sequence at 100 tokens of context and one at 8,000 take turns, step
for step (noise on a shared box hits both alike); the medians must stay within 1.5x. Operation
counts back the timing, deterministically: the tokens a step reads from a request's token list
and the digests it computes do not depend on the context length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import engine.block_manager as bm
import engine.engine as engine_mod
from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.native import ffi, lib
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

SHORT, LONG = 100, 8_000
STEPS = 240
TOKEN = 1_000  # what the stub "predicts": an ordinary token, never an end token


class _StubLib:
    """The C library, except that st_forward only writes logits (one fixed winner per row) or
    that winner as the rows' greedy pick."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(lib, name)

    def st_forward(self, model: Any, kv: Any, pool: Any, b: Any, stats: Any) -> int:
        self.calls += 1
        n = int(b.n_logits)
        if n and b.logits != ffi.NULL:
            out = np.frombuffer(ffi.buffer(b.logits, n * self.n_vocab * 4), dtype=np.float32)
            out[:] = 0.0
            out[TOKEN :: self.n_vocab] = 10.0
        if n and b.out_tokens != ffi.NULL:  # the greedy pick of those rows (the scheduler's greedy steps)
            np.frombuffer(ffi.buffer(b.out_tokens, n * 4), dtype=np.int32)[:] = TOKEN
        return 0


class _TokenReads:
    n = 0


class _CountingList(list):  # type: ignore[type-arg]
    """A request's token list that counts the elements read through slicing and iteration."""

    def __init__(self, items: list[int], reads: _TokenReads) -> None:
        super().__init__(items)
        self.reads = reads

    def __getitem__(self, i: Any) -> Any:
        out = super().__getitem__(i)
        self.reads.n += len(out) if isinstance(i, slice) else 1
        return out

    def __iter__(self) -> Iterator[int]:
        self.reads.n += len(self)
        return super().__iter__()

    def copy(self) -> list[int]:
        self.reads.n += len(self)
        return super().copy()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.open(build_default_model(default_model_path()), threads=1, kv_tokens=LONG + 1024,
                      max_model_len=LONG + 1024)
    _ = eng.tokenizer
    yield eng
    eng.close()


@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
def test_per_step_overhead_is_flat_in_context_length(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                     penalties: bool) -> None:
    """Also with penalties, whose rows read the whole history (as array views, never list copies)."""
    stub = _StubLib(engine.hparams.n_vocab)
    monkeypatch.setattr(engine_mod, "lib", stub)
    digests = 0
    real_digest = bm.block_digest

    def counting_digest(parent: bytes, tokens: Any) -> bytes:
        nonlocal digests
        digests += 1
        return real_digest(parent, tokens)

    rng = np.random.default_rng(0)
    extra = {"repetition_penalty": 1.1, "presence_penalty": 0.5} if penalties else {}  # TOKEN still wins
    params = SamplingParams.parse(temperature=0.0, max_tokens=STEPS + 8, ignore_eos=True, **extra)
    scheds = {}
    for n in (SHORT, LONG):
        sched = Scheduler(engine, SchedulerConfig(max_batch_tokens=1024))
        sched.add([int(t) for t in rng.integers(100, 40_000, size=n)], params)
        while not (sched.running and sched.running[0].n_output >= 2):  # prefill and first tokens
            sched.step()
        scheds[n] = sched
    monkeypatch.setattr(bm, "block_digest", counting_digest)
    reads = _TokenReads()
    for sched in scheds.values():
        req = sched.running[0]
        req.token_ids = _CountingList(req.token_ids, reads)
    times: dict[int, list[float]] = {SHORT: [], LONG: []}
    for _ in range(STEPS):
        for n, sched in scheds.items():  # interleaved: both see the same background load
            t0 = time.perf_counter()
            outs = sched.step()
            times[n].append(time.perf_counter() - t0)
            assert len(outs) == 1 and outs[0].token_ids == [TOKEN] and not outs[0].finished
    short, long = statistics.median(times[SHORT]), statistics.median(times[LONG])
    print(f"per-step Python time outside C{' (penalties)' if penalties else ''}: {SHORT} tokens {short * 1e6:.0f} us, {LONG} tokens "
          f"{long * 1e6:.0f} us (ratio {long / short:.2f})")
    assert long < 1.5 * short, (short, long)
    # tokens read: the one token each step computes, plus a block's tokens when it completes
    # (its digest) -- never the whole context (8,000 tokens a step before this was fixed)
    assert reads.n <= 2 * STEPS * (1 + 2) + 2 * (STEPS // engine.block_size + 1) * engine.block_size, reads.n
    # hashing: one digest per completed block, never the whole chain again
    assert digests <= 2 * (STEPS // engine.block_size + 1), digests
    assert stub.calls >= 2 * STEPS
    for sched in scheds.values():
        for r in list(sched.running):
            sched.abort(r.request_id)
        sched.step()
    assert engine.blocks.num_free == engine.blocks.n_blocks
