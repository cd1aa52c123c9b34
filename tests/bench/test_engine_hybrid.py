"""bench/engine_hybrid.py's CPU-side logic: llama.cpp's placement at equal VRAM, the budget for a share of the
routed experts and its inverse, the prompt steps, the deadline that keeps a device call under its limit, the
knobs' environment, the CPU read rate behind the floor (the GPU rows run on the device only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import bench.engine_hybrid as eh
from bench.engine_hybrid import (
    Deadline,
    _Env,
    budget_for_fraction,
    fraction_for_budget,
    llama_placement,
    main,
    model_path,
    parse_floats,
    parse_ints,
    prompt_steps,
)
from tests.engine.gguf_factory import make_random_gguf


def test_llama_placement_matches_the_share_of_layers() -> None:
    assert llama_placement(0.0, 48) == ["-ot", "exps=CPU"]
    assert llama_placement(0.25, 48) == ["-ncmoe", "36"]
    assert llama_placement(0.5, 48) == ["-ncmoe", "24"]
    assert llama_placement(1.0, 48) == ["-ncmoe", "0"]
    assert llama_placement(0.01, 48) == ["-ot", "exps=CPU"]  # rounds to every layer on the CPU
    assert llama_placement(0.0, 48, 2) == ["-ncmoe", "46"] and llama_placement(0.5, 48, 2) == ["-ncmoe", "22"]


def test_prompt_steps_take_whole_prompts_up_to_the_chunk() -> None:
    assert prompt_steps(1, 32, 512) == [[0]]
    assert prompt_steps(8, 32, 512) == [list(range(8))]
    assert prompt_steps(32, 32, 512) == [list(range(16)), list(range(16, 32))]
    assert prompt_steps(3, 600, 512) == [[0], [1], [2]]  # a prompt longer than the chunk goes alone
    steps = prompt_steps(33, 32, 500)
    assert [i for s in steps for i in s] == list(range(33)) and max(len(s) for s in steps) * 32 <= 500


def test_lists_parse() -> None:
    assert parse_ints("8,32") == [8, 32] and parse_ints("") == [] and parse_ints(" 1 , 2") == [1, 2]
    assert parse_floats("0,0.25,0.5") == [0.0, 0.25, 0.5]
    with pytest.raises(ValueError):
        parse_ints("8,x")


def test_deadline_starts_a_row_only_when_the_longest_of_its_kind_fits() -> None:
    now = [0.0]
    dl = Deadline(100.0, clock=lambda: now[0])
    assert dl.fits("strata", 40.0)
    dl.took("strata", 30.0)
    dl.took("strata", 20.0)  # the longest counts
    now[0] = 65.0
    assert dl.left() == pytest.approx(35.0)
    assert dl.fits("strata", 999.0)  # measured (30 s) beats the guess
    assert not dl.fits("llama", 60.0)  # not measured yet: the guess
    now[0] = 71.0
    assert not dl.fits("strata", 1.0)
    assert Deadline(None).fits("anything", 1e9)


def test_env_sets_and_restores() -> None:
    key, other = "STRATA_GPU_HYBRID_OVERLAP", "STRATA_GPU_HYBRID_STAGE"
    old = os.environ.get(key), os.environ.get(other)
    os.environ.pop(other, None)
    os.environ[key] = "1"
    try:
        with _Env({key: "0", other: "1"}):
            assert os.environ[key] == "0" and os.environ[other] == "1"
        assert os.environ[key] == "1" and other not in os.environ
    finally:
        for k, v in zip((key, other), old, strict=True):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_budget_and_fraction_are_inverse(tmp_path: Path) -> None:
    """budget_for_fraction's gpu_budget_gb leaves that share of the routed experts after the fixed parts, and
    fraction_for_budget gives the share back (clipped to [0, 1]), so llama.cpp's -ncmoe follows Strata's budget."""
    path = make_random_gguf(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=4, n_embd=128, n_head=4, n_head_kv=2,
                            n_ff=64, n_vocab=256, n_expert=8, n_expert_used=2, qk_norm=True)
    b0 = budget_for_fraction(path, 0.0, 256, 16, 512)
    b1 = budget_for_fraction(path, 1.0, 256, 16, 512)
    assert 0 < b0 < b1
    for f in (0.0, 0.25, 0.5, 1.0):
        b = budget_for_fraction(path, f, 256, 16, 512)
        assert fraction_for_budget(path, b, 256, 16, 512) == pytest.approx(f, abs=1e-6)
    assert fraction_for_budget(path, b0 / 2, 256, 16, 512) == 0.0
    assert fraction_for_budget(path, 2 * b1, 256, 16, 512) == 1.0


def test_model_path_names_skew_and_experts() -> None:
    assert model_path("/m", 48, 1.0, "q4_k") == Path("/m/qwen3moe-synth-48L-skew1.gguf")
    assert model_path("/m", 48, 0.0, "q8_0") == Path("/m/qwen3moe-synth-48L-skew0-q8_0.gguf")


def test_knobs_must_name_settings() -> None:
    with pytest.raises(SystemExit):
        main(["--knob", "x:STRATA_GPU_NOT_A_SETTING=1", "--model-dir", "/nonexistent", "--build-only"])


def test_build_only_builds_several_skews_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--build-only with several skews starts a builder process per missing file at once (build_models), then
    names each file; one skew builds in this process."""
    started: list[list[str]] = []

    class Proc:
        returncode = 0

        def __init__(self, cmd: list[str]) -> None:
            started.append(cmd)
            model_path(str(tmp_path), 2, float(cmd[cmd.index("--skew") + 1]), "q4_k").write_bytes(b"x" * 1024)

        def wait(self) -> int:
            assert len(started) == 2, "the second builder starts before the first is waited for"
            return 0

    monkeypatch.setattr(eh.subprocess, "Popen", Proc)
    assert main(["--build-only", "--skews", "1,0", "--layers", "2", "--model-dir", str(tmp_path)]) == 0
    assert [c[c.index("--skew") + 1] for c in started] == ["1", "0"]
    out = capsys.readouterr().out
    assert "skew1.gguf" in out and "skew0.gguf" in out
    built: list[float] = []
    monkeypatch.setattr(eh, "build_model", lambda path, shape, skew, experts: (built.append(skew),
                                                                               path.write_bytes(b"y")))
    assert main(["--build-only", "--skew", "0.5", "--layers", "2", "--model-dir", str(tmp_path)]) == 0
    assert built == [0.5] and len(started) == 2


def test_mean_frame_averages_the_steps_parts() -> None:
    """The decode rows' frame is the mean of their steps' parts (ms), its idle share and PCIe rate from those
    means; the hit rate the steps' mean."""
    from types import SimpleNamespace

    from bench.engine_hybrid import mean_frame

    def step(total: float, wait: float, pcie: float, nbytes: int, hit: float) -> SimpleNamespace:
        return SimpleNamespace(t_total=total, t_gpu=total - wait - pcie, t_pcie=pcie, t_gpu_wait=wait,
                               t_cpu_experts=wait, t_cpu_wait=0.001, pcie_bytes=nbytes, resident_hit_rate=hit)

    got = mean_frame([step(0.020, 0.015, 0.001, 1_000_000, 0.5), step(0.030, 0.021, 0.003, 3_000_000, 0.7)])
    assert got["t_total"] == pytest.approx(25.0) and got["t_gpu_wait"] == pytest.approx(18.0)
    assert got["t_gpu"] + got["t_pcie"] + got["t_gpu_wait"] == pytest.approx(got["t_total"])
    assert got["gpu_idle_share"] == pytest.approx(18.0 / 25.0)
    assert got["pcie_gb_s"] == pytest.approx(2_000_000 / 0.002 / 1e9)
    assert got["resident_hit_rate"] == pytest.approx(0.6) and got["steps"] == 2
    assert mean_frame([]) == {}


def test_main_runs_the_table_then_the_knobs_then_q8_and_skips_what_does_not_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The orchestration with the GPU parts replaced: both skews' rows (Strata, then llama.cpp at the same
    fraction), the knob rows (Strata only, under their settings), then the Q8_0 row after the Q4_K files are
    deleted; the JSON holds every row; with a deadline that the measured rows leave no room under, the rest are
    skipped and listed."""
    import json

    import bench.engine_hybrid as eh

    calls: list[tuple] = []
    clock = [0.0]
    monkeypatch.setattr(eh.time, "monotonic", lambda: clock[0])

    def fake_build(args, skews, experts):  # noqa: ANN001, ANN202
        paths = [eh.model_path(args.model_dir, args.layers, s, experts) for s in skews]
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x")
        calls.append(("build", experts, tuple(skews)))
        return paths

    def fake_strata(path, frac, args, budget=None, batches=None):  # noqa: ANN001, ANN202
        calls.append(("strata", path.name, frac, os.environ.get("STRATA_GPU_HYBRID_OVERLAP"), batches))
        clock[0] += 10.0
        return {"fraction": frac, "decode_b1_tok_s": 50.0}

    def fake_llama(bin_dir, path, frac, args, batches=None, timeout_s=None):  # noqa: ANN001, ANN202
        calls.append(("llama", path.name, frac, batches))
        clock[0] += 20.0
        return {"fraction": frac, "decode_b1_tok_s": 40.0, "placement": "-ot exps=CPU"}

    monkeypatch.setattr(eh, "build_models", fake_build)
    monkeypatch.setattr(eh, "run_strata", fake_strata)
    monkeypatch.setattr(eh, "run_llama", fake_llama)
    monkeypatch.setattr(eh, "fraction_for_budget", lambda *a: 0.7)
    monkeypatch.setattr(eh, "print_row", lambda row, args: None)
    monkeypatch.delenv("STRATA_GPU_HYBRID_OVERLAP", raising=False)
    out = tmp_path / "out.json"
    base = ["--skews", "1,0", "--fractions", "0,0.5", "--batch", "8,32", "--model-dir", str(tmp_path / "m"),
            "--llama-bin", str(tmp_path), "--knob", "nooverlap:STRATA_GPU_HYBRID_OVERLAP=0", "--q8-budget-gb", "24",
            "--json", str(out)]
    assert eh.main(base) == 0
    kinds = [c[0] for c in calls]
    assert kinds == ["build"] + ["strata", "llama"] * 4 + ["strata", "build", "strata", "llama"]
    assert calls[9] == ("strata", "qwen3moe-synth-48L-skew1.gguf", 0.0, "0", None)  # the knob row, its setting
    assert "STRATA_GPU_HYBRID_OVERLAP" not in os.environ
    assert calls[10] == ("build", "q8_0", (1.0,)) and calls[11][-1] == [] and calls[12][-1] == []
    assert not (tmp_path / "m" / "qwen3moe-synth-48L-skew0.gguf").exists()  # the disk's room for the Q8_0 file
    got = json.loads(out.read_text())
    assert len(got["rows"]) == 6 and got["skipped"] == []
    calls.clear()
    clock[0] = 0.0
    assert eh.main([*base, "--deadline-s", "75"]) == 0
    # 0 s: strata (10) + llama (20); 30 s: strata + llama; 60 s: 15 s left < the 10 s / 20 s measured? strata
    # fits (10 <= 15), llama does not (20 > 5); then nothing more fits
    assert [c[0] for c in calls] == ["build", "strata", "llama", "strata", "llama", "strata"]
    got = json.loads(out.read_text())
    assert len(got["skipped"]) >= 3 and any("Q8_0" in s for s in got["skipped"])


def test_knob_every_puts_each_knob_beside_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--knob-every: each knob's row (Strata only, under its settings) right after every skew and fraction's own
    row, and no knob rows after the table."""
    import bench.engine_hybrid as eh

    calls: list[tuple] = []

    def fake_build(args, skews, experts):  # noqa: ANN001, ANN202
        return [eh.model_path(args.model_dir, args.layers, s, experts) for s in skews]

    def fake_strata(path, frac, args, budget=None, batches=None):  # noqa: ANN001, ANN202
        calls.append((path.name, frac, os.environ.get("STRATA_GPU_HYBRID_OVERLAP")))
        return {"fraction": frac, "decode_b1_tok_s": 50.0}

    monkeypatch.setattr(eh, "build_models", fake_build)
    monkeypatch.setattr(eh, "run_strata", fake_strata)
    monkeypatch.setattr(eh, "print_row", lambda row, args: None)
    monkeypatch.delenv("STRATA_GPU_HYBRID_OVERLAP", raising=False)
    assert eh.main(["--skews", "0,1", "--fractions", "0,0.5", "--strata-only", "--model-dir", str(tmp_path),
                    "--knob", "nooverlap:STRATA_GPU_HYBRID_OVERLAP=0", "--knob-every"]) == 0
    s0, s1 = "qwen3moe-synth-48L-skew0.gguf", "qwen3moe-synth-48L-skew1.gguf"
    assert calls == [(s0, 0.0, None), (s0, 0.0, "0"), (s0, 0.5, None), (s0, 0.5, "0"),
                     (s1, 0.0, None), (s1, 0.0, "0"), (s1, 0.5, None), (s1, 0.5, "0")]
    assert "STRATA_GPU_HYBRID_OVERLAP" not in os.environ


def test_cpu_read_rate_is_one_median_per_core_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row's floor divides by the same CPU read rate: the median of READ_PROBES probes, taken once per core
    set (a second row on the same cores probes nothing; other cores get their own median)."""
    monkeypatch.setattr(eh, "_read_gbs", {})
    readings = iter([140.0, 128.0, 133.0, 148.0, 131.0, 60.0, 70.0, 65.0, 80.0, 50.0])
    calls: list[list[int]] = []

    def probe(cores: list[int]) -> float:
        calls.append(cores)
        return next(readings)

    assert eh.cpu_read_gbs([0, 1, 2], probe) == 133.0
    assert eh.cpu_read_gbs([0, 1, 2], probe) == 133.0
    assert len(calls) == eh.READ_PROBES and all(c == [0, 1, 2] for c in calls)
    assert eh.cpu_read_gbs([3], probe) == 65.0
    assert len(calls) == 2 * eh.READ_PROBES
