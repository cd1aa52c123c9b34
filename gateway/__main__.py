"""Run the gateway: ``python -m gateway [--config gateway.toml] [--host H] [--port N] [--check-config]``.

SIGTERM / SIGINT: ``/readyz`` turns 503, the listening socket closes (no new connections),
requests in flight get up to ``shutdown_timeout_s`` to finish (streams included), the rest
are cut, the request log is flushed, exit 0.

Exit codes: 0 clean stop after a signal; 2 bad configuration (one line on stderr; also an
admin key file readable by group/other); 3 the port cannot be bound or the database cannot
be opened.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from common.cpus import pin_process
from common.http import setup_logging
from gateway.app import create_app
from gateway.auth import resolve_admin_key
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.connections import quiet_protocol_errors, raise_fd_limit
from gateway.db import safe_url
from gateway.state import GATEWAY

log = logging.getLogger("strata.gateway")

EXIT_OK, EXIT_CONFIG, EXIT_FAILED = 0, 2, 3
# after an error answer to a request whose body was not read (413, 408), the rest is read and dropped this long so
# the client sees the answer rather than a reset; aiohttp's default (10 s) is a slow client's gift
LINGER_S = 2.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway", description="Strata gateway: the public OpenAI-compatible face")
    p.add_argument("--config", type=Path, help="TOML gateway config (then STRATA_GATEWAY_* environment overrides)")
    p.add_argument("--host", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="listen port (default 8080; 0: any free port)")
    p.add_argument("--check-config", action="store_true", help="print the resolved config as JSON and exit")
    return p


async def serve(config: GatewayConfig) -> int:
    # every file the gateway and its children write is private whatever umask it was started with (supervisord's is
    # 022): the database, the journal, uploads, the documents' indexes hold key hashes and users' words
    os.umask(0o077)
    # the request-log writer commits on its own thread: an event loop waking for a client or a lane's token takes the
    # GIL back within this, not Python's 5 ms, which a wake-up on a busy box would add to its time to first token
    sys.setswitchinterval(config.switch_interval_ms / 1000)
    error = pin_cores(config)
    if error is not None:
        log.error("%s", error)
        return EXIT_CONFIG
    if config.nice is not None:
        set_nice(config.nice)
    fd_limit, fit = raise_fd_limit(config)  # before anything opens files: the database, the lanes' pool
    try:
        app = create_app(config)
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_CONFIG
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=config.shutdown_timeout_s,
                           keepalive_timeout=config.keepalive_timeout_s, lingering_time=LINGER_S)
    try:
        await runner.setup()  # opens the database, polls the lanes once
    except Exception as e:
        log.error("gateway cannot start: %s: %s", type(e).__name__, e)
        return EXIT_FAILED
    # What start-up built (modules, the app, its pools) lives as long as the process: frozen out of the cyclic
    # collector's reach, a full collection walks only what requests create, not ~470,000 objects (a 0.45-0.5 s
    # stall of the event loop measured on the 2-core VM, 2026-12-02)
    gc.collect()
    gc.freeze()
    guard = app[GATEWAY].connections
    assert guard is not None and runner.server is not None
    guard.max_total = fit
    guard.install(runner.server)
    quiet_protocol_errors(app[GATEWAY].metrics)
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        log.error("gateway cannot listen on %s:%d: %s", config.host, config.port, e.strerror or e)
        await runner.cleanup()
        await guard.stop()
        return EXIT_FAILED
    addrs = ", ".join(f"{a[0]}:{a[1]}" for a in runner.addresses if isinstance(a, tuple))
    log.info("gateway pid=%d listening on %s (open files up to %d, connections up to %d, event loop %s)", os.getpid(),
             addrs, fd_limit, fit, type(asyncio.get_running_loop()).__module__.split(".")[0])

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if not stop.is_set():
            log.info("gateway got %s: finishing requests in flight (up to %.0fs)", signal.Signals(signum).name,
                     config.shutdown_timeout_s)
            app[GATEWAY].stopping = True
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await stop.wait()
    # AppRunner.cleanup: close the listener, wait for handlers up to shutdown_timeout, then app cleanup
    await runner.cleanup()
    await guard.stop()
    # the embedding model's process: stopped now, not at exit after a model load or an encode in flight
    from gateway.documents.embed import close_all

    await asyncio.to_thread(close_all)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    log.info("gateway stopped (exit 0)")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, os.environ, {"host": args.host, "port": args.port})
    except ConfigError as e:
        print(f"strata gateway: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        shown = config.model_dump(mode="json")
        shown["db_url"] = safe_url(config.db_url)  # never print a database password
        print(json.dumps(shown, indent=2))
        return EXIT_OK
    try:
        resolve_admin_key(config)  # a bad admin key source is a config error: refuse before listening
    except ConfigError as e:
        print(f"strata gateway: {e}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(config.log_level)
    with asyncio.Runner(loop_factory=loop_factory(config)) as runner:
        return runner.run(serve(config))


def pin_cores(config: GatewayConfig) -> str | None:
    """Pin every thread to config.cores before the request-log writer, the workers and the embedding child start
    (they inherit it); the error to report when the system refuses (e.g. CPUs outside the container's cpuset)."""
    if config.cores is None:
        return None
    try:
        pin_process(config.cores)
    except OSError as e:
        return f"cannot pin to cores {config.cores}: {e.strerror or e}"
    return None


def set_nice(value: int) -> None:
    """The priority of every thread of the process (Linux keeps one per thread; the event loop's may have started
    one before this), before the request-log writer, the workers and the embedding child start: they inherit it
    (the embedding child's forkserver goes back to 0)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as e:
            log.warning("nice = %d not applied: %s (raising priority needs CAP_SYS_NICE)", value, e.strerror or e)
            return


def loop_factory(config: GatewayConfig) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when the config asks for it and it is installed (None: the standard library's)."""
    if config.event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("event_loop = uvloop but uvloop is not installed: the standard library's event loop serves")
            return None
        return uvloop.new_event_loop
    return None


if __name__ == "__main__":
    sys.exit(main())
