"""Run one lane: ``python -m lanes --lane a [--config lane.toml] [--port N] [--host H] [--model PATH]``.

SIGTERM / SIGINT: drain (``/health`` 503, new requests 503 ``server_draining``), wait up to
``drain_timeout_s`` for in-flight requests, abort the rest, clean up, exit 0. A second signal
during the drain aborts what is left at once.

Engine loop failure: every request in flight gets a typed error (500 ``engine_error``, or an
SSE error event and ``[DONE]``), ``/health`` answers 503 ``failed`` (the gateway stops
sending and fails over), and once the handlers have answered (and ``FAILED_HOLD_S`` more, so
health pollers see why) the process exits 4: supervisord (``autorestart=true``) starts a fresh
lane. A lane that stayed up would never recover its engine; one that exited at once would cut
off the error answers.

Exit codes: 0 clean stop after a signal; 2 bad configuration (one line on stderr);
3 the engine failed to load or the port cannot be bound; 4 the engine loop failed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from aiohttp import web

from common.http import setup_logging
from engine.scheduler import FAULT_ENV
from lanes.config import ConfigError, LaneConfig, load_config
from lanes.server import STATE, LaneState, create_app, drain

log = logging.getLogger("strata.lanes")

EXIT_OK, EXIT_CONFIG, EXIT_FAILED, EXIT_ENGINE_FAILED = 0, 2, 3, 4
FAILED_HOLD_S = 1.0  # after an engine loop failure: /health says "failed" this long before the exit
FAILED_ANSWER_S = 10.0  # at most this long for in-flight handlers to send their error answers


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lanes", description="Strata lane: OpenAI-compatible engine server")
    p.add_argument("--config", type=Path, help="TOML lane config (then STRATA_LANE_* environment overrides)")
    p.add_argument("--lane", help="lane name; 'a' / 'b' also select port 8101 / 8102 unless set elsewhere")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (0: any free port)")
    p.add_argument("--model", type=Path, help="GGUF model path (default: the embedded default model)")
    p.add_argument("--check-config", action="store_true", help="print the resolved config as JSON and exit")
    return p


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket before anything else, so a busy port fails fast instead
    of after a full model load (supervisord would count that as a slow crash)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def serve(config: LaneConfig) -> int:
    try:
        sock = _bind(config.host, config.port)
    except OSError as e:
        log.error("lane=%s cannot listen on %s:%d: %s", config.name, config.host, config.port, e.strerror or e)
        return EXIT_FAILED
    if os.environ.get(FAULT_ENV):
        log.warning("lane=%s %s=%s is set: test-only fault injection is active", config.name, FAULT_ENV,
                    os.environ[FAULT_ENV])
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()  # starts loading the engine in the background
    site = web.SockSite(runner, sock)
    await site.start()
    addrs = ", ".join(f"{a[0]}:{a[1]}" for a in runner.addresses if isinstance(a, tuple))
    log.info("lane=%s pid=%d listening on %s (loading the model)", config.name, os.getpid(), addrs)

    st = app[STATE]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("lane=%s got %s: draining", config.name, signal.Signals(signum).name)
            stop.set()
        else:
            log.warning("lane=%s got %s again: aborting %d request(s)", config.name, signal.Signals(signum).name,
                        len(st.runs))
            for run in list(st.runs):
                run.abort_all()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    code = EXIT_OK
    stop_wait = asyncio.create_task(stop.wait())
    fail_wait = asyncio.create_task(st.engine_failed.wait())
    assert st.load_task is not None
    await asyncio.wait({stop_wait, st.load_task}, return_when=asyncio.FIRST_COMPLETED)
    if st.status == "failed":
        code = EXIT_FAILED
    else:
        if st.status == "ready":
            log.info("lane=%s heap frozen after the load: %d objects out of the GC's reach", config.name,
                     freeze_heap())
        await asyncio.wait({stop_wait, fail_wait}, return_when=asyncio.FIRST_COMPLETED)
        if stop_wait.done():
            drained = await drain(app)
            log.info("lane=%s drain %s", config.name, "complete" if drained else "timed out")
        if st.engine_failed.is_set():
            code = EXIT_ENGINE_FAILED
            await _answer_then_exit(st)
    stop_wait.cancel()
    fail_wait.cancel()
    await runner.cleanup()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    log.info("lane=%s stopped (exit %d)", config.name, code)
    return code


def freeze_heap() -> int:
    """Once the model is loaded: its metadata (a 49k-entry vocabulary, merges) and the tokenizer
    live as long as the process, so move them out of the cyclic GC's reach; collections during
    decoding then stop re-walking them. Process-wide, hence here in the lane's entry point and
    not in the Engine (a library must not change its host process's GC)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _answer_then_exit(st: LaneState) -> None:
    """After an engine loop failure: let the handlers send their typed errors, keep /health at
    503 "failed" a moment, then return (the caller exits non-zero)."""
    log.error("lane=%s engine loop failed: answering %d request(s) in flight, then exiting %d for a restart",
              st.config.name, st.inflight, EXIT_ENGINE_FAILED)
    try:
        await asyncio.wait_for(st.idle.wait(), FAILED_ANSWER_S)
    except TimeoutError:
        log.warning("lane=%s %d handler(s) still running after the engine failed", st.config.name, st.inflight)
    await asyncio.sleep(FAILED_HOLD_S)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = {"name": args.lane, "host": args.host, "port": args.port,
                 "model": str(args.model) if args.model else None}
    try:
        config = load_config(args.config, os.environ, overrides)
    except ConfigError as e:
        print(f"strata lane: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return EXIT_OK
    setup_logging(config.log_level)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
