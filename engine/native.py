"""The compiled C engine (cffi) and the error mapping from C status codes."""

from __future__ import annotations

import os
from typing import Any

try:
    from engine._strata_c import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError("the C engine is not built: run `make build` (python -m engine._build)") from exc

__all__ = ["ffi", "lib", "EngineError", "UnsupportedError", "check", "VARIANTS", "available_variants", "ptr",
           "set_attn_split", "get_attn_split", "attn_blocks_part", "attn_blocks_gbs"]


class EngineError(RuntimeError):
    """An error reported by the C engine (bad shape, out of memory, ...)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class UnsupportedError(EngineError):
    """A quant type, architecture or kernel variant the engine does not support."""


class OutOfRangeError(EngineError):
    """An index (token id, position, KV block) outside its valid range."""


_CODE_NAMES = {1: "invalid argument", 2: "out of memory", 3: "unsupported", 4: "out of range", 5: "thread error"}


def check(rc: int, what: str = "") -> None:
    """Raise the matching exception for a non-zero C status."""
    if rc == 0:
        return
    msg = ffi.string(lib.st_last_error()).decode("utf-8", "replace") or _CODE_NAMES.get(rc, f"error {rc}")
    if what and not msg.startswith(f"{what}:"):  # C messages often name their entry point already
        msg = f"{what}: {msg}"
    cls = UnsupportedError if rc == lib.ST_EUNSUPPORTED else OutOfRangeError if rc == lib.ST_ERANGE else EngineError
    raise cls(msg, rc)


VARIANTS = {"auto": lib.ST_VARIANT_AUTO, "ref": lib.ST_VARIANT_REF, "avx2": lib.ST_VARIANT_AVX2, "avx512": lib.ST_VARIANT_AVX512}


def _variant_from_env() -> None:
    """STRATA_KERNEL_VARIANT=ref|avx2|avx512|auto forces the kernels process-wide (benchmarks,
    debugging on a machine whose best ISA is not the deployment's)."""
    name = os.environ.get("STRATA_KERNEL_VARIANT", "").strip().lower()
    if not name:
        return
    if name not in VARIANTS:
        raise ValueError(f"STRATA_KERNEL_VARIANT={name!r}: expected one of {', '.join(VARIANTS)}")
    check(lib.st_set_variant(VARIANTS[name]), "STRATA_KERNEL_VARIANT")


def available_variants() -> list[str]:
    """Kernel variants this CPU can run, reference first."""
    mask = lib.st_cpu_variants()
    return [name for name, v in VARIANTS.items() if v and mask & (1 << v)]


_variant_from_env()


def set_attn_split(mode: str | int) -> None:
    """How st_forward splits decode attention over the pool (st_set_attn_split), process-wide:
    "auto" (the rule in docs/engine.md), "off" (never: the per-head kernels, the reference the
    split is tested and measured against) or a chunk length in keys (a multiple of 16) that every
    decode query is cut into. For tests and benchmarks; serving keeps "auto"."""
    code = {"auto": lib.ST_SPLIT_AUTO, "off": lib.ST_SPLIT_OFF}.get(mode) if isinstance(mode, str) else mode
    if code is None or isinstance(code, bool):
        raise ValueError(f"attention split mode {mode!r}: expected 'auto', 'off' or a chunk length")
    check(lib.st_set_attn_split(code), "set_attn_split")


def get_attn_split() -> str | int:
    """The current attention split mode: "auto", "off" or the forced chunk length."""
    code = lib.st_get_attn_split()
    return {lib.ST_SPLIT_AUTO: "auto", lib.ST_SPLIT_OFF: "off"}.get(code, code)


def ptr(array: Any, ctype: str = "void *") -> Any:
    """A C pointer to a numpy array's (or memmap's) data, without copying."""
    return ffi.cast(ctype, ffi.from_buffer(array))


def attn_blocks_part(pool: Any, kv_type: str, k: Any, v: Any, ks: Any, vs: Any, head_dim: int, n_head: int,
                     n_kv: int, q: Any, blk_off: Any, blocks: Any, n_keys: Any) -> tuple[Any, Any]:
    """st_attn_blocks_part on numpy arrays: k / v one layer's cache ([n_blocks, ...] in st_kv's layout: F16 as
    uint16 or float16, the 8-bit cache's int8 values with ks / vs their F16 scales), q [n_tok, n_head, head_dim]
    float32 (scaled), blk_off [n_tok + 1], blocks, n_keys [n_tok] int32. Returns (ml [n_tok, n_head, 2], acc
    [n_tok, n_head, head_dim]): each (token, head)'s max score, sum of exp(s - max) and unnormalised output. pool:
    an st_pool * or None (the calling thread)."""
    import numpy as np

    types = {"f16": lib.ST_KV_F16, "q8_0": lib.ST_KV_Q8_0}
    if kv_type not in types:
        raise ValueError(f"kv_type must be one of {sorted(types)}, got {kv_type!r}")
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    q = np.ascontiguousarray(q, dtype=np.float32)
    n_tok = q.shape[0]
    off = np.ascontiguousarray(blk_off, dtype=np.int32)
    bl = np.ascontiguousarray(blocks, dtype=np.int32)
    nk = np.ascontiguousarray(n_keys, dtype=np.int32)
    if q.shape != (n_tok, n_head, head_dim) or off.shape != (n_tok + 1,) or nk.shape != (n_tok,):
        raise ValueError("attn_blocks_part: q [n_tok, n_head, head_dim], blk_off [n_tok + 1], n_keys [n_tok]")
    n_blocks = k.shape[0]
    block_size = k.size // max(n_blocks, 1) // (n_kv * head_dim) if n_blocks else 16
    ml = np.empty((n_tok, n_head, 2), np.float32)
    acc = np.empty((n_tok, n_head, head_dim), np.float32)
    scales = kv_type == "q8_0" and ks is not None and vs is not None  # else NULL: the C check refuses q8_0
    ks_p = ptr(np.ascontiguousarray(ks), "const uint16_t *") if scales else ffi.NULL
    vs_p = ptr(np.ascontiguousarray(vs), "const uint16_t *") if scales else ffi.NULL
    check(lib.st_attn_blocks_part(pool if pool is not None else ffi.NULL, types[kv_type], ptr(k), ptr(v), ks_p, vs_p,
                                  n_blocks, block_size, head_dim, n_head, n_kv, n_tok, ptr(q, "const float *"),
                                  ptr(off, "const int32_t *"), ptr(bl, "const int32_t *") if bl.size else ffi.NULL,
                                  ptr(nk, "const int32_t *"), ptr(ml, "float *"), ptr(acc, "float *")),
          "attn_blocks_part")
    return ml, acc


def attn_blocks_gbs(pool: Any, kv_type: str, block_size: int, head_dim: int, n_head: int, n_kv: int, n_tok: int,
                    n_keys: int, seconds: float = 0.2) -> float:
    """st_attn_blocks_gbs: the pool's rate (GB/s of K and V read) in st_attn_blocks_part at that shape."""
    types = {"f16": lib.ST_KV_F16, "q8_0": lib.ST_KV_Q8_0}
    if kv_type not in types:
        raise ValueError(f"kv_type must be one of {sorted(types)}, got {kv_type!r}")
    out = ffi.new("double *")
    check(lib.st_attn_blocks_gbs(pool if pool is not None else ffi.NULL, types[kv_type], block_size, head_dim, n_head,
                                 n_kv, n_tok, n_keys, float(seconds), out), "attn_blocks_gbs")
    return float(out[0])
