"""soak: mixed load for a while (10 minutes; quick: 60 s): short and medium prompts, streamed and
not. Reported: error rate, latency p99 of the first and last thirds (drift), and the slope of every
process's resident memory (from /proc) and of each lane's KV usage (its /metrics), sampled
throughout. Pass/fail thresholds are printed beside each figure."""

from __future__ import annotations

import asyncio
import time

from bench.harness.client import ChatResult
from bench.harness.context import Context, closed_loop, sleep_until, unique_prefix
from bench.harness.haystack import filler_sentences
from bench.harness.plots import timeline
from bench.harness.procs import process_pids, rss_mb
from bench.harness.result import ScenarioResult, percentile, slope

NAME = "soak"
CORRECTNESS = True
KINDS = ("gateway", "lane")
MAX_ERROR_RATE = 0.01
MEDIUM = " ".join(filler_sentences(40, 3)) + "\n\nWhich sentence above is the longest?"


async def run(ctx: Context, res: ScenarioResult) -> None:
    t = ctx.target
    duration = ctx.soak_s or ctx.q(60.0, 600.0)
    workers = ctx.q(3, 6)
    interval = ctx.q(2.0, 5.0)
    max_drift = ctx.q(3.0, 2.0)  # a minute on a shared 2-core box is noisy; ten minutes less so
    max_rss_slope = ctx.q(50.0, 20.0)  # MiB per minute: a minute holds warm-up growth (allocator, caches)
    pids = await process_pids(t, ctx.supervisor_conf)
    stop = asyncio.Event()
    t0 = time.monotonic()
    samples: list[dict[str, float]] = []
    bar = ctx.bar(int(duration), "soak (s)")

    async def request(i: int) -> ChatResult:
        kind = i % 4
        if kind == 0:
            return await t.chat([{"role": "user", "content": unique_prefix() + "Name three primary colors."}], 16)
        if kind == 1:
            return await t.chat([{"role": "user", "content": unique_prefix() + "What is 2 + 2?"}], 8, stream=False)
        if kind == 2:
            return await t.chat([{"role": "user", "content": unique_prefix() + MEDIUM}], 24)
        return await t.chat([{"role": "user", "content": "What is the capital of France?"}], 32)  # prefix-cached

    async def sampler() -> None:
        last = 0
        while not stop.is_set():
            row: dict[str, float] = {"t": time.monotonic() - t0}
            for name, pid in pids.items():
                mb = rss_mb(pid)
                if mb is not None:
                    row[f"rss:{name}"] = mb
            for lane in t.lanes:
                m = await t.scrape(str(lane["url"]))
                if "strata_kv_usage_ratio" in m:
                    row[f"kv:{lane.get('name')}"] = m["strata_kv_usage_ratio"]
            samples.append(row)
            now = int(row["t"])
            bar.update(min(int(duration), now) - last)
            last = min(int(duration), now)
            await sleep_until(stop, interval)

    async def timer() -> None:
        await asyncio.sleep(duration)
        stop.set()

    sampling = asyncio.create_task(sampler())
    results, _ = await asyncio.gather(closed_loop(workers, request, stop), timer())
    await sampling
    bar.close()
    wall = time.monotonic() - t0
    n = len(results)
    errors = [r for r in results if not r.ok]
    rate = len(errors) / n if n else None
    third = duration / 3
    first = [r.total_s for r in results if r.sent - t0 < third and r.ok]
    last = [r.total_s for r in results if r.sent - t0 >= 2 * third and r.ok]
    p99_first, p99_last = percentile(first, 99), percentile(last, 99)
    drift = p99_last / p99_first if p99_first and p99_last else None
    res.metric("requests", n, "", "higher")
    res.metric("error_rate", rate, "", "lower")
    res.metric("p50_s", percentile([r.total_s for r in results if r.ok], 50), "s", "lower")
    res.metric("p99_s", percentile([r.total_s for r in results if r.ok], 99), "s", "lower")
    res.metric("p99_drift", drift, "x", "lower")
    rows = [["requests", n, "-", "-"], ["error rate", f"{(rate or 0):.2%}", f"<= {MAX_ERROR_RATE:.0%}",
                                        _pf(rate is not None and rate <= MAX_ERROR_RATE)],
            ["p99 first third s", _f(p99_first), "-", "-"], ["p99 last third s", _f(p99_last), "-", "-"],
            ["p99 drift (last/first)", _f(drift), f"<= {max_drift:g}", _pf(drift is not None and drift <= max_drift)]]
    res.check("error rate", rate, "<=", MAX_ERROR_RATE)
    res.check("p99 drift (last third / first third)", drift, "<=", max_drift)
    series_rss: dict[str, tuple[list[float], list[float]]] = {}
    worst = 0.0
    for key in sorted({k for s in samples for k in s if k != "t"}):
        xs = [s["t"] / 60 for s in samples if key in s]
        ys = [s[key] for s in samples if key in s]
        sl = slope(xs, ys)
        if key.startswith("rss:"):
            series_rss[key[4:]] = ([x * 60 for x in xs], ys)
            res.metric(f"rss_slope_mb_min:{key[4:]}", sl, "MiB/min", "lower", noise=5.0)
            rows.append([f"RSS slope {key[4:]} MiB/min (now {ys[-1]:.0f} MiB)", _f(sl), f"<= {max_rss_slope:g}",
                         _pf(sl is not None and sl <= max_rss_slope)])
            worst = max(worst, sl or 0.0)
        else:
            res.metric(f"kv_slope_per_min:{key[3:]}", sl, "/min", "lower", noise=0.2)
            rows.append([f"KV usage slope {key[3:]} per min (max {max(ys):.2f})", _f(sl, 4), "-", "-"])
    if series_rss:
        res.check("worst RSS slope MiB/min", worst, "<=", max_rss_slope)
    else:
        res.notes.append("no process memory sampled (no supervisord config and no local lane pids)")
    res.table(f"Soak: {workers} clients for {wall:.0f} s, mixed prompts (sampled every {interval:g} s)",
              ["figure", "value", "threshold", "pass"], rows)
    if errors:
        res.notes.append(f"first errors: {[e.error for e in errors[:3]]}")
    ok = [r for r in results if r.ok]
    res.plots.append(timeline(ctx.out / "soak.png", "Soak: request latency and process memory",
                              {"request s": ([r.sent - t0 for r in ok], [r.total_s for r in ok])}, "latency s",
                              panels2=series_rss or None, ylabel2="RSS MiB"))


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pf(ok: bool) -> str:
    return "pass" if ok else "FAIL"
