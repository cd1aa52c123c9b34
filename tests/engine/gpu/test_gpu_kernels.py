"""The GPU kernel harness: every kernel against the CPU engine's reference on random data.

Dequantisation and activation quantisation must be bitwise equal to the CPU's; matrix
products (every quant type, every GPU path: reference, matvec, tiled dp4a GEMM) within 1e-3
of max|ref| of the CPU reference dot on the same 8-bit activations; paged attention (decode
and prefill tiles, both GPU paths) within 1e-3 of the CPU reference, and the prefill query-tile
kernel bitwise equal to the decode kernel; RMSNorm, RoPE (both layouts) and the router against
the CPU formulas.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from engine.native import ffi, lib, ptr
from tests.engine.gpu._env import rel_err, requires_gpu
from tests.engine.gpu._kernel_helpers import (
    attention_case,
    attention_heads,
    cpu_quant,
    cpu_quant_k,
    gcheck,
    gptr,
    harness_settings,
)
from tests.engine.test_kernels import (  # the CPU harness's: both harnesses check the same bytes
    Q8K_TYPES,
    c_dequant,
    random_blocks,
)

pytestmark = requires_gpu

# issue 32's types: the IQ codebooks (device copies of iq_grids.h), the 16-entry value tables, Q3_K's halves,
# Q2_K's per-16 minima
LOWBIT = ["Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4"]
QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", *LOWBIT]
FLOAT = ["F32", "F16", "BF16"]
PATHS = {"ref": 0, "matvec": 1, "gemm": 2, "auto": 3}


def tid(name: str) -> int:
    return int(GGMLQuantizationType[name])


@pytest.mark.parametrize("name", QUANT + FLOAT)
def test_dequantize_bitwise_equals_cpu(g: tuple, name: str) -> None:
    rng = np.random.default_rng(7)
    n = 256 * 24
    raw = random_blocks(name, n, rng)
    cpu = np.full(n, np.nan, np.float32)
    assert lib.st_dequantize(tid(name), ptr(raw), ptr(cpu, "float *"), n) == 0
    gpu = np.full(n, np.nan, np.float32)
    gcheck(g, g[1].stg_test_dequantize(tid(name), gptr(g, raw), gptr(g, gpu, "float *"), n))
    assert np.array_equal(cpu.view(np.uint32), gpu.view(np.uint32))


def test_quantize_activations_bitwise_equal_cpu(g: tuple) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 1024)) * rng.uniform(0.01, 10, size=(5, 1))).astype(np.float32)
    x[2, 64:96] = 0.0  # an all-zero block: scale 0
    cq, cd, cs = cpu_quant(x)
    gq, gd, gs = np.empty_like(cq), np.empty_like(cd), np.empty_like(cs)
    gcheck(g, g[1].stg_test_quantize_act(gptr(g, x, "float *"), 5, 1024, gptr(g, gq, "int8_t *"),
                                         gptr(g, gd, "float *"), gptr(g, gs, "int32_t *")))
    assert np.array_equal(cq, gq) and np.array_equal(cd.view(np.uint32), gd.view(np.uint32)) and np.array_equal(cs, gs)


def test_quantize_activations_per256_bitwise_equal_cpu(g: tuple) -> None:
    """k_quant_act256 (the view linear() makes for the per-256 types) gives st_quantize_act_k's codes, scales and
    sums of 16 bit for bit, in the per-32 layout: each 256-group's scale in its 8 blocks' places. Rows of very
    different ranges, an all-zero group (scale 0), a group whose largest value is negative, and exact halves of
    the scale (round half away from zero)."""
    rng = np.random.default_rng(5)
    T, K = 6, 2048
    x = (rng.standard_normal((T, K)) * rng.uniform(1e-3, 30, size=(T, 1))).astype(np.float32)
    x[1, 256:512] = 0.0
    x[3, 512:768] *= 0.01
    x[3, 600] = -7.0
    x[4, :256] = (np.arange(256) - 128).astype(np.float32) * np.float32(0.5)  # scale 1 (amax 127): x / d at
    x[4, 0] = -127.0  # every half, rounded away from zero
    cq, cd, cs = cpu_quant_k(x)
    gq, gd, gs = np.empty_like(cq), np.empty((T, K // 32), np.float32), np.empty((T, K // 16), np.int32)
    gcheck(g, g[1].stg_test_quantize_act256(gptr(g, x, "float *"), T, K, gptr(g, gq, "int8_t *"),
                                            gptr(g, gd, "float *"), gptr(g, gs, "int32_t *")))
    assert np.array_equal(cq, gq)
    assert np.array_equal(np.repeat(cd, 8, axis=1).view(np.uint32), gd.view(np.uint32))
    assert np.array_equal(cs.astype(np.int32), gs)
    assert cd[1, 1] == 0.0 and not gq[1, 256:512].any()
    bad = np.zeros((1, 288), np.float32)  # K % 256 != 0: a typed error
    assert g[1].stg_test_quantize_act256(gptr(g, bad, "float *"), 1, 288, gptr(g, gq, "int8_t *"),
                                         gptr(g, gd, "float *"), gptr(g, gs, "int32_t *")) != 0


def cpu_linear(name: str, w: np.ndarray, rows: int, k: int, x: np.ndarray) -> np.ndarray:
    """The CPU reference kernels (variant ref) over the same 8-bit activations."""
    T = x.shape[0]
    rb = w.size // rows
    out = np.empty((T, rows), np.float32)
    res = ffi.new("float *")
    if name in FLOAT:
        for t in range(T):
            xp = ptr(x[t], "float *")
            for r in range(rows):
                assert lib.st_vec_dot_f(tid(name), lib.ST_VARIANT_REF, ptr(w[r * rb : (r + 1) * rb]), xp, k, res) == 0
                out[t, r] = res[0]
        return out
    if name in Q8K_TYPES:
        # the CPU's and the GPU's kernels of these types both read the per-256 view of x (st_quantize_act_k; the
        # GPU's k_quant_act256 gives the same codes and scales): the float64 dot of the dequantised rows with it
        qk, dk, _ = cpu_quant_k(x)
        xa = (qk.reshape(T, -1, 256) * dk[:, :, None].astype(np.float64)).reshape(T, k)
        wd = np.stack([c_dequant(name, w[r * rb : (r + 1) * rb], k) for r in range(rows)]).astype(np.float64)
        return (xa @ wd.T).astype(np.float32)
    qs, d, s = cpu_quant(x)
    for t in range(T):
        qp, dp, sp = ptr(qs[t], "int8_t *"), ptr(d[t], "float *"), ptr(s[t], "int32_t *")
        for r in range(rows):
            assert lib.st_vec_dot_q(tid(name), lib.ST_VARIANT_REF, ptr(w[r * rb : (r + 1) * rb]), qp, dp, sp, k,
                                    res) == 0
            out[t, r] = res[0]
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return (x / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


@pytest.mark.parametrize("n_tok", [1, 3, 8, 70])
@pytest.mark.parametrize("name", QUANT + FLOAT)
def test_linear_every_path_matches_cpu_reference(g: tuple, name: str, n_tok: int) -> None:
    rng = np.random.default_rng(100 + n_tok)
    rows, k = 72, 768  # three k-quant super-blocks; 72 rows: a partial GEMM tile
    w, w2 = random_blocks(name, rows * k, rng), random_blocks(name, rows * k, rng)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    ref = cpu_linear(name, w, rows, k, x)
    ref_sw = silu(ref) * cpu_linear(name, w2, rows, k, x)  # the fused gate/up form
    paths = ["ref", "matvec", "auto"] + (["gemm"] if name in QUANT else [])
    for path in paths:
        for second, want in ((None, ref), (w2, ref_sw)):
            out = np.full((n_tok, rows), np.nan, np.float32)
            gcheck(g, g[1].stg_test_linear(tid(name), PATHS[path], gptr(g, w), g[0].NULL if second is None else
                                           gptr(g, second), rows, k, gptr(g, x, "float *"), n_tok,
                                           gptr(g, out, "float *")))
            assert rel_err(out, want) <= 1e-3, (name, path, second is not None, rel_err(out, want))


@pytest.mark.parametrize(("k", "n_tok"), [(768, 5), (2304, 19), (4096, 40)])
@pytest.mark.parametrize("name", QUANT)
def test_gemm_bitwise_equals_matvec(g: tuple, name: str, k: int, n_tok: int) -> None:
    """The tensor-core GEMM keeps the matvec's summation order: identical bits, so which kernel a
    step picks (by its size) cannot change a sequence's result. k = 2304: 72 sub-blocks, residues
    with 3 and 2 terms; 80 rows and n_tok pairs: partial tiles. The plain form also with 32 pairs
    per block (gemm_wide_min 1: a dense layer's wide tiles from the first block), and with its k
    loop split over 4 blocks (dense_split 1: the parts added by k_ksplit_combine as the butterfly's
    top levels; 16 pairs per block at 5 tokens, 32 above)."""
    rng = np.random.default_rng(k + n_tok)
    rows = 80
    w, w2 = random_blocks(name, rows * k, rng), random_blocks(name, rows * k, rng)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    for second in (None, w2):
        outs = []
        for path, wide, split in (("matvec", "256", "0"), ("gemm", "1000000", "0"), ("gemm", "1", "0"),
                                  ("gemm", "256", "1")):
            out = np.full((n_tok, rows), np.nan, np.float32)
            with harness_settings(g, gemm_wide_min=int(wide), dense_split=int(split)):
                gcheck(g, g[1].stg_test_linear(tid(name), PATHS[path], gptr(g, w), g[0].NULL if second is None else
                                               gptr(g, second), rows, k, gptr(g, x, "float *"), n_tok,
                                               gptr(g, out, "float *")))
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        for i, out in enumerate(outs[1:]):
            assert np.array_equal(outs[0].view(np.uint32), out.view(np.uint32)), (name, second is not None, i)


# every block layout of the GEMMs that load each k stage's weights into registers: 22-byte blocks (2-byte aligned),
# 34, 18, 136 (with an 8-byte header), 17 (any offset), 98 with a codebook, and Q6_K's 210 (the output head)
LOADED = ["Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4", "IQ3_XXS", "Q6_K"]


@pytest.mark.parametrize("n_tok", [8, 32, 512])
@pytest.mark.parametrize("name", LOADED)
def test_gemm_dense_forms_bitwise_equal_matvec(g: tuple, name: str, n_tok: int) -> None:
    """The GEMM gives the matvec's bits in every dense form: 16-pair tiles, 32-pair tiles (gemm_wide_min 1), the k
    loop split over 4 blocks (dense_split 1, up to 64 tokens), gate/up; the plain product within the tolerance of
    the CPU reference. k = 2304: residues of 3 and 2 sub-blocks; 80 rows: a partial tile."""
    rng = np.random.default_rng(17 * n_tok + len(name))
    rows, k = 80, 2304
    w, w2 = random_blocks(name, rows * k, rng), random_blocks(name, rows * k, rng)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    forms = [("matvec", 256, 0)] + [("gemm", wide, split) for wide, split in ((1000000, 0), (1, 0), (256, 1))]
    for second in (None, w2):
        outs = []
        for path, wide, split in forms:
            out = np.full((n_tok, rows), np.nan, np.float32)
            with harness_settings(g, gemm_wide_min=wide, dense_split=split):
                gcheck(g, g[1].stg_test_linear(tid(name), PATHS[path], gptr(g, w), g[0].NULL if second is None else
                                               gptr(g, second), rows, k, gptr(g, x, "float *"), n_tok,
                                               gptr(g, out, "float *")))
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        for form, out in zip(forms[1:], outs[1:], strict=True):
            assert np.array_equal(outs[0].view(np.uint32), out.view(np.uint32)), (name, second is not None, form)
        if second is None:
            assert rel_err(outs[1], cpu_linear(name, w, rows, k, x)) <= 1e-3


@pytest.mark.parametrize("n_tok", [8, 32, 512])
@pytest.mark.parametrize("name", LOADED)
def test_routed_gemm_bitwise_equals_matvec(g: tuple, name: str, n_tok: int) -> None:
    """Routed experts (skewed popularity) on the GEMM, plain and gate/up: the matvec's bits for every pair at 8, 32
    and 512 tokens."""
    rng = np.random.default_rng(5 * n_tok + len(name))
    n_expert, k_used, rows, k = 16, 4, 80, 768
    w = np.concatenate([random_blocks(name, rows * k, rng) for _ in range(n_expert)])
    w2 = np.concatenate([random_blocks(name, rows * k, rng) for _ in range(n_expert)])
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    pop = 1.0 / np.arange(1, n_expert + 1)
    ids = np.stack([rng.choice(n_expert, k_used, replace=False, p=pop / pop.sum()) for _ in range(n_tok)])
    ids = ids.astype(np.int32).reshape(-1)
    P = n_tok * k_used
    for second in (None, w2):
        outs = []
        for path in ("matvec", "gemm"):
            out = np.full((P, rows), np.nan, np.float32)
            gcheck(g, g[1].stg_test_routed_linear(tid(name), PATHS[path], gptr(g, w),
                                                  g[0].NULL if second is None else gptr(g, second), n_expert, rows,
                                                  k, gptr(g, x, "float *"), n_tok, gptr(g, ids, "int32_t *"),
                                                  k_used, gptr(g, out, "float *")))
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), (name, second is not None)


@pytest.mark.parametrize("n_tok", [5, 19, 40])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K"])
def test_qkv_segments_bitwise_equal_matvec(g: tuple, name: str, n_tok: int) -> None:
    """q / k / v in one row-segmented launch (separate weight buffers and outputs, as the attention
    block has them): the fused matvec and the split GEMM over the stacked rows (dense_split 1) give
    each segment the bits of its own plain matvec; segments whose rows are not whole 64-row tiles
    are refused on the GEMM path (typed error)."""
    with harness_settings(g, dense_split=1):
        qkv_segments(g, name, n_tok)


def qkv_segments(g: tuple, name: str, n_tok: int) -> None:
    rng = np.random.default_rng(n_tok)
    k, rows = 768, [192, 64, 64]
    w = random_blocks(name, sum(rows) * k, rng)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    row_bytes = w.size // sum(rows)
    ref = []
    for i, r in enumerate(rows):
        wi = np.ascontiguousarray(w[sum(rows[:i]) * row_bytes:(sum(rows[:i]) + r) * row_bytes])
        out = np.full((n_tok, r), np.nan, np.float32)
        gcheck(g, g[1].stg_test_linear(tid(name), PATHS["matvec"], gptr(g, wi), g[0].NULL, r, k, gptr(g, x, "float *"),
                                       n_tok, gptr(g, out, "float *")))
        ref.append(out.reshape(-1))
    ref_all = np.concatenate(ref)
    assert np.isfinite(ref_all).all()
    seg_rows = np.array(rows, np.int64)
    for path in ("matvec", "gemm"):
        out = np.full(ref_all.size, np.nan, np.float32)
        gcheck(g, g[1].stg_test_linear_seg(tid(name), PATHS[path], gptr(g, w), len(rows), gptr(g, seg_rows, "int64_t *"),
                                           k, gptr(g, x, "float *"), n_tok, gptr(g, out, "float *")))
        assert np.array_equal(ref_all.view(np.uint32), out.view(np.uint32)), path
    odd = np.array([160, 96, 64], np.int64)  # 160 and 96: not whole tiles
    assert g[1].stg_test_linear_seg(tid(name), PATHS["gemm"], gptr(g, w), len(rows), gptr(g, odd, "int64_t *"), k,
                                    gptr(g, x, "float *"), n_tok, gptr(g, out, "float *")) != 0


@pytest.mark.parametrize(("n_tok", "k_used", "n_expert"), [(70, 4, 8), (300, 8, 32), (5, 2, 8)])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K", "IQ3_XXS", "Q3_K", "Q2_K", "MXFP4", "IQ4_XS"])
def test_routed_gemm_tiles_bitwise_equal_matvec(g: tuple, name: str, n_tok: int, k_used: int, n_expert: int) -> None:
    """Routed experts (grouped on the GPU, skewed popularity: groups of 1 to ~100 pairs): the GEMM
    (over the grouping's tile list where that is fewer blocks than the (largest group) x (groups)
    grid) and the matvec give the same bits for every pair, gate/up form too; so does gate/up's GEMM
    with its k loop split over 2 blocks per tile (routed_split_max: the parts added by k_ksplit_routed;
    Q4_K up to 16 tokens, else the unsplit form); one expert's pairs against the CPU."""
    rng = np.random.default_rng(n_tok * n_expert)
    rows, k = 80, 512
    w = np.concatenate([random_blocks(name, rows * k, rng) for _ in range(n_expert)])
    w2 = np.concatenate([random_blocks(name, rows * k, rng) for _ in range(n_expert)])
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    pop = 1.0 / np.arange(1, n_expert + 1)  # Zipf-like: expert 0 in most tokens
    ids = np.stack([rng.choice(n_expert, k_used, replace=False, p=pop / pop.sum()) for _ in range(n_tok)])
    ids = ids.astype(np.int32).reshape(-1)
    P = n_tok * k_used
    for second in (None, w2):
        outs = []
        for path, split_max in (("matvec", 0), ("gemm", 0), ("gemm", 64)):
            out = np.full((P, rows), np.nan, np.float32)
            with harness_settings(g, routed_split_max=split_max):
                gcheck(g, g[1].stg_test_routed_linear(tid(name), PATHS[path], gptr(g, w),
                                                      g[0].NULL if second is None else gptr(g, second), n_expert, rows,
                                                      k, gptr(g, x, "float *"), n_tok, gptr(g, ids, "int32_t *"),
                                                      k_used, gptr(g, out, "float *")))
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        for o in outs[1:]:
            assert np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)), (name, second is not None)
        if second is None:
            plain = outs[0]
    e = int(ids[0])
    pairs = np.flatnonzero(ids == e)
    rb = w.size // (n_expert * rows)
    ref = cpu_linear(name, w[e * rows * rb : (e + 1) * rows * rb], rows, k, x[pairs // k_used])
    assert rel_err(plain[pairs], ref) <= 1e-3


@pytest.mark.parametrize(("n_tok", "k_used", "n_expert"), [(5, 2, 8), (16, 8, 32)])
def test_routed_split_quantisation_bitwise(g: tuple, n_tok: int, k_used: int, n_expert: int) -> None:
    """The routed gate/up GEMM of a decode step of <= 16 tokens (Q4_K over the tile list, its k loop split over
    2 blocks per tile) whose combine k_ksplit_routed also quantises the output for the down projection: the float
    rows are the matvec's and the 8-bit blocks the CPU's st_quantize_act of them, bit for bit; without the split
    (routed_split_max 0) the harness reports that nothing was quantised."""
    rng = np.random.default_rng(31 * n_tok + n_expert)
    rows, k = 96, 512
    w = np.concatenate([random_blocks("Q4_K", rows * k, rng) for _ in range(n_expert)])
    w2 = np.concatenate([random_blocks("Q4_K", rows * k, rng) for _ in range(n_expert)])
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    pop = 1.0 / np.arange(1, n_expert + 1)
    ids = np.stack([rng.choice(n_expert, k_used, replace=False, p=pop / pop.sum()) for _ in range(n_tok)])
    ids = ids.astype(np.int32).reshape(-1)
    P = n_tok * k_used
    plain = np.full((P, rows), np.nan, np.float32)
    gcheck(g, g[1].stg_test_routed_linear(tid("Q4_K"), PATHS["matvec"], gptr(g, w), gptr(g, w2), n_expert, rows, k,
                                          gptr(g, x, "float *"), n_tok, gptr(g, ids, "int32_t *"), k_used,
                                          gptr(g, plain, "float *")))
    out = np.full((P, rows), np.nan, np.float32)
    hq, hd, hs = np.zeros((P, rows), np.int8), np.zeros((P, rows // 32), np.float32), np.zeros((P, rows // 16), np.int32)
    args = (tid("Q4_K"), gptr(g, w), gptr(g, w2), n_expert, rows, k, gptr(g, x, "float *"), n_tok,
            gptr(g, ids, "int32_t *"), k_used, gptr(g, out, "float *"), gptr(g, hq, "int8_t *"), gptr(g, hd, "float *"),
            gptr(g, hs, "int32_t *"))
    gcheck(g, g[1].stg_test_routed_quant(*args))
    assert np.isfinite(out).all() and np.array_equal(out.view(np.uint32), plain.view(np.uint32))
    cq, cd, cs = cpu_quant(out)
    assert np.array_equal(cq, hq) and np.array_equal(cd.view(np.uint32), hd.view(np.uint32)) and np.array_equal(cs, hs)
    with harness_settings(g, routed_split_max=0):
        assert g[1].stg_test_routed_quant(*args) != 0


@pytest.mark.parametrize("k", [256, 2048, 4096, 7168, 12288])
def test_head_and_down_decode_forms_bitwise_equal_gemm(g: tuple, k: int) -> None:
    """The batch-1 forms of the output head and the routed down projection give the GEMM's bits (which are the
    matvec's): a dense single-token Q6_K matvec of at least 65,536 rows (the head) on k_q6_stage with the most rows
    per warp whose copies fit 48 KB of shared memory (K 256: 4 rows of 210 bytes, not 16-byte aligned; K 2,048: 4;
    K 4,096: 2; K 7,168, DeepSeek-V3's: 2 rows of 5,880 bytes, the weight's last 16-byte granule partial; K 12,288:
    1), the row count ending inside a warp's rows; and a routed Q4_K plain matvec of single-pair passes (1 or 2
    tokens, 8 of 16 experts each) on k_linear_q_rows<Q4_K, 8>."""
    rng = np.random.default_rng(k)
    rows = 65536 + 41
    w = random_blocks("Q6_K", rows * k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    outs = []
    for path in ("matvec", "gemm"):
        out = np.full((1, rows), np.nan, np.float32)
        gcheck(g, g[1].stg_test_linear(tid("Q6_K"), PATHS[path], gptr(g, w), g[0].NULL, rows, k, gptr(g, x, "float *"),
                                       1, gptr(g, out, "float *")))
        outs.append(out)
    assert np.isfinite(outs[0]).all() and np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), k
    if k >= 4096:
        return
    n_expert, rows, k_used = 16, 80, 8
    w = np.concatenate([random_blocks("Q4_K", rows * k, rng) for _ in range(n_expert)])
    for n_tok in (1, 2):
        x = rng.standard_normal((n_tok, k)).astype(np.float32)
        ids = np.concatenate([rng.choice(n_expert, k_used, replace=False) for _ in range(n_tok)]).astype(np.int32)
        outs = []
        for path in ("matvec", "gemm"):
            out = np.full((ids.size, rows), np.nan, np.float32)
            gcheck(g, g[1].stg_test_routed_linear(tid("Q4_K"), PATHS[path], gptr(g, w), g[0].NULL, n_expert, rows, k,
                                                  gptr(g, x, "float *"), n_tok, gptr(g, ids, "int32_t *"), k_used,
                                                  gptr(g, out, "float *")))
            outs.append(out)
        assert np.isfinite(outs[0]).all() and np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), n_tok


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "IQ4_NL", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("k", [64, 128, 256, 512, 544, 4096])
def test_one_token_matvec_forms_bitwise_equal_warp_per_row(g: tuple, name: str, k: int) -> None:
    """The one-token forms of a dense matvec give the bits of k_linear_q's warp per row with 2 sub-blocks a lane in
    flight (the same rows at two tokens: each token's sum is the one-token kernel's), within 1e-3 of the CPU
    reference: rows of at most 16 sub-blocks on k_linear_q_short (4, 8 or 16 lanes per row, as DeepSeek-V3's
    per-head attn_k_b of 128 and attn_v_b of 512 elements run; K 544, 17 sub-blocks, stays on k_linear_q), few
    long rows (K 4,096: 128 sub-blocks, 301 rows, as q_a / kv_a) on k_linear_q with 8 in flight. The row count
    ends inside a warp's rows."""
    if k % 256 and name in ("Q4_K", "Q6_K"):
        pytest.skip("a K-quant row is whole 256-element blocks")
    rng = np.random.default_rng(k)
    rows = 301
    w = random_blocks(name, rows * k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    outs = []
    for xs in (x, np.repeat(x, 2, axis=0)):
        out = np.full((len(xs), rows), np.nan, np.float32)
        gcheck(g, g[1].stg_test_linear(tid(name), PATHS["matvec"], gptr(g, w), g[0].NULL, rows, k,
                                       gptr(g, xs, "float *"), len(xs), gptr(g, out, "float *")))
        outs.append(out)
    assert np.isfinite(outs[0]).all()
    for t in (0, 1):
        assert np.array_equal(outs[0][0].view(np.uint32), outs[1][t].view(np.uint32)), (name, k, t)
    assert rel_err(outs[0], cpu_linear(name, w, rows, k, x)) <= 1e-3


def mla_attention(g: tuple, G: int, ref: int, case: tuple, q: np.ndarray, pos: np.ndarray, seq: np.ndarray,
                  kl: int) -> np.ndarray:
    """stg_test_mla_attention over ``case`` (kc, block tables, block size): the heads' latent outputs [T, H, kl]."""
    kc, tables, bs = case
    T, H, ck = q.shape
    out = np.full((T, H, kl), np.nan, np.float32)
    gcheck(g, g[1].stg_test_mla_attention(G, ref, gptr(g, kc, "uint16_t *"), kc.size // (bs * ck), bs,
                                          gptr(g, tables, "int32_t *"), tables.shape[1], tables.shape[0],
                                          gptr(g, q, "float *"), gptr(g, pos, "int32_t *"), gptr(g, seq, "int32_t *"),
                                          T, H, kl, ck - kl, gptr(g, out, "float *")))
    return out


def test_mla_attention_bitwise_equals_reference(g: tuple) -> None:
    """deepseek2's latent attention (k_mla_attention: loads ahead of use, two keys per warp) gives the reference
    kernel's bits (k_mla_attention_ref) at every G (heads per block: 1, 2, 4, 8; a head's bits depend on none), over
    3 sequences of a paged cache with tokens at positions inside the first 64-key chunk, at its end, at 64 and past
    several chunks (the last chunk's key count not a multiple of 4 or 8); within 1e-4 of max|ref| of a float64
    softmax over the f16 rows. And the G a step picks: 1 at batch 1 of DeepSeek-V3's 128 heads, 8 from 8 tokens."""
    rng = np.random.default_rng(32)
    H, kl, rd, bs, n_seq, max_blocks = 16, 512, 64, 16, 3, 12
    ck = kl + rd
    n_blocks = n_seq * max_blocks + 2
    tables = rng.permutation(n_blocks)[: n_seq * max_blocks].astype(np.int32).reshape(n_seq, max_blocks)
    kc16 = (rng.standard_normal((n_blocks, bs, ck)) * 0.5).astype(np.float16)
    kc = kc16.view(np.uint16).reshape(-1)
    pos = np.array([0, 5, 63, 64, 150, 190, 37], np.int32)
    seq = np.array([0, 1, 2, 0, 1, 2, 0], np.int32)
    T = pos.size
    q = (rng.standard_normal((T, H, ck)) * 0.1).astype(np.float32)
    case = (kc, tables, bs)
    base = mla_attention(g, 8, 1, case, q, pos, seq, kl)
    assert np.isfinite(base).all()
    for G in (1, 2, 4, 8):
        for ref in (0, 1):
            got = mla_attention(g, G, ref, case, q, pos, seq, kl)
            assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), (G, ref)
    rows = kc16.astype(np.float64)
    for t in range(T):
        keys = np.arange(pos[t] + 1)
        kr = rows[tables[seq[t], keys // bs], keys % bs]  # [n_keys, ck]
        sc = q[t].astype(np.float64) @ kr.T  # [H, n_keys]
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        want = (p / p.sum(axis=1, keepdims=True)) @ kr[:, :kl]
        assert rel_err(base[t], want) <= 1e-4, t
    att_g = g[1].stg_test_mla_att_g
    assert [att_g(1, 128, 576), att_g(2, 128, 576), att_g(4, 128, 576), att_g(8, 128, 576), att_g(64, 128, 576)] == [
        1, 2, 4, 8, 8]
    assert att_g(64, 12, 576) == 4 and att_g(1, 12, 576) == 1


@pytest.mark.parametrize("k", [768, 2048])
def test_routed_iq3_rows_bitwise_equal_gemm_and_match_cpu(g: tuple, k: int) -> None:
    """IQ3_XXS routed experts at one pair per pass (DeepSeek-V3's and GLM-4.5's down projection at 1-2 tokens) take
    k_linear_q_rows<IQ3_XXS, 8> on the matvec path: the GEMM's bits for every pair, each pair's row within 1e-3 of
    the CPU reference (the float64 product on the per-256 view); 83 rows end inside a warp's 8."""
    rng = np.random.default_rng(k + 3)
    n_expert, rows, k_used = 16, 83, 8
    w = np.concatenate([random_blocks("IQ3_XXS", rows * k, rng) for _ in range(n_expert)])
    per = w.size // n_expert
    for n_tok in (1, 2):
        x = rng.standard_normal((n_tok, k)).astype(np.float32)
        ids = np.concatenate([rng.choice(n_expert, k_used, replace=False) for _ in range(n_tok)]).astype(np.int32)
        outs = []
        for path in ("matvec", "gemm"):
            out = np.full((ids.size, rows), np.nan, np.float32)
            gcheck(g, g[1].stg_test_routed_linear(tid("IQ3_XXS"), PATHS[path], gptr(g, w), g[0].NULL, n_expert, rows,
                                                  k, gptr(g, x, "float *"), n_tok, gptr(g, ids, "int32_t *"), k_used,
                                                  gptr(g, out, "float *")))
            outs.append(out)
        assert np.isfinite(outs[0]).all()
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), (k, n_tok)
        for p, e in enumerate(ids.tolist()):  # pair p: token p // k_used through expert e
            t = p // k_used
            ref = cpu_linear("IQ3_XXS", w[e * per : (e + 1) * per], rows, k, x[t : t + 1])
            assert rel_err(outs[0][p : p + 1], ref) <= 1e-3, (k, n_tok, p, rel_err(outs[0][p : p + 1], ref))


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ3_XXS"])
@pytest.mark.parametrize("k", [768, 2048])
def test_routed_chunk_quantisation_bitwise(g: tuple, name: str, k: int) -> None:
    """The routed gate/up matvec of one pair per pass quantising its own output a 32-row chunk at a time
    (k_linear_q_chunk: one block of 16 warps x 2 rows per chunk and expert, as decode steps of 1-7 tokens run
    it) gives k_linear_q's float rows bit for bit (the routed matvec without the quantisation) and the CPU's
    st_quantize_act blocks of them, at 1 and 2 tokens (the second token shares experts with the first:
    groups of two passes)."""
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
        ref = np.full((P, rows), np.nan, np.float32)
        gcheck(g, g[1].stg_test_routed_linear(tid(name), PATHS["matvec"], gptr(g, w), gptr(g, w2), n_expert, rows, k,
                                              gptr(g, x, "float *"), n_tok, gptr(g, ids, "int32_t *"), k_used,
                                              gptr(g, ref, "float *")))
        assert np.isfinite(ref).all()
        cq, cd, cs = cpu_quant(ref)
        out = np.full((P, rows), np.nan, np.float32)
        hq, hd, hs = np.zeros((P, rows), np.int8), np.zeros((P, rows // 32), np.float32), \
            np.zeros((P, rows // 16), np.int32)
        gcheck(g, g[1].stg_test_routed_chunk_quant(tid(name), gptr(g, w), gptr(g, w2), n_expert, rows, k,
                                                   gptr(g, x, "float *"), n_tok, gptr(g, ids, "int32_t *"), k_used,
                                                   gptr(g, out, "float *"), gptr(g, hq, "int8_t *"),
                                                   gptr(g, hd, "float *"), gptr(g, hs, "int32_t *")))
        assert np.array_equal(ref.view(np.uint32), out.view(np.uint32)), (name, k, n_tok)
        assert np.array_equal(cq, hq) and np.array_equal(cd.view(np.uint32), hd.view(np.uint32)) and \
            np.array_equal(cs, hs), (name, k, n_tok)


@pytest.mark.parametrize(("k", "n_tok"), [(2048, 9), (2048, 16), (2048, 24), (2048, 32), (2048, 61), (2048, 64),
                                           (992, 13), (992, 40)])
@pytest.mark.parametrize("name", FLOAT)
def test_router_mlp_bitwise_equal_f_rows(g: tuple, name: str, k: int, n_tok: int) -> None:
    """Float weights of at most 1,024 rows (a router) at 9-64 pairs run k_linear_f_rows_mlp (weights before the
    wait, each pass's activations all loaded before the first fma): the bits of k_linear_f_rows<8>, which takes
    the same rows at more than 64 pairs (each pass of 8 pairs is independent, so a token's row is the same in
    both launches); K = 992 leaves part of the last 128-wide stride empty."""
    rng = np.random.default_rng(5 * n_tok + k)
    rows = 130
    w = random_blocks(name, rows * k, rng)
    x = rng.standard_normal((72, k)).astype(np.float32)  # 72 tokens: k_linear_f_rows<8>
    outs = []
    for t in (72, n_tok):
        out = np.full((t, rows), np.nan, np.float32)
        gcheck(g, g[1].stg_test_linear(tid(name), PATHS["matvec"], gptr(g, w), g[0].NULL, rows, k,
                                       gptr(g, x, "float *"), t, gptr(g, out, "float *")))
        outs.append(out)
    assert np.isfinite(outs[0]).all() and np.array_equal(outs[0][:n_tok].view(np.uint32), outs[1].view(np.uint32))


@pytest.mark.parametrize(("k", "n_tok"), [(2048, 1), (4096, 2), (7168, 1), (8192, 2), (7000, 1)])
@pytest.mark.parametrize("name", FLOAT)
def test_router_rows_pre_bitwise_equal_f_rows(g: tuple, name: str, k: int, n_tok: int) -> None:
    """A decode router (1-2 tokens, 256 rows) with its weights loaded before the wait (f_rows_pre: ROUTER_PRE
    weights per thread up to K 2,048, ROUTER_PRE_WIDE up to 8,192: DeepSeek-V3's 7,168, GLM-4.5's 4,096) gives
    f_rows_body's bits (k_linear_f_rows); K 7,000 leaves part of the last stride empty; too long a K for a form is
    refused."""
    rng = np.random.default_rng(k + n_tok)
    rows = 256
    w = random_blocks(name, rows * k, rng)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    outs = []
    for pre in (0, 1, 2):
        out = np.full((n_tok, rows), np.nan, np.float32)
        rc = g[1].stg_test_router_rows(tid(name), pre, gptr(g, w), rows, k, gptr(g, x, "float *"), n_tok,
                                       gptr(g, out, "float *"))
        if pre == 1 and k > 2048:
            assert rc != 0
            continue
        gcheck(g, rc)
        outs.append(out)
    assert np.isfinite(outs[0]).all()
    for out in outs[1:]:
        assert np.array_equal(outs[0].view(np.uint32), out.view(np.uint32)), (name, k, n_tok)


@pytest.mark.parametrize(("hd", "bs", "n_kv", "nq", "p0"), [(64, 16, 2, 1, 0), (64, 16, 2, 1, 300),
                                                             (128, 32, 4, 1, 1000), (128, 16, 1, 16, 40),
                                                             (80, 16, 2, 7, 13), (256, 16, 1, 3, 64)])
def test_attention_matches_cpu_reference(g: tuple, hd: int, bs: int, n_kv: int, nq: int, p0: int) -> None:
    rng = np.random.default_rng(hd + p0)
    n_blocks, table, k, v = attention_case(rng, hd, bs, n_kv, p0 + nq)
    kvh = n_kv - 1
    q = (rng.standard_normal((nq, hd)) / np.sqrt(hd)).astype(np.float32)
    ref = np.empty((nq, hd), np.float32)
    assert lib.st_attention(lib.ST_VARIANT_REF, ptr(k, "uint16_t *"), ptr(v, "uint16_t *"), ptr(table, "int32_t *"),
                            bs, hd, n_kv, kvh, ptr(q, "float *"), nq, p0, ptr(ref, "float *")) == 0
    for path in ("ref", "auto"):
        out = np.full((nq, hd), np.nan, np.float32)
        gcheck(g, g[1].stg_test_attention(PATHS[path], gptr(g, k, "uint16_t *"), gptr(g, v, "uint16_t *"), n_blocks,
                                          gptr(g, table, "int32_t *"), len(table), bs, hd, n_kv, kvh,
                                          gptr(g, q, "float *"), nq, p0, gptr(g, out, "float *")))
        assert rel_err(out, ref) <= 1e-3, (path, rel_err(out, ref))


@pytest.mark.parametrize(("hd", "bs", "n_head", "n_kv", "nq", "p0"), [
    (128, 16, 32, 4, 37, 0),  # Qwen3-30B-A3B's heads: 8 query heads per kv head, 2 tokens per tile
    (128, 16, 32, 4, 20, 913),  # a later chunk: keys before the step, chunk boundaries inside tiles
    (64, 32, 8, 8, 19, 5),  # no grouping: 16 tokens per tile
    (32, 16, 4, 2, 33, 64)])  # the small test models' shape
def test_attention_tile_bitwise_equals_k_attention(g: tuple, hd: int, bs: int, n_head: int, n_kv: int, nq: int,
                                                   p0: int) -> None:
    """The prefill query-tile kernel gives every (token, head) exactly k_attention's bits (floats and the
    output's 8-bit blocks), so a token's result does not depend on its step; both within 1e-3 of the CPU."""
    rng = np.random.default_rng(hd + nq + p0)
    c = attention_case(rng, hd, bs, n_kv, p0 + nq)
    _, table, k, v = c
    qd = n_head * hd
    q = (rng.standard_normal((nq, qd)) / np.sqrt(hd)).astype(np.float32)
    (o0, q0, d0, s0), (o1, q1, d1, s1) = (attention_heads(g, tile, c, bs, hd, n_head, n_kv, q, p0) for tile in (0, 1))
    assert np.isfinite(o1).all()
    assert np.array_equal(o0.view(np.uint32), o1.view(np.uint32)), np.abs(o0 - o1).max()
    assert np.array_equal(q0, q1) and np.array_equal(d0.view(np.uint32), d1.view(np.uint32)) and np.array_equal(s0, s1)
    G = n_head // n_kv
    for h in (0, n_head - 1):  # against the CPU reference for a first and a last head
        ref = np.empty((nq, hd), np.float32)
        qh = np.ascontiguousarray(q[:, h * hd : (h + 1) * hd])
        for i in range(0, nq, 16):  # the CPU reference takes at most ST_ATTN_TILE (16) queries a call
            n = min(16, nq - i)
            assert lib.st_attention(lib.ST_VARIANT_REF, ptr(k, "uint16_t *"), ptr(v, "uint16_t *"),
                                    ptr(table, "int32_t *"), bs, hd, n_kv, h // G, ptr(qh[i:], "float *"), n, p0 + i,
                                    ptr(ref[i:], "float *")) == 0
        assert rel_err(o1[:, h * hd : (h + 1) * hd], ref) <= 1e-3


@pytest.mark.parametrize("n", [576, 5000, 7168])
def test_rmsnorm_matches_cpu_formula(g: tuple, n: int) -> None:
    """k_rmsnorm against the CPU's formula: rows in registers (576) and longer ones (5,000, 7,168: DeepSeek-V3's
    embedding, a chunk of RMS_CH elements per thread at a time, the last one partial); with the 8-bit blocks of the
    same launch (n a multiple of 32) the same floats and the CPU's blocks of them."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, n)).astype(np.float32) * 3
    w = (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    ss = (x.astype(np.float64) ** 2).sum(axis=1, keepdims=True)
    scale = (1.0 / np.sqrt(ss / n + 1e-5)).astype(np.float32)
    ref = w * (x * scale)  # float32 operations, the CPU's order
    out = np.empty_like(x)
    gcheck(g, g[1].stg_test_rmsnorm(gptr(g, x, "float *"), gptr(g, w, "float *"), 6, n, 1e-5, gptr(g, out, "float *")))
    assert rel_err(out, ref) <= 1e-6
    if n % 32:
        return
    yq = np.full_like(x, np.nan)
    qs, d, s = np.zeros((6, n), np.int8), np.zeros((6, n // 32), np.float32), np.zeros((6, n // 16), np.int32)
    gcheck(g, g[1].stg_test_rmsnorm_q(gptr(g, x, "float *"), gptr(g, w, "float *"), 6, n, 1e-5,
                                      gptr(g, yq, "float *"), gptr(g, qs, "int8_t *"), gptr(g, d, "float *"),
                                      gptr(g, s, "int32_t *")))
    assert np.array_equal(yq.view(np.uint32), out.view(np.uint32))
    cq, cd, cs = cpu_quant(out)
    assert np.array_equal(cq, qs) and np.array_equal(cd.view(np.uint32), d.view(np.uint32)) and np.array_equal(cs, s)


@pytest.mark.parametrize("rope_type", [0, 2])
def test_rope_both_layouts_match_cpu_formula(g: tuple, rope_type: int) -> None:
    rng = np.random.default_rng(rope_type)
    n_tok, n_heads, hd, rd = 5, 3, 64, 48  # partial rotary dimension
    x = rng.standard_normal((n_tok, n_heads * hd)).astype(np.float32)
    pos = np.array([0, 1, 17, 500, 4095], np.int32)
    inv = (1.0 / np.power(10000.0, np.arange(0, rd, 2, dtype=np.float64) / rd)).astype(np.float32)
    ref = x.copy().reshape(n_tok, n_heads, hd)
    for t in range(n_tok):
        theta = np.float32(pos[t]) * inv
        cs, sn = np.cos(theta.astype(np.float64)).astype(np.float32), np.sin(theta.astype(np.float64)).astype(np.float32)
        i = np.arange(rd // 2)
        a, b = (i, i + rd // 2) if rope_type == 2 else (2 * i, 2 * i + 1)
        x0, x1 = ref[t][:, a].copy(), ref[t][:, b].copy()
        ref[t][:, a] = x0 * cs - x1 * sn
        ref[t][:, b] = x0 * sn + x1 * cs
    out = x.copy()
    gcheck(g, g[1].stg_test_rope(gptr(g, out, "float *"), gptr(g, pos, "int32_t *"), n_tok, n_heads, hd, rd, rope_type,
                                 10000.0))
    assert rel_err(out, ref.reshape(n_tok, -1)) <= 1e-5


def test_router_top_k_matches_cpu_rule(g: tuple) -> None:
    rng = np.random.default_rng(11)
    T, ne, k = 33, 128, 8
    logits = (rng.standard_normal((T, ne)) * 2).astype(np.float32)
    logits[0, 5] = logits[0, 9] = 30.0  # a tie: the lower index first
    ids = np.empty((T, k), np.int32)
    w = np.empty((T, k), np.float32)
    gcheck(g, g[1].stg_test_router(gptr(g, logits, "float *"), T, ne, k, gptr(g, ids, "int32_t *"), gptr(g, w, "float *")))
    p = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ref_ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    assert np.array_equal(ids, ref_ids)
    assert rel_err(w, np.take_along_axis(p, ref_ids, axis=1)) <= 1e-5


@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.parametrize(("n", "misalign"), [(151936, 0), (151936, 1), (300, 0), (4097, 0), (5, 2)])
def test_greedy_pick_equals_numpy_argmax(g: tuple, rows: int, n: int, misalign: int) -> None:
    """k_argmax_split (the step's greedy pick, 16 blocks per row) == np.argmax == the CPU's st_argmax_rows, on
    random rows and rows with ties, -inf, NaN and signed zeros; the bench model's vocabulary, an odd length and an
    unaligned start (the kernel's scalar loop), slices shorter than a thread's share and empty ones at n = 5."""
    from tests.engine.test_greedy_pick import tricky_rows

    rng = np.random.default_rng(rows * 1000 + n + misalign)
    base = tricky_rows(rng, max(n, 8))[:, :n]
    x = np.ascontiguousarray(np.concatenate([base, rng.standard_normal((max(rows - len(base), 0), n))
                                             .astype(np.float32)])[:rows])
    rng.shuffle(x)
    gpu = np.full(rows, -7, np.int32)
    gcheck(g, g[1].stg_test_argmax(gptr(g, x, "float *"), rows, n, misalign, gptr(g, gpu, "int32_t *")))
    cpu = np.full(rows, -7, np.int32)
    assert lib.st_argmax_rows(ptr(x, "float *"), rows, n, ptr(cpu, "int32_t *")) == 0
    assert gpu.tolist() == cpu.tolist() == np.argmax(x, axis=1).tolist()
