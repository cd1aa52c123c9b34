"""The request log's local journal: every row is on disk before its answer completes.

The database writer works in batches on its own thread, so a row queued for it is lost when
the process dies (SIGKILL, OOM, a power cut of the process). Each row is therefore first
appended to a journal file here, one JSON line, with one ``write`` (no fsync: what the kernel
holds survives the process; a machine crash may lose the last moments, as the database's own
``synchronous=NORMAL`` may). When the writer has committed rows, whole segments whose rows are
all in the database are deleted. At start the gateway reads what is left (:meth:`replay`),
writes it to the database (a row id seen twice keeps its last version) and starts afresh.

A stream's row is appended as in progress when it starts and again when it ends. Its first version
may be committed, and its segment deleted, long before the end; a crash in between would leave the
database saying "in progress" with nothing in the journal to say otherwise. So the latest line of
every row still in progress is kept in the journal: before a segment holding one goes, the line is
written again into the current segment, and the next start writes such rows as interrupted.

Files are private (0700 directory, 0600 segments) whatever the umask: rows may hold prompt
text for keys with ``log_prompts``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["Journal", "JournalBusy"]

log = logging.getLogger("strata.gateway")

_SEGMENT_BYTES = 4 << 20


class JournalBusy(RuntimeError):
    """The journal directory is locked by another live process."""


class Journal:
    def __init__(self, directory: Path, segment_bytes: int = _SEGMENT_BYTES) -> None:
        self.dir = directory
        self.segment_bytes = segment_bytes
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        # one process per journal: another gateway replaying (and deleting) this one's live segments would lose rows
        self._lock_fd = os.open(directory / "lock", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise JournalBusy(f"another gateway uses the request-log journal {directory}; give each gateway its own "
                              "log_journal_dir") from None
        self._lock = threading.Lock()
        self.seq = 0  # rows appended by this process
        self._fd = -1
        self._size = 0
        self._closed: list[tuple[Path, int]] = []  # full segments and the last row number each holds
        self._path: Path | None = None
        self._live: dict[str, tuple[Path, bytes]] = {}  # rows in progress: the segment of their latest line, the line
        self._carried = 0  # bytes of the current segment that are such lines written again
        self._old = sorted(directory.glob("segment-*.jsonl"))  # left by an earlier process: replay() reads them
        self._next = 1 + max((int(p.stem.split("-")[1]) for p in self._old), default=0)

    def _open(self) -> None:
        self._path = self.dir / f"segment-{self._next:012d}.jsonl"
        self._next += 1
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = 0
        self._carried = 0

    def _write(self, line: bytes) -> Path:
        if self._fd < 0:
            self._open()
        assert self._path is not None
        os.write(self._fd, line)
        self._size += len(line)
        return self._path

    def append(self, row: dict[str, Any], in_progress: bool = False) -> int:
        """Write one row (any thread); its number, for :meth:`committed`. ``in_progress``: a later version of the
        row will follow (a stream's end), and until it does this line stays in the journal."""
        line = (json.dumps(row, ensure_ascii=True, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            path = self._write(line)
            rid = row.get("id")
            if in_progress and isinstance(rid, str):
                self._live[rid] = (path, line)
            else:
                self._live.pop(rid, None)  # type: ignore[arg-type]
            self.seq += 1
            if self._size >= self.segment_bytes:
                os.close(self._fd)
                self._closed.append((path, self.seq))
                self._fd = -1
            return self.seq

    def _carry(self, path: Path) -> Path:
        """Write again into the current segment the lines of rows still in progress that ``path``, a segment whose
        rows are committed, holds (lock held); ``path`` may then be deleted."""
        for rid, (where, line) in list(self._live.items()):
            if where == path:
                self._live[rid] = (self._write(line), line)
                self._carried += len(line)
        return path

    def _unlink(self, path: Path) -> None:
        self._carry(path).unlink(missing_ok=True)

    @property
    def in_progress(self) -> int:
        """Rows whose latest line says they are in progress."""
        return len(self._live)

    def committed(self, seq: int) -> None:
        """Every row up to number ``seq`` is in the database: full segments holding only such rows go."""
        done: list[Path] = []
        with self._lock:
            while self._closed and self._closed[0][1] <= seq:
                path, _ = self._closed.pop(0)
                done.append(self._carry(path))
            if self._fd >= 0 and seq >= self.seq and self._size - self._carried >= 64 * 1024:
                # everything is written: start a new segment rather than let a quiet one grow
                os.close(self._fd)
                self._fd = -1
                assert self._path is not None
                done.append(self._carry(self._path))
        # deleted outside the lock: an unlink waits on the file system, and append (the event loop) takes the lock
        for path in done:
            path.unlink(missing_ok=True)

    def replay(self) -> list[dict[str, Any]]:
        """The rows an earlier process journaled (oldest first; a torn last line is skipped)."""
        rows: list[dict[str, Any]] = []
        for path in self._old:
            try:
                data = path.read_bytes()
            except OSError as e:
                log.error("request log journal: cannot read %s: %s", path, e)
                continue
            for line in data.split(b"\n"):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:  # the process died in the middle of this write
                    continue
                if isinstance(row, dict) and isinstance(row.get("id"), str):
                    rows.append(row)
        return rows

    def forget_old(self) -> None:
        """The replayed rows are in the database: their segments go."""
        for path in self._old:
            path.unlink(missing_ok=True)
        self._old = []

    def close(self, all_committed: bool) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
                if self._path is not None:
                    self._closed.append((self._path, self.seq))
            if all_committed:
                for path, _ in self._closed:
                    self._unlink(path)
                self._closed = []
                if self._fd >= 0:  # it holds only rows still in progress: the next start writes them as interrupted
                    os.close(self._fd)
                    self._fd = -1
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the lock
                self._lock_fd = -1
