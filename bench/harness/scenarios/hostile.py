"""hostile: well-behaved clients chat while attackers work the public port at the same time: slow connections
that send half their headers (reconnecting when cut), streams whose clients stop reading, a flood of made-up
keys, an embedding flood and an upload flood from one key each (the attackers' keys have the gateway's default
limits). The same clients alone first, as the baseline. Reported: the clients' errors and TTFT p50/p99 in both
phases and their ratio, what the attackers got (status counts). Checked: the well-behaved clients get no error,
and afterwards every connection and slot is released (the gateway's open connections back to the baseline's plus
the harness's own keep-alive pool, no request in flight on any lane). The attackers run in the harness's process:
on a small box their own CPU use is part of what the well-behaved clients' TTFT shows."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import secrets
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bench.harness.client import ChatResult, TargetError
from bench.harness.context import Context, closed_loop, unique_prefix
from bench.harness.result import ScenarioResult, percentile

NAME = "hostile"
CORRECTNESS = True
KINDS = ("gateway",)
GOOD_CLIENTS = 8
RELEASE_WITHIN_S = 120.0  # stalled streams are cut after stream_write_timeout_s (30 s by default)


async def run(ctx: Context, res: ScenarioResult) -> None:
    t = ctx.target
    if not t.admin_key:
        raise TargetError("hostile needs the admin key (attackers' keys, the gateway's metrics)")
    phase_s = ctx.q(8.0, 60.0)
    good_key = await t.create_key(f"bench-hostile-good-{ctx.seed}")
    # the attackers' keys: the gateway's default limits (made without the harness's lifted ones)
    attackers = {}
    for role in ("stream", "embed", "upload"):
        data = await t.admin("POST", "/v1/admin/keys", {"name": f"bench-hostile-{role}-{ctx.seed}"})
        attackers[role] = str(data["key"])
    before = await t.scrape(t.url)
    bar = ctx.bar(None, "hostile (good requests)")

    async def good(i: int) -> ChatResult:
        r = await t.chat([{"role": "user", "content": unique_prefix() + "Name three primary colors."}],
                         max_tokens=ctx.q(8, 32), stream=True, key=good_key)
        bar.update(1)
        return r

    async def phase(attack: bool) -> tuple[list[ChatResult], dict[str, collections.Counter[str]]]:
        stop = asyncio.Event()
        seen: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        tasks = [asyncio.create_task(_stop_after(stop, phase_s))]
        attack_session = aiohttp.ClientSession()  # closed at the end: its pooled connections are the attackers'
        if attack:
            host, port = _host_port(t.url)
            tasks += [asyncio.create_task(_slow_connection(host, port, stop, seen["slow connections"]))
                      for _ in range(ctx.q(50, 500))]
            tasks += [asyncio.create_task(_stalled_stream(host, port, attackers["stream"], stop,
                                                          seen["stalled streams"])) for _ in range(ctx.q(5, 50))]
            tasks += [asyncio.create_task(_junk_keys(attack_session, t.url, stop, seen["junk keys"]))
                      for _ in range(4)]
            tasks += [asyncio.create_task(_embed_flood(attack_session, t.url, attackers["embed"], stop,
                                                       seen["embedding flood"])) for _ in range(2)]
            tasks += [asyncio.create_task(_upload_flood(attack_session, t.url, attackers["upload"], stop,
                                                        seen["upload flood"]))]
        results = await closed_loop(GOOD_CLIENTS, good, stop)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await attack_session.close()
        return results, seen

    base, _ = await phase(False)
    hostile, seen = await phase(True)
    bar.close()

    # afterwards: every connection and slot is released
    t0 = time.monotonic()
    released = False
    state: dict[str, Any] = {}
    while time.monotonic() - t0 < RELEASE_WITHIN_S:
        m = await t.scrape(t.url)
        lanes = await t.admin("GET", "/v1/admin/lanes")
        state = {"connections_open": m.get("strata_gateway_connections_open"),
                 "in_flight": sum(int(x["in_flight"]) for x in lanes["data"])}
        # what may stay: the harness's own keep-alive pool (a connection per good client, the scrapes')
        if state["in_flight"] == 0 and (state["connections_open"] or 0) <= \
                (before.get("strata_gateway_connections_open") or 0) + GOOD_CLIENTS + 2:
            released = True
            break
        await asyncio.sleep(1.0)
    release_s = time.monotonic() - t0

    rows, figures = [], {}
    for label, rs in (("alone", base), ("under attack", hostile)):
        ok = [r for r in rs if r.ok]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        figures[label] = (percentile(ttfts, 50), percentile(ttfts, 99))
        rows.append([label, len(rs), len(rs) - len(ok), _f(figures[label][0]), _f(figures[label][1])])
    failed = [r for r in hostile if not r.ok]
    for r in failed[:3]:
        res.notes.append(f"a well-behaved request failed under attack: HTTP {r.status} {r.error}")
    p99_base, p99_attack = figures["alone"][1], figures["under attack"][1]
    ratio = p99_attack / p99_base if p99_base and p99_attack else None
    res.table(f"{GOOD_CLIENTS} well-behaved streaming clients, {phase_s:.0f} s alone then {phase_s:.0f} s under attack",
              ["phase", "requests", "failed", "TTFT p50 s", "TTFT p99 s"], rows)
    res.table("What the attackers got (HTTP status or outcome: count)", ["attack", "outcomes"],
              [[name, ", ".join(f"{k}: {v}" for k, v in sorted(c.items()))] for name, c in sorted(seen.items())])
    after = await t.scrape(t.url)
    res.table("Gateway counters during the attack", ["metric", "increase"],
              [[name, int(after.get(name, 0) - before.get(name, 0))] for name in sorted(after)
               if name.startswith(("strata_gateway_connections_closed_total", "strata_gateway_connections_refused",
                                   "strata_gateway_rate_limited_total", "strata_gateway_auth_failures_total"))
               and after.get(name, 0) != before.get(name, 0)])
    res.metric("ttft_p99_s_alone", p99_base, "s", "lower")
    res.metric("ttft_p99_s_under_attack", p99_attack, "s", "lower")
    res.metric("ttft_p99_ratio", ratio, "x", "lower")
    res.metric("release_s", release_s, "s", "lower")
    res.check("well-behaved requests failed under attack", len(failed), "==", 0)
    res.check("connections and slots released after the attack", 1.0 if released else 0.0, "==", 1.0,
              note=json.dumps(state))
    res.data["ttft"] = {"alone": [r.ttft_s for r in base], "under_attack": [r.ttft_s for r in hostile]}


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _host_port(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80


async def _stop_after(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        stop.set()


async def _slow_connection(host: str, port: int, stop: asyncio.Event, seen: collections.Counter[str]) -> None:
    """Half a request's headers, then nothing; a new connection each time the gateway cuts one."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            seen["connect failed"] += 1
            await asyncio.sleep(0.5)
            continue
        try:
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            await writer.drain()
            got = await _until_closed(reader, stop)
            seen[got] += 1
        except OSError:
            seen["reset"] += 1
        finally:
            writer.close()
        await asyncio.sleep(0.5)  # persistent, not a spin: the harness shares the box with what it measures


async def _until_closed(reader: asyncio.StreamReader, stop: asyncio.Event) -> str:
    read = asyncio.ensure_future(reader.read(64))
    wait = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({read, wait}, return_when=asyncio.FIRST_COMPLETED)
    wait.cancel()
    if read not in done:
        read.cancel()
        return "still open at the end"
    data = read.result()
    return data.split(b"\r\n", 1)[0].decode(errors="replace")[9:12] if data else "closed"


async def _stalled_stream(host: str, port: int, key: str, stop: asyncio.Event,
                          seen: collections.Counter[str]) -> None:
    """A streaming chat (large chunks: logprobs) whose client never reads a byte of the answer."""
    body = json.dumps({"messages": [{"role": "user", "content": unique_prefix() + "Tell a long story."}],
                       "stream": True, "max_tokens": 2000, "ignore_eos": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    while not stop.is_set():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(s, (host, port))
            await loop.sock_sendall(s, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                                    key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: " +
                                    str(len(body)).encode() + b"\r\n\r\n" + body)
            await stop.wait()  # never read: the gateway's write deadline must cut it
            seen["held to the end"] += 1
        except OSError:
            seen["cut"] += 1
            await asyncio.sleep(0.5)
        finally:
            s.close()


async def _junk_keys(session: aiohttp.ClientSession, url: str, stop: asyncio.Event,
                     seen: collections.Counter[str]) -> None:
    while not stop.is_set():
        headers = {"Authorization": f"Bearer sk-strata-{secrets.token_urlsafe(32)}"}
        try:
            async with session.get(url + "/v1/models", headers=headers) as r:
                await r.read()
                seen[str(r.status)] += 1
        except aiohttp.ClientError:
            seen["error"] += 1


async def _embed_flood(session: aiohttp.ClientSession, url: str, key: str, stop: asyncio.Event,
                       seen: collections.Counter[str]) -> None:
    inputs = [f"attack text number {i} with a few more words" for i in range(256)]
    while not stop.is_set():
        try:
            async with session.post(url + "/v1/embeddings", json={"input": inputs},
                                    headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                seen[str(r.status)] += 1
                if r.status == 429:
                    await asyncio.sleep(0.2)  # a client that ignores Retry-After, but not a busy loop
        except aiohttp.ClientError:
            seen["error"] += 1


async def _upload_flood(session: aiohttp.ClientSession, url: str, key: str, stop: asyncio.Event,
                        seen: collections.Counter[str]) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    cid = None
    while cid is None:  # a new key's first call may meet the junk-key flood's auth budget (429): wait, retry
        wait = 0.2
        try:
            async with session.post(url + "/v1/collections", json={"name": f"flood-{secrets.token_hex(4)}"},
                                    headers=headers) as r:
                if r.status == 201:
                    cid = (await r.json())["id"]
                    break
                seen[f"collection {r.status}"] += 1
                if r.status not in (429, 503):
                    return
                with contextlib.suppress(ValueError):
                    wait = float(r.headers.get("Retry-After", "1"))
        except aiohttp.ClientError:
            seen["error"] += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), min(wait, 5.0))
        if stop.is_set():
            return
    i = 0
    while not stop.is_set():
        form = aiohttp.FormData()
        form.add_field("file", f"flood document {i} {secrets.token_hex(16)}\n".encode() * 200,
                       filename=f"flood-{i}.txt", content_type="text/plain")
        i += 1
        try:
            async with session.post(f"{url}/v1/collections/{cid}/documents", data=form, headers=headers) as r:
                await r.read()
                seen[str(r.status)] += 1
                if r.status == 429:
                    await asyncio.sleep(0.2)
        except aiohttp.ClientError:
            seen["error"] += 1
