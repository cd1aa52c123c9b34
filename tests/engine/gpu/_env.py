"""Whether this machine can run the GPU tests, and why not: one reason string for every skip."""

from __future__ import annotations

import pytest


def _no_gpu_reason() -> str | None:
    try:
        from engine.cuda_backend import DeviceUnavailableError, device_count
    except ImportError as exc:  # the C engine itself is not built
        return f"the engine is not built ({exc})"
    try:
        n = device_count()
    except DeviceUnavailableError as exc:
        return str(exc)
    return None if n > 0 else "no CUDA device is visible"


NO_GPU = _no_gpu_reason()
requires_gpu = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")]


def rel_err(got, ref) -> float:  # noqa: ANN001 - numpy arrays
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "non-finite values in the GPU result"
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
