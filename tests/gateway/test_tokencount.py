"""The window precheck's local count (gateway/tokencount.py): the lane's tokenizer loaded in the gateway
must count exactly what the lane's own /tokenize counts, and replace the round trip once loaded."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.tokencount import LocalCounter
from gateway.window import precheck_inline
from tests.gateway.conftest import GW, KV_TOKENS, auth, gateway_config, running_gateway
from tests.http_helpers import eventually
from tests.lanes.conftest import Lane

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Name three colours."}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2 + 2?"}]},
    {"messages": [{"role": "user", "content": "Say hello in Chinese: 你好，世界! 🌍 <|im_start|> tabs\tand\n\nlines"}],
     "add_generation_prompt": False},
    {"messages": [{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "tool_choice": "none"},
    {"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}], "tools": TOOLS},
    {"messages": [{"role": "user", "content": "Weather in Paris and Rome?"}], "tools": TOOLS, "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"messages": [{"role": "user", "content": "Paris and Rome?"},
                  {"role": "assistant", "content": "Checking both.", "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                      {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "18 C"}, {"role": "tool", "tool_call_id": "c2", "content": "21 C"}],
     "tools": TOOLS},
    {"messages": [{"role": "user", "content": ""}]},  # an empty message: only the template's own tokens
    {"messages": [{"role": "system", "content": "One."}, {"role": "system", "content": "Two."},
                  {"role": "user", "name": "alice", "content": "Hi"}]},
    {"messages": [{"role": "user", "content": "long line " * 1000}]},  # past INLINE_CHARS: counted in a thread
    {"messages": [{"role": "user", "content": "\u200b zero-width, \u00a0 nbsp, e\u0301 combining, \U0001f600\U0001f600"}]},
]
PROMPTS = ["Once upon a time", "", "<|im_start|>user\nspecial text<|im_end|>", "naïve café " * 40]
REFUSED: list[dict[str, Any]] = [  # the lane answers these with a 4xx: the local count must leave them to it
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "tool", "content": "no id"}]},
    {"messages": [{"role": "user", "content": "hi"}], "model": "another-model"},
    {"messages": [{"role": "user", "content": "hi"}], "tools": {"not": "a list"}},
    {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
]


async def _lane_count(http: aiohttp.ClientSession, lane: Lane, payload: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(lane.url + "/tokenize", json=payload) as r:
        return r.status, await r.json()


async def test_local_count_equals_the_lanes(lane: Lane, http: aiohttp.ClientSession) -> None:
    async with http.get(lane.url + "/v1/models") as r:
        card = (await r.json())["data"][0]
    async with http.get(lane.url + "/v1/lane/tokenizer") as r:
        assert r.status == 200
        raw = await r.read()
    assert hashlib.sha256(raw).hexdigest() == card["tokenizer_digest"] == r.headers["X-Strata-Tokenizer-Digest"]
    counter = LocalCounter(card["tokenizer_digest"], json.loads(raw))
    model = card["id"]
    for payload in [*CHATS, *({"prompt": p} for p in PROMPTS)]:
        status, body = await _lane_count(http, lane, payload)
        assert status == 200, body
        assert counter.count(payload, model) == body["count"], payload
        assert counter.count({**payload, "model": model}, model) == body["count"]
    for payload in REFUSED:
        status, _ = await _lane_count(http, lane, payload)
        assert 400 <= status < 500, payload
        assert counter.count(payload, model) is None, payload


async def test_the_gateway_counts_without_tokenize(lane: Lane, http: aiohttp.ClientSession, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    cfg = gateway_config(tmp_path, [{"name": "a", "url": lane.url}], default_max_tokens=8)
    async with running_gateway(cfg) as gw:
        rt = gw.state.dispatcher.lanes["a"]
        await eventually(lambda: rt.counter, lambda c: c is not None, 30.0, "the gateway loaded the lane's tokenizer")
        key = gw.key("user")
        long = [{"role": "user", "content": "go " * 1500}]  # longer than the window: refused by the gateway
        status, lane_says = await _lane_count(http, lane, {"messages": long})
        assert status == 200 and lane_says["count"] > KV_TOKENS
        caplog.set_level(logging.INFO, logger="strata.lanes")
        caplog.clear()
        async with http.post(gw.url + "/v1/chat/completions", json={"messages": long}, headers=auth(key)) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "context_length_exceeded"
            assert err["n_prompt_tokens"] == lane_says["count"] and err["n_ctx"] == KV_TOKENS
        body = {"messages": CHATS[0]["messages"], "max_tokens": 5000, "temperature": 0, "stop": [" ", "."]}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
            assert r.status == 200
            n = (await _lane_count(http, lane, CHATS[0]))[1]["count"]
            assert r.headers["X-Strata-Max-Tokens-Clamped"] == f"5000->{KV_TOKENS - n}"
            assert (await r.json())["usage"]["prompt_tokens"] == n
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "strata.lanes"]
        assert sum("POST /tokenize" in m for m in lines) == 1  # the test's own, none from the gateway
        # the common request is planned without awaiting (no task); a long one is left to the awaited precheck
        plan = precheck_inline(rt, {"messages": CHATS[0]["messages"], "max_tokens": 5000}, "chat", cap=None,
                               min_clamp=16)
        assert plan is not None and plan.prompt_tokens == n and plan.max_tokens == KV_TOKENS - n
        assert precheck_inline(rt, {"messages": CHATS[12]["messages"]}, "chat", cap=None, min_clamp=16) is None
        assert precheck_inline(rt, {"prompt": [[1, 2, 3], "Once upon a time"]}, "completion", cap=None,
                               min_clamp=16).prompt_tokens == 3 + (await _lane_count(http, lane, {"prompt": PROMPTS[0]}))[1]["count"]  # type: ignore[union-attr]
        assert sum("POST /v1/chat/completions" in m for m in lines) == 1
        await _no_local_count(gw, http, key, caplog)


async def _no_local_count(gw: GW, http: aiohttp.ClientSession, key: str, caplog: pytest.LogCaptureFixture) -> None:
    """A body only the lane can judge still goes to /tokenize, and its 400 comes back unchanged."""
    caplog.clear()
    bad = {"messages": [{"role": "wizard", "content": "hi"}]}
    async with http.post(gw.url + "/v1/chat/completions", json=bad, headers=auth(key)) as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_role"
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "strata.lanes"]
    assert sum("POST /tokenize" in m for m in lines) == 1


@pytest.mark.parametrize(("status", "body", "digest_of"), [
    (200, None, b"another document"),  # the lane's real, loadable tokenizer, but not what its card names
    (404, b'{"error": "none"}', b'{"error": "none"}'),  # a lane that serves none
    (200, b"{not json", b"{not json"),  # the digest matches, the document is broken
])
async def test_a_bad_tokenizer_document_leaves_the_count_to_the_lane(
        lane: Lane, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, status: int,
        body: bytes | None, digest_of: bytes) -> None:
    """Whatever the lane's tokenizer endpoint answers that is not its card's tokenizer, the gateway keeps no
    counter (the precheck asks /tokenize) and says why; it tries again later, not on every poll."""
    from aiohttp import web

    from gateway.dispatch import LaneRuntime
    from gateway.tokencount import TokenizerCache

    if body is None:
        async with http.get(lane.url + "/v1/lane/tokenizer") as r:
            body = await r.read()

    async def serve(_: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/lane/tokenizer", serve)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        lane = LaneRuntime(name="x", url=f"http://127.0.0.1:{port}", weight=1.0,
                           tokenizer_digest=hashlib.sha256(digest_of).hexdigest())
        cache = TokenizerCache()
        with caplog.at_level(logging.WARNING, logger="strata.gateway"):
            cache.attach(lane, http)
            task = cache._loading[lane.tokenizer_digest]
            await task
        assert lane.counter is None and lane.tokenizer_digest not in cache.counters
        assert "not loaded (prompts are counted by /tokenize)" in caplog.text
        cache.attach(lane, http)  # within the retry interval: no second fetch
        assert not cache._loading and lane.counter is None
    finally:
        await runner.cleanup()
