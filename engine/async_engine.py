"""asyncio face of the scheduler: the step loop runs in its own thread.

    async for out in engine.stream(prompt_ids, params):
        print(out.text, end="")

A consumer that stops iterating (client disconnect, cancellation) aborts its request;
the scheduler frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import RequestOutput, Scheduler, SchedulerConfig, StepReport


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class AsyncEngine:
    """Owns an Engine and its Scheduler; thread-safe add/abort, asyncio streaming."""

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None,
                 on_step: Callable[[StepReport], None] | None = None) -> None:
        self.engine = engine
        self.scheduler = Scheduler(engine, config)
        self.on_step = on_step
        self.recent_steps: deque[StepReport] = deque(maxlen=256)
        self._sinks: dict[str, _Sink] = {}
        self._sinks_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()
        self.loop_error: BaseException | None = None

    # ------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.scheduler.step()
            except BaseException as exc:  # keep serving; fail what is in flight
                self.loop_error = exc
                time.sleep(0.01)
                continue
            report = self.scheduler.last_report
            if report is not None:
                self.recent_steps.append(report)
                if self.on_step is not None:
                    try:
                        self.on_step(report)
                    except Exception:
                        pass
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

    # ------------------------------------------------------------ API
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> tuple[str, asyncio.Queue[RequestOutput]]:
        """Queue a request; outputs arrive on the returned queue (call from the event loop).

        Raises the scheduler's typed errors (OverloadedError, KVCapacityError, ValueError)
        at once. The caller must abort(request_id) if it stops reading before the final output.
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
