"""Limits on every endpoint that costs work: defaults from ``[limits]``, a key's own values, admin keys without;
embeddings (inputs per call and per minute), searches, uploads (rate, queue, quotas, disk) and session requests
through the real app; and the ingestion queue that serves keys in turn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from gateway.config import LimitsConfig
from gateway.documents.service import FairQueue
from gateway.errors import APIError
from gateway.keys import KeyRecord, KeySpec
from gateway.limits import Limiter
from tests.gateway.conftest import gateway_config, running_gateway
from tests.gateway.documents.helpers import auth, create_collection, upload

NO_LANE = [{"name": "a", "url": "http://127.0.0.1:9"}]  # nothing listens: these tests need no lane


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_defaults_own_values_and_admin_keys() -> None:
    clock = Clock()
    lim = Limiter(clock, config=LimitsConfig(rpm=2, max_concurrent=5, searches_per_minute=3))
    plain = KeyRecord(id=1, name="plain", prefix="")
    own = KeyRecord(id=2, name="own", prefix="", rpm=4, limits={"searches_per_minute": None})
    admin = KeyRecord(id=3, name="ops", prefix="", admin=True)
    assert lim.value(plain, "rpm") == 2 and lim.value(own, "rpm") == 4 and lim.value(admin, "rpm") is None
    assert lim.value(own, "searches_per_minute") is None and lim.value(plain, "searches_per_minute") == 3
    for _ in range(2):
        lim.release(lim.admit(plain))
    with pytest.raises(APIError) as e:
        lim.admit(plain)
    assert e.value.status == 429 and e.value.extra["limit"] == "rpm" and e.value.retry_after == 60
    for _ in range(3):
        lim.rate(plain, "searches_per_minute")
    with pytest.raises(APIError) as e:
        lim.rate(plain, "searches_per_minute")
    assert e.value.status == 429 and e.value.extra["limit"] == "searches_per_minute"
    for _ in range(50):
        lim.rate(own, "searches_per_minute")  # unlimited for this key
    clock.t += 61
    lim.rate(plain, "searches_per_minute")  # the window moved on
    # weighted: 10 inputs against 25 per minute; a call larger than the whole limit passes on an empty window
    lim2 = Limiter(clock, config=LimitsConfig(embedding_inputs_per_minute=25))
    lim2.rate(plain, "embedding_inputs_per_minute", 10)
    lim2.rate(plain, "embedding_inputs_per_minute", 10)
    with pytest.raises(APIError):
        lim2.rate(plain, "embedding_inputs_per_minute", 10)
    clock.t += 61
    lim2.rate(plain, "embedding_inputs_per_minute", 100)
    # concurrency counts every kind of request
    tickets = [lim.admit(admin), *(lim.admit(own, generation=False) for _ in range(5))]
    with pytest.raises(APIError) as e:
        lim.admit(own, generation=False)
    assert e.value.extra["limit"] == "concurrency"
    for t in tickets:
        lim.release(t)


async def test_ingestion_serves_keys_in_turn() -> None:
    q = FairQueue()
    for i in range(5):
        q.put_nowait(f"flood-{i}", 1)
    q.put_nowait("one", 2)
    q.put_nowait("other", 3)
    got = [await q.get() for _ in range(3)]
    assert got == ["flood-0", "one", "other"]  # the flooding key's second document waits for the others' first
    q.put_nowait("late", 2)
    assert [await q.get() for _ in range(5)] == ["flood-1", "late", "flood-2", "flood-3", "flood-4"]
    assert q.empty()
    waiter = asyncio.ensure_future(q.get())
    await asyncio.sleep(0)
    q.put_nowait("x", 9)
    assert await asyncio.wait_for(waiter, 1) == "x"


async def test_endpoint_limits_over_http(tmp_path: Path) -> None:
    limits = {"embedding_inputs_per_call": 4, "embedding_inputs_per_minute": 6, "searches_per_minute": 2,
              "uploads_per_minute": 3, "documents_per_key": 2, "queued_documents_per_key": 10}
    cfg = gateway_config(tmp_path, NO_LANE, limits=limits, rag={"data_dir": str(tmp_path / "rag")})
    async with running_gateway(cfg) as g, aiohttp.ClientSession() as s:
        key = g.key("k")
        free = g.key("free", limits={"embedding_inputs_per_minute": None})

        async def embed(k: str, n: int) -> tuple[int, dict, aiohttp.ClientResponse]:
            async with s.post(g.url + "/v1/embeddings", json={"input": ["x"] * n}, headers=auth(k)) as r:
                return r.status, await r.json(), r

        status, body, _ = await embed(key, 5)
        assert status == 400 and body["error"]["param"] == "input"  # over the per-call limit
        assert (await embed(key, 4))[0] == 200
        status, body, r = await embed(key, 4)  # 8 > 6 per minute
        assert status == 429 and body["error"]["limit"] == "embedding_inputs_per_minute"
        assert int(r.headers["Retry-After"]) >= 1
        for _ in range(3):
            assert (await embed(free, 4))[0] == 200  # its own value: unlimited

        coll = await create_collection(s, g.url, key, "c")
        for _ in range(2):
            async with s.post(f"{g.url}/v1/collections/{coll['id']}/search", json={"query": "x"},
                              headers=auth(key)) as r:
                assert r.status == 200, await r.text()
        async with s.post(f"{g.url}/v1/collections/{coll['id']}/search", json={"query": "x"}, headers=auth(key)) as r:
            body = await r.json()
            assert r.status == 429 and body["error"]["limit"] == "searches_per_minute" and "Retry-After" in r.headers

        statuses = [await upload(s, g.url, key, coll["id"], f"d{i}.txt", f"document {i}".encode()) for i in range(4)]
        assert [st for st, _ in statuses[:2]] == [202, 202]
        assert statuses[2][0] == 429 and statuses[2][1]["error"]["code"] == "quota_exceeded"  # 2 documents a key
        assert statuses[3][0] == 429 and statuses[3][1]["error"]["limit"] == "uploads_per_minute"  # 4th in a minute
        m = g.state.metrics.rate_limited
        assert m.labels(limit="documents_per_key")._value.get() == 1

    # the disk: an upload needs min_free_disk_bytes free beside it
    cfg = gateway_config(tmp_path / "disk", NO_LANE, limits={"min_free_disk_bytes": 1 << 60},
                         rag={"data_dir": str(tmp_path / "disk" / "rag")})
    async with running_gateway(cfg) as g, aiohttp.ClientSession() as s:
        key = g.key("k")
        coll = await create_collection(s, g.url, key, "c")
        status, body = await upload(s, g.url, key, coll["id"], "d.txt", b"words")
        assert status == 507 and body["error"]["code"] == "insufficient_storage"


async def test_session_requests_over_http(tmp_path: Path) -> None:
    """Every session route is one of the key's session_requests_per_minute and holds a max_concurrent slot; a key's
    own value wins (null: unlimited); a 429 names the limit and carries Retry-After."""
    cfg = gateway_config(tmp_path, NO_LANE, limits={"session_requests_per_minute": 4},
                         rag={"data_dir": str(tmp_path / "rag")})
    async with running_gateway(cfg) as g, aiohttp.ClientSession() as s:
        assert g.state.keys is not None
        key = g.key("k")
        own = g.key("own", limits={"session_requests_per_minute": 6})
        free = g.key("free", limits={"session_requests_per_minute": None})
        one_secret, one = g.state.keys.create(KeySpec(name="one", limits={"max_concurrent": 1}))

        async def call(k: str, method: str, path: str, body: dict | None = None) -> aiohttp.ClientResponse:
            async with s.request(method, g.url + path, json=body, headers=auth(k)) as r:
                await r.read()
                return r

        r = await call(key, "POST", "/v1/sessions", {"title": "t"})
        assert r.status == 201
        sid = (await r.json())["id"]
        for method, path, body in (("GET", "/v1/sessions", None), ("PATCH", f"/v1/sessions/{sid}", {"title": "u"}),
                                   ("GET", f"/v1/sessions/{sid}/export", None)):
            assert (await call(key, method, path, body)).status == 200
        for method, path in (("DELETE", f"/v1/sessions/{sid}"), ("GET", f"/v1/sessions/{sid}")):
            r = await call(key, method, path)  # the fifth and sixth in a minute
            body = await r.json()
            assert r.status == 429 and body["error"]["limit"] == "session_requests_per_minute", body
            assert 1 <= int(r.headers["Retry-After"]) <= 60
        assert [(await call(own, "GET", "/v1/sessions")).status for _ in range(7)] == [200] * 6 + [429]
        assert {(await call(free, "GET", "/v1/sessions")).status for _ in range(12)} == {200}
        assert g.state.metrics.rate_limited.labels(limit="session_requests_per_minute")._value.get() == 3

        ticket = g.state.limiter.admit(one)  # the key's one slot is in use (a chat of its own, say)
        try:
            r = await call(one_secret, "GET", "/v1/sessions")
            assert r.status == 429 and (await r.json())["error"]["limit"] == "concurrency"
        finally:
            g.state.limiter.release(ticket)
        assert (await call(one_secret, "GET", "/v1/sessions")).status == 200
