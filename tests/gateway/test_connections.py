"""The connection guard on a real aiohttp server and real sockets: eviction of the oldest connection that never
authenticated, keyed connections kept, 503 when nothing may go, the header deadline, the fd limit."""

from __future__ import annotations

import asyncio
import resource
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from gateway.auth import ClientAddress
from gateway.config import GatewayConfig
from gateway.connections import ConnectionGuard, connection_middleware, raise_fd_limit
from gateway.metrics import GatewayMetrics

GUARD = web.AppKey("guard", ConnectionGuard)


@asynccontextmanager
async def guarded(**cfg: object) -> AsyncIterator[tuple[ConnectionGuard, int]]:
    config = GatewayConfig(**cfg)  # type: ignore[arg-type]
    guard = ConnectionGuard(config, GatewayMetrics(), ClientAddress(config.trusted_proxies))

    async def hello(request: web.Request) -> web.Response:
        if request.query.get("key"):  # stands for an authenticated request
            guard.keyed(request.protocol)
        if request.path == "/big":
            return web.Response(body=b"x" * (32 << 20))
        return web.Response(text="ok")

    app = web.Application(middlewares=[connection_middleware(lambda r: r.app[GUARD])])
    app[GUARD] = guard
    app.router.add_get("/", hello)
    app.router.add_get("/big", hello)
    runner = web.AppRunner(app, keepalive_timeout=60)
    await runner.setup()
    assert runner.server is not None
    guard.install(runner.server)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield guard, runner.addresses[0][1]
    finally:
        await guard.stop()
        await runner.cleanup()


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _request(w: asyncio.StreamWriter, r: asyncio.StreamReader, path: str = "/") -> bytes:
    w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    await r.readexactly(2)  # "ok"
    return head


async def _closed(r: asyncio.StreamReader, within: float = 5) -> bytes:
    """What the server sent before it closed the connection (fails when it stays open)."""
    return await asyncio.wait_for(r.read(), within)


async def test_newcomers_evict_the_oldest_anonymous_connection_never_a_keyed_one() -> None:
    async with guarded(max_connections_per_address=3, header_timeout_s=60) as (guard, port):
        keyed = await _open(port)
        assert (await _request(keyed[1], keyed[0], "/?key=1")).startswith(b"HTTP/1.1 200")
        idle = [await _open(port) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert guard.open == 3
        newcomer = await _open(port)  # over the address's cap: the oldest anonymous one goes, with a 408
        assert (await _closed(idle[0][0])).startswith(b"HTTP/1.1 408")
        assert (await _request(newcomer[1], newcomer[0])).startswith(b"HTTP/1.1 200")
        another = await _open(port)  # the oldest anonymous idle one is now idle[1]
        assert (await _closed(idle[1][0])).startswith(b"HTTP/1.1 408")
        # the table holds the keyed connection, the newcomer (served, idle: anonymous) and `another`
        assert (await _request(keyed[1], keyed[0])).startswith(b"HTTP/1.1 200")  # never evicted
        for _, w in (keyed, newcomer, another):
            w.close()
        m = guard.metrics.connections_closed
        assert m.labels(reason="evicted")._value.get() == 2


async def test_full_of_connections_that_may_not_go_a_newcomer_gets_503() -> None:
    async with guarded(max_connections_per_address=2, header_timeout_s=60) as (guard, port):
        conns = [await _open(port) for _ in range(2)]
        for r, w in conns:
            assert (await _request(w, r, "/?key=1")).startswith(b"HTTP/1.1 200")
        r, w = await _open(port)
        got = await _closed(r)
        assert got.startswith(b"HTTP/1.1 503") and b"too_many_connections" in got
        assert guard.metrics.connections_refused.labels(reason="per_address")._value.get() == 1
        for _, cw in conns:
            cw.close()


async def test_half_sent_headers_get_408_after_the_header_deadline() -> None:
    async with guarded(header_timeout_s=0.5) as (guard, port):
        r, w = await _open(port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = asyncio.get_running_loop().time()
        got = await _closed(r, 5)
        assert got.startswith(b"HTTP/1.1 408") and asyncio.get_running_loop().time() - t0 < 2
        await asyncio.sleep(0.05)
        assert guard.open == 0


def test_fd_limit_is_raised_and_connections_fit_under_it() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 1024:
        pytest.skip("needs a finite hard limit of at least 1024")
    try:
        got, fit = raise_fd_limit(GatewayConfig(max_open_files=1024, max_connections=100_000))
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got == max(soft, 1024)
        assert fit == got - 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_an_answer_the_client_does_not_read_is_cut() -> None:
    """A large answer to a client that stops reading (keyed or not): once its handler is done, the bytes left in
    the transport that do not move for stream_write_timeout_s get the connection cut."""
    async with guarded(stream_write_timeout_s=0.5, header_timeout_s=60) as (guard, port):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(s, b"GET /big?key=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.2)
        assert guard.open == 1
        deadline = loop.time() + 10
        while guard.open and loop.time() < deadline:
            await asyncio.sleep(0.1)
        assert guard.open == 0
        assert guard.metrics.connections_closed.labels(reason="write_stalled")._value.get() == 1
        s.close()
