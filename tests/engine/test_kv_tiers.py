"""The tiered KV cache (a forced tiny hot tier on the CPU path) gives bit-identical logits and greedy
tokens to the untiered cache, for one and several sequences longer than the hot tier, with blocks moved
between the tiers by the scheduler; prefix-cache sharing stays correct across tiers (issue 30, CI test 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.block_manager import KVCapacityError
from engine.engine import Engine
from engine.kv_tiers import KVTiers
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.gguf_factory import TINY_VOCAB

HOT = 64  # tokens: 4 blocks of 16, far below the prompts


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, TINY_VOCAB, size=int(k))] for k in rng.integers(90, 200, size=n)]


def _generate(eng: Engine, prompts: list[list[int]], max_tokens: int = 12) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt served together by one scheduler; the KV bytes moved between tiers."""
    sched = Scheduler(eng, SchedulerConfig(max_batch_tokens=96))
    rids = [sched.add(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for p in prompts]
    moved = 0
    out: dict[str, list[int]] = {r: [] for r in rids}
    while sched.has_work():
        for o in sched.step():
            out[o.request_id].extend(o.token_ids)
        if sched.last_report and sched.last_report.stats:
            moved += sched.last_report.stats.kv_moved_bytes
    return [out[r] for r in rids], moved


@pytest.fixture(scope="module")
def engines(tiny_path: Path) -> tuple[Engine, Engine]:
    flat = Engine.open(tiny_path, threads=1, kv_tokens=1024, block_size=16)
    tiered = Engine.open(tiny_path, threads=1, kv_tokens=1024, block_size=16, kv_hot_tokens=HOT)
    yield flat, tiered
    flat.close()
    tiered.close()


def test_tiers_shape(engines: tuple[Engine, Engine]) -> None:
    flat, tiered = engines
    assert flat.kv_tiers is None
    t = tiered.kv_tiers
    assert t is not None and (t.n_hot, t.n_hot + t.n_cold) == (4, tiered.blocks.n_blocks)


def test_prefill_and_moves_bit_identical(engines: tuple[Engine, Engine]) -> None:
    """One sequence across both tiers: the same logits before and after its blocks are shuffled between tiers."""
    flat, tiered = engines
    p = _prompts(1, 0)[0]
    n = -(-(len(p) + 1) // 16)
    tf, tt = flat.blocks.allocate(n), tiered.blocks.allocate(n)
    try:
        pos = list(range(len(p)))
        want = flat.forward(p, pos, [0] * len(p), [tf], pos)
        got = tiered.forward(p, pos, [0] * len(p), [tt], pos)
        assert np.array_equal(want, got)
        assert any(not tiered.kv_tiers.is_hot(b) for b in tt)  # the prompt lies in both pools
        hot_before = [b for b in tt if tiered.kv_tiers.is_hot(b)]
        moved = tiered.place_kv([tt])  # window and sink hot: the prompt's last blocks move in
        assert moved > 0 and tiered.kv_tiers.is_hot(tt[-1]) and tiered.kv_tiers.is_hot(tt[0])
        assert hot_before != [b for b in tt if tiered.kv_tiers.is_hot(b)]
        nxt = int(np.argmax(want[-1]))
        a = flat.forward([nxt], [len(p)], [0], [tf], [0])
        b = tiered.forward([nxt], [len(p)], [0], [tt], [0])
        assert np.array_equal(a, b)
        assert tiered.last_stats is not None and tiered.last_stats.kv_moved_bytes == moved
    finally:
        flat.blocks.release(tf)
        tiered.blocks.release(tt)


@pytest.mark.parametrize("n_seqs", [1, 4])
def test_scheduler_greedy_tokens_identical(engines: tuple[Engine, Engine], n_seqs: int) -> None:
    flat, tiered = engines
    prompts = _prompts(n_seqs, 10 + n_seqs)
    want, moved0 = _generate(flat, prompts)
    got, moved = _generate(tiered, prompts)
    assert got == want
    assert moved0 == 0 and moved > 0  # the scheduler moved blocks between the tiers


def test_prefix_sharing_across_tiers(engines: tuple[Engine, Engine]) -> None:
    """A shared prefix cached while its blocks sit in either tier serves a later request exactly."""
    flat, tiered = engines
    base = _prompts(1, 5)[0][:160]
    tails = [base + t for t in ([1, 2, 3], [7, 8, 9, 10, 11], [4])]
    want, _ = _generate(flat, tails)
    hits0 = tiered.blocks.hits
    got1, _ = _generate(tiered, tails[:1])  # the prefix gets cached (its blocks in both tiers)
    got2, moved = _generate(tiered, tails[1:])  # served from the cache after blocks moved
    assert tiered.blocks.hits - hits0 >= 2 * 9 * 16  # both later requests reused the 10 full blocks' prefix
    assert got1 + got2 == want


def test_kvtiers_policy() -> None:
    """Window first, then sinks, then whole sequences that fit; empty hot blocks leave without a copy."""
    swaps: list[tuple[int, int, bool, bool]] = []
    held = set(range(20))

    def swap(a: int, b: int, ca: bool, cb: bool) -> int:
        swaps.append((a, b, ca, cb))
        return 10 * (ca + cb)

    t = KVTiers(4, 16, swap, lambda b: b in held, sink_blocks=1, window_blocks=2)
    assert t.wanted([[10, 11, 12, 13, 14]]) == [13, 14, 10]
    assert t.wanted([[5, 6], [7, 8, 9]]) == [5, 6, 8, 9]
    held.discard(3)
    assert t.place([[10, 11, 12, 13, 14]]) == 10 + 20 + 20
    assert swaps[0] == (13, 3, True, False)  # the empty hot block goes first
    assert all(t.is_hot(b) for b in (13, 14, 10)) and sorted(t.phys) == list(range(20))
    assert t.place([[10, 11, 12, 13, 14]]) == 0  # already in place
    with pytest.raises(ValueError):
        KVTiers(0, 4, swap, lambda b: True)


def test_admission_counts_both_tiers(engines: tuple[Engine, Engine]) -> None:
    """The window is both tiers' capacity; a prompt beyond it gets the typed context error before any work."""
    _, tiered = engines
    assert tiered.n_ctx == min(tiered.kv_tokens, tiered.hparams.n_ctx_train) > HOT
    sched = Scheduler(tiered, SchedulerConfig())
    free, moved = tiered.blocks.num_free, tiered.kv_tiers.moved_bytes
    with pytest.raises(KVCapacityError, match="context window"):
        sched.add([1] * tiered.n_ctx, SamplingParams(max_tokens=4))
    assert not sched.has_work() and tiered.blocks.num_free == free and tiered.kv_tiers.moved_bytes == moved
    long = _prompts(1, 3)[0] * 3  # several times the hot tier, within the window
    rid = sched.add(long[: tiered.n_ctx // 2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    done = sched.run_to_completion()
    assert len([t for o in done[rid] for t in o.token_ids]) == 2


def test_wanted_skips_sequences_longer_than_the_hot_tier() -> None:
    """A sequence with more blocks than the hot tier never goes hot whole (its window and sinks do), and a shorter
    one after it still does."""
    t = KVTiers(6, 30, lambda a, b, ca, cb: 0, lambda b: True, sink_blocks=1, window_blocks=1)
    long, short = list(range(10, 20)), [3, 4]
    assert t.wanted([long, short]) == [19, 4, 10, 3]


def test_vram_budget_gives_the_hot_tier(tiny_path: Path) -> None:
    """gpu_kv_budget_gb: the hot tier is the whole blocks of kv_type's bytes that fit (at least one), on either
    engine (the CPU's hot pool stands for VRAM); not with kv_hot_tokens; a bad budget is refused."""
    from engine.engine import kv_hot_budget_tokens

    with Engine.open(tiny_path, threads=1, kv_tokens=64) as probe:
        mf = probe.model_file
    per = mf.hparams.kv_bytes_per_token_of("f16") * 16
    assert kv_hot_budget_tokens(mf, 3.5 * per / 2**30, 16) == 48
    assert kv_hot_budget_tokens(mf, 1e-12, 16) == 16  # at least one block
    per8 = mf.hparams.kv_bytes_per_token_of("q8_0") * 16
    assert kv_hot_budget_tokens(mf, 7 * per8 / 2**30, 16, "q8_0") == 7 * 16
    with Engine.open(tiny_path, threads=1, kv_tokens=1024, gpu_kv_budget_gb=5 * per / 2**30) as eng:
        assert eng.kv_tiers is not None and eng.kv_tiers.n_hot == 5
    with pytest.raises(ValueError, match="not both"):
        Engine.open(tiny_path, kv_tokens=1024, kv_hot_tokens=64, gpu_kv_budget_gb=1.0)
    with pytest.raises(ValueError, match="gpu_kv_budget_gb"):
        Engine.open(tiny_path, kv_tokens=1024, gpu_kv_budget_gb=0.0)
