"""Strata's decoder: GGUF models, C/SIMD kernels, batching scheduler.

The engine's thread pool owns the cores it is given; numpy's BLAS threads would only
compete with it (numpy here does sampling, not matrix products), so they are limited
to one unless the caller set otherwise before importing numpy.
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
