"""The eleven scenarios, in the order a full run takes them. Each module has ``NAME``, ``CORRECTNESS``
(its checks gate CI), ``KINDS`` (the target kinds it runs against; others skip it with a reason) and
``async def run(ctx, res)``."""

from __future__ import annotations

from types import ModuleType

from bench.harness.scenarios import (
    babilong,
    concurrency,
    crash,
    hostile,
    long_prefill,
    memory,
    passkey,
    rag,
    single,
    soak,
    switch,
)

SCENARIOS: dict[str, ModuleType] = {m.NAME: m for m in (single, concurrency, long_prefill, passkey, babilong, rag,
                                                        memory, soak, crash, hostile, switch)}
