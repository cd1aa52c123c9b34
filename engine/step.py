"""The interface between the scheduler and an engine: a step's figures and the calls a scheduler makes.

:class:`engine.engine.Engine` implements :class:`StepEngine`; :class:`engine.scheduler.Scheduler`
imports this module, never ``engine.engine``, so ``Engine.generate`` / ``stream`` (which run a private
scheduler) sit above the scheduler without an import cycle (tests/common/test_layering.py checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.block_manager import BlockManager
from engine.cuda_backend import DeviceSpec
from engine.gguf_model import HParams

__all__ = ["StepEngine", "StepStats"]


@dataclass
class StepStats:
    """Timing and routing figures of one forward step."""

    n_tokens: int
    t_total: float
    t_attn: float
    t_experts: float
    t_dense: float
    t_output: float
    n_expert_tokens: int
    n_active_experts: int
    pool_idle_share: float = 0.0  # share of the pool's thread time spent waiting in parallel regions
    # the frame profile of a GPU step (stg_step_profile; zero on the CPU engine): t_total split into the GPU at
    # work and the GPU waiting on the CPU's experts (hybrid placement), the host's time in those experts, the
    # share of routed pairs the GPU's resident experts computed, expert bytes staged over PCIe
    t_gpu: float = 0.0
    t_cpu_experts: float = 0.0
    t_gpu_wait: float = 0.0
    resident_hit_rate: float = 0.0
    staged_bytes: int = 0
    kv_moved_bytes: int = 0  # KV bytes copied between the cache's tiers before this step (Engine.place_kv)


class StepEngine(Protocol):
    """What a scheduler uses of an engine (``Engine``'s methods of the same names say what each does)."""

    hparams: HParams
    blocks: BlockManager
    kv_tokens: int
    device: DeviceSpec
    last_stats: StepStats | None

    @property
    def tokenizer(self) -> Any: ...

    @property
    def has_tokenizer(self) -> bool: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def can_launch(self) -> bool: ...

    def forward(self, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int],
                block_tables: Sequence[Sequence[int]], logit_idx: Sequence[int],
                expert_hist: np.ndarray | None = None, *, greedy: bool = False,
                token_src: Sequence[int] | None = None) -> np.ndarray: ...

    def launch(self, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int],
               block_tables: Sequence[Sequence[int]], logit_idx: Sequence[int], *,
               token_src: Sequence[int] | None = None, expert_hist: np.ndarray | None = None,
               after: int | None = None) -> int: ...

    def wait(self, ticket: int) -> np.ndarray: ...

    def place_kv(self, block_tables: Sequence[Sequence[int]]) -> int: ...
