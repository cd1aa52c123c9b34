"""An engine loop failure in a real lane process (real HTTP, the real default model), provoked
with the test-only fault switch ``STRATA_TEST_FAULT``: every request in flight ends with a typed
error (JSON 500 ``engine_error``; streams an SSE error event and ``[DONE]``), ``/health`` turns
503 ``failed``, new requests get 503 ``engine_failed``, and the process exits 4 so that
supervisord (``autorestart=true``) starts a fresh lane."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp

from lanes.__main__ import EXIT_ENGINE_FAILED
from tests.http_helpers import child_env, child_server, sse, wait_healthy


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        if body.get("stream"):
            return r.status, await sse(r)
        return r.status, await r.json()


async def test_engine_loop_failure_fails_requests_health_503_and_exit_4() -> None:
    env = child_env(("STRATA_LANE_", "STRATA_TEST_FAULT"), STRATA_LANE_KV_TOKENS="2048", STRATA_LANE_THREADS="1",
                    STRATA_TEST_FAULT="sample_raise_after_n_steps:12")
    async with child_server("lanes", "--lane", "a", "--port", "0", env=env, what="lane") as lane:
        url = lane.url
        async with aiohttp.ClientSession() as s:
            await wait_healthy(s, url)
            base = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
            bodies = [
                {**base, "prompt": "Once upon a time", "stream": True},
                {**base, "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True},
                {**base, "prompt": "The history of the river"},
                {**base, "messages": [{"role": "user", "content": "Count to one hundred."}]},
            ]
            paths = ["/v1/completions", "/v1/chat/completions"] * 2
            results = await asyncio.wait_for(
                asyncio.gather(*(_post(s, url + p, b) for p, b in zip(paths, bodies, strict=True))), 120)
            for status, lines in results[:2]:
                assert status == 200  # the stream had started: the error comes as an SSE event
                data = [ln[6:] for ln in lines if ln.startswith("data: ")]
                assert data[-1] == "[DONE]", data[-3:]
                err = json.loads(data[-2])["error"]
                assert err["code"] == "engine_error" and err["type"] == "server_error", err
                assert not any('"finish_reason":"length"' in d for d in data)
            for status, obj in results[2:]:
                assert status == 500, obj
                assert set(obj["error"]) >= {"message", "type", "param", "code"}
                assert obj["error"]["code"] == "engine_error" and obj["error"]["type"] == "server_error"
            async with s.get(url + "/health") as r:
                health = await r.json()
                assert r.status == 503, health
                assert health["status"] == "failed" and "InjectedFault" in health["error"]
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "engine_failed"
        code = await lane.wait_exit(30)
    text = lane.text
    assert code == EXIT_ENGINE_FAILED, text[-3000:]
    assert "test-only fault injection is active" in text
    frozen = re.search(r"heap frozen after the load: (\d+) objects", text)  # gc.freeze in the entry point
    assert frozen and int(frozen.group(1)) > 10_000, text[-3000:]
    assert "engine loop failed" in text and f"stopped (exit {EXIT_ENGINE_FAILED})" in text
