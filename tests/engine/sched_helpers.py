"""Driving a Scheduler step by step in the engine's tests: each request's outputs gathered as they
come, the preemptions counted."""

from __future__ import annotations

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
