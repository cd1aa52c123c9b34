"""st_moe_pairs, the CPU expert entry point of the hybrid GPU engine: its rows, weighted and summed as the
step sums them, are bitwise the CPU engine's own routed FFN (st_moe_layer, the code st_forward runs);
each row is independent of the other pairs; bad input is a typed error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.default_model import quantize_q4_k
from engine.engine import Engine
from engine.native import EngineError, OutOfRangeError
from tests.engine.gguf_factory import make_random_gguf

# (arch, weight type, extra factory arguments): Mixtral-style llama, Qwen3-MoE (q/k norms, NEOX rope),
# Qwen2-MoE (shared expert, no renormalisation), over float, repacked (Q8_0 / Q4_1) and K-quant weights
CASES = {
    "llama-f32": ("llama", Q.F32, {}),
    "llama-q8_0": ("llama", Q.Q8_0, {}),
    "llama-q4_1": ("llama", Q.Q4_1, {}),
    "qwen3moe-q4_k": ("qwen3moe", Q.Q8_0, {"qk_norm": True, "n_embd": 256, "n_ff": 256, "n_head": 4}),
    "qwen2moe-q5_0": ("qwen2moe", Q.Q5_0, {"qkv_bias": True, "n_ff_shexp": 64}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def eng(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    arch, wt, extra = CASES[request.param]
    kw = {"n_embd": 64, "n_ff": 96, "n_expert": 8, "n_expert_used": 2, **extra}
    if request.param.endswith("q4_k"):  # routed experts in Q4_K (gguf-py has no Q4_K quantiser)
        kw["raw_overrides"] = _q4_k_experts(n_layer=2, n_expert=8, n_embd=kw["n_embd"], n_ff=kw["n_ff"])
    path = make_random_gguf(tmp_path_factory.mktemp("moe") / f"{request.param}.gguf", arch=arch, n_layer=2,
                            weight_type=wt, seed=3, **kw)
    e = Engine.open(path, threads=2, kv_tokens=64)
    yield e
    e.close()


def _q4_k_experts(n_layer: int, n_expert: int, n_embd: int, n_ff: int) -> dict[str, tuple[np.ndarray, tuple[int, ...], Q]]:
    rng = np.random.default_rng(11)
    out = {}
    for il in range(n_layer):
        for name, rows, cols in (("gate", n_ff, n_embd), ("up", n_ff, n_embd), ("down", n_embd, n_ff)):
            x = (rng.standard_normal((n_expert * rows, cols)) * 0.08).astype(np.float32)
            blob = quantize_q4_k(x).reshape(n_expert, rows, -1)
            out[f"blk.{il}.ffn_{name}_exps.weight"] = (blob, blob.shape, Q.Q4_K)
    return out


def _combine(out_pairs: np.ndarray, ids: np.ndarray, w: np.ndarray, norm: bool) -> np.ndarray:
    """moe.c's combine: per token, sum_j p_j o_j in slot order in double, over sum_j p_j (renormalised),
    one rounding to float, added to a zero residual."""
    T, k = ids.shape
    o = out_pairs.reshape(T, k, -1).astype(np.float64)
    num = np.zeros((T, o.shape[2]), np.float64)
    den = np.zeros((T, 1), np.float64)
    for j in range(k):
        num = num + w[:, j : j + 1].astype(np.float64) * o[:, j, :]
        den = den + w[:, j : j + 1].astype(np.float64)
    if not norm:
        den = np.ones_like(den)
    return np.float32(0.0) + (num / den).astype(np.float32)


@pytest.mark.parametrize("T", [1, 7, 70])  # 70: more pairs per expert than one 64-token tile
def test_pairs_weighted_and_summed_equal_the_steps_routed_ffn_bitwise(eng: Engine, T: int) -> None:
    rng = np.random.default_rng(T)
    hp = eng.hparams
    for layer in range(hp.n_layer):
        x = rng.standard_normal((T, hp.n_embd)).astype(np.float32)
        ref, ids, w = eng.moe_layer(layer, x)
        k = hp.n_expert_used
        tok = np.repeat(np.arange(T, dtype=np.int32), k)
        exp = ids.reshape(-1)
        # the caller's pair order is its own: shuffled, the rows are the same bits
        perm = rng.permutation(tok.size)
        got = np.empty((tok.size, hp.n_embd), np.float32)
        got[perm] = eng.moe_pairs(layer, x, tok[perm], exp[perm])
        np.testing.assert_array_equal(_combine(got, ids, w, hp.expert_norm), ref)


def test_a_pairs_row_does_not_depend_on_the_other_pairs(eng: Engine) -> None:
    rng = np.random.default_rng(1)
    hp = eng.hparams
    T = 9
    x = rng.standard_normal((T, hp.n_embd)).astype(np.float32)
    tok = np.repeat(np.arange(T, dtype=np.int32), hp.n_expert)  # every (token, expert)
    exp = np.tile(np.arange(hp.n_expert, dtype=np.int32), T)
    full = eng.moe_pairs(1, x, tok, exp)
    pick = rng.choice(tok.size, size=11, replace=False)
    np.testing.assert_array_equal(eng.moe_pairs(1, x, tok[pick], exp[pick]), full[pick])
    one = eng.moe_pairs(1, x[3:4], [0], [5])  # a batch of one token: the same bits as inside the larger one
    np.testing.assert_array_equal(one[0], full[3 * hp.n_expert + 5])
    assert np.isfinite(full).all() and np.abs(full).max() > 0


def test_moe_layer_routes_k_distinct_experts_by_descending_weight(eng: Engine) -> None:
    """The routing st_moe_layer reports (and st_moe_pairs' caller weights by): k distinct experts per token,
    the softmax's top-k probabilities in descending slot order."""
    hp = eng.hparams
    x = np.random.default_rng(5).standard_normal((16, hp.n_embd)).astype(np.float32)
    _, ids, w = eng.moe_layer(0, x)
    assert ids.shape == (16, hp.n_expert_used)
    assert all(len(set(r)) == hp.n_expert_used for r in ids.tolist())
    assert ((ids >= 0) & (ids < hp.n_expert)).all()
    assert (np.diff(w, axis=1) <= 0).all() and (w > 0).all() and (w.sum(axis=1) <= 1 + 1e-6).all()


def test_bad_input_is_a_typed_error(eng: Engine) -> None:
    hp = eng.hparams
    x = np.zeros((4, hp.n_embd), np.float32)
    with pytest.raises(OutOfRangeError, match="layer"):
        eng.moe_pairs(hp.n_layer, x, [0], [0])
    with pytest.raises(OutOfRangeError, match="layer"):
        eng.moe_pairs(-1, x, [0], [0])
    with pytest.raises(OutOfRangeError, match="expert 8 outside"):
        eng.moe_pairs(0, x, [0, 1], [0, hp.n_expert])
    with pytest.raises(OutOfRangeError, match="token 4 outside"):
        eng.moe_pairs(0, x, [4], [0])
    with pytest.raises(OutOfRangeError, match="token -1 outside"):
        eng.moe_pairs(0, x, [-1], [0])
    with pytest.raises(EngineError, match="at most one pair per token and expert"):
        n = 4 * hp.n_expert + 1
        eng.moe_pairs(0, x, np.zeros(n, np.int32), np.zeros(n, np.int32))
    with pytest.raises(ValueError, match="same length"):
        eng.moe_pairs(0, x, [0, 1], [0])
    with pytest.raises(ValueError, match="float32"):
        eng.moe_pairs(0, np.zeros((4, hp.n_embd + 1), np.float32), [0], [0])
    assert eng.moe_pairs(0, x, [], []).shape == (0, hp.n_embd)
    # the engine still steps normally afterwards
    assert np.isfinite(eng.logits_for([1, 2, 3])).all()


def test_a_dense_model_has_no_routed_experts(tmp_path: Path) -> None:
    path = make_random_gguf(tmp_path / "dense.gguf", n_expert=0, n_expert_used=0)
    with Engine.open(path, threads=1, kv_tokens=32) as e:
        with pytest.raises(EngineError, match="no routed experts"):
            e.moe_pairs(0, np.zeros((1, e.hparams.n_embd), np.float32), [0], [0])


def test_default_model_pairs_equal_its_routed_ffn(engine: Engine) -> None:
    """The embedded default model (Q4_1 experts, repacked at the first CPU call)."""
    hp = engine.hparams
    x = np.random.default_rng(2).standard_normal((5, hp.n_embd)).astype(np.float32)
    ref, ids, w = engine.moe_layer(3, x)
    tok = np.repeat(np.arange(5, dtype=np.int32), hp.n_expert_used)
    got = engine.moe_pairs(3, x, tok, ids.reshape(-1))
    np.testing.assert_array_equal(_combine(got, ids, w, hp.expert_norm), ref)


def test_every_kernel_variant_keeps_the_pairs_bitwise(eng: Engine) -> None:
    """The reference kernels and each SIMD variant this CPU runs: per variant, the pairs reproduce the
    routed FFN bit for bit (the variants agree with each other within rounding, which the kernel harness
    checks; here the entry point must not change a variant's bits)."""
    from engine.native import VARIANTS, available_variants, check, lib

    hp = eng.hparams
    x = np.random.default_rng(4).standard_normal((6, hp.n_embd)).astype(np.float32)
    tok = np.repeat(np.arange(6, dtype=np.int32), hp.n_expert_used)
    try:
        for name in available_variants():
            check(lib.st_set_variant(VARIANTS[name]), name)
            ref, ids, w = eng.moe_layer(0, x)
            got = eng.moe_pairs(0, x, tok, ids.reshape(-1))
            np.testing.assert_array_equal(_combine(got, ids, w, hp.expert_norm), ref, err_msg=name)
    finally:
        check(lib.st_set_variant(VARIANTS["auto"]), "auto")


def test_moe_layer_routes_as_the_step_does(tmp_path: Path) -> None:
    """Tie st_moe_layer to st_forward: in a one-layer model whose attention output is zero, the FFN input is
    RMSNorm(embedding row), which numpy repeats bit for bit (st_rmsnorm_row: a sequential double sum of
    squares, one float scale); the step's expert histogram then equals the routes st_moe_layer takes."""
    E, H = 64, 4
    path = make_random_gguf(tmp_path / "one.gguf", n_layer=1, n_embd=E, n_head=H, n_expert=8, n_expert_used=2,
                            overrides={"blk.0.attn_output.weight": np.zeros((E, E), np.float32)}, seed=21)
    with Engine.open(path, threads=2, kv_tokens=64) as e:
        mf = e.model_file
        ids = [5, 17, 3, 99, 42, 7, 64, 1, 120, 33, 8, 77]
        emb = np.asarray(mf.tensors["token_embd.weight"].data).view(np.float32).reshape(-1, E)[ids]
        w = np.asarray(mf.tensors["blk.0.ffn_norm.weight"].data).view(np.float32)
        ss = np.cumsum(emb.astype(np.float64) ** 2, axis=1)[:, -1]  # sequential, as the C loop adds
        scale = (1.0 / np.sqrt(ss / E + np.float64(e.hparams.norm_eps))).astype(np.float32)
        xn = w[None, :] * (emb * scale[:, None])
        hist = np.zeros((1, 8), np.int32)
        blocks = e.blocks.allocate(1)
        try:
            e.forward(ids, list(range(len(ids))), [0] * len(ids), [blocks], [len(ids) - 1], expert_hist=hist)
        finally:
            e.blocks.release(blocks)
        _, routes, _ = e.moe_layer(0, xn)
        np.testing.assert_array_equal(hist[0], np.bincount(routes.reshape(-1), minlength=8))
        assert (hist > 0).sum() >= 4  # a real spread of experts, not one


@pytest.mark.parametrize("case", ["llama-f32", "qwen3moe-q4_k", "qwen2moe-q5_0"])
def test_routed_ffn_bits_do_not_depend_on_the_pools_threads(case: str, tmp_path: Path) -> None:
    """The grouped FFN runs gate / up and down in one pool region, a group's down items waiting for the thread
    that finishes its last gate / up item (and quantises its h rows): one thread takes every item in order, six
    on this machine's cores interleave them and wait. Each row is the same calls on the same inputs either way,
    so the routed FFN's output and the step's logits are bitwise the same for 1, 2, 3 and 6 threads, at a
    decode-sized and a prefill-sized batch."""
    arch, wt, extra = CASES[case]
    kw = {"n_embd": 64, "n_ff": 96, "n_expert": 8, "n_expert_used": 2, **extra}
    if case.endswith("q4_k"):
        kw["raw_overrides"] = _q4_k_experts(n_layer=2, n_expert=8, n_embd=kw["n_embd"], n_ff=kw["n_ff"])
    path = make_random_gguf(tmp_path / f"{case}.gguf", arch=arch, n_layer=2, weight_type=wt, seed=5, **kw)
    rng = np.random.default_rng(9)
    prompt = [int(t) for t in rng.integers(0, 100, 40)]
    got: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
    for threads in (1, 2, 3, 6):
        with Engine.open(path, threads=threads, kv_tokens=64) as e:
            layers = [e.moe_layer(0, rng_x)[0] for rng_x in (
                np.random.default_rng(1).standard_normal((T, e.hparams.n_embd)).astype(np.float32) for T in (1, 37))]
            got[threads] = (layers, np.asarray(e.logits_for(prompt)))
    for threads in (2, 3, 6):
        for a, b in zip(got[1][0], got[threads][0], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{threads} threads")
        np.testing.assert_array_equal(got[1][1], got[threads][1], err_msg=f"{threads} threads")
