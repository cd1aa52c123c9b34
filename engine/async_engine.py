"""asyncio face of the scheduler: the step loop runs in its own thread.

    async for out in engine.stream(prompt_ids, params):
        print(out.text, end="")

A consumer that stops iterating (client disconnect, cancellation) aborts its request;
the scheduler frees its KV blocks before the next step.

If a step raises, the loop does not retry: a half-applied step leaves the scheduler's
bookkeeping in doubt (a request whose last prefill chunk was computed but whose token was
never sampled would next be planned as a 0-token chunk). Instead every request in flight
(running, waiting, not yet seen) gets a final output carrying the error, new submissions
raise :class:`~engine.scheduler.EngineFailedError`, the loop thread ends and ``on_failure``
is called once: a lane reports ``failed`` (``/health`` 503) and exits so that its
supervisor restarts it with a fresh engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import EngineFailedError, RequestOutput, Scheduler, SchedulerConfig, StepReport

__all__ = ["AsyncEngine", "EngineFailedError"]

log = logging.getLogger("strata.engine")


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class AsyncEngine:
    """Owns an Engine and its Scheduler; thread-safe add/abort, asyncio streaming."""

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None,
                 on_step: Callable[[StepReport], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.scheduler = Scheduler(engine, config)
        self.on_step = on_step
        self.on_failure = on_failure
        self.recent_steps: deque[StepReport] = deque(maxlen=256)
        self.loop_error: BaseException | None = None
        self._sinks: dict[str, _Sink] = {}
        self._sinks_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()

    @property
    def failed(self) -> bool:
        return self.loop_error is not None

    # ------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.scheduler.step()
            except BaseException as exc:  # no retry: fail everything in flight, then stop
                self._fail(exc)
                return
            report = self.scheduler.last_report
            if report is not None:
                self.recent_steps.append(report)
                if self.on_step is not None:
                    try:
                        self.on_step(report)
                    except Exception:
                        log.exception("on_step callback failed")
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._sinks_lock:
                sink = self._sinks.get(out.request_id)
                if out.finished:
                    self._sinks.pop(out.request_id, None)
            if sink is not None:
                try:
                    sink.loop.call_soon_threadsafe(sink.queue.put_nowait, out)
                except RuntimeError:  # the consumer's loop is closed
                    pass

    def _fail(self, exc: BaseException) -> None:
        self.loop_error = exc
        reason = f"engine loop failed: {type(exc).__name__}: {exc}"
        log.error("%s", reason, exc_info=exc)
        outputs = self.scheduler.fail_all(reason)
        if self.on_failure is not None:  # first: a lane is "failed" before any handler sees its error
            try:
                self.on_failure(exc)
            except Exception:
                log.exception("on_failure callback failed")
        self._deliver(outputs)
        # a sink registered whose request the scheduler never saw (submit raced the failure)
        with self._sinks_lock:
            orphans = list(self._sinks)
        self._deliver([RequestOutput(rid, [], "", [], True, "abort", 0, 0, 0, reason) for rid in orphans])

    # ------------------------------------------------------------ API
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> tuple[str, asyncio.Queue[RequestOutput]]:
        """Queue a request; outputs arrive on the returned queue (call from the event loop).

        Raises the scheduler's typed errors (OverloadedError, KVCapacityError, ValueError,
        EngineFailedError) at once. The caller must abort(request_id) if it stops reading
        before the final output.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = request_id or f"req-{id(queue):x}-{time.monotonic_ns()}"
        with self._sinks_lock:
            if rid in self._sinks:
                raise ValueError(f"duplicate request id {rid!r}")
            self._sinks[rid] = _Sink(loop, queue)
        try:
            self.scheduler.add(prompt_ids, params, rid)
        except BaseException:
            with self._sinks_lock:
                self._sinks.pop(rid, None)
            raise
        self._wake.set()
        return rid, queue

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps produce them; abort on early exit."""
        rid, queue = self.submit(prompt_ids, params, request_id)
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> list[RequestOutput]:
        return [o async for o in self.stream(prompt_ids, params, request_id)]

    def abort(self, request_id: str) -> None:
        with self._sinks_lock:
            self._sinks.pop(request_id, None)
        self.scheduler.abort(request_id)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
