"""long_prefill: TTFT against prompt length up to the window, then a short request sent while a
window-long prompt is being prefilled: its TTFT beside the same short request on an idle server.
Against the gateway the short request is also sent straight to the lane serving the long one, so
both the dispatcher's answer (another lane) and the lane's own (chunked prefill) are measured."""

from __future__ import annotations

import asyncio

from bench.harness.client import ChatResult
from bench.harness.context import Context, unique_prefix
from bench.harness.plots import lines
from bench.harness.prompts import chat, prompt_of_length
from bench.harness.result import ScenarioResult, median

NAME = "long_prefill"
CORRECTNESS = False
KINDS = ("gateway", "lane")
SHORT = "What is 2 + 2?"


async def run(ctx: Context, res: ScenarioResult) -> None:
    t = ctx.target
    n_ctx = t.n_ctx or 2048
    top = n_ctx - 64
    lengths = [x for x in ctx.q([256], [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]) if x < top] + [top]
    bar = ctx.bar(len(lengths) + ctx.q(4, 11), "long_prefill")
    xs, ys, rows = [], [], []
    prompts = {}
    for length in lengths:
        text, measured = await prompt_of_length(t, length, seed=7 + length)
        prompts[length] = (text, measured)
        r = await t.chat(chat(unique_prefix() + text), max_tokens=2)
        bar.update(1)
        if not r.ok or r.ttft_s is None:
            res.notes.append(f"{measured} tokens: {r.error}")
            continue
        xs.append(float(r.prompt_tokens or measured))
        ys.append(r.ttft_s)
        rows.append([r.prompt_tokens or measured, f"{r.ttft_s:.3f}", f"{(r.prompt_tokens or measured) / r.ttft_s:,.0f}",
                     r.lane or "-"])
        tag = "max" if length == top else str(length)
        res.metric(f"ttft_s@{tag}", r.ttft_s, "s", "lower")
    res.table("TTFT against prompt length (one request at a time)", ["prompt tokens", "TTFT s", "prefill tok/s",
                                                                     "lane"], rows)

    # a short request alone, then during a window-long prefill
    idle = []
    for _ in range(ctx.q(2, 5)):
        r = await t.chat(chat(unique_prefix() + SHORT), max_tokens=4)
        bar.update(1)
        if r.ok and r.ttft_s is not None:
            idle.append(r.ttft_s)
    text, measured = prompts[top]

    async def interfere(url: str | None) -> tuple[ChatResult, ChatResult]:
        long_task = asyncio.create_task(t.chat(chat(unique_prefix() + text), max_tokens=2, url=url))
        await asyncio.sleep(0.3)  # the long prompt is admitted and prefilling
        short = await t.chat(chat(unique_prefix() + SHORT), max_tokens=4, url=url)
        return await long_task, short

    cases: list[tuple[str, str | None]] = [(f"both through the {t.kind}", None)]
    if t.kind == "gateway" and t.lane_urls:
        cases.append((f"both straight to one lane ({t.lane_urls[0]})", t.lane_urls[0]))
    during: dict[str, list[float]] = {}
    lanes_seen: dict[str, list[str]] = {}
    for label, url in cases:
        for _ in range(ctx.q(1, 3)):
            long_r, short = await interfere(url)
            bar.update(1)
            if short.ok and short.ttft_s is not None:
                during.setdefault(label, []).append(short.ttft_s)
                lanes_seen.setdefault(label, []).append(f"{long_r.lane or 'same'}/{short.lane or 'same'}")
    bar.close()
    idle_med = median(idle)
    irows = [["alone", len(idle), f"{idle_med:.3f}" if idle_med else "-", "-"]]
    for label, vals in during.items():
        m = median(vals)
        irows.append([f"during a {measured}-token prefill, {label}", len(vals), f"{m:.3f}" if m else "-",
                      ", ".join(lanes_seen.get(label, [])) or "-"])
        key = "one_lane" if "straight" in label else "target"
        res.metric(f"short_ttft_during_long_s:{key}", m, "s", "lower")
    res.metric("short_ttft_idle_s", idle_med, "s", "lower")
    res.table("A short request during a long prefill (TTFT of the short one)",
              ["case", "samples", "TTFT s (median)", "lanes long/short"], irows)
    res.data.update(ttft=list(zip(xs, ys, strict=True)), idle=idle, during=during)
    res.plots.append(lines(ctx.out / "long_prefill.png", "TTFT against prompt length", "prompt tokens",
                           [("TTFT s", {t.label: (xs, ys)})]))  # type: ignore[dict-item]
