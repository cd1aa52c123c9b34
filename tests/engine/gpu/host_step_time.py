"""Engine.forward's host share of a decode step, on the CPU with the C step stubbed out (no GPU needed):

    PYTHONPATH=. python3 tests/engine/gpu/host_step_time.py [--steps 3000] [--seqs 1,8,32]

b1_host_time.py's timers (time.perf_counter: Python before the C call, after it, and the greedy pick
on the host), but the C call replaced by a stub that only writes its outputs (a fixed winner per
logits row, or the picks), so that the figures are Engine.forward's own Python: the arrays, the
st_batch, the output array, StepStats. A tiny random model with the bench model's vocabulary
(151,936) is built in a temporary folder; the tables are the scheduler's array('i') rows, each
sequence a few blocks long, positions advancing every step (a table's width changes every 16
steps). Rows: ``logits`` (logits copied back, np.argmax here: the path before session 11) and
``greedy`` (Engine.forward(greedy=True): only the ids); an engine without ``greedy`` (an older
checkout on PYTHONPATH) gets the first row only."""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import numpy as np

V = 151936
WIN = 1000


class _Stub:
    """engine.engine's lib, but st_forward marks the time and writes its outputs only."""

    def __init__(self, lib: Any, ffi: Any, marks: dict[str, float]) -> None:
        self._lib, self._ffi, self.marks = lib, ffi, marks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def st_forward(self, model: Any, kv: Any, pool: Any, b: Any, stats: Any) -> int:
        self.marks["c0"] = time.perf_counter()
        n = int(b.n_logits)
        f = self._ffi
        if n and b.logits != f.NULL:
            x = np.frombuffer(f.buffer(b.logits, 4 * n * V), np.float32).reshape(n, V)
            x[:] = 0.0  # (inside the stub's marks: not counted)
            x[:, WIN] = 1.0
        if n and getattr(b, "out_tokens", f.NULL) != f.NULL:
            for i in range(n):
                b.out_tokens[i] = WIN
        stats.n_tokens = b.n_tokens
        self.marks["c1"] = time.perf_counter()
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seqs", default="1,8,32")
    args = ap.parse_args(argv)
    import gguf

    import engine.engine as em
    from engine.engine import Engine
    from engine.native import ffi, lib
    from tests.engine.gguf_factory import make_random_gguf

    marks: dict[str, float] = {}
    em.lib = _Stub(lib, ffi, marks)  # type: ignore[assignment]
    has_greedy = "greedy" in inspect.signature(Engine.forward).parameters
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_gguf(Path(tmp) / "v.gguf", n_vocab=V, n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32,
                                n_expert=4, n_expert_used=2, weight_type=gguf.GGMLQuantizationType.Q8_0)
        eng = Engine.open(path, threads=1, kv_tokens=128 * 1024, block_size=16)
        print(f"engine from {Path(em.__file__).resolve().parent.parent}; greedy={'yes' if has_greedy else 'no'}")
        for n in (int(s) for s in args.seqs.split(",")):
            tabs = [array("i", eng.blocks.allocate(-(-(40 + args.steps + 8) // 16))) for _ in range(n)]
            for mode in ("logits", "greedy") if has_greedy else ("logits",):
                rows = []
                last, pos = [1] * n, 40
                for s in range(args.steps):
                    used = [tb[: pos // 16 + 1] for tb in tabs]  # the scheduler's tables grow block by block
                    t0 = time.perf_counter()
                    if mode == "greedy":
                        out = eng.forward(last, [pos] * n, list(range(n)), used, list(range(n)), greedy=True)
                        t1 = t2 = time.perf_counter()
                        last = out.tolist()
                    else:
                        out = eng.forward(last, [pos] * n, list(range(n)), used, list(range(n)))
                        t1 = time.perf_counter()
                        last = [int(x) for x in out.argmax(axis=1)]
                        t2 = time.perf_counter()
                    t3 = time.perf_counter()
                    pos += 1
                    if s >= 10:
                        rows.append((marks["c0"] - t0, t1 - marks["c1"], t2 - t1, t3 - t2, t3 - t0 - (marks["c1"] - marks["c0"])))
                    assert last == [WIN] * n
                med = np.median(np.array(rows), axis=0) * 1e6
                print(f"{n:>2} seqs {mode:>6}: before C {med[0]:6.1f} us, after C {med[1]:5.1f}, argmax {med[2]:6.1f}, "
                      f"ids to list {med[3]:4.1f}, host total {med[4]:6.1f} (medians of {len(rows)} steps)")
            for tb in tabs:
                eng.blocks.release(list(tb))
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
