"""``python -m lanes`` as a real process: config errors exit 2, SIGTERM drains and exits 0, log lines."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_LANE_")}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


async def test_bad_config_exits_2(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lanes", "--lane", "a", env=_env(STRATA_LANE_KV_TOKENS="lots"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "kv_tokens='lots' (from environment STRATA_LANE_KV_TOKENS)" in lines[0]


async def test_sigterm_drains_then_exits_0() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lanes", "--lane", "b", "--port", "0",
        env=_env(STRATA_LANE_KV_TOKENS="1024", STRATA_LANE_THREADS="1"),
        stderr=asyncio.subprocess.PIPE, cwd=REPO)
    assert proc.stderr is not None
    log: list[str] = []
    try:
        port = None
        while port is None:
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            assert line, "lane exited early: " + "".join(log)
            log.append(line)
            if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
        url = f"http://127.0.0.1:{port}"
        reader = asyncio.create_task(_drain_stderr(proc.stderr, log))
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
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
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        await reader
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = "".join(log)
    assert "zebra" not in text  # prompts never reach the log
    req = next(ln for ln in log if "POST /v1/completions" in ln)
    for part in ("lane=b", "status=200", "xrid=gw-123", "id=cmpl-", "prompt_tokens=", "completion_tokens=24",
                 "ttft=", "dur=", "finish=length"):
        assert part in req, (part, req)
    assert "draining" in text and "stopped (exit 0)" in text


async def _drain_stderr(stream: asyncio.StreamReader, log: list[str]) -> None:
    while line := await stream.readline():
        log.append(line.decode())
