"""The processes behind the target: pids from supervisord (when its config is given) or from each
lane's ``/v1/lane``, resident memory from /proc, and supervisorctl for the fault scenarios."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from bench.harness.client import Target

BIN = Path(sys.executable).parent  # the venv's bin: supervisorctl
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # deploy/ (supervisord helpers) is a folder of scripts, not an installed package
    sys.path.append(str(REPO))


def supervised_pids(conf: Path) -> dict[str, int]:
    """{program: pid} of the running programs of ``conf`` (lanes, gateway, event listener)."""
    from deploy.run import process_states

    try:
        states = process_states(conf)
    except OSError:
        return {}
    return {name: int(p["pid"]) for name, p in states.items() if p.get("pid")}


async def process_pids(target: Target, conf: Path | None) -> dict[str, int]:
    if conf is not None:
        pids = await asyncio.to_thread(supervised_pids, conf)
        if pids:
            return pids
    out = {}
    for lane in target.lanes:
        status, info = await target.get_json(str(lane["url"]) + "/v1/lane")
        if status == 200 and isinstance(info, dict) and info.get("pid"):
            out[f"lane_{info.get('lane') or lane.get('name')}"] = int(info["pid"])
    return out


def rss_mb(pid: int) -> float | None:
    """Resident set size in MiB (None when the process is gone or not ours to read)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


async def supervisorctl(conf: Path, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(str(BIN / "supervisorctl"), "-c", str(conf), *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return int(proc.returncode or 0), out.decode(errors="replace").strip()


def lane_config_file(conf: Path, program: str) -> Path:
    """The lane TOML file that ``program``'s command reads (its ``--config``)."""
    from deploy.run import lane_programs

    argv = lane_programs(conf).get(program) or []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
    raise FileNotFoundError(f"{conf}: {program} has no --config FILE")
