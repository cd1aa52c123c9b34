"""Same bits with a switch at two values, on the benchmark's model (run on the GPU machine after
device_run.sh's setup; builds the model if missing):

    python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_COMBINE_FUSE [--values 0,1] [--seqs 1,16,32] [--steps 4]
    python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_ATT_PRE,STRATA_GPU_MV_STAGE --values 0,1   (each value to all)

For each sequence count, distinct random 32-token prompts are prefilled and decoded for --steps
greedy steps once per value of the variable (read by the engine at every step); every step's
logits must be bitwise equal across the values. Prints one line per count and exits 1 on a
difference. A check for switches that promise "same results" (the split GEMM's combine, the
router tail, ...) at the real shapes, which the random test models do not all reach."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def decode_logits(eng: object, n_seq: int, steps: int, env: dict[str, str], prompt_len: int = 32) -> list[np.ndarray]:
    """Distinct random prompts of prompt_len tokens (seeded by n_seq) prefilled, then `steps` greedy
    decode steps of n_seq sequences with the variables in env set (restored afterwards); every step's
    logits. Also serves test_gpu_b1_knobs.py."""
    rng = np.random.default_rng(n_seq)
    V, bs = eng.hparams.n_vocab, eng.block_size  # type: ignore[attr-defined]
    tabs = [eng.blocks.allocate(-(-(prompt_len + steps + 1) // bs)) for _ in range(n_seq)]  # type: ignore[attr-defined]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        last, out = [], []
        for tb in tabs:
            assert tb is not None
            ids = [int(t) for t in rng.integers(0, V, size=prompt_len)]
            last.append(int(np.argmax(eng.prefill(ids, tb))))  # type: ignore[attr-defined]
        for s in range(steps):
            pos = [prompt_len + s] * n_seq
            lg = eng.forward(last, pos, list(range(n_seq)), tabs, list(range(n_seq)))  # type: ignore[attr-defined]
            out.append(np.array(lg, copy=True))
            last = [int(x) for x in lg.argmax(axis=1)]
        return out
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for tb in tabs:
            eng.blocks.release(tb)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("env")
    ap.add_argument("--values", default="0,1")
    ap.add_argument("--seqs", default="1,16,32")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    from bench.engine_gpu import bench_model
    from engine.engine import Engine

    eng = Engine.open(bench_model(), device="cuda:0", kv_tokens=8 * 1024, block_size=16, prefill_chunk=512)
    values = args.values.split(",")
    bad = 0
    for n_seq in (int(x) for x in args.seqs.split(",")):
        names = args.env.split(",")  # several variables: each set to the value
        ref = decode_logits(eng, n_seq, args.steps, dict.fromkeys(names, values[0]))
        for v in values[1:]:
            got = decode_logits(eng, n_seq, args.steps, dict.fromkeys(names, v))
            same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(ref, got, strict=True))
            diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got, strict=True))
            print(f"{args.env} {values[0]} vs {v}, {n_seq} sequences x {args.steps} steps: "
                  f"{'bitwise equal' if same else f'DIFFERENT (max |diff| {diff:.3g})'}")
            bad += not same
    eng.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
