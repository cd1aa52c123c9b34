"""The request log ("infer store"): one row per authenticated generation request.

Rows are queued by the event loop (``record`` never blocks) and written in batches by one
writer thread; ``flush`` waits until everything queued so far is written (the admin query
does so, so it reads its own writes). Retention deletes rows older than ``retention_days``.
Key material never reaches a row; prompt and response text only for keys with
``log_prompts``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Engine, Integer, delete, insert, select

from gateway.db import INT_MAX, INT_MIN, check_text, requests

__all__ = ["RequestLog", "RequestQuery"]

log = logging.getLogger("strata.gateway")

_BATCH = 500


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
    def __init__(self, engine: Engine, retention_days: float) -> None:
        self.engine = engine
        self.retention_s = retention_days * 86400.0
        self._q: queue.SimpleQueue[dict[str, Any] | threading.Event | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._writer, name="strata-gateway-log", daemon=True)
        self.dropped = 0  # rows lost to database errors

    def start(self) -> None:
        self._thread.start()

    def record(self, row: dict[str, Any]) -> None:
        self._q.put(row)

    async def flush(self, timeout: float = 5.0) -> bool:
        marker = threading.Event()
        self._q.put(marker)
        return await asyncio.to_thread(marker.wait, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer (blocking)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout)

    def _writer(self) -> None:
        stop = False
        while not stop:
            items = [self._q.get()]
            while len(items) < _BATCH:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            rows = [i for i in items if isinstance(i, dict)]
            if rows:
                self._write(rows)
            for i in items:
                if isinstance(i, threading.Event):
                    i.set()
                elif i is None:
                    stop = True

    def _write(self, rows: list[dict[str, Any]]) -> None:
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(requests), [_fit(r) for r in rows])
        except Exception as e:  # the log must never take the gateway down
            if len(rows) > 1:
                for row in rows:  # one bad row must not cost the whole batch
                    self._write([row])
                return
            self.dropped += 1
            # the engine hides bound parameters: prompt text never reaches the server log
            log.error("request log: a row was lost: %s: %s", type(e).__name__, str(e).splitlines()[0])

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
