"""Must-show 4 of issue 9 as a test: the whole stack under supervisord with lane A on the GPU and
lane B on the CPU, then ``make switch LANE=b`` moving lane B onto the same GPU under load (zero
failed requests, each lane within its VRAM budget). See tests/engine/gpu/stack_on_gpu.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.engine.gpu._env import requires_gpu

pytestmark = [*requires_gpu, pytest.mark.slow]

pytest.importorskip("supervisor", reason="supervisor (a serving dependency) is needed to run the stack")


def test_stack_lane_a_on_gpu_then_lane_b_switched_onto_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("tests.engine.hf_models", reason="transformers (torch) is needed to build the random model")
    from tests.engine.gpu.stack_on_gpu import StackCheckError, build_model, run

    model = build_model(tmp_path_factory.mktemp("gpu_stack_model"))
    work = Path(tmp_path_factory.mktemp("gs"))
    report: dict = {}
    try:
        report = run(model, "cuda:0", "cpu", "cuda:0", work)
    except StackCheckError as e:
        report = e.args[1] if len(e.args) > 1 else {}
        raise
    finally:
        out = os.environ.get("STRATA_STACK_REPORT")  # the GPU call keeps the report under $OUT
        if out:
            Path(out).write_text(json.dumps(report, indent=1, default=str))
    assert report["ok"]
    assert report["after"]["lane_b"]["device"] == "cuda:0" and report["after"]["lane_a"]["device"] == "cuda:0"
    assert report["load"]["failed"] == 0 and report["switch"]["exit"] == 0


def test_stack_hybrid_lanes_switched_between_budgets(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Must-show 4 of issue 29: both lanes on the GPU with a `gpu_budget_gb` below the model's size (hybrid
    placement: 30% of the routed experts resident, the rest on each lane's half of the cores) serve through the
    gateway and agree on a greedy completion; then ``make switch LANE=b`` moves lane B to a budget of 70% under
    load: no failed request, lane B holds more resident experts after it, every lane within its own budget by the
    engine's account and by nvidia-smi's."""
    pytest.importorskip("tests.engine.hf_models", reason="transformers (torch) is needed to build the random model")
    from tests.engine.gpu.stack_on_gpu import StackCheckError, build_model, hybrid_budget_gb, run

    model = build_model(tmp_path_factory.mktemp("gpu_stack_hybrid_model"))
    work = Path(tmp_path_factory.mktemp("gsh"))
    kv = 2048
    low, high = hybrid_budget_gb(model, 0.3, kv), hybrid_budget_gb(model, 0.7, kv)
    try:
        report = run(model, "cuda:0", "cuda:0", "cuda:0", work, kv_tokens=kv,
                     lane_extra={"lane_a": {"gpu_budget_gb": low}, "lane_b": {"gpu_budget_gb": low}},
                     switch_extra={"gpu_budget_gb": high})
    except StackCheckError as e:
        report = e.args[1] if len(e.args) > 1 else {}
        raise AssertionError(f"{e.args[0]}\n{json.dumps(report.get('logs', {}), indent=1)[-6000:]}") from None
    before, after = report["before"], report["after"]
    for lanes in (before, after):
        for p in ("lane_a", "lane_b"):
            gi = lanes[p]["gpu_info"]
            assert gi["hybrid"] is True and 0 < gi["resident_experts"] < gi["routed_experts"], (p, gi)
    assert before["lane_b"]["gpu_info"]["gpu_budget_gb"] == low and after["lane_b"]["gpu_info"]["gpu_budget_gb"] == high
    assert after["lane_b"]["gpu_info"]["resident_experts"] > before["lane_b"]["gpu_info"]["resident_experts"]
    assert report["load"]["failed"] == 0 and report["switch"]["exit"] == 0
    assert report["load"]["by_lane"].get("b", 0) > report["load"]["by_lane_before_switch"].get("b", 0)
