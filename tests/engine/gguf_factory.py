"""Small random GGUF models written directly with gguf-py, for engine tests.

These exercise the engine without Hugging Face in the loop (batching, bad input);
the HF parity tests build their models through engine.convert_hf instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

TINY_VOCAB = 300

# The types gguf-py reads but does not write: byte offsets of each block's f16 scale fields, and
# the value those fields start from (Q2_K's dmin at 1.5 d centres the weights: mean code 1.5,
# mean scale and min alike).
_RANDOM_BLOCK_SCALES: dict[GGMLQuantizationType, dict[int, float]] = {
    GGMLQuantizationType.Q2_K: {80: 1.0, 82: 1.5},
    GGMLQuantizationType.Q3_K: {108: 1.0},
    GGMLQuantizationType.Q6_K: {208: 1.0},
    GGMLQuantizationType.IQ4_NL: {0: 1.0},
    GGMLQuantizationType.IQ4_XS: {0: 1.0},
}


def random_quantized(data: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """`data` quantised to `qtype` by gguf-py where it can; for the types it cannot write
    (_RANDOM_BLOCK_SCALES), random blocks whose dequantised values have the standard deviation of
    `data` (random codes and sub-block scales, the f16 scales set to match). Bytes [..., row_bytes]."""
    if qtype not in _RANDOM_BLOCK_SCALES:
        return quantize(data, qtype)
    bs, tb = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(data.size // bs, tb), dtype=np.uint8)

    def set_scales(mult: float) -> None:
        for off, v in _RANDOM_BLOCK_SCALES[qtype].items():
            raw[:, off:off + 2] = np.full(raw.shape[0], v * mult, np.float16).view(np.uint8).reshape(-1, 2)

    set_scales(1.0)
    std = float(dequantize(raw.reshape(-1), qtype).std())
    set_scales(float(data.std()) / std)
    return raw.reshape(*data.shape[:-1], data.shape[-1] // bs * tb)


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


# A tensor written as given: (raw bytes, logical shape, type).
RawTensor = tuple[np.ndarray, tuple[int, ...], GGMLQuantizationType]
# The types stored as random valid blocks (random_quant_blob) rather than quantised data.
_RANDOM_IQ = (GGMLQuantizationType.IQ3_XXS, GGMLQuantizationType.IQ2_XXS)


def _add_tensor(w: GGUFWriter, rng: np.random.Generator, name: str, data: np.ndarray,
                qtype: GGMLQuantizationType = GGMLQuantizationType.F32, omit: tuple[str, ...] = (),
                raw_overrides: dict[str, RawTensor] | None = None) -> None:
    """Add tensor `name` to `w`: nothing when it is in `omit`, its `raw_overrides` entry as given, else `data`
    as F32 or in `qtype` (random_quant_blob for _RANDOM_IQ, random_quantized for the rest)."""
    if name in omit:
        return
    if raw_overrides and name in raw_overrides:
        blob, shape, raw_type = raw_overrides[name]
        w.add_tensor(name, blob, raw_shape=shape, raw_dtype=raw_type)
    elif qtype == GGMLQuantizationType.F32:
        w.add_tensor(name, data)
    else:
        q = (random_quant_blob(qtype, data.shape, float(data.std()), rng) if qtype in _RANDOM_IQ
             else random_quantized(data, qtype, rng))
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def _scaled_normals(rng: np.random.Generator) -> tuple[Callable[..., np.ndarray], Callable[[int], np.ndarray]]:
    """(mat, gain): mat(*shape, scale=0.08) normal float32 values of std `scale`; gain(n) n norm weights 1 + N(0, 0.2)."""
    def mat(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def gain(n: int) -> np.ndarray:
        return (1.0 + mat(n, scale=0.2)).astype(np.float32)

    return mat, gain


def _add_arch_keys(w: GGUFWriter, arch: str, keys: dict[str, tuple[str, object]], drop_keys: tuple[str, ...]) -> None:
    """Write `keys` (name without the ``arch.`` prefix: (kind, value), kind "u" uint32, "f" float32, "b" bool)
    but those in `drop_keys`."""
    for key, (kind, value) in keys.items():
        if key in drop_keys:
            continue
        if kind == "u":
            w.add_uint32(f"{arch}.{key}", int(value))  # type: ignore[arg-type]
        elif kind == "f":
            w.add_float32(f"{arch}.{key}", float(value))  # type: ignore[arg-type]
        else:
            w.add_bool(f"{arch}.{key}", bool(value))


def _add_extra_md(w: GGUFWriter, extra_md: dict[str, object] | None) -> None:
    """Write full metadata keys: a str as a string, a float as F32, anything else as uint32."""
    for key, value in (extra_md or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))  # type: ignore[arg-type]


def _gating_keys(gating: int | None, weights_scale: float | None, weights_norm: bool | None, n_group: int,
                 n_group_used: int) -> dict[str, tuple[str, object]]:
    """The MoE gating keys for _add_arch_keys: None (or n_group 0 for the group keys) leaves a key out."""
    keys: dict[str, tuple[str, object]] = {}
    if gating is not None:
        keys["expert_gating_func"] = ("u", gating)
    if weights_scale is not None:
        keys["expert_weights_scale"] = ("f", weights_scale)
    if weights_norm is not None:
        keys["expert_weights_norm"] = ("b", weights_norm)
    if n_group:
        keys["expert_group_count"] = ("u", n_group)
        keys["expert_group_used_count"] = ("u", n_group_used)
    return keys


def finish_gguf(w: GGUFWriter, path: Path) -> Path:
    """Write the header, metadata and tensors of `w` and close it; `path` (the file it writes)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
    raw_overrides: dict[str, RawTensor] | None = None,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    n_ff_shexp: int = 0,
    vocab: bool = False,
    n_ctx: int = 256,
    metadata: dict[str, object] | None = None,
) -> Path:
    """Write a random model; `overrides` replaces tensors by name (float data),
    `raw_overrides` by (raw bytes, logical shape, type), `omit` drops them. `qkv_bias`
    adds q/k/v biases (qwen2moe), `qk_norm` per-head q/k norms (qwen3moe), `n_ff_shexp`
    a gated shared expert of that width (qwen2moe), `vocab` a plain SentencePiece-style token list
    (ids 0..2 unk/bos/eos, then one piece per id) so that llama.cpp loads the file; `n_ctx` the
    trained context, `metadata` extra keys (a float value is written as F32)."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    add_metadata(w, metadata or {})
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff)  # llama.cpp sizes qwen3moe experts from this key
    if n_ff_shexp:
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", n_ff_shexp)
    if vocab:
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, n_vocab)])
        w.add_token_scores([0.0] * n_vocab)
        w.add_token_types([2, 3, 3] + [1] * (n_vocab - 3))
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    mat, _ = _scaled_normals(rng)

    def add(name: str, data: np.ndarray, quant: bool = True) -> None:
        if overrides and name in overrides:
            data = overrides[name]
        qtype = weight_type if quant and data.ndim >= 2 else GGMLQuantizationType.F32
        _add_tensor(w, rng, name, data, qtype, omit, raw_overrides)

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
    return finish_gguf(w, path)


# ---------------------------------------------------------------------------------------------- glm4moe

# GLM-4.5's special tokens (their texts in its tokenizer), in this vocabulary after the normal ones.
GLM_SPECIALS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>", "<think>", "</think>")
GLM_VOCAB = 320


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode characters in byte order (the alphabet of a byte-level BPE)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def _byte_bpe(specials: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary: (tokens, merges). The tokens are the 256 byte characters,
    "Ġ" + each lower-case letter, 26 common bigrams, then `specials`."""
    alphabet = _byte_alphabet()
    space = alphabet[ord(" ")]
    bigrams = ["th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed",
               "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha"]
    merges = [f"{space} {c}" for c in "abcdefghijklmnopqrstuvwxyz"] + [f"{a} {b}" for a, b in bigrams]
    return alphabet + [m.replace(" ", "") for m in merges] + list(specials), merges


def glm_vocab_metadata(chat_template: str | None = None) -> dict[str, object]:
    """A GLM-4.5-style byte-level BPE vocabulary of GLM_VOCAB tokens (_byte_bpe with GLM_SPECIALS);
    pre-tokenizer "glm4", and the special ids llama.cpp's converter writes for GLM-4.5 ([gMASK] as
    BOS, <|endoftext|> as EOS, <|user|> as EOT, <|observation|> as EOM)."""
    tokens, merges = _byte_bpe(GLM_SPECIALS)
    assert len(tokens) == GLM_VOCAB == len(set(tokens))
    types = [1] * (GLM_VOCAB - len(GLM_SPECIALS)) + [3] * (len(GLM_SPECIALS) - 2) + [4, 4]  # think tags: user-defined
    sid = {t: tokens.index(t) for t in GLM_SPECIALS}
    md: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "glm4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": sid["[gMASK]"],
        "tokenizer.ggml.eos_token_id": sid["<|endoftext|>"],
        "tokenizer.ggml.eot_token_id": sid["<|user|>"],
        "tokenizer.ggml.eom_token_id": sid["<|observation|>"],
        "tokenizer.ggml.unknown_token_id": sid["<|endoftext|>"],
        "tokenizer.ggml.padding_token_id": sid["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
    }
    if chat_template is not None:
        md["tokenizer.chat_template"] = chat_template
    return md


def add_metadata(w: GGUFWriter, md: Mapping[str, object]) -> None:
    """Write metadata keys by their values' Python types: bool, int (as uint32), float (as F32), str, and any
    other iterable as an array of its items."""
    for key, value in md.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))  # type: ignore[call-overload]


def make_glm4moe_gguf(
    path: Path,
    *,
    n_dense_lead: int = 1,
    n_moe: int = 2,
    n_nextn: int = 1,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    rope_dim: int = 16,
    n_ff: int = 96,
    n_expert: int = 16,
    n_expert_used: int = 4,
    n_ff_exp: int = 32,
    n_expert_shared: int = 1,
    n_group: int = 0,
    n_group_used: int = 0,
    gating: int | None = 2,
    weights_scale: float | None = 2.5,
    weights_norm: bool | None = True,
    qk_norm: bool = False,
    exp_probs_b: bool = True,
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    seed: int = 0,
    chat_template: str | None = None,
    vocab: bool = True,
    drop_keys: tuple[str, ...] = (),
    extra_keys: dict[str, int] | None = None,
    omit: tuple[str, ...] = (),
    raw_overrides: dict[str, RawTensor] | None = None,
) -> Path:
    """A random ``glm4moe`` GGUF in llama.cpp's names and layout (GLM-4.5 / Air in miniature):
    head_dim * heads != n_embd, partial rotary (rope_dim < head_dim), q/k/v biases, optional q/k
    norms, ``n_dense_lead`` dense layers, then ``n_moe`` MoE layers (router, score-correction bias
    ``exp_probs_b``, routed experts, an ungated shared expert), then ``n_nextn`` NextN layers
    (block_count counts them) with their eh_proj / enorm / hnorm / shared head. ``gating``,
    ``weights_scale`` and ``weights_norm`` of None leave their keys out; ``drop_keys`` removes
    metadata keys (without the ``glm4moe.`` prefix), ``extra_keys`` adds or replaces integer ones and ``omit``
    drops tensors; ``raw_overrides`` replaces tensors by (raw bytes, logical shape, type). The vocabulary is
    glm_vocab_metadata()'s (GLM_VOCAB tokens; token_embd has that many rows even when ``vocab`` is
    False and the tokenizer keys are left out)."""
    arch = "glm4moe"
    rng = np.random.default_rng(seed)
    n_block = n_dense_lead + n_moe + n_nextn
    n_vocab = GLM_VOCAB
    w = GGUFWriter(str(path), arch)
    keys: dict[str, tuple[str, object]] = {
        "block_count": ("u", n_block), "context_length": ("u", 512), "embedding_length": ("u", n_embd),
        "feed_forward_length": ("u", n_ff), "attention.head_count": ("u", n_head),
        "attention.head_count_kv": ("u", n_head_kv), "attention.key_length": ("u", head_dim),
        "attention.value_length": ("u", head_dim), "rope.dimension_count": ("u", rope_dim),
        "rope.freq_base": ("f", 10000.0), "attention.layer_norm_rms_epsilon": ("f", 1e-5),
        "expert_count": ("u", n_expert), "expert_used_count": ("u", n_expert_used),
        "expert_shared_count": ("u", n_expert_shared), "expert_feed_forward_length": ("u", n_ff_exp),
        "leading_dense_block_count": ("u", n_dense_lead), "nextn_predict_layers": ("u", n_nextn),
        "vocab_size": ("u", n_vocab),
    }
    keys |= _gating_keys(gating, weights_scale, weights_norm, n_group, n_group_used)
    for key, value in (extra_keys or {}).items():
        keys[key] = ("u", value)
    _add_arch_keys(w, arch, keys, drop_keys)
    if vocab:  # llama.cpp needs it; the engine does not
        add_metadata(w, glm_vocab_metadata(chat_template))
    mat, gain = _scaled_normals(rng)

    def add(name: str, data: np.ndarray, quant: bool = True) -> None:
        qtype = weight_type if quant and data.ndim >= 2 else GGMLQuantizationType.F32
        _add_tensor(w, rng, name, data, qtype, omit, raw_overrides)

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    add("token_embd.weight", mat(n_vocab, n_embd, scale=0.5))
    add("output_norm.weight", gain(n_embd), quant=False)
    add("output.weight", mat(n_vocab, n_embd, scale=0.2))
    for i in range(n_block):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", gain(n_embd), quant=False)
        add(p + "attn_q.weight", mat(q_dim, n_embd, scale=0.2))
        add(p + "attn_k.weight", mat(kv_dim, n_embd, scale=0.2))
        add(p + "attn_v.weight", mat(kv_dim, n_embd))
        add(p + "attn_q.bias", mat(q_dim, scale=0.2), quant=False)
        add(p + "attn_k.bias", mat(kv_dim, scale=0.2), quant=False)
        add(p + "attn_v.bias", mat(kv_dim), quant=False)
        add(p + "attn_output.weight", mat(n_embd, q_dim))
        if qk_norm:
            add(p + "attn_q_norm.weight", gain(head_dim), quant=False)
            add(p + "attn_k_norm.weight", gain(head_dim), quant=False)
        add(p + "post_attention_norm.weight", gain(n_embd), quant=False)
        if i < n_dense_lead:
            add(p + "ffn_gate.weight", mat(n_ff, n_embd))
            add(p + "ffn_up.weight", mat(n_ff, n_embd))
            add(p + "ffn_down.weight", mat(n_embd, n_ff))
        else:
            # router logits with std ~2: top-k choices well separated (no float near-ties)
            add(p + "ffn_gate_inp.weight", mat(n_expert, n_embd, scale=0.5), quant=False)
            if exp_probs_b:  # of the order of the sigmoid's spread, so it changes choices
                add(p + "exp_probs_b.bias", mat(n_expert, scale=0.3), quant=False)
            add(p + "ffn_gate_exps.weight", mat(n_expert, n_ff_exp, n_embd))
            add(p + "ffn_up_exps.weight", mat(n_expert, n_ff_exp, n_embd))
            add(p + "ffn_down_exps.weight", mat(n_expert, n_embd, n_ff_exp))
            if n_expert_shared:
                fs = n_ff_exp * n_expert_shared
                add(p + "ffn_gate_shexp.weight", mat(fs, n_embd))
                add(p + "ffn_up_shexp.weight", mat(fs, n_embd))
                add(p + "ffn_down_shexp.weight", mat(n_embd, fs))
        if i >= n_dense_lead + n_moe:  # NextN / MTP head
            add(p + "nextn.eh_proj.weight", mat(n_embd, 2 * n_embd))
            add(p + "nextn.enorm.weight", gain(n_embd), quant=False)
            add(p + "nextn.hnorm.weight", gain(n_embd), quant=False)
            add(p + "nextn.shared_head_head.weight", mat(n_vocab, n_embd, scale=0.2))
            add(p + "nextn.shared_head_norm.weight", gain(n_embd), quant=False)
    return finish_gguf(w, path)


def make_gptoss_gguf(
    path: Path,
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    sliding_window: int = 8,
    expert_scale: float = 0.35,
    down_scale: float = 0.02,
    expert_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    seed: int = 0,
    chat_template: str | None = None,
    drop_keys: tuple[str, ...] = (),
    extra_md: dict[str, object] | None = None,
    omit: tuple[str, ...] = (),
) -> Path:
    """A random ``gpt-oss`` GGUF in llama.cpp's names and layout (gpt-oss-20b / 120b in miniature):
    head_dim * heads != n_embd, biases on q/k/v/o, one attention sink per head, sliding-window
    layers (llama.cpp makes the even ones slide) alternating with full ones, post_attention_norm
    before the FFN, a router with a bias, and routed experts with biases on gate / up / down, in
    ``expert_type`` (F32, Q8_0 or MXFP4: gguf-py writes all three). With the default
    ``expert_scale`` (the gate and up weights' std) the projections spread wide enough (std ~3)
    that the clamped SwiGLU's limit (7) is reached. ``drop_keys``
    removes metadata keys (without the ``gpt-oss.`` prefix), ``extra_md`` adds full keys (strings
    or integers) and ``omit`` drops tensors. The vocabulary is glm_vocab_metadata()'s."""
    arch = "gpt-oss"
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    keys: dict[str, tuple[str, object]] = {
        "block_count": ("u", n_layer), "context_length": ("u", 512), "embedding_length": ("u", n_embd),
        "feed_forward_length": ("u", n_ff_exp), "attention.head_count": ("u", n_head),
        "attention.head_count_kv": ("u", n_head_kv), "attention.key_length": ("u", head_dim),
        "attention.value_length": ("u", head_dim), "rope.dimension_count": ("u", head_dim),
        "rope.freq_base": ("f", 10000.0), "attention.layer_norm_rms_epsilon": ("f", 1e-5),
        "expert_count": ("u", n_expert), "expert_used_count": ("u", n_expert_used),
        "expert_feed_forward_length": ("u", n_ff_exp), "attention.sliding_window": ("u", sliding_window),
    }
    _add_arch_keys(w, arch, keys, drop_keys)
    _add_extra_md(w, extra_md)
    add_metadata(w, glm_vocab_metadata(chat_template))
    n_vocab = GLM_VOCAB
    mat, gain = _scaled_normals(rng)

    def add(name: str, data: np.ndarray, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> None:
        _add_tensor(w, rng, name, data, qtype, omit)

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    add("token_embd.weight", mat(n_vocab, n_embd, scale=0.5))
    add("output_norm.weight", gain(n_embd))
    add("output.weight", mat(n_vocab, n_embd, scale=0.2))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", gain(n_embd))
        add(p + "attn_q.weight", mat(q_dim, n_embd, scale=0.15))
        add(p + "attn_k.weight", mat(kv_dim, n_embd, scale=0.15))
        add(p + "attn_v.weight", mat(kv_dim, n_embd, scale=0.05))
        add(p + "attn_q.bias", mat(q_dim, scale=0.2))
        add(p + "attn_k.bias", mat(kv_dim, scale=0.2))
        add(p + "attn_v.bias", mat(kv_dim))
        add(p + "attn_output.weight", mat(n_embd, q_dim, scale=0.05))
        add(p + "attn_output.bias", mat(n_embd))
        # sinks of the order of the scores: each takes a real share of the softmax
        add(p + "attn_sinks.weight", mat(n_head, scale=1.5))
        add(p + "post_attention_norm.weight", gain(n_embd))
        # router logits with std ~2 plus a bias: top-k choices well separated
        add(p + "ffn_gate_inp.weight", mat(n_expert, n_embd, scale=0.25))
        add(p + "ffn_gate_inp.bias", mat(n_expert, scale=0.5))
        add(p + "ffn_gate_exps.weight", mat(n_expert, n_ff_exp, n_embd, scale=expert_scale), expert_type)
        add(p + "ffn_up_exps.weight", mat(n_expert, n_ff_exp, n_embd, scale=expert_scale), expert_type)
        add(p + "ffn_down_exps.weight", mat(n_expert, n_embd, n_ff_exp, scale=down_scale), expert_type)
        add(p + "ffn_gate_exps.bias", mat(n_expert, n_ff_exp, scale=0.5))
        add(p + "ffn_up_exps.bias", mat(n_expert, n_ff_exp, scale=0.5))
        add(p + "ffn_down_exps.bias", mat(n_expert, n_embd, scale=0.1))
    return finish_gguf(w, path)


# ---------------------------------------------------------------------------------------------- deepseek2

# DeepSeek-V3's special tokens (their texts in its tokenizer), after the normal ones.
DEEPSEEK_SPECIALS = ("<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
                     "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>")
DEEPSEEK_VOCAB = 256 + 52 + len(DEEPSEEK_SPECIALS)


def deepseek_vocab_metadata() -> dict[str, object]:
    """A DeepSeek-V3-style byte-level BPE vocabulary of DEEPSEEK_VOCAB tokens (_byte_bpe with
    DEEPSEEK_SPECIALS): pre-tokenizer "deepseek-v3", BOS / EOS the sentence tokens, BOS added."""
    tokens, merges = _byte_bpe(DEEPSEEK_SPECIALS)
    assert len(tokens) == DEEPSEEK_VOCAB == len(set(tokens))
    n = len(DEEPSEEK_SPECIALS)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "deepseek-v3",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (DEEPSEEK_VOCAB - n) + [3] * n,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": DEEPSEEK_VOCAB - n,
        "tokenizer.ggml.eos_token_id": DEEPSEEK_VOCAB - n + 1,
        "tokenizer.ggml.padding_token_id": DEEPSEEK_VOCAB - n + 1,
        "tokenizer.ggml.add_bos_token": True,
    }


def make_deepseek2_gguf(
    path: Path,
    *,
    n_dense_lead: int = 1,
    n_moe: int = 2,
    n_embd: int = 256,
    n_head: int = 4,
    q_lora_rank: int = 96,
    kv_lora_rank: int = 64,
    qk_nope: int = 32,
    qk_rope: int = 16,
    v_head_dim: int = 32,
    n_ff: int = 128,
    n_expert: int = 16,
    n_expert_used: int = 4,
    n_ff_exp: int = 64,
    n_expert_shared: int = 1,
    n_group: int = 4,
    n_group_used: int = 2,
    gating: int | None = 2,
    weights_scale: float | None = 2.5,
    weights_norm: bool | None = True,
    exp_probs_b: bool = True,
    router_gain: float = 2.0,
    split: bool = True,
    expert_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    expert_std: float = 0.06,
    seed: int = 0,
    vocab: bool = True,
    drop_keys: tuple[str, ...] = (),
    extra_md: dict[str, object] | None = None,
    omit: tuple[str, ...] = (),
) -> Path:
    """A random ``deepseek2`` GGUF in llama.cpp's names and layout (DeepSeek-V3 / Kimi-K2 or V2 in
    miniature): multi-head latent attention with heads of ``qk_nope + qk_rope`` query / key and
    ``v_head_dim`` value dimensions (n_head x head_dim != n_embd), a low-rank query (``attn_q_a``,
    ``attn_q_a_norm``, ``attn_q_b``; ``q_lora_rank`` 0: ``attn_q``), the compressed KV
    (``attn_kv_a_mqa``: latent + the shared rotary key, ``attn_kv_a_norm``) and its expansion,
    ``n_dense_lead`` dense layers, then ``n_moe`` MoE layers (router with logits of std ~``router_gain``,
    optional score-correction bias,
    routed experts in ``expert_type`` with weights of std ``expert_std``, ``n_expert_shared``
    shared experts). ``split``: the expansion as ``attn_k_b`` / ``attn_v_b`` with the MLA keys
    (``key_length_mla`` ...; head_count_kv 1, key_length the cached row), as llama.cpp's converter
    writes today; else one ``attn_kv_b`` with per-head key / value lengths (older files). Both
    forms hold the same numbers for the same seed. ``gating``, ``weights_scale`` and
    ``weights_norm`` of None leave their keys out; ``n_group`` 0 leaves the group keys out;
    ``drop_keys`` removes metadata keys (without the ``deepseek2.`` prefix), ``extra_md`` adds full
    keys and ``omit`` drops tensors. The vocabulary is deepseek_vocab_metadata()'s (token_embd has that
    many rows even when ``vocab`` is False and the tokenizer keys are left out). Matrices have
    std ~1/sqrt(fan-in) so activations stay of order one; IQ types are random valid blocks."""
    arch = "deepseek2"
    rng = np.random.default_rng(seed)
    n_layer = n_dense_lead + n_moe
    head_dim = qk_nope + qk_rope
    w = GGUFWriter(str(path), arch)
    keys: dict[str, tuple[str, object]] = {
        "block_count": ("u", n_layer), "context_length": ("u", 512), "embedding_length": ("u", n_embd),
        "feed_forward_length": ("u", n_ff), "attention.head_count": ("u", n_head),
        "rope.dimension_count": ("u", qk_rope), "rope.freq_base": ("f", 10000.0),
        "attention.layer_norm_rms_epsilon": ("f", 1e-6), "expert_count": ("u", n_expert),
        "expert_used_count": ("u", n_expert_used), "expert_shared_count": ("u", n_expert_shared),
        "expert_feed_forward_length": ("u", n_ff_exp), "leading_dense_block_count": ("u", n_dense_lead),
        "attention.q_lora_rank": ("u", q_lora_rank), "attention.kv_lora_rank": ("u", kv_lora_rank),
        "vocab_size": ("u", DEEPSEEK_VOCAB),
    }
    if split:  # llama.cpp's converter for MLA: the cache sees one head of the latent + rotary key
        keys |= {"attention.head_count_kv": ("u", 1), "attention.key_length": ("u", kv_lora_rank + qk_rope),
                 "attention.value_length": ("u", kv_lora_rank), "attention.key_length_mla": ("u", head_dim),
                 "attention.value_length_mla": ("u", v_head_dim)}
    else:
        keys |= {"attention.head_count_kv": ("u", n_head), "attention.key_length": ("u", head_dim),
                 "attention.value_length": ("u", v_head_dim)}
    keys |= _gating_keys(gating, weights_scale, weights_norm, n_group, n_group_used)
    _add_arch_keys(w, arch, keys, drop_keys)
    _add_extra_md(w, extra_md)
    if vocab:  # llama.cpp needs it; the engine does not
        add_metadata(w, deepseek_vocab_metadata())
    n_vocab = DEEPSEEK_VOCAB

    def mat(*shape: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    def gain(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.2).astype(np.float32)

    def add(name: str, data: np.ndarray, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> None:
        _add_tensor(w, rng, name, data, qtype, omit)

    add("token_embd.weight", (rng.standard_normal((n_vocab, n_embd))).astype(np.float32))
    add("output_norm.weight", gain(n_embd))
    add("output.weight", mat(n_vocab, n_embd, gain=4.0))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", gain(n_embd))
        if q_lora_rank:
            add(p + "attn_q_a.weight", mat(q_lora_rank, n_embd))
            add(p + "attn_q_a_norm.weight", gain(q_lora_rank))
            add(p + "attn_q_b.weight", mat(n_head * head_dim, q_lora_rank, gain=1.5))
        else:
            add(p + "attn_q.weight", mat(n_head * head_dim, n_embd, gain=1.5))
        add(p + "attn_kv_a_mqa.weight", mat(kv_lora_rank + qk_rope, n_embd, gain=1.5))
        add(p + "attn_kv_a_norm.weight", gain(kv_lora_rank))
        kv_b = mat(n_head * (qk_nope + v_head_dim), kv_lora_rank, gain=1.5)
        if split:  # as llama.cpp's converter splits kv_b_proj: per head, the key rows transposed
            per_head = kv_b.reshape(n_head, qk_nope + v_head_dim, kv_lora_rank)
            add(p + "attn_k_b.weight", np.ascontiguousarray(per_head[:, :qk_nope, :].transpose(0, 2, 1)))
            add(p + "attn_v_b.weight", np.ascontiguousarray(per_head[:, qk_nope:, :]))
        else:
            add(p + "attn_kv_b.weight", kv_b)
        add(p + "attn_output.weight", mat(n_embd, n_head * v_head_dim))
        add(p + "ffn_norm.weight", gain(n_embd))
        if i < n_dense_lead:
            add(p + "ffn_gate.weight", mat(n_ff, n_embd))
            add(p + "ffn_up.weight", mat(n_ff, n_embd))
            add(p + "ffn_down.weight", mat(n_embd, n_ff))
            continue
        # router logits with std ~router_gain: top-k choices well separated (no float near-ties)
        add(p + "ffn_gate_inp.weight", mat(n_expert, n_embd, gain=router_gain))
        if exp_probs_b:  # of the order of the gating's spread, so it changes choices
            add(p + "exp_probs_b.bias", (rng.standard_normal(n_expert) * 0.3).astype(np.float32))
        e = expert_std * np.sqrt(n_embd)
        add(p + "ffn_gate_exps.weight", mat(n_expert, n_ff_exp, n_embd, gain=e), expert_type)
        add(p + "ffn_up_exps.weight", mat(n_expert, n_ff_exp, n_embd, gain=e), expert_type)
        add(p + "ffn_down_exps.weight", mat(n_expert, n_embd, n_ff_exp, gain=expert_std * np.sqrt(n_ff_exp)),
            expert_type)
        fs = n_ff_exp * n_expert_shared
        if fs:
            add(p + "ffn_gate_shexp.weight", mat(fs, n_embd))
            add(p + "ffn_up_shexp.weight", mat(fs, n_embd))
            add(p + "ffn_down_shexp.weight", mat(n_embd, fs))
    return finish_gguf(w, path)
