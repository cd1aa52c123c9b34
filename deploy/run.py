#!/usr/bin/env python3
"""Start, stop and inspect the Strata process table (supervisord.conf) — what ``make run``,
``make stop`` and ``make status`` call.

    .venv/bin/python deploy/run.py start [--timeout 120]   # start supervisord if needed, wait for /health + /readyz
    .venv/bin/python deploy/run.py stop [--timeout 120]    # supervisorctl shutdown, wait for the exit
    .venv/bin/python deploy/run.py status [--check]        # supervisorctl status + each lane's /health + gateway /readyz

``start`` is idempotent: with supervisord already up it (re)starts only programs that are not
running and waits for them. Before the first start it creates the gateway's admin key file
(``admin_key_file`` in deploy/gateway.toml, default var/secrets/admin.key: 32 random bytes,
mode 0600) when it is missing and ``STRATA_ADMIN_KEY`` is not set; the key itself is never
printed. Each lane's address comes from the lane itself
(``python -m lanes --check-config``: lane file + ``STRATA_LANE_*`` environment), so the file,
not this script, is the one place a port is written. supervisord is reached over its unix
socket with supervisor's own XML-RPC transport (what supervisorctl uses).
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import xmlrpc.client
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the repo's packages (common, gateway) must import
    sys.path.insert(0, str(REPO))

from common.config import ADMIN_ENV  # noqa: E402
from deploy.stack import get_json as get_json_or_error  # noqa: E402

DEFAULT_CONFIG = REPO / "supervisord.conf"
BIN = Path(sys.executable).parent  # the venv's bin (not resolved: the venv python is a symlink)
LANE_GROUP = "lanes"
GATEWAY_PROGRAM = "gateway"
HEALTH_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 120.0  # > stopwaitsecs (50) of a draining lane


# ---------------------------------------------------------------------------------------- config


@dataclass
class Lane:
    program: str  # supervisord program name: lane_a
    name: str  # lane name: a
    host: str
    port: int
    cores: Any

    @property
    def base(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def _parser(conf: Path) -> configparser.RawConfigParser:
    p = configparser.RawConfigParser(inline_comment_prefixes=(";", "#"), strict=False)
    if not p.read(conf):
        raise SystemExit(f"run: {conf} does not exist")
    return p


def _here(value: str, conf: Path) -> str:
    return value.replace("%(here)s", str(conf.resolve().parent))


def socket_path(conf: Path) -> Path:
    url = _here(_parser(conf).get("supervisorctl", "serverurl"), conf)
    if not url.startswith("unix://"):
        raise SystemExit(f"run: [supervisorctl] serverurl={url!r}: only unix:// sockets are supported")
    return Path(url.removeprefix("unix://"))


def state_dirs(conf: Path) -> list[Path]:
    """Parent directories of every file the config names (socket, pidfile, logs): supervisord
    refuses to start when one is missing."""
    p = _parser(conf)
    dirs: set[Path] = set()
    for section in p.sections():
        for key, value in p.items(section):
            if (key == "file" or key.endswith("logfile") or key == "pidfile") and value.upper() not in ("NONE", "AUTO"):
                dirs.add(Path(_here(value, conf)).parent)
    return sorted(dirs)


def lane_programs(conf: Path) -> dict[str, list[str]]:
    """``{"lane_a": argv, ...}`` for the members of ``[group:lanes]`` (commands with %(here)s expanded)."""
    p = _parser(conf)
    members = [m.strip() for m in p.get(f"group:{LANE_GROUP}", "programs").split(",") if m.strip()]
    return {m: shlex.split(_here(p.get(f"program:{m}", "command"), conf)) for m in members}


def resolve_lane(program: str, argv: list[str]) -> Lane:
    """What the lane will bind to: its own ``--check-config`` (file + environment), run the same way."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([*argv, "--check-config"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"run: {program} has a bad config (exit {r.returncode}): {r.stderr.strip()}")
    cfg = json.loads(r.stdout)
    return Lane(program, cfg["name"], cfg["host"], int(cfg["port"]), cfg["cores"])


@dataclass
class Gateway:
    program: str  # supervisord program name: gateway
    host: str
    port: int
    admin_key_file: Path | None  # resolved against the program's directory

    @property
    def base(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"


def _argv_option(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def gateway_program(conf: Path) -> Gateway | None:
    """The ``[program:gateway]`` of the config, resolved like the gateway resolves it (its
    ``--config`` file + ``STRATA_GATEWAY_*``); None when the config runs no gateway."""
    p = _parser(conf)
    section = f"program:{GATEWAY_PROGRAM}"
    if not p.has_section(section):
        return None
    argv = shlex.split(_here(p.get(section, "command"), conf))
    cwd = Path(_here(p.get(section, "directory", fallback=str(conf.parent)), conf))
    cfg_path = _argv_option(argv, "--config")
    from gateway.config import ConfigError, load_config

    try:
        cfg = load_config(Path(cfg_path) if cfg_path else None, os.environ)
    except ConfigError as e:
        raise SystemExit(f"run: {GATEWAY_PROGRAM} has a bad config: {e}") from None
    port = _argv_option(argv, "--port")
    key_file = cfg.admin_key_file
    if key_file is not None and not key_file.is_absolute():
        key_file = cwd / key_file
    return Gateway(GATEWAY_PROGRAM, _argv_option(argv, "--host") or cfg.host,
                   int(port) if port else cfg.port, key_file)


def ensure_admin_key(gw: Gateway, log: Callable[[str], None] | None = None) -> bool:
    """Create the admin key file (random, mode 0600) when missing; False when it is unusable."""
    log = log or _log
    if os.environ.get(ADMIN_ENV):
        log(f"run: the gateway's admin key comes from ${ADMIN_ENV}")
        return True
    path = gw.admin_key_file
    if path is None:
        log("run: the gateway has no admin key (no admin_key_file, no $STRATA_ADMIN_KEY): the admin API "
            "answers only database keys created with --admin")
        return True
    if path.exists():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log(f"run: {path} has mode {mode:04o}; the gateway refuses it (run: chmod 600 {path})")
            return False
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    log(f"run: created the gateway admin key {path} (mode 0600; read it with: cat {path})")
    return True


def read_admin_key(gw: Gateway | None) -> str | None:
    key = os.environ.get(ADMIN_ENV)
    if key:
        return key
    if gw is None or gw.admin_key_file is None:
        return None
    try:
        return gw.admin_key_file.read_text().strip() or None
    except OSError:
        return None


# ---------------------------------------------------------------------------------------- supervisord


def rpc(conf: Path) -> Any:
    """An XML-RPC proxy to supervisord over the unix socket (supervisor's own transport)."""
    from supervisor.xmlrpc import SupervisorTransport

    transport = SupervisorTransport(None, None, f"unix://{socket_path(conf)}")
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)


def supervisord_pid(conf: Path) -> int | None:
    """supervisord's pid when it answers on the socket, else None."""
    if not socket_path(conf).exists():
        return None
    try:
        return int(rpc(conf).supervisor.getPID())
    except (OSError, xmlrpc.client.Fault, xmlrpc.client.ProtocolError):
        return None


def process_states(conf: Path) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in rpc(conf).supervisor.getAllProcessInfo()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie of ours (never, for a daemon) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def supervisorctl(conf: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "supervisorctl"), "-c", str(conf), *args], capture_output=True, text=True)


# ---------------------------------------------------------------------------------------- lanes over HTTP


def health(lane: Lane, timeout: float = 2.0) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of /health; (0, {"error": ...}) when nothing answers."""
    return get_json_or_error(lane.base + "/health", timeout=timeout)


def get_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


FIRST_PROMPT = "What is the capital of France? Answer in one sentence."  # the tiny default model gets it right


def first_answer(base: str, key: str | None = None) -> str:
    """Ask ``base`` (a lane or the gateway) the first prompt, greedily: a line naming the answer
    and who gave it, or why none came."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {"messages": [{"role": "user", "content": FIRST_PROMPT}], "max_tokens": 32, "temperature": 0}
    t0 = time.monotonic()
    try:
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=60) as r:
            lane = r.headers.get("X-Strata-Lane")
            text = json.loads(r.read())["choices"][0]["message"]["content"].strip()
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return f"(the first test prompt failed: {e})"
    took = f"{time.monotonic() - t0:.1f}s"
    where = f"through the gateway (lane {lane}, {took})" if lane else f"({took})"
    return f"first answer {where}: {text!r}"


def port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host if host not in ("0.0.0.0", "") else "127.0.0.1", port)) == 0


def gpus() -> list[str]:
    """``nvidia-smi -L`` lines; [] without a driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        r = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in r.stdout.splitlines() if ln.startswith("GPU ")] if r.returncode == 0 else []


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e.strerror})"


# ---------------------------------------------------------------------------------------- commands


def _log(msg: str) -> None:
    print(msg, flush=True)


def readyz(gw: Gateway, timeout: float = 2.0) -> int:
    """HTTP status of the gateway's /readyz; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(gw.base + "/readyz", timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return 0


def wait_healthy(conf: Path, lanes: list[Lane], timeout: float, log: Callable[[str], None] = _log,
                 gateway: Gateway | None = None) -> bool:
    """Poll supervisord's states, each lane's /health and the gateway's /readyz until all answer
    200; print progress."""
    t0 = time.monotonic()
    last = ""
    next_print = 0.0
    while True:
        elapsed = time.monotonic() - t0
        try:
            states = process_states(conf)
        except (OSError, xmlrpc.client.Fault, xmlrpc.client.ProtocolError) as e:
            log(f"run: supervisord stopped answering: {e}")
            return False
        parts, ready = [], 0
        for lane in lanes:
            info = states.get(lane.program, {})
            state = info.get("statename", "?")
            if state == "FATAL":
                log(f"run: {lane.program} is FATAL ({info.get('spawnerr') or 'gave up'}); the end of its log:")
                log(_tail(Path(info.get("stdout_logfile") or "/dev/null")))
                log("run: supervisord keeps running (make status; fix, then make run again, or make stop)")
                return False
            code, body = health(lane)
            ready += code == 200
            parts.append(f"{lane.program} {state} /health " + (str(code) if code else "-")
                         + (f" {body['status']}" if body.get("status") else ""))
        if gateway is not None:
            info = states.get(gateway.program, {})
            state = info.get("statename", "?")
            if state == "FATAL":
                log(f"run: {gateway.program} is FATAL ({info.get('spawnerr') or 'gave up'}); the end of its log:")
                log(_tail(Path(info.get("stdout_logfile") or "/dev/null")))
                return False
            code = readyz(gateway)
            ready += code == 200
            parts.append(f"{gateway.program} {state} /readyz " + (str(code) if code else "-"))
        line = ", ".join(parts)
        if ready == len(lanes) + (gateway is not None):
            log(f"  [{elapsed:5.1f}s] {line}")
            return True
        if line != last or elapsed >= next_print:
            log(f"  [{elapsed:5.1f}s] {line}")
            last, next_print = line, elapsed + 5.0
        if elapsed > timeout:
            log(f"run: not healthy after {timeout:.0f}s; see var/log/ (make status)")
            return False
        time.sleep(0.5)


def cmd_start(conf: Path, timeout: float) -> int:
    programs = lane_programs(conf)
    with ThreadPoolExecutor(len(programs)) as ex:  # both --check-config at once (a second each)
        lanes = list(ex.map(lambda kv: resolve_lane(*kv), programs.items()))
    found = gpus()
    if found:
        _log(f"run: {len(found)} GPU(s): " + "; ".join(found))
        _log("     gpu ids are recorded only until the CUDA path exists: set gpu = 0 / 1 in "
             "deploy/lanes/lane_{a,b}.toml to have /v1/lane report them")
    gw = gateway_program(conf)
    if gw is not None and not ensure_admin_key(gw):
        return 1
    pid = supervisord_pid(conf)
    if pid is None:
        for prog, host, port in [(ln.program, ln.host, ln.port) for ln in lanes] + (
                [(gw.program, gw.host, gw.port)] if gw is not None else []):
            if port_taken(host, port):
                _log(f"run: {host}:{port} ({prog}) is already in use by another process "
                     f"(another checkout's stack? `ss -ltnp | grep {port}`); not starting")
                return 1
        for d in state_dirs(conf):
            d.mkdir(parents=True, exist_ok=True)
        _log(f"run: starting supervisord ({conf})")
        r = subprocess.run([str(BIN / "supervisord"), "-c", str(conf)], capture_output=True, text=True)
        if r.returncode != 0:
            _log(f"run: supervisord failed to start (exit {r.returncode}): {(r.stderr or r.stdout).strip()}")
            return 1
        for _ in range(100):  # it daemonises at once; the socket follows within a second
            pid = supervisord_pid(conf)
            if pid is not None:
                break
            time.sleep(0.1)
        if pid is None:
            _log("run: supervisord did not come up; the end of its log:")
            _log(_tail(conf.parent / "var" / "log" / "supervisord.log"))
            return 1
        _log(f"run: supervisord pid {pid}; waiting for the lanes to load the model")
    else:
        _log(f"run: supervisord is already running (pid {pid})")
        states = process_states(conf)
        for lane in lanes:
            state = states.get(lane.program, {}).get("statename")
            if state in ("STOPPED", "EXITED", "FATAL"):
                _log(f"run: {lane.program} was {state}; starting it")
                rpc(conf).supervisor.startProcess(f"{LANE_GROUP}:{lane.program}", False)
        if gw is not None and states.get(gw.program, {}).get("statename") in ("STOPPED", "EXITED", "FATAL"):
            _log(f"run: {gw.program} was {states[gw.program]['statename']}; starting it")
            rpc(conf).supervisor.startProcess(gw.program, False)
    if not wait_healthy(conf, lanes, timeout, gateway=gw):
        return 1
    if gw is not None:
        _summary_gateway(conf, lanes, gw)
    else:
        _summary(conf, lanes)
    return 0


def _lane_line(lane: Lane, note: str = "") -> str:
    try:
        info = get_json(lane.base + "/v1/lane", timeout=5)
        extra = f"pid {info['pid']}, cores {info['cores']}, n_ctx {info['n_ctx']}, model {info['served_model_name']}"
    except (OSError, ValueError, KeyError):
        extra = ""
    return f"  lane {lane.name}   {lane.base}/v1   {note}{extra}"


def _openai_snippet(base_url: str, api_key: str) -> None:
    _log("")
    _log("  from openai import OpenAI")
    _log(f"  client = OpenAI(base_url=\"{base_url}\", api_key=\"{api_key}\")")
    _log("  r = client.chat.completions.create(model=\"strata-default\", "
         "temperature=0, messages=[{\"role\": \"user\", \"content\": \"Hi!\"}])")
    _log("  print(r.choices[0].message.content)")
    _log("")


def _summary_gateway(conf: Path, lanes: list[Lane], gw: Gateway) -> None:
    _log("")
    _log("Strata is up: the gateway fronts the lanes (OpenAI-compatible; model \"strata-default\"):")
    _log(f"  gateway  {gw.base}/v1   (listening on {gw.host}:{gw.port}; API key required)")
    for lane in lanes:
        _log(_lane_line(lane, "(loopback only) "))
    admin = read_admin_key(gw)
    if admin:
        _log(f"  {first_answer(gw.base, admin)}")
    where = f"{gw.admin_key_file}" if gw.admin_key_file else f"${ADMIN_ENV}"
    host = socket.gethostname() if gw.host in ("0.0.0.0", "", "::") else gw.host
    _log("")
    _log("Create an API key (printed once; stored hashed in the gateway database):")
    _log(f"  {BIN / 'strata'} keys create --name me          # --rpm 60 --max-concurrent 4 --log-prompts ...")
    _log(f"Admin key (admin API /v1/admin/*, never printed): {where}   (cat it to use it)")
    _log("")
    _log("Try it (the tiny default model answers short questions best at temperature 0; README.md says more):")
    _log(f"  curl -s {gw.base}/v1/chat/completions -H \"Authorization: Bearer $KEY\" \\")
    _log("    -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", "
         "\"content\": \"Hi!\"}], \"max_tokens\": 64, \"temperature\": 0}'")
    _openai_snippet(f"http://{host}:{gw.port}/v1", "sk-strata-...")
    _log(f"Status: make status    Logs: {conf.parent / 'var' / 'log'}/    "
         f"Control: {BIN / 'supervisorctl'} -c {conf}    Lane switch: make switch LANE=b CONFIG=...    "
         "Stop: make stop")


def _summary(conf: Path, lanes: list[Lane]) -> None:
    _log("")
    _log("Strata lanes are up (OpenAI-compatible; any api_key; model \"strata-default\"):")
    for lane in lanes:
        _log(_lane_line(lane))
    first = lanes[0]
    _log(f"  lane {first.name}: {first_answer(first.base)}")
    url = first.base
    _log("")
    _log("Try it:")
    _log(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\")
    _log("    -d '{\"model\": \"strata-default\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}], "
         "\"max_tokens\": 64, \"temperature\": 0}'")
    _log(f"  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' \\")
    _log("    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Name three primary colors.\"}], "
         "\"temperature\": 0, \"stream\": true}'")
    _openai_snippet(f"{url}/v1", "unused")
    _log("(This process table has no [program:gateway]: clients talk to the lanes directly.)")
    _log(f"Status: make status    Logs: {conf.parent / 'var' / 'log'}/    "
         f"Control: {BIN / 'supervisorctl'} -c {conf}    Stop: make stop")


def cmd_stop(conf: Path, timeout: float) -> int:
    pid = supervisord_pid(conf)
    if pid is None:
        _log("run: supervisord is not running; nothing to stop")
        return 0
    _log(f"run: shutting down supervisord (pid {pid}); the gateway and the lanes finish in-flight requests first")
    try:
        rpc(conf).supervisor.shutdown()
    except (OSError, xmlrpc.client.Fault, xmlrpc.client.ProtocolError) as e:
        _log(f"run: shutdown request failed: {e}")
    t0 = time.monotonic()
    next_print = 5.0
    while _alive(pid):
        elapsed = time.monotonic() - t0
        if elapsed > timeout:
            _log(f"run: supervisord (pid {pid}) still running after {timeout:.0f}s; see var/log/supervisord.log")
            return 1
        if elapsed >= next_print:
            _log(f"  [{elapsed:5.1f}s] waiting for the lanes to drain and exit")
            next_print += 5.0
        time.sleep(0.2)
    _log(f"run: stopped ({time.monotonic() - t0:.1f}s)")
    return 0


def cmd_status(conf: Path, check: bool) -> int:
    pid = supervisord_pid(conf)
    if pid is None:
        _log("supervisord is not running (make run starts it)")
        return 3 if check else 0
    r = supervisorctl(conf, "status")
    _log(f"supervisord pid {pid} ({conf})")
    _log(r.stdout.rstrip())
    ok = r.returncode == 0
    for program, argv in lane_programs(conf).items():
        try:
            lane = resolve_lane(program, argv)
        except SystemExit as e:
            _log(str(e))
            ok = False
            continue
        code, body = health(lane)
        ok = ok and code == 200
        _log(f"{program:<32} {lane.base}/health {code or '-'} {json.dumps(body, separators=(',', ':'))}")
    try:
        gw = gateway_program(conf)
    except SystemExit as e:
        _log(str(e))
        return 3 if check else 0
    if gw is not None:
        code = readyz(gw)
        ok = ok and code == 200
        _log(f"{gw.program:<32} {gw.base}/readyz {code or '-'}")
    return 0 if ok or not check else 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploy/run.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="supervisord config (default: the repo's)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start supervisord if needed and wait until every lane's /health is 200")
    s.add_argument("--timeout", type=float, default=HEALTH_TIMEOUT_S)
    s = sub.add_parser("stop", help="supervisorctl shutdown and wait for supervisord to exit (idempotent)")
    s.add_argument("--timeout", type=float, default=STOP_TIMEOUT_S)
    s = sub.add_parser("status", help="supervisorctl status and each lane's /health")
    s.add_argument("--check", action="store_true", help="exit 3 unless everything is RUNNING and healthy")
    args = p.parse_args(argv)
    conf = args.config.resolve()
    if args.cmd == "start":
        return cmd_start(conf, args.timeout)
    if args.cmd == "stop":
        return cmd_stop(conf, args.timeout)
    return cmd_status(conf, args.check)


if __name__ == "__main__":
    sys.exit(main())
