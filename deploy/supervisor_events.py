#!/usr/bin/env python3
"""supervisord event listener: one JSON line per process state event in an append-only file.

    [eventlistener:lane_events]
    command=.../python deploy/supervisor_events.py --out var/log/events.jsonl
    events=PROCESS_STATE_EXITED,PROCESS_STATE_BACKOFF,PROCESS_STATE_FATAL

The protocol (http://supervisord.org/events.html): write ``READY\\n`` on stdout; read one header
line from stdin (``ver:3.0 server:supervisor serial:21 pool:lane_events poolserial:10
eventname:PROCESS_STATE_EXITED len:71``); read exactly ``len`` bytes of payload
(``processname:lane_a groupname:lanes from_state:RUNNING expected:0 pid:2766``); answer
``RESULT 2\\nOK``; repeat. stdout carries nothing else; diagnostics go to stderr.

Each line written::

    {"time": "2026-11-29T20:15:02.125+00:00", "event": "PROCESS_STATE_EXITED", "state": "EXITED",
     "process": "lane_a", "group": "lanes", "from_state": "RUNNING", "pid": 2766, "expected": 0,
     "tries": null, "serial": 21}

``expected`` is 1 when the exit code is in the program's ``exitcodes``, 0 otherwise (a crash,
a SIGKILL); ``tries`` is set on BACKOFF. A line is written with one ``write`` on an
``O_APPEND`` descriptor and flushed before the OK, so readers never see half a line; the file
rotates at ``--max-bytes`` (``events.jsonl.1`` … ``.N``). The listener never blocks
supervisord: a failure to write is logged on stderr and the event is still acknowledged.

Only the standard library: it runs under the venv's python but needs none of Strata.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

__all__ = ["EventLog", "event_record", "main", "parse_tokens", "serve"]

_INT_FIELDS = ("pid", "expected", "tries", "serial", "poolserial")


def parse_tokens(text: str) -> dict[str, str]:
    """``"a:1 b:two"`` -> ``{"a": "1", "b": "two"}`` (supervisor's header / payload syntax)."""
    out: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition(":")
        if sep:
            out[key] = value
    return out


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def event_record(headers: dict[str, str], payload: str, now: datetime | None = None) -> dict[str, Any]:
    """The JSON object for one event (header + the payload's first line)."""
    body = parse_tokens(payload.split("\n", 1)[0])
    eventname = headers.get("eventname", "")
    when = (now or datetime.now(UTC)).isoformat(timespec="milliseconds")
    return {
        "time": when,
        "event": eventname,
        "state": eventname.removeprefix("PROCESS_STATE_") if eventname.startswith("PROCESS_STATE_") else None,
        "process": body.get("processname"),
        "group": body.get("groupname"),
        "from_state": body.get("from_state"),
        "pid": _int_or_none(body.get("pid")),
        "expected": _int_or_none(body.get("expected")),
        "tries": _int_or_none(body.get("tries")),
        "serial": _int_or_none(headers.get("serial")),
    }


class EventLog:
    """An append-only JSON-lines file with size-based rotation."""

    def __init__(self, path: Path, max_bytes: int = 10 * 1024 * 1024, backups: int = 3) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        path.parent.mkdir(parents=True, exist_ok=True)

    def _rotate(self) -> None:
        if self.backups <= 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(", ", ": ")) + "\n").encode()
        try:
            if self.max_bytes > 0 and self.path.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
        except FileNotFoundError:
            pass
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write on O_APPEND: lines never interleave
        finally:
            os.close(fd)


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def serve(stdin: IO[bytes], stdout: IO[bytes], log: EventLog, stderr: IO[str] = sys.stderr,
          max_events: int | None = None) -> int:
    """Run the listener loop until stdin closes (or ``max_events`` were handled); returns the count."""
    handled = 0
    while max_events is None or handled < max_events:
        stdout.write(b"READY\n")
        stdout.flush()
        line = stdin.readline()
        if not line:
            break  # supervisord closed our stdin: it is shutting down
        headers = parse_tokens(line.decode("utf-8", "replace"))
        try:
            length = int(headers.get("len", "0"))
            payload = _read_exact(stdin, length).decode("utf-8", "replace")
        except (ValueError, EOFError):
            print(f"lane_events: bad header or short payload: {line!r}", file=stderr, flush=True)
            break
        try:
            log.append(event_record(headers, payload))
        except Exception as e:  # a listener that dies or blocks stalls supervisord's event queue
            print(f"lane_events: cannot record {headers.get('eventname')}: {type(e).__name__}: {e}",
                  file=stderr, flush=True)
        stdout.write(b"RESULT 2\nOK")
        stdout.flush()
        handled += 1
    return handled


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="supervisord event listener: state events -> JSON lines")
    p.add_argument("--out", type=Path, required=True, help="the JSON-lines file to append to")
    p.add_argument("--max-bytes", type=int, default=10 * 1024 * 1024, help="rotate at this size (0: never)")
    p.add_argument("--backups", type=int, default=3, help="rotated files kept")
    args = p.parse_args(argv)
    # stopsignal=TERM: leave quietly (exit 0) instead of dying of the signal
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    serve(sys.stdin.buffer, sys.stdout.buffer, EventLog(args.out, args.max_bytes, args.backups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
