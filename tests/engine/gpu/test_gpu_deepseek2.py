"""deepseek2 (DeepSeek-V2 / V3 / R1, Kimi-K2) on the GPU against the CPU engine (the oracle), on the small random
files tests/engine/test_deepseek2.py checks the CPU engine with (gguf_factory.make_deepseek2_gguf, its VARIANTS):
multi-head latent attention (the latent row cached, each head's query absorbed into the latent space, W_UV after
the attention: engine/csrc/cuda/mla.cu), a leading dense layer, MoE layers with shared experts, sigmoid or softmax
gating, the score-correction bias, group-limited top-k and the routed scaling factor.

"v3" (low-rank q, attn_k_b / attn_v_b) and "v2" (q from attn_q, one attn_kv_b: the absorption matrix transposed on
the device) in F32: logits at every position of a 40-token prompt within 1e-2 of max|ref| and 64 greedy tokens
identical. "iq3_xxs" / "q2_k": the routed experts in IQ3_XXS / Q2_K: logits within 2e-2 at the positions where the
oracle is decisive (test_gpu_glm4moe.decisive_rows), greedy tokens identical up to the oracle's first near-tie. Each
also: 16 sequences batched == each alone (tests/engine/gpu/_model_checks.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.engine.gguf_factory import DEEPSEEK_VOCAB, make_deepseek2_gguf
from tests.engine.gpu._env import requires_gpu
from tests.engine.gpu._model_checks import check_model
from tests.engine.gpu.test_gpu_glm4moe import KV_TOKENS, decisive_rows
from tests.engine.test_deepseek2 import VARIANTS

pytestmark = requires_gpu

EXACT = ("v3", "v2")


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(42)
    prompts = [
        [int(t) for t in rng.integers(0, DEEPSEEK_VOCAB, size=int(n))] for n in rng.integers(5, 40, size=16)
    ]
    prompts[0] = [int(t) for t in rng.integers(0, DEEPSEEK_VOCAB, size=40)]
    return prompts


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_deepseek2_gpu_matches_cpu(tmp_path: Path, name: str) -> None:
    path = make_deepseek2_gguf(tmp_path / f"deepseek2.{name}.gguf", **VARIANTS[name])
    prompts = _prompts()
    if name in EXACT:
        check_model(path, prompts, kv_tokens=KV_TOKENS, exact=True, tol=1e-2)
        return
    rows = decisive_rows(path, prompts[0], 2e-2, eps=1e-7)
    assert rows.mean() >= 0.75, f"the oracle is decisive at {rows.sum()} of {rows.size} positions only"
    check_model(path, prompts, kv_tokens=KV_TOKENS, exact=False, tol=2e-2, rows=rows)
