"""memory.store on SQLite and on PostgreSQL: schema versions, sessions per key, atomic turns, summaries,
vectors, deletion, concurrent writers."""

from __future__ import annotations

import threading

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
