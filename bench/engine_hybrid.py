"""Hybrid placement on the GPU machine: the routed experts that do not fit the budget computed on the CPU,
Strata beside llama.cpp in the same run, on the same file.

    PYTHONPATH=. python -m bench.engine_hybrid --skew 1 --llama-bin /tmp/llama-build/bin --json out.json

Issue 29's whole table in one device call (both routings, three budgets, 8 and 32 sequences, then the Q8_0 model
at the reference card's 24 GB while time remains; rows that would not finish before ``--deadline-s`` are skipped
and said so, the JSON is rewritten after every row):

    PYTHONPATH=. python -m bench.engine_hybrid --skews 1,0 --batch 8,32 --q8-budget-gb 24 --deadline-s 510 \
        --llama-bin /tmp/llama-build/bin --json $OUT/hybrid.json

The model is bench/engine_gpu.py's synthetic Qwen3-30B-A3B-shaped Q4_K file (built if missing, ``--skew`` picks
the router's Zipf exponent: 1 skewed, 0 uniform; ``--experts q8_0`` the same shape with Q8_0 experts, ~32 GB, and
``--budget-gb 24`` one row at the reference card's budget instead of ``--fractions``). For each expert fraction F (``--fractions``, default 0, 0.25,
0.5) Strata opens it with ``gpu_budget_gb`` = the plan's fixed GPU bytes (non-routed weights, KV, step buffers,
the context reserve) + F x every routed expert's bytes, so that the plan makes about F of the routed experts
resident (the most used first, by the default placement file beside the model if there is one, else uniform);
llama.cpp runs with ``-ncmoe`` = (1 - F) x layers (the experts of the first layers on the CPU, the rest on the
GPU) and, at F = 0, ``-ot exps=CPU``. Its VRAM is read from nvidia-smi during the run (the peak, the driver's
figure), Strata's from the engine's own account beside the budget.

Figures per fraction: batch-1 decode tok/s, prefill tok/s at each ``--prefill`` length, aggregate decode of each of
``--batch`` sequence counts (their 32-token prompts in steps of at most 512 tokens); Strata's frame profile of its last decode step (GPU compute, PCIe copies, GPU waiting
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
from bench.engine_gpu_depth import parse_knobs

GIB = 2**30


def model_path(model_dir: str | Path, layers: int, skew: float, experts: str) -> Path:
    tail = "" if experts == "q4_k" else f"-{experts}"
    return Path(model_dir) / f"qwen3moe-synth-{layers}L-skew{skew:g}{tail}.gguf"


def _model(args: argparse.Namespace, skew: float | None = None, experts: str | None = None) -> Path:
    skew = args.skew if skew is None else skew
    experts = args.experts if experts is None else experts
    path = model_path(args.model_dir, args.layers, skew, experts)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        build_model(path, dict(SHAPE, n_layer=args.layers), skew, experts=experts)
    return path


def build_models(args: argparse.Namespace, skews: list[float], experts: str) -> list[Path]:
    """The files of every skew, the missing ones built at once in processes of their own (the builder is one
    thread each: two files take the time of one on a machine with cores to spare)."""
    paths = [model_path(args.model_dir, args.layers, s, experts) for s in skews]
    procs = []
    for s, p in zip(skews, paths, strict=True):
        if not p.exists():
            cmd = [sys.executable, "-m", "bench.engine_hybrid", "--build-only", "--skew", f"{s:g}", "--experts",
                   experts, "--layers", str(args.layers), "--model-dir", str(args.model_dir)]
            procs.append((subprocess.Popen(cmd), p))
    for pr, p in procs:
        if pr.wait() != 0:
            raise RuntimeError(f"building {p} failed (exit {pr.returncode})")
    return paths


class Deadline:
    """The call's time limit: a row starts only when the longest row of its kind so far (or a stated guess
    before the first) still fits before the deadline."""

    def __init__(self, seconds: float | None, clock: Any = None) -> None:
        self.clock = clock or time.monotonic
        self.t0 = self.clock()
        self.seconds = seconds
        self.longest: dict[str, float] = {}

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (self.clock() - self.t0)

    def fits(self, kind: str, guess_s: float) -> bool:
        return self.longest.get(kind, guess_s) <= self.left()

    def took(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


def llama_placement(frac: float, layers: int, extra_layers: int = 0) -> list[str]:
    """llama.cpp's expert placement for a share ``frac`` of the routed experts on the GPU: the experts of the
    first (1 - frac) x layers layers on the CPU (``-ncmoe``), all of them (``-ot exps=CPU``) at 0;
    ``extra_layers`` more layers' experts on the GPU (--llama-extra-layers: equal VRAM with Strata, whose
    fixed parts hold the staging ring)."""
    ncmoe = max(0, round((1.0 - frac) * layers) - extra_layers)
    return ["-ot", "exps=CPU"] if ncmoe >= layers else ["-ncmoe", str(ncmoe)]


def prompt_steps(n_seq: int, prompt_len: int, max_tokens: int) -> list[list[int]]:
    """The sequences whose prompts share each prefill step: as many whole prompts as fit ``max_tokens``."""
    per = max(1, max_tokens // max(prompt_len, 1))
    return [list(range(i, min(i + per, n_seq))) for i in range(0, n_seq, per)]


def fraction_for_budget(path: Path, budget_gb: float, kv_tokens: int, block_size: int, prefill_chunk: int) -> float:
    """The share of the routed experts' bytes a budget leaves after the fixed parts (budget_for_fraction's
    inverse), so that llama.cpp's -ncmoe matches Strata's GPU memory."""
    lo = budget_for_fraction(path, 0.0, kv_tokens, block_size, prefill_chunk)
    hi = budget_for_fraction(path, 1.0, kv_tokens, block_size, prefill_chunk)
    return min(1.0, max(0.0, (budget_gb - lo) / (hi - lo)))


def budget_for_fraction(path: Path, frac: float, kv_tokens: int, block_size: int, prefill_chunk: int,
                        kv_type: str = "f16") -> float:
    """gpu_budget_gb that leaves room for ``frac`` of the routed experts' bytes after the fixed parts."""
    from engine import gpu_settings
    from engine.gguf_model import open_model
    from engine.placement import engine_plan_params, plan

    mf = open_model(path)
    slots = gpu_settings.staging_slots(mf.hparams.n_expert)  # a fixed part, as Engine.open plans it
    p = plan(mf, engine_plan_params(0, kv_tokens, block_size, prefill_chunk, staging_slots=slots, kv_type=kv_type))
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


def mean_frame(stats: list[Any]) -> dict[str, float]:
    """The frame profile averaged over steps (frame_ms of their summed parts: a step's own figures vary with
    its routing and the CPU's memory), with the mean resident hit rate."""
    if not stats:
        return {}
    tot = {k: sum(float(getattr(st, k, float("nan"))) for st in stats) / len(stats) for k in FRAME_KEYS}
    tot["pcie_bytes"] = sum(float(getattr(st, "pcie_bytes", 0)) for st in stats) / len(stats)
    out = frame_ms(argparse.Namespace(**tot))
    out["resident_hit_rate"] = sum(float(getattr(st, "resident_hit_rate", float("nan"))) for st in stats) / len(stats)
    out["steps"] = float(len(stats))
    return out


# the CPU's read rate behind every row's floor: one median of READ_PROBES probes per core set and process, so that
# rows and knob A/Bs of a call share one floor (single probes between rows varied 128-148 GB/s on the GPU machine)
READ_PROBES = 5
_read_gbs: dict[tuple[int, ...], float] = {}


def cpu_read_gbs(cores: list[int], probe: Any = None) -> float:
    """RAM read GB/s on these cores (engine.placement.measure_cpu_read_gbs, the median of READ_PROBES probes), measured
    once per core set and process."""
    key = tuple(cores)
    if key not in _read_gbs:
        if probe is None:
            from engine.placement import measure_cpu_read_gbs as probe
        _read_gbs[key] = float(np.median([probe(cores=cores) for _ in range(READ_PROBES)]))
    return _read_gbs[key]


def run_strata(path: Path, frac: float, args: argparse.Namespace, budget_gb: float | None = None,
               batches: list[int] | None = None) -> dict[str, Any]:
    """Strata's row. Its VRAM by the driver is the device's free memory before the model opens (this process's
    CUDA context already up) less after its last step: two queries, no polling beside the measured steps (a
    poller's processes would take cores from the pinned pool)."""
    from engine.cuda_backend import gpu_info
    from engine.engine import Engine

    kv, bs, chunk = args.kv_tokens, 16, args.prefill_chunk
    budget = budget_gb if budget_gb is not None else budget_for_fraction(path, frac, kv, bs, chunk)
    batches = parse_ints(args.batch) if batches is None else batches
    cores = list(range(os.cpu_count() or 1)) if args.cores is None else [int(c) for c in args.cores.split(",")]
    gpu = int(args.device.partition(":")[2] or 0)
    free0 = gpu_info(gpu).free_bytes
    t0 = time.perf_counter()
    eng = Engine.open(path, device=args.device, kv_tokens=kv, block_size=bs, prefill_chunk=chunk,
                      gpu_budget_gb=budget, cores=cores)
    out: dict[str, Any] = {"fraction": frac, "gpu_budget_gb": budget, "load_s": time.perf_counter() - t0,
                           "cores": len(cores), "env": {k: v for k, v in os.environ.items()
                                                        if k.startswith("STRATA_GPU_")}}
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

        def decode(n_seq: int, steps: int) -> tuple[float, Any, float]:
            """Aggregate tok/s of n_seq sequences after distinct random 32-token prompts (prefilled together, in
            steps of at most `chunk` tokens), the measured steps' mean frame and the mean wall ms of a step."""
            plen = 32
            tabs = [blocks(plen + steps + 3) for _ in range(n_seq)]
            try:
                last = [0] * n_seq
                for group in prompt_steps(n_seq, plen, chunk):
                    toks = [int(t) for _ in group for t in rng.integers(0, V, plen)]
                    picks = eng.forward(toks, [p for _ in group for p in range(plen)],
                                        [j for j in range(len(group)) for _ in range(plen)], [tabs[i] for i in group],
                                        [(j + 1) * plen - 1 for j in range(len(group))], greedy=True).tolist()
                    for j, i in enumerate(group):
                        last[i] = int(picks[j])
                pos = plen
                frames = []
                for s in range(steps + 2):  # two warm-up steps
                    if s == 2:
                        t = time.perf_counter()
                    last = eng.forward(last, [pos] * n_seq, list(range(n_seq)), tabs, list(range(n_seq)),
                                       greedy=True).tolist()
                    if s >= 2:
                        frames.append(eng.last_stats)
                    pos += 1
                wall = time.perf_counter() - t
                return n_seq * steps / wall, mean_frame(frames), 1e3 * wall / steps
            finally:
                for tb in tabs:
                    eng.blocks.release(tb)

        def prefill(n: int) -> float:
            # a step of the timed run's size first (on blocks of its own), so that the step buffers (and the
            # hybrid's pinned row buffers) grow there and not in the timed run, as llama-bench warms up first
            eng.warm_up(n)
            b = blocks(n)
            try:
                ids = [int(t) for t in rng.integers(0, V, n)]
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

        out["decode_b1_tok_s"], fr, out["wall_b1_ms"] = decode(1, args.steps)
        out["frame_b1_ms"] = fr
        out["resident_hit_rate_b1"] = fr["resident_hit_rate"]
        for n in parse_ints(args.prefill):
            out[f"prefill_{n}_tok_s"] = prefill(n)
        for nb in batches:
            rate, fr, wall = decode(nb, max(4, args.steps // 4))
            out[f"decode_b{nb}_tok_s"], out[f"frame_b{nb}_ms"], out[f"wall_b{nb}_ms"] = rate, fr, wall
        out["vram_held_gib"] = (free0 - gpu_info(gpu).free_bytes) / GIB  # the driver's figure, beside the context
    finally:
        eng.close()
    gbs = cpu_read_gbs(cores)
    out["cpu_read_gbs"] = gbs
    if "ram_bytes_per_token" in out:
        gpu_s = out["frame_b1_ms"]["t_gpu"] / 1e3
        floor_s = out["ram_bytes_per_token"] / (gbs * 1e9) + gpu_s
        out["floor_b1_tok_s"] = 1.0 / floor_s
        out["floor_share_b1"] = out["decode_b1_tok_s"] / out["floor_b1_tok_s"]
    return out


class _VramPeak:
    """The peak of nvidia-smi's memory.used (MiB, the driver's figure for the whole GPU) while running, and the
    first sample (``base``): peak - base is what the block added, e.g. llama.cpp's process beside this one's
    idle CUDA context."""

    def __init__(self) -> None:
        self.peak = 0
        self.base: int | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=5)
                used = int(r.stdout.split()[0])
                self.peak = max(self.peak, used)
                if self.base is None:
                    self.base = used
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(1.0)  # seldom: each query is a process on the cores llama.cpp computes on

    def __enter__(self) -> _VramPeak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def run_llama(bin_dir: Path, path: Path, frac: float, args: argparse.Namespace,
              batches: list[int] | None = None, timeout_s: float | None = None) -> dict[str, Any]:
    """llama-bench (batch-1 decode, prefill) and llama-batched-bench (the batch rows) at the placement of ``frac``,
    each run given ``timeout_s`` (default --llama-timeout)."""
    env = llama_env(bin_dir)
    timeout = args.llama_timeout if timeout_s is None else timeout_s
    place = llama_placement(frac, args.layers, args.llama_extra_layers)
    batches = parse_ints(args.batch) if batches is None else batches
    threads = str(os.cpu_count() if args.cores is None else len(args.cores.split(",")))
    out: dict[str, Any] = {"fraction": frac, "placement": " ".join(place), "threads": threads}
    cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-ngl", "99", "-fa", "1", *place, "-t", threads,
           "-p", ",".join(str(n) for n in parse_ints(args.prefill)), "-n", str(args.steps), "-r", str(args.llama_reps), "-o", "json",
           *(["-b", str(args.prefill_chunk), "-ub", str(args.prefill_chunk)] if args.prefill_chunk != 512 else [])]
    with _VramPeak() as vram:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out["vram_peak_gib"] = vram.peak / 1024
    out["vram_added_gib"] = (vram.peak - (vram.base or 0)) / 1024  # llama.cpp's own, beside this process's context
    if p.returncode != 0:
        out["error"] = p.stderr[-1500:]
        return out
    out.update(parse_llama_bench(p.stdout))
    if not batches:
        return out
    ntg = max(4, args.steps // 4)
    ctx = max(4096, max(batches) * (32 + ntg + 8))
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(path), "-ngl", "99", "-fa", "on", *place, "-t", threads,
           "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", "32", "-ntg", str(ntg),
           "-npl", ",".join(str(b) for b in batches), "--output-format", "jsonl"]
    with _VramPeak() as vram:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out["vram_added_batched_gib"] = (vram.peak - (vram.base or 0)) / 1024
    if p.returncode != 0:
        out["error"] = p.stderr[-1500:]
        return out
    out.update(parse_batched_bench(p.stdout + "\n" + p.stderr))
    return out


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


class _Env:
    """Environment variables set for the duration of a block (a Strata row under a knob)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.old: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.env.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def print_row(row: dict[str, Any], args: argparse.Namespace) -> None:
    s, ll = row["strata"], row.get("llama", {})
    frac = row["fraction"]
    fr = s.get("frame_b1_ms")
    print(f"{row.get('label', '')} F={frac:.3g}: budget {s.get('gpu_budget_gb', float('nan')):.2f} GiB (Strata "
          f"held {s.get('vram_held_gib', float('nan')):.2f} GiB by the driver, beside its context), resident "
          f"{s.get('n_resident', '?')}/{s.get('n_routed', '?')} experts (plan hit rate "
          f"{s.get('plan_hit_rate', float('nan')):.2f}, measured {s.get('resident_hit_rate_b1', float('nan')):.2f}"
          f"); llama.cpp {ll.get('placement', '-')} VRAM {ll.get('vram_added_gib', float('nan')):.2f} GiB (its "
          f"process's peak; the GPU's {ll.get('vram_peak_gib', float('nan')):.2f})",
          flush=True)
    keys = ["decode_b1_tok_s"] + [f"prefill_{n}_tok_s" for n in parse_ints(args.prefill)] + sorted(
        {k for k in list(s) + list(ll) if k.startswith("decode_b") and k.endswith("_tok_s") and k != "decode_b1_tok_s"},
        key=lambda k: int(k[len("decode_b"):-len("_tok_s")]))
    for k in keys:
        a, b = s.get(k), ll.get(k)
        print(f"   {k:<22}{a if a else float('nan'):>10.1f}{b if b else float('nan'):>10.1f}{_ratio(a, b):>8}")
    if "error" in ll:
        print(f"   llama.cpp failed: {ll['error'][-400:]}")
    if "error" in s:
        print(f"   Strata failed: {s['error'][-400:]}")
    if fr is None:  # llama.cpp's rows alone
        return
    for nb in [1] + [int(k[len("frame_b"):-len("_ms")]) for k in s if k.startswith("frame_b") and k != "frame_b1_ms"]:
        f = s[f"frame_b{nb}_ms"]
        print(f"   frame b{nb} ms: total {f['t_total']:.2f} (wall {s.get(f'wall_b{nb}_ms', float('nan')):.2f}) = GPU "
              f"{f['t_gpu']:.2f} + PCIe {f['t_pcie']:.2f} + GPU waiting on CPU {f['t_gpu_wait']:.2f} (idle "
              f"{100 * f['gpu_idle_share']:.0f}%); CPU experts {f['t_cpu_experts']:.2f}, CPU waiting on GPU "
              f"{f['t_cpu_wait']:.2f}; PCIe {f['pcie_gb_s']:.1f} GB/s", flush=True)
    print(f"   floor b1 {s.get('floor_b1_tok_s', float('nan')):.1f} tok/s (reached "
          f"{100 * s.get('floor_share_b1', 0):.0f}%), CPU read {s['cpu_read_gbs']:.1f} GB/s", flush=True)
    for n in parse_ints(args.prefill):
        sg = s.get(f"prefill_{n}_staging")
        if not sg:
            continue
        pf = s[f"prefill_{n}_frame_ms"]
        print(f"   prefill {n}'s last step: {pf['t_total']:.1f} ms = GPU {pf['t_gpu']:.1f} + PCIe {pf['t_pcie']:.1f} + "
              f"waiting {pf['t_gpu_wait']:.1f}; staged {sg['staged_layers']:.0f} layers, "
              f"{sg['staged_bytes'] / 2**20:.0f} MiB (rates: PCIe {sg['stage_pcie_gbs']:.1f} GB/s, GPU "
              f"{sg['stage_gpu_gbs']:.0f} GB/s, CPU {sg['stage_cpu_pairs_s']:.0f} pairs/s)", flush=True)


# a row's guessed seconds before one of its kind has run (a fresh machine, files in the page cache)
GUESS_S = {"strata": 40.0, "llama": 60.0, "knob": 30.0, "q8": 200.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_hybrid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity (0 = uniform)")
    ap.add_argument("--skews", default=None, help="comma-separated skews, each a file and a set of rows (the "
                                                  "files built in parallel); default --skew alone")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--fractions", default="0,0.25,0.5", help="shares of the routed experts' bytes on the GPU")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cores", default=None, help="comma-separated CPU ids for the CPU experts (default: all)")
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32, help="batch-1 decode steps (the batch rows take a quarter)")
    ap.add_argument("--batch", default="8", help="comma-separated sequence counts of the aggregate decode rows")
    ap.add_argument("--prefill", default="512", help="comma-separated prompt lengths of the prefill rows")
    ap.add_argument("--prefill-chunk", type=int, default=512,
                    help="tokens a prefill step: Strata's prefill_chunk and (other than 512, llama-bench's default "
                         "-ub) llama-bench's -b and -ub")
    ap.add_argument("--model-dir", default="/tmp/strata-bench")
    ap.add_argument("--experts", default="q4_k", choices=("q4_k", "q8_0"),
                    help="the routed experts' type (q8_0: ~32 GB at the Qwen3-30B-A3B shape)")
    ap.add_argument("--budget-gb", type=float, default=None,
                    help="one row at this gpu_budget_gb (GiB) instead of --fractions; llama.cpp's -ncmoe from the "
                         "fraction of the routed experts it leaves")
    ap.add_argument("--q8-budget-gb", type=float, default=None,
                    help="after the Q4_K rows: the Q8_0 file (~32 GB; the Q4_K files are deleted first, for the "
                         "disk) at this budget, batch 1 and prefill, Strata and llama.cpp, if the deadline allows")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME:VAR=VAL[,VAR=VAL]",
                    help="an extra Strata row (the first skew, the first fraction) under these environment "
                         "variables, e.g. nooverlap:STRATA_GPU_HYBRID_OVERLAP=0 (an A/B in the same call)")
    ap.add_argument("--knob-every", action="store_true",
                    help="each --knob row at every skew and fraction, right after that skew and fraction's own row "
                         "(e.g. nooverlap:STRATA_GPU_HYBRID_OVERLAP=0 --strata-only: an A/B across the table)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="skip rows that would end after this many seconds from the start (a device call's limit)")
    ap.add_argument("--llama-bin", default=None, help="llama.cpp's llama-bench / llama-batched-bench (CUDA build)")
    ap.add_argument("--llama-timeout", type=float, default=300.0)
    ap.add_argument("--llama-extra-layers", type=int, default=0,
                    help="llama.cpp keeps this many more layers' experts on the GPU than the fraction says (its "
                         "VRAM up to Strata's, whose fixed parts hold the staging ring; with --llama-only)")
    ap.add_argument("--llama-reps", type=int, default=2, help="llama-bench repetitions")
    ap.add_argument("--strata-only", action="store_true")
    ap.add_argument("--llama-only", action="store_true", help="llama.cpp's rows alone (a device call of its own)")
    ap.add_argument("--build-only", action="store_true", help="write the model file and stop (the Q8_0 file takes "
                                                                "minutes: a device call of its own)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    knobs = parse_knobs(args.knob)
    skews = parse_floats(args.skews) if args.skews is not None else [args.skew]
    if args.build_only:  # one skew here; several side by side (build_models: a process each)
        paths = [_model(args, skews[0])] if len(skews) == 1 else build_models(args, skews, args.experts)
        for path in paths:
            print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB", flush=True)
        return 0
    dl = Deadline(args.deadline_s)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps({"skews": skews, "rows": rows, "skipped": skipped}, indent=1))

    def row(label: str, path: Path, frac: float, kind: str, budget: float | None = None,
            batches: list[int] | None = None, env: dict[str, str] | None = None, llama: bool = True) -> None:
        if not dl.fits(kind, GUESS_S[kind]):
            skipped.append(f"{label} F={frac:g} ({kind}: {dl.left():.0f} s left)")
            print(f"{label} F={frac:g}: skipped, {dl.left():.0f} s left before the deadline", flush=True)
            return
        t = time.monotonic()
        r: dict[str, Any] = {"label": label, "model": str(path), "fraction": frac, "strata": {}}
        if not args.llama_only:
            try:
                with _Env(env or {}):
                    r["strata"] = run_strata(path, frac, args, budget, batches)
            except Exception as e:  # a failed row is reported, the others still run
                r["strata"] = {"error": f"{type(e).__name__}: {e}"}
        dl.took(kind, time.monotonic() - t)
        if llama and args.llama_bin and not args.strata_only:
            t1 = time.monotonic()
            if dl.fits("llama", GUESS_S["llama"]):
                try:
                    r["llama"] = run_llama(Path(args.llama_bin), path, frac, args, batches,
                                           timeout_s=min(args.llama_timeout, max(30.0, dl.left())))
                except (OSError, subprocess.SubprocessError) as e:  # a timeout: the row says so, the rest run
                    r["llama"] = {"fraction": frac, "placement": " ".join(llama_placement(frac, args.layers, args.llama_extra_layers)),
                                  "error": f"{type(e).__name__}: {e}"}
                dl.took("llama", time.monotonic() - t1)
            else:
                skipped.append(f"{label} F={frac:g} (llama.cpp: {dl.left():.0f} s left)")
        rows.append(r)
        print_row(r, args)
        save()

    fracs = parse_floats(args.fractions)
    paths = build_models(args, skews, args.experts)
    print(f"models ready after {time.monotonic() - dl.t0:.0f} s: {', '.join(p.name for p in paths)}", flush=True)
    for sk, path in zip(skews, paths, strict=True):
        if args.budget_gb is not None:
            row(f"skew {sk:g}", path, fraction_for_budget(path, args.budget_gb, args.kv_tokens, 16, 512), "strata",
                budget=args.budget_gb)
        else:
            for frac in fracs:
                row(f"skew {sk:g}", path, frac, "strata")
                for name, env in knobs if args.knob_every else []:
                    row(f"skew {sk:g} [{name}]", path, frac, "knob", env=env, llama=False)
    for name, env in [] if args.knob_every else knobs:  # the A/B rows after the table: the first skew and fraction
        row(f"skew {skews[0]:g} [{name}]", paths[0], fracs[0], "knob", env=env, llama=False)
    if args.q8_budget_gb is not None:
        if not dl.fits("q8", GUESS_S["q8"]):
            skipped.append(f"Q8_0 at {args.q8_budget_gb:g} GiB ({dl.left():.0f} s left)")
            print(f"Q8_0 at {args.q8_budget_gb:g} GiB: skipped, {dl.left():.0f} s left", flush=True)
        else:
            for p in paths:  # the disk holds the Q8_0 file or the Q4_K ones
                if args.experts == "q4_k":
                    p.unlink(missing_ok=True)
            t = time.monotonic()
            q8 = build_models(args, skews[:1], "q8_0")[0]
            print(f"Q8_0 file built in {time.monotonic() - t:.0f} s", flush=True)
            frac = fraction_for_budget(q8, args.q8_budget_gb, args.kv_tokens, 16, 512)
            row(f"Q8_0 skew {skews[0]:g} at {args.q8_budget_gb:g} GiB", q8, frac, "strata", budget=args.q8_budget_gb,
                batches=[])
    print(f"done in {time.monotonic() - dl.t0:.0f} s" + (f"; skipped: {'; '.join(skipped)}" if skipped else ""),
          flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
