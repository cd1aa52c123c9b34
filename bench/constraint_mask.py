"""Per-token grammar mask time on the default model's vocabulary: llguidance vs outlines-core.

    .venv/bin/python -m bench.constraint_mask [--model var/models/smollm2-135m-moe8.gguf]

Walks one fixed valid JSON document for a nested schema through each library token by token
(the same token ids), timing the mask of every step, and the one-off compile time. xgrammar
is not measured: its wheel requires torch (CUDA build by default), transformers and triton.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from common.tokenizer import Tokenizer
from engine.constraints import GrammarCompiler, apply_mask, json_schema_grammar, mask_words

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOC = '{"name":"Ada Lovelace","age":36,"tags":["a","c"],"address":{"city":"London","zip":"W1"}}'


def bench_llguidance(tok: Tokenizer, ids: list[int]) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    comp = GrammarCompiler.for_tokenizer(tok)
    t_vocab = time.perf_counter() - t0
    t0 = time.perf_counter()
    c = comp.matcher(json_schema_grammar(SCHEMA))
    t_compile = time.perf_counter() - t0
    buf = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        c.fill(buf)
        times.append(time.perf_counter() - t0)
        assert buf[t // 32] >> (t % 32) & 1, f"token {t} masked out"
        assert c.consume(t)
    print(f"llguidance: vocabulary {t_vocab * 1e3:.0f} ms, grammar {t_compile * 1e3:.1f} ms")
    return t_compile, times


def bench_outlines(tok: Tokenizer, ids: list[int]) -> tuple[float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = min(tok.eot_ids)
    m: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i in tok.eot_ids:
            continue
        b = tok.token_bytes(i)
        if b:
            m.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, m)
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    t_compile = time.perf_counter() - t0
    g = Guide(index)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        allowed = g.get_tokens()
        times.append(time.perf_counter() - t0)
        assert t in allowed
        g.advance(t)
    print(f"outlines-core: index {t_compile * 1e3:.0f} ms")
    return t_compile, times


def batch_cost(tok: Tokenizer, ids: list[int], rows: int = 16) -> None:
    """What the scheduler adds per step for ``rows`` constrained sequences: fill every mask (done
    in the mask thread while the C step runs) and apply them to the logits (on the loop thread)."""
    comp = GrammarCompiler.for_tokenizer(tok)
    g = json_schema_grammar(SCHEMA)
    cons = [comp.matcher(g) for _ in range(rows)]
    bits = np.zeros((rows, mask_words(tok.vocab_size)), dtype=np.int32)
    logits = np.random.default_rng(0).standard_normal((rows, tok.vocab_size)).astype(np.float32)
    fill_t, apply_t = [], []
    for t in ids:
        t0 = time.perf_counter()
        for k, c in enumerate(cons):
            c.fill(bits[k])
        t1 = time.perf_counter()
        for k in range(rows):
            apply_mask(logits[k], bits[k])
        t2 = time.perf_counter()
        fill_t.append(t1 - t0)
        apply_t.append(t2 - t1)
        for c in cons:
            assert c.consume(t)
    print(f"{rows} constrained rows per step: fill median {statistics.median(fill_t) * 1e3:.2f} ms "
          f"(max {max(fill_t) * 1e3:.2f}), apply median {statistics.median(apply_t) * 1e3:.2f} ms "
          f"(max {max(apply_t) * 1e3:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="var/models/smollm2-135m-moe8.gguf")
    a = ap.parse_args()
    tok = Tokenizer.from_gguf(a.model)
    ids = tok.encode(DOC, add_special=False)
    print(f"vocabulary {tok.vocab_size} tokens; document {len(ids)} tokens")
    for name, fn in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines)):
        comp, times = fn(tok, ids)
        us = [x * 1e6 for x in times]
        print(f"{name:14s} compile {comp * 1e3:8.1f} ms  mask/token median {statistics.median(us):8.1f} us  "
              f"p90 {sorted(us)[int(0.9 * len(us))]:8.1f} us  max {max(us):8.1f} us")
    batch_cost(tok, ids)


if __name__ == "__main__":
    main()
