"""``python -m lanes`` as a real process: config errors exit 2, SIGTERM drains and exits 0, log lines."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import aiohttp

from tests.http_helpers import REPO, child_env, child_server, wait_healthy


def _env(**extra: str) -> dict[str, str]:
    return child_env(("STRATA_LANE_",), **extra)


async def test_bad_config_exits_2(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lanes", "--lane", "a", env=_env(STRATA_LANE_KV_TOKENS="lots"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "kv_tokens='lots' (from environment STRATA_LANE_KV_TOKENS)" in lines[0]


async def test_sigterm_drains_then_exits_0() -> None:
    env = _env(STRATA_LANE_KV_TOKENS="1024", STRATA_LANE_THREADS="1")
    async with child_server("lanes", "--lane", "b", "--port", "0", env=env, what="lane") as lane:
        proc, url, log = lane.proc, lane.url, lane.log
        async with aiohttp.ClientSession() as s:
            await wait_healthy(s, url)
            body = {"prompt": "zebra-secret", "max_tokens": 24, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            async with s.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "gw-123"}) as r:
                lines = []
                async for raw in r.content:
                    lines.append(raw.decode())
                    if len(lines) == 2:
                        proc.send_signal(signal.SIGTERM)
            data = [ln for ln in lines if ln.startswith("data: ")]
            assert data[-1].strip() == "data: [DONE]"
            assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert await lane.wait_exit(30) == 0
    text = lane.text
    assert "zebra" not in text  # prompts never reach the log
    req = next(ln for ln in log if "POST /v1/completions" in ln)
    for part in ("lane=b", "status=200", "xrid=gw-123", "id=cmpl-", "prompt_tokens=", "completion_tokens=24",
                 "ttft=", "dur=", "finish=length"):
        assert part in req, (part, req)
    assert "draining" in text and "stopped (exit 0)" in text
