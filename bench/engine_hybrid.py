"""Hybrid placement on the GPU machine: the routed experts that do not fit the budget computed on the CPU,
Strata beside llama.cpp in the same run, on the same file.

    PYTHONPATH=. python -m bench.engine_hybrid --skew 1 --llama-bin /tmp/llama-build/bin --json out.json

The model is bench/engine_gpu.py's synthetic Qwen3-30B-A3B-shaped Q4_K file (built if missing, ``--skew`` picks
the router's Zipf exponent: 1 skewed, 0 uniform; ``--experts q8_0`` the same shape with Q8_0 experts, ~32 GB, and
``--budget-gb 24`` one row at the reference card's budget instead of ``--fractions``). For each expert fraction F (``--fractions``, default 0, 0.25,
0.5) Strata opens it with ``gpu_budget_gb`` = the plan's fixed GPU bytes (non-routed weights, KV, step buffers,
the context reserve) + F x every routed expert's bytes, so that the plan makes about F of the routed experts
resident (the most used first, by the default placement file beside the model if there is one, else uniform);
llama.cpp runs with ``-ncmoe`` = (1 - F) x layers (the experts of the first layers on the CPU, the rest on the
GPU) and, at F = 0, ``-ot exps=CPU``. Its VRAM is read from nvidia-smi during the run (the peak, the driver's
figure), Strata's from the engine's own account beside the budget.

Figures per fraction: batch-1 decode tok/s, prefill tok/s of ``--prefill`` tokens, aggregate decode of
``--batch`` sequences; Strata's frame profile of its last decode step (GPU compute, PCIe copies, GPU waiting
on the CPU, CPU experts, CPU waiting on the GPU, GPU idle share, PCIe GB/s, resident hit rate); the floor: routed-expert bytes a decode token reads from RAM / the CPU's measured
read bandwidth + the GPU's part (the plan's figures), with the share of it Strata reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_gpu import SHAPE, build_model, llama_env, parse_batched_bench, parse_llama_bench

GIB = 2**30


def _model(args: argparse.Namespace) -> Path:
    tail = "" if args.experts == "q4_k" else f"-{args.experts}"
    path = Path(args.model_dir) / f"qwen3moe-synth-{args.layers}L-skew{args.skew:g}{tail}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        build_model(path, dict(SHAPE, n_layer=args.layers), args.skew, experts=args.experts)
    return path


def fraction_for_budget(path: Path, budget_gb: float, kv_tokens: int, block_size: int, prefill_chunk: int) -> float:
    """The share of the routed experts' bytes a budget leaves after the fixed parts (budget_for_fraction's
    inverse), so that llama.cpp's -ncmoe matches Strata's GPU memory."""
    lo = budget_for_fraction(path, 0.0, kv_tokens, block_size, prefill_chunk)
    hi = budget_for_fraction(path, 1.0, kv_tokens, block_size, prefill_chunk)
    return min(1.0, max(0.0, (budget_gb - lo) / (hi - lo)))


def budget_for_fraction(path: Path, frac: float, kv_tokens: int, block_size: int, prefill_chunk: int) -> float:
    """gpu_budget_gb that leaves room for ``frac`` of the routed experts' bytes after the fixed parts."""
    from engine import gpu_settings
    from engine.gguf_model import open_model
    from engine.placement import engine_plan_params, plan

    mf = open_model(path)
    # STRATA_GPU_HYBRID_STAGE=1: the staging ring (two whole layers) is a fixed part, as Engine.open plans it
    slots = 2 * mf.hparams.n_expert if gpu_settings.env_override("hybrid_stage") == 1 else 0
    p = plan(mf, engine_plan_params(0, kv_tokens, block_size, prefill_chunk, staging_slots=slots))
    return (p.fixed_bytes + frac * p.routed_bytes) / GIB + 1e-3


FRAME_KEYS = ("t_total", "t_gpu", "t_pcie", "t_gpu_wait", "t_cpu_experts", "t_cpu_wait")


def frame_ms(st: Any) -> dict[str, float]:
    """A step's frame profile in ms (engine.step.StepStats), with the GPU's idle share (waiting on the CPU) and
    the PCIe rate of the CPU share's copies."""
    out = {k: 1e3 * float(getattr(st, k, float("nan"))) for k in FRAME_KEYS}
    out["gpu_idle_share"] = out["t_gpu_wait"] / out["t_total"] if out["t_total"] > 0 else float("nan")
    pcie_b = float(getattr(st, "pcie_bytes", 0))
    out["pcie_gb_s"] = pcie_b / (out["t_pcie"] * 1e6) if out["t_pcie"] > 0 else float("nan")
    return out


def run_strata(path: Path, frac: float, args: argparse.Namespace) -> dict[str, Any]:
    from engine.engine import Engine
    from engine.placement import measure_cpu_read_gbs

    kv, bs, chunk = args.kv_tokens, 16, 512
    budget = args.budget_gb if args.budget_gb is not None else budget_for_fraction(path, frac, kv, bs, chunk)
    cores = list(range(os.cpu_count() or 1)) if args.cores is None else [int(c) for c in args.cores.split(",")]
    t0 = time.perf_counter()
    eng = Engine.open(path, device=args.device, kv_tokens=kv, block_size=bs, prefill_chunk=chunk,
                      gpu_budget_gb=budget, cores=cores)
    out: dict[str, Any] = {"fraction": frac, "gpu_budget_gb": budget, "load_s": time.perf_counter() - t0,
                           "cores": len(cores)}
    try:
        p = getattr(eng, "plan", None)
        if p is not None:
            out.update(n_resident=p.n_resident, n_routed=p.n_routed, plan_hit_rate=p.hit_rate,
                       ram_bytes_per_token=p.ram_bytes_per_token, plan_gpu_bytes=p.gpu_bytes,
                       gpu_read_bytes_per_token=p.gpu_read_bytes_per_token)
        if eng._gpu is not None:
            out["engine_memory"] = eng._gpu.memory()
        V = eng.hparams.n_vocab
        rng = np.random.default_rng(1)

        def blocks(n: int) -> list[int]:
            got = eng.blocks.allocate(-(-n // bs))
            assert got is not None
            return got

        def decode(n_seq: int, steps: int) -> tuple[float, Any]:
            tabs = [blocks(32 + steps + 3) for _ in range(n_seq)]
            try:
                last = [int(np.argmax(eng.prefill([int(t) for t in rng.integers(0, V, 32)], tb))) for tb in tabs]
                pos = 32
                for s in range(steps + 2):  # two warm-up steps
                    if s == 2:
                        t = time.perf_counter()
                    last = eng.forward(last, [pos] * n_seq, list(range(n_seq)), tabs, list(range(n_seq)),
                                       greedy=True).tolist()
                    pos += 1
                return n_seq * steps / (time.perf_counter() - t), eng.last_stats
            finally:
                for tb in tabs:
                    eng.blocks.release(tb)

        def prefill(n: int) -> float:
            b = blocks(n)
            try:
                ids = [int(t) for t in rng.integers(0, V, n)]
                eng.prefill(ids[:16], b)
                t = time.perf_counter()
                eng.prefill(ids, b)
                rate = n / (time.perf_counter() - t)
                st = eng.last_stats  # the chunk's last step: its frame and what staging did
                out[f"prefill_{n}_frame_ms"] = frame_ms(st)
                out[f"prefill_{n}_staging"] = {k: float(getattr(st, k, 0)) for k in (
                    "staged_layers", "staged_bytes", "stage_pcie_gbs", "stage_gpu_gbs", "stage_cpu_pairs_s")}
                return rate
            finally:
                eng.blocks.release(b)

        out["decode_b1_tok_s"], st = decode(1, args.steps)
        out["frame_b1_ms"] = frame_ms(st)
        out["resident_hit_rate_b1"] = float(getattr(st, "resident_hit_rate", float("nan")))
        out[f"prefill_{args.prefill}_tok_s"] = prefill(args.prefill)
        out[f"decode_b{args.batch}_tok_s"], st = decode(args.batch, max(4, args.steps // 4))
        out[f"frame_b{args.batch}_ms"] = frame_ms(st)
    finally:
        eng.close()
    gbs = measure_cpu_read_gbs(cores=cores)
    out["cpu_read_gbs"] = gbs
    if "ram_bytes_per_token" in out:
        gpu_s = out["frame_b1_ms"]["t_gpu"] / 1e3
        floor_s = out["ram_bytes_per_token"] / (gbs * 1e9) + gpu_s
        out["floor_b1_tok_s"] = 1.0 / floor_s
        out["floor_share_b1"] = out["decode_b1_tok_s"] / out["floor_b1_tok_s"]
    return out


class _VramPeak:
    """The peak of nvidia-smi's memory.used (MiB) while running: llama.cpp's VRAM, the driver's figure."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=5)
                self.peak = max(self.peak, int(r.stdout.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(0.2)

    def __enter__(self) -> _VramPeak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def run_llama(bin_dir: Path, path: Path, frac: float, args: argparse.Namespace) -> dict[str, Any]:
    env = llama_env(bin_dir)
    ncmoe = round((1.0 - frac) * args.layers)
    place = ["-ot", "exps=CPU"] if ncmoe >= args.layers else ["-ncmoe", str(ncmoe)]
    threads = str(os.cpu_count() if args.cores is None else len(args.cores.split(",")))
    out: dict[str, Any] = {"fraction": frac, "placement": " ".join(place), "threads": threads}
    cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-ngl", "99", "-fa", "1", *place, "-t", threads,
           "-p", str(args.prefill), "-n", str(args.steps), "-r", "2", "-o", "json"]
    with _VramPeak() as vram:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.llama_timeout, env=env)
    out["vram_peak_gib"] = vram.peak / 1024
    if p.returncode != 0:
        out["error"] = p.stderr[-1500:]
        return out
    out.update(parse_llama_bench(p.stdout))
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(path), "-ngl", "99", "-fa", "on", *place, "-t", threads,
           "-c", "4096", "-b", "2048", "-ub", "512", "-npp", "32", "-ntg", str(max(4, args.steps // 4)),
           "-npl", str(args.batch), "--output-format", "jsonl"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.llama_timeout, env=env)
    if p.returncode != 0:
        out["error"] = p.stderr[-1500:]
        return out
    out.update(parse_batched_bench(p.stdout + "\n" + p.stderr))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_hybrid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity (0 = uniform)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--fractions", default="0,0.25,0.5", help="shares of the routed experts' bytes on the GPU")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cores", default=None, help="comma-separated CPU ids for the CPU experts (default: all)")
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32, help="batch-1 decode steps (the batch row takes a quarter)")
    ap.add_argument("--batch", type=int, default=8, help="sequences of the aggregate decode row")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--model-dir", default="/tmp/strata-bench")
    ap.add_argument("--experts", default="q4_k", choices=("q4_k", "q8_0"),
                    help="the routed experts' type (q8_0: ~32 GB at the Qwen3-30B-A3B shape)")
    ap.add_argument("--budget-gb", type=float, default=None,
                    help="one row at this gpu_budget_gb (GiB) instead of --fractions; llama.cpp's -ncmoe from the "
                         "fraction of the routed experts it leaves")
    ap.add_argument("--llama-bin", default=None, help="llama.cpp's llama-bench / llama-batched-bench (CUDA build)")
    ap.add_argument("--llama-timeout", type=float, default=300.0)
    ap.add_argument("--strata-only", action="store_true")
    ap.add_argument("--llama-only", action="store_true", help="llama.cpp's rows alone (a device call of its own)")
    ap.add_argument("--build-only", action="store_true", help="write the model file and stop (the Q8_0 file takes "
                                                                "minutes: a device call of its own)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    path = _model(args)
    if args.build_only:
        print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB", flush=True)
        return 0
    rows: list[dict[str, Any]] = []
    fracs = [float(f) for f in args.fractions.split(",")]
    if args.budget_gb is not None:
        fracs = [fraction_for_budget(path, args.budget_gb, args.kv_tokens, 16, 512)]
    for frac in fracs:
        row: dict[str, Any] = {"fraction": frac, "strata": {} if args.llama_only else run_strata(path, frac, args)}
        if args.llama_bin and not args.strata_only:
            row["llama"] = run_llama(Path(args.llama_bin), path, frac, args)
        rows.append(row)
        s, ll = row["strata"], row.get("llama", {})
        fr = s.get("frame_b1_ms")
        print(f"F={frac:g}: budget {s.get('gpu_budget_gb', float('nan')):.2f} GiB, resident "
              f"{s.get('n_resident', '?')}/{s.get('n_routed', '?')} experts (plan hit rate "
              f"{s.get('plan_hit_rate', float('nan')):.2f}, measured {s.get('resident_hit_rate_b1', float('nan')):.2f}"
              f"); llama.cpp {ll.get('placement', '-')} "
              f"VRAM peak {ll.get('vram_peak_gib', float('nan')):.2f} GiB", flush=True)
        for k in ("decode_b1_tok_s", f"prefill_{args.prefill}_tok_s", f"decode_b{args.batch}_tok_s"):
            a, b = s.get(k), ll.get(k)
            ratio = f"{a / b:.2f}x" if a and b else "-"
            print(f"   {k:<22}{a if a else float('nan'):>10.1f}{b if b else float('nan'):>10.1f}{ratio:>8}")
        if "error" in ll:
            print(f"   llama.cpp failed: {ll['error'][-400:]}")
        if fr is None:  # llama.cpp's rows alone
            continue
        print(f"   frame b1 ms: total {fr['t_total']:.2f} = GPU {fr['t_gpu']:.2f} + PCIe {fr['t_pcie']:.2f} + GPU "
              f"waiting on CPU {fr['t_gpu_wait']:.2f} (idle {100 * fr['gpu_idle_share']:.0f}%); CPU experts "
              f"{fr['t_cpu_experts']:.2f}, CPU waiting on GPU {fr['t_cpu_wait']:.2f}; PCIe {fr['pcie_gb_s']:.1f} "
              f"GB/s; floor "
              f"{s.get('floor_b1_tok_s', float('nan')):.1f} tok/s (reached {100 * s.get('floor_share_b1', 0):.0f}%), "
              f"CPU read {s['cpu_read_gbs']:.1f} GB/s", flush=True)
        sg = s.get(f"prefill_{args.prefill}_staging")
        if sg:
            pf = s[f"prefill_{args.prefill}_frame_ms"]
            print(f"   prefill's last step: {pf['t_total']:.1f} ms = GPU {pf['t_gpu']:.1f} + PCIe {pf['t_pcie']:.1f} + "
                  f"waiting {pf['t_gpu_wait']:.1f}; staged {sg['staged_layers']:.0f} layers, "
                  f"{sg['staged_bytes'] / 2**20:.0f} MiB (rates: PCIe {sg['stage_pcie_gbs']:.1f} GB/s, GPU "
                  f"{sg['stage_gpu_gbs']:.0f} GB/s, CPU {sg['stage_cpu_pairs_s']:.0f} pairs/s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"skew": args.skew, "model": str(path), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
