"""Decode and prefill tok/s against context, Strata beside llama.cpp (issue 30's plot): one figure, two panels.

    python -m bench.depth_plot IN.json [IN.json ...] --out docs/img/gpu-depth-h200.svg [--title TEXT]

Each input is either the JSON ``bench.engine_gpu --depth D,... --json OUT`` writes (its Strata rows and, where it
ran, llama.cpp's, as the decode panel's two lines, labelled by the run's KV type and batch), or a summary file of
recorded figures (docs/data/gpu-depth-h200.json):

    {"title": "...", "source": "...", "series": [{"panel": "decode" | "prefill", "label": "Strata, F16 KV",
     "peer": false, "points": {"0": 412.1, "8192": 279.6}}, ...]}

The x axis is the context before decoding (decode) or the prompt length (prefill), on a log-2 scale with depth 0
drawn at the left edge; Strata's lines are solid, the peers' dashed. The output's format follows its suffix
(.svg keeps the text as text: a small file the docs can hold; .png for a quick look).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PANELS = ("decode", "prefill")
_AXES = {"decode": ("context before decode (tokens)", "batch-1 decode tok/s"),
         "prefill": ("prompt length (tokens)", "prefill tok/s")}


class PlotInputError(ValueError):
    """An input file that is not one of the two accepted shapes."""


def _points(raw: Any, where: str) -> dict[int, float]:
    if not isinstance(raw, dict) or not raw:
        raise PlotInputError(f"{where}: expected an object of context -> tok/s, got {json.dumps(raw)[:60]}")
    out: dict[int, float] = {}
    for k, v in raw.items():
        y = v.get("tok_s") if isinstance(v, dict) else v
        try:
            x, y = int(k), float(y)
        except (TypeError, ValueError):
            raise PlotInputError(f"{where}: {k!r}: {json.dumps(v)[:60]} is not a context and a tok/s") from None
        if x < 0 or not y > 0:
            raise PlotInputError(f"{where}: {k!r}: a context >= 0 and a tok/s > 0 are expected")
        out[x] = y
    return dict(sorted(out.items()))


def read_series(path: Path) -> list[dict[str, Any]]:
    """The series of one input file: [{panel, label, peer, points {x: tok/s}}]."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlotInputError(f"{path}: {e}") from None
    if not isinstance(doc, dict):
        raise PlotInputError(f"{path}: expected a JSON object")
    if "series" in doc:
        series = doc["series"]
        if not isinstance(series, list) or not series:
            raise PlotInputError(f"{path}: 'series' must be a non-empty list")
        out = []
        for i, s in enumerate(series):
            where = f"{path}: series {i}"
            if not isinstance(s, dict) or s.get("panel") not in PANELS or not isinstance(s.get("label"), str):
                raise PlotInputError(f"{where}: needs 'panel' (one of {list(PANELS)}), 'label' and 'points'")
            out.append({"panel": s["panel"], "label": s["label"], "peer": bool(s.get("peer", False)),
                        "points": _points(s.get("points"), where)})
        return out
    if "strata" in doc:  # bench.engine_gpu --depth --json
        kv = {"f16": "F16", "q8_0": "8-bit"}.get(str(doc.get("kv_type", "f16")), str(doc.get("kv_type")))
        n = int(doc.get("n_seq", 1) or 1)
        tag = f"{kv} KV" + (f", {n} sequences" if n > 1 else "")
        out = [{"panel": "decode", "label": f"Strata, {tag}", "peer": False,
                "points": _points(doc["strata"], f"{path}: strata")}]
        if doc.get("llama_cpp"):
            out.append({"panel": "decode", "label": f"llama.cpp, {tag}", "peer": True,
                        "points": _points(doc["llama_cpp"], f"{path}: llama_cpp")})
        return out
    raise PlotInputError(f"{path}: neither bench.engine_gpu --depth's JSON (a 'strata' object) nor a summary "
                         "('series' list)")


def _runs(have: list[int], xs: list[int]) -> list[list[int]]:
    """``have`` (sorted) cut where it skips a context of ``xs`` (the panel's, sorted): a series measured at 0 and
    128k only is two points, not a line through the contexts it did not measure."""
    runs: list[list[int]] = []
    for x in have:
        if runs and xs.index(x) == xs.index(runs[-1][-1]) + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return runs


def plot(series: list[dict[str, Any]], out: Path, title: str | None = None) -> Path:
    """Write the figure (one panel per kind of series present) to ``out``; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: a small, searchable SVG
    matplotlib.rcParams["svg.hashsalt"] = "strata"  # element ids from the content: same input, same file
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if any(s["panel"] == p for s in series)]
    if not panels:
        raise PlotInputError("nothing to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        mine = [s for s in series if s["panel"] == panel]
        xs = sorted({x for s in mine for x in s["points"]})
        low = min([x for x in xs if x > 0], default=1) / 2  # where depth 0 sits on the log axis
        for s in mine:
            color = None
            for run in _runs(list(s["points"]), xs):  # a line only between neighbouring measured contexts
                line, = ax.plot([x if x > 0 else low for x in run], [s["points"][x] for x in run], marker="o",
                                linestyle="--" if s["peer"] else "-", color=color,
                                label=s["label"] if color is None else None)
                color = line.get_color()
        ax.set_xscale("log", base=2)
        ax.set_xticks([x if x > 0 else low for x in xs])
        ax.set_xticklabels(["0" if x == 0 else (f"{x // 1024}k" if x % 1024 == 0 else str(x)) for x in xs])
        ax.set_ylim(bottom=0)
        ax.set_xlabel(_AXES[panel][0])
        ax.set_ylabel(_AXES[panel][1])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Date": None} if out.suffix == ".svg" else None)  # no timestamp: same input, same file
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.depth_plot", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", type=Path, help="bench.engine_gpu --depth JSON files or summary files")
    p.add_argument("--out", type=Path, required=True, help="the figure (.svg or .png)")
    p.add_argument("--title", help="the figure's title (default: the first summary file's 'title')")
    args = p.parse_args(argv)
    if args.out.suffix not in (".svg", ".png"):
        p.error(f"--out {args.out}: .svg or .png")
    try:
        series = [s for path in args.inputs for s in read_series(path)]
        title = args.title
        if title is None:
            for path in args.inputs:
                doc = json.loads(path.read_text())
                if isinstance(doc.get("title"), str):
                    title = doc["title"]
                    break
        plot(series, args.out, title)
    except PlotInputError as e:
        print(f"depth_plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
