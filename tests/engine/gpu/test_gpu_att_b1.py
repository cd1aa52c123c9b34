"""STRATA_GPU_ATT_B1 (session 12, default 3 since run 72; tests/engine/gpu/b1_att_candidate.patch): the fused decode attention's
q / k head prep with a shorter chain (k_attention<1, 128, B1>: the head's values and norm weights in registers, RoPE's
cos / sin from a table that warp 3 computes, after its wait at 1, before it at 2 and 3; 3 also prefetches the next
layer's K / V into L2) promises HEAD's bits: the same operations in the same order. The form only runs inside fused
decode steps (every token of a different sequence, head_dim 128), so these tests compare whole decode steps of a small
random Qwen3-MoE with head_dim 128 (head norms, NEOX RoPE over all 128 dimensions, no q / k / v bias): 1, 2 and 16
sequences (16: the q / k / v GEMM's split parts added inside the attention, COMBINE_FUSE), prompts of 20 and 70 tokens
(partial and whole chunks, 2 and 5 chunks of 16 keys), with ATT_PRE on and off. A library without the switch ignores
it (the tests then pass trivially)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.gpu._env import requires_gpu
from tests.engine.gpu._steps import decode_logits

pytestmark = requires_gpu


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


@pytest.fixture(scope="module")
def eng(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 (the engine, closed after the module)
    H = pytest.importorskip("tests.engine.hf_models", reason="transformers (torch) builds the model")
    from engine.engine import Engine

    tmp = tmp_path_factory.mktemp("att_b1")
    hf_dir, _ = H.MAKERS["qwen3moe"](tmp / "hf", head_dim=128)
    path = H.to_gguf(hf_dir, tmp / "m.q8_0.gguf", "q8_0")
    e = Engine.open(path, device="cuda:0", kv_tokens=4096, block_size=16)
    yield e
    e.close()


@pytest.mark.parametrize("pre", ["1", "0"])
@pytest.mark.parametrize("prompt_len", [20, 70])
@pytest.mark.parametrize("n_seq", [1, 2, 16])
def test_decode_steps_bitwise_with_att_b1(eng: object, n_seq: int, prompt_len: int, pre: str) -> None:
    """Every decode step's logits with STRATA_GPU_ATT_B1 at 1, 2 and 3 bitwise equal to HEAD's form (0)."""
    base = {"STRATA_GPU_ATT_PRE": pre, "STRATA_GPU_ATT_V2": "1", "STRATA_GPU_ATT_UNROLL": "1"}
    want = decode_logits(eng, n_seq, 4, {**base, "STRATA_GPU_ATT_B1": "0"}, prompt_len=prompt_len)
    assert all(np.isfinite(w).all() for w in want)
    for b1 in ("1", "2", "3"):
        got = decode_logits(eng, n_seq, 4, {**base, "STRATA_GPU_ATT_B1": b1}, prompt_len=prompt_len)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(want, got, strict=True))
        assert all(same(a, b) for a, b in zip(want, got, strict=True)), (n_seq, prompt_len, pre, b1, diff)
