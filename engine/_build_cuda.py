"""Builds the GPU engine, ``engine/_strata_cuda.so``, and its kernel harness for the GPU tests,
``engine/_strata_cuda_test.so``, with nvcc: ``python -m engine._build_cuda``.

Without nvcc it prints one line and succeeds (CPU-only machines, CI without CUDA). The library
is loaded only when a GPU is asked for (engine/cuda_backend.py, cffi ABI mode), so nothing on
the CPU path depends on it; the harness library only by tests/engine/gpu. Each is one translation
unit (strata_cuda.cu includes the op families in order); the two compile in parallel.

    python -m engine._build_cuda            # sm_89 + sm_90 + PTX, both libraries, skipped when up to date
    python -m engine._build_cuda --check    # compile both for one architecture to temporary files (CI)
    python -m engine._build_cuda --sm90-out engine/_strata_cuda_base.so   # the engine alone, sm_90, another file
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_SRC = ROOT / "engine" / "csrc" / "cuda"
MAIN = CUDA_SRC / "strata_cuda.cu"
TARGET = ROOT / "engine" / "_strata_cuda.so"
TEST_MAIN = CUDA_SRC / "strata_cuda_test.cu"
TEST_TARGET = ROOT / "engine" / "_strata_cuda_test.so"
# RTX 40xx (sm_89), H100/H200 (sm_90), and PTX for anything newer (the driver compiles it)
ARCHS = ["-gencode=arch=compute_89,code=sm_89", "-gencode=arch=compute_90,code=sm_90",
         "-gencode=arch=compute_90,code=compute_90"]
CHECK_ARCHS = ["-gencode=arch=compute_90,code=sm_90"]
# -Xlinker -s: no static symbol table (cffi finds the entry points in the dynamic one), ~0.6 MB less a library
# for the GPU machine's 64 MiB carry (tools/gpu/README.md)
FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-Wall,-Wextra", "--threads", "0",
         "-Werror", "all-warnings", "-Xlinker", "-s"]


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME or /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (Path(base) / "bin" / "nvcc").is_file():
            return str(Path(base) / "bin" / "nvcc")
    return None


def sources() -> list[Path]:
    return sorted(CUDA_SRC.glob("*.cu")) + sorted(CUDA_SRC.glob("*.cuh")) + sorted(CUDA_SRC.glob("*.h")) + [
        ROOT / "engine" / "csrc" / n for n in ("strata.h", "rope_table.h", "iq_grids.h")]


def up_to_date(target: Path = TARGET) -> bool:
    return target.exists() and target.stat().st_mtime >= max(p.stat().st_mtime for p in sources())


def compile_cuda(nvcc: str, jobs: list[tuple[Path, Path]], archs: list[str]) -> None:
    """Compile each (source, output) with nvcc, all at once; raise CalledProcessError naming the first failure."""
    procs = [(subprocess.Popen([nvcc, *FLAGS, *archs, "-o", str(out), str(src)], cwd=str(ROOT)), src)
             for src, out in jobs]
    failed = [(p.wait(), src) for p, src in procs]
    for rc, src in failed:
        if rc:
            raise subprocess.CalledProcessError(rc, [nvcc, str(src)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compile for sm_90 only, to a temporary file")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    ap.add_argument("--sm90-out", type=Path, default=None, metavar="PATH",
                    help="compile for sm_90 only to PATH (a second, smaller library: a before/after of a kernel "
                         "change in one H200 call, loaded through STRATA_CUDA_LIB)")
    args = ap.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("engine._build_cuda: nvcc not found, GPU engine not built (CPU only)")
        return 0
    t0 = time.monotonic()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            compile_cuda(nvcc, [(MAIN, Path(tmp) / "check.so"), (TEST_MAIN, Path(tmp) / "check_test.so")], CHECK_ARCHS)
        print(f"engine._build_cuda: CUDA sources compile (sm_90, {time.monotonic() - t0:.0f} s)")
        return 0
    if args.sm90_out is not None:
        compile_cuda(nvcc, [(MAIN, args.sm90_out.resolve())], CHECK_ARCHS)
        print(f"engine._build_cuda: built {args.sm90_out} (sm_90, {time.monotonic() - t0:.0f} s)")
        return 0
    targets = [(src, out) for src, out in ((MAIN, TARGET), (TEST_MAIN, TEST_TARGET)) if args.force or not up_to_date(out)]
    if not targets:
        return 0
    tmp = [(src, out.with_suffix(".so.tmp")) for src, out in targets]
    try:
        compile_cuda(nvcc, tmp, ARCHS)
        for (_, t), (_, out) in zip(tmp, targets, strict=True):
            os.replace(t, out)
    finally:
        for _, t in tmp:
            t.unlink(missing_ok=True)
    built = ", ".join(str(out.relative_to(ROOT)) for _, out in targets)
    print(f"engine._build_cuda: built {built} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
