"""``strata bench``: run scenarios against a running stack, or compare two results files.

    strata bench run --target http://HOST:8080 --key KEY [--scenarios single,passkey] [--quick]
                     [--admin-key-file var/secrets/admin.key] [--supervisor-config supervisord.conf]
                     [--peer http://127.0.0.1:8101] [--with-lane] [--out var/bench]
    strata bench compare A/results.json B/results.json [--threshold 0.10]

``run`` writes ``<out>/<UTC timestamp>/report.md``, its PNG plots and ``results.json``; it exits 0
when every scenario completed and every correctness check passed, 1 otherwise, 2 on bad arguments,
an unreachable target, or a missing package of the ``bench`` extra (named, with the command that
installs it). ``compare`` exits 1 when it flags a regression.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path

from common.config import ADMIN_ENV

REPO = Path(__file__).resolve().parents[2]

# What ``run`` imports beyond the serving install (``make run``): module -> distribution in the
# pyproject extra ``bench``, and the scenarios that need it (None: every run).
RUN_NEEDS: dict[str, tuple[str, frozenset[str] | None]] = {
    "matplotlib": ("matplotlib", None),  # the report's PNG plots
    "tqdm": ("tqdm", None),  # progress bars
    "fpdf": ("fpdf2", frozenset({"rag"})),  # the rag scenario's PDF corpus
}


def missing_packages(scenarios: str) -> list[str]:
    """The distributions ``run --scenarios SCENARIOS`` needs that cannot be imported here (checked before
    the harness's modules are imported: they import these at the top)."""
    names = {s.strip() for s in scenarios.split(",")} - {""}
    missing = []
    for module, (dist, only) in RUN_NEEDS.items():
        if only is not None and names and names != {"all"} and not only & names:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
    return missing


def _bench_requirement(dist: str) -> str:
    """``dist`` with its version range from pyproject's ``bench`` extra, when the source tree is here."""
    try:
        extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return dist
    for req in extra:
        if re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower() == dist:
            return req
    return dist


def missing_message(missing: list[str]) -> str:
    reqs = " ".join(f"'{_bench_requirement(d)}'" for d in missing)
    return (f"strata bench run: needs {', '.join(missing)}, which the serving install (make run) leaves out. "
            f"Install them with `.venv/bin/python -m pip install {reqs}`, or the whole bench extra with "
            "`.venv/bin/python -m pip install -e '.[bench]'` (what `make bench` installs before it runs every benchmark).")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata bench", description="Benchmark scenarios against a running stack")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run scenarios and write a report")
    r.add_argument("--target", required=True, help="gateway (or plain lane) base URL, e.g. http://127.0.0.1:8080")
    r.add_argument("--key", default=os.environ.get("STRATA_BENCH_KEY"),
                   help="API key for the gateway (default: $STRATA_BENCH_KEY)")
    r.add_argument("--scenarios", default="all", help="comma-separated names or 'all' (default)")
    r.add_argument("--quick", action="store_true", help="short durations, small grids, few requests")
    r.add_argument("--admin-key-file", type=Path, default=None,
                   help=f"the gateway's admin key (default: ${ADMIN_ENV}); needed by memory, crash, switch, "
                        "and to find the lanes (tokenizer, metrics)")
    r.add_argument("--supervisor-config", type=Path, default=None,
                   help="supervisord.conf of the stack (crash and switch drive it; soak reads process memory)")
    r.add_argument("--peer", action="append", default=[], help="another server for single/concurrency "
                   "(a plain lane URL, a llama.cpp server); repeatable")
    r.add_argument("--with-lane", action="store_true", help="add the gateway's first lane as a peer")
    r.add_argument("--out", type=Path, default=REPO / "var" / "bench", help="reports go to OUT/<timestamp>/")
    r.add_argument("--soak-s", type=float, default=None, help="soak's duration in seconds (default 600; quick 60)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    c = sub.add_parser("compare", help="diff two results.json files and flag regressions")
    c.add_argument("a", type=Path, help="the baseline results.json")
    c.add_argument("b", type=Path, help="the new results.json")
    c.add_argument("--threshold", type=float, default=0.10, help="relative change that counts (default 0.10)")
    c.add_argument("--flagged", action="store_true", help="list only regressions and improvements")
    return ap


def redact(argv: list[str]) -> list[str]:
    """The command line as the report shows it: the API key's value replaced (reports get shared)."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
        elif arg == "--key":
            out.append(arg)
            hide = True
        elif arg.startswith("--key="):
            out.append("--key=***")
        else:
            out.append(arg)
    return out


def _admin_key(path: Path | None) -> str | None:
    if path is not None:
        try:
            return path.read_text().strip() or None
        except OSError as e:
            raise SystemExit(f"strata bench: {path}: {e.strerror}") from None
    return os.environ.get(ADMIN_ENV) or None


async def run_cmd(args: argparse.Namespace, argv: list[str]) -> int:
    from bench.harness.client import TargetError
    from bench.harness.runner import parse_scenarios

    names = parse_scenarios(args.scenarios)
    if args.soak_s is not None and not 5 <= args.soak_s <= 86400:
        raise ValueError(f"--soak-s {args.soak_s:g}: expected 5 to 86400 seconds")
    admin = _admin_key(args.admin_key_file)
    conf = args.supervisor_config.resolve() if args.supervisor_config else None
    if conf is not None and not conf.is_file():
        raise SystemExit(f"strata bench: {conf}: no such file")
    try:
        return await _run(args, argv, names, admin, conf)
    except TargetError as e:
        raise SystemExit(f"strata bench: {e}") from None


async def _run(args: argparse.Namespace, argv: list[str], names: list[str], admin: str | None,
               conf: Path | None) -> int:
    from bench.harness.client import Target
    from bench.harness.runner import new_run_dir, run_scenarios, verify

    async with Target(args.target, key=args.key, admin_key=admin, label="gateway") as target:
        if target.kind == "gateway" and not args.key:
            raise SystemExit("strata bench: the gateway needs --key (or $STRATA_BENCH_KEY)")
        if target.kind != "gateway":
            target.label = target.kind
        out = new_run_dir(args.out)
        peers: list[Target] = []
        urls = list(args.peer)
        if args.with_lane and target.lane_urls:
            urls.insert(0, target.lane_urls[0])
        try:
            for url in urls:
                p = Target(url, label="peer")
                await p.__aenter__()
                p.label = "lane" if p.kind == "lane" else ("llama.cpp" if p.kind == "llama" else url)
                if p.kind == "llama" and not p.n_ctx:
                    p.n_ctx = target.n_ctx
                peers.append(p)
            print(f"bench: target {target.kind} {target.url} (window {target.n_ctx}, lanes "
                  f"{[x.get('name') for x in target.lanes]}); peers {[p.label for p in peers]}; report in {out}",
                  file=sys.stderr, flush=True)
            results = await run_scenarios(names, target, peers, out, args.quick, conf, ["strata", "bench", *redact(argv)],
                                          progress=not args.no_progress and sys.stderr.isatty(), soak_s=args.soak_s)
        finally:
            for p in peers:
                await p.__aexit__(None, None, None)
    problems = verify(results, names, allow_skipped=True)  # a lane target skips the gateway-only scenarios
    print(f"bench: report {out / 'report.md'}; results {out / 'results.json'}")
    for p in problems:
        print(f"bench: PROBLEM {p}")
    return 1 if problems else 0


def compare_cmd(args: argparse.Namespace) -> int:
    from bench.harness.compare import compare, load, render

    changes, broken = compare(load(args.a), load(args.b), args.threshold)
    print(render(changes, broken, args.threshold, only_flagged=args.flagged), end="")
    return 1 if broken or any(c.regression for c in changes) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.cmd == "run" and (missing := missing_packages(args.scenarios)):
        print(missing_message(missing), file=sys.stderr)
        return 2
    try:
        if args.cmd == "compare":
            return compare_cmd(args)
        return asyncio.run(run_cmd(args, argv))
    except ValueError as e:
        print(f"strata bench: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
