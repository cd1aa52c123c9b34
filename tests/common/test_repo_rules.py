"""``tests/`` holds tests: test modules, their conftest files and the few support modules they import.

No patch files, no shell scripts (one-off calls of the GPU machine live in ``tools/gpu/``), no
stand-alone diagnostic scripts. A new support module goes into ``SUPPORT`` below, and only when a
test imports it."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

# Modules under tests/ that are neither test_*.py, conftest.py nor __init__.py, each imported by tests.
SUPPORT = {
    "tests/http_helpers.py",  # a real gateway / lane over HTTP for the tests that speak to one
    "tests/pg.py",  # the PostgreSQL server the postgres tests use
    "tests/engine/arch_checks.py",  # the new architectures' shared checks: greedy vs llama.cpp, mixed steps, devices
    "tests/engine/gguf_factory.py",  # small random GGUF files
    "tests/engine/hf_models.py",  # small random Hugging Face MoE models converted to GGUF
    "tests/engine/parity.py",  # the parity tests' relative error, llama.cpp oracle, greedy judging, NumPy pieces
    "tests/engine/sched_helpers.py",  # stepping a scheduler and collecting its outputs; prompts prefilled together
    "tests/engine/gpu/_env.py",  # whether a GPU is there, the skip reason
    "tests/engine/gpu/_kernel_helpers.py",  # pointers into the CUDA test library, CPU references
    "tests/engine/gpu/_model_checks.py",  # a model on the GPU against the CPU engine: logits, greedy, batched
    "tests/engine/gpu/stack_on_gpu.py",  # the supervisord stack with a lane on the GPU
    "tests/gateway/flood.py",  # the many-keys flood of test_auth.py
    "tests/gateway/documents/helpers.py",  # documents API calls
    "tests/gateway/documents/samples.py",  # PDF / DOCX samples and bombs
    "tests/memory/_writer.py",  # the process that test_durability.py kills mid-write
}
PATCH_SUFFIXES = {".patch", ".diff", ".orig", ".rej"}
SHELL_SUFFIXES = {".sh", ".bash", ".zsh"}


def tracked_files() -> list[Path]:
    """Files under tests/ that git tracks or would (not ignored); without git (an sdist) every file there."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "tests"], cwd=REPO, capture_output=True, check=True,
                             timeout=30).stdout
        files = [REPO / p for p in out.decode().split("\0") if p]
        if files:
            return [f for f in files if f.is_file()]  # a deletion not yet committed is gone
    except (OSError, subprocess.SubprocessError):
        pass
    return [p for p in TESTS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def is_test_module(p: Path) -> bool:
    return p.name.startswith("test_") or p.name in ("conftest.py", "__init__.py")


def test_the_listing_sees_the_tests() -> None:
    names = {rel(p) for p in tracked_files()}
    assert "tests/common/test_repo_rules.py" in names and "tests/conftest.py" in names


def test_no_patch_files_under_tests() -> None:
    bad = [rel(p) for p in tracked_files() if p.suffix in PATCH_SUFFIXES]
    assert not bad, f"patch files belong in no test folder (a lost experiment's numbers go to docs/): {bad}"


def test_no_shell_scripts_under_tests() -> None:
    bad = []
    for p in tracked_files():
        if p.suffix in SHELL_SUFFIXES:
            bad.append(rel(p))
        elif p.suffix != ".py":
            with p.open("rb") as f:
                if f.read(2) == b"#!" or os.access(p, os.X_OK):
                    bad.append(rel(p))
    assert not bad, f"scripts belong in tools/ (the GPU machine's in tools/gpu/), not tests/: {bad}"


def test_python_under_tests_is_tests_or_listed_support() -> None:
    bad = [rel(p) for p in tracked_files() if p.suffix == ".py" and not is_test_module(p) and rel(p) not in SUPPORT]
    assert not bad, ("not a test module (test_*.py, conftest.py, __init__.py): make it a test, move it out of "
                     f"tests/ (tools/), or, if tests import it, add it to SUPPORT here: {bad}")


def imported_modules(path: Path) -> set[str]:
    """Dotted names a module imports (``from a.b import c`` gives a.b and a.b.c) or names as a string
    (``pytest.importorskip("a.b")``, a forkserver's preload list)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("tests."):
            names.add(node.value)
    return names


def test_every_support_module_exists_and_is_imported_by_tests() -> None:
    files = {rel(p): p for p in tracked_files()}
    gone = sorted(s for s in SUPPORT if s not in files)
    assert not gone, f"listed in SUPPORT but not in the tree (remove the entry): {gone}"
    users = [p for p in files.values() if p.suffix == ".py" and (is_test_module(p) or rel(p) in SUPPORT)]
    imported: set[str] = set()
    for p in users:
        imported |= imported_modules(p)
    unused = sorted(s for s in SUPPORT if s.removesuffix(".py").replace("/", ".") not in imported)
    assert not unused, f"support modules no test imports (delete them, or move them to tools/): {unused}"
