"""PNG plots of the report (matplotlib, Agg backend: no display needed). Each function writes one
file and returns its name relative to the report folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)


def _save(fig: Any, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def bars(path: Path, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> str:
    """Grouped bars: one group per category (inner keys), one bar per series (outer keys)."""
    cats = list(dict.fromkeys(k for s in groups.values() for k in s))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / max(1, len(groups))
    for i, (label, vals) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(cats))]
        ax.bar(xs, [vals.get(c, 0.0) or 0.0 for c in cats], width, label=label)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(cats))], cats)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return _save(fig, path)


def lines(path: Path, title: str, xlabel: str, panels: list[tuple[str, dict[str, tuple[list[float], list[float]]]]],
          logx: bool = False) -> str:
    """One panel per (ylabel, {series: (xs, ys)})."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in series.items():
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if logx:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # 1 2 4 8, not 2^n
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def heatmap(path: Path, title: str, rows: list[str], cols: list[str], values: list[list[float | None]],
            xlabel: str, ylabel: str) -> str:
    """A rows x cols grid of 0..1 values (None: not measured), each cell labelled."""
    fig, ax = plt.subplots(figsize=(1.1 * len(cols) + 2.5, 0.6 * len(rows) + 1.8))
    grid = [[float("nan") if v is None else v for v in row] for row in values]
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, "-" if v is None else f"{v:.0%}", ha="center", va="center", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046)
    return _save(fig, path)


def timeline(path: Path, title: str, points: dict[str, tuple[list[float], list[float]]], ylabel: str,
             marks: dict[str, float] | None = None, panels2: dict[str, tuple[list[float], list[float]]] | None = None,
             ylabel2: str = "") -> str:
    """Scatter/line series over time (seconds), vertical lines at ``marks``; an optional second panel."""
    n = 2 if panels2 else 1
    fig, axes = plt.subplots(n, 1, figsize=(7.0, 3.0 * n), squeeze=False, sharex=True)
    ax = axes[0][0]
    for label, (xs, ys) in points.items():
        ax.plot(xs, ys, marker=".", linestyle="", label=label)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    for label, x in (marks or {}).items():
        for a in axes[:, 0]:
            a.axvline(x, color="red", linestyle="--", alpha=0.6)
        ax.text(x, ax.get_ylim()[1], f" {label}", color="red", va="top", fontsize=8)
    if len(points) > 1:
        ax.legend(fontsize=8)
    if panels2:
        ax2 = axes[1][0]
        for label, (xs, ys) in panels2.items():
            ax2.plot(xs, ys, label=label)
        ax2.set_ylabel(ylabel2)
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    axes[-1][0].set_xlabel("seconds")
    fig.suptitle(title)
    return _save(fig, path)
