"""Hybrid placement (engine/placement.py): routing statistics with decay, the versioned placement file and
its model identity, and the GPU plan, whose budget is never exceeded (a property over random models,
budgets and frequencies)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine import placement as pl
from engine.gguf_model import HParams, ModelFile, TensorRef, open_model
from engine.native import EngineError
from tests.engine.gguf_factory import make_random_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("placement")
    return {
        "a": make_random_gguf(d / "a.gguf", n_layer=2, n_expert=4, n_expert_used=2, weight_type=Q.Q8_0),
        "a_other_seed": make_random_gguf(d / "a2.gguf", n_layer=2, n_expert=4, n_expert_used=2,
                                         weight_type=Q.Q8_0, seed=9),
        "a_q4_0": make_random_gguf(d / "a3.gguf", n_layer=2, n_expert=4, n_expert_used=2, weight_type=Q.Q4_0),
        "three_layers": make_random_gguf(d / "b.gguf", n_layer=3, n_expert=4, n_expert_used=2),
        "qwen2moe": make_random_gguf(d / "c.gguf", arch="qwen2moe", n_layer=2, n_expert=8, n_expert_used=2,
                                     n_ff_shexp=32, qkv_bias=True, weight_type=Q.Q8_0),
        "dense": make_random_gguf(d / "dense.gguf", n_expert=0, n_expert_used=0),
    }


# ---------------------------------------------------------------- routing statistics

def test_stats_sum_histograms_and_give_routing_probabilities() -> None:
    s = pl.RoutingStats.empty(2, 4, 2)
    np.testing.assert_array_equal(s.frequencies(), np.full((2, 4), 0.5))  # nothing counted: uniform k / n
    s.update(np.array([[3, 1, 0, 2], [0, 0, 3, 3]], np.int32))  # 3 tokens x top-2 per layer
    s.update(np.array([[1, 0, 1, 0], [1, 1, 0, 0]], np.int32))  # 1 token
    np.testing.assert_array_equal(s.tokens, [4.0, 4.0])
    f = s.frequencies()
    np.testing.assert_allclose(f, [[1.0, 0.25, 0.25, 0.5], [0.25, 0.25, 0.75, 0.75]])
    np.testing.assert_allclose(f.sum(axis=1), 2.0)


def test_decay_halves_old_counts_every_half_life_of_tokens() -> None:
    s = pl.RoutingStats.empty(1, 4, 1, half_life_tokens=100)
    s.update(np.array([[100, 0, 0, 0]]))  # a workload on expert 0
    s.update(np.array([[0, 100, 0, 0]]))  # then 100 tokens on expert 1: the first half-weighted
    np.testing.assert_allclose(s.counts, [[50.0, 100.0, 0.0, 0.0]])
    np.testing.assert_allclose(s.tokens, [150.0])
    for _ in range(20):  # the new workload takes over
        s.update(np.array([[0, 100, 0, 0]]))
    f = s.frequencies()[0]
    assert f[1] > 0.999 and f[0] < 1e-3 and abs(f.sum() - 1) < 1e-9


def test_bad_histograms_and_counts_are_refused() -> None:
    s = pl.RoutingStats.empty(2, 4, 2)
    with pytest.raises(pl.PlacementError, match="shape"):
        s.update(np.zeros((2, 5), np.int32))
    with pytest.raises(pl.PlacementError, match="non-negative integer"):
        s.update(np.full((2, 4), -1, np.int32))
    with pytest.raises(pl.PlacementError, match="non-negative integer"):
        s.update(np.full((2, 4), 0.5))
    with pytest.raises(ValueError, match="exceeds the tokens"):
        pl.RoutingStats(n_layer=1, n_expert=2, n_expert_used=1, counts=[[5.0, 0.0]], tokens=[4.0])
    with pytest.raises(ValueError, match="counts must be"):
        pl.RoutingStats(n_layer=1, n_expert=2, n_expert_used=1, counts=[[0.0]], tokens=[0.0])


# ---------------------------------------------------------------- the placement file

def test_file_round_trip_and_identity(files: dict[str, Path], tmp_path: Path) -> None:
    mf = open_model(files["a"])
    s = pl.RoutingStats.for_model(mf)
    s.update(np.array([[4, 2, 1, 1], [0, 2, 3, 3]], np.int32))
    pf = pl.PlacementFile.for_model(mf, s, source="unit test")
    out = pf.save(tmp_path / "p.json")
    back = pl.PlacementFile.load(out, model=mf)
    assert back.stats.same(s) and back.model == pf.model and back.source == "unit test"
    np.testing.assert_array_equal(back.stats.frequencies(), s.frequencies())
    raw = json.loads(out.read_text())
    assert raw["format"] == "strata-placement" and raw["version"] == pl.PLACEMENT_VERSION
    assert raw["model"]["tensor_table_sha256"] == pl.tensor_table_hash(mf)
    # the identity is the tensor layout: other weights of the same layout are the same model here
    pl.PlacementFile.load(out, model=open_model(files["a_other_seed"]))
    for other, what in (("a_q4_0", "tensor_table_sha256"), ("three_layers", "n_layer"), ("qwen2moe", "arch")):
        with pytest.raises(pl.PlacementMismatchError, match=what):
            pl.PlacementFile.load(out, model=open_model(files[other]))


def test_unreadable_files_are_typed_errors(files: dict[str, Path], tmp_path: Path) -> None:
    mf = open_model(files["a"])
    good = json.loads(pl.PlacementFile.for_model(mf, pl.RoutingStats.for_model(mf)).to_json())
    cases = {
        "missing.json": None,
        "garbage.json": b"\x00\xffnot json",
        "truncated.json": json.dumps(good).encode()[:50],
        "list.json": b"[1, 2]",
        "format.json": json.dumps({**good, "format": "other"}).encode(),
        "version.json": json.dumps({**good, "version": 99}).encode(),
        "shape.json": json.dumps({**good, "stats": {**good["stats"], "counts": [[0.0]]}}).encode(),
        "extra.json": json.dumps({**good, "surprise": 1}).encode(),
    }
    for name, data in cases.items():
        p = tmp_path / name
        if data is not None:
            p.write_bytes(data)
        with pytest.raises(pl.PlacementFormatError, match=name):
            pl.PlacementFile.load(p)
    with pytest.raises(pl.PlacementFormatError, match="version 99"):
        pl.PlacementFile.load(tmp_path / "version.json")
    with pytest.raises(pl.PlacementError, match="dense model"):
        pl.model_identity(open_model(files["dense"]))


# ---------------------------------------------------------------- the plan

def _synthetic(rng: np.random.Generator, n_layer: int | None = None, expert_type: Q | None = None) -> ModelFile:
    """A model's tensor table without its weights (the plan reads names, types, shapes and byte counts):
    random shapes, quant types per layer (every layer's experts in expert_type where given), tied or separate
    head, shared experts or not; n_layer layers where given, else a random count."""
    types = {Q.Q4_0: (32, 18), Q.Q8_0: (32, 34), Q.Q4_K: (256, 144), Q.Q6_K: (256, 210), Q.F16: (1, 2)}
    n_layer = int(rng.integers(1, 48)) if n_layer is None else n_layer
    n_embd = 256 * int(rng.integers(1, 16))
    n_ff = 256 * int(rng.integers(1, 12))
    n_expert = int(rng.choice([4, 8, 16, 64, 128]))
    k = int(rng.integers(1, min(n_expert, 8) + 1))
    n_head, n_kv, hd = 16, int(rng.choice([2, 4, 8])), 128
    n_vocab = int(rng.integers(1000, 160_000))
    shexp = bool(rng.integers(0, 2))
    tensors: dict[str, TensorRef] = {}

    def add(name: str, shape: tuple[int, ...], qt: Q) -> None:
        blk, size = types.get(qt, (1, 4))
        n = int(np.prod(shape))
        tensors[name] = TensorRef(name, int(qt), shape, np.empty(0, np.uint8), n // blk * size)

    add("token_embd.weight", (n_embd, n_vocab), Q.Q8_0)
    add("output_norm.weight", (n_embd,), Q.F32)
    if rng.integers(0, 2):
        add("output.weight", (n_embd, n_vocab), Q.Q6_K)
    for il in range(n_layer):
        qt = [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16][int(rng.integers(0, 5))] if expert_type is None else expert_type
        p = f"blk.{il}."
        for nm, shape in (("attn_q", (n_embd, n_head * hd)), ("attn_k", (n_embd, n_kv * hd)),
                          ("attn_v", (n_embd, n_kv * hd)), ("attn_output", (n_head * hd, n_embd))):
            add(p + nm + ".weight", shape, Q.Q8_0)
        add(p + "attn_norm.weight", (n_embd,), Q.F32)
        add(p + "ffn_norm.weight", (n_embd,), Q.F32)
        add(p + "ffn_gate_inp.weight", (n_embd, n_expert), Q.F32)
        add(p + "ffn_gate_exps.weight", (n_embd, n_ff, n_expert), qt)
        add(p + "ffn_up_exps.weight", (n_embd, n_ff, n_expert), qt)
        add(p + "ffn_down_exps.weight", (n_ff, n_embd, n_expert), qt)
        if shexp:
            add(p + "ffn_gate_shexp.weight", (n_embd, n_ff), Q.Q8_0)
            add(p + "ffn_up_shexp.weight", (n_embd, n_ff), Q.Q8_0)
            add(p + "ffn_down_shexp.weight", (n_ff, n_embd), Q.Q8_0)
    hp = HParams(arch="qwen3moe", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_kv, head_dim=hd,
                 n_vocab=n_vocab, n_ctx_train=32768, n_expert=n_expert, n_expert_used=k, n_ff_exp=n_ff,
                 rope_dim=hd)
    return ModelFile(path=Path("synthetic.gguf"), metadata={}, hparams=hp, tensors=tensors)


def _freqs(rng: np.random.Generator, n_layer: int, n_expert: int, k: int) -> np.ndarray | None:
    kind = int(rng.integers(0, 3))
    if kind == 0:
        return None  # uniform
    if kind == 1:  # Zipf-skewed, a random expert order per layer
        w = 1.0 / np.arange(1, n_expert + 1) ** float(rng.uniform(0.5, 2.0))
        f = np.stack([rng.permutation(w) for _ in range(n_layer)])
    else:
        f = rng.random((n_layer, n_expert)) * (rng.random((n_layer, n_expert)) > 0.3)
    s = f.sum(axis=1, keepdims=True)
    return np.where(s > 0, f / np.where(s > 0, s, 1) * k, 0.0)


def test_budget_is_never_exceeded_and_the_fill_is_greedy() -> None:
    rng = np.random.default_rng(20261203)
    for _ in range(150):
        mf = _synthetic(rng)
        hp = mf.hparams
        freqs = _freqs(rng, hp.n_layer, hp.n_expert, hp.n_expert_used)
        eb = pl.expert_bytes(mf)
        base = pl.PlanParams(budget_bytes=0, n_ctx=int(rng.integers(1, 65536)), n_seqs=int(rng.integers(1, 5)),
                             cpu_read_gbs=float(rng.uniform(5, 300)), gpu_read_gbs=float(rng.uniform(300, 5000)),
                             staging_slots=int(rng.integers(0, 4)))
        fixed = sum(pl.fixed_gpu_bytes(mf, base.n_ctx, base.n_seqs, staging_slots=base.staging_slots).values())
        budget = int(rng.uniform(0.5, 1.0) * fixed + rng.uniform(0, 1.3) * eb.sum())
        p = pl.plan(mf, base.model_copy(update={"budget_bytes": budget}), freqs)
        res = np.zeros(eb.shape, bool)
        for il, ids in enumerate(p.resident):
            res[il, ids] = True
        assert p.fixed_bytes == fixed and p.resident_bytes == int(eb[res].sum())
        if not p.fits:
            assert fixed > budget and p.n_resident == 0
            continue
        assert p.gpu_bytes == fixed + p.resident_bytes <= budget
        left = budget - p.gpu_bytes
        assert not (eb[~res] <= left).any(), "an expert that fits was left out"
        f = freqs if freqs is not None else np.full(eb.shape, hp.n_expert_used / hp.n_expert)
        score = f / eb
        for b in np.unique(eb):  # the greedy order: among experts of one size, the resident ones score highest
            same = eb == b
            if (res & same).any() and (~res & same).any():
                assert score[res & same].min() >= score[~res & same].max()
        ram = float((f * eb * ~res).sum())
        assert p.ram_bytes_per_token == pytest.approx(ram, rel=1e-12, abs=1e-6)
        total = float(f.sum())
        assert p.hit_rate == pytest.approx(float(f[res].sum()) / total if total else 0.0)
        assert p.predicted_tok_s >= p.cpu_only_tok_s * (1 - 1e-9) > 0  # the GPU's bandwidth is the higher here


def test_layer_fill_rank_leaves_spread_layers_without_experts() -> None:
    """Ties go to layers in layer_fill_rank's order: a permutation whose last k layers (those a budget leaves
    without resident experts) are spread over the depth for every k, never a block at the end."""
    for n in (1, 2, 3, 5, 48, 61, 94):
        rank = pl.layer_fill_rank(n)
        assert sorted(rank.tolist()) == list(range(n))
        order = np.argsort(rank)
        for k in range(1, n + 1):
            left = np.sort(order[n - k:])
            gaps = np.diff(np.concatenate(([-1], left, [n])))
            assert gaps.max() <= 2 * -(-n // k) + 1, (n, k, left)
    assert pl.layer_fill_rank(2).tolist() == [0, 1]  # two layers: the lower first, as before
    order48 = np.argsort(pl.layer_fill_rank(48))
    assert sorted(order48[-16:].tolist()) == [3, 7, 11, 13, 15, 19, 23, 27, 29, 31, 35, 37, 39, 43, 45, 47]


def test_uniform_plan_spreads_the_layers_left_on_the_cpu() -> None:
    """Uniform routing, equal layers, room for about two thirds of the experts: whole layers stay on the CPU (a
    partial one at the boundary), and they are spread over the depth (no two staged layers adjacent), where
    the greedy fill by layer index would leave the last third of the layers."""
    mf = _synthetic(np.random.default_rng(7), n_layer=48, expert_type=Q.Q4_K)
    eb = pl.expert_bytes(mf)
    params = pl.PlanParams(budget_bytes=0, n_ctx=4096, cpu_read_gbs=100.0, gpu_read_gbs=4000.0)
    fixed = pl.plan(mf, params).fixed_bytes
    p = pl.plan(mf, params.model_copy(update={"budget_bytes": fixed + int(eb.sum() * 0.685)}))
    per_layer = np.array([len(r) for r in p.resident])
    ne = mf.hparams.n_expert
    assert ((per_layer == 0) | (per_layer == ne)).sum() >= 47  # whole layers but one
    cpu_layers = np.flatnonzero(per_layer < ne)
    assert 14 <= len(cpu_layers) <= 16
    assert np.diff(cpu_layers).min() >= 2 and cpu_layers.max() == 47 and cpu_layers.min() <= 5
    assert p.n_resident == int(per_layer.sum())
    # `strata model inspect` groups the layers by resident set: all, none, and the one at the budget's edge
    text = pl.render_plan(p, ne)
    groups = [ln for ln in text.splitlines() if ln.startswith("  layer")]
    assert len(groups) == 3, text
    none_line = next(ln for ln in groups if f" 0/{ne} resident" in ln)
    cpu_whole = [int(x) for x in np.flatnonzero(per_layer == 0)]
    assert none_line.split()[1] == ",".join(str(x) for x in cpu_whole)  # single layers, no two adjacent
    assert "more sets of layers" not in text


def test_plan_extremes_and_uniform_order(files: dict[str, Path]) -> None:
    mf = open_model(files["qwen2moe"])
    params = pl.PlanParams(budget_bytes=0, n_ctx=256, cpu_read_gbs=20.0, gpu_read_gbs=1000.0)
    none = pl.plan(mf, params)
    assert not none.fits and none.n_resident == 0
    fixed = none.fixed_bytes
    assert set(none.fixed) >= {"attention", "norms", "router", "shared experts", "embeddings", "output head",
                               "KV cache", "step buffers", "context + graphs reserve"}
    eb = pl.expert_bytes(mf)
    allin = pl.plan(mf, params.model_copy(update={"budget_bytes": fixed + int(eb.sum())}))
    assert allin.n_resident == allin.n_routed == 16 and allin.ram_bytes_per_token == 0 and allin.hit_rate == 1
    zero = pl.plan(mf, params.model_copy(update={"budget_bytes": fixed}))
    assert zero.fits and zero.n_resident == 0 and zero.hit_rate == 0
    assert zero.ram_bytes_per_token == pytest.approx(float(eb.sum()) * 2 / 8)  # top-2 of 8, uniform
    # a skewed layer keeps its hot experts: room for three experts goes to the three most frequent
    f = np.full((2, 8), 0.15)
    f[1] = [0.05, 0.9, 0.05, 0.6, 0.05, 0.05, 0.2, 0.1]
    three = pl.plan(mf, params.model_copy(update={"budget_bytes": fixed + 3 * int(eb[0, 0])}), f)
    assert three.resident == [[], [1, 3, 6]]
    with pytest.raises(pl.PlacementError, match="shape"):
        pl.plan(mf, params, np.ones((3, 8)))
    with pytest.raises(pl.PlacementError, match="finite"):
        pl.plan(mf, params, np.full((2, 8), np.nan))


def test_ram_read_probe() -> None:
    gbs = pl.measure_cpu_read_gbs(threads=1, n_bytes=16 << 20, passes=2)
    assert 0.1 < gbs < 10_000
    from engine.native import ffi, lib

    pp = ffi.new("st_pool **")
    assert lib.st_pool_create(1, ffi.NULL, 0, pp) == 0
    out = ffi.new("double *")
    try:
        for n, passes in ((1024, 1), (16 << 20, 0), (16 << 20, 1001)):
            with pytest.raises(EngineError):
                from engine.native import check

                check(lib.st_mem_read_gbs(pp[0], n, passes, out), "probe")
    finally:
        lib.st_pool_destroy(pp[0])


def test_gpu_table() -> None:
    assert pl.gpu_read_gbs("NVIDIA H200") == 4800 and pl.gpu_read_gbs("NVIDIA GeForce RTX 4090 D") == 1008
    assert pl.gpu_read_gbs("NVIDIA H100 PCIe") == 2000 and pl.gpu_read_gbs("NVIDIA H100 80GB HBM3") == 3350
    with pytest.raises(pl.PlacementError, match="give the figure"):
        pl.gpu_read_gbs("Voodoo 2")


# ---------------------------------------------------------------- what Engine.open places

def test_engine_plan_params_and_the_cpu_rows_part(files: dict[str, Path]) -> None:
    """Engine.open's plan request: the KV cache of kv_tokens rounded up to whole blocks, step buffers for the
    tokens the GPU scratch grows to (at least 512), and the hybrid step's device buffers (per routed pair a slot
    id and a CPU row of n_embd floats with its pair index, and a row of n_embd floats per token for the shared
    expert where the model has one)."""
    mf = open_model(files["a"])
    hp = mf.hparams
    p = pl.engine_plan_params(10 << 30, kv_tokens=100, block_size=16, step_tokens=256)
    assert p.n_ctx == 112 and p.n_seqs == 1 and p.step_tokens == 512 and p.budget_bytes == 10 << 30
    assert pl.engine_plan_params(1, 100, 16, 2048).step_tokens == 2048
    got = pl.plan(mf, p)
    shx = 4 * hp.n_embd if hp.n_ff_shexp else 0
    assert got.fixed["hybrid buffers"] == 512 * (hp.n_expert_used * (4 + 4 * hp.n_embd + 4) + shx)
    assert got.fixed["KV cache"] == 2 * 2 * hp.n_layer * hp.n_head_kv * hp.head_dim * 112
    assert "hybrid buffers" not in pl.plan(open_model(files["dense"]), p).fixed


def test_placement_frequencies_come_from_the_file_then_the_default_then_uniform(files: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    src = files["a"]
    model = tmp_path / "m.gguf"
    model.symlink_to(src)
    mf = open_model(model)
    assert pl.default_placement_path(model) == tmp_path / "m.gguf.placement.json"
    freqs, source = pl.placement_frequencies(mf)
    assert freqs is None and "uniform" in source
    stats = pl.RoutingStats.for_model(mf)
    stats.update(np.array([[4, 0, 2, 2], [0, 4, 4, 0]], np.int32))
    pf = pl.PlacementFile.for_model(mf, stats, source="test")
    pf.save(pl.default_placement_path(model))
    freqs, source = pl.placement_frequencies(mf)  # the default file beside the model
    np.testing.assert_allclose(freqs, stats.frequencies())
    assert "m.gguf.placement.json" in source and "4 tokens" in source
    other = pl.RoutingStats.for_model(mf)
    other.update(np.array([[0, 4, 4, 0], [0, 0, 4, 4]], np.int32))
    given = pl.PlacementFile.for_model(mf, other)
    np.testing.assert_allclose(pl.placement_frequencies(mf, given)[0], other.frequencies())  # given beats default
    np.testing.assert_allclose(pl.placement_frequencies(mf, given.save(tmp_path / "g.json"))[0], other.frequencies())
    with pytest.raises(pl.PlacementMismatchError):
        pl.placement_frequencies(open_model(files["a_q4_0"]), given)
    p = pl.plan(mf, pl.PlanParams(budget_bytes=0, cpu_read_gbs=1, gpu_read_gbs=1), freqs)
    eb = int(pl.expert_bytes(mf)[0, 0])
    want = pl.PlanParams(budget_bytes=p.fixed_bytes + 3 * eb, cpu_read_gbs=1, gpu_read_gbs=1)
    mask = pl.resident_mask(mf, pl.plan(mf, want, other.frequencies()))
    assert mask.dtype == np.uint8  # the three most used (ties: layer_fill_rank, then lower id)
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0], [0, 0, 1, 0]])


# ---------------------------------------------------------------- online re-placement's moves

def test_replacement_moves_swap_within_layers_by_gain_within_the_bytes() -> None:
    """Swaps stay within a layer (the bytes held never change), take the best gain per byte first, stop at
    max_bytes, need freq_in > margin x freq_out, and skip layers with too few tokens counted."""
    freqs = np.array([[0.9, 0.1, 0.5, 0.5],     # layer 0: 0 in for 1 (gain 0.8); 2 for 3 fails the margin
                      [0.22, 0.3, 0.26, 0.25],  # layer 1: 2 (0.26) for 0 (0.22): 0.26 < 1.25 x 0.22, none
                      [0.6, 0.0, 0.7, 0.1]])    # layer 2: 2 in for 1 (0.7), then 0 for 3 (0.5)
    resident = np.array([[0, 1, 0, 1], [1, 1, 0, 0], [0, 1, 0, 1]], np.uint8)
    ebytes = np.full((3, 4), 100, np.int64)
    moves = pl.replacement_moves(freqs, resident, ebytes, max_bytes=1000)
    assert moves == [(0, 1, 0), (2, 1, 2), (2, 3, 0)]
    assert pl.replacement_moves(freqs, resident, ebytes, max_bytes=250) == moves[:2]
    assert pl.replacement_moves(freqs, resident, ebytes, max_bytes=99) == []
    few = pl.replacement_moves(freqs, resident, ebytes, 1000, min_tokens=np.array([10.0, 100.0, 100.0]),
                               min_layer_tokens=64.0)
    assert all(m[0] != 0 for m in few) and len(few) == 2
    # applied, the moves leave every layer's resident count as it was
    after = resident.copy()
    for il, e_out, e_in in moves:
        assert after[il, e_out] == 1 and after[il, e_in] == 0
        after[il, e_out], after[il, e_in] = 0, 1
    assert (after.sum(axis=1) == resident.sum(axis=1)).all()


def test_glm4moe_plan_counts_the_forward_layers_only(tmp_path: Path) -> None:
    """A glm4moe file (a leading dense layer, two MoE layers, a NextN layer): the plan's non-routed weights are
    every tensor of the forward layers and the globals (the score-correction bias with the router), none of the
    NextN layer, which the GPU never uploads; the dense layer has no routed experts to place, so its row of the
    resident mask is whole (nothing of it runs on the CPU)."""
    from tests.engine.gguf_factory import make_glm4moe_gguf

    path = make_glm4moe_gguf(tmp_path / "glm.gguf", n_dense_lead=1, n_moe=2, n_nextn=1, vocab=False)
    mf = open_model(path)
    hp = mf.hparams
    assert (hp.n_layer, hp.n_dense_lead, hp.n_nextn) == (3, 1, 1)
    fixed = pl.fixed_gpu_bytes(mf, 64, 1)
    weights = sum(v for k, v in fixed.items() if k not in ("KV cache", "step buffers", "hybrid buffers",
                                                           "staging slots", "context + graphs reserve"))
    forward = {n: t for n, t in mf.tensors.items() if not n.startswith(f"blk.{hp.n_layer}.")}
    assert len(forward) < len(mf.tensors)  # the NextN layer's tensors are in the file
    assert weights == sum(pl._aligned(t.n_bytes) for n, t in forward.items() if not n.endswith(pl.ROUTED_SUFFIXES))
    assert fixed["router"] == sum(pl._aligned(forward[f"blk.{il}.{n}"].n_bytes) for il in (1, 2)
                                  for n in ("ffn_gate_inp.weight", "exp_probs_b.bias"))
    assert "other" not in fixed
    eb = pl.expert_bytes(mf)
    assert (eb[0] == 0).all() and (eb[1:] > 0).all()
    p = pl.plan(mf, pl.PlanParams(budget_bytes=1 << 40, cpu_read_gbs=50.0, gpu_read_gbs=3000.0))
    assert p.resident[0] == [] and p.n_resident == p.n_routed == 2 * hp.n_expert
    mask = pl.resident_mask(mf, p)
    assert mask.all()  # everything resident: the engine runs the plain GPU model
    none = pl.plan(mf, pl.PlanParams(budget_bytes=p.fixed_bytes, cpu_read_gbs=50.0, gpu_read_gbs=3000.0))
    mask0 = pl.resident_mask(mf, none)
    assert none.n_resident == 0 and mask0[0].all() and not mask0[1:].any()
