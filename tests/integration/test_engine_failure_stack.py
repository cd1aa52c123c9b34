"""An engine loop failure in the real stack (supervisord, two lanes, the gateway, the real
default model): lane a runs with the test-only fault switch ``STRATA_TEST_FAULT``. Its
engine loop fails under load; the gateway fails its requests over to lane b (every client
gets a 200), lane a exits 4, and supervisord (``autorestart=true``) brings it back."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.integration.conftest import BIN, REPO, Stack, start_stack

pytestmark = pytest.mark.slow

FAULT = "sample_raise_after_n_steps:6"
ENV_LINE = 'environment=PYTHONPATH="%(here)s",PYTHONUNBUFFERED="1"'


def _inject_fault(text: str) -> str:
    """Lane a's environment line gains the test-only fault switch; lane b stays healthy."""
    head, sep, rest = text.partition("[program:lane_a]")
    section, sep2, tail = rest.partition("[program:lane_b]")
    env_line = ENV_LINE.replace("%(here)s", str(REPO))
    assert env_line in section, "supervisord.conf's lane environment line changed"
    section = section.replace(env_line, env_line + f',STRATA_TEST_FAULT="{FAULT}"')
    return head + sep + section + sep2 + tail


@pytest.fixture(scope="module")
def faulty_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(tmp_path_factory.mktemp("svf"), _inject_fault, drop_env=("STRATA_TEST_FAULT",)) as st:
        yield st


def _make_key(stack: Stack) -> str:
    r = subprocess.run([str(BIN / "strata"), "keys", "--config", str(stack.gateway_conf), "create", "--name",
                        "fault-test"], capture_output=True, text=True, timeout=60,
                       env={**stack.env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


async def _ask(s: aiohttp.ClientSession, url: str, key: str, i: int) -> tuple[int, str, str]:
    body = {"messages": [{"role": "user", "content": f"Write a long story number {i}."}], "max_tokens": 40,
            "ignore_eos": True}
    async with s.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        data = await r.json()
        return r.status, r.headers.get("X-Strata-Lane", "?"), str(data)[:300]


async def _load(stack: Stack, key: str, n: int) -> list[tuple[int, str, str]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s:
        return await asyncio.gather(*(_ask(s, stack.gateway_url, key, i) for i in range(n)))


def test_engine_loop_failure_fails_over_and_the_lane_comes_back(faulty_stack: Stack) -> None:
    stack = faulty_stack
    key = _make_key(stack)
    old_pid = stack.pid("lane_a")
    deadline = time.monotonic() + 240
    lanes: set[str] = set()
    while stack.pid("lane_a") == old_pid:  # keep loading until lane a's engine has failed
        assert time.monotonic() < deadline, f"lane a never failed; lanes seen {lanes}"
        results = asyncio.run(_load(stack, key, 8))
        for status, lane, body in results:
            assert status == 200, (status, lane, body)  # lane a's 500s were failed over to lane b
            lanes.add(lane)
        time.sleep(0.5)
    log = Path(stack.log_dir / "lane_a.log").read_text(errors="replace")
    assert "test-only fault injection is active" in log
    assert "engine loop failed" in log and "stopped (exit 4)" in log
    assert "exit status 4" in stack.supervisord_log()
    info = stack.wait_ready("lane_a", timeout=120)  # supervisord restarted it
    assert info["pid"] != old_pid
