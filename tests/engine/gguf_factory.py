"""Small random GGUF models written directly with gguf-py, for engine tests.

These exercise the engine without Hugging Face in the loop (batching, bad input);
the HF parity tests build their models through engine.convert_hf instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

TINY_VOCAB = 300


def make_tiny_gguf(path: Path) -> Path:
    """The cheap 2-layer Q8_0 model of TINY_VOCAB ids (conftest.py's ``tiny_path``: the greedy-pick, overlap
    and scheduler tests)."""
    return make_random_gguf(path, n_vocab=TINY_VOCAB, n_layer=2, weight_type=GGMLQuantizationType.Q8_0)


def random_quant_blob(qtype: GGMLQuantizationType, shape: tuple[int, ...], std: float,
                      rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a quant type whose first two bytes are its f16 scale d (the IQ types,
    which gguf-py cannot quantise to): random codes, grid indices, signs and sub-scales, then each
    block's d set so that the dequantised values have roughly standard deviation `std`. Returns the
    raw bytes shaped [*shape[:-1], bytes per row] (ggml order reversed, as GGUFWriter takes them)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    raw[:, :2] = np.ones(n_blocks, np.float16).view(np.uint8).reshape(-1, 2)
    unit = float(dequantize(raw.reshape(-1), qtype).std())
    d = (rng.uniform(0.5, 1.5, n_blocks) * std / unit).astype(np.float16)
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * type_size)


def make_random_gguf(
    path: Path,
    *,
    arch: str = "llama",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 96,
    n_vocab: int = 128,
    n_expert: int = 4,
    n_expert_used: int = 2,
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    seed: int = 0,
    overrides: dict[str, np.ndarray] | None = None,
    omit: tuple[str, ...] = (),
    raw_overrides: dict[str, tuple[np.ndarray, tuple[int, ...], GGMLQuantizationType]] | None = None,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    n_ff_shexp: int = 0,
    spm_vocab: bool = False,
) -> Path:
    """Write a random model; `overrides` replaces tensors by name (float data),
    `raw_overrides` by (raw bytes, logical shape, type), `omit` drops them. `qkv_bias`
    adds q/k/v biases (qwen2moe), `qk_norm` per-head q/k norms (qwen3moe), `n_ff_shexp`
    a gated shared expert of that width (qwen2moe), `spm_vocab` a placeholder SentencePiece vocabulary
    (<unk>, <s>, </s>, then one piece per id) and the expert width key so that llama.cpp loads the file."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    if n_ff_shexp:
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", n_ff_shexp)
    if spm_vocab:
        if n_expert:  # llama.cpp reads the expert width from here (Strata from the tensors)
            w.add_expert_feed_forward_length(n_ff)
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"p{i}" for i in range(3, n_vocab)])
        w.add_token_scores([0.0] * n_vocab)
        w.add_token_types([2, 3, 3] + [1] * (n_vocab - 3))

    def mat(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def add(name: str, data: np.ndarray, quant: bool = True) -> None:
        if name in omit:
            return
        if raw_overrides and name in raw_overrides:
            blob, shape, qtype = raw_overrides[name]
            w.add_tensor(name, blob, raw_shape=shape, raw_dtype=qtype)
            return
        if overrides and name in overrides:
            data = overrides[name]
        if quant and weight_type != GGMLQuantizationType.F32 and data.ndim >= 2:
            q = quantize(data, weight_type)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=weight_type)
        else:
            w.add_tensor(name, data)

    add("token_embd.weight", mat(n_vocab, n_embd, scale=0.5))
    add("output_norm.weight", (1.0 + mat(n_embd)).astype(np.float32), quant=False)
    add("output.weight", mat(n_vocab, n_embd, scale=0.2))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (1.0 + mat(n_embd)).astype(np.float32), quant=False)
        add(p + "attn_q.weight", mat(n_head * head_dim, n_embd, scale=0.2))
        add(p + "attn_k.weight", mat(n_head_kv * head_dim, n_embd, scale=0.2))
        add(p + "attn_v.weight", mat(n_head_kv * head_dim, n_embd))
        add(p + "attn_output.weight", mat(n_embd, n_head * head_dim))
        if qkv_bias:
            add(p + "attn_q.bias", mat(n_head * head_dim), quant=False)
            add(p + "attn_k.bias", mat(n_head_kv * head_dim), quant=False)
            add(p + "attn_v.bias", mat(n_head_kv * head_dim), quant=False)
        if qk_norm:
            add(p + "attn_q_norm.weight", (1.0 + mat(head_dim)).astype(np.float32), quant=False)
            add(p + "attn_k_norm.weight", (1.0 + mat(head_dim)).astype(np.float32), quant=False)
        add(p + "ffn_norm.weight", (1.0 + mat(n_embd)).astype(np.float32), quant=False)
        if n_expert:
            add(p + "ffn_gate_inp.weight", mat(n_expert, n_embd, scale=0.5), quant=False)
            add(p + "ffn_gate_exps.weight", mat(n_expert, n_ff, n_embd))
            add(p + "ffn_up_exps.weight", mat(n_expert, n_ff, n_embd))
            add(p + "ffn_down_exps.weight", mat(n_expert, n_embd, n_ff))
            if n_ff_shexp:
                add(p + "ffn_gate_inp_shexp.weight", mat(n_embd, scale=0.5), quant=False)
                add(p + "ffn_gate_shexp.weight", mat(n_ff_shexp, n_embd))
                add(p + "ffn_up_shexp.weight", mat(n_ff_shexp, n_embd))
                add(p + "ffn_down_shexp.weight", mat(n_embd, n_ff_shexp))
        else:
            add(p + "ffn_gate.weight", mat(n_ff, n_embd))
            add(p + "ffn_up.weight", mat(n_ff, n_embd))
            add(p + "ffn_down.weight", mat(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
