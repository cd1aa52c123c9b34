"""Hostile clients against the real supervisord stack (the repo's process table, real lanes, the real gateway
process): half-sent headers, crowds of idle connections, slow bodies, a stream whose client stops reading, the
gateway's own open-file limit and umask, and a SIGKILL of the gateway under load (the request log keeps every
answered request; SQLite, and PostgreSQL when STRATA_TEST_PG_URL is set). Short deadlines are set through the
gateway program's environment."""

from __future__ import annotations

import json
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.gateway_crash import check_log, kill_under_load
from tests.http_helpers import wait_until
from tests.integration.conftest import ADMIN_KEY, REPO, Stack, start_stack
from tests.pg import fresh_schema, server_url

HEADER_TIMEOUT_S = 2.0
PER_ADDRESS = 12
SETTINGS = {"HEADER_TIMEOUT_S": HEADER_TIMEOUT_S, "BODY_TIMEOUT_S": 2.0, "KEEPALIVE_TIMEOUT_S": 3.0,
            "STREAM_WRITE_TIMEOUT_S": 2.0, "MAX_CONNECTIONS_PER_ADDRESS": PER_ADDRESS, "MAX_CONNECTIONS": 64,
            "SEND_BUFFER_BYTES": 16384}


def _settings(text: str, **more: str) -> str:
    """The gateway program's environment gains the test's deadlines and caps (STRATA_GATEWAY_* overrides)."""
    anchor = f'environment=PYTHONPATH="{REPO}",PYTHONUNBUFFERED="1" ; (default none)'
    assert anchor in text, "supervisord.conf's [program:gateway] environment line changed"
    # '%' is supervisord's expansion character
    extra = "".join(f',STRATA_GATEWAY_{k}="{str(v).replace("%", "%%")}"' for k, v in {**SETTINGS, **more}.items())
    return text.replace(anchor, anchor.replace(' ; (default none)', extra), 1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(tmp_path_factory.mktemp("hostile"), edit_config=_settings) as st:
        yield st


def _call(stack: Stack, method: str, path: str, key: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(stack.gateway_url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _key(stack: Stack, **spec: Any) -> str:
    status, body = _call(stack, "POST", "/v1/admin/keys", ADMIN_KEY, {"name": "hostile", "limits": {"rpm": None},
                                                                     **spec})
    assert status == 201, body
    return body["key"]


def _metrics(url: str) -> dict[str, float]:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _connect(stack: Stack, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: the advertised window stays this small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", stack.ports["gateway"]))
    return s


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(the server closed ``s`` within ``seconds``, what it sent before)."""
    deadline = time.monotonic() + seconds
    got = b""
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def test_half_sent_headers_are_closed_in_bounded_time_and_keyed_clients_get_in(stack: Stack) -> None:
    key = _key(stack)
    before = _metrics(stack.gateway_url)
    t0 = time.monotonic()
    slow = []
    for _ in range(3 * PER_ADDRESS):  # three times the address's cap: newcomers evict the oldest
        s = _connect(stack)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow.append(s)
    # a keyed client from the same address, while the cap is full of half-sent requests
    status, body = _call(stack, "GET", "/v1/models", key, timeout=10)
    assert status == 200 and body["data"], body
    for s in slow:  # every one is closed: by eviction or by the header deadline (408 where it can be sent)
        closed, got = _closed_within(s, HEADER_TIMEOUT_S + 3 - (time.monotonic() - t0) + 2)
        assert closed, "a connection with half-sent headers is still open"
        assert got == b"" or got.startswith(b"HTTP/1.1 408 ") or got.startswith(b"HTTP/1.1 503 "), got[:80]
        s.close()
    assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 8
    m = _metrics(stack.gateway_url)
    closed = sum(m.get(f'strata_gateway_connections_closed_total{{reason="{r}"}}', 0) -
                 before.get(f'strata_gateway_connections_closed_total{{reason="{r}"}}', 0)
                 for r in ("evicted", "header_timeout"))
    assert closed >= 3 * PER_ADDRESS
    assert m['strata_gateway_connections_closed_total{reason="evicted"}'] >= 2 * PER_ADDRESS - 1
    wait_until(lambda: _metrics(stack.gateway_url)["strata_gateway_connections_open"], lambda n: n <= 2, 10,
                "open connections back to the scrape's own")


def test_a_slow_body_gets_408_and_its_connection_closed(stack: Stack) -> None:
    key = _key(stack)
    s = _connect(stack)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\"")
    t0 = time.monotonic()
    closed, got = _closed_within(s, 10)
    s.close()
    assert closed and got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b'"request_timeout"' in got
    assert time.monotonic() - t0 < 6


def test_idle_keepalive_connection_is_closed(stack: Stack) -> None:
    s = _connect(stack)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.monotonic()
    closed, got = _closed_within(s, 10)
    s.close()
    assert got.startswith(b"HTTP/1.1 200 ") and closed
    assert 2.5 < time.monotonic() - t0 < 8  # keepalive_timeout_s = 3


def test_a_stream_whose_client_stops_reading_is_cut_and_its_slots_freed(stack: Stack) -> None:
    key = _key(stack, max_concurrent=1)
    before = {name: _metrics(stack.url(name)) for name in ("lane_a", "lane_b")}
    gw_before = _metrics(stack.gateway_url)
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a very long story."}], "stream": True,
                       "max_tokens": 1500, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()
    s = _connect(stack, rcvbuf=4096)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 0, 0))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    # the client never reads: the gateway's buffers fill, its write deadline passes, it hangs up
    wait_until(lambda: _metrics(stack.gateway_url)['strata_gateway_connections_closed_total{reason="stream_stalled"}'],
                lambda n: n > gw_before['strata_gateway_connections_closed_total{reason="stream_stalled"}'], 90,
                "the stalled stream is cut")
    s.close()

    def lanes() -> list[tuple[int, float, float]]:
        status, data = _call(stack, "GET", "/v1/admin/lanes", ADMIN_KEY)
        out = []
        for lane in data["data"]:
            m = _metrics(stack.url("lane_" + lane["name"]))
            out.append((lane["in_flight"], m["strata_requests_running"],
                        m['strata_requests_total{finish_reason="abort"}'] -
                        before["lane_" + lane["name"]]['strata_requests_total{finish_reason="abort"}']))
        return out

    state = wait_until(lanes, lambda v: all(f == 0 and r == 0 for f, r, _ in v), 30, "lanes idle")
    assert sum(a for _, _, a in state) == 1, state  # the lane request was aborted, not run to its end
    status, answer = _call(stack, "POST", "/v1/chat/completions", key,
                           {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert status == 200, answer  # the key's one concurrency slot is free again


def test_the_gateway_raises_its_open_file_limit(stack: Stack) -> None:
    pid = int(stack.ctl("pid", "gateway").stdout.strip())
    limits = Path(f"/proc/{pid}/limits").read_text()
    line = next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard, line  # max_open_files unset: the soft limit is raised to the hard one
    log = (stack.log_dir / "gateway.log").read_text()
    assert f"open files up to {soft}" in log


KILLS = 10  # bench.gateway_crash runs the same with 100 (docs/benchmarks.md)


def test_sigkill_under_load_loses_no_answered_request(stack: Stack) -> None:
    """Clients chat (plain and streaming) while the gateway process is killed with SIGKILL, again and again, each
    time with a stream in flight; supervisord starts it again. Every answer a client received has its row, a
    stream a kill cut is logged as interrupted, no row is left in progress."""
    _sigkill_under_load(stack, f"sqlite:///{stack.dir / 'var' / 'gateway.db'}", KILLS)


def test_sigkill_with_postgresql(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same with the request log in PostgreSQL (STRATA_TEST_PG_URL; skipped without it, as tests/pg.py)."""
    with fresh_schema(server_url("the request log after a SIGKILL"), "strata_sigkill") as (url, _, _), \
            start_stack(tmp_path_factory.mktemp("pg"), edit_config=lambda t: _settings(t, DB_URL=url)) as st:
        _sigkill_under_load(st, url, KILLS // 2)


def _sigkill_under_load(stack: Stack, db_url: str, kills: int) -> None:
    key = _key(stack)
    since = time.time() - 1
    run = kill_under_load(stack, key, kills)
    assert run["kills"] == kills
    assert sum(r["streams_in_flight"] for r in run["rounds"]) >= kills // 2  # most kills cut a stream
    result = check_log(stack, db_url, run["answered"], since)
    assert not result["missing"], f"{len(result['missing'])} of {result['answered']} answered requests have no row"
    assert not result["whole_not_complete"] and not result["cut_wrong"] and not result["in_progress_left"], result
    assert result["streams_cut"] and result["cut_interrupted"] >= result["streams_cut"] - 1, result
    assert result["restarts_that_replayed"] >= kills, result
    assert result["ok"]


def test_files_are_private_and_metrics_need_the_admin_key(stack: Stack) -> None:
    pid = int(stack.ctl("pid", "gateway").stdout.strip())
    status = Path(f"/proc/{pid}/status").read_text()
    assert "Umask:\t0077" in status  # supervisord starts it with 022
    var = stack.dir / "var"
    for path in [var / "gateway.db", *var.glob("request-journal-*"), *var.glob("request-journal-*/*")]:
        mode = path.stat().st_mode & 0o777
        assert mode in (0o600, 0o700), (path, oct(mode))
    try:
        urllib.request.urlopen(stack.gateway_url + "/metrics", timeout=10)
        raise AssertionError("/metrics answered without a key")
    except urllib.error.HTTPError as e:
        assert e.code == 401
    assert "strata_gateway_connections_open" in _metrics(stack.gateway_url)
