"""HTTP helpers shared by the lane and gateway tests."""

from __future__ import annotations

import re

import aiohttp

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
