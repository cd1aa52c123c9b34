"""Session memory benchmark: recall of planted facts by distance, and composition time at 10,000 turns.

    .venv/bin/python bench/memory_eval.py                 # both parts, SQLite in a temp dir
    .venv/bin/python bench/memory_eval.py --db-url postgresql+psycopg://...   # on PostgreSQL
    .venv/bin/python bench/memory_eval.py --turns 10000 --queries 100 --json out.json

Recall: for each distance (10, 50, 200 turns) and each of 10 facts, a session holds the fact in its
first exchange, then that many filler turns (varied everyday topics); the question about the fact is
composed for a 2048-token window (budget 2048 - 256 reserved - 16) with the real store, the real
embedding model and the real composition. Recall = the fact's value is in the composed prompt (verbatim
or retrieved). No lane is involved (no summary): this measures what memory hands the lane, not what the
model answers; tests/integration/test_memory.py reports the model's answers on the real stack.

Composition time: one session with ``--turns`` turns and their vectors (random unit vectors by default:
the values do not change the speed; ``--real-vectors`` embeds them all), then ``--queries`` requests
timed from loading the session to the composed messages (summary + recent turns from SQL, the query's
embedding, similarity over all the session's vectors, composition). The first request, which fills the
per-session vector cache, is reported apart. Target: p50 <= 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.documents.embed import get_embedder  # noqa: E402
from memory.config import MemoryConfig  # noqa: E402
from memory.service import MemoryService  # noqa: E402
from memory.store import MemoryStore, open_engine  # noqa: E402

FACTS = [("my locker code", "4417"), ("my cat's name", "Pixel"), ("my favourite city", "Lisbon"),
         ("the project codename", "Marigold"), ("my dentist's name", "Dr Okafor"), ("my bike's colour", "teal"),
         ("the wifi password", "otter-92"), ("my sister's birthday", "March 3"), ("my car's plate", "KX-551"),
         ("the meeting room", "Room 7B")]
TOPICS = ["the weather this weekend", "a pasta recipe with mushrooms", "training for a 10k run", "repairing a "
          "leaking tap", "the history of the printing press", "learning to play the guitar", "planting tomatoes",
          "choosing a laptop for school", "a trip to the mountains", "how tides work", "saving money on groceries",
          "a film about space travel", "painting a bedroom", "the rules of chess", "baking sourdough bread"]
WINDOW, RESERVE = 2048, 256


def filler(rng: random.Random, i: int) -> tuple[str, str]:
    t = rng.choice(TOPICS)
    return (f"Question {i}: could you tell me a little about {t}? I am curious about the details.",
            f"Sure. Here are a few thoughts on {t}: start simple, take notes, and ask if anything is unclear.")


async def recall(svc: MemoryService, distances: list[int], rng: random.Random) -> dict[int, float]:
    out: dict[int, float] = {}
    for d in distances:
        hits = 0
        for what, value in FACTS:
            s = svc.store.create_session(1)
            assert s is not None
            items = [("user", f"Please remember: {what} is {value}.", 12, True),
                     ("assistant", f"Noted: {what} is {value}.", 10, True)]
            for i in range(d // 2):
                q, a = filler(rng, i)
                items += [("user", q, len(q) // 3 + 1, True), ("assistant", a, len(a) // 3 + 1, True)]
            svc.store.append(s.pk, items)
            await svc.embed_missing(s.pk, limit=10_000)
            s = svc.store.get_session(1, s.id)
            assert s is not None
            question = f"What is {what}?"
            loaded = await svc.load(s, question)
            comp = loaded.compose(svc.cfg, None, [{"role": "user", "content": question}], WINDOW - RESERVE - 16)
            if value.lower() in json.dumps(comp.messages).lower():
                hits += 1
        out[d] = hits / len(FACTS)
        print(f"recall at {d:>4} turns: {hits}/{len(FACTS)}", flush=True)
    return out


async def timing(svc: MemoryService, n_turns: int, n_queries: int, real: bool, rng: random.Random) -> dict[str, Any]:
    assert svc.embedder is not None
    s = svc.store.create_session(2)
    assert s is not None
    t0 = time.perf_counter()
    for start in range(0, n_turns, 1000):
        items = []
        for i in range(start, min(n_turns, start + 1000), 2):
            q, a = filler(rng, i)
            items += [("user", q, len(q) // 3 + 1, True), ("assistant", a, len(a) // 3 + 1, True)]
        got = svc.store.append(s.pk, items)
        if real:
            vecs = await svc.embedder.aencode([t.content for t in got])
        else:
            vecs = np.random.default_rng(start).standard_normal((len(got), 384)).astype(np.float32)
            vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        svc.store.put_vectors(s.pk, svc.embedder.version_key, [t.id for t in got], vecs)
    fill_s = time.perf_counter() - t0
    s = svc.store.get_session(2, s.id)
    assert s is not None
    await svc.embedder.aencode(["warm up"])
    times, cpu = [], []
    for k in range(n_queries + 1):
        q = f"What did we say about {rng.choice(TOPICS)} (request {k})?"
        t, c = time.perf_counter(), time.process_time()
        loaded = await svc.load(s, q)
        comp = loaded.compose(svc.cfg, None, [{"role": "user", "content": q}], WINDOW - RESERVE - 16)
        times.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)  # every thread of the process: less sensitive to load
        assert comp.total_turns == n_turns
    first, rest = times[0], sorted(times[1:])
    res = {"turns": n_turns, "queries": n_queries, "fill_s": round(fill_s, 1), "first_ms": round(first, 2),
           "p50_ms": round(statistics.median(rest), 2), "p95_ms": round(rest[int(0.95 * (len(rest) - 1))], 2),
           "max_ms": round(rest[-1], 2), "cpu_p50_ms": round(statistics.median(cpu[1:]), 2),
           "loadavg": os.getloadavg()[0], "retrieved_last": comp.retrieved, "recent_last": comp.recent}
    print(f"composition at {n_turns} turns: p50 {res['p50_ms']} ms, p95 {res['p95_ms']} ms, first (cold cache) "
          f"{res['first_ms']} ms; CPU time p50 {res['cpu_p50_ms']} ms (load average {res['loadavg']:.1f})",
          flush=True)
    return res


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--db-url", help="SQLAlchemy URL (default: SQLite in a temp dir)")
    p.add_argument("--turns", type=int, default=10_000)
    p.add_argument("--queries", type=int, default=50)
    p.add_argument("--distances", default="10,50,200")
    p.add_argument("--real-vectors", action="store_true", help="embed the timing session's turns for real")
    p.add_argument("--skip-recall", action="store_true")
    p.add_argument("--backend", choices=["auto", "onnx", "torch"], default="auto",
                   help="the embedding forward pass (auto: ONNX Runtime when setup exported the model)")
    p.add_argument("--embed-threads", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "int8"], default="fp32",
                    help="int8: the quantised export")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        url = a.db_url or f"sqlite:///{Path(tmp) / 'memory.db'}"
        store = MemoryStore(open_engine(url))
        emb = get_embedder(threads=a.embed_threads, backend=a.backend, precision=a.precision)
        svc = MemoryService(store, MemoryConfig(), emb)
        rng = random.Random(1)
        results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                   "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
                                   "db": url.split(":")[0], "embedding_model": emb.version_key,
                                   "backend": emb.backend, "embed_threads": emb.threads}
        if not a.skip_recall:
            results["recall"] = await recall(svc, [int(x) for x in a.distances.split(",")], rng)
        results["composition"] = await timing(svc, a.turns, a.queries, a.real_vectors, rng)
        store.engine.dispose()
        emb.close()
    print(json.dumps(results, indent=2))
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
