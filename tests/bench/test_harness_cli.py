"""``strata bench run`` on a serving-only install (``make run``): the packages of the ``bench`` extra
that it imports are missing there, and the command names them and the way to install them (exit 2)
instead of dying in an import with a traceback.

The missing packages are made real in a fresh interpreter whose import system refuses them, running
the real ``strata`` entry point (``cli.main``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bench.harness import cli

REPO = Path(__file__).resolve().parents[2]

CHILD = '''
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Refuse())
from cli.main import main
sys.exit(main(sys.argv[2:]))
'''


def strata_without(blocked: set[str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", CHILD, ",".join(sorted(blocked)), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


# port 9 (discard) on loopback: nothing listens, so a run that got past the check would fail to connect
RUN = ("bench", "run", "--target", "http://127.0.0.1:9", "--key", "k")


def test_run_without_matplotlib_names_it_and_the_install() -> None:
    proc = strata_without({"matplotlib"}, *RUN, "--scenarios", "single")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "needs matplotlib," in proc.stderr
    assert "make run" in proc.stderr and "make bench" in proc.stderr
    assert "pip install -e '.[bench]'" in proc.stderr
    # the version range comes from pyproject's bench extra
    assert re.search(r"pip install 'matplotlib>=[0-9.]+,<[0-9]+'", proc.stderr), proc.stderr


def test_run_names_every_missing_package_the_scenarios_need() -> None:
    proc = strata_without({"matplotlib", "tqdm", "fpdf"}, *RUN)  # all scenarios: rag's fpdf2 too
    assert proc.returncode == 2, proc.stderr
    assert "needs matplotlib, tqdm, fpdf2," in proc.stderr
    proc = strata_without({"fpdf"}, *RUN, "--scenarios", "single,concurrency")  # no rag: fpdf2 is not needed
    assert "needs" not in proc.stderr
    assert "127.0.0.1:9" in proc.stderr and "Traceback" not in proc.stderr  # it went on to the target
    assert proc.returncode == 2


def test_compare_needs_none_of_them(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text('{"scenarios": {}}')
    proc = strata_without({"matplotlib", "tqdm", "fpdf"}, "bench", "compare", str(a), str(a))
    assert "needs" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("module", sorted(cli.RUN_NEEDS))
def test_each_needed_package_is_in_the_bench_extra(module: str) -> None:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    dist = cli.RUN_NEEDS[module][0]
    assert cli._bench_requirement(dist) in extra, f"{dist} is not in pyproject's bench extra"
