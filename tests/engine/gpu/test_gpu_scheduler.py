"""The serving core on the GPU: the scheduler's guarantees with device="cuda:0" (batched ==
alone, preemption by recompute without leaks, prefix-cache hits, aborts freeing blocks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, collect_text
from tests.engine.gguf_factory import make_random_gguf
from tests.engine.gpu._env import requires_gpu

pytestmark = requires_gpu

VOCAB = 300


def greedy(n: int = 16) -> SamplingParams:
    return SamplingParams.parse(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_gguf(tmp_path_factory.mktemp("gsched") / "moe.gguf", n_vocab=VOCAB, n_layer=2, n_embd=128,
                            n_head=4, n_head_kv=2, n_ff=128, n_expert=8, n_expert_used=2,
                            weight_type=GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def gpu(model_path: Path) -> Engine:
    eng = Engine.open(model_path, device="cuda:0", kv_tokens=8192)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, VOCAB, size=int(n))] for n in rng.integers(4, 60, size=16)]


def run_alone(eng: Engine, ids: list[int], params: SamplingParams) -> list[int]:
    s = Scheduler(eng, SchedulerConfig(prefix_cache=False))
    rid = s.add(ids, params)
    return collect_text(s.run_to_completion()[rid])[0]


@pytest.fixture(scope="module")
def alone(gpu: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [run_alone(gpu, p, greedy()) for p in prompts]


def test_gpu_tokens_equal_cpu(model_path: Path, prompts: list[list[int]], alone: list[list[int]]) -> None:
    with Engine.open(model_path, threads=2, kv_tokens=4096) as cpu:
        assert [run_alone(cpu, p, greedy()) for p in prompts[:4]] == alone[:4]


def test_batched_equals_alone(gpu: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    sched = Scheduler(gpu, SchedulerConfig(max_batch_tokens=64))
    rids = [sched.add(p, greedy()) for p in prompts]
    out = sched.run_to_completion()
    assert [collect_text(out[r])[0] for r in rids] == alone
    assert gpu.blocks.num_free == gpu.blocks.n_blocks


def test_preemption_recomputes_without_leaks(model_path: Path, prompts: list[list[int]],
                                             alone: list[list[int]]) -> None:
    with Engine.open(model_path, device="cuda:0", kv_tokens=256, block_size=16) as small:
        sched = Scheduler(small, SchedulerConfig(max_batch_tokens=128))
        rids = [sched.add(p, greedy()) for p in prompts[:12]]
        out: dict[str, list] = {}
        preempted = 0
        while sched.has_work():
            for o in sched.step():
                out.setdefault(o.request_id, []).append(o)
            preempted += sched.last_report.n_preempted
        assert preempted > 0, "the arena was meant to be too small"
        assert [collect_text(out[r])[0] for r in rids] == alone[:12]
        assert small.blocks.num_free == small.blocks.n_blocks


def test_prefix_cache_hit(gpu: Engine) -> None:
    rng = np.random.default_rng(5)
    head = [int(t) for t in rng.integers(0, VOCAB, size=200)]
    q1, q2 = head + [1, 2, 3], head + [4, 5, 6, 7]
    sched = Scheduler(gpu)
    r1 = sched.add(q1, greedy(8))
    sched.run_to_completion()
    r2 = sched.add(q2, greedy(8))
    out2 = sched.run_to_completion()[r2]
    assert r1 != r2
    assert out2[-1].cached_tokens >= 192
    assert collect_text(out2)[0] == run_alone(gpu, q2, greedy(8))


def test_abort_frees_blocks_at_once(gpu: Engine, prompts: list[list[int]], alone: list[list[int]]) -> None:
    sched = Scheduler(gpu, SchedulerConfig(max_batch_tokens=512))
    rids = [sched.add(p, greedy()) for p in prompts]
    out: dict[str, list] = {}
    for _ in range(4):
        for o in sched.step():
            out.setdefault(o.request_id, []).append(o)
    used_before = gpu.blocks.n_blocks - gpu.blocks.num_free
    for r in rids[::2]:
        sched.abort(r)
    for o in sched.step():
        out.setdefault(o.request_id, []).append(o)
    assert all(out[r][-1].finish_reason == "abort" for r in rids[::2])
    assert gpu.blocks.n_blocks - gpu.blocks.num_free < used_before
    for k, v in sched.run_to_completion().items():
        out.setdefault(k, []).extend(v)
    assert [collect_text(out[r])[0] for r in rids[1::2]] == alone[1::2]
    assert gpu.blocks.num_free == gpu.blocks.n_blocks


def decode_logits(gpu: Engine, steps: int = 3, n_seq: int = 6) -> np.ndarray:
    """Logits of `steps` decode steps of n_seq sequences after a 20-token prefill each."""
    seqs = np.random.default_rng(9).integers(0, VOCAB, size=(n_seq, 20 + steps)).tolist()
    tabs = [gpu.blocks.allocate(-(-(20 + steps) // gpu.block_size)) for _ in range(n_seq)]
    try:
        for tb, p in zip(tabs, seqs, strict=True):
            gpu.prefill(p[:20], tb)
        outs = []
        for step in range(steps):  # the first step captures, the next replay
            toks = [p[20 + step] for p in seqs]
            outs.append(gpu.forward(toks, [20 + step] * n_seq, list(range(n_seq)), tabs, list(range(n_seq))))
        return np.stack(outs)
    finally:
        for tb in tabs:
            gpu.blocks.release(tb)


def test_graph_replay_equals_eager_launches(gpu: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-sized steps replay a captured CUDA graph; the logits are those of plain launches."""
    with_graphs = decode_logits(gpu)
    monkeypatch.setenv("STRATA_GPU_GRAPHS", "0")
    assert np.array_equal(decode_logits(gpu), with_graphs)


def test_fused_decode_kernels_equal_separate_launches(gpu: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps fold q/k/v post-processing into attention and the down projection's input
    quantisation into gate/up; the logits are bitwise those of the separate launches."""
    monkeypatch.setenv("STRATA_GPU_FUSED_QUANT", "1")  # opt-in (measured no faster)
    fused = decode_logits(gpu)
    monkeypatch.setenv("STRATA_GPU_FUSED_QKV", "0")
    monkeypatch.setenv("STRATA_GPU_FUSED_QUANT", "0")
    assert np.array_equal(decode_logits(gpu), fused)


def test_step_stats_split_on_every_step(gpu: Engine) -> None:
    """Per-layer events run on one graph step in 16; the others still report an attention /
    experts split (the last measured shares of their step size times their own total)."""
    tabs = [gpu.blocks.allocate(4)]
    try:
        gpu.prefill(list(range(1, 21)), tabs[0])
        for step in range(20):
            gpu.forward([5], [20 + step], [0], tabs, [0])
            st = gpu.last_stats
            assert st.t_total > 0 and st.t_attn > 0 and st.t_experts > 0, (step, st)
            assert st.t_attn + st.t_experts + st.t_output <= st.t_total * 1.1, (step, st)
    finally:
        gpu.blocks.release(tabs[0])
