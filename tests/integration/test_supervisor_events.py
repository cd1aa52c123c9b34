"""deploy/supervisor_events.py: the event-listener protocol and the JSON lines, without supervisord
(test_supervisord.py covers it under the real one)."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

from tests.integration.conftest import REPO


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("supervisor_events", REPO / "deploy" / "supervisor_events.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ev = _load()


def _frame(eventname: str, payload: str, serial: int) -> bytes:
    body = payload.encode()
    header = (f"ver:3.0 server:supervisor serial:{serial} pool:lane_events poolserial:{serial} "
              f"eventname:{eventname} len:{len(body)}\n")
    return header.encode() + body


EXITED = "processname:lane_a groupname:lanes from_state:RUNNING expected:0 pid:2766"
BACKOFF = "processname:lane_b groupname:lanes from_state:STARTING tries:2"
FATAL = "processname:lane_b groupname:lanes from_state:BACKOFF"


def test_event_record_fields() -> None:
    now = datetime(2026, 11, 29, 20, 15, 2, 125000, tzinfo=UTC)
    rec = ev.event_record(ev.parse_tokens("ver:3.0 serial:21 eventname:PROCESS_STATE_EXITED len:71"), EXITED, now)
    assert rec == {"time": "2026-11-29T20:15:02.125+00:00", "event": "PROCESS_STATE_EXITED", "state": "EXITED",
                   "process": "lane_a", "group": "lanes", "from_state": "RUNNING", "pid": 2766, "expected": 0,
                   "tries": None, "serial": 21}
    rec = ev.event_record({"eventname": "PROCESS_STATE_BACKOFF"}, BACKOFF)
    assert rec["tries"] == 2 and rec["pid"] is None and rec["expected"] is None


def test_protocol_ready_result_ok(tmp_path: Path) -> None:
    stdin = io.BytesIO(_frame("PROCESS_STATE_EXITED", EXITED, 1) + _frame("PROCESS_STATE_BACKOFF", BACKOFF, 2)
                       + _frame("PROCESS_STATE_FATAL", FATAL, 3))
    stdout = io.BytesIO()
    out = tmp_path / "log" / "events.jsonl"
    assert ev.serve(stdin, stdout, ev.EventLog(out)) == 3
    # READY before each event, RESULT 2\nOK after it; one more READY before stdin closed
    assert stdout.getvalue() == b"READY\nRESULT 2\nOK" * 3 + b"READY\n"
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [(r["state"], r["process"], r["serial"]) for r in lines] == [
        ("EXITED", "lane_a", 1), ("BACKOFF", "lane_b", 2), ("FATAL", "lane_b", 3)]


def test_write_failure_still_acknowledged(tmp_path: Path) -> None:
    log = ev.EventLog(tmp_path / "events.jsonl")
    log.path = tmp_path  # a directory: every append fails
    stdout, stderr = io.BytesIO(), io.StringIO()
    assert ev.serve(io.BytesIO(_frame("PROCESS_STATE_FATAL", FATAL, 1)), stdout, log, stderr) == 1
    assert b"RESULT 2\nOK" in stdout.getvalue() and "cannot record PROCESS_STATE_FATAL" in stderr.getvalue()


def test_rotation(tmp_path: Path) -> None:
    log = ev.EventLog(tmp_path / "events.jsonl", max_bytes=400, backups=2)
    for i in range(12):
        log.append({"i": i, "pad": "x" * 80})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    assert all(p.stat().st_size <= 400 for p in tmp_path.iterdir())
    last = [json.loads(ln)["i"] for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert last[-1] == 11


def test_script_speaks_the_protocol(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    r = subprocess.run([sys.executable, str(REPO / "deploy" / "supervisor_events.py"), "--out", str(out)],
                       input=_frame("PROCESS_STATE_EXITED", EXITED, 7), capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"READY\nRESULT 2\nOKREADY\n"
    assert json.loads(out.read_text())["pid"] == 2766
