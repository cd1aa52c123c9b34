"""HTTP helpers shared by the lane and gateway tests, and polling against a deadline (never a fixed
sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp

T = TypeVar("T")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


async def scrape(session: aiohttp.ClientSession, url: str, key: str | None = None) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (``key``: the gateway's needs its admin key unless metrics_public)."""
    async with session.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else None) as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


async def sse(resp: aiohttp.ClientResponse) -> list[str]:
    """Every SSE line of a response (comments included), without line ends."""
    lines = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line:
            lines.append(line)
    return lines


async def eventually(probe: Callable[[], Awaitable[T] | T], ok: Callable[[T], bool], within: float, what: str,
                     interval: float = 0.05) -> T:
    """Poll ``probe()`` (awaited when it returns an awaitable) until ``ok(value)``; an AssertionError
    naming ``what`` and the last value after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {within:g}s (last: {value!r})")
        await asyncio.sleep(interval)


def wait_until(probe: Callable[[], T], ok: Callable[[T], bool], within: float, what: str,
               interval: float = 0.05) -> T:
    """The blocking form of :func:`eventually` (for tests that drive real processes from a thread)."""
    deadline = time.monotonic() + within
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {within:g}s (last: {value!r})")
        time.sleep(interval)


REPO = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")


def child_env(drop_prefixes: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a child ``python -m ...`` of the repo, without the variables
    whose names start with one of ``drop_prefixes`` (so a developer's settings cannot leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


@dataclass
class ChildServer:
    """A server started as ``python -m MODULE``: its process, base URL and stderr lines so far."""

    proc: asyncio.subprocess.Process
    url: str
    log: list[str]

    @property
    def text(self) -> str:
        return "".join(self.log)

    async def wait_exit(self, within: float = 30) -> int:
        """The exit code, once the process has ended and its stderr has been read to the end."""
        code = await asyncio.wait_for(self.proc.wait(), within)
        if self._reader is not None:
            await asyncio.wait_for(self._reader, within)
        return code

    _reader: asyncio.Task[None] | None = None


@contextlib.asynccontextmanager
async def child_server(*args: str, env: dict[str, str], what: str = "server",
                       start_within: float = 60) -> AsyncIterator[ChildServer]:
    """Start ``python -m ARGS`` (which must log ``listening on 127.0.0.1:PORT``), yield it once it
    listens, and kill it on the way out if it is still running. Its stderr is collected throughout."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", *args, env=env, cwd=REPO,
                                                stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    stream = proc.stderr
    log: list[str] = []
    server: ChildServer | None = None
    try:
        port = None
        while port is None:
            line = (await asyncio.wait_for(stream.readline(), start_within)).decode()
            assert line, f"{what} exited early: " + "".join(log)
            log.append(line)
            if m := _LISTENING.search(line):
                port = int(m.group(1))

        async def pump() -> None:
            while raw := await stream.readline():
                log.append(raw.decode())

        server = ChildServer(proc, f"http://127.0.0.1:{port}", log)
        server._reader = asyncio.create_task(pump())
        yield server
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if server is not None and server._reader is not None and not server._reader.done():
            server._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server._reader


async def wait_healthy(session: aiohttp.ClientSession, url: str, within: float = 120, path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200."""
    async def status() -> int:
        async with session.get(url + path) as r:
            return r.status
    await eventually(status, lambda s: s == 200, within, f"{url}{path} ready", interval=0.1)
