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
from tests.engine.gpu._kernel_helpers import attention_case, attention_heads, cpu_quant, gcheck, gptr
from tests.engine.gpu._steps import decode_logits
from tests.engine.gpu.test_gpu_kernels import PATHS, random_blocks, tid

pytestmark = requires_gpu

# every switch of the batch-1 set (and the Q6_K GEMM's wide loads), and the value that turns it off (the form
# before session 9)
OFF = {"STRATA_GPU_Q6_WIDE": "0", "STRATA_GPU_ATT_PRE": "0", "STRATA_GPU_ROUTER_PRE": "0", "STRATA_GPU_MV_ROWS": "1",
       "STRATA_GPU_Q6_GEMM_WIDE": "0", "STRATA_GPU_ATT_UNROLL": "0", "STRATA_GPU_Q6_ROWS": "0"}


def linear(g: tuple, name: str, path: str, w: np.ndarray, w2: np.ndarray | None, rows: int, k: int,
           x: np.ndarray) -> np.ndarray:
    out = np.full((x.shape[0], rows), np.nan, np.float32)
    gcheck(g, g[1].stg_test_linear(tid(name), PATHS[path], gptr(g, w), g[0].NULL if w2 is None else gptr(g, w2), rows,
                                   k, gptr(g, x, "float *"), x.shape[0], gptr(g, out, "float *")))
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


HEADS = 16, 8, 2  # the attention cases' block size, query heads, kv heads


def heads_case(seed: int, hd: int, nq: int, p0: int) -> tuple[tuple, np.ndarray]:
    """An attention case (HEADS) of p0 + nq keys and nq queries [nq, 8 * hd] at positions p0..."""
    bs, n_head, n_kv = HEADS
    rng = np.random.default_rng(seed)
    c = attention_case(rng, hd, bs, n_kv, p0 + nq)
    return c, (rng.standard_normal((nq, n_head * hd)) / np.sqrt(hd)).astype(np.float32)


def heads(g: tuple, c: tuple, q: np.ndarray, hd: int, p0: int) -> tuple:
    """k_attention (the decode kernel, tile 0) on heads_case's case: the output and its 8-bit blocks."""
    bs, n_head, n_kv = HEADS
    return attention_heads(g, 0, c, bs, hd, n_head, n_kv, q, p0)


def decode_steps_equal(tmp_path: Path, outtype: str, ref: dict[str, str], variants: list[dict[str, str]],
                       **model: int) -> None:
    """Whole decode steps of a small random Qwen3-MoE (tests/engine/hf_models.py's maker with ``model``'s
    options, as ``outtype``) at 1 and 2 sequences: every step's logits with each of ``variants``' variables set
    bitwise equal to those with ``ref``'s."""
    H = pytest.importorskip("tests.engine.hf_models", reason="transformers (torch) builds the model")
    from engine.engine import Engine

    hf_dir, _ = H.MAKERS["qwen3moe"](tmp_path / "hf", **model)
    path = H.to_gguf(hf_dir, tmp_path / f"m.{outtype}.gguf", outtype)
    eng = Engine.open(path, device="cuda:0", kv_tokens=1024, block_size=16)
    try:
        for n_seq in (1, 2):
            want = decode_logits(eng, n_seq, 4, ref, prompt_len=20)
            for env in variants:
                got = decode_logits(eng, n_seq, 4, env, prompt_len=20)
                assert all(same(a, b) for a, b in zip(want, got, strict=True)), (outtype, n_seq, env)
    finally:
        eng.close()


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


@pytest.mark.parametrize(("hd", "nq", "p0"), [(128, 1, 300), (128, 3, 40), (64, 2, 77), (256, 1, 50), (32, 1, 20)])
def test_attention_vector_loads_bitwise(g: tuple, hd: int, nq: int, p0: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """k_attention's vector loads (ATT_V2 = 1: half2 values, 2: also q as float4 in the scores, 3: the scores over
    key pairs on half2 K loads; hd % 64 == 0, else the scalar form) give the same bits, floats and the output's
    8-bit blocks."""
    c, q = heads_case(hd + p0, hd, nq, p0)
    outs = []
    for v2 in ("0", "1", "2", "3"):
        monkeypatch.setenv("STRATA_GPU_ATT_V2", v2)
        outs.append(heads(g, c, q, hd, p0))
    o0, q0, d0, s0 = outs[0]
    assert np.isfinite(o0).all()
    for v2, (o1, q1, d1, s1) in zip((1, 2, 3), outs[1:], strict=True):
        assert same(o0, o1), (v2, np.abs(o0 - o1).max())
        assert np.array_equal(q0, q1) and same(d0, d1) and np.array_equal(s0, s1), v2


def test_decode_steps_bitwise_with_attention_vector_loads(tmp_path: Path) -> None:
    """Whole decode steps (the fused decode attention) of a small random Qwen3-MoE with head_dim 64 (the
    vector forms need hd % 64 == 0) at 1 and 2 sequences: bitwise equal with ATT_V2 at 0, 1, 2 and 3."""
    decode_steps_equal(tmp_path, "f32", {"STRATA_GPU_ATT_V2": "0"}, [{"STRATA_GPU_ATT_V2": v} for v in "123"],
                       head_dim=64)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_decode_steps_bitwise_with_every_switch(tmp_path: Path, outtype: str) -> None:
    """Whole decode steps (graphs, programmatic dependent launch) of a small random Qwen3-MoE (32 experts,
    top 8; F32 / Q8_0, so only the attention's and router's pre-wait reads apply): every step's logits at
    1 and 2 sequences bitwise equal with every switch off and at its default."""
    decode_steps_equal(tmp_path, outtype, OFF, [{}])


@pytest.mark.parametrize(("nq", "p0"), [(1, 300), (1, 47), (3, 40), (2, 15)])
def test_attention_unroll_bitwise(g: tuple, nq: int, p0: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """k_attention<1, 128> (ATT_UNROLL, session 11: head_dim 128 at compile time, a whole chunk's value loop
    unrolled, the softmax's reductions over 16 lanes) gives k_attention<1>'s bits, floats and 8-bit output blocks;
    whole and partial chunks, one to three tokens."""
    hd = 128
    c, q = heads_case(p0 + 7 * nq, hd, nq, p0)
    outs = []
    monkeypatch.setenv("STRATA_GPU_ATT_V2", "1")
    for unroll in ("0", "1"):
        monkeypatch.setenv("STRATA_GPU_ATT_UNROLL", unroll)
        outs.append(heads(g, c, q, hd, p0))
    (o0, q0, d0, s0), (o1, q1, d1, s1) = outs
    assert np.isfinite(o0).all()
    assert same(o0, o1), np.abs(o0 - o1).max()
    assert np.array_equal(q0, q1) and same(d0, d1) and np.array_equal(s0, s1)


def test_q6k_head_rows_per_warp_bitwise(g: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense single-token Q6_K matvec of at least 65,536 rows (the output head at batch 1) with 2 or 4 rows per
    warp (Q6_ROWS), with either unpack (Q6_WIDE), gives one row per warp's bits; the row count ends inside a
    warp's rows."""
    k, rows = 256, 65536 + 40
    rng = np.random.default_rng(rows)
    w = random_blocks("Q6_K", rows * k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    monkeypatch.setenv("STRATA_GPU_Q6_HEAD", "0")  # Q6_ROWS' own forms (K 256 would not take the staged one anyway)
    for wide in ("0", "1"):
        monkeypatch.setenv("STRATA_GPU_Q6_WIDE", wide)
        monkeypatch.setenv("STRATA_GPU_Q6_ROWS", "0")
        ref = linear(g, "Q6_K", "matvec", w, None, rows, k, x)
        assert np.isfinite(ref).all()
        for r in ("2", "4"):
            monkeypatch.setenv("STRATA_GPU_Q6_ROWS", r)
            assert same(ref, linear(g, "Q6_K", "matvec", w, None, rows, k, x)), (wide, r)


@pytest.mark.parametrize("k", [256, 2048, 4096])
def test_q6k_head_stage_bitwise(g: tuple, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """STRATA_GPU_Q6_HEAD 1 / 2 / 3 (k_q6_stage: each warp's 2 / 4 / 2 rows copied into shared memory by cp.async,
    3 with the copy before the wait, then Q6_ROWS' loop on the copy) give one row per warp's bits and Q6_ROWS=2's at
    the output head's kind of launch (a dense single-token Q6_K matvec of at least 65,536 rows), the row count ending
    inside a warp's rows; K 2,048 and 4,096 take it (4 rows a warp at 4,096 would pass 48 KB of shared memory and keep
    Q6_ROWS' form), K 256 (rows of 210 bytes) keeps Q6_ROWS' form."""
    rows = 65536 + 41
    rng = np.random.default_rng(k)
    w = random_blocks("Q6_K", rows * k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    monkeypatch.setenv("STRATA_GPU_Q6_HEAD", "0")
    monkeypatch.setenv("STRATA_GPU_Q6_ROWS", "0")
    ref = linear(g, "Q6_K", "matvec", w, None, rows, k, x)
    assert np.isfinite(ref).all()
    monkeypatch.setenv("STRATA_GPU_Q6_ROWS", "2")
    assert same(ref, linear(g, "Q6_K", "matvec", w, None, rows, k, x))
    for mode in ("1", "2", "3"):
        monkeypatch.setenv("STRATA_GPU_Q6_HEAD", mode)
        assert same(ref, linear(g, "Q6_K", "matvec", w, None, rows, k, x)), mode


def test_decode_steps_bitwise_with_attention_unroll(tmp_path: Path) -> None:
    """Whole decode steps (graphs, programmatic dependent launch, the fused decode attention) of a small random
    Qwen3-MoE with head_dim 128 at 1 and 2 sequences: bitwise equal with ATT_UNROLL off and on."""
    decode_steps_equal(tmp_path, "q8_0", {"STRATA_GPU_ATT_UNROLL": "0"}, [{"STRATA_GPU_ATT_UNROLL": "1"}],
                       head_dim=128)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("k", [768, 2048])
def test_gu_chunk_bitwise(g: tuple, name: str, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """STRATA_GPU_GU_CHUNK 1 / 2 / 3 (session 12): the routed gate/up matvec of one pair per pass quantising its
    own output a 32-row chunk at a time (one block of 32 warps, of 16 warps x 2 rows, or a cluster of 8 blocks)
    gives k_linear_q's float rows bit for bit (GU_CHUNK=0, the matvec without quantisation) and the CPU's
    st_quantize_act blocks of them (k_quant_act's values), at 1 and 2 tokens (the second token shares experts
    with the first: groups of two passes); with it off the harness reports that nothing was quantised."""
    rng = np.random.default_rng(k + len(name))
    n_expert, rows, k_used = 16, 96, 8
    w = np.concatenate([random_blocks(name, rows * k, rng) for _ in range(n_expert)])
    w2 = np.concatenate([random_blocks(name, rows * k, rng) for _ in range(n_expert)])
    for n_tok in (1, 2):
        x = rng.standard_normal((n_tok, k)).astype(np.float32)
        first = rng.choice(n_expert, k_used, replace=False)
        rest = rng.permutation(np.setdiff1d(np.arange(n_expert), first[:3]))[: k_used - 3]
        ids = np.concatenate([first, np.concatenate([first[:3], rest])][:n_tok]).astype(np.int32)
        P = n_tok * k_used
        monkeypatch.setenv("STRATA_GPU_GU_CHUNK", "0")
        ref = np.full((P, rows), np.nan, np.float32)
        gcheck(g, g[1].stg_test_routed_linear(tid(name), PATHS["matvec"], 0, gptr(g, w), gptr(g, w2), n_expert, rows,
                                              k, gptr(g, x, "float *"), n_tok, gptr(g, ids, "int32_t *"), k_used,
                                              gptr(g, ref, "float *")))
        assert np.isfinite(ref).all()
        cq, cd, cs = cpu_quant(ref)
        out = np.full((P, rows), np.nan, np.float32)
        hq, hd, hs = np.zeros((P, rows), np.int8), np.zeros((P, rows // 32), np.float32), \
            np.zeros((P, rows // 16), np.int32)
        args = (tid(name), gptr(g, w), gptr(g, w2), n_expert, rows, k, gptr(g, x, "float *"), n_tok,
                gptr(g, ids, "int32_t *"), k_used, gptr(g, out, "float *"), gptr(g, hq, "int8_t *"),
                gptr(g, hd, "float *"), gptr(g, hs, "int32_t *"))
        assert g[1].stg_test_routed_chunk_quant(*args) != 0  # off: the plain matvec, nothing quantised
        for v in ("1", "2", "3"):
            monkeypatch.setenv("STRATA_GPU_GU_CHUNK", v)
            out[:], hq[:], hd[:], hs[:] = np.nan, 0, np.nan, 0
            gcheck(g, g[1].stg_test_routed_chunk_quant(*args))
            assert same(ref, out), (name, k, n_tok, v, np.abs(ref - out).max())
            assert np.array_equal(cq, hq) and same(cd, hd) and np.array_equal(cs, hs), (name, k, n_tok, v)


def test_gu_chunk_decode_steps_bitwise(tmp_path: Path) -> None:
    """Whole decode steps (graphs, programmatic dependent launch) of a small random Qwen3-MoE as Q8_0 (32 experts,
    top 8, 32-row experts: one chunk each) at 1 and 2 sequences: every step's logits bitwise equal with
    STRATA_GPU_GU_CHUNK at 1, 2 and 3 against 0 (the routed gate/up quantising its own output in-block, ffn_block's
    k_quant_act launch gone)."""
    decode_steps_equal(tmp_path, "q8_0", {"STRATA_GPU_GU_CHUNK": "0"}, [{"STRATA_GPU_GU_CHUNK": v} for v in "123"])
