"""Continuous batching on the real default model: invariance, preemption, prefix cache, abort."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from engine.async_engine import AsyncEngine
from engine.block_manager import KVCapacityError
from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import OverloadedError, Scheduler, SchedulerConfig, collect_text
from tests.engine.gguf_factory import make_random_gguf

TOPICS = ["the sea", "mountains", "a robot", "coffee", "rain", "a city at night", "an old book", "the moon",
          "a garden", "winter", "a train", "music", "a cat", "the desert", "a river", "friendship"]


def greedy(n: int = 16, **kw: object) -> SamplingParams:
    return SamplingParams.parse(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_default_model(default_model_path())


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Engine:
    eng = Engine.open(model_path, threads=2, kv_tokens=8192)
    yield eng
    eng.close()


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
            for o in sched.step():
                out.setdefault(o.request_id, []).append(o)
    for k, v in sched.run_to_completion().items():
        out.setdefault(k, []).extend(v)
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
        preempted = 0
        out: dict[str, list] = {}
        while sched.has_work():
            for o in sched.step():
                out.setdefault(o.request_id, []).append(o)
            preempted += sched.last_report.n_preempted
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
    path = make_random_gguf(tmp_path / "tiny.gguf", n_vocab=300, n_layer=2, weight_type=__import__("gguf").GGMLQuantizationType.Q8_0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 300, size=int(n))) for n in rng.integers(4, 30, size=100)]
    params = SamplingParams.parse(temperature=0.0, max_tokens=24, ignore_eos=True)
    with Engine.open(path, threads=2, kv_tokens=8192) as eng:
        ref_sched = Scheduler(eng)
        ref_ids = [ref_sched.add(p, params) for p in prompts]
        ref = ref_sched.run_to_completion()
        sched = Scheduler(eng, SchedulerConfig(max_num_seqs=128, max_batch_tokens=4096))
        rids = [sched.add(p, params) for p in prompts]
        out: dict[str, list] = {}
        for _ in range(6):
            for o in sched.step():
                out.setdefault(o.request_id, []).append(o)
        used_before = eng.blocks.n_blocks - eng.blocks.num_free
        for r in rids[::2]:
            sched.abort(r)
        for o in sched.step():  # the very next step frees them
            out.setdefault(o.request_id, []).append(o)
        assert all(out[r][-1].finish_reason == "abort" for r in rids[::2])
        held = sum(len(req.blocks) for req in sched.running)
        assert eng.blocks.n_blocks - eng.blocks.num_free == held < used_before
        for k, v in sched.run_to_completion().items():
            out.setdefault(k, []).extend(v)
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
