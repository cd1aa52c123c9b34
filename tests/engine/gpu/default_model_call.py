"""Diagnosis, not a test: the numbers behind test_default_model_gpu_matches_cpu on the device
(run by default_model_call.sh b, which puts the source package on PYTHONPATH).

    python tests/engine/gpu/default_model_call.py

For the test's first prompt: the logits' max error relative to max|ref| over all positions (and
the worst position), then the 64 greedy tokens of both devices: the first differing step, if
any, with the CPU's margin between its token and the GPU's, relative to max|logit|.
"""

from __future__ import annotations

import numpy as np

from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine

TOPIC = "the sea"  # the test's first prompt
N_GREEDY = 64


def main() -> int:
    path = build_default_model(default_model_path())
    with Engine.open(path, threads=2, kv_tokens=4096) as cpu, Engine.open(path, device="cuda:0", kv_tokens=4096) as gpu:
        prompt = cpu.render_chat([{"role": "user", "content": f"Write one sentence about {TOPIC}."}])
        ref, got = cpu.logits_for(prompt), gpu.logits_for(prompt)
        per = np.abs(got.astype(np.float64) - ref).max(axis=1) / np.abs(ref).max()
        print(f"prompt of {len(prompt)} tokens: logits max rel diff {per.max():.3e} (position {int(per.argmax())}), "
              f"max|ref| {float(np.abs(ref).max()):.3f}")
        ra = cpu.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True)
        a, b = ra.token_ids, gpu.generate(prompt, max_tokens=N_GREEDY, ignore_eos=True).token_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is None:
            print(f"greedy: {N_GREEDY} tokens identical")
        else:
            lg = cpu.logits_for(prompt + a[:first])[-1]
            gap = float(lg[a[first]] - lg[b[first]]) / float(np.abs(lg).max())
            print(f"greedy: first differing step {first}: CPU {a[first]}, GPU {b[first]}, CPU margin {gap:.3e} of max|logit|")
        print("CPU text:", repr(ra.text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
