"""The repo's supervisord.conf, run for real: real processes, real HTTP, the real default model.

The fixture renders ``supervisord.conf`` into a temp dir with deploy/stack.py, changing only state paths
and ports: ``%(here)s/var`` -> the temp dir's ``var``, ``%(here)s/deploy/lanes/lane_X.toml`` -> temp lane
files (the repo's lane files with a free port, one explicit core each, a small KV arena), every
other ``%(here)s`` -> the repo root; ``%(here)s/deploy/gateway.toml`` -> a temp gateway file (the
repo's with a free port, the temp lanes, a temp SQLite database and a temp 0600 admin key file). Then
``supervisord -n -c <rendered>`` (the venv's), and the tests drive it with ``supervisorctl -c <rendered>``.
Teardown: ``supervisorctl shutdown``, then no process whose command line names the temp dir may be left.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from deploy.stack import (
    BIN,
    PROGRAMS,
    REPO,
    Supervised,
    child_env,
    dump_toml,
    free_port,
    get_json,
    one_core_each,
    render,
)
from engine.default_model import build_default_model, default_model_path

__all__ = ["ADMIN_KEY", "BIN", "GROUP", "PROGRAMS", "REPO", "Stack", "dump_toml", "http_get", "start_stack"]

GROUP = "lanes"
GATEWAY = "gateway"
ADMIN_KEY = "test-admin-" + "k" * 24  # only ever in a 0600 temp file and this process
KV_TOKENS = 2048
DRAIN_TIMEOUT_S = 30.0  # below the conf's stopwaitsecs (50); the drain test's streams take ~10 s
READY_TIMEOUT_S = 120.0
http_get = get_json  # (status, JSON body); (0, {"error": why}) when nothing answers


@dataclass
class Stack(Supervised):
    """A running supervisord with the repo's process table, and ways to poke at it."""

    cores: dict[str, list[int]] = field(default_factory=dict)
    seen_pids: set[int] = field(default_factory=set)
    started_s: float = 0.0  # supervisord's start to both lanes and the gateway ready: this run's baseline

    @property
    def gateway_conf(self) -> Path:
        return self.dir / "gateway.toml"

    def wait_gateway(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the gateway's /readyz is 200 and it sees every lane ready."""
        deadline = time.monotonic() + timeout
        while not self.gateway_ready():
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

    def state(self, program: str) -> str:
        """The state word of ``supervisorctl status lanes:<program>`` (RUNNING, STOPPED, ...)."""
        out = self.ctl("status", f"{GROUP}:{program}").stdout.split()
        return out[1] if len(out) > 1 else "?"

    def pid(self, program: str) -> int:
        pid = int(self.ctl("pid", f"{GROUP}:{program}").stdout.strip() or 0)
        if pid:
            self.seen_pids.add(pid)
        return pid

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
            if self.proc is not None and self.proc.poll() is not None:
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


@contextlib.contextmanager
def start_stack(tmp: Path, edit_config: Callable[[str], str] | None = None,
                drop_env: tuple[str, ...] = ()) -> Iterator[Stack]:
    """supervisord with both lanes and the gateway on free ports under ``tmp``, ready; shut down and
    checked on the way out. ``edit_config`` may rewrite the rendered supervisord.conf (fault tests);
    ``drop_env`` names more variables kept from the children."""
    build_default_model(default_model_path())  # once, before two lanes would race to build it
    ports = {p: free_port() for p in (*PROGRAMS, GATEWAY)}
    cores = one_core_each()
    lanes = {p: {"cores": cores[p], "kv_tokens": KV_TOKENS, "drain_timeout_s": DRAIN_TIMEOUT_S,
                 "ping_interval_s": 1.0} for p in PROGRAMS}
    conf = render(tmp, ports, ADMIN_KEY, lanes, gateway={"shutdown_timeout_s": 5.0, "ping_interval_s": 1.0})
    if edit_config is not None:
        conf.write_text(edit_config(conf.read_text()))
    st = Stack(tmp, conf, ports, ADMIN_KEY, env=child_env(drop_env), cores=cores)
    t0 = time.monotonic()
    st.start()
    try:
        for program in PROGRAMS:
            st.wait_ready(program)
        st.wait_gateway()
        st.started_s = time.monotonic() - t0
        yield st
    finally:
        left = st.stop()
        assert st.proc is not None and st.proc.returncode == 0, f"supervisord exited {st.proc and st.proc.returncode}"
        assert not left, f"processes left after shutdown (killed): {left}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(tmp_path_factory.mktemp("sv")) as st:
        yield st
