"""``make bench`` / ``make bench QUICK=1``: start a throwaway stack (bench/harness/stack.py), make an API
key, run ``strata bench run`` with every scenario against the gateway (and the gateway's first lane as
a plain-lane peer; with ``--llama``, a llama.cpp server on the same GGUF too), then check what CI
needs: report.md and results.json exist, every scenario completed, every correctness check passed.

    .venv/bin/python -m bench.harness.ci --quick                 # what CI runs (make bench QUICK=1)
    .venv/bin/python -m bench.harness.ci --llama                 # full scenarios (make bench)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.harness.stack import REPO, StackError, free_port, throwaway_stack


@contextlib.contextmanager
def llama_server(model: Path, n_ctx: int, log: Path) -> Iterator[str | None]:
    """llama-cpp-python's OpenAI server on ``model`` (one thread, like one lane); None when its
    ``[server]`` extra is not installed."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        print(f"bench: no llama.cpp server peer ({e}); install llama-cpp-python[server]", file=sys.stderr)
        yield None
        return
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                                 "--port", str(port), "--n_threads", "1", "--n_ctx", str(n_ctx),
                                 "--interrupt_requests", "False"],  # queue concurrent requests, never cut one off
                                stdout=out,
                                stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    print(f"bench: the llama.cpp server did not start (see {log})", file=sys.stderr)
                    url = ""
                    break
                time.sleep(0.5)
            yield url or None
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class Expired(BaseException):  # not an Exception: no scenario handler may swallow it
    """The whole run took longer than --timeout-s."""


def _expired(signum: int, frame: object) -> None:
    raise Expired


def check_run(out: Path, names: list[str]) -> list[str]:
    """CI's checks of one run folder."""
    from bench.harness.runner import verify

    problems = [f"{out / f}: missing" for f in ("report.md", "results.json") if not (out / f).is_file()]
    if problems:
        return problems
    results = json.loads((out / "results.json").read_text())
    problems += verify(results, names)
    for name in names:
        for plot in (results["scenarios"].get(name) or {}).get("plots") or []:
            if not (out / plot).is_file():
                problems.append(f"{name}: plot {plot} missing")
    return problems


def main(argv: list[str] | None = None) -> int:
    from bench.harness.cli import main as bench_main
    from bench.harness.runner import parse_scenarios

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--scenarios", default="all")
    ap.add_argument("--kv-tokens", type=int, default=None, help="lane KV size = the window (default: quick "
                    "1024, which keeps window-long prompts to seconds on one core; full 8192, the model's own)")
    ap.add_argument("--llama", action="store_true", help="also a llama.cpp server peer for single/concurrency")
    ap.add_argument("--out", type=Path, default=REPO / "var" / "bench")
    ap.add_argument("--soak-s", type=float, default=None, help="soak's duration (default 600; quick 60)")
    ap.add_argument("--keep", action="store_true", help="keep the stack's temp folder (logs)")
    ap.add_argument("--timeout-s", type=int, default=None, help="give up (stack shut down, exit 1) after this long "
                    "(default: quick 1800, full none)")
    args = ap.parse_args(argv)
    names = parse_scenarios(args.scenarios)
    signal.signal(signal.SIGTERM, _terminate)  # a CI timeout still shuts the throwaway stack down
    limit = args.timeout_s if args.timeout_s is not None else (1800 if args.quick else 0)
    if limit > 0:  # a hung request must not hold CI until its own limit
        signal.signal(signal.SIGALRM, _expired)
        signal.alarm(limit)
    kv = args.kv_tokens or (1024 if args.quick else 8192)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="sbench-", dir="/tmp"))  # short: supervisord's socket path is limited
    before = set(args.out.glob("*")) if args.out.exists() else set()
    try:
        with throwaway_stack(tmp, kv_tokens=kv) as st:
            print(f"bench: throwaway stack up in {time.monotonic() - t0:.1f}s ({tmp}, window {kv})", file=sys.stderr)
            key = st.create_key("bench", unlimited=True)
            run_argv = ["run", "--target", st.gateway_url, "--key", key, "--admin-key-file", str(st.admin_key_file),
                        "--supervisor-config", str(st.conf), "--scenarios", ",".join(names), "--with-lane",
                        "--out", str(args.out)]
            if args.quick:
                run_argv.append("--quick")
            if args.soak_s is not None:
                run_argv += ["--soak-s", str(args.soak_s)]
            with contextlib.ExitStack() as peers:
                if args.llama:
                    from engine.default_model import default_model_path

                    url = peers.enter_context(llama_server(default_model_path(), kv, tmp / "llama_server.log"))
                    if url:
                        run_argv += ["--peer", url]
                t1 = time.monotonic()
                code = bench_main(run_argv)
                took = time.monotonic() - t1
    except StackError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except Expired:
        print(f"bench: FAIL: not done after {limit} s (--timeout-s); the stack was shut down", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    runs = sorted(p for p in set(args.out.glob("*")) - before if p.is_dir())  # others write files there too
    if not runs:
        print("bench: FAIL: no report folder was written", file=sys.stderr)
        return 1
    out = runs[-1]
    problems = check_run(out, names)
    total = time.monotonic() - t0
    print(f"bench: scenarios {took:.0f}s, {total:.0f}s with the stack's start and stop; {out}", file=sys.stderr)
    if problems or code != 0:
        for p in problems:
            print(f"bench: FAIL: {p}", file=sys.stderr)
        return 1
    print(f"bench: OK: {len(names)} scenarios completed, every correctness check passed ({out / 'report.md'})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    sys.exit(main())
