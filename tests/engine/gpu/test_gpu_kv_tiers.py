"""The GPU engine's KV tiers (stg_kv_create_tiered): a forced tiny VRAM tier (4 blocks) beside an untiered cache on
the same model gives bitwise the same logits and greedy tokens, for the F16 and the 8-bit caches.

What runs over host-tier blocks: prefill chunks whose prefix lies in pinned host memory (staged into VRAM layer by
layer, their own written blocks written back), decode steps that stream host blocks in place (CUDA graphs, the
split-KV kernel at a low att_split_min and, for F16, the unsplit kernel with the split off), blocks moved between the
tiers by ``place_kv`` between steps, and two sequences served by the scheduler. The kernels are the untiered cache's,
reading each block through one address function, so nothing may differ in any bit; the step statistics report the
host bytes read (> 0 tiered, 0 untiered) and the bytes moved.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.native import EngineError
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.gpu._env import requires_gpu
from tests.engine.gpu._model_checks import write_hd128_moe

pytestmark = requires_gpu

VOCAB = 300
HOT = 64  # tokens: 4 blocks of 16 in VRAM, far below the prompts
KV = 8192
CHUNK = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hd128_moe(tmp_path_factory.mktemp("kvtiers") / "m.gguf", KV, VOCAB)


def _pair(model: Path, kv_type: str) -> tuple[Engine, Engine]:
    kw = dict(device="cuda:0", kv_tokens=KV, prefill_chunk=CHUNK, kv_type=kv_type)
    return Engine.open(model, **kw), Engine.open(model, kv_hot_tokens=HOT, **kw)


def _steps(eng: Engine, prompt: list[int], table: list[int], feed: list[int]) -> list[np.ndarray]:
    """Every prefill chunk's logits (all rows), then one decode step per fed token; the host bytes of each step."""
    out, host = [], []
    for s in range(0, len(prompt), CHUNK):
        chunk = prompt[s : s + CHUNK]
        pos = list(range(s, s + len(chunk)))
        out.append(eng.forward(chunk, pos, [0] * len(chunk), [table], list(range(len(chunk)))))
        host.append(eng.last_stats.kv_host_bytes)
    for i, t in enumerate(feed):
        if i == 2 and eng.kv_tiers is not None:
            # sinks and the recent window into VRAM: blocks move mid-sequence
            assert eng.place_kv([table]) > 0
        out.append(eng.forward([t], [len(prompt) + i], [0], [table], [0]))
        host.append(eng.last_stats.kv_host_bytes)
    # two tokens of the sequence: a graph-sized step that is not a decode (prefill kernels, host blocks streamed)
    p = len(prompt) + len(feed)
    out.append(eng.forward(feed[:2], [p, p + 1], [0, 0], [table], [0, 1]))
    host.append(eng.last_stats.kv_host_bytes)
    return out + [np.asarray(host)]


CASES = [(t, split_min, 1) for t in ("f16", "q8_0") for split_min in (0, 256)] + [
    ("f16", 256, 0),
    ("q8_0", 256, 0),
    ("f16", 256, -1),
    ("q8_0", 256, -1),
]


@pytest.mark.parametrize(
    ("kv_type", "split_min", "stream"), CASES, ids=[f"{t}-split{m}-stream{s}" for t, m, s in CASES]
)
def test_tiny_vram_tier_bit_identical(model: Path, kv_type: str, split_min: int, stream: int) -> None:
    """stream 0 (STRATA_GPU_KV_STREAM=0): every step stages its host blocks, decode too (eager, no graphs); -1: each
    decode step takes a form by the two forms' measured times (its first steps try both)."""
    # split_min 0: F16 decodes with the unsplit kernel (prefill on the fp32 tiles), the 8-bit cache with the split
    # kernel in one split
    rng = np.random.default_rng(30 + split_min)
    prompt = [int(t) for t in rng.integers(0, VOCAB, size=2100)]
    feed = [int(t) for t in rng.integers(0, VOCAB, size=6)]
    flat, tiered = _pair(model, kv_type)
    with flat, tiered:
        env = {"STRATA_GPU_ATT_SPLIT_MIN": str(split_min), "STRATA_GPU_KV_STREAM": str(stream)}
        # split_min 0 on F16: the fp32 prefill tiles too (the 8-bit cache's prefill is the tensor-core kernel)
        if split_min == 0:
            env["STRATA_GPU_ATT_MMA"] = "0"
        for e in (flat, tiered):
            e._gpu.set_settings(env)
        assert tiered._gpu.kv_bytes == flat._gpu.kv_bytes // (KV // HOT)  # 4 of the 512 blocks in VRAM
        assert (
            tiered._gpu.kv_host_bytes == flat._gpu.kv_bytes - tiered._gpu.kv_bytes
            and flat._gpu.kv_host_bytes == 0
        )
        n = -(-(len(prompt) + len(feed) + 2) // 16)
        tf, tt = flat.blocks.allocate(n), tiered.blocks.allocate(n)
        assert tf == tt
        # the prompt lies mostly on the host
        assert sum(not tiered.kv_tiers.is_hot(b) for b in tt) >= n - HOT // 16
        want, got = _steps(flat, prompt, tf, feed), _steps(tiered, prompt, tt, feed)
        for i, (a, b) in enumerate(zip(want[:-1], got[:-1], strict=True)):
            assert np.array_equal(a, b), (
                f"step {i}: the tiered cache's logits differ (max {np.abs(a - b).max():.3e})"
            )
        assert (want[-1] == 0).all() and (got[-1] > 0).all(), (want[-1], got[-1])
        # prefill staged the host prefix in VRAM slots (one layer's, beside the budget); the untiered cache has none
        assert tiered.gpu_memory()["kv_stage"] > 0 and flat.gpu_memory()["kv_stage"] == 0
        print(f"{kv_type}, att_split_min {split_min}: host bytes per step {got[-1].tolist()}")


def test_kv_stream_per_step_tries_both_forms_then_keeps_one(model: Path) -> None:
    """kv_stream -1: a decode step's form (stg_profile.kv_form: 1 in place, 0 staged) alternates while the two
    forms are timed (each form's first step skipped, three timed each: 0, 0, 1, 1, 0, 1, 0, 1), then one form, the
    faster by the running means, until the 64th step looks at the other again."""
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, VOCAB, size=1500)]
    with Engine.open(model, device="cuda:0", kv_tokens=KV, prefill_chunk=CHUNK, kv_hot_tokens=HOT) as eng:
        eng._gpu.set_settings({"STRATA_GPU_KV_STREAM": "-1"})
        table = eng.blocks.allocate(-(-(len(prompt) + 40) // 16))
        for s in range(0, len(prompt), CHUNK):
            chunk = prompt[s : s + CHUNK]
            eng.forward(chunk, list(range(s, s + len(chunk))), [0] * len(chunk), [table], [len(chunk) - 1])
            assert eng.last_stats.kv_form in (0, -1)  # prefill steps stage
        forms, times = [], []
        for i in range(30):
            eng.forward([int(rng.integers(0, VOCAB))], [len(prompt) + i], [0], [table], [0])
            st = eng.last_stats
            assert st.kv_host_bytes > 0
            forms.append(st.kv_form)
            times.append(st.t_total)
        print(f"forms {forms}; ms {[round(t * 1e3, 3) for t in times]}")
        assert forms[:8] == [0, 0, 1, 1, 0, 1, 0, 1], forms
        assert len(set(forms[8:])) == 1, forms


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_scheduler_two_sequences_same_tokens(model: Path, kv_type: str) -> None:
    """Two long prompts served together (chunked prefill beside decode, moves between every step): the same greedy
    tokens as the untiered cache, with bytes moved and host bytes read reported."""
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in (1800, 1300)]

    def run(eng: Engine) -> tuple[list[list[int]], int, int]:
        sched = Scheduler(eng, SchedulerConfig(max_batch_tokens=CHUNK))
        rids = [
            sched.add(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for p in prompts
        ]
        out: dict[str, list[int]] = {r: [] for r in rids}
        moved = host = 0
        while sched.has_work():
            for o in sched.step():
                out[o.request_id].extend(o.token_ids)
            st = sched.last_report.stats if sched.last_report else None
            if st is not None:
                moved, host = moved + st.kv_moved_bytes, host + st.kv_host_bytes
        return [out[r] for r in rids], moved, host

    flat, tiered = _pair(model, kv_type)
    with flat, tiered:
        a, b = run(flat), run(tiered)
    assert a[0] == b[0]
    assert a[1] == 0 and a[2] == 0 and b[1] > 0 and b[2] > 0, (a[1:], b[1:])
    print(f"{kv_type}: moved {b[1]} bytes, read {b[2]} host bytes over {sum(map(len, b[0]))} tokens")


HOST_ATTN_TOL = 1e-3  # of max |logit| of the untiered cache (docs/engine.md, "KV tiers on the GPU")


def _prefill_pair(flat: Engine, tiered: Engine, prompts: list[list[int]],
                  steps: int) -> tuple[list[list[list[int]]], list[int], list[int]]:
    """Each prompt alone on both engines, chunked (prefill steps stage the host blocks), in blocks for steps more
    tokens: the two engines' tables (the same ids), the untiered engine's greedy tokens and the next positions."""
    tables: list[list[list[int]]] = [[], []]
    for e, tabs in zip((flat, tiered), tables, strict=True):
        for p in prompts:
            tabs.append(e.blocks.allocate(-(-(len(p) + steps + 1) // 16)))
    assert tables[0] == tables[1]
    last = []
    for e, tabs in zip((flat, tiered), tables, strict=True):
        for i, p in enumerate(prompts):
            for s in range(0, len(p), CHUNK):
                chunk = p[s : s + CHUNK]
                out = e.forward(chunk, list(range(s, s + len(chunk))), [0] * len(chunk), [tabs[i]], [len(chunk) - 1])
            if e is flat:
                last.append(int(out[0].argmax()))
    return tables, last, [len(p) for p in prompts]


def _host_read_bytes(tiered: Engine, tables: list[list[int]], pos: list[int]) -> int:
    """The bytes (every layer's K and V) of the host-tier blocks that tokens at ``pos`` over ``tables`` read where
    they are placed now: what the CPU's (kv_cpu_bytes) and the device's (kv_host_bytes: streamed or staged) shares
    of a kv_host_attn step add up to (distinct sequences: no block read twice)."""
    kt = tiered.kv_tiers
    per_block = tiered._gpu.kv_bytes // kt.n_hot
    return per_block * sum(not kt.is_hot(b) for t, q in zip(tables, pos, strict=True) for b in t[: q // 16 + 1])


def _decode_pair(flat: Engine, tiered: Engine, tables: list[list[list[int]]], toks: list[int],
                 pos: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One decode step of every sequence on both engines, the tiered one's recent window (each sequence's block
    being written) placed in VRAM first, as the scheduler places: both engines' logits."""
    seqs = list(range(len(toks)))
    tiered.place_kv([t[: q // 16 + 1] for t, q in zip(tables[1], pos, strict=True)])
    return flat.forward(toks, pos, seqs, tables[0], seqs), tiered.forward(toks, pos, seqs, tables[1], seqs)


@pytest.mark.parametrize("stream", [1, 0])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("n_seq", [1, 2])
def test_host_attn_within_tolerance(model: Path, kv_type: str, n_seq: int, stream: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_host_attn 1 with the CPU's share at 100%: the CPU pool attends the host-tier blocks of each decode step
    (split-KV at a low att_split_min) while the GPU attends its VRAM blocks; over several decode steps of 1 and 2
    sequences the logits stay within HOST_ATTN_TOL of max |logit| of the untiered cache and the greedy tokens are
    its tokens; the step statistics say the CPU read the host blocks (kv_cpu_bytes) and nothing crossed PCIe.
    Setting 0 on the same engine then streams them again, bitwise the untiered logits, rerunning the first decode
    step: the keys the steps under setting 1 wrote come from hidden states of the CPU's order of additions (a
    rounding apart from the untiered cache's), so only a step that reads none of them can be bitwise. Under
    kv_stream 0 (stream 0) the same: the device stages none (all host blocks are the CPU's), setting 0 stages them."""
    monkeypatch.setenv("STRATA_GPU_KV_STREAM", str(stream))
    monkeypatch.setenv("STRATA_GPU_KV_HOST_ATTN", "1")
    monkeypatch.setenv("STRATA_GPU_KV_HOST_SHARE", "100")
    monkeypatch.setenv("STRATA_GPU_ATT_SPLIT_MIN", "256")
    rng = np.random.default_rng(300 + n_seq)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in (2100, 1700)[:n_seq]]
    steps = 6
    flat, tiered = _pair(model, kv_type)
    with flat, tiered:
        tables, toks, pos = _prefill_pair(flat, tiered, prompts, steps)
        first = (toks, pos)
        for step in range(steps):
            a, b = _decode_pair(flat, tiered, tables, toks, pos)
            st = tiered.last_stats
            err = np.abs(a - b).max() / np.abs(a).max()
            assert err <= HOST_ATTN_TOL, f"step {step}: {err:.3e} of max |logit|"
            assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {step}: greedy tokens differ"
            assert st.kv_cpu_bytes > 0 and st.kv_host_bytes == 0, (st.kv_cpu_bytes, st.kv_host_bytes)
            assert st.kv_cpu_bytes == _host_read_bytes(tiered, tables[1], pos)
            assert st.kv_cpu_share == 1.0
            print(f"stream {stream}, {kv_type}, {n_seq} sequence(s), step {step}: {err:.2e} of max |logit|, CPU read "
                  f"{st.kv_cpu_bytes} host-tier bytes in {st.t_cpu_attn * 1e3:.2f} ms")
            toks, pos = [int(x) for x in a.argmax(-1)], [q + 1 for q in pos]
        # setting 0 on the first decode step again (its keys: the prompts' and its own)
        tiered._gpu.set_settings({**os.environ, "STRATA_GPU_KV_HOST_ATTN": "0"})
        a, b = _decode_pair(flat, tiered, tables, *first)
        st = tiered.last_stats
        assert np.array_equal(a, b), f"setting 0: max {np.abs(a - b).max():.3e}"
        assert st.kv_host_bytes > 0 and st.kv_cpu_bytes == 0


@pytest.mark.parametrize("stream", [1, 0])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("share", [0, 50, -1])
def test_host_attn_mixed_share(model: Path, kv_type: str, share: int, stream: int,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_host_attn 1's mixed form over two sequences: kv_host_share 50 has the CPU attend the first half of each
    token's host-tier blocks (rounded to whole blocks) and the GPU stream the rest beside its VRAM blocks: both byte
    counts > 0, their split the share, the logits within HOST_ATTN_TOL of the untiered cache's and its greedy
    tokens. -1 takes the share from the measured rates (the PCIe probe's and, after the first step, the CPU's
    running mean: both reported), strictly between 0 and 1 here. 0 gives the CPU no block: every step is
    kv_host_attn 0's, bitwise the untiered logits, nothing attended by the CPU. stream 0 (kv_stream 0): the
    device's share is staged into VRAM (kv_host_bytes: the staged blocks; the rate weighed, the staging gather's),
    the CPU's and the staged bytes adding up to the host blocks' the tokens read, share 50 bitwise the in-place form's
    (the step rerun under the other kv_stream) and share 0 bitwise kv_host_attn 0's staged step (the step rerun under
    setting 0)."""
    monkeypatch.setenv("STRATA_GPU_KV_STREAM", str(stream))
    monkeypatch.setenv("STRATA_GPU_KV_HOST_ATTN", "1")
    monkeypatch.setenv("STRATA_GPU_KV_HOST_SHARE", str(share))
    monkeypatch.setenv("STRATA_GPU_ATT_SPLIT_MIN", "256")
    rng = np.random.default_rng(310)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in (2100, 1700)]
    steps = 5
    flat, tiered = _pair(model, kv_type)
    with flat, tiered:
        tables, toks, pos = _prefill_pair(flat, tiered, prompts, steps)
        cpu_steps = 0
        for step in range(steps):
            a, b = _decode_pair(flat, tiered, tables, toks, pos)
            st = tiered.last_stats
            if share == 0:
                assert np.array_equal(a, b), f"step {step}: max {np.abs(a - b).max():.3e}"
                assert st.kv_cpu_bytes == 0 and st.kv_host_bytes > 0 and st.kv_cpu_share == 0.0
                # the same step under kv_host_attn 0 (its keys rewritten with the same bits): the same logits
                seqs = list(range(len(toks)))
                tiered._gpu.set_settings({**os.environ, "STRATA_GPU_KV_HOST_ATTN": "0"})
                c = tiered.forward(toks, pos, seqs, tables[1], seqs)
                tiered._gpu.set_settings(dict(os.environ))
                assert np.array_equal(b, c), f"step {step}: kv_host_attn 0 max {np.abs(b - c).max():.3e}"
                assert tiered.last_stats.kv_host_bytes == st.kv_host_bytes
            else:
                err = np.abs(a - b).max() / np.abs(a).max()
                assert err <= HOST_ATTN_TOL, f"step {step}: {err:.3e} of max |logit|"
                assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {step}: greedy tokens differ"
                if share == -1 and st.kv_cpu_bytes == 0:
                    # the measured share rounds to no whole block of any token (the test model's CPU work is a
                    # few microseconds a layer, so its measured rate is low): kv_host_attn 0's step, every host
                    # block the device's
                    assert st.kv_cpu_share == 0.0
                    assert st.kv_host_bytes == _host_read_bytes(tiered, tables[1], pos)
                    toks, pos = [int(x) for x in a.argmax(-1)], [q + 1 for q in pos]
                    continue
                cpu_steps += 1
                assert st.kv_cpu_bytes > 0 and st.kv_host_bytes > 0, (st.kv_cpu_bytes, st.kv_host_bytes)
                assert st.kv_cpu_bytes + st.kv_host_bytes == _host_read_bytes(tiered, tables[1], pos)
                got = st.kv_cpu_bytes / (st.kv_cpu_bytes + st.kv_host_bytes)
                assert got == pytest.approx(st.kv_cpu_share)
                assert st.kv_pcie_gbs > 0
                if share == 50:
                    assert abs(got - 0.5) <= 0.02, got  # whole blocks of ~125 and ~100 per token
                    # the other form of the device's share (staged / in place) rerun on the step: the same bits (the
                    # same blocks in the same order through the same kernels; the step rewrites its keys unchanged)
                    seqs = list(range(len(toks)))
                    tiered._gpu.set_settings({**os.environ, "STRATA_GPU_KV_STREAM": str(1 - stream)})
                    c = tiered.forward(toks, pos, seqs, tables[1], seqs)
                    tiered._gpu.set_settings(dict(os.environ))
                    assert np.array_equal(b, c), f"step {step}: kv_stream {1 - stream} max {np.abs(b - c).max():.3e}"
                    assert tiered.last_stats.kv_cpu_bytes == st.kv_cpu_bytes
                elif step > 0:
                    assert st.kv_cpu_gbs > 0
                    want = st.kv_cpu_gbs / (st.kv_cpu_gbs + st.kv_pcie_gbs)
                    print(f"stream {stream}, {kv_type}, step {step}: CPU {st.kv_cpu_gbs:.1f} GB/s, device "
                          f"{st.kv_pcie_gbs:.1f} GB/s, share {got:.3f} (measured rule {want:.3f} after this step's "
                          "update)")
            toks, pos = [int(x) for x in a.argmax(-1)], [q + 1 for q in pos]
        # the first step's share is one half (no rate measured yet counts as the other's): the CPU attends there
        assert share == 0 or cpu_steps >= 1


def test_swap_refuses_untiered_and_bad_ids(model: Path) -> None:
    flat, tiered = _pair(model, "f16")
    with flat, tiered:
        with pytest.raises(EngineError, match="not tiered"):
            flat._gpu.kv_swap(0, 1, True, True)
        with pytest.raises(EngineError, match="outside"):
            tiered._gpu.kv_swap(0, tiered.blocks.n_blocks, True, False)


def test_vram_budget_sets_the_hot_tier(model: Path) -> None:
    """gpu_kv_budget_gb: the hot tier is the whole blocks of the budget; the device holds exactly those bytes."""
    with Engine.open(model, kv_tokens=64) as cpu:
        per_block = cpu.hparams.kv_bytes_per_token * 16
    budget = 10 * per_block / 2**30
    with Engine.open(model, device="cuda:0", kv_tokens=KV, gpu_kv_budget_gb=budget) as eng:
        assert eng.kv_tiers is not None and eng.kv_tiers.n_hot == 10
        assert eng._gpu.kv_bytes == 10 * per_block
        assert eng._gpu.kv_host_bytes == (KV // 16 - 10) * per_block


def test_admission_counts_both_tiers(model: Path) -> None:
    """The window is both tiers' tokens (VRAM holds 64 of them); a prompt beyond it gets the typed context error
    before any block is taken or moved."""
    from engine.block_manager import KVCapacityError

    with Engine.open(model, device="cuda:0", kv_tokens=1024, kv_hot_tokens=HOT) as eng:
        assert eng.n_ctx == 1024 and eng.kv_tiers.n_hot * eng.block_size == HOT
        sched = Scheduler(eng, SchedulerConfig())
        free, moved = eng.blocks.num_free, eng.kv_tiers.moved_bytes
        with pytest.raises(KVCapacityError, match="context window"):
            sched.add([1] * eng.n_ctx, SamplingParams(max_tokens=4))
        assert not sched.has_work() and eng.blocks.num_free == free and eng.kv_tiers.moved_bytes == moved


# The 2 x 32k bench's conditions (bench.engine_gpu --depth 32768 --depth-batch 2 --kv-budget-gb 4 with kv_host_attn 1)
# at a fraction of its size, on a dense model of its attention shape (head_dim 128, 8 query heads per KV head): a
# sequence wholly in VRAM beside one whose host-tier blocks the CPU attends, every one of them moved out of VRAM by
# place_kv just before the step (the bench's first such step moves ~1,370 blocks so), many device splits (the
# VRAM-resident sequence's 60+ splits and the CPU's keyless one fill the combine's 64), sequences of different
# lengths. Dense, two layers: the logits follow the attention's rounding (in a deep random MoE a last-bit change
# flips near-tied expert choices and moves the logits by 1e-3..1e-1 of max |logit|: docs/engine.md).
BENCH_KV = 30_720
BENCH_HOT = 17_600  # 1,100 blocks: either sequence whole, beside the other's window and sink
BENCH_LENS = (16_400, 12_000)


@pytest.fixture(scope="module")
def dense_g8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.gguf_factory import make_random_gguf

    return make_random_gguf(tmp_path_factory.mktemp("kvtiers_g8") / "m.gguf", arch="llama", n_layer=2, n_embd=2048,
                            n_head=16, n_head_kv=2, n_ff=256, n_expert=0, n_expert_used=0, n_vocab=VOCAB,
                            n_ctx=BENCH_KV)


@pytest.mark.parametrize("stream", [1, 0])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_host_attn_bench_conditions(dense_g8: Path, kv_type: str, stream: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Six decode steps of two sequences (16,400 and 12,000 prompt tokens; 1,100 blocks hot): before each, place_kv
    puts one sequence wholly in VRAM and then the other, so that the second's blocks leave VRAM for the host tier
    right before the step that has the CPU attend them (the sequences alternate); kv_host_share 100 for three steps,
    then 50 (the mixed form: the device also streams host blocks). Each step's logits within HOST_ATTN_TOL of the
    untiered cache's, its greedy tokens, the CPU's bytes > 0 and hundreds of just-moved blocks among its reads. stream 0
    (kv_stream 0): the device's share is staged into VRAM instead of read in place (the bench's mixstage row)."""
    monkeypatch.setenv("STRATA_GPU_KV_STREAM", str(stream))
    monkeypatch.setenv("STRATA_GPU_KV_HOST_ATTN", "1")
    monkeypatch.setenv("STRATA_GPU_KV_HOST_SHARE", "100")
    monkeypatch.delenv("STRATA_GPU_ATT_SPLIT_MIN", raising=False)  # the default, as the bench runs
    rng = np.random.default_rng(320)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in BENCH_LENS]
    steps = 6
    kw = dict(device="cuda:0", kv_tokens=BENCH_KV, prefill_chunk=CHUNK, kv_type=kv_type)
    flat, tiered = Engine.open(dense_g8, **kw), Engine.open(dense_g8, kv_hot_tokens=BENCH_HOT, **kw)
    with flat, tiered:
        tables, toks, pos = _prefill_pair(flat, tiered, prompts, steps)
        kt = tiered.kv_tiers
        for step in range(steps):
            if step == 3:
                tiered._gpu.set_settings({**os.environ, "STRATA_GPU_KV_HOST_SHARE": "50"})
            used = [t[: q // 16 + 1] for t, q in zip(tables[1], pos, strict=True)]
            whole, cold = (0, 1) if step % 2 == 0 else (1, 0)
            tiered.place_kv([used[cold]])  # the cold-to-be sequence wholly in VRAM first
            assert all(kt.is_hot(b) for b in used[cold])
            moved = tiered.place_kv([used[whole], used[cold]])  # then the other: the first one's blocks go out
            assert moved > 0 and all(kt.is_hot(b) for b in used[whole])
            just_out = sum(not kt.is_hot(b) for b in used[cold])
            assert just_out >= 300, just_out
            seqs = [0, 1]
            a = flat.forward(toks, pos, seqs, tables[0], seqs)
            b = tiered.forward(toks, pos, seqs, tables[1], seqs)
            st = tiered.last_stats
            err = np.abs(a - b).max() / np.abs(a).max()
            print(f"stream {stream}, {kv_type}, step {step}: {err:.2e} of max |logit|; {just_out} blocks of sequence {cold} moved to "
                  f"the host tier before the step; CPU share {st.kv_cpu_share:.2f}, {st.kv_cpu_bytes} bytes")
            assert err <= HOST_ATTN_TOL, f"step {step}: {err:.3e} of max |logit|"
            assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {step}: greedy tokens differ"
            assert st.kv_cpu_bytes > 0, st.kv_cpu_bytes
            assert st.kv_cpu_bytes + st.kv_host_bytes == _host_read_bytes(tiered, tables[1], pos)
            if step >= 3:
                assert 0.0 < st.kv_cpu_share < 1.0 and st.kv_host_bytes > 0, (st.kv_cpu_share, st.kv_host_bytes)
                # the device's rate over its share (F16: ~5 MiB a layer, timed from the first such step on)
                assert st.kv_pcie_gbs > 0
                print(f"  device {st.kv_pcie_gbs:.1f} GB/s ({'in place' if stream else 'staged'}), CPU "
                      f"{st.kv_cpu_gbs:.1f} GB/s")
            else:
                assert st.kv_cpu_share == 1.0 and st.kv_host_bytes == 0, (st.kv_cpu_share, st.kv_host_bytes)
            toks, pos = [int(x) for x in a.argmax(-1)], [q + 1 for q in pos]
