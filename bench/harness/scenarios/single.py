"""single: one stream at a time; prefill tok/s (prompt tokens / TTFT) and decode tok/s (tokens after
the first / the time after the first) at 1k, 4k and the window's prompt lengths, on the target and
on each peer (a plain lane, a llama.cpp server) with the same prompts."""

from __future__ import annotations

from bench.harness.context import Context, unique_prefix
from bench.harness.plots import bars
from bench.harness.prompts import chat, prompt_of_length
from bench.harness.result import ScenarioResult, median

NAME = "single"
CORRECTNESS = False
KINDS = ("gateway", "lane", "llama")


async def run(ctx: Context, res: ScenarioResult) -> None:
    gen = ctx.q(32, 128)
    reps = ctx.q(1, 3)
    n_ctx = ctx.target.n_ctx or 2048
    top = n_ctx - gen - 32  # room for the unique prefix and the answer
    lengths = sorted({min(x, top) for x in ctx.q([512], [1024, 4096])} | {top})
    prompts = {}
    for length in lengths:
        prompts[length] = await prompt_of_length(ctx.target, length, seed=length)
    targets = [ctx.target, *ctx.peers]
    rows, series = [], {}
    bar = ctx.bar(reps * (len(lengths) + len(ctx.peers) * (1 if ctx.quick else len(lengths))), "single")
    for t in targets:
        for length in lengths if t is ctx.target or not ctx.quick else lengths[:1]:  # quick: peers at one length
            text, measured = prompts[length]
            if t.n_ctx and measured + gen > t.n_ctx:
                res.notes.append(f"{t.label}: {measured}-token prompt skipped (window {t.n_ctx})")
                bar.update(reps)
                continue
            runs = []
            for _ in range(reps):
                r = await t.chat(chat(unique_prefix() + text), max_tokens=gen, ignore_eos=True)
                bar.update(1)
                if not r.ok or r.ttft_s is None:
                    res.notes.append(f"{t.label} @{measured}: {r.error}")
                    continue
                runs.append(r)
            if not runs:
                continue
            ptok = runs[0].prompt_tokens or measured
            ttft = median([r.ttft_s for r in runs if r.ttft_s is not None])
            pre = median([(r.prompt_tokens or measured) / r.ttft_s for r in runs if r.ttft_s])
            dec = median([d for r in runs if (d := r.decode_tok_s) is not None])
            tag = "max" if length == top else (f"{length // 1024}k" if length >= 1024 else str(length))
            rows.append([t.label, tag, ptok, f"{ttft:.3f}" if ttft else "-", f"{pre:,.0f}" if pre else "-",
                         f"{dec:.1f}" if dec else "-", runs[0].completion_tokens])
            res.metric(f"{t.label}:prefill_tok_s@{tag}", pre, "tok/s", "higher")
            res.metric(f"{t.label}:decode_tok_s@{tag}", dec, "tok/s", "higher")
            res.metric(f"{t.label}:ttft_s@{tag}", ttft, "s", "lower")
            series.setdefault(t.label, {})[tag] = {"prefill_tok_s": pre, "decode_tok_s": dec, "ttft_s": ttft}
    bar.close()
    res.table(f"Single stream ({gen} generated tokens, ignore_eos, median of {reps})",
              ["target", "prompt", "prompt tokens", "TTFT s", "prefill tok/s", "decode tok/s", "generated"], rows)
    res.data["series"] = series
    if series:
        res.plots.append(bars(ctx.out / "single.png", "Single-stream decode tok/s",
                              {lbl: {k: v["decode_tok_s"] or 0 for k, v in s.items()} for lbl, s in series.items()},
                              "tok/s"))
