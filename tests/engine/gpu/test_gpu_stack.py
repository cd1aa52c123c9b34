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
