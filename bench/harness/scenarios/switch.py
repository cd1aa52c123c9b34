"""switch: an A/B switch of one lane (deploy/switch_lane.py: drain, swap the lane file, restart, smoke
test, traffic steps) while clients keep sending through the gateway. The new lane file is a copy of
the current one, so the run changes nothing but exercises the whole rollout. Checked: the switch
completes (exit 0) and not one client request fails; reported: time to complete."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

from bench.harness.client import ChatResult, TargetError
from bench.harness.context import Context, closed_loop, unique_prefix
from bench.harness.plots import timeline
from bench.harness.procs import lane_config_file
from bench.harness.result import ScenarioResult

NAME = "switch"
CORRECTNESS = True
KINDS = ("gateway",)
REPO = Path(__file__).resolve().parents[3]


async def run(ctx: Context, res: ScenarioResult) -> None:
    t = ctx.target
    if ctx.supervisor_conf is None or not t.admin_key:
        raise TargetError("switch needs --supervisor-config and the admin key")
    lanes = await t.refresh_lanes()
    lane = str(lanes[-1]["name"])
    work = ctx.out / "switch"
    work.mkdir(parents=True, exist_ok=True)
    current = lane_config_file(ctx.supervisor_conf, f"lane_{lane}")
    new = work / f"lane_{lane}.toml"
    shutil.copyfile(current, new)
    key_file = work / "admin.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(t.admin_key + "\n")
    hold = ctx.q(2.0, 30.0)
    steps = ctx.q("0.5,1.0", "0.1,0.5,1.0")
    argv = [sys.executable, str(REPO / "deploy" / "switch_lane.py"), "--supervisor-config", str(ctx.supervisor_conf),
            "--lane", lane, "--config", str(new), "--gateway", t.url, "--admin-key-file", str(key_file),
            "--steps", steps, "--step-hold-s", str(hold), "--state-dir", str(work / "rollout")]
    env = {k: v for k, v in os.environ.items() if k != "STRATA_ADMIN_KEY"}
    env["PYTHONPATH"] = str(REPO)
    stop = asyncio.Event()
    t0 = time.monotonic()
    bar = ctx.bar(None, "switch (requests)")

    async def load(i: int) -> ChatResult:
        r = await t.chat([{"role": "user", "content": unique_prefix() + "What is the capital of France?"}],
                         max_tokens=16, stream=i % 2 == 0)
        bar.update(1)
        return r

    async def switch() -> tuple[int, float, str]:
        await asyncio.sleep(1.0)
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=REPO, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        took = time.monotonic() - start
        await asyncio.sleep(1.0)
        stop.set()
        return int(proc.returncode or 0), took, out.decode(errors="replace")

    results, (code, took, out) = await asyncio.gather(closed_loop(ctx.q(2, 4), load, stop), switch())
    bar.close()
    (work / "switch.log").write_text(out)
    failed = [r for r in results if not r.ok]
    lanes_used = sorted({r.lane for r in results if r.lane})
    res.metric("switch_s", took, "s", "lower")
    res.metric("failed_requests", len(failed), "", "lower")
    res.metric("requests", len(results), "", None)
    res.table(f"Switch of lane {lane} under load (steps {steps}, {hold:g} s each)", ["figure", "value"], [
        ["switch exit code (0 = switched)", code], ["time to complete s", f"{took:.1f}"],
        ["client requests during the switch", len(results)], ["failed", len(failed)],
        ["lanes that answered", ", ".join(lanes_used)], ["switch log", "switch/switch.log"]])
    res.check("switch exit code", code, "==", 0)
    res.check("failed requests during the switch", len(failed), "==", 0)
    if code != 0:
        res.notes.append("switch output (tail): " + " | ".join(out.strip().splitlines()[-5:]))
    if failed:
        res.notes.append(f"failures (first 3): {[f.error for f in failed[:3]]}")
    res.plots.append(timeline(ctx.out / "switch.png", f"Requests during the switch of lane {lane}",
                              {"ok": ([r.sent - t0 for r in results if r.ok], [r.total_s for r in results if r.ok]),
                               "failed": ([r.sent - t0 for r in failed], [r.total_s for r in failed])}, "request s",
                              marks={"switch starts": 1.0, "switch ends": 1.0 + took}))
