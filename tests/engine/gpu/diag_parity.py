"""Diagnosis, not a test: where the GPU's logits part from the CPU's on the random HF models.

    python tests/engine/gpu/diag_parity.py [arch:outtype ...]

Prints, per model, the error relative to max|ref| at each prompt position that exceeds 1e-4,
and whether the greedy continuations agree. STRATA_GPU_GEMM_MIN forces the kernel choice.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from engine.engine import Engine
from tests.engine import hf_models as H


def main(argv: list[str]) -> int:
    cases = [tuple(a.split(":")) for a in argv] or [("qwen2moe", "q5_0"), ("qwen2moe", "f32"), ("mixtral", "q4_1"),
                                                      ("qwen3moe", "q8_0")]
    rng = np.random.default_rng(42)  # the prompt of test_gpu_models
    _ = [[int(t) for t in rng.integers(0, 300, size=int(n))] for n in rng.integers(5, 40, size=16)]
    prompt = [int(t) for t in rng.integers(0, 300, size=40)]
    print("STRATA_GPU_GEMM_MIN =", os.environ.get("STRATA_GPU_GEMM_MIN", "(default)"))
    with tempfile.TemporaryDirectory() as tmp:
        for arch, qt in cases:
            hf, _ = H.MAKERS[arch](Path(tmp) / arch)
            path = H.to_gguf(hf, Path(tmp) / f"{arch}.{qt}.gguf", qt)
            with Engine.open(path, threads=2, kv_tokens=1024) as cpu, \
                    Engine.open(path, device="cuda:0", kv_tokens=1024) as gpu:
                ref, got = cpu.logits_for(prompt), gpu.logits_for(prompt)
                per = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
                bad = [(i, f"{e:.2e}") for i, e in enumerate(per) if e > 1e-4]
                a = cpu.generate(prompt, max_tokens=64, ignore_eos=True).token_ids
                b = gpu.generate(prompt, max_tokens=64, ignore_eos=True).token_ids
                first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                print(f"{arch}:{qt} max {per.max():.2e} at {int(per.argmax())}; positions > 1e-4: {bad[:12]}; "
                      f"greedy 64 first difference: {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
