"""SIGKILL of the gateway under load, many times over: every answer a client received must have its row in
the request log, and every stream a kill cut must be logged as interrupted (issue 31).

    PYTHONPATH=. .venv/bin/python -m bench.gateway_crash                       # 100 kills, SQLite
    PYTHONPATH=. .venv/bin/python -m bench.gateway_crash --db-url "$PG_URL"    # the request log in PostgreSQL
    PYTHONPATH=. .venv/bin/python -m bench.gateway_crash --kills 20 --json var/bench/gateway_crash.json

It starts the repository's supervisord stack in a temp folder (bench/harness/stack.py: both lanes on one core
each, the gateway with its default protections and journal), creates a key, and runs clients that chat
without pause: ``--plain`` threads of short non-streamed requests and ``--streams`` threads of long streamed
ones. Each round waits until the gateway it is about to kill has answered ``--answers`` plain requests, has
been RUNNING for longer than supervisord's ``startsecs`` (an earlier death is a failed start, and three in a
row leave it FATAL) and has a stream in flight, waits a random 0-0.3 s more (so kills land anywhere in a
request's life: before its row, between the row and the answer, in a database commit, in a segment rotation),
then kills it with SIGKILL; supervisord starts it again, and the round ends when it is ready.

After the last round the clients stop and the request log is read from the database itself. Checked:

* every request whose answer a client received (a 200 read whole, or a stream's status line) has its row;
* a request answered whole (a plain 200, or a stream that reached ``[DONE]``) has a complete row;
* a stream a kill cut is ``interrupted`` (or complete: the kill fell between its last row and ``[DONE]``);
* no row of the run is left ``in_progress``.

``--db-url`` names a PostgreSQL database (``postgresql+psycopg://...``) for the request log; the gateway creates
its tables there if missing, and only this run's rows are checked. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import machine_info, write_json
from bench.harness.stack import Stack, throwaway_stack

__all__ = ["Load", "check_log", "kill_under_load", "main"]

STARTSECS = 3.0  # supervisord.conf's [program:gateway] startsecs
CUT = "stream_started"  # what a client saw of a stream it got no [DONE] for


@dataclass
class Load:
    """Client threads chatting through the gateway until :meth:`stop`; ``got`` holds (request id, what the client
    saw): ``plain`` (a 200 read whole), ``stream_started`` (a stream's 200) and ``stream_done`` (its ``[DONE]``)."""

    host: str
    port: int
    key: str
    plain: int = 4
    streams: int = 2
    got: list[tuple[str, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _post(self, body: dict[str, Any]) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        return conn.getresponse()

    def _saw(self, rid: str, what: str) -> None:
        with self._lock:
            self.got.append((rid, what))

    def _plain(self) -> None:
        while not self._stop.is_set():
            try:
                r = self._post({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
                r.read()
                if r.status == 200:
                    self._saw(r.headers["X-Request-Id"], "plain")
            except (OSError, http.client.HTTPException):
                time.sleep(0.05)  # the gateway is down: supervisord is starting it again

    def _stream(self) -> None:
        while not self._stop.is_set():
            try:
                r = self._post({"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 120,
                                "stream": True})
                if r.status != 200:
                    r.read()
                    continue
                rid = r.headers["X-Request-Id"]
                self._saw(rid, CUT)
                for line in r:
                    if line.strip() == b"data: [DONE]":
                        self._saw(rid, "stream_done")
            except (OSError, http.client.HTTPException):
                time.sleep(0.05)

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._plain, daemon=True) for _ in range(self.plain)] + \
            [threading.Thread(target=self._stream, daemon=True) for _ in range(self.streams)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def snapshot(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.got)

    def plain_answers(self) -> int:
        return sum(k == "plain" for _, k in self.snapshot())

    def in_flight(self) -> set[str]:
        """Streams started and not (yet) done."""
        seen = self.snapshot()
        return {rid for rid, k in seen if k == CUT} - {rid for rid, k in seen if k == "stream_done"}


def _gateway_pid(st: Stack) -> int:
    out = st.ctl("pid", "gateway").stdout.strip()
    return int(out) if out.isdigit() else 0


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _running(st: Stack) -> bool:
    return "RUNNING" in st.ctl("status", "gateway").stdout


def _wait(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)


def kill_under_load(st: Stack, key: str, kills: int, *, answers: int = 5, plain: int = 4, streams: int = 2,
                    seed: int = 0, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """``kills`` rounds of load, then SIGKILL of the gateway (see the module's doc); the clients' view (``answered``:
    request id -> what each saw) and per-round figures. The stack's gateway must be ready."""
    rng = random.Random(seed)
    load = Load("127.0.0.1", st.ports["gateway"], key, plain, streams)
    rounds: list[dict[str, Any]] = []
    was_cut: set[str] = set()  # streams an earlier kill cut
    load.start()
    started = time.monotonic()  # when the gateway about to be killed became ready
    try:
        for i in range(kills):
            n0 = len(load.snapshot())
            target = load.plain_answers() + answers
            _wait("answers before the kill", lambda t=target: load.plain_answers() >= t, 120)  # type: ignore[misc]
            # it became ready after supervisord started it: startsecs after readiness is past startsecs after start
            time.sleep(max(0.0, started + STARTSECS + 0.2 - time.monotonic()))
            with contextlib.suppress(TimeoutError):  # rarely none: kill anyway
                _wait("a stream in flight", lambda: bool(load.in_flight() - was_cut), 30)
            time.sleep(rng.uniform(0.0, 0.3))
            old = _gateway_pid(st)
            if not _running(st):
                raise RuntimeError(f"the gateway is not RUNNING before kill {i + 1}: {st.ctl('status').stdout}")
            cut = load.in_flight() - was_cut
            was_cut.update(cut)
            t_kill = time.monotonic()
            os.kill(old, signal.SIGKILL)
            _wait("the killed gateway gone", lambda o=old: not _alive(o), 30, 0.02)  # type: ignore[misc]
            # polled over HTTP, not supervisorctl (a Python start per call): with the old process gone, the next
            # ready answer is the new one's
            _wait("supervisord starts the gateway again, ready", st.gateway_ready, 120, 0.1)
            started = time.monotonic()
            new = _gateway_pid(st)
            if new in (0, old):
                raise RuntimeError(f"after kill {i + 1} the gateway's pid is {new} (was {old})")
            rounds.append({"answers": len(load.snapshot()) - n0, "streams_in_flight": len(cut),
                           "restart_s": round(started - t_kill, 3)})
            say(f"kill {i + 1}/{kills}: {rounds[-1]['answers']} answers before it, {len(cut)} stream(s) in flight, "
                f"ready again after {rounds[-1]['restart_s']:.2f}s")
        # a last stretch of answers after the last restart: their rows come from the live writer, not a replay
        target = load.plain_answers() + answers
        _wait("answers after the last restart", lambda: load.plain_answers() >= target, 120)
    finally:
        load.stop()
    answered: dict[str, list[str]] = {}
    for rid, what in load.snapshot():
        answered.setdefault(rid, []).append(what)
    return {"kills": len(rounds), "rounds": rounds, "answered": answered}


def _rows(db_url: str, ids: set[str], since: float) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The rows of ``ids``, and the ids of every row since ``since`` still in progress."""
    from sqlalchemy import create_engine, select

    from gateway.db import requests

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = {r.id: dict(r._mapping) for r in conn.execute(
                select(requests.c.id, requests.c.status, requests.c.error_type, requests.c.stream)
                .where(requests.c.time >= since))}
    finally:
        engine.dispose()
    stuck = sorted(rid for rid, r in rows.items() if r["error_type"] == "in_progress")
    return {rid: r for rid, r in rows.items() if rid in ids}, stuck


def check_log(st: Stack, db_url: str, answered: dict[str, list[str]], since: float) -> dict[str, Any]:
    """Compare what the clients saw with the request log (the database itself, after the gateway's writer has
    flushed: the admin query waits for it)."""
    from deploy.stack import get_json

    get_json(st.gateway_url + "/v1/admin/requests?limit=1", {"Authorization": f"Bearer {st.admin_key}"}, 30)
    rows, stuck = _rows(db_url, set(answered), since)
    missing = sorted(rid for rid in answered if rid not in rows)
    whole = [rid for rid, seen in answered.items() if "plain" in seen or "stream_done" in seen]
    cut = [rid for rid, seen in answered.items() if seen == [CUT]]
    not_complete = sorted(rid for rid in whole if rid in rows and (rows[rid]["status"] != 200
                                                                   or rows[rid]["error_type"] is not None))
    cut_rows = [rows[rid] for rid in cut if rid in rows]
    interrupted = sum(r["error_type"] == "interrupted" for r in cut_rows)
    cut_complete = sum(r["error_type"] is None for r in cut_rows)
    wrong_cut = sorted(r["id"] for r in cut_rows if r["error_type"] not in ("interrupted", None))
    replays = (st.log_dir / "gateway.log").read_text(errors="replace").count(
        "row(s) from the journal of a gateway that stopped")
    ok = not missing and not not_complete and not wrong_cut and not stuck
    return {"ok": ok, "answered": len(answered), "answered_whole": len(whole), "streams_cut": len(cut),
            "cut_interrupted": interrupted, "cut_complete": cut_complete, "missing": missing,
            "whole_not_complete": not_complete, "cut_wrong": wrong_cut, "in_progress_left": stuck,
            "restarts_that_replayed": replays}


@contextlib.contextmanager
def _stack(db_url: str | None) -> Iterator[tuple[Stack, str]]:
    with tempfile.TemporaryDirectory(prefix="strata-crash-") as d:
        tmp = Path(d)
        gateway = {"db_url": db_url} if db_url else {}
        with throwaway_stack(tmp, kv_tokens=2048, gateway=gateway) as st:
            yield st, db_url or f"sqlite:///{tmp / 'var' / 'gateway.db'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_crash", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=100, help="SIGKILLs of the gateway (default 100)")
    p.add_argument("--db-url", help="the request log's database (a PostgreSQL URL; default: the stack's SQLite)")
    p.add_argument("--answers", type=int, default=5, help="plain answers each gateway gives before its kill (5)")
    p.add_argument("--plain", type=int, default=4, help="client threads sending plain requests (4)")
    p.add_argument("--streams", type=int, default=2, help="client threads sending long streams (2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random delays before each kill")
    p.add_argument("--json", type=Path, help="write the summary and every round here")
    args = p.parse_args(argv)
    t0 = time.time()
    with _stack(args.db_url) as (st, db_url):
        key = st.create_key("crash", unlimited=True)
        since = time.time() - 1
        run = kill_under_load(st, key, args.kills, answers=args.answers, plain=args.plain, streams=args.streams,
                              seed=args.seed, say=lambda m: print(m, flush=True))
        result = check_log(st, db_url, run["answered"], since)
    restarts = sorted(r["restart_s"] for r in run["rounds"])
    summary = {**result, "kills": run["kills"], "backend": "postgresql" if args.db_url else "sqlite",
               "restart_s_median": restarts[len(restarts) // 2] if restarts else None,
               "restart_s_max": restarts[-1] if restarts else None,
               "streams_in_flight_at_kills": sum(r["streams_in_flight"] for r in run["rounds"]),
               "wall_s": round(time.time() - t0, 1)}
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list) or v}, indent=1))
    print(f"{summary['kills']} kills ({summary['backend']}): {summary['answered']} answered requests, "
          f"{len(summary['missing'])} without a row; {summary['streams_cut']} streams cut "
          f"({summary['cut_interrupted']} interrupted, {summary['cut_complete']} complete), "
          f"{len(summary['in_progress_left'])} rows left in progress: {'PASS' if summary['ok'] else 'FAIL'}")
    if args.json:
        write_json(args.json, {"summary": summary, "rounds": run["rounds"], "machine": machine_info(),
                               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                          if k != "db_url"}})
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
