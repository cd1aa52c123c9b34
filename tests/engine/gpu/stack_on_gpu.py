"""Must-show 4 of issue 9: the whole stack on a one-GPU machine.

The repo's supervisord.conf, lane files and gateway file, rendered into a temp folder (ports,
state paths, the model and the device changed; ``cores = "auto"`` kept, so lane A pins the first
half of the CPUs and lane B the second half), run by supervisord as ``make run`` runs them:

1. lane A on ``device_a`` (``cuda:0``), lane B on ``device_b`` (``cpu``): both ready, both answer
   chat completions through the gateway (``X-Strata-Lane``) and give the same greedy completion,
   ``/v1/lane`` reports each lane's device, GPU and cores (disjoint halves);
2. a load generator (closed loop, streamed and plain chat completions through the gateway) runs
   while ``make switch LANE=b CONFIG=<lane B moved to device_switch>`` (deploy/switch_lane.py:
   drain, swap, restart, smoke test, 10/50/100%) completes;
3. checked: the switch exits 0, not one client request failed, lane B now reports the new
   device, requests reach it there, and on the GPU each lane stays within its VRAM budget: what
   the engine says it holds (weights + KV) within ``engine.inspect_model.gpu_bytes`` (what
   ``strata model inspect --vram`` promises), and the process's memory as ``nvidia-smi`` sees
   it within that plus a CUDA context allowance; both lanes together within the card.

Off the GPU (``--device-a cpu --device-b cpu --device-switch cpu``) the same run checks the
stack machinery with a switch that only changes lane B's KV size.

    python -m tests.engine.gpu.stack_on_gpu --device-a cuda:0 --device-b cpu --device-switch cuda:0 \
        [--model M.gguf] [--json out.json]

Without ``--model`` a small random Qwen3-MoE with a byte-level tokenizer and a chat template is
built (torch + transformers): the default model's source package cannot travel to the GPU box.
Where the repository has no ``.venv`` (the GPU box), a wrapper in the temp folder takes the venv
python's place: this interpreter with this ``PYTHONPATH`` (the carried wheels) added even where a
caller resets it; supervisord is ``python -m supervisor.supervisord``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.stack import PROGRAMS, StackError, Supervised, dump_toml, free_port, render
from gateway.config import KEY_LIMITS

REPO = Path(__file__).resolve().parents[3]
ADMIN_KEY = "gpu-stack-admin-" + "k" * 24  # only in a 0600 temp file and this process
# A CUDA context with the engine's module loaded and its streams: measured ~0.5 GiB on an H200 by
# nvidia-smi for a process that allocated nothing else; the allowance leaves room for the driver.
CONTEXT_ALLOWANCE = 1 << 30
GIB = 1 << 30


class StackCheckError(AssertionError):
    """A must-show check failed (the message says which, with what was seen)."""


def _req(method: str, url: str, body: dict[str, Any] | None = None, key: str | None = None,
         timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
    except OSError as e:
        return 0, {}, str(e).encode()


def _json(method: str, url: str, body: dict[str, Any] | None = None, key: str | None = None) -> tuple[int, Any]:
    code, _, raw = _req(method, url, body, key, timeout=10.0)
    try:
        return code, json.loads(raw or b"{}")
    except ValueError:
        return code, None


@dataclass
class GpuStack(Supervised):
    log: list[str] = field(default_factory=list)

    def say(self, msg: str) -> None:
        line = f"[stack {time.strftime('%H:%M:%S')}] {msg}"
        self.log.append(line)
        print(line, flush=True)


def render_stack(tmp: Path, model: Path, device_a: str, device_b: str, kv_tokens: int,
                 wrap: bool = False, lane_extra: dict[str, dict[str, Any]] | None = None) -> GpuStack:
    """supervisord.conf + lane files + gateway file under ``tmp`` (see the module doc); ``lane_extra``:
    more lane keys by program (e.g. ``{"lane_a": {"gpu_budget_gb": 0.02}}``)."""
    ports = {p: free_port() for p in (*PROGRAMS, "gateway")}
    pythonpath = os.pathsep.join([str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                               if p and Path(p).resolve() != REPO]])
    python = str(REPO / ".venv" / "bin" / "python")
    if wrap or not Path(python).exists():
        # the GPU box has no venv: a wrapper runs this interpreter with this PYTHONPATH (the carried
        # wheels), also where a caller resets PYTHONPATH to the repository (make switch; the
        # lanes' --check-config run by deploy/run.py), and takes the venv python's place
        wrapper = tmp / "bin" / "python"
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        wrapper.write_text(f'#!/bin/sh\nexport PYTHONPATH="{pythonpath}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
                           f'exec "{sys.executable}" "$@"\n')
        wrapper.chmod(0o755)
        python = str(wrapper)

    def edit(text: str) -> str:
        text = text.replace("%(here)s/.venv/bin/python", python)
        if 'PYTHONPATH="%(here)s"' not in text:
            raise StackCheckError("supervisord.conf no longer sets PYTHONPATH=\"%(here)s\" for its programs")
        return text.replace('PYTHONPATH="%(here)s"', f'PYTHONPATH="{pythonpath}"')

    lanes = {p: {"model": str(model), "device": device, "kv_tokens": kv_tokens, "drain_timeout_s": 20.0,
                 "ping_interval_s": 1.0, **(lane_extra or {}).get(p, {})}
             for p, device in zip(PROGRAMS, (device_a, device_b), strict=True)}
    conf = render(tmp, ports, ADMIN_KEY, lanes, gateway={"shutdown_timeout_s": 10.0}, edit=edit)
    return GpuStack(tmp, conf, ports, ADMIN_KEY, python=python)


def chat(gateway: str, key: str, content: str, stream: bool, max_tokens: int = 12) -> tuple[bool, str, str]:
    """(ok, lane, error) of one chat completion through the gateway; a stream must end in [DONE]."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    code, headers, raw = _req("POST", gateway + "/v1/chat/completions", body, key, timeout=120.0)
    lane = headers.get("X-Strata-Lane", "?")
    if code != 200:
        return False, lane, f"HTTP {code}: {raw[:200].decode(errors='replace')}"
    if stream:
        text = raw.decode(errors="replace")
        events = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
        if not events or events[-1] != "[DONE]" or any('"error"' in e for e in events):
            return False, lane, f"stream without [DONE] or with an error: {text[-200:]!r}"
        return True, lane, ""
    try:
        msg = json.loads(raw)["choices"][0]
        if not msg.get("finish_reason"):
            return False, lane, f"no finish_reason: {raw[:200]!r}"
    except (ValueError, KeyError, IndexError) as e:
        return False, lane, f"bad body ({e}): {raw[:200]!r}"
    return True, lane, ""


class Load:
    """``n`` closed-loop clients through the gateway, alternately streamed and plain."""

    def __init__(self, gateway: str, key: str, n: int = 4) -> None:
        self.gateway, self.key = gateway, key
        self.ok = 0
        self.by_lane: dict[str, int] = {}
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            ok, lane, err = chat(self.gateway, self.key, f"load {worker}-{i}: hello there", stream=i % 2 == 0)
            with self._lock:
                if ok:
                    self.ok += 1
                    self.by_lane[lane] = self.by_lane.get(lane, 0) + 1
                else:
                    self.failures.append(f"lane {lane}: {err}")

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.by_lane)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)


def gpu_process_memory() -> dict[int, int] | None:
    """pid -> bytes used on the GPU (nvidia-smi); None when nvidia-smi is missing or reports no numbers."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    r = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return None
    out: dict[int, int] = {}
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = int(parts[1]) * (1 << 20)
    return out


def lane_budget(model: Path, kv_tokens: int, step_tokens: int) -> int:
    """What ``strata model inspect --vram`` counts for the whole model on the GPU: weights + KV + step buffers."""
    from engine.gguf_model import open_model
    from engine.inspect_model import analyse, gpu_bytes

    mf = open_model(model)
    return gpu_bytes(mf, analyse(mf).kv_bytes_per_token * kv_tokens, step_tokens=step_tokens)


def hybrid_budget_gb(model: Path, frac: float, kv_tokens: int, block_size: int = 16, prefill_chunk: int = 512) -> float:
    """A lane's ``gpu_budget_gb`` that leaves ``frac`` of the routed experts' bytes for resident experts once
    the parts every step needs are placed (the lane's default placement: no placement file)."""
    from engine.gguf_model import open_model
    from engine.placement import engine_plan_params, plan

    base = plan(open_model(model), engine_plan_params(0, kv_tokens, block_size, prefill_chunk), None)
    return round((base.fixed_bytes + int(frac * base.routed_bytes) + 4096) / 2**30, 9)


def lane_budgets(model: Path, lanes: dict[str, dict[str, Any]], kv_tokens: int, step_tokens: int) -> dict[str, int]:
    """Each lane's GPU budget in bytes: its ``gpu_budget_gb`` (hybrid placement) or, without one, what
    ``strata model inspect --vram`` counts for the whole model (weights + KV + step buffers)."""
    whole = lane_budget(model, kv_tokens, step_tokens)
    return {p: int(float(cfg["gpu_budget_gb"]) * 2**30) if cfg.get("gpu_budget_gb") else whole
            for p, cfg in lanes.items()}


def check_vram(st: GpuStack, infos: dict[str, dict[str, Any]], budgets: dict[str, int],
               report: dict[str, Any]) -> None:
    """Every lane on a GPU within its budget; together within the card."""
    on_gpu = {p: i for p, i in infos.items() if i.get("gpu_info")}
    if not on_gpu:
        return
    used = gpu_process_memory()
    rows = {}
    for program, info in on_gpu.items():
        gi = info["gpu_info"]
        budget = budgets[program]
        held = int(gi["weight_bytes"]) + int(gi["kv_bytes"])
        proc = used.get(int(info["pid"])) if used else None
        rows[program] = {"weight_bytes": gi["weight_bytes"], "kv_bytes": gi["kv_bytes"], "process_bytes": proc,
                         "budget_bytes": budget, "process_budget_bytes": budget + CONTEXT_ALLOWANCE}
        if held > budget:
            raise StackCheckError(f"{program}: the engine holds {held} B of weights + KV on the GPU, over the "
                                  f"{budget} B that model inspect promises")
        if proc is not None and proc > budget + CONTEXT_ALLOWANCE:
            raise StackCheckError(f"{program}: nvidia-smi sees {proc} B for pid {info['pid']}, over its budget "
                                  f"{budget} + {CONTEXT_ALLOWANCE} B context allowance")
    total = int(next(iter(on_gpu.values()))["gpu_info"]["total_bytes"])
    together = sum(r["process_bytes"] or (r["weight_bytes"] + r["kv_bytes"]) for r in rows.values())
    if together > total:
        raise StackCheckError(f"the lanes together use {together} B of the GPU's {total} B")
    report.setdefault("vram", []).append({"lanes": rows, "gpu_total_bytes": total, "together_bytes": together,
                                          "nvidia_smi": used is not None})
    def mib(v: int | None) -> str:
        return "?" if v is None else f"{v / 2**20:.0f}"

    st.say("VRAM: " + ", ".join(f"{p} engine {mib(r['weight_bytes'] + r['kv_bytes'])} MiB, process "
                                f"{mib(r['process_bytes'])} MiB, budget {mib(r['budget_bytes'])} MiB"
                                for p, r in rows.items())
           + f" (+{mib(CONTEXT_ALLOWANCE)} MiB context each)")


def lane_infos(st: GpuStack) -> dict[str, dict[str, Any]]:
    out = {}
    for p in PROGRAMS:
        code, info = _json("GET", st.url(p) + "/v1/lane")
        if code != 200 or not isinstance(info, dict):
            raise StackCheckError(f"{p}: /v1/lane answered {code}")
        out[p] = info
    return out


def check_lane(program: str, info: dict[str, Any], device: str) -> None:
    want = "cpu" if device == "cpu" else (device if ":" in device else f"{device}:0")
    if info["device"] != want:
        raise StackCheckError(f"{program}: /v1/lane device {info['device']!r}, expected {want!r}")
    gi = info.get("gpu_info")
    if want == "cpu":
        if gi is not None:
            raise StackCheckError(f"{program}: on the CPU but /v1/lane reports a GPU {gi}")
        return
    if not gi or gi["index"] != int(want.split(":")[1]) or not gi["name"]:
        raise StackCheckError(f"{program}: /v1/lane gpu_info {gi!r} does not name GPU {want}")
    if not gi["total_bytes"] > gi["weight_bytes"] > 0 or gi["kv_bytes"] <= 0:
        raise StackCheckError(f"{program}: implausible gpu_info {gi!r}")


def answer_through_gateway(st: GpuStack, key: str, lanes: set[str], timeout: float = 120.0) -> dict[str, int]:
    """Plain chat completions through the gateway until each of ``lanes`` has answered one."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    i = 0
    while not lanes <= set(seen):
        if time.monotonic() > deadline:
            raise StackCheckError(f"lanes {sorted(lanes - set(seen))} never answered through the gateway ({seen})")
        i += 1
        ok, lane, err = chat(st.url("gateway"), key, f"What is the capital of France? ({i})", stream=False)
        if not ok:
            raise StackCheckError(f"a request through the gateway failed: lane {lane}: {err}")
        seen[lane] = seen.get(lane, 0) + 1
    return seen


def same_greedy_text(st: GpuStack, key: str, timeout: float = 120.0) -> dict[str, str]:
    """The same greedy completion through the gateway from each lane (GPU and CPU engines agree on
    this model and prompt: test_gpu_lane.py); returns lane -> text."""
    body = {"model": "strata-default", "prompt": "hello there", "max_tokens": 12, "temperature": 0}
    texts: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while set(texts) != {"a", "b"}:
        if time.monotonic() > deadline:
            raise StackCheckError(f"the completion did not reach both lanes: {sorted(texts)}")
        code, headers, raw = _req("POST", st.url("gateway") + "/v1/completions", body, key)
        if code != 200:
            raise StackCheckError(f"completion through the gateway: HTTP {code} {raw[:200]!r}")
        texts[headers.get("X-Strata-Lane", "?")] = json.loads(raw)["choices"][0]["text"]
    if texts["a"] != texts["b"]:
        raise StackCheckError(f"lanes a and b disagree on a greedy completion: {texts}")
    return texts


def switch_lane_b(st: GpuStack, new_file: Path, hold_s: float) -> tuple[int, str, list[str]]:
    """``make switch LANE=b CONFIG=new_file`` against the rendered stack (the same script directly without make)."""
    key_file = st.dir / "var" / "secrets" / "admin.key"
    args = ["--gateway", st.url("gateway"), "--admin-key-file", str(key_file), "--step-hold-s", f"{hold_s:g}",
            "--health-timeout-s", "180", "--smoke-timeout-s", "120", "--state-dir", str(st.dir / "var" / "rollout")]
    if shutil.which("make"):
        cmd = ["make", "--no-print-directory", "-C", str(REPO), "switch", "LANE=b", f"CONFIG={new_file}",
               f"SUPERVISOR_CONF={st.conf}", f"VPY={st.python}", "SWITCH_ARGS=" + " ".join(args)]
    else:
        cmd = [st.python, str(REPO / "deploy" / "switch_lane.py"), "--supervisor-config", str(st.conf),
               "--lane", "b", "--config", str(new_file), *args]
    env = {**st.env, "PYTHONPATH": st.env.get("PYTHONPATH", str(REPO))}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    return r.returncode, r.stdout + r.stderr, cmd


def build_model(out_dir: Path) -> Path:
    from tests.engine.hf_models import MAKERS, to_gguf

    hf_dir, _ = MAKERS["qwen3moe"](out_dir / "qwen3moe")
    return to_gguf(hf_dir, out_dir / "qwen3moe.q8_0.gguf", "q8_0")


def run(model: Path, device_a: str, device_b: str, device_switch: str, work: Path, kv_tokens: int = 2048,
        hold_s: float = 3.0, clients: int = 4, wrap: bool = False, lane_extra: dict[str, dict[str, Any]] | None = None,
        switch_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole check; returns a report (also on failure: raised with the report in ``args[1]``).
    ``lane_extra``: more keys of each lane's file (by program); ``switch_extra``: keys lane B's new file changes
    besides the device (e.g. its ``gpu_budget_gb``: the switch then moves it between budgets)."""
    report: dict[str, Any] = {"devices": {"a": device_a, "b": device_b, "b_after_switch": device_switch},
                              "model": str(model), "kv_tokens": kv_tokens, "lane_extra": lane_extra or {},
                              "switch_extra": switch_extra or {}}
    st = render_stack(work, model, device_a, device_b, kv_tokens, wrap, lane_extra)
    t0 = time.monotonic()
    st.start()
    try:
        st.wait_stack(240.0)
        report["ready_s"] = round(time.monotonic() - t0, 1)
        st.say(f"stack ready in {report['ready_s']} s (lane A {device_a}, lane B {device_b})")
        infos = lane_infos(st)
        check_lane("lane_a", infos["lane_a"], device_a)
        check_lane("lane_b", infos["lane_b"], device_b)
        cores = {p: set(infos[p]["cores"]) for p in PROGRAMS}
        if len(os.sched_getaffinity(0)) > 1 and cores["lane_a"] & cores["lane_b"]:
            raise StackCheckError(f"the lanes share cores: {cores}")
        report["before"] = {p: {k: infos[p][k] for k in ("device", "gpu", "gpu_info", "cores", "threads")}
                            for p in PROGRAMS}
        st.say("lanes: " + "; ".join(f"{p} device {infos[p]['device']} cores {infos[p]['cores']} gpu_info "
                                     f"{infos[p]['gpu_info']}" for p in PROGRAMS))
        scheduler = tomllib.loads((work / "lane_b.toml").read_text()).get("scheduler", {})
        step_tokens = max(int(scheduler.get("max_batch_tokens", 256)), 512)
        lanes = {p: tomllib.loads((work / f"{p}.toml").read_text()) for p in PROGRAMS}
        budgets = lane_budgets(model, lanes, kv_tokens, step_tokens)
        report["budget_bytes"] = budgets
        check_vram(st, infos, budgets, report)

        # the load below measures the switch, not the gateway's per-key defaults (600 requests a minute)
        code, body = _json("POST", st.url("gateway") + "/v1/admin/keys",
                           {"name": "gpu-stack", "limits": dict.fromkeys(KEY_LIMITS)}, key=ADMIN_KEY)
        if code not in (200, 201):
            raise StackCheckError(f"creating an API key: HTTP {code} {body}")
        key = str(body["key"])
        report["answered_before"] = answer_through_gateway(st, key, {"a", "b"})
        st.say(f"both lanes answered through the gateway: {report['answered_before']}")
        report["greedy_text"] = same_greedy_text(st, key)
        st.say(f"the same greedy completion from lane a ({device_a}) and lane b ({device_b}): "
               f"{report['greedy_text']['a']!r}")

        moved = dict(lanes["lane_b"], device=device_switch, **(switch_extra or {}))
        if moved == lanes["lane_b"]:  # the CPU rehearsal: a change the switch can see
            moved["kv_tokens"] = kv_tokens - 512
        new_file = work / "lane_b_moved.toml"
        new_file.write_text(dump_toml(moved))
        with Load(st.url("gateway"), key, clients) as load:
            deadline = time.monotonic() + 60
            while load.ok < 2 * clients and not load.failures and time.monotonic() < deadline:
                time.sleep(0.1)
            before_switch = load.snapshot()
            t_sw = time.monotonic()
            code, text, cmd = switch_lane_b(st, new_file, hold_s)
            report["switch"] = {"exit": code, "seconds": round(time.monotonic() - t_sw, 1), "command": cmd[:3],
                                "output_tail": text.strip().splitlines()[-12:]}
            st.say(f"switch exit {code} in {report['switch']['seconds']} s")
            for line in text.strip().splitlines()[-14:]:
                st.say("  " + line)
            after = load.snapshot()
            deadline = time.monotonic() + 60
            while (load.snapshot().get("b", 0) <= after.get("b", 0) and not load.failures
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            infos_after = lane_infos(st)
            budgets_after = lane_budgets(model, {**lanes, "lane_b": moved}, kv_tokens, step_tokens)
            report["budget_bytes_after"] = budgets_after
            check_vram(st, infos_after, budgets_after, report)  # lane B on its new device / budget, under load
        report["load"] = {"clients": clients, "ok": load.ok, "failed": len(load.failures),
                          "failures": load.failures[:5], "by_lane": load.snapshot(),
                          "by_lane_before_switch": before_switch}
        st.say(f"load: {load.ok} answered, {len(load.failures)} failed, by lane {load.snapshot()}")
        if code != 0:
            raise StackCheckError(f"make switch exited {code}:\n{text[-3000:]}")
        if load.failures:
            raise StackCheckError(f"{len(load.failures)} request(s) failed under the switch: {load.failures[:3]}")
        if load.snapshot().get("b", 0) <= after.get("b", 0):
            raise StackCheckError(f"no request reached lane b after the switch: {load.snapshot()}")
        check_lane("lane_b", infos_after["lane_b"], device_switch)
        check_lane("lane_a", infos_after["lane_a"], device_a)
        report["after"] = {p: {k: infos_after[p][k] for k in ("device", "gpu", "gpu_info", "cores", "threads")}
                           for p in PROGRAMS}
        report["ok"] = True
        return report
    except (StackCheckError, StackError) as e:
        report["ok"] = False
        report["error"] = str(e)[:4000]
        report["logs"] = {n: st.log_tail(n, 4000) for n in ("lane_a", "lane_b", "gateway", "supervisord")}
        raise StackCheckError(str(e), report) from None
    finally:
        report["log"] = st.log
        st.stop(timeout=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.engine.gpu.stack_on_gpu", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", type=Path, help="GGUF for both lanes (default: a small random Qwen3-MoE, built here)")
    p.add_argument("--device-a", default="cuda:0")
    p.add_argument("--device-b", default="cpu")
    p.add_argument("--device-switch", default="cuda:0", help="lane B's device after make switch")
    p.add_argument("--kv-tokens", type=int, default=2048)
    p.add_argument("--hold-s", type=float, default=3.0, help="each traffic step of the switch (make switch: 30)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--hybrid", default=None, metavar="A,B,SWITCH",
                   help="hybrid placement: each lane's gpu_budget_gb as the fraction of the routed experts it leaves "
                        "resident (lane A, lane B, lane B after the switch), e.g. 0.3,0.3,0.7")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--wrap-python", action="store_true",
                   help="run the stack through the PYTHONPATH wrapper even with a .venv (as on the GPU box)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stk", dir="/tmp") as d:  # short: supervisord's socket path
        work = Path(d)
        model = args.model or build_model(work / "model")
        (work / "s").mkdir()
        lane_extra, switch_extra = None, None
        if args.hybrid:
            fa, fb, fs = (hybrid_budget_gb(model, float(f), args.kv_tokens) for f in args.hybrid.split(","))
            lane_extra = {"lane_a": {"gpu_budget_gb": fa}, "lane_b": {"gpu_budget_gb": fb}}
            switch_extra = {"gpu_budget_gb": fs}
        try:
            report = run(model, args.device_a, args.device_b, args.device_switch, work / "s", args.kv_tokens,
                         args.hold_s, args.clients, args.wrap_python, lane_extra, switch_extra)
            rc = 0
        except (StackCheckError, StackError) as e:
            report = e.args[1] if len(e.args) > 1 else {"ok": False, "error": str(e)}
            print(f"FAILED: {e.args[0]}", flush=True)
            rc = 1
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"must-show 4: {'PASS' if rc == 0 else 'FAIL'}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
