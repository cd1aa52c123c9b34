"""st_attn_blocks_part: decode attention partials over listed blocks (the GPU engine's host tier under
kv_host_attn) against a float64 reference, on the F16 and the 8-bit cache, block lists with gaps (a token's
blocks scattered through the cache, as the host tier holds them), one and several tokens, with and without the
pool, every kernel variant.

* a partial: its (max, sum, output / sum) within PART_TOL of the reference's over the same keys;
* a partial merged with another partial (the GPU's combine: one more split) equals attention over the union of
  their keys within MERGE_TOL of max |reference|;
* a token without keys gives {-inf, 0} and zeros (the merge then weighs it 0); bad lists are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine
from engine.native import (
    EngineError,
    OutOfRangeError,
    attn_blocks_gbs,
    attn_blocks_part,
    available_variants,
    ffi,
    lib,
)
from tests.engine.gguf_factory import make_random_gguf

PART_TOL = 1e-5
MERGE_TOL = 1e-5

HD, N_HEAD, N_KV, BS, N_BLOCKS = 64, 8, 2, 16, 24


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    pp = ffi.new("st_pool **")
    assert lib.st_pool_create(3, ffi.NULL, 0, pp) == 0
    yield pp[0]
    lib.st_pool_destroy(pp[0])


@pytest.fixture(params=available_variants())
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    before = lib.st_get_variant()
    assert lib.st_set_variant({"ref": lib.ST_VARIANT_REF, "avx2": lib.ST_VARIANT_AVX2,
                               "avx512": lib.ST_VARIANT_AVX512}[request.param]) == 0
    yield request.param
    lib.st_set_variant(before)


def make_cache(kv_type: str, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """One layer's cache of N_BLOCKS blocks in st_kv's layout, and its keys / values as float64:
    kf [block, kv head, slot, dim], vf [block, slot, kv head, dim]."""
    rng = np.random.default_rng(seed)
    if kv_type == "f16":
        k = rng.standard_normal((N_BLOCKS, N_KV, HD, BS)).astype(np.float16)
        v = rng.standard_normal((N_BLOCKS, BS, N_KV * HD)).astype(np.float16)
        kf = k.astype(np.float64).transpose(0, 1, 3, 2)
        vf = v.astype(np.float64).reshape(N_BLOCKS, BS, N_KV, HD)
        return {"k": k, "v": v, "ks": None, "vs": None}, kf, vf
    k8 = rng.integers(-127, 128, size=(N_BLOCKS, N_KV, HD, BS), dtype=np.int8)
    v8 = rng.integers(-127, 128, size=(N_BLOCKS, BS, N_KV * HD), dtype=np.int8)
    ks = (rng.uniform(0.5, 1.5, size=(N_BLOCKS, N_KV, HD // 32, BS)) / 127).astype(np.float16)
    vs = (rng.uniform(0.5, 1.5, size=(N_BLOCKS, BS, N_KV * HD // 32)) / 127).astype(np.float16)
    kf = k8.astype(np.float64) * np.repeat(ks.astype(np.float64), 32, axis=2)  # [b, kvh, dim, slot]
    vf = v8.astype(np.float64) * np.repeat(vs.astype(np.float64), 32, axis=2)
    return ({"k": k8, "v": v8, "ks": ks, "vs": vs}, kf.transpose(0, 1, 3, 2),
            vf.reshape(N_BLOCKS, BS, N_KV, HD))


def token_kv(kf: np.ndarray, vf: np.ndarray, blocks: list[int], n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """A token's keys [kv head, key, dim] and values [kv head, key, dim] through its block list."""
    ks = np.concatenate([kf[b] for b in blocks], axis=1)[:, :n_keys] if blocks else np.zeros((N_KV, 0, HD))
    vs = np.concatenate([vf[b].transpose(1, 0, 2) for b in blocks], axis=1)[:, :n_keys] if blocks else \
        np.zeros((N_KV, 0, HD))
    return ks, vs


def ref_part(q: np.ndarray, keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [n_head, HD] over keys / vals [kv head, n, HD]: (max [n_head], sum [n_head], acc [n_head, HD])."""
    G = N_HEAD // N_KV
    m, s, acc = np.empty(N_HEAD), np.empty(N_HEAD), np.empty((N_HEAD, HD))
    for h in range(N_HEAD):
        sc = keys[h // G] @ q[h].astype(np.float64)
        m[h] = sc.max()
        p = np.exp(sc - m[h])
        s[h], acc[h] = p.sum(), p @ vals[h // G]
    return m, s, acc


def lists(spec: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    off = np.cumsum([0] + [len(b) for b, _ in spec]).astype(np.int32)
    blocks = np.array([x for b, _ in spec for x in b], dtype=np.int32)
    return off, blocks, np.array([n for _, n in spec], dtype=np.int32)


def run(pool: Any, kv_type: str, cache: dict[str, np.ndarray], q: np.ndarray,
        spec: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray]:
    off, blocks, nk = lists(spec)
    return attn_blocks_part(pool, kv_type, cache["k"], cache["v"], cache["ks"], cache["vs"], HD, N_HEAD, N_KV, q,
                            off, blocks, nk)


# token lists: gaps (the VRAM blocks left out), a partial last block, one block, many blocks
SPECS = [
    [([5, 2, 19], 2 * BS + 7)],
    [([3], BS), ([7, 0, 11, 4, 22, 9, 13], 7 * BS), ([1, 17], BS + 1)],
    [([6, 8, 10, 12, 14, 16, 18, 20, 21, 23, 15], 11 * BS - 5), ([4], 3)],
]


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("spec", SPECS, ids=["one-token", "three-tokens", "two-tokens"])
@pytest.mark.parametrize("use_pool", [True, False], ids=["pool", "caller"])
def test_partials_match_reference(pool: Any, variant: str, kv_type: str, spec: list[tuple[list[int], int]],
                                  use_pool: bool) -> None:
    cache, kf, vf = make_cache(kv_type, 1)
    rng = np.random.default_rng(2)
    q = (rng.standard_normal((len(spec), N_HEAD, HD)) / np.sqrt(HD)).astype(np.float32)
    ml, acc = run(pool if use_pool else None, kv_type, cache, q, spec)
    for t, (blocks, n) in enumerate(spec):
        m, s, a = ref_part(q[t], *token_kv(kf, vf, blocks, n))
        np.testing.assert_allclose(ml[t, :, 0], m, rtol=0, atol=PART_TOL * max(1.0, np.abs(m).max()))
        # sum and output depend on the max: compare them at the reference's max
        scale = np.exp(ml[t, :, 0].astype(np.float64) - m)
        np.testing.assert_allclose(ml[t, :, 1] * scale, s, rtol=PART_TOL)
        out, ref = acc[t] / ml[t, :, 1:2], a / s[:, None]
        assert np.abs(out - ref).max() <= PART_TOL * np.abs(ref).max(), variant


def merge(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """Partials (max, sum, acc) merged as the GPU's combine merges splits, normalised: [n_head, HD]."""
    M = np.max([p[0] for p in parts], axis=0)
    w = [np.where(np.isneginf(p[0]), 0.0, np.exp(p[0] - M)) for p in parts]
    L = sum(wi * p[1] for wi, p in zip(w, parts, strict=True))
    A = sum(wi[:, None] * p[2] for wi, p in zip(w, parts, strict=True))
    return A / L[:, None]


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_merged_partials_equal_attention_over_union(pool: Any, variant: str, kv_type: str) -> None:
    """A token's keys split between two lists (say VRAM and host blocks; the union in sequence order): the two
    partials merged equal attention over all of its keys."""
    cache, kf, vf = make_cache(kv_type, 3)
    rng = np.random.default_rng(4)
    seq = [14, 3, 20, 7, 1, 9, 22, 5]  # one sequence's block table
    n = 7 * BS + 9  # its last block partly filled
    q = (rng.standard_normal((2, N_HEAD, HD)) / np.sqrt(HD)).astype(np.float32)
    for cut in ([0, 2, 5], [1, 3, 4, 6]):  # the blocks of the first list (full blocks: the last stays in the other)
        a_blocks = [seq[i] for i in cut]
        b_blocks = [seq[i] for i in range(len(seq)) if i not in cut]
        nb = n - len(a_blocks) * BS
        keys, vals = token_kv(kf, vf, seq, n)
        for t in range(2):  # the token's two lists as two rows of one call
            qq = np.stack([q[t], q[t]])
            ml, acc = run(pool, kv_type, cache, qq, [(a_blocks, len(a_blocks) * BS), (b_blocks, nb)])
            parts = [(ml[i, :, 0].astype(np.float64), ml[i, :, 1].astype(np.float64), acc[i].astype(np.float64))
                     for i in range(2)]
            out = merge(parts)
            m, s, a = ref_part(q[t], keys, vals)
            ref = a / s[:, None]
            assert np.abs(out - ref).max() <= MERGE_TOL * np.abs(ref).max()


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_token_without_keys(pool: Any, kv_type: str) -> None:
    cache, kf, vf = make_cache(kv_type, 5)
    q = np.full((2, N_HEAD, HD), 0.1, np.float32)
    ml, acc = run(pool, kv_type, cache, q, [([], 0), ([2, 4], BS + 3)])
    assert np.isneginf(ml[0, :, 0]).all() and (ml[0, :, 1] == 0).all() and (acc[0] == 0).all()
    assert np.isfinite(ml[1]).all() and (ml[1, :, 1] > 0).all()
    only, _ = run(pool, kv_type, cache, q[:1], [([], 0)])
    assert np.isneginf(only[0, :, 0]).all()
    # merged with a real partial it weighs nothing
    m, s, a = ref_part(q[1], *token_kv(kf, vf, [2, 4], BS + 3))
    parts = [(ml[0, :, 0].astype(np.float64), ml[0, :, 1].astype(np.float64), acc[0].astype(np.float64)),
             (ml[1, :, 0].astype(np.float64), ml[1, :, 1].astype(np.float64), acc[1].astype(np.float64))]
    ref = a / s[:, None]
    assert np.abs(merge(parts) - ref).max() <= MERGE_TOL * np.abs(ref).max()


def test_bad_lists_refused(pool: Any) -> None:
    cache, _, _ = make_cache("f16", 6)
    q = np.zeros((1, N_HEAD, HD), np.float32)
    with pytest.raises(OutOfRangeError):
        run(pool, "f16", cache, q, [([3, N_BLOCKS], 2 * BS)])
    with pytest.raises(EngineError):
        run(pool, "f16", cache, q, [([3], BS + 1)])  # more keys than the listed blocks hold
    with pytest.raises(EngineError):
        attn_blocks_part(pool, "f16", cache["k"], cache["v"], None, None, HD, N_HEAD, 3, q,
                         np.array([0, 1], np.int32), np.array([1], np.int32), np.array([4], np.int32))
    with pytest.raises(EngineError):  # the 8-bit cache without its scales
        attn_blocks_part(pool, "q8_0", cache["k"].view(np.int8), cache["v"].view(np.int8), None, None, HD, N_HEAD,
                         N_KV, q, np.array([0, 1], np.int32), np.array([1], np.int32), np.array([4], np.int32))


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_rate_probe(pool: Any, kv_type: str) -> None:
    gbs = attn_blocks_gbs(pool, kv_type, 16, 128, 16, 2, 2, 2048, seconds=0.05)
    assert 0.0 < gbs < 1e4
    with pytest.raises(EngineError):
        attn_blocks_gbs(pool, kv_type, 16, 128, 16, 2, 2, 0, seconds=0.05)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_engine_reports_its_pool_rate(tmp_path: Path, kv_type: str) -> None:
    """Engine.cpu_attn_gbs: the probe at the model's own attention shape and KV type, on the engine's pool."""
    path = make_random_gguf(tmp_path / "m.gguf", n_embd=128, n_head=4, n_head_kv=2)
    with Engine.open(path, threads=2, kv_tokens=256, kv_type=kv_type) as eng:
        assert 0.0 < eng.cpu_attn_gbs(n_keys=512, seconds=0.02) < 1e4


# The GPU bench's shapes (bench.engine_gpu's Qwen3-30B-A3B-shaped model at 2 x 32k under a 4 GiB VRAM tier): head_dim
# 128, 8 query heads per KV head, 4 KV heads, blocks of 16; a decode step of two tokens where the first sequence lies
# wholly in VRAM (no CPU keys) and the second has ~1,370 host-tier blocks scattered through the host pool (the
# CPU-only form, kv_host_share 100) or a prefix of ~430 of them (the mixed form's ~32%).
BIG_HD, BIG_HEAD, BIG_KV, BIG_BLOCKS = 128, 32, 4, 1500


def big_cache(kv_type: str, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """make_cache at the bench's shapes: kf [block, kv head, slot, dim], vf [block, slot, kv head, dim] (float32:
    exact for F16 and for the 8-bit cache's int8 times an F16 scale, and half a float64 cache's memory)."""
    rng = np.random.default_rng(seed)
    nb, nkv, hd = BIG_BLOCKS, BIG_KV, BIG_HD
    if kv_type == "f16":
        k = rng.standard_normal((nb, nkv, hd, BS), dtype=np.float32).astype(np.float16)
        v = rng.standard_normal((nb, BS, nkv * hd), dtype=np.float32).astype(np.float16)
        return ({"k": k, "v": v, "ks": None, "vs": None}, k.astype(np.float32).transpose(0, 1, 3, 2),
                v.astype(np.float32).reshape(nb, BS, nkv, hd))
    k8 = rng.integers(-127, 128, size=(nb, nkv, hd, BS), dtype=np.int8)
    v8 = rng.integers(-127, 128, size=(nb, BS, nkv * hd), dtype=np.int8)
    ks = (rng.uniform(0.5, 1.5, size=(nb, nkv, hd // 32, BS)) / 127).astype(np.float16)
    vs = (rng.uniform(0.5, 1.5, size=(nb, BS, nkv * hd // 32)) / 127).astype(np.float16)
    kf = k8.astype(np.float32) * np.repeat(ks.astype(np.float32), 32, axis=2)
    vf = v8.astype(np.float32) * np.repeat(vs.astype(np.float32), 32, axis=2)
    return {"k": k8, "v": v8, "ks": ks, "vs": vs}, kf.transpose(0, 1, 3, 2), vf.reshape(nb, BS, nkv, hd)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_partials_at_the_gpu_bench_shapes(pool: Any, variant: str, kv_type: str) -> None:
    """Two tokens as the GPU's first CPU-attended step of the 2 x 32k bench hands them over (token 0 without keys,
    token 1 with 1,367 scattered blocks), then the mixed form's prefix (433 blocks) beside another token's: each
    partial's (max, sum, output / sum) against float64 over the same keys, the keyless token {-inf, 0, zeros}."""
    cache, kf, vf = big_cache(kv_type, 7)
    rng = np.random.default_rng(8)
    perm = [int(b) for b in rng.permutation(BIG_BLOCKS)]
    G = BIG_HEAD // BIG_KV
    for spec in ([([], 0), (perm[:1367], 1367 * BS)], [(perm[:433], 433 * BS), (perm[433:1000], 567 * BS)]):
        # scores of a few units, as the bench's normalised q and k give (q pre-scaled by 1 / sqrt(head_dim))
        q = (rng.standard_normal((len(spec), BIG_HEAD, BIG_HD)) * (1.5 if kv_type == "f16" else 3.5)
             / np.sqrt(BIG_HD)).astype(np.float32)
        off, blocks, nk = lists(spec)
        ml, acc = attn_blocks_part(pool, kv_type, cache["k"], cache["v"], cache["ks"], cache["vs"], BIG_HD, BIG_HEAD,
                                   BIG_KV, q, off, blocks, nk)
        for t, (bl, n) in enumerate(spec):
            if not bl:
                assert np.isneginf(ml[t, :, 0]).all() and (ml[t, :, 1] == 0).all() and (acc[t] == 0).all()
                continue
            keys = np.concatenate([kf[b] for b in bl], axis=1)[:, :n]  # [kv head, key, dim]
            vals = np.concatenate([vf[b].transpose(1, 0, 2) for b in bl], axis=1)[:, :n]
            for h in range(BIG_HEAD):
                sc = keys[h // G].astype(np.float64) @ q[t, h].astype(np.float64)
                m = sc.max()
                p = np.exp(sc - m)
                s, a = p.sum(), p @ vals[h // G].astype(np.float64)
                got_m = float(ml[t, h, 0])
                assert abs(got_m - m) <= PART_TOL * max(1.0, abs(m)), (variant, t, h, got_m, m)
                got_s = float(ml[t, h, 1]) * np.exp(got_m - m)  # the sum at the reference's max
                assert abs(got_s - s) <= PART_TOL * s, (variant, t, h, got_s, s)
                out, ref = acc[t, h].astype(np.float64) / float(ml[t, h, 1]), a / s
                assert np.abs(out - ref).max() <= PART_TOL * np.abs(ref).max(), (variant, t, h)
