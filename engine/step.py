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
    # the frame profile of a GPU step (stg_step_profile; zero on the CPU engine). The device's timeline:
    # t_total = t_gpu (computing) + t_pcie (the CPU share's copies) + t_gpu_wait (waiting on the CPU's experts,
    # hybrid placement), each part measured on its own; the host's: t_cpu_experts computing them, t_cpu_wait
    # waiting on the device for their inputs. The share of routed pairs the GPU's resident experts computed,
    # bytes over PCIe for the CPU share, expert bytes staged over PCIe; on_gpu: the step ran on a GPU
    t_gpu: float = 0.0
    t_cpu_experts: float = 0.0
    t_gpu_wait: float = 0.0
    resident_hit_rate: float = 0.0
    staged_bytes: int = 0
    t_pcie: float = 0.0
    t_cpu_wait: float = 0.0
    pcie_bytes: int = 0
    on_gpu: bool = False
    # staging (the GPU engine's hybrid_stage): layers whose non-resident experts the step staged over PCIe
    # and computed on the GPU, and the rates that decision used (host -> GPU GB/s, the GPU's copy GB/s, the
    # CPU engine's routed pairs per second; 0: staging unavailable)
    staged_layers: int = 0
    stage_pcie_gbs: float = 0.0
    stage_gpu_gbs: float = 0.0
    stage_cpu_pairs_s: float = 0.0
    kv_moved_bytes: int = 0  # KV bytes copied between the cache's tiers before this step (Engine.place_kv)
    # the GPU's KV tiers: bytes of host-tier blocks the step read over PCIe (streamed in place by decode, staged
    # into VRAM layer by layer by prefill-form steps, whose written blocks go back: those bytes too)
    kv_host_bytes: int = 0
    # kv_host_attn: bytes of host-tier blocks the CPU pool attended where they lie (not in kv_host_bytes: they did
    # not cross PCIe) and the seconds it spent on them (st_attn_blocks_part, summed over layers)
    kv_cpu_bytes: int = 0
    t_cpu_attn: float = 0.0
    # kv_host_attn's mixed form: the CPU's share of the host-tier bytes (kv_cpu_bytes / (kv_cpu_bytes +
    # kv_host_bytes)), and the rates the measured share weighs (GB/s): the CPU pool's running mean, PCIe's probe
    # (in-place reads of mapped host memory)
    kv_cpu_share: float = 0.0
    kv_cpu_gbs: float = 0.0
    kv_pcie_gbs: float = 0.0
    # whether t_gpu and t_pcie come from the step's own events (False for a decode-sized hybrid step between two
    # sampled ones: t_gpu_wait from the GPU's clock, the rest split as the last measured step of its size split it)
    frame_measured: bool = True
    # a tiered KV cache on the GPU: the step read its host-tier blocks in place (1) or staged them into VRAM (0);
    # -1 it read none (kv_stream -1 picks the form of each decode step by the two forms' measured times)
    kv_form: int = -1


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

    def replace_experts(self, hist: np.ndarray, max_bytes: int) -> int: ...
    def place_kv(self, block_tables: Sequence[Sequence[int]]) -> int: ...
