"""GGUF file -> validated hyper-parameters and borrowed tensor pointers for the C engine.

The header and metadata are read by common/gguf_meta.py, the tensor infos here; the file is
memory-mapped read-only and tensors are handed to C as pointers into that mapping, so loading copies no weights and the page cache is
shared by every process (lane) that maps the same file.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from common.gguf_meta import GGUFError, Walker, check_header, read_header, read_kv
from engine.rope import SCALING_TYPES, RopeParams, RopeScaling, resolve

# ggml type ids the C engine implements (see engine/csrc/strata.h).
SUPPORTED_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 21: "IQ3_S", 22: "IQ2_S",
    10: "Q2_K", 11: "Q3_K", 20: "IQ4_NL", 23: "IQ4_XS", 39: "MXFP4",
}

ARCH_IDS = {"llama": 0, "qwen3moe": 1, "qwen2moe": 2, "glm4moe": 3, "gpt-oss": 4, "deepseek2": 5}
ROPE_NORM, ROPE_NEOX = 0, 2
# Renormalise the top-k routing weights unless the file says otherwise (llama.cpp's defaults).
DEFAULT_EXPERT_NORM = {"llama": True, "qwen3moe": True, "qwen2moe": False, "glm4moe": False, "gpt-oss": False,
                       "deepseek2": False}

# Router gating functions: llama.cpp's expert_gating_func values (ST_GATING_* in strata.h).
GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 1, 2, 3
GATING_NAMES = {GATING_SOFTMAX: "softmax", GATING_SIGMOID: "sigmoid", GATING_SOFTMAX_WEIGHT: "softmax of the chosen"}
# Architectures whose llama.cpp graph takes its routing from the file: expert_gating_func (0 or
# absent: the value here), expert_weights_scale and leading_dense_block_count. The others route
# by softmax without scaling whatever the file says (a file asking for another gating is refused).
GATING_FROM_FILE = {"glm4moe": GATING_SIGMOID, "deepseek2": GATING_SOFTMAX}
# Architectures whose llama.cpp graph fixes the routing whatever the file says: the gating, and no
# renormalisation (gpt-oss: top-k of the logits, then softmax over the k chosen).
GATING_FIXED = {"gpt-oss": GATING_SOFTMAX_WEIGHT}
# Sliding-window layers: the pattern llama.cpp sets (layer il slides when il % n < n - 1: gpt-oss's
# even layers), the window from attention.sliding_window.
SWA_PATTERN = {"gpt-oss": 2}
# Architectures that may end in next-token-prediction (NextN / MTP) layers: block_count counts
# them, nextn_predict_layers says how many of the last blocks they are.
NEXTN_ARCHES = frozenset({"glm4moe"})
# Per architecture: the name of the norm before the FFN, when it is not ffn_norm.
_FFN_NORM_NAME = {"glm4moe": "post_attention_norm.weight", "gpt-oss": "post_attention_norm.weight"}
# Metadata llama.cpp requires for an architecture beyond the common keys (missing: a GGUFError).
_REQUIRED_KEYS = {
    "glm4moe": ("expert_count", "expert_used_count", "expert_shared_count", "expert_feed_forward_length",
                "attention.layer_norm_rms_epsilon"),
    "gpt-oss": ("expert_count", "expert_used_count", "expert_feed_forward_length", "attention.layer_norm_rms_epsilon",
                "attention.sliding_window"),
    "deepseek2": ("expert_count", "expert_used_count", "expert_shared_count", "expert_feed_forward_length",
                  "attention.layer_norm_rms_epsilon", "attention.kv_lora_rank"),
}


class UnsupportedModelError(GGUFError):
    """A valid GGUF whose architecture or quant type Strata does not run."""


# Bounds on hyper-parameters, the same as the C engine's (ST_MAX_* in engine/csrc/internal.h):
# checked here before anything is allocated from them, and again in C.
MAX_LAYERS = 4096
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_ROW = 65536
MAX_EXPERTS = 4096
MAX_EXPERTS_USED = 64
MAX_VOCAB = 1 << 24
MAX_CTX = 1 << 31


class HParams(BaseModel):
    """Model hyper-parameters, all read from GGUF metadata."""

    model_config = ConfigDict(frozen=True)

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    n_expert: int = 0
    n_expert_used: int = 0
    expert_norm: bool = True
    n_ff: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    rope_type: int = ROPE_NORM
    rope_dim: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    # routing (see st_model_desc in engine/csrc/strata.h)
    gating: int = GATING_SOFTMAX
    expert_weights_scale: float = 1.0
    n_expert_group: int = 0  # 0 or 1: no group-limited top-k
    n_group_used: int = 0
    n_expert_shared: int = 0  # shared experts (their FFN width is n_ff_shexp)
    exp_probs_b: bool = False  # a score-correction bias per expert steers the choice
    n_dense_lead: int = 0  # the first layers run a dense FFN instead of experts
    n_nextn: int = 0  # NextN layers after the n_layer forward layers: loaded and kept, not run
    n_swa: int = 0  # sliding window (tokens) of the sliding layers; 0: every layer attends to all
    swa_pattern: int = 0  # layer il slides when il % swa_pattern < swa_pattern - 1
    attn_sinks: bool = False  # a learned per-head logit joins each softmax's denominator
    rope_scaling: RopeScaling = RopeScaling()  # as the file states it (engine.rope.resolve: the values run)
    # multi-head latent attention (deepseek2; see st_model_desc): head_dim is each head's query / key
    # width (nope + rope_dim), head_dim_v its value width; n_head_kv is 1 (the cached latent row)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q straight from attn_q
    head_dim_v: int = 0  # 0: head_dim
    mla_split: bool = False  # the latent's expansion as attn_k_b / attn_v_b (else one attn_kv_b)

    @property
    def kv_bytes_per_token(self) -> int:
        """The F16 KV cache per token over all layers: K and V of every KV head, or with latent
        attention the one cached row per layer (the latent and the rotary key as K, the latent as V)."""
        if self.kv_lora_rank:
            return 2 * self.n_layer * (2 * self.kv_lora_rank + self.rope_dim)
        return 2 * 2 * self.n_layer * self.n_head_kv * self.head_dim

    def kv_bytes_per_token_of(self, kv_type: str = "f16") -> int:
        """The KV cache per token over all layers for a cache of kv_type values: "f16" (kv_bytes_per_token), or
        "q8_0" (one byte a value and an F16 scale per 32 values: 17/32 of the F16 figure)."""
        if kv_type == "f16":
            return self.kv_bytes_per_token
        if kv_type == "q8_0":
            return self.kv_bytes_per_token * 17 // 32
        raise ValueError(f"kv_type must be 'f16' or 'q8_0', got {kv_type!r}")

    def sliding_layers(self) -> list[int]:
        """The layers that attend through the sliding window."""
        if not (self.n_swa and self.swa_pattern):
            return []
        return [il for il in range(self.n_layer) if il % self.swa_pattern < self.swa_pattern - 1]

    @property
    def rope(self) -> RopeParams:
        """The rope scaling the file asks for, without a lane's overrides."""
        return resolve(self.rope_scaling, self.n_ctx_train)

    @property
    def routing(self) -> str:
        """The router in words, e.g. "sigmoid + score bias, top-8 of 160, weights renormalised x 2.5"."""
        if not self.n_expert:
            return "none (dense)"
        kind = GATING_NAMES.get(self.gating, str(self.gating)) + (" + score bias" if self.exp_probs_b else "")
        groups = (f", groups: best {self.n_group_used} of {self.n_expert_group}"
                  if self.n_expert_group > 1 else "")
        post = ", weights renormalised" if self.expert_norm else ""
        if self.expert_weights_scale != 1.0:
            post += f" x {self.expert_weights_scale:g}"
        return f"{kind}, top-{self.n_expert_used} of {self.n_expert}{groups}{post}"


@dataclass
class TensorRef:
    name: str
    type_id: int
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    data: np.ndarray
    n_bytes: int


@dataclass
class ModelFile:
    """An opened, validated GGUF model."""

    path: Path
    metadata: dict[str, Any]
    hparams: HParams
    tensors: dict[str, TensorRef]
    mapping: np.ndarray | None = None  # the whole file, read-only (uint8); every tensor is a view of it

    @property
    def size_bytes(self) -> int:
        return self.path.stat().st_size

    def quant_mix(self) -> dict[str, int]:
        """Bytes per quant type."""
        mix: dict[str, int] = {}
        for t in self.tensors.values():
            name = SUPPORTED_TYPES.get(t.type_id, str(t.type_id))
            mix[name] = mix.get(name, 0) + t.n_bytes
        return mix


# ---------------------------------------------------------------- reading
# The header and metadata: common/gguf_meta.py (shared with the tokenizer); then the tensor infos, with every
# count bounded by the bytes left and every tensor checked to lie inside the file.

_MAX_DIM = 1 << 40  # any single tensor extent (as in C)


@dataclass
class _TensorInfo:
    name: str
    dims: list[int]
    type_id: int
    offset: int  # from the start of the data section
    n_bytes: int = 0  # the data's size, set once the shape and type are checked


def _read_layout(path: Path) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    """Header, metadata and tensor infos: (metadata, tensor infos, data section start); raise GGUFError on
    anything that cannot be parsed or cannot fit in the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        w = Walker(path, buf, size)
        version, n_tensors, n_kv = read_header(w, UnsupportedModelError)
        md, alignment = read_kv(w, version, n_tensors, n_kv)
        infos: list[_TensorInfo] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = w.unique(w.text(f"tensor {i} name"), names, "tensor")
            n_dims = w.u32(f"tensor {name[:80]!r} dimension count")
            if not 1 <= n_dims <= 4:
                raise w.fail(f"tensor {name[:80]!r} has {n_dims} dimensions")
            dims = [w.u64(f"tensor {name[:80]!r} dimension") for _ in range(n_dims)]
            infos.append(_TensorInfo(name, dims, w.u32(f"tensor {name[:80]!r} type"),
                                     w.u64(f"tensor {name[:80]!r} offset")))
        data_start = -(-w.pos // alignment) * alignment
    for t in infos:
        label = t.name[:80]
        try:
            qt = GGMLQuantizationType(t.type_id)
        except ValueError:
            raise UnsupportedModelError(path, f"tensor {label!r} has unknown quant type id {t.type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qt]
        if any(d < 1 or d > _MAX_DIM for d in t.dims) or t.dims[0] % block:
            raise GGUFError(path, f"corrupt GGUF: tensor {label!r} has impossible shape {t.dims}")
        t.n_bytes = _n_bytes(t.dims, block, type_size)
        end = data_start + t.offset + t.n_bytes
        if t.offset % alignment or end > size:
            raise GGUFError(path, f"truncated or corrupt GGUF: tensor {label!r} spans bytes "
                                  f"{data_start + t.offset}..{end} of a {size}-byte file")
    return md, infos, data_start


def _n_bytes(dims: list[int], block: int, type_size: int) -> int:
    n_elems = 1
    for d in dims:
        n_elems *= d
    return n_elems // block * type_size


def _get(md: dict[str, Any], key: str, default: Any = None, *, path: Path) -> Any:
    if key in md:
        return md[key]
    if default is None:
        raise GGUFError(path, f"missing metadata key {key!r}")
    return default


def _as_int(v: Any, key: str, lo: int, hi: int, path: Path) -> int:
    """A metadata integer within [lo, hi], or a GGUFError naming the key."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise GGUFError(path, f"metadata {key!r} must be an integer, got {type(v).__name__}")
    if not lo <= int(v) <= hi:
        raise GGUFError(path, f"metadata {key!r} = {int(v)} is out of range [{lo}, {hi}]")
    return int(v)


def _as_float(v: Any, key: str, path: Path) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise GGUFError(path, f"metadata {key!r} must be a number, got {type(v).__name__}")
    f = float(v)
    if not np.isfinite(f):
        raise GGUFError(path, f"metadata {key!r} = {f} is not finite")
    return f


def _hparams(md: dict[str, Any], tensors: dict[str, TensorRef], path: Path) -> HParams:
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(path, "missing metadata key 'general.architecture'")
    if arch not in ARCH_IDS:
        raise UnsupportedModelError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCH_IDS))})"
        )

    def g(key: str, default: Any = None) -> Any:
        return _get(md, f"{arch}.{key}", default, path=path)

    def gi(key: str, lo: int, hi: int, default: Any = None) -> int:
        return _as_int(g(key, default), f"{arch}.{key}", lo, hi, path)

    def gf(key: str, default: float) -> float:
        return _as_float(g(key, default), f"{arch}.{key}", path)

    for key in _REQUIRED_KEYS.get(arch, ()):
        g(key)  # a GGUFError naming the first one missing
    n_embd = gi("embedding_length", 1, MAX_ROW)
    n_head = gi("attention.head_count", 1, MAX_HEADS)
    head_dim = gi("attention.key_length", 1, MAX_HEAD_DIM, n_embd // n_head or 1)
    if "token_embd.weight" not in tensors:
        raise GGUFError(path, "missing tensor 'token_embd.weight'")
    emb = tensors["token_embd.weight"]
    if len(emb.shape) != 2:
        raise GGUFError(path, f"tensor 'token_embd.weight' has {len(emb.shape)} dimensions, expected 2")
    n_vocab = int(emb.shape[1])
    if n_vocab > MAX_VOCAB:
        raise GGUFError(path, f"vocabulary of {n_vocab} tokens exceeds {MAX_VOCAB}")
    n_block = gi("block_count", 1, MAX_LAYERS)
    n_nextn = gi("nextn_predict_layers", 0, n_block - 1, 0) if arch in NEXTN_ARCHES else 0
    n_layer = n_block - n_nextn  # the layers the forward pass runs
    n_expert = gi("expert_count", 0, MAX_EXPERTS, 0)
    n_expert_used = gi("expert_used_count", 0, MAX_EXPERTS_USED, 0)
    from_file = arch in GATING_FROM_FILE
    n_dense_lead = gi("leading_dense_block_count", 0, n_layer, 0) if n_expert and from_file else 0
    gating = g("expert_gating_func", 0)
    if from_file:
        default = GATING_FROM_FILE[arch]
        if arch == "deepseek2" and n_layer in (47, 48) and _vocab_size(md, arch, n_vocab) == 154880:
            default = GATING_SIGMOID  # llama.cpp's rule for GLM-4.7-Flash files, which carry no gating key
        gating = _as_int(gating, f"{arch}.expert_gating_func", 0, 1 << 31, path) or default
        if gating not in GATING_NAMES:
            raise UnsupportedModelError(path, f"expert gating function {gating} is not supported "
                                              f"({', '.join(f'{k} {v}' for k, v in GATING_NAMES.items())})")
    elif arch in GATING_FIXED:
        gating = GATING_FIXED[arch]
    elif n_expert and gating not in (0, GATING_SOFTMAX):
        raise UnsupportedModelError(path, f"expert gating function {gating} is not supported (only softmax)")
    else:
        gating = GATING_SOFTMAX
    scale = gf("expert_weights_scale", 0.0) if from_file else 0.0
    if scale < 0:
        raise GGUFError(path, f"metadata '{arch}.expert_weights_scale' = {scale} is negative")
    n_group = gi("expert_group_count", 0, MAX_EXPERTS, 0)
    n_group_used = gi("expert_group_used_count", 0, MAX_EXPERTS, 0)
    if n_group > 1 and not (n_expert and n_group < n_expert and n_expert % n_group == 0
                            and 0 < n_group_used < n_group and n_group_used * (n_expert // n_group) >= n_expert_used):
        raise GGUFError(path, f"metadata {arch}.expert_group_count = {n_group} with expert_group_used_count = "
                              f"{n_group_used} is invalid for {n_expert} experts, top-{n_expert_used} (groups must "
                              "divide the experts, 0 < used < groups, and the used groups hold top-k experts)")
    n_ff_exp = 0
    first_moe = f"blk.{n_dense_lead}.ffn_gate_exps.weight"
    if n_expert and first_moe in tensors:
        shape = tensors[first_moe].shape
        n_ff_exp = int(shape[1]) if len(shape) > 1 else 0
    n_ff_shexp = gi("expert_shared_feed_forward_length", 0, 1 << 40, 0)
    n_shared = gi("expert_shared_count", 0, MAX_EXPERTS, 0)
    if arch in ("glm4moe", "gpt-oss", "deepseek2"):  # the expert width llama.cpp creates the tensors with
        want_exp = gi("expert_feed_forward_length", 1, MAX_ROW)
        if n_ff_exp and n_ff_exp != want_exp:
            raise GGUFError(path, f"tensor {first_moe!r} has width {n_ff_exp}, metadata "
                                  f"'{arch}.expert_feed_forward_length' says {want_exp}")
    if arch == "deepseek2" and n_dense_lead < n_layer and not (n_expert and n_shared):
        raise GGUFError(path, f"metadata '{arch}.expert_count' = {n_expert}, 'expert_shared_count' = {n_shared}: "
                              f"deepseek2's layers past the first {n_dense_lead} route experts beside shared ones")
    if arch in ("glm4moe", "deepseek2"):  # the shared experts' width llama.cpp creates the tensors with
        n_ff_shexp = gi("expert_feed_forward_length", 1, MAX_ROW) * n_shared
        shexp = tensors.get(f"blk.{n_dense_lead}.ffn_gate_shexp.weight")
        if n_shared and (shexp is None or len(shexp.shape) != 2 or int(shexp.shape[1]) != n_ff_shexp):
            raise GGUFError(path, f"'{arch}.expert_shared_count' = {n_shared} needs shared-expert tensors of width "
                                  f"{n_ff_shexp} (blk.{n_dense_lead}.ffn_gate_shexp.weight: "
                                  f"{'missing' if shexp is None else shexp.shape})")
    if arch == "glm4moe" and any(int(v) for v in np.atleast_1d(g("rope.dimension_sections", [0]))):
        raise UnsupportedModelError(path, "multimodal rotary sections (rope.dimension_sections) are not supported")
    rope_scaling = _rope_scaling(md, arch, path)
    n_swa, swa_pattern = 0, 0
    if arch in SWA_PATTERN:
        n_swa, swa_pattern = gi("attention.sliding_window", 1, MAX_CTX), SWA_PATTERN[arch]
    if arch == "gpt-oss":
        if n_expert < 1:
            raise GGUFError(path, f"metadata '{arch}.expert_count' = 0: gpt-oss routes every layer's FFN")
        if gi("rope.dimension_count", 1, MAX_HEAD_DIM, head_dim) != head_dim:
            raise UnsupportedModelError(path, "partial rotary dimensions are not supported for gpt-oss")
    mla: dict[str, Any] = {}
    n_head_kv = gi("attention.head_count_kv", 1, MAX_HEADS, n_head)
    rope_dim = gi("rope.dimension_count", 1, MAX_HEAD_DIM, head_dim)
    if arch == "deepseek2":
        mla = _mla(md, tensors, path, n_embd, n_head, rope_dim)
        head_dim, n_head_kv = mla.pop("head_dim"), 1  # the cache holds one latent row per token
        if n_nextn_ds := gi("nextn_predict_layers", 0, MAX_LAYERS, 0):
            raise UnsupportedModelError(path, f"{n_nextn_ds} NextN layers (nextn_predict_layers) are not supported "
                                              "for deepseek2")
    norm = g("expert_weights_norm", DEFAULT_EXPERT_NORM[arch]) if arch not in GATING_FIXED else False
    if not isinstance(norm, (bool, int, np.bool_, np.integer)):
        raise GGUFError(path, f"metadata '{arch}.expert_weights_norm' must be a bool, got {type(norm).__name__}")
    return HParams(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_vocab=n_vocab,
        n_ctx_train=gi("context_length", 1, MAX_CTX, 2048),
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        expert_norm=bool(norm),
        n_ff=gi("feed_forward_length", 0, 1 << 40, 0),
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_shexp,
        rope_type=ROPE_NORM if arch in ("llama", "deepseek2") else ROPE_NEOX,
        rope_dim=rope_dim,
        rope_base=gf("rope.freq_base", 10000.0),
        norm_eps=gf("attention.layer_norm_rms_epsilon", 1e-5),
        gating=gating,
        expert_weights_scale=scale or 1.0,
        n_expert_group=n_group if n_group > 1 else 0,
        n_group_used=n_group_used if n_group > 1 else 0,
        n_expert_shared=n_shared,
        exp_probs_b=bool(n_expert) and f"blk.{n_dense_lead}.exp_probs_b.bias" in tensors,
        n_dense_lead=n_dense_lead,
        n_nextn=n_nextn,
        n_swa=n_swa,
        swa_pattern=swa_pattern,
        attn_sinks="blk.0.attn_sinks.weight" in tensors,
        rope_scaling=rope_scaling,
        **mla,
    )


def _vocab_size(md: dict[str, Any], arch: str, n_embd_rows: int) -> int:
    """The vocabulary size as llama.cpp reads it for its per-model rules: vocab_size, else the token list."""
    v = md.get(f"{arch}.vocab_size")
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return int(v)
    tokens = md.get("tokenizer.ggml.tokens")
    return len(tokens) if isinstance(tokens, (list, tuple)) else n_embd_rows


def _mla(md: dict[str, Any], tensors: dict[str, TensorRef], path: Path, n_embd: int, n_head: int,
         rope_dim: int) -> dict[str, Any]:
    """deepseek2's latent attention fields of HParams (plus "head_dim"), as llama.cpp reads them:
    with attention.key_length_mla / value_length_mla (files converted for MLA: attn_k_b / attn_v_b,
    key_length then being the cached row's width) the heads' widths come from those, else from
    key_length / value_length (older files: attn_kv_b). Rotary scaling is refused here."""
    arch = "deepseek2"

    def gi(key: str, lo: int, hi: int, default: Any = None) -> int:
        return _as_int(_get(md, f"{arch}.{key}", default, path=path), f"{arch}.{key}", lo, hi, path)

    k_mla, v_mla = gi("attention.key_length_mla", 0, MAX_HEAD_DIM, 0), gi("attention.value_length_mla", 0, MAX_HEAD_DIM, 0)
    if bool(k_mla) != bool(v_mla):
        raise GGUFError(path, f"metadata '{arch}.attention.key_length_mla' = {k_mla} and 'value_length_mla' = {v_mla}: "
                              "both or neither")
    split = bool(k_mla)
    default = n_embd // n_head or 1
    head_dim = k_mla or gi("attention.key_length", 1, MAX_HEAD_DIM, default)
    head_dim_v = v_mla or gi("attention.value_length", 1, MAX_HEAD_DIM, default)
    if not 1 <= rope_dim < head_dim:
        raise GGUFError(path, f"metadata '{arch}.rope.dimension_count' = {rope_dim} leaves no non-rotary key "
                              f"dimensions of {head_dim}")
    kv_lora = gi("attention.kv_lora_rank", 1, MAX_ROW)
    q_a = tensors.get("blk.0.attn_q_a.weight")
    q_lora = gi("attention.q_lora_rank", 0, MAX_ROW, int(q_a.shape[1]) if q_a is not None and len(q_a.shape) == 2 else 0)
    want = "attn_k_b" if split else "attn_kv_b"
    if f"blk.0.{want}.weight" not in tensors:
        raise GGUFError(path, f"missing tensor 'blk.0.{want}.weight' (a deepseek2 file "
                              f"{'with' if split else 'without'} '{arch}.attention.key_length_mla' carries "
                              f"{'attn_k_b / attn_v_b' if split else 'attn_kv_b'})")
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    factor = md.get(f"{arch}.rope.scaling.factor", 0.0)
    if not (kind == "none" or (kind in ("yarn", "linear") and factor in (0, 1))):
        raise UnsupportedModelError(path, f"rope scaling {kind!r} (factor {factor}) is not supported for deepseek2 yet "
                                          "(YaRN's attention scale with yarn_log_multiplier is not implemented)")
    temp = md.get(f"{arch}.attention.temperature_scale", 0.0)
    if temp not in (0, 0.0):
        raise UnsupportedModelError(path, f"attention temperature scaling ({arch}.attention.temperature_scale = "
                                          f"{temp}) is not supported")
    return {"head_dim": head_dim, "head_dim_v": head_dim_v, "kv_lora_rank": kv_lora, "q_lora_rank": q_lora,
            "mla_split": split}


def _rope_scaling(md: dict[str, Any], arch: str, path: Path) -> RopeScaling:
    """The rope.scaling.* keys (gguf.constants.Keys.Rope), validated; llama.cpp's defaults where absent."""
    kind = md.get(f"{arch}.rope.scaling.type", "linear")
    if not isinstance(kind, str):
        raise GGUFError(path, f"metadata '{arch}.rope.scaling.type' must be a string, got {type(kind).__name__}")
    if kind not in SCALING_TYPES:
        raise UnsupportedModelError(path, f"rope scaling type {kind[:40]!r} is not supported "
                                          f"(supported: {', '.join(SCALING_TYPES)})")

    def num(key: str, default: float, lo: float, hi: float) -> float:
        full = f"{arch}.rope.{key}"
        v = _as_float(md.get(full, default), full, path)
        if not lo <= v <= hi:
            raise GGUFError(path, f"metadata {full!r} = {v:g} is out of range [{lo:g}, {hi:g}]")
        return v

    factor = num("scaling.factor", 0.0, 0.0, 1e6) or num("scale_linear", 0.0, 0.0, 1e6)
    orig = md.get(f"{arch}.rope.scaling.original_context_length", 0)
    return RopeScaling(
        type=kind, factor=factor,
        original_context_length=_as_int(orig, f"{arch}.rope.scaling.original_context_length", 0, MAX_CTX, path),
        attn_factor=num("scaling.attn_factor", 1.0, 1e-6, 1e3),
        yarn_ext_factor=num("scaling.yarn_ext_factor", -1.0, -1e3, 1e3),
        yarn_attn_factor=num("scaling.yarn_attn_factor", 1.0, 0.0, 1e3),
        yarn_beta_fast=num("scaling.yarn_beta_fast", 32.0, 1e-6, 1e6),
        yarn_beta_slow=num("scaling.yarn_beta_slow", 1.0, 1e-6, 1e6),
        yarn_log_mul=num("scaling.yarn_log_multiplier", 0.0, -1e3, 1e3),
    )


def open_model(path: str | os.PathLike[str]) -> ModelFile:
    """Open and validate a GGUF model; raise GGUFError naming the file and problem.

    Whatever a damaged file makes the parser raise becomes a GGUFError, except
    MemoryError: that would mean an allocation sized by the file, which the layout
    check exists to prevent, so it is not hidden."""
    path = Path(path)
    try:
        return _open_model(path)
    except (GGUFError, MemoryError):
        raise
    except Exception as exc:
        raise GGUFError(path, f"corrupt GGUF ({type(exc).__name__}: {exc})") from exc


def _open_model(path: Path) -> ModelFile:
    from gguf import GGMLQuantizationType

    check_header(path)
    md, infos, data_start = _read_layout(path)  # every tensor's type known, its bytes inside the file
    mapping = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))  # the views below keep the map alive
    tensors: dict[str, TensorRef] = {}
    for t in infos:
        tid = t.type_id
        if tid not in SUPPORTED_TYPES:
            raise UnsupportedModelError(path, f"tensor {t.name!r} has unsupported quant type "
                                              f"{GGMLQuantizationType(tid).name} (id {tid})")
        start = data_start + t.offset
        tensors[t.name] = TensorRef(t.name, tid, tuple(t.dims), mapping[start:start + t.n_bytes], t.n_bytes)
    hp = _hparams(md, tensors, path)
    return ModelFile(path=path, metadata=md, hparams=hp, tensors=tensors, mapping=mapping)


# ---------------------------------------------------------------- writing

def commit_gguf(writer: Any, tmp: Path, out: Path) -> None:
    """Finish a gguf.GGUFWriter that wrote to `tmp`: flush to disk, then rename over `out`,
    so readers never see a half-written model."""
    assert writer.fout is not None
    for fp in writer.fout:
        fp.flush()
        os.fsync(fp.fileno())
    writer.close()
    os.replace(tmp, out)


def abort_gguf(writer: Any, tmp: Path) -> None:
    """Drop a partly written GGUF after a failure."""
    writer.close()
    tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- C descriptor

_LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "ffn_gate.weight", "ffn_up": "ffn_up.weight", "ffn_down": "ffn_down.weight",
    "gate_inp": "ffn_gate_inp.weight", "gate_exps": "ffn_gate_exps.weight", "up_exps": "ffn_up_exps.weight",
    "down_exps": "ffn_down_exps.weight", "gate_inp_shexp": "ffn_gate_inp_shexp.weight",
    "gate_shexp": "ffn_gate_shexp.weight", "up_shexp": "ffn_up_shexp.weight", "down_shexp": "ffn_down_shexp.weight",
    "exp_probs_b": "exp_probs_b.bias", "bo": "attn_output.bias", "sinks": "attn_sinks.weight",
    "gate_inp_b": "ffn_gate_inp.bias", "gate_exps_b": "ffn_gate_exps.bias", "up_exps_b": "ffn_up_exps.bias",
    "down_exps_b": "ffn_down_exps.bias",
    "wq_a": "attn_q_a.weight", "q_a_norm": "attn_q_a_norm.weight", "wq_b": "attn_q_b.weight",
    "wkv_a": "attn_kv_a_mqa.weight", "kv_a_norm": "attn_kv_a_norm.weight", "wkv_b": "attn_kv_b.weight",
    "wk_b": "attn_k_b.weight", "wv_b": "attn_v_b.weight",
}
_NEXTN_TENSORS = {
    "eh_proj": "nextn.eh_proj.weight", "enorm": "nextn.enorm.weight", "hnorm": "nextn.hnorm.weight",
    "embed_tokens": "nextn.embed_tokens.weight", "shared_head_head": "nextn.shared_head_head.weight",
    "shared_head_norm": "nextn.shared_head_norm.weight",
}


def _fill(dst: Any, t: TensorRef | None, keep: list[Any]) -> None:
    from engine.native import ffi

    if t is None:
        dst.data = ffi.NULL
        return
    buf = ffi.from_buffer(t.data)
    keep.append(buf)
    dst.data = buf
    dst.type = t.type_id
    dst.n_dims = len(t.shape)
    for i in range(4):
        dst.ne[i] = t.shape[i] if i < len(t.shape) else 1
    dst.n_bytes = t.n_bytes


def build_desc(mf: ModelFile, rope: RopeParams | None = None) -> tuple[Any, list[Any]]:
    """A filled st_model_desc plus the cffi objects that must outlive it. The C side
    checks every value again (shapes, byte lengths, extents inside the mapping). `rope`: the
    rope scaling to run (default: the file's, engine.rope.resolve)."""
    from engine.native import ffi  # here, so reading and writing GGUF needs no C build

    hp = mf.hparams
    if mf.mapping is None:
        raise GGUFError(mf.path, "the model file is not mapped")
    keep: list[Any] = []
    desc = ffi.new("st_model_desc *")
    layers = ffi.new("st_layer[]", hp.n_layer)  # n_layer <= MAX_LAYERS (checked in _hparams)
    mapping = ffi.from_buffer(mf.mapping)
    keep += [desc, layers, mapping]
    desc.arch = ARCH_IDS[hp.arch]
    for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_vocab", "n_expert", "n_expert_used",
              "rope_type", "rope_dim", "rope_base", "norm_eps"):
        setattr(desc, k, getattr(hp, k))
    desc.expert_norm = int(hp.expert_norm)
    for k in ("gating", "expert_weights_scale", "n_expert_group", "n_group_used", "n_dense_lead", "n_swa",
              "swa_pattern", "kv_lora_rank", "q_lora_rank", "head_dim_v"):
        setattr(desc, k, getattr(hp, k))
    rp = rope or hp.rope
    desc.rope_freq_scale = rp.freq_scale
    desc.rope_ext_factor = rp.ext_factor
    desc.rope_attn_factor = rp.attn_factor
    desc.rope_beta_fast = rp.beta_fast
    desc.rope_beta_slow = rp.beta_slow
    desc.rope_n_ctx_orig = min(rp.n_ctx_orig, (1 << 31) - 1)
    desc.map_data = mapping
    desc.map_bytes = mf.mapping.nbytes
    t = mf.tensors
    _fill(desc.token_embd, t["token_embd.weight"], keep)
    if "output_norm.weight" not in t:
        raise GGUFError(mf.path, "missing tensor 'output_norm.weight'")
    _fill(desc.output_norm, t["output_norm.weight"], keep)
    _fill(desc.output, t.get("output.weight", t["token_embd.weight"]), keep)  # tied embeddings
    names = dict(_LAYER_TENSORS)
    if hp.arch in _FFN_NORM_NAME:
        names["ffn_norm"] = _FFN_NORM_NAME[hp.arch]
    for field in ("wkv_b",) if hp.mla_split else ("wk_b", "wv_b"):  # the form llama.cpp loads for the file
        del names[field]

    def fill_layer(dst: Any, il: int) -> None:
        if f"blk.{il}.{names['ffn_norm']}" not in t:  # named here: the C message would say ffn_norm
            raise GGUFError(mf.path, f"missing tensor 'blk.{il}.{names['ffn_norm']}'")
        for field_name, suffix in names.items():
            _fill(getattr(dst, field_name), t.get(f"blk.{il}.{suffix}"), keep)

    for il in range(hp.n_layer):
        fill_layer(layers[il], il)
    desc.layers = layers
    if hp.n_nextn:  # validated by C with the model and kept there; st_forward never runs them
        nl = ffi.new("st_layer[]", hp.n_nextn)
        nh = ffi.new("st_nextn[]", hp.n_nextn)
        keep += [nl, nh]
        for i in range(hp.n_nextn):
            il = hp.n_layer + i
            fill_layer(nl[i], il)
            for field_name, suffix in _NEXTN_TENSORS.items():
                _fill(getattr(nh[i], field_name), t.get(f"blk.{il}.{suffix}"), keep)
        desc.n_nextn = hp.n_nextn
        desc.nextn_layers = nl
        desc.nextn = nh
    return desc, keep


def create_native_model(mf: ModelFile, rope: RopeParams | None = None) -> tuple[Any, Any, list[Any]]:
    """The C model for an opened file: (st_model *, its descriptor, the cffi objects that
    must outlive it). A file the C checks refuse raises GGUFError (UnsupportedModelError
    for an unsupported type or shape) carrying the C message; free the model with
    lib.st_model_destroy."""
    from engine.native import ffi, lib

    desc, keep = build_desc(mf, rope)
    pm = ffi.new("st_model **")
    rc = lib.st_model_create(desc, pm)
    if rc != lib.ST_OK:
        msg = ffi.string(lib.st_last_error()).decode("utf-8", "replace") or f"error {rc}"
        cls = UnsupportedModelError if rc == lib.ST_EUNSUPPORTED else GGUFError
        raise cls(mf.path, msg, int(rc))
    return pm[0], desc, keep
