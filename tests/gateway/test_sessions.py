"""Session memory through the real gateway app and real lanes (the default model, a 1024-token window):
the sessions API per key, turns stored with each reply, composition before the window precheck,
the counts in ``X-Strata-Memory`` and the request log, interrupted replies, summarisation (charged to the
session's key's limits), concurrency and prefix-cache reuse."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from multidict import CIMultiDict

from gateway.keys import KeySpec
from gateway.sessions import MEMORY
from memory.compose import RETRIEVED_BEGIN, SUMMARY_BEGIN
from memory.service import MemoryService
from memory.store import Session
from tests.gateway.conftest import (
    ADMIN_KEY,
    GW,
    auth,
    gateway_config,
    lane_entries,
    running_gateway,
)
from tests.lanes.conftest import Lane

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(lanes: dict[str, Lane], tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GW]:
    tmp = tmp_path_factory.mktemp("memgw")
    cfg = gateway_config(tmp, lane_entries(lanes),
                         default_max_tokens=16,
                         memory={"summarize_after_tokens": 100_000, "summary_input_tokens": 300,
                                 "summary_max_tokens": 64, "summary_keep_turns": 4, "retrieve_min_score": 0.2})
    async with running_gateway(cfg) as g:
        emb = g.app[MEMORY].embedder
        if emb is not None:  # until the model is loaded requests compose without retrieval; these tests retrieve
            await emb.warm()  # type: ignore[attr-defined]
        yield g


def svc_of(gw: GW) -> MemoryService:
    return gw.app[MEMORY]


async def new_session(s: aiohttp.ClientSession, gw: GW, key: str, **body: Any) -> dict[str, Any]:
    async with s.post(gw.url + "/v1/sessions", json=body, headers=auth(key)) as r:
        assert r.status == 201, await r.text()
        return await r.json()


async def chat(s: aiohttp.ClientSession, gw: GW, key: str, sid: str, text: str, *, header: bool = False,
               **extra: Any) -> tuple[int, CIMultiDict[str], dict[str, Any]]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
                            **extra}
    headers = auth(key)
    if header:
        headers["X-Session-Id"] = sid
    else:
        body["session_id"] = sid
    async with s.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, CIMultiDict(r.headers), await r.json()


async def request_log(s: aiohttp.ClientSession, gw: GW, request_id: str) -> dict[str, Any]:
    async with s.get(gw.url + "/v1/admin/requests?limit=1000", headers=auth(ADMIN_KEY)) as r:
        rows = (await r.json())["data"]
    return next(row for row in rows if row["id"] == request_id)


async def test_sessions_api_and_isolation(gw: GW) -> None:
    a, b = gw.key("a"), gw.key("b")
    async with aiohttp.ClientSession() as s:
        sess = await new_session(s, gw, a, title="plans", system="Be brief.")
        sid = sess["id"]
        assert sid.startswith("sess_") and sess["title"] == "plans" and sess["turns"] == 0
        status, headers, body = await chat(s, gw, a, sid, "Hello, my name is Ada.")
        assert status == 200, body
        assert headers["X-Strata-Memory"].startswith("turns=0;")
        status, headers, body = await chat(s, gw, a, sid, "What is my name?", header=True)  # the header works too
        assert status == 200 and headers["X-Strata-Memory"].startswith("turns=2;")
        async with s.get(gw.url + f"/v1/sessions/{sid}", headers=auth(a)) as r:
            got = await r.json()
        assert [(t["seq"], t["role"], t["complete"]) for t in got["turns"]] == [
            (1, "user", True), (2, "assistant", True), (3, "user", True), (4, "assistant", True)]
        assert got["turns"][0]["content"] == "Hello, my name is Ada." and got["summary"] is None
        async with s.get(gw.url + f"/v1/sessions/{sid}/export", headers=auth(a)) as r:
            exp = await r.json()
        assert r.status == 200 and exp["session"]["id"] == sid and len(exp["turns"]) == 4
        async with s.get(gw.url + "/v1/sessions", headers=auth(a)) as r:
            assert sid in [x["id"] for x in (await r.json())["data"]]
        # key B: cannot list, read, export, chat in or delete A's session; all 404 (existence not revealed)
        async with s.get(gw.url + "/v1/sessions", headers=auth(b)) as r:
            assert sid not in [x["id"] for x in (await r.json())["data"]]
        for method, path in (("GET", f"/v1/sessions/{sid}"), ("GET", f"/v1/sessions/{sid}/export"),
                             ("DELETE", f"/v1/sessions/{sid}")):
            async with s.request(method, gw.url + path, headers=auth(b)) as r:
                err = (await r.json())["error"]
                assert r.status == 404 and err["code"] == "session_not_found", (method, path)
        status, _, body = await chat(s, gw, b, sid, "What is A's name?")
        assert status == 404 and body["error"]["code"] == "session_not_found"
        async with s.get(gw.url + "/v1/sessions/sess_" + "0" * 32, headers=auth(a)) as r:
            assert r.status == 404
        # bad input: typed 400s
        async with s.post(gw.url + "/v1/sessions", json={"title": 5}, headers=auth(a)) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "title"
        async with s.post(gw.url + "/v1/sessions", json={"nope": 1}, headers=auth(a)) as r:
            assert r.status == 400
        async with s.post(gw.url + "/v1/completions", json={"prompt": "hi", "session_id": sid},
                          headers=auth(a)) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "session_id"
        async with s.post(gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                 "session_id": 7}, headers=auth(a)) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "session_id"
        # a plain (non-sess_) session_id keeps its old meaning: affinity only, nothing stored
        status, headers, _ = await chat(s, gw, a, "conversation-7", "hi")
        assert status == 200 and "X-Strata-Memory" not in headers
        # deletion leaves no turns, summaries or vectors
        svc = svc_of(gw)
        sess_a = await svc.session(_key_id(gw, a), sid)
        assert sess_a is not None
        pk = sess_a.pk
        await svc.embed_missing(pk)
        await asyncio.to_thread(svc.store.put_summary, pk, 1, 2, "Ada said hello.", 4, 0)
        before = await asyncio.to_thread(svc.store.counts, pk)
        assert before["memory_turns"] == 4 and before["memory_summaries"] == 1 and before["memory_vectors"] == 4
        async with s.delete(gw.url + f"/v1/sessions/{sid}", headers=auth(a)) as r:
            assert r.status == 200 and (await r.json())["deleted"] is True
        assert await asyncio.to_thread(svc.store.counts, pk) == {"memory_turns": 0, "memory_summaries": 0,
                                                                 "memory_vectors": 0}
        async with s.get(gw.url + f"/v1/sessions/{sid}", headers=auth(a)) as r:
            assert r.status == 404


def _key_id(gw: GW, key: str) -> int:
    assert gw.state.keys is not None
    rec = next(k for k in gw.state.keys.list() if key[len("sk-strata-"):].startswith(k.prefix) and not k.revoked)
    return rec.id


async def stored_session(s: aiohttp.ClientSession, gw: GW, key: str) -> tuple[str, Session]:
    """A new session of ``key``'s, made through the API, and the memory store's record of it."""
    sid = (await new_session(s, gw, key))["id"]
    sess = await svc_of(gw).session(_key_id(gw, key), sid)
    assert sess is not None
    return sid, sess


async def test_history_beyond_the_window_is_composed_to_fit(gw: GW) -> None:
    """Far more history than the 1024-token window: the lane never sees an overflow, the planted fact is
    retrieved into the composed prompt, the counts are in the header and the request log."""
    key = gw.key("long", log_prompts=True)
    svc = svc_of(gw)
    async with aiohttp.ClientSession() as s:
        sid, sess = await stored_session(s, gw, key)
        items = [("user", "Please remember this: my locker code is 4417.", 12, True),
                 ("assistant", "Noted, your locker code is 4417.", 10, True)]
        for i in range(60):
            items += [("user", f"Filler {i}: tell me something about the weather in town number {i}.", 20, True),
                      ("assistant", f"The weather in town {i} is mild with a light breeze and some clouds.", 20,
                       True)]
        await asyncio.to_thread(svc.store.append, sess.pk, items)
        status, headers, body = await chat(s, gw, key, sid, "What is my locker code?", max_tokens=12)
        assert status == 200, body
        counts = dict(x.split("=") for x in headers["X-Strata-Memory"].split("; "))
        assert int(counts["turns"]) == 122 and int(counts["retrieved"]) >= 1 and int(counts["dropped"]) > 0
        assert body["usage"]["prompt_tokens"] + 12 <= 1024
        row = await request_log(s, gw, headers["X-Request-Id"])
        assert row["memory"] == headers["X-Strata-Memory"]
        sent = json.loads(row["prompt_text"])
        assert "4417" in json.dumps(sent), "the planted fact did not reach the lane"
        assert sent[-1] == {"role": "user", "content": "What is my locker code?"}
        # deterministic: the same state composes the same prompt
        loaded = await svc.load(sess, "What is my locker code?")
        one = loaded.compose(svc.cfg, None, [{"role": "user", "content": "q"}], 700)
        two = loaded.compose(svc.cfg, None, [{"role": "user", "content": "q"}], 700)
        assert one == two


async def test_correction_wins(gw: GW) -> None:
    key = gw.key("fix", log_prompts=True)
    svc = svc_of(gw)
    async with aiohttp.ClientSession() as s:
        sid, sess = await stored_session(s, gw, key)
        items = [("user", "My flight to Oslo leaves from gate B12.", 10, True), ("assistant", "Gate B12, noted.", 5,
                                                                                   True)]
        items += [("user", f"Unrelated question {i} about cooking pasta number {i}.", 15, True)
                  for i in range(40)]
        items += [("user", "Correction: my flight to Oslo now leaves from gate C7, not B12.", 16, True),
                  ("assistant", "Updated: gate C7.", 5, True)]
        items += [("user", f"Another unrelated note {i} about gardening tools.", 12, True) for i in range(40)]
        await asyncio.to_thread(svc.store.append, sess.pk, items)
        status, headers, body = await chat(s, gw, key, sid, "Which gate does my flight to Oslo leave from?")
        assert status == 200, body
        row = await request_log(s, gw, headers["X-Request-Id"])
        text = row["prompt_text"]
        assert "C7" in text, "the correction was not composed in"
        if "gate B12." in text:  # the old value only as older, retrieved context, which the prompt ranks lower
            block = text[text.index(RETRIEVED_BEGIN):]
            assert "gate B12." in block and "gate B12." not in text[:text.index(RETRIEVED_BEGIN)]
            if "gate C7" in block:  # both retrieved: in turn order, and the later turn is the correct one
                assert block.index("gate C7") > block.index("gate B12.")
                assert "the later turn is the correct one" in text
            else:  # the correction is verbatim, above the block, and the block defers to it
                assert "the conversation above is correct" in text


async def test_interrupted_stream_is_stored_incomplete(gw: GW) -> None:
    key = gw.key("cut")
    svc = svc_of(gw)
    async with aiohttp.ClientSession() as s:
        sid = (await new_session(s, gw, key))["id"]
        body = {"messages": [{"role": "user", "content": "Count slowly from one to one thousand."}],
                "session_id": sid, "stream": True, "max_tokens": 400, "ignore_eos": True}
        got = ""
        async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: {"):
                    ch = json.loads(line[6:])["choices"]
                    if ch:
                        got += ch[0]["delta"].get("content") or ""
                if len(got) > 20:
                    break  # leave mid-stream
        sess = await svc.session(_key_id(gw, key), sid)
        assert sess is not None
        deadline = time.monotonic() + 60  # generous for a busy box: complete=False below tells a cut reply apart
        while not (turns := await asyncio.to_thread(svc.store.turns, sess.pk)):
            assert time.monotonic() < deadline, "the interrupted reply was not stored"
            await asyncio.sleep(0.1)
        assert [(t.role, t.complete) for t in turns] == [("user", True), ("assistant", False)]
        assert turns[1].content.startswith(got)  # what was streamed (perhaps a little more)
        # a complete streamed reply: stored complete before [DONE] reached the client
        body = {"messages": [{"role": "user", "content": "Say hi."}], "session_id": sid, "stream": True,
                "max_tokens": 4}
        async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
            raw = await r.read()
            assert r.headers["X-Strata-Memory"].startswith("turns=2;")
        assert raw.endswith(b"data: [DONE]\n\n")
        turns = await asyncio.to_thread(svc.store.turns, sess.pk)
        assert [(t.seq, t.complete) for t in turns] == [(1, True), (2, False), (3, True), (4, True)]


async def test_twenty_sessions_concurrently(gw: GW) -> None:
    key = gw.key("many", max_concurrent=32)  # 20 sessions at once: above the default 8 in flight
    svc = svc_of(gw)
    async with aiohttp.ClientSession() as s:
        sids = [(await new_session(s, gw, key, title=f"s{i}"))["id"] for i in range(20)]

        async def talk(i: int, sid: str) -> None:
            for j in range(2):
                status, _, body = await chat(s, gw, key, sid, f"session {i} message {j}", max_tokens=2)
                assert status == 200, body

        await asyncio.gather(*(talk(i, sid) for i, sid in enumerate(sids)))
    kid = _key_id(gw, key)
    for i, sid in enumerate(sids):
        sess = await svc.session(kid, sid)
        assert sess is not None
        turns = await asyncio.to_thread(svc.store.turns, sess.pk)
        assert [(t.seq, t.role) for t in turns] == [(k + 1, "user" if k % 2 == 0 else "assistant") for k in range(4)]
        assert [t.content for t in turns[0::2]] == [f"session {i} message {j}" for j in range(2)]
        assert all(t.complete for t in turns)


async def test_prefix_cache_hits_every_turn_after_the_first(gw: GW) -> None:
    key = gw.key("cache")
    async with aiohttp.ClientSession() as s:
        sid = (await new_session(s, gw, key, system="You are a concise assistant for a small team. " * 4))["id"]
        cached, lanes = [], set()
        for i in range(10):
            status, headers, body = await chat(s, gw, key, sid, f"Turn {i}: name a colour.", max_tokens=6)
            assert status == 200, body
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            lanes.add(headers["X-Strata-Lane"])
    assert len(lanes) == 1  # affinity: one lane holds the session's prefix
    assert all(c > 0 for c in cached[1:]), cached
    print(f"\ncached prompt tokens per turn: {cached}")


async def test_summarisation_folds_old_turns_into_the_head(gw: GW) -> None:
    key = gw.key("sum", log_prompts=True)
    svc = svc_of(gw)
    async with aiohttp.ClientSession() as s:
        sid, sess = await stored_session(s, gw, key)
        items = [("user", "My cat is called Pixel.", 8, True), ("assistant", "Pixel is a lovely name.", 8, True)]
        items += [("user" if i % 2 == 0 else "assistant", f"Small talk line {i}.", 6, True) for i in range(12)]
        await asyncio.to_thread(svc.store.append, sess.pk, items)
        assert await svc.summarise(sess.pk, force=True)  # through a real lane, the fixed prompt
        sm = await asyncio.to_thread(svc.store.summary, sess.pk)
        assert sm is not None and sm.first_seq == 1 and sm.last_seq == 14 - svc.cfg.summary_keep_turns and sm.text
        status, headers, body = await chat(s, gw, key, sid, "What is my cat called?")
        assert status == 200, body
        assert f"summary={sm.last_seq}" in headers["X-Strata-Memory"]
        sent = json.loads((await request_log(s, gw, headers["X-Request-Id"]))["prompt_text"])
        assert sent[0]["role"] == "system" and SUMMARY_BEGIN in sent[0]["content"] and sm.text in sent[0]["content"]
        # the turns after the summary are verbatim, in order, right after the head
        assert [m["content"] for m in sent[1:1 + svc.cfg.summary_keep_turns]] == \
            [t[1] for t in items[-svc.cfg.summary_keep_turns:]]


async def test_summary_failure_never_blocks_chat(gw: GW) -> None:
    key = gw.key("sumfail")
    svc = svc_of(gw)
    calls: list[int] = []

    async def broken(messages: list[dict[str, Any]], max_tokens: int, temperature: float, key_id: int) -> str:
        calls.append(1)
        raise ConnectionError("lane unreachable")

    real = svc.complete
    svc.complete = broken
    try:
        async with aiohttp.ClientSession() as s:
            sid, sess = await stored_session(s, gw, key)
            await asyncio.to_thread(svc.store.append, sess.pk, [("user", f"line {i}", 50, True) for i in range(10)])
            assert await svc.summarise(sess.pk, force=True) is False
            assert calls and sess.pk in svc._retry  # scheduled for later
            n = len(calls)
            assert await svc.summarise(sess.pk) is False and len(calls) == n  # backing off: no new call yet
            status, _, body = await chat(s, gw, key, sid, "still there?")
            assert status == 200, body
    finally:
        svc.complete = real
    assert await svc.summarise(sess.pk, force=True)  # the lane is back: the retry succeeds
    assert sess.pk not in svc._retry


async def test_summaries_are_charged_to_the_sessions_key(gw: GW) -> None:
    """A summary's lane call is a generation request of the session's key: a max_concurrent slot while it runs, one
    of its rpm, its tokens in its tpm (settled to the lane's usage); at a limit it waits for room, not a failure."""
    state, svc = gw.state, svc_of(gw)
    assert state.keys is not None
    secret, rec = state.keys.create(KeySpec(name="sumlim", limits={"max_concurrent": 1, "rpm": 2, "tpm": 100_000}))
    items = [("user" if i % 2 == 0 else "assistant", f"Note {i}: the locker code is {1000 + i}.", 12, True)
             for i in range(14)]
    async with aiohttp.ClientSession() as s:
        sid = (await new_session(s, gw, secret))["id"]
        sess = await svc.session(rec.id, sid)
        assert sess is not None
        await asyncio.to_thread(svc.store.append, sess.pk, items)
        done, deferred = state.metrics.summaries.labels(result="done"), state.metrics.summaries.labels(result="deferred")
        done0, deferred0, failures0 = done._value.get(), deferred._value.get(), svc.summary_failures

        ticket = state.limiter.admit(rec, generation=False)  # the key's one slot: a request of its own in flight
        try:
            assert await svc.summarise(sess.pk, force=True) is False
        finally:
            state.limiter.release(ticket)
        assert deferred._value.get() == deferred0 + 1 and svc.summary_failures == failures0
        assert svc._retry[sess.pk][0] > time.monotonic()  # tried again once the key has room
        assert state.metrics.rate_limited.labels(limit="concurrency")._value.get() >= 1

        tokens0 = state.metrics.summary_tokens._value.get()
        assert await svc.summarise(sess.pk, force=True)
        used = state.metrics.summary_tokens._value.get() - tokens0
        window = state.limiter._keys[rec.id]
        assert done._value.get() == done0 + 1 and used > 0
        assert len(window.requests) == 1 and window.token_sum == used and window.concurrent == 0
        # rpm 2: the summary was one of them
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
        statuses = []
        for _ in range(2):
            async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(secret)) as r:
                statuses.append((r.status, (await r.json()).get("error", {}).get("limit")))
        assert statuses == [(200, None), (429, "rpm")]

    # tpm: a key whose window already holds its summary's tokens waits about a minute for the next
    secret, rec = state.keys.create(KeySpec(name="sumtpm", limits={"tpm": 64}))
    async with aiohttp.ClientSession() as s:
        sid = (await new_session(s, gw, secret))["id"]
    sess = await svc.session(rec.id, sid)
    assert sess is not None
    await asyncio.to_thread(svc.store.append, sess.pk, items)
    assert await svc.summarise(sess.pk, force=True)  # an empty window lets one request through, however large
    await asyncio.to_thread(svc.store.append, sess.pk, items)
    assert await svc.summarise(sess.pk, force=True) is False
    assert svc._retry[sess.pk][0] > time.monotonic() + 30
    assert state.metrics.rate_limited.labels(limit="tpm")._value.get() >= 1


async def test_vectors_are_unit_norm(gw: GW) -> None:
    emb = svc_of(gw).embedder
    assert emb is not None
    v = await emb.aencode(["hello there"])
    assert v.shape == (1, 384) and abs(float(np.linalg.norm(v[0])) - 1) < 1e-4
