"""Helpers shared by the benchmarks: medians, ratios, machine info, text and markdown tables, JSON.

Every benchmark prints ratios against a peer measured in the same run, and records enough
about the machine (CPU, cores, date, commit) that a figure in ``docs/`` says when and on what
it was taken.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "REPO_ROOT",
    "affinity_cores",
    "cpu_busy",
    "cpu_flags",
    "cpu_model",
    "fmt_num",
    "git_commit",
    "machine_info",
    "markdown_table",
    "median",
    "quiet_gc",
    "ratio",
    "text_table",
    "timed",
    "write_json",
]

REPO_ROOT = Path(__file__).resolve().parent.parent


def median(samples: Sequence[float]) -> float:
    """Median of the samples (NaN when there are none)."""
    return float(statistics.median(samples)) if samples else math.nan


def ratio(ours: float, peer: float) -> float:
    """ours / peer, NaN when the peer figure is zero or missing."""
    if not peer or math.isnan(peer) or math.isnan(ours):
        return math.nan
    return ours / peer


def fmt_num(x: float | int | None, digits: int = 1) -> str:
    """A figure for a table: thousands separators, fixed decimals, '-' for missing values."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def affinity_cores() -> list[int]:
    """The CPU cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> list[str]:
    """The SIMD flags of interest that /proc/cpuinfo lists (avx2, avx512*, ...)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    except OSError:
        pass
    return []


def cpu_busy(interval: float = 0.5) -> float | None:
    """Cores kept busy by the whole machine over a short interval (from /proc/stat); None elsewhere.

    Measured before a benchmark starts, it shows whether other processes compete for the cores.
    """
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return sum(vals[:8]), idle

    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if t1 <= t0:
        return None
    return (os.cpu_count() or 1) * (1.0 - (i1 - i0) / (t1 - t0))


def git_commit(repo: Path = REPO_ROOT) -> str:
    """Short commit of the checkout, with '+dirty' when tracked files differ; 'unknown' without git."""
    def run(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        commit = run("rev-parse", "--short=12", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    try:
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = False
    return commit + ("+dirty" if dirty else "")


def machine_info(busy_interval: float = 0.5) -> dict[str, Any]:
    """What a figure was measured on, and when; call it before the measurement (it samples how
    many cores other processes keep busy)."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "nproc": os.cpu_count(),
        "affinity_cores": len(affinity_cores()),
        "loadavg": load,
        "busy_cores_before": cpu_busy(busy_interval) if busy_interval > 0 else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "git_commit": git_commit(),
    }


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], n_text_cols: int = 1) -> str:
    """A GitHub-flavoured markdown table: the first n_text_cols columns left-aligned, the rest
    (numbers) right-aligned."""
    align = ["---"] * n_text_cols + ["---:"] * (len(headers) - n_text_cols)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(align), *(line(r) for r in rows)])


@contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect once, then keep the garbage collector out of a timed region."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, with the garbage collector held off."""
    with quiet_gc():
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """Write a report as indented JSON (NaN becomes null), creating parent folders."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_jsonable(report), indent=2) + "\n", encoding="utf-8")


def emit_report(report: dict[str, Any], text: str, markdown: str | None, json_path: str | os.PathLike[str] | None,
                log: Callable[[str], None]) -> None:
    """A benchmark's end: its text report on stdout, then its markdown table when one was asked for (``markdown``
    not None), and the report as JSON at ``json_path`` when given (``write_json``; ``log`` names the file)."""
    print(text)
    if markdown is not None:
        print("\n" + markdown)
    if json_path:
        write_json(json_path, report)
        log(f"wrote {json_path}")
