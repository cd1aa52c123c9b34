"""``strata bench compare``: relative changes, regressions flagged by direction and threshold, checks
that stopped passing, bad input refused with a typed error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.harness.cli import main
from bench.harness.compare import compare, load, render


def results(metrics: dict[str, tuple[float | None, str | None]], checks: list[tuple[str, bool]] | None = None,
            status: str = "completed") -> dict[str, Any]:
    return {"scenarios": {"single": {
        "status": status, "metrics": {k: {"value": v, "unit": "", "better": b} for k, (v, b) in metrics.items()},
        "checks": [{"name": n, "value": 1.0 if ok else 0.0, "op": ">=", "threshold": 1.0, "passed": ok}
                   for n, ok in (checks or [])]}}}


def test_regressions_follow_the_direction_and_the_threshold() -> None:
    a = results({"tok_s": (100.0, "higher"), "ttft_s": (1.0, "lower"), "n": (10.0, None), "small": (100.0, "higher")})
    b = results({"tok_s": (80.0, "higher"), "ttft_s": (1.3, "lower"), "n": (1.0, None), "small": (95.0, "higher")})
    changes, broken = compare(a, b, threshold=0.10)
    by = {c.metric: c for c in changes}
    assert by["tok_s"].regression and by["tok_s"].rel == pytest.approx(-0.2)
    assert by["ttft_s"].regression and by["ttft_s"].rel == pytest.approx(0.3)
    assert not by["n"].regression  # no direction: never a regression
    assert not by["small"].regression  # -5 % is inside the threshold
    assert broken == []


def test_improvements_are_not_regressions() -> None:
    changes, _ = compare(results({"tok_s": (100.0, "higher"), "ttft_s": (1.0, "lower")}),
                         results({"tok_s": (150.0, "higher"), "ttft_s": (0.5, "lower")}))
    assert not any(c.regression for c in changes) and all(c.improvement for c in changes)


def test_a_threshold_of_a_half_lets_a_fifth_pass() -> None:
    changes, _ = compare(results({"tok_s": (100.0, "higher")}), results({"tok_s": (80.0, "higher")}), threshold=0.5)
    assert not changes[0].regression


def test_a_check_that_stops_passing_and_a_lost_figure_are_regressions() -> None:
    a = results({"acc": (1.0, "higher")}, [("recall", True)])
    b = results({"acc": (None, "higher")}, [("recall", False)], status="failed")
    changes, broken = compare(a, b)
    assert changes[0].regression  # measured before, missing now
    assert any("recall" in x for x in broken) and any("now failed" in x for x in broken)
    text = render(changes, broken, 0.1)
    assert "REGRESSION" in text and "3 regression(s)" in text


def test_zero_baseline() -> None:
    changes, _ = compare(results({"failed": (0.0, "lower")}), results({"failed": (2.0, "lower")}))
    assert changes[0].regression
    changes, _ = compare(results({"failed": (0.0, "lower")}), results({"failed": (0.0, "lower")}))
    assert not changes[0].regression


def test_bad_threshold_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="threshold"):
        compare(results({}), results({}), threshold=-1)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable results.json"):
        load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("[]")
    with pytest.raises(ValueError, match="not a bench results.json"):
        load(tmp_path / "y.json")


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(results({"tok_s": (100.0, "higher")})))
    b.write_text(json.dumps(results({"tok_s": (50.0, "higher")})))
    assert main(["compare", str(a), str(a)]) == 0
    assert main(["compare", str(a), str(b)]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert main(["compare", str(a), str(b), "--threshold", "0.6"]) == 0
    (tmp_path / "bad.json").write_text("nope")
    assert main(["compare", str(a), str(tmp_path / "bad.json")]) == 2


def test_the_reported_command_line_hides_the_key() -> None:
    from bench.harness.cli import redact

    assert redact(["run", "--key", "sk-strata-secret", "--quick"]) == ["run", "--key", "***", "--quick"]
    assert redact(["run", "--key=sk-strata-secret"]) == ["run", "--key=***"]


def test_changes_inside_a_figures_noise_are_not_flagged() -> None:
    a = results({"slope": (0.1, "lower")})
    b = results({"slope": (3.0, "lower")})
    a["scenarios"]["single"]["metrics"]["slope"]["noise"] = 5.0
    changes, _ = compare(a, b)
    assert not changes[0].regression and not changes[0].improvement
    b = results({"slope": (9.0, "lower")})
    assert compare(a, b)[0][0].regression
