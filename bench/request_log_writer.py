"""The request log's writer thread: its CPU time per request for each ``log_batch_s``, in one run.

    PYTHONPATH=. .venv/bin/python -m bench.request_log_writer                       # 0, 0.05, 0.2 s; 100 requests
    PYTHONPATH=. .venv/bin/python -m bench.request_log_writer --batch 0,0.2 --gap-ms 30,70 -n 200

Each request records two rows as a stream does (in progress when its first byte leaves, complete
before its ``[DONE]``), ``--gap-ms`` A,B apart (A between the two rows, B until the next request),
into a temp SQLite database with the journal, through :class:`gateway.store.RequestLog` itself.
Reported per window: the writer thread's CPU time (``pthread_getcpuclockid``) per request and the
transactions it used. The windows alternate over ``--rounds`` rounds, so a change in the box's load
hits every window alike.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.db import open_db
from gateway.journal import Journal
from gateway.store import IN_PROGRESS, RequestLog


def _row(i: int, **kw: Any) -> dict[str, Any]:
    return {"id": f"gw-{i:06d}", "time": time.time(), "key_id": 1, "lane": "a", "model": "m",
            "endpoint": "/v1/chat/completions", "stream": True, "prompt_tokens": 12, "completion_tokens": 8,
            "ttft_ms": 20.0, "duration_ms": 30.0, "status": 200, "retried": False, "error_type": None, **kw}


def measure(batch_s: float, n: int, gap1_s: float, gap2_s: float) -> tuple[float, int]:
    """(writer CPU ms per request, transactions) for ``n`` requests with window ``batch_s``."""
    with tempfile.TemporaryDirectory(prefix="strata-logbench-") as d:
        engine = open_db(f"sqlite:///{d}/r.db")
        log = RequestLog(engine, 30, journal=Journal(Path(d) / "journal"), batch_s=batch_s)
        log.start()
        assert log._thread.ident is not None
        clock = time.pthread_getcpuclockid(log._thread.ident)
        c0 = time.clock_gettime(clock)
        for i in range(n):
            log.record(_row(i, error_type=IN_PROGRESS))
            time.sleep(gap1_s)
            log.record(_row(i))
            time.sleep(gap2_s)
        asyncio.run(log.flush(60))
        cpu = time.clock_gettime(clock) - c0
        attempts = log.attempts
        log.close()
        engine.dispose()
    return cpu * 1e3 / n, attempts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.request_log_writer", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="0,0.05,0.2", help="log_batch_s values, comma-separated (default 0,0.05,0.2)")
    p.add_argument("--gap-ms", default="30,70", help="ms between a request's two rows, then to the next request")
    p.add_argument("-n", type=int, default=100, help="requests per window and round (default 100)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the windows (default 2)")
    args = p.parse_args(argv)
    windows = [float(x) for x in args.batch.split(",")]
    gap1, gap2 = (float(x) / 1e3 for x in args.gap_ms.split(","))
    for r in range(args.rounds):
        for b in windows:
            ms, tx = measure(b, args.n, gap1, gap2)
            print(f"round {r + 1}  log_batch_s {b:5.2f}: writer CPU {ms:6.3f} ms/request, {tx} transactions for "
                  f"{args.n} requests", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
