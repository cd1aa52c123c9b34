"""How long the gateway's event loop stalls while the embedding model loads and while it embeds a document.

    PYTHONPATH=. .venv/bin/python bench/embed_loop_lag.py                     # the current Embedder
    git show d28ff79:gateway/documents/embed.py > /tmp/embed_before.py          # the in-process one, for an A/B
    PYTHONPATH=. .venv/bin/python bench/embed_loop_lag.py --impl /tmp/embed_before.py

A fresh process (nothing imported, the model not loaded: what a starting gateway holds) runs a ticker on its
event loop, asking to wake every 10 ms, beside (1) ``Embedder.warm()`` from its start until the model is
ready, then (2) ``aencode`` of ``--texts`` chunk-sized texts (ingestion). A tick's lag is how late it woke;
the lag is what every request the loop serves meanwhile waits on top of its own work. Reports per phase the
duration, the number of ticks and the lag's p50 / p99 / max, as JSON on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TICK_S = 0.010
CHUNK = ("Section 4.2 of the maintenance handbook: the boiler runs at 2.4 bar; the relief valve is tested every "
         "month and its seal replaced each spring by the duty engineer on the morning shift. ")


def _embedder_class(impl: str | None) -> Any:
    if impl is None:
        from gateway.documents.embed import Embedder

        return Embedder
    spec = importlib.util.spec_from_file_location("embed_impl", impl)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["embed_impl"] = mod
    spec.loader.exec_module(mod)
    return mod.Embedder


async def _ticker(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(TICK_S)
        lags.append(loop.time() - t - TICK_S)


def _stats(name: str, seconds: float, lags: list[float]) -> dict[str, Any]:
    a = np.array(lags or [0.0]) * 1000
    return {"phase": name, "seconds": round(seconds, 2), "ticks": len(lags),
            "lag_p50_ms": round(float(np.percentile(a, 50)), 2), "lag_p99_ms": round(float(np.percentile(a, 99)), 2),
            "lag_max_ms": round(float(a.max()), 1)}


async def _phase(name: str, work: Any) -> dict[str, Any]:
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(_ticker(lags, stop))
    await asyncio.sleep(0.2)  # the ticker's own baseline before the work starts
    del lags[:]
    t0 = time.monotonic()
    await work
    seconds = time.monotonic() - t0
    stop.set()
    await tick
    return _stats(name, seconds, lags)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    cls = _embedder_class(args.impl)
    emb = cls()  # reads the tokenizer only, like a gateway's start
    out: dict[str, Any] = {"impl": args.impl or "gateway.documents.embed", "backend": emb.backend,
                           "load": os.getloadavg()[0], "phases": []}
    out["phases"].append(await _phase("model load", emb.warm()))
    texts = [f"{i}. {CHUNK * 4}" for i in range(args.texts)]
    out["phases"].append(await _phase(f"embed {args.texts} chunks", emb.aencode(texts)))
    out["load_after"] = os.getloadavg()[0]
    emb.close()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", help="an embed.py to import the Embedder from instead of the installed one")
    p.add_argument("--texts", type=int, default=96, help="chunks embedded in the ingestion phase (default 96)")
    print(json.dumps(asyncio.run(main(p.parse_args()))), flush=True)
