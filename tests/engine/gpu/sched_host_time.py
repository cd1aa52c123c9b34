"""The scheduler's host share of a decode step, on the CPU with the C step stubbed out (no GPU needed):

    PYTHONPATH=. python3 tests/engine/gpu/sched_host_time.py [--steps 400] [--seqs 1,8,32]

What a step of serving costs the host around the engine call, i.e. what overlapping the host with the next
step would hide (docs/gpu-runs.md, "Overlapping the host with the next step"): N greedy requests on the
default model (its tokenizer: the detokenizer and stop checks run) through one Scheduler, every step a
decode step of all N; the C step (st_forward) replaced by a stub that writes an ordinary token as each
row's greedy pick (or into the logits with STRATA_DEVICE_GREEDY=0). Prints per N the medians of
Scheduler.step()'s wall time, of the Engine.forward call inside it, and of their difference (the
scheduler's own Python: planning, the step's lists, hist, outputs, detokenisation, block bookkeeping)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

TOKEN = 1000  # an ordinary token of the default model's vocabulary, never an end token


class _Stub:
    def __init__(self, lib: Any, ffi: Any, n_vocab: int) -> None:
        self._lib, self._ffi, self.v = lib, ffi, n_vocab

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def st_forward(self, model: Any, kv: Any, pool: Any, b: Any, stats: Any) -> int:
        n, f = int(b.n_logits), self._ffi
        if n and b.logits != f.NULL:
            x = np.frombuffer(f.buffer(b.logits, 4 * n * self.v), np.float32).reshape(n, self.v)
            x[:] = 0.0
            x[:, TOKEN] = 1.0
        if n and b.out_tokens != f.NULL:
            np.frombuffer(f.buffer(b.out_tokens, 4 * n), np.int32)[:] = TOKEN
        stats.n_tokens = b.n_tokens
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seqs", default="1,8,32")
    args = ap.parse_args(argv)
    import engine.engine as em
    from engine.default_model import build_default_model, default_model_path
    from engine.engine import Engine
    from engine.native import ffi, lib
    from engine.sampling import SamplingParams
    from engine.scheduler import Scheduler, SchedulerConfig

    eng = Engine.open(build_default_model(default_model_path()), threads=1, kv_tokens=64 * 1024)
    _ = eng.tokenizer
    em.lib = _Stub(lib, ffi, eng.hparams.n_vocab)  # type: ignore[assignment]
    inner = eng.forward
    spent = {"t": 0.0}

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent["t"] = time.perf_counter() - t0

    eng.forward = timed  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    params = SamplingParams.parse(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
    for n in (int(s) for s in args.seqs.split(",")):
        for env in ({}, {"STRATA_DEVICE_GREEDY": "0"}):
            sched = Scheduler(eng, SchedulerConfig(max_num_seqs=64, max_batch_tokens=4096), environ=env)
            for _ in range(n):
                sched.add([int(t) for t in rng.integers(100, 40_000, size=48)], params)
            while not (len(sched.running) == n and all(r.n_output >= 2 for r in sched.running)):
                sched.step()
            rows = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                outs = sched.step()
                rows.append((time.perf_counter() - t0, spent["t"]))
                assert len(outs) == n
            for r in list(sched.running):
                sched.abort(r.request_id)
            sched.step()
            a = np.array(rows) * 1e6
            med = np.median(a, axis=0)
            d = np.median(a[:, 0] - a[:, 1])
            print(f"{n:>2} seqs, {'device pick' if not env else 'logits    '}: step {med[0]:7.1f} us, Engine.forward "
                  f"{med[1]:6.1f} us (C stubbed), scheduler outside it {d:7.1f} us (medians of {len(rows)} steps)")
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
