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

``--kv-type q8_0`` runs the engine on its 8-bit KV cache (``f16`` the default). ``--unfilled`` decodes at
each depth without prefilling it, for a kernel as slow as the 8-bit cache's generic reference (about
0.06 GB/s per thread), which would take an hour to prefill a few thousand tokens: its speed does not
depend on the cached values, nor on where they are read from. The cache's unwritten pages may all
map the kernel's one zero page, always in cache, so a kernel near memory bandwidth reads faster
than it would from a filled cache: time those filled.

``--kernel`` measures the attention kernels alone instead, on one thread and random caches: one
decode query's GQA group (``--group`` query heads of one KV head of ``--head-dim``) over D keys in
the engine's chunks of 1024 keys (st_attention_split_kv for the F16 cache, st_attention_q8 for the
8-bit one), the reference against the variant the CPU selects; it prints GB/s of K and V attended
(the KV head's bytes over the keys, read once for the group) per thread and ms per call, medians
over rounds.

Usage: ``python -m bench.cpu_attention_depth [--model PATH] [--threads N] [--depths 0,4096,16384]
[--tokens N] [--rounds R] [--kv-type f16|q8_0] [--kernel [--head-dim 128] [--group 8]]
[--json OUT.json] [--markdown]``.
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
    emit_report,
    fmt_num,
    machine_info,
    markdown_table,
    median,
    ratio,
    text_table,
)

MODES = ("off", "auto")
SEED = 1234
KV_TYPES = ("f16", "q8_0")
KERNEL_CHUNK = 1024  # the split rule's largest chunk (docs/engine.md): the engine's decode at depth


def kv_bytes_per_key(kv_type: str, hd: int, vd: int) -> float:
    """Bytes of one KV head's K and V for one key: F16 values, or int8 values with an F16 scale per 32."""
    return (hd + vd) * (2.0 if kv_type == "f16" else 34.0 / 32.0)


def kernel_call(kv_type: str, variant: str, n_keys: int, hd: int, group: int, bs: int = 16) -> Callable[[], None]:
    """A closure running one decode query's attention for a GQA group over n_keys random keys of one KV head,
    split in chunks of KERNEL_CHUNK keys, with the given kernel variant ("ref" or "auto")."""
    from engine.native import VARIANTS, ffi, lib, ptr

    rng = np.random.default_rng(SEED + n_keys)
    n_blocks = -(-n_keys // bs)
    bt = rng.permutation(n_blocks).astype(np.int32)
    q = (rng.standard_normal((group, hd)) * 0.1).astype(np.float32)
    out = np.zeros((group, hd), np.float32)
    chunk = KERNEL_CHUNK if n_keys > KERNEL_CHUNK else -(-n_keys // 16) * 16
    v = VARIANTS[variant]
    if kv_type == "f16":
        k = rng.standard_normal((n_blocks, 1, hd, bs)).astype(np.float16)
        val = rng.standard_normal((n_blocks, bs, hd)).astype(np.float16)
        args = (v, ptr(k), ptr(val), ptr(bt, "int32_t *"), bs, hd, hd, 1, 0, ptr(q, "float *"), group, n_keys, chunk,
                ffi.NULL, ptr(out, "float *"))
        fn = lib.st_attention_split_kv
    else:
        k8 = rng.integers(-127, 128, (n_blocks, 1, hd, bs), dtype=np.int8)
        ks = (rng.uniform(0.2, 1.0, (n_blocks, 1, hd // 32, bs)) / 127).astype(np.float16)
        v8 = rng.integers(-127, 128, (n_blocks, bs, hd), dtype=np.int8)
        vs = (rng.uniform(0.2, 1.0, (n_blocks, bs, hd // 32)) / 127).astype(np.float16)
        args = (v, ptr(k8, "int8_t *"), ptr(ks, "uint16_t *"), ptr(v8, "int8_t *"), ptr(vs, "uint16_t *"),
                ptr(bt, "int32_t *"), bs, hd, hd, 1, 0, ptr(q, "float *"), group, n_keys - 1, chunk,
                ptr(out, "float *"))
        fn = lib.st_attention_q8
    keep = (bt, q, out) + ((k, val) if kv_type == "f16" else (k8, ks, v8, vs))

    def call() -> None:
        rc = fn(*args)
        if rc:
            raise RuntimeError(f"{kv_type} {variant} attention failed: {ffi.string(lib.st_last_error()).decode()}")

    call.__dict__["arrays"] = keep  # the arrays the pointers in args refer to live as long as the closure
    return call


def time_call(call: Callable[[], None], min_s: float = 0.05) -> float:
    """Seconds per call on this thread's CPU clock, over enough calls to fill min_s."""
    call()  # warm: caches, page faults
    n, t0 = 0, time.thread_time()
    while True:
        call()
        n += 1
        dt = time.thread_time() - t0
        if dt >= min_s:
            return dt / n


def run_kernels(depths: Sequence[int], hd: int, group: int, rounds: int,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Per-thread GB/s of KV attended and ms per call, F16 and 8-bit caches, reference and selected variant."""
    from engine.native import lib

    machine = machine_info()
    rows: list[dict[str, Any]] = []
    for depth in sorted(depths):
        n_keys = depth + 1
        for kv_type in KV_TYPES:
            calls = {variant: kernel_call(kv_type, variant, n_keys, hd, group) for variant in ("ref", "auto")}
            samples: dict[str, list[float]] = {variant: [] for variant in calls}
            for r in range(rounds):
                for variant in (("ref", "auto") if r % 2 == 0 else ("auto", "ref")):
                    samples[variant].append(time_call(calls[variant]))
            gb = n_keys * kv_bytes_per_key(kv_type, hd, hd) / 1e9
            row: dict[str, Any] = {"depth": depth, "kv_type": kv_type, "samples": samples}
            for variant in calls:
                row[f"{variant}_ms"] = median(samples[variant]) * 1e3
                row[f"{variant}_gb_s"] = gb / median(samples[variant])
            row["speedup"] = ratio(row["ref_ms"], row["auto_ms"])
            rows.append(row)
            log(f"depth {depth} {kv_type}: ref {row['ref_gb_s']:.3f} GB/s, variant {row['auto_gb_s']:.3f} GB/s "
                f"({row['speedup']:.1f}x)")
    return {"machine": machine, "variant": int(lib.st_get_variant()),
            "config": {"depths": list(depths), "head_dim": hd, "group": group, "rounds": rounds,
                       "chunk": KERNEL_CHUNK}, "rows": rows}


def format_kernel_report(rep: dict[str, Any]) -> str:
    m, c = rep["machine"], rep["config"]
    head = (f"{m['date']}  {m['cpu_model']}  one thread  load before {m['loadavg']}  selected variant {rep['variant']}"
            f"\nhead dim {c['head_dim']}, {c['group']} query heads per KV head, chunks of {c['chunk']} keys, "
            f"median of {c['rounds']} rounds\n")
    rows = [(fmt_num(r["depth"]), r["kv_type"], fmt_num(r["ref_gb_s"], 3), fmt_num(r["auto_gb_s"], 3),
             fmt_num(r["ref_ms"], 3), fmt_num(r["auto_ms"], 3), f"{r['speedup']:.1f}x") for r in rep["rows"]]
    return head + text_table(("context", "KV cache", "ref GB/s", "variant GB/s", "ref ms/call", "variant ms/call",
                              "variant / ref"), rows)


def format_kernel_markdown(rep: dict[str, Any]) -> str:
    rows = [(fmt_num(r["depth"]), r["kv_type"], fmt_num(r["ref_gb_s"], 3), fmt_num(r["auto_gb_s"], 3),
             fmt_num(r["ref_ms"], 2), fmt_num(r["auto_ms"], 2), f"{r['speedup']:.1f}x") for r in rep["rows"]]
    return markdown_table(("context", "KV cache", "ref GB/s per thread", "variant GB/s per thread", "ref ms/call",
                           "variant ms/call", "variant / ref"), rows)


def time_decode(eng: Any, table: list[int], ids: Sequence[int], depth: int) -> tuple[float, float]:
    """(wall seconds, attention seconds) of len(ids) single-token steps at positions depth.."""
    t_attn = 0.0
    t0 = time.perf_counter()
    for i, tok in enumerate(ids):
        eng.forward([tok], [depth + i], [0], [table], [0])
        t_attn += eng.last_stats.t_attn
    return time.perf_counter() - t0, t_attn


def run(model: Path, threads: int, depths: Sequence[int], n_tokens: int, rounds: int,
        log: Callable[[str], None], kv_type: str = "f16", unfilled: bool = False) -> dict[str, Any]:
    from engine.engine import Engine
    from engine.native import ffi, lib, set_attn_split

    machine = machine_info()
    depths = sorted(depths)
    capacity = depths[-1] + n_tokens + 16
    rows: list[dict[str, Any]] = []
    with Engine.open(model, threads=threads, kv_tokens=capacity, prefill_chunk=512, kv_type=kv_type) as eng:
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
                if depth > filled and not unfilled:
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
            "config": {"threads": threads, "depths": list(depths), "tokens": n_tokens, "rounds": rounds,
                       "kv_type": kv_type, "unfilled": unfilled},
            "rows": rows}


def format_report(rep: dict[str, Any]) -> str:
    m, c = rep["machine"], rep["config"]
    head = (f"{m['date']}  {m['cpu_model']}  threads {c['threads']}  load before {m['loadavg']}  "
            f"after {rep['load_after']}\nmodel {rep['model']['path']} ({rep['model']['shape']})\n"
            f"{c['tokens']} decode steps per sample, median of {c['rounds']} rounds per mode, "
            f"KV cache {c.get('kv_type', 'f16')}\n")
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
    ap.add_argument("--kv-type", choices=KV_TYPES, default="f16", help="the engine's KV cache (default f16)")
    ap.add_argument("--unfilled", action="store_true",
                    help="decode at each depth without prefilling it (the keys are whatever the cache holds): for "
                    "timing kernels too slow to prefill to depth, e.g. the 8-bit cache's generic reference (unwritten "
                    "pages may read from cache: not for kernels near memory bandwidth)")
    ap.add_argument("--kernel", action="store_true",
                    help="time the attention kernels alone (one thread, random caches): ref vs the selected variant")
    ap.add_argument("--head-dim", type=int, default=128, help="with --kernel: head dimensions (multiple of 32)")
    ap.add_argument("--group", type=int, default=8, help="with --kernel: query heads per KV head (default 8)")
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
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if a.kernel:
        if not depths or min(depths) < 0 or a.rounds < 1 or a.head_dim < 32 or a.head_dim % 32 or not 1 <= a.group <= 64:
            print("error: depths >= 0, rounds >= 1, --head-dim a multiple of 32, --group 1..64", file=sys.stderr)
            return 2
        rep = run_kernels(depths, a.head_dim, a.group, a.rounds, log)
        emit_report(rep, format_kernel_report(rep), format_kernel_markdown(rep) if a.markdown else None, a.json, log)
        return 0
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

    rep = run(a.model.resolve(), threads, depths, a.tokens, a.rounds, log, a.kv_type, a.unfilled)
    emit_report(rep, format_report(rep), format_markdown(rep) if a.markdown else None, a.json, log)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
