"""Hybrid placement: which routed experts sit on the GPU, from measured routing frequencies.

Three pieces, all on the host (the CUDA engine reads their result):

- :class:`RoutingStats`: per (layer, expert) routing counts and the tokens they were counted over, updated
  from step histograms (``st_batch.expert_hist``, ``StepReport.expert_hist``) with an exponential decay by
  tokens, so the frequencies follow a changing workload.
- :class:`PlacementFile`: those statistics saved as versioned JSON with the identity of the model they were
  measured on (architecture, layer / expert counts, a hash of the tensor table); loading it for another model
  raises :class:`PlacementMismatchError`.
- :func:`plan`: given the model, a GPU byte budget and the frequencies, the bytes everything but the routed
  experts needs on the GPU, then resident experts chosen greedily by expected tokens saved per byte until the
  budget is full; bytes per token read from RAM and the predicted batch-1 decode rate from measured
  bandwidths (:func:`measure_cpu_read_gbs`, :func:`gpu_read_gbs`).

docs/engine.md, "Hybrid placement", describes the file and the budget accounting.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    model_validator,
)

from engine.gguf_model import ModelFile

__all__ = [
    "PLACEMENT_FORMAT", "PLACEMENT_VERSION", "PlacementError", "PlacementFormatError", "PlacementMismatchError",
    "ModelIdentity", "RoutingStats", "PlacementFile", "GpuPlan", "PlanParams", "GPU_READ_GBS", "model_identity",
    "tensor_table_hash", "expert_bytes", "fixed_gpu_bytes", "plan", "measure_cpu_read_gbs", "gpu_read_gbs",
    "render_plan", "engine_plan_params", "engine_step_tokens", "default_placement_path", "placement_frequencies",
    "resident_mask", "replacement_moves",
]

PLACEMENT_FORMAT = "strata-placement"
PLACEMENT_VERSION = 1
MIB = 1 << 20
GIB = 1 << 30
ALIGN = 256  # the CUDA engine's weight arena aligns every tensor to 256 bytes (engine/csrc/cuda/model.cu)
ROUTED_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


class PlacementError(ValueError):
    """A placement file or plan request that cannot be used; the message says why."""


class PlacementFormatError(PlacementError):
    """A placement file that is not valid JSON, not this format, or of a version this code does not read."""


class PlacementMismatchError(PlacementError):
    """A placement file measured on another model (architecture, counts or tensor table differ)."""


# ---------------------------------------------------------------- the model's identity

def tensor_table_hash(mf: ModelFile) -> str:
    """sha256 over the tensor table (every tensor's name, ggml type and shape, in name order): two files
    with the same weights layout hash the same whatever their metadata or tensor order; a requantised or
    reshaped model does not."""
    h = hashlib.sha256()
    for name in sorted(mf.tensors):
        t = mf.tensors[name]
        h.update(f"{name}\t{t.type_id}\t{','.join(map(str, t.shape))}\n".encode())
    return h.hexdigest()


class ModelIdentity(BaseModel):
    """What a placement file was measured on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: str
    n_layer: int = Field(ge=1)
    n_expert: int = Field(ge=1)
    n_expert_used: int = Field(ge=1)
    tensor_table_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    def mismatch(self, other: ModelIdentity) -> str | None:
        """None when both name the same model, else what differs (one line)."""
        diffs = [f"{k} {getattr(self, k)!r} != {getattr(other, k)!r}"
                 for k in ("arch", "n_layer", "n_expert", "n_expert_used", "tensor_table_sha256")
                 if getattr(self, k) != getattr(other, k)]
        return "; ".join(diffs) or None


def model_identity(mf: ModelFile) -> ModelIdentity:
    hp = mf.hparams
    if not hp.n_expert or not hp.n_expert_used:
        raise PlacementError(f"{mf.path}: a dense model has no routed experts to place")
    return ModelIdentity(arch=hp.arch, n_layer=hp.n_layer, n_expert=hp.n_expert, n_expert_used=hp.n_expert_used,
                         tensor_table_sha256=tensor_table_hash(mf))


# ---------------------------------------------------------------- routing statistics

def _f64(v: Any) -> np.ndarray:
    a = np.array(v, dtype=np.float64)  # a copy: the model owns its arrays
    if a.dtype != np.float64:
        raise ValueError("expected numbers")
    return a


F64Array = Annotated[np.ndarray, BeforeValidator(_f64), PlainSerializer(lambda a: a.tolist(), return_type=list)]


class RoutingStats(BaseModel):
    """Routing counts per (layer, expert), decayed, and the tokens they were counted over.

    ``frequencies()[l, e]`` is the probability that a token routes to expert e in layer l (a layer's row
    sums to n_expert_used). Before any token is counted the routing is taken as uniform (k / n_expert), the
    load-balanced router's aim. The counts live in numpy arrays (an update of a 94-layer, 128-expert
    model is a few vector operations); they serialise as lists."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    n_layer: int = Field(ge=1)
    n_expert: int = Field(ge=1)
    n_expert_used: int = Field(ge=1)
    counts: F64Array  # [n_layer, n_expert], decayed token counts
    tokens: F64Array  # [n_layer], decayed tokens counted per layer
    half_life_tokens: float | None = Field(None, gt=0, description="online decay: a count's weight halves every "
                                                                    "this many tokens; None: plain sums")

    @model_validator(mode="after")
    def _shapes(self) -> RoutingStats:
        if self.n_expert_used > self.n_expert:
            raise ValueError(f"n_expert_used {self.n_expert_used} > n_expert {self.n_expert}")
        c, t = self.counts, self.tokens
        if c.shape != (self.n_layer, self.n_expert):
            raise ValueError(f"counts must be [{self.n_layer}][{self.n_expert}]")
        if t.shape != (self.n_layer,):
            raise ValueError(f"tokens must have {self.n_layer} entries")
        if not (np.isfinite(c).all() and np.isfinite(t).all()) or (c < 0).any() or (t < 0).any():
            raise ValueError("counts and tokens must be finite and >= 0")
        # a token routes to k distinct experts: no expert can have been hit more often than tokens were seen
        if (c > t[:, None] * (1 + 1e-9) + 1e-6).any():
            raise ValueError("an expert's count exceeds the tokens counted in its layer")
        return self

    def same(self, other: RoutingStats) -> bool:
        """Equal shapes, decay and counts (``==`` on a model holding arrays is not defined)."""
        return ((self.n_layer, self.n_expert, self.n_expert_used, self.half_life_tokens) ==
                (other.n_layer, other.n_expert, other.n_expert_used, other.half_life_tokens)
                and np.array_equal(self.counts, other.counts) and np.array_equal(self.tokens, other.tokens))

    @classmethod
    def empty(cls, n_layer: int, n_expert: int, n_expert_used: int,
              half_life_tokens: float | None = None) -> RoutingStats:
        return cls(n_layer=n_layer, n_expert=n_expert, n_expert_used=n_expert_used,
                   counts=np.zeros((n_layer, n_expert)), tokens=np.zeros(n_layer), half_life_tokens=half_life_tokens)

    @classmethod
    def for_model(cls, mf: ModelFile, half_life_tokens: float | None = None) -> RoutingStats:
        ident = model_identity(mf)
        return cls.empty(ident.n_layer, ident.n_expert, ident.n_expert_used, half_life_tokens)

    def update(self, hist: np.ndarray) -> None:
        """Add one step's histogram (int [n_layer, n_expert], tokens routed per expert, as the CPU and GPU
        engines fill ``st_batch.expert_hist``). With a half-life, what was counted before decays by
        0.5 ** (step tokens / half_life_tokens), per layer, first."""
        h = np.asarray(hist)
        if h.shape != (self.n_layer, self.n_expert):
            raise PlacementError(f"histogram of shape {h.shape}, expected ({self.n_layer}, {self.n_expert})")
        if not np.issubdtype(h.dtype, np.integer) or (h < 0).any():
            raise PlacementError("a histogram holds non-negative integer counts")
        step_tokens = h.sum(axis=1, dtype=np.float64) / self.n_expert_used  # each token adds k pairs to its layer
        if self.half_life_tokens is not None:
            f = np.power(0.5, step_tokens / self.half_life_tokens)
            self.counts *= f[:, None]
            self.tokens *= f
        self.counts += h
        self.tokens += step_tokens

    def frequencies(self) -> np.ndarray:
        """[n_layer, n_expert] float64: the probability that a token routes to each expert (uniform k / n_expert
        for a layer with nothing counted)."""
        c, t = self.counts, self.tokens
        out = np.full_like(c, self.n_expert_used / self.n_expert)
        seen = t > 0
        out[seen] = c[seen] / t[seen, None]
        return out

    @property
    def total_tokens(self) -> float:
        return float(self.tokens.max(initial=0.0))


# ---------------------------------------------------------------- the placement file

class PlacementFile(BaseModel):
    """A placement file: routing statistics and the model they belong to (JSON, versioned)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["strata-placement"] = PLACEMENT_FORMAT
    version: int = PLACEMENT_VERSION
    model: ModelIdentity
    stats: RoutingStats
    source: str = Field("", max_length=4096, description="how the statistics were gathered (one line)")
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @model_validator(mode="after")
    def _consistent(self) -> PlacementFile:
        m, s = self.model, self.stats
        if (m.n_layer, m.n_expert, m.n_expert_used) != (s.n_layer, s.n_expert, s.n_expert_used):
            raise ValueError("stats shape differs from the model's layer / expert counts")
        return self

    @classmethod
    def for_model(cls, mf: ModelFile, stats: RoutingStats, source: str = "") -> PlacementFile:
        return cls(model=model_identity(mf), stats=stats, source=source)

    def check_model(self, mf: ModelFile) -> None:
        """Raise PlacementMismatchError unless this file was measured on ``mf``'s model."""
        diff = self.model.mismatch(model_identity(mf))
        if diff:
            raise PlacementMismatchError(f"placement file is for another model ({diff}), not {mf.path}")

    def to_json(self) -> str:
        """JSON with one line per layer of counts (diffable, and a few hundred KB for a big model)."""
        d = self.model_dump(mode="json")
        stats = d.pop("stats")
        counts = stats.pop("counts")
        body = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items()]
        inner = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in stats.items()]
        rows = ",\n".join(f"   {json.dumps(r)}" for r in counts)
        inner.append(f'  "counts": [\n{rows}\n  ]')
        body.append(' "stats": {\n' + ",\n".join(inner) + "\n }")
        return "{\n" + ",\n".join(body) + "\n}"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (a temporary file in the same directory, then rename)."""
        p = Path(path)
        text = self.to_json()
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent if str(p.parent) else ".")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text + "\n")
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: ModelFile | None = None,
             max_bytes: int = 64 * MIB) -> PlacementFile:
        """Read a placement file; with ``model``, refuse one measured on another model (PlacementMismatchError).
        Anything unreadable is a PlacementFormatError naming the file."""
        p = Path(path)
        try:
            size = p.stat().st_size
            if size > max_bytes:
                raise PlacementFormatError(f"{p}: {size} bytes, more than a placement file's {max_bytes}")
            raw: Any = json.loads(p.read_bytes())
        except PlacementError:
            raise
        except (OSError, ValueError) as exc:
            raise PlacementFormatError(f"{p}: not a readable JSON placement file ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != PLACEMENT_FORMAT:
            raise PlacementFormatError(f"{p}: not a {PLACEMENT_FORMAT} file")
        if raw.get("version") != PLACEMENT_VERSION:
            raise PlacementFormatError(f"{p}: placement format version {raw.get('version')!r}; this Strata reads "
                                       f"version {PLACEMENT_VERSION}")
        try:
            pf = cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise PlacementFormatError(f"{p}: invalid placement file: {where}: {first.get('msg')}") from None
        if model is not None:
            pf.check_model(model)
        return pf


# ---------------------------------------------------------------- bandwidths

# Peak memory read bandwidth by GPU (GB/s, vendors' data sheets); the first name found in the device's
# name wins, so the more specific entries come first.
GPU_READ_GBS: dict[str, float] = {
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "RTX 6000 Ada": 960.0,
    "RTX 5090": 1792.0,
    "RTX 4090": 1008.0,  # the 4090D has the 4090's memory system
    "RTX 3090": 936.0,
}
DEFAULT_GPU = "RTX 4090D"  # the reference box's card (shared/DESIGN.md)


def gpu_read_gbs(name: str) -> float:
    """The table's figure for a GPU name (case-insensitive substring); PlacementError for an unknown card."""
    low = name.lower()
    for key, gbs in GPU_READ_GBS.items():
        if key.lower() in low:
            return gbs
    raise PlacementError(f"no memory bandwidth known for GPU {name!r} (known: {', '.join(GPU_READ_GBS)}); "
                         "give the figure in GB/s")


def measure_cpu_read_gbs(threads: int | None = None, cores: Sequence[int] | None = None,
                         n_bytes: int = 512 * MIB, passes: int = 3) -> float:
    """RAM read bandwidth (GB/s) through a thread pool like the engine's (``st_mem_read_gbs``): the rate
    routed experts stream from RAM on these cores. The buffer should be well past the last-level cache."""
    from engine.native import check, ffi, lib

    n = threads if threads is not None else (len(cores) if cores else len(os.sched_getaffinity(0)))
    pp = ffi.new("st_pool **")
    core_arr = ffi.new("int32_t[]", list(cores)) if cores else ffi.NULL
    check(lib.st_pool_create(n, core_arr, len(cores) if cores else 0, pp), "thread pool")
    try:
        out = ffi.new("double *")
        check(lib.st_mem_read_gbs(pp[0], n_bytes, passes, out), "memory probe")
        return float(out[0])
    finally:
        lib.st_pool_destroy(pp[0])


# ---------------------------------------------------------------- the plan

def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _category(name: str) -> str:
    """Which part of the GPU side a non-routed tensor belongs to."""
    if name == "token_embd.weight":
        return "embeddings"
    if name.startswith("output"):
        return "norms" if name.startswith("output_norm") else "output head"
    base = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if base.endswith("_norm.weight") or base in ("attn_norm.weight", "ffn_norm.weight"):
        return "norms"
    if base.startswith("attn_"):
        return "attention"
    if base.startswith("ffn_gate_inp_shexp") or "_shexp" in base:
        return "shared experts"
    if base.startswith(("ffn_gate_inp", "exp_probs_b")):  # the router and its score-correction bias
        return "router"
    if base.startswith(("ffn_gate.", "ffn_up.", "ffn_down.")):
        return "dense FFN"
    return "other"


def expert_bytes(mf: ModelFile) -> np.ndarray:
    """[n_layer, n_expert] int64: bytes one routed expert occupies on the GPU (its gate, up and down slices,
    each 256-aligned); 0 where a layer has no routed experts."""
    hp = mf.hparams
    out = np.zeros((hp.n_layer, max(hp.n_expert, 1)), dtype=np.int64)
    for il in range(hp.n_layer):
        per = 0
        for suf in ROUTED_SUFFIXES:
            t = mf.tensors.get(f"blk.{il}.{suf}")
            if t is None:
                per = 0
                break
            per += _aligned(t.n_bytes // hp.n_expert)
        out[il, :] = per
    return out


def fixed_gpu_bytes(mf: ModelFile, n_ctx: int, n_seqs: int, step_tokens: int = 512, logit_rows: int = 64,
                    reserve_bytes: int = 640 * MIB, staging_slots: int = 0, kv_type: str = "f16") -> dict[str, int]:
    """Everything but the resident routed experts that the GPU holds, by part (bytes): every non-routed
    weight of the forward layers 256-aligned (a tied output head shares the embedding; NextN layers, which the
    forward pass never runs, are not uploaded), the KV cache (kv_type's) for n_ctx tokens of each
    of n_seqs sequences, the step buffers for step_tokens tokens, the buffers of the CPU's expert rows (a
    hybrid step's slot ids, pair indices and one row of n_embd floats per routed pair of step_tokens tokens,
    engine/csrc/cuda/hybrid.cu), staging slots (each one expert of the largest size) and the stated reserve
    for the CUDA context and captured graphs."""
    from engine.inspect_model import _layer_of, step_buffer_bytes

    hp = mf.hparams
    parts: dict[str, int] = {}
    for name, t in mf.tensors.items():
        if name.endswith(ROUTED_SUFFIXES) or _layer_of(name) >= hp.n_layer:  # NextN layers stay off the GPU
            continue
        cat = _category(name)
        parts[cat] = parts.get(cat, 0) + _aligned(t.n_bytes)
    kv_per_token = hp.kv_bytes_per_token_of(kv_type)
    parts["KV cache"] = kv_per_token * n_ctx * n_seqs
    parts["step buffers"] = step_buffer_bytes(hp, step_tokens, logit_rows)
    if hp.n_expert:
        # the hybrid step's device buffers: per routed pair a slot id and room for a CPU row (n_embd floats) with
        # its pair index (the rows the CPU computed are copied in before they are summed), and the shared
        # expert's rows (computed while the CPU works)
        parts["hybrid buffers"] = step_tokens * (hp.n_expert_used * (4 * hp.n_embd + 8) +
                                                 (4 * hp.n_embd if hp.n_ff_shexp else 0))
    if staging_slots:
        parts["staging slots"] = staging_slots * int(expert_bytes(mf).max())
    parts["context + graphs reserve"] = reserve_bytes
    return parts


class PlanParams(BaseModel):
    """What a plan is asked for."""

    model_config = ConfigDict(extra="forbid")

    budget_bytes: int = Field(ge=0)
    n_ctx: int = Field(4096, ge=1, description="KV cache tokens per sequence")
    n_seqs: int = Field(1, ge=1, description="sequences the KV cache holds at n_ctx each")
    step_tokens: int = Field(512, ge=1, description="largest step (the prefill chunk): sizes the step buffers")
    reserve_bytes: int = Field(640 * MIB, ge=0, description="CUDA context (measured ~0.5 GiB on an H200) and "
                                                             "captured graphs")
    staging_slots: int = Field(0, ge=0, description="GPU slots for experts staged over PCIe, one expert each")
    cpu_read_gbs: float = Field(gt=0, description="RAM read bandwidth of the lane's cores")
    gpu_read_gbs: float = Field(gt=0, description="GPU memory bandwidth")
    decode_pos: int = Field(1024, ge=0, description="context position of the decode token the rate assumes")
    kv_type: Literal["f16", "q8_0"] = Field("f16", description="the KV cache's values (q8_0: 17/32 of f16's bytes)")


class GpuPlan(BaseModel):
    """What sits where, and what a decode token costs."""

    params: PlanParams
    fixed: dict[str, int]  # GPU bytes by part, resident experts excluded
    fixed_bytes: int
    fits: bool  # the fixed parts fit the budget (else nothing is resident and the lane cannot run)
    resident: list[list[int]]  # [n_layer]: resident expert ids per layer, ascending
    resident_bytes: int
    gpu_bytes: int  # fixed + resident: what the lane holds on the GPU
    routed_bytes: int  # every routed expert
    n_resident: int
    n_routed: int
    hit_rate: float  # expected share of routed pairs served by resident experts
    ram_bytes_per_token: float  # expected routed-expert bytes read from RAM per decode token
    gpu_read_bytes_per_token: float  # weights (and KV at decode_pos) the GPU reads per decode token
    t_cpu_s: float
    t_gpu_s: float
    predicted_tok_s: float  # 1 / (t_cpu + t_gpu): the floor of a frame where neither side hides the other
    cpu_only_tok_s: float  # the whole model read from RAM per token, for comparison


def layer_fill_rank(n_layer: int) -> np.ndarray:
    """[n_layer] int64: the order in which layers take experts of equal score (0 first). The layers ranked last,
    those a budget leaves without resident experts when frequencies tie (uniform routing), are spread over the
    depth instead of being the last layers: a prefill step stages such a layer whole over PCIe into a ring of two
    slots (the GPU engine's hybrid_stage), so its copies run while the resident layers before it compute, where
    a block of consecutive staged layers leaves the copies of all but two of them on the step's critical path.
    The order: bit-reversed positions counted from the last layer (layers n-1, n/2-1, 3n/4-1, n/4-1, ...: every
    tail of the ranking is spread evenly), reversed."""
    bits = max(1, (n_layer - 1).bit_length())
    last_first = [n_layer - 1 - r for r in (int(f"{i:0{bits}b}"[::-1], 2) for i in range(1 << bits)) if r < n_layer]
    rank = np.empty(n_layer, dtype=np.int64)
    rank[last_first[::-1]] = np.arange(n_layer)
    return rank


def plan(mf: ModelFile, params: PlanParams, freqs: np.ndarray | None = None) -> GpuPlan:
    """The GPU side of a hybrid lane: the fixed parts, then resident experts by expected tokens saved per
    byte (frequency / expert bytes, highest first; ties by layer_fill_rank, then expert id) while they fit. freqs:
    [n_layer, n_expert] routing probabilities (RoutingStats.frequencies); None: uniform. The result never
    holds more than the budget: gpu_bytes <= budget_bytes whenever fits, and nothing is resident otherwise."""
    hp = mf.hparams
    ne = max(hp.n_expert, 1)
    ebytes = expert_bytes(mf) if hp.n_expert else np.zeros((hp.n_layer, 1), dtype=np.int64)
    if freqs is None:
        f = np.full((hp.n_layer, ne), hp.n_expert_used / ne if hp.n_expert else 0.0)
    else:
        f = np.asarray(freqs, dtype=np.float64)
        if f.shape != (hp.n_layer, ne):
            raise PlacementError(f"frequencies of shape {f.shape}, the model has ({hp.n_layer}, {ne})")
        if not np.isfinite(f).all() or (f < 0).any():
            raise PlacementError("frequencies must be finite and >= 0")
    f = np.where(ebytes > 0, f, 0.0)
    fixed = fixed_gpu_bytes(mf, params.n_ctx, params.n_seqs, params.step_tokens,
                            reserve_bytes=params.reserve_bytes, staging_slots=params.staging_slots,
                            kv_type=params.kv_type)
    fixed_total = sum(fixed.values())
    fits = fixed_total <= params.budget_bytes
    resident = np.zeros_like(ebytes, dtype=bool)
    left = params.budget_bytes - fixed_total
    if fits:
        cand = np.argwhere(ebytes > 0)
        score = f[cand[:, 0], cand[:, 1]] / ebytes[cand[:, 0], cand[:, 1]]
        # score desc, then the layers' fill rank, then expert id
        order = np.lexsort((cand[:, 1], layer_fill_rank(hp.n_layer)[cand[:, 0]], -score))
        smallest = int(ebytes[ebytes > 0].min()) if (ebytes > 0).any() else 0
        for i in order:
            if left < smallest:
                break
            il, e = cand[i]
            b = int(ebytes[il, e])
            if b <= left:
                resident[il, e] = True
                left -= b
    resident_bytes = int(ebytes[resident].sum())
    routed = int(ebytes.sum())
    pairs = float((f * (ebytes > 0)).sum())
    hit = float(f[resident].sum()) / pairs if pairs > 0 else 0.0
    ram_per_token = float((f * ebytes * ~resident).sum())
    # the GPU side of a decode token: every non-routed weight once (the embedding: one row), resident
    # experts by frequency, and the KV cache up to decode_pos
    kv_per_token = hp.kv_bytes_per_token_of(params.kv_type)
    emb = mf.tensors["token_embd.weight"]
    weights_read = sum(v for k, v in fixed.items() if k not in ("KV cache", "step buffers", "staging slots",
                                                                 "context + graphs reserve", "embeddings",
                                                                 "hybrid buffers"))
    if "output.weight" not in mf.tensors:  # tied: the head reads the embedding table
        weights_read += emb.n_bytes
    weights_read += emb.n_bytes // max(int(emb.shape[1]), 1)
    gpu_read = float(weights_read + (f * ebytes * resident).sum() + kv_per_token * params.decode_pos)
    t_cpu = ram_per_token / (params.cpu_read_gbs * 1e9)
    t_gpu = gpu_read / (params.gpu_read_gbs * 1e9)
    all_read = float(weights_read + (f * ebytes).sum() + kv_per_token * params.decode_pos)
    return GpuPlan(
        params=params, fixed=fixed, fixed_bytes=fixed_total, fits=fits,
        resident=[np.flatnonzero(resident[il]).tolist() for il in range(hp.n_layer)],
        resident_bytes=resident_bytes, gpu_bytes=fixed_total + resident_bytes, routed_bytes=routed,
        n_resident=int(resident.sum()), n_routed=int((ebytes > 0).sum()), hit_rate=hit,
        ram_bytes_per_token=ram_per_token, gpu_read_bytes_per_token=gpu_read, t_cpu_s=t_cpu, t_gpu_s=t_gpu,
        predicted_tok_s=1.0 / (t_cpu + t_gpu) if t_cpu + t_gpu > 0 else float("inf"),
        cpu_only_tok_s=params.cpu_read_gbs * 1e9 / all_read if all_read > 0 else float("inf"),
    )


def _fmt(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _ranges(ids: list[int]) -> str:
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def render_plan(p: GpuPlan, n_expert: int, source: str = "uniform routing", max_layer_lines: int = 12) -> str:
    """The plan as `strata model inspect` prints it."""
    pr = p.params
    lines = [f"hybrid plan     GPU budget {_fmt(pr.budget_bytes)}; KV for {pr.n_seqs} x {pr.n_ctx} tokens; "
             f"frequencies: {source}"]
    for k, v in sorted(p.fixed.items(), key=lambda kv: -kv[1]):
        lines.append(f"  on GPU        {k:<26}{_fmt(v):>12}")
    lines.append(f"  on GPU        {'fixed parts in all':<26}{_fmt(p.fixed_bytes):>12}")
    if not p.fits:
        lines.append(f"  does NOT fit  the fixed parts need {_fmt(p.fixed_bytes)}, over the budget by "
                     f"{_fmt(p.fixed_bytes - pr.budget_bytes)}: lower n_ctx / seqs or raise the budget")
        return "\n".join(lines)
    lines.append(f"  on GPU        {'resident routed experts':<26}{_fmt(p.resident_bytes):>12}  "
                 f"({p.n_resident} of {p.n_routed}, {100 * p.resident_bytes / max(p.routed_bytes, 1):.1f}% of "
                 f"{_fmt(p.routed_bytes)})")
    lines.append(f"  GPU total     {_fmt(p.gpu_bytes)} of {_fmt(pr.budget_bytes)} "
                 f"({_fmt(pr.budget_bytes - p.gpu_bytes)} unused)")
    lines.append(f"  in RAM        {p.n_routed - p.n_resident} routed experts, "
                 f"{_fmt(p.routed_bytes - p.resident_bytes)} (computed on the CPU from the mmap)")
    # layers with the same resident set, in order of their first layer (a uniform plan: every expert, none, and
    # the one layer at the budget's edge)
    groups: dict[tuple[int, ...], list[int]] = {}
    for il, ids in enumerate(p.resident):
        groups.setdefault(tuple(ids), []).append(il)
    for ids, layers in list(groups.items())[:max_layer_lines]:
        name = f"layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}"
        lines.append(f"  {name:<13} {len(ids):>4}/{n_expert} resident" + (f": {_ranges(list(ids))}" if ids else ""))
    if len(groups) > max_layer_lines:
        lines.append(f"  ...           {len(groups) - max_layer_lines} more sets of layers")
    lines += [
        f"  hit rate      {100 * p.hit_rate:.1f}% of routed pairs expected on resident experts",
        f"  per token     {_fmt(p.ram_bytes_per_token)} of expert weights read from RAM, "
        f"{_fmt(p.gpu_read_bytes_per_token)} read on the GPU (KV at position {pr.decode_pos})",
        f"  bandwidths    CPU RAM read {pr.cpu_read_gbs:.1f} GB/s, GPU {pr.gpu_read_gbs:.0f} GB/s",
        f"  decode        predicted {p.predicted_tok_s:.1f} tok/s at batch 1 (CPU {1e3 * p.t_cpu_s:.2f} ms + "
        f"GPU {1e3 * p.t_gpu_s:.2f} ms per token, not overlapped); all on the CPU: {p.cpu_only_tok_s:.1f} tok/s",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- what Engine.open places

def engine_step_tokens(step_tokens: int) -> int:
    """Tokens the GPU engine's step buffers grow to for steps of up to ``step_tokens`` tokens (the largest step;
    Engine.open passes the larger of its prefill_chunk and step_tokens, a lane's max_batch_tokens): they grow to
    at least twice their last size, up to 512 tokens (engine/csrc/cuda/model.cu, ensure_scratch)."""
    return max(step_tokens, 512)


def engine_plan_params(budget_bytes: int, kv_tokens: int, block_size: int, step_tokens: int,
                       reserve_bytes: int = 640 * MIB, staging_slots: int = 0, kv_type: str = "f16") -> PlanParams:
    """The plan request of ``Engine.open(device="cuda:N", gpu_budget_gb=...)``: the KV cache of the engine
    (kv_tokens rounded up to whole blocks, as one sequence's worth), step buffers for the largest step of
    ``step_tokens`` tokens (:func:`engine_step_tokens`), the reserve. The bandwidths feed only the plan's
    prediction, which opening a model does not use: they are set to 1 GB/s. ``staging_slots``: experts' worth
    of VRAM for the staging ring (the GPU engine's hybrid_stage: two whole layers, 2 x n_expert). ``kv_type``:
    the cache's values."""
    n_ctx = -(-kv_tokens // block_size) * block_size
    return PlanParams(budget_bytes=budget_bytes, n_ctx=n_ctx, n_seqs=1, step_tokens=engine_step_tokens(step_tokens),
                      reserve_bytes=reserve_bytes, staging_slots=staging_slots, cpu_read_gbs=1.0, gpu_read_gbs=1.0,
                      kv_type=kv_type)


def default_placement_path(model_path: str | os.PathLike[str]) -> Path:
    """Where a model's default placement file lives: beside the GGUF, ``<file>.placement.json``
    (``strata plan calibrate M.gguf`` writes it there without ``-o``)."""
    p = Path(model_path)
    return p.with_name(p.name + ".placement.json")


def placement_frequencies(mf: ModelFile, placement: str | os.PathLike[str] | PlacementFile | None = None
                          ) -> tuple[np.ndarray | None, str]:
    """The routing frequencies a hybrid lane places by, and where they came from: the given placement file
    (checked against the model), else the model's default placement file when it exists, else None
    (uniform routing)."""
    if placement is None:
        default = default_placement_path(mf.path)
        if not default.is_file():
            return None, "uniform routing (no placement file)"
        placement = default
    if isinstance(placement, PlacementFile):
        placement.check_model(mf)
        pf, where = placement, "the given placement"
    else:
        pf, where = PlacementFile.load(placement, model=mf), str(placement)
    return pf.stats.frequencies(), f"{where} ({pf.stats.total_tokens:.0f} tokens)"


def resident_mask(mf: ModelFile, p: GpuPlan) -> np.ndarray:
    """[n_layer, n_expert] uint8: 1 where the plan keeps the routed expert on the GPU. A leading dense layer
    (glm4moe, deepseek2) has no routed experts, so nothing of it runs on the CPU: its row is all 1."""
    hp = mf.hparams
    mask = np.zeros((hp.n_layer, max(hp.n_expert, 1)), dtype=np.uint8)
    mask[:hp.n_dense_lead] = 1
    for il, ids in enumerate(p.resident):
        mask[il, ids] = 1
    return mask


def replacement_moves(freqs: np.ndarray, resident: np.ndarray, ebytes: np.ndarray, max_bytes: int,
                      margin: float = 1.25, min_tokens: np.ndarray | None = None, min_layer_tokens: float = 0.0
                      ) -> list[tuple[int, int, int]]:
    """Online re-placement's moves for one step: (layer, out, in) swaps within a layer, each bringing a
    non-resident expert onto the GPU in place of a resident one of the same layer (so the bytes held never
    change), taken in descending gain per byte ((freq_in - freq_out) / bytes) while their bytes fit
    ``max_bytes``. A swap qualifies only where freq_in > margin x freq_out (hysteresis: no expert moves back
    and forth on noise), and only in layers whose statistics hold at least ``min_layer_tokens`` tokens
    (``min_tokens`` [n_layer], RoutingStats.tokens). Per layer the most frequent non-resident experts pair with
    the least frequent resident ones in order. freqs, resident, ebytes: [n_layer, n_expert]."""
    f = np.asarray(freqs, dtype=np.float64)
    res = np.asarray(resident).astype(bool)
    cand: list[tuple[float, int, int, int, int]] = []
    for il in range(f.shape[0]):
        if min_tokens is not None and float(min_tokens[il]) < min_layer_tokens:
            continue
        ins = [int(e) for e in np.flatnonzero(~res[il])]
        outs = [int(e) for e in np.flatnonzero(res[il])]
        if not ins or not outs:
            continue
        ins.sort(key=lambda e: (-f[il, e], e))
        outs.sort(key=lambda e: (f[il, e], e))
        for e_in, e_out in zip(ins, outs, strict=False):
            if not f[il, e_in] > margin * f[il, e_out]:
                break
            b = int(ebytes[il, e_in])
            cand.append(((f[il, e_in] - f[il, e_out]) / max(b, 1), il, e_out, e_in, b))
    cand.sort(key=lambda c: (-c[0], c[1], c[3]))
    moves: list[tuple[int, int, int]] = []
    used = 0
    for _, il, e_out, e_in, b in cand:
        if used + b > max_bytes:
            continue
        moves.append((il, e_out, e_in))
        used += b
    return moves
