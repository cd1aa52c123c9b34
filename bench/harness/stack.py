"""A throwaway stack for ``make bench``: the repo's supervisord.conf rendered into a temp folder
(state, logs, socket, SQLite database and a random 0600 admin key there; free loopback ports; one
core per lane), run with the venv's supervisord, ready when both lanes answer /health and the
gateway sees them ready; shut down through supervisorctl on the way out.

The repo's lane and gateway files are the source: only ports, cores, the KV size and state paths
change, so the bench measures what ``make run`` serves.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROGRAMS = ("lane_a", "lane_b")


class StackError(RuntimeError):
    """The throwaway stack did not come up (the message carries the end of the logs)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, for a process that binds it seconds later (a lane binds after its Python
    start, 20 s on a loaded box). Not the kernel's bind-to-0 pick: that comes from the ephemeral
    range, where every outgoing connection takes its local port and another pytest-xdist worker's
    stack takes its picks, and CI once lost a lane's port that way. So: a random port below the
    ephemeral range, in a slice of its own per xdist worker, checked bindable."""
    low = _ephemeral_low()
    if low <= 12000:  # an unusual range: fall back to the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    slices = 8
    size = (low - 10000) // slices
    start = 10000 + (index % slices) * size
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(start, start + size)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {start}-{start + size - 1}")


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(data: dict[str, Any]) -> str:
    """Flat keys, then one level of tables (what the lane and gateway files hold)."""
    lines = [f"{k} = {_toml(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_toml(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=3) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


@dataclass
class Stack:
    dir: Path
    conf: Path
    proc: subprocess.Popen[bytes]
    ports: dict[str, int]
    admin_key: str
    admin_key_file: Path

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def lane_url(self, program: str) -> str:
        return f"http://127.0.0.1:{self.ports[program]}"

    def log_tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.dir / "var" / "log" / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def create_key(self, name: str) -> str:
        """A key without per-key limits (the benchmarks measure the stack, not its [limits] defaults)."""
        from gateway.config import KEY_LIMITS

        body = {"name": name, "limits": dict.fromkeys(KEY_LIMITS)}
        req = urllib.request.Request(self.gateway_url + "/v1/admin/keys", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {self.admin_key}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return str(json.loads(r.read())["key"])


def write_gateway_config(tmp: Path, ports: dict[str, int], admin_key: str, **overrides: Any) -> Path:
    """``tmp/gateway.toml``: the repository's deploy/gateway.toml on the stack's ports, with a temp
    SQLite database and the admin key in a new 0600 file (returned); ``overrides`` on top."""
    secrets_dir = tmp / "var" / "secrets"
    secrets_dir.mkdir(parents=True, mode=0o700)
    key_file = secrets_dir / "admin.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(admin_key + "\n")
    gw = tomllib.loads((REPO / "deploy" / "gateway.toml").read_text())
    lanes = [dict(x, url=f"http://127.0.0.1:{ports['lane_' + x['name']]}") for x in gw.pop("lanes")]
    gw.update(port=ports["gateway"], host="127.0.0.1", db_url=f"sqlite:///{tmp / 'var' / 'gateway.db'}",
              admin_key_file=str(key_file), health_interval_s=0.25, **overrides)
    (tmp / "gateway.toml").write_text(dump_toml(gw) + "".join("\n[[lanes]]\n" + dump_toml(x) for x in lanes))
    return key_file


def render(tmp: Path, ports: dict[str, int], kv_tokens: int) -> tuple[Path, Path, str]:
    """(supervisord.conf, admin key file, admin key) of a stack under ``tmp``."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = {"lane_a": [cpus[0]], "lane_b": [cpus[1] if len(cpus) > 1 else cpus[0]]}
    text = (REPO / "supervisord.conf").read_text()
    for program in PROGRAMS:
        src = f"%(here)s/deploy/lanes/{program}.toml"
        if src not in text:
            raise StackError(f"supervisord.conf no longer runs {program} with {src}")
        lane = tomllib.loads((REPO / "deploy" / "lanes" / f"{program}.toml").read_text())
        lane.update(port=ports[program], cores=cores[program], kv_tokens=kv_tokens, ping_interval_s=1.0)
        (tmp / f"{program}.toml").write_text(dump_toml(lane))
        text = text.replace(src, str(tmp / f"{program}.toml"))
    key = "bench-admin-" + secrets.token_urlsafe(24)
    # a window-long prompt on a one-core lane: 8,192 tokens took ~130 s to the first token with a
    # neighbour on the other core, past the 120 s default (the gateway then retried on the other
    # lane and failed there too)
    key_file = write_gateway_config(tmp, ports, key, shutdown_timeout_s=5.0,
                                    first_token_timeout_s=max(120.0, 0.06 * kv_tokens))
    src = "%(here)s/deploy/gateway.toml"
    if src not in text:
        raise StackError(f"supervisord.conf no longer runs the gateway with {src}")
    text = text.replace(src, str(tmp / "gateway.toml"))
    text = text.replace("%(here)s/var", str(tmp / "var")).replace("%(here)s", str(REPO))
    for sub in ("var/run", "var/log"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    if len(str(tmp / "var" / "run" / "supervisor.sock")) >= 100:
        raise StackError(f"{tmp}: too long a path for supervisord's unix socket")
    conf = tmp / "supervisord.conf"
    conf.write_text(text)
    return conf, key_file, key


def wait_ready(st: Stack, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if st.proc.poll() is not None:
            raise StackError(f"supervisord exited {st.proc.returncode}:\n{st.log_tail('supervisord')}")
        lanes_ok = all(_get(st.lane_url(p) + "/health")[0] == 200 for p in PROGRAMS)
        if lanes_ok and _get(st.gateway_url + "/readyz")[0] == 200:
            code, body = _get(st.gateway_url + "/v1/admin/lanes", {"Authorization": f"Bearer {st.admin_key}"})
            if code == 200 and all(x["ready"] for x in body["data"]):
                return
        if time.monotonic() > deadline:
            raise StackError(f"the stack is not ready after {timeout:.0f}s\n{st.log_tail('lane_a')}\n"
                             f"{st.log_tail('gateway')}")
        time.sleep(0.25)


def processes_mentioning(marker: str) -> list[int]:
    """Pids (other than ours) whose command line contains ``marker``, zombies left out."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(entry.name))
    return out


@contextlib.contextmanager
def throwaway_stack(tmp: Path, kv_tokens: int = 4096, timeout: float = 180.0) -> Iterator[Stack]:
    """Both lanes and the gateway under supervisord in ``tmp``; shut down (and checked) on the way out."""
    from engine.default_model import build_default_model, default_model_path

    build_default_model(default_model_path())  # once, before two lanes would race to build it
    ports = {p: free_port() for p in (*PROGRAMS, "gateway")}
    conf, key_file, key = render(tmp, ports, kv_tokens)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STRATA_LANE_", "STRATA_GATEWAY_")) and k != "STRATA_ADMIN_KEY"}
    out = open(tmp / "supervisord.stdout", "wb")  # closed in the finally below
    proc = subprocess.Popen([str(BIN / "supervisord"), "-n", "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT,
                            env=env, cwd=tmp)
    st = Stack(tmp, conf, proc, ports, key, key_file)
    try:
        wait_ready(st, timeout)
        yield st
    finally:
        if proc.poll() is None:
            subprocess.run([str(BIN / "supervisorctl"), "-c", str(conf), "shutdown"], capture_output=True, timeout=60,
                           env=env)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in processes_mentioning(str(tmp)):  # only processes whose command line names our temp folder
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out.close()
