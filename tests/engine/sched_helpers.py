"""Driving the engine in its tests: a Scheduler step by step (each request's outputs gathered as they come, the
preemptions counted), and prompts prefilled together in one forward step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.engine import Engine
from engine.scheduler import RequestOutput, Scheduler


def step_into(sched: Scheduler, out: dict[str, list[RequestOutput]]) -> int:
    """One step, its outputs appended to ``out`` under their request ids; the requests it preempted."""
    for o in sched.step():
        out.setdefault(o.request_id, []).append(o)
    return sched.last_report.n_preempted if sched.last_report else 0


def drain(sched: Scheduler) -> tuple[dict[str, list[RequestOutput]], int]:
    """Steps until the scheduler has no work: every request's outputs and the preemptions on the way."""
    out: dict[str, list[RequestOutput]] = {}
    preempted = 0
    while sched.has_work():
        preempted += step_into(sched, out)
    return out, preempted


def finish_into(sched: Scheduler, out: dict[str, list[RequestOutput]]) -> None:
    """The scheduler run to completion, its outputs appended to ``out`` under their request ids."""
    for k, v in sched.run_to_completion().items():
        out.setdefault(k, []).extend(v)


def abort_every_other(sched: Scheduler, rids: list[str], steps: int) -> tuple[dict[str, list[RequestOutput]], int]:
    """``steps`` steps, then every other request (``rids[::2]``) aborted and one more step, which must end each
    of them with finish_reason "abort": the outputs so far and the KV blocks in use before the aborts."""
    out: dict[str, list[RequestOutput]] = {}
    for _ in range(steps):
        step_into(sched, out)
    blocks = sched.engine.blocks
    used_before = blocks.n_blocks - blocks.num_free
    for r in rids[::2]:
        sched.abort(r)
    step_into(sched, out)  # the very next step frees them
    assert all(out[r][-1].finish_reason == "abort" for r in rids[::2])
    return out, used_before


def prefill_together(eng: Engine, prompts: Sequence[Sequence[int]], spare: int = 0) -> tuple[np.ndarray, list]:
    """The prompts in one forward step, each its own sequence on fresh blocks with room for ``spare`` more tokens:
    every row's logits ([sum of the prompts' lengths, V], in prompt order) and the block tables, which the caller
    hands back with ``release_tables``."""
    tables = [eng.blocks.allocate(-(-(len(p) + spare) // eng.block_size)) for p in prompts]
    tokens: list[int] = []
    pos: list[int] = []
    seq: list[int] = []
    for i, p in enumerate(prompts):
        tokens += p
        pos += list(range(len(p)))
        seq += [i] * len(p)
    return eng.forward(tokens, pos, seq, tables, list(range(len(tokens)))), tables


def release_tables(eng: Engine, tables: list) -> None:
    """The blocks of ``prefill_together``'s tables back to the engine's block manager."""
    for t in tables:
        eng.blocks.release(t)
