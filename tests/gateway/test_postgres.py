"""The gateway's database on a real PostgreSQL server: keys, the request log, the admin API.

``STRATA_TEST_PG_URL`` names the server (tests/pg.py: skipped without it, failed without it in CI).
Each test gets a fresh schema (the URL's ``search_path``), dropped at its end.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from pydantic import ValidationError
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from gateway.auth import Authenticator
from gateway.db import INT_MAX, open_db
from gateway.documents.store import rag_metadata
from gateway.errors import APIError
from gateway.keys import KEY_PREFIX, KeyRecord, KeySpec, KeyStore, main
from gateway.state import Trace
from gateway.store import RequestLog, RequestQuery
from memory.store import metadata as memory_metadata
from tests.gateway.conftest import ADMIN_KEY, auth, gateway_config, running_gateway, running_lane
from tests.pg import fresh_schema, server_url

TABLES = {"api_keys", "requests", "gateway_meta", "responses"}  # responses: /v1/responses stored for previous_response_id


@pytest.fixture(scope="session")
def pg_url() -> str:
    return server_url("the gateway database")


@dataclass
class PG:
    url: str  # the server URL with search_path = schema: what the gateway is given
    schema: str
    admin: Engine  # on the plain URL, for looking at the tables from outside the gateway

    def tables(self) -> set[str]:
        with self.admin.connect() as c:
            return set(c.execute(text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
                                 {"s": self.schema}).scalars())

    def dump(self) -> str:
        """Every row of every table in the schema, as PostgreSQL renders it."""
        out = []
        with self.admin.connect() as c:
            for table in sorted(self.tables()):
                rows = c.execute(text(f'SELECT t::text FROM "{self.schema}"."{table}" t')).scalars()
                out += [f"{table}: {row}" for row in rows]
        return "\n".join(out)


@pytest.fixture
def pg(pg_url: str) -> Iterator[PG]:
    with fresh_schema(pg_url, "strata_test") as (url, schema, admin):
        yield PG(url, schema, admin)


def _start_at_once(url: str, n: int) -> list[KeyStore]:
    """``n`` gateways' key stores opened on ``url`` at the same moment (threads); any error fails the test."""
    errors: list[Exception] = []
    stores: list[KeyStore] = []

    def start() -> None:
        try:
            stores.append(KeyStore(open_db(url)))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return stores


def test_old_database_gets_new_columns(pg: PG) -> None:
    """A database made before ``api_keys.default_max_tokens`` existed: gateways starting at once add the
    column once (under the advisory lock), and the old keys stay valid."""
    with pg.admin.begin() as c:
        c.execute(text(f'CREATE TABLE "{pg.schema}".api_keys (id SERIAL PRIMARY KEY, name VARCHAR(128) NOT NULL, '
                       "hash VARCHAR(64) NOT NULL UNIQUE, prefix VARCHAR(16) NOT NULL, admin BOOLEAN NOT NULL, "
                       "rpm INTEGER, tpm INTEGER, max_concurrent INTEGER, max_tokens INTEGER, "
                       "log_prompts BOOLEAN NOT NULL, created FLOAT NOT NULL, revoked FLOAT)"))
        c.execute(text(f'INSERT INTO "{pg.schema}".api_keys (name, hash, prefix, admin, log_prompts, created) '
                       "VALUES ('old', 'h', 'abcdefgh', false, false, 1.0)"))
    stores = _start_at_once(pg.url, 3)
    store = stores[0]
    assert [(k.name, k.default_max_tokens) for k in store.list()] == [("old", None)]
    _, rec = store.create(KeySpec(name="new", default_max_tokens=64))
    assert store.get(rec.id).default_max_tokens == 64  # type: ignore[union-attr]
    for s in stores:
        s.engine.dispose()


def test_tables_and_concurrent_start(pg: PG) -> None:
    """Gateways starting at once on an empty database: one creates the tables, all share one pepper."""
    stores = _start_at_once(pg.url, 6)
    assert pg.tables() == TABLES  # in the test's schema, not public
    assert len({s.hash("sk-strata-same") for s in stores}) == 1
    with pg.admin.connect() as c:
        types = dict(c.execute(text("SELECT column_name, data_type FROM information_schema.columns "
                                    "WHERE table_schema = :s AND table_name = 'requests'"), {"s": pg.schema}).all())
        assert c.execute(text(f'SELECT count(*) FROM "{pg.schema}".gateway_meta')).scalar() == 1
    assert types["time"] == "double precision" and types["stream"] == "boolean" and types["prompt_text"] == "text"
    for s in stores:
        s.engine.dispose()


def test_key_ids_are_never_reused_after_a_delete(pg: PG) -> None:
    """A key's id owns its sessions and collections: PostgreSQL's sequence must not hand a deleted top id out again
    (SQLite needed AUTOINCREMENT for this: tests/gateway/test_keys.py)."""
    store = KeyStore(open_db(pg.url))
    store.create(KeySpec(name="a"))
    _, top = store.create(KeySpec(name="b"))
    with pg.admin.begin() as c:
        c.execute(text(f'DELETE FROM "{pg.schema}".api_keys WHERE id = :i'), {"i": top.id})
    assert store.create(KeySpec(name="c"))[1].id > top.id
    store.engine.dispose()


async def test_keys(pg: PG, capsys: pytest.CaptureFixture[str]) -> None:
    store = KeyStore(open_db(pg.url))
    key, rec = store.create(KeySpec(name="alice", rpm=10, log_prompts=None), log_prompts_default=True)
    other, bob = store.create(KeySpec(name="bob", max_tokens=64))
    assert key.startswith(KEY_PREFIX) and rec.log_prompts is True and bob.log_prompts is False
    assert store.lookup(key) == rec and store.lookup(other) == bob and store.get(rec.id) == rec
    assert store.lookup(key + "x") is None and store.lookup("sk-other") is None
    assert [k.name for k in store.list()] == ["alice", "bob"]

    # only the peppered hash is stored: no table holds a key, its random part, or the admin key
    dump = pg.dump()
    assert store.hash(key) in dump and store.hash(other) in dump
    for secret in (key, other, key.removeprefix(KEY_PREFIX), other.removeprefix(KEY_PREFIX), ADMIN_KEY):
        assert secret not in dump
    assert KeyStore(open_db(pg.url)).hash(key) == store.hash(key)  # the pepper is in the database

    authn = Authenticator(store, ADMIN_KEY, cache_s=60, log_prompts_default=False)
    assert await authn.authenticate(f"Bearer {key}") == rec
    assert (await authn.authenticate(f"Bearer {ADMIN_KEY}")).admin
    with pytest.raises(APIError) as err:
        await authn.authenticate(f"Bearer {key}x")
    assert err.value.status == 401

    revoked = store.revoke(rec.id)
    assert revoked is not None and revoked.revoked is not None and store.lookup(key) is None
    authn.forget(rec.id)  # what DELETE /v1/admin/keys/{id} does
    with pytest.raises(APIError):
        await authn.authenticate(f"Bearer {key}")
    assert store.revoke(rec.id).revoked == revoked.revoked  # type: ignore[union-attr]  # idempotent
    assert await authn.authenticate(f"Bearer {other}") == bob
    for missing in (999, 2**40, -(2**40)):  # out of INTEGER range: "no such key", not a database error
        assert store.revoke(missing) is None and store.get(missing) is None
    for bad in ({"name": "nul\x00name"}, {"name": "x", "rpm": INT_MAX + 1}):
        with pytest.raises(ValidationError):
            KeySpec(**bad)  # type: ignore[arg-type]
    store.engine.dispose()

    # the keys CLI on the same database; a failed login names the URL without its password
    assert main(["--db-url", pg.url, "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in listed] == ["alice", "bob"] and listed[0]["revoked"] is not None
    wrong = make_url(pg.url).set(password="wrong-pw-9f1c")
    assert main(["--db-url", wrong.render_as_string(hide_password=False), "list"]) == 2
    err_text = capsys.readouterr().err
    assert "cannot open the database" in err_text and "wrong-pw-9f1c" not in err_text


def _log(store: RequestLog, key: KeyRecord, i: int, t: float, *, lane: str = "a", status: int = 200,
         prompt: str = "hello", answer: str = "hi", **fields: object) -> str:
    """One request-log row made as the gateway makes it (a Trace; prompt text only for log_prompts)."""
    trace = Trace(key=key, endpoint="/v1/chat/completions", log_row=True)
    trace.time, trace.lane, trace.model = t, lane, "strata-default"
    trace.prompt_tokens, trace.completion_tokens, trace.cached_tokens = 10 + i, 5, 0
    if key.log_prompts:
        trace.prompt_text = json.dumps([{"role": "user", "content": prompt}], ensure_ascii=False)
        trace.response_text = answer
    for name, value in fields.items():
        setattr(trace, name, value)
    store.record(trace.row(status, 12.5))
    return trace.id


async def test_request_log(pg: PG) -> None:
    engine = open_db(pg.url)
    keys = KeyStore(engine)
    _, loud = keys.create(KeySpec(name="loud", log_prompts=True))
    _, quiet = keys.create(KeySpec(name="quiet"))
    store = RequestLog(engine, retention_days=1)
    store.start()
    now = time.time()
    ids = [_log(store, (loud, quiet)[i % 2], i, now - i, lane="ab"[i % 2], status=429 if i == 3 else 200,
                prompt=f"quiet-secret-{i}" if i % 2 else f"loud-visible-{i}") for i in range(10)]
    old = _log(store, quiet, 99, now - 3 * 86400)  # older than the retention
    # what a client can put in a row: PostgreSQL refuses these as they are (the row would be lost)
    hostile = _log(store, loud, 50, now + 1, model="m" * 300 + "\x00", clamped_from=3_000_000_000, clamped_to=8,
                   prompt="nul\x00 and lone \ud800 surrogate", answer="a\x00b")
    assert await store.flush()
    assert store.dropped == 0

    rows = store.query(RequestQuery(limit=1000))
    assert [r["id"] for r in rows] == [hostile, *ids, old]  # newest first
    first = next(r for r in rows if r["id"] == ids[0])
    assert first["time"] == now and first["stream"] is False and first["retried"] is False
    assert first["key_id"] == loud.id and first["duration_ms"] == 12.5 and first["prompt_tokens"] == 10
    h = rows[0]
    assert len(h["model"]) == 256 and h["clamped_from"] == INT_MAX and h["clamped_to"] == 8
    assert h["response_text"] == "a\ufffdb" and "and lone ? surrogate" in h["prompt_text"]

    # the admin API's filters
    assert [r["id"] for r in store.query(RequestQuery(status="4xx"))] == [ids[3]]
    assert [r["id"] for r in store.query(RequestQuery(status="429"))] == [ids[3]]
    assert len(store.query(RequestQuery(status="2xx"))) == 11
    by_key = store.query(RequestQuery(key_id=quiet.id, lane="b"))
    assert [r["id"] for r in by_key] == [ids[1], ids[3], ids[5], ids[7], ids[9]]
    assert [r["id"] for r in store.query(RequestQuery(key_id=quiet.id, lane="a"))] == [old]
    assert len(store.query(RequestQuery(since=now - 4.5, until=now))) == 4  # type: ignore[arg-type]
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 2 * 86400))
    assert len(store.query(RequestQuery(since=iso))) == 11  # type: ignore[arg-type]
    assert [r["id"] for r in store.query(RequestQuery(limit=2))] == [hostile, ids[0]]
    assert store.query(RequestQuery(key_id=123456)) == []
    for bad in ({"key_id": 2**40}, {"lane": "a\x00"}):
        with pytest.raises(ValidationError):
            RequestQuery(**bad)  # type: ignore[arg-type]

    # prompt text only for the key with log_prompts
    assert all((r["prompt_text"] is None) == (r["key_id"] == quiet.id) for r in rows)
    dump = pg.dump()
    assert "loud-visible-0" in dump and "quiet-secret" not in dump

    # retention
    assert store.purge() == 1 and store.purge() == 0
    assert old not in {r["id"] for r in store.query(RequestQuery(limit=1000))}
    assert len(store.query(RequestQuery(limit=1000))) == 11
    store.close()
    engine.dispose()


async def test_gateway_end_to_end(pg_url: str, gateway_engines: tuple, pg: PG, tmp_path: Path) -> None:
    """The in-process gateway on PostgreSQL: keys through the admin API, real completions, the log."""
    async with running_lane("a", gateway_engines[0]) as lane:
        cfg = gateway_config(tmp_path, [{"name": "a", "url": lane.url}], db_url=pg.url)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
            admin = auth(ADMIN_KEY)
            async with http.post(gw.url + "/v1/admin/keys", headers=admin,
                                 json={"name": "pg-user", "max_tokens": 8, "log_prompts": True}) as r:
                assert r.status == 201, await r.text()
                made = await r.json()
            key, key_id = made["key"], made["id"]
            async with http.post(gw.url + "/v1/admin/keys", headers=admin, json={"name": "pg-quiet"}) as r:
                quiet = await r.json()
            # the app adds the documents tables and the session memory tables
            assert pg.tables() == TABLES | set(rag_metadata.tables) | set(memory_metadata.tables)

            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
            raw = await client.chat.completions.with_raw_response.create(
                model="strata-default", messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=3_000_000_000, temperature=0)  # clamped to the key's 8 (and saturated in the log)
            answer = raw.parse()
            request_id = raw.headers["X-Request-Id"]
            assert raw.headers["X-Strata-Lane"] == "a" and answer.choices[0].message.content
            assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 8
            await client.close()
            async with http.post(gw.url + "/v1/chat/completions", headers=auth(quiet["key"]), json={
                    "messages": [{"role": "user", "content": "walrus-secret-prompt"}], "max_tokens": 2}) as r:
                assert r.status == 200
                quiet_id = r.headers["X-Request-Id"]

            async with http.get(gw.url + "/v1/admin/requests", headers=admin,
                                params={"key_id": str(key_id), "lane": "a", "status": "2xx"}) as r:
                assert r.status == 200, await r.text()
                listed = (await r.json())["data"]
            assert [row["id"] for row in listed] == [request_id]
            row = listed[0]
            assert row["status"] == 200 and row["lane"] == "a" and row["model"] == "strata-default"
            assert row["endpoint"] == "/v1/chat/completions" and row["stream"] is False
            assert row["completion_tokens"] == answer.usage.completion_tokens
            assert row["clamped_from"] == INT_MAX and row["clamped_to"] == 8
            assert "capital of France" in row["prompt_text"] and row["response_text"] == answer.choices[0].message.content
            with pg.admin.connect() as c:
                stored = c.execute(text(f'SELECT * FROM "{pg.schema}".requests WHERE id = :id'),
                                   {"id": request_id}).mappings().one()
                quiet_row = c.execute(text(f'SELECT * FROM "{pg.schema}".requests WHERE id = :id'),
                                      {"id": quiet_id}).mappings().one()
            assert dict(stored) == row
            assert quiet_row["key_id"] == quiet["id"] and quiet_row["prompt_text"] is None

            for params in ({"key_id": str(2**40)}, {"lane": "a\x00"}):  # a 400, not a database error
                async with http.get(gw.url + "/v1/admin/requests", headers=admin, params=params) as r:
                    assert r.status == 400
            async with http.delete(gw.url + f"/v1/admin/keys/{2**40}", headers=admin) as r:
                assert r.status == 404
            async with http.delete(gw.url + f"/v1/admin/keys/{key_id}", headers=admin) as r:
                assert r.status == 200 and (await r.json())["revoked"] is not None
            async with http.post(gw.url + "/v1/chat/completions", headers=auth(key),
                                 json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
                assert r.status == 401
            dump = pg.dump()
            assert "walrus-secret-prompt" not in dump
            for secret in (key, quiet["key"], ADMIN_KEY):
                assert secret not in dump
