"""Decode at depth on the CPU engine: batch-1 decode tok/s after D tokens of context, with the
split decode attention (``auto``: the rule in docs/engine.md) beside the unsplit per-head kernels
(``off``, the path before the split), in the same process, on the same KV cache.

One sequence is prefilled to each depth in turn (positions past the model's trained context are
fine for timing: rope runs at any position). At each depth, R rounds alternate which mode goes
first; each round times N decode steps at positions D..D+N-1 (the same token ids in both modes, so
both rewrite the same cache slots and read the same D keys), and the figures are the medians over
rounds: tok/s, and the attention block's ms per token from the steps' StepStats (q / k / v / o
projections, RoPE and the attention itself). The prefill speed of each
stretch is printed too (tiles, unchanged by the split).

Usage: ``python -m bench.cpu_attention_depth [--model PATH] [--threads N] [--depths 0,4096,16384]
[--tokens N] [--rounds R] [--json OUT.json] [--markdown]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    affinity_cores,
    fmt_num,
    machine_info,
    markdown_table,
    median,
    ratio,
    text_table,
    write_json,
)

MODES = ("off", "auto")
SEED = 1234


def time_decode(eng: Any, table: list[int], ids: Sequence[int], depth: int) -> tuple[float, float]:
    """(wall seconds, attention seconds) of len(ids) single-token steps at positions depth.."""
    t_attn = 0.0
    t0 = time.perf_counter()
    for i, tok in enumerate(ids):
        eng.forward([tok], [depth + i], [0], [table], [0])
        t_attn += eng.last_stats.t_attn
    return time.perf_counter() - t0, t_attn


def run(model: Path, threads: int, depths: Sequence[int], n_tokens: int, rounds: int,
        log: Callable[[str], None]) -> dict[str, Any]:
    from engine.engine import Engine
    from engine.native import ffi, lib, set_attn_split

    machine = machine_info()
    depths = sorted(depths)
    capacity = depths[-1] + n_tokens + 16
    rows: list[dict[str, Any]] = []
    with Engine.open(model, threads=threads, kv_tokens=capacity, prefill_chunk=512) as eng:
        hp = eng.hparams
        rng = np.random.default_rng(SEED)
        ids = [int(t) for t in rng.integers(0, hp.n_vocab, capacity)]
        table = eng.blocks.allocate(eng.blocks.n_blocks) or []
        filled = 0
        try:
            for mode in MODES:  # untimed: the first step repacks the weights, and the pool wakes up
                set_attn_split(mode)
                time_decode(eng, table, ids[:2], 0)
            for depth in depths:
                prefill_tok_s = float("nan")
                if depth > filled:
                    log(f"prefill {filled} -> {depth} ...")
                    t0 = time.perf_counter()
                    eng.prefill(ids[filled:depth], table, filled)
                    prefill_tok_s = (depth - filled) / (time.perf_counter() - t0)
                    filled = depth
                step_ids = ids[depth : depth + n_tokens]
                samples: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
                for r in range(rounds):
                    for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                        set_attn_split(mode)
                        samples[mode].append(time_decode(eng, table, step_ids, depth))
                set_attn_split("auto")
                chunk = ffi.new("int32_t *")
                lib.st_attn_split_plan(depth + 1, threads, hp.n_head_kv, chunk)
                row: dict[str, Any] = {"depth": depth, "prefill_tok_s": prefill_tok_s, "chunk": int(chunk[0]),
                                       "samples": samples}
                for mode in MODES:
                    row[f"{mode}_tok_s"] = median([n_tokens / w for w, _ in samples[mode]])
                    row[f"{mode}_attn_ms"] = median([a / n_tokens * 1e3 for _, a in samples[mode]])
                row["speedup"] = ratio(row["auto_tok_s"], row["off_tok_s"])
                rows.append(row)
                log(f"depth {depth}: off {row['off_tok_s']:.2f} tok/s, split {row['auto_tok_s']:.2f} tok/s "
                    f"({row['speedup']:.2f}x); attention {row['off_attn_ms']:.1f} -> {row['auto_attn_ms']:.1f} ms/tok")
        finally:
            eng.blocks.release(table)
        shape = (f"{hp.arch}, {hp.n_layer} layers, {hp.n_head} heads / {hp.n_head_kv} KV heads of {hp.head_dim}")
    try:
        load_after = list(os.getloadavg())
    except OSError:
        load_after = []
    return {"machine": machine, "load_after": load_after, "model": {"path": str(model), "shape": shape},
            "config": {"threads": threads, "depths": list(depths), "tokens": n_tokens, "rounds": rounds},
            "rows": rows}


def format_report(rep: dict[str, Any]) -> str:
    m, c = rep["machine"], rep["config"]
    head = (f"{m['date']}  {m['cpu_model']}  threads {c['threads']}  load before {m['loadavg']}  "
            f"after {rep['load_after']}\nmodel {rep['model']['path']} ({rep['model']['shape']})\n"
            f"{c['tokens']} decode steps per sample, median of {c['rounds']} rounds per mode\n")
    rows = [(fmt_num(r["depth"]), fmt_num(r["off_tok_s"], 2), fmt_num(r["auto_tok_s"], 2), f"{r['speedup']:.2f}x",
             fmt_num(r["off_attn_ms"], 2), fmt_num(r["auto_attn_ms"], 2), fmt_num(r["chunk"]),
             fmt_num(r["prefill_tok_s"], 1)) for r in rep["rows"]]
    return head + text_table(("context", "unsplit tok/s", "split tok/s", "split / unsplit", "attn block ms/tok unsplit",
                              "attn block ms/tok split", "keys per chunk", "prefill tok/s"), rows)


def format_markdown(rep: dict[str, Any]) -> str:
    rows = [(fmt_num(r["depth"]), fmt_num(r["off_tok_s"], 2), fmt_num(r["auto_tok_s"], 2), f"{r['speedup']:.2f}x",
             fmt_num(r["off_attn_ms"], 1), fmt_num(r["auto_attn_ms"], 1)) for r in rep["rows"]]
    return markdown_table(("context", "unsplit tok/s", "split tok/s", "split / unsplit",
                           "attention block ms/tok unsplit", "attention block ms/tok split"), rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_attention_depth",
                                 description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the embedded default model)")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: the process's cores)")
    ap.add_argument("--depths", default="0,4096,16384", help="contexts before decode, comma-separated")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps per sample (default 16)")
    ap.add_argument("--rounds", type=int, default=3, help="samples per mode and depth (default 3)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="write samples and machine info")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table for docs/benchmarks.md")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        depths = [int(d) for d in a.depths.split(",") if d.strip()]
    except ValueError:
        print(f"error: --depths {a.depths!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    threads = a.threads if a.threads is not None else len(affinity_cores())
    if not depths or min(depths) < 0 or threads < 1 or a.tokens < 1 or a.rounds < 1:
        print("error: depths >= 0, threads, tokens and rounds >= 1", file=sys.stderr)
        return 2
    if a.model is None:
        from engine.default_model import build_default_model, default_model_path

        a.model = Path(build_default_model(default_model_path()))
    if not a.model.is_file():
        print(f"error: no such model file: {a.model}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rep = run(a.model.resolve(), threads, depths, a.tokens, a.rounds, log)
    print(format_report(rep))
    if a.markdown:
        print("\n" + format_markdown(rep))
    if a.json:
        write_json(a.json, rep)
        log(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
