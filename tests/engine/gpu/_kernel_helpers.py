"""What the GPU kernel tests share (the library itself is the ``g`` fixture of conftest.py): pointers into
it, its error text, the CPU's activation quantisations (per 32 and per 256) that the GPU's 8-bit blocks are compared with, and an
attention case (a paged f16 cache) with the heads kernels' call on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from engine.native import lib, ptr


def gcheck(g: tuple, rc: int) -> None:
    gffi, glib = g
    assert rc == 0, gffi.string(glib.stg_last_error()).decode()


def gptr(g: tuple, a: np.ndarray, ctype: str = "void *"):  # noqa: ANN201
    return g[0].cast(ctype, g[0].from_buffer(a))


@contextmanager
def harness_settings(g: tuple, **fields: int) -> Iterator[None]:
    """Run the harness calls inside under stg_settings_default's settings without the prefill form
    (gemm_fast_min 0) and with ``fields`` replaced; the harness's defaults again afterwards."""
    gffi, glib = g
    s = gffi.new("stg_settings *")
    glib.stg_settings_default(s)
    s.gemm_fast_min = 0
    for name, value in fields.items():
        setattr(s, name, value)
    gcheck(g, glib.stg_test_set_settings(s))
    try:
        yield
    finally:
        gcheck(g, glib.stg_test_set_settings(gffi.NULL))


@contextmanager
def assumed_smem_optin(g: tuple, nbytes: int) -> Iterator[None]:
    """Run the harness calls inside as on a device whose blocks may opt in to ``nbytes`` of shared memory
    (stg_test_assume_smem_optin; 0: the device's own limit); the device's limit again afterwards."""
    gcheck(g, g[1].stg_test_assume_smem_optin(nbytes))
    try:
        yield
    finally:
        gcheck(g, g[1].stg_test_assume_smem_optin(0))


# opt-in limits that, assumed one after another, give every form of the tensor-core prefill attention on an H100 /
# H200 (227 KiB: 0, the device's own): at head_dim 128 128 rows with P.V one stage behind (140 KiB), 64 rows with it
# (105 KiB) and without it (70 KiB: sm_89's 101,376 bytes take it); at head_dim 64 (72, 54, 36 KiB) and 32 (38, 29,
# 19 KiB) the same three at smaller limits
MMA_LIMITS = (0, 110_000, 101_376, 74_000, 56_000, 40_000, 29_500, 20_000)


def mma_forms(g: tuple, hd: int) -> dict[tuple[int, int], int]:
    """The forms of the tensor-core prefill attention at head_dim ``hd`` that MMA_LIMITS give, (rows, pipe) -> the
    first limit giving it (0 first: the device's own form); limits that fit no form are left out."""
    rows, pipe = g[0].new("int32_t *"), g[0].new("int32_t *")
    out: dict[tuple[int, int], int] = {}
    for limit in MMA_LIMITS:
        with assumed_smem_optin(g, limit):
            gcheck(g, g[1].stg_test_attention_mma_form(hd, rows, pipe))
        if rows[0]:
            out.setdefault((int(rows[0]), int(pipe[0])), limit)
    return out


def cpu_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CPU's 8-bit blocks of each row of ``x`` [T, K]: codes [T, K], scales [T, K/32], sums [T, K/16]."""
    T, K = x.shape
    qs, d, s = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32), np.empty((T, K // 16), np.int32)
    for t in range(T):
        assert lib.st_quantize_act(ptr(x[t], "float *"), K, ptr(qs[t], "int8_t *"), ptr(d[t], "float *"),
                                   ptr(s[t], "int32_t *")) == 0
    return qs, d, s


def cpu_quant_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CPU's per-256 view of each row of ``x`` [T, K] (st_quantize_act_k, the reference variant): codes
    [T, K], one scale per 256 [T, K/256], sums of 16 [T, K/16] (int16)."""
    T, K = x.shape
    qs, d, s = np.empty((T, K), np.int8), np.empty((T, K // 256), np.float32), np.empty((T, K // 16), np.int16)
    for t in range(T):
        assert lib.st_quantize_act_k(lib.ST_VARIANT_REF, ptr(x[t], "float *"), K, ptr(qs[t], "int8_t *"),
                                     ptr(d[t], "float *"), ptr(s[t], "int16_t *")) == 0
    return qs, d, s


def attention_case(rng: np.random.Generator, hd: int, bs: int, n_kv: int, n_keys: int) -> tuple:
    """A paged f16 K/V cache of ``n_keys`` keys: (n_blocks, block table, k, v), the table a permutation of
    all but 3 of the blocks."""
    n_blocks = -(-n_keys // bs) + 3
    table = rng.permutation(n_blocks).astype(np.int32)[: -(-n_keys // bs)]
    kv_dim = n_kv * hd
    k = (rng.standard_normal(n_blocks * bs * kv_dim) * 0.5).astype(np.float16).view(np.uint16)
    v = rng.standard_normal(n_blocks * bs * kv_dim).astype(np.float16).view(np.uint16)
    return n_blocks, table, k, v


def attention_heads(g: tuple, tile: int, c: tuple, bs: int, hd: int, n_head: int, n_kv: int, q: np.ndarray,
                    p0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """stg_test_attention_heads (``tile`` picks the kernel) of queries q [nq, n_head * hd] at positions p0...
    over the case ``c`` (attention_case's): the output [nq, n_head * hd] and its 8-bit blocks (codes, scales,
    sums)."""
    n_blocks, table, k, v = c
    nq, qd = q.shape
    out = np.full((nq, qd), np.nan, np.float32)
    aq, ad, as_ = np.zeros((nq, qd), np.int8), np.full((nq, qd // 32), np.nan, np.float32), \
        np.zeros((nq, qd // 16), np.int32)
    gcheck(g, g[1].stg_test_attention_heads(tile, gptr(g, k, "uint16_t *"), gptr(g, v, "uint16_t *"), n_blocks,
                                            gptr(g, table, "int32_t *"), len(table), bs, hd, n_head, n_kv,
                                            gptr(g, q, "float *"), nq, p0, gptr(g, out, "float *"),
                                            gptr(g, aq, "int8_t *"), gptr(g, ad, "float *"),
                                            gptr(g, as_, "int32_t *")))
    return out, aq, ad, as_
