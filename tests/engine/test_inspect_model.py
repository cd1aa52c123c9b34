"""`strata model inspect`'s KV tier figures: bytes per token and the tokens each tier's budget holds."""

from __future__ import annotations

from pathlib import Path

from engine.gguf_model import open_model
from engine.inspect_model import GIB, analyse, render, step_buffer_bytes, tier_tokens


def test_tier_tokens_and_line(tiny_path: Path) -> None:
    mf = open_model(tiny_path)
    r = analyse(mf)
    hot, cold = tier_tokens(mf, 1.0, 0.5)
    assert hot == (int(0.5 * GIB) - r.dense_bytes - step_buffer_bytes(mf.hparams)) // r.kv_bytes_per_token
    assert cold == (GIB - r.file_bytes) // r.kv_bytes_per_token
    assert tier_tokens(mf, None, None) == (None, None)
    assert tier_tokens(mf, 1e-9, None) == (None, 0)  # a budget below the weights holds nothing
    out = render(mf, 1.0, 0.5, 1024)
    assert f"hot (VRAM 0.5 GiB after dense weights and step buffers) {hot:,} tokens" in out
    assert f"cold (RAM 1 GiB after the weights) {cold:,} tokens" in out
    assert f"{hot + cold:,} tokens in all = {(hot + cold) // 1024:,} sequences at context 1024" in out
    assert "KV tiers" not in render(mf, None, None, 1024)
