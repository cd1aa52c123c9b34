"""Split decode attention on the CPU (flash-decoding across the pool's threads) against the
unsplit reference, within the rule docs/engine.md states:

* attention outputs: max |split - unsplit| <= ATTN_TOL * max(1, max |unsplit|); the distance is
  mostly the unsplit kernel's own rounding (its sums run over every key in one chain), so each is
  also checked against float64 (<= ORACLE_TOL, the kernel harness's bar), where the split is the
  closer of the two;
* logits of a whole engine step: max |split - unsplit| <= LOGIT_TOL * max |unsplit| per sequence;
* a query under the automatic rule's threshold (one chunk) gives the unsplit bits exactly, and a
  sequence gets the same bits alone or in any batch.

At 1, 17 and 4,099 cached tokens, through the C entry point (every variant) and through real
engine steps holding 1 and 8 sequences of different lengths. The kernel harness
(tests/engine/test_kernels.py) checks each variant's partial kernel against the float64 oracle.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.native import (
    VARIANTS,
    EngineError,
    available_variants,
    ffi,
    get_attn_split,
    lib,
    set_attn_split,
)
from tests.engine.gguf_factory import make_deepseek2_gguf, make_gptoss_gguf, make_random_gguf
from tests.engine.test_kernels import attention, attention_split

ATTN_TOL = 5e-5
ORACLE_TOL = 1e-4
LOGIT_TOL = 2e-5
CACHED = (1, 17, 4099)
THREADS = 2


def plan(n_keys: int, n_threads: int, n_kv: int) -> int:
    out = ffi.new("int32_t *")
    assert lib.st_attn_split_plan(n_keys, n_threads, n_kv, out) == 0, ffi.string(lib.st_last_error())
    return int(out[0])


@pytest.fixture(autouse=True)
def auto_split() -> Iterator[None]:
    """Every test leaves the process-wide mode as serving has it."""
    yield
    set_attn_split("auto")


# ------------------------------------------------------------------------------------ the C entry point

@pytest.mark.parametrize("variant", available_variants())
@pytest.mark.parametrize("cached", CACHED)
@pytest.mark.parametrize("nq", [1, 3, 8])
def test_split_equals_unsplit_within_the_rule(variant: str, cached: int, nq: int) -> None:
    """A decode query after `cached` tokens (it sees cached + 1 keys), split in chunks of 16, 256
    and the automatic rule's, against the same variant's per-head kernel."""
    n_keys = cached + 1
    rng = np.random.default_rng(cached * 10 + nq)
    bs, hd, n_kv, kvh = 16, 64, 2, 1
    n_blocks = -(-n_keys // bs) + 1
    k = rng.standard_normal((n_blocks, n_kv, hd, bs)).astype(np.float16)
    v = rng.standard_normal((n_blocks, bs, n_kv * hd)).astype(np.float16)
    bt = rng.permutation(n_blocks).astype(np.int32)
    q = (rng.standard_normal((nq, hd)) * 0.5).astype(np.float32)
    ref = np.concatenate([attention(variant, k, v, bt, bs, hd, n_kv, kvh, q[i : i + 1].copy(), cached)
                          for i in range(nq)])
    j = np.arange(n_keys)
    keys = k[bt[j // bs], kvh, :, j % bs].astype(np.float64)  # [n_keys, hd]
    vals = v[bt[j // bs], j % bs, kvh * hd : (kvh + 1) * hd].astype(np.float64)
    s = q.astype(np.float64) @ keys.T
    p = np.exp(s - s.max(axis=1, keepdims=True))
    exact = p @ vals / p.sum(axis=1, keepdims=True)
    scale = max(1.0, np.abs(exact).max())
    assert np.abs(ref - exact).max() <= ORACLE_TOL * scale
    for chunk in (16, 256, plan(n_keys, 16, n_kv)):
        got = attention_split(variant, k, v, bt, bs, hd, n_kv, kvh, q, n_keys, chunk)
        err = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
        assert err <= ATTN_TOL, (chunk, err)
        assert np.abs(got - exact).max() <= ORACLE_TOL * scale
        if chunk >= n_keys:
            assert np.array_equal(got, ref)


def test_split_plan_follows_the_keys_and_the_pool() -> None:
    """The automatic rule: one chunk below 1,024 keys, then chunks of 256 to 1,024 keys, more of
    them for a bigger pool, always multiples of 16; "off" and a forced chunk override it."""
    assert get_attn_split() == "auto"
    for n_keys in (1, 18, 1023):
        assert plan(n_keys, THREADS, 3) == -(-n_keys // 16) * 16
    for n_threads in (1, 2, 16, 64):
        for n_keys in (1024, 4100, 16385, 131072):
            chunk = plan(n_keys, n_threads, 3)
            assert chunk % 16 == 0 and 256 <= chunk <= 1024
            assert chunk < n_keys or (n_keys == 1024 and n_threads == 1)  # one thread, 1,024 keys: one chunk
    assert plan(4100, 16, 3) < plan(4100, 2, 3)  # a bigger pool cuts finer
    assert plan(4096, 64, 1) == 256 and plan(4100, 64, 1) == 272  # never below 256 keys
    assert plan(1 << 30, 2, 3) > 1024  # at most 256 chunks
    set_attn_split("off")
    assert get_attn_split() == "off" and plan(131072, 2, 3) == 0
    set_attn_split(32)
    assert get_attn_split() == 32 and plan(5, 2, 3) == 32


def test_bad_modes_and_plans_are_typed_errors() -> None:
    for bad in (8, 24, -5, 2):
        with pytest.raises(EngineError, match="attention split mode"):
            set_attn_split(bad)
    with pytest.raises(ValueError, match="expected 'auto', 'off'"):
        set_attn_split("fast")
    assert get_attn_split() == "auto"
    out = ffi.new("int32_t *")
    for args in ((0, 2, 3), (10, 0, 3), (10, 2, 0)):
        assert lib.st_attn_split_plan(*args, out) == lib.ST_EINVAL
    assert lib.st_attn_split_plan(10, 2, 3, ffi.NULL) == lib.ST_EINVAL


# ------------------------------------------------------------------------------------ real engine steps

LENGTHS = (1, 17, 4099, 300, 2000, 5, 1500, 64)  # cached tokens of the 8 sequences (all different)
VOCAB = 160


@pytest.fixture(scope="module")
def primed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, list[list[int]], list[int]]]:
    """An engine (6 query heads over 2 KV heads, 2 threads) holding the 8 sequences' caches,
    prefilled once (prefill tiles never split; decode steps rewrite only their own position)."""
    path = make_random_gguf(tmp_path_factory.mktemp("split") / "m.gguf", n_embd=192, n_head=6, n_head_kv=2,
                            n_vocab=VOCAB, n_ctx=8192, seed=3)
    rng = np.random.default_rng(7)
    with Engine.open(path, threads=THREADS, kv_tokens=sum(LENGTHS) + 16 * len(LENGTHS)) as eng:
        tables = [eng.blocks.allocate(-(-(n + 1) // eng.block_size)) for n in LENGTHS]
        for n, table in zip(LENGTHS, tables, strict=True):
            eng.prefill([int(t) for t in rng.integers(0, VOCAB, n)], table)
        yield eng, tables, [int(t) for t in rng.integers(0, VOCAB, len(LENGTHS))]


def decode(primed: tuple[Engine, list[list[int]], list[int]], which: list[int], mode: str | int) -> np.ndarray:
    """One step holding the next token of each sequence in `which`; logits [len(which), vocab]."""
    eng, tables, nxt = primed
    set_attn_split(mode)
    return eng.forward([nxt[i] for i in which], [LENGTHS[i] for i in which], list(range(len(which))),
                       [tables[i] for i in which], list(range(len(which))))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("variant", available_variants())
def test_engine_steps_split_within_the_rule(primed: tuple[Engine, list[list[int]], list[int]], variant: str) -> None:
    """One sequence per step at 1, 17 and 4,099 cached tokens, then all 8 in one step: the automatic
    split and a forced one (16-key chunks, splitting even the short ones) against no split."""
    assert lib.st_set_variant(VARIANTS[variant]) == 0
    try:
        assert plan(4100, THREADS, 2) < 4100  # the long sequence really splits under the automatic rule
        everyone = list(range(len(LENGTHS)))
        cases = [[LENGTHS.index(c)] for c in CACHED] + [everyone]
        for which in cases:
            ref = decode(primed, which, "off")
            auto = decode(primed, which, "auto")
            forced = decode(primed, which, 16)
            for row, i in enumerate(which):
                assert rel_err(auto[row], ref[row]) <= LOGIT_TOL, (LENGTHS[i], rel_err(auto[row], ref[row]))
                assert rel_err(forced[row], ref[row]) <= LOGIT_TOL, (LENGTHS[i], rel_err(forced[row], ref[row]))
                if LENGTHS[i] + 1 < 1024:  # one chunk: the unsplit bits
                    assert np.array_equal(auto[row], ref[row]), LENGTHS[i]
        # the split depends on a sequence's own keys only: alone and in the batch, the same bits
        for mode in ("auto", 16):
            batch = decode(primed, everyone, mode)
            for i in everyone:
                assert np.array_equal(decode(primed, [i], mode)[0], batch[i]), (mode, LENGTHS[i])
    finally:
        lib.st_set_variant(VARIANTS["auto"])


def test_gptoss_sinks_split_within_the_rule(tmp_path: Path) -> None:
    """gpt-oss (a sink per head joins the combine; sliding layers stay unsplit) at 1,100 cached
    tokens: the automatic and a forced split against no split."""
    path = make_gptoss_gguf(tmp_path / "g.gguf", n_layer=2, seed=2)
    rng = np.random.default_rng(0)
    n = 1100
    with Engine.open(path, threads=THREADS, kv_tokens=n + 16) as eng:
        table = eng.blocks.allocate(-(-(n + 1) // eng.block_size))
        eng.prefill([int(t) for t in rng.integers(0, 200, n)], table)
        assert plan(n + 1, THREADS, eng.hparams.n_head_kv) < n + 1

        def step(mode: str | int) -> np.ndarray:
            set_attn_split(mode)
            return eng.forward([5], [n], [0], [table], [0])[0]

        ref = step("off")
        for mode in ("auto", 64):
            got = step(mode)
            assert rel_err(got, ref) <= LOGIT_TOL, (mode, rel_err(got, ref))
            assert not np.array_equal(got, ref)  # the split path ran


def test_deepseek2_latent_attention_split_within_the_rule(tmp_path: Path) -> None:
    """deepseek2's latent row (one KV head, values narrower than keys, every query head in its
    group) at 1,100 cached tokens: the automatic and a forced split against no split, and a
    decode below the split threshold (one chunk) equal to the unsplit bits."""
    path = make_deepseek2_gguf(tmp_path / "d.gguf", seed=4)
    rng = np.random.default_rng(1)
    n = 1100
    with Engine.open(path, threads=THREADS, kv_tokens=n + 16) as eng:
        assert eng.hparams.kv_lora_rank and eng.hparams.n_head_kv == 1
        table = eng.blocks.allocate(-(-(n + 1) // eng.block_size))
        prompt = [int(t) for t in rng.integers(0, 200, n)]
        eng.prefill(prompt, table)
        assert plan(n + 1, THREADS, 1) < n + 1

        def step(mode: str | int, pos: int = n) -> np.ndarray:
            set_attn_split(mode)
            return eng.forward([5], [pos], [0], [table], [0])[0]

        ref = step("off")
        for mode in ("auto", 64):
            got = step(mode)
            assert rel_err(got, ref) <= LOGIT_TOL, (mode, rel_err(got, ref))
            assert not np.array_equal(got, ref)  # the split path ran
        short = 40  # rewrites position 40 only; the keys before it are the prefill's
        assert np.array_equal(step("auto", short), step("off", short))
