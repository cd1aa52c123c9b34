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
from tests.engine.sched_helpers import abort_every_other, drain, finish_into

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
        out, preempted = drain(sched)
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
    out, used_before = abort_every_other(sched, rids, 4)
    assert gpu.blocks.n_blocks - gpu.blocks.num_free < used_before
    finish_into(sched, out)
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


def test_graph_replay_equals_eager_launches(gpu: Engine) -> None:
    """Decode-sized steps replay a captured CUDA graph; the logits are those of plain launches."""
    with_graphs = decode_logits(gpu)
    gpu._gpu.set_settings({"STRATA_GPU_GRAPHS": "0"})
    try:
        assert np.array_equal(decode_logits(gpu), with_graphs)
    finally:
        gpu._gpu.set_settings({})


def test_fused_decode_kernels_equal_separate_launches(gpu: Engine) -> None:
    """Decode steps (every token of another sequence) fold q/k/v post-processing into attention and the
    down projection's input quantisation into gate/up; a step holding a whole sequence runs them as
    separate launches. A decode token's logits are bitwise those of the same position as the last row
    of such a step (batch invariance), for every step of decode_logits."""
    steps, n_seq = 3, 6
    decoded = decode_logits(gpu, steps, n_seq)
    seqs = np.random.default_rng(9).integers(0, VOCAB, size=(n_seq, 20 + steps)).tolist()  # decode_logits' ids
    for s in (0, n_seq - 1):
        tb = gpu.blocks.allocate(-(-(20 + steps) // gpu.block_size))
        try:
            for step in range(steps):
                n = 21 + step
                whole = gpu.forward(seqs[s][:n], list(range(n)), [0] * n, [tb], [n - 1])
                assert np.array_equal(whole[0].view(np.uint32), decoded[step][s].view(np.uint32)), (s, step)
        finally:
            gpu.blocks.release(tb)


def test_step_stats_split_on_every_step(gpu: Engine) -> None:
    """Per-layer events run on one graph step in 64 (LAYER_EVENT_PERIOD); the others still report an attention /
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


def step_both(eng: Engine, toks: list[int], pos: list[int], seq: list[int], tabs: list, rows: list[int],
              ) -> tuple[np.ndarray, np.ndarray]:
    """One step with st_batch.logits and out_tokens both set: (logits, the device's picks of them)."""
    from engine.native import ffi, ptr

    logits = np.full((len(rows), eng.hparams.n_vocab), np.nan, np.float32)
    picks = np.full(len(rows), -7, np.int32)
    b = eng._io.fill(toks, pos, seq, tabs, rows)
    b.logits, b.out_tokens, b.expert_hist = ptr(logits, "float *"), ptr(picks, "int32_t *"), ffi.NULL
    eng._gpu.forward(b, eng._io.stats)
    return logits, picks


@pytest.fixture(scope="module")
def big_vocab_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bench model's vocabulary (151,936) on a tiny MoE."""
    return make_random_gguf(tmp_path_factory.mktemp("gbig") / "moe.gguf", n_vocab=151936, n_layer=1, n_embd=64,
                            n_head=4, n_head_kv=2, n_ff=64, n_expert=4, n_expert_used=2,
                            weight_type=GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_device_greedy_pick_is_argmax_of_the_steps_logits(big_vocab_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          graphs: str) -> None:
    """Decode steps of 1, 8 and 32 sequences (graph replay, or plain launches), and a prefill step: the
    picks k_argmax_split takes on the device are np.argmax of the same step's logits, bitwise; a step asking
    for the picks alone (no logits copied) gives the same ids."""
    monkeypatch.setenv("STRATA_GPU_GRAPHS", graphs)  # read when the engine opens below
    V = 151936
    rng = np.random.default_rng(5)
    with Engine.open(big_vocab_path, device="cuda:0", kv_tokens=4096) as eng:
        for n_seq in (1, 8, 32):
            tabs = [eng.blocks.allocate(2) for _ in range(n_seq)]
            try:
                toks = [int(t) for t in rng.integers(0, V, size=8 * n_seq)]
                eng.forward(toks, [i % 8 for i in range(8 * n_seq)], [i // 8 for i in range(8 * n_seq)], tabs,
                            [8 * s + 7 for s in range(n_seq)])
                for step in range(3):  # the first captures, the next replay
                    args = ([int(t) for t in rng.integers(0, V, size=n_seq)], [8 + step] * n_seq,
                            list(range(n_seq)), tabs, list(range(n_seq)))
                    logits, picks = step_both(eng, *args)
                    assert picks.tolist() == np.argmax(logits, axis=1).tolist(), (n_seq, step)
                    assert eng.forward(*args, greedy=True).tolist() == picks.tolist()
                logits, picks = step_both(eng, toks[:8], list(range(8)), [0] * 8, tabs[:1], [3, 7])  # prefill
                assert picks.tolist() == np.argmax(logits, axis=1).tolist()
            finally:
                for tb in tabs:
                    eng.blocks.release(tb)


def test_scheduler_device_pick_on_and_off_same_tokens(gpu: Engine, model_path: Path, prompts: list[list[int]],
                                                      alone: list[list[int]]) -> None:
    """16 batched greedy requests, a batch with a sampled request beside (its steps take the logits), and
    preemption in a small arena: the same tokens with the device's pick (the default) and without
    (STRATA_DEVICE_GREEDY=0: logits copied back, argmax on the host)."""
    from engine.scheduler import DEVICE_GREEDY_ENV

    def batched(eng: Engine, env: dict, extra: SamplingParams | None = None, **cfg: int) -> list[list[int]]:
        sched = Scheduler(eng, SchedulerConfig(**cfg), environ=env)
        rids = [sched.add(p, greedy()) for p in prompts]
        if extra is not None:
            sched.add(prompts[0], extra)
        out = sched.run_to_completion()
        assert eng.blocks.num_free == eng.blocks.n_blocks
        return [collect_text(out[r])[0] for r in rids]

    off = {DEVICE_GREEDY_ENV: "0"}
    assert batched(gpu, {}) == batched(gpu, off) == alone
    sampled = SamplingParams.parse(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    assert batched(gpu, {}, sampled) == batched(gpu, off, sampled) == alone
    with Engine.open(model_path, device="cuda:0", kv_tokens=320) as small:
        assert batched(small, {}, max_batch_tokens=128) == batched(small, off, max_batch_tokens=128) == alone


def test_scheduler_overlap_on_and_off_same_tokens(gpu: Engine, model_path: Path) -> None:
    """STRATA_OVERLAP=1 (launch N+1 with ids from N's picks on the device before waiting N) against 0:
    the same tokens and finish reasons for 8 requests of max_tokens 1-24, for stops on an id mid-batch,
    and in a small arena with preemption, aborts in flight and late arrivals (tests/engine/test_overlap.py's
    CPU cases on the GPU), every block free and nothing left in flight."""
    from tests.engine.test_overlap import greedy as g
    from tests.engine.test_overlap import prompts as ps_of
    from tests.engine.test_overlap import sched_run

    reqs = [(p, g(n)) for p, n in zip(ps_of(8), [24, 1, 2, 3, 17, 24, 9, 5], strict=True)]
    on, spy = sched_run(gpu, reqs, True)
    assert on == sched_run(gpu, reqs, False)[0] and spy.speculative > 10
    ps = ps_of(6, 3)
    free, _ = sched_run(gpu, [(p, g(20)) for p in ps], False)
    stops = [[toks[k]] for (toks, _, _), k in zip(free, [2, 5, 9, 0, 14, 19], strict=True)]
    reqs = [(p, g(20, stop_token_ids=s)) for p, s in zip(ps, stops, strict=True)]
    assert sched_run(gpu, reqs, True)[0] == sched_run(gpu, reqs, False)[0]
    ps = ps_of(10, 4)
    ps[8] = ps[0] + [1, 2, 3]
    reqs = [(p, g(40)) for p in ps]
    with Engine.open(model_path, device="cuda:0", kv_tokens=256, block_size=16) as small:
        kw: dict = {"aborts": {2: 3, 7: 9}, "late": {8: 12}}
        on, spy = sched_run(small, reqs, True, **kw)
        off, spy_off = sched_run(small, reqs, False, **kw)
    assert spy.preempted > 0 and spy.speculative > 0
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        if i in (2, 7):
            n = min(len(a[0]), len(b[0]))
            assert a[2] == b[2] == "abort" and a[0][:n] == b[0][:n]
        else:
            assert a == b, i


def test_step_launch_and_wait_misuse_are_typed_errors(gpu: Engine) -> None:
    """stg_step_launch / stg_step_wait refuse misuse with a message, through CudaModel directly: logits in a
    launched step, token_src with no previous picks or outside them, a third launch, stg_forward with a step
    in flight, a wait out of order or without a launch; the picks of two launched steps are forward's."""
    from engine.native import EngineError, OutOfRangeError, ffi, ptr

    g = gpu._gpu
    st = gpu._io.stats
    blocks = gpu.blocks.allocate(1)
    out = np.zeros(1, np.int32)
    logits = np.empty((1, VOCAB), np.float32)

    def batch(tok: int, pos: int, src: list[int] | None = None, with_logits: bool = False) -> object:
        b = gpu._io.fill([tok], [pos], [0], [blocks], [0], src)
        b.logits = ptr(logits, "float *") if with_logits else ffi.NULL
        b.out_tokens = ptr(out, "int32_t *")
        b.expert_hist = ffi.NULL
        return b

    def wait(t: int) -> int:
        g.wait(t, ptr(out, "int32_t *"), st)
        return int(out[0])

    try:
        want = [int(gpu.forward([4], [0], [0], [blocks], [0], greedy=True)[0])]
        want.append(int(gpu.forward(want, [1], [0], [blocks], [0], greedy=True)[0]))
        with pytest.raises(EngineError, match="logits must be NULL"):
            g.launch(batch(4, 0, with_logits=True))
        gpu.forward([4], [0], [0], [blocks], [0])  # logits only: no picks left
        with pytest.raises(EngineError, match="no greedy picks"):
            g.launch(batch(0, 1, [0]))
        t1 = g.launch(batch(4, 0))
        t2 = g.launch(batch(0, 1, [0]))
        with pytest.raises(EngineError, match="two launched steps"):
            g.launch(batch(0, 2, [0]))
        with pytest.raises(EngineError, match="in flight"):
            g.forward(batch(4, 0), st)
        with pytest.raises(EngineError, match="not the oldest"):
            wait(t2)
        assert [wait(t1), wait(t2)] == want
        with pytest.raises(EngineError, match="no launched step"):
            wait(t2)
        with pytest.raises(OutOfRangeError, match="outside"):
            g.launch(batch(0, 2, [1]))
    finally:
        gpu.blocks.release(blocks)


@pytest.fixture(scope="module")
def q4k_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_K experts (the routed split GEMM's type; the rest Q8_0), 32 experts of which 4 per token: at 8-32
    sequences the experts hold from one pair to about ten."""
    from engine.default_model import quantize_q4_k

    n_layer, n_embd, n_ff, n_expert = 2, 256, 256, 32
    rng = np.random.default_rng(23)
    raw = {}
    for il in range(n_layer):
        for name, (r, c) in (("ffn_gate_exps", (n_ff, n_embd)), ("ffn_up_exps", (n_ff, n_embd)),
                             ("ffn_down_exps", (n_embd, n_ff))):
            blob = quantize_q4_k((rng.standard_normal((n_expert * r, c)) * 0.08).astype(np.float32))
            blob = blob.reshape(n_expert, r, -1)
            raw[f"blk.{il}.{name}.weight"] = (blob, blob.shape, GGMLQuantizationType.Q4_K)
    return make_random_gguf(tmp_path_factory.mktemp("gsplit") / "moe_q4k.gguf", n_vocab=VOCAB, n_layer=n_layer,
                            n_embd=n_embd, n_head=4, n_head_kv=2, n_ff=n_ff, n_expert=n_expert, n_expert_used=4,
                            weight_type=GGMLQuantizationType.Q8_0, raw_overrides=raw)


def test_routed_split_by_expert_size_same_logits(q4k_moe_path: Path) -> None:
    """Steps whose routed layers take the GEMM (from gemm_min_tokens tokens) send the experts holding at most
    routed_mv_max pairs to the matvec and the rest to the GEMM, split on the device by the grouping. The logits
    of decode steps of 8, 16 and 32 sequences are bitwise those of all-GEMM steps (routed_mv_max 0), of
    all-matvec splits (64) and of the matvec alone (gemm_min_tokens 0)."""
    with Engine.open(q4k_moe_path, device="cuda:0", kv_tokens=4096) as gpu:
        try:
            for n_seq in (8, 16, 32):
                runs = {}
                for env in ({"STRATA_GPU_ROUTED_MV_MAX": "0"}, {"STRATA_GPU_ROUTED_MV_MAX": "1"}, {},
                            {"STRATA_GPU_ROUTED_MV_MAX": "64"}, {"STRATA_GPU_GEMM_MIN_TOKENS": "0"}):
                    gpu._gpu.set_settings(env)
                    runs[str(env)] = decode_logits(gpu, steps=2, n_seq=n_seq).view(np.uint32)
                first = next(iter(runs.values()))
                for name, got in runs.items():
                    assert np.array_equal(got, first), (n_seq, name)
        finally:
            gpu._gpu.set_settings({})


def test_routed_split_decision_follows_routing_same_logits(q4k_moe_path: Path) -> None:
    """A layer keeps the routed split only while its recent decode steps of that size averaged at least
    routed_mv_groups matvec-sized experts, decided on the host from the device's histogram (first after 4 steps,
    then every 32; the step's graph is captured again with the new mask). A threshold no layer reaches drops
    the split in every layer after the first decision, 0 keeps it in every layer, 1 keeps it where the routing
    is load-balanced (64 pairs over 32 experts: every layer); the logits of the steps before and after the
    decision are bitwise the same in all three."""
    n_seq, steps = 16, 10
    with Engine.open(q4k_moe_path, device="cuda:0", kv_tokens=4096) as gpu:
        try:
            runs, layers = {}, {}
            for groups in ("0", "1024", "1"):
                gpu._gpu.set_settings({"STRATA_GPU_ROUTED_MV_GROUPS": groups})
                runs[groups] = decode_logits(gpu, steps=steps, n_seq=n_seq).view(np.uint32)
                layers[groups] = gpu._gpu.routed_split_layers(n_seq)
            assert layers == {"0": 2, "1024": 0, "1": 2}
            for groups, got in runs.items():
                assert np.array_equal(got, runs["0"]), groups
            assert gpu._gpu.routed_split_layers(4) == 0  # below gemm_min_tokens: no split to decide
        finally:
            gpu._gpu.set_settings({})
