"""A step over many sequences gives each sequence the logits it gets alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from engine.engine import Engine
from engine.native import VARIANTS, available_variants, lib
from tests.engine.gguf_factory import make_random_gguf
from tests.engine.sched_helpers import prefill_together, release_tables


@pytest.fixture(scope="module", params=["F32", "Q8_0", "Q4_1"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    qt = GGMLQuantizationType[request.param]
    return make_random_gguf(tmp_path_factory.mktemp("m") / f"moe-{request.param}.gguf", weight_type=qt,
                            n_vocab=160, n_expert=8, n_expert_used=2)


@pytest.fixture(params=available_variants())
def variant(request: pytest.FixtureRequest) -> str:
    """Every kernel variant must be batch invariant on its own."""
    assert lib.st_set_variant(VARIANTS[request.param]) == 0
    yield request.param
    lib.st_set_variant(VARIANTS["auto"])


def test_eight_sequences_batched_equal_alone(model_path: Path, variant: str) -> None:
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 160, size=int(n))) for n in rng.integers(3, 40, size=8)]
    with Engine.open(model_path, threads=2, kv_tokens=1024) as eng:
        alone = [eng.logits_for(p) for p in prompts]  # [T_i, V] each
        batched, tables = prefill_together(eng, prompts)
        release_tables(eng, tables)
        assert eng.blocks.num_free == eng.blocks.n_blocks
    offset = 0
    for p, ref in zip(prompts, alone, strict=True):
        got = batched[offset : offset + len(p)]
        offset += len(p)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, err
        assert np.array_equal(got, ref)  # in fact bit-identical: no kernel depends on the batch


def test_decode_steps_of_mixed_sequences_equal_alone(model_path: Path, variant: str) -> None:
    """Interleaved decode: one step holds one token of each of 4 sequences at different lengths."""
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 160, size=n)) for n in (5, 17, 9, 30)]
    with Engine.open(model_path, threads=2, kv_tokens=1024) as eng:
        ref = [eng.generate(p, max_tokens=8, ignore_eos=True).token_ids for p in prompts]
        tables = [eng.blocks.allocate(-(-(len(p) + 8) // eng.block_size)) for p in prompts]
        last = [int(np.argmax(eng.prefill(p, t))) for p, t in zip(prompts, tables, strict=True)]
        n_tokens = [len(p) for p in prompts]
        outs: list[list[int]] = [[t] for t in last]
        for _ in range(7):
            logits = eng.forward(last, n_tokens, list(range(4)), tables, list(range(4)))
            n_tokens = [n + 1 for n in n_tokens]
            last = [int(np.argmax(row)) for row in logits]
            for o, t in zip(outs, last, strict=True):
                o.append(t)
        for t in tables:
            eng.blocks.release(t)
    assert outs == ref


@pytest.mark.parametrize("threads", [1, 2])
def test_step_reports_pool_idle_share(model_path: Path, threads: int) -> None:
    """st_step_stats.pool_idle_share: the caller alone is never idle; two threads wait somewhere
    (at least on each region's join), but not all the time."""
    with Engine.open(model_path, threads=threads, kv_tokens=256) as eng:
        eng.logits_for([1, 2, 3, 4, 5, 6, 7, 8])
        assert eng.last_stats is not None
        share = eng.last_stats.pool_idle_share
    assert np.isfinite(share)
    if threads == 1:
        assert share == 0.0
    else:
        assert 0.0 < share < 1.0
