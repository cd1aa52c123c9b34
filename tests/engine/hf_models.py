"""Small random Hugging Face models (CPU torch, float32) for converter and engine oracle tests.

Each ``make_*`` builds a model from a fixed torch seed, perturbs the weights that default
initialisation leaves trivial (norms = 1, biases = 0, tiny router logits), saves it with
``save_pretrained`` (safetensors) plus, by default, a tiny byte-level BPE tokenizer (ids < 300 of
the 320 embedding rows; llama.cpp will not load a GGUF without a vocab) and returns
``(hf_dir, model)``. ``to_gguf`` converts a saved directory through :mod:`engine.convert_hf`.
Seeds were chosen so greedy continuations vary and top-k router / top-1 logit gaps sit far
above test tolerances (see ``router_margin``).

Shapes follow the real models in miniature: Mixtral 4 experts top-2; Qwen3-MoE 32 experts top-8
(real: 128/top-8) with q/k norms and head_dim*heads != hidden; Qwen2-MoE with a sigmoid-gated
shared expert, qkv biases and no top-k renormalisation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engine.convert_hf import convert_hf

VOCAB = 320
HIDDEN = 64
COMMON: dict = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.1,  # above HF's 0.02: varied greedy text, logits far from ties
    attn_implementation="eager",
    dtype=torch.float32,
)


@torch.no_grad()
def _perturb(model: PreTrainedModel, seed: int) -> None:
    """Give norms, biases and routers values a layout bug cannot hide behind."""
    g = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # RMSNorm gains (incl. q_norm/k_norm): 1 +- 0.2
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
            # router logits with std ~2 keep top-k choices well separated (no float near-ties)
            p.copy_(torch.randn(p.shape, generator=g) * (2.0 / HIDDEN**0.5))
        elif name.endswith("shared_expert_gate.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / HIDDEN**0.5))


def _finish(model: PreTrainedModel, out_dir: Path, seed: int, tokenizer: bool) -> tuple[Path, PreTrainedModel]:
    _perturb(model, seed)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer:  # llama.cpp refuses a GGUF without a vocab; our engine is fine either way
        make_byte_bpe_tokenizer(out_dir, vocab_size=VOCAB - 20)
    return out_dir, model


def make_mixtral(out_dir: Path, *, seed: int = 3, n_layers: int = 3,
                 tokenizer: bool = True) -> tuple[Path, MixtralForCausalLM]:
    torch.manual_seed(seed)
    cfg = MixtralConfig(**COMMON, intermediate_size=96, num_hidden_layers=n_layers, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return _finish(MixtralForCausalLM(cfg), out_dir, seed, tokenizer)


def _common(rope: dict | None) -> dict:
    """COMMON, with `rope` (transformers' rope_parameters without rope_theta, e.g. YaRN) when given."""
    if not rope:
        return dict(COMMON)
    out = {k: v for k, v in COMMON.items() if k != "rope_theta"}
    return {**out, "rope_parameters": {"rope_theta": COMMON["rope_theta"], **rope}}


def make_qwen3_moe(out_dir: Path, *, seed: int = 2, n_layers: int = 2, head_dim: int = 16,
                   tokenizer: bool = True, rope: dict | None = None) -> tuple[Path, Qwen3MoeForCausalLM]:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**_common(rope), intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=n_layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, num_experts=32,
                         num_experts_per_tok=8, norm_topk_prob=True)
    return _finish(Qwen3MoeForCausalLM(cfg), out_dir, seed, tokenizer)


def make_qwen2_moe(out_dir: Path, *, seed: int = 0, n_layers: int = 2,
                   tokenizer: bool = True) -> tuple[Path, Qwen2MoeForCausalLM]:
    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False,
                         qkv_bias=True)
    return _finish(Qwen2MoeForCausalLM(cfg), out_dir, seed, tokenizer)


def make_llama(out_dir: Path, *, seed: int = 3, n_layers: int = 2, intermediate_size: int = 96,
               tie_word_embeddings: bool = False, attention_bias: bool = False,
               tokenizer: bool = True, rope: dict | None = None) -> tuple[Path, LlamaForCausalLM]:
    """Dense llama; ``intermediate_size=48`` gives ffn_down rows that no 32-block quant type divides."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**_common(rope), "tie_word_embeddings": tie_word_embeddings}, intermediate_size=intermediate_size,
                      num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                      attention_bias=attention_bias)
    return _finish(LlamaForCausalLM(cfg), out_dir, seed, tokenizer)


MAKERS: dict[str, Callable[..., tuple[Path, PreTrainedModel]]] = {
    "mixtral": make_mixtral,
    "qwen3moe": make_qwen3_moe,
    "qwen2moe": make_qwen2_moe,
    "llama": make_llama,
}


def to_gguf(hf_dir: Path, out: Path | None = None, outtype: str = "f32") -> Path:
    """Convert a directory written by a ``make_*`` function (F32 by default: exact round trip)."""
    return convert_hf(hf_dir, out or hf_dir.with_suffix(f".{outtype}.gguf"), outtype)


def make_byte_bpe_tokenizer(hf_dir: Path, *, vocab_size: int = 300, chat_template: str | None = None) -> None:
    """Train a tiny byte-level BPE (ids < vocab_size) and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "mixture of experts"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(hf_dir / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
           "chat_template": chat_template or "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))


@torch.no_grad()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> np.ndarray:
    """float32 [T, vocab] logits of a fresh sequence."""
    return model(torch.tensor([token_ids])).logits[0].float().numpy()


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, token_ids: list[int], n: int) -> list[int]:
    """Greedy continuation by full re-evaluation (no KV cache, so nothing HF-specific can differ)."""
    seq = list(token_ids)
    for _ in range(n):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(token_ids):]


@torch.no_grad()
def router_margin(model: PreTrainedModel, token_ids: list[int]) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit over all MoE layers and tokens.

    A tiny gap means float noise could flip an expert choice, so a parity failure would say
    nothing about the engine; tests assert this is comfortably above their tolerance.
    """
    k = model.config.num_experts_per_tok
    gaps: list[float] = []

    def hook(_mod: torch.nn.Module, _inp: object, out: object) -> None:
        logits = out[0] if isinstance(out, tuple) else out
        top = torch.topk(logits.float(), k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    try:
        model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    if not gaps:
        raise RuntimeError("no router outputs captured (model layout changed?)")
    return min(gaps)
