"""Convert a Hugging Face checkpoint directory to GGUF (llama.cpp's names, keys and layouts).

Supported ``architectures[0]`` values and the GGUF arch they become:

=========================  ==========  ==================================================
HF architecture            GGUF arch   notes
=========================  ==========  ==================================================
``LlamaForCausalLM``       llama       dense FFN; q/k rows permuted for NORM rope
``MixtralForCausalLM``     llama       experts stacked into ``ffn_*_exps``; q/k permuted
``Qwen3MoeForCausalLM``    qwen3moe    per-head q/k RMSNorm; NEOX rope (no permute)
``Qwen2MoeForCausalLM``    qwen2moe    q/k/v biases; sigmoid-gated shared expert
=========================  ==========  ==================================================

Weights are read straight from the ``*.safetensors`` files (F32/F16/BF16/F64; no torch needed),
both in the original per-expert layout (``experts.N.w1`` / ``experts.N.gate_proj``) and in the
fused transformers-5 layout (``experts.gate_up_proj`` [E, 2F, D], ``experts.down_proj`` [E, D, F]).

The file is planned completely (every shape checked) before anything is written, then streamed
one tensor at a time into a temporary file that is renamed over ``out`` only on success.

CLI::

    python -m engine.convert_hf HF_DIR OUT.gguf [--outtype f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType

from engine.gguf_model import abort_gguf, commit_gguf

log = logging.getLogger(__name__)

__all__ = ["ConversionError", "OUTTYPES", "SUPPORTED_ARCHITECTURES", "convert_hf", "main", "permute_qk", "unpermute_qk"]


class ConversionError(ValueError):
    """The checkpoint cannot be converted (unsupported, missing or malformed input)."""


# outtype -> (storage type of >=2-D weights, general.file_type)
OUTTYPES: dict[str, tuple[QT, LlamaFileType]] = {
    "f32": (QT.F32, LlamaFileType.ALL_F32),
    "f16": (QT.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (QT.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (QT.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (QT.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q5_0": (QT.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q5_1": (QT.Q5_1, LlamaFileType.MOSTLY_Q5_1),
}


@dataclass(frozen=True)
class _ArchSpec:
    gguf_arch: str
    moe: bool
    permute_qk: bool  # llama's NORM rope pairs adjacent dims; HF stores rotate-half pairs
    qk_norm: bool = False
    qkv_bias: bool = False
    shared_expert: bool = False


SUPPORTED_ARCHITECTURES: dict[str, _ArchSpec] = {
    "LlamaForCausalLM": _ArchSpec("llama", moe=False, permute_qk=True),
    "MixtralForCausalLM": _ArchSpec("llama", moe=True, permute_qk=True),
    "Qwen3MoeForCausalLM": _ArchSpec("qwen3moe", moe=True, permute_qk=False, qk_norm=True),
    "Qwen2MoeForCausalLM": _ArchSpec("qwen2moe", moe=True, permute_qk=False, qkv_bias=True, shared_expert=True),
}

# Checkpoint entries that carry no weights (old checkpoints saved rotary buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------------------------
# q/k row permutation (llama arch only)


def _qk_row_order(n_head: int, head_dim: int) -> np.ndarray:
    """Source row for each destination row: HF pairs (j, j+hd/2), llama NORM rope pairs (2i, 2i+1)."""
    if head_dim % 2:
        raise ConversionError(f"head_dim {head_dim} is odd; rope needs an even head dimension")
    per_head = np.arange(head_dim).reshape(2, head_dim // 2).T.reshape(-1)  # 0, hd/2, 1, hd/2+1, ...
    return (np.arange(n_head)[:, None] * head_dim + per_head[None, :]).reshape(-1)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF (rotate-half) row layout -> llama.cpp NORM-rope layout; rows = n_head * head_dim."""
    return w[_qk_row_order(n_head, w.shape[0] // n_head)]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk` (used by tests and tools that read GGUF back)."""
    out = np.empty_like(w)
    out[_qk_row_order(n_head, w.shape[0] // n_head)] = w
    return out


# ----------------------------------------------------------------------------------------------
# safetensors reading (header parsed by hand so BF16 works without torch)

_ST_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
}


@dataclass
class _StEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class _Checkpoint:
    """All tensors of the ``*.safetensors`` files of one directory, loaded lazily as float32."""

    def __init__(self, hf_dir: Path) -> None:
        self.entries: dict[str, _StEntry] = {}
        self.claimed: set[str] = set()
        self._maps: dict[Path, np.memmap] = {}
        files = self._files(hf_dir)
        for f in files:
            self._read_header(f)

    @staticmethod
    def _files(hf_dir: Path) -> list[Path]:
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: not a valid safetensors index ({e})") from e
            files = sorted({hf_dir / name for name in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ConversionError(f"{index} names missing shard(s): {', '.join(missing)}")
            return files
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{hf_dir}: no *.safetensors files (only safetensors checkpoints are supported)")
        return files

    def _read_header(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as fp:
            head = fp.read(8)
            if len(head) != 8:
                raise ConversionError(f"{path}: truncated safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ConversionError(f"{path}: safetensors header length {n} exceeds the file size")
            try:
                header = json.loads(fp.read(n))
            except ValueError as e:
                raise ConversionError(f"{path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise ConversionError(f"{path}: corrupt safetensors header (not an object)")
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError) as exc:
                raise ConversionError(f"{path}: corrupt header entry for tensor {name!r}") from exc
            if name in self.entries:
                raise ConversionError(f"tensor {name!r} appears in both {self.entries[name].file} and {path}")
            if dtype not in _ST_DTYPES:
                if any(name.endswith(s) for s in _IGNORED_SUFFIXES):
                    continue
                raise ConversionError(f"tensor {name!r} has dtype {dtype}; supported: {', '.join(_ST_DTYPES)}")
            want = math.prod(shape) * _ST_DTYPES[dtype].itemsize
            if e - b != want or base + e > size:
                raise ConversionError(f"{path}: tensor {name!r} data range is inconsistent with shape {list(shape)}")
            self.entries[name] = _StEntry(path, dtype, shape, base + b, base + e)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def claim(self, name: str) -> tuple[int, ...]:
        """Mark a tensor as used by the plan and return its shape."""
        if name not in self.entries:
            raise ConversionError(f"missing tensor {name!r} in the checkpoint")
        self.claimed.add(name)
        return self.entries[name].shape

    def load(self, name: str) -> np.ndarray:
        ent = self.entries[name]
        mm = self._maps.get(ent.file)
        if mm is None:
            mm = self._maps[ent.file] = np.memmap(ent.file, dtype=np.uint8, mode="r")
        raw = mm[ent.start : ent.end].view(_ST_DTYPES[ent.dtype]).reshape(ent.shape)
        if ent.dtype == "BF16":  # bf16 is the top half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return np.array(raw, dtype=np.float32)

    def unclaimed(self) -> list[str]:
        return sorted(n for n in self.entries if n not in self.claimed and not n.endswith(_IGNORED_SUFFIXES))

    def close(self) -> None:
        self._maps.clear()


# ----------------------------------------------------------------------------------------------
# hyperparameters


def _cfg(config: dict[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    val = config.get(key)
    if val is None:
        if required:
            raise ConversionError(f"config.json: missing required key {key!r}")
        return default
    return val


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    val = _cfg(config, key, default, required=default is None)
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise ConversionError(f"config.json: {key!r} must be a positive integer, got {val!r}")
    return val


@dataclass
class _HParams:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx: int
    n_ff: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    norm_topk: bool = False
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _rope_theta(config: dict[str, Any]) -> float:
    # transformers 5 moved rope settings into rope_parameters; 4.x kept rope_theta/rope_scaling.
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    if params and "rope_theta" not in params:  # e.g. per-layer-type rope settings
        raise ConversionError(f"config.json: unsupported rope_parameters layout {sorted(params)}")
    for p in (params, scaling):
        rtype = p.get("rope_type", p.get("type", "default"))
        if rtype not in (None, "default", "linear", "yarn"):
            raise ConversionError(f"config.json: rope type {rtype!r} is not supported (plain, linear or yarn)")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConversionError(f"config.json: invalid rope_theta {theta!r}")
    return float(theta)


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any]:
    """Linear or YaRN rope scaling as GGUF rope.scaling.* values (empty: none). YaRN's factor is
    the stated one; its other parameters beyond the original context must be transformers'
    defaults (beta_fast 32, beta_slow 1, no attention factor or mscale override), which are
    llama.cpp's too."""
    p = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rtype = p.get("rope_type", p.get("type", "default"))
    if rtype in (None, "default"):
        return {}
    factor = p.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1e6:
        raise ConversionError(f"config.json: rope scaling {rtype!r} needs a positive factor, got {factor!r}")
    out: dict[str, Any] = {"type": rtype, "factor": float(factor)}
    if rtype == "yarn":
        extra = {k: p[k] for k in ("attention_factor", "mscale", "mscale_all_dim") if p.get(k) is not None}
        if extra or p.get("beta_fast", 32) != 32 or p.get("beta_slow", 1) != 1 or p.get("truncate", True) is False:
            raise ConversionError(f"config.json: YaRN parameters {sorted(p)} beyond factor and original context "
                                  "are not converted")
        orig = p.get("original_max_position_embeddings")
        if orig is not None:
            if not isinstance(orig, int) or orig < 1:
                raise ConversionError(f"config.json: invalid original_max_position_embeddings {orig!r}")
            out["original_context_length"] = orig
    return out


def _hparams(config: dict[str, Any], spec: _ArchSpec, hf_arch: str, hf_dir: Path) -> _HParams:
    n_embd = _int(config, "hidden_size")
    n_head = _int(config, "num_attention_heads")
    n_head_kv = _int(config, "num_key_value_heads", n_head)
    head_dim = _int(config, "head_dim", n_embd // n_head)
    if n_head % n_head_kv:
        raise ConversionError(f"config.json: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}")
    hp = _HParams(
        n_layer=_int(config, "num_hidden_layers"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_vocab=_int(config, "vocab_size"),
        n_ctx=_int(config, "max_position_embeddings"),
        n_ff=_int(config, "intermediate_size"),
        rms_eps=float(_cfg(config, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        tie_embeddings=bool(_cfg(config, "tie_word_embeddings", False)),
        name=str(config.get("_name_or_path") or hf_dir.resolve().name),
    )
    if head_dim % 2:
        raise ConversionError(f"config.json: head_dim {head_dim} must be even")
    if scaling := _rope_scaling(config):
        hp.extra["rope_scaling"] = scaling
    if not spec.moe:
        return hp
    if hf_arch == "MixtralForCausalLM":
        hp.n_expert = _int(config, "num_local_experts")
        hp.n_ff_exp = hp.n_ff  # Mixtral's experts use intermediate_size
        hp.norm_topk = True  # Mixtral always renormalises its top-k weights
    else:
        # transformers 5 saves Qwen's num_experts under its alias num_local_experts
        hp.n_expert = _int(config, "num_experts" if "num_experts" in config else "num_local_experts")
        hp.n_ff_exp = _int(config, "moe_intermediate_size")
        hp.norm_topk = bool(_cfg(config, "norm_topk_prob", False))
        # Qwen MoE configs can interleave dense layers; llama.cpp's qwen*moe graphs cannot.
        step = _int(config, "decoder_sparse_step", 1)
        dense = sorted(set(_cfg(config, "mlp_only_layers", [])) | {i for i in range(hp.n_layer) if (i + 1) % step})
        if dense:
            raise ConversionError(f"config.json: dense (non-MoE) layers {dense} are not supported for {hf_arch}")
    hp.n_expert_used = _int(config, "num_experts_per_tok")
    if hp.n_expert_used > hp.n_expert:
        raise ConversionError(f"config.json: num_experts_per_tok {hp.n_expert_used} > expert count {hp.n_expert}")
    if spec.shared_expert:
        hp.n_ff_shexp = _int(config, "shared_expert_intermediate_size")
    return hp


# ----------------------------------------------------------------------------------------------
# tensor plan


@dataclass
class _Planned:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # row-major float shape (GGUF ne is this reversed)
    load: Callable[[], np.ndarray]
    qtype: QT = QT.F32


class _Planner:
    def __init__(self, ckpt: _Checkpoint) -> None:
        self.ckpt = ckpt
        self.items: list[_Planned] = []

    def check(self, hf_name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        if got != want:
            raise ConversionError(f"tensor {hf_name!r} has shape {list(got)}, expected {list(want)}")

    def add(self, gguf_name: str, hf_name: str, want: tuple[int, ...],
            transform: Callable[[np.ndarray], np.ndarray] | None = None,
            out_shape: tuple[int, ...] | None = None) -> None:
        self.check(hf_name, self.ckpt.claim(hf_name), want)
        ckpt = self.ckpt

        def load() -> np.ndarray:
            arr = ckpt.load(hf_name)
            return transform(arr) if transform else arr

        self.items.append(_Planned(gguf_name, out_shape or want, load))

    def add_loaded(self, gguf_name: str, shape: tuple[int, ...], load: Callable[[], np.ndarray]) -> None:
        self.items.append(_Planned(gguf_name, shape, load))


def _first_present(ckpt: _Checkpoint, names: Iterable[str]) -> str | None:
    return next((n for n in names if n in ckpt), None)


def _plan_experts(pl: _Planner, hp: _HParams, i: int, prefixes: tuple[str, ...]) -> None:
    """Router + stacked experts of layer i; accepts per-expert or fused (transformers 5) layout."""
    ckpt, E, F, D = pl.ckpt, hp.n_expert, hp.n_ff_exp, hp.n_embd
    prefix = next((p for p in prefixes if f"{p}.gate.weight" in ckpt), prefixes[-1])
    pl.add(f"blk.{i}.ffn_gate_inp.weight", f"{prefix}.gate.weight", (E, D))

    gate_up = _first_present(ckpt, (f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.gate_up_proj.weight"))
    if gate_up is not None:
        down = _first_present(ckpt, (f"{prefix}.experts.down_proj", f"{prefix}.experts.down_proj.weight"))
        if down is None:
            raise ConversionError(f"missing tensor {prefix + '.experts.down_proj'!r} in the checkpoint")
        pl.check(gate_up, ckpt.claim(gate_up), (E, 2 * F, D))  # gate rows first, then up
        pl.check(down, ckpt.claim(down), (E, D, F))
        pl.add_loaded(f"blk.{i}.ffn_gate_exps.weight", (E, F, D), lambda: ckpt.load(gate_up)[:, :F, :])
        pl.add_loaded(f"blk.{i}.ffn_up_exps.weight", (E, F, D), lambda: ckpt.load(gate_up)[:, F:, :])
        pl.add_loaded(f"blk.{i}.ffn_down_exps.weight", (E, D, F), lambda: ckpt.load(down))
        return

    # Per-expert layout: Mixtral names w1 (gate), w3 (up), w2 (down); Qwen names them *_proj.
    naming = ("w1", "w3", "w2") if f"{prefix}.experts.0.w1.weight" in ckpt else ("gate_proj", "up_proj", "down_proj")
    for kind, hf_w, shape in zip(("gate", "up", "down"), naming, ((F, D), (F, D), (D, F)), strict=True):
        names = [f"{prefix}.experts.{e}.{hf_w}.weight" for e in range(E)]
        for n in names:
            pl.check(n, ckpt.claim(n), shape)
        pl.add_loaded(f"blk.{i}.ffn_{kind}_exps.weight", (E, *shape),
                      lambda names=names: np.stack([ckpt.load(n) for n in names]))


def _plan(ckpt: _Checkpoint, spec: _ArchSpec, hp: _HParams) -> list[_Planned]:
    pl = _Planner(ckpt)
    D, H, Hkv, hd = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    pl.add("token_embd.weight", "model.embed_tokens.weight", (hp.n_vocab, D))
    for i in range(hp.n_layer):
        p = f"model.layers.{i}"
        pl.add(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight", (D,))
        perm_q = (lambda a: permute_qk(a, H)) if spec.permute_qk else None
        perm_k = (lambda a: permute_qk(a, Hkv)) if spec.permute_qk else None
        pl.add(f"blk.{i}.attn_q.weight", f"{p}.self_attn.q_proj.weight", (H * hd, D), perm_q)
        pl.add(f"blk.{i}.attn_k.weight", f"{p}.self_attn.k_proj.weight", (Hkv * hd, D), perm_k)
        pl.add(f"blk.{i}.attn_v.weight", f"{p}.self_attn.v_proj.weight", (Hkv * hd, D))
        # q/k/v biases: required by qwen2moe, optional for llama (attention_bias=True checkpoints);
        # llama.cpp's qwen3moe has no bias tensors, so there they stay unclaimed and are reported.
        llama_bias = spec.gguf_arch == "llama" and f"{p}.self_attn.q_proj.bias" in ckpt
        if spec.qkv_bias or llama_bias:
            pl.add(f"blk.{i}.attn_q.bias", f"{p}.self_attn.q_proj.bias", (H * hd,), perm_q)
            pl.add(f"blk.{i}.attn_k.bias", f"{p}.self_attn.k_proj.bias", (Hkv * hd,), perm_k)
            pl.add(f"blk.{i}.attn_v.bias", f"{p}.self_attn.v_proj.bias", (Hkv * hd,))
        pl.add(f"blk.{i}.attn_output.weight", f"{p}.self_attn.o_proj.weight", (D, H * hd))
        if llama_bias and f"{p}.self_attn.o_proj.bias" in ckpt:
            pl.add(f"blk.{i}.attn_output.bias", f"{p}.self_attn.o_proj.bias", (D,))
        if spec.qk_norm:
            pl.add(f"blk.{i}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight", (hd,))
            pl.add(f"blk.{i}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight", (hd,))
        pl.add(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", (D,))
        if spec.moe:
            _plan_experts(pl, hp, i, (f"{p}.block_sparse_moe", f"{p}.mlp"))
        else:
            pl.add(f"blk.{i}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", (hp.n_ff, D))
            pl.add(f"blk.{i}.ffn_up.weight", f"{p}.mlp.up_proj.weight", (hp.n_ff, D))
            pl.add(f"blk.{i}.ffn_down.weight", f"{p}.mlp.down_proj.weight", (D, hp.n_ff))
        if spec.shared_expert:
            Fs = hp.n_ff_shexp
            # HF's Linear(D, 1) weight is [1, D]; llama.cpp wants a 1-D {n_embd} tensor.
            pl.add(f"blk.{i}.ffn_gate_inp_shexp.weight", f"{p}.mlp.shared_expert_gate.weight", (1, D),
                   lambda a: a.reshape(-1), out_shape=(D,))
            pl.add(f"blk.{i}.ffn_gate_shexp.weight", f"{p}.mlp.shared_expert.gate_proj.weight", (Fs, D))
            pl.add(f"blk.{i}.ffn_up_shexp.weight", f"{p}.mlp.shared_expert.up_proj.weight", (Fs, D))
            pl.add(f"blk.{i}.ffn_down_shexp.weight", f"{p}.mlp.shared_expert.down_proj.weight", (D, Fs))
    pl.add("output_norm.weight", "model.norm.weight", (D,))
    if hp.tie_embeddings:
        if "lm_head.weight" in ckpt:  # some tied checkpoints still carry a copy; it is redundant
            ckpt.claim("lm_head.weight")
    else:
        pl.add("output.weight", "lm_head.weight", (hp.n_vocab, D))

    extra = ckpt.unclaimed()
    if extra:
        shown = ", ".join(repr(n) for n in extra[:8]) + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else "")
        raise ConversionError(f"unexpected tensor(s) in the checkpoint that would be dropped: {shown}")
    return pl.items


def _storage_type(name: str, shape: tuple[int, ...], want: QT) -> QT:
    # Norms, biases and routers stay F32 as in llama.cpp (routers are tiny and sensitive).
    if len(shape) == 1 or ".ffn_gate_inp" in name:
        return QT.F32
    if want in (QT.F32, QT.F16, QT.BF16):
        return want
    block = gguf.GGML_QUANT_SIZES[want][0]
    if shape[-1] % block:
        log.warning("%s: row length %d is not a multiple of %d; storing F16 instead of %s",
                     name, shape[-1], block, want.name)
        return QT.F16
    return want


def _encode(arr: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == QT.F16:
        return np.ascontiguousarray(arr, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)


def _nbytes_and_dtype(shape: tuple[int, ...], qtype: QT) -> tuple[int, np.dtype, tuple[int, ...]]:
    """Bytes, numpy dtype and numpy shape of the encoded tensor (for GGUFWriter.add_tensor_info)."""
    if qtype in (QT.F32, QT.F16):
        dt = np.dtype(np.float32 if qtype == QT.F32 else np.float16)
        return math.prod(shape) * dt.itemsize, dt, shape
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    byte_shape = (*shape[:-1], shape[-1] // block * type_size)
    return math.prod(byte_shape), np.dtype(np.uint8), byte_shape


# ----------------------------------------------------------------------------------------------
# tokenizer


def _is_byte_level(tok: dict[str, Any]) -> bool:
    def has_byte_level(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has_byte_level(n) for n in node.get("pretokenizers", []) + node.get("decoders", []))

    return (tok.get("model") or {}).get("type") == "BPE" and (
        has_byte_level(tok.get("pre_tokenizer")) or has_byte_level(tok.get("decoder"))
    )


def _special_content(val: Any) -> str | None:
    if isinstance(val, dict):
        val = val.get("content")
    return val if isinstance(val, str) else None


def _write_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, hp: _HParams, spec: _ArchSpec, config: dict[str, Any]) -> bool:
    """Write a gpt2 (byte-level BPE) vocab; returns False when the checkpoint has no tokenizer.json."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return False
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from e
    if not _is_byte_level(tok):
        raise ConversionError(f"{path}: only byte-level BPE tokenizers are supported "
                              "(convert with --skip-tokenizer to write a token-id-only GGUF)")
    vocab: dict[str, int] = tok["model"].get("vocab") or {}
    added = {int(a["id"]): a for a in tok.get("added_tokens", [])}
    ids = list(vocab.values()) + list(added)
    if ids and max(ids) >= hp.n_vocab:
        raise ConversionError(f"{path}: token id {max(ids)} does not fit the model's vocab_size {hp.n_vocab}")

    # llama.cpp wants exactly n_vocab entries; embedding rows the tokenizer never uses become [PADn].
    tokens = [f"[PAD{i}]" for i in range(hp.n_vocab)]
    types = [int(gguf.TokenType.UNUSED)] * hp.n_vocab
    for text, i in vocab.items():
        tokens[i], types[i] = text, int(gguf.TokenType.NORMAL)
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = int(gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]

    w.add_tokenizer_model("gpt2")
    # The pre-tokenizer regex is chosen by name in llama.cpp; Qwen2/3 share "qwen2".
    w.add_tokenizer_pre("qwen2" if spec.gguf_arch.startswith("qwen") else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)

    tcfg: dict[str, Any] = {}
    tcfg_path = hf_dir / "tokenizer_config.json"
    if tcfg_path.is_file():
        try:
            tcfg = json.loads(tcfg_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConversionError(f"{tcfg_path}: invalid JSON ({e})") from e
    lookup = {t: i for i, t in enumerate(tokens)}

    def special_id(kind: str) -> int | None:
        text = _special_content(tcfg.get(f"{kind}_token"))
        if text is not None and text in lookup:
            return lookup[text]
        val = config.get(f"{kind}_token_id")
        if isinstance(val, list):
            val = val[0] if val else None
        return val if isinstance(val, int) and 0 <= val < hp.n_vocab else None

    for kind, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                      ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):
        if (tid := special_id(kind)) is not None:
            add(tid)
    if isinstance(tcfg.get("add_bos_token"), bool):
        w.add_add_bos_token(tcfg["add_bos_token"])
    template = tcfg.get("chat_template")
    jinja = hf_dir / "chat_template.jinja"  # transformers >= 4.43 may store it separately
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template:
        w.add_chat_template(template)
    return True


# ----------------------------------------------------------------------------------------------
# driver


def _write_metadata(w: gguf.GGUFWriter, spec: _ArchSpec, hp: _HParams, file_type: LlamaFileType) -> None:
    w.add_name(hp.name)
    w.add_vocab_size(hp.n_vocab)
    w.add_context_length(hp.n_ctx)
    w.add_embedding_length(hp.n_embd)
    w.add_block_count(hp.n_layer)
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_key_length(hp.head_dim)
    w.add_value_length(hp.head_dim)
    w.add_rope_dimension_count(hp.head_dim)
    w.add_rope_freq_base(hp.rope_theta)
    scaling = hp.extra.get("rope_scaling") or {}
    if scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling["type"]))
        w.add_rope_scaling_factor(scaling["factor"])
        if "original_context_length" in scaling:
            w.add_rope_scaling_orig_ctx_len(scaling["original_context_length"])
    w.add_layer_norm_rms_eps(hp.rms_eps)
    if spec.moe:
        w.add_expert_count(hp.n_expert)
        w.add_expert_used_count(hp.n_expert_used)
        w.add_expert_feed_forward_length(hp.n_ff_exp)
        w.add_expert_weights_norm(hp.norm_topk)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        if spec.shared_expert:
            w.add_expert_shared_feed_forward_length(hp.n_ff_shexp)
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def convert_hf(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], outtype: str = "f16",
               *, skip_tokenizer: bool = False) -> Path:
    """Convert ``hf_dir`` to a GGUF at ``out`` (written atomically); returns ``out``."""
    hf_dir, out = Path(hf_dir), Path(out)
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    want_type, file_type = OUTTYPES[outtype]
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{hf_dir}: no config.json")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConversionError(f"{cfg_path}: invalid JSON ({e})") from e
    archs = config.get("architectures") or []
    hf_arch = archs[0] if archs and isinstance(archs[0], str) else None
    if hf_arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"unsupported architecture {hf_arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    spec = SUPPORTED_ARCHITECTURES[hf_arch]
    hp = _hparams(config, spec, hf_arch, hf_dir)

    ckpt = _Checkpoint(hf_dir)
    plan = _plan(ckpt, spec, hp)  # validates every name and shape before a byte is written
    for item in plan:
        item.qtype = _storage_type(item.name, item.shape, want_type)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, spec.gguf_arch)
    try:
        _write_metadata(writer, spec, hp, file_type)
        if not skip_tokenizer:
            _write_tokenizer(writer, hf_dir, hp, spec, config)
        for item in plan:
            nbytes, dtype, shape = _nbytes_and_dtype(item.shape, item.qtype)
            writer.add_tensor_info(item.name, shape, dtype, nbytes, raw_dtype=item.qtype)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item in plan:  # one tensor in memory at a time
            arr = item.load()
            if arr.shape != item.shape:
                raise ConversionError(f"{item.name}: produced shape {list(arr.shape)}, planned {list(item.shape)}")
            writer.write_tensor_data(_encode(arr, item.qtype))
        commit_gguf(writer, tmp, out)
    except BaseException:
        abort_gguf(writer, tmp)
        raise
    finally:
        ckpt.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.convert_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", type=Path, help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("out", type=Path, help="output .gguf path")
    ap.add_argument("--outtype", choices=list(OUTTYPES), default="f16", help="storage type of 2-D+ weights (default f16)")
    ap.add_argument("--skip-tokenizer", action="store_true", help="write no tokenizer (the engine then takes token ids)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        path = convert_hf(args.hf_dir, args.out, args.outtype, skip_tokenizer=args.skip_tokenizer)
    except (ConversionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
