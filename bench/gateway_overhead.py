"""What the gateway adds to a request: the same streamed request straight to a lane and through
the gateway, alternating, in one run.

    PYTHONPATH=. .venv/bin/python -m bench.gateway_overhead                      # starts a lane + gateway
    PYTHONPATH=. .venv/bin/python -m bench.gateway_overhead -n 200 --json var/bench/gateway_overhead.json
    PYTHONPATH=. .venv/bin/python -m bench.gateway_overhead --lane-url http://127.0.0.1:8101 \\
        --gateway-url http://127.0.0.1:8080 --key sk-strata-...                  # a running stack

Without URLs it starts one lane (``python -m lanes``, the default model or ``--model``'s GGUF, 2048-token KV)
and the gateway (``python -m gateway`` with a temp config that keeps the deployed defaults, health polls every
1 s and every protection included, a temp SQLite database and a random admin
key in its environment) as real processes on free ports, creates a key with the keys CLI, and
stops both at the end. Each pair of samples sends the identical request (``max_tokens`` 8,
``temperature`` 0, same prompt, so the prefix cache makes both sides equal) once to the lane
and once through the gateway, in alternating order, over one keep-alive connection each.

Before the first pair it waits until the gateway's embedding model (document search and session
memory) has loaded (``/readyz`` ``retrieval`` no longer ``loading``): the gateway starts it in a child
process after it starts (tens of seconds here). The gateway's event loop no longer stalls meanwhile
(the child imports torch, not the gateway), but the child's load keeps a core busy, which on a small box
slows lane and gateway alike: a start-up cost, reported separately as ``retrieval_wait_s``, not the
per-request cost this measures. Where the embedding model's package is not installed (the device machine,
tools/gpu/gateway_overhead.sh) the gateway starts with retrieval ``off`` (its log says why) and there is nothing
to wait for. The measured request names no session and no collections: the plain path (auth, window precheck,
dispatch, relay), which neither documents nor session memory touch.

``--stages`` turns on the started gateway's ``trace_stages`` and reports the median time of each of its
stages and the lane's own TTFT for direct and relayed requests (from the two processes' logs), and joins them
to every measured pair by request id (the client, the gateway and the lane read the same monotonic clock):
each gateway request cut into segments (client -> gateway, gateway in, via the lane, relay, -> client), the
gateway's step-to-step times (median / p99), and the 5 worst pairs segment by segment, so a tail is traced
to where it grew; ``--control`` is an A/A run, both sides of every pair straight to the lane, whose
"added" figures are the method's own noise floor on the box at that moment;
``--compare NAME=VALUE`` starts a second gateway (B) with that config line in front of the same lane, and every pair
becomes a triple (direct, A, B, each of the 6 orders in turn): B's added TTFT against the same direct requests and
B - A triple by triple, an A/B of a setting at the same moments of a busy box;
``--count-via-lane`` starts the gateway with ``count_locally = false`` (the window precheck asks the
lane's ``/tokenize``), for an A/B of the precheck.

Reported: TTFT (request sent -> first content token read) and total time per request, for
both paths; the *added* TTFT = gateway - direct per pair (median, p95, p99) and the added
total time (median). Targets (issue 31): median added TTFT <= 3 ms, p99 <= 10 ms, both read
per pair: the p99 of the 300 (``-n``) differences, the stricter reading, since the two
requests of a pair meet the same moment of the box. Beside it, p99(gateway TTFT) - p99(direct
TTFT), the difference of the two tails, which is what a client population sees; on a shared
box a stall of the lane or of the machine that lands in one request of a pair moves the per-pair
p99 but not this one. Both are printed; the verdict reads the per-pair one.

Noise the gateway does not cause is kept out, not subtracted: ``--warmup`` pairs (default 20)
first (the lane's prefix cache, both connections, the gateway's first-use imports and caches),
the order alternates in every pair (direct first, then gateway first), and the client's own
garbage collector is off while it measures. When it started the processes it also reports
the CPU time the gateway process (every thread: event loop, request-log writer, health polls)
and the lane spent per request, read from /proc before and after the measured pairs: a figure
the load of other processes hardly moves.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import itertools
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.common import REPO_ROOT, machine_info, write_json
from bench.harness.stack import free_port

TARGET_MEDIAN_MS = 3.0
TARGET_P99_MS = 10.0
BODY = {"model": "strata-default", "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 8, "temperature": 0, "stream": True}


def _wait(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    """Until ``url`` answers 200; a started ``proc`` that exits first ends the run at once with its log's tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log is not None else []
            raise SystemExit(f"gateway_overhead: the process serving {url} exited ({proc.returncode}): "
                             + " | ".join(tail))
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.25)
    raise SystemExit(f"gateway_overhead: {url} not 200 after {timeout:.0f}s")


def wait_retrieval(gw_url: str, timeout: float) -> tuple[str, float]:
    """Wait until the gateway's embedding model is no longer loading; (its state, seconds waited)."""
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(gw_url + "/readyz", timeout=5) as r:
                state = str(json.loads(r.read()).get("retrieval", "off"))
        except urllib.error.HTTPError as e:  # 503 while no lane is ready: the body still says it
            state = str(json.loads(e.read() or b"{}").get("retrieval", "off"))
        if state != "loading":
            return state, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"gateway_overhead: the gateway's embedding model still loading after {timeout:.0f}s")
        time.sleep(0.25)


def lane_info(lane_url: str) -> dict[str, Any]:
    """What the lane says it serves and where it runs (``GET /v1/lane``): its model file, cores, engine threads,
    device and engine build; the JSON report keeps it beside the figures."""
    with urllib.request.urlopen(lane_url + "/v1/lane", timeout=10) as r:
        info = json.loads(r.read())
    return {k: info.get(k) for k in ("model", "cores", "threads", "device", "engine_build")}


def _local_count_ready(gateway_log: Path, timeout: float) -> str:
    """Wait until the started gateway has loaded the lane's tokenizer (its log says so); what counts prompts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "the window precheck counts prompts in the gateway" in gateway_log.read_text(errors="replace"):
            return "the gateway (the lane's tokenizer, loaded)"
        time.sleep(0.25)
    return "the lane's /tokenize (the gateway has not loaded the lane's tokenizer)"


def _event_loop(gateway_log: Path) -> str:
    """The started gateway's event loop, as its start-up line names it."""
    m = re.search(r"event loop (\w+)\)", gateway_log.read_text(errors="replace"))
    return m.group(1) if m else "unknown"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _env() -> dict[str, str]:
    """The started processes' environment: no lane or gateway settings of the caller's, the repository first on
    the import path and the caller's own entries after it (packages installed with ``--target``, as on the
    device machine: tools/gpu/gateway_overhead.sh)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_LANE_", "STRATA_GATEWAY_"))}
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", STRATA_LANE_KV_TOKENS="2048",
               STRATA_ADMIN_KEY=secrets.token_urlsafe(32))
    return env


def lane_env(lane_cores: str | None = None, model: Path | None = None) -> dict[str, str]:
    """The started lane's environment: ``_env()`` with its cores and model when given."""
    env = _env()
    if lane_cores:
        env["STRATA_LANE_CORES"] = lane_cores
    if model is not None:
        env["STRATA_LANE_MODEL"] = str(Path(model).resolve())
    return env


def start_stack(stack: ExitStack, tmp: Path, gateway_toml: str = "", lane_cores: str | None = None,
                pids: dict[str, int] | None = None, model: Path | None = None) -> tuple[str, str, str]:
    """One lane and the gateway as processes (``gateway_toml``: extra lines of its config; ``lane_cores``: the
    lane's ``cores``, e.g. ``auto`` as ``make run`` pins it; ``model``: the GGUF the lane serves, default the
    default model); returns (lane url, gateway url, user key) and puts the two processes' ids in ``pids``
    ("lane", "gateway")."""
    env = lane_env(lane_cores, model)
    lane_port = free_port()
    lane_log = open(tmp / "lane.log", "wb")
    stack.callback(lane_log.close)
    lane = subprocess.Popen([sys.executable, "-m", "lanes", "--lane", "a", "--port", str(lane_port)], env=env,
                            cwd=REPO_ROOT, stdout=lane_log, stderr=subprocess.STDOUT)
    stack.callback(_stop, lane)
    if pids is not None:
        pids["lane"] = lane.pid
    lane_url = f"http://127.0.0.1:{lane_port}"
    _wait(lane_url + "/health", 180, lane, tmp / "lane.log")
    gw_url, key = start_gateway(stack, tmp, lane_url, gateway_toml, pids, "gateway")
    return lane_url, gw_url, key


def start_gateway(stack: ExitStack, d: Path, lane_url: str, gateway_toml: str, pids: dict[str, int] | None,
                  name: str) -> tuple[str, str]:
    """A gateway process in front of ``lane_url`` with its own config, SQLite database, journal and log in ``d``
    (``gateway.log``); returns (its url, a user key) and puts its process id in ``pids[name]``."""
    py, env = sys.executable, _env()
    gw_port = free_port()
    conf = d / "gateway.toml"
    conf.write_text(f'host = "127.0.0.1"\nport = {gw_port}\ndb_url = "sqlite:///{d / "gateway.db"}"\n{gateway_toml}\n'
                    f'[[lanes]]\nname = "a"\nurl = "{lane_url}"\n')
    gw_log = open(d / "gateway.log", "wb")
    stack.callback(gw_log.close)
    gw = subprocess.Popen([py, "-m", "gateway", "--config", str(conf)], env=env, cwd=REPO_ROOT, stdout=gw_log,
                          stderr=subprocess.STDOUT)
    stack.callback(_stop, gw)
    if pids is not None:
        pids[name] = gw.pid
    gw_url = f"http://127.0.0.1:{gw_port}"
    _wait(gw_url + "/readyz", 60, gw, d / "gateway.log")
    r = subprocess.run([py, "-m", "gateway.keys", "--config", str(conf), "create", "--name", "bench"], env=env,
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"gateway_overhead: key creation failed: {r.stderr.strip()}")
    return gw_url, r.stdout.strip()


class Client:
    """One keep-alive HTTP connection; ``stream()`` -> (ttft_s, total_s, text). After each call ``sent`` is when
    the request left (``time.monotonic()``, the clock the gateway's stage stamps use) and ``rid`` the request's id
    as the lane logs it (``xrid``): the one sent with it (``prefix`` + a count), or, through the gateway (``key``
    given), the gateway's own ``X-Request-Id``, which the gateway forwards to the lane."""

    def __init__(self, base: str, key: str | None, prefix: str = "bench-") -> None:
        u = urlsplit(base)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        self.body = json.dumps(BODY).encode()
        self.prefix = prefix
        self.count = 0
        self.sent = 0.0
        self.rid = ""

    def stream(self) -> tuple[float, float, str]:
        self.count += 1
        rid = f"{self.prefix}{self.count}"
        t0 = time.perf_counter()
        self.sent = time.monotonic()
        self.conn.request("POST", "/v1/chat/completions", body=self.body, headers={**self.headers, "X-Request-Id": rid})
        r = self.conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"gateway_overhead: HTTP {r.status}: {r.read()[:300]!r}")
        self.rid = (r.headers.get("X-Request-Id") or rid) if "Authorization" in self.headers else rid
        ttft: float | None = None
        text = ""
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
        r.read()
        total = time.perf_counter() - t0
        return (ttft if ttft is not None else total), total, text


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(lane_url: str, gw_url: str, key: str, n: int, warmup: int, pids: dict[str, int] | None = None,
        control: bool = False, compare: tuple[str, str] | None = None) -> dict[str, Any]:
    """``n`` measured pairs. ``control``: the "gateway" side is a second connection straight to the lane (an A/A
    run: every figure is then the method's own noise at that moment, what no gateway can go below). ``compare``:
    (url, key) of a second gateway (B) in front of the same lane; each pair becomes a triple (direct, A, B in a
    rotating order: each of the 6 orders once every 6 triples), and B's figures are read against the same direct
    requests, and B - A triple by triple: an A/B of two gateways at the same moments of the box."""
    direct = Client(lane_url, None, "bench-d")
    gateway = Client(lane_url, None, "bench-c") if control else Client(gw_url, key)
    other = Client(compare[0], compare[1]) if compare else None
    sides = {"direct": direct, "gw": gateway, **({"cmp": other} if other else {})}
    for _ in range(warmup):
        for c in sides.values():
            c.stream()
    orders = list(itertools.permutations(sides))
    samples: list[dict[str, Any]] = []
    cpu0 = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
    gc.collect()
    gc.disable()  # the client's own collections stay out of the pairs
    try:
        for i in range(n):
            order = orders[i % len(orders)]
            res = {}
            for side in order:
                c = sides[side]
                ttft, total, _ = c.stream()
                res[side] = (ttft, total, c.sent, c.rid)
            smp = {"direct_ttft_ms": res["direct"][0] * 1e3, "direct_total_ms": res["direct"][1] * 1e3,
                   "gateway_ttft_ms": res["gw"][0] * 1e3, "gateway_total_ms": res["gw"][1] * 1e3,
                   "gateway_first": order.index("gw") < order.index("direct"), "direct_sent": res["direct"][2],
                   "gateway_sent": res["gw"][2], "direct_id": res["direct"][3], "gateway_id": res["gw"][3]}
            if "cmp" in res:
                smp.update(compare_ttft_ms=res["cmp"][0] * 1e3, compare_total_ms=res["cmp"][1] * 1e3,
                           order="/".join(order))
            samples.append(smp)
    finally:
        gc.enable()
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in (pids or {}).items()}
    added_ttft = [s["gateway_ttft_ms"] - s["direct_ttft_ms"] for s in samples]
    added_total = [s["gateway_total_ms"] - s["direct_total_ms"] for s in samples]
    direct_ttft = [s["direct_ttft_ms"] for s in samples]
    gateway_ttft = [s["gateway_ttft_ms"] for s in samples]
    summary = {
        "n": n,
        "direct_ttft_median_ms": statistics.median(direct_ttft),
        "gateway_ttft_median_ms": statistics.median(gateway_ttft),
        "direct_ttft_p99_ms": _pct(direct_ttft, 0.99),
        "gateway_ttft_p99_ms": _pct(gateway_ttft, 0.99),
        "direct_total_median_ms": statistics.median(s["direct_total_ms"] for s in samples),
        "gateway_total_median_ms": statistics.median(s["gateway_total_ms"] for s in samples),
        "added_ttft_median_ms": statistics.median(added_ttft),
        "added_ttft_p95_ms": _pct(added_ttft, 0.95),
        "added_ttft_p99_ms": _pct(added_ttft, 0.99),  # per pair: what the target reads
        "added_ttft_p99_of_tails_ms": _pct(gateway_ttft, 0.99) - _pct(direct_ttft, 0.99),
        "added_total_median_ms": statistics.median(added_total),
        "target_added_ttft_median_ms": TARGET_MEDIAN_MS,
        "target_added_ttft_p99_ms": TARGET_P99_MS,
    }
    if "gateway" in cpu:  # every gateway request of the measured pairs; the lane served 2 per pair (3: compare)
        summary["gateway_cpu_ms_per_request"] = cpu["gateway"] * 1e3 / n
    if "compare" in cpu:
        summary["compare_cpu_ms_per_request"] = cpu["compare"] * 1e3 / n
    if "lane" in cpu:
        summary["lane_cpu_ms_per_request"] = cpu["lane"] * 1e3 / (len(sides) * n)
    if other is not None:
        cmp_added = [s["compare_ttft_ms"] - s["direct_ttft_ms"] for s in samples]
        b_minus_a = [s["compare_ttft_ms"] - s["gateway_ttft_ms"] for s in samples]
        summary.update(compare_added_ttft_median_ms=statistics.median(cmp_added),
                       compare_added_ttft_p95_ms=_pct(cmp_added, 0.95),
                       compare_added_ttft_p99_ms=_pct(cmp_added, 0.99),
                       compare_ttft_p99_ms=_pct([s["compare_ttft_ms"] for s in samples], 0.99),
                       b_minus_a_ttft_median_ms=statistics.median(b_minus_a),
                       b_minus_a_ttft_mean_ms=statistics.fmean(b_minus_a))
    return {"summary": summary, "samples": samples}


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def lane_ttft_by_previous(samples: list[dict[str, Any]], lane_ttft: dict[str, float]) -> dict[str, float]:
    """The lane's own TTFT (median ms) by what it served just before, in sending order: "gateway after gateway",
    "gateway after direct", "direct after gateway", "direct after direct". The order alternates per pair, so each
    holds about a quarter of the requests; a pattern here (one case slow) points at what the previous request
    leaves behind (the gateway's work after a stream, an idle gap that lets the lane's threads sleep), not at the
    request itself. Empty for triples (``--compare``)."""
    if not samples or "compare_ttft_ms" in samples[0]:
        return {}
    seq = sorted([(s["direct_sent"], "direct", s["direct_id"]) for s in samples] +
                 [(s["gateway_sent"], "gateway", s["gateway_id"]) for s in samples])
    by: dict[str, list[float]] = {}
    for (_, prev, _), (_, kind, rid) in itertools.pairwise(seq):
        if rid in lane_ttft:
            by.setdefault(f"{kind} after {prev}", []).append(lane_ttft[rid])
    return {k: round(statistics.median(v), 2) for k, v in sorted(by.items())}


def stage_report(tmp: Path, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Where each measured pair's time went, from the started gateway's ``trace_stages`` lines and the lane's
    access log, joined by request id: the medians of the gateway's stages (ms since the request arrived: ``body``
    read, prompt ``counted``, upstream ``post`` sent, lane ``headers`` back, the lane's first ``chunk`` read,
    ``first_token`` written) and the lane's own TTFT (its log: 1 ms resolution) for direct and relayed requests;
    then each gateway request cut into segments on the one monotonic clock: ``to_gateway`` (client send ->
    the gateway's handler starts), ``gateway_in`` (-> upstream POST sent: auth, body, precheck), ``via_lane``
    (-> the lane's first chunk read: the lane's own TTFT and both hops), ``relay`` (-> first token written),
    ``to_client`` (-> the client read it); and ``added_outside_lane``: the pair's added TTFT less the difference
    of the lane's own TTFTs of its two requests, the part the engine's variance does not explain (a diagnosis,
    1 ms resolution: not the target). The 5 pairs with the largest added TTFT are listed segment by segment."""
    gw: dict[str, tuple[float, dict[str, float]]] = {}
    for ln in (tmp / "gateway.log").read_text(errors="replace").splitlines():
        if " stages=" not in ln:
            continue
        f = _fields(ln)
        stages = {name: float(ms) for name, ms in (part.rsplit(":", 1) for part in f["stages"].split(","))}
        gw[f["id"]] = (float(f["t0"]), stages)
    lane_ttft: dict[str, float] = {}
    lane_conn: dict[str, int] = {}  # the request's ordinal on its connection at the lane (1: a new connection)
    for ln in (tmp / "lane.log").read_text(errors="replace").splitlines():
        if "POST /v1/chat/completions" in ln and " ttft=" in ln and " xrid=" in ln:
            f = _fields(ln)
            with contextlib.suppress(ValueError):
                lane_ttft[f["xrid"]] = float(f["ttft"]) * 1000
            with contextlib.suppress(KeyError, ValueError):
                lane_conn[f["xrid"]] = int(f["conn"])
    stage_lists: dict[str, list[float]] = {}
    seg_lists: dict[str, list[float]] = {}
    step_lists: dict[str, list[float]] = {}  # from one stage to the next
    rows = []
    for i, smp in enumerate(samples):
        g = gw.get(smp["gateway_id"])
        if g is None:
            continue
        t0, st = g
        prev, prev_ms = "arrival", 0.0
        for name, ms in st.items():
            stage_lists.setdefault(name, []).append(ms)
            step_lists.setdefault(f"{prev}>{name}", []).append(ms - prev_ms)
            prev, prev_ms = name, ms
        to_gw = (t0 - smp["gateway_sent"]) * 1000
        seg = {"to_gateway": to_gw, "gateway_in": st.get("post", float("nan")),
               "via_lane": st.get("chunk", float("nan")) - st.get("post", float("nan")),
               "relay": st.get("first_token", float("nan")) - st.get("chunk", float("nan")),
               "to_client": smp["gateway_ttft_ms"] - to_gw - st.get("first_token", float("nan"))}
        lg, ld = lane_ttft.get(smp["gateway_id"]), lane_ttft.get(smp["direct_id"])
        if lg is not None and ld is not None:
            seg["lane_ttft_gateway"], seg["lane_ttft_direct"] = lg, ld
            seg["added_outside_lane"] = (smp["gateway_ttft_ms"] - lg) - (smp["direct_ttft_ms"] - ld)
        for k, v in seg.items():
            if v == v:  # not NaN
                seg_lists.setdefault(k, []).append(v)
        rows.append({"pair": i, "added_ttft_ms": smp["gateway_ttft_ms"] - smp["direct_ttft_ms"],
                     "direct_ttft_ms": smp["direct_ttft_ms"], "gateway_first": smp["gateway_first"],
                     **{k: round(v, 3) for k, v in seg.items()}})
    worst = sorted(rows, key=lambda r: r["added_ttft_ms"], reverse=True)[:5]
    return {"gateway_stage_median_ms": {k: round(statistics.median(v), 3) for k, v in stage_lists.items()},
            "lane_ttft_mean_ms": {k: round(statistics.fmean(v), 3) for k, v in
                                  (("direct", seg_lists.get("lane_ttft_direct", [])),
                                   ("gateway", seg_lists.get("lane_ttft_gateway", []))) if v},
            "lane_ttft_by_previous_ms": lane_ttft_by_previous(samples, lane_ttft),
            "gateway_requests_on_a_new_lane_connection": sum(
                1 for smp in samples if lane_conn.get(smp["gateway_id"]) == 1),
            "segments_ms": {k: {"median": round(statistics.median(v), 3), "p99": round(_pct(v, 0.99), 3)}
                            for k, v in seg_lists.items()},
            "steps_ms": {k: {"median": round(statistics.median(v), 3), "p99": round(_pct(v, 0.99), 3)}
                         for k, v in step_lists.items()},
            "worst_pairs": worst, "pairs_joined": len(rows), "pairs": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=300, help="request pairs (default 300: the p99 is the 3rd-largest pair)")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured pairs first (default 20)")
    p.add_argument("--lane-url", help="a running lane (then also --gateway-url and --key)")
    p.add_argument("--gateway-url", help="a running gateway in front of that lane")
    p.add_argument("--key", help="an API key for the running gateway (default: $STRATA_API_KEY)")
    p.add_argument("--json", type=Path, help="write summary, raw samples and machine info here")
    p.add_argument("--count-via-lane", action="store_true",
                   help="the started gateway counts prompts with the lane's /tokenize (count_locally = false), "
                        "as before the local count: for an A/B of the window precheck")
    p.add_argument("--lane-cores", help="the started lane's cores (STRATA_LANE_CORES): 'auto' pins lane a to the "
                   "first half of the CPUs as `make run` does (default: unpinned, one engine thread per CPU)")
    p.add_argument("--model", type=Path,
                   help="the GGUF the started lane serves (default: the default model); on a machine without the "
                        "default model's package, one of its shape, tokenizer and chat template "
                        "(python -m bench.synthetic_moe --shape default, as tools/gpu/gateway_overhead.sh builds)")
    p.add_argument("--control", action="store_true",
                   help="an A/A run: the second side of every pair is a second connection straight to the lane, "
                        "not the gateway; its 'added' figures are the method's noise floor at that moment")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a line of the started gateway's config (TOML), e.g. log_batch_s=0, for an A/B")
    p.add_argument("--compare", action="append", default=[], metavar="NAME=VALUE",
                   help="start a second gateway B with this config line (instead of --set's) in front of the same "
                        "lane: each pair becomes a triple (direct, A, B, rotating order) and B - A is reported "
                        "triple by triple: an A/B at the same moments of a busy box")
    p.add_argument("--stages", action="store_true",
                   help="the started gateway logs per-stage times (trace_stages); their medians are reported")
    args = p.parse_args(argv)
    pids: dict[str, int] = {}
    compare: tuple[str, str] | None = None
    if args.model is not None and (args.lane_url or args.gateway_url):
        p.error("--model is the started lane's (not with --lane-url / --gateway-url)")
    if args.model is not None and not args.model.is_file():
        p.error(f"--model {args.model}: no such file")
    if args.compare and (args.lane_url or args.control):
        p.error("--compare starts its own lane and two gateways (not with --lane-url or --control)")
    with ExitStack() as stack:
        if args.lane_url or args.gateway_url:
            key = args.key or os.environ.get("STRATA_API_KEY")
            if not (args.lane_url and args.gateway_url and key):
                p.error("a running stack needs --lane-url, --gateway-url and --key (or $STRATA_API_KEY)")
            lane_url, gw_url = args.lane_url.rstrip("/"), args.gateway_url.rstrip("/")
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="strata-gwbench-")))
            print("gateway_overhead: starting a lane and the gateway ...", flush=True)
            base = ("count_locally = false\n" if args.count_via_lane else "") + \
                ("trace_stages = true\n" if args.stages else "")
            extra = base + "".join(line + "\n" for line in args.set)
            lane_url, gw_url, key = start_stack(stack, tmp, extra, args.lane_cores, pids, args.model)
            if args.compare:
                (tmp / "b").mkdir()
                compare = start_gateway(stack, tmp / "b", lane_url, base + "".join(ln + "\n" for ln in args.compare),
                                        pids, "compare")
        retrieval, waited = wait_retrieval(gw_url, 600)
        if compare is not None:
            wait_retrieval(compare[0], 600)
            if not args.count_via_lane:
                _local_count_ready(tmp / "b" / "gateway.log", 60)
            print(f"gateway_overhead: B, a second gateway ({compare[0]}, event loop "
                  f"{_event_loop(tmp / 'b' / 'gateway.log')}) with {args.compare} instead of {args.set}", flush=True)
        counting, loop = "unknown (a running stack)", "unknown (a running stack)"
        if not args.lane_url:
            loop = _event_loop(tmp / "gateway.log")
            # the precheck counts in the gateway only once it has loaded the lane's tokenizer (in the background)
            counting = "the lane's /tokenize" if args.count_via_lane else _local_count_ready(tmp / "gateway.log", 60)
        print(f"gateway_overhead: gateway retrieval {retrieval} (waited {waited:.1f}s for its embedding model); "
              f"{args.n} pairs, lane {lane_url} vs gateway {gw_url} (max_tokens 8, stream); prompts counted by "
              f"{counting}; the gateway's event loop: {loop}", flush=True)
        lane = lane_info(lane_url)
        machine = machine_info()  # before the pairs: it samples how busy the other processes keep the cores
        if args.control:
            print("gateway_overhead: A/A control: both sides of every pair go straight to the lane", flush=True)
        report = run(lane_url, gw_url, key, args.n, args.warmup, pids, control=args.control, compare=compare)
        load_after = list(os.getloadavg())
        if args.stages and not args.lane_url and not args.control:
            time.sleep(0.5)  # the last access-log lines
            report["stages"] = stage_report(tmp, report["samples"])
    s = report["summary"]
    print(f"  TTFT median   direct {s['direct_ttft_median_ms']:8.2f} ms   gateway {s['gateway_ttft_median_ms']:8.2f} ms")
    print(f"  total median  direct {s['direct_total_median_ms']:8.2f} ms   gateway {s['gateway_total_median_ms']:8.2f} ms")
    ok_med = s["added_ttft_median_ms"] <= TARGET_MEDIAN_MS
    ok_p99 = s["added_ttft_p99_ms"] <= TARGET_P99_MS
    print(f"  added TTFT median {s['added_ttft_median_ms']:6.2f} ms (target <= {TARGET_MEDIAN_MS:g} ms: "
          f"{'met' if ok_med else 'MISSED'})")
    print(f"  added TTFT p99    {s['added_ttft_p99_ms']:6.2f} ms per pair (target <= {TARGET_P99_MS:g} ms: "
          f"{'met' if ok_p99 else 'MISSED'}); p95 {s['added_ttft_p95_ms']:.2f} ms")
    print(f"  TTFT p99          direct {s['direct_ttft_p99_ms']:8.2f} ms   gateway {s['gateway_ttft_p99_ms']:8.2f} ms   "
          f"difference of the tails {s['added_ttft_p99_of_tails_ms']:.2f} ms (reported, not the target)")
    print(f"  added time per request (median) {s['added_total_median_ms']:6.2f} ms")
    if "compare_added_ttft_median_ms" in s:
        print(f"  B: added TTFT median {s['compare_added_ttft_median_ms']:6.2f} ms, p95 "
              f"{s['compare_added_ttft_p95_ms']:.2f}, p99 {s['compare_added_ttft_p99_ms']:.2f} ms per pair "
              f"(against the same direct requests); TTFT p99 {s['compare_ttft_p99_ms']:.2f} ms")
        print(f"  B - A, triple by triple: TTFT median {s['b_minus_a_ttft_median_ms']:+.2f} ms, mean "
              f"{s['b_minus_a_ttft_mean_ms']:+.2f} ms")
    if "gateway_cpu_ms_per_request" in s:
        print(f"  CPU per request   gateway {s['gateway_cpu_ms_per_request']:.2f} ms (all its threads)   "
              f"lane {s['lane_cpu_ms_per_request']:.2f} ms" +
              (f"   B {s['compare_cpu_ms_per_request']:.2f} ms" if "compare_cpu_ms_per_request" in s else ""))
    print(f"  load average before {machine.get('loadavg')} after {[round(x, 2) for x in load_after]}")
    if "stages" in report:
        st = report["stages"]
        print("  gateway stages, median ms since arrival: " +
              ", ".join(f"{k} {v:.2f}" for k, v in st["gateway_stage_median_ms"].items()))
        print("  lane's own TTFT, mean ms: " + ", ".join(f"{k} {v:.2f}" for k, v in st["lane_ttft_mean_ms"].items()))
        if st["lane_ttft_by_previous_ms"]:
            print("  lane's own TTFT by the request before it, median ms: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in st["lane_ttft_by_previous_ms"].items()))
        print(f"  the gateway's requests that reached the lane on a new connection: "
              f"{st['gateway_requests_on_a_new_lane_connection']} of {st['pairs_joined']}")
        print(f"  segments of the gateway's requests ({st['pairs_joined']} pairs joined), median / p99 ms: " +
              ", ".join(f"{k} {v['median']:.2f} / {v['p99']:.2f}" for k, v in st["segments_ms"].items()))
        print("  gateway steps, median / p99 ms: " +
              ", ".join(f"{k} {v['median']:.2f} / {v['p99']:.2f}" for k, v in st["steps_ms"].items()))
        for w in st["worst_pairs"]:
            print("    worst pair " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in w.items()))
    if args.json:
        report["machine"] = {**machine, "loadavg_after": load_after}
        report["config"] = {"n": args.n, "warmup": args.warmup, "body": BODY, "retrieval": retrieval,
                            "control": args.control, "gateway_config": args.set, "compare_config": args.compare,
                            "count_via_lane": args.count_via_lane, "lane_cores": args.lane_cores,
                            "model": str(args.model) if args.model is not None else "the default model",
                            "lane": lane,
                            "retrieval_wait_s": round(waited, 2), "counted_by": counting, "event_loop": loop}
        write_json(args.json, report)
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
