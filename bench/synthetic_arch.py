"""Synthetic GGUFs of the new MoE architectures with their real per-layer shapes and published quant
mixes, but fewer layers, written at bench time (never committed) for bench/engine_cpu.py's ``--arch``.

    python -m bench.synthetic_arch glm4moe|gpt-oss|deepseek2 [OUT.gguf]   # default var/bench/<name>.gguf

| key | model | kept layers (of) | per-layer shapes | quant mix |
|---|---|---|---|---|
| glm4moe | GLM-4.5-Air | 1 dense + 4 MoE (1 + 45) | n_embd 4096, 96 q heads / 8 kv heads of 128, rope 64, dense FFN 10944, 128 experts top-8 of 1408 + 1 shared, vocab 151,552 | experts IQ3_XXS (their down rows of 1408: IQ4_NL, llama-quantize's fallback); attn q/k/o, dense + shared FFN, embedding Q4_K (down rows of 10944 / 1408: Q5_0); attn_v and the output head Q6_K |
| gpt-oss | gpt-oss-120b | 2 (36): one sliding, one full | n_embd 2880, 64 q heads / 8 kv heads of 64, 128 experts top-4 of 2880, window 128, vocab 201,088 | experts MXFP4; everything else 2-D Q8_0 |
| deepseek2 | DeepSeek-V3 | 1 dense + 1 MoE (3 + 58) | n_embd 7168, 128 heads, MLA q_lora 1536 / kv_lora 512, qk 128 + 64 rope, v 128, dense FFN 18432, 256 experts top-8 of 2048 + 1 shared, 8 groups top-4, vocab 129,280 | experts IQ3_XXS; attention, dense + shared FFN, embedding Q4_K; attn_k_b / attn_v_b Q8_0 (rows of 128); the output head Q6_K |

Fewer layers keep each file at 4.7-6.2 GB (this box: 23 GiB RAM, both engines map the same file) and
its build at a minute or two; the per-token share of the output head and embedding is larger than in
the full model (the bench prints its per-op profile). Weights are random valid blocks of each type
(codes, grid indices, signs and sub-scales random; each block's scale fields set so values have std
~1/sqrt(fan-in)): the models are for timing only and their text is noise. The vocabulary is the
byte-level BPE of tests/engine/gguf_factory.py padded with unreachable filler tokens to the real size.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import IO, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from tests.engine.gguf_factory import (
    _RANDOM_BLOCK_SCALES,
    add_metadata,
    deepseek_vocab_metadata,
    glm_vocab_metadata,
)

T = GGMLQuantizationType
OUT_DIR = Path(__file__).resolve().parent.parent / "var" / "bench"
SEED = 20261204
CHUNK_BYTES = 64 << 20  # random bytes generated per piece of a tensor

# The f16 scale fields of each block (byte offset: value relative to d) for the types whose
# random blocks this module writes; the low-bit K and IQ4 types come from gguf_factory.
_SCALES: dict[GGMLQuantizationType, dict[int, float]] = {
    **_RANDOM_BLOCK_SCALES,
    T.Q8_0: {0: 1.0}, T.Q5_0: {0: 1.0},
    T.Q4_K: {0: 1.0, 2: 7.5},  # dmin 7.5 d: the mean code times the mean scale, about zero-mean
    T.Q6_K: {208: 1.0},
    T.IQ2_XXS: {0: 1.0}, T.IQ2_XS: {0: 1.0}, T.IQ2_S: {0: 1.0}, T.IQ3_XXS: {0: 1.0}, T.IQ3_S: {0: 1.0},
}


# llama-quantize's type for rows that are not a whole number of 256-blocks (GLM-4.5-Air's 1408 and 10944)
FALLBACK = {T.IQ3_XXS: T.IQ4_NL, T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}


@dataclass(frozen=True)
class Tensor:
    """One tensor of the plan: numpy-order shape in elements (last axis the row), type, value std."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    std: float = 0.0  # 2-D+ weights: value std; 1-D F32: 0 -> ones (norm gains), else N(0, std)

    @property
    def row_bytes(self) -> int:
        if self.qtype == T.F32:
            return 4 * self.shape[-1]
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape[:-1]) * self.row_bytes


@dataclass(frozen=True)
class Arch:
    """One synthetic model: what it stands for, its metadata and tensor plan."""

    key: str
    model: str
    arch: str
    layers_kept: str
    n_vocab: int
    vocab: dict[str, object]
    keys: dict[str, object]
    tensors: list[Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


# ---------------------------------------------------------------- random blocks
@cache
def _unit_std(qtype: GGMLQuantizationType) -> float:
    """Std of dequantised random blocks with every scale field at its unit value (256 blocks)."""
    raw = _with_scales(np.random.default_rng(0).integers(0, 256, (256, GGML_QUANT_SIZES[qtype][1]), np.uint8),
                       qtype, 1.0)
    return float(dequantize(raw.reshape(-1), qtype).astype(np.float64).std())


def _with_scales(raw: np.ndarray, qtype: GGMLQuantizationType, mult: float) -> np.ndarray:
    """`raw` [n_blocks, type_size] with its scale fields set for values of std ~`mult` x unit."""
    if qtype == T.MXFP4:  # one e8m0 exponent byte: the value scale is 2^(e - 127) (ggml halves the codes)
        raw[:, 0] = np.uint8(127 + round(math.log2(mult)))
        return raw
    for off, v in _SCALES[qtype].items():
        raw[:, off:off + 2] = np.full(raw.shape[0], v * mult, np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` random valid blocks of `qtype` whose values have std ~`std`: [n_blocks, type_size] uint8."""
    raw = rng.integers(0, 256, (n_blocks, GGML_QUANT_SIZES[qtype][1]), np.uint8)
    return _with_scales(raw, qtype, std / _unit_std(qtype))


class _Streamed:
    """A tensor's bytes generated piece by piece as GGUFWriter.write_tensor_data writes them
    (it needs only .nbytes and .tofile), so that no multi-GB array is ever held."""

    def __init__(self, t: Tensor, rng: np.random.Generator) -> None:
        self.t, self.rng, self.nbytes = t, rng, t.nbytes

    def tofile(self, fout: IO[bytes]) -> None:
        t = self.t
        if t.qtype == T.F32:
            n = math.prod(t.shape)
            a = np.ones(n, np.float32) if t.std == 0.0 else (self.rng.standard_normal(n) * t.std).astype(np.float32)
            a.tofile(fout)
            return
        block, size = GGML_QUANT_SIZES[t.qtype]
        total = self.nbytes // size
        step = max(1, CHUNK_BYTES // size)
        for lo in range(0, total, step):
            random_blocks(t.qtype, min(step, total - lo), t.std, self.rng).tofile(fout)


# ---------------------------------------------------------------- vocabularies
def padded_vocab(md: dict[str, object], n_vocab: int) -> dict[str, object]:
    """A tokenizer block from gguf_factory padded to `n_vocab` tokens with normal filler tokens
    that no merge reaches (the special ids keep their places)."""
    tokens = list(md["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    types = list(md["tokenizer.ggml.token_type"])  # type: ignore[call-overload]
    pad = n_vocab - len(tokens)
    return {**md, "tokenizer.ggml.tokens": tokens + [f"<filler_{i}>" for i in range(pad)],
            "tokenizer.ggml.token_type": types + [1] * pad}


# ---------------------------------------------------------------- the three plans
def _attn_std(fan_in: int) -> float:
    return 1.0 / math.sqrt(fan_in)


def glm45_air(n_dense: int = 1, n_moe: int = 4) -> Arch:
    e, nh, nkv, hd, ff, fe, ne, nv = 4096, 96, 8, 128, 10944, 1408, 128, 151552
    a = Arch("glm4moe", "GLM-4.5-Air", "glm4moe", f"{n_dense} dense + {n_moe} MoE of 1 + 45 (no NextN layer)", nv,
             padded_vocab(glm_vocab_metadata(), nv), {
                 "block_count": n_dense + n_moe, "context_length": 131072, "embedding_length": e,
                 "feed_forward_length": ff, "attention.head_count": nh, "attention.head_count_kv": nkv,
                 "attention.key_length": hd, "attention.value_length": hd, "rope.dimension_count": 64,
                 "rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-5, "expert_count": ne,
                 "expert_used_count": 8, "expert_shared_count": 1, "expert_feed_forward_length": fe,
                 "leading_dense_block_count": n_dense, "nextn_predict_layers": 0, "vocab_size": nv,
                 "expert_gating_func": 2, "expert_weights_scale": 1.0, "expert_weights_norm": True})
    ts = a.tensors
    ts += _embedding_and_head(nv, e, T.Q4_K, T.Q6_K)
    for i in range(n_dense + n_moe):
        p = f"blk.{i}."
        ts += [Tensor(p + "attn_norm.weight", (e,), T.F32),
               *_biased_attention(p, e, nh, nkv, hd, T.Q4_K, T.Q6_K),
               Tensor(p + "post_attention_norm.weight", (e,), T.F32)]
        if i < n_dense:
            ts += _ffn(p, "", ff, e, T.Q4_K)
            continue
        ts += _sigmoid_moe(p, ne, fe, e)
    return a


def gpt_oss_120b(n_layer: int = 2) -> Arch:
    e, nh, nkv, hd, fe, ne, nv = 2880, 64, 8, 64, 2880, 128, 201088
    a = Arch("gpt-oss", "gpt-oss-120b", "gpt-oss", f"{n_layer} of 36 (sliding and full alternate)", nv,
             padded_vocab(glm_vocab_metadata(), nv), {
                 "block_count": n_layer, "context_length": 131072, "embedding_length": e,
                 "feed_forward_length": fe, "attention.head_count": nh, "attention.head_count_kv": nkv,
                 "attention.key_length": hd, "attention.value_length": hd, "rope.dimension_count": hd,
                 "rope.freq_base": 150000.0, "attention.layer_norm_rms_epsilon": 1e-5, "expert_count": ne,
                 "expert_used_count": 4, "expert_feed_forward_length": fe, "attention.sliding_window": 128})
    ts = a.tensors
    ts += _embedding_and_head(nv, e, T.Q8_0, T.Q8_0)
    for i in range(n_layer):
        p = f"blk.{i}."
        ts += [Tensor(p + "attn_norm.weight", (e,), T.F32),
               *_biased_attention(p, e, nh, nkv, hd, T.Q8_0, T.Q8_0),
               Tensor(p + "attn_output.bias", (e,), T.F32, 0.1), Tensor(p + "attn_sinks.weight", (nh,), T.F32, 1.0),
               Tensor(p + "post_attention_norm.weight", (e,), T.F32),
               Tensor(p + "ffn_gate_inp.weight", (ne, e), T.F32, 2.0 / math.sqrt(e)),
               Tensor(p + "ffn_gate_inp.bias", (ne,), T.F32, 0.5)]
        ts += _ffn(p, "_exps", fe, e, T.MXFP4, ne)
        ts += [Tensor(p + "ffn_gate_exps.bias", (ne, fe), T.F32, 0.1), Tensor(p + "ffn_up_exps.bias", (ne, fe), T.F32, 0.1),
               Tensor(p + "ffn_down_exps.bias", (ne, e), T.F32, 0.1)]
    return a


def deepseek_v3(n_dense: int = 1, n_moe: int = 1) -> Arch:
    e, nh, ql, kvl, nope, rope, vd, ff, fe, ne, nv = 7168, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 129280
    a = Arch("deepseek2", "DeepSeek-V3", "deepseek2", f"{n_dense} dense + {n_moe} MoE of 3 + 58 (no MTP layer)", nv,
             padded_vocab(deepseek_vocab_metadata(), nv), {
                 "block_count": n_dense + n_moe, "context_length": 163840, "embedding_length": e,
                 "feed_forward_length": ff, "attention.head_count": nh, "attention.head_count_kv": 1,
                 "attention.key_length": kvl + rope, "attention.value_length": kvl,
                 "attention.key_length_mla": nope + rope, "attention.value_length_mla": vd,
                 "rope.dimension_count": rope, "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-6,
                 "expert_count": ne, "expert_used_count": 8, "expert_shared_count": 1,
                 "expert_feed_forward_length": fe, "leading_dense_block_count": n_dense,
                 "attention.q_lora_rank": ql, "attention.kv_lora_rank": kvl, "vocab_size": nv,
                 "expert_gating_func": 2, "expert_weights_scale": 2.5, "expert_weights_norm": True,
                 "expert_group_count": 8, "expert_group_used_count": 4})
    ts = a.tensors
    ts += _embedding_and_head(nv, e, T.Q4_K, T.Q6_K)
    for i in range(n_dense + n_moe):
        p = f"blk.{i}."
        ts += [Tensor(p + "attn_norm.weight", (e,), T.F32),
               Tensor(p + "attn_q_a.weight", (ql, e), T.Q4_K, _attn_std(e)),
               Tensor(p + "attn_q_a_norm.weight", (ql,), T.F32),
               Tensor(p + "attn_q_b.weight", (nh * (nope + rope), ql), T.Q4_K, 1.5 * _attn_std(ql)),
               Tensor(p + "attn_kv_a_mqa.weight", (kvl + rope, e), T.Q4_K, 1.5 * _attn_std(e)),
               Tensor(p + "attn_kv_a_norm.weight", (kvl,), T.F32),
               Tensor(p + "attn_k_b.weight", (nh, kvl, nope), T.Q8_0, 1.5 * _attn_std(kvl)),
               Tensor(p + "attn_v_b.weight", (nh, vd, kvl), T.Q8_0, 1.5 * _attn_std(kvl)),
               Tensor(p + "attn_output.weight", (e, nh * vd), T.Q4_K, _attn_std(nh * vd)),
               Tensor(p + "ffn_norm.weight", (e,), T.F32)]
        if i < n_dense:
            ts += _ffn(p, "", ff, e, T.Q4_K)
            continue
        ts += _sigmoid_moe(p, ne, fe, e)
    return a


def _embedding_and_head(nv: int, e: int, emb_type: GGMLQuantizationType,
                        out_type: GGMLQuantizationType) -> list[Tensor]:
    """The token embedding (std 1, in emb_type), the output norm and the output head (logits of std ~4, in
    out_type) of a vocabulary of nv tokens and width e."""
    return [Tensor("token_embd.weight", (nv, e), emb_type, 1.0), Tensor("output_norm.weight", (e,), T.F32),
            Tensor("output.weight", (nv, e), out_type, 4.0 / math.sqrt(e))]


def _biased_attention(p: str, e: int, nh: int, nkv: int, hd: int, qtype: GGMLQuantizationType,
                      v_type: GGMLQuantizationType) -> list[Tensor]:
    """q / k / v projections with their biases and the output projection (GLM-4.5 and gpt-oss): v in v_type,
    the others in qtype."""
    return [Tensor(p + "attn_q.weight", (nh * hd, e), qtype, _attn_std(e)),
            Tensor(p + "attn_k.weight", (nkv * hd, e), qtype, _attn_std(e)),
            Tensor(p + "attn_v.weight", (nkv * hd, e), v_type, _attn_std(e)),
            Tensor(p + "attn_q.bias", (nh * hd,), T.F32, 0.1), Tensor(p + "attn_k.bias", (nkv * hd,), T.F32, 0.1),
            Tensor(p + "attn_v.bias", (nkv * hd,), T.F32, 0.1),
            Tensor(p + "attn_output.weight", (e, nh * hd), qtype, _attn_std(nh * hd))]


def _sigmoid_moe(p: str, ne: int, fe: int, e: int) -> list[Tensor]:
    """A GLM-4.5 / DeepSeek-V3 MoE layer's FFN as published: the router with its score-correction bias (sigmoid
    routing), IQ3_XXS routed experts and a Q4_K shared expert of the same width."""
    return [Tensor(p + "ffn_gate_inp.weight", (ne, e), T.F32, 2.0 / math.sqrt(e)),
            Tensor(p + "exp_probs_b.bias", (ne,), T.F32, 0.3),
            *_ffn(p, "_exps", fe, e, T.IQ3_XXS, ne), *_ffn(p, "_shexp", fe, e, T.Q4_K)]


def _ffn(p: str, suffix: str, ff: int, e: int, qtype: GGMLQuantizationType, n_expert: int = 0) -> list[Tensor]:
    """gate / up [(n_expert,) ff, e] and down [(n_expert,) e, ff] of one FFN (dense, routed or shared).
    A down row that is not a whole number of 256-blocks takes llama-quantize's fallback type."""
    lead = (n_expert,) if n_expert else ()
    down = qtype if ff % GGML_QUANT_SIZES[qtype][0] == 0 else FALLBACK[qtype]
    return [Tensor(f"{p}ffn_gate{suffix}.weight", (*lead, ff, e), qtype, _attn_std(e)),
            Tensor(f"{p}ffn_up{suffix}.weight", (*lead, ff, e), qtype, _attn_std(e)),
            Tensor(f"{p}ffn_down{suffix}.weight", (*lead, e, ff), down, 0.5 * _attn_std(ff))]


ARCHS: dict[str, Callable[[], Arch]] = {"glm4moe": glm45_air, "gpt-oss": gpt_oss_120b, "deepseek2": deepseek_v3}


def default_path(key: str) -> Path:
    return OUT_DIR / f"synthetic-{ARCHS[key]().model.lower()}.gguf"


# ---------------------------------------------------------------- writer
def write_arch(a: Arch, out: Path, seed: int = SEED) -> Path:
    """Write `a` to `out` (through a temp file renamed at the end)."""
    from engine.gguf_model import abort_gguf, commit_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = GGUFWriter(tmp, a.arch)
    try:
        w.add_name(f"synthetic {a.model} ({a.layers_kept} layers)")
        md: dict[str, Any] = {f"{a.arch}.{k}": v for k, v in a.keys.items() if not isinstance(v, float)}
        add_metadata(w, md)
        for k, v in a.keys.items():
            if isinstance(v, float):
                w.add_float32(f"{a.arch}.{k}", v)
        add_metadata(w, a.vocab)
        for t in a.tensors:
            dtype = np.float32 if t.qtype == T.F32 else np.uint8
            shape = t.shape if t.qtype == T.F32 else (*t.shape[:-1], t.row_bytes)
            w.add_tensor_info(t.name, shape, np.dtype(dtype), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for t in a.tensors:
            w.write_tensor_data(_Streamed(t, rng))  # type: ignore[arg-type]
        commit_gguf(w, tmp, out)
    except BaseException:
        abort_gguf(w, tmp)
        raise
    return out


def build(key: str, out: Path | None = None) -> Path:
    """The synthetic model `key` at `out` (default var/bench/...), written unless already there."""
    out = Path(out) if out is not None else default_path(key)
    if not out.is_file():
        write_arch(ARCHS[key](), out)
    return out


def describe(key: str) -> str:
    a = ARCHS[key]()
    return (f"synthetic {a.model} ({a.arch}): real layer shapes, {a.layers_kept} layers kept, "
            f"{a.nbytes / 2**30:.2f} GiB, random weights (timing only)")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ARCHS:
        print(f"usage: python -m bench.synthetic_arch {{{'|'.join(ARCHS)}}} [OUT.gguf]", file=sys.stderr)
        return 2
    print(describe(args[0]), file=sys.stderr)
    print(build(args[0], Path(args[1]) if len(args) > 1 else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
