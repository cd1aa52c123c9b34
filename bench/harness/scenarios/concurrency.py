"""concurrency: waves of N simultaneous streams (1, 2, 4, 8, 16, 32; quick: 1, 2, 4, 8): aggregate
generated tok/s, TTFT and inter-token latency p50/p99, on the target and each peer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.harness.client import ChatResult, Target
from bench.harness.context import Context, unique_prefix
from bench.harness.plots import lines
from bench.harness.prompts import chat
from bench.harness.result import ScenarioResult, percentile

NAME = "concurrency"
CORRECTNESS = False
KINDS = ("gateway", "lane", "llama")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def run(ctx: Context, res: ScenarioResult) -> None:
    levels = ctx.q([1, 2, 4, 8], [1, 2, 4, 8, 16, 32])
    gen = ctx.q(16, 64)
    waves = ctx.q(1, 2)
    rows = []
    plot: dict[str, dict[str, tuple[list[float], list[float]]]] = {"tok/s": {}, "TTFT p50 s": {}, "ITL p99 ms": {}}
    targets = [ctx.target, *ctx.peers]
    bar = ctx.bar(len(targets) * sum(levels) * waves, "concurrency")
    for t in targets:
        xs: list[float] = []
        tput: list[float | None] = []
        ttft50: list[float | None] = []
        itl99: list[float | None] = []
        for n in levels:
            results: list[ChatResult] = []
            t0 = time.monotonic()
            for _ in range(waves):
                results += await asyncio.gather(*(_one(t, gen, bar) for _ in range(n)))
            wall = time.monotonic() - t0
            ok = [r for r in results if r.ok]
            failed = len(results) - len(ok)
            if failed:
                res.notes.append(f"{t.label} at {n}: {failed} failed, e.g. {next(r.error for r in results if not r.ok)}")
            toks = sum(r.completion_tokens or 0 for r in ok)
            ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
            itls = [x for r in ok for x in r.itl_s]
            agg = toks / wall if wall > 0 else None
            p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
            i50, i99 = percentile(itls, 50), percentile(itls, 99)
            rows.append([t.label, n, len(results), failed, f"{agg:.1f}" if agg else "-",
                         _f(p50, 3), _f(p99, 3), _f(i50 and i50 * 1000, 1), _f(i99 and i99 * 1000, 1)])
            res.metric(f"{t.label}:tok_s@{n}", agg, "tok/s", "higher")
            res.metric(f"{t.label}:ttft_p50_s@{n}", p50, "s", "lower")
            res.metric(f"{t.label}:ttft_p99_s@{n}", p99, "s", "lower")
            res.metric(f"{t.label}:itl_p99_ms@{n}", i99 and i99 * 1000, "ms", "lower")
            res.metric(f"{t.label}:failed@{n}", failed, "", "lower")
            xs.append(n)
            tput.append(agg)
            ttft50.append(p50)
            itl99.append(i99 and i99 * 1000)
        plot["tok/s"][t.label] = (xs, tput)  # type: ignore[assignment]
        plot["TTFT p50 s"][t.label] = (xs, ttft50)  # type: ignore[assignment]
        plot["ITL p99 ms"][t.label] = (xs, itl99)  # type: ignore[assignment]
    bar.close()
    res.table(f"Concurrent streams ({gen} tokens each, ignore_eos, {waves} wave(s) per level)",
              ["target", "streams", "requests", "failed", "aggregate tok/s", "TTFT p50 s", "TTFT p99 s",
               "ITL p50 ms", "ITL p99 ms"], rows)
    res.data["plot"] = plot
    res.plots.append(lines(ctx.out / "concurrency.png", "Throughput and latency vs concurrency", "concurrent streams",
                           list(plot.items()), logx=True))


async def _one(t: Target, gen: int, bar: Any) -> ChatResult:
    r = await t.chat(chat(unique_prefix() + PROMPT), max_tokens=gen, ignore_eos=True)
    bar.update(1)
    return r


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
