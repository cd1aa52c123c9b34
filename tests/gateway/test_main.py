"""``python -m gateway`` and ``python -m gateway.keys`` as real processes: config errors exit 2, the
admin key file must be private, SIGTERM lets a live stream finish and exits 0, logs hold no secrets."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.__main__ import loop_factory, pin_cores
from gateway.config import GatewayConfig
from tests.gateway.conftest import auth, running_lane
from tests.http_helpers import REPO, child_env, child_server

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _env(**extra: str) -> dict[str, str]:
    return child_env(("STRATA_GATEWAY_", "STRATA_ADMIN_KEY"), **extra)


async def _run(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", *args, env=env, cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_bad_config_exits_2(tmp_path: Path) -> None:
    code, _, err = await _run("gateway", env=_env(STRATA_GATEWAY_PORT="lots"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "port='lots' (from environment STRATA_GATEWAY_PORT)" in lines[0]
    code, out, _ = await _run("gateway", "--check-config", env=_env(STRATA_GATEWAY_MAX_TOKENS_CAP="512"))
    assert code == 0 and json.loads(out)["max_tokens_cap"] == 512


async def test_admin_key_file_must_be_private(tmp_path: Path) -> None:
    f = tmp_path / "admin.key"
    f.write_text("a-perfectly-long-admin-key\n")
    f.chmod(0o644)
    code, _, err = await _run("gateway", env=_env(STRATA_GATEWAY_ADMIN_KEY_FILE=str(f),
                                                  STRATA_GATEWAY_DB_URL=f"sqlite:///{tmp_path / 'gw.db'}"))
    assert code == 2 and "mode 0644" in err and "chmod 600" in err and "a-perfectly" not in err


async def test_sigterm_finishes_the_stream_then_exits_0(gateway_engines: tuple, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'gw.db'}"
    code, key, err = await _run("gateway.keys", "--db-url", db, "create", "--name", "proc", env=_env())
    key = key.strip()
    assert code == 0 and key.startswith("sk-strata-") and "shown only this once" in err and key not in err
    admin_file = tmp_path / "admin.key"
    admin_file.write_text("file-admin-key-0123456789\n")
    admin_file.chmod(0o600)
    pinned = max(os.sched_getaffinity(0))  # config cores: one CPU of ours
    async with running_lane("a", gateway_engines[0]) as lane:
        env = _env(STRATA_GATEWAY_DB_URL=db, STRATA_GATEWAY_PORT="0", STRATA_GATEWAY_HOST="127.0.0.1",
                   STRATA_GATEWAY_LANES=json.dumps([{"name": "a", "url": lane.url}]),
                   STRATA_GATEWAY_ADMIN_KEY_FILE=str(admin_file), STRATA_GATEWAY_NICE="3",
                   STRATA_GATEWAY_CORES=str(pinned))
        async with child_server("gateway", env=env, what="gateway") as gw:
            proc, url, log = gw.proc, gw.url, gw.log
            # config nice: every thread of the process runs at it (lowering priority needs no privilege)
            threads = list(Path(f"/proc/{proc.pid}/task").iterdir())
            assert threads and all(int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) == 3 for t in threads)
            # config cores: every thread is pinned to them
            assert all(os.sched_getaffinity(int(t.name)) == {pinned} for t in threads)
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/v1/admin/lanes", headers=auth("file-admin-key-0123456789")) as r:
                    assert r.status == 200 and (await r.json())["data"][0]["ready"]
                body = {"prompt": "zebra-secret", "max_tokens": 24, "ignore_eos": True, "stream": True}
                async with s.post(url + "/v1/completions", json=body, headers=auth(key)) as r:
                    assert r.status == 200
                    lines = []
                    async for raw in r.content:
                        if raw.startswith(b"data: "):
                            lines.append(raw.decode().strip())
                            if len(lines) == 2:
                                proc.send_signal(signal.SIGTERM)
                assert lines[-1] == "data: [DONE]"
                assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
            # nothing is left in flight: the exit is prompt, also while the embedding model's forkserver is still
            # importing torch (it held the exit ~22 s before close_all ended it; supervisord kills at stopwaitsecs)
            assert await gw.wait_exit(10) == 0
    text = gw.text
    assert "zebra" not in text and key not in text and "file-admin-key" not in text
    req = next(ln for ln in log if "POST /v1/completions" in ln)
    for part in ("status=200", "key=1", "lane=a", "stream=1", "completion_tokens=24", "ttft=", "dur="):
        assert part in req, (part, req)
    assert "got SIGTERM" in text and "stopped (exit 0)" in text
    # the configured default, uvloop, serves wherever it is installed; else the standard library's loop, said once
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    assert f"event loop {loop})" in text
    assert ("uvloop is not installed" in text) == (loop == "asyncio")


async def test_loop_factory_follows_the_config() -> None:
    assert loop_factory(GatewayConfig(event_loop="asyncio")) is None
    if importlib.util.find_spec("uvloop") is not None:
        factory = loop_factory(GatewayConfig())
        assert factory is not None
        loop = factory()
        try:
            assert type(loop).__module__.startswith("uvloop")
        finally:
            loop.close()


async def test_pin_cores_reports_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pin_cores(GatewayConfig()) is None

    def refuse(cores: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr("gateway.__main__.pin_process", refuse)
    assert pin_cores(GatewayConfig(cores=[0])) == "cannot pin to cores [0]: Invalid argument"
