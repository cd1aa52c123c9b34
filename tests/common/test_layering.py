"""Layering: the gateway, session memory, ``strata keys`` and the shared package work without the engine.

Each check runs in a fresh interpreter whose import system refuses ``engine`` (and with it the C
extension ``_strata_c``) and ``lanes``: an import of either anywhere below the gateway fails
the check, whether or not the C build exists on this machine.
"""

from __future__ import annotations

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
            "common.http", "common.config", "memory.store", "memory.compose", "memory.service", "memory.chat",
            "memory.api"} <= set(out["imported"])
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
