"""The request log: a background writer, flush, filters, retention, a database outage; and a gateway with no
lane ready."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import aiohttp
import pytest
from sqlalchemy import create_engine, text

from gateway.db import open_db
from gateway.keys import KeySpec, KeyStore
from gateway.store import RequestLog, RequestQuery
from tests.gateway.conftest import ADMIN_KEY, auth, gateway_config, running_gateway
from tests.http_helpers import scrape


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


async def test_log_queue_is_bounded_during_a_database_outage(tmp_path: Path) -> None:
    """The database goes away (its directory renamed, the pool's connections closed): rows wait in a
    bounded queue, the rest are dropped and counted in /metrics, and everything queued is written
    in a few batches once the database is back."""
    db_dir = tmp_path / "db"
    cfg = gateway_config(tmp_path, [{"name": "a", "url": "http://127.0.0.1:9"}], db_url=f"sqlite:///{db_dir / 'gw.db'}",
                         key_cache_s=600.0, log_queue_max=50, log_retry_max_s=0.5)
    prompt = "p" * 20_000  # rows carry prompt text: the reason the queue must be bounded
    async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
        store, db = gw.state.store, gw.state.db
        assert store is not None and db is not None
        key = gw.key("logged", log_prompts=True)
        body = {"messages": [{"role": "user", "content": prompt}]}

        async def send(n: int) -> None:
            for _ in range(n):  # no lane is up: a quick 503, still one request-log row each
                async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
                    assert r.status == 503
        await send(1)  # the key is now cached: authentication needs no database during the outage
        assert await store.flush()
        assert len(store.query(RequestQuery())) == 1

        away = tmp_path / "db-away"
        db_dir.rename(away)
        db.dispose()  # open connections would keep the renamed file reachable
        attempts = store.attempts
        await send(300)
        deadline = time.monotonic() + 10
        while not store.outage and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert store.outage
        assert store.queued == 50 and store.dropped == 250
        assert sum(len(r["prompt_text"] or "") for _, r in store._rows) <= 50 * (len(prompt) + 100)
        m = await scrape(http, gw.url, ADMIN_KEY)
        assert m['strata_gateway_request_log_dropped_total{reason="queue_full"}'] == 250
        assert m["strata_gateway_request_log_queued"] == 50
        assert not await store.flush(timeout=0.3)  # nothing can be written now
        await asyncio.sleep(1.5)  # a few retry periods pass
        tried = store.attempts - attempts
        assert 1 <= tried <= 8, tried  # whole batches with backoff, not one attempt per row

        away.rename(db_dir)
        assert await store.flush(timeout=10)
        assert store.queued == 0 and not store.outage and store.dropped == 250
        async with http.get(gw.url + "/v1/admin/requests", params={"limit": "1000"}, headers=auth(ADMIN_KEY)) as r:
            rows = (await r.json())["data"]
        assert len(rows) == 51 and all(row["status"] == 503 for row in rows)
        assert store.attempts - attempts - tried <= 2  # the 50 rows went in one batch
        m = await scrape(http, gw.url, ADMIN_KEY)
        assert m["strata_gateway_request_log_queued"] == 0
        assert m['strata_gateway_request_log_dropped_total{reason="rejected"}'] == 0


def test_database_directory_is_private(tmp_path: Path) -> None:
    engine = open_db(f"sqlite:///{tmp_path / 'new' / 'deeper' / 'gw.db'}")
    engine.dispose()
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper" / "gw.db").st_mode) == 0o600
    os.chmod(tmp_path, 0o755)
    open_db(f"sqlite:///{tmp_path / 'gw.db'}").dispose()
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o755  # an existing directory keeps its mode


def test_columns_added_to_an_old_database(tmp_path: Path) -> None:
    """A database made before ``api_keys.default_max_tokens`` existed gets the column at start."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = create_engine(url)
    with old.begin() as conn:
        conn.execute(text("CREATE TABLE api_keys (id INTEGER PRIMARY KEY, name VARCHAR(128) NOT NULL, "
                          "hash VARCHAR(64) NOT NULL UNIQUE, prefix VARCHAR(16) NOT NULL, admin BOOLEAN NOT NULL, "
                          "rpm INTEGER, tpm INTEGER, max_concurrent INTEGER, max_tokens INTEGER, "
                          "log_prompts BOOLEAN NOT NULL, created FLOAT NOT NULL, revoked FLOAT)"))
        conn.execute(text("INSERT INTO api_keys (name, hash, prefix, admin, log_prompts, created) "
                          "VALUES ('old', 'h', 'abcdefgh', 0, 0, 1.0)"))
    old.dispose()
    store = KeyStore(open_db(url))
    assert [k.name for k in store.list()] == ["old"] and store.list()[0].default_max_tokens is None
    _, rec = store.create(KeySpec(name="new", default_max_tokens=64))
    assert store.get(rec.id).default_max_tokens == 64  # type: ignore[union-attr]
    store.engine.dispose()
