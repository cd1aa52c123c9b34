"""Clients that hang up free their engine slots at once; the others are not disturbed."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.http_helpers import eventually, scrape
from tests.lanes.conftest import Lane

ABORTS = 'strata_requests_total{finish_reason="abort"}'

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = 2000  # tokens a hung-up request would still generate if it were not aborted


STEPS = "strata_step_seconds_count"
# engine steps a hang-up may still cost: the lane notices it at its next write or ping (ping_interval_s 0.2),
# a few steps; the hung-up requests would need up to LONG more steps if they were not aborted
ABORT_STEPS = LONG // 8


async def _wait_idle(session: aiohttp.ClientSession, url: str, since_steps: float, within: float = 120.0
                     ) -> dict[str, float]:
    """Until the lane has nothing running, waiting or in KV; then at most ``ABORT_STEPS`` engine steps may have
    run since ``since_steps``. Counted in steps, not seconds: a busy box slows the steps, not their number."""
    deadline = time.monotonic() + within
    while True:
        m = await scrape(session, url)
        if m["strata_requests_running"] == 0 and m["strata_requests_waiting"] == 0 and m["strata_kv_usage_ratio"] == 0:
            break
        assert time.monotonic() < deadline, f"not idle after {within}s: running={m['strata_requests_running']} " \
                                            f"waiting={m['strata_requests_waiting']} kv={m['strata_kv_usage_ratio']}"
        await asyncio.sleep(0.05)
    steps = m[STEPS] - since_steps
    print(f"idle {steps:.0f} engine steps after the hang-up")
    assert steps <= ABORT_STEPS, f"{steps:.0f} engine steps ran after the hang-up before the lane was idle"
    return m


async def test_twenty_streams_ten_hang_up(lane: Lane) -> None:
    hung_up = asyncio.Event()
    started = 0
    all_started = asyncio.Event()

    async def client(i: int, session: aiohttp.ClientSession) -> tuple[str, str | None]:
        nonlocal started
        closer = i % 2 == 0
        body = {"prompt": f"Story number {i}:", "stream": True, "temperature": 0, "ignore_eos": True,
                "max_tokens": LONG if closer else 8}
        resp = await session.post(lane.url + "/v1/completions", json=body)
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers["X-Accel-Buffering"] == "no" and resp.headers["Cache-Control"] == "no-cache"
        text, reason = [], None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                resp.release()
                return "done", reason
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            reason = chunk["choices"][0]["finish_reason"] or reason
            if closer and len(text) == 2:
                started += 1
                if started == 10:
                    all_started.set()
                await hung_up.wait()
                resp.close()  # drop the connection mid-stream
                return "closed", None
        return "eof", reason

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s, \
            aiohttp.ClientSession() as probe:
        tasks = [asyncio.create_task(client(i, s)) for i in range(20)]
        await asyncio.wait_for(all_started.wait(), 60)
        steps = (await scrape(probe, lane.url))[STEPS]
        hung_up.set()
        # the hung-up ten would run for up to LONG more steps: idle within a few steps means they were aborted
        await _wait_idle(probe, lane.url, steps)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert results.count(("closed", None)) == 10
        assert results.count(("done", "length")) == 10
        # handlers record a request when they see its end (one poll at most)
        m = await eventually(lambda: scrape(probe, lane.url), lambda m: m.get(ABORTS, 0) >= 10, 30.0,
                             "10 aborts counted")
        assert m[ABORTS] == 10
        assert m['strata_requests_total{finish_reason="length"}'] == 10


async def test_non_stream_client_timeout_aborts(lane: Lane) -> None:
    async with aiohttp.ClientSession() as s:
        aborts = (await scrape(s, lane.url)).get(ABORTS, 0)
        body = {"prompt": "Count:", "temperature": 0, "ignore_eos": True, "max_tokens": LONG}
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(lane.url + "/v1/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        steps = (await scrape(s, lane.url))[STEPS]
        await _wait_idle(s, lane.url, steps)  # LONG more steps unless it was aborted
        m = await eventually(lambda: scrape(s, lane.url), lambda m: m.get(ABORTS, 0) >= aborts + 1, 30.0,
                             "the abort counted")
        assert m[ABORTS] == aborts + 1
