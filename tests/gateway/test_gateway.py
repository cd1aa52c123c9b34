"""The gateway end to end: the official openai client through the gateway to two real lanes."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web_protocol
from aiohttp.http_writer import StreamWriter

from gateway.keys import KeySpec
from tests.gateway.conftest import (
    ADMIN_KEY,
    GW,
    KV_TOKENS,
    Lane,
    auth,
    gateway_config,
    lane_entries,
    running_gateway,
)
from tests.http_helpers import eventually, scrape, sse
from tests.lanes.conftest import engine_steps, idle_within_steps

pytestmark = pytest.mark.asyncio(loop_scope="module")

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(lanes: dict[str, Lane], tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GW]:
    cfg = gateway_config(tmp_path_factory.mktemp("gw"), lane_entries(lanes),
                         ping_interval_s=0.05, default_max_tokens=48)
    async with running_gateway(cfg) as g:
        assert [lane.name for lane in g.state.dispatcher.routable()] == ["a", "b"]
        yield g


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def key(gw: GW) -> str:
    return gw.key("user")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(gw: GW, key: str) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    yield c
    await c.close()


async def _requests(http: aiohttp.ClientSession, gw: GW, **query: str) -> list[dict]:
    async with http.get(gw.url + "/v1/admin/requests", params=query, headers=auth(ADMIN_KEY)) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["data"]


async def _prompt_leaving(http: aiohttp.ClientSession, lane: Lane, room: int) -> list[dict]:
    """Chat messages whose templated prompt leaves exactly ``room`` tokens of the window."""
    async def count(msgs: list[dict]) -> int:
        async with http.post(lane.url + "/tokenize", json={"messages": msgs}) as r:
            return (await r.json())["count"]
    base = await count([{"role": "user", "content": ""}])
    n = (KV_TOKENS - room - base)
    while True:
        msgs = [{"role": "user", "content": "go " * n}]
        c = await count(msgs)
        if c == KV_TOKENS - room:
            return msgs
        n += (KV_TOKENS - room) - c


async def _lane_totals(http: aiohttp.ClientSession, lanes: dict[str, Lane]) -> float:
    total = 0.0
    for lane in lanes.values():
        m = await scrape(http, lane.url)
        total += m["strata_prompt_tokens_total"] + sum(v for k, v in m.items() if k.startswith("strata_requests_total"))
    return total


# ---------------------------------------------------------------------------------------- the API


async def test_models_and_probes(client: openai.AsyncOpenAI, gw: GW, http: aiohttp.ClientSession, key: str) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["strata-default"]
    async with http.get(gw.url + "/v1/models", headers=auth(key)) as r:
        assert (await r.json())["data"][0]["max_model_len"] == KV_TOKENS  # the lanes' window, read from them
    async with http.get(gw.url + "/healthz") as r:
        assert r.status == 200
    async with http.get(gw.url + "/readyz") as r:
        assert r.status == 200 and (await r.json())["lanes"] == ["a", "b"]


async def test_chat_non_stream_and_stream(client: openai.AsyncOpenAI, gw: GW, http: aiohttp.ClientSession) -> None:
    resp = await client.chat.completions.create(model="strata-default", messages=QUESTION, max_tokens=24,
                                                temperature=0)
    text = resp.choices[0].message.content or ""
    assert "Paris" in text
    assert resp.usage is not None and resp.usage.prompt_tokens > 10 and resp.usage.completion_tokens > 0

    stream = await client.chat.completions.create(model="strata-default", messages=QUESTION, max_tokens=24,
                                                  temperature=0, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)  # the usage chunk stripped

    stream = await client.chat.completions.create(model="strata-default", messages=QUESTION, max_tokens=24,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens

    rows = await _requests(http, gw, limit="3")
    assert [r["stream"] for r in rows] == [True, True, False]
    assert all(r["status"] == 200 and r["prompt_tokens"] == resp.usage.prompt_tokens for r in rows)
    assert rows[0]["ttft_ms"] > 0 and rows[2]["ttft_ms"] is None
    assert rows[0]["completion_tokens"] == chunks[-1].usage.completion_tokens
    assert rows[1]["completion_tokens"] == resp.usage.completion_tokens  # greedy: the same answer


async def test_stream_chunks_relayed_as_the_lane_wrote_them_less_the_usage(gw: GW, http: aiohttp.ClientSession,
                                                                          lanes: dict[str, Lane]) -> None:
    """Without stream_options the client's chunks are the lane's own bytes with the null usage member (which the
    gateway asked the lane for) cut off: compact JSON, no "usage" key, every other member in the lane's order."""
    body = {"model": "strata-default", "messages": QUESTION, "max_tokens": 6, "temperature": 0, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(ADMIN_KEY)) as r:
        relayed = [ln.removeprefix("data: ") for ln in await sse(r) if ln.startswith("data: {")]
    wanted = {**body, "stream_options": {"include_usage": True}}
    async with http.post(lanes["a"].url + "/v1/chat/completions", json=wanted) as r:
        direct = [ln.removeprefix("data: ") for ln in await sse(r) if ln.startswith("data: {")]
    assert relayed and all('"usage"' not in ln for ln in relayed)
    assert all(ln == json.dumps(json.loads(ln), ensure_ascii=False, separators=(",", ":")) for ln in relayed)
    lane_chunks = [json.loads(ln) for ln in direct if json.loads(ln)["choices"]]  # the usage chunk is not relayed
    assert all(c.pop("usage", 0) is None for c in lane_chunks)
    for mine, theirs in zip([json.loads(ln) for ln in relayed], lane_chunks, strict=True):
        for d in (mine, theirs):
            d.pop("id"), d.pop("created")
        assert list(mine) == list(theirs) and mine == theirs


async def test_streams_keep_their_connections(gw: GW, http: aiohttp.ClientSession, key: str,
                                             lanes: dict[str, Lane], monkeypatch: pytest.MonkeyPatch) -> None:
    """Finished streams hand their upstream connections back to the gateway's pool: six streams in a row open
    at most one new connection per lane (a connection closed at each [DONE] would cost every request a new one,
    and the lane a closed one). The gateway ends its own streams as the lanes do, ``[DONE]`` and the chunked
    terminator in one write (recorded at aiohttp's writer), so its clients can keep theirs too."""
    writes: list[bytes] = []
    lines = StreamWriter._writelines
    monkeypatch.setattr(StreamWriter, "_writelines",
                        lambda self, cs: (writes.append(b"".join(bytes(c) for c in cs)), lines(self, cs))[1])
    ports = {int(lane.url.rsplit(":", 1)[1]) for lane in lanes.values()}
    opened: list[int] = []
    made = web_protocol.RequestHandler.connection_made

    def counting(self: web_protocol.RequestHandler, transport: asyncio.BaseTransport) -> None:
        if transport.get_extra_info("sockname")[1] in ports:
            opened.append(transport.get_extra_info("sockname")[1])
        made(self, transport)

    monkeypatch.setattr(web_protocol.RequestHandler, "connection_made", counting)
    body = {"model": "strata-default", "messages": QUESTION, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    for _ in range(6):
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
            assert r.status == 200 and (await sse(r))[-1] == "data: [DONE]"
    assert len(opened) <= len(ports), opened
    ends = [w for w in writes if b"data: [DONE]" in w]
    assert len(ends) == 12 and all(w.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") for w in ends)  # 6 lane, 6 gateway


async def test_stream_row_journaled_while_the_lane_prefills(gw: GW, http: aiohttp.ClientSession, key: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A stream's in-progress row goes to the journal when the lane's 200 arrives, before its first chunk is
    read (the journal's write is off the path to the first token), so it is on disk before the client's 200."""
    caplog.set_level(logging.INFO, logger="strata.gateway")
    cfg, store = gw.state.config, gw.state.store
    assert store is not None and store.journal is not None
    cfg.trace_stages = True
    try:
        body = {"model": "strata-default", "messages": QUESTION, "max_tokens": 2, "temperature": 0, "stream": True}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
            assert r.status == 200
            assert store.journal.in_progress >= 1  # its row, in progress, before the client read a byte of it
            rid = r.headers["X-Request-Id"]
            assert (await sse(r))[-1] == "data: [DONE]"
    finally:
        cfg.trace_stages = False
    line = await eventually(lambda: next((rec.getMessage() for rec in caplog.records
                                          if f"id={rid} " in rec.getMessage()), ""), bool, 5, "the access-log line")
    stages = [part.split(":")[0] for part in line.split(" stages=")[1].split()[0].split(",")]
    assert stages.index("headers") < stages.index("logged") < stages.index("chunk") < stages.index("first_token")
    assert stages.index("logged") < stages.index("prepared")


async def test_completions_stream_and_non_stream(client: openai.AsyncOpenAI) -> None:
    resp = await client.completions.create(model="strata-default", prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
    assert resp.choices[0].text and resp.usage is not None and resp.usage.completion_tokens == 8
    stream = await client.completions.create(model="strata-default", prompt="The capital of France is",
                                             max_tokens=8, temperature=0, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == resp.choices[0].text


async def test_pings_while_waiting_for_the_first_token(gw: GW, http: aiohttp.ClientSession, key: str,
                                                       lanes: dict[str, Lane]) -> None:
    msgs = await _prompt_leaving(http, lanes["a"], 20)  # a long prefill on one thread
    body = {"messages": msgs, "max_tokens": 2, "stream": True, "session_id": "long-prompt"}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
        assert r.status == 200
        assert r.headers["X-Accel-Buffering"] == "no" and r.headers["Cache-Control"] == "no-cache"
        lines = await sse(r)
    first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data: "))
    assert ": ping" in lines[:first_data]
    assert lines[-1] == "data: [DONE]"


# ---------------------------------------------------------------------------------------- auth


async def test_auth_errors(gw: GW, http: aiohttp.ClientSession, key: str) -> None:
    bad = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-strata-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        await bad.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    await bad.close()
    async with http.post(gw.url + "/v1/chat/completions", json={"messages": QUESTION}) as r:
        body = await r.json()
        assert r.status == 401 and body["error"]["code"] == "invalid_api_key" and body["error"]["type"]
    async with http.get(gw.url + "/v1/admin/lanes", headers=auth(key)) as r:
        assert r.status == 403 and (await r.json())["error"]["code"] == "insufficient_permissions"
    async with http.get(gw.url + "/v1/admin/lanes", headers={"Authorization": "Basic xyz"}) as r:
        assert r.status == 401


async def test_admin_keys_api_and_revocation(gw: GW, http: aiohttp.ClientSession) -> None:
    async with http.post(gw.url + "/v1/admin/keys", json={"name": "temp", "rpm": 100}, headers=auth(ADMIN_KEY)) as r:
        assert r.status == 201
        created = await r.json()
    new_key, key_id = created["key"], created["id"]
    assert new_key.startswith("sk-strata-") and created["prefix"] == new_key[10:18] and "hash" not in created
    async with http.get(gw.url + "/v1/models", headers=auth(new_key)) as r:
        assert r.status == 200  # now cached as valid
    async with http.get(gw.url + "/v1/admin/keys", headers=auth(ADMIN_KEY)) as r:
        listed = (await r.json())["data"]
    assert any(k["id"] == key_id and k["rpm"] == 100 for k in listed)
    assert new_key not in json.dumps(listed)
    async with http.delete(gw.url + f"/v1/admin/keys/{key_id}", headers=auth(ADMIN_KEY)) as r:
        assert r.status == 200 and (await r.json())["revoked"] is not None
    async with http.get(gw.url + "/v1/models", headers=auth(new_key)) as r:
        assert r.status == 401  # revoked at once, despite the cache
    async with http.delete(gw.url + "/v1/admin/keys/99999", headers=auth(ADMIN_KEY)) as r:
        assert r.status == 404
    async with http.post(gw.url + "/v1/admin/keys", json={"name": "x", "rpm": "lots"}, headers=auth(ADMIN_KEY)) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "rpm"


# ---------------------------------------------------------------------------------------- window


async def test_window_clamp(client: openai.AsyncOpenAI, gw: GW, http: aiohttp.ClientSession,
                            lanes: dict[str, Lane]) -> None:
    msgs = await _prompt_leaving(http, lanes["a"], 40)
    before = (await scrape(http, gw.url, ADMIN_KEY))['strata_gateway_max_tokens_clamped_total{reason="window"}']
    raw = await client.chat.completions.with_raw_response.create(
        model="strata-default", messages=msgs, max_tokens=200,
        extra_body={"ignore_eos": True, "session_id": "long-prompt"})  # same lane: its prefix cache is warm
    assert raw.headers["X-Strata-Max-Tokens-Clamped"] == "200->40"
    resp = raw.parse()
    assert resp.usage is not None and resp.usage.completion_tokens == 40  # the lane got the clamped value
    assert resp.choices[0].finish_reason == "length"
    after = (await scrape(http, gw.url, ADMIN_KEY))['strata_gateway_max_tokens_clamped_total{reason="window"}']
    assert after == before + 1
    row = (await _requests(http, gw, limit="1"))[0]
    assert (row["clamped_from"], row["clamped_to"], row["prompt_tokens"]) == (200, 40, KV_TOKENS - 40)


async def test_window_too_small_never_reaches_a_lane(client: openai.AsyncOpenAI, http: aiohttp.ClientSession,
                                                     lanes: dict[str, Lane]) -> None:
    before = await _lane_totals(http, lanes)
    msgs = await _prompt_leaving(http, lanes["a"], 10)  # fewer than min_clamp_tokens=16 would remain
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="strata-default", messages=msgs, max_tokens=100)
    err = e.value.body
    assert isinstance(err, dict) and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert err["n_prompt_tokens"] == KV_TOKENS - 10 and err["n_ctx"] == KV_TOKENS
    with pytest.raises(openai.BadRequestError) as e:  # larger than the whole window
        await client.chat.completions.create(model="strata-default", stream=True,
                                             messages=[{"role": "user", "content": "go " * 1500}])
    err = e.value.body
    assert isinstance(err, dict) and err["code"] == "context_length_exceeded" and err["n_prompt_tokens"] > KV_TOKENS
    assert await _lane_totals(http, lanes) == before  # no lane generated anything


async def test_key_cap_clamps_max_tokens(gw: GW, http: aiohttp.ClientSession) -> None:
    capped = gw.key("capped", max_tokens=8)
    body = {"prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": True}
    async with http.post(gw.url + "/v1/completions", json=body, headers=auth(capped)) as r:
        assert r.status == 200 and r.headers["X-Strata-Max-Tokens-Clamped"] == "50->8"
        assert (await r.json())["usage"]["completion_tokens"] == 8


async def test_default_max_tokens(gw: GW, http: aiohttp.ClientSession, key: str, lanes: dict[str, Lane]) -> None:
    body = {"prompt": "Once upon a time", "ignore_eos": True}  # names no max_tokens: the gateway's default (48)
    async with http.post(gw.url + "/v1/completions", json=body, headers=auth(key)) as r:
        assert r.status == 200 and "X-Strata-Max-Tokens-Clamped" not in r.headers
        data = await r.json()
        assert data["usage"]["completion_tokens"] == 48 and data["choices"][0]["finish_reason"] == "length"
    async with http.post(gw.url + "/v1/admin/keys", json={"name": "short", "default_max_tokens": 5},
                         headers=auth(ADMIN_KEY)) as r:
        assert r.status == 201
        created = await r.json()
    assert created["default_max_tokens"] == 5
    chat = {"messages": [{"role": "user", "content": "Tell me a story."}], "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(gw.url + "/v1/chat/completions", json=chat, headers=auth(created["key"])) as r:
        lines = await sse(r)
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 5  # the key's own default wins
    async with http.post(gw.url + "/v1/chat/completions", json={**chat, "max_tokens": 7, "stream": False},
                         headers=auth(created["key"])) as r:
        assert (await r.json())["usage"]["completion_tokens"] == 7  # a value the client names is kept
    # the window stays the hard limit: 40 tokens left of it, the default (48) becomes 40 (no 400, no clamp);
    # the prompt of test_window_clamp, on the same lane: its prefix cache is warm
    msgs = await _prompt_leaving(http, lanes["a"], 40)
    long = {"messages": msgs, "ignore_eos": True, "session_id": "long-prompt"}
    async with http.post(gw.url + "/v1/chat/completions", json=long, headers=auth(key)) as r:
        assert r.status == 200 and "X-Strata-Max-Tokens-Clamped" not in r.headers
        assert (await r.json())["usage"]["completion_tokens"] == 40


async def test_tpm_reserves_max_tokens(gw: GW, http: aiohttp.ClientSession, lanes: dict[str, Lane]) -> None:
    async with http.post(lanes["a"].url + "/tokenize", json={"messages": QUESTION}) as r:
        p = (await r.json())["count"]
    m = 200
    key = gw.key("tpm-parallel", tpm=3 * (p + m) + 10)
    body = {"messages": QUESTION, "max_tokens": m, "temperature": 0}

    async def one() -> tuple[int, dict]:
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
            return r.status, await r.json()
    results = await asyncio.gather(*(one() for _ in range(8)))
    statuses = sorted(s for s, _ in results)
    assert statuses == [200] * 3 + [429] * 5, statuses  # only what fits: 3 x (prompt + max_tokens)
    assert all(b["error"]["limit"] == "tpm" for s, b in results if s == 429)
    used = [b["usage"] for s, b in results if s == 200]
    assert all(u["prompt_tokens"] == p and u["completion_tokens"] < m // 2 for u in used), used
    # the unused part came back when they ended: one more fits at once (3 x max_tokens were held before)
    status, data = await one()
    assert status == 200, data


# ---------------------------------------------------------------------------------------- errors and limits


async def test_bad_requests_are_openai_shaped(client: openai.AsyncOpenAI, gw: GW, http: aiohttp.ClientSession,
                                              key: str) -> None:
    with pytest.raises(openai.APIStatusError) as e:  # 5 MB
        await client.chat.completions.create(model="strata-default",
                                             messages=[{"role": "user", "content": "a" * 5_000_000}])
    assert e.value.status_code == 413 and isinstance(e.value.body, dict)
    assert e.value.body["code"] == "request_too_large"
    cases = [(b'{"messages": [', 400, "invalid_json", None), (b"[1, 2]", 400, "invalid_json", None),
             (b'{"model": "strata-default"}', 400, None, "messages"),
             (b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}', 404, "model_not_found", "model"),
             (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400, None, "temperature")]
    for raw, status, code, param in cases:
        async with http.post(gw.url + "/v1/chat/completions", data=raw, headers=auth(key)) as r:
            body = await r.json()
        assert r.status == status, (raw, body)
        assert set(body["error"]) >= {"message", "type", "param", "code"}
        assert body["error"]["code"] == code and body["error"]["param"] == param, (raw, body)
    rows = await _requests(http, gw, status="4xx", limit="1")
    assert rows[0]["error_type"] == "invalid_request_error" and rows[0]["retried"] is False  # the lane's 4xx, as is


async def test_rpm_limit(gw: GW, http: aiohttp.ClientSession) -> None:
    limited = gw.key("rpm2", rpm=2)
    for _ in range(2):  # counted even though they fail
        async with http.post(gw.url + "/v1/completions", data=b"{", headers=auth(limited)) as r:
            assert r.status == 400
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x"}, headers=auth(limited)) as r:
        body = await r.json()
        assert r.status == 429 and body["error"]["code"] == "rate_limit_exceeded" and body["error"]["limit"] == "rpm"
        assert 55 <= int(r.headers["Retry-After"]) <= 60


async def test_concurrency_and_tpm_limits(gw: GW, http: aiohttp.ClientSession) -> None:
    one = gw.key("conc1", max_concurrent=1)
    body = {"prompt": "Count to a hundred:", "max_tokens": 300, "ignore_eos": True, "stream": True}
    async with http.post(gw.url + "/v1/completions", json=body, headers=auth(one)) as first:
        assert first.status == 200
        await first.content.readline()
        async with http.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             headers=auth(one)) as r:
            body2 = await r.json()
            assert r.status == 429 and body2["error"]["limit"] == "concurrency" and r.headers["Retry-After"] == "1"
        first.close()
    small = gw.key("tpm", tpm=40)
    ok = {"prompt": "The capital of France is", "max_tokens": 40, "ignore_eos": True}
    async with http.post(gw.url + "/v1/completions", json=ok, headers=auth(small)) as r:
        assert r.status == 200
    async with http.post(gw.url + "/v1/completions", json=ok, headers=auth(small)) as r:
        body3 = await r.json()
        assert r.status == 429 and body3["error"]["limit"] == "tpm" and int(r.headers["Retry-After"]) >= 1


# ---------------------------------------------------------------------------------------- dispatch


async def test_session_affinity_and_spread(gw: GW, http: aiohttp.ClientSession, key: str) -> None:
    async def lane_of(**extra: str) -> str:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
            assert r.status == 200, await r.text()
            return r.headers["X-Strata-Lane"]
    assert len({await lane_of(session_id="conversation-7") for _ in range(4)}) == 1
    assert len({await lane_of(user="alice") for _ in range(3)}) == 1
    assert {await lane_of(session_id=f"s{i}") for i in range(12)} == {"a", "b"}


async def test_drain_and_weight(gw: GW, http: aiohttp.ClientSession, key: str) -> None:
    async def put(name: str, body: dict) -> tuple[int, dict]:
        async with http.put(gw.url + f"/v1/admin/lanes/{name}", json=body, headers=auth(ADMIN_KEY)) as r:
            return r.status, await r.json()

    async def lanes_used(n: int) -> set[str]:
        used = set()
        for i in range(n):
            body = {"prompt": "hi", "max_tokens": 1, "session_id": f"d{i}"}
            async with http.post(gw.url + "/v1/completions", json=body, headers=auth(key)) as r:
                assert r.status == 200
                used.add(r.headers["X-Strata-Lane"])
        return used

    status, lane = await put("a", {"drain": True})
    assert status == 200 and lane["draining"] is True and lane["n_ctx"] == KV_TOKENS
    assert await lanes_used(6) == {"b"}
    await put("a", {"drain": False})
    await put("b", {"weight": 0})
    assert await lanes_used(6) == {"a"}
    await put("b", {"weight": 1.0})
    async with http.get(gw.url + "/v1/admin/lanes", headers=auth(ADMIN_KEY)) as r:
        listed = {x["name"]: x for x in (await r.json())["data"]}
    assert listed["a"]["ready"] and not listed["a"]["draining"] and listed["b"]["weight"] == 1.0
    assert set(listed["a"]) >= {"name", "url", "ready", "ejected_until", "weight", "draining", "in_flight",
                                "engine_build", "n_ctx"}
    assert (await put("zz", {"weight": 1}))[0] == 404
    assert (await put("a", {"weight": -1}))[0] == 400
    assert (await put("a", {"drain": "yes"}))[0] == 400


async def test_client_disconnect_frees_the_lane(gw: GW, http: aiohttp.ClientSession,
                                                lanes: dict[str, Lane]) -> None:
    assert gw.state.keys is not None
    key, rec = gw.state.keys.create(KeySpec(name="leaver", tpm=10**6))
    body = {"prompt": "A long story:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    r = await http.post(gw.url + "/v1/completions", json=body, headers=auth(key))
    lane = lanes[r.headers["X-Strata-Lane"]]
    seen = 0
    async for raw in r.content:
        seen += raw.startswith(b"data: ")
        if seen == 3:
            break
    assert lane.state.aeng.scheduler.num_running == 1
    steps = engine_steps(lane)
    r.close()
    # without the abort it would run for ~900 more steps: counted in steps, a busy box cannot fail it
    await idle_within_steps(lane, steps, 200, "the lane freed after the client left")
    rows = await eventually(lambda: _requests(http, gw, limit="1"), lambda rows: bool(rows) and rows[0]["status"] == 499,
                            5.0, "the request-log row of the client that left")
    assert rows[0]["stream"] is True
    # its tpm reservation (prompt + 900) shrank to the prompt and the chunks that reached the client
    held = gw.state.limiter._keys[rec.id].token_sum
    assert rows[0]["prompt_tokens"] + 3 <= held <= rows[0]["prompt_tokens"] + 60, held


# ---------------------------------------------------------------------------------------- request log


async def test_request_log_privacy(gw: GW, http: aiohttp.ClientSession, key: str) -> None:
    secret_prompt = "zebra-secret-prompt"
    async with http.post(gw.url + "/v1/completions", json={"prompt": secret_prompt, "max_tokens": 3},
                         headers=auth(key)) as r:
        assert r.status == 200
    logged = gw.key("logged", log_prompts=True)
    async with http.post(gw.url + "/v1/chat/completions", headers=auth(logged), json={
            "messages": [{"role": "user", "content": "okapi-visible"}], "max_tokens": 4, "stream": True}) as r:
        assert r.status == 200
        await r.read()
    rows = await _requests(http, gw, limit="2")
    assert rows[0]["prompt_text"] and "okapi-visible" in rows[0]["prompt_text"] and rows[0]["response_text"]
    assert rows[1]["prompt_text"] is None and rows[1]["response_text"] is None
    by_key = await _requests(http, gw, key_id=str(rows[1]["key_id"]), lane=rows[1]["lane"], limit="1000")
    assert by_key and all(r["key_id"] == rows[1]["key_id"] and r["lane"] == rows[1]["lane"] for r in by_key)
    async with http.get(gw.url + "/v1/admin/requests", params={"limit": "5000"}, headers=auth(ADMIN_KEY)) as r:
        assert r.status == 400
    async with http.get(gw.url + "/v1/admin/requests", params={"since": "2999-01-01T00:00:00Z"},
                        headers=auth(ADMIN_KEY)) as r:
        assert r.status == 200 and (await r.json())["data"] == []
    db = Path(gw.state.config.db_url.removeprefix("sqlite:///"))
    blob = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))
    assert secret_prompt.encode() not in blob
    for k in (key, logged, ADMIN_KEY):
        assert k.encode() not in blob


async def test_metrics(gw: GW, http: aiohttp.ClientSession) -> None:
    m = await scrape(http, gw.url, ADMIN_KEY)
    assert m['strata_gateway_lane_ready{lane="a"}'] == 1 and m['strata_gateway_lane_ready{lane="b"}'] == 1
    assert any(k.startswith("strata_gateway_requests_total{") and 'status="200"' in k for k in m)
    assert m["strata_gateway_context_length_exceeded_total"] >= 2
    assert m['strata_gateway_rate_limited_total{limit="rpm"}'] >= 1
    assert any(k.startswith("strata_gateway_time_to_first_token_seconds_count") for k in m)
