"""Continuous batching on the CPU engine: aggregate decode throughput at 1/4/16/32
concurrent sequences, and the time to first token of a short request that arrives
while a long prompt is being prefilled.

    python -m bench.engine_batching [--quick] [--model PATH] [--threads N] [--json OUT]

Ratios are against Strata's own single-stream figure and against llama.cpp decoding the
same number of sequences in one `llama_decode` batch (its low-level C API through
llama-cpp-python), both measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine_info, text_table, write_json
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig


def decode_throughput(eng: Engine, n_seqs: int, n_tokens: int, budget: int) -> dict[str, float]:
    """Aggregate decode tok/s over steps that carry only decode tokens, with the median step, the
    median time per step outside the C forward call (scheduler, sampler, detokenizer) and the
    median share of the pool's thread time spent waiting inside the step."""
    rng = np.random.default_rng(n_seqs)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=max(n_seqs, 1), max_batch_tokens=budget, prefix_cache=False))
    params = SamplingParams.parse(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    for _ in range(n_seqs):
        sched.add(list(rng.integers(100, eng.hparams.n_vocab - 100, size=32)), params)
    decode_time = 0.0
    decoded = 0
    step_times: list[float] = []
    outside: list[float] = []
    idle: list[float] = []
    while sched.has_work():
        t0 = time.perf_counter()
        sched.step()
        dt = time.perf_counter() - t0
        rep = sched.last_report
        if rep is not None and rep.n_prefill == 0 and rep.n_decode:
            decode_time += dt
            decoded += rep.n_decode
            step_times.append(dt)
            st = eng.last_stats
            if st is not None:
                outside.append(dt - st.t_total)
                idle.append(st.pool_idle_share)
    return {"tok_s": decoded / decode_time if decode_time else 0.0,
            "step_ms_median": 1e3 * statistics.median(step_times) if step_times else 0.0,
            "outside_c_ms_median": 1e3 * statistics.median(outside) if outside else 0.0,
            "pool_idle_median": statistics.median(idle) if idle else 0.0}


def llama_decode_throughput(path: Path, n_seqs: int, n_tokens: int, threads: int) -> float:
    """llama.cpp: n_seqs sequences of 32 random prompt tokens, then n_tokens greedy steps
    with one token of every sequence per llama_decode call; aggregate decode tok/s."""
    import ctypes

    import llama_cpp as lc

    noop = lc.llama_log_callback(lambda level, text, user: None)
    lc.llama_log_set(noop, ctypes.c_void_p(0))
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = max(n_seqs, 1) * (32 + n_tokens + 16), 512, 512
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = n_seqs, threads, threads
    ctx = lc.llama_init_from_model(model, cp)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(512, 0, n_seqs)

    def add(tok: int, pos: int, seq: int, logits: bool) -> None:
        i = batch.n_tokens
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
        batch.seq_id[i][0] = seq
        batch.n_tokens += 1

    def argmax(i: int) -> int:
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), (n_vocab,)).argmax())

    try:
        rng = np.random.default_rng(n_seqs)
        last = []
        for s in range(n_seqs):  # prompts one sequence per call (untimed)
            batch.n_tokens = 0
            for j, t in enumerate(rng.integers(100, n_vocab - 100, size=32)):
                add(int(t), j, s, j == 31)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed on a prompt")
            last.append(argmax(31))
        t0 = time.perf_counter()
        for k in range(n_tokens):
            batch.n_tokens = 0
            for s in range(n_seqs):
                add(last[s], 32 + k, s, True)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed on a decode step")
            last = [argmax(s) for s in range(n_seqs)]
        return n_seqs * n_tokens / (time.perf_counter() - t0)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def ttft_during_long_prefill(eng: Engine, long_tokens: int, progress: float, budget: int) -> dict[str, float]:
    """TTFT of a 24-token request submitted once a long prompt is `progress` prefilled."""
    rng = np.random.default_rng(7)
    vocab = eng.hparams.n_vocab
    sched = Scheduler(eng, SchedulerConfig(max_batch_tokens=budget, prefix_cache=False))
    long_id = sched.add(list(rng.integers(100, vocab - 100, size=long_tokens)),
                        SamplingParams.parse(temperature=0.0, max_tokens=4, ignore_eos=True))
    step_times: list[float] = []
    while True:  # prefill the long prompt up to `progress`
        t0 = time.perf_counter()
        sched.step()
        step_times.append(time.perf_counter() - t0)
        req = next((r for r in sched.running if r.request_id == long_id), None)
        if req is None or req.n_computed >= progress * long_tokens:
            break
    short_id = sched.add(list(rng.integers(100, vocab - 100, size=24)),
                         SamplingParams.parse(temperature=0.0, max_tokens=1, ignore_eos=True))
    t_submit = time.perf_counter()
    steps = 0
    ttft = None
    while ttft is None and steps < 100:
        t0 = time.perf_counter()
        outs = sched.step()
        step_times.append(time.perf_counter() - t0)
        steps += 1
        if any(o.request_id == short_id and o.token_ids for o in outs):
            ttft = time.perf_counter() - t_submit
    sched.abort(long_id)
    sched.run_to_completion()
    recent = statistics.median(step_times[-8:])
    return {"ttft_s": ttft or float("nan"), "steps": float(steps), "step_s_median": recent,
            "ttft_in_steps": (ttft or float("nan")) / recent}


def run(args: argparse.Namespace) -> dict[str, Any]:
    path = args.model
    if path is None:
        from engine.default_model import build_default_model, default_model_path

        path = build_default_model(default_model_path())
    threads = args.threads or len(os.sched_getaffinity(0))
    long_tokens = args.long_tokens or (4000 if args.quick else 16000)
    kv = max(long_tokens + 512, 8192)
    eng = Engine.open(path, threads=threads, kv_tokens=kv, max_model_len=kv)
    n_tokens = 16 if args.quick else 64
    results: dict[str, Any] = {"model": str(path), "threads": threads, "decode": {}, "machine": machine_info()}
    try:
        for c in (1, 4, 16, 32):
            r = decode_throughput(eng, c, n_tokens, args.budget)
            if not args.no_llama:
                r["llama_tok_s"] = llama_decode_throughput(Path(path), c, n_tokens, threads)
            results["decode"][c] = r
            print(f"  {c:>2} sequences: {r['tok_s']:.1f} tok/s aggregate"
                  + (f" (llama.cpp {r['llama_tok_s']:.1f})" if "llama_tok_s" in r else ""), file=sys.stderr)
        results["ttft"] = ttft_during_long_prefill(eng, long_tokens, 0.25, args.budget)
        results["long_tokens"] = long_tokens
    finally:
        eng.close()
    return results


def report(res: dict[str, Any]) -> None:
    base = res["decode"][1]["tok_s"] or 1.0
    rows = [(f"decode, {c} concurrent", f"{r['tok_s']:.1f} tok/s", f"{r['tok_s'] / base:.2f}x single",
             f"{r['step_ms_median']:.1f} ms/step", f"{r['outside_c_ms_median']:.1f} ms",
             f"{100 * r['pool_idle_median']:.0f}%",
             f"{r['llama_tok_s']:.1f} tok/s" if "llama_tok_s" in r else "-",
             f"{r['tok_s'] / r['llama_tok_s']:.2f}x" if r.get("llama_tok_s") else "-")
            for c, r in res["decode"].items()]
    print(text_table(["metric", "Strata", "vs 1 stream", "step", "outside C", "pool idle", "llama.cpp",
                      "Strata / llama.cpp"], rows))
    t = res["ttft"]
    print(f"\nshort request during a {res['long_tokens']}-token prefill: TTFT {t['ttft_s'] * 1e3:.0f} ms "
          f"= {t['ttft_in_steps']:.2f} step-times ({int(t['steps'])} steps; step {t['step_s_median'] * 1e3:.0f} ms)")
    print(f"targets: 16-way >= 5x single -> {res['decode'][16]['tok_s'] / base:.2f}x; TTFT < 3 step-times -> "
          f"{t['ttft_in_steps']:.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.engine_batching", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="16 tokens per sequence, 4k-token long prompt")
    ap.add_argument("--long-tokens", type=int, default=None, help="long prompt length (default 16000)")
    ap.add_argument("--budget", type=int, default=256, help="scheduler tokens per step")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp peer")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    res = run(args)
    report(res)
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
