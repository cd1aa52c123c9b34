"""engine.sampling: parameter validation, per-row semantics, reproducibility and speed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.sampling import MAX_STOP, Sampler, SamplingParams, SamplingParamsError, sample_one

V = 64


def _params(**kw: Any) -> SamplingParams:
    return SamplingParams.parse(**kw)


def _sample(logits: np.ndarray, params: SamplingParams, seed: int | None = 0, prompt: list[int] | None = None,
            output: list[int] | None = None) -> int:
    rng = np.random.default_rng(seed)
    res = Sampler().sample(logits[None, :], [params], [rng], [prompt or []], [output or []])
    return int(res.tokens[0])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# ----------------------------------------------------------------------------- validation

def test_defaults() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.max_tokens is None and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos and p.skip_special_tokens


def test_stop_normalised_and_top_k_minus_one() -> None:
    assert _params(stop="x").stop == ["x"]
    assert _params(stop=None).stop == []
    assert _params(stop=["a", "b"]).stop == ["a", "b"]
    assert _params(top_k=-1).top_k == 0
    assert _params(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert _params(temperature=2).temperature == 2.0  # an int is a valid number


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("temperature", float("nan")),
        ("temperature", "0.5"),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_p", -1.0),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -2.01),
        ("seed", 1 << 64),
        ("seed", -(1 << 63) - 1),
        ("seed", 1.0),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("stop", [""]),
        ("stop", ""),
        ("stop", ["x"] * (MAX_STOP + 1)),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("ignore_eos", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("skip_special_tokens", 1),
    ],
)
def test_out_of_range_rejected(param: str, value: Any) -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.parse(**{param: value})
    assert ei.value.param == param
    assert param in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_unknown_field_rejected() -> None:
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams.parse(temperature=0.5, best_of=2)
    assert ei.value.param == "best_of"
    assert "unknown parameter" in str(ei.value)


def test_boundaries_accepted() -> None:
    SamplingParams.parse(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, repetition_penalty=1e-3,
                         presence_penalty=-2.0, frequency_penalty=2.0, seed=(1 << 64) - 1,
                         max_tokens=1, stop=["x"] * MAX_STOP, logprobs=20)
    SamplingParams.parse(temperature=2.0, seed=-(1 << 63), logprobs=0)


def test_make_rng_negative_seed() -> None:
    a = _params(seed=-1).make_rng().random()
    b = _params(seed=(1 << 64) - 1).make_rng().random()
    assert a == b
    assert _params(seed=5).make_rng().random() == np.random.default_rng(5).random()


# ----------------------------------------------------------------------------- greedy

def test_greedy_is_argmax_ties_lowest_id() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((8, V)).astype(np.float32)
    logits[3, [5, 9, 40]] = 10.0  # a three-way tie for the max
    params = [_params(temperature=0)] * 8
    res = Sampler().sample(logits, params, [None] * 8, [[]] * 8, [[]] * 8)
    assert res.tokens.dtype == np.int32
    np.testing.assert_array_equal(res.tokens, np.argmax(logits, axis=1))
    assert res.tokens[3] == 5


def test_greedy_consumes_no_randomness() -> None:
    rng = np.random.default_rng(3)
    before = rng.bit_generator.state
    Sampler().sample(np.zeros((1, V), np.float32), [_params(temperature=0)], [rng], [[]], [[]])
    assert rng.bit_generator.state == before


def test_top_k_one_is_greedy() -> None:
    rng = np.random.default_rng(2)
    for _ in range(20):
        x = rng.standard_normal(V).astype(np.float32)
        x[[7, 30]] = x.max() + 1  # tie: greedy picks 7
        assert _sample(x, _params(top_k=1, temperature=1.5), seed=int(rng.integers(1 << 30))) == 7


def test_tiny_top_p_is_greedy() -> None:
    rng = np.random.default_rng(3)
    for s in range(30):
        x = rng.standard_normal(V).astype(np.float32)
        assert _sample(x, _params(top_p=1e-6), seed=s) == int(np.argmax(x))


def test_temperature_to_zero_limit() -> None:
    rng = np.random.default_rng(4)
    for s in range(30):
        x = rng.standard_normal(V).astype(np.float32)
        assert _sample(x, _params(temperature=1e-4), seed=s) == int(np.argmax(x))


def test_sample_one_compat() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(V).astype(np.float32)
    assert sample_one(x) == int(np.argmax(x))
    assert sample_one(x, temperature=0.0, top_k=3) == int(np.argmax(x))
    a = [sample_one(x, temperature=0.8, top_k=10, top_p=0.9, rng=np.random.default_rng(9)) for _ in range(3)]
    assert len(set(a)) == 1
    assert a[0] in set(np.argsort(-x)[:10].tolist())
    assert 0 <= sample_one(x, temperature=3.0, rng=np.random.default_rng(1)) < V  # > 2 allowed here
    for kw in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}):
        with pytest.raises(ValueError):
            sample_one(x, **kw)


# ----------------------------------------------------------------------------- filters

def test_top_k_restricts_support() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal(V).astype(np.float32)
    top5 = set(np.argsort(-x)[:5].tolist())
    got = {_sample(x, _params(top_k=5, temperature=2.0), seed=s) for s in range(300)}
    assert got == top5


def test_top_p_support() -> None:
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-9] * 4, dtype=np.float32))
    got = {_sample(x, _params(top_p=0.7), seed=s) for s in range(300)}
    assert got == {0, 1}  # 0.5 < 0.7 <= 0.8
    got = {_sample(x, _params(top_p=0.79), seed=s) for s in range(300)}
    assert got == {0, 1}
    got = {_sample(x, _params(top_p=0.5 - 1e-4), seed=s) for s in range(100)}
    assert got == {0}  # the first token alone reaches top_p
    got = {_sample(x, _params(top_p=0.81), seed=s) for s in range(300)}
    assert got == {0, 1, 2}


def test_top_p_large_vocab_candidate_and_fallback_paths() -> None:
    """Peaked (candidate set suffices) and flat (full sort needed) rows agree with a reference."""
    rng = np.random.default_rng(7)
    for scale in (8.0, 0.3):
        x = (rng.standard_normal(8192) * scale).astype(np.float32)
        p = _softmax(x)
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(cum, 0.9, side="left")) + 1
        nucleus = set(order[:n_keep].tolist())
        got = {_sample(x, _params(top_p=0.9), seed=s) for s in range(400)}
        assert got <= nucleus
        if scale == 0.3:
            assert n_keep > 1024  # really exercised the fallback


def test_min_p() -> None:
    x = np.log(np.array([0.4, 0.3, 0.1, 0.05, 0.03] + [0.12 / 59] * 59, dtype=np.float32))
    # threshold 0.2 * 0.4 = 0.08: tokens 0, 1, 2 survive
    got = {_sample(x, _params(min_p=0.2), seed=s) for s in range(300)}
    assert got == {0, 1, 2}
    got = {_sample(x, _params(min_p=1.0), seed=s) for s in range(50)}
    assert got == {0}
    # min_p after top_p: top_p=0.65 keeps {0, 1}; min_p 0.2 changes nothing more
    got = {_sample(x, _params(top_p=0.65, min_p=0.2), seed=s) for s in range(300)}
    assert got == {0, 1}


def test_min_p_relative_to_tempered_distribution() -> None:
    # At temperature 0.5 probs square: 0.3/0.4 -> 0.5625 ratio, 0.1/0.4 -> 0.0625 (< 0.1)
    x = np.log(np.array([0.4, 0.3, 0.1] + [0.2 / 61] * 61, dtype=np.float32))
    got = {_sample(x, _params(min_p=0.1, temperature=0.5), seed=s) for s in range(300)}
    assert got == {0, 1}


# ----------------------------------------------------------------------------- penalties

def test_repetition_penalty_numeric() -> None:
    x = np.array([2.0, -1.0, 1.5, 0.5], dtype=np.float32)
    p = _params(temperature=0, repetition_penalty=2.0)
    # token 0 seen in the prompt: 2.0 / 2 = 1.0 < 1.5 -> token 2 wins
    assert _sample(x, p, prompt=[0]) == 2
    # tokens 0 and 2 seen (prompt and output): 1.0, 0.75 vs unseen 0.5 -> token 0
    assert _sample(x, p, prompt=[0], output=[2]) == 0
    # negative logits are multiplied: -1.0 * 2 = -2.0; verify through the distribution
    y = np.array([-1.0, -1.2], dtype=np.float32)
    assert _sample(y, p) == 0
    assert _sample(y, p, output=[0]) == 1  # -2.0 < -1.2
    # penalty < 1 encourages repetition
    assert _sample(np.array([1.0, 1.5], np.float32), _params(temperature=0, repetition_penalty=0.5), prompt=[0]) == 0


def test_frequency_and_presence_penalty_numeric() -> None:
    x = np.array([3.0, 2.0, 1.05], dtype=np.float32)
    # frequency 0.5 * count 3 = 1.5: token 0 -> 1.5 < 2.0 -> token 1
    assert _sample(x, _params(temperature=0, frequency_penalty=0.5), output=[0, 0, 0]) == 1
    # count 1: 3.0 - 0.5 = 2.5 -> still token 0
    assert _sample(x, _params(temperature=0, frequency_penalty=0.5), output=[0]) == 0
    # presence counts once: 3.0 - 1.5 = 1.5, 2.0 - 1.5 = 0.5 -> token 0 beats... 1.5 > 1.05
    assert _sample(x, _params(temperature=0, presence_penalty=1.5), output=[0, 0, 0, 1]) == 0
    # presence 2: 1.0 and 0.0 vs 1.05 -> token 2
    assert _sample(x, _params(temperature=0, presence_penalty=2.0), output=[0, 1, 1]) == 2
    # presence/frequency ignore the prompt
    assert _sample(x, _params(temperature=0, presence_penalty=2.0), prompt=[0, 1]) == 0
    # negative penalties encourage
    assert _sample(x, _params(temperature=0, frequency_penalty=-1.0), output=[2, 2]) == 2


def test_penalties_exact_distribution() -> None:
    """With temperature 1 the penalised logits define the sampling distribution exactly."""
    x = np.array([1.0, 0.5, -0.5, 0.0], dtype=np.float32)
    p = _params(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.1)
    prompt, output = [1], [0, 0, 2]
    z = x.astype(np.float64).copy()
    for t in (0, 1, 2):
        z[t] = z[t] / 1.5 if z[t] > 0 else z[t] * 1.5
    z[0] -= 0.25 * 2 + 0.1
    z[2] -= 0.25 * 1 + 0.1
    expected = _softmax(z)
    n = 20000
    rng = np.random.default_rng(11)
    sampler = Sampler()
    counts = np.zeros(4)
    logits = np.repeat(x[None, :], 500, axis=0)
    for _ in range(n // 500):
        res = sampler.sample(logits, [p] * 500, [rng] * 500, [prompt] * 500, [output] * 500)
        counts += np.bincount(res.tokens, minlength=4)
    np.testing.assert_allclose(counts / n, expected, atol=0.015)


def test_logits_not_modified() -> None:
    x = np.array([[1.0, 2.0, -1.0]], dtype=np.float32)
    before = x.copy()
    p = _params(repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=1.0)
    Sampler().sample(x, [p], [np.random.default_rng(0)], [[0, 1, 2]], [[1]])
    np.testing.assert_array_equal(x, before)


# ----------------------------------------------------------------------------- logprobs

def test_logprobs_are_raw_log_softmax() -> None:
    rng = np.random.default_rng(12)
    logits = (rng.standard_normal((4, 500)) * 3).astype(np.float32)
    params = [
        _params(temperature=0, logprobs=5),
        _params(temperature=0.7, top_k=20, repetition_penalty=1.3, logprobs=0),
        _params(temperature=1.2, top_p=0.8),
        _params(min_p=0.1, frequency_penalty=1.0, logprobs=20),
    ]
    res = Sampler().sample(logits, params, [np.random.default_rng(i) for i in range(4)],
                           [[1, 2, 3]] * 4, [[4, 5]] * 4)
    ref = _log_softmax(logits)
    assert res.logprobs.dtype == np.float32
    asked = [0, 1, 3]  # row 2 asked for none: not computed (NaN)
    np.testing.assert_allclose(res.logprobs[asked], ref[asked, res.tokens[asked]], rtol=1e-5, atol=1e-5)
    assert np.isnan(res.logprobs[2])
    assert res.top_logprobs[1] == [] and res.top_logprobs[2] is None
    for row, n in ((0, 5), (3, 20)):
        top = res.top_logprobs[row]
        assert top is not None and len(top) == n
        ids = [t for t, _ in top]
        assert ids == np.argsort(-ref[row], kind="stable")[:n].tolist()
        lps = [lp for _, lp in top]
        assert lps == sorted(lps, reverse=True)
        np.testing.assert_allclose(lps, ref[row, ids], rtol=1e-5, atol=1e-5)
    assert res.top_logprobs[0][0][0] == res.tokens[0]  # greedy pick is the top alternative


def test_top_logprobs_ties_lowest_id_first() -> None:
    x = np.zeros((1, 10), dtype=np.float32)
    x[0, [8, 2, 5]] = 1.0
    res = Sampler().sample(x, [_params(temperature=0, logprobs=3)], [None], [[]], [[]])
    assert [t for t, _ in res.top_logprobs[0]] == [2, 5, 8]
    assert res.tokens[0] == 2


# ----------------------------------------------------------------------------- reproducibility

def test_seeded_row_independent_of_batch() -> None:
    vocab = 2048
    rng = np.random.default_rng(13)
    target = (rng.standard_normal(vocab) * 2).astype(np.float32)
    p = _params(temperature=0.9, top_p=0.95, top_k=200, min_p=0.01, seed=1234)
    sampler = Sampler()

    alone_rng = p.make_rng()
    alone = [int(sampler.sample(target[None, :], [p], [alone_rng], [[]], [[]]).tokens[0]) for _ in range(50)]

    batch_rng = p.make_rng()
    others = [_params(temperature=float(t), top_p=0.9) for t in rng.uniform(0, 2, 15)]
    other_rngs: list[np.random.Generator | None] = [np.random.default_rng(int(s)) for s in rng.integers(1 << 30, size=15)]
    other_rngs[3] = None  # unseeded rows mixed in
    in_batch = []
    for _ in range(50):
        logits = (rng.standard_normal((16, vocab)) * 2).astype(np.float32)
        logits[7] = target
        params = others[:7] + [p] + others[7:]
        rngs = other_rngs[:7] + [batch_rng] + other_rngs[7:]
        res = sampler.sample(logits, params, rngs, [[]] * 16, [[]] * 16)
        in_batch.append(int(res.tokens[7]))
    assert alone == in_batch
    assert len(set(alone)) > 5  # really sampling, not stuck


def test_one_draw_per_token() -> None:
    p = _params(temperature=1.0, top_p=0.9, seed=7)
    rng = p.make_rng()
    ref = p.make_rng()
    x = np.random.default_rng(0).standard_normal((1, 300)).astype(np.float32)
    Sampler().sample(x, [p], [rng], [[]], [[]])
    ref.random()
    assert rng.bit_generator.state == ref.bit_generator.state


def test_unseeded_rows_vary() -> None:
    x = np.zeros((1, 1000), dtype=np.float32)
    got = {int(Sampler().sample(x, [_params()], [None], [[]], [[]]).tokens[0]) for _ in range(20)}
    assert len(got) > 1


# ----------------------------------------------------------------------------- statistics

def test_temperature_one_follows_softmax() -> None:
    rng = np.random.default_rng(14)
    x = (rng.standard_normal(12) * 1.5).astype(np.float32)
    expected = _softmax(x)
    n = 30000
    draws = np.random.default_rng(15)
    logits = np.repeat(x[None, :], 1000, axis=0)
    sampler = Sampler()
    counts = np.zeros(12)
    params = [_params()] * 1000
    for _ in range(n // 1000):
        counts += np.bincount(sampler.sample(logits, params, [draws] * 1000).tokens, minlength=12)
    chi2 = float((((counts - n * expected) ** 2) / (n * expected)).sum())
    assert chi2 < 40.0  # 11 dof: p(chi2 > 40) ~ 3e-5; a wrong distribution gives hundreds+


def test_temperature_scales_distribution() -> None:
    x = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))
    expected = _softmax(x / 0.5)
    n = 20000
    draws = np.random.default_rng(16)
    logits = np.repeat(x[None, :], 1000, axis=0)
    params = [_params(temperature=0.5)] * 1000
    counts = np.zeros(3)
    for _ in range(n // 1000):
        counts += np.bincount(Sampler().sample(logits, params, [draws] * 1000).tokens, minlength=3)
    np.testing.assert_allclose(counts / n, expected, atol=0.015)


# ----------------------------------------------------------------------------- speed

def test_shape_mismatch_errors() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros(5, np.float32), [_params()], [None])
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros((2, 5), np.float32), [_params()], [None])
