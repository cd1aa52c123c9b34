"""bench.gateway_overhead's own pieces: the started processes' environment (the caller's import path kept after
the repository, as on the device machine where packages live in --target folders; the lane's model and cores),
the ``--model`` option's checks, and one short run against a lane serving a small model of the default model's
tokenizer and template (bench/synthetic_moe.py), as tools/gpu/gateway_overhead.sh runs it with the default shape."""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench import gateway_overhead as go
from bench.common import REPO_ROOT
from bench.synthetic_moe import Shape, build_synthetic_model


def test_started_processes_keep_the_callers_import_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/gwsite", str(REPO_ROOT), "", "/tmp/site"]))
    monkeypatch.setenv("STRATA_LANE_MODEL", "/somewhere/else.gguf")
    monkeypatch.setenv("STRATA_GATEWAY_PORT", "1")
    env = go._env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/tmp/gwsite", "/tmp/site"]
    assert "STRATA_GATEWAY_PORT" not in env and env["STRATA_LANE_KV_TOKENS"] == "2048"
    assert "STRATA_LANE_MODEL" not in env  # the caller's lane settings never leak into the started lane
    monkeypatch.delenv("PYTHONPATH")
    assert go._env()["PYTHONPATH"] == str(REPO_ROOT)


def test_the_lane_gets_the_model_and_cores_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = go.lane_env("auto", Path("m.gguf"))
    assert env["STRATA_LANE_MODEL"] == str(tmp_path / "m.gguf") and env["STRATA_LANE_CORES"] == "auto"
    plain = go.lane_env()
    assert "STRATA_LANE_MODEL" not in plain and "STRATA_LANE_CORES" not in plain


def test_a_lane_that_exits_at_start_ends_the_run_with_its_reason(tmp_path: Path) -> None:
    """A refused lane config (here a CPU the machine lacks) stops the run at once with the lane's own words,
    not after the 180 s health wait."""
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e, ExitStack() as stack:
        go.start_stack(stack, tmp_path, lane_cores="100000")
    assert "exited (2)" in str(e.value) and "outside this machine's CPUs" in str(e.value)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "no-such.gguf"], "no such file"),
        (
            [
                "--model",
                __file__,
                "--lane-url",
                "http://127.0.0.1:1",
                "--gateway-url",
                "http://127.0.0.1:2",
                "--key",
                "k",
            ],
            "not with --lane-url",
        ),
    ],
)
def test_the_model_option_is_checked(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        go.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_against_a_given_model(tmp_path: Path) -> None:
    model = build_synthetic_model(
        tmp_path / "small.gguf",
        shape=Shape(n_layer=2, n_embd=128, n_head=2, n_head_kv=1, n_ff=64, n_expert=4, n_used=2),
    )
    out = tmp_path / "r.json"
    # documents and session memory off: no embedding model to load here, as on the device machine where it is
    # not installed (there the gateway turns them off itself)
    assert (
        go.main(
            [
                "-n",
                "4",
                "--warmup",
                "1",
                "--model",
                str(model),
                "--set",
                "rag = { enabled = false }",
                "--set",
                "memory = { enabled = false }",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rep = json.loads(out.read_text())
    cfg, s = rep["config"], rep["summary"]
    assert cfg["lane"]["model"]["path"] == str(model) and cfg["model"] == str(model)
    assert cfg["retrieval"] == "off" and cfg["counted_by"].startswith("the gateway (the lane's tokenizer")
    assert s["n"] == len(rep["samples"]) == 4
    assert all(
        0 < x["direct_ttft_ms"] <= x["direct_total_ms"] and 0 < x["gateway_ttft_ms"] for x in rep["samples"]
    )


def test_lane_ttft_is_grouped_by_the_request_before_it() -> None:
    """Requests in sending order G D | D G | G D: each lane TTFT lands under what the lane served just before."""
    samples = [{"direct_sent": 2.0, "gateway_sent": 1.0, "direct_id": "d0", "gateway_id": "g0"},
               {"direct_sent": 3.0, "gateway_sent": 4.0, "direct_id": "d1", "gateway_id": "g1"},
               {"direct_sent": 6.0, "gateway_sent": 5.0, "direct_id": "d2", "gateway_id": "g2"}]
    ttft = {"g0": 99.0, "d0": 6.0, "d1": 7.0, "g1": 8.0, "g2": 18.0, "d2": 5.0}
    assert go.lane_ttft_by_previous(samples, ttft) == {
        "direct after direct": 7.0, "direct after gateway": 5.5, "gateway after direct": 8.0,
        "gateway after gateway": 18.0}
    assert go.lane_ttft_by_previous([{**samples[0], "compare_ttft_ms": 1.0}], ttft) == {}
