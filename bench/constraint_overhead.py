"""Decode throughput with and without a JSON-schema constraint, in one run (issue 15).

    .venv/bin/python -m bench.constraint_overhead [--threads 2] [--max-tokens 64] [--rounds 2]

For 1 and 16 concurrent sequences of the default model: aggregate decode tok/s of greedy
requests without a grammar (ignore_eos, so every one runs max_tokens) and with a JSON schema
(open-ended strings; only steps that decode all n sequences are timed). The
ratio constrained / unconstrained is printed per concurrency; the target is >= 0.90. Rounds
alternate the two modes so machine load affects both alike; the best round of each is kept.
"""

from __future__ import annotations

import argparse
import time

from engine.constraints import GrammarCompiler, json_schema_grammar
from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"}, "lines": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "lines"], "additionalProperties": False}
TOPICS = ["the sea", "mountains", "a robot", "coffee", "rain", "a city", "an old book", "the moon",
          "a garden", "winter", "a train", "music", "a cat", "the desert", "a river", "friendship"]


def decode_rate(engine: Engine, n: int, params: SamplingParams) -> float:
    """Aggregate tok/s over the decode steps that ran all n sequences (a constrained request
    that completes its JSON early would otherwise shrink the batch and the rate with it)."""
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=64, max_batch_tokens=4096, prefix_cache=False))
    for t in TOPICS[:n]:
        sched.add(engine.render_chat([{"role": "user", "content": f"Write a poem about {t} as JSON."}]), params)
    tokens, spent = 0, 0.0
    while sched.has_work():
        full = len(sched.running) == n and all(r.n_output > 0 for r in sched.running)
        t0 = time.perf_counter()
        out = sched.step()
        if full and len(out) == n and all(not o.finished for o in out):
            spent += time.perf_counter() - t0
            tokens += n
    return tokens / spent if spent else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with Engine.open(build_default_model(default_model_path()), threads=a.threads, kv_tokens=8192) as engine:
        GrammarCompiler.for_tokenizer(engine.tokenizer)  # the one-off vocabulary build, outside the timing
        free = SamplingParams.parse(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
        json_p = SamplingParams.parse(temperature=0.0, max_tokens=a.max_tokens, grammar=json_schema_grammar(SCHEMA))
        for n in (1, 16):
            best = {"free": 0.0, "json": 0.0}
            for _ in range(a.rounds):
                best["free"] = max(best["free"], decode_rate(engine, n, free))
                best["json"] = max(best["json"], decode_rate(engine, n, json_p))
            print(f"{n:2d} sequences: unconstrained {best['free']:7.1f} tok/s  json-schema {best['json']:7.1f} tok/s"
                  f"  ratio {best['json'] / best['free']:.3f}", flush=True)


if __name__ == "__main__":
    main()
