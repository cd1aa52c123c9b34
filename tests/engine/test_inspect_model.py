"""`strata model inspect`'s KV tier figures: bytes per token and the tokens each tier's budget holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.gguf_model import open_model
from engine.inspect_model import GIB, _fmt_bytes, analyse, render, step_buffer_bytes, tier_tokens


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
    # a GPU lane's 2,048-token steps: larger step buffers, fewer hot tokens, in the tier line and the whole-model line
    hot2k, _ = tier_tokens(mf, None, 0.5, step_tokens=2048)
    assert hot2k == (int(0.5 * GIB) - r.dense_bytes - step_buffer_bytes(mf.hparams, 2048)) // r.kv_bytes_per_token
    assert hot2k < hot
    assert f"step buffers) {hot2k:,} tokens" in render(mf, None, 0.5, 1024, 2048)


def test_q8_kv_figures(tiny_path: Path) -> None:
    """The 8-bit cache (kv_type q8_0): a byte a value and an F16 scale per 32 values, 17/32 of the F16 bytes, so
    a VRAM budget's hot tier holds about 1.88x the tokens; the plan's KV part follows the kv_type."""
    from engine.placement import fixed_gpu_bytes

    mf = open_model(tiny_path)
    hp = mf.hparams
    per16, per8 = hp.kv_bytes_per_token_of("f16"), hp.kv_bytes_per_token_of("q8_0")
    values = 2 * hp.n_layer * hp.n_head_kv * hp.head_dim
    assert per16 == hp.kv_bytes_per_token == 2 * values
    assert per8 == values + 2 * values // 32
    free = int(0.5 * GIB) - analyse(mf).dense_bytes - step_buffer_bytes(hp)
    hot8, _ = tier_tokens(mf, None, 0.5, per8)
    assert hot8 == free // per8 and tier_tokens(mf, None, 0.5)[0] == free // per16
    out = render(mf, None, 0.5, 1024)
    assert f"KV cache q8_0   {_fmt_bytes(per8)} per token, {_fmt_bytes(per8 * 1024)} at context 1024" in out
    assert f"{GIB // per8:,} tokens a GiB, F16 {GIB // per16:,}" in out
    assert f"hot (VRAM 0.5 GiB) {hot8:,} tokens with kv_type q8_0" in out
    assert fixed_gpu_bytes(mf, 1024, 2, kv_type="q8_0")["KV cache"] == per8 * 1024 * 2
    assert fixed_gpu_bytes(mf, 1024, 2)["KV cache"] == per16 * 1024 * 2
    with pytest.raises(ValueError, match="kv_type"):
        hp.kv_bytes_per_token_of("q4")
