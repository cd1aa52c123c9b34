"""The repo's supervisord.conf, run for real: real processes, real HTTP, the real default model.

The fixture renders ``supervisord.conf`` into a temp dir changing only state paths and ports:
``%(here)s/var`` -> the temp dir's ``var``, ``%(here)s/deploy/lanes/lane_X.toml`` -> temp lane
files (the repo's lane files with a free port, one explicit core each, a small KV arena), every
other ``%(here)s`` -> the repo root; ``%(here)s/deploy/gateway.toml`` -> a temp gateway file (the
repo's with a free port, the temp lanes, a temp SQLite database and a temp 0600 admin key file). Then ``supervisord -n -c <rendered>`` (the venv's), and the
tests drive it with ``supervisorctl -c <rendered>``. Teardown: ``supervisorctl shutdown``, then
no process whose command line names the temp dir may be left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.harness.stack import dump_toml, free_port, processes_mentioning, write_gateway_config
from engine.default_model import build_default_model, default_model_path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: supervisord, supervisorctl
PROGRAMS = ("lane_a", "lane_b")
GROUP = "lanes"
GATEWAY = "gateway"
ADMIN_KEY = "test-admin-" + "k" * 24  # only ever in a 0600 temp file and this process
KV_TOKENS = 2048
DRAIN_TIMEOUT_S = 30.0  # below the conf's stopwaitsecs (50); the drain test's streams take ~10 s
READY_TIMEOUT_S = 120.0


def lane_cores() -> dict[str, list[int]]:
    """One explicit core per lane: the first two allowed CPUs (both the same on a 1-CPU box)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"lane_a": [cpus[0]], "lane_b": [cpus[1] if len(cpus) > 1 else cpus[0]]}


def render_gateway(tmp: Path, ports: dict[str, int]) -> Path:
    """The repo's deploy/gateway.toml with the temp lanes, port, database and admin key file."""
    write_gateway_config(tmp, ports, ADMIN_KEY, shutdown_timeout_s=5.0, ping_interval_s=1.0)
    return tmp / "gateway.toml"


def render_config(tmp: Path, ports: dict[str, int], cores: dict[str, list[int]]) -> Path:
    """The repo's supervisord.conf with state paths, lane files and the gateway file moved into ``tmp``."""
    text = (REPO / "supervisord.conf").read_text()
    assert "%(here)s/var/" in text, "supervisord.conf no longer keeps its state under %(here)s/var/"
    for program in PROGRAMS:
        src = f"%(here)s/deploy/lanes/{program}.toml"
        assert src in text, f"supervisord.conf no longer runs {program} with {src}"
        lane = tomllib.loads((REPO / "deploy" / "lanes" / f"{program}.toml").read_text())
        lane.update(port=ports[program], cores=cores[program], kv_tokens=KV_TOKENS,
                    drain_timeout_s=DRAIN_TIMEOUT_S, ping_interval_s=1.0)
        dst = tmp / f"{program}.toml"
        dst.write_text(dump_toml(lane))
        text = text.replace(src, str(dst))
    if GATEWAY in ports:
        src = "%(here)s/deploy/gateway.toml"
        assert src in text, f"supervisord.conf no longer runs the gateway with {src}"
        text = text.replace(src, str(render_gateway(tmp, ports)))
    text = text.replace("%(here)s/var", str(tmp / "var")).replace("%(here)s", str(REPO))
    for sub in ("var/run", "var/log"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    sock = tmp / "var" / "run" / "supervisor.sock"
    assert len(str(sock)) < 100, f"unix socket path too long for AF_UNIX: {sock}"
    out = tmp / "supervisord.conf"
    out.write_text(text)
    return out


def http_get(url: str, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    """(status, JSON body); (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body or b"{}")
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


@dataclass
class Stack:
    """A running supervisord with the repo's process table, and ways to poke at it."""

    dir: Path
    conf: Path
    proc: subprocess.Popen[bytes]
    ports: dict[str, int]
    cores: dict[str, list[int]]
    env: dict[str, str]
    seen_pids: set[int] = field(default_factory=set)
    started_s: float = 0.0  # supervisord's start to both lanes and the gateway ready: this run's baseline

    def ctl(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "supervisorctl"), "-c", str(self.conf), *args], capture_output=True,
                              text=True, timeout=timeout, env=self.env)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[GATEWAY]}"

    @property
    def gateway_conf(self) -> Path:
        return self.dir / "gateway.toml"

    def wait_gateway(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the gateway's /readyz is 200 and it sees every lane ready."""
        deadline = time.monotonic() + timeout
        while True:
            code, _ = http_get(self.gateway_url + "/readyz", timeout=2)
            if code == 200:
                req = urllib.request.Request(self.gateway_url + "/v1/admin/lanes",
                                             headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                try:
                    with urllib.request.urlopen(req, timeout=5) as r:
                        lanes = json.loads(r.read())["data"]
                    if all(lane["ready"] for lane in lanes):
                        return
                except (OSError, ValueError):
                    pass
            if time.monotonic() > deadline:
                log = (self.log_dir / "gateway.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"gateway not ready after {timeout:.0f}s\n{log}")
            time.sleep(0.25)

    def wait_retrieval(self, timeout: float = 300.0) -> None:
        """Until the gateway's embedding model is loaded (``retrieval`` in /readyz): before that, memory composes
        without retrieval and document search is BM25 alone. The model loads in the background from the gateway's
        start (over a minute on a busy box)."""
        deadline = time.monotonic() + timeout
        while (state := http_get(self.gateway_url + "/readyz", timeout=5)[1].get("retrieval")) != "ready":
            if time.monotonic() > deadline:
                log = (self.log_dir / "gateway.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"the gateway's embedding model is not loaded after {timeout:.0f}s "
                                     f"(retrieval: {state})\n{log}")
            time.sleep(0.5)

    def url(self, program: str) -> str:
        return f"http://127.0.0.1:{self.ports[program]}"

    def state(self, program: str) -> str:
        """The state word of ``supervisorctl status lanes:<program>`` (RUNNING, STOPPED, ...)."""
        out = self.ctl("status", f"{GROUP}:{program}").stdout.split()
        return out[1] if len(out) > 1 else "?"

    def pid(self, program: str) -> int:
        pid = int(self.ctl("pid", f"{GROUP}:{program}").stdout.strip() or 0)
        if pid:
            self.seen_pids.add(pid)
        return pid

    @property
    def log_dir(self) -> Path:
        return self.dir / "var" / "log"

    def supervisord_log(self) -> str:
        return (self.log_dir / "supervisord.log").read_text(errors="replace")

    def lane_log(self, program: str) -> str:
        return (self.log_dir / f"{program}.log").read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        path = self.log_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]

    def wait_ready(self, program: str, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Until supervisord says RUNNING and /health says 200; returns /v1/lane."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisord exited {self.proc.returncode}:\n{self.supervisord_log()}")
            state = self.state(program)
            code, _ = http_get(self.url(program) + "/health", timeout=2)
            if state == "RUNNING" and code == 200:
                _, info = http_get(self.url(program) + "/v1/lane")
                self.seen_pids.add(int(info["pid"]))
                return info
            if state == "FATAL" or time.monotonic() > deadline:
                raise AssertionError(f"{program}: state {state}, /health {code} after {timeout:.0f}s\n"
                                     f"{self.lane_log(program)[-3000:]}\n{self.supervisord_log()[-3000:]}")
            time.sleep(0.25)


def _shutdown(stack: Stack) -> list[int]:
    """supervisorctl shutdown; wait; returns the pids left over (then killed) — must be none."""
    if stack.proc.poll() is None:
        stack.ctl("shutdown", timeout=30)
        try:
            stack.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            stack.proc.kill()
            stack.proc.wait()
    left = processes_mentioning(str(stack.dir))  # lanes, listener, supervisord: all name the temp dir
    for pid in left:  # only processes started by this fixture: their command line names our temp dir
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@contextlib.contextmanager
def start_stack(tmp: Path, edit_config: Callable[[str], str] | None = None,
                drop_env: tuple[str, ...] = ()) -> Iterator[Stack]:
    """supervisord with both lanes and the gateway on free ports under ``tmp``, ready; shut down and
    checked on the way out. ``edit_config`` may rewrite the rendered supervisord.conf (fault tests);
    ``drop_env`` names more variables kept from the children."""
    build_default_model(default_model_path())  # once, before two lanes would race to build it
    ports = {p: free_port() for p in (*PROGRAMS, GATEWAY)}
    cores = lane_cores()
    conf = render_config(tmp, ports, cores)
    if edit_config is not None:
        conf.write_text(edit_config(conf.read_text()))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STRATA_LANE_", "STRATA_GATEWAY_")) and k not in ("STRATA_ADMIN_KEY", *drop_env)}
    out = open(tmp / "supervisord.stdout", "wb")  # closed in the finally below
    proc = subprocess.Popen([str(BIN / "supervisord"), "-n", "-c", str(conf)], stdout=out,
                            stderr=subprocess.STDOUT, env=env, cwd=tmp)
    st = Stack(tmp, conf, proc, ports, cores, env)
    t0 = time.monotonic()
    try:
        for program in PROGRAMS:
            st.wait_ready(program)
        st.wait_gateway()
        st.started_s = time.monotonic() - t0
        yield st
    finally:
        left = _shutdown(st)
        out.close()
        assert st.proc.returncode == 0, f"supervisord exited {st.proc.returncode}"
        assert not left, f"processes left after shutdown (killed): {left}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(tmp_path_factory.mktemp("sv")) as st:
        yield st
