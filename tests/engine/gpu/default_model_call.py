"""Diagnosis, not a test: the numbers behind test_default_model_gpu_matches_cpu on the device
(run by default_model_call.sh b, which puts the source package on PYTHONPATH).

    python tests/engine/gpu/default_model_call.py

For the test's first prompt, against both CPU oracles (the reference kernels, which the test
uses, and the default auto variant): the logits' max error relative to max|ref| over all
positions (and the worst position), then the 64 greedy tokens: the first step where the GPU
leaves each, with that CPU variant's margin between its token and the GPU's, relative to
max|logit|.
"""

from __future__ import annotations

import numpy as np

from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.native import VARIANTS, _variant_from_env, lib

TOPIC = "the sea"  # the test's first prompt
N_GREEDY = 64


def compare(path: str, prompt: list[int], got: np.ndarray, b: list[int], name: str) -> list[int]:
    # A fresh engine per variant: generate() keeps the prompt's full KV blocks in the prefix
    # cache, and another variant's run would reuse them (KV computed by the other kernels).
    with Engine.open(path, threads=2, kv_tokens=4096) as cpu:
        return _compare(cpu, prompt, got, b, name)


def _compare(cpu: Engine, prompt: list[int], got: np.ndarray, b: list[int], name: str) -> list[int]:
    ref = cpu.logits_for(prompt)
    per = np.abs(got.astype(np.float64) - ref).max(axis=1) / np.abs(ref).max()
    print(f"[{name}] logits: GPU max rel diff {per.max():.3e} (position {int(per.argmax())}), "
          f"max|ref| {float(np.abs(ref).max()):.3f}; first 3 of the last position: CPU {ref[-1, :3]}, GPU {got[-1, :3]}")
    a = cpu.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True).token_ids
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    if first is None:
        print(f"[{name}] greedy: {N_GREEDY} tokens identical to the GPU's")
    else:
        lg = cpu.logits_for(prompt + a[:first])[-1]
        gap = float(lg[a[first]] - lg[b[first]]) / float(np.abs(lg).max())
        print(f"[{name}] greedy: first step leaving the GPU {first}: CPU {a[first]}, GPU {b[first]}, "
              f"CPU margin {gap:.3e} of max|logit|")
    return a


def main() -> int:
    path = build_default_model(default_model_path())
    with Engine.open(path, device="cuda:0", kv_tokens=4096) as gpu:
        prompt = gpu.render_chat([{"role": "user", "content": f"Write one sentence about {TOPIC}."}])
        print(f"prompt of {len(prompt)} tokens; CPU kernels by default: {lib.st_get_variant()} (1 ref, 2 avx2, 3 avx512)")
        got = gpu.logits_for(prompt)
        g = gpu.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True)
        auto = compare(str(path), prompt, got, g.token_ids, "CPU auto")
        assert lib.st_set_variant(VARIANTS["ref"]) == 0
        try:
            refs = compare(str(path), prompt, got, g.token_ids, "CPU reference")
        finally:
            assert lib.st_set_variant(VARIANTS["auto"]) == 0
            _variant_from_env()
        first = next((i for i, (x, y) in enumerate(zip(auto, refs, strict=True)) if x != y), None)
        print(f"CPU auto vs reference greedy: first differing step {first}")
        print("GPU text:", repr(g.text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
