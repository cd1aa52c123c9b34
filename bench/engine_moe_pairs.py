"""The CPU expert entry point of the hybrid engine (``st_moe_pairs``): its rate in pairs/s and in GB/s of
expert weights read, with uniform and Zipf-skewed expert choice, beside the machine's RAM read rate
(``st_mem_read_gbs`` on the same threads) and the CPU step's own routed FFN (``st_moe_layer``) on the
same rows.

The model is ``bench/engine_gpu.py``'s synthetic Qwen3-30B-A3B shape (n_embd 2048, 128 experts top-8,
expert FFN 768, Q4_K), cut to a few layers and a small vocabulary (the layers' expert bytes are what
count: 340 MB per layer), written under var/bench/ on first use. Each timed call takes the next layer in
turn, so its experts come from RAM, not from the cache the previous call filled.

    python -m bench.engine_moe_pairs [--threads N] [--layers L] [--seconds S] [--tokens 1,8,32] [--json OUT]

Per (tokens T, routing): T tokens x top-8 pairs; uniform: 8 distinct experts per token drawn uniformly;
skewed: drawn with probability ~ 1 / rank (Zipf, skew 1) over a fixed random expert order. "experts" is
the mean number of distinct experts a call touches; GB/s counts each touched expert's gate, up and down
bytes once per call (what has to stream from RAM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(n_layer=4, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8,
             n_ff_exp=768, n_vocab=4096)


def model_path(n_layer: int) -> Path:
    from bench.engine_gpu import build_model

    out = ROOT / "var" / "bench" / f"moe-pairs-q30b-shape-L{n_layer}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        build_model(out, {**SHAPE, "n_layer": n_layer}, skew=0.0, seed=7)
    return out


def draw_pairs(rng: np.random.Generator, T: int, ne: int, k: int, skew: float,
               order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = 1.0 / np.arange(1, ne + 1) ** skew
    p = p[np.argsort(order)] / p.sum()  # expert order[r] has rank r
    exp = np.concatenate([rng.choice(ne, size=k, replace=False, p=p) for _ in range(T)]).astype(np.int32)
    return np.repeat(np.arange(T, dtype=np.int32), k), exp


def timed(fn, seconds: float, min_calls: int = 3) -> tuple[float, int]:  # noqa: ANN001 - a closure
    """Median seconds per call over at least ``min_calls`` calls and ``seconds`` of wall time."""
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    while len(times) < min_calls or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn(len(times))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), len(times)


def run(args: argparse.Namespace) -> dict:
    from engine.engine import Engine
    from engine.gguf_model import open_model
    from engine.placement import expert_bytes, measure_cpu_read_gbs

    path = model_path(args.layers)
    mf = open_model(path)
    hp = mf.hparams
    ne, k, L = hp.n_expert, hp.n_expert_used, hp.n_layer
    eb = int(expert_bytes(mf)[0, 0])  # gate + up + down of one expert (256-aligned slices; Q4_K rows are exact)
    threads = args.threads or len(os.sched_getaffinity(0))
    ram = measure_cpu_read_gbs(threads, n_bytes=1 << 30, passes=3)
    res: dict = {"model": str(path), "threads": threads, "expert_bytes": eb, "ram_read_gbs": ram, "rows": []}
    rng = np.random.default_rng(1)
    order = rng.permutation(ne)
    with Engine.open(path, threads=threads, kv_tokens=64) as eng:
        for T in args.tokens:
            x = [rng.standard_normal((T, hp.n_embd)).astype(np.float32) for _ in range(L)]
            for routing, skew in (("uniform", 0.0), ("skewed", 1.0)):
                pairs = [draw_pairs(rng, T, ne, k, skew, order) for _ in range(16)]
                touched = float(np.mean([len(np.unique(e)) for _, e in pairs]))
                eng.moe_pairs(0, x[0], *pairs[0])  # first call: scratch, repack (none for Q4_K)
                sec, n = timed(lambda i, x=x, pairs=pairs: eng.moe_pairs(i % L, x[i % L], *pairs[i % len(pairs)]),
                               args.seconds)
                row = {"entry": "st_moe_pairs", "tokens": T, "routing": routing, "pairs": T * k, "experts": touched,
                       "ms": 1e3 * sec, "pairs_s": T * k / sec, "gb_s": touched * eb / sec / 1e9, "calls": n}
                res["rows"].append(row)
            # the step's routed FFN over the same rows (its own router picks the experts: near uniform here)
            outs = [eng.moe_layer(il, x[il])[1] for il in range(L)]
            touched = float(np.mean([len(np.unique(ids)) for ids in outs]))
            sec, n = timed(lambda i, x=x: eng.moe_layer(i % L, x[i % L]), args.seconds)
            res["rows"].append({"entry": "st_moe_layer (step)", "tokens": T, "routing": "router", "pairs": T * k,
                                "experts": touched, "ms": 1e3 * sec, "pairs_s": T * k / sec,
                                "gb_s": touched * eb / sec / 1e9, "calls": n})
    return res


def print_table(res: dict) -> None:
    print(f"# st_moe_pairs: {res['model']}, {res['threads']} threads, expert {res['expert_bytes'] / 1e6:.2f} MB "
          f"(gate+up+down, Q4_K), RAM read {res['ram_read_gbs']:.1f} GB/s (st_mem_read_gbs, same threads)")
    print(f"{'entry':<20} {'T':>4} {'routing':<8} {'pairs':>6} {'experts':>8} {'ms/call':>9} {'pairs/s':>10} "
          f"{'GB/s':>7} {'of RAM':>7}")
    for r in res["rows"]:
        print(f"{r['entry']:<20} {r['tokens']:>4} {r['routing']:<8} {r['pairs']:>6} {r['experts']:>8.1f} "
              f"{r['ms']:>9.2f} {r['pairs_s']:>10.0f} {r['gb_s']:>7.2f} {100 * r['gb_s'] / res['ram_read_gbs']:>6.0f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="pool threads (default: all allowed cores)")
    ap.add_argument("--layers", type=int, default=4, help="layers in the model (calls cycle through them)")
    ap.add_argument("--seconds", type=float, default=2.0, help="timing per row")
    ap.add_argument("--tokens", default="1,8,32", help="token rows per call, comma-separated")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    res = run(args)
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
