"""Continuous batching on the real default model: invariance, preemption, prefix cache, abort."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from engine.async_engine import AsyncEngine
from engine.block_manager import KVCapacityError
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import OverloadedError, Scheduler, SchedulerConfig, collect_text
from tests.engine.gguf_factory import make_tiny_gguf
from tests.engine.sched_helpers import abort_every_other, drain, finish_into, step_into

TOPICS = ["the sea", "mountains", "a robot", "coffee", "rain", "a city at night", "an old book", "the moon",
          "a garden", "winter", "a train", "music", "a cat", "the desert", "a river", "friendship"]


def greedy(n: int = 16, **kw: object) -> SamplingParams:
    return SamplingParams.parse(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    return [engine.render_chat([{"role": "user", "content": f"Write one sentence about {t}."}]) for t in TOPICS]


def run_alone(engine: Engine, ids: list[int], params: SamplingParams) -> tuple[list[int], str, str | None]:
    sched = Scheduler(engine, SchedulerConfig(prefix_cache=False))
    rid = sched.add(ids, params)
    return collect_text(sched.run_to_completion()[rid])


@pytest.fixture(scope="module")
def alone(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], str, str | None]]:
    return [run_alone(engine, p, greedy()) for p in prompts]


def test_sixteen_requests_together_equal_alone(engine: Engine, prompts: list[list[int]], alone: list) -> None:
    sched = Scheduler(engine)
    rids = [sched.add(p, greedy()) for p in prompts]
    out = sched.run_to_completion()
    assert [collect_text(out[r]) for r in rids] == alone
    assert engine.blocks.num_free == engine.blocks.n_blocks


def test_staggered_arrivals_equal_alone(engine: Engine, prompts: list[list[int]], alone: list) -> None:
    sched = Scheduler(engine, SchedulerConfig(max_batch_tokens=64))
    out: dict[str, list] = {}
    rids: list[str] = []
    for i, p in enumerate(prompts):
        rids.append(sched.add(p, greedy()))
        for _ in range(i % 3 + 1):  # some steps between arrivals
            step_into(sched, out)
    finish_into(sched, out)
    assert [collect_text(out[r]) for r in rids] == alone


def test_seeded_sampling_same_alone_and_in_busy_batch(engine: Engine, prompts: list[list[int]]) -> None:
    params = SamplingParams.parse(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    ref = run_alone(engine, prompts[0], params)
    sched = Scheduler(engine)
    noise = [sched.add(p, SamplingParams.parse(temperature=1.0, max_tokens=12)) for p in prompts[1:9]]
    sched.step()
    rid = sched.add(prompts[0], params)
    out = sched.run_to_completion()
    assert collect_text(out[rid]) == ref
    assert all(out[n][-1].finished for n in noise)


def test_kv_exhaustion_preempts_and_recomputes(model_path: Path, prompts: list[list[int]],
                                               alone: list) -> None:
    """12 concurrent requests in an arena far too small for all: all complete, exactly."""
    with Engine.open(model_path, threads=2, kv_tokens=288, block_size=16) as small:
        sched = Scheduler(small, SchedulerConfig(max_batch_tokens=128))
        initial = small.blocks.num_free
        rids = [sched.add(p, greedy()) for p in prompts[:12]]
        out, preempted = drain(sched)
        assert preempted > 0, "the arena was meant to be too small"
        assert [collect_text(out[r]) for r in rids] == alone[:12]
        assert small.blocks.num_free == initial
        assert all(r == 0 for r in small.blocks.ref)


def test_request_that_can_never_fit_is_a_typed_error(model_path: Path) -> None:
    with Engine.open(model_path, threads=1, kv_tokens=64) as small:
        sched = Scheduler(small)
        with pytest.raises(KVCapacityError, match="context window of 64"):
            sched.add(list(range(100)), greedy())


def test_prefix_cache_reuses_a_long_shared_prefix(engine: Engine) -> None:
    doc = " ".join(f"Fact {i}: the value of item {i} is {i * 7 % 13}." for i in range(90))
    head = engine.tokenizer.encode(doc)[:1000]
    q1 = head + engine.tokenizer.encode(" Question: what is the value of item 3?")
    q2 = head + engine.tokenizer.encode(" Question: what is the value of item 5?")
    assert len(head) == 1000
    sched = Scheduler(engine)
    r1 = sched.add(q1, greedy(8))
    out1 = sched.run_to_completion()[r1]
    r2 = sched.add(q2, greedy(8))
    out2 = sched.run_to_completion()[r2]
    assert out1[-1].cached_tokens == 0
    assert out2[-1].cached_tokens >= 900
    assert collect_text(out2) == run_alone(engine, q2, greedy(8))


def test_overload_is_typed_with_retry_after(engine: Engine, prompts: list[list[int]]) -> None:
    sched = Scheduler(engine, SchedulerConfig(max_waiting=2))
    sched.add(prompts[0], greedy(2))
    sched.add(prompts[1], greedy(2))
    with pytest.raises(OverloadedError) as ei:
        sched.add(prompts[2], greedy(2))
    assert ei.value.retry_after > 0
    sched.run_to_completion()
    sched.add(prompts[2], greedy(2))  # room again once the queue drained
    sched.run_to_completion()


def test_stop_string_and_multibyte_streaming(engine: Engine) -> None:
    ids = engine.render_chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    full = run_alone(engine, ids, greedy(30))
    assert "Paris" in full[1]
    cut = run_alone(engine, ids, greedy(30, stop=["Par"]))
    assert cut[2] == "stop"
    assert cut[1] == full[1][: full[1].index("Par")]
    zh = engine.render_chat([{"role": "user", "content": "Say hello in Chinese: 你好，世界! 🌍"}])
    sched = Scheduler(engine)
    rid = sched.add(zh, SamplingParams.parse(temperature=1.0, seed=3, max_tokens=40))
    for o in sched.run_to_completion()[rid]:
        assert "\ufffd" not in o.text or o.finished  # never half a character mid-stream


def test_abort_half_of_100_streams(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path / "tiny.gguf")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 300, size=int(n))) for n in rng.integers(4, 30, size=100)]
    params = SamplingParams.parse(temperature=0.0, max_tokens=24, ignore_eos=True)
    with Engine.open(path, threads=2, kv_tokens=8192) as eng:
        ref_sched = Scheduler(eng)
        ref_ids = [ref_sched.add(p, params) for p in prompts]
        ref = ref_sched.run_to_completion()
        sched = Scheduler(eng, SchedulerConfig(max_num_seqs=128, max_batch_tokens=4096))
        rids = [sched.add(p, params) for p in prompts]
        out, used_before = abort_every_other(sched, rids, 6)
        held = sum(len(req.blocks) for req in sched.running)
        assert eng.blocks.n_blocks - eng.blocks.num_free == held < used_before
        finish_into(sched, out)
        for r, rr in zip(rids[1::2], ref_ids[1::2], strict=True):
            assert collect_text(out[r]) == collect_text(ref[rr])
        assert eng.blocks.num_free == eng.blocks.n_blocks


async def test_async_stream_and_cancellation_frees_the_slot(engine: Engine, prompts: list[list[int]]) -> None:
    aeng = AsyncEngine(engine)
    try:
        outs = await aeng.generate(prompts[0], greedy())
        assert outs[-1].finished and collect_text(outs)[0] == run_alone(engine, prompts[0], greedy())[0]

        async def consume_three() -> None:
            n = 0
            async for _ in aeng.stream(prompts[1], greedy(200)):
                n += 1
                if n == 3:
                    break

        await consume_three()
        for _ in range(100):
            if not aeng.scheduler.has_work():
                break
            await asyncio.sleep(0.02)
        assert not aeng.scheduler.running
        assert engine.blocks.num_free == engine.blocks.n_blocks
    finally:
        aeng.shutdown()


# ---------------------------------------------------------------------------- accounting and failure


def test_aborting_preempted_requests_keeps_the_queue_counters_exact(tiny_path: Path) -> None:
    """Requests preempted back to the waiting queue and then aborted must not be counted out
    twice: the max_waiting limit (the lane's 429) has to hold exactly, round after round."""
    rng = np.random.default_rng(7)
    params = SamplingParams.parse(temperature=0.0, max_tokens=60, ignore_eos=True)
    with Engine.open(tiny_path, threads=1, kv_tokens=128, block_size=16) as eng:  # 8 blocks: far too few
        sched = Scheduler(eng, SchedulerConfig(max_waiting=6, max_batch_tokens=64))
        aborted_preempted = 0
        for _ in range(25):
            rids = [sched.add([int(t) for t in rng.integers(0, 300, size=20)], params) for _ in range(6)]
            for _ in range(400):
                sched.step()
                victims = [r for r in sched.waiting if r.preemptions > 0]
                if victims:
                    break
            assert victims, "the arena was meant to force preemption"
            for r in victims:
                sched.abort(r.request_id)
            sched.step()
            aborted_preempted += len(victims)
            for rid in rids:
                sched.abort(rid)
            sched.step()
            assert not sched.has_work()
            assert sched.queued == (0, 0)
        assert aborted_preempted >= 25
        for _ in range(6):  # the limit is still exactly max_waiting
            sched.add([1, 2, 3], params)
        with pytest.raises(OverloadedError):
            sched.add([1, 2, 3], params)
        for rid in [r.request_id for r in sched.waiting] + [r.request_id for r in sched._inbox]:
            sched.abort(rid)
        sched.step()
        assert sched.queued == (0, 0)
        assert eng.blocks.num_free == eng.blocks.n_blocks


def test_a_zero_token_chunk_is_refused_before_any_compute(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling raises after a request's last prefill chunk: its tokens are all computed and no
    token was added. Stepping again must refuse the 0-token chunk, not compute it with logit
    row len(tokens) - 1 (another request's row, or -1)."""
    from engine.scheduler import SchedulerError

    params = SamplingParams.parse(temperature=0.0, max_tokens=8, ignore_eos=True)
    with Engine.open(tiny_path, threads=1, kv_tokens=512) as eng:
        sched = Scheduler(eng, environ={"STRATA_DEVICE_GREEDY": "0"})  # greedy rows through the sampler
        sched.add(list(range(5, 40)), params)
        real = sched.sampler.sample
        calls = {"n": 0}

        def failing(*a: object, **kw: object) -> object:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("sampler blew up")
            return real(*a, **kw)

        monkeypatch.setattr(sched.sampler, "sample", failing)
        with pytest.raises(RuntimeError, match="sampler blew up"):
            sched.step()
        forwards = {"n": 0}
        real_forward = eng.forward
        monkeypatch.setattr(eng, "forward", lambda *a, **kw: (forwards.__setitem__("n", forwards["n"] + 1),
                                                              real_forward(*a, **kw))[1])
        with pytest.raises(SchedulerError, match="chunk of 0 tokens"):
            sched.step()
        assert forwards["n"] == 0
        outs = sched.fail_all("test")
        assert len(outs) == 1 and outs[0].finished and outs[0].error == "test"
        assert eng.blocks.num_free == eng.blocks.n_blocks


def test_fail_all_ends_everything_and_refuses_new_work(tiny_path: Path) -> None:
    from engine.scheduler import EngineFailedError

    params = SamplingParams.parse(temperature=0.0, max_tokens=50, ignore_eos=True)
    with Engine.open(tiny_path, threads=1, kv_tokens=128) as eng:
        sched = Scheduler(eng, SchedulerConfig(max_batch_tokens=32))
        rids = [sched.add(list(range(1, 30)), params) for _ in range(8)]  # running, waiting and inbox
        sched.step()
        sched.step()
        late = sched.add(list(range(1, 10)), params)  # still in the inbox
        assert sched.running and sched.waiting
        outs = sched.fail_all("engine loop failed: boom")
        assert sorted(o.request_id for o in outs) == sorted([*rids, late])
        assert all(o.finished and o.error == "engine loop failed: boom" for o in outs)
        assert sched.queued == (0, 0) and not sched.has_work()
        assert eng.blocks.num_free == eng.blocks.n_blocks
        with pytest.raises(EngineFailedError):
            sched.add([1, 2], params)
        with pytest.raises(EngineFailedError):
            sched.step()


def test_fault_switch_is_parsed_strictly() -> None:
    from engine.scheduler import parse_fault

    assert parse_fault(None) is None and parse_fault("") is None
    assert parse_fault("sample_raise_after_n_steps:3") == ("sample_raise_after_n_steps", 3)
    for bad in ("sample_raise_after_n_steps", "sample_raise_after_n_steps:x", "explode:1"):
        with pytest.raises(ValueError, match="STRATA_TEST_FAULT"):
            parse_fault(bad)


async def test_async_engine_loop_failure_fails_every_request(tiny_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The injected fault through the real loop thread: every request in flight gets an error
    output, on_failure runs once, and new submissions are refused."""
    from engine.scheduler import EngineFailedError

    monkeypatch.setenv("STRATA_TEST_FAULT", "sample_raise_after_n_steps:3")
    params = SamplingParams.parse(temperature=0.0, max_tokens=100, ignore_eos=True)
    failures: list[BaseException] = []
    with Engine.open(tiny_path, threads=1, kv_tokens=2048) as eng:
        aeng = AsyncEngine(eng, SchedulerConfig(max_batch_tokens=16), on_failure=failures.append)
        try:
            # the loop thread steps only once all six are queued: on a loaded box it reached step 3
            # before the last submit (CI, 2026-12-02), which then raised EngineFailedError instead
            # of joining the batch
            gate, real_step = threading.Event(), aeng.scheduler.step

            def gated_step() -> list:
                gate.wait()
                return real_step()

            monkeypatch.setattr(aeng.scheduler, "step", gated_step)
            queues = [aeng.submit(list(range(1, 20 + i)), params)[1] for i in range(6)]
            gate.set()

            async def read_until_finished(queue: asyncio.Queue) -> list:
                outs = [await queue.get()]
                while not outs[-1].finished:
                    outs.append(await queue.get())
                return outs

            results = await asyncio.wait_for(asyncio.gather(*(read_until_finished(q) for q in queues)), 60)
            for outs in results:
                assert outs[-1].finished and outs[-1].finish_reason == "abort"
                assert "InjectedFault" in (outs[-1].error or "")
            assert len(failures) == 1 and aeng.failed
            with pytest.raises(EngineFailedError):
                aeng.submit([1, 2, 3], params)
            assert eng.blocks.num_free == eng.blocks.n_blocks
        finally:
            aeng.shutdown()


def test_engine_generate_runs_through_the_scheduler(engine: Engine, prompts: list[list[int]], alone: list) -> None:
    """Engine.generate / Engine.stream are the scheduler's path: the same tokens and text as a
    scheduler run; closing a stream early frees its blocks."""
    res = engine.generate(prompts[0], max_tokens=16)
    assert (res.token_ids, res.text, res.finish_reason) == alone[0]
    it = engine.stream(prompts[1], greedy(100))
    next(it)
    next(it)
    it.close()
    assert engine.blocks.num_free == engine.blocks.n_blocks


def test_engine_leaves_the_garbage_collector_alone(tiny_path: Path) -> None:
    """gc.freeze() is process-wide: the lane's entry point calls it after the load, a library
    constructor must not (a test process or any host would have its GC changed under it)."""
    import gc

    before = gc.get_freeze_count()
    junk = [[i] for i in range(1000)]  # objects a freeze would move to the permanent generation
    with Engine.open(tiny_path, threads=1, kv_tokens=64):
        assert gc.get_freeze_count() == before
    del junk


def test_penalties_see_the_whole_history_through_the_scheduler(tiny_path: Path) -> None:
    """Penalty rows get their history as views of a growing int64 buffer (no per-step list
    copies); the tokens must equal a plain loop that hands the sampler Python lists, across
    the buffer's growth (70 slots for a 35-token prompt and 60 new tokens)."""
    from engine.sampling import Sampler

    params = SamplingParams.parse(temperature=0.0, max_tokens=60, ignore_eos=True, repetition_penalty=1.3,
                                  frequency_penalty=0.5, presence_penalty=0.2)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 300, size=35)]
    with Engine.open(tiny_path, threads=1, kv_tokens=256) as eng:
        sched = Scheduler(eng, SchedulerConfig(prefix_cache=False))
        rid = sched.add(prompt, params)
        got = collect_text(sched.run_to_completion()[rid])[0]
        blocks = eng.blocks.allocate(-(-(len(prompt) + 60) // eng.block_size))
        try:
            logits = eng.prefill(prompt, blocks)
            out: list[int] = []
            for _ in range(60):
                tok = int(Sampler().sample(logits[None, :], [params], [None], [prompt], [out]).tokens[0])
                out.append(tok)
                logits = eng.prefill([tok], blocks, len(prompt) + len(out) - 1)
        finally:
            eng.blocks.release(blocks)
    assert got == out
    assert len(set(out)) > 10  # the penalties really steered it (greedy alone repeats a few tokens)
