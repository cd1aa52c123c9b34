"""Builds the C engine as a cffi extension module: ``python -m engine._build``.

The public C API is engine/csrc/strata.h; its declarations are fed to cffi verbatim
(minus the include guard), so the header is the single source of truth.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent / "csrc"
# The CPU engine: kernels (quants, quants_iq, kernels_*, attention) and their selection (variants),
# the pool, then the step: model validation (model), KV cache (kv), shared primitives
# (linear), experts (moe), latent attention (mla) and the step itself (forward). engine/csrc/cuda/ is not
# built here.
SOURCES = ["quants.c", "quants_iq.c", "quants_lowbit.c", "kernels_avx2.c", "kernels_avx512.c", "attention.c",
           "variants.c", "attn_blocks.c", "pool.c", "model.c", "kv.c", "linear.c", "moe.c", "mla.c", "forward.c"]
CFLAGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off", "-pthread", "-Wall", "-Wextra"]


def cdef_from_header(header: Path) -> str:
    text = header.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    keep = [ln for ln in text.splitlines() if not re.match(r"\s*#\s*(include|ifndef|endif|define STRATA_H)", ln)]
    return "\n".join(keep)


def make_builder() -> FFI:
    ffi = FFI()
    ffi.cdef(cdef_from_header(CSRC / "strata.h"))
    ffi.set_source(
        "engine._strata_c",
        '#include "strata.h"',
        sources=[str(CSRC / s) for s in SOURCES],
        include_dirs=[str(CSRC)],
        extra_compile_args=CFLAGS,
        extra_link_args=["-pthread", "-lm"],
    )
    return ffi


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    make_builder().compile(tmpdir=str(root / "build" / "cffi"), target=str(root / "engine" / "_strata_c.*"), verbose=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
