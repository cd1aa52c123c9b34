"""memory: the memory evaluator's facts and filler (bench/memory_eval.py) through the gateway's
session memory. Per distance, one session gets the facts planted in its first turns, then that many
filler turns, then a question about each fact. Recall = the fact's value reached the lane's prompt
(the request log's prompt text, for a key with prompt logging made with the admin key); the model's
answers naming the value are reported beside it. Every turn must be stored exactly once."""

from __future__ import annotations

import asyncio
import time

from bench.harness.client import TargetError
from bench.harness.context import Context
from bench.harness.plots import lines
from bench.harness.result import ScenarioResult

NAME = "memory"
CORRECTNESS = True
KINDS = ("gateway",)
THRESHOLD = 0.9
RETRIEVAL_WAIT_S = (180.0, 300.0)  # quick, full: a fresh gateway loads its embedding model in the background


async def wait_retrieval(ctx: Context, res: ScenarioResult) -> str | None:
    """Until the gateway's embedding model is loaded (``/readyz`` ``retrieval``), at most RETRIEVAL_WAIT_S: before
    that a session request composes without retrieval, and recall would measure the model's load, not memory.
    Reports the wait, and says so when it gave up (then measures anyway). Returns the last state seen."""
    t = ctx.target
    limit = ctx.q(*RETRIEVAL_WAIT_S)
    t0 = time.monotonic()
    state: str | None = None
    while True:
        _, body = await t.get_json(t.url + "/readyz")
        state = body.get("retrieval") if isinstance(body, dict) else None
        if state != "loading" or time.monotonic() - t0 > limit:
            break  # ready, off, or a gateway that does not say (nothing to wait for)
        await asyncio.sleep(0.5)
    waited = time.monotonic() - t0
    res.metric("retrieval_wait_s", waited, "s")
    if state == "loading":
        res.notes.append(f"gave up waiting for the gateway's embedding model after {waited:.0f} s: measured anyway, "
                         "and turns composed before it loaded could not retrieve older facts")
    elif state == "off":
        res.notes.append("the gateway has no embedding model (retrieval off): recall comes from the summary and "
                         "the recent turns only")
    elif waited >= 1.0:
        res.notes.append(f"waited {waited:.0f} s for the gateway's embedding model before measuring")
    return state


async def run(ctx: Context, res: ScenarioResult) -> None:
    import random

    from bench.memory_eval import FACTS, filler

    t = ctx.target
    if not t.admin_key:
        raise TargetError("memory needs the admin key (a key with prompt logging and the request log)")
    await wait_retrieval(ctx, res)
    key = await t.create_key(f"bench-memory-{ctx.seed}", log_prompts=True)
    headers = t.headers(key)
    distances = ctx.q([6], [10, 50, 200])
    facts = FACTS[:ctx.q(3, 10)]
    rng = random.Random(ctx.seed)
    total = sum(len(facts) * 2 + d for d in distances)
    bar = ctx.bar(total, "memory")
    rows, xs, in_prompt_series, answered_series = [], [], [], []
    all_in, all_n = 0, 0
    turn_errors = 0
    for d in distances:
        async with t.session.post(t.url + "/v1/sessions", json={"title": f"bench memory {d}"}, headers=headers) as r:
            sess = await r.json(content_type=None)
            if r.status != 201:
                raise TargetError(f"create session: HTTP {r.status}: {sess}")
        sid = sess["id"]
        sent = 0

        async def say(text: str, max_tokens: int, sid: str = sid) -> tuple[str, str | None]:
            nonlocal sent
            r = await t.chat([{"role": "user", "content": text}], max_tokens=max_tokens, stream=False, key=key,
                             session_id=sid)
            bar.update(1)
            if not r.ok:
                raise TargetError(f"session turn failed: {r.error}")
            sent += 1
            return r.text, r.request_id

        for what, value in facts:
            await say(f"Please remember: {what} is {value}.", 8)
        for i in range(d):
            await say(filler(rng, i)[0], 4)
        since = time.time() - 1.0
        asked = []
        for what, value in facts:
            text, rid = await say(f"What is {what}?", 16)
            asked.append((value, text, rid))
        log = {row["id"]: row for row in await t.request_log(since, limit=1000)}
        in_prompt = sum(1 for v, _, rid in asked if v.lower() in str((log.get(rid) or {}).get("prompt_text") or "").lower())
        answered = sum(1 for v, text, _ in asked if v.lower() in text.lower())
        async with t.session.get(f"{t.url}/v1/sessions/{sid}", headers=headers) as r:
            full = await r.json(content_type=None)
        turns = full.get("turns") or []
        history = sum(int(x.get("tokens") or 0) for x in turns)
        users = [x["content"] for x in turns if x["role"] == "user"]
        stored_ok = len(turns) == 2 * sent and len(set(users)) == len(users) and all(x["complete"] for x in turns)
        turn_errors += not stored_ok
        all_in += in_prompt
        all_n += len(facts)
        rows.append([d, history, t.n_ctx or "-", f"{in_prompt}/{len(facts)}", f"{answered}/{len(facts)}",
                     f"{len(turns)}/{2 * sent}", "yes" if stored_ok else "NO"])
        res.metric(f"recall_in_prompt@{d}", in_prompt / len(facts), "", "higher")
        res.metric(f"answered@{d}", answered / len(facts), "", "higher")
        xs.append(float(d))
        in_prompt_series.append(in_prompt / len(facts))
        answered_series.append(answered / len(facts))
        async with t.session.delete(f"{t.url}/v1/sessions/{sid}", headers=headers):
            pass
    bar.close()
    res.table("Session memory through the gateway (facts planted, then filler turns, then questions)",
              ["filler turns", "history est. tokens", "window", "fact in the lane's prompt", "answer names it",
               "turns stored / expected", "each turn once, complete"], rows)
    res.check("fact in the lane's prompt (all distances)", all_in / all_n if all_n else None, ">=", THRESHOLD)
    res.check("sessions with a lost, duplicated or incomplete turn", turn_errors, "==", 0)
    res.notes.append("answers naming the fact measure the default model, reported and not gated")
    res.plots.append(lines(ctx.out / "memory.png", "Session memory recall", "filler turns",
                           [("share of facts", {"in the lane's prompt": (xs, in_prompt_series),  # type: ignore[dict-item]
                                                "named in the answer": (xs, answered_series)})]))
