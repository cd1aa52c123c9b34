"""The synthetic architecture models' plans and writer (bench/synthetic_arch.py), without writing the
multi-GB files themselves."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from bench.synthetic_arch import ARCHS, FALLBACK, Arch, Tensor, padded_vocab, random_blocks, write_arch
from tests.engine.gguf_factory import GLM_VOCAB, glm_vocab_metadata

T = GGMLQuantizationType


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0, T.IQ3_XXS, T.IQ4_NL, T.MXFP4, T.Q2_K, T.IQ2_S])
def test_random_blocks_have_the_asked_std(qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, 512, 0.02, np.random.default_rng(3))
    assert raw.shape == (512, GGML_QUANT_SIZES[qtype][1])
    vals = dequantize(raw.reshape(-1), qtype)
    assert np.isfinite(vals).all()
    assert 0.5 * 0.02 < float(vals.std()) < 2.0 * 0.02  # MXFP4 scales by powers of two


@pytest.mark.parametrize("key", list(ARCHS))
def test_plans_hold_real_shapes_in_whole_blocks(key: str) -> None:
    a = ARCHS[key]()
    names = [t.name for t in a.tensors]
    assert len(names) == len(set(names))
    for t in a.tensors:
        if t.qtype != T.F32:
            assert t.shape[-1] % GGML_QUANT_SIZES[t.qtype][0] == 0, t
    by = {t.name: t for t in a.tensors}
    assert by["token_embd.weight"].shape[0] == a.n_vocab == len(a.vocab["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    assert 4 << 30 < a.nbytes < 7 << 30  # fits this box beside llama.cpp's mapping of the same file


def test_published_mixes() -> None:
    glm = {t.name: t for t in ARCHS["glm4moe"]().tensors}
    assert glm["blk.1.ffn_gate_exps.weight"].shape == (128, 1408, 4096)
    assert glm["blk.1.ffn_gate_exps.weight"].qtype == T.IQ3_XXS
    assert glm["blk.1.ffn_down_exps.weight"].qtype == FALLBACK[T.IQ3_XXS] == T.IQ4_NL  # rows of 1408
    assert glm["blk.0.attn_q.weight"].qtype == T.Q4_K and glm["blk.0.attn_v.weight"].qtype == T.Q6_K
    oss = {t.name: t for t in ARCHS["gpt-oss"]().tensors}
    assert oss["blk.0.ffn_up_exps.weight"].shape == (128, 2880, 2880)
    assert oss["blk.0.ffn_up_exps.weight"].qtype == T.MXFP4
    ds = {t.name: t for t in ARCHS["deepseek2"]().tensors}
    assert ds["blk.1.ffn_down_exps.weight"].shape == (256, 7168, 2048)
    assert ds["blk.1.ffn_down_exps.weight"].qtype == T.IQ3_XXS
    assert ds["blk.0.attn_kv_a_mqa.weight"].shape == (576, 7168)


def test_padded_vocab_keeps_the_specials_in_place() -> None:
    md = glm_vocab_metadata()
    out = padded_vocab(md, GLM_VOCAB + 5)
    toks, types = out["tokenizer.ggml.tokens"], out["tokenizer.ggml.token_type"]
    assert len(toks) == len(types) == GLM_VOCAB + 5  # type: ignore[arg-type]
    assert toks[:GLM_VOCAB] == md["tokenizer.ggml.tokens"] and len(set(toks)) == len(toks)  # type: ignore[arg-type]
    assert out["tokenizer.ggml.eos_token_id"] == md["tokenizer.ggml.eos_token_id"]


def test_writer_streams_the_plan(tmp_path: Path) -> None:
    a = Arch("tiny", "tiny", "llama", "2", GLM_VOCAB + 4, padded_vocab(glm_vocab_metadata(), GLM_VOCAB + 4),
             {"block_count": 1, "embedding_length": 256, "rope.freq_base": 10000.0})
    a.tensors.extend([Tensor("token_embd.weight", (GLM_VOCAB + 4, 256), T.Q4_K, 1.0),
                      Tensor("output_norm.weight", (256,), T.F32),
                      Tensor("blk.0.ffn_up_exps.weight", (3, 64, 256), T.IQ3_XXS, 0.05),
                      Tensor("blk.0.attn_q.bias", (64,), T.F32, 0.1)])
    out = write_arch(a, tmp_path / "m.gguf")
    r = GGUFReader(out)
    got = {t.name: t for t in r.tensors}
    assert got["blk.0.ffn_up_exps.weight"].tensor_type == T.IQ3_XXS
    assert [int(x) for x in got["blk.0.ffn_up_exps.weight"].shape] == [256, 64, 3]
    assert np.all(np.asarray(got["output_norm.weight"].data) == 1.0)
    assert float(np.asarray(got["blk.0.attn_q.bias"].data).std()) > 0.0
    assert int(r.get_field("llama.block_count").contents()) == 1
    assert abs(float(r.get_field("llama.rope.freq_base").contents()) - 10000.0) < 1e-3
    assert not list(tmp_path.glob(".*.tmp"))
