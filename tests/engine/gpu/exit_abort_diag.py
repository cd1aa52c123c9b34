"""A small GPU workload for run 51's `free(): invalid size` check under compute-sanitizer (run on the GPU
machine after device_run.sh's setup; docs/gpu-runs.md run 51):

    compute-sanitizer --tool memcheck python3 tests/engine/gpu/exit_abort_diag.py [--quick] [--device cpu]

Opens the benchmark's model (--quick: its 4-layer form, built here in seconds if missing), prefills
16 and 64 tokens (the split GEMMs' combine, STRATA_GPU_COMBINE_FUSE, applies at 16-64 tokens) and 512
tokens, decodes 16 sequences for 2 steps, closes the engine and exits; prints one line per part so
that an abort at exit shows after the last one."""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-dir", default="/tmp/strata-bench")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args(argv)
    from bench.engine_gpu import bench_model
    from engine.engine import Engine

    path = bench_model(args.model_dir, quick=args.quick)
    rng = np.random.default_rng(0)
    with Engine.open(path, device=args.device, kv_tokens=4096, block_size=16, prefill_chunk=512) as eng:
        V, bs = eng.hparams.n_vocab, eng.block_size
        for n in (16, 64, 512):
            b = eng.blocks.allocate(-(-n // bs))
            assert b is not None
            lg = eng.prefill([int(t) for t in rng.integers(0, V, size=n)], b)
            eng.blocks.release(b)
            print(f"prefill {n}: argmax {int(np.argmax(lg))}", flush=True)
        n_seq, plen = 16, 32
        tabs = [eng.blocks.allocate(-(-(plen + 3) // bs)) for _ in range(n_seq)]
        last = []
        for tb in tabs:
            assert tb is not None
            last.append(int(np.argmax(eng.prefill([int(t) for t in rng.integers(0, V, size=plen)], tb))))
        for s in range(2):
            lg = eng.forward(last, [plen + s] * n_seq, list(range(n_seq)), tabs, list(range(n_seq)))
            last = [int(x) for x in lg.argmax(axis=1)]
        for tb in tabs:
            eng.blocks.release(tb)
        print(f"decode {n_seq} x 2: {last[:4]}", flush=True)
    print("engine closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
