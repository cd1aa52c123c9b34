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
