"""Durability: SIGKILL while turns are being written. 100 kills of a writer process that runs the real
store code (each life opens the SQLite file, migrates, appends exchanges and acknowledges each after
its commit returned), then a few SIGKILLs of the real gateway process while clients chat. After every
kill: ``PRAGMA integrity_check`` is ok, every acknowledged exchange is present, no exchange is half
stored."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import signal
import sqlite3
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from memory.store import MemoryStore, open_engine
from tests.gateway.conftest import (
    auth,
    gateway_engines,  # noqa: F401  (the fixture)
    running_lane,
)
from tests.memory import _writer

REPO = Path(__file__).resolve().parents[2]
KILLS = 100


def integrity(path: Path) -> str:
    with sqlite3.connect(path) as c:
        return str(c.execute("PRAGMA integrity_check").fetchone()[0])


def check_history(path: Path, session_pk: int, acked: dict[int, int]) -> int:
    """Every acknowledged exchange is there with its answer; exchanges are whole and numbered densely."""
    with sqlite3.connect(path) as c:
        rows = c.execute("SELECT seq, role, content, complete FROM memory_turns WHERE session_pk = ? ORDER BY seq",
                         (session_pk,)).fetchall()
        n_turns = c.execute("SELECT n_turns FROM memory_sessions WHERE pk = ?", (session_pk,)).fetchone()[0]
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1)) and n_turns == len(rows)
    assert len(rows) % 2 == 0, "half an exchange was stored"
    by_seq = {r[0]: r for r in rows}
    for q, a in zip(rows[0::2], rows[1::2], strict=True):
        i = q[2].removeprefix("question ")
        assert q[1] == "user" and a[1] == "assistant" and a[2] == f"answer {i} " * 20 and q[3] and a[3]
    for seq, i in acked.items():
        assert by_seq[seq][2] == f"question {i}", f"acknowledged exchange {i} (turn {seq}) is missing"
    return len(rows)


def test_sigkill_the_writer_100_times(tmp_path: Path) -> None:
    path = tmp_path / "mem.db"
    url = f"sqlite:///{path}"
    store = MemoryStore(open_engine(url))
    sess = store.create_session(1)
    assert sess is not None
    store.engine.dispose()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["memory.store", "tests.memory._writer"])
    acked: dict[int, int] = {}
    rng = random.Random(12)
    start = 0
    t0 = time.monotonic()
    for kill in range(KILLS):
        r, w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_writer.write_forever, args=(url, sess.pk, w, start), daemon=True)
        proc.start()
        w.close()
        assert r.poll(30) and r.recv_bytes() == b"ready", "the writer did not start"
        # the kill lands while exchanges are being written: after 0, 1 or 2 acknowledged ones (waited for, not
        # guessed with a sleep, so a busy box still acknowledges enough to mean something), then a random moment
        for _ in range(rng.randint(0, 2)):
            assert r.poll(30), "the writer acknowledged nothing in 30 s"
            seq, i = r.recv_bytes().decode().split(":")
            acked[int(seq)] = int(i)
            start = max(start, int(i) + 1)
        time.sleep(rng.uniform(0.0, 0.1))
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        while True:
            try:
                seq, i = r.recv_bytes().decode().split(":")
            except EOFError:
                break
            acked[int(seq)] = int(i)
            start = max(start, int(i) + 1)
        r.close()
        start += 1000  # a killed life may have committed past its last ack: keep the markers unique
        if kill % 10 == 9 or kill == KILLS - 1:
            assert integrity(path) == "ok"
            check_history(path, sess.pk, acked)
    n = check_history(path, sess.pk, acked)
    assert len(acked) >= KILLS // 2, f"too few exchanges acknowledged to mean anything: {len(acked)}"
    print(f"\n{KILLS} kills in {time.monotonic() - t0:.1f}s: {len(acked)} acknowledged exchanges, {n} turns stored")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_GATEWAY_", "STRATA_ADMIN_KEY"))}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


async def _start_gateway(env: dict[str, str]) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", env=env, cwd=REPO,
                                                stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    log = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 90)).decode()
        assert line, "gateway exited early: " + "".join(log)
        log.append(line)
        if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
            asyncio.get_running_loop().create_task(_drain(proc))
            return proc, int(m.group(1))


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stderr is not None
    while await proc.stderr.readline():
        pass


@pytest.mark.asyncio(loop_scope="function")
async def test_sigkill_the_gateway_while_chatting(gateway_engines: tuple, tmp_path: Path) -> None:  # noqa: F811
    """The real gateway process, SIGKILLed at random points while two clients chat in one session each;
    restarted each time. Every turn whose HTTP response completed is in the database afterwards."""
    path = tmp_path / "gw.db"
    db = f"sqlite:///{path}"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.keys", "--db-url", db, "create",
                                                "--name", "kill", env=_env(), cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    key = out.decode().strip()
    rng = random.Random(7)
    done: dict[str, list[str]] = {}  # session -> messages whose response completed
    statuses: list[tuple[int, bytes]] = []  # answers other than 200 (reported on failure)
    kills = 5
    async with running_lane("a", gateway_engines[0]) as lane:
        env = _env(STRATA_GATEWAY_DB_URL=db, STRATA_GATEWAY_PORT="0", STRATA_GATEWAY_HOST="127.0.0.1",
                   STRATA_GATEWAY_LANES=json.dumps([{"name": "a", "url": lane.url}]),
                   STRATA_GATEWAY_MEMORY=json.dumps({"summarize": False}), STRATA_GATEWAY_DEFAULT_MAX_TOKENS="2")
        for life in range(kills + 1):
            gw, port = await _start_gateway(env)
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as s:
                if not done:
                    for _ in range(2):
                        async with s.post(url + "/v1/sessions", json={}, headers=auth(key)) as r:
                            done[(await r.json())["id"]] = []

                async def client(sid: str, s: aiohttp.ClientSession = s, url: str = url, life: int = life) -> None:
                    n = 0
                    while True:
                        msg = f"life {life} message {n}"
                        body = {"messages": [{"role": "user", "content": msg}], "session_id": sid, "max_tokens": 2}
                        try:
                            async with s.post(url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
                                raw = await r.read()
                                ok = r.status == 200
                                if not ok:
                                    statuses.append((r.status, raw[:200]))
                        except (aiohttp.ClientError, OSError):
                            return  # the gateway died under us: this response never completed
                        if ok:
                            done[sid].append(msg)
                        n += 1

                before = sum(len(v) for v in done.values())
                tasks = [asyncio.create_task(client(sid)) for sid in done]
                # a new gateway composes without retrieval until its embedding model has loaded, so turns
                # are written from its first request; the allowance is for gateway start on a busy box
                deadline = time.monotonic() + 120
                while sum(len(v) for v in done.values()) == before:  # this life is serving: turns are being written
                    assert time.monotonic() < deadline, f"no turn completed in life {life}: {statuses[:3]}"
                    await asyncio.sleep(0.05)
                if life < kills:
                    await asyncio.sleep(rng.uniform(0.1, 1.5))
                    gw.send_signal(signal.SIGKILL)
                    await gw.wait()
                    await asyncio.wait(tasks, timeout=10)
                else:
                    await asyncio.sleep(1.0)
                    for t in tasks:
                        t.cancel()
                    gw.send_signal(signal.SIGTERM)
                    await gw.wait()
                    await asyncio.gather(*tasks, return_exceptions=True)
            assert integrity(path) == "ok"
    with sqlite3.connect(path) as c:
        for sid, msgs in done.items():
            pk = c.execute("SELECT pk FROM memory_sessions WHERE id = ?", (sid,)).fetchone()[0]
            stored = [r[0] for r in c.execute("SELECT content FROM memory_turns WHERE session_pk = ? AND role = 'user' "
                                              "ORDER BY seq", (pk,))]
            missing = [m for m in msgs if m not in stored]
            assert not missing, f"turns acknowledged to the client but lost: {missing[:5]}"
            roles = [r[0] for r in c.execute("SELECT role FROM memory_turns WHERE session_pk = ? ORDER BY seq", (pk,))]
            assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) % 2 == 0
    total = sum(len(v) for v in done.values())
    assert total >= kills, f"too few completed turns to mean anything: {total} {statuses[:3]}"
    print(f"\n{kills} gateway kills: {total} completed turns, all stored")
