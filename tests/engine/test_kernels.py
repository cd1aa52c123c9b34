"""One harness for every kernel variant: dequantisation against gguf-py (bitwise), and
every SIMD dot product against the generic C reference and a float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.native import VARIANTS, available_variants, ffi, lib, ptr

IQ_TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]  # engine/csrc/quants_iq.h
LOWBIT_TYPES = ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"]  # engine/csrc/quants_lowbit.h
QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", *IQ_TYPES, *LOWBIT_TYPES]
FLOAT_TYPES = ["F32", "F16", "BF16"]
# byte offsets of the f16 scale fields in each block (kept finite in random blocks)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208], **{name: [0] for name in IQ_TYPES}, "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0],
              "IQ4_XS": [0], "MXFP4": []}
# byte offsets of E8M0 exponents (kept near 2^-5, the size of the f16 scales above, in random blocks)
E8M0_FIELDS = {"MXFP4": [0]}
N = 256 * 12  # a multiple of every block size; an even and an odd count of 32-blocks below
# the types whose kernels read the per-256 activation view (engine/csrc/internal.h, st_type_q8k)
Q8K_TYPES = {"Q6_K", "Q2_K", "Q3_K", "IQ4_XS", *IQ_TYPES}


def random_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for n elements of `name`, with finite random f16 scales."""
    qt = GGMLQuantizationType[name]
    if name in FLOAT_TYPES:
        x = rng.standard_normal(n).astype(np.float32)
        if name == "F32":
            return x.view(np.uint8)
        if name == "F16":
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    bs, tb = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n // bs, tb), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        scales = (rng.uniform(-1, 1, size=n // bs) * 0.05).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    for off in E8M0_FIELDS.get(name, []):
        raw[:, off] = rng.integers(119, 126, size=n // bs)
    return raw.reshape(-1)


def c_dequant(name: str, raw: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.float32)
    rc = lib.st_dequantize(int(GGMLQuantizationType[name]), ptr(raw), ptr(out, "float *"), n)
    assert rc == 0, ffi.string(lib.st_last_error())
    return out


def quant_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = x.size
    qs, d, s = np.empty(n, np.int8), np.empty(n // 32, np.float32), np.empty(n // 16, np.int32)
    assert lib.st_quantize_act(ptr(x, "float *"), n, ptr(qs, "int8_t *"), ptr(d, "float *"), ptr(s, "int32_t *")) == 0
    return qs, d, s


def quant_act_k(x: np.ndarray, variant: str = "ref") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = x.size
    qs, d, b = np.empty(n, np.int8), np.empty(n // 256, np.float32), np.empty(n // 16, np.int16)
    rc = lib.st_quantize_act_k(VARIANTS[variant], ptr(x, "float *"), n, ptr(qs, "int8_t *"), ptr(d, "float *"),
                               ptr(b, "int16_t *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    return qs, d, b


def act_values(name: str, qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The activation values a kernel of `name` multiplies (float64), given the per-32 rows qs, d
    ([n] or [nt, n]): q * d, or for the per-256 types that product (float32, as in C) quantised
    again per 256, the view st_vec_dot_q builds for them."""
    n = qs.shape[-1]
    x = (qs.reshape(-1, n // 32, 32) * d.reshape(-1, n // 32, 1)).reshape(qs.shape)  # float32 products
    if name not in Q8K_TYPES:
        return x.astype(np.float64)
    rows = [quant_act_k(np.ascontiguousarray(row, np.float32)) for row in x.reshape(-1, n)]
    return np.stack([(q.reshape(-1, 256) * dk[:, None].astype(np.float64)).reshape(-1) for q, dk, _ in rows]).reshape(
        qs.shape)


@pytest.mark.parametrize("name", QUANT_TYPES + FLOAT_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantize_bitwise_equals_gguf_py(name: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = random_blocks(name, N, rng)
    ref = dequantize(raw, GGMLQuantizationType[name]).reshape(-1).astype(np.float32)
    out = c_dequant(name, raw, N)
    assert np.array_equal(ref.view(np.uint32), out.view(np.uint32))


def edge_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    """Blocks of `name` at the edges of the format: codes all 0x00 / all 0xFF / random, each with
    scales of +0, -0, the smallest f16 subnormal, the largest f16 (65504) and random; MXFP4's
    exponent byte at 0, 1 (subnormal scales), 2, 127, 252 and 253..255 (products past the float
    range, inf in both), and every code 0..15 in one block."""
    bs, tb = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    f16_edges = np.array([0.0, -0.0, 6e-8, 65504.0, -65504.0, 0.03], np.float16).view(np.uint8).reshape(-1, 2)
    blocks = []
    for fill in ("zero", "ones", "random"):
        for k in range(f16_edges.shape[0] if F16_FIELDS[name] else 9):
            b = {"zero": np.zeros(tb, np.uint8), "ones": np.full(tb, 0xFF, np.uint8),
                 "random": rng.integers(0, 256, tb, dtype=np.uint8)}[fill]
            for off in F16_FIELDS[name]:
                b[off : off + 2] = f16_edges[k]
            for off in E8M0_FIELDS.get(name, []):
                b[off] = [0, 1, 2, 127, 252, 253, 254, 255, 128][k]
            blocks.append(b)
    every = rng.integers(0, 256, tb, dtype=np.uint8)
    nib = np.arange(32, dtype=np.uint8) % 16
    if name in ("IQ4_NL", "MXFP4"):  # the 16 bytes of codes after the scale: every index, low and high
        every[tb - 16:] = nib[:16] | (nib[::-1][:16] << 4)
    blocks.append(every)
    out = np.concatenate(blocks)
    # Q2_K / Q3_K scales bytes all-zero (with nonzero d) and all-max, too
    if name in ("Q2_K", "Q3_K"):
        lo, hi = (0, 16) if name == "Q2_K" else (96, 108)
        for v in (0x00, 0xFF):
            b = rng.integers(0, 256, tb, dtype=np.uint8)
            b[lo:hi] = v
            out = np.concatenate([out, b])
    pad = (-out.size // tb) % (256 // bs if bs < 256 else 1)  # whole 256-element rows
    return np.concatenate([out] + [rng.integers(0, 256, tb, dtype=np.uint8)] * pad)


@pytest.mark.parametrize("name", LOWBIT_TYPES)
def test_dequantize_edge_values_bitwise_equals_gguf_py(name: str) -> None:
    raw = edge_blocks(name, np.random.default_rng(4))
    bs, tb = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    n = raw.size // tb * bs
    with np.errstate(over="ignore", invalid="ignore"):
        ref = dequantize(raw, GGMLQuantizationType[name]).reshape(-1).astype(np.float32)
    out = c_dequant(name, raw, n)
    assert np.array_equal(ref.view(np.uint32), out.view(np.uint32))
    assert not np.any(np.isnan(out)) and np.any(out == 0)
    if name not in ("Q2_K", "MXFP4"):  # (-0 * q) - (-0 * m) is +0; MXFP4 scales are positive
        assert np.any(np.signbit(out) & (out == 0))


@pytest.mark.parametrize("name", [t for t in LOWBIT_TYPES if t == "MXFP4"])
def test_gguf_py_quantisation_round_trips_through_c(name: str) -> None:
    """Where gguf-py quantises the type (MXFP4; the test models use it), its blocks dequantise in
    C to exactly gguf-py's values, and within the format's error of the input."""
    from gguf.quants import quantize

    x = np.random.default_rng(8).standard_normal((4, 256)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.linspace(-3.9e-38, 3e-38, 32, dtype=np.float32)  # the smallest (subnormal) scale
    raw = quantize(x, GGMLQuantizationType[name]).reshape(-1)
    assert raw[17 * 8] == 0  # that block's exponent byte: 2^-128
    out = c_dequant(name, raw, x.size)
    ref = dequantize(raw, GGMLQuantizationType[name]).reshape(-1)
    assert np.array_equal(ref.view(np.uint32), out.view(np.uint32))
    assert np.sqrt(np.mean((out - x.reshape(-1)) ** 2)) <= 0.2 * np.sqrt(np.mean(x**2))


def test_activation_quantisation_matches_definition() -> None:
    x = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    qs, d, s = quant_act(x)
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    np.testing.assert_allclose(d, amax / 127, rtol=1e-6)
    np.testing.assert_array_equal(s, qs.reshape(-1, 16).astype(np.int32).sum(axis=1))
    # every value within half a quantisation step
    assert np.all(np.abs(qs.reshape(-1, 32) * d[:, None] - blocks) <= d[:, None] * 0.5 + 1e-7)


@pytest.mark.parametrize("variant", available_variants())
def test_activation_quantisation_every_variant_bitwise(variant: str) -> None:
    """The step quantises with the current variant's quantiser (AVX2 where it runs): the same
    bytes, scales and sums as the scalar definition, including exact .5 ties (rounded away from
    zero), an all-zero block and values of very different magnitudes."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal(N).astype(np.float32)
    x[:32] = 0.0
    x[32:64] = (rng.integers(-254, 255, size=32) / 2).astype(np.float32)  # d = 1: x * id are exact halves
    x[63] = 127.0
    x[64:96] *= np.float32(1e-30)
    x[96:128] *= np.float32(3e4)
    x[128:160] = -x[128:160]
    ref = quant_act(x)
    qs, d, s = np.empty(N, np.int8), np.empty(N // 32, np.float32), np.empty(N // 16, np.int32)
    rc = lib.st_quantize_act_variant(VARIANTS[variant], ptr(x, "float *"), N, ptr(qs, "int8_t *"), ptr(d, "float *"),
                                     ptr(s, "int32_t *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    assert np.array_equal(qs, ref[0]) and np.array_equal(d.view(np.uint32), ref[1].view(np.uint32))
    assert np.array_equal(s, ref[2])
    assert np.array_equal(qs[32:64], np.trunc(x[32:64] + np.copysign(0.5, x[32:64])).astype(np.int8))  # ties away from 0
    assert lib.st_quantize_act_variant(VARIANTS[variant], ptr(x, "float *"), 33, ptr(qs, "int8_t *"),
                                       ptr(d, "float *"), ptr(s, "int32_t *")) == lib.ST_EINVAL


def test_per_256_quantisation_matches_definition() -> None:
    x = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    x[256:512] *= np.float32(1e-3)
    qs, d, b = quant_act_k(x)
    blocks = x.reshape(-1, 256)
    np.testing.assert_allclose(d, np.abs(blocks).max(axis=1) / 127, rtol=1e-6)
    np.testing.assert_array_equal(b, qs.reshape(-1, 16).astype(np.int32).sum(axis=1))
    assert np.all(np.abs(qs.reshape(-1, 256) * d[:, None] - blocks) <= d[:, None] * 0.5 + 1e-7)
    assert np.abs(qs).max() == 127
    out = np.empty(8, np.int8)
    assert lib.st_quantize_act_k(VARIANTS["ref"], ptr(x, "float *"), 128, ptr(out, "int8_t *"), ptr(d, "float *"),
                                 ptr(b, "int16_t *")) == lib.ST_EINVAL


@pytest.mark.parametrize("variant", available_variants())
def test_per_256_quantisation_every_variant_bitwise(variant: str) -> None:
    """Every variant's per-256 quantiser gives the reference's bytes, scales and sums, with exact .5
    ties, an all-zero block and blocks of very different magnitudes."""
    rng = np.random.default_rng(23)
    x = rng.standard_normal(N).astype(np.float32)
    x[:256] = 0.0
    x[256:512] = (rng.integers(-254, 255, size=256) / 2).astype(np.float32)  # d = 1: exact halves
    x[300] = 127.0
    x[512:768] *= np.float32(1e-30)
    x[768:1024] *= np.float32(3e4)
    ref = quant_act_k(x)
    got = quant_act_k(x, variant)
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1].view(np.uint32), ref[1].view(np.uint32))
    assert np.array_equal(got[2], ref[2])
    assert np.array_equal(ref[0][256:512], np.trunc(x[256:512] + np.copysign(0.5, x[256:512])).astype(np.int8))


GUARD = 64  # elements of sentinel after each buffer


def guarded(n: int, dtype: type, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """A buffer of exactly n elements followed by a guard region of sentinels."""
    full = np.full(n + GUARD, fill, dtype=dtype)
    return full[:n], full


@pytest.mark.parametrize("n", [32, 96, N])
def test_activation_buffers_are_exactly_the_documented_sizes(n: int) -> None:
    """strata.h: qs[n], d[n/32], sums[n/16]. Nothing past them is written (quantise) or
    read (dot: a poisoned guard would change the result)."""
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    qs, qs_full = guarded(n, np.int8, 0x5A)
    d, d_full = guarded(n // 32, np.float32, 0)
    s, s_full = guarded(n // 16, np.int32, 0x5A5A5A5A)
    d_full[n // 32:] = np.float32(1e30)
    rc = lib.st_quantize_act(ptr(x, "float *"), n, ptr(qs, "int8_t *"), ptr(d, "float *"), ptr(s, "int32_t *"))
    assert rc == 0
    assert np.all(qs_full[n:] == 0x5A) and np.all(d_full[n // 32:] == np.float32(1e30))
    assert np.all(s_full[n // 16:] == 0x5A5A5A5A)
    np.testing.assert_array_equal(s, qs.reshape(-1, 16).astype(np.int32).sum(axis=1))
    # the dot product reads the same lengths: poisoning the guards changes nothing
    rng = np.random.default_rng(1)
    for name in ("Q4_0", "Q4_1", "Q8_0") if n % 256 else QUANT_TYPES:
        raw = random_blocks(name, n, rng)
        for variant in available_variants():
            before = dot_q(name, variant, raw, qs, d, s, n)
            qs_full[n:], s_full[n // 16:] = 127, 1 << 30
            after = dot_q(name, variant, raw, qs, d, s, n)
            qs_full[n:], s_full[n // 16:] = 0x5A, 0x5A5A5A5A
            assert before == after and np.isfinite(before), (name, variant)


def dot_q(name: str, variant: str, raw: np.ndarray, qs: np.ndarray, d: np.ndarray, s: np.ndarray, n: int) -> float:
    out = ffi.new("float *")
    rc = lib.st_vec_dot_q(int(GGMLQuantizationType[name]), VARIANTS[variant], ptr(raw), ptr(qs, "int8_t *"),
                          ptr(d, "float *"), ptr(s, "int32_t *"), n, out)
    assert rc == 0, ffi.string(lib.st_last_error())
    return float(out[0])


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("n", [N, N - 256 + 32 * 3])  # even and odd numbers of 32-blocks
def test_quantised_dot_every_variant(name: str, variant: str, n: int) -> None:
    if n % GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]:
        n = N
    rng = np.random.default_rng(7)
    for _ in range(5):
        raw = random_blocks(name, n, rng)
        x = rng.standard_normal(n).astype(np.float32)
        qs, d, s = quant_act(x)
        w = c_dequant(name, raw, n).astype(np.float64)
        xa = act_values(name, qs, d)
        oracle = float(np.dot(w, xa))
        scale = float(np.abs(w * xa).sum())
        got = dot_q(name, variant, raw, qs, d, s, n)
        ref = dot_q(name, "ref", raw, qs, d, s, n)
        assert abs(got - oracle) <= 1e-4 * scale, (got, oracle)
        assert abs(got - ref) <= 1e-4 * scale, (got, ref)


# ---------------------------------------------------------------- IQ types: edge blocks

def _iq_sweep_body(name: str, k: int) -> np.ndarray:
    """Block k (0..31) of a sweep whose blocks together use every grid index, every sign pattern
    (every 7-bit sign index, or every sign byte) and every 4-bit sub-scale of the type, laid out as
    in the format (the bytes after the f16 d)."""
    u8 = np.uint8

    def scales(m: int) -> np.ndarray:
        return np.array([((k + i) % 16) | (((k + i + 7) % 16) << 4) for i in range(m)], u8)

    def aux(base: int, ib: int) -> np.ndarray:
        word = sum(((base + 4 * ib + j) % 128) << (7 * j) for j in range(4)) | (((k + ib) % 16) << 28)
        return np.array([word], np.uint32).view(u8)

    if name == "IQ2_XXS":
        return np.concatenate([np.concatenate([np.array([(32 * k + 4 * ib + j) % 256 for j in range(4)], u8),
                                               aux(32 * k, ib)]) for ib in range(8)])
    if name == "IQ2_XS":
        v = np.array([((32 * k + j) % 512) | (((32 * k + j + k) % 128) << 9) for j in range(32)], np.uint16)
        return np.concatenate([v.view(u8), scales(8)])
    if name == "IQ2_S":
        idx = np.array([(32 * k + j) % 1024 for j in range(32)])
        qh = np.array([sum(((idx[4 * i + j] >> 8) & 3) << (2 * j) for j in range(4)) for i in range(8)], u8)
        signs = np.array([(32 * k + j) % 256 for j in range(32)], u8)
        return np.concatenate([(idx & 255).astype(u8), signs, qh, scales(8)])
    if name == "IQ3_XXS":
        grid = np.array([(64 * k + j) % 256 for j in range(64)], u8)
        return np.concatenate([grid] + [aux(32 * k, ib) for ib in range(8)])
    assert name == "IQ3_S"
    idx = np.array([(64 * k + j) % 512 for j in range(64)])
    qh = np.array([sum(((idx[8 * i + j] >> 8) & 1) << j for j in range(8)) for i in range(8)], u8)
    signs = np.array([(32 * k + j) % 256 for j in range(32)], u8)
    return np.concatenate([(idx & 255).astype(u8), qh, signs, scales(4)])


IQ_EDGE_D = [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 2.0**-24, 6.1e-5, 0.03]


def iq_edge_blocks(name: str) -> np.ndarray:
    """Every sweep block, all-zero and all-0xff bodies (grid index 0 / the last entries, no / all
    signs, smallest / largest sub-scales), each with every d of IQ_EDGE_D (zero, signed zero,
    the largest half, subnormal, ordinary)."""
    _, tb = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    bodies = [_iq_sweep_body(name, k) for k in range(32)] + [np.zeros(tb - 2, np.uint8), np.full(tb - 2, 255, np.uint8)]
    blocks = [np.concatenate([np.array([d], np.float16).view(np.uint8), body]) for d in IQ_EDGE_D for body in bodies]
    assert all(b.size == tb for b in blocks)
    return np.concatenate(blocks)


@pytest.mark.parametrize("name", IQ_TYPES)
def test_iq_dequantize_edge_blocks_bitwise(name: str) -> None:
    raw = iq_edge_blocks(name)
    n = raw.size // GGML_QUANT_SIZES[GGMLQuantizationType[name]][1] * 256
    ref = dequantize(raw, GGMLQuantizationType[name]).reshape(-1).astype(np.float32)
    out = c_dequant(name, raw, n)
    assert np.all(np.isfinite(ref)) and np.array_equal(ref.view(np.uint32), out.view(np.uint32))
    assert np.any(np.signbit(out) & (out == 0))  # -0.0 where gguf-py gives it


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("name", IQ_TYPES)
def test_iq_dot_edge_blocks_every_variant(name: str, variant: str) -> None:
    """The edge blocks with d = +-1 (the largest integer sums: every code, sign and sub-scale at
    its extremes) against activations at full scale, alternating and random: every variant within
    the harness's tolerance of the dequantised dot and of the reference."""
    _, tb = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    blocks = iq_edge_blocks(name).reshape(len(IQ_EDGE_D), -1, tb)[2:4].reshape(-1)  # d = 1, -1
    n = blocks.size // tb * 256
    w = c_dequant(name, blocks, n).astype(np.float64)
    rng = np.random.default_rng(29)
    for x in (np.ones(n, np.float32), np.where(np.arange(n) % 2, -1.0, 1.0).astype(np.float32),
              rng.standard_normal(n).astype(np.float32)):
        qs, d, s = quant_act(x)
        xa = act_values(name, qs, d)
        oracle, scale = float(np.dot(w, xa)), float(np.abs(w * xa).sum())
        got, ref = dot_q(name, variant, blocks, qs, d, s, n), dot_q(name, "ref", blocks, qs, d, s, n)
        assert abs(got - oracle) <= 1e-4 * scale and abs(got - ref) <= 1e-4 * scale, (got, ref, oracle)


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("name", LOWBIT_TYPES)
def test_extreme_codes_and_activations_every_variant(name: str, variant: str) -> None:
    """The integer sums stay exact at the extremes: every code at its largest or smallest (and
    6-bit scales at theirs) against activations all at +127 or -127 or alternating, where a 16-bit
    partial sum would overflow if the kernel added one product too many."""
    bs, tb = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    n = 1024
    rng = np.random.default_rng(19)
    for fill in (0x00, 0xFF, 0x77, 0x88):
        raw = np.full(n // bs * tb, fill, np.uint8).reshape(-1, tb)
        for off in F16_FIELDS[name]:
            raw[:, off:off + 2] = np.full(raw.shape[0], 0.01, np.float16).view(np.uint8).reshape(-1, 2)
        for off in E8M0_FIELDS.get(name, []):
            raw[:, off] = 120
        raw = raw.reshape(-1)
        for x in (np.ones(n), -np.ones(n), np.resize([1.0, -1.0], n), rng.standard_normal(n)):
            qs, d, s = quant_act(x.astype(np.float32))
            w = c_dequant(name, raw, n).astype(np.float64)
            xa = act_values(name, qs, d)
            # all-zero weights (MXFP4 codes 0 and 8): measured against the largest weight of these blocks
            scale = float(np.abs(w * xa).sum()) or float(np.abs(xa).sum()) * 0.01 * 127
            oracle = float(np.dot(w, xa))
            got = dot_q(name, variant, raw, qs, d, s, n)
            assert abs(got - oracle) <= 1e-4 * scale, (name, variant, fill, got, oracle)


def dot_q_tokens(name: str, variant: str, raw: np.ndarray, qs: np.ndarray, d: np.ndarray, s: np.ndarray,
                 n: int) -> np.ndarray:
    """One weight row against every token row of qs [nt, n] through the multi-token path."""
    nt = qs.shape[0]
    out = np.empty(nt, np.float32)
    rc = lib.st_vec_dot_q_tokens(int(GGMLQuantizationType[name]), VARIANTS[variant], ptr(raw), nt,
                                 ptr(qs, "int8_t *"), ptr(d, "float *"), ptr(s, "int32_t *"), n,
                                 ptr(out, "float *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    return out


# 1 token (decode), 2..4 (the fused in-register paths), 5..13 (the unpacked row shared by
# four-token passes plus a remainder) and 64 (the largest tile)
TOKEN_COUNTS = [1, 2, 3, 4, 5, 8, 13, 64]


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("n", [N, N - 256 + 32 * 3])  # even and odd numbers of 32-blocks
def test_multi_token_dot_equals_alone_bitwise_every_variant(name: str, variant: str, n: int) -> None:
    """Batched == alone inside the kernel: each token of an nt-token pass gets exactly the bits
    the one-token pass gives it, for every token count path, and stays within 1e-4 of the
    reference variant."""
    if n % GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]:
        n = N
    rng = np.random.default_rng(11)
    raw = random_blocks(name, n, rng)
    x = rng.standard_normal((max(TOKEN_COUNTS), n)).astype(np.float32)
    acts = [quant_act(row) for row in x]
    qs = np.stack([a[0] for a in acts])
    d = np.stack([a[1] for a in acts])
    s = np.stack([a[2] for a in acts])
    alone = np.array([dot_q(name, variant, raw, qs[t], d[t], s[t], n) for t in range(len(x))], np.float32)
    ref = np.array([dot_q(name, "ref", raw, qs[t], d[t], s[t], n) for t in range(len(x))], np.float64)
    w = c_dequant(name, raw, n).astype(np.float64)
    for nt in TOKEN_COUNTS:
        got = dot_q_tokens(name, variant, raw, qs[:nt].copy(), d[:nt].copy(), s[:nt].copy(), n)
        assert np.array_equal(got.view(np.uint32), alone[:nt].view(np.uint32)), (name, variant, nt)
        for t in range(nt):
            xa = act_values(name, qs[t], d[t])
            scale = float(np.abs(w * xa).sum())
            assert abs(float(got[t]) - ref[t]) <= 1e-4 * scale, (name, variant, nt, t)


def dot_q_rows(name: str, variant: str, raw: np.ndarray, nr: int, qs: np.ndarray, d: np.ndarray, s: np.ndarray,
               n: int) -> np.ndarray:
    """nr consecutive weight rows (raw holds them back to back) against every token row of qs
    [nt, n] through the register-blocked micro-kernel: [nt, nr]."""
    nt = qs.shape[0]
    out = np.empty((nt, nr), np.float32)
    rc = lib.st_vec_dot_q_rows(int(GGMLQuantizationType[name]), VARIANTS[variant], ptr(raw), nr, nt,
                               ptr(qs, "int8_t *"), ptr(d, "float *"), ptr(s, "int32_t *"), n, ptr(out, "float *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    return out


ROW_COUNTS = [1, 2, 3, 4, 5, 8]  # one register block of rows, a short one, two (full and short)


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("n", [N - 256 + 32 * 3, 256 * 3])  # odd and even numbers of 32-blocks
def test_row_blocked_dot_equals_alone_bitwise_every_variant(name: str, variant: str, n: int) -> None:
    """Every (row, token) of an nr x nt micro-kernel pass gets exactly the bits of that row
    and token alone, for every row-block and token-count path, within 1e-4 of the reference."""
    if n % GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]:
        n = 256 * 3
    rng = np.random.default_rng(13)
    nr_max, nt_max = max(ROW_COUNTS), max(TOKEN_COUNTS)
    rows = [random_blocks(name, n, rng) for _ in range(nr_max)]
    raw = np.concatenate(rows)
    x = rng.standard_normal((nt_max, n)).astype(np.float32)
    x[1] *= 1e-3  # tokens of very different magnitudes share a pass
    acts = [quant_act(row) for row in x]
    qs = np.stack([a[0] for a in acts])
    d = np.stack([a[1] for a in acts])
    s = np.stack([a[2] for a in acts])
    alone = np.array([[dot_q(name, variant, rows[r], qs[t], d[t], s[t], n) for r in range(nr_max)]
                      for t in range(nt_max)], np.float32)
    ref = np.array([[dot_q(name, "ref", rows[r], qs[t], d[t], s[t], n) for r in range(nr_max)]
                    for t in range(nt_max)], np.float64)
    w = np.stack([c_dequant(name, r, n) for r in rows]).astype(np.float64)  # [nr, n]
    xa = act_values(name, qs, d)
    scale = np.abs(xa) @ np.abs(w).T  # [nt, nr]: sum |w * a|
    assert np.all(np.abs(alone - ref) <= 1e-4 * scale), (name, variant)
    for nr in ROW_COUNTS:
        for nt in TOKEN_COUNTS:
            got = dot_q_rows(name, variant, raw, nr, qs[:nt].copy(), d[:nt].copy(), s[:nt].copy(), n)
            assert np.array_equal(got.view(np.uint32), alone[:nt, :nr].view(np.uint32)), (name, variant, nr, nt)


REPACKED = {"Q4_1": ("ST_TYPE_Q4_1_R8", "st_repack_q4_1"), "Q8_0": ("ST_TYPE_Q8_0_R8", "st_repack_q8_0")}


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("name", list(REPACKED))
@pytest.mark.parametrize("n", [N - 256 + 32 * 3, 576])  # odd and even numbers of 32-blocks
def test_repacked_rows_equal_plain_bitwise_every_variant(variant: str, name: str, n: int) -> None:
    """Rows repacked in groups of 8 (st_repack_*, what the model does at its first step) give
    exactly the plain rows' bits through the micro-kernel, for every row and token count; the
    plain rows are held to the reference by the tests above."""
    rtype, repack = getattr(lib, REPACKED[name][0]), getattr(lib, REPACKED[name][1])
    rng = np.random.default_rng(17)
    rows = 16
    raw = np.concatenate([random_blocks(name, n, rng) for _ in range(rows)])
    packed = np.zeros_like(raw)
    assert repack(ptr(raw), ptr(packed), rows, n) == 0, ffi.string(lib.st_last_error())
    assert not np.array_equal(packed, raw) and np.array_equal(np.sort(packed), np.sort(raw))  # same bytes, moved
    x = rng.standard_normal((max(TOKEN_COUNTS), n)).astype(np.float32)
    x[1] *= 1e-3
    acts = [quant_act(row) for row in x]
    qs, d, s = (np.stack([a[i] for a in acts]) for i in range(3))
    rb = raw.nbytes // rows
    for g in (0, 8):  # both groups: the second one starts at row 8's offset, as in a tensor
        for nr in (8, 5, 1):
            for nt in TOKEN_COUNTS:
                q_t, d_t, s_t = qs[:nt].copy(), d[:nt].copy(), s[:nt].copy()  # alive through the calls
                args = (nr, nt, ptr(q_t, "int8_t *"), ptr(d_t, "float *"), ptr(s_t, "int32_t *"), n)
                want, got = np.empty((nt, nr), np.float32), np.empty((nt, nr), np.float32)
                assert lib.st_vec_dot_q_rows(int(GGMLQuantizationType[name]), VARIANTS[variant],
                                             ptr(raw[g * rb:]), *args, ptr(want, "float *")) == 0
                assert lib.st_vec_dot_q_rows(rtype, VARIANTS[variant], ptr(packed[g * rb:]), *args,
                                             ptr(got, "float *")) == 0, ffi.string(lib.st_last_error())
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (variant, name, g, nr, nt)


def test_repacked_type_is_refused_where_a_group_is_not_given() -> None:
    """The repacked type is never a file type, and single-row entry points refuse it; bad
    repack shapes are errors."""
    raw = random_blocks("Q8_0", 64, np.random.default_rng(0))
    qs, d, s = quant_act(np.ones(64, np.float32))
    out = np.empty(1, np.float32)
    dst = np.zeros_like(raw)
    for rtype_name, repack_name in REPACKED.values():
        rtype, repack = getattr(lib, rtype_name), getattr(lib, repack_name)
        assert lib.st_type_supported(rtype) == 0
        rc = lib.st_vec_dot_q_tokens(rtype, VARIANTS["ref"], ptr(raw), 1, ptr(qs, "int8_t *"), ptr(d, "float *"),
                                     ptr(s, "int32_t *"), 64, ptr(out, "float *"))
        assert rc == lib.ST_EUNSUPPORTED
        for rows, n in ((1, 64), (7, 64), (8, 48), (8, 0)):
            assert repack(ptr(raw), ptr(dst), rows, n) == lib.ST_EINVAL


def test_model_repacked_at_first_step_gives_the_same_logits(model_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's Q4_1 and Q8_0 matrices are repacked at the first CPU step (unless
    STRATA_REPACK=0) and the logits of prefills and 4-sequence decode steps are the plain
    build's bits (the kernel-level test above covers every variant)."""
    from engine.engine import Engine
    from engine.gguf_model import open_model

    mf = open_model(model_path)  # parsed once (the slow part of opening), two C models on it
    ids = list(range(100, 124))
    out = {}
    for repack in ("0", "1"):
        monkeypatch.setenv("STRATA_REPACK", repack)
        with Engine(mf, 2, None, 1024, 16, 512) as eng:
            assert lib.st_model_repacked_bytes(eng._model) == 0  # nothing before the first step
            res = []
            for n in (24, 3):
                tables = [eng.blocks.allocate(2) for _ in range(4)]
                res.append(eng.prefill(ids[:n], tables[0], start=0))
                for i, t in enumerate(tables[1:]):
                    eng.prefill(ids[i:i + 2], t, start=0)
                res.append(eng.forward([5, 6, 7, 8], [n, 2, 2, 2], [0, 1, 2, 3], tables, [0, 1, 2, 3]))
                for t in tables:
                    eng.blocks.release(t)
            out[repack] = (res, lib.st_model_repacked_bytes(eng._model))
    assert out["0"][1] == 0 and out["1"][1] > 100_000_000  # the experts, attention matrices and head
    for a, b in zip(out["0"][0], out["1"][0], strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_row_blocked_dot_rejects_bad_row_counts() -> None:
    raw = np.zeros(18 * 8, np.uint8)
    qs, d, s = np.zeros(32, np.int8), np.ones(1, np.float32), np.zeros(2, np.int32)
    out = np.empty(16, np.float32)
    for nr in (0, 9, -1):
        rc = lib.st_vec_dot_q_rows(int(GGMLQuantizationType["Q4_0"]), VARIANTS["ref"], ptr(raw), nr, 1,
                                   ptr(qs, "int8_t *"), ptr(d, "float *"), ptr(s, "int32_t *"), 32,
                                   ptr(out, "float *"))
        assert rc == lib.ST_EINVAL


def test_multi_token_dot_rejects_bad_token_counts() -> None:
    raw = random_blocks("Q4_1", 64, np.random.default_rng(0))
    qs, d, s = quant_act(np.ones(64, np.float32))
    out = np.empty(1, np.float32)
    for nt in (0, -1, 65):
        rc = lib.st_vec_dot_q_tokens(int(GGMLQuantizationType["Q4_1"]), VARIANTS["ref"], ptr(raw), nt,
                                     ptr(qs, "int8_t *"), ptr(d, "float *"), ptr(s, "int32_t *"), 64,
                                     ptr(out, "float *"))
        assert rc != 0 and b"nt=" in ffi.string(lib.st_last_error())


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("name", FLOAT_TYPES)
def test_float_dot_every_variant(name: str, variant: str) -> None:
    rng = np.random.default_rng(11)
    n = N + 5  # exercise the scalar tail
    raw = random_blocks(name, n, rng)
    x = rng.standard_normal(n).astype(np.float32)
    w = c_dequant(name, raw, n).astype(np.float64)
    oracle = float(np.dot(w, x))
    out = ffi.new("float *")
    assert lib.st_vec_dot_f(int(GGMLQuantizationType[name]), VARIANTS[variant], ptr(raw), ptr(x, "float *"), n, out) == 0
    assert abs(out[0] - oracle) <= 1e-5 * float(np.abs(w * x).sum())


@pytest.mark.parametrize("variant", available_variants())
def test_silu_mul_every_variant(variant: str) -> None:
    """The expert gate h = silu(g) * u: every variant within 4e-7 relative of float64 (the
    AVX2 one has its own exp), finite at the extremes, and an element's result independent of
    its position (a tail shorter than one vector gives the bits of the full-width pass)."""
    rng = np.random.default_rng(23)
    g = np.concatenate([rng.standard_normal(4000) * 6, np.linspace(-100, 100, 401), [0.0, 87.0, -87.0, 200.0, -200.0]])
    g = g.astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)
    ref = g.astype(np.float64) / (1.0 + np.exp(-g.astype(np.float64))) * u

    def run(gv: np.ndarray, uv: np.ndarray) -> np.ndarray:
        h = np.empty_like(gv)
        rc = lib.st_silu_mul_variant(VARIANTS[variant], ptr(gv, "float *"), ptr(uv, "float *"), ptr(h, "float *"),
                                     gv.size)
        assert rc == 0, ffi.string(lib.st_last_error())
        return h

    h = run(g, u)
    assert np.all(np.isfinite(h))
    big = np.abs(ref) > 1e-30
    assert np.max(np.abs(h[big] - ref[big]) / np.abs(ref[big])) < 4e-7
    assert np.all(np.abs(h[~big]) < 1e-30)
    for n in (1, 5, 8, 13):
        part = run(np.ascontiguousarray(g[3:3 + n]), np.ascontiguousarray(u[3:3 + n]))
        assert np.array_equal(part.view(np.uint32), h[3:3 + n].view(np.uint32))
    assert lib.st_silu_mul_variant(VARIANTS[variant], ptr(g, "float *"), ptr(u, "float *"), ptr(h, "float *"),
                                   0) == lib.ST_EINVAL


def test_bad_arguments_are_errors_not_crashes() -> None:
    raw = np.zeros(64, np.uint8)
    out = np.zeros(64, np.float32)
    assert lib.st_dequantize(99, ptr(raw), ptr(out, "float *"), 32) == lib.ST_EUNSUPPORTED
    assert "unsupported" in ffi.string(lib.st_last_error()).decode()
    assert lib.st_dequantize(int(GGMLQuantizationType.Q4_0), ptr(raw), ptr(out, "float *"), 33) == lib.ST_EINVAL
    assert lib.st_set_variant(42) == lib.ST_EINVAL
    assert lib.st_quantize_act(ffi.NULL, 32, ffi.NULL, ffi.NULL, ffi.NULL) == lib.ST_EINVAL


def test_forced_variant_switch_round_trips() -> None:
    for v in available_variants():
        assert lib.st_set_variant(VARIANTS[v]) == 0
        assert lib.st_get_variant() == VARIANTS[v]
    assert lib.st_set_variant(VARIANTS["auto"]) == 0


# ---------------------------------------------------------------- attention

def attention(variant: str, k: np.ndarray, v: np.ndarray, bt: np.ndarray, bs: int, hd: int, n_kv: int, kvh: int,
              q: np.ndarray, p0: int) -> np.ndarray:
    nq = q.shape[0]
    out = np.zeros((nq, hd), np.float32)
    rc = lib.st_attention(VARIANTS[variant], ptr(k), ptr(v), ptr(bt, "int32_t *"), bs, hd, n_kv, kvh,
                          ptr(q, "float *"), nq, p0, ptr(out, "float *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    return out


def attention_oracle(k: np.ndarray, v: np.ndarray, bt: np.ndarray, bs: int, hd: int, kvh: int, q: np.ndarray,
                     p0: int) -> np.ndarray:
    """float64 softmax attention over the same paged layout, decoded independently."""
    n = p0 + q.shape[0]
    keys = np.stack([k[bt[j // bs], kvh, :, j % bs] for j in range(n)]).astype(np.float64)  # [n, hd]
    vals = np.stack([v[bt[j // bs], j % bs, kvh * hd : (kvh + 1) * hd] for j in range(n)]).astype(np.float64)
    out = []
    for i, qi in enumerate(q.astype(np.float64)):
        s = keys[: p0 + i + 1] @ qi
        p = np.exp(s - s.max())
        out.append((p / p.sum()) @ vals[: p0 + i + 1])
    return np.array(out)


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize(("nq", "p0"), [(1, 0), (1, 37), (5, 0), (16, 20), (16, 100), (3, 64)])
def test_attention_every_variant(variant: str, nq: int, p0: int) -> None:
    rng = np.random.default_rng(nq * 1000 + p0)
    bs, hd, n_kv, kvh, n_blocks = 16, 64, 3, 1, 12
    k = rng.standard_normal((n_blocks, n_kv, hd, bs)).astype(np.float16)
    v = rng.standard_normal((n_blocks, bs, n_kv * hd)).astype(np.float16)
    bt = rng.permutation(n_blocks).astype(np.int32)  # scattered blocks
    q = (rng.standard_normal((nq, hd)) * 0.3).astype(np.float32)
    got = attention(variant, k, v, bt, bs, hd, n_kv, kvh, q, p0)
    ref = attention_oracle(k, v, bt, bs, hd, kvh, q, p0)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("variant", available_variants())
def test_attention_tile_equals_single_queries_bitwise(variant: str) -> None:
    """A query's output does not depend on the tile it is computed in (batch invariance)."""
    rng = np.random.default_rng(5)
    bs, hd, n_kv, n_blocks, p0, nq = 16, 64, 2, 10, 40, 16
    k = rng.standard_normal((n_blocks, n_kv, hd, bs)).astype(np.float16)
    v = rng.standard_normal((n_blocks, bs, n_kv * hd)).astype(np.float16)
    bt = np.arange(n_blocks, dtype=np.int32)[::-1].copy()
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    tile = attention(variant, k, v, bt, bs, hd, n_kv, 0, q, p0)
    for i in range(nq):
        one = attention(variant, k, v, bt, bs, hd, n_kv, 0, q[i : i + 1].copy(), p0 + i)
        assert np.array_equal(one[0], tile[i]), i
    half = attention(variant, k, v, bt, bs, hd, n_kv, 0, q[5:12].copy(), p0 + 5)
    assert np.array_equal(half, tile[5:12])


def attention_split(variant: str, k: np.ndarray, v: np.ndarray, bt: np.ndarray, bs: int, hd: int, n_kv: int,
                    kvh: int, q: np.ndarray, n_keys: int, chunk: int, sink: np.ndarray | None = None,
                    vd: int | None = None) -> np.ndarray:
    """st_attention_split_kv: the query heads q [nq, hd] sharing KV head kvh, keys 0..n_keys-1 in
    chunks, values of vd (default hd) dimensions."""
    vd = hd if vd is None else vd
    out = np.zeros((q.shape[0], vd), np.float32)
    rc = lib.st_attention_split_kv(VARIANTS[variant], ptr(k), ptr(v), ptr(bt, "int32_t *"), bs, hd, vd, n_kv, kvh,
                                   ptr(q, "float *"), q.shape[0], n_keys, chunk,
                                   ffi.NULL if sink is None else ptr(sink, "float *"), ptr(out, "float *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    return out


def attention_kv(variant: str, k: np.ndarray, v: np.ndarray, bt: np.ndarray, bs: int, hd: int, vd: int, n_kv: int,
                 kvh: int, q: np.ndarray, p0: int) -> np.ndarray:
    nq = q.shape[0]
    out = np.zeros((nq, vd), np.float32)
    rc = lib.st_attention_kv(VARIANTS[variant], ptr(k), ptr(v), ptr(bt, "int32_t *"), bs, hd, vd, n_kv, kvh,
                             ptr(q, "float *"), nq, p0, ptr(out, "float *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    return out


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize(("nq", "n_keys", "chunk"), [(1, 1, 16), (3, 37, 16), (5, 100, 32), (8, 190, 64), (2, 64, 256)])
def test_attention_split_every_variant(variant: str, nq: int, n_keys: int, chunk: int) -> None:
    """Each variant's partial kernel (queries of one KV head sharing its loads) plus the combine,
    against the float64 oracle, also with a sink per head (gpt-oss's softmax)."""
    rng = np.random.default_rng(nq * 1000 + n_keys)
    bs, hd, n_kv, kvh, n_blocks = 16, 64, 3, 2, 14
    k = rng.standard_normal((n_blocks, n_kv, hd, bs)).astype(np.float16)
    v = rng.standard_normal((n_blocks, bs, n_kv * hd)).astype(np.float16)
    bt = rng.permutation(n_blocks).astype(np.int32)
    q = (rng.standard_normal((nq, hd)) * 0.3).astype(np.float32)
    got = attention_split(variant, k, v, bt, bs, hd, n_kv, kvh, q, n_keys, chunk)
    ref = np.concatenate([attention_oracle(k, v, bt, bs, hd, kvh, q[i : i + 1], n_keys - 1) for i in range(nq)])
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    sink = rng.standard_normal(nq).astype(np.float32) + 1.0
    got = attention_split(variant, k, v, bt, bs, hd, n_kv, kvh, q, n_keys, chunk, sink)
    for i in range(nq):
        keys = np.stack([k[bt[j // bs], kvh, :, j % bs] for j in range(n_keys)]).astype(np.float64)
        vals = np.stack([v[bt[j // bs], j % bs, kvh * hd : (kvh + 1) * hd] for j in range(n_keys)]).astype(np.float64)
        s = keys @ q[i].astype(np.float64)
        mx = max(s.max(), float(sink[i]))
        p = np.exp(s - mx)
        want = p @ vals / (p.sum() + np.exp(float(sink[i]) - mx))
        assert np.abs(got[i] - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("nq", [1, 2, 3, 4, 5, 8])
def test_attention_split_one_chunk_equals_unsplit_bitwise(variant: str, nq: int) -> None:
    """A single chunk gives each query exactly the decode kernel's bits (the queries share K and V
    loads, each lane keeps its operations), at block-straddling and partial-vector key counts."""
    rng = np.random.default_rng(nq)
    bs, hd, n_kv, n_blocks = 32, 48, 2, 12
    k = rng.standard_normal((n_blocks, n_kv, hd, bs)).astype(np.float16)
    v = rng.standard_normal((n_blocks, bs, n_kv * hd)).astype(np.float16)
    bt = rng.permutation(n_blocks).astype(np.int32)
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    for n_keys in (1, 9, 40, 333):
        got = attention_split(variant, k, v, bt, bs, hd, n_kv, 1, q, n_keys, -(-n_keys // 16) * 16)
        for i in range(nq):
            one = attention(variant, k, v, bt, bs, hd, n_kv, 1, q[i : i + 1].copy(), n_keys - 1)
            assert np.array_equal(one[0], got[i]), (n_keys, i)


def test_attention_split_rejects_bad_shapes() -> None:
    z = np.zeros(4096, np.float16)
    bt = np.zeros(4, np.int32)
    q = np.zeros((2, 64), np.float32)
    out = np.zeros((2, 64), np.float32)

    def call(n_keys: int, chunk: int, nq: int = 2) -> int:
        return lib.st_attention_split(0, ptr(z), ptr(z), ptr(bt, "int32_t *"), 16, 64, 1, 0, ptr(q, "float *"), nq,
                                      n_keys, chunk, ffi.NULL, ptr(out, "float *"))

    for n_keys, chunk, nq in ((0, 16, 2), (10, 8, 2), (10, 24, 2), (10, 16, 0)):
        assert call(n_keys, chunk, nq) == lib.ST_EINVAL
        assert "bad shape" in ffi.string(lib.st_last_error()).decode()


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize(("hd", "vd", "n_kv", "nq"), [(80, 64, 1, 5), (48, 16, 2, 3)])
def test_attention_split_narrower_values(variant: str, hd: int, vd: int, n_kv: int, nq: int) -> None:
    """The split path with values narrower than keys (MLA's latent row): against the float64 oracle
    over several chunks, and one chunk equal to st_attention_kv's decode kernel bit for bit."""
    rng = np.random.default_rng(hd + vd)
    bs, n_blocks, kvh, n_keys = 16, 12, n_kv - 1, 150
    k = rng.standard_normal((n_blocks, n_kv, hd, bs)).astype(np.float16)
    v = rng.standard_normal((n_blocks, bs, n_kv * vd)).astype(np.float16)
    bt = rng.permutation(n_blocks).astype(np.int32)
    q = (rng.standard_normal((nq, hd)) * 0.3).astype(np.float32)
    keys = np.stack([k[bt[j // bs], kvh, :, j % bs] for j in range(n_keys)]).astype(np.float64)
    vals = np.stack([v[bt[j // bs], j % bs, kvh * vd : (kvh + 1) * vd] for j in range(n_keys)]).astype(np.float64)
    got = attention_split(variant, k, v, bt, bs, hd, n_kv, kvh, q, n_keys, 32, vd=vd)
    for i in range(nq):
        s = keys @ q[i].astype(np.float64)
        p = np.exp(s - s.max())
        want = p @ vals / p.sum()
        assert np.abs(got[i] - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    one_chunk = attention_split(variant, k, v, bt, bs, hd, n_kv, kvh, q, n_keys, 160, vd=vd)
    for i in range(nq):
        one = attention_kv(variant, k, v, bt, bs, hd, vd, n_kv, kvh, q[i : i + 1].copy(), n_keys - 1)
        assert np.array_equal(one[0], one_chunk[i]), i


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize(("hd", "vd", "n_kv", "kvh"), [(80, 64, 1, 0), (48, 32, 3, 2), (64, 16, 2, 1)])
@pytest.mark.parametrize(("nq", "p0"), [(1, 0), (1, 45), (16, 20), (7, 64)])
def test_attention_narrower_values_every_variant(variant: str, hd: int, vd: int, n_kv: int, kvh: int, nq: int,
                                                 p0: int) -> None:
    """Values narrower than keys (MLA's latent row: keys are the latent and the rotary part, values the
    latent alone): every variant against the float64 oracle, and a tile's rows equal the same
    queries alone, bit for bit."""
    rng = np.random.default_rng(hd * 100 + vd + nq * 7 + p0)
    bs, n_blocks = 16, 12
    k = rng.standard_normal((n_blocks, n_kv, hd, bs)).astype(np.float16)
    v = rng.standard_normal((n_blocks, bs, n_kv * vd)).astype(np.float16)
    bt = rng.permutation(n_blocks).astype(np.int32)
    q = (rng.standard_normal((nq, hd)) * 0.3).astype(np.float32)
    got = attention_kv(variant, k, v, bt, bs, hd, vd, n_kv, kvh, q, p0)
    n = p0 + nq
    keys = np.stack([k[bt[j // bs], kvh, :, j % bs] for j in range(n)]).astype(np.float64)
    vals = np.stack([v[bt[j // bs], j % bs, kvh * vd : (kvh + 1) * vd] for j in range(n)]).astype(np.float64)
    ref = []
    for i, qi in enumerate(q.astype(np.float64)):
        sc = keys[: p0 + i + 1] @ qi
        pr = np.exp(sc - sc.max())
        ref.append((pr / pr.sum()) @ vals[: p0 + i + 1])
    assert np.abs(got - np.array(ref)).max() <= 1e-4 * max(1.0, np.abs(np.array(ref)).max())
    for i in range(nq):
        one = attention_kv(variant, k, v, bt, bs, hd, vd, n_kv, kvh, q[i : i + 1].copy(), p0 + i)
        assert np.array_equal(one[0], got[i]), i


def test_attention_kv_rejects_bad_value_widths() -> None:
    z = np.zeros(8192, np.float16)
    bt = np.zeros(4, np.int32)
    q = np.zeros((1, 64), np.float32)
    out = np.zeros((1, 80), np.float32)
    for vd in (80, 8, 24, 0):  # wider than the keys, below 16, not a multiple of 16
        rc = lib.st_attention_kv(0, ptr(z), ptr(z), ptr(bt, "int32_t *"), 16, 64, vd, 1, 0, ptr(q, "float *"), 1, 0,
                                 ptr(out, "float *"))
        assert rc == lib.ST_EINVAL and "bad shape" in ffi.string(lib.st_last_error()).decode(), vd


def test_attention_rejects_bad_shapes() -> None:
    z = np.zeros(4096, np.float16)
    bt = np.zeros(4, np.int32)
    q = np.zeros((1, 64), np.float32)
    out = np.zeros((1, 64), np.float32)
    rc = lib.st_attention(0, ptr(z), ptr(z), ptr(bt, "int32_t *"), 10, 64, 1, 0, ptr(q, "float *"), 1, 0,
                          ptr(out, "float *"))
    assert rc == lib.ST_EINVAL and "bad shape" in ffi.string(lib.st_last_error()).decode()


def test_variant_forced_from_environment() -> None:
    import os
    import subprocess
    import sys

    code = "from engine.native import lib; print(lib.st_get_variant())"
    env = dict(os.environ, STRATA_KERNEL_VARIANT="ref")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(VARIANTS["ref"])
    env["STRATA_KERNEL_VARIANT"] = "sse9"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "STRATA_KERNEL_VARIANT='sse9'" in bad.stderr


def test_kernel_rate_runs_and_rejects_bad_arguments() -> None:
    """st_kernel_rate (the benchmark's in-cache micro-kernel rate): a positive rate for a short
    run, typed errors for bad shapes and types."""
    out = ffi.new("double *")
    q41 = int(GGMLQuantizationType["Q4_1"])
    assert lib.st_kernel_rate(q41, VARIANTS["auto"], 256, 8, 0.01, out) == 0 and out[0] > 0
    for repacked in (lib.ST_TYPE_Q4_1_R8, lib.ST_TYPE_Q8_0_R8):  # the engine's form of Q4_1 / Q8_0
        assert lib.st_kernel_rate(repacked, VARIANTS["auto"], 256, 1, 0.01, out) == 0 and out[0] > 0
        assert lib.st_kernel_rate(repacked, VARIANTS["auto"], 100, 1, 0.01, out) == lib.ST_EINVAL
    assert lib.st_kernel_rate(q41, VARIANTS["auto"], 100, 8, 0.01, out) == lib.ST_EINVAL
    assert lib.st_kernel_rate(q41, VARIANTS["auto"], 256, 65, 0.01, out) == lib.ST_EINVAL
    assert lib.st_kernel_rate(q41, VARIANTS["auto"], 256, 8, 0.0, out) == lib.ST_EINVAL
    assert lib.st_kernel_rate(int(GGMLQuantizationType["F32"]), VARIANTS["auto"], 256, 8, 0.01, out) == \
        lib.ST_EUNSUPPORTED


# ---------------------------------------------------------------- attention over the 8-bit cache

def q8_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0's rule on the last axis in groups of 32 (st_kv_q8_group): int8 values and F16 scales."""
    g = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.trunc(g * inv + np.copysign(np.float32(0.5), g)).astype(np.int8)
    return q.reshape(x.shape), d[..., 0].astype(np.float16)


@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize(("nq", "p0", "chunk"), [(1, 0, 0), (16, 37, 0), (5, 100, 0), (1, 150, 16), (3, 190, 64),
                                                  (4, 0, 16)])
def test_attention_q8_against_oracle(variant: str, nq: int, p0: int, chunk: int) -> None:
    """st_attention_q8 (the 8-bit cache's tile and split kernels) against the float64 oracle over the dequantised
    values; the split equals the unsplit kernel within the split rule."""
    rng = np.random.default_rng(nq * 1000 + p0 + chunk)
    bs, hd, vd, n_kv, kvh, n_blocks = 16, 64, 64, 3, 1, 14
    kf = rng.standard_normal((n_blocks, n_kv, bs, hd)).astype(np.float32)  # per token: its head's dims
    vf = rng.standard_normal((n_blocks, bs, n_kv * vd)).astype(np.float32)
    kq, kd = q8_groups(kf)  # [blk, n_kv, bs, hd], [blk, n_kv, bs, hd/32]
    vq, vdq = q8_groups(vf)
    k8 = np.ascontiguousarray(kq.transpose(0, 1, 3, 2))  # [blk, n_kv, hd, bs]: slot-minor
    ks = np.ascontiguousarray(kd.transpose(0, 1, 3, 2))  # [blk, n_kv, hd/32, bs]
    kdeq = (kq.astype(np.float32).reshape(n_blocks, n_kv, bs, hd // 32, 32) * kd[..., None].astype(np.float32))
    k_oracle = kdeq.reshape(n_blocks, n_kv, bs, hd).transpose(0, 1, 3, 2)  # the oracle's [blk, n_kv, hd, bs]
    v_oracle = (vq.astype(np.float32).reshape(n_blocks, bs, -1, 32) * vdq[..., None].astype(np.float32)).reshape(vf.shape)
    bt = rng.permutation(n_blocks).astype(np.int32)
    q = (rng.standard_normal((nq, hd)) * 0.3).astype(np.float32)
    out = np.zeros((nq, vd), np.float32)
    rc = lib.st_attention_q8(VARIANTS[variant], ptr(k8, "int8_t *"), ptr(ks, "uint16_t *"), ptr(vq, "int8_t *"),
                             ptr(vdq, "uint16_t *"), ptr(bt, "int32_t *"), bs, hd, vd, n_kv, kvh, ptr(q, "float *"), nq,
                             p0, chunk, ptr(out, "float *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    if chunk:
        ref = np.concatenate([attention_oracle(k_oracle, v_oracle, bt, bs, hd, kvh, q[i : i + 1], p0)
                              for i in range(nq)])
    else:
        ref = attention_oracle(k_oracle, v_oracle, bt, bs, hd, kvh, q, p0)
    assert np.abs(out - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    z = np.zeros(1, np.int8)
    assert lib.st_attention_q8(VARIANTS[variant], ptr(z, "int8_t *"), ptr(z, "uint16_t *"), ptr(z, "int8_t *"),
                               ptr(z, "uint16_t *"), ptr(bt, "int32_t *"), bs, 48, 48, 1, 0, ptr(q, "float *"), 1, 0,
                               0, ptr(out, "float *")) == lib.ST_EINVAL  # head dims not multiples of 32
    assert lib.st_attention_q8(99, ptr(k8, "int8_t *"), ptr(ks, "uint16_t *"), ptr(vq, "int8_t *"),
                               ptr(vdq, "uint16_t *"), ptr(bt, "int32_t *"), bs, hd, vd, n_kv, kvh, ptr(q, "float *"),
                               nq, p0, chunk, ptr(out, "float *")) == lib.ST_EINVAL  # no such variant


def q8_cache(rng: np.random.Generator, n_blocks: int, bs: int, hd: int, vd: int, n_kv: int) -> tuple[np.ndarray, ...]:
    """A random 8-bit cache in st_attention_q8's layout: k8, ks (F16 scales near 1/127), v8, vs."""
    k8 = rng.integers(-127, 128, (n_blocks, n_kv, hd, bs), dtype=np.int8)
    ks = (rng.uniform(0.2, 1.0, (n_blocks, n_kv, hd // 32, bs)) / 127).astype(np.float16)
    v8 = rng.integers(-127, 128, (n_blocks, bs, n_kv * vd), dtype=np.int8)
    vs = (rng.uniform(0.2, 1.0, (n_blocks, bs, n_kv * vd // 32)) / 127).astype(np.float16)
    return k8, ks, v8, vs


def attention_q8(variant: str, cache: tuple[np.ndarray, ...], bt: np.ndarray, bs: int, hd: int, vd: int, n_kv: int,
                 kvh: int, q: np.ndarray, p0: int, chunk: int) -> np.ndarray:
    """st_attention_q8 with one variant's kernels: a tile of queries at p0.. (chunk 0) or query heads at p0, split."""
    k8, ks, v8, vs = cache
    out = np.zeros((q.shape[0], vd), np.float32)
    rc = lib.st_attention_q8(VARIANTS[variant], ptr(k8, "int8_t *"), ptr(ks, "uint16_t *"), ptr(v8, "int8_t *"),
                             ptr(vs, "uint16_t *"), ptr(bt, "int32_t *"), bs, hd, vd, n_kv, kvh, ptr(q, "float *"),
                             q.shape[0], p0, chunk, ptr(out, "float *"))
    assert rc == 0, ffi.string(lib.st_last_error())
    return out


# The SIMD variant runs the reference's operations in its order except the exponential (a ~1 ulp
# polynomial for expf): within 1e-5 of max|ref|.
Q8_TOL = 1e-5


@pytest.mark.parametrize("variant", [v for v in available_variants() if v != "ref"])
@pytest.mark.parametrize(("hd", "vd", "group", "bs"), [(64, 64, 1, 16), (128, 128, 4, 16), (128, 128, 8, 64),
                                                       (128, 64, 4, 32), (64, 64, 8, 256)])
@pytest.mark.parametrize("cached", [1, 17, 4099])
def test_attention_q8_variant_against_reference(variant: str, hd: int, vd: int, group: int, bs: int,
                                                cached: int) -> None:
    """The 8-bit cache's SIMD kernels against its reference after `cached` tokens: decode (one
    query), a prefill tile of 16 causal queries, and the split partials of a GQA group (every
    query head of one KV head, chunks of 64 and one chunk); the tile and the single chunk give
    each query its decode bits."""
    rng = np.random.default_rng(hd * 7 + group * 31 + bs + cached)
    n_kv, kvh = 3, 2
    n_blocks = -(-(cached + 16) // bs) + 1
    cache = q8_cache(rng, n_blocks, bs, hd, vd, n_kv)
    bt = rng.permutation(n_blocks).astype(np.int32)
    q = (rng.standard_normal((16, hd)) * 0.5).astype(np.float32)

    def close(got: np.ndarray, ref: np.ndarray) -> None:
        assert np.abs(got - ref).max() <= Q8_TOL * np.abs(ref).max()

    one = attention_q8(variant, cache, bt, bs, hd, vd, n_kv, kvh, q[:1].copy(), cached, 0)
    close(one, attention_q8("ref", cache, bt, bs, hd, vd, n_kv, kvh, q[:1].copy(), cached, 0))
    tile = attention_q8(variant, cache, bt, bs, hd, vd, n_kv, kvh, q, cached, 0)
    close(tile, attention_q8("ref", cache, bt, bs, hd, vd, n_kv, kvh, q, cached, 0))
    assert np.array_equal(tile[0], one[0])
    last = attention_q8(variant, cache, bt, bs, hd, vd, n_kv, kvh, q[15:].copy(), cached + 15, 0)
    assert np.array_equal(tile[15], last[0])
    heads = q[:group].copy()
    for chunk in (64, -(-(cached + 1) // 16) * 16):
        split = attention_q8(variant, cache, bt, bs, hd, vd, n_kv, kvh, heads, cached, chunk)
        close(split, attention_q8("ref", cache, bt, bs, hd, vd, n_kv, kvh, heads, cached, chunk))
    for i in range(group):  # the last split is one chunk: each head's decode bits
        alone = attention_q8(variant, cache, bt, bs, hd, vd, n_kv, kvh, heads[i : i + 1].copy(), cached, 0)
        assert np.array_equal(split[i], alone[0]), i
