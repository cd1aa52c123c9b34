"""Run named scenarios against a target and write ``<out>/results.json`` (after every scenario, so a
run cut short keeps what it measured) and ``<out>/report.md`` with the plots."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import machine_info
from bench.harness.client import Target
from bench.harness.context import Context
from bench.harness.report import write_report
from bench.harness.result import ScenarioResult
from bench.harness.scenarios import SCENARIOS

RESULTS_VERSION = 1


def parse_scenarios(spec: str) -> list[str]:
    """'all' or a comma-separated list of scenario names, in the given order; a ValueError names the bad one."""
    if spec.strip() in ("", "all"):
        return list(SCENARIOS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        raise ValueError(f"unknown scenario(s) {', '.join(bad)}; known: {', '.join(SCENARIOS)}")
    return names


def new_run_dir(root: Path) -> Path:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = root / stamp
    n = 1
    while out.exists():
        n += 1
        out = root / f"{stamp}-{n}"
    out.mkdir(parents=True)
    return out


async def run_scenarios(names: list[str], target: Target, peers: list[Target], out: Path, quick: bool,
                        supervisor_conf: Path | None, command: list[str], progress: bool = True,
                        log: Any = None, soak_s: float | None = None) -> dict[str, Any]:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    results: dict[str, Any] = {
        "version": RESULTS_VERSION, "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": quick, "command": command, "target": {"url": target.url, "kind": target.kind, "n_ctx": target.n_ctx,
                                                      "lanes": [x.get("name") for x in target.lanes]},
        "peers": [{"url": p.url, "kind": p.kind, "label": p.label} for p in peers],
        "machine": machine_info(), "scenarios": {}}
    ctx = Context(target=target, quick=quick, out=out, peers=peers, supervisor_conf=supervisor_conf,
                  progress=progress, soak_s=soak_s)
    t_all = time.monotonic()
    for name in names:
        mod = SCENARIOS[name]
        res = ScenarioResult(name=name, correctness=bool(mod.CORRECTNESS), target=target.kind)
        t0 = time.monotonic()
        if target.kind not in mod.KINDS:
            res.status = "skipped"
            res.error = f"does not apply to a {target.kind} target (runs against: {', '.join(mod.KINDS)})"
        else:
            log(f"bench: {name} ...")
            try:
                await mod.run(ctx, res)
                res.status = "completed" if res.passed or not res.correctness else "failed"
            except Exception as e:  # a broken scenario is recorded and the others still run
                res.status = "error"
                res.error = f"{type(e).__name__}: {e}"
                res.data["traceback"] = traceback.format_exc(limit=6)
        res.duration_s = round(time.monotonic() - t0, 2)
        checks = ", ".join(f"{c.name} {c.value} {c.op} {c.threshold} {'ok' if c.passed else 'FAIL'}" for c in res.checks)
        log(f"bench: {name} {res.status} in {res.duration_s:.1f}s" + (f" ({checks})" if checks else "")
            + (f": {res.error}" if res.error else ""))
        results["scenarios"][name] = res.to_json()
        results["duration_s"] = round(time.monotonic() - t_all, 2)
        write_results(out / "results.json", results)
    results["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    write_results(out / "results.json", results)
    write_report(out, results)
    return results


def write_results(path: Path, results: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def verify(results: dict[str, Any], names: list[str] | None = None, allow_skipped: bool = False) -> list[str]:
    """What CI checks: every scenario completed (none errored or, unless ``allow_skipped``, skipped
    as not applying to the target) and every check of a correctness scenario passed. Returns the
    problems (empty: all good)."""
    problems = []
    scen = results.get("scenarios") or {}
    for name in names or list(scen):
        r = scen.get(name)
        if r is None:
            problems.append(f"{name}: not in results.json")
            continue
        if r["status"] == "skipped" and allow_skipped:
            continue
        if r["status"] in ("error", "skipped"):
            problems.append(f"{name}: {r['status']}: {r.get('error')}")
        if r.get("correctness") and r["status"] != "skipped":
            if not r.get("checks"):
                problems.append(f"{name}: a correctness scenario with no checks")
            for c in r.get("checks") or []:
                if not c["passed"]:
                    problems.append(f"{name}: {c['name']} = {c['value']} (needs {c['op']} {c['threshold']})")
    return problems
