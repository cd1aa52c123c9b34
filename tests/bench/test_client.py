"""The harness's HTTP client against a small in-process server that speaks the lane's protocol
(no engine, no stack): kind probing, token counts from /tokenize, streamed timing and usage, an
error event mid-stream, and a failed request returned as a result rather than raised."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.harness.client import Target, TargetError, parse_metrics


def _lane_app() -> web.Application:
    async def lane(_: web.Request) -> web.Response:
        return web.json_response({"lane": "a", "n_ctx": 1024, "pid": 4242})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        text = " ".join(m["content"] for m in body["messages"])
        return web.json_response({"count": len(text.split()) + 5})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        content = body["messages"][-1]["content"]
        if content == "bad":
            return web.json_response({"error": {"message": "nope", "code": "bad_request"}}, status=400)
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "hello there"}, "finish_reason": "stop"}],
                                      "usage": {"prompt_tokens": 7, "completion_tokens": 2}},
                                     headers={"X-Request-Id": "gw-1", "X-Strata-Lane": "a"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": "gw-2"})
        await resp.prepare(request)
        await resp.write(b": ping\n\n")
        for word in ["one", " two", " three"]:
            await asyncio.sleep(0.02)
            chunk = {"choices": [{"delta": {"content": word}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if content == "break":
            await resp.write(b'data: {"error": {"message": "lane died", "code": "upstream_error"}}\n\n')
        else:
            await resp.write(b'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}\n\n')
            await resp.write(b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text='# HELP x\nstrata_kv_usage_ratio 0.25\nstrata_requests{reason="stop"} 3\n')

    app = web.Application()
    app.router.add_get("/v1/lane", lane)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    return app


@pytest.fixture
async def lane_url() -> AsyncIterator[str]:
    server = TestServer(_lane_app())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_probe_tokens_stream_and_errors(lane_url: str) -> None:
    async with Target(lane_url) as t:
        assert t.kind == "lane" and t.n_ctx == 1024 and t.lane_urls == [lane_url]
        assert await t.count_tokens([{"role": "user", "content": "a b c"}]) == 8
        r = await t.chat([{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.ok and r.text == "one two three" and r.finish_reason == "length"
        assert (r.prompt_tokens, r.completion_tokens) == (9, 3) and r.request_id == "gw-2"
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.total_s and len(r.itl_s) == 2
        assert r.decode_tok_s is not None and r.decode_tok_s > 0
        r = await t.chat([{"role": "user", "content": "hi"}], max_tokens=3, stream=False)
        assert r.ok and r.text == "hello there" and r.lane == "a" and r.completion_tokens == 2
        r = await t.chat([{"role": "user", "content": "break"}], max_tokens=3)
        assert not r.ok and "lane died" in (r.error or "") and r.text == "one two three"
        r = await t.chat([{"role": "user", "content": "bad"}], max_tokens=3)
        assert not r.ok and r.status == 400 and "nope" in (r.error or "")
        assert (await t.scrape(lane_url))["strata_kv_usage_ratio"] == 0.25
        with pytest.raises(TargetError, match="admin key"):
            await t.admin("GET", "/v1/admin/requests")


async def test_nothing_listening_is_a_target_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TargetError, match="neither a lane"):
        async with Target(f"http://127.0.0.1:{port}"):
            pass
    r = await _closed_port_chat(port)
    assert not r.ok and r.status == 0 and r.error


async def _closed_port_chat(port: int):  # type: ignore[no-untyped-def]
    t = Target(f"http://127.0.0.1:{port}")
    import aiohttp

    t._session = aiohttp.ClientSession()
    try:
        return await t.chat([{"role": "user", "content": "x"}], max_tokens=1)
    finally:
        await t._session.close()


def test_parse_metrics() -> None:
    m = parse_metrics('a 1\nb{x="y"} 2.5\n# c 3\nbad line\n')
    assert m == {"a": 1.0, 'b{x="y"}': 2.5}
