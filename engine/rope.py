"""RoPE scaling: what a GGUF file asks for, what a lane may override, and the values the engine runs.

The rules are llama.cpp's (its model loader and llama_context), so that a file means the same here
as there:

- ``{arch}.rope.scaling.type`` is "none", "linear" or "yarn" (absent: "linear", which with no factor
  changes nothing); any other value is refused.
- ``{arch}.rope.scaling.factor`` (or the older ``rope.scale_linear``) is the context stretch: the
  rotary frequencies are divided by it (``freq_scale = 1 / factor``); type "none" keeps them.
- ``rope.scaling.original_context_length`` is YaRN's original context (absent: the trained context).
- YaRN mixes interpolation and extrapolation per rotary pair (``ext_factor``, default 1 for YaRN and
  0 otherwise; the ramp between ``beta_fast`` = 32 and ``beta_slow`` = 1 rotations over the original
  context) and scales q and k by ``mscale``: ``0.1 ln(factor) + 1`` for a factor above 1 (with
  ``rope.scaling.yarn_log_multiplier``: that over ``0.1 m ln(factor) + 1``), times
  ``rope.scaling.attn_factor``.

A lane's overrides are llama.cpp's context parameters: ``rope_scaling_type`` (``--rope-scaling``),
``rope_scaling_factor`` (``--rope-scale``, the inverse of ``--rope-freq-scale``), ``yarn_orig_ctx``,
``yarn_ext_factor``, ``yarn_attn_factor`` (ignored while YaRN's ext_factor is non-zero, as in
llama.cpp, which then derives it), ``yarn_beta_fast`` and ``yarn_beta_slow`` (``--yarn-*``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ScalingType = Literal["none", "linear", "yarn"]
SCALING_TYPES: tuple[str, ...] = ("none", "linear", "yarn")


class RopeScaling(BaseModel):
    """The rope scaling a GGUF file's metadata states (llama.cpp's defaults where a key is absent)."""

    model_config = ConfigDict(frozen=True)

    type: ScalingType = "linear"
    factor: float = Field(0.0, ge=0.0, allow_inf_nan=False)  # 0: not stated (no stretch)
    original_context_length: int = Field(0, ge=0)  # 0: not stated (the trained context)
    attn_factor: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # rope.scaling.attn_factor
    yarn_ext_factor: float = Field(-1.0, allow_inf_nan=False)  # negative: not stated
    yarn_attn_factor: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    yarn_beta_fast: float = Field(32.0, gt=0.0, allow_inf_nan=False)
    yarn_beta_slow: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    yarn_log_mul: float = Field(0.0, allow_inf_nan=False)


class RopeOverrides(BaseModel):
    """A lane's overrides of the file's rope scaling (None: the file's value)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rope_scaling_type: ScalingType | None = None
    rope_scaling_factor: float | None = Field(None, gt=0.0, le=1e6, allow_inf_nan=False)
    yarn_orig_ctx: int | None = Field(None, ge=1, le=1 << 31)
    yarn_ext_factor: float | None = Field(None, ge=0.0, le=1e3, allow_inf_nan=False)
    yarn_attn_factor: float | None = Field(None, gt=0.0, le=1e3, allow_inf_nan=False)
    yarn_beta_fast: float | None = Field(None, gt=0.0, le=1e6, allow_inf_nan=False)
    yarn_beta_slow: float | None = Field(None, gt=0.0, le=1e6, allow_inf_nan=False)

    @property
    def empty(self) -> bool:
        return all(v is None for v in self.model_dump().values())


class RopeParams(BaseModel):
    """The values the engine's RoPE runs with (st_model_desc's rope_* fields; rule in strata.h)."""

    model_config = ConfigDict(frozen=True)

    type: ScalingType
    freq_scale: float  # 1 / factor
    ext_factor: float
    attn_factor: float  # before YaRN's ln term, which C applies while ext_factor != 0
    beta_fast: float
    beta_slow: float
    n_ctx_orig: int

    @property
    def factor(self) -> float:
        return 1.0 / self.freq_scale

    @property
    def mscale(self) -> float:
        """The factor q and k take after rotation (attention logits take its square)."""
        ln = 1.0 + 0.1 * math.log(1.0 / self.freq_scale) if self.ext_factor != 0 else 1.0
        return self.attn_factor * ln

    @property
    def active(self) -> bool:
        """Whether the rotation differs from plain RoPE at all."""
        return self.freq_scale != 1.0 or self.ext_factor != 0.0 or self.attn_factor != 1.0

    def window(self, n_ctx_train: int) -> int:
        """The context the scaled model is meant for: the original context times the factor when
        that exceeds the trained context (files often state the stretched one already)."""
        if self.type == "none" or self.freq_scale >= 1.0:
            return n_ctx_train
        return max(n_ctx_train, int(self.n_ctx_orig * self.factor))

    def describe(self) -> str:
        if not self.active:
            return "none"
        if self.type == "yarn" or self.ext_factor != 0:
            return (f"yarn x{self.factor:g} of {self.n_ctx_orig} (ext {self.ext_factor:g}, beta {self.beta_fast:g}/"
                    f"{self.beta_slow:g}, mscale {self.mscale:.4g})")
        out = f"{self.type} x{self.factor:g}"
        return out + (f", attn factor {self.attn_factor:g}" if self.attn_factor != 1.0 else "")


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def resolve(file: RopeScaling, n_ctx_train: int, overrides: RopeOverrides | None = None) -> RopeParams:
    """The effective rope parameters: the file's, then the overrides, by llama_context's rules."""
    o = overrides or RopeOverrides()
    freq_scale = 1.0 / file.factor if file.factor else 1.0
    if o.rope_scaling_factor is not None:
        freq_scale = 1.0 / o.rope_scaling_factor
    kind = o.rope_scaling_type or file.type
    if kind == "none":
        freq_scale = 1.0
    ext = o.yarn_ext_factor if o.yarn_ext_factor is not None else file.yarn_ext_factor
    if ext < 0:
        ext = 1.0 if kind == "yarn" else 0.0
    attn = o.yarn_attn_factor if o.yarn_attn_factor is not None else file.yarn_attn_factor
    if ext != 0:
        factor = 1.0 / freq_scale
        attn = _mscale(factor, 1.0) / _mscale(factor, file.yarn_log_mul) if file.yarn_log_mul else _mscale(factor, 1.0)
        attn /= 1.0 + 0.1 * math.log(factor)  # the engine multiplies this term back in (strata.h's rule)
    attn *= file.attn_factor
    n_orig = o.yarn_orig_ctx or file.original_context_length or n_ctx_train
    return RopeParams(type=kind, freq_scale=freq_scale, ext_factor=ext, attn_factor=attn,
                      beta_fast=o.yarn_beta_fast if o.yarn_beta_fast is not None else file.yarn_beta_fast,
                      beta_slow=o.yarn_beta_slow if o.yarn_beta_slow is not None else file.yarn_beta_slow,
                      n_ctx_orig=n_orig)
