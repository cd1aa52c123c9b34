"""The GPU engine: ``engine/_strata_cuda.so`` (built by engine/_build_cuda.py with nvcc),
reached through cffi in ABI mode and loaded only when a GPU is asked for.

It takes the same ``st_model_desc`` the CPU engine gets (weights are uploaded once, in their
GGUF quant format, from the mmap), keeps the paged KV cache in VRAM with the CPU's block
layout, and runs a step with ``st_forward``'s contract (the same ``st_batch`` and
``st_step_stats`` structs), so the scheduler and its block tables do not change.

Without a GPU, asking for one raises :class:`DeviceUnavailableError` naming what is missing:
the library was not built (no nvcc at build time), no NVIDIA driver, or no device.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import gpu_settings
from engine.native import EngineError, OutOfRangeError, UnsupportedError

__all__ = ["DeviceUnavailableError", "DeviceSpec", "GpuInfo", "parse_device", "resolve_device", "gpu_info",
           "load", "lib_path", "CudaModel", "LIB_PATH", "HEADER"]

ROOT = Path(__file__).resolve().parent
LIB_PATH = ROOT / "_strata_cuda.so"
HEADER = ROOT / "csrc" / "cuda" / "strata_cuda.h"

_ST_EUNSUPPORTED, _ST_ERANGE = 3, 4


class DeviceUnavailableError(EngineError):
    """A GPU was asked for and cannot be used; the message names what is missing."""

    def __init__(self, message: str, missing: str) -> None:
        super().__init__(message, _ST_EUNSUPPORTED)
        self.missing = missing  # "build" | "driver" | "device"


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string: kind "cpu" or "cuda" (index for cuda), or "auto"."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else self.kind


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int]


_DEVICE_RE = re.compile(r"^(cpu|auto|cuda|gpu)(?::(\d+))?$")


def parse_device(device: str | None) -> DeviceSpec:
    """'cpu', 'auto', 'cuda', 'cuda:N' (also 'gpu', 'gpu:N'); None means 'cpu'."""
    text = (device or "cpu").strip().lower()
    m = _DEVICE_RE.match(text)
    if not m or (m.group(1) in ("cpu", "auto") and m.group(2) is not None):
        raise ValueError(f"device {device!r}: expected 'cpu', 'auto', 'cuda' or 'cuda:N'")
    kind = "cuda" if m.group(1) in ("cuda", "gpu") else m.group(1)
    return DeviceSpec(kind, int(m.group(2) or 0))


# ------------------------------------------------------------------ the library

_lock = threading.Lock()
_loaded: tuple[Any, Any] | None = None


def cdef_text(header: Path = HEADER) -> str:
    """A C header of the GPU engine as cffi's cdef takes it: comments, includes and guards removed."""
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    keep = [ln for ln in text.splitlines() if not re.match(r"\s*#\s*(include|ifndef|endif|define STRATA_CUDA\w*_H)", ln)]
    return "\n".join(keep)


def lib_path() -> Path:
    """The library load() opens: $STRATA_CUDA_LIB where set (another build of the same sources, so
    that one device call can time two versions of a kernel), else LIB_PATH."""
    env = os.environ.get(gpu_settings.LIBRARY_ENV)
    return Path(env) if env else LIB_PATH


def load() -> tuple[Any, Any]:
    """(ffi, lib) of the GPU engine; DeviceUnavailableError when it is not built or cannot load."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        path = lib_path()
        if not path.exists():
            raise DeviceUnavailableError(
                f"the GPU engine is not built ({path.name} is missing: nvcc was not found when the engine was "
                "built; install the CUDA toolkit and run `python -m engine._build_cuda`)", "build")
        from cffi import FFI

        ffi = FFI()
        ffi.cdef(cdef_text())
        try:
            lib = ffi.dlopen(str(path))
        except OSError as exc:
            raise DeviceUnavailableError(f"the GPU engine cannot be loaded ({exc}); is the NVIDIA driver installed?",
                                         "driver") from exc
        _loaded = (ffi, lib)
        return _loaded


def _check(ffi: Any, lib: Any, rc: int, what: str) -> None:
    if rc == 0:
        return
    msg = ffi.string(lib.stg_last_error()).decode("utf-8", "replace") or f"error {rc}"
    msg = f"{what}: {msg}" if what else msg
    cls = UnsupportedError if rc == _ST_EUNSUPPORTED else OutOfRangeError if rc == _ST_ERANGE else EngineError
    raise cls(msg, rc)


def device_count() -> int:
    """CUDA devices visible to this process; DeviceUnavailableError without a build or a driver."""
    ffi, lib = load()
    n = int(lib.stg_device_count())
    if n < 0:
        raise DeviceUnavailableError(ffi.string(lib.stg_last_error()).decode("utf-8", "replace"), "driver")
    return n


def gpu_info(index: int = 0) -> GpuInfo:
    ffi, lib = load()
    name = ffi.new("char[256]")
    tot, free = ffi.new("int64_t *"), ffi.new("int64_t *")
    ma, mi = ffi.new("int32_t *"), ffi.new("int32_t *")
    _check(ffi, lib, lib.stg_device_info(index, name, 256, tot, free, ma, mi), f"cuda:{index}")
    return GpuInfo(index, ffi.string(name).decode("utf-8", "replace"), int(tot[0]), int(free[0]), (int(ma[0]), int(mi[0])))


def resolve_device(device: str | None) -> DeviceSpec:
    """The device a model will run on: 'auto' is cuda:0 when a GPU is usable, else cpu; an explicit
    'cuda:N' that cannot be used raises DeviceUnavailableError naming the missing piece."""
    spec = parse_device(device)
    if spec.kind == "cpu":
        return spec
    if spec.kind == "auto":
        try:
            return DeviceSpec("cuda", 0) if device_count() > 0 else DeviceSpec("cpu")
        except DeviceUnavailableError:
            return DeviceSpec("cpu")
    n = device_count()
    if n == 0:
        ffi, lib = load()
        raise DeviceUnavailableError(f"{spec}: {ffi.string(lib.stg_last_error()).decode('utf-8', 'replace')}",
                                     "device")
    if spec.index >= n:
        raise DeviceUnavailableError(f"{spec}: no such CUDA device ({n} visible)", "device")
    return spec


# ------------------------------------------------------------------ pinned host arrays

class _PinnedPool:
    """Page-locked host memory for step outputs (the logits): a device-to-host copy into it is a
    DMA, not the driver's staged copy into pageable memory. Each array owns its buffer (freed back
    to this pool when the array and every view of it are gone), so a caller may keep what a step
    returned; buffers are reused by size class, at most _KEEP of each and _CAP bytes in all. Arrays
    over _LARGE bytes (all logits of a long prefill chunk, which an oracle may ask for: 311 MB at
    512 tokens of a 151,936 vocabulary) stay pageable, so that rarely used gigabytes are not page-locked."""

    _KEEP = 4
    _CAP = 512 << 20
    _LARGE = 64 << 20  # decode-sized outputs: 32 sequences' logits are 19.4 MB

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[int]] = {}
        self._cached = 0

    def array(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import numpy as np

        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        if n == 0 or n > self._LARGE:
            return np.empty(shape, dt)
        size = max(4096, 1 << (n - 1).bit_length())  # size classes: powers of two
        ffi, lib = load()
        addr = None
        with self._lock:
            free = self._free.get(size)
            if free:
                addr = free.pop()
                self._cached -= size
        if addr is None:
            pp = ffi.new("void **")
            _check(ffi, lib, lib.stg_host_alloc(size, pp), "pinned host memory")
            addr = int(ffi.cast("uintptr_t", pp[0]))
        raw = ffi.gc(ffi.cast("char *", addr), lambda p, size=size: self._release(size, p), size=size)
        return np.frombuffer(ffi.buffer(raw, n), dt).reshape(shape)  # the buffer keeps `raw` alive

    def _release(self, size: int, p: Any) -> None:
        ffi, lib = load()
        with self._lock:
            keep = len(self._free.get(size, ())) < self._KEEP and self._cached + size <= self._CAP
            if keep:
                self._free.setdefault(size, []).append(int(ffi.cast("uintptr_t", p)))
                self._cached += size
        if not keep:
            lib.stg_host_free(p)


_pinned = _PinnedPool()


# ------------------------------------------------------------------ a model on the GPU

def _addr(cpu_ffi: Any, cdata: Any) -> int:
    return int(cpu_ffi.cast("uintptr_t", cdata))


class CudaModel:
    """Weights and the paged KV cache of one model on one GPU; ``forward`` is one step. Its settings
    (engine/gpu_settings.py) are read from the environment once, here.

    resident: hybrid placement's [n_layer, n_expert] mask (1: the routed expert is uploaded); the others are
    computed by ``cpu`` = (st_model *, st_pool *) of the C engine on the same file (st_moe_pairs), which must
    outlive this model. None: every weight on the GPU. kv_type: the cache's values, "f16" or "q8_0" (the CPU
    engine's 8-bit cache, the same bytes for the same K / V: stg_kv_create_typed). n_host_blocks: the KV tiers
    (stg_kv_create_tiered): the first n_blocks - n_host_blocks physical blocks in VRAM, the rest in pinned host
    memory that the kernels read in place; ``kv_swap`` moves logical blocks between them. cpu_attn: the C engine's
    st_pool * that attends the host tier under ``kv_host_attn`` (stg_model_set_cpu_attn; it must outlive this
    model), or None (those steps stream). settings_over:
    stg_settings fields that the caller decides over the environment's (the plan's hybrid_stage 0 when it holds
    no staging ring)."""

    def __init__(self, desc: Any, index: int, n_blocks: int, block_size: int, resident: Any = None,
                 cpu: tuple[Any, Any] | None = None, kv_type: str = "f16", n_host_blocks: int = 0,
                 settings_over: dict[str, int] | None = None, cpu_attn: Any = None) -> None:
        from engine.native import ffi as cffi_cpu
        from engine.native import lib as lib_cpu

        self._cpu_ffi = cffi_cpu
        self.ffi, self.lib = load()
        self.library = lib_path()  # the build this model runs on
        self.index = index
        settings = gpu_settings.from_env(self.ffi, self.lib)
        for field, value in (settings_over or {}).items():
            setattr(settings, field, value)
        pm = self.ffi.new("stg_model **")
        f = self.ffi
        desc_p = f.cast("void *", _addr(cffi_cpu, desc))
        if resident is None:
            rc = self.lib.stg_model_create(index, desc_p, settings, pm)
        else:
            import numpy as np

            if cpu is None:
                raise ValueError("a resident mask needs the CPU engine (model, pool) for the other experts")
            mask = np.ascontiguousarray(resident, dtype=np.uint8)
            ce = f.new("stg_cpu_experts *")
            ce.moe_pairs = f.cast("stg_moe_pairs_fn", _addr(cffi_cpu, cffi_cpu.addressof(lib_cpu, "st_moe_pairs")))
            ce.last_error = f.cast("stg_last_error_fn", _addr(cffi_cpu, cffi_cpu.addressof(lib_cpu, "st_last_error")))
            ce.model = f.cast("void *", _addr(cffi_cpu, cpu[0]))
            ce.pool = f.cast("void *", _addr(cffi_cpu, cpu[1]))
            keep = f.from_buffer(mask)
            rc = self.lib.stg_model_create_hybrid(index, desc_p, settings, f.cast("const uint8_t *", keep), ce, pm)
        _check(self.ffi, self.lib, rc, f"cuda:{index}: model")
        self._model = pm[0]
        pk = self.ffi.new("stg_kv **")
        kv_types = {"f16": self.lib.STG_KV_F16, "q8_0": self.lib.STG_KV_Q8_0}
        if kv_type not in kv_types:
            self.lib.stg_model_destroy(self._model)
            self._model = None
            raise ValueError(f"kv_type must be one of {sorted(kv_types)}, got {kv_type!r}")
        self.kv_type = kv_type
        if not 0 <= n_host_blocks < n_blocks:
            self.lib.stg_model_destroy(self._model)
            self._model = None
            raise ValueError(f"n_host_blocks must be in [0, {n_blocks}), got {n_host_blocks}")
        rc = self.lib.stg_kv_create_tiered(self._model, n_blocks - n_host_blocks, n_host_blocks, block_size,
                                           kv_types[kv_type], pk)
        if rc:
            self.lib.stg_model_destroy(self._model)
            self._model = None
            _check(self.ffi, self.lib, rc, f"cuda:{index}: KV cache")
        self._kv = pk[0]
        if cpu_attn is not None and n_host_blocks > 0:
            ca = f.new("stg_cpu_attn *")
            ca.attn_blocks = f.cast("stg_attn_blocks_fn",
                                    _addr(cffi_cpu, cffi_cpu.addressof(lib_cpu, "st_attn_blocks_part")))
            ca.last_error = f.cast("stg_last_error_fn", _addr(cffi_cpu, cffi_cpu.addressof(lib_cpu, "st_last_error")))
            ca.pool = f.cast("void *", _addr(cffi_cpu, cpu_attn))
            rc = self.lib.stg_model_set_cpu_attn(self._model, ca)
            if rc:
                self.lib.stg_kv_destroy(self._kv)
                self.lib.stg_model_destroy(self._model)
                self._model = self._kv = None
                _check(self.ffi, self.lib, rc, f"cuda:{index}: CPU attention")
        self.weight_bytes = int(self.lib.stg_model_weight_bytes(self._model))
        self._ticket = self.ffi.new("int64_t *")
        self._profile = self.ffi.new("stg_profile *")
        self.kv_bytes = int(self.lib.stg_kv_bytes(self._kv))
        self.kv_host_bytes = int(self.lib.stg_kv_host_bytes(self._kv))
        self._moved = self.ffi.new("uint64_t *")
        self.info = gpu_info(index)

    def kv_swap(self, a: int, b: int, copy_a: bool, copy_b: bool) -> int:
        """stg_kv_swap: logical blocks a and b exchange physical homes (their bytes copied as asked, queued on
        the model's stream after the steps already launched); the bytes copied."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        _check(self.ffi, self.lib, self.lib.stg_kv_swap(self._kv, int(a), int(b), int(copy_a), int(copy_b),
                                                        self._moved), "KV tier move")
        return int(self._moved[0])

    def graph_status(self) -> tuple[int, int, str]:
        """(CUDA graphs cached, captures that failed, the last failure's message)."""
        failed = self.ffi.new("int32_t *")
        note = self.ffi.new("char[256]")
        n = int(self.lib.stg_model_graphs(self._model, failed, note, 256))
        return n, int(failed[0]), self.ffi.string(note).decode("utf-8", "replace")

    def routed_split_layers(self, n_tokens: int) -> int:
        """Layers that keep the routed split (stg_settings.routed_mv_groups) in decode steps of ``n_tokens``
        tokens: the decision the device's routing statistics made (0 where the split does not apply)."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        return int(self.lib.stg_model_routed_split_layers(self._model, n_tokens))

    def set_settings(self, environ: dict[str, str] | None = None) -> None:
        """Replace the open model's settings with the defaults and ``environ``'s overrides (default: the
        process environment), as if it were opened again; its CUDA graphs are dropped."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        settings = gpu_settings.from_env(self.ffi, self.lib, environ)
        _check(self.ffi, self.lib, self.lib.stg_model_set_settings(self._model, settings), "settings")

    def memory(self) -> dict[str, int]:
        """Bytes the model's own device allocations hold (stg_model_memory, stg_kv_bytes) and the routed experts
        it holds."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        w, s = self.ffi.new("int64_t *"), self.ffi.new("int64_t *")
        _check(self.ffi, self.lib, self.lib.stg_model_memory(self._model, w, s), "memory")
        return {"weights": int(w[0]), "kv": int(self.lib.stg_kv_bytes(self._kv)), "scratch": int(s[0]),
                "kv_host": int(self.lib.stg_kv_host_bytes(self._kv)),
                "kv_stage": int(self.lib.stg_kv_stage_bytes(self._kv)),
                "resident_experts": int(self.lib.stg_model_resident_experts(self._model))}

    def profile(self) -> dict[str, float]:
        """The frame profile of the last waited step (stg_step_profile): seconds and pair counts."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        p = self._profile
        _check(self.ffi, self.lib, self.lib.stg_step_profile(self._model, p), "profile")
        return {"t_total": p.t_total, "t_gpu": p.t_gpu, "t_cpu_experts": p.t_cpu_experts, "t_gpu_wait": p.t_gpu_wait,
                "t_pcie": p.t_pcie, "t_cpu_wait": p.t_cpu_wait, "pairs_gpu": int(p.pairs_gpu),
                "pairs_cpu": int(p.pairs_cpu), "staged_bytes": int(p.staged_bytes), "pcie_bytes": int(p.pcie_bytes),
                "staged_layers": int(p.staged_layers), "stage_pcie_gbs": p.stage_pcie_gbs,
                "stage_gpu_gbs": p.stage_gpu_gbs, "stage_cpu_pairs_s": p.stage_cpu_pairs_s,
                "kv_host_bytes": int(p.kv_host_bytes), "kv_cpu_bytes": int(p.kv_cpu_bytes),
                "t_cpu_attn": p.t_cpu_attn, "kv_cpu_share": p.kv_cpu_share, "kv_cpu_gbs": p.kv_cpu_gbs,
                "kv_pcie_gbs": p.kv_pcie_gbs, "measured": int(p.measured), "kv_form": int(p.kv_form)}

    def stage_info(self) -> dict[str, float]:
        """Staging (stg_settings.hybrid_stage): whether it is available on this model and its rates."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        f = self.ffi
        av, pcie, gpu, cpu = f.new("int32_t *"), f.new("double *"), f.new("double *"), f.new("double *")
        _check(f, self.lib, self.lib.stg_model_stage_info(self._model, av, pcie, gpu, cpu), "stage info")
        return {"available": bool(av[0]), "pcie_gbs": pcie[0], "gpu_gbs": gpu[0], "cpu_pairs_s": cpu[0]}

    def swap_expert(self, layer: int, out_expert: int, in_expert: int) -> None:
        """Online re-placement (stg_model_swap_expert): ``in_expert`` takes ``out_expert``'s GPU slot."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        _check(self.ffi, self.lib, self.lib.stg_model_swap_expert(self._model, int(layer), int(out_expert),
                                                                  int(in_expert)), "swap expert")

    def set_stage_rate(self, cpu_pairs_per_s: float) -> None:
        """The CPU engine's routed pairs per second that staging's decision weighs against PCIe."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        _check(self.ffi, self.lib, self.lib.stg_model_set_stage_rate(self._model, float(cpu_pairs_per_s)),
               "stage rate")

    def host_array(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A numpy array in page-locked host memory, for a step's logits (see _PinnedPool)."""
        return _pinned.array(shape, dtype)

    def forward(self, batch: Any, stats: Any) -> None:
        """batch / stats: cdata of the CPU engine's ffi (st_batch *, st_step_stats *)."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        f = self.ffi
        _check(f, self.lib, self.lib.stg_forward(self._model, self._kv, f.cast("void *", _addr(self._cpu_ffi, batch)),
                                                 f.cast("void *", _addr(self._cpu_ffi, stats))), "forward")

    def launch(self, batch: Any) -> int:
        """stg_step_launch: queue a greedy step (batch->logits NULL); its ticket."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        f = self.ffi
        _check(f, self.lib, self.lib.stg_step_launch(self._model, self._kv,
                                                     f.cast("void *", _addr(self._cpu_ffi, batch)), self._ticket),
               "launch")
        return int(self._ticket[0])

    def wait(self, ticket: int, out_tokens: Any, stats: Any) -> None:
        """stg_step_wait: out_tokens (int32_t * of the CPU engine's ffi, or its NULL), stats (st_step_stats *)."""
        if self._model is None:
            raise EngineError("GPU model is closed")
        f = self.ffi
        _check(f, self.lib, self.lib.stg_step_wait(self._model, ticket, f.cast("int32_t *", _addr(self._cpu_ffi, out_tokens)),
                                                   f.cast("void *", _addr(self._cpu_ffi, stats))), "wait")

    def close(self) -> None:
        if getattr(self, "_model", None) is not None:
            self.lib.stg_kv_destroy(self._kv)
            self.lib.stg_model_destroy(self._model)
            self._model = self._kv = None
