"""The repository's process table run in a temp folder: render supervisord.conf, start it, wait, shut it down.

One helper for every caller that runs the real stack away from ``make run``'s state: the benchmark
harness's throwaway stack (bench/harness/stack.py), the integration tests (tests/integration/conftest.py)
and the GPU machine's stack check (tests/engine/gpu/stack_on_gpu.py). The repository's supervisord.conf,
lane files and gateway file are the source: :func:`render` changes only what each caller names (ports,
cores, KV size, model, device, timeouts) and the state paths, which move under the temp folder (logs,
socket, a SQLite database and a random 0600 admin key), so each caller runs what ``make run`` serves.
Teardown is ``supervisorctl shutdown``; then no process whose command line names the temp folder may be
left (:meth:`Supervised.stop` kills and returns them).

Importable as ``deploy.stack`` with the repository on ``sys.path`` (make exports it; pytest's rootdir).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["BIN", "PROGRAMS", "REPO", "StackError", "Supervised", "child_env", "dump_toml", "free_port",
           "get_json", "one_core_each", "processes_mentioning", "render", "supervised", "write_gateway_config"]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: supervisord, supervisorctl
PROGRAMS = ("lane_a", "lane_b")


class StackError(RuntimeError):
    """The stack could not be rendered or did not come up (the message carries the end of the logs)."""


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


def get_json(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, Any]:
    """(status, JSON body) of a GET, an error's body too ({} when it is not JSON); (0, {"error": why}) when
    nothing answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}
    except (OSError, ValueError) as e:
        return 0, {"error": str(getattr(e, "reason", e))}


def one_core_each() -> dict[str, list[int]]:
    """One explicit core per lane: the first two allowed CPUs (both the same on a 1-CPU box)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"lane_a": [cpus[0]], "lane_b": [cpus[1] if len(cpus) > 1 else cpus[0]]}


def child_env(drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without what would override the rendered files (``STRATA_LANE_*``,
    ``STRATA_GATEWAY_*``, ``STRATA_ADMIN_KEY``) and without the variables named in ``drop``."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("STRATA_LANE_", "STRATA_GATEWAY_")) and k not in ("STRATA_ADMIN_KEY", *drop)}


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
    # the journal beside the database even when an override moves the database to PostgreSQL (the gateway's own
    # default for that is the repository's var/)
    gw.update({"port": ports["gateway"], "host": "127.0.0.1", "db_url": f"sqlite:///{tmp / 'var' / 'gateway.db'}",
               "log_journal_dir": str(tmp / "var" / f"request-journal-{ports['gateway']}"),
               "admin_key_file": str(key_file), "health_interval_s": 0.25, **overrides})
    (tmp / "gateway.toml").write_text(dump_toml(gw) + "".join("\n[[lanes]]\n" + dump_toml(x) for x in lanes))
    return key_file


def render(tmp: Path, ports: dict[str, int], admin_key: str, lanes: Mapping[str, Mapping[str, Any]],
           gateway: Mapping[str, Any] | None = None, edit: Callable[[str], str] | None = None) -> Path:
    """``tmp/supervisord.conf`` (returned): the repository's with each lane's file replaced by
    ``deploy/lanes/<program>.toml`` plus its port and ``lanes[program]`` written under ``tmp``, the gateway's
    by deploy/gateway.toml through :func:`write_gateway_config` with ``gateway`` on top (None: a stack
    without a ``gateway`` port keeps the file), ``%(here)s/var`` moved to ``tmp/var`` and every other
    ``%(here)s`` the repository. ``edit`` rewrites the repository's text first (its ``%(here)s`` intact)."""
    text = (REPO / "supervisord.conf").read_text()
    if edit is not None:
        text = edit(text)
    if "%(here)s/var/" not in text:
        raise StackError("supervisord.conf no longer keeps its state under %(here)s/var/")
    for program in PROGRAMS:
        src = f"%(here)s/deploy/lanes/{program}.toml"
        if src not in text:
            raise StackError(f"supervisord.conf no longer runs {program} with {src}")
        lane = tomllib.loads((REPO / "deploy" / "lanes" / f"{program}.toml").read_text())
        lane.update(port=ports[program], **lanes.get(program, {}))
        (tmp / f"{program}.toml").write_text(dump_toml(lane))
        text = text.replace(src, str(tmp / f"{program}.toml"))
    if "gateway" in ports:
        src = "%(here)s/deploy/gateway.toml"
        if src not in text:
            raise StackError(f"supervisord.conf no longer runs the gateway with {src}")
        write_gateway_config(tmp, ports, admin_key, **(gateway or {}))
        text = text.replace(src, str(tmp / "gateway.toml"))
    text = text.replace("%(here)s/var", str(tmp / "var")).replace("%(here)s", str(REPO))
    for sub in ("var/run", "var/log"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    if len(str(tmp / "var" / "run" / "supervisor.sock")) >= 100:
        raise StackError(f"{tmp}: too long a path for supervisord's unix socket")
    conf = tmp / "supervisord.conf"
    conf.write_text(text)
    return conf


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


@dataclass
class Supervised:
    """A supervisord on a rendered config (:func:`render`) in ``dir``, and ways to reach what it runs."""

    dir: Path
    conf: Path
    ports: dict[str, int]
    admin_key: str
    env: dict[str, str] = field(default_factory=child_env)
    # None: the supervisord and supervisorctl scripts beside this interpreter (the venv's); else this
    # python runs them as ``-m supervisor.supervisord`` (a machine without the venv's scripts)
    python: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    left: list[int] = field(default_factory=list)  # what stop() found still running (and killed)
    _out: IO[bytes] | None = field(default=None, repr=False)

    def _tool(self, name: str) -> list[str]:
        return [str(BIN / name)] if self.python is None else [self.python, "-m", f"supervisor.{name}"]

    def url(self, program: str) -> str:
        return f"http://127.0.0.1:{self.ports[program]}"

    @property
    def gateway_url(self) -> str:
        return self.url("gateway")

    @property
    def admin_key_file(self) -> Path:
        return self.dir / "var" / "secrets" / "admin.key"

    @property
    def log_dir(self) -> Path:
        return self.dir / "var" / "log"

    def log_tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def ctl(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self._tool("supervisorctl"), "-c", str(self.conf), *args], capture_output=True,
                              text=True, timeout=timeout, env=self.env)

    def start(self) -> None:
        """``supervisord -n`` in the background, its own output in ``dir/supervisord.stdout``."""
        self._out = open(self.dir / "supervisord.stdout", "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen([*self._tool("supervisord"), "-n", "-c", str(self.conf)], stdout=self._out,
                                     stderr=subprocess.STDOUT, env=self.env, cwd=self.dir)

    def gateway_ready(self) -> bool:
        """The gateway's /readyz is 200 and it sees every lane ready."""
        if get_json(self.gateway_url + "/readyz", timeout=3.0)[0] != 200:
            return False
        code, body = get_json(self.gateway_url + "/v1/admin/lanes", {"Authorization": f"Bearer {self.admin_key}"})
        return code == 200 and all(x["ready"] for x in body["data"])

    def wait_stack(self, timeout: float) -> None:
        """Until every lane's /health is 200 and the gateway is ready; StackError if supervisord exits first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise StackError(f"supervisord exited {self.proc.returncode}:\n{self.log_tail('supervisord')}")
            if all(get_json(self.url(p) + "/health", timeout=3.0)[0] == 200 for p in PROGRAMS) and self.gateway_ready():
                return
            if time.monotonic() > deadline:
                raise StackError(f"the stack is not ready after {timeout:.0f}s\n" + "\n".join(
                    f"{n}: {self.log_tail(n)}" for n in (*PROGRAMS, "gateway")))
            time.sleep(0.25)

    def create_key(self, name: str, *, unlimited: bool = False) -> str:
        """A new API key, made through the gateway's admin API; ``unlimited``: without per-key limits (the
        benchmarks measure the stack, not its [limits] defaults)."""
        body: dict[str, Any] = {"name": name}
        if unlimited:
            from gateway.config import KEY_LIMITS

            body["limits"] = dict.fromkeys(KEY_LIMITS)
        req = urllib.request.Request(self.gateway_url + "/v1/admin/keys", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {self.admin_key}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return str(json.loads(r.read())["key"])

    def stop(self, timeout: float = 90.0) -> list[int]:
        """``supervisorctl shutdown`` and wait (killed after ``timeout``); then every process left whose command
        line names ``dir`` is killed: returns their pids (none on a clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.ctl("shutdown", timeout=60)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.left = left = processes_mentioning(str(self.dir))  # lanes, listener, supervisord: all name the folder
        for pid in left:  # only processes of this stack: their command line names our folder
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._out is not None:
            self._out.close()
        return left


@contextlib.contextmanager
def supervised(st: Supervised, timeout: float | None = None) -> Iterator[Supervised]:
    """``st`` started (and, with ``timeout``, ready: :meth:`Supervised.wait_stack`); stopped on the way out."""
    st.start()
    try:
        if timeout is not None:
            st.wait_stack(timeout)
        yield st
    finally:
        st.stop()
