"""bench/engine_gpu_depth.py's argument parsing (the GPU part runs on the device only)."""

from __future__ import annotations

import pytest

from bench.engine_gpu_depth import parse_depths, parse_knobs


def test_depths_sorted_and_distinct() -> None:
    assert parse_depths("32768,0, 8192,0") == [0, 8192, 32768]
    for bad in ("", "x", "-1"):
        with pytest.raises(SystemExit):
            parse_depths(bad)


def test_knobs_name_registered_settings() -> None:
    assert parse_knobs(["fp32:STRATA_GPU_ATT_SPLIT_MMA=0", "b:STRATA_GPU_ATT_SPLIT_MMA=1, STRATA_GPU_ATT_SPLIT_L2=0"]) == [
        ("fp32", {"STRATA_GPU_ATT_SPLIT_MMA": "0"}),
        ("b", {"STRATA_GPU_ATT_SPLIT_MMA": "1", "STRATA_GPU_ATT_SPLIT_L2": "0"}),
    ]
    for bad in ("nolabel", ":STRATA_GPU_ATT_SPLIT_MMA=0", "a:STRATA_GPU_NOT_A_SETTING=1", "a:STRATA_GPU_ATT_SPLIT_MMA"):
        with pytest.raises(SystemExit):
            parse_knobs([bad])
