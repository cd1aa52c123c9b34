"""The request log ("infer store"): one row per authenticated generation request.

Rows are queued by the event loop (``record`` never blocks) and written in batches by one
writer thread: after the first row of a batch arrives the writer waits ``batch_s`` (config
``log_batch_s``) for more, then commits them all in one transaction: a transaction costs the
writer ~1 ms of CPU whatever its size (SQLite on the 2-core dev VM, docs/benchmarks.md), and a
stream's two versions of its row (in progress, then complete) often meet in one batch.
``flush`` cuts the wait short and waits until everything queued so far is written (the admin
query does so, so it reads its own writes). The window does not weaken durability: a row is
in the journal before ``record`` returns, and the journal keeps it until it is committed. Retention deletes rows older than ``retention_days``.
Key material never reaches a row; prompt and response text only for keys with
``log_prompts``.

Every queued row is first appended to a local journal (gateway/journal.py) when one is
given, so a row is on disk before its answer completes and survives a SIGKILL; the journal
left by a dead process is written to the database at start (:meth:`RequestLog.replay`). A
stream gets its row when the lane takes it, before its 200 goes out (``error_type`` ``in_progress``),
and again at its end; a row still in progress at a restart is written as ``interrupted``. Writes replace a
row with the same id (delete and insert in one transaction), so replays are idempotent.

The queue holds at most ``log_queue_max`` rows: while the database is down rows wait there
(a batch is retried whole, with exponential backoff up to ``log_retry_max_s``) and rows
arriving at a full queue are dropped and counted, so an outage costs a bounded amount of
memory. A batch the database refuses while it is up is written row by row, and only the
rows it refuses are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Engine, Integer, delete, insert, select

from gateway.db import INT_MAX, INT_MIN, check_text, requests
from gateway.journal import Journal

__all__ = ["IN_PROGRESS", "INTERRUPTED", "RequestLog", "RequestQuery"]

log = logging.getLogger("strata.gateway")

_BATCH = 500
IN_PROGRESS = "in_progress"  # the error_type of a stream's row while it runs
INTERRUPTED = "interrupted"  # ... of one the gateway died during (written at the next start)


def _parse_time(v: Any) -> Any:
    """Unix seconds or ISO 8601 (a naive time is local)."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
        try:
            return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise ValueError(f"expected unix seconds or an ISO 8601 time, got {v!r}") from None
    return v


class RequestQuery(BaseModel):
    """Filters of ``GET /v1/admin/requests`` (query-string values)."""

    model_config = ConfigDict(extra="forbid")

    key_id: int | None = Field(None, ge=INT_MIN, le=INT_MAX)
    lane: str | None = None
    status: str | None = Field(None, pattern=r"^([1-5][0-9][0-9]|[1-5]xx)$", description="200, 429, 4xx, 5xx ...")
    since: float | None = None
    until: float | None = None
    limit: int = Field(100, ge=1, le=1000)

    @field_validator("since", "until", mode="before")
    @classmethod
    def _times(cls, v: Any) -> Any:
        return _parse_time(v)

    @field_validator("lane")
    @classmethod
    def _storable(cls, v: str | None) -> str | None:
        return None if v is None else check_text(v)


def _fit(row: dict[str, Any]) -> dict[str, Any]:
    """A row every backend stores as is: PostgreSQL refuses (and would lose the whole row for)
    NUL characters, lone surrogates, strings over a column's length and integers outside
    INTEGER, all of which a client can put in ``model``, the prompt or ``max_tokens``. NUL and
    surrogates become U+FFFD / '?', long strings are cut, integers saturate."""
    out = dict(row)
    for name, value in row.items():
        col = requests.c.get(name)
        if col is None:
            continue
        if isinstance(value, str):
            if "\x00" in value:
                value = value.replace("\x00", "\ufffd")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                value = value.encode("utf-8", "replace").decode("utf-8")
            length = getattr(col.type, "length", None)
            if length is not None and len(value) > length:
                value = value[:length]
            out[name] = value
        elif isinstance(value, int) and not isinstance(value, bool) and isinstance(col.type, Integer):
            out[name] = min(max(value, INT_MIN), INT_MAX)
    return out


class RequestLog:
    def __init__(self, engine: Engine, retention_days: float, *, max_queue: int = 10_000,
                 retry_max_s: float = 30.0, on_drop: Callable[[str, int], None] | None = None,
                 journal: Journal | None = None, batch_s: float = 0.0) -> None:
        self.engine = engine
        self.batch_s = batch_s  # how long a batch collects rows after its first one
        self.retention_s = retention_days * 86400.0
        self.max_queue = max_queue
        self.retry_max_s = retry_max_s
        self._on_drop = on_drop or (lambda reason, n: None)
        self.journal = journal
        # (journal row number, row), oldest first; a batch leaves only once it is written
        self._rows: deque[tuple[int, dict[str, Any]]] = deque()
        self._cond = threading.Condition()
        self._queued_total = 0  # rows ever accepted into the queue
        self._done_total = 0  # rows ever taken off it (written, or refused by the database)
        self._urgent = 0  # flush() wants rows up to this count written now: the batch window is cut short
        self._stop = False
        self._thread = threading.Thread(target=self._writer, name="strata-gateway-log", daemon=True)
        self.dropped = 0  # rows lost: queue full or refused by the database
        self.outage = False  # the last write attempt found the database unavailable
        self.attempts = 0  # INSERT statements tried (one per batch; row by row only for a refused batch)

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._rows)

    def record(self, row: dict[str, Any]) -> None:
        with self._cond:
            if len(self._rows) >= self.max_queue:
                self._drop("queue_full", 1)
                return
            seq = self.journal.append(row, in_progress=row.get("error_type") == IN_PROGRESS) \
                if self.journal is not None else 0
            self._rows.append((seq, row))
            self._queued_total += 1
            self._cond.notify_all()

    def _drop(self, reason: str, n: int) -> None:
        with self._cond:
            self.dropped += n
        self._on_drop(reason, n)

    def _wait_written(self, target: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done_total >= target, timeout)

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every row queued so far has been written (False after ``timeout``)."""
        with self._cond:
            target = self._queued_total
            self._urgent = max(self._urgent, target)
            self._cond.notify_all()
        return await asyncio.to_thread(self._wait_written, target, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (one attempt), then stop the writer (blocking)."""
        if self._thread.is_alive():
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join(timeout)
        if self.journal is not None:
            with self._cond:
                empty = not self._rows
            self.journal.close(all_committed=empty and not self._thread.is_alive())

    def replay(self) -> int:
        """Write what the journal of a process that died still holds (blocking, before ``start``); the rows
        written. A stream's row still in progress is written as interrupted. Raises when the database refuses."""
        if self.journal is None:
            return 0
        rows = self.journal.replay()
        for row in rows:
            if row.get("error_type") == IN_PROGRESS:
                row["error_type"] = INTERRUPTED
        for i in range(0, len(rows), _BATCH):
            self._upsert(rows[i:i + _BATCH])
        self.journal.forget_old()
        return len({r["id"] for r in rows})

    def _writer(self) -> None:
        delay = 0.0
        while True:
            with self._cond:
                if delay:  # backing off: only close() cuts the pause short
                    self._cond.wait_for(lambda: self._stop, timeout=delay)
                else:
                    self._cond.wait_for(lambda: bool(self._rows) or self._stop)
                    if self.batch_s > 0 and not self._stop:  # collect a batch (a flush or a full batch ends it)
                        self._cond.wait_for(lambda: self._stop or len(self._rows) >= _BATCH or
                                            self._urgent > self._done_total, timeout=self.batch_s)
                stopping = self._stop
                batch = list(itertools.islice(self._rows, _BATCH))
            if not batch:
                if stopping:
                    return
                continue
            taken = self._write([row for _, row in batch])
            if taken and self.journal is not None:
                self.journal.committed(batch[taken - 1][0])
            with self._cond:
                for _ in range(taken):
                    self._rows.popleft()
                self._done_total += taken
                self._cond.notify_all()
            if taken:
                delay = 0.0
                continue
            if stopping:  # the database is down and we are told to stop: what is queued is lost
                with self._cond:
                    n = len(self._rows)
                    self._rows.clear()
                    self._done_total += n
                    self._cond.notify_all()
                self._drop("shutdown", n)
                log.error("request log: %d row(s) lost at shutdown: the database is unavailable", n)
                return
            delay = min(self.retry_max_s, max(0.5, delay * 2))

    def _database_up(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(select(1))
            return True
        except Exception:
            return False

    def _write(self, rows: list[dict[str, Any]]) -> int:
        """Write ``rows`` (oldest first); the number taken off the queue (0: the database is down)."""
        self.attempts += 1
        try:
            self._upsert(rows)
        except Exception as e:  # the log must never take the gateway down
            if not self._database_up():
                if not self.outage:
                    self.outage = True
                    # the engine hides bound parameters: prompt text never reaches the server log
                    log.error("request log: the database is unavailable (%s: %s); keeping up to %d row(s) and "
                              "retrying", type(e).__name__, str(e).splitlines()[0], self.max_queue)
                return 0
            if len(rows) > 1:  # the database is up and refused this batch: one bad row must not cost the rest
                for i, row in enumerate(rows):
                    if self._write([row]) == 0:
                        return i
                return len(rows)
            self._drop("rejected", 1)
            log.error("request log: a row was lost: %s: %s", type(e).__name__, str(e).splitlines()[0])
            return 1
        if self.outage:
            self.outage = False
            log.warning("request log: the database is back; writing the queued rows")
        return len(rows)

    def _upsert(self, rows: list[dict[str, Any]]) -> None:
        """Write ``rows``, each replacing an earlier version of itself (a stream's row in progress, a replay)."""
        latest = {r["id"]: r for r in rows}  # one id twice in a batch: its last version
        with self.engine.begin() as conn:
            conn.execute(delete(requests).where(requests.c.id.in_(list(latest))))
            conn.execute(insert(requests), [_fit(r) for r in latest.values()])

    # ------------------------------------------------------------ blocking queries (worker threads)
    def purge(self, now: float | None = None) -> int:
        cutoff = (time.time() if now is None else now) - self.retention_s
        with self.engine.begin() as conn:
            return conn.execute(delete(requests).where(requests.c.time < cutoff)).rowcount or 0

    def query(self, q: RequestQuery) -> list[dict[str, Any]]:
        stmt = select(requests)
        if q.key_id is not None:
            stmt = stmt.where(requests.c.key_id == q.key_id)
        if q.lane is not None:
            stmt = stmt.where(requests.c.lane == q.lane)
        if q.status is not None:
            if q.status.endswith("xx"):
                lo = int(q.status[0]) * 100
                stmt = stmt.where(requests.c.status >= lo, requests.c.status < lo + 100)
            else:
                stmt = stmt.where(requests.c.status == int(q.status))
        if q.since is not None:
            stmt = stmt.where(requests.c.time >= q.since)
        if q.until is not None:
            stmt = stmt.where(requests.c.time < q.until)
        stmt = stmt.order_by(requests.c.time.desc()).limit(q.limit)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(stmt)]
