"""What the GPU kernel tests share (the library itself is the ``g`` fixture of conftest.py): pointers into
it, its error text, and the CPU's activation quantisation that the GPU's 8-bit blocks are compared with."""

from __future__ import annotations

import numpy as np

from engine.native import lib, ptr


def gcheck(g: tuple, rc: int) -> None:
    gffi, glib = g
    assert rc == 0, gffi.string(glib.stg_last_error()).decode()


def gptr(g: tuple, a: np.ndarray, ctype: str = "void *"):  # noqa: ANN201
    return g[0].cast(ctype, g[0].from_buffer(a))


def cpu_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CPU's 8-bit blocks of each row of ``x`` [T, K]: codes [T, K], scales [T, K/32], sums [T, K/16]."""
    T, K = x.shape
    qs, d, s = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32), np.empty((T, K // 16), np.int32)
    for t in range(T):
        assert lib.st_quantize_act(ptr(x[t], "float *"), K, ptr(qs[t], "int8_t *"), ptr(d[t], "float *"),
                                   ptr(s[t], "int32_t *")) == 0
    return qs, d, s
