"""Lane configuration: a TOML file, then ``STRATA_LANE_*`` environment overrides.

Precedence (lowest first): field defaults < ``--lane`` preset (name, port) < TOML file <
environment < explicit overrides (command-line flags). Environment keys are the field
names upper-cased, nested tables joined by ``__``::

    STRATA_LANE_PORT=8102
    STRATA_LANE_CORES=auto            # or [0,1,2] or "0-7,16"
    STRATA_LANE_SCHEDULER__MAX_NUM_SEQS=32

Values are JSON-decoded when they parse as JSON, else taken as strings. Every problem is a
:class:`ConfigError` whose message is one line naming the key, its value and where it came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.config import ConfigError as _BaseConfigError
from common.config import decode_env, read_toml
from common.cpus import cpu_list_value, parse_cpu_list
from engine.rope import RopeOverrides, ScalingType
from engine.scheduler import SchedulerConfig

__all__ = ["CPU_STEP_DEFAULTS", "ENV_PREFIX", "GPU_STEP_DEFAULTS", "LANE_PORTS", "ConfigError", "LaneConfig",
           "decode_env", "load_config", "parse_cpu_list", "read_toml"]

ENV_PREFIX = "STRATA_LANE_"
LANE_PORTS = {"a": 8101, "b": 8102}  # the --lane presets; any other name keeps the default port
_AUTO_HALF = {"a": 0, "b": 1}  # cores="auto": which half of the allowed CPUs a lane takes
# step sizes a lane takes unless its configuration sets them: (prefill_chunk, scheduler.max_batch_tokens).
# The CPU's keep other sequences' decode latency low between prefill chunks; a GPU step is far more efficient
# with more tokens (hybrid placement re-copies the staged experts every step of >= 64 tokens): 2048, vLLM's
# online-serving max_num_batched_tokens (docs/operations.md, "Step sizes")
CPU_STEP_DEFAULTS = (512, 256)
GPU_STEP_DEFAULTS = (2048, 2048)


class ConfigError(_BaseConfigError):
    """A bad lane configuration; the message is a single line naming the key and value."""


class LaneConfig(BaseModel):
    """One lane process: where it listens, which model and cores, how it schedules."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    name: str = Field("a", pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")
    host: str = "127.0.0.1"
    port: int = Field(8101, ge=0, le=65535, description="0: any free port (tests)")
    model: Path | None = Field(None, description="GGUF path; None: the embedded default model")
    served_model_name: str = Field("strata-default", min_length=1, max_length=256)
    cores: list[int] | Literal["auto"] | None = Field(
        None, description='CPU ids to pin to; "auto": half of the allowed CPUs (a: first, b: second); None: no pinning'
    )
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:\d+)?)$",
                        description='"cpu", "cuda" (the GPU `gpu`), "cuda:N", or "auto" (a GPU when one is usable)')
    gpu: int | None = Field(None, ge=0, description="which GPU for device cuda/auto (default 0; supervisord may set "
                                                    "CUDA_VISIBLE_DEVICES per lane, then 0 is the lane's own GPU)")
    gpu_budget_gb: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="GPU memory the lane may hold (GiB, as `strata model inspect --vram`: weights, KV cache, buffers); None: no limit. "
                    "Below what the whole model needs on the GPU the routed experts that do not fit are computed on "
                    "the lane's cores (hybrid placement, by `placement`); below what the rest needs the lane refuses to "
                    "start; ignored on the CPU")
    placement: Path | None = Field(None, description="hybrid placement: the routing frequencies (`strata plan calibrate`) "
                                                    "a GPU lane with a budget places experts by; None: the model's "
                                                    "MODEL.placement.json when it exists, else uniform routing")
    threads: int | None = Field(None, ge=1, description="engine threads; None: one per core")
    kv_tokens: int = Field(8192, ge=16)
    kv_type: Literal["f16", "q8_0"] = Field("f16", description="the KV cache's values: f16, or q8_0 (8-bit with an F16 "
                                                               "scale per 32: 17/32 of the bytes; CPU and GPU engines)")
    kv_hot_tokens: int | None = Field(None, ge=1, description="KV tiers: the hot tier's tokens (VRAM on a GPU), the rest "
                                                              "of kv_tokens cold (host RAM; outputs unchanged); None: "
                                                              "one tier")
    gpu_kv_budget_gb: float | None = Field(None, gt=0, allow_inf_nan=False,
                                           description="KV tiers by bytes: the VRAM (GiB) the hot tier may hold at "
                                                       "kv_type's bytes per token, the rest of kv_tokens in pinned host "
                                                       "RAM; not with kv_hot_tokens; None: one tier")
    max_model_len: int | None = Field(None, ge=2)
    # rope scaling overrides (None: the model file's), llama.cpp's context options: engine/rope.py
    rope_scaling_type: ScalingType | None = Field(None, description="--rope-scaling: none, linear or yarn")
    rope_scaling_factor: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False,
                                              description="--rope-scale: the context stretch (1 / --rope-freq-scale)")
    yarn_orig_ctx: int | None = Field(None, ge=1, le=1 << 31, description="--yarn-orig-ctx")
    yarn_ext_factor: float | None = Field(None, ge=0, le=1e3, allow_inf_nan=False, description="--yarn-ext-factor")
    yarn_attn_factor: float | None = Field(None, gt=0, le=1e3, allow_inf_nan=False,
                                           description="--yarn-attn-factor (derived while ext_factor != 0)")
    yarn_beta_fast: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False, description="--yarn-beta-fast")
    yarn_beta_slow: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False, description="--yarn-beta-slow")
    block_size: int = Field(16, ge=1, le=1024)
    prefill_chunk: int = Field(512, ge=1)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    drain_timeout_s: float = Field(30.0, ge=0)
    ping_interval_s: float = Field(3.0, gt=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    additional_properties_default: bool = Field(
        False, description="object schemas (tool parameters, json_schema) that do not say additionalProperties: "
                           "false closes them (OpenAI strict mode's rule), true leaves them open; a request may "
                           "say its own with the field of the same name")

    @model_validator(mode="after")
    def _gpu_steps(self) -> LaneConfig:
        # a device that names a GPU takes the GPU's step sizes now; "auto" is resolved where the engine opens
        # (lanes/server.py: with_step_defaults)
        if self.device.startswith("cuda"):
            self._set_step_defaults(GPU_STEP_DEFAULTS)
        return self

    def _set_step_defaults(self, defaults: tuple[int, int]) -> None:
        """Set the step sizes the configuration left unset (model_fields_set), leaving them unset. The values go
        into __dict__ (pydantic's field storage): assignment and model_copy(update=...) would mark them set, and
        pydantic v2 has no call that sets a field as a default."""
        chunk, batch = defaults
        if "prefill_chunk" not in self.model_fields_set:
            self.__dict__["prefill_chunk"] = chunk
        if "max_batch_tokens" not in self.scheduler.model_fields_set and self.scheduler.max_batch_tokens != batch:
            sched = self.scheduler.model_copy()  # a copy: the caller's object stays
            sched.__dict__["max_batch_tokens"] = batch
            self.__dict__["scheduler"] = sched

    def with_step_defaults(self, gpu: bool) -> LaneConfig:
        """This configuration with the step sizes of the device the engine runs on (``gpu``: a GPU) where the
        configuration did not set them: prefill_chunk and scheduler.max_batch_tokens, CPU_STEP_DEFAULTS or
        GPU_STEP_DEFAULTS. Explicit values always win."""
        cfg = self.model_copy(deep=True)
        cfg._set_step_defaults(GPU_STEP_DEFAULTS if gpu else CPU_STEP_DEFAULTS)
        return cfg

    def step_tokens(self) -> int:
        """The most tokens one engine step may hold: the scheduler's max_batch_tokens (decode rows and prefill
        chunks together), or prefill_chunk (Engine.prefill's pieces) when larger; the GPU plan's step buffers."""
        return max(self.prefill_chunk, self.scheduler.max_batch_tokens)

    @field_validator("cores", mode="before")
    @classmethod
    def _cores_text(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        return cpu_list_value(v)

    @field_validator("cores", mode="after")
    @classmethod
    def _cores_valid(cls, v: list[int] | str | None) -> list[int] | str | None:
        if isinstance(v, list):
            if not v:
                raise ValueError("empty core list (use null for no pinning)")
            if any(c < 0 for c in v):
                raise ValueError("CPU ids must be >= 0")
            if len(set(v)) != len(v):
                raise ValueError("duplicate CPU ids")
        return v

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler_keys(cls, v: Any) -> Any:
        # SchedulerConfig itself ignores unknown keys; a typo in a lane file must not pass silently.
        if isinstance(v, Mapping):
            unknown = sorted(set(v) - set(SchedulerConfig.model_fields))
            if unknown:
                raise ValueError(f"unknown scheduler key(s) {unknown}; known: {sorted(SchedulerConfig.model_fields)}")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    def resolved_cores(self, allowed: Sequence[int] | None = None) -> list[int] | None:
        """The concrete core list: ``"auto"`` split over ``allowed`` (default: this process's CPUs)."""
        if self.cores != "auto":
            return list(self.cores) if self.cores is not None else None
        cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
        if len(cpus) == 1:
            return cpus  # one CPU: both lanes share it
        half = _AUTO_HALF.get(self.name)
        if half is None:
            raise ConfigError(f"cores='auto' needs lane name 'a' or 'b', got name={self.name!r}")
        mid = len(cpus) // 2
        return cpus[:mid] if half == 0 else cpus[mid:]

    def engine_device(self) -> str:
        """The device string for Engine.open: "cpu", "auto" or "cuda:N"."""
        if self.device == "cuda":
            return f"cuda:{self.gpu or 0}"
        if self.device.startswith("cuda:") and self.gpu is not None and int(self.device[5:]) != self.gpu:
            raise ConfigError(f"device={self.device!r} and gpu={self.gpu} name different GPUs")
        return self.device

    def rope_overrides(self) -> RopeOverrides | None:
        """The rope scaling overrides for Engine.open (None: the model file's scaling)."""
        o = RopeOverrides(**{k: getattr(self, k) for k in RopeOverrides.model_fields})
        return None if o.empty else o

    def engine_threads(self, cores: Sequence[int] | None) -> int | None:
        return self.threads if self.threads is not None else (len(cores) if cores else None)


def _set_path(tree: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    node = tree
    for key in path[:-1]:
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{source}: {'.'.join(path)} cannot set a sub-key of non-table {key!r}={nxt!r}")
        node = nxt
    node[path[-1]] = value


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        out[key] = v
    return out


def load_config(path: Path | str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> LaneConfig:
    """Build a LaneConfig from an optional TOML file, ``STRATA_LANE_*`` variables and overrides.

    ``overrides`` (flat or nested dict, e.g. from command-line flags) win over everything;
    ``overrides["name"]`` also selects the lane preset (lane "b" listens on 8102 unless told).
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(key_path: list[str], value: Any, source: str) -> None:
        _set_path(merged, key_path, value, source)
        sources[".".join(key_path)] = source

    if path is not None:
        p = Path(path)
        data = read_toml(p, ConfigError)
        for key, value in data.items():
            merged[key] = value
        for key in _flatten(data):
            sources[key] = f"file {p}"
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var == ENV_PREFIX:
            continue
        key_path = [part.lower() for part in var[len(ENV_PREFIX):].split("__")]
        if any(not part for part in key_path):
            raise ConfigError(f"environment {var}={env[var]!r}: empty key segment (nested keys use '__')")
        put(key_path, decode_env(env[var]), f"environment {var}")
    for key, value in (overrides or {}).items():
        if value is not None:
            put(key.split("."), value, f"override {key}")
    if "port" not in merged and merged.get("name") in LANE_PORTS:
        merged["port"] = LANE_PORTS[merged["name"]]
    try:
        cfg = LaneConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_describe(e, merged, sources)) from None
    if cfg.model is not None and not cfg.model.is_file():
        raise ConfigError(f"model={str(cfg.model)!r} (from {sources.get('model', 'defaults')}): no such file")
    if isinstance(cfg.cores, list):  # the machine's, not the model's rule: checked here, like the model file
        n_cpu = os.cpu_count() or 1
        outside = [c for c in cfg.cores if c >= n_cpu]
        if outside:
            raise ConfigError(f"cores={cfg.cores!r} (from {sources.get('cores', 'defaults')}): CPU ids {outside} "
                              f"are outside this machine's CPUs 0-{n_cpu - 1}")
    if cfg.cores == "auto" and cfg.name not in _AUTO_HALF:
        raise ConfigError(f"cores='auto' (from {sources.get('cores', 'defaults')}) needs lane name 'a' or 'b', "
                          f"got name={cfg.name!r}")
    return cfg


def _describe(err: ValidationError, merged: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    """One line per problem, joined: ``key=value (from SOURCE): what is wrong``."""
    parts = []
    for e in err.errors():
        loc = [str(x) for x in e.get("loc", ())]
        # union/literal branches add their own loc segments: keep the real key path only
        keys: list[str] = []
        node: Any = merged
        for seg in loc:
            if isinstance(node, Mapping) and seg in node:
                keys.append(seg)
                node = node[seg]
            else:
                break
        key = ".".join(keys) or ".".join(loc) or "config"
        src = sources.get(key) or next((s for k, s in sources.items() if k.startswith(key + ".")), "defaults")
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = f"unknown key (known: {', '.join(LaneConfig.model_fields)})"
        parts.append(f"{key}={node!r} (from {src}): {msg}")
    seen: list[str] = []
    for p in parts:  # a union reports the same key once per branch
        if not any(p.split(" (from")[0] == s.split(" (from")[0] for s in seen):
            seen.append(p)
    return "invalid lane config: " + "; ".join(seen)
