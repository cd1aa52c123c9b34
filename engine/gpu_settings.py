"""The GPU engine's settings and the one registry of the environment variables that override them.

A model on the GPU reads its settings once, when it opens (``stg_model_create``); the defaults are the C
library's (``stg_settings_default``, strata_cuda.h documents each field). An override here replaces one
field for every model this process opens afterwards; ``CudaModel.set_settings`` replaces them on an open
model (benchmarks time several values in one process that way). Nothing else in engine/ or bench/ reads a
``STRATA_GPU_*`` or ``STRATA_CUDA_*`` variable, and the C sources read none (tests/engine/test_gpu_source_rules.py
checks both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["LIBRARY_ENV", "OVERRIDES", "Override", "HYBRID_STAGE_DEFAULT", "apply_env", "env_override", "from_env",
           "staging_slots"]

# Not a setting of a model but of the process: which build of the GPU engine cuda_backend.load() opens
# (another build of the same sources, so that one device call can time two versions of a kernel).
LIBRARY_ENV = "STRATA_CUDA_LIB"


@dataclass(frozen=True)
class Override:
    env: str  # the environment variable
    field: str  # the stg_settings field it sets
    doc: str  # one line: what the field chooses


OVERRIDES: tuple[Override, ...] = (
    Override("STRATA_GPU_GRAPHS", "graphs",
             "1: steps of at most 64 tokens replay a CUDA graph per shape; 0: plain launches"),
    Override("STRATA_GPU_PDL", "pdl", "1: programmatic dependent launch on sm_90+; 0: off"),
    Override("STRATA_GPU_LAYER_EVENTS", "layer_events",
             "per-layer attention / FFN times: -1 sampled on graph steps, 0 never, 1 every step"),
    Override("STRATA_GPU_GEMM_MIN", "gemm_min",
             "expected pairs per expert from which the tensor-core GEMM replaces the matvec"),
    Override("STRATA_GPU_GEMM_MIN_TOKENS", "gemm_min_tokens",
             "routed layers of steps of at least this many tokens take the GEMM (0, 8, 16 or 24)"),
    Override("STRATA_GPU_GEMM_DENSE_MIN", "gemm_dense_min",
             "pairs from which a dense layer or the output head may take the GEMM"),
    Override("STRATA_GPU_GEMM_WIDE_MIN", "gemm_wide_min", "blocks from which a dense GEMM takes the wider tiles"),
    Override("STRATA_GPU_DENSE_SPLIT", "dense_split",
             "tokens from which a small dense layer's GEMM splits its k loop (0: never)"),
    Override("STRATA_GPU_ROUTED_SPLIT_MAX", "routed_split_max",
             "routed gate/up GEMMs of at most this many tokens split their k loop (a multiple of 8, 0: never)"),
    Override("STRATA_GPU_ROUTED_MV_MAX", "routed_mv_max",
             "in steps whose routed layers take the GEMM, experts with at most this many pairs take the matvec"),
    Override("STRATA_GPU_ROUTED_MV_GROUPS", "routed_mv_groups",
             "a layer keeps that split while its recent decode steps average at least this many matvec-sized "
             "experts (0: always)"),
    Override("STRATA_GPU_GEMM_FAST_MIN", "gemm_fast_min",
             "runs of this many tokens of one sequence take the prefill-form Q4_K and Q8_0 GEMMs (0: never)"),
    Override("STRATA_GPU_ATT_MMA", "att_mma",
             "prefill attention on tensor cores: 0 off (fp32, bitwise), 1 q as f16, 2 q as f16 hi + lo"),
    Override("STRATA_GPU_ATT_MMA_MIN", "att_mma_min", "runs of at least this many tokens take the tensor cores"),
    Override("STRATA_GPU_ATT_SPLIT_MIN", "att_split_min",
             "decode: sequences of at least this many keys spread their keys over several blocks (0: never)"),
    Override("STRATA_GPU_HYBRID_OVERLAP", "hybrid_overlap",
             "hybrid placement: 1 the whole step queued at once, the CPU's experts on a thread of their own; "
             "0 queued layer by layer"),
    Override("STRATA_GPU_HYBRID_STAGE", "hybrid_stage",
             "hybrid placement: N >= 1 a step of at least N tokens may stage a layer's non-resident experts over "
             "PCIe and compute them on the GPU where the measured rates say it is faster (two whole-layer slots "
             "of VRAM; 64, the default, keeps decode off it); 0 never"),
    Override("STRATA_GPU_KV_STREAM", "kv_stream",
             "KV tiers: -1 (the default) each decode step takes the form its recent steps of the same size measured "
             "faster; 0 every step stages the host-tier blocks it reads into VRAM (no graphs); 1 decode steps read "
             "them in place over PCIe (graphs kept), prefill steps stage them"),
    Override("STRATA_GPU_KV_HOST_ATTN", "kv_host_attn",
             "KV tiers: 1 split-KV decode steps have the CPU pool attend the host-tier blocks where they lie (its "
             "partials merged as one more split; eager steps, within 1e-3 of the untiered logits), the GPU its VRAM "
             "blocks (kv_stream 0: the GPU's share staged); 0 (the default) host blocks streamed over PCIe"),
    Override("STRATA_GPU_KV_HOST_SHARE", "kv_host_share",
             "kv_host_attn 1: the CPU's share (%) of each token's host-tier blocks, the rest read by the GPU in the "
             "same step (in place over PCIe, or staged into VRAM with kv_stream 0); -1 (the default) from the "
             "measured rates, r_cpu / (r_cpu + r_dev)"),
    Override("STRATA_GPU_HYBRID_STAGE_SKIP", "hybrid_stage_skip",
             "staging: N >= 1 a staged layer copies only the non-resident experts the routing so far expects at "
             "least N / 1000 hits of in the step, the device reading any other the step uses from the page-locked "
             "file (the same bits; 50, the default: 0.05 hits); 0 every one copied"),
)


def apply_env(settings: Any, environ: dict[str, str] | None = None) -> Any:
    """Set each field of ``settings`` (an ``stg_settings *`` cdata, or any object with the fields) whose
    variable is set and not empty; a value that is not an integer raises ValueError naming the variable.
    Ranges are the C library's to check (ST_EINVAL at model open names the field)."""
    env = os.environ if environ is None else environ
    for o in OVERRIDES:
        raw = env.get(o.env, "").strip()
        if not raw:
            continue
        try:
            value = int(raw, 10)
        except ValueError:
            raise ValueError(f"{o.env}={raw!r}: expected an integer ({o.doc})") from None
        setattr(settings, o.field, value)
    return settings


def from_env(ffi: Any, lib: Any, environ: dict[str, str] | None = None) -> Any:
    """A new ``stg_settings *``: the library's defaults with the environment's overrides applied."""
    s = ffi.new("stg_settings *")
    lib.stg_settings_default(s)
    return apply_env(s, environ)


def env_override(field: str, environ: dict[str, str] | None = None) -> int | None:
    """The environment's override of one stg_settings field (``apply_env``'s parsing), or None where it is not
    set: for decisions made before the library is loaded (the hybrid plan reserves the staging ring's VRAM
    when ``hybrid_stage`` is set, i.e. at least 1)."""

    class _Fields:
        pass

    got = apply_env(_Fields(), environ)
    value = getattr(got, field, None)
    return int(value) if value is not None else None


# stg_settings_default's hybrid_stage (model.cu): steps of 64 tokens and more may stage, decode never does
HYBRID_STAGE_DEFAULT = 64


def staging_slots(n_expert: int, environ: dict[str, str] | None = None) -> int:
    """The expert slots the hybrid plan reserves for staging (staging.cu's ring: two whole layers' routed experts)
    when ``hybrid_stage`` (the fewest tokens of a step that may stage; the override, else the default) is at
    least 1; 0 when it is 0."""
    stage = env_override("hybrid_stage", environ)
    return 2 * n_expert if (HYBRID_STAGE_DEFAULT if stage is None else stage) >= 1 else 0
