"""The batch-1 decode switches of session 9 (strata_cuda.cu, "Batch-1 decode knobs"; docs/gpu-runs.md
runs 51-52) promise the bits of the form each replaces: they change when loads are issued, how wide
they are or how many rows a warp takes, never an arithmetic operation or its order. These tests hold
each one to that at the harness's shapes, and all of them together in whole decode steps of a small
model (the attention's and the router's pre-wait reads only run inside a step)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.engine.gpu._env import requires_gpu
from tests.engine.gpu._kernel_helpers import gcheck, gptr
from tests.engine.gpu.knob_bitwise import decode_logits
from tests.engine.gpu.test_gpu_kernels import PATHS, random_blocks, tid

pytestmark = requires_gpu

# every switch of the batch-1 set (and the Q6_K GEMM's wide loads), and the value that turns it off (the form
# before session 9)
OFF = {"STRATA_GPU_Q6_WIDE": "0", "STRATA_GPU_ATT_PRE": "0", "STRATA_GPU_ROUTER_PRE": "0", "STRATA_GPU_MV_ROWS": "1",
       "STRATA_GPU_Q6_GEMM_WIDE": "0"}


def linear(g: tuple, name: str, path: str, w: np.ndarray, w2: np.ndarray | None, rows: int, k: int,
           x: np.ndarray) -> np.ndarray:
    out = np.full((x.shape[0], rows), np.nan, np.float32)
    gcheck(g, g[1].stg_test_linear(tid(name), PATHS[path], gptr(g, w), g[0].NULL if w2 is None else gptr(g, w2), rows,
                                   k, gptr(g, x, "float *"), x.shape[0], gptr(g, out, "float *")))
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


@pytest.mark.parametrize("k", [256, 768, 2048])
def test_q6k_wide_loads_bitwise(g: tuple, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q6_K matvec with the wide loads (Q6_WIDE; k = 256 / 768: 210- and 630-byte rows, whose blocks
    start at every even offset) gives the 2-byte loads' bits and the GEMM's, with either unpack (Q6_GEMM_WIDE),
    one token and three, gate/up form too."""
    name = "Q6_K"
    rng = np.random.default_rng(k)
    rows = 80  # 20 blocks of 4 warps; not a multiple of 32 rows
    w, w2 = random_blocks(name, rows * k, rng), random_blocks(name, rows * k, rng)
    for n_tok in (1, 3):
        x = rng.standard_normal((n_tok, k)).astype(np.float32)
        for second in (None, w2):
            for env, v in OFF.items():
                monkeypatch.setenv(env, v)
            ref = linear(g, name, "matvec", w, second, rows, k, x)
            assert np.isfinite(ref).all()
            monkeypatch.setenv("STRATA_GPU_Q6_WIDE", "1")
            got = linear(g, name, "matvec", w, second, rows, k, x)
            assert same(ref, got), (name, k, n_tok, second is not None, "wide")
            got = linear(g, name, "gemm", w, second, rows, k, x)
            assert same(ref, got), (name, k, n_tok, second is not None, "gemm")
            monkeypatch.setenv("STRATA_GPU_Q6_GEMM_WIDE", "1")
            got = linear(g, name, "gemm", w, second, rows, k, x)
            assert same(ref, got), (name, k, n_tok, second is not None, "gemm wide")


@pytest.mark.parametrize("k", [768, 2048])
def test_routed_rows_per_warp_bitwise(g: tuple, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Routed Q4_K matvec of single-pair passes (1 or 2 tokens, 8 of 16 experts each: one pair per
    group, or two where both tokens chose an expert) with 2, 4 or 8 rows per warp (MV_ROWS) against
    one row per warp and against the GEMM over the tile list; the gate/up form (which keeps one row
    per warp) unchanged by the switch."""
    rng = np.random.default_rng(k + 1)
    n_expert, rows, k_used = 16, 80, 8
    w = np.concatenate([random_blocks("Q4_K", rows * k, rng) for _ in range(n_expert)])
    w2 = np.concatenate([random_blocks("Q4_K", rows * k, rng) for _ in range(n_expert)])

    def run(path: str, tiles: int, second: np.ndarray | None, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        out = np.full((ids.size, rows), np.nan, np.float32)
        gcheck(g, g[1].stg_test_routed_linear(tid("Q4_K"), PATHS[path], tiles, gptr(g, w),
                                              g[0].NULL if second is None else gptr(g, second), n_expert, rows, k,
                                              gptr(g, x, "float *"), x.shape[0], gptr(g, ids, "int32_t *"), k_used,
                                              gptr(g, out, "float *")))
        return out

    for n_tok in (1, 2):
        x = rng.standard_normal((n_tok, k)).astype(np.float32)
        ids = np.concatenate([rng.choice(n_expert, k_used, replace=False) for _ in range(n_tok)]).astype(np.int32)
        for second in (None, w2):
            monkeypatch.setenv("STRATA_GPU_MV_ROWS", "1")
            ref = run("matvec", 0, second, x, ids)
            assert np.isfinite(ref).all()
            for r in ("2", "4", "8"):
                monkeypatch.setenv("STRATA_GPU_MV_ROWS", r)
                assert same(ref, run("matvec", 0, second, x, ids)), (k, n_tok, second is not None, r)
            assert same(ref, run("gemm", 1, second, x, ids)), (k, n_tok, second is not None, "gemm")


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_decode_steps_bitwise_with_every_switch(tmp_path: Path, outtype: str) -> None:
    """Whole decode steps (graphs, programmatic dependent launch) of a small random Qwen3-MoE (32 experts,
    top 8; F32 / Q8_0, so only the attention's and router's pre-wait reads apply): every step's logits at
    1 and 2 sequences bitwise equal with every switch off and at its default."""
    H = pytest.importorskip("tests.engine.hf_models", reason="transformers (torch) builds the model")
    from engine.engine import Engine

    hf_dir, _ = H.MAKERS["qwen3moe"](tmp_path / "hf")
    path = H.to_gguf(hf_dir, tmp_path / f"m.{outtype}.gguf", outtype)
    eng = Engine.open(path, device="cuda:0", kv_tokens=1024, block_size=16)
    try:
        for n_seq in (1, 2):
            ref = decode_logits(eng, n_seq, 4, OFF, prompt_len=20)
            got = decode_logits(eng, n_seq, 4, {}, prompt_len=20)
            assert all(same(a, b) for a, b in zip(ref, got, strict=True)), (outtype, n_seq)
    finally:
        eng.close()
