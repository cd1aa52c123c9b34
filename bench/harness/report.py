"""``report.md`` from a results.json: when, on what, with which command; a summary of every scenario
(status, time, checks); then each scenario's tables, checks, plots and notes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import markdown_table


def _cell(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def summary_table(results: dict[str, Any]) -> str:
    rows = []
    for name, r in results.get("scenarios", {}).items():
        checks = r.get("checks") or []
        passed = sum(1 for c in checks if c["passed"])
        rows.append([name, r["status"], "yes" if r.get("correctness") else "no", f"{r.get('duration_s', 0):.1f}",
                     f"{passed}/{len(checks)}" if checks else "-", (r.get("error") or "")[:120]])
    return markdown_table(["scenario", "status", "gates CI", "seconds", "checks passed", "error"], rows, 3)


def headline(results: dict[str, Any]) -> str:
    """The header lines: date, machine, command, target."""
    m = results.get("machine") or {}
    t = results.get("target") or {}
    cmd = " ".join(results.get("command") or [])
    return "\n".join([
        f"- date: {results.get('started')} (UTC); {'quick' if results.get('quick') else 'full'} mode; "
        f"{results.get('duration_s', 0):.0f} s in all",
        f"- machine: {m.get('cpu_model')}, {m.get('affinity_cores')} cores, load {m.get('loadavg')}, "
        f"{m.get('busy_cores_before')} cores busy before the run, commit {m.get('git_commit')}",
        f"- target: {t.get('kind')} {t.get('url')} (window {t.get('n_ctx')}, lanes {t.get('lanes')})"
        + "".join(f"; peer {p['label']} {p['url']}" for p in results.get("peers") or []),
        f"- command: `{cmd}`"])


def render(results: dict[str, Any]) -> str:
    out = ["# Strata benchmark report", "", headline(results), "", "## Summary", "", summary_table(results), ""]
    for name, r in results.get("scenarios", {}).items():
        out += [f"## {name}", ""]
        if r.get("error"):
            out += [f"**{r['status']}**: {r['error']}", ""]
        for tbl in r.get("tables") or []:
            out += [f"**{tbl['title']}**", "", markdown_table(tbl["headers"], [[_cell(c) for c in row]
                                                                             for row in tbl["rows"]]), ""]
        if r.get("checks"):
            rows = [[c["name"], _cell(c["value"]), f"{c['op']} {_cell(c['threshold'])}", "pass" if c["passed"] else
                     "**FAIL**", c.get("note") or ""] for c in r["checks"]]
            out += ["Checks:", "", markdown_table(["check", "value", "threshold", "result", "note"], rows, 1), ""]
        for p in r.get("plots") or []:
            out += [f"![{name}]({p})", ""]
        for n in r.get("notes") or []:
            out.append(f"- {n}")
        if r.get("notes"):
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_report(out: Path, results: dict[str, Any]) -> Path:
    path = out / "report.md"
    path.write_text(render(results), encoding="utf-8")
    return path
