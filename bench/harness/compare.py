"""Compare two results.json files: every figure both runs have, its relative change, and a
regression flag when it moved the wrong way by more than the threshold; a check that passed in A
and fails in B is a regression too, whatever its size."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import markdown_table


@dataclass
class Change:
    scenario: str
    metric: str
    a: float | None
    b: float | None
    rel: float | None  # (b - a) / |a|
    better: str | None
    regression: bool
    improvement: bool


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable results.json ({e})") from None
    if not isinstance(data, dict) or "scenarios" not in data:
        raise ValueError(f"{path}: no 'scenarios' in it: not a bench results.json")
    return data


def compare(a: dict[str, Any], b: dict[str, Any], threshold: float = 0.10,
            min_abs: float = 1e-9) -> tuple[list[Change], list[str]]:
    """(figure changes, failed-check regressions). ``threshold`` is relative (0.10 = 10 %)."""
    if threshold < 0 or math.isnan(threshold):
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    changes: list[Change] = []
    broken: list[str] = []
    for name, ra in a.get("scenarios", {}).items():
        rb = b.get("scenarios", {}).get(name)
        if rb is None:
            continue
        for metric, ma in (ra.get("metrics") or {}).items():
            mb = (rb.get("metrics") or {}).get(metric)
            if mb is None:
                continue
            va, vb, better = ma.get("value"), mb.get("value"), ma.get("better")
            rel = None
            if va is not None and vb is not None:
                rel = (vb - va) / abs(va) if abs(va) > min_abs else (0.0 if abs(vb - va) <= min_abs else math.inf)
            noise = float(ma.get("noise") or 0.0)
            if va is not None and vb is not None and abs(vb - va) <= noise:
                rel = 0.0 if rel is None or math.isinf(rel) else rel
                quiet = True
            else:
                quiet = False
            worse = not quiet and rel is not None and ((better == "higher" and rel < -threshold) or
                                                       (better == "lower" and rel > threshold))
            gone = better is not None and va is not None and vb is None  # measured before, not any more
            improved = not quiet and rel is not None and ((better == "higher" and rel > threshold) or
                                                          (better == "lower" and rel < -threshold))
            changes.append(Change(name, metric, va, vb, rel, better, worse or gone, improved))
        checks_b = {c["name"]: c for c in rb.get("checks") or []}
        for c in ra.get("checks") or []:
            cb = checks_b.get(c["name"])
            if c["passed"] and cb is not None and not cb["passed"]:
                broken.append(f"{name}: check '{c['name']}' passed ({c['value']}) and now fails ({cb['value']}, "
                              f"needs {cb['op']} {cb['threshold']})")
        if ra.get("status") == "completed" and rb.get("status") in ("error", "failed"):
            broken.append(f"{name}: completed before, now {rb['status']}: {rb.get('error') or 'checks fail'}")
    return changes, broken


def render(changes: list[Change], broken: list[str], threshold: float, only_flagged: bool = False) -> str:
    rows = []
    for c in changes:
        if only_flagged and not (c.regression or c.improvement):
            continue
        flag = "REGRESSION" if c.regression else ("better" if c.improvement else "")
        rel = "-" if c.rel is None else ("inf" if math.isinf(c.rel) else f"{c.rel:+.1%}")
        rows.append([c.scenario, c.metric, _v(c.a), _v(c.b), rel, c.better or "-", flag])
    out = [markdown_table(["scenario", "figure", "A", "B", "change", "better", "flag"], rows, 2)]
    n = sum(c.regression for c in changes) + len(broken)
    out += ["", f"{n} regression(s) at a threshold of {threshold:.0%}" + (":" if broken else "")]
    out += [f"- {b}" for b in broken]
    return "\n".join(out) + "\n"


def _v(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"
