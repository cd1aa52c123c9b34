"""What every scenario gets: the target, its peers, the mode, where to write, progress bars, and
a closed-loop load generator shared by the scenarios that need traffic in the background."""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.harness.client import ChatResult, Target

_UNIQUE = itertools.count()


def unique_prefix() -> str:
    """A short distinct opening: prompts that must not share a cached prefix start with it."""
    return f"[run {time.time_ns() % 10**9} #{next(_UNIQUE)}] "


@dataclass
class Context:
    target: Target
    quick: bool
    out: Path  # this run's report folder (plots go here)
    peers: list[Target] = field(default_factory=list)  # a plain lane / llama.cpp for side-by-side figures
    supervisor_conf: Path | None = None  # crash and switch drive supervisord through it
    progress: bool = True
    seed: int = 1234
    soak_s: float | None = None  # soak's duration (default: 600 full, 60 quick)

    def bar(self, total: int | None, desc: str) -> tqdm:  # type: ignore[type-arg]
        return tqdm(total=total, desc=desc, file=sys.stderr, disable=not self.progress, leave=False,
                    dynamic_ncols=True, mininterval=0.5)

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{name}")

    def q(self, quick: Any, full: Any) -> Any:
        """The quick or the full value of a parameter."""
        return quick if self.quick else full


Request = Callable[[int], Awaitable[ChatResult]]


async def closed_loop(workers: int, request: Request, stop: asyncio.Event,
                      on_result: Callable[[ChatResult], None] | None = None,
                      max_requests: int | None = None) -> list[ChatResult]:
    """``workers`` clients, each sending its next request as soon as the last one ends, until ``stop``
    is set (requests in flight then finish) or ``max_requests`` were sent in all."""
    results: list[ChatResult] = []
    counter = itertools.count()

    async def worker() -> None:
        while not stop.is_set():
            i = next(counter)
            if max_requests is not None and i >= max_requests:
                return
            res = await request(i)
            results.append(res)
            if on_result is not None:
                on_result(res)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return results


async def sleep_until(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
