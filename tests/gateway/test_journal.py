"""The request log's journal: rows on disk before the database has them, replayed after a crash, segments
deleted once committed, one process per directory, private files."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.db import open_db
from gateway.journal import Journal, JournalBusy
from gateway.store import RequestLog, RequestQuery
from tests.pg import fresh_schema, server_url


def _row(i: int, **kw: object) -> dict:
    return {"id": f"gw-{i:04d}", "time": 1000.0 + i, "key_id": 1, "lane": "a", "model": "m",
            "endpoint": "/v1/chat/completions", "stream": False, "prompt_tokens": 1, "completion_tokens": 1,
            "duration_ms": 1.0, "status": 200, "retried": False, "error_type": None, **kw}


def test_segments_rotate_and_go_once_committed(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j", segment_bytes=2000)
    seqs = [j.append(_row(i)) for i in range(40)]
    assert seqs == list(range(1, 41))
    segments = sorted((tmp_path / "j").glob("segment-*.jsonl"))
    assert len(segments) > 3
    assert stat.S_IMODE((tmp_path / "j").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in segments)
    j.committed(20)  # the full segments holding rows 1..20 only are gone, the rest stay
    left = sorted((tmp_path / "j").glob("segment-*.jsonl"))
    assert 0 < len(left) < len(segments)
    j.close(all_committed=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'r.db'}"
        return
    with fresh_schema(server_url("the request log's journal replay"), "strata_journal") as (url, _, _):
        yield url


def test_replay_after_a_crash_writes_every_row_once(tmp_path: Path, db_url: str) -> None:
    engine = open_db(db_url)
    j = Journal(tmp_path / "j")
    for i in range(5):
        j.append(_row(i))
    j.append(_row(5, stream=True, error_type="in_progress"))
    j.append(_row(3, completion_tokens=9))  # a later version of row 3
    with open(next((tmp_path / "j").glob("segment-*.jsonl")), "ab") as f:
        f.write(b'{"id": "gw-torn", "ti')  # the process died in the middle of a write
    os.close(j._lock_fd)  # the process is gone, its lock with it (its segments stay)
    j._lock_fd = -1
    log = RequestLog(engine, retention_days=1e6, journal=Journal(tmp_path / "j"))
    assert log.replay() == 6
    rows = {r["id"]: r for r in log.query(RequestQuery(limit=100))}
    assert sorted(rows) == [f"gw-{i:04d}" for i in range(6)]
    assert rows["gw-0003"]["completion_tokens"] == 9 and rows["gw-0005"]["error_type"] == "interrupted"
    assert not list((tmp_path / "j").glob("segment-*.jsonl"))  # replayed: gone
    assert log.replay() == 0
    log.close()
    engine.dispose()


def test_one_gateway_per_journal(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j")
    with pytest.raises(JournalBusy):
        Journal(tmp_path / "j")
    j.close(all_committed=True)
    Journal(tmp_path / "j").close(all_committed=True)


def test_the_writer_commits_and_empties_the_journal(tmp_path: Path) -> None:
    engine = open_db(f"sqlite:///{tmp_path / 'r.db'}")
    log = RequestLog(engine, retention_days=1e6, journal=Journal(tmp_path / "j", segment_bytes=1500))
    log.start()
    for i in range(30):
        log.record(_row(i))
    log.close()
    assert len(log.query(RequestQuery(limit=100))) == 30
    assert not list((tmp_path / "j").glob("segment-*.jsonl"))
    engine.dispose()


def _crash(log: RequestLog) -> None:
    """The process dies: the writer stops where it is, the journal's files stay as they are, its lock goes."""
    j = log.journal
    assert j is not None
    log.journal = None
    log.close()
    if j._fd >= 0:
        os.close(j._fd)
    os.close(j._lock_fd)
    j._lock_fd = -1


@pytest.mark.parametrize("segment_bytes", [1500, 4 << 20])  # full segments go; a quiet segment past 64 KiB goes
def test_a_stream_in_progress_outlives_its_segment(tmp_path: Path, db_url: str, segment_bytes: int) -> None:
    """A stream's row is committed as in progress and its segment deleted while the stream runs; a crash then
    must still leave it interrupted at the next start, not in progress for ever."""
    engine = open_db(db_url)
    log = RequestLog(engine, retention_days=1e6, journal=Journal(tmp_path / "j", segment_bytes=segment_bytes))
    log.start()
    log.record(_row(0, stream=True, error_type="in_progress"))
    assert asyncio.run(log.flush())
    first = sorted((tmp_path / "j").glob("segment-*.jsonl"))[0]
    for i in range(1, 400):
        log.record(_row(i, model="m" * 100))
        if i % 50 == 0:
            assert asyncio.run(log.flush())
    assert asyncio.run(log.flush())
    assert not first.exists()  # the stream's first line went with its segment ...
    assert log.query(RequestQuery(limit=1000))[-1]["error_type"] == "in_progress"
    assert log.journal is not None and log.journal.in_progress == 1
    _crash(log)
    log = RequestLog(engine, retention_days=1e6, journal=Journal(tmp_path / "j"))
    assert log.replay() >= 1  # ... but the line was written again: the restart knows the stream was cut
    rows = {r["id"]: r for r in log.query(RequestQuery(limit=1000))}
    assert len(rows) == 400 and rows["gw-0000"]["error_type"] == "interrupted"
    assert all(r["error_type"] is None for rid, r in rows.items() if rid != "gw-0000")
    log.close()
    engine.dispose()


def test_a_stream_that_ends_leaves_nothing_behind(tmp_path: Path) -> None:
    engine = open_db(f"sqlite:///{tmp_path / 'r.db'}")
    log = RequestLog(engine, retention_days=1e6, journal=Journal(tmp_path / "j", segment_bytes=1500))
    log.start()
    log.record(_row(0, stream=True, error_type="in_progress"))  # ends
    log.record(_row(1, stream=True, error_type="in_progress"))  # still running when the gateway stops
    for i in range(2, 40):
        log.record(_row(i))
    log.record(_row(0, stream=True, completion_tokens=7))
    log.close()
    lines = [line for p in (tmp_path / "j").glob("segment-*.jsonl") for line in p.read_text().splitlines()]
    assert lines and all('"gw-0001"' in line for line in lines)  # only the stream still running stays
    log = RequestLog(engine, retention_days=1e6, journal=Journal(tmp_path / "j"))
    assert log.replay() == 1
    rows = {r["id"]: r for r in log.query(RequestQuery(limit=100))}
    assert rows["gw-0000"]["completion_tokens"] == 7 and rows["gw-0000"]["error_type"] is None
    assert rows["gw-0001"]["error_type"] == "interrupted"
    log.close()
    assert not list((tmp_path / "j").glob("segment-*.jsonl"))
    engine.dispose()


def test_a_batch_window_commits_once_and_a_crash_inside_it_loses_nothing(tmp_path: Path, db_url: str) -> None:
    """``log_batch_s``: rows arriving within the window share one transaction; a flush cuts the window short; a
    crash before the window ends loses no row (each is in the journal before ``record`` returns)."""
    engine = open_db(db_url)
    log = RequestLog(engine, retention_days=1e6, journal=Journal(tmp_path / "j"), batch_s=0.5)
    log.start()
    for i in range(5):
        log.record(_row(i))
    assert asyncio.run(log.flush())  # well before the window ends
    assert log.attempts == 1 and len(log.query(RequestQuery(limit=100))) == 5
    log.batch_s = 60.0  # the next batch's window outlives the process
    log.record(_row(5, stream=True, error_type="in_progress"))
    log.record(_row(6))
    time.sleep(0.3)
    assert len(log.query(RequestQuery(limit=100))) == 5  # not committed yet ...
    journaled = b"".join(p.read_bytes() for p in (tmp_path / "j").glob("segment-*.jsonl"))
    assert b'"gw-0005"' in journaled and b'"gw-0006"' in journaled  # ... but on disk
    with log._cond:
        log._rows.clear()  # the process dies: the rows the writer held in memory are gone
    _crash(log)
    log = RequestLog(engine, retention_days=1e6, journal=Journal(tmp_path / "j"))
    assert log.replay() >= 2  # ... but journaled: the next start writes them
    rows = {r["id"]: r for r in log.query(RequestQuery(limit=100))}
    assert len(rows) == 7 and rows["gw-0005"]["error_type"] == "interrupted" and rows["gw-0006"]["status"] == 200
    log.close()
    engine.dispose()
