"""HTTP helpers shared by the lane and gateway tests, and polling against a deadline (never a fixed
sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

T = TypeVar("T")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    async with session.get(url + "/metrics") as r:
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
