"""Layering: the gateway, session memory, ``strata keys`` and the shared package work without the engine;
``memory`` does not import the gateway; ``engine.engine`` and ``engine.scheduler`` are not in one import cycle.

The run-time checks run in a fresh interpreter whose import system refuses ``engine`` (and with it the C
extension ``_strata_c``) and ``lanes``: an import of either anywhere below the gateway fails
the check, whether or not the C build exists on this machine. The static checks read every module's
source (AST): an import counts wherever it is written (module level, in a function, under TYPE_CHECKING),
so an import that only some code path runs is found too.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Installed before anything else in the child: a finder that refuses the engine and the lanes.
BLOCKER = '''
import importlib.abc, sys
BLOCKED = {"engine", "lanes", "_strata_c"}
class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or name.rsplit(".", 1)[-1] == "_strata_c":
            raise ImportError(f"layering: {name} may not be imported here")
        return None
sys.meta_path.insert(0, _Refuse())
'''

IMPORT_ALL = BLOCKER + '''
import importlib, json, pkgutil
import common, gateway, memory
names = []
for pkg in (common, gateway, memory):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
import cli.main
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({"imported": names, "blocked_loaded": loaded}))
'''

CLI = BLOCKER + '''
from cli.main import main
sys.exit(main(sys.argv[1:]))
'''

HEALTH = BLOCKER + '''
import asyncio, json
import aiohttp
from aiohttp import web
from gateway.app import create_app
from gateway.config import GatewayConfig

async def run(db_url):
    # a lane that is not there: the gateway is alive, not ready, and answers unauthenticated calls typed
    cfg = GatewayConfig(host="127.0.0.1", port=0, db_url=db_url,
                        lanes=[{"name": "a", "url": "http://127.0.0.1:9"}], health_timeout_s=0.5)
    runner = web.AppRunner(create_app(cfg, env={}), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    out = {}
    async with aiohttp.ClientSession() as s:
        for path in ("/healthz", "/readyz", "/v1/models"):
            async with s.get(f"http://127.0.0.1:{port}{path}") as r:
                out[path] = [r.status, await r.json()]
    await runner.cleanup()
    print(json.dumps(out))

asyncio.run(run(sys.argv[1]))
'''


def _child(code: str, *args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=120)


def test_blocker_really_blocks(tmp_path: Path) -> None:
    """The check can fail: importing the lanes (which import the engine) is refused in the child."""
    r = _child(BLOCKER + "import lanes.server\n", tmp=tmp_path)
    assert r.returncode != 0 and "layering: " in r.stderr


def test_every_gateway_module_imports_without_engine(tmp_path: Path) -> None:
    r = _child(IMPORT_ALL, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"gateway.app", "gateway.proxy", "gateway.keys", "gateway.__main__", "common.errors",
            "common.http", "common.config", "common.db", "common.embedding", "common.token_limit", "memory.store",
            "memory.compose", "memory.service", "gateway.sessions", "gateway.memory_chat"} <= set(out["imported"])
    assert out["blocked_loaded"] == []


def test_strata_keys_without_engine(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'keys.db'}"
    r = _child(CLI, "keys", "--help", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "create" in r.stdout
    r = _child(CLI, "keys", "--db-url", db, "create", "--name", "layering", "--json", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    created = json.loads(r.stdout)
    assert created["key"].startswith("sk-strata-")
    r = _child(CLI, "keys", "--db-url", db, "list", "--json", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [k["name"] for k in json.loads(r.stdout)] == ["layering"]


def test_strata_help_and_engine_command_without_engine(tmp_path: Path) -> None:
    r = _child(CLI, "--help", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stdout and "keys" in r.stdout
    # an engine subcommand without the engine: one typed line, no traceback
    r = _child(CLI, "generate", "--prompt", "hi", tmp=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("strata: error:") and "Traceback" not in r.stderr


def test_gateway_app_serves_health_without_engine(tmp_path: Path) -> None:
    r = _child(HEALTH, f"sqlite:///{tmp_path / 'gw.db'}", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["/healthz"] == [200, {"status": "alive"}]
    assert out["/readyz"][0] == 503
    status, body = out["/v1/models"]
    assert status == 401 and set(body["error"]) >= {"message", "type", "param", "code"}


# ------------------------------------------------------------------ static: imports read from the source


def _modules(pkg_dir: Path) -> dict[str, Path]:
    """Every module of the package at ``pkg_dir`` by dotted name (a package by its own name)."""
    out = {}
    for f in sorted(pkg_dir.rglob("*.py")):
        parts = list(f.relative_to(pkg_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def imports_of(path: Path, name: str) -> set[str]:
    """The dotted names a module imports anywhere in its source: ``import a.b``, ``from a import b`` (as
    ``a`` and ``a.b``), relative imports resolved against ``name``, and ``importlib.import_module("a.b")`` /
    ``__import__("a.b")`` with a literal name."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" if mod else a.name for a in node.names if a.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__"):
                found.add(node.args[0].value)
    return found


def forbidden_imports(pkg_dir: Path, forbidden: str) -> dict[str, list[str]]:
    """Module -> the names it imports from the top-level package ``forbidden``."""
    out = {}
    for name, path in _modules(pkg_dir).items():
        bad = sorted(n for n in imports_of(path, name) if n.split(".")[0] == forbidden)
        if bad:
            out[name] = bad
    return out


def import_path(pkg_dir: Path, src: str, dst: str) -> list[str] | None:
    """A chain of imports inside the package from module ``src`` to module ``dst`` (None: there is none).
    An imported name counts as an edge to the longest module of the package it names."""
    mods = _modules(pkg_dir)
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        for n in imports_of(path, name):
            parts = n.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in mods),
                          None)
            if target is not None and target != name:
                edges.setdefault(name, set()).add(target)
    seen = {src: [src]}
    todo = [src]
    while todo:
        m = todo.pop()
        for t in sorted(edges.get(m, ())):
            if t not in seen:
                seen[t] = seen[m] + [t]
                todo.append(t)
    return seen.get(dst)


def import_cycle(pkg_dir: Path, a: str, b: str) -> list[str] | None:
    """The cycle through modules ``a`` and ``b`` (a -> ... -> b -> ... -> a), or None."""
    there, back = import_path(pkg_dir, a, b), import_path(pkg_dir, b, a)
    return there + back[1:] if there and back else None


def test_memory_does_not_import_the_gateway() -> None:
    """memory is a library the gateway calls: no module under memory/ imports gateway, anywhere in its code."""
    assert forbidden_imports(REPO / "memory", "gateway") == {}


def test_no_import_cycle_between_engine_and_scheduler() -> None:
    """Engine.generate / stream run a scheduler (engine.engine imports engine.scheduler); the scheduler reaches
    the engine through engine.step's interface only, so no chain of imports leads back."""
    assert import_path(REPO / "engine", "engine.engine", "engine.scheduler") is not None  # the check sees edges
    assert import_cycle(REPO / "engine", "engine.engine", "engine.scheduler") is None


def test_static_checks_find_violations(tmp_path: Path) -> None:
    """The checks above can fail: a memory module importing the gateway in each written form, and an engine
    whose scheduler imports it back only inside a function, through a third module."""
    mem = tmp_path / "memory"
    (mem / "sub").mkdir(parents=True)
    (mem / "__init__.py").write_text("")
    (mem / "clean.py").write_text("import json\nfrom memory import sub\nfrom . import clean\n")
    (mem / "a.py").write_text("from gateway.errors import APIError\n")
    (mem / "b.py").write_text("def f():\n    import gateway.state as s\n    return s\n")
    (mem / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gateway\n")
    (mem / "d.py").write_text("import importlib\nm = importlib.import_module('gateway.db')\n")
    (mem / "sub" / "__init__.py").write_text("from .. import clean\nfrom .x import y\n")
    assert imports_of(mem / "sub" / "__init__.py", "memory.sub") == {"memory", "memory.clean", "memory.sub.x",
                                                                     "memory.sub.x.y"}
    assert forbidden_imports(mem, "gateway") == {
        "memory.a": ["gateway.errors", "gateway.errors.APIError"], "memory.b": ["gateway.state"],
        "memory.c": ["gateway"], "memory.d": ["gateway.db"]}

    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "__init__.py").write_text("")
    (eng / "engine.py").write_text("def stream():\n    from engine.scheduler import Scheduler\n")
    (eng / "step.py").write_text("class StepStats: ...\n")
    (eng / "scheduler.py").write_text("from engine.step import StepStats\n")
    assert import_cycle(eng, "engine.engine", "engine.scheduler") is None
    (eng / "step.py").write_text("def f():\n    from engine import engine\n")
    assert import_cycle(eng, "engine.engine", "engine.scheduler") == [
        "engine.engine", "engine.scheduler", "engine.step", "engine.engine"]
