#!/usr/bin/env python3
"""A/B rollout of one lane behind the gateway — what ``make switch LANE=b CONFIG=path`` calls.

    .venv/bin/python deploy/switch_lane.py --lane b --config new_lane_b.toml [--step-hold-s 30]

1. pre-flight: the new file must pass the lane's own ``--check-config`` and keep the lane's
   name, host and port (else: ``rejected``, exit 2, nothing touched);
2. drain the lane in the gateway (``PUT /v1/admin/lanes/{lane}`` ``{"drain": true}``) and wait
   until its ``in_flight`` is 0;
3. save the lane file the supervisord program reads (``--config`` in its command) to
   ``var/rollout/lane_<x>.toml.prev`` and put the new file in its place;
4. restart the program (``lanes:lane_<x>``) and wait for the lane's ``/health`` 200 and the
   gateway seeing it ready;
5. smoke test: one chat completion straight to the lane (``max_tokens`` 8): non-empty text and
   a ``finish_reason``;
6. shift traffic: weight = 10%, 50%, 100% of the former weight (``--steps``), each held
   ``--step-hold-s`` while the gateway's request log (``/v1/admin/requests?lane=&since=``) and
   its ``strata_gateway_upstream_failures_total{lane}`` are watched: error rate over
   ``--max-error-rate`` (or median latency over ``--max-latency-ms``) fails the step;
7. on any failure after step 3 (never healthy, FATAL, smoke test, error rate, Ctrl-C): drain,
   put the saved file back, restart, wait healthy, restore the former weight; exit 1
   (``rolled_back``) or 3 (``rollback_failed``: the lane is left drained);
8. append one JSON line per switch to ``var/rollout/history.jsonl``.

The admin key comes from ``STRATA_ADMIN_KEY`` or the gateway's ``admin_key_file``; it is never
printed. Exit codes: 0 switched, 1 rolled back, 2 rejected / bad arguments / nothing changed
(drain timed out), 3 the rollback failed too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import time
import tomllib
import urllib.error
import urllib.request
import xmlrpc.client
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common.config import ADMIN_ENV  # noqa: E402  (the repo root must be importable first)
from deploy.run import (  # noqa: E402
    DEFAULT_CONFIG,
    FIRST_PROMPT,
    LANE_GROUP,
    Lane,
    gateway_program,
    health,
    lane_programs,
    process_states,
    read_admin_key,
    resolve_lane,
    rpc,
)

EXIT_OK, EXIT_ROLLED_BACK, EXIT_REJECTED, EXIT_ROLLBACK_FAILED = 0, 1, 2, 3


class SwitchFailed(Exception):
    """A step failed after the lane file was replaced: roll back."""


class Rejected(Exception):
    """Nothing was changed (or everything was put back before the config was touched)."""


@dataclass
class Switch:
    lane: str
    program: str
    lane_file: Path
    new_config: Path
    lane_url: str
    gateway: str
    admin_key: str
    conf: Path
    state_dir: Path
    args: argparse.Namespace
    t0: float = field(default_factory=time.monotonic)
    steps: list[dict[str, Any]] = field(default_factory=list)
    weight: float = 1.0

    # ------------------------------------------------------------------ output and HTTP

    def say(self, msg: str) -> None:
        print(f"switch[{self.lane}] {time.monotonic() - self.t0:6.1f}s {msg}", flush=True)

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.gateway + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.admin_key}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise RuntimeError(f"gateway {method} {path}: HTTP {e.code}: {detail}") from None
        except OSError as e:
            raise RuntimeError(f"gateway {method} {path}: {getattr(e, 'reason', e)}") from None
        return json.loads(raw) if path != "/metrics" else raw.decode()

    def lane_state(self) -> dict[str, Any]:
        for lane in self.admin("GET", "/v1/admin/lanes")["data"]:
            if lane["name"] == self.lane:
                return dict(lane)
        raise Rejected(f"the gateway has no lane named {self.lane!r}")

    def set_lane(self, **patch: Any) -> dict[str, Any]:
        return dict(self.admin("PUT", f"/v1/admin/lanes/{self.lane}", patch))

    def upstream_failures(self) -> float:
        """Sum of strata_gateway_upstream_failures_total{lane=<this lane>} (0 if unreadable)."""
        try:
            text = self.admin("GET", "/metrics")
        except RuntimeError:
            return 0.0
        total = 0.0
        pat = re.compile(r'^strata_gateway_upstream_failures_total\{[^}]*lane="' + re.escape(self.lane) + r'"[^}]*\} (\S+)$')
        for line in text.splitlines():
            m = pat.match(line)
            if m:
                total += float(m.group(1))
        return total

    # ------------------------------------------------------------------ phases

    def drain(self, timeout: float) -> None:
        self.set_lane(drain=True)
        deadline = time.monotonic() + timeout
        last = -1
        while True:
            n = int(self.lane_state()["in_flight"])
            if n != last:
                self.say(f"drain: in_flight {n}")
                last = n
            if n == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"lane {self.lane} still has {n} request(s) in flight after {timeout:.0f}s")
            time.sleep(0.2)

    def restart(self) -> None:
        name = f"{LANE_GROUP}:{self.program}"
        server = rpc(self.conf)
        try:
            server.supervisor.stopProcess(name, True)
        except xmlrpc.client.Fault as e:
            if "NOT_RUNNING" not in e.faultString:
                raise SwitchFailed(f"supervisord stop {name}: {e.faultString}") from None
        try:
            server.supervisor.startProcess(name, False)
        except xmlrpc.client.Fault as e:
            raise SwitchFailed(f"supervisord start {name}: {e.faultString}") from None
        self.say(f"restarted {name}")

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            info = process_states(self.conf).get(self.program, {})
            state = info.get("statename", "?")
            if state == "FATAL":
                raise SwitchFailed(f"{self.program} is FATAL ({info.get('spawnerr') or 'gave up starting'})")
            code, body = _health(self.lane_url)
            seen = False
            if code == 200:
                try:
                    seen = bool(self.lane_state()["ready"])
                except RuntimeError:
                    seen = False
            line = f"{state} /health {code or '-'} {body.get('status', '')} gateway {'ready' if seen else 'not ready'}"
            if line != last:
                self.say(f"waiting: {line}")
                last = line
            if code == 200 and seen:
                return
            if time.monotonic() > deadline:
                raise SwitchFailed(f"lane {self.lane} not healthy after {timeout:.0f}s ({line})")
            time.sleep(0.25)

    def smoke(self, timeout: float) -> None:
        body = {"messages": [{"role": "user", "content": FIRST_PROMPT}],
                "max_tokens": 8, "temperature": 0}
        req = urllib.request.Request(self.lane_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": "switch-smoke"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                answer = json.loads(r.read())
            choice = answer["choices"][0]
            text, finish = choice["message"]["content"], choice["finish_reason"]
        except urllib.error.HTTPError as e:
            raise SwitchFailed(f"smoke test: HTTP {e.code}: {e.read()[:200].decode(errors='replace')}") from None
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise SwitchFailed(f"smoke test: {type(e).__name__}: {e}") from None
        if not (isinstance(text, str) and text.strip()) or not finish:
            raise SwitchFailed(f"smoke test: empty answer (text={text!r}, finish_reason={finish!r})")
        self.say(f"smoke test ok ({time.monotonic() - t0:.2f}s, finish={finish}): {text.strip()[:60]!r}")

    def step(self, fraction: float) -> None:
        weight = round(self.weight * fraction, 6)
        since = time.time()
        failures0 = self.upstream_failures()
        self.set_lane(drain=False, weight=weight)
        hold = self.args.step_hold_s
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:  # a lane that falls over mid-step fails the step at once
            code, body = _health(self.lane_url)
            if code != 200:
                raise SwitchFailed(f"step {fraction:.0%}: lane /health {code or '-'} {body.get('status', '')}")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        rows = self.admin("GET", f"/v1/admin/requests?lane={self.lane}&since={since:.3f}&limit=1000")["data"]
        failures = self.upstream_failures() - failures0
        total = len(rows)
        errors = sum(1 for r in rows if int(r.get("status") or 0) >= 500)
        errors = max(errors, int(failures))  # failures retried on another lane are logged under that lane
        attempts = max(total, errors)
        rate = errors / attempts if attempts else 0.0
        durations = [float(r["duration_ms"]) for r in rows if r.get("duration_ms") is not None]
        ttfts = [float(r["ttft_ms"]) for r in rows if r.get("ttft_ms") is not None]
        p50 = statistics.median(durations) if durations else None
        ttft50 = statistics.median(ttfts) if ttfts else None
        record = {"fraction": fraction, "weight": weight, "hold_s": hold, "requests": total, "errors": errors,
                  "error_rate": round(rate, 4), "p50_ms": p50, "ttft_p50_ms": ttft50}
        self.steps.append(record)
        self.say(f"step {fraction:.0%} weight {weight:g}: {total} request(s), {errors} error(s) "
                 f"({rate:.1%}), p50 {_ms(p50)}, ttft p50 {_ms(ttft50)}")
        if errors and rate > self.args.max_error_rate:
            raise SwitchFailed(f"step {fraction:.0%}: error rate {rate:.1%} > {self.args.max_error_rate:.1%} "
                               f"({errors}/{attempts})")
        if self.args.max_latency_ms is not None and p50 is not None and p50 > self.args.max_latency_ms:
            raise SwitchFailed(f"step {fraction:.0%}: median latency {p50:.0f} ms > {self.args.max_latency_ms:.0f} ms")

    def rollback(self, backup: Path) -> bool:
        self.say("rolling back: restoring the previous config")
        try:
            try:
                self.drain(self.args.drain_timeout_s)
            except (TimeoutError, RuntimeError) as e:
                self.say(f"rollback: drain: {e}; continuing")
            _atomic_copy(backup, self.lane_file)
            self.restart()
            self.wait_healthy(self.args.health_timeout_s)
            self.set_lane(drain=False, weight=self.weight)
        except (SwitchFailed, RuntimeError, OSError, xmlrpc.client.Fault) as e:
            self.say(f"ROLLBACK FAILED: {e}; lane {self.lane} stays drained in the gateway")
            return False
        self.say(f"rolled back: lane {self.lane} serves the previous config at weight {self.weight:g}")
        return True


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}ms"


def _health(base: str) -> tuple[int, dict[str, Any]]:
    host_port = base.split("://", 1)[1]
    host, _, port = host_port.rpartition(":")
    return health(Lane("", "", host, int(port), None), timeout=2.0)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.switch-tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _lane_file(conf: Path, program: str) -> tuple[Path, list[str]]:
    argv = lane_programs(conf).get(program)
    if argv is None:
        raise Rejected(f"{conf} has no program {program!r} in [group:{LANE_GROUP}]")
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1]), argv
    raise Rejected(f"{program}'s command has no --config FILE: nothing to switch")


def _append_history(state_dir: Path, record: dict[str, Any]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "history.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")


def _check_new(argv: list[str], lane_file: Path, new: Path, current: Lane, program: str) -> None:
    """The new file must pass the lane's --check-config and keep its name, host and port."""
    if not new.is_file():
        raise Rejected(f"{new}: no such file")
    try:
        tomllib.loads(new.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise Rejected(f"{new}: not valid TOML: {e}") from None
    cmd = [str(new) if a == str(lane_file) else a for a in argv]
    try:
        lane = resolve_lane(program, cmd)
    except SystemExit as e:
        raise Rejected(str(e).removeprefix("run: ")) from None
    if (lane.name, lane.host, lane.port) != (current.name, current.host, current.port):
        raise Rejected(f"{new} changes the lane's identity: name/host/port {lane.name}/{lane.host}:{lane.port} "
                       f"!= {current.name}/{current.host}:{current.port} (the gateway would not find it)")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deploy/switch_lane.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--lane", required=True, help="lane name (a, b): program lanes:lane_<name>")
    p.add_argument("--config", required=True, type=Path, help="the new lane TOML file")
    p.add_argument("--supervisor-config", type=Path, default=DEFAULT_CONFIG, help="supervisord.conf (default: the repo's)")
    p.add_argument("--gateway", help="gateway base URL (default: from [program:gateway], http://127.0.0.1:8080)")
    p.add_argument("--admin-key-file", type=Path, help=f"admin key file (default: ${ADMIN_ENV}, else the gateway's admin_key_file)")
    p.add_argument("--steps", default="0.1,0.5,1.0", help="traffic steps as fractions of the former weight (default 0.1,0.5,1.0)")
    p.add_argument("--step-hold-s", type=float, default=30.0, help="how long each step is watched (default 30)")
    p.add_argument("--weight", type=float, help="the lane's full weight (default: its current weight, 1 if 0)")
    p.add_argument("--drain-timeout-s", type=float, default=120.0, help="wait for in_flight 0 (default 120)")
    p.add_argument("--health-timeout-s", type=float, default=120.0, help="wait for /health 200 after a restart (default 120)")
    p.add_argument("--smoke-timeout-s", type=float, default=60.0, help="the smoke-test request (default 60)")
    p.add_argument("--max-error-rate", type=float, default=0.02, help="per-step 5xx share that rolls back (default 0.02)")
    p.add_argument("--max-latency-ms", type=float, help="per-step median request latency that rolls back (default: none)")
    p.add_argument("--state-dir", type=Path, help="backups and history.jsonl (default: var/rollout beside supervisord.conf)")
    args = p.parse_args(argv)
    try:
        args.fractions = [float(x) for x in args.steps.split(",") if x.strip()]
    except ValueError:
        p.error(f"--steps {args.steps!r}: comma-separated numbers expected")
    if not args.fractions or any(not 0 < f <= 1 for f in args.fractions) or args.fractions[-1] != 1.0:
        p.error("--steps: fractions in (0, 1], the last one 1.0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    conf = args.supervisor_config.resolve()
    state_dir = (args.state_dir or conf.parent / "var" / "rollout").resolve()
    program = f"lane_{args.lane}"
    new = args.config.resolve()
    record: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "lane": args.lane,
                              "program": f"{LANE_GROUP}:{program}", "new_config": str(new)}

    def finish(outcome: str, code: int, reason: str | None, sw: Switch | None = None) -> int:
        record.update(outcome=outcome, reason=reason, steps=sw.steps if sw else [],
                      duration_s=round(time.monotonic() - sw.t0, 2) if sw else 0.0)
        _append_history(state_dir, record)
        tail = f": {reason}" if reason else ""
        print(f"switch[{args.lane}] {outcome}{tail} (history: {state_dir / 'history.jsonl'})", flush=True)
        return code

    try:
        lane_file, lane_argv = _lane_file(conf, program)
        record["config_file"] = str(lane_file)
        record["old_hash"] = _sha(lane_file)
        record["new_hash"] = _sha(new) if new.is_file() else None
        current = resolve_lane(program, lane_argv)
        _check_new(lane_argv, lane_file, new, current, program)
        gw = gateway_program(conf)
        gateway = (args.gateway or (gw.base if gw else "http://127.0.0.1:8080")).rstrip("/")
        if args.admin_key_file is not None and not os.environ.get(ADMIN_ENV):
            admin = args.admin_key_file.read_text().strip() or None
        else:
            admin = read_admin_key(gw)
        if not admin:
            raise Rejected(f"no admin key: set ${ADMIN_ENV} or pass --admin-key-file")
    except (Rejected, SystemExit, OSError) as e:
        return finish("rejected", EXIT_REJECTED, str(e).removeprefix("run: "))

    sw = Switch(args.lane, program, lane_file, new, current.base, gateway, admin, conf, state_dir, args)
    sw.say(f"{lane_file.name} {record['old_hash']} -> {new.name} {record['new_hash']}; gateway {gateway}")
    try:
        before = sw.lane_state()
        sw.weight = args.weight if args.weight is not None else (float(before["weight"]) or 1.0)
        record["weight"] = sw.weight
        sw.say(f"lane {args.lane}: weight {before['weight']:g}, in_flight {before['in_flight']}, "
               f"health {before['health']}")
        try:
            sw.drain(args.drain_timeout_s)
        except TimeoutError as e:
            sw.set_lane(drain=bool(before["draining"]))
            raise Rejected(f"{e}; lane left as it was") from None
    except (Rejected, RuntimeError) as e:
        return finish("rejected", EXIT_REJECTED, str(e), sw)

    state_dir.mkdir(parents=True, exist_ok=True)
    backup = state_dir / f"{lane_file.name}.prev"
    shutil.copyfile(lane_file, backup)
    try:
        _atomic_copy(new, lane_file)
        sw.say(f"saved {backup}; {lane_file} replaced")
        sw.restart()
        sw.wait_healthy(args.health_timeout_s)
        sw.smoke(args.smoke_timeout_s)
        for fraction in args.fractions:
            sw.step(fraction)
    except (SwitchFailed, RuntimeError, OSError, xmlrpc.client.Fault, KeyboardInterrupt) as e:
        reason = "interrupted" if isinstance(e, KeyboardInterrupt) else str(e)
        sw.say(f"FAILED: {reason}")
        if sw.rollback(backup):
            return finish("rolled_back", EXIT_ROLLED_BACK, reason, sw)
        return finish("rollback_failed", EXIT_ROLLBACK_FAILED, reason, sw)
    return finish("switched", EXIT_OK, None, sw)


if __name__ == "__main__":
    sys.exit(main())
