"""Decode throughput with and without a JSON-schema constraint, in one run (issue 15).

    PYTHONPATH=. .venv/bin/python -m bench.constraint_overhead [--threads 2] [--max-tokens 64]
        [--rounds 5] [--json var/bench/constraint_overhead.json]

For 1 and 16 concurrent sequences of the default model: aggregate decode tok/s of greedy requests
without a grammar and under a JSON schema (an array of records: keys, enums, bounded integers,
short strings, so both restrictive and open masks), target constrained >= 0.90 x unconstrained.

Made to hold on a shared, noisy machine:

* equal work: the schema asks for more records than ``max_tokens`` can hold and the free run
  ignores EOS, so every sequence of both modes generates exactly ``max_tokens`` tokens (checked);
* only decode steps that run all n sequences are timed (no prefill, no shrinking batch);
* rounds interleave the modes in ABBA order (free, json, json, free, ...) so a load change hits
  both alike; each round's constrained rate is divided by its own unconstrained rate and the
  median of those paired ratios is the headline, beside the ratio of the median per-step times;
* the load average before and after is printed (and written with ``--json``);
* beside the end-to-end rates, the grammar work on each constrained step's critical path is
  timed inside that step (see :func:`run_batch`): its share of the step does not depend on how
  loaded the machine is, and ``1 - share`` is the ratio the grammar alone can cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.constraints import GrammarCompiler, json_schema_grammar
from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

RECORD = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "colour": {"enum": ["red", "green", "blue", "black"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
          "required": ["name", "age", "colour", "tags"], "additionalProperties": False}
# more records than any max_tokens here can hold: the answer never completes, so every sequence runs max_tokens
SCHEMA = {"type": "array", "items": RECORD, "minItems": 500}
TOPICS = ["the sea", "mountains", "a robot", "coffee", "rain", "a city", "an old book", "the moon",
          "a garden", "winter", "a train", "music", "a cat", "the desert", "a river", "friendship"]


class _Timed:
    """Wall time spent inside wrapped callables (the grammar work on the step's critical path)."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent += time.perf_counter() - t0
        return timed


def run_batch(engine: Engine, n: int, params: SamplingParams) -> tuple[list[float], list[dict[str, float]]]:
    """(times of the decode steps that ran all n sequences, the grammar work inside each of them);
    every sequence must run max_tokens.

    The grammar work on the critical path is what the loop thread does for the masks: submitting
    them, waiting for the mask thread and writing -inf (``_start_masks``, ``_apply_masks``) and
    advancing each matcher (``Constraint.consume``); the mask computation itself runs in the mask
    thread during the C step."""
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=64, max_batch_tokens=4096, prefix_cache=False))
    rids = [sched.add(engine.render_chat([{"role": "user", "content": f"List people who like {t}, as JSON."}]),
                      params) for t in TOPICS[:n]]
    parts = {"start": _Timed(), "wait_apply": _Timed(), "consume": _Timed()}
    forward = _Timed()  # the C step alone (does the mask thread slow it down?)
    engine.forward = forward.wrap(Engine.forward.__get__(engine))  # type: ignore[method-assign]
    sched._start_masks = parts["start"].wrap(sched._start_masks)  # type: ignore[method-assign]
    sched._apply_masks = parts["wait_apply"].wrap(sched._apply_masks)  # type: ignore[method-assign]
    for r in [*sched._inbox, *sched.waiting]:  # queued by add(), admitted at the first step
        if r.constraint is not None:
            r.constraint.consume = parts["consume"].wrap(r.constraint.consume)  # type: ignore[method-assign]
    times: list[float] = []
    overhead: list[dict[str, float]] = []
    produced: dict[str, int] = {}
    while sched.has_work():
        full = len(sched.running) == n and all(r.n_output > 0 for r in sched.running)
        before = {k: p.spent for k, p in parts.items()}
        before_fwd = forward.spent
        t0 = time.perf_counter()
        out = sched.step()
        dt = time.perf_counter() - t0
        if full and len(out) == n and all(not o.finished for o in out):
            times.append(dt)
            overhead.append({k: p.spent - before[k] for k, p in parts.items()} | {"forward": forward.spent - before_fwd})
        for o in out:
            if o.finished:
                produced[o.request_id] = o.completion_tokens
                if o.finish_reason != "length":
                    raise RuntimeError(f"{o.request_id} ended with {o.finish_reason!r} before max_tokens")
    if sorted(produced) != sorted(rids) or set(produced.values()) != {params.max_tokens}:
        raise RuntimeError(f"unequal work: {produced}")
    del engine.forward  # back to the class's method
    return times, overhead


def _machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu or platform.processor(), "nproc": os.cpu_count(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="ABBA-interleaved rounds per concurrency")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--json", type=Path, help="write the raw step times, ratios and machine info here")
    a = ap.parse_args()
    report: dict[str, Any] = {"machine": _machine(), "load_before": os.getloadavg(), "threads": a.threads,
                              "max_tokens": a.max_tokens, "rounds": a.rounds, "schema": SCHEMA, "rows": []}
    print(f"load average before: {' '.join(f'{x:.2f}' for x in report['load_before'])}", flush=True)
    with Engine.open(build_default_model(default_model_path()), threads=a.threads, kv_tokens=8192) as engine:
        GrammarCompiler.for_tokenizer(engine.tokenizer)  # the one-off vocabulary build, outside the timing
        modes = {"free": SamplingParams.parse(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True),
                 "json": SamplingParams.parse(temperature=0.0, max_tokens=a.max_tokens,
                                              grammar=json_schema_grammar(SCHEMA))}
        for n in a.concurrency:
            run_batch(engine, n, modes["free"])  # warm-up (page cache, thread pool, mask thread)
            steps: dict[str, list[float]] = {"free": [], "json": []}
            rates: dict[str, list[float]] = {"free": [], "json": []}
            grammar_parts: list[dict[str, float]] = []
            forward_parts: dict[str, list[dict[str, float]]] = {"free": [], "json": []}
            for r in range(a.rounds):
                for mode in (("free", "json") if r % 2 == 0 else ("json", "free")):
                    t, g = run_batch(engine, n, modes[mode])
                    steps[mode] += t
                    rates[mode].append(n * len(t) / sum(t))
                    forward_parts[mode] += g
                    if mode == "json":
                        grammar_parts += g
            paired = [j / f for j, f in zip(rates["json"], rates["free"], strict=True)]
            med = {m: statistics.median(steps[m]) for m in steps}
            p10 = {m: sorted(steps[m])[len(steps[m]) // 10] for m in steps}
            # the grammar's share of each constrained step: a ratio inside the same step, so load
            # from other jobs inflates both parts alike
            grammar_s = [sum(v for k, v in g.items() if k != "forward") for g in grammar_parts]
            fwd = {m: statistics.median(x["forward"] for x in forward_parts[m]) for m in forward_parts}
            share = statistics.median(g / t for g, t in zip(grammar_s, steps["json"], strict=True))
            by_part = {k: statistics.median(g[k] for g in grammar_parts) for k in grammar_parts[0] if k != "forward"}
            row = {"n": n, "rates": rates, "paired_ratios": paired, "median_paired_ratio": statistics.median(paired),
                   "median_step_s": med, "p10_step_s": p10, "step_ratio": med["free"] / med["json"],
                   "p10_step_ratio": p10["free"] / p10["json"], "grammar_share_median": share,
                   "grammar_s_median": statistics.median(grammar_s), "grammar_s_median_by_part": by_part,
                   "forward_s_median": fwd,
                   "steps": steps, "grammar_parts": grammar_parts}
            report["rows"].append(row)
            print(f"{n:2d} sequences: unconstrained {statistics.median(rates['free']):7.1f} tok/s, "
                  f"json-schema {statistics.median(rates['json']):7.1f} tok/s (medians of {a.rounds} rounds); "
                  f"paired ratio median {row['median_paired_ratio']:.3f} "
                  f"[{min(paired):.3f}..{max(paired):.3f}]; step median {med['free'] * 1e3:.1f} vs "
                  f"{med['json'] * 1e3:.1f} ms -> {row['step_ratio']:.3f}, fastest decile {p10['free'] * 1e3:.1f} "
                  f"vs {p10['json'] * 1e3:.1f} ms -> {row['p10_step_ratio']:.3f}; grammar work on the critical path "
                  f"{row['grammar_s_median'] * 1e3:.2f} ms/step ("
                  + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in by_part.items())
                  + f") = {share * 100:.2f}% of the step (-> ratio {1 - share:.3f}); C step alone median "
                  f"{fwd['free'] * 1e3:.1f} vs {fwd['json'] * 1e3:.1f} ms", flush=True)
    report["load_after"] = os.getloadavg()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in report['load_after'])}", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
