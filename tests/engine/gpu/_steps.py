"""Whole decode steps of an open engine under given environment settings, for the tests that compare
two settings' logits bit for bit (test_gpu_b1_knobs.py, test_gpu_att_b1.py)."""

from __future__ import annotations

import os

import numpy as np


def decode_logits(eng: object, n_seq: int, steps: int, env: dict[str, str], prompt_len: int = 32) -> list[np.ndarray]:
    """Distinct random prompts of prompt_len tokens (seeded by n_seq) prefilled, then `steps` greedy
    decode steps of n_seq sequences with the variables in env set (restored afterwards); every step's
    logits."""
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
