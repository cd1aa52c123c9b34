"""What a scenario hands back: figures (with which direction is better, for ``compare``), pass/fail
checks with their thresholds, tables for the report, plots, notes. Stored as plain JSON."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Better = Literal["higher", "lower"] | None


@dataclass
class Check:
    """One thresholded figure: ``value op threshold`` must hold (op is '>=', '<=' or '==')."""

    name: str
    value: float | None
    op: Literal[">=", "<=", "=="]
    threshold: float
    passed: bool
    note: str = ""


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]]


@dataclass
class ScenarioResult:
    name: str
    status: Literal["completed", "failed", "error", "skipped"] = "completed"
    correctness: bool = False  # a scenario whose checks gate CI (the others only measure)
    duration_s: float = 0.0
    target: str = ""
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    data: dict[str, Any] = field(default_factory=dict)  # raw series for plots and later analysis

    def metric(self, name: str, value: float | None, unit: str = "", better: Better = None,
               noise: float = 0.0) -> None:
        """``noise``: an absolute change below it is never a regression (slopes near zero, say)."""
        if value is not None and isinstance(value, float) and not math.isfinite(value):
            value = None
        self.metrics[name] = {"value": None if value is None else round(float(value), 4), "unit": unit,
                              "better": better, "noise": noise}

    def check(self, name: str, value: float | None, op: Literal[">=", "<=", "=="], threshold: float,
              note: str = "") -> bool:
        if value is None:
            ok = False
        elif op == ">=":
            ok = value >= threshold
        elif op == "<=":
            ok = value <= threshold
        else:
            ok = value == threshold
        self.checks.append(Check(name, None if value is None else round(float(value), 4), op, threshold, ok, note))
        return ok

    def table(self, title: str, headers: list[str], rows: list[list[Any]]) -> None:
        self.tables.append(Table(title, headers, rows))

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs; None with fewer than 3 points or no spread in xs."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den
