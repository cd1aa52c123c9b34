"""The Python face of the engine: open a GGUF model, run batched forward steps, generate.

Python schedules *steps*; one step (any mix of prefill chunks and decode tokens of
many sequences) is a single C call that releases the GIL.

There is one generation path: ``generate``, ``chat`` and ``stream`` (the CLI) run through
:class:`engine.scheduler.Scheduler`, the same code a lane serves with. ``forward`` and
``prefill`` are raw steps over block ids the caller holds (oracles, benchmarks, ``logits_for``).
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.block_manager import BlockManager, KVCapacityError
from engine.cuda_backend import DeviceSpec, parse_device, resolve_device
from engine.gguf_model import ModelFile, UnsupportedModelError, create_native_model, open_model
from engine.kv_tiers import KVTiers
from engine.native import EngineError, UnsupportedError, check, ffi, lib, ptr
from engine.rope import RopeOverrides, RopeParams, resolve
from engine.step import StepStats

if TYPE_CHECKING:
    from engine.placement import GpuPlan, PlacementFile
    from engine.sampling import SamplingParams
    from engine.scheduler import RequestOutput

# the KV cache's element types (st_kv_create_tiered): F16, or Q8_0-style 8-bit values with an F16 scale per 32
KV_TYPES = {"f16": 0, "q8_0": 1}

__all__ = ["Engine", "GenerationResult", "StepStats", "KVCapacityError", "EngineError", "GpuBudgetError"]


# Architectures the CUDA backend implements (engine/csrc/cuda/model.cu); "auto" runs the others on the CPU.
GPU_ARCHES = frozenset({"llama", "qwen3moe", "qwen2moe", "gpt-oss", "glm4moe", "deepseek2"})
# Architectures the GPU runs only with every routed expert on the device (no hybrid placement yet).
GPU_WHOLE_ONLY = frozenset({"gpt-oss", "deepseek2"})


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int


def _default_threads(cores: Sequence[int] | None) -> int:
    if cores:
        return len(cores)
    return len(os.sched_getaffinity(0))


def hybrid_pool_threads(threads: int, environ: dict[str, str] | None = None) -> int:
    """The pool of a hybrid GPU lane: with the overlapped step (``hybrid_overlap``, the default) one thread less
    than the lane's cores, leaving a core to the thread that queues the step while the pool computes the CPU's
    experts (its 2-3 ms of launches a decode step, on a core of a pinned worker, stall the pool's regions for a
    scheduler slice); the experts' reads are memory-bound, so the thread given up costs little."""
    from engine import gpu_settings

    if threads > 2 and gpu_settings.env_override("hybrid_overlap", environ) != 0:
        return threads - 1
    return threads


def kv_host_attn_on(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment turns on ``kv_host_attn`` (the CPU pool attending a tiered GPU cache's host tier):
    the pool of such a lane then gets the lane's cores instead of one thread."""
    from engine import gpu_settings

    return bool(gpu_settings.env_override("kv_host_attn", environ))


def _check_cores(cores: Sequence[int]) -> None:
    """A core list the pool can pin to: distinct ids of CPUs this machine has."""
    ids = list(cores)
    n_cpu = os.cpu_count() or 1
    if not ids:
        raise ValueError("cores: an empty list (None: no pinning)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"cores: duplicate CPU ids in {ids}")
    bad = [c for c in ids if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < n_cpu]
    if bad:
        raise ValueError(f"cores: {bad} outside this machine's CPUs 0-{n_cpu - 1}")


def _gpu_plan(mf: ModelFile, gpu_budget_gb: float | None, kv_tokens: int, block_size: int, step_tokens: int,
              placement: str | os.PathLike[str] | PlacementFile | None,
              kv_type: str = "f16") -> tuple[GpuPlan, str] | None:
    """The hybrid plan of a GPU lane with a budget (see Engine.open) and where its frequencies came from; None
    without a budget. GpuBudgetError when not even the parts every step needs fit. ``step_tokens``: the largest
    step, whose buffers the plan counts."""
    if gpu_budget_gb is None:
        return None
    from engine import gpu_settings
    from engine.placement import engine_plan_params, placement_frequencies, plan

    budget = int(gpu_budget_gb * 2**30)
    freqs, source = placement_frequencies(mf, placement) if mf.hparams.n_expert else (None, "")
    slots = gpu_settings.staging_slots(mf.hparams.n_expert)
    p = plan(mf, engine_plan_params(budget, kv_tokens, block_size, step_tokens, staging_slots=slots,
                                    kv_type=kv_type), freqs)
    if slots:  # the staging ring only where it fits and something is left to stage
        bare = plan(mf, engine_plan_params(budget, kv_tokens, block_size, step_tokens, kv_type=kv_type), freqs)
        if not p.fits or (bare.fits and bare.n_resident == bare.n_routed):
            p = bare
    if not p.fits:
        what = ("its non-routed weights, " if mf.hparams.n_expert else "its weights, ") + \
            f"the KV cache for {kv_tokens} tokens, step buffers and the CUDA context reserve"
        raise GpuBudgetError(
            f"gpu_budget_gb={gpu_budget_gb:g}: the GPU side of the model needs {p.fixed_bytes / 2**30:.2f} GiB "
            f"({what}); raise the budget, lower kv_tokens, or serve it on device='cpu'", lib.ST_EUNSUPPORTED)
    return p, source


def kv_hot_budget_tokens(mf: ModelFile, budget_gb: float, block_size: int, kv_type: str = "f16") -> int:
    """The KV tiers' hot part for a VRAM budget (GiB, 2**30 bytes): the whole blocks of ``kv_type``'s bytes per
    token that fit, at least one block."""
    per_block = mf.hparams.kv_bytes_per_token_of(kv_type) * block_size
    return max(1, int(budget_gb * 2**30) // per_block) * block_size


class _StepIO:
    """A step's host-side arguments, kept across steps (Engine.forward fills them under the step
    lock): one st_batch and st_step_stats, one int32 buffer for the tokens, positions, sequence
    indices and logit rows, and the block table [n_seqs, max_blocks] padded with -1. Rows are
    copied in every step (memmove for the scheduler's array('i') tables), but the table is only
    re-allocated and re-padded when its width or row count changes, and a row shorter than what
    its slot held before re-pads only its own tail."""

    def __init__(self) -> None:
        self.batch = ffi.new("st_batch *")
        self.stats = ffi.new("st_step_stats *")
        self._ints = np.empty(0, np.int32)
        self._ip: Any = None
        self._ip_keep: Any = None
        self._bt = np.empty(0, np.int32)
        self._bp: Any = None
        self._bp_keep: Any = None
        self._w = 0  # the table's row width (max_blocks) and row slots
        self._rows = 0
        self._lens: list[int] = []  # per row slot: entries written before the -1 padding

    def fill(self, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int],
             tables: Sequence[Sequence[int]], logit_idx: Sequence[int],
             token_src: Sequence[int] | None = None) -> Any:
        n, nl = len(tokens), len(logit_idx)
        need = 3 * n + nl + (n if token_src is not None else 0)
        if need > self._ints.size:
            self._ints = np.empty(max(need, 2 * self._ints.size, 64), np.int32)
            self._ip_keep = ffi.from_buffer(self._ints)
            self._ip = ffi.cast("int32_t *", self._ip_keep)
        ints, ip = self._ints, self._ip
        ints[:n] = tokens
        ints[n : 2 * n] = pos
        ints[2 * n : 3 * n] = seq
        ints[3 * n : 3 * n + nl] = logit_idx
        if token_src is not None:
            ints[3 * n + nl : need] = token_src
        ns = len(tables)
        w = max(1, max(map(len, tables), default=1))
        if w != self._w or ns > self._rows:
            self._rows = max(ns, self._rows, 1)
            self._w = w
            self._bt = np.full(self._rows * w, -1, dtype=np.int32)
            self._bp_keep = ffi.from_buffer(self._bt)
            self._bp = ffi.cast("int32_t *", self._bp_keep)
            self._lens = [0] * self._rows
        bt, bp, lens = self._bt, self._bp, self._lens
        for i, row in enumerate(tables):
            k = len(row)
            o = i * w
            if type(row) is array and row.typecode == "i" and row.itemsize == 4:
                ffi.memmove(bp + o, row, 4 * k)  # the scheduler's tables: a memcpy, not a list walk
            else:
                bt[o : o + k] = row
            if k < lens[i]:
                bt[o + k : o + lens[i]] = -1
            lens[i] = k
        b = self.batch
        b.n_tokens = n
        b.tokens, b.pos, b.seq = ip, ip + n, ip + 2 * n
        b.n_seqs, b.max_blocks = ns, w
        b.block_tables = bp
        b.n_logits = nl
        b.logit_idx = ip + 3 * n if nl else ffi.NULL
        b.token_src = ip + 3 * n + nl if token_src is not None else ffi.NULL
        return b


class GpuBudgetError(UnsupportedError):
    """device="cuda" with a gpu_budget_gb below what the model's GPU side needs before any routed expert is
    placed there (weights other than the routed experts, the KV cache, step buffers, the context reserve)."""


class HybridArchError(UnsupportedError):
    """device="cuda" with a gpu_budget_gb that leaves routed experts on the CPU, for an architecture whose GPU
    engine has no hybrid placement yet (GPU_WHOLE_ONLY: gpt-oss, deepseek2)."""


class StaleSourceError(EngineError):
    """Engine.launch(token_src=..., after=t): another step ran on the engine after step t, so its picks
    are no longer the ones the device holds; nothing was run."""


def _stats(st: Any, profile: dict[str, float] | None = None) -> StepStats:
    out = StepStats(int(st.n_tokens), st.t_total, st.t_attn, st.t_experts, st.t_dense, st.t_output,
                    int(st.n_expert_tokens), int(st.n_active_experts), float(st.pool_idle_share))
    if profile is not None:  # a GPU step's frame profile (CudaModel.profile)
        pairs = profile["pairs_gpu"] + profile["pairs_cpu"]
        out.t_gpu, out.t_cpu_experts, out.t_gpu_wait = profile["t_gpu"], profile["t_cpu_experts"], profile["t_gpu_wait"]
        out.t_pcie, out.t_cpu_wait = profile["t_pcie"], profile["t_cpu_wait"]
        out.pcie_bytes, out.on_gpu = int(profile["pcie_bytes"]), True
        out.staged_layers = int(profile.get("staged_layers", 0))
        out.stage_pcie_gbs = float(profile.get("stage_pcie_gbs", 0.0))
        out.stage_gpu_gbs = float(profile.get("stage_gpu_gbs", 0.0))
        out.stage_cpu_pairs_s = float(profile.get("stage_cpu_pairs_s", 0.0))
        out.resident_hit_rate = profile["pairs_gpu"] / pairs if pairs else 1.0
        out.staged_bytes = int(profile["staged_bytes"])
        out.kv_host_bytes = int(profile.get("kv_host_bytes", 0))
        out.kv_cpu_bytes = int(profile.get("kv_cpu_bytes", 0))
        out.t_cpu_attn = float(profile.get("t_cpu_attn", 0.0))
        out.kv_cpu_share = float(profile.get("kv_cpu_share", 0.0))
        out.kv_cpu_gbs = float(profile.get("kv_cpu_gbs", 0.0))
        out.kv_pcie_gbs = float(profile.get("kv_pcie_gbs", 0.0))
        out.frame_measured = bool(profile.get("measured", 1))
        out.kv_form = int(profile.get("kv_form", -1))
    return out


class Engine:
    """A loaded model, its KV cache and thread pool."""

    def __init__(self, mf: ModelFile, threads: int, cores: Sequence[int] | None, kv_tokens: int,
                 block_size: int, prefill_chunk: int, max_model_len: int | None = None,
                 device: DeviceSpec | None = None, gpu_budget_gb: float | None = None,
                 resident: np.ndarray | None = None, plan: GpuPlan | None = None, plan_source: str = "",
                 rope: RopeParams | None = None, kv_hot_tokens: int | None = None, kv_type: str = "f16",
                 step_tokens: int | None = None) -> None:
        self.model_file = mf
        self.gpu_budget_gb = gpu_budget_gb  # the GPU memory a lane may hold, GiB (2**30 bytes)
        self.plan = plan  # a GPU lane with a budget: what sits where (engine.placement.plan)
        self.plan_source = plan_source  # where the plan's routing frequencies came from
        self.hparams = mf.hparams
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        # the largest step a caller sends: the GPU plan's step buffers (Engine.open) and warm_up's size
        self.step_tokens = max(prefill_chunk, step_tokens or 0)
        self.threads = threads
        self.cores = list(cores) if cores else None
        # a file the C checks refuse raises GGUFError carrying the C message
        self.rope = rope or mf.hparams.rope  # the rope scaling run: the file's and the lane's overrides
        self.device = device or DeviceSpec("cpu")
        self._model, self._desc, self._keep = create_native_model(mf, self.rope)
        n_blocks = max(1, -(-kv_tokens // block_size))
        on_gpu = self.device.kind == "cuda"
        # hybrid: the routed experts the GPU does not hold run on this C model and pool (st_moe_pairs); on the
        # GPU otherwise the C model only validated the file, and its pool is one thread
        self.resident = resident if on_gpu and resident is not None and not resident.all() else None
        cpu_threads = threads if not on_gpu or self.resident is not None else 1
        if self.resident is not None:
            cpu_threads = hybrid_pool_threads(threads)
        # a tiered cache: the first n_hot blocks in the hot pool (the GPU's VRAM; a separate allocation on the
        # CPU), the rest in the cold one (pinned host memory on the GPU)
        n_hot = n_blocks if kv_hot_tokens is None else max(1, -(-kv_hot_tokens // block_size))
        n_hot = min(n_hot, n_blocks)
        # a tiered cache on the GPU under kv_host_attn: the pool attends the host tier (a core left to the thread
        # that queues the step, as for hybrid placement)
        if on_gpu and self.resident is None and n_hot < n_blocks and kv_host_attn_on():
            cpu_threads = threads - 1 if threads > 2 else threads
        pk = ffi.new("st_kv **")
        if kv_type not in KV_TYPES:
            lib.st_model_destroy(self._model)
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        self.kv_type = kv_type
        # on the GPU this one-block F16 cache only completes the C model; the device holds the real one (kv_type)
        rc = lib.st_kv_create_tiered(self._model, 1 if on_gpu else n_hot, 0 if on_gpu else n_blocks - n_hot,
                                     block_size, KV_TYPES["f16" if on_gpu else kv_type], pk)
        if rc:
            lib.st_model_destroy(self._model)
            check(rc, "KV cache")
        self._kv = pk[0]
        pp = ffi.new("st_pool **")
        core_arr = ffi.new("int32_t[]", self.cores) if self.cores else ffi.NULL
        rc = lib.st_pool_create(cpu_threads, core_arr, len(self.cores) if self.cores else 0, pp)
        if rc:
            lib.st_kv_destroy(self._kv)
            lib.st_model_destroy(self._model)
            check(rc, "thread pool")
        self._pool = pp[0]
        self._gpu: Any = None
        if on_gpu:  # weights (the resident experts of a hybrid plan) and KV in VRAM
            from engine.cuda_backend import CudaModel

            try:
                # a plan without the staging ring (a budget too small for it) turns staging off
                no_ring = self.plan is not None and not self.plan.params.staging_slots
                self._gpu = CudaModel(self._desc, self.device.index, n_blocks, block_size, resident=self.resident,
                                      cpu=(self._model, self._pool) if self.resident is not None else None,
                                      kv_type=kv_type, n_host_blocks=n_blocks - n_hot,
                                      settings_over={"hybrid_stage": 0} if no_ring else None,
                                      cpu_attn=self._pool if n_hot < n_blocks else None)
            except BaseException:
                lib.st_pool_destroy(self._pool)
                lib.st_kv_destroy(self._kv)
                lib.st_model_destroy(self._model)
                self._pool = self._kv = self._model = None
                raise
        self.blocks = BlockManager(n_blocks, block_size)
        self.kv_tokens = n_blocks * block_size
        self.kv_tiers: KVTiers | None = None  # None: one tier (every block hot)
        if n_hot < n_blocks:
            bm = self.blocks
            self.kv_tiers = KVTiers(n_hot, n_blocks - n_hot, self._gpu.kv_swap if self._gpu is not None else self._kv_swap,
                                    lambda b: bm.ref[b] > 0 or bm.block_digest[b] is not None)
        self._kv_moved = 0  # bytes moved between tiers since the last step's stats
        self._tokenizer: Any = None
        self._template: Any = None
        self.last_stats: StepStats | None = None
        self._max_model_len = max_model_len
        self._step_lock = threading.Lock()
        self._io = _StepIO()
        # launched steps (Engine.launch / Engine.wait), in launch order: ticket -> (picks, the C ticket, stats on
        # the CPU); steps waited on a caller's behalf (another step needed the engine) wait in _done
        self._inflight: dict[int, tuple[np.ndarray, int, StepStats | None, Any]] = {}
        self._done: dict[int, tuple[np.ndarray, StepStats | None] | EngineError] = {}
        self._last_step = 0  # the id of the last step run (forward or launch): token_src's source
        if self._gpu is not None and self.resident is not None and self._gpu.stage_info()["available"]:
            try:
                # at most 512 tokens: the whole-layer decision's rate at the step size its threshold is measured for
                # (a GPU lane's 2,048-token chunk puts ~4x the pairs on each expert and reads the CPU as faster)
                self._gpu.set_stage_rate(self._cpu_pairs_rate(max(64, min(prefill_chunk, 512))))
            except BaseException:
                self.close()
                raise

    # online re-placement: the statistics' half-life (tokens) and the tokens a layer must have seen before its
    # experts move
    REPLACE_HALF_LIFE_TOKENS = 4096.0
    REPLACE_MIN_LAYER_TOKENS = 64.0

    def replace_experts(self, hist: np.ndarray, max_bytes: int) -> int:
        """Online re-placement between steps (issue 29): ``hist`` (a step's [n_layer, n_expert] routing counts)
        joins the engine's decaying routing statistics (half-life ``REPLACE_HALF_LIFE_TOKENS``, seeded from
        nothing: a layer moves nothing before ``REPLACE_MIN_LAYER_TOKENS`` tokens), then up to ``max_bytes`` of
        experts move onto the GPU, each in place of a less used resident expert of its layer
        (``placement.replacement_moves``; the GPU's bytes do not change). Steps in flight are waited first.
        Returns the experts moved; 0 on an engine without a CPU share."""
        if self._gpu is None or self.resident is None or max_bytes <= 0:
            return 0
        from engine.placement import RoutingStats, expert_bytes, replacement_moves

        if getattr(self, "_routing", None) is None:
            self._routing = RoutingStats.for_model(self.model_file, half_life_tokens=self.REPLACE_HALF_LIFE_TOKENS)
            self._expert_bytes = expert_bytes(self.model_file)
        self._routing.update(hist)
        moves = replacement_moves(self._routing.frequencies(), self.resident, self._expert_bytes, max_bytes,
                                  min_tokens=self._routing.tokens, min_layer_tokens=self.REPLACE_MIN_LAYER_TOKENS)
        if not moves:
            return 0
        with self._step_lock:
            self._drain(0)
            resident = self.resident.copy()
            try:
                for il, e_out, e_in in moves:
                    resident[il, e_out] = 0  # the C side takes out_e off first: a failed copy leaves both out
                    self._gpu.swap_expert(il, e_out, e_in)
                    resident[il, e_in] = 1
            finally:
                self.resident = resident
        return len(moves)

    def _cpu_pairs_rate(self, tokens: int) -> float:
        """Staging's CPU rate, measured at start-up: routed (token, expert) pairs per second of ``st_moe_pairs``
        over a chunk of ``tokens`` tokens in the first partial layer, each token on k distinct non-resident
        experts drawn uniformly (the second of two calls: the first pages the experts in)."""
        assert self.resident is not None
        hp = self.hparams
        k = hp.n_expert_used
        layer = next(i for i in range(hp.n_layer) if self.resident[i].sum() < hp.n_expert)
        off = np.flatnonzero(self.resident[layer] == 0)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((tokens, hp.n_embd)).astype(np.float32)
        per = min(k, off.size)
        exp = np.stack([rng.choice(off, size=per, replace=False) for _ in range(tokens)]).reshape(-1)
        tok = np.repeat(np.arange(tokens, dtype=np.int32), per)
        self.moe_pairs(layer, x, tok, exp)
        t = time.perf_counter()
        self.moe_pairs(layer, x, tok, exp)
        return tok.size / max(time.perf_counter() - t, 1e-9)

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None, *, threads: int | None = None,
             cores: Sequence[int] | None = None, kv_tokens: int = 4096, block_size: int = 16,
             prefill_chunk: int = 512, max_model_len: int | None = None, device: str = "cpu",
             gpu_budget_gb: float | None = None,
             placement: str | os.PathLike[str] | PlacementFile | None = None,
             rope: RopeOverrides | None = None, kv_hot_tokens: int | None = None, kv_type: str = "f16",
             gpu_kv_budget_gb: float | None = None, step_tokens: int | None = None) -> Engine:
        """Open a GGUF model (the embedded default model when path is None).

        device: "cpu", "cuda:N" (weights and KV cache in that GPU's memory) or "auto" (cuda:0
        when a GPU is usable); a GPU that cannot be used raises DeviceUnavailableError.

        cores: the CPUs the engine's thread pool is pinned to (one thread each unless ``threads``).
        gpu_budget_gb: the GPU memory (GiB, 2**30 bytes: `strata model inspect --vram`'s unit) the lane may
        hold, stored as ``gpu_budget_gb``. On a GPU it is planned (``engine.placement.plan``, kept as ``plan``):
        the non-routed weights, this KV cache, the step buffers and the context reserve first, then routed
        experts by routing frequency while they fit. Experts left out are computed on the CPU (this pool,
        ``cores``) from the mapped file: hybrid placement, ``resident`` the [n_layer, n_expert] mask. A budget
        the first parts do not fit raises GpuBudgetError before any device is touched; for an architecture in
        GPU_WHOLE_ONLY (gpt-oss, deepseek2) a budget that leaves any expert out raises HybridArchError. The CPU ignores it.
        placement: the routing frequencies to place by (a placement file or its path: ``strata plan
        calibrate``); default: the model's default placement file beside it when it exists
        (``engine.placement.default_placement_path``), else uniform routing.

        max_model_len overrides the context window (default: the trained context, or the
        scaled one under rope scaling, bounded by the KV capacity); beyond it quality is not promised.

        kv_hot_tokens: the hot tier's size in tokens (rounded up to blocks); the rest of the ``kv_tokens``
        cache is the cold tier, a separate allocation (on a GPU: pinned host RAM that the kernels read over PCIe,
        docs/engine.md "KV tiers"). None: one tier. Blocks move between tiers only when the scheduler asks
        (``place_kv``); outputs are bit-identical to the untiered cache's. Admission counts both tiers (the
        block manager holds every block of ``kv_tokens``); a GPU budget plans the hot tier's bytes only.
        gpu_kv_budget_gb: the GPU's KV tiers by bytes instead: the hot tier holds what fits in this many GiB of
        VRAM at ``kv_type``'s bytes per token (whole blocks, at least one); not with ``kv_hot_tokens``.

        step_tokens: the most tokens a caller's step holds (a lane's scheduler.max_batch_tokens); a GPU budget
        plans step buffers for max(prefill_chunk, step_tokens) tokens (None: prefill_chunk, Engine.prefill's pieces).

        kv_type: "f16" (the default) or "q8_0": the 8-bit cache, Q8_0's rule per group of 32 values of a
        token's K or V (1.0625 bytes a value instead of 2; accuracy in docs/benchmarks.md). Untiered; on the CPU
        read by generic C kernels (slower attention than the F16 cache's SIMD ones); on the GPU the same bytes,
        read by the split decode and tensor-core prefill kernels (head_dim 64 or 128, at most 8 query heads per
        kv head dividing 16; other models raise EngineError).

        rope: overrides of the file's rope scaling (llama.cpp's --rope-scaling / --rope-scale /
        --yarn-* options, engine.rope); both engines, CPU and GPU, run it.
        """
        if path is None:
            from engine.default_model import build_default_model, default_model_path

            path = build_default_model(default_model_path())
        if kv_tokens < 1 or block_size < 1 or prefill_chunk < 1:
            raise ValueError("kv_tokens, block_size and prefill_chunk must be positive")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be positive, got {step_tokens}")
        plan_tokens = max(prefill_chunk, step_tokens or 0)  # the largest step the GPU's step buffers hold
        n_threads = threads if threads is not None else _default_threads(cores)
        if n_threads < 1:
            raise ValueError(f"threads must be >= 1, got {n_threads}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if gpu_budget_gb is not None and not (gpu_budget_gb > 0 and gpu_budget_gb < float("inf")):
            raise ValueError(f"gpu_budget_gb must be a positive number of GiB, got {gpu_budget_gb}")
        if gpu_kv_budget_gb is not None and not (gpu_kv_budget_gb > 0 and gpu_kv_budget_gb < float("inf")):
            raise ValueError(f"gpu_kv_budget_gb must be a positive number of GiB, got {gpu_kv_budget_gb}")
        if gpu_kv_budget_gb is not None and kv_hot_tokens is not None:
            raise ValueError("give the KV tiers' hot part as kv_hot_tokens or gpu_kv_budget_gb, not both")
        if cores is not None:
            _check_cores(cores)
        asked = parse_device(device)  # a bad device string fails before the file is read
        mf = open_model(path)
        rp = resolve(mf.hparams.rope_scaling, mf.hparams.n_ctx_train, rope)
        if mf.hparams.arch not in GPU_ARCHES:  # the CPU engine runs it; the CUDA backend does not yet
            if asked.kind == "cuda":
                raise UnsupportedModelError(mf.path, f"architecture {mf.hparams.arch!r} runs on the CPU only "
                                                     f"(device 'cpu' or 'auto'), not on {device!r}")
            device = "cpu"
        # the budget first: a request the GPU engine cannot serve is refused before any device is touched
        planned = None
        if gpu_kv_budget_gb is not None:
            kv_hot_tokens = kv_hot_budget_tokens(mf, gpu_kv_budget_gb, block_size, kv_type)
        # the GPU's plan holds the hot tier only: the cold one is host RAM
        vram_kv = kv_tokens if kv_hot_tokens is None else min(kv_tokens, kv_hot_tokens)
        if asked.kind == "cuda":
            planned = _gpu_plan(mf, gpu_budget_gb, vram_kv, block_size, plan_tokens, placement, kv_type)
        spec = resolve_device(device)
        if spec.kind == "cuda" and asked.kind != "cuda":  # "auto" that found a GPU
            planned = _gpu_plan(mf, gpu_budget_gb, vram_kv, block_size, plan_tokens, placement, kv_type)
        resident = None
        if planned is not None and mf.hparams.n_expert:
            from engine.placement import resident_mask

            resident = resident_mask(mf, planned[0])
            if mf.hparams.arch in GPU_WHOLE_ONLY and not resident.all():
                raise HybridArchError(
                    f"gpu_budget_gb={gpu_budget_gb:g}: {int((resident == 0).sum())} routed experts of this "
                    f"{mf.hparams.arch} model would stay on the CPU, and the GPU engine runs {mf.hparams.arch} only "
                    "with every expert on the device; raise the budget, or serve it on device='cpu'",
                    lib.ST_EUNSUPPORTED)
        if kv_hot_tokens is not None and kv_hot_tokens < 1:
            raise ValueError(f"kv_hot_tokens must be >= 1, got {kv_hot_tokens}")
        return cls(mf, n_threads, cores, kv_tokens, block_size, prefill_chunk, max_model_len, spec, gpu_budget_gb,
                   resident, planned[0] if planned else None, planned[1] if planned else "", rp, kv_hot_tokens,
                   kv_type, plan_tokens)

    def close(self) -> None:
        if getattr(self, "_gpu", None) is not None:
            self._gpu.close()
            self._gpu = None
        if getattr(self, "_pool", None) is not None:
            lib.st_pool_destroy(self._pool)
            lib.st_kv_destroy(self._kv)
            lib.st_model_destroy(self._model)
            self._pool = self._kv = self._model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ text side
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from common.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_metadata(self.model_file.metadata)
        return self._tokenizer

    @property
    def chat_template(self) -> Any:
        if self._template is None:
            from common.chat_template import ChatTemplate

            self._template = ChatTemplate.from_metadata(self.model_file.metadata, self.tokenizer)
        return self._template

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    @property
    def n_ctx(self) -> int:
        """The context window, the one number a lane reports and the gateway enforces: the trained
        context (the scaled one under rope scaling: engine.rope.RopeParams.window) or the
        max_model_len override, bounded by the KV capacity."""
        return min(self._max_model_len or self.rope.window(self.hparams.n_ctx_train), self.kv_tokens)

    # ------------------------------------------------------------ the step
    def forward(self, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int],
                block_tables: Sequence[Sequence[int]], logit_idx: Sequence[int],
                expert_hist: np.ndarray | None = None, *, greedy: bool = False,
                token_src: Sequence[int] | None = None) -> np.ndarray:
        """One batched forward step; returns logits [len(logit_idx), n_vocab], or with
        ``greedy=True`` each of those rows' greedy pick as int32 [len(logit_idx)]: the first index
        of the row's maximum (numpy argmax's rule, a NaN counting as the maximum), taken in C or on
        the GPU (``st_batch.out_tokens``), so that no logits are copied back or scanned here.

        ``token_src`` (optional, one per token): -1 takes ``tokens[i]``, j >= 0 the previous step's
        greedy pick j (``st_batch.token_src``; that step must have been a greedy one with more than j
        rows); ``tokens[i]`` is then not read."""
        self._check_step(tokens, pos, seq, token_src)
        nl = len(logit_idx)
        if greedy:
            out = np.empty(nl, np.int32)
        else:
            shape = (nl, self.hparams.n_vocab)  # on a GPU in page-locked memory: the copy is a DMA
            out = self._gpu.host_array(shape, np.float32) if self._gpu is not None else np.empty(shape, np.float32)
        self._check_hist(expert_hist)
        with self._step_lock:  # one step at a time: the model's scratch, the pool and the step's host arrays are shared
            self._drain(0)  # launched steps first (another caller's: their results wait for their Engine.wait)
            self._last_step += 1
            io = self._io
            b = io.fill(tokens, pos, seq, block_tables, logit_idx, token_src)
            if nl:
                p = ptr(out, "int32_t *" if greedy else "float *")
                b.logits, b.out_tokens = (ffi.NULL, p) if greedy else (p, ffi.NULL)
            else:
                b.logits = b.out_tokens = ffi.NULL
            b.expert_hist = ptr(expert_hist, "int32_t *") if expert_hist is not None else ffi.NULL
            st = io.stats
            if self._gpu is not None:
                self._gpu.forward(b, st)
                self.last_stats = self._take_moved(_stats(st, self._gpu_profile(st)))
            else:
                check(lib.st_forward(self._model, self._kv, self._pool, b, st), "forward")
                self.last_stats = self._take_moved(_stats(st))
        return out

    def _kv_swap(self, a: int, b: int, copy_a: bool, copy_b: bool) -> int:
        moved = ffi.new("uint64_t *")
        check(lib.st_kv_swap(self._kv, a, b, int(copy_a), int(copy_b), moved), "KV tier move")
        return int(moved[0])

    def place_kv(self, block_tables: Sequence[Sequence[int]]) -> int:
        """Between steps: move KV blocks between the tiers so the hot tier holds what a step over
        ``block_tables`` reads most (engine.kv_tiers); returns the bytes moved, which the next step's
        stats report (``StepStats.kv_moved_bytes``). A no-op on an untiered cache."""
        if self.kv_tiers is None:
            return 0
        with self._step_lock:  # never during a step: the C cache is read by st_forward
            moved = self.kv_tiers.place(block_tables)
            self._kv_moved += moved
        return moved

    def _take_moved(self, stats: StepStats) -> StepStats:
        stats.kv_moved_bytes, self._kv_moved = self._kv_moved, 0
        return stats

    # ------------------------------------------------------------ routed experts for a caller (hybrid)
    def _moe_input(self, layer: int, x: np.ndarray) -> np.ndarray:
        if self._model is None:
            raise EngineError("engine is closed")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.hparams.n_embd or x.shape[0] < 1:
            raise ValueError(f"x must be float32 [T >= 1, {self.hparams.n_embd}], got shape {x.shape}")
        return x

    def moe_layer(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The routed FFN of one layer as a step computes it (``st_moe_layer``) over x [T, n_embd] (the FFN
        input after RMSNorm): (out [T, n_embd], topk_id [T, k], topk_w [T, k])."""
        x = self._moe_input(layer, x)
        T, k = x.shape[0], self.hparams.n_expert_used
        out = np.empty_like(x)
        ids = np.empty((T, max(k, 1)), np.int32)
        w = np.empty((T, max(k, 1)), np.float32)
        with self._step_lock:
            self._drain(0)
            check(lib.st_moe_layer(self._model, self._pool, int(layer), T, ptr(x, "float *"), ptr(out, "float *"),
                                   ptr(ids, "int32_t *"), ptr(w, "float *")), "moe_layer")
        return out, ids, w

    def moe_pairs(self, layer: int, x: np.ndarray, pair_tok: Sequence[int] | np.ndarray,
                  pair_exp: Sequence[int] | np.ndarray) -> np.ndarray:
        """The routed experts of one layer for (token row, expert) pairs (``st_moe_pairs``): out [n_pairs,
        n_embd], row p = expert pair_exp[p]'s FFN of x[pair_tok[p]], unweighted."""
        x = self._moe_input(layer, x)
        tok = np.ascontiguousarray(pair_tok, dtype=np.int32).reshape(-1)
        exp = np.ascontiguousarray(pair_exp, dtype=np.int32).reshape(-1)
        if tok.shape != exp.shape:
            raise ValueError("pair_tok and pair_exp must have the same length")
        out = np.empty((tok.size, self.hparams.n_embd), np.float32)
        n = tok.size
        with self._step_lock:
            self._drain(0)
            check(lib.st_moe_pairs(self._model, self._pool, int(layer), x.shape[0], ptr(x, "float *"), n,
                                   ptr(tok, "int32_t *") if n else ffi.NULL, ptr(exp, "int32_t *") if n else ffi.NULL,
                                   ptr(out, "float *") if n else ffi.NULL), "moe_pairs")
        return out

    def _check_step(self, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int],
                    token_src: Sequence[int] | None) -> None:
        """forward's and launch's checks of a step's token arrays (the engine open)."""
        if self._model is None:
            raise EngineError("engine is closed")
        n = len(tokens)
        if not (len(pos) == len(seq) == n):
            raise ValueError("tokens, pos and seq must have the same length")
        self._check_src(token_src, n)

    def _check_hist(self, expert_hist: np.ndarray | None) -> None:
        if expert_hist is not None and (expert_hist.dtype != np.int32 or
                                        expert_hist.shape != (self.hparams.n_layer, self.hparams.n_expert)):
            raise ValueError("expert_hist must be int32 [n_layer, n_expert]")

    def _check_src(self, token_src: Sequence[int] | None, n: int) -> None:
        if token_src is None:
            return
        if len(token_src) != n:
            raise ValueError("token_src must have one entry per token")

    def launch(self, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int],
               block_tables: Sequence[Sequence[int]], logit_idx: Sequence[int], *,
               token_src: Sequence[int] | None = None, expert_hist: np.ndarray | None = None,
               after: int | None = None) -> int:
        """Issue a greedy step (``forward(..., greedy=True)``'s arguments) without waiting for it;
        returns a ticket for :meth:`wait`, which returns its picks. On a GPU the step runs while the
        caller prepares the next one, whose ``token_src`` may name this step's picks (the ids stay
        on the device). On the CPU the step runs here, synchronously (same results, one code path).
        ``expert_hist`` is added to when the step is waited.

        ``after``: the ticket whose picks ``token_src`` means; when another step ran on this engine
        since (another caller's), :class:`StaleSourceError` is raised and nothing runs. The device
        holds two launched steps: a third launch waits for the oldest first (its picks then wait for
        its own ``wait``), as ``forward`` waits for all of them."""
        self._check_step(tokens, pos, seq, token_src)
        self._check_hist(expert_hist)
        nl = len(logit_idx)
        out = np.empty(nl, np.int32)
        with self._step_lock:
            if after is not None and token_src is not None and after != self._last_step:
                raise StaleSourceError(f"launch: token_src names step {after}'s picks but step {self._last_step} "
                                       "ran since", lib.ST_EINVAL)
            self._drain(1)
            b = self._io.fill(tokens, pos, seq, block_tables, logit_idx, token_src)
            b.logits = ffi.NULL
            b.out_tokens = ptr(out, "int32_t *") if nl else ffi.NULL
            b.expert_hist = ptr(expert_hist, "int32_t *") if expert_hist is not None else ffi.NULL
            self._last_step += 1  # (a refused step changes nothing in C either, but its id is spent)
            ticket = self._last_step
            if self._gpu is not None:
                self._inflight[ticket] = (out, self._gpu.launch(b), None, expert_hist)  # C adds to it at the wait
            else:  # the CPU: the whole step now
                st = self._io.stats
                check(lib.st_forward(self._model, self._kv, self._pool, b, st), "forward")
                self._inflight[ticket] = (out, 0, self._take_moved(_stats(st)), None)
        return ticket

    def _drain(self, keep: int) -> None:
        """Wait for the oldest launched steps until at most ``keep`` are in flight (under the step lock);
        their results go to _done for their own wait."""
        while len(self._inflight) > keep:
            t = next(iter(self._inflight))
            try:
                self._done[t] = self._wait_c(t)
            except EngineError as exc:  # the step's own failure, for its owner's wait
                self._done[t] = exc

    def _wait_c(self, ticket: int) -> tuple[np.ndarray, StepStats | None]:
        out, c_ticket, stats, _hist = self._inflight.pop(ticket)
        if self._gpu is not None:
            st = self._io.stats
            self._gpu.wait(c_ticket, ptr(out, "int32_t *") if out.size else ffi.NULL, st)
            # the tier moves queued since the last waited step (between launches: before this one or the next)
            stats = self._take_moved(_stats(st, self._gpu_profile(st)))
        return out, stats

    def wait(self, ticket: int) -> np.ndarray:
        """The picks (int32 [len(logit_idx)]) of a step issued by :meth:`launch` (steps launched before
        it are waited first); sets ``last_stats``. A ticket not launched, or already waited, raises
        EngineError. An engine error of the step is raised here (its ticket is then spent)."""
        with self._step_lock:
            if ticket in self._done:
                done = self._done.pop(ticket)
                if isinstance(done, EngineError):
                    raise done
                out, stats = done
            elif ticket in self._inflight:
                while next(iter(self._inflight)) != ticket:
                    self._drain(len(self._inflight) - 1)
                out, stats = self._wait_c(ticket)
            else:
                raise EngineError(f"wait: no launched step {ticket} to wait for", lib.ST_EINVAL)
            self.last_stats = stats
        return out

    def _gpu_profile(self, st: Any) -> dict[str, float]:
        """The frame profile of the GPU step just waited: the C library's for a hybrid model; on the GPU alone
        it is the step itself (every pair on the GPU, nothing waited), without a call."""
        if self.resident is not None:
            return self._gpu.profile()
        tier = self._gpu.profile() if self.kv_tiers is not None else {}
        return {"t_gpu": st.t_total, "t_cpu_experts": 0.0, "t_gpu_wait": 0.0, "t_pcie": 0.0, "t_cpu_wait": 0.0,
                "pairs_gpu": int(st.n_expert_tokens), "pairs_cpu": 0, "staged_bytes": 0, "pcie_bytes": 0,
                "kv_host_bytes": tier.get("kv_host_bytes", 0), "kv_cpu_bytes": tier.get("kv_cpu_bytes", 0),
                "t_cpu_attn": tier.get("t_cpu_attn", 0.0), "kv_cpu_share": tier.get("kv_cpu_share", 0.0),
                "kv_cpu_gbs": tier.get("kv_cpu_gbs", 0.0), "kv_pcie_gbs": tier.get("kv_pcie_gbs", 0.0),
                "kv_form": tier.get("kv_form", -1)}

    def cpu_attn_gbs(self, n_keys: int = 32768, n_tok: int = 1, seconds: float = 0.2) -> float:
        """The pool's rate (GB/s of K and V) attending listed blocks at this model's attention shape and KV type
        (st_attn_blocks_gbs: n_tok tokens of n_keys keys): the CPU side of kv_host_attn, beside the PCIe rate of
        streaming the same blocks, for a choice between the two from measured rates."""
        from engine.native import attn_blocks_gbs

        hp = self.hparams
        return attn_blocks_gbs(self._pool, self.kv_type, self.block_size, hp.head_dim, hp.n_head, hp.n_head_kv,
                               n_tok, n_keys, seconds)

    def gpu_memory(self) -> dict[str, int]:
        """On a GPU, the bytes the engine's own allocations hold there: ``weights`` (non-routed tensors and
        resident experts), ``kv`` (the VRAM tier of a tiered cache), ``kv_host`` (its pinned host tier; 0
        untiered), ``kv_stage`` (VRAM slots staging host-tier blocks for prefill steps, grown on demand),
        ``scratch`` (step buffers at their current size), and
        ``resident_experts`` (how many routed experts the GPU holds). The driver's figure adds the CUDA context."""
        if self._gpu is None:
            raise EngineError("gpu_memory: the engine runs on the CPU")
        return self._gpu.memory()

    @property
    def in_flight(self) -> int:
        """Launched steps whose results were not yet taken by wait."""
        return len(self._inflight) + len(self._done)

    @property
    def last_step(self) -> int:
        """The id of the last step run on this engine (a launch's ticket is its id): ``launch(after=...)``."""
        return self._last_step

    def prefill(self, token_ids: Sequence[int], blocks: Sequence[int], start: int = 0,
                all_logits: bool = False) -> np.ndarray:
        """Raw steps over blocks the caller holds: compute token_ids at positions start.. of one
        sequence in ``prefill_chunk`` pieces; logits of the last token [n_vocab], or of all
        [T, n_vocab]. Serving never uses this (the scheduler plans its own steps)."""
        if not token_ids:
            raise ValueError("no tokens to process")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        end = start + len(token_ids)
        if end > len(blocks) * self.block_size:
            raise KVCapacityError(f"{end} positions need {-(-end // self.block_size)} KV blocks, "
                                  f"{len(blocks)} given")
        outs = []
        table = [list(blocks)]
        for off in range(0, len(token_ids), self.prefill_chunk):
            chunk = [int(t) for t in token_ids[off : off + self.prefill_chunk]]
            p0 = start + off
            want = list(range(len(chunk))) if all_logits else (
                [len(chunk) - 1] if off + len(chunk) == len(token_ids) else [])
            out = self.forward(chunk, list(range(p0, p0 + len(chunk))), [0] * len(chunk), table, want)
            if want:
                outs.append(out)
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def warm_up(self, tokens: int | None = None) -> float:
        """One step of ``tokens`` prompt tokens and one greedy decode step on KV blocks taken and given back, so that
        a lane's first request does not pay for first-use work: on a GPU, the lazy loading of the kernels a step
        runs, the step buffers' growth to the largest step (with a hybrid model's pinned row buffers) and the
        batch-1 decode graph's capture; on the CPU, the pool's first wake-up and the first touch of the mapped
        weights a step reads. ``tokens`` defaults to ``step_tokens`` on a GPU (the largest step its buffers are
        planned for) and 16 on the CPU, cut to what the free blocks hold. Passes no expert histogram (placement
        statistics unchanged) and publishes nothing in the prefix cache. Seconds taken; 0.0 when no block is free."""
        t0 = time.perf_counter()
        n = tokens if tokens is not None else (self.step_tokens if self._gpu is not None else 16)
        n = min(max(1, n), self.step_tokens, self.blocks.num_free * self.block_size - 1)
        if n < 1:
            return 0.0
        table = self.blocks.allocate(-(-(n + 1) // self.block_size))
        if table is None:  # taken meanwhile by another caller of this engine
            return 0.0
        try:
            ids = [i % self.hparams.n_vocab for i in range(1, n + 1)]
            self.forward(ids, list(range(n)), [0] * n, [table], [n - 1], greedy=True)
            self.forward([ids[-1]], [n], [0], [table], [0], greedy=True)
        finally:
            self.blocks.release(table)
        return time.perf_counter() - t0

    def logits_for(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of a fresh sequence: [T, n_vocab] (oracle tests)."""
        if not token_ids:
            raise ValueError("no tokens to process")
        if len(token_ids) > self.kv_tokens:
            raise KVCapacityError(
                f"sequence of {len(token_ids)} tokens exceeds the KV cache capacity of {self.kv_tokens} tokens"
            )
        need = -(-len(token_ids) // self.block_size)
        blocks = self.blocks.allocate(need)
        if blocks is None:
            raise KVCapacityError(f"need {need} KV blocks, {self.blocks.num_free} free of {self.blocks.n_blocks}")
        try:
            return self.prefill(token_ids, blocks, all_logits=True)
        finally:
            self.blocks.release(blocks)

    # ------------------------------------------------------------ generation (through the scheduler)
    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """One request through a private :class:`~engine.scheduler.Scheduler` on this thread:
        its outputs (text deltas, the final one ``finished``) as steps produce them.

        Closing the iterator early aborts the request and frees its KV blocks. Safe beside a
        lane's scheduler on the same engine (blocks are locked, C steps serialised), though
        the two then share the arena and the step rate.
        """
        from engine.scheduler import Scheduler

        ids = self.tokenizer.encode(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) \
            else list(prompt)
        sched = Scheduler(self)
        rid = sched.add(ids, params)
        done = False
        try:
            while not done:
                try:
                    outs = sched.step()
                except Exception as exc:
                    sched.fail_all(f"{type(exc).__name__}: {exc}")  # frees the blocks
                    done = True
                    raise
                for o in outs:
                    done = done or o.finished
                    yield o
        finally:
            if not done:
                sched.abort(rid)
                sched.step()  # applies the abort: the blocks are free when this returns

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 **params: Any) -> GenerationResult:
        """Generate from a text prompt or token ids (no chat template applied); greedy by
        default. Extra keyword arguments are :class:`~engine.sampling.SamplingParams` fields."""
        from engine.sampling import SamplingParams

        sp = SamplingParams.parse(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  seed=seed, **params)
        ids = self.tokenizer.encode(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) \
            else [int(t) for t in prompt]
        toks: list[int] = []
        text: list[str] = []
        finish = "length"
        for o in self.stream(ids, sp):
            toks.extend(o.token_ids)
            text.append(o.text)
            if o.finished:
                if o.error:
                    raise EngineError(o.error)
                finish = o.finish_reason or "length"
        return GenerationResult(token_ids=toks, text="".join(text), finish_reason=finish, prompt_tokens=len(ids))

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 256, **kw: Any) -> GenerationResult:
        return self.generate(self.render_chat(messages), max_tokens=max_tokens, **kw)

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self.model_file.metadata

    @property
    def model_path(self) -> Path:
        return self.model_file.path
