"""CPU lists and pinning, shared by the lanes and the gateway (each pins its own process at start)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["cpu_list_value", "parse_cpu_list", "pin_process"]


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (the taskset / cgroup cpulist syntax)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in CPU list {text!r}")
        lo, sep, hi = part.partition("-")
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            raise ValueError(f"bad CPU list entry {part!r} (want N or N-M)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad CPU range {part!r}")
        out.extend(range(a, b + 1))
    return out


def cpu_list_value(v: object) -> object:
    """A config field's CPU list before validation: a number (an environment value decodes as JSON, so ``CORES=3``
    arrives as 3) is that one CPU, a string the cpulist syntax; anything else as given."""
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    return parse_cpu_list(v) if isinstance(v, str) else v


def pin_process(cores: Sequence[int]) -> None:
    """Pin every thread of this process (threads started later inherit the mask)."""
    os.sched_setaffinity(0, cores)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that exited meanwhile
            pass
