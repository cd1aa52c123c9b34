"""The request log: a background writer, flush, filters, retention; and a gateway with no lane ready."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest

from gateway.db import open_db
from gateway.store import RequestLog, RequestQuery
from tests.gateway.conftest import ADMIN_KEY, auth, gateway_config, running_gateway


def _row(i: int, t: float, **kw: object) -> dict:
    row = {"id": f"gw-{i}", "time": t, "key_id": 1 + i % 2, "lane": "ab"[i % 2], "model": "m", "endpoint": "/v1/x",
           "stream": False, "prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 1, "ttft_ms": None,
           "duration_ms": 1.0, "status": 200, "error_type": None, "clamped_from": None, "clamped_to": None,
           "retried": False, "prompt_text": None, "response_text": None}
    row.update(kw)
    return row


async def test_writer_filters_and_retention(tmp_path: Path) -> None:
    store = RequestLog(open_db(f"sqlite:///{tmp_path / 'r.db'}"), retention_days=1)
    store.start()
    now = time.time()
    for i in range(10):
        store.record(_row(i, now - i, status=429 if i == 3 else 200))
    store.record(_row(99, now - 3 * 86400))  # older than the retention
    store.record({"id": "broken"})  # a bad row loses its batch, never the writer
    assert await store.flush()
    for i in range(10, 12):
        store.record(_row(i, now + i))
    assert await store.flush()
    rows = store.query(RequestQuery())
    assert [r["id"] for r in rows[:2]] == ["gw-11", "gw-10"] and store.dropped >= 1
    assert [r["id"] for r in store.query(RequestQuery(status="4xx"))] == ["gw-3"]
    assert {r["lane"] for r in store.query(RequestQuery(lane="a", key_id=1))} == {"a"}
    assert len(store.query(RequestQuery(since=now - 4.5, until=now))) == 4  # type: ignore[arg-type]
    assert len(store.query(RequestQuery(limit=2))) == 2
    purged = store.purge()
    assert purged >= 1 and all(r["id"] != "gw-99" for r in store.query(RequestQuery(limit=1000)))
    with pytest.raises(ValueError):
        RequestQuery(since="yesterday")  # type: ignore[arg-type]
    store.close()


async def test_no_lane_ready(tmp_path: Path) -> None:
    cfg = gateway_config(tmp_path, [{"name": "a", "url": "http://127.0.0.1:9"}], metrics_public=False)
    async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
        key = gw.key()
        async with http.get(gw.url + "/readyz") as r:
            assert r.status == 503
        async with http.get(gw.url + "/healthz") as r:
            assert r.status == 200
        async with http.post(gw.url + "/v1/chat/completions", headers=auth(key),
                             json={"messages": [{"role": "user", "content": "hi"}]}) as r:
            err = (await r.json())["error"]
            assert r.status == 503 and err["code"] == "no_lane_available" and r.headers["Retry-After"] == "1"
        async with http.get(gw.url + "/v1/models", headers=auth(key)) as r:
            assert r.status == 503
        async with http.get(gw.url + "/metrics") as r:
            assert r.status == 401  # metrics_public = false
        async with http.get(gw.url + "/metrics", headers=auth(ADMIN_KEY)) as r:
            assert r.status == 200 and "strata_gateway_lane_ready" in await r.text()
        async with http.get(gw.url + "/nope", headers=auth(key)) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with http.get(gw.url + "/v1/admin/lanes", headers=auth(ADMIN_KEY)) as r:
            lane = (await r.json())["data"][0]
            assert lane["ready"] is False and lane["health"] == "unreachable" and lane["n_ctx"] is None
