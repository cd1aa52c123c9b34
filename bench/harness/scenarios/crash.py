"""crash: SIGKILL a lane through supervisorctl while the gateway is under load (clients plus one
session-memory conversation). Reported: requests that failed, time until the lane is back (its
/health 200 and the gateway seeing it ready). Checked: every request the clients sent has a row in
the gateway's request log whose outcome is the one the client saw, and the session holds each
answered turn exactly once (nothing lost, nothing duplicated)."""

from __future__ import annotations

import asyncio
import time

from bench.harness.client import ChatResult, TargetError
from bench.harness.context import Context, closed_loop, unique_prefix
from bench.harness.plots import timeline
from bench.harness.procs import supervisorctl
from bench.harness.result import ScenarioResult

NAME = "crash"
CORRECTNESS = True
KINDS = ("gateway",)
RECOVERY_LIMIT_S = 120.0


async def run(ctx: Context, res: ScenarioResult) -> None:
    t = ctx.target
    if ctx.supervisor_conf is None or not t.admin_key:
        raise TargetError("crash needs --supervisor-config and the admin key")
    lanes = await t.refresh_lanes()
    victim = str(lanes[0]["name"])
    program = f"lanes:lane_{victim}"
    key = await t.create_key(f"bench-crash-{ctx.seed}")
    headers = t.headers(key)
    async with t.session.post(t.url + "/v1/sessions", json={"title": "bench crash"}, headers=headers) as r:
        sess = await r.json(content_type=None)
        if r.status != 201:
            raise TargetError(f"create session: HTTP {r.status}: {sess}")
    sid = sess["id"]
    since = time.time() - 1.0
    stop = asyncio.Event()
    t0 = time.monotonic()
    turns: list[tuple[str, ChatResult]] = []
    kill_at = ctx.q(3.0, 10.0)
    after = ctx.q(3.0, 15.0)
    bar = ctx.bar(None, "crash (requests)")

    async def load(i: int) -> ChatResult:
        r = await t.chat([{"role": "user", "content": unique_prefix() + "Name three primary colors."}],
                         max_tokens=24, stream=i % 2 == 0, key=key)
        bar.update(1)
        return r

    async def conversation() -> None:
        i = 0
        while not stop.is_set():
            text = f"Turn {i}: please note the number {1000 + i}."
            r = await t.chat([{"role": "user", "content": text}], max_tokens=8, stream=i % 2 == 1, key=key,
                             session_id=sid)
            turns.append((text, r))
            bar.update(1)
            i += 1

    async def fault() -> tuple[float, float | None, str]:
        await asyncio.sleep(kill_at)
        code, out = await supervisorctl(ctx.supervisor_conf, "signal", "KILL", program)  # type: ignore[arg-type]
        killed = time.monotonic() - t0
        if code != 0:
            stop.set()
            raise TargetError(f"supervisorctl signal KILL {program}: exit {code}: {out}")
        await asyncio.sleep(0.5)  # the health poll notices the lane gone before "ready" means back
        back: float | None = None
        lane_url = str(lanes[0]["url"])
        while time.monotonic() - t0 - killed < RECOVERY_LIMIT_S:
            status, _ = await t.get_json(lane_url + "/health", timeout=2)
            if status == 200:
                current = {x["name"]: x for x in await t.refresh_lanes()}
                if current.get(victim, {}).get("ready"):
                    back = time.monotonic() - t0
                    break
            await asyncio.sleep(0.2)
        await asyncio.sleep(after)
        stop.set()
        return killed, back, out

    results, _, (killed, back, out) = await asyncio.gather(closed_loop(ctx.q(3, 6), load, stop), conversation(),
                                                          fault())
    bar.close()
    everything = results + [r for _, r in turns]
    failed = [r for r in everything if not r.ok]
    recovery = None if back is None else back - killed
    res.metric("requests", len(everything), "", None)
    res.metric("failed_requests", len(failed), "", "lower")
    res.metric("recovery_s", recovery, "s", "lower")

    # every request has its true outcome in the request log
    await asyncio.sleep(0.5)
    rows = {row["id"]: row for row in await t.request_log(since, limit=1000)}
    no_id = [r for r in everything if not r.request_id]
    missing = [r for r in everything if r.request_id and r.request_id not in rows]
    wrong = []
    for r in everything:
        row = rows.get(r.request_id or "")
        if row is None:
            continue
        logged_ok = int(row["status"]) == 200 and not row.get("error_type")
        if logged_ok != r.ok:
            wrong.append((r.request_id, r.ok, row["status"], row.get("error_type"), r.error))

    # the session holds each answered turn exactly once
    async with t.session.get(f"{t.url}/v1/sessions/{sid}", headers=headers) as resp:
        stored = (await resp.json(content_type=None)).get("turns") or []
    users = [x["content"] for x in stored if x["role"] == "user"]
    lost = [text for text, r in turns if r.ok and users.count(text) != 1]
    dup = [text for text, _ in turns if users.count(text) > 1]
    stray = [u for u in users if u not in {text for text, _ in turns}]
    res.table(f"SIGKILL of lane {victim} at {killed:.1f} s under load", ["figure", "value"], [
        ["requests sent (load + session turns)", f"{len(everything)} ({len(results)} + {len(turns)})"],
        ["failed requests", len(failed)],
        ["time to recovery s (kill -> /health 200 and gateway ready)", "-" if recovery is None else f"{recovery:.1f}"],
        ["requests without a request id", len(no_id)],
        ["requests missing from the request log", len(missing)],
        ["request-log outcome differs from the client's", len(wrong)],
        ["session turns answered / stored user turns", f"{sum(r.ok for _, r in turns)} / {len(users)}"],
        ["answered turns lost", len(lost)], ["turns duplicated", len(dup)], ["stored turns never sent", len(stray)]])
    res.check("lane recovered (s)", recovery, "<=", RECOVERY_LIMIT_S)
    res.check("requests without a true outcome in the request log", len(no_id) + len(missing) + len(wrong), "==", 0)
    res.check("memory turns lost or duplicated", len(lost) + len(dup) + len(stray), "==", 0)
    if wrong:
        res.notes.append(f"outcome mismatches (id, client ok, logged status, error type, client error): {wrong[:3]}")
    if failed:
        res.notes.append(f"failures (first 3): {[f.error for f in failed[:3]]}")
    ok_pts = ([r.sent - t0 for r in everything if r.ok], [r.total_s for r in everything if r.ok])
    bad_pts = ([r.sent - t0 for r in failed], [r.total_s for r in failed])
    marks = {"SIGKILL": killed, **({"recovered": back} if back is not None else {})}
    res.plots.append(timeline(ctx.out / "crash.png", f"Requests around the SIGKILL of lane {victim}",
                              {"ok": ok_pts, "failed": bad_pts}, "request s", marks=marks))
    async with t.session.delete(f"{t.url}/v1/sessions/{sid}", headers=headers):
        pass
