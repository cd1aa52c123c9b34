"""A junk-key flood from its own process (so the gateway under test does not share its event loop
with the attacker): ``python -m tests.gateway.flood URL N CONCURRENCY X_FORWARDED_FOR``.

Sends N requests to ``GET URL/v1/models``, each with a different well-formed but unknown key,
at most CONCURRENCY at a time, and prints one JSON line: the count of each status, the
largest index (in sending order) that got a 401, and whether every error was OpenAI-shaped
with the expected code (429s also with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from collections import Counter

import aiohttp

from gateway.keys import KEY_PREFIX


async def flood(url: str, n: int, concurrency: int, xff: str) -> dict[str, object]:
    statuses: list[int] = [0] * n
    shaped = True
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, http: aiohttp.ClientSession) -> None:
        nonlocal shaped
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        async with sem:
            async with http.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}",
                                                             "X-Forwarded-For": xff}) as r:
                body = await r.json()
                statuses[i] = r.status
                err = body.get("error") or {}
                want = {401: "invalid_api_key", 429: "too_many_auth_failures"}.get(r.status)
                if err.get("code") != want or not {"message", "type", "param", "code"} <= set(err):
                    shaped = False
                if r.status == 429 and int(r.headers.get("Retry-After", "0")) < 1:
                    shaped = False

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        await asyncio.gather(*(one(i, http) for i in range(n)))
    counts = Counter(statuses)
    last_401 = max((i for i, s in enumerate(statuses) if s == 401), default=-1)
    return {"counts": {str(k): v for k, v in counts.items()}, "last_401": last_401, "shaped": shaped}


if __name__ == "__main__":
    url, n, conc, xff = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    print(json.dumps(asyncio.run(flood(url, n, conc, xff))))
