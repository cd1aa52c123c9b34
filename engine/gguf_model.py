"""GGUF file -> validated hyper-parameters and borrowed tensor pointers for the C engine.

The file is memory-mapped read-only by gguf-py's reader; tensors are handed to C as
pointers into that mapping, so loading copies no weights and the page cache is
shared by every process (lane) that maps the same file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

GGUF_MAGIC = b"GGUF"

# ggml type ids the C engine implements (see engine/csrc/strata.h).
SUPPORTED_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16",
}

ARCH_IDS = {"llama": 0, "qwen3moe": 1, "qwen2moe": 2}
ROPE_NORM, ROPE_NEOX = 0, 2
# Renormalise the top-k routing weights unless the file says otherwise.
DEFAULT_EXPERT_NORM = {"llama": True, "qwen3moe": True, "qwen2moe": False}


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the file and the problem named."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class UnsupportedModelError(GGUFError):
    """A valid GGUF whose architecture or quant type Strata does not run."""


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


def _field_value(f: Any) -> Any:
    v = f.contents()
    return v


def read_metadata(reader: Any) -> dict[str, Any]:
    return {k: _field_value(f) for k, f in reader.fields.items()}


def _open_reader(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.exists():
        raise GGUFError(path, "file not found")
    if not path.is_file():
        raise GGUFError(path, "not a regular file")
    with path.open("rb") as fh:
        head = fh.read(8)
    if len(head) < 8:
        raise GGUFError(path, f"file too short to be GGUF ({len(head)} bytes)")
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(path, f"bad magic {head[:4]!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # gguf-py raises ValueError/IndexError/struct errors on damage
        raise GGUFError(path, f"corrupt or truncated GGUF ({type(exc).__name__}: {exc})") from exc


def _get(md: dict[str, Any], key: str, default: Any = None, *, path: Path) -> Any:
    if key in md:
        return md[key]
    if default is None:
        raise GGUFError(path, f"missing metadata key {key!r}")
    return default


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

    n_embd = int(g("embedding_length"))
    n_head = int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", n_embd // max(n_head, 1)))
    if "token_embd.weight" not in tensors:
        raise GGUFError(path, "missing tensor 'token_embd.weight'")
    n_vocab = int(tensors["token_embd.weight"].shape[1])
    n_expert = int(g("expert_count", 0))
    gating = int(g("expert_gating_func", 1))
    if n_expert and gating != 1:
        raise UnsupportedModelError(path, f"expert gating function {gating} is not supported (only softmax)")
    n_ff_exp = 0
    if n_expert and "blk.0.ffn_gate_exps.weight" in tensors:
        n_ff_exp = int(tensors["blk.0.ffn_gate_exps.weight"].shape[1])
    return HParams(
        arch=arch,
        n_layer=int(g("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(g("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_vocab=n_vocab,
        n_ctx_train=int(g("context_length", 2048)),
        n_expert=n_expert,
        n_expert_used=int(g("expert_used_count", 0)),
        expert_norm=bool(g("expert_weights_norm", DEFAULT_EXPERT_NORM[arch])),
        n_ff=int(g("feed_forward_length", 0)),
        n_ff_exp=n_ff_exp,
        n_ff_shexp=int(g("expert_shared_feed_forward_length", 0)),
        rope_type=ROPE_NORM if arch == "llama" else ROPE_NEOX,
        rope_dim=int(g("rope.dimension_count", head_dim)),
        rope_base=float(g("rope.freq_base", 10000.0)),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
    )


def open_model(path: str | os.PathLike[str]) -> ModelFile:
    """Open and validate a GGUF model; raise GGUFError naming the file and problem."""
    path = Path(path)
    reader = _open_reader(path)
    size = path.stat().st_size
    tensors: dict[str, TensorRef] = {}
    for t in reader.tensors:
        tid = int(t.tensor_type)
        if tid not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                path, f"tensor {t.name!r} has unsupported quant type {t.tensor_type.name} (id {tid})"
            )
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(path, f"truncated: tensor {t.name!r} ends at byte {end}, file has {size}")
        data = np.asarray(t.data).reshape(-1).view(np.uint8)
        if data.nbytes != int(t.n_bytes):
            raise GGUFError(path, f"tensor {t.name!r} holds {data.nbytes} bytes, expected {int(t.n_bytes)}")
        tensors[t.name] = TensorRef(t.name, tid, tuple(int(x) for x in t.shape), data, int(t.n_bytes))
    md = read_metadata(reader)
    hp = _hparams(md, tensors, path)
    # gguf-py keeps a numpy object per metadata item (~170 MB for a 49k vocabulary);
    # the tensor views keep the mapping alive, so the parsed fields can go.
    reader.fields.clear()
    reader.tensors = []
    return ModelFile(path=path, metadata=md, hparams=hp, tensors=tensors)


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


def build_desc(mf: ModelFile) -> tuple[Any, list[Any]]:
    """A filled st_model_desc plus the cffi objects that must outlive it."""
    from engine.native import ffi  # here, so reading and writing GGUF needs no C build

    hp = mf.hparams
    keep: list[Any] = []
    desc = ffi.new("st_model_desc *")
    layers = ffi.new("st_layer[]", hp.n_layer)
    keep += [desc, layers]
    desc.arch = ARCH_IDS[hp.arch]
    for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_vocab", "n_expert", "n_expert_used",
              "rope_type", "rope_dim", "rope_base", "norm_eps"):
        setattr(desc, k, getattr(hp, k))
    desc.expert_norm = int(hp.expert_norm)
    t = mf.tensors
    _fill(desc.token_embd, t["token_embd.weight"], keep)
    if "output_norm.weight" not in t:
        raise GGUFError(mf.path, "missing tensor 'output_norm.weight'")
    _fill(desc.output_norm, t["output_norm.weight"], keep)
    _fill(desc.output, t.get("output.weight", t["token_embd.weight"]), keep)  # tied embeddings
    for il in range(hp.n_layer):
        for field_name, suffix in _LAYER_TENSORS.items():
            _fill(getattr(layers[il], field_name), t.get(f"blk.{il}.{suffix}"), keep)
    desc.layers = layers
    return desc, keep
