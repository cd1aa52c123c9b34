"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def g() -> tuple:
    """``(ffi, lib)`` of the kernel harness, engine/_strata_cuda_test.so (the engine's sources plus the
    stg_test_* entry points of strata_cuda_test.h; built beside the engine by engine/_build_cuda.py),
    loaded only when a test asks (every such test requires a GPU)."""
    from cffi import FFI

    from engine import cuda_backend

    path = cuda_backend.ROOT / "_strata_cuda_test.so"
    if not path.exists():
        pytest.fail(f"{path.name} is missing: build it with `python -m engine._build_cuda` (make build does)")
    ffi = FFI()
    ffi.cdef(cuda_backend.cdef_text(cuda_backend.HEADER))
    ffi.cdef(cuda_backend.cdef_text(cuda_backend.HEADER.with_name("strata_cuda_test.h")))
    return ffi, ffi.dlopen(str(path))
