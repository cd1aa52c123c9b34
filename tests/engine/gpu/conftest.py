"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def g() -> tuple:
    """``(ffi, lib)`` of the CUDA library, loaded only when a test asks (every such test requires a GPU)."""
    from engine.cuda_backend import load

    return load()
