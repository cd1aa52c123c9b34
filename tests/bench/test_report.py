"""Report writing, the CI verdict over a results file, the result helpers, fitting a prompt to a token
length, and one real plot (Agg backend)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.harness.haystack import filler_sentences, fit, passkey_prompt
from bench.harness.report import render, write_report
from bench.harness.result import ScenarioResult, percentile, slope
from bench.harness.runner import parse_scenarios, verify, write_results


def _results() -> dict:
    ok = ScenarioResult("passkey", correctness=True)
    ok.metric("accuracy@256", 1.0, "", "higher")
    ok.check("accuracy at <= 1024 tokens", 0.9, ">=", 0.8)
    ok.table("Pass key found", ["prompt tokens", "depth 10%"], [[256, "yes"]])
    ok.plots.append("passkey.png")
    ok.notes.append("at the window: 1/3 found")
    bad = ScenarioResult("crash", correctness=True)
    bad.check("memory turns lost or duplicated", 2, "==", 0)
    bad.status = "failed"
    err = ScenarioResult("soak", status="error", error="TargetError: boom")
    measure = ScenarioResult("single")
    measure.metric("gateway:decode_tok_s@1k", 41.234567, "tok/s", "higher")
    return {"started": "2026-12-01T10:00:00+00:00", "quick": True, "duration_s": 12.0,
            "command": ["strata", "bench", "run", "--quick"],
            "machine": {"cpu_model": "Test CPU", "affinity_cores": 2, "loadavg": [0.1], "git_commit": "abc"},
            "target": {"kind": "gateway", "url": "http://127.0.0.1:8080", "n_ctx": 4096, "lanes": ["a", "b"]},
            "scenarios": {r.name: r.to_json() for r in (ok, bad, err, measure)}}


def test_report_has_headline_summary_tables_checks_plots_and_notes(tmp_path: Path) -> None:
    path = write_report(tmp_path, _results())
    text = path.read_text()
    assert text.startswith("# Strata benchmark report")
    assert "2026-12-01T10:00:00+00:00" in text and "Test CPU" in text and "`strata bench run --quick`" in text
    assert "| passkey | completed | yes |" in text and "| crash | failed | yes |" in text
    assert "**error**: TargetError: boom" in text
    assert "| 256 | yes |" in text and "![passkey](passkey.png)" in text and "- at the window: 1/3 found" in text
    assert "**FAIL**" in text  # the crash check
    assert render(_results()) == text


def test_verify_is_what_ci_checks(tmp_path: Path) -> None:
    res = _results()
    problems = verify(res)
    assert any(p.startswith("crash: memory turns lost") for p in problems)
    assert any(p.startswith("soak: error") for p in problems)
    assert not any(p.startswith(("passkey", "single")) for p in problems)
    assert verify(res, ["passkey", "single"]) == []
    assert verify(res, ["rag"]) == ["rag: not in results.json"]
    write_results(tmp_path / "results.json", res)
    assert json.loads((tmp_path / "results.json").read_text())["scenarios"]["single"]["metrics"][
        "gateway:decode_tok_s@1k"]["value"] == 41.2346


def test_a_correctness_scenario_without_checks_does_not_pass() -> None:
    r = ScenarioResult("rag", correctness=True)
    assert verify({"scenarios": {"rag": r.to_json()}}) == ["rag: a correctness scenario with no checks"]


def test_parse_scenarios() -> None:
    assert parse_scenarios("all")[0] == "single" and len(parse_scenarios("all")) == 11
    assert parse_scenarios("passkey, single") == ["passkey", "single"]
    with pytest.raises(ValueError, match="unknown scenario"):
        parse_scenarios("single,nope")


def test_checks_and_helpers() -> None:
    r = ScenarioResult("x")
    assert r.check("a", 1.0, ">=", 1.0) and r.check("b", 0.0, "<=", 0.1) and r.check("c", 0, "==", 0)
    assert not r.check("d", None, ">=", 0.0)
    assert not r.passed
    r.metric("nan", float("nan"))
    assert r.metrics["nan"]["value"] is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == 2.0
    assert percentile([], 50) is None
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert slope([0, 1], [0, 1]) is None


def test_fit_lands_just_under_the_target() -> None:
    calls = []

    async def count(n: int) -> int:  # a prompt of 40 fixed tokens and 13 per filler unit
        calls.append(n)
        return 40 + 13 * n

    n, got = asyncio.run(fit(count, 1000))
    assert got <= 1000 and 1000 - got < 13 and n == (1000 - 40) // 13
    assert len(calls) <= 6
    assert asyncio.run(fit(count, 10)) == (0, 40)  # the fixed part alone is longer: nothing to add


def test_passkey_prompt_places_the_needle_at_the_depth() -> None:
    text = passkey_prompt(100, 0.5, "12345")
    body = text.split("\n\n")[1]
    assert body.count("12345") == 2
    before = body.split("The pass key is")[0]
    assert before.count(".") == 50  # 50 filler sentences before the needle
    assert passkey_prompt(10, 0.0, "1").split("\n\n")[1].startswith("The pass key is 1.")
    assert not any(ch.isdigit() for ch in " ".join(filler_sentences(200)))


def test_heatmap_png(tmp_path: Path) -> None:
    from bench.harness.plots import heatmap

    name = heatmap(tmp_path / "h.png", "t", ["256", "1024"], ["10%", "90%"], [[1.0, 0.0], [None, 1.0]], "x", "y")
    assert name == "h.png" and (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_skipped_scenarios_fail_ci_but_not_a_run_against_a_lane() -> None:
    r = ScenarioResult("rag", status="skipped", correctness=True, error="does not apply to a lane target")
    res = {"scenarios": {"rag": r.to_json()}}
    assert verify(res) == ["rag: skipped: does not apply to a lane target"]
    assert verify(res, allow_skipped=True) == []
