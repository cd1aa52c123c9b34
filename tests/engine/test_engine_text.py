"""End to end on real weights: the upcycled default model answers like its dense origin."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.assets import smollm2_dense_gguf
from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.gguf_model import open_model
from tests.engine.gguf_factory import make_random_gguf

PARIS = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPTS = ["Once upon a time, in a small village,", "def fibonacci(n):", "The three primary colours are"]


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    dense = Engine.open(smollm2_dense_gguf(), threads=2, kv_tokens=1024)
    moe = Engine.open(build_default_model(default_model_path()), threads=2, kv_tokens=1024)
    yield dense, moe
    dense.close()
    moe.close()


def test_default_model_answers_paris(engines: tuple[Engine, Engine]) -> None:
    _, moe = engines
    res = moe.chat(PARIS, max_tokens=64)
    assert "Paris" in res.text
    assert res.finish_reason == "stop"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_upcycled_greedy_text_equals_dense(engines: tuple[Engine, Engine], prompt: str) -> None:
    dense, moe = engines
    ids = dense.tokenizer.encode(prompt)
    assert ids == moe.tokenizer.encode(prompt)
    a = dense.generate(ids, max_tokens=64)
    b = moe.generate(ids, max_tokens=64)
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert len(a.token_ids) == 64 or a.finish_reason == "stop"


def test_chat_answer_equal_to_dense(engines: tuple[Engine, Engine]) -> None:
    dense, moe = engines
    assert dense.chat(PARIS, max_tokens=64).text == moe.chat(PARIS, max_tokens=64).text


def test_identical_experts_with_random_router_reproduce_dense_bitwise(tmp_path: Path) -> None:
    """Any routing over identical experts equals the dense FFN exactly (the weighted sum is
    done in double with one rounding), not only the paired router of the default model."""
    dense_path = make_random_gguf(tmp_path / "dense.gguf", n_expert=0, seed=5)
    mf = open_model(dense_path)
    arrays = {n: np.array(t.data).view(np.float32).reshape(tuple(reversed(t.shape))) for n, t in mf.tensors.items()}
    rng = np.random.default_rng(9)
    over = dict(arrays)
    for i in range(2):
        for part in ("gate", "up", "down"):
            over[f"blk.{i}.ffn_{part}_exps.weight"] = np.stack([arrays[f"blk.{i}.ffn_{part}.weight"]] * 6)
        over[f"blk.{i}.ffn_gate_inp.weight"] = rng.standard_normal((6, 64)).astype(np.float32)
    moe_path = make_random_gguf(tmp_path / "moe.gguf", n_expert=6, n_expert_used=3, overrides=over)
    ids = list(rng.integers(0, 128, size=40))
    with Engine.open(dense_path, threads=2, kv_tokens=256) as d, Engine.open(moe_path, threads=2, kv_tokens=256) as m:
        assert np.array_equal(d.logits_for(ids), m.logits_for(ids))
