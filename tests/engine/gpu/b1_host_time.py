"""Where a batch-1 decode step's host time goes, on the benchmark's model (run on the GPU machine after
device_run.sh's setup; builds the model if missing):

    python3 tests/engine/gpu/b1_host_time.py [--steps 256] [--seqs 1] [--greedy]

Decodes as bench.engine_gpu's decode() does (32-token prompt, greedy argmax on the host) and times, per step,
with time.perf_counter: Engine.forward's Python before the C call (arrays, batch struct), the C call
(stg_forward: uploads, graph launch, the logits copy, the wait), the Python after it, the argmax, and the
GPU's own step time (st_step_stats.t_total). Prints the medians in microseconds; the C call minus the GPU
step is stg_forward's host share (launch and wake-up latency included). --greedy: the engine's own pick
(Engine.forward(greedy=True): the argmax on the GPU, only the ids copied back; the argmax column is then
the ids' conversion to a list), as the scheduler runs greedy requests since session 11."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--greedy", action="store_true", help="the device's greedy pick instead of the host's argmax")
    ap.add_argument("--sched", choices=sorted(SCHED), default=None,
                    help="set the primary context's scheduling flag (cuDevicePrimaryCtxSetFlags) before the engine opens")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    if args.sched:
        set_sched(SCHED[args.sched])
    from bench.engine_gpu import bench_model
    from engine.engine import Engine

    eng = Engine.open(bench_model(), device="cuda:0", kv_tokens=8 * 1024, block_size=16, prefill_chunk=512)
    gpu = eng._gpu  # type: ignore[attr-defined]
    marks: dict[str, float] = {}
    inner = gpu.forward

    def timed(batch: object, stats: object) -> None:
        marks["c0"] = time.perf_counter()
        inner(batch, stats)
        marks["c1"] = time.perf_counter()

    gpu.forward = timed
    rng = np.random.default_rng(1)
    n, bs, V, prompt = args.seqs, eng.block_size, eng.hparams.n_vocab, 32
    tabs = [eng.blocks.allocate(-(-(prompt + args.steps + 3) // bs)) for _ in range(n)]
    last = [int(np.argmax(eng.prefill([int(t) for t in rng.integers(0, V, size=prompt)], tb))) for tb in tabs]
    rows: list[tuple[float, ...]] = []
    again: list[tuple[float, float]] = []  # the index arrays right after a step, then once more at once
    pos = prompt
    for s in range(args.steps + 2):
        t0 = time.perf_counter()
        out = eng.forward(last, [pos] * n, list(range(n)), tabs, list(range(n)), greedy=args.greedy)
        t1 = time.perf_counter()
        last = out.tolist() if args.greedy else [int(x) for x in out.argmax(axis=1)]
        t2 = time.perf_counter()
        index_arrays(tabs)
        t3 = time.perf_counter()
        index_arrays(tabs)
        t4 = time.perf_counter()
        pos += 1
        if s >= 2:
            again.append((t3 - t2, t4 - t3))
            rows.append((marks["c0"] - t0, marks["c1"] - marks["c0"], t1 - marks["c1"], t2 - t1, t2 - t0,
                         eng.last_stats.t_total))
    micro = pieces(eng, tabs)
    eng.close()
    a = np.array(rows) * 1e6
    med = np.median(a, axis=0)
    names = ("forward before C", "stg_forward", "forward after C", "argmax", "wall step", "GPU step")
    print(f"batch {n}, {args.steps} steps, {'device pick' if args.greedy else 'host argmax'}, medians (us): " + ", ".join(f"{k} {v:.1f}" for k, v in zip(names, med, strict=True)))
    print(f"stg_forward minus GPU step: {med[1] - med[5]:.1f} us; wall minus GPU step: {med[4] - med[5]:.1f} us; "
          f"p90 wall {np.percentile(a[:, 4], 90):.1f} us")
    b = np.median(np.array(again), axis=0) * 1e6
    print(f"sched {args.sched or 'default'}: the index arrays right after a step {b[0]:.1f} us, at once again {b[1]:.1f} us")
    print("Engine.forward's pieces alone (us a call, 2,000 calls): " + ", ".join(f"{k} {v:.1f}" for k, v in micro.items()))
    return 0


SCHED = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}  # CU_CTX_SCHED_*


def set_sched(flags: int) -> None:
    """The primary context's scheduling flags through the driver API (before any context exists)."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    fn = getattr(cu, "cuDevicePrimaryCtxSetFlags_v2", None) or cu.cuDevicePrimaryCtxSetFlags
    rc = fn(dev, ctypes.c_uint(flags))
    print(f"cuDevicePrimaryCtxSetFlags({flags}): {rc}")


def index_arrays(tabs: list) -> None:
    """Engine.forward's index arrays for one batch-1 step (the block table and four int32 vectors)."""
    bt = np.full((len(tabs), max(len(t) for t in tabs)), -1, dtype=np.int32)
    for i, row in enumerate(tabs):
        bt[i, : len(row)] = row
    for v in ([5], [40], [0], [0]):
        np.ascontiguousarray(v, dtype=np.int32)


def pieces(eng: object, tabs: list) -> dict[str, float]:
    """Engine.forward's host pieces one at a time, in a loop (is one of them slow on this machine, or all?)."""
    from engine.native import ffi, ptr

    gpu, V, n = eng._gpu, eng.hparams.n_vocab, 2000  # type: ignore[attr-defined]
    x = np.random.default_rng(0).standard_normal((1, V)).astype(np.float32)
    out: dict[str, float] = {}

    def arrays() -> None:
        index_arrays(tabs)

    tok = np.zeros(1, np.int32)

    def cdata() -> None:
        b = ffi.new("st_batch *")
        b.tokens, b.pos, b.seq = ptr(tok, "int32_t *"), ptr(tok, "int32_t *"), ptr(tok, "int32_t *")
        b.block_tables = ptr(tok, "int32_t *")
        ffi.new("st_step_stats *")

    for name, fn in (("index arrays", arrays), ("st_batch / stats cdata", cdata),
                     ("pinned logits array", lambda: gpu.host_array((1, V), np.float32)),
                     ("argmax", lambda: [int(v) for v in x.argmax(axis=1)])):
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t) / n * 1e6
    return out


if __name__ == "__main__":
    sys.exit(main())
