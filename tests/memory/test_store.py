"""memory.store on SQLite and on PostgreSQL: schema versions, sessions per key, atomic turns, summaries,
vectors, deletion, concurrent writers."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import insert, text
from sqlalchemy.exc import IntegrityError

from memory.store import (
    SCHEMA_VERSION,
    MemoryStore,
    SchemaError,
    migrate,
    open_engine,
    schema,
    schema_version,
)


def test_migrations_are_versioned_and_idempotent(store: MemoryStore) -> None:
    assert store.version == SCHEMA_VERSION
    assert migrate(store.engine) == SCHEMA_VERSION  # a second gateway: nothing to do
    with store.engine.connect() as c:
        assert schema_version(c) == SCHEMA_VERSION
        assert c.execute(text("SELECT count(*) FROM memory_schema")).scalar_one() == SCHEMA_VERSION


def test_newer_schema_is_refused(store: MemoryStore) -> None:
    with store.engine.begin() as c:
        c.execute(insert(schema).values(version=SCHEMA_VERSION + 1, applied=0.0, note="from the future"))
    with pytest.raises(SchemaError, match="upgrade the gateway"):
        migrate(store.engine)


def test_concurrent_start_migrates_once(db_url: str) -> None:
    engines = [open_engine(db_url) for _ in range(4)]
    errors: list[BaseException] = []

    def start(e: object) -> None:
        try:
            MemoryStore(e)  # type: ignore[arg-type]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with engines[0].connect() as c:
        assert c.execute(text("SELECT count(*) FROM memory_schema")).scalar_one() == SCHEMA_VERSION
    for e in engines:
        e.dispose()


def test_sessions_are_private_to_their_key(store: MemoryStore) -> None:
    a = store.create_session(1, title="mine", system="be brief", collections=["c1"])
    assert a is not None and a.id.startswith("sess_") and a.collections == ["c1"]
    assert store.get_session(1, a.id) == a
    assert store.get_session(2, a.id) is None  # another key: as if it did not exist
    assert [s.id for s in store.list_sessions(1)] == [a.id]
    assert store.list_sessions(2) == []
    assert store.delete_session(2, a.id) is False
    assert store.get_session(1, a.id) is not None


def test_session_limit(store: MemoryStore) -> None:
    assert store.create_session(5, limit=2) is not None
    assert store.create_session(5, limit=2) is not None
    assert store.create_session(5, limit=2) is None
    assert store.create_session(6, limit=2) is not None


def test_append_is_atomic_and_numbered(store: MemoryStore) -> None:
    s = store.create_session(1)
    assert s is not None
    got = store.append(s.pk, [("user", "hello", 2, True), ("assistant", "hi there", 3, True)], "gw-1")
    assert [(t.seq, t.role, t.content) for t in got] == [(1, "user", "hello"), (2, "assistant", "hi there")]
    got = store.append(s.pk, [("user", "more", 1, True), ("assistant", "cut sh", 2, False)])
    assert [(t.seq, t.complete) for t in got] == [(3, True), (4, False)]
    assert [t.seq for t in store.turns(s.pk)] == [1, 2, 3, 4]
    assert [t.seq for t in store.turns(s.pk, newest=2)] == [3, 4]
    assert [t.seq for t in store.turns(s.pk, after_seq=2)] == [3, 4]
    assert store.get_session(1, s.id).n_turns == 4  # type: ignore[union-attr]
    assert store.pending_tokens(s.pk, 2) == (2, 3)
    # a failing insert leaves nothing behind: the whole exchange or none of it
    with pytest.raises(IntegrityError):
        store.append(s.pk, [("user", "ok", 1, True), ("assistant", None, 1, True)])  # type: ignore[list-item]
    assert [t.seq for t in store.turns(s.pk)] == [1, 2, 3, 4]
    assert store.get_session(1, s.id).n_turns == 4  # type: ignore[union-attr]


def test_concurrent_appends_of_one_session_never_interleave(store: MemoryStore) -> None:
    s = store.create_session(1)
    assert s is not None
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(10):
                store.append(s.pk, [("user", f"w{w}-q{i}", 1, True), ("assistant", f"w{w}-a{i}", 1, True)])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ts = store.turns(s.pk)
    assert [t.seq for t in ts] == list(range(1, 81))
    for q, a in zip(ts[0::2], ts[1::2], strict=True):  # every exchange is adjacent: question then its answer
        assert q.role == "user" and a.role == "assistant" and q.content.replace("-q", "-a") == a.content


def test_summaries_are_optimistic_and_replace_older(store: MemoryStore) -> None:
    s = store.create_session(1)
    assert s is not None
    store.append(s.pk, [("user", f"m{i}", 1, True) for i in range(6)])
    assert store.summary(s.pk) is None
    assert store.put_summary(s.pk, 1, 2, "first", 1, expect_last=0)
    assert not store.put_summary(s.pk, 1, 3, "stale writer", 1, expect_last=0)  # someone else summarised first
    assert store.put_summary(s.pk, 1, 4, "second", 1, expect_last=2)
    sm = store.summary(s.pk)
    assert sm is not None and (sm.first_seq, sm.last_seq, sm.text) == (1, 4, "second")
    assert store.counts(s.pk)["memory_summaries"] == 1


def test_vectors_and_deletion_leave_nothing(store: MemoryStore) -> None:
    s = store.create_session(1)
    other = store.create_session(1)
    assert s is not None and other is not None
    ts = store.append(s.pk, [("user", "a", 1, True), ("assistant", "b", 1, True)])
    store.append(other.pk, [("user", "keep me", 1, True)])
    assert [t.seq for t in store.missing_vectors(s.pk, "m:3", 10)] == [1, 2]
    vecs = np.eye(2, 3, dtype=np.float32)
    assert store.put_vectors(s.pk, "m:3", [t.id for t in ts], vecs) == 2
    assert store.put_vectors(s.pk, "m:3", [t.id for t in ts], vecs) == 0  # idempotent
    assert store.missing_vectors(s.pk, "m:3", 10) == []
    ids, mat = store.load_vectors(s.pk, "m:3")
    assert list(ids) == [t.id for t in ts] and np.array_equal(mat, vecs)
    ids, _ = store.load_vectors(s.pk, "m:3", after_turn_id=ts[0].id)
    assert list(ids) == [ts[1].id]
    store.put_summary(s.pk, 1, 1, "sum", 1, expect_last=0)
    assert store.counts(s.pk) == {"memory_turns": 2, "memory_summaries": 1, "memory_vectors": 2}
    assert store.delete_session(1, s.id)
    assert store.counts(s.pk) == {"memory_turns": 0, "memory_summaries": 0, "memory_vectors": 0}
    assert store.get_session(1, s.id) is None
    assert store.counts(other.pk)["memory_turns"] == 1  # the other session is untouched
    assert not store.put_summary(s.pk, 1, 2, "late", 1, expect_last=1)  # a summariser finishing late: no orphan
    assert store.put_vectors(s.pk, "m:3", [t.id for t in ts], vecs) == 0


def test_unicode_and_long_content_round_trip(store: MemoryStore) -> None:
    s = store.create_session(1, title="Ünïcødé 🧠")
    assert s is not None
    body = "日本語 " * 5000
    store.append(s.pk, [("user", body, 10, True)])
    assert store.turns(s.pk)[0].content == body
    assert store.get_session(1, s.id).title == "Ünïcødé 🧠"  # type: ignore[union-attr]


def test_ids_are_never_reused_after_a_delete(store: MemoryStore) -> None:
    """A gateway keeps per-session state by session pk and turn id: a new session must never get a deleted one's."""
    s = store.create_session(1)
    assert s is not None
    ts = store.append(s.pk, [("user", "a", 1, True), ("assistant", "b", 1, True)])
    store.put_summary(s.pk, 1, 1, "sum", 1, expect_last=0)
    with store.engine.connect() as c:
        sum_id = c.execute(text("SELECT max(id) FROM memory_summaries")).scalar_one()
    assert store.delete_session(1, s.id)  # the newest rows of every table: the ids a plain rowid would hand out again
    new = store.create_session(1)
    assert new is not None and new.pk > s.pk
    assert store.append(new.pk, [("user", "c", 1, True)])[0].id > ts[-1].id
    store.put_summary(new.pk, 1, 1, "sum", 1, expect_last=0)
    with store.engine.connect() as c:
        assert c.execute(text("SELECT max(id) FROM memory_summaries")).scalar_one() > sum_id


# the memory tables as schema version 1 created them on SQLite (INTEGER PRIMARY KEY without AUTOINCREMENT)
_V1_SQLITE = """
CREATE TABLE memory_schema (version INTEGER NOT NULL, applied FLOAT NOT NULL, note VARCHAR(200) NOT NULL,
    PRIMARY KEY (version));
CREATE TABLE memory_sessions (pk INTEGER NOT NULL, id VARCHAR(40) NOT NULL, key_id INTEGER NOT NULL,
    title VARCHAR(256), system TEXT, collections TEXT, created FLOAT NOT NULL, last_active FLOAT NOT NULL,
    n_turns INTEGER NOT NULL, PRIMARY KEY (pk), UNIQUE (id));
CREATE INDEX ix_memory_sessions_key ON memory_sessions (key_id, last_active);
CREATE TABLE memory_turns (id INTEGER NOT NULL, session_pk INTEGER NOT NULL, seq INTEGER NOT NULL,
    role VARCHAR(16) NOT NULL, content TEXT NOT NULL, tokens INTEGER NOT NULL, created FLOAT NOT NULL,
    complete BOOLEAN NOT NULL, request_id VARCHAR(64), PRIMARY KEY (id),
    CONSTRAINT uq_memory_turns_seq UNIQUE (session_pk, seq));
CREATE TABLE memory_summaries (id INTEGER NOT NULL, session_pk INTEGER NOT NULL, first_seq INTEGER NOT NULL,
    last_seq INTEGER NOT NULL, text TEXT NOT NULL, tokens INTEGER NOT NULL, created FLOAT NOT NULL,
    PRIMARY KEY (id), CONSTRAINT uq_memory_summaries_last UNIQUE (session_pk, last_seq));
CREATE TABLE memory_vectors (turn_id INTEGER NOT NULL, session_pk INTEGER NOT NULL, model VARCHAR(128) NOT NULL,
    vector BLOB NOT NULL, PRIMARY KEY (turn_id));
CREATE INDEX ix_memory_vectors_session ON memory_vectors (session_pk, turn_id);
INSERT INTO memory_schema VALUES (1, 0.0, 'sessions, turns, summaries, turn vectors');
INSERT INTO memory_sessions VALUES (3, 'sess_kept', 1, 'kept', 'be brief', '["col_1"]', 1.5, 2.5, 3);
INSERT INTO memory_sessions VALUES (7, 'sess_newest', 2, NULL, NULL, NULL, 1.0, 1.0, 1);
INSERT INTO memory_turns VALUES (4, 3, 1, 'user', 'my code is 4417', 5, 1.5, 1, 'gw-1');
INSERT INTO memory_turns VALUES (5, 3, 2, 'assistant', 'noted', 2, 1.6, 0, NULL);
INSERT INTO memory_turns VALUES (6, 3, 3, 'user', 'Ünïcødé', 3, 1.7, 1, NULL);
INSERT INTO memory_turns VALUES (9, 7, 1, 'user', 'newest', 1, 1.0, 1, NULL);
INSERT INTO memory_summaries VALUES (2, 3, 1, 2, 'the code is 4417', 5, 1.8);
INSERT INTO memory_vectors VALUES (4, 3, 'm:2', x'0000803f00000000');
"""


def test_a_v1_sqlite_database_keeps_every_row_and_stops_reusing_ids(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "v1.db"
    raw = sqlite3.connect(path)
    raw.executescript(_V1_SQLITE)
    raw.close()
    names = ("memory_sessions", "memory_turns", "memory_summaries", "memory_vectors")

    def dump() -> dict[str, list[tuple[object, ...]]]:
        with sqlite3.connect(path) as c:
            return {n: c.execute(f"SELECT * FROM {n} ORDER BY 1").fetchall() for n in names}

    before = dump()
    store = MemoryStore(open_engine(f"sqlite:///{path}"))
    assert store.version == SCHEMA_VERSION == 2
    assert dump() == before  # every row, every id
    with store.engine.connect() as c:
        ddl = dict(c.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'table'")).all())
        ixs = set(c.execute(text("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")).scalars())
        seqs = dict(c.execute(text("SELECT name, seq FROM sqlite_sequence")).all())
    assert all("AUTOINCREMENT" in ddl[n] for n in names[:3]) and not any(n.endswith("__rebuild") for n in ddl)
    assert ixs == {"ix_memory_sessions_key", "ix_memory_vectors_session"}
    assert seqs == {"memory_sessions": 7, "memory_turns": 9, "memory_summaries": 2}
    assert [t.seq for t in store.turns(3)] == [1, 2, 3] and store.summary(3).text == "the code is 4417"  # type: ignore[union-attr]
    assert store.get_session(1, "sess_kept").collections == ["col_1"]  # type: ignore[union-attr]
    assert store.append(3, [("user", "x", 1, True)])[0].id == 10
    with pytest.raises(IntegrityError), store.engine.begin() as c:  # the constraints came along
        c.execute(text("INSERT INTO memory_turns (session_pk, seq, role, content, tokens, created, complete) "
                       "VALUES (3, 1, 'user', 'dup', 1, 0, 1)"))
    assert store.delete_session(2, "sess_newest")  # the highest ids, which version 1 would hand out again
    new = store.create_session(2)
    assert new is not None and new.pk == 8 and store.append(new.pk, [("user", "y", 1, True)])[0].id > 10
    assert MemoryStore(open_engine(f"sqlite:///{path}")).version == 2  # a second start: nothing to do
    with store.engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM memory_schema")).scalar_one() == 2


def test_a_failed_sqlite_migration_leaves_the_database_as_it_was(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild runs in one transaction: a process killed (here: a step raising) after it rebuilt the tables
    but before it recorded the version leaves version 1 intact, and the next start migrates."""
    import sqlite3

    import memory.store as ms

    path = tmp_path / "v1.db"
    with sqlite3.connect(path) as raw:
        raw.executescript(_V1_SQLITE)

    def state() -> list[tuple[object, ...]]:
        with sqlite3.connect(path) as c:
            return c.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall() + \
                c.execute("SELECT * FROM memory_turns ORDER BY id").fetchall()

    before = state()
    v2 = ms.MIGRATIONS[1][2]

    def crash(conn: object) -> None:
        v2(conn)  # type: ignore[arg-type]
        raise RuntimeError("killed half way")

    monkeypatch.setattr(ms, "MIGRATIONS", [ms.MIGRATIONS[0], (2, "crashing", crash)])
    with pytest.raises(RuntimeError, match="half way"):
        MemoryStore(open_engine(f"sqlite:///{path}"))
    assert state() == before
    monkeypatch.undo()
    assert MemoryStore(open_engine(f"sqlite:///{path}")).version == 2
