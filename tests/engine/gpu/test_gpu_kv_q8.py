"""The GPU engine's 8-bit KV cache (``kv_type="q8_0"``, STG_KV_Q8_0): the CPU engine's Q8_0 cache (kv.c) on the
device, the same bytes for the same K / V values.

Kernel level (the harness): k_qkv_post's store writes exactly the bytes the CPU's quantiser (st_kv_q8_group) gives
for the same K / V rows, in kv.c's layout; the reference kernel (k_attention_ref over the 8-bit cache) equals the
CPU's 8-bit reference (st_attention_q8) within 1e-5 of max|ref| (the same operations; the GPU's expf may differ in
the last bit); the split decode kernel (tensor cores: q and p as f16 hi + lo, the integers exact as f16, the scales
applied in fp32) is held to 1e-3 of max|ref| of the reference, the rule of every GPU attention kernel, at 1, 17 and
4,099 cached tokens and 8 sequences of different lengths in one step, under the step's split rule and two others;
the tensor-core prefill kernel over a cached prefix, whose K and V enter as f16(q * d) (one more f16 rounding of
each value, like p's), within 2e-3.

Model level (a random F32 MoE model, head_dim 128, 4 query heads on 1 kv head, prompts of 700, 40 and 1,500 tokens
in prefill chunks of 256, so later chunks read an 8-bit prefix written by earlier steps): the GPU's logits on its 8-bit
cache against the CPU engine's on its 8-bit cache. A max-norm bound cannot hold on this model: the K / V the devices
quantise differ in the last bits, which moves a value by one step of its group now and then, and a top-2 routing
near-tie turns that into a jump; on the CPU alone a relative change of 1e-5 in the layers' weights moves the 700-token
logits by 0.18 of max|ref| (8-bit cache; 0.27 on the F16 cache), the 8-bit cache itself by 0.73 from the F16 cache.
What a wrong read (block, scale, key count, a stale prefix) cannot avoid is moving most rows: so each prefill chunk's
median row error (max|diff| of the row / max|ref|) is held to MODEL_MEDIAN_RATIO of the same chunk's median distance
between the CPU's 8-bit and F16 caches (the quantisation's own effect), and argmax agreement to MODEL_AGREE; greedy
tokens identical up to the CPU's first near-tie within the same noise. A model the 8-bit kernels do not take
(head_dim 32) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine
from engine.native import ffi as cffi
from engine.native import lib, ptr
from tests.engine.gguf_factory import make_random_gguf
from tests.engine.gpu._env import rel_err, requires_gpu
from tests.engine.gpu._kernel_helpers import assumed_smem_optin, gcheck, gptr, mma_forms
from tests.engine.gpu._model_checks import check_greedy, tokens_of, write_hd128_moe

pytestmark = requires_gpu

REF_TOL = 1e-3  # any GPU attention vs the reference, of max|ref|
PREFILL_TOL = 2e-3  # the prefill kernel: K and V rounded to f16 after their scale
GPU_REF_TOL = 1e-5  # the GPU's reference kernel vs the CPU's
# the model test (see the module docstring): per prefill chunk, the median row error GPU q8 vs CPU q8 as a share of
# the 8-bit cache's own median effect (CPU q8 vs CPU f16); argmax agreement; the CPU's top-2 gap where greedy parts.
# On the CPU, relative weight changes of 1e-5 / 3e-5 / 1e-4 give shares 0.06-0.10 / 0.11-0.20 / 0.24-0.35 and
# agreement 0.97-1.0 / 0.96-0.975 / 0.92-0.975; a wrong read moves rows by the quantisation's effect or more (share >= 1)
MODEL_MEDIAN_RATIO = 0.3
MODEL_AGREE = 0.9
MODEL_GREEDY_GAP = 5e-2


def cpu_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """st_kv_q8_group over the rows of x [n, m] (m % 32 == 0): (q [n, m] int8, d [n, m / 32] F16 bits)."""
    n, m = x.shape
    q = np.zeros((n, m), np.int8)
    d = np.zeros((n, m // 32), np.uint16)
    for i in range(n):
        for gi in range(m // 32):
            grp = np.ascontiguousarray(x[i, 32 * gi : 32 * gi + 32], np.float32)
            qq = cffi.new("int8_t[32]")
            dd = cffi.new("uint16_t *")
            lib.st_kv_q8_group(cffi.cast("const float *", cffi.from_buffer(grp)), qq, dd)
            q[i, 32 * gi : 32 * gi + 32] = np.frombuffer(cffi.buffer(qq), np.int8)
            d[i, gi] = dd[0]
    return q, d


def np_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0's rule in numpy (for large caches; the bytes of cpu_q8: checked in test_kv_store_writes_the_cpu_bytes
    through the C quantiser): d = max|x| / 127 (float32), q = round half away from zero of x * (1/d)."""
    n, m = x.shape
    g = x.reshape(n, m // 32, 32).astype(np.float32)
    d = (np.abs(g).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(
        np.float32
    )
    y = (g * inv[..., None]).astype(np.float32)
    q = (np.sign(y) * np.floor(np.abs(y).astype(np.float64) + 0.5)).astype(np.int8)
    return q.reshape(n, m), d.astype(np.float16).view(np.uint16)


def cache_of(k: np.ndarray, v: np.ndarray, slots: np.ndarray, n_blocks: int, bs: int, quant=cpu_q8) -> tuple:  # noqa: ANN001
    """kv.c's 8-bit layout of rows k, v [n, kd] at the given slots, quantised by `quant` (the CPU's C quantiser by
    default): (k8 [nb, kd, bs], ks [nb, kd / 32, bs], v8 [nb, bs, kd], vs [nb, bs, kd / 32]) flattened."""
    kd = k.shape[1]
    k8 = np.zeros((n_blocks, kd, bs), np.int8)
    ks = np.zeros((n_blocks, kd // 32, bs), np.uint16)
    v8 = np.zeros((n_blocks, bs, kd), np.int8)
    vs = np.zeros((n_blocks, bs, kd // 32), np.uint16)
    kq, kdd = quant(k)
    vq, vdd = quant(v)
    for i, s in enumerate(slots.tolist()):
        b, j = divmod(s, bs)
        k8[b, :, j], ks[b, :, j], v8[b, j], vs[b, j] = kq[i], kdd[i], vq[i], vdd[i]
    return k8.ravel(), ks.ravel(), v8.ravel(), vs.ravel()


def test_kv_store_writes_the_cpu_bytes(g: tuple) -> None:
    rng = np.random.default_rng(7)
    n_kv, hd, bs, n_blocks, n = 4, 128, 16, 6, 40
    kd = n_kv * hd
    k = (rng.standard_normal((n, kd)) * rng.choice([0.01, 1.0, 30.0], size=(n, 1))).astype(np.float32)
    v = rng.standard_normal((n, kd)).astype(np.float32)
    k[3, 32:64] = 0.0  # a zero group: d = 0, every q 0
    v[5, :32] = np.float32(0.5) * np.sign(rng.standard_normal(32)).astype(np.float32)  # ties at x / d = 127
    v[6, 64:96] = np.linspace(-1, 1, 32, dtype=np.float32)
    slots = rng.permutation(n_blocks * bs)[:n].astype(np.int32)
    k8 = np.zeros(n_blocks * bs * kd, np.int8)
    v8 = np.zeros_like(k8)
    ks = np.zeros(n_blocks * bs * kd // 32, np.uint16)
    vs = np.zeros_like(ks)
    gcheck(
        g,
        g[1].stg_test_kv_store_q8(
            gptr(g, k, "float *"),
            gptr(g, v, "float *"),
            n,
            n_kv,
            hd,
            bs,
            n_blocks,
            gptr(g, slots, "int32_t *"),
            gptr(g, k8, "int8_t *"),
            gptr(g, ks, "uint16_t *"),
            gptr(g, v8, "int8_t *"),
            gptr(g, vs, "uint16_t *"),
        ),
    )
    want = cache_of(k, v, slots, n_blocks, bs)
    for name, got, w in zip(
        ("K values", "K scales", "V values", "V scales"), (k8, ks, v8, vs), want, strict=True
    ):
        bad = np.flatnonzero(got != w)
        assert bad.size == 0, f"{name}: {bad.size} bytes differ from the CPU's (first at {bad[:4].tolist()})"
    for x in (k, v):  # the numpy rule the large caches below use is the C quantiser's
        assert all(np.array_equal(a, b) for a, b in zip(np_q8(x), cpu_q8(x), strict=True))


def decode_cache(rng: np.random.Generator, hd: int, bs: int, n_kv: int, n_keys: list[int]) -> tuple:
    """An 8-bit cache holding sequences of n_keys[i] keys in disjoint shuffled blocks (3 spare), quantised by Q8_0's
    rule (np_q8): (n_blocks, tables, k8, ks, v8, vs)."""
    need = [-(-n // bs) for n in n_keys]
    n_blocks = sum(need) + 3
    perm = rng.permutation(n_blocks).astype(np.int32)
    tables = np.zeros((len(n_keys), max(need)), np.int32)
    off = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[off : off + n]
        off += n
    kd, n_slots = n_kv * hd, n_blocks * bs
    k = (rng.standard_normal((n_slots, kd)) * 0.5).astype(np.float32)
    v = rng.standard_normal((n_slots, kd)).astype(np.float32)
    return (n_blocks, tables, *cache_of(k, v, np.arange(n_slots, dtype=np.int32), n_blocks, bs, np_q8))


def call_q8(
    g: tuple,
    mode: int,
    c: tuple,
    bs: int,
    hd: int,
    n_head: int,
    n_kv: int,
    q: np.ndarray,
    pos: np.ndarray,
    seq: np.ndarray,
    split: tuple[int, int, int] = (0, 0, 0),
) -> tuple[int, np.ndarray, np.ndarray]:
    """stg_test_attention_q8 over the cache ``c`` (decode_cache's): its status, the output and the splits per token."""
    n_blocks, tables, k8, ks, v8, vs = c
    out = np.full(q.shape, np.nan, np.float32)
    ns = np.zeros(len(pos), np.int32)
    return (
        g[1].stg_test_attention_q8(
            mode,
            *split,
            gptr(g, k8, "int8_t *"),
            gptr(g, ks, "uint16_t *"),
            gptr(g, v8, "int8_t *"),
            gptr(g, vs, "uint16_t *"),
            n_blocks,
            gptr(g, tables, "int32_t *"),
            tables.shape[0],
            tables.shape[1],
            bs,
            hd,
            n_head,
            n_kv,
            gptr(g, q, "float *"),
            gptr(g, pos, "int32_t *"),
            gptr(g, seq, "int32_t *"),
            len(pos),
            gptr(g, out, "float *"),
            gptr(g, ns, "int32_t *"),
        ),
        out,
        ns,
    )


def run_q8(g: tuple, *args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """call_q8's output and splits per token (call_q8's arguments), the status required to be ST_OK."""
    rc, out, ns = call_q8(g, *args, **kwargs)
    gcheck(g, rc)
    return out, ns


def cpu_reference(
    c: tuple, bs: int, hd: int, n_head: int, n_kv: int, q: np.ndarray, pos: np.ndarray, seq: np.ndarray
) -> np.ndarray:
    """st_attention_q8 (the CPU's 8-bit reference, one query at a time) for every (token, head)."""
    _, tables, k8, ks, v8, vs = c
    G = n_head // n_kv
    ref = np.empty(q.shape, np.float32)
    for i, (p, s) in enumerate(zip(pos.tolist(), seq.tolist(), strict=True)):
        table = np.ascontiguousarray(tables[s])
        for h in range(n_head):
            qh = np.ascontiguousarray(q[i, h * hd : (h + 1) * hd])
            oh = np.empty(hd, np.float32)
            assert (
                lib.st_attention_q8(
                    lib.ST_VARIANT_REF,
                    ptr(k8, "int8_t *"),
                    ptr(ks, "uint16_t *"),
                    ptr(v8, "int8_t *"),
                    ptr(vs, "uint16_t *"),
                    ptr(table, "int32_t *"),
                    bs,
                    hd,
                    hd,
                    n_kv,
                    h // G,
                    ptr(qh, "float *"),
                    1,
                    p,
                    0,
                    ptr(oh, "float *"),
                )
                == 0
            )
            ref[i, h * hd : (h + 1) * hd] = oh
    return ref


def expected_splits(n_keys: int, split_min: int, chunks: int, zmax: int) -> int:
    """attention.cuh's att_split_chunks rule (split_min 0: one split)."""
    nc = -(-n_keys // 16)
    cps = nc if split_min == 0 or n_keys < split_min else max(chunks, -(-nc // zmax))
    return -(-nc // cps)


FORMS = {
    "step_rule": (512, 16, 64),
    "one_chunk": (1, 1, 64),
    "seven_from_1000": (1000, 1, 7),
    "never": (0, 16, 64),
}
SHAPES = {
    "qwen3_30b": (128, 16, 32, 4),
    "hd64_no_groups": (64, 32, 8, 8),
}  # (head_dim, block_size, n_head, n_kv)
CASES = [
    ("qwen3_30b", [1]),
    ("qwen3_30b", [17]),
    ("qwen3_30b", [4099]),
    ("qwen3_30b", [300, 17, 4099, 1, 2000, 1030, 9000, 40]),
    ("hd64_no_groups", [17, 4099, 700, 1, 33, 5000, 16, 64]),
]


@pytest.mark.parametrize(("shape", "cached"), CASES, ids=[f"{s}-{len(c)}seq-{max(c)}" for s, c in CASES])
def test_split_decode_on_q8_matches_reference(g: tuple, shape: str, cached: list[int]) -> None:
    hd, bs, n_head, n_kv = SHAPES[shape]
    rng = np.random.default_rng(sum(cached) + hd)
    pos = np.array(cached, np.int32)
    seq = np.arange(len(cached), dtype=np.int32)
    c = decode_cache(rng, hd, bs, n_kv, [p + 1 for p in cached])
    q = (rng.standard_normal((len(cached), n_head * hd)) * (2.0 / np.sqrt(hd))).astype(np.float32)
    ref, _ = run_q8(g, 0, c, bs, hd, n_head, n_kv, q, pos, seq)
    cref = cpu_reference(c, bs, hd, n_head, n_kv, q, pos, seq)
    e = rel_err(ref, cref)
    assert e <= GPU_REF_TOL, f"the GPU's 8-bit reference {e:.3e} of max|ref| from the CPU's"
    for form, split in FORMS.items():
        out, ns = run_q8(g, 1, c, bs, hd, n_head, n_kv, q, pos, seq, split)
        want = [expected_splits(p + 1, *split) for p in cached]
        assert ns.tolist() == want, f"{form}: splits per sequence {ns.tolist()}, the rule gives {want}"
        for i, p in enumerate(cached):
            e = rel_err(out[i], ref[i])
            print(f"{form}, sequence {i} ({p} cached tokens, {ns[i]} splits): {e:.2e} of max|ref|")
            assert e <= REF_TOL, (
                f"{form}, sequence {i} ({p} cached tokens): {e:.3e} of max|ref| from the reference"
            )


def test_split_decode_on_q8_fits_a_99_kib_device(g: tuple) -> None:
    """sm_89 (RTX 40xx) lets a block opt in to 101,376 bytes of shared memory, and the head_dim-128 split decode kernel
    of the 8-bit cache takes 102,656 with four raw stages a warp: there it takes three (85,248 bytes), whose output
    is bitwise the 4-stage form's under every split rule, at an assumed limit of 101,376 and of 85,248 bytes; at
    85,247 no form fits and the cache is refused with ST_EUNSUPPORTED (stg_kv_create_tiered's check, which the
    engine raises as UnsupportedError) instead of a failed launch."""
    hd, bs, n_head, n_kv = SHAPES["qwen3_30b"]
    cached = [300, 17, 4099, 1, 2000, 9000]
    rng = np.random.default_rng(89)
    pos = np.array(cached, np.int32)
    seq = np.arange(len(cached), dtype=np.int32)
    c = decode_cache(rng, hd, bs, n_kv, [p + 1 for p in cached])
    q = (rng.standard_normal((len(cached), n_head * hd)) * (2.0 / np.sqrt(hd))).astype(np.float32)
    assert g[1].stg_test_q8_split_stages(hd) == 4  # an H100 / H200's own limit (227 KiB)
    assert g[1].stg_test_q8_split_stages(64) == 4
    for form, split in FORMS.items():
        base, ns = run_q8(g, 1, c, bs, hd, n_head, n_kv, q, pos, seq, split)
        for limit in (101_376, 85_248):
            with assumed_smem_optin(g, limit):
                assert g[1].stg_test_q8_split_stages(hd) == 3, limit
                assert g[1].stg_test_q8_split_stages(64) == 4, limit
                out, ns3 = run_q8(g, 1, c, bs, hd, n_head, n_kv, q, pos, seq, split)
            assert ns3.tolist() == ns.tolist(), (form, limit)
            assert np.array_equal(out.view(np.uint32), base.view(np.uint32)), (
                f"{form}, limit {limit}: 3 stages {rel_err(out, base):.3e} of max|ref| from 4"
            )
    with assumed_smem_optin(g, 85_247):
        assert g[1].stg_test_q8_split_stages(hd) == 0
        for mode in (1, 2):  # decode and prefill: the same refusal, before any launch
            rc, out, _ = call_q8(g, mode, c, bs, hd, n_head, n_kv, q, pos, seq, FORMS["step_rule"])
            msg = g[0].string(g[1].stg_last_error()).decode()
            assert rc == lib.ST_EUNSUPPORTED, (mode, rc, msg)
            assert "needs 85248 bytes of shared memory" in msg and "allows 85247" in msg, msg
            assert np.isnan(out).all(), mode
    assert g[1].stg_test_q8_split_stages(hd) == 4  # the device's own limit again


# block_size 48: chunks start at slots 0, 16 and 32 of a block
EDGE_SHAPES = {**SHAPES, "bs48": (128, 48, 32, 4)}
EDGE_CASES = [
    ("qwen3_30b", [0]),
    ("qwen3_30b", [16]),
    ("qwen3_30b", [4098]),
    ("qwen3_30b", [39999]),
    ("qwen3_30b", [300, 17, 4099, 1, 2000, 1030, 9000, 40]),
    ("hd64_no_groups", [17, 4099, 700, 1, 33, 5000, 16, 64]),
    ("bs48", [47, 5000, 1, 129]),
]


@pytest.mark.parametrize(
    ("shape", "cached"), EDGE_CASES, ids=[f"{s}-{len(c)}seq-{max(c) + 1}" for s, c in EDGE_CASES]
)
def test_split_decode_on_q8_stage_forms_match_reference(g: tuple, shape: str, cached: list[int]) -> None:
    """The 8-bit cache's split decode kernel at 1, 17, 4,099 and 40,000 keys, in mixed batches and at block size
    48, under every split rule: within the reference's tolerance with four raw stages, and (head_dim 128) sm_89's
    three give bitwise the four's output."""
    hd, bs, n_head, n_kv = EDGE_SHAPES[shape]
    rng = np.random.default_rng(sum(cached) + hd + bs)
    pos = np.array(cached, np.int32)
    seq = np.arange(len(cached), dtype=np.int32)
    c = decode_cache(rng, hd, bs, n_kv, [p + 1 for p in cached])
    q = (rng.standard_normal((len(cached), n_head * hd)) * (2.0 / np.sqrt(hd))).astype(np.float32)
    ref, _ = run_q8(g, 0, c, bs, hd, n_head, n_kv, q, pos, seq)
    for form, split in FORMS.items():
        out, ns = run_q8(g, 1, c, bs, hd, n_head, n_kv, q, pos, seq, split)
        want = [expected_splits(p + 1, *split) for p in cached]
        assert ns.tolist() == want, f"{form}: splits per sequence {ns.tolist()}, the rule gives {want}"
        assert np.isfinite(out).all(), form
        for i, p in enumerate(cached):
            e = rel_err(out[i], ref[i])
            assert e <= REF_TOL, (
                f"{form}, sequence {i} ({p} cached tokens): {e:.3e} of max|ref| from the reference"
            )
        if hd != 128:
            continue
        with assumed_smem_optin(g, 101_376):  # sm_89: three raw stages
            assert g[1].stg_test_q8_split_stages(hd) == 3
            out3, ns3 = run_q8(g, 1, c, bs, hd, n_head, n_kv, q, pos, seq, split)
        assert ns3.tolist() == ns.tolist(), form
        bad = np.flatnonzero(out3.view(np.uint32) != out.view(np.uint32))
        assert bad.size == 0, (
            f"{form}: 3 stages differ from 4 in {bad.size} of {out.size} values (first at {bad[:4].tolist()}; "
            f"{rel_err(out3, out):.3e} of max|out|)"
        )


@pytest.mark.parametrize(("p0", "n"), [(0, 300), (4000, 130), (17, 1)])
def test_prefill_on_q8_matches_reference(g: tuple, p0: int, n: int) -> None:
    """A chunk of n tokens at positions p0.. of one sequence (its prefix p0 tokens cached) and a second
    sequence's chunk in the same launch, through the tensor-core prefill kernel in the device's own form (128-row
    tiles with P.V one stage behind on an H100 / H200); every other form (64-row tiles with and without it, under
    assumed opt-in limits: sm_89's 101,376 bytes take the last) gives bitwise its output."""
    hd, bs, n_head, n_kv = SHAPES["qwen3_30b"]
    rng = np.random.default_rng(p0 + n)
    c = decode_cache(rng, hd, bs, n_kv, [p0 + n, 90])
    pos = np.r_[np.arange(p0, p0 + n), np.arange(20, 90)].astype(np.int32)
    seq = np.r_[np.zeros(n), np.ones(70)].astype(np.int32)
    q = (rng.standard_normal((len(pos), n_head * hd)) * (2.0 / np.sqrt(hd))).astype(np.float32)
    ref, _ = run_q8(g, 0, c, bs, hd, n_head, n_kv, q, pos, seq)
    out, _ = run_q8(g, 2, c, bs, hd, n_head, n_kv, q, pos, seq)
    e = rel_err(out, ref)
    print(f"prefill of {n} tokens after {p0}: {e:.2e} of max|ref|")
    assert e <= PREFILL_TOL, f"the prefill kernel on the 8-bit cache: {e:.3e} of max|ref| from the reference"
    forms = mma_forms(g, hd)
    assert {(64, 1), (64, 0)} <= set(forms), forms
    for form, limit in forms.items():
        with assumed_smem_optin(g, limit):
            other, _ = run_q8(g, 2, c, bs, hd, n_head, n_kv, q, pos, seq)
        assert np.array_equal(other.view(np.uint32), out.view(np.uint32)), (
            f"form {form} (assumed limit {limit}): {rel_err(other, out):.3e} of max|ref| from the device's own form"
        )


def test_q8_refuses_bad_arguments(g: tuple) -> None:
    rng = np.random.default_rng(0)
    c = decode_cache(rng, 128, 16, 4, [40])
    q = np.zeros((2, 32 * 128), np.float32)
    pos, seq = np.array([39, 38], np.int32), np.array([0, 0], np.int32)
    with pytest.raises(
        AssertionError, match="one token per sequence"
    ):  # the split path: one token a sequence
        run_q8(g, 1, c, 16, 128, 32, 4, q, pos, seq)
    with pytest.raises(AssertionError, match="bad arguments"):  # head_dim 32: no 8-bit kernels
        run_q8(g, 0, c, 16, 32, 4, 4, np.ascontiguousarray(q[:, : 4 * 32]), pos, seq)
    with pytest.raises(AssertionError, match="consecutive"):  # the prefill path: positions in order
        run_q8(g, 2, c, 16, 128, 32, 4, q, pos, seq)
    with pytest.raises(AssertionError, match="position 48"):  # past the sequence's 3-block table
        run_q8(g, 0, c, 16, 128, 32, 4, q, np.array([39, 48], np.int32), seq)


# ------------------------------------------------------------------------------------------------ model level

VOCAB = 300


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a window of 2,048: the 1,500-token prompt and its greedy continuation fit
    return write_hd128_moe(tmp_path_factory.mktemp("kvq8") / "m.gguf", 2048, VOCAB)


def row_errs(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Each row's max|got - ref| over max|ref| of the whole array."""
    return np.abs(got - ref).max(-1) / max(float(np.abs(ref).max()), 1e-30)


def test_gpu_q8_cache_matches_cpu_q8_cache(q8_model: Path) -> None:
    rng = np.random.default_rng(30)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in (700, 40, 1500)]
    chunk = 256
    kw = dict(kv_tokens=4096, prefill_chunk=chunk)
    with (
        Engine.open(q8_model, threads=2, kv_type="q8_0", **kw) as cpu,
        Engine.open(q8_model, threads=2, **kw) as cpu16,
        Engine.open(q8_model, device="cuda:0", kv_type="q8_0", **kw) as gpu,
        Engine.open(q8_model, device="cuda:0", **kw) as f16,
    ):
        assert gpu._gpu.kv_bytes == f16._gpu.kv_bytes * 17 // 32
        for p in prompts:
            a, b, h, a16 = cpu.logits_for(p), gpu.logits_for(p), f16.logits_for(p), cpu16.logits_for(p)
            r, quant, floor = row_errs(b, a), row_errs(a, a16), row_errs(h, a16)
            agree = float((a.argmax(-1) == b.argmax(-1)).mean())
            print(
                f"{len(p)} tokens: GPU q8 vs CPU q8 max {r.max():.2e} median {np.median(r):.2e} (argmax agreement "
                f"{agree:.3f}); GPU f16 vs CPU f16 max {floor.max():.2e} median {np.median(floor):.2e}; "
                f"CPU q8 vs CPU f16 max {quant.max():.2e} median {np.median(quant):.2e}; "
                f"GPU q8 vs GPU f16 {rel_err(b, h):.2e}"
            )
            for s in range(0, len(p), chunk):
                got, want = float(np.median(r[s : s + chunk])), float(np.median(quant[s : s + chunk]))
                assert got <= MODEL_MEDIAN_RATIO * want, (
                    f"{len(p)}-token prompt, prefill chunk at {s}: the GPU's 8-bit cache a median {got:.3e} of "
                    f"max|ref| from the CPU's, the 8-bit cache's own effect {want:.3e}"
                )
            assert agree >= MODEL_AGREE, f"{len(p)}-token prompt: argmax agreement {agree:.3f}"
            ta, tb = tokens_of(cpu, p, 32), tokens_of(gpu, p, 32)
            same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
            print(
                f"  greedy: identical for {same} of 32 tokens; vs the GPU's f16 cache "
                f"{sum(x == y for x, y in zip(tb, tokens_of(f16, p, 32), strict=True))} of 32 the same"
            )
            check_greedy(cpu, gpu, p, exact=False, bound=MODEL_GREEDY_GAP)


def test_gpu_q8_refuses_head_dim_32(tmp_path: Path) -> None:
    path = make_random_gguf(tmp_path / "hd32.gguf", n_embd=128, n_head=4, n_head_kv=2, n_vocab=VOCAB)
    with pytest.raises(Exception, match="8-bit KV cache"):
        Engine.open(path, device="cuda:0", kv_tokens=256, kv_type="q8_0")


def test_gpu_q8_batched_decode_gives_each_sequence_its_alone_logits(q8_model: Path) -> None:
    """One 5,000-token sequence (split at decode) and seven short ones (one split) decoded in one batch on the 8-bit
    cache get, bitwise, the logits each gets alone (a sequence's splits depend on its own length only), with graphs
    on and off; a step of two tokens of one sequence (not pure decode: the prefill kernel, eagerly) runs too."""
    rng = np.random.default_rng(31)
    lens = [5000, 3, 17, 40, 100, 511, 600, 64]
    steps = 4
    with Engine.open(q8_model, device="cuda:0", kv_type="q8_0", kv_tokens=8192, prefill_chunk=512) as eng:
        eng._gpu.set_settings({})
        tables = [eng.blocks.allocate(-(-(n + steps + 2) // eng.block_size)) for n in lens]
        for n, tb in zip(lens, tables, strict=True):
            eng.prefill([int(t) for t in rng.integers(0, VOCAB, size=n)], tb)
        feed = [[int(t) for t in rng.integers(0, VOCAB, size=steps)] for _ in lens]

        def run(rows: list[int]) -> np.ndarray:
            return np.stack(
                [
                    eng.forward(
                        [feed[r][s] for r in rows],
                        [lens[r] + s for r in rows],
                        list(range(len(rows))),
                        [tables[r] for r in rows],
                        list(range(len(rows))),
                    )
                    for s in range(steps)
                ]
            )

        alone = [run([r])[:, 0] for r in range(len(lens))]
        batched = run(list(range(len(lens))))
        for r in range(len(lens)):
            assert np.array_equal(batched[:, r].view(np.uint32), alone[r].view(np.uint32)), (
                f"sequence {r} ({lens[r]} tokens): batched {rel_err(batched[:, r], alone[r]):.3e} from alone"
            )
        eng._gpu.set_settings({"STRATA_GPU_GRAPHS": "0"})
        try:
            plain = run(list(range(len(lens))))
        finally:
            eng._gpu.set_settings({})
        assert np.array_equal(plain.view(np.uint32), batched.view(np.uint32)), "graphs on and off differ"
        two = eng.forward([1, 2], [lens[1] + steps, lens[1] + steps + 1], [0, 0], [tables[1]], [0, 1])
        assert np.isfinite(two).all()
