"""The gateway's client connections: deadlines, caps, eviction and the process's file-descriptor limit.

aiohttp reads a request's headers with no deadline of its own (its keep-alive timer closes a
connection that sent part of a request only once ``keepalive_timeout`` passed), and it keeps
any number of connections open. One client could hold every file descriptor with connections
that send half their headers (slowloris). The guard here:

* closes a connection whose first request's headers have not arrived within
  ``header_timeout_s`` (408, then closed), and an idle keep-alive connection after
  ``keepalive_timeout_s`` (aiohttp's own timer, set from the config);
* caps open connections per client address (``max_connections_per_address``; the peers in
  ``trusted_proxies`` are exempt: every client behind them shares their address) and in all
  (``max_connections``). A new connection over a cap takes the place of the oldest connection
  of that address (or of any, for the total) that never authenticated and has no request in
  progress; when there is none it gets 503 and is closed. So connections of keyed clients and
  requests in progress are never cut for a newcomer, and a keyed client always gets in while
  anonymous idle connections hold the slots;
* cuts a connection whose answer has not moved for ``stream_write_timeout_s`` after its
  handler finished (bytes waiting in its transport's buffer, the same amount at every look):
  a client that stopped reading a large answer holds nothing for long, keyed or not;
* raises RLIMIT_NOFILE to the hard limit (or ``max_open_files``) at start and lowers
  ``max_connections`` to fit what it got, keeping room for lanes, the database and files.

Body deadlines are per request (``gateway.state.read_body``, the upload handler); a stream's
write deadline is in ``gateway.proxy``. The hooks are aiohttp's ``Server.connection_made`` /
``connection_lost`` (the request handlers call them on their server) and an outermost
middleware that knows when a request is in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.auth import ClientAddress
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics

__all__ = ["FD_RESERVE", "ConnectionGuard", "connection_middleware", "quiet_protocol_errors", "raise_fd_limit"]

log = logging.getLogger("strata.gateway")

FD_RESERVE = 256  # descriptors kept for everything but client connections: lanes, database, logs, uploads
_ABORT_AFTER_S = 2.0  # a closed connection whose peer does not take the last bytes is cut after this


def _response(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500 else
                                 "invalid_request_error", "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_TIMEOUT_408 = _response(408, "Request Timeout", "the request headers did not arrive in time", "request_timeout")
_FULL_503 = _response(503, "Service Unavailable", "too many open connections; retry shortly", "too_many_connections",
                      retry_after=1)


@dataclass(eq=False)
class _Conn:
    transport: asyncio.Transport
    address: str
    capped: bool  # counted against its address's cap (False: a trusted proxy)
    since: float  # the start of its current phase: connected, or its last request finished
    busy: int = 0  # requests in progress (headers arrived, answer not finished)
    served: int = 0  # requests finished
    keyed: bool = False  # a request on it authenticated
    closing: bool = False
    pending: int = 0  # bytes its transport held at the last look
    pending_since: float = 0.0  # ... unchanged since then


class ConnectionGuard:
    """The table of open client connections (see the module's docstring)."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics, client_address: ClientAddress,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.header_timeout_s = config.header_timeout_s
        self.write_timeout_s = config.stream_write_timeout_s
        self.max_total = config.max_connections
        self.max_per_address = config.max_connections_per_address
        self.send_buffer_bytes = config.send_buffer_bytes
        self.metrics = metrics
        self.client_address = client_address
        self._clock = clock
        self._conns: dict[Any, _Conn] = {}  # aiohttp RequestHandler -> its connection, oldest first
        self._per_address: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        metrics.connections_open.set_function(lambda: len(self._conns))

    # ------------------------------------------------------------ wiring
    def install(self, server: web.Server) -> None:
        """Hook ``server`` (``AppRunner.server``, after ``setup()``) and start the deadline sweeper."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._made(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self._lost(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]
        self._task = asyncio.get_running_loop().create_task(self._sweep(), name="gateway-connections")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def open(self) -> int:
        return len(self._conns)

    # ------------------------------------------------------------ requests (the middleware)
    def begin(self, handler: Any) -> _Conn | None:
        conn = self._conns.get(handler)
        if conn is not None:
            conn.busy += 1
        return conn

    def end(self, conn: _Conn) -> None:
        conn.busy -= 1
        conn.served += 1
        conn.since = self._clock()

    def keyed(self, handler: Any) -> None:
        """A request on this connection authenticated: it is never evicted for a newcomer."""
        conn = self._conns.get(handler)
        if conn is not None:
            conn.keyed = True

    # ------------------------------------------------------------ connections
    def _made(self, handler: Any, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) and peer else None
        address = self.client_address.of(host, None) if host else "unknown"
        capped = not (host and self.client_address.is_trusted(host))
        if capped and self._per_address.get(address, 0) >= self.max_per_address and \
                not self._evict(lambda c: c.address == address):
            self._refuse(transport, "per_address")
            return
        if len(self._conns) >= self.max_total and not self._evict(lambda c: True):
            self._refuse(transport, "total")
            return
        if self.send_buffer_bytes is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        self._conns[handler] = _Conn(transport, address, capped, self._clock())
        if capped:
            self._per_address[address] = self._per_address.get(address, 0) + 1

    def _lost(self, handler: Any) -> None:
        conn = self._conns.pop(handler, None)
        if conn is not None and conn.capped:
            n = self._per_address.get(conn.address, 0) - 1
            if n > 0:
                self._per_address[conn.address] = n
            else:
                self._per_address.pop(conn.address, None)

    def _refuse(self, transport: asyncio.Transport, reason: str) -> None:
        self.metrics.connections_refused.labels(reason=reason).inc()
        self._close(transport, _FULL_503)

    def _evict(self, match: Callable[[_Conn], bool]) -> bool:
        """Close the oldest matching connection that never authenticated and has no request in progress."""
        for handler, conn in self._conns.items():
            if not conn.keyed and not conn.busy and not conn.closing and match(conn):
                self.metrics.connections_closed.labels(reason="evicted").inc()
                self._drop(handler, conn, _TIMEOUT_408 if not conn.served else b"")
                return True
        return False

    def _drop(self, handler: Any, conn: _Conn, last: bytes) -> None:
        """Close ``conn`` now; its slot is free at once (the transport's own end may take a moment)."""
        conn.closing = True
        self._lost(handler)
        self._close(conn.transport, last)

    @staticmethod
    def _close(transport: asyncio.Transport, last: bytes) -> None:
        if transport.is_closing():
            return
        if last:
            transport.write(last)
        transport.close()  # after the last bytes; a peer that does not take them is cut below
        asyncio.get_running_loop().call_later(_ABORT_AFTER_S, transport.abort)

    async def _sweep(self) -> None:
        """Close connections whose first request's headers are late (aiohttp's keep-alive timer closes idle ones
        after a request)."""
        every = min(1.0, self.header_timeout_s / 4, self.write_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = self._clock()
            late, stalled = [], []
            for h, c in self._conns.items():
                if not c.busy and not c.served and now - c.since > self.header_timeout_s:
                    late.append((h, c))
                    continue
                if c.busy:  # a request in progress has its own deadlines (a stream's writes: gateway.proxy)
                    continue
                pending = c.transport.get_write_buffer_size()
                if not pending or pending != c.pending:
                    c.pending, c.pending_since = pending, now
                elif now - c.pending_since > self.write_timeout_s:
                    stalled.append((h, c))
            for handler, conn in late:
                self.metrics.connections_closed.labels(reason="header_timeout").inc()
                self._drop(handler, conn, _TIMEOUT_408)
            for handler, conn in stalled:  # nothing more can be sent to it: cut, not closed after a flush
                self.metrics.connections_closed.labels(reason="write_stalled").inc()
                self._lost(handler)
                conn.closing = True
                conn.transport.abort()


def connection_middleware(guard_of: Callable[[web.Request], ConnectionGuard | None]) -> Any:
    """The outermost middleware: a request is in progress on its connection from its headers to its answer."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        guard = guard_of(request)
        conn = guard.begin(request.protocol) if guard is not None else None
        if conn is None:
            return await handler(request)
        try:
            return await handler(request)
        finally:
            guard.end(conn)  # type: ignore[union-attr]

    return middleware


def raise_fd_limit(config: GatewayConfig) -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to ``max_open_files`` (None: the hard limit); returns (soft limit now,
    connections that fit: ``max_connections`` or less)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if config.max_open_files is None else config.max_open_files
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if want != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    fit = config.max_connections if soft == resource.RLIM_INFINITY else \
        max(16, min(config.max_connections, soft - FD_RESERVE))
    if fit < config.max_connections:
        log.warning("max_connections lowered from %d to %d: the open-file limit is %d (raise the hard limit, e.g. "
                    "supervisord's minfds or LimitNOFILE)", config.max_connections, fit, soft)
    return soft, fit


class _ProtocolErrors(logging.Filter):
    """aiohttp logs a malformed request (bad request line or header: the client gets its 400) at ERROR with a
    traceback; from a hostile client that is a log flood. Those records are counted, not logged."""

    def __init__(self, count: Callable[[], None]) -> None:
        super().__init__()
        self.count = count

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            self.count()
            return False
        return True


def quiet_protocol_errors(metrics: GatewayMetrics) -> logging.Filter:
    f = _ProtocolErrors(lambda: metrics.connections_closed.labels(reason="bad_request").inc())
    logging.getLogger("aiohttp.server").addFilter(f)
    return f
