"""STRATA_CUDA_LIB picks which build of the GPU engine load() opens (two builds timed in one device
call: a second library loaded through STRATA_CUDA_LIB). Runs without a GPU: a missing library is the typed 'build' error."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import cuda_backend
from engine.cuda_backend import DeviceUnavailableError


def test_strata_cuda_lib_selects_the_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    other = tmp_path / "other_build.so"
    monkeypatch.setenv("STRATA_CUDA_LIB", str(other))
    monkeypatch.setattr(cuda_backend, "_loaded", None)
    assert cuda_backend.lib_path() == other
    with pytest.raises(DeviceUnavailableError, match="other_build.so is missing") as ei:
        cuda_backend.load()
    assert ei.value.missing == "build"
    monkeypatch.delenv("STRATA_CUDA_LIB")
    assert cuda_backend.lib_path() == cuda_backend.LIB_PATH
