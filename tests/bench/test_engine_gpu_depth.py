"""bench/engine_gpu_depth.py's argument parsing and KV sizing (the GPU part runs on the device only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engine_gpu_depth import KV_RESERVE, NCU_STEPS, kv_fit, kv_plan, parse_depths, parse_knobs
from engine.block_manager import BlockManager


def test_depths_sorted_and_distinct() -> None:
    assert parse_depths("32768,0, 8192,0") == [0, 8192, 32768]
    for bad in ("", "x", "-1"):
        with pytest.raises(SystemExit):
            parse_depths(bad)


def test_knobs_name_registered_settings() -> None:
    assert parse_knobs(["nographs:STRATA_GPU_GRAPHS=0", "b:STRATA_GPU_ATT_SPLIT_MIN=1024, STRATA_GPU_GRAPHS=0"]) == [
        ("nographs", {"STRATA_GPU_GRAPHS": "0"}),
        ("b", {"STRATA_GPU_ATT_SPLIT_MIN": "1024", "STRATA_GPU_GRAPHS": "0"}),
    ]
    # settings whose A/B closed are no longer settings (att_split_mma, att_split_l2: deleted with their losing forms)
    for bad in ("nolabel", ":STRATA_GPU_GRAPHS=0", "a:STRATA_GPU_NOT_A_SETTING=1", "a:STRATA_GPU_GRAPHS",
                "fp32:STRATA_GPU_ATT_SPLIT_MMA=0", "nol2:STRATA_GPU_ATT_SPLIT_L2=0"):
        with pytest.raises(SystemExit):
            parse_knobs([bad])


@pytest.mark.parametrize(("depths", "steps", "unsplit", "n_seq"), [
    ([32768], 32, 0, 8),  # 8 x 32k: 32,872 tokens a sequence, not a whole number of blocks
    ([0, 1024, 2048, 8192, 32768, 131072], 64, 16, 1),
    ([0, 131072], 7, 3, 64),
])
def test_kv_plan_holds_every_sequence_table(depths: list[int], steps: int, unsplit: int, n_seq: int) -> None:
    """A cache of n_seq times one sequence's tokens holds n_seq tables of that sequence's blocks (as run_strata
    opens and allocates them), each reaching the deepest depth plus every depth's decode steps."""
    per_token = 2 * 2 * 48 * 4 * 128  # Qwen3-30B-A3B: 48 layers, 4 KV heads of 128, F16 K and V
    tokens, nbytes = kv_plan(per_token, depths, steps, unsplit, n_knobs=1, block_size=16)
    assert tokens % 16 == 0 and nbytes == per_token * tokens
    assert tokens >= max(depths) + len(depths) * (2 * steps + unsplit)
    blocks = BlockManager(-(-(n_seq * tokens) // 16), 16)
    tables = [blocks.allocate(tokens // 16) for _ in range(n_seq)]
    assert all(tb is not None for tb in tables)
    assert len({b for tb in tables for b in tb}) == n_seq * tokens // 16


def test_kv_plan_counts_the_ncu_steps() -> None:
    """--depth-ncu's two warm-up steps and its profiled one come on top of each depth's rows."""
    per_token = 2 * 2 * 48 * 4 * 128
    depths = [0, 131072]
    plain, _ = kv_plan(per_token, depths, 64, 0, block_size=1)
    with_ncu, _ = kv_plan(per_token, depths, 64, 0, block_size=1, ncu=True)
    assert with_ncu - plain == len(depths) * NCU_STEPS == 6


def test_kv_fit_names_the_shortfall() -> None:
    gib = 2**30
    assert kv_fit(8, 32_896, 3 * gib, 17 * gib, None) is None  # free memory unknown: not checked
    assert kv_fit(8, 32_896, 3 * gib, 17 * gib, 139 * gib) is None
    assert kv_fit(1, 32_896, 3 * gib, 17 * gib, 24 * gib) is None  # exactly the need
    assert 3 * gib + 17 * gib + KV_RESERVE == 24 * gib
    why = kv_fit(8, 131_584, 12 * gib, 17 * gib, 100 * gib)
    assert why is not None and "--depth-batch 8" in why and "96.00 GiB" in why and "117.00 GiB" in why and "100.00 GiB free" in why


def _fake_llama(monkeypatch: pytest.MonkeyPatch, n_seq: int) -> list[list[str]]:
    """llama.cpp's two binaries replaced by canned JSON (llama-bench: 300 tok/s at depth 0; llama-batched-bench:
    1,000 tok/s over n_seq sequences); returns the list their commands are recorded in."""
    import json
    import subprocess

    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        seen.append(cmd)
        if "llama-bench" in cmd[0]:
            out = json.dumps([{"n_depth": 0, "n_gen": 128, "avg_ts": 300.0}])
        else:
            out = json.dumps({"pp": 0, "tg": 128, "pl": n_seq, "speed_tg": 1000.0})
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    return seen


@pytest.mark.parametrize(("ubatch", "n_seq"), [(512, 1), (2048, 1), (4096, 8)])
def test_llama_fills_the_cache_in_the_same_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ubatch: int,
                                                 n_seq: int) -> None:
    """--depth-ubatch N: llama.cpp's -ub N (and a -b that holds it) in both its commands, as Strata's prefill_chunk."""
    from bench import engine_gpu_depth as D

    seen = _fake_llama(monkeypatch, n_seq)
    D.run_llama(tmp_path, tmp_path / "m.gguf", [0], 1, n_seq=n_seq, ubatch=ubatch)
    assert seen
    for cmd in seen:
        assert cmd[cmd.index("-ub") + 1] == str(ubatch) and cmd[cmd.index("-b") + 1] == str(max(2048, ubatch)), cmd


def test_depth_ubatch_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import engine_gpu_depth as D
    from bench.engine_gpu import main

    def never(*_: object) -> int:
        raise AssertionError("the depth run started with --depth-ubatch 0")

    monkeypatch.setattr(D, "main", never)
    with pytest.raises(SystemExit, match="--depth-ubatch must be >= 1"):
        main(["--depth", "0", "--depth-ubatch", "0"])


@pytest.mark.parametrize(("kv_type", "n_seq"), [("f16", 1), ("q8_0", 1), ("q8_0", 8)])
def test_llama_runs_with_the_same_kv_type(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kv_type: str,
                                          n_seq: int) -> None:
    """--kv-type q8_0: llama.cpp's own 8-bit cache beside Strata's (-ctk q8_0 -ctv q8_0), f16 as before."""
    from bench import engine_gpu_depth as D

    seen = _fake_llama(monkeypatch, n_seq)
    got = D.run_llama(tmp_path, tmp_path / "m.gguf", [0], 1, n_seq=n_seq, kv_type=kv_type)
    assert got == {0: 300.0 if n_seq == 1 else 1000.0}
    assert seen, "llama.cpp was not run"
    for cmd in seen:
        tail = " ".join(cmd)
        assert ("-ctk q8_0 -ctv q8_0" in tail) == (kv_type == "q8_0"), tail


def test_tiers_row_on_the_cpu_engine(tmp_path: Path) -> None:
    """The --kv-budget-gb row's mechanics on the CPU engine (its tiers stand in for VRAM and host RAM): two requests
    served with a budget of 3 blocks give the unlimited run's tokens, with blocks moved between the tiers; the JSON
    says so and the exit status is 0."""
    import json
    from types import SimpleNamespace

    from bench.engine_gpu_depth import main_tiers, run_tiers
    from tests.engine.gguf_factory import make_random_gguf

    path = make_random_gguf(tmp_path / "m.gguf", n_ctx=1024)
    from engine.gguf_model import open_model

    budget = 3 * 16 * open_model(path).hparams.kv_bytes_per_token / 2**30
    res = run_tiers(path, "cpu", 150, 2, 5, budget)
    assert res["same_tokens"] and res["tiered"]["hot_tokens"] == 48 and res["unlimited"]["moved_bytes"] == 0
    assert res["tiered"]["moved_bytes"] > 0 and res["tiered"]["decode_tokens"] == 2 * 4
    # the second round reads each prompt's full blocks from the prefix cache (both tiers), so the two decode together
    assert res["tiered"]["cached_tokens"] == res["unlimited"]["cached_tokens"] == 2 * (150 // 16 * 16)
    out = tmp_path / "tiers.json"
    args = SimpleNamespace(depth="150", depth_batch=2, depth_steps=5, kv_budget_gb=budget, kv_type="f16", device="cpu",
                           json=str(out))
    assert main_tiers(args, path, lambda p: None) == 0
    assert json.loads(out.read_text())["same_tokens"] is True
    with pytest.raises(SystemExit):
        main_tiers(SimpleNamespace(**{**vars(args), "depth": "100,200"}), path, lambda p: None)


def test_tie_gaps_reports_the_rounding_floor(tmp_path: Path) -> None:
    """tie_gaps on the CPU engine: a request whose tokens agree is skipped; one that differs gets the unlimited
    logits' gaps there and the model's rounding floor (decode vs prefill of the same context): 0 where the CPU's
    decode of a short context is bitwise its prefill tile, > 0 where the attention is split into chunks."""
    import numpy as np

    from bench.engine_gpu_depth import tie_gaps
    from engine.native import get_attn_split, set_attn_split
    from tests.engine.gguf_factory import make_random_gguf

    path = make_random_gguf(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_vocab=128,
                            n_ctx=1024)
    rng = np.random.default_rng(4)
    prompts = [[int(x) for x in rng.integers(0, 128, size=300)] for _ in range(2)]
    ref, got = [[5, 6, 7], [1, 2, 3]], [[5, 6, 8], [1, 2, 3]]
    (g,) = tie_gaps(path, "cpu", 512, "f16", prompts, ref, got)
    assert (g["request"], g["index"], g["ref"], g["got"]) == (0, 2, 7, 8)
    assert g["top2"] >= 0 and g["rel_gap"] * g["gap"] >= 0 and abs(g["rel_gap"]) <= 2.0
    assert g["floor"] == 0.0
    before = get_attn_split()
    set_attn_split(64)  # decode in chunks of 64 keys: another order of additions than the prefill tile's
    try:
        (g,) = tie_gaps(path, "cpu", 512, "f16", prompts, ref, got)
    finally:
        set_attn_split(before)
    assert 0.0 < g["floor"] < 1e-4
