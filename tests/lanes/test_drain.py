"""Drain in-process: in-flight streams finish, new requests get 503, health says draining."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from lanes.server import EngineFactory, drain
from tests.http_helpers import eventually
from tests.lanes.conftest import Lane, engine_steps, idle_within_steps, lane_config, running_lane


async def _stream(session: aiohttp.ClientSession, lane: Lane, max_tokens: int, first_token: asyncio.Event
                  ) -> tuple[list[str], str | None, list[dict]]:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    texts, errors, reason = [], [], None
    async with session.post(lane.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                texts.append("[DONE]")
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            texts.append(chunk["choices"][0]["text"])
            reason = chunk["choices"][0]["finish_reason"] or reason
            first_token.set()
    return texts, reason, errors


async def test_drain_lets_streams_finish(engine_factory: EngineFactory) -> None:
    async with running_lane(lane_config(), engine_factory) as lane, aiohttp.ClientSession() as s:
        started = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(_stream(s, lane, 16, ev)) for ev in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 20)
        draining = asyncio.create_task(drain(lane.app, timeout=30))
        await eventually(lambda: lane.state.status, lambda st: st == "draining", 5.0, "the lane draining")
        async with s.get(lane.url + "/health") as r:
            assert r.status == 503 and (await r.json())["status"] == "draining"
        async with s.post(lane.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "server_draining"
        async with s.post(lane.url + "/tokenize", json={"prompt": "still served"}) as r:
            assert r.status == 200  # tokenizer endpoints keep answering while in-flight work ends
        assert await asyncio.wait_for(draining, 30) is True
        for texts, reason, errors in await asyncio.gather(*streams):
            assert texts[-1] == "[DONE]" and reason == "length" and not errors
        assert lane.state.inflight == 0 and lane.state.aeng.scheduler.num_running == 0


async def test_drain_timeout_aborts_the_rest(engine_factory: EngineFactory) -> None:
    async with running_lane(lane_config(), engine_factory) as lane, aiohttp.ClientSession() as s:
        started = asyncio.Event()
        stream = asyncio.create_task(_stream(s, lane, 2000, started))
        await asyncio.wait_for(started.wait(), 20)
        steps = engine_steps(lane)
        assert await drain(lane.app, timeout=0.3) is False
        texts, reason, errors = await asyncio.wait_for(stream, 30)
        assert texts[-1] == "[DONE]" and reason is None
        assert errors and errors[0]["code"] == "server_stopping" and errors[0]["type"] == "service_unavailable"
        # the engine applies the abort at its next step: the stream's ~2000 remaining steps never run
        await idle_within_steps(lane, steps, 250, "the aborted stream's slot and KV freed")
        assert lane.state.engine.blocks.usage == 0
