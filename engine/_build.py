"""Builds the C engine as a cffi extension module: ``python -m engine._build``.

The public C API is engine/csrc/strata.h; its declarations are fed to cffi verbatim
(minus the include guard), so the header is the single source of truth.

The engine's sources are compiled to objects in parallel (one compiler process per source, up to the
machine's cores) under build/cobj/, each object kept while the digest of its source, the headers and the
flags is unchanged; cffi then compiles only its own wrapper and links the objects. A fresh GPU machine
builds in the time of the largest source instead of the sum of all fifteen.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
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


def compile_command() -> list[str]:
    """The compiler and flags of an engine object: Python's own (what cffi's compile of the sources used), then
    CFLAGS."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    base = [sysconfig.get_config_var(v) or "" for v in ("CFLAGS", "CCSHARED")]
    return [*shlex.split(cc), *(f for b in base for f in shlex.split(b)), *CFLAGS, f"-I{CSRC}"]


def compile_objects(obj_dir: Path, jobs: int | None = None) -> list[Path]:
    """SOURCES compiled to obj_dir/<name>.o side by side; an object whose digest (source, every csrc header, the
    command) is unchanged is kept. Raises RuntimeError with the compiler's output when a source fails."""
    obj_dir.mkdir(parents=True, exist_ok=True)
    cmd = compile_command()
    shared = hashlib.sha256("\0".join(cmd).encode())
    for h in sorted(CSRC.glob("*.h")):
        shared.update(h.name.encode() + h.read_bytes())

    def one(name: str) -> Path:
        src, obj = CSRC / name, obj_dir / (Path(name).stem + ".o")
        digest = shared.copy()
        digest.update(src.read_bytes())
        key, stamp = digest.hexdigest(), obj.with_suffix(".sha256")
        if obj.is_file() and stamp.is_file() and stamp.read_text() == key:
            return obj
        tmp = obj.with_suffix(".o.tmp")
        r = subprocess.run([*cmd, "-c", str(src), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"engine._build: {name} did not compile:\n{r.stderr}")
        if r.stderr:
            print(r.stderr, file=sys.stderr, end="")
        os.replace(tmp, obj)
        stamp.write_text(key)
        return obj

    with ThreadPoolExecutor(max_workers=jobs or len(os.sched_getaffinity(0))) as pool:
        return list(pool.map(one, SOURCES))


def make_builder(objects: list[Path]) -> FFI:
    """cffi's module: its wrapper over strata.h, linked with the engine's compiled objects."""
    ffi = FFI()
    ffi.cdef(cdef_from_header(CSRC / "strata.h"))
    ffi.set_source(
        "engine._strata_c",
        '#include "strata.h"',
        include_dirs=[str(CSRC)],
        extra_compile_args=CFLAGS,
        extra_objects=[str(o) for o in objects],
        extra_link_args=["-pthread", "-lm"],
    )
    return ffi


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    try:
        objects = compile_objects(root / "build" / "cobj")
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    make_builder(objects).compile(tmpdir=str(root / "build" / "cffi"), target=str(root / "engine" / "_strata_c.*"),
                                  verbose=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
