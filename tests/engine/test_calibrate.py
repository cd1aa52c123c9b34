"""`strata plan calibrate` and `strata model inspect --vram`'s hybrid plan, through the CLI on the default
model: the placement file holds the CPU engine's measured routing, the plan reads it back, and bad prompt
or placement files are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli.main import main
from engine.calibrate import builtin_corpus, read_prompts
from engine.gguf_model import open_model
from engine.placement import PlacementFile, RoutingStats
from tests.engine.gguf_factory import make_random_gguf

PROMPTS = 'What is the capital of France?\n\n{"prompt": "def add(a, b):"}\n' \
          '{"messages": [{"role": "user", "content": "Hi! Name three colors."}]}\n"2 + 2 ="\n'


@pytest.fixture(scope="module")
def calibrated(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("calibrate")
    (d / "prompts.txt").write_text(PROMPTS)
    out = d / "placement.json"
    assert main(["plan", "calibrate", str(model_path), "--prompts", str(d / "prompts.txt"), "-o", str(out),
                 "--max-tokens", "4", "--threads", "2", "--kv-tokens", "1024"]) == 0
    return out


def test_calibration_writes_the_measured_routing(calibrated: Path, model_path: Path) -> None:
    mf = open_model(model_path)
    pf = PlacementFile.load(calibrated, model=mf)
    hp = mf.hparams
    s = pf.stats
    assert (s.n_layer, s.n_expert, s.n_expert_used) == (hp.n_layer, hp.n_expert, hp.n_expert_used)
    counts = np.asarray(s.counts)
    tokens = np.asarray(s.tokens)
    assert (tokens == tokens[0]).all() and tokens[0] >= 4 * 4  # every prompt's tokens and 4 generated each
    np.testing.assert_array_equal(counts, np.round(counts))  # plain sums of step histograms
    np.testing.assert_array_equal(counts.sum(axis=1), hp.n_expert_used * tokens)  # k pairs per token
    np.testing.assert_allclose(s.frequencies().sum(axis=1), hp.n_expert_used)
    assert (s.frequencies().std(axis=1) > 0).any()  # a measured router, not the uniform prior
    assert "4 prompts" in pf.source and "up to 4 greedy tokens" in pf.source


def test_calibration_is_deterministic(calibrated: Path, model_path: Path, tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text(PROMPTS)
    again = tmp_path / "again.json"
    assert main(["plan", "calibrate", str(model_path), "--prompts", str(tmp_path / "p.txt"), "-o", str(again),
                 "--max-tokens", "4", "--threads", "1", "--kv-tokens", "1024"]) == 0
    assert PlacementFile.load(again).stats.same(PlacementFile.load(calibrated).stats)


def test_inspect_prints_the_plan_from_the_placement_file(calibrated: Path, model_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "inspect", str(model_path), "--vram", "0.9", "--ram", "216", "--ctx", "2048",
                 "--cpu-bw", "12.5", "--gpu", "H200", "--placement", str(calibrated)]) == 0
    out = capsys.readouterr().out
    assert "hybrid plan     GPU budget 921.60 MiB; KV for 1 x 2048 tokens; frequencies: " + str(calibrated) in out
    for needle in ("resident routed experts", "KV cache", "context + graphs reserve", "hit rate",
                   "of expert weights read from RAM", "CPU RAM read 12.5 GB/s, GPU 4800 GB/s", "predicted",
                   "RAM 216 GiB", "RAM           fits: the mapped file"):
        assert needle in out, needle
    # the uniform plan of the same budget keeps as many experts but expects fewer hits
    assert main(["model", "inspect", str(model_path), "--vram", "0.9", "--ctx", "2048", "--cpu-bw", "12.5"]) == 0
    uniform = capsys.readouterr().out
    hit = [float(line.split()[2].rstrip("%")) for line in (out + uniform).splitlines() if "hit rate" in line]
    assert hit[0] > hit[1]


def test_inspect_measures_the_ram_rate_when_not_given(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "inspect", str(model_path), "--vram", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "CPU bandwidth measured now, 1 threads" in out and "RTX 4090D's from the table" in out


def test_a_placement_for_another_model_is_one_line_error(calibrated: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    other = make_random_gguf(tmp_path / "other.gguf", n_expert=8, n_expert_used=2)
    assert main(["model", "inspect", str(other), "--vram", "1", "--cpu-bw", "10", "--placement", str(calibrated)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("strata: error:") and "another model" in err and "\n" not in err


@pytest.mark.parametrize(("content", "needle"), [
    (None, "cannot read the prompt file"),
    ("", "no prompts"),
    ("hello\n{\"prompt\": \n", ":2: not a prompt"),
    ('{"text": "x"}\n', ":1: a JSON line needs 'prompt' or 'messages'"),
    ('{"messages": []}\n', ":1: not a prompt"),
])
def test_bad_prompt_files(model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          content: str | None, needle: str) -> None:
    f = tmp_path / "prompts.jsonl"
    if content is not None:
        f.write_text(content)
    assert main(["plan", "calibrate", str(model_path), "--prompts", str(f), "-o", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and not (tmp_path / "o.json").exists()


def test_builtin_corpus_is_varied_and_renders(engine) -> None:  # noqa: ANN001 - the conftest engine
    prompts = builtin_corpus()
    assert len(prompts) >= 40
    kinds = {p.kind for p in prompts}
    assert kinds >= {"code", "prose", "chat", "multilingual", "math"}
    assert sum(p.messages is not None for p in prompts) >= 10 and sum(p.prompt is not None for p in prompts) >= 10
    assert all(len(p.ids(engine)) >= 3 for p in prompts)
    assert any(ord(ch) > 0x3000 for p in prompts for ch in (p.prompt or ""))  # CJK among the multilingual lines


@pytest.mark.slow
def test_default_placement_from_the_builtin_corpus(model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "default.json"
    assert main(["plan", "calibrate", str(model_path), "-o", str(out), "--max-tokens", "1", "--threads", "2",
                 "--kv-tokens", "4096"]) == 0
    pf = PlacementFile.load(out, model=open_model(model_path))
    assert "built-in corpus" in pf.source and f"{len(builtin_corpus())} prompts" in pf.source
    assert pf.stats.total_tokens > 500
    raw = json.loads(out.read_text())
    assert raw["format"] == "strata-placement" and isinstance(RoutingStats.model_validate(raw["stats"]), RoutingStats)


def test_without_output_the_default_placement_is_written_beside_the_model(model_path: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """No -o: the model's default placement file (MODEL.placement.json), which a GPU lane with a budget and no
    configured placement file places by (engine.placement.placement_frequencies)."""
    from engine.placement import default_placement_path, placement_frequencies

    model = tmp_path / "m.gguf"
    model.symlink_to(model_path)
    (tmp_path / "p.txt").write_text("What is the capital of France?\n")
    assert main(["plan", "calibrate", str(model), "--prompts", str(tmp_path / "p.txt"), "--max-tokens", "1",
                 "--threads", "2", "--kv-tokens", "256"]) == 0
    out = default_placement_path(model)
    assert str(out) in capsys.readouterr().out
    mf = open_model(model)
    pf = PlacementFile.load(out, model=mf)
    freqs, source = placement_frequencies(mf)
    np.testing.assert_array_equal(freqs, pf.stats.frequencies())
    assert str(out) in source


def test_read_prompts_forms(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text(PROMPTS)
    ps = read_prompts(f)
    assert [p.prompt for p in ps] == ["What is the capital of France?", "def add(a, b):", None, "2 + 2 ="]
    assert ps[2].messages == [{"role": "user", "content": "Hi! Name three colors."}]
