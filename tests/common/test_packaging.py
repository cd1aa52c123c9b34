"""pyproject's package list matches the tree: an installed ``strata`` (no PYTHONPATH) imports every
top-level package, and no pattern names a package that does not exist."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

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
