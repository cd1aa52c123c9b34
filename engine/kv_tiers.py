"""The KV cache's two tiers: which logical block lives in the hot pool and which in the cold one.

The block manager hands out *logical* block ids (reference counts, prefix cache, block tables:
none of them ever change when a block moves). A tiered cache keeps every logical block in one
physical block of either pool: the hot tier (on the GPU engine, device memory; here a separate
host allocation) or the cold tier (pinned host RAM there, host memory here). This module keeps
that mapping (a permutation, mirrored by the C cache's own map) and decides the moves. The GPU engine's
swap (``CudaModel.kv_swap``, stg_kv_swap) queues the copy on the device's stream, behind the steps already
launched, so the scheduler may place between a launch and its wait.

Between steps the scheduler hands ``place`` the block tables of the sequences of the next step.
The hot tier is filled in priority order, as far as it goes:

1. each sequence's recent window: its last ``window_blocks`` blocks (the ones being written and
   the keys every decode step reads with the most weight);
2. each sequence's attention sinks: its first ``sink_blocks`` blocks;
3. whole sequences, in step order, while they fit.

A wanted block that is cold swaps places with a hot block that is not wanted, preferring one that
holds nothing (then only one block's bytes are copied). Moves never change outputs: attention
reads both pools through the same logical tables (bit-identical logits, tests/engine/test_kv_tiers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["KVTiers"]

# swap(a, b, copy_a, copy_b) -> bytes copied: exchanges the physical homes of logical blocks a and b
SwapFn = Callable[[int, int, bool, bool], int]


class KVTiers:
    def __init__(self, n_hot: int, n_cold: int, swap: SwapFn, holds: Callable[[int], bool], *,
                 sink_blocks: int = 1, window_blocks: int = 2) -> None:
        """``holds(b)``: whether logical block b holds contents that must survive a move (in use or
        cached); ``swap``: the cache's block exchange (``st_kv_swap``)."""
        if n_hot < 1 or n_cold < 0:
            raise ValueError(f"n_hot must be >= 1 and n_cold >= 0, got {n_hot}, {n_cold}")
        if sink_blocks < 0 or window_blocks < 1:
            raise ValueError(f"sink_blocks must be >= 0 and window_blocks >= 1, got {sink_blocks}, {window_blocks}")
        self.n_hot, self.n_cold = n_hot, n_cold
        self.sink_blocks, self.window_blocks = sink_blocks, window_blocks
        self._swap, self._holds = swap, holds
        n = n_hot + n_cold
        self.phys = list(range(n))  # logical -> physical (physical < n_hot: hot)
        self.owner = list(range(n))  # physical -> logical
        self.moved_bytes = 0  # copied between tiers since the cache was made
        self.moves = 0  # swaps done

    def is_hot(self, block: int) -> bool:
        return self.phys[block] < self.n_hot

    def wanted(self, tables: Sequence[Sequence[int]]) -> list[int]:
        """The logical blocks the hot tier should hold for a step over ``tables``, best first, at most n_hot."""
        out: dict[int, None] = {}
        for t in tables:
            for b in t[max(0, len(t) - self.window_blocks):]:
                out[b] = None
        for t in tables:
            for b in t[: self.sink_blocks]:
                out[b] = None
        for t in tables:
            if len(t) > self.n_hot or len(out) + sum(1 for b in t if b not in out) > self.n_hot:
                continue  # a whole sequence goes hot only if it fits entirely
            for b in t:
                out[b] = None
        return list(out)[: self.n_hot]

    def place(self, tables: Sequence[Sequence[int]]) -> int:
        """Move blocks so the hot tier holds ``wanted(tables)``; returns the bytes copied."""
        if not self.n_cold:
            return 0
        want = self.wanted(tables)
        keep = set(want)
        cold = [b for b in want if self.phys[b] >= self.n_hot]
        if not cold:
            return 0
        # hot blocks free to leave: empty ones first (no copy), then the rest
        empty, full = [], []
        for p in range(self.n_hot):
            b = self.owner[p]
            if b not in keep:
                (full if self._holds(b) else empty).append(b)
        victims = empty + full
        moved = 0
        for b, v in zip(cold, victims, strict=False):
            moved += self._swap(b, v, self._holds(b), self._holds(v))
            pb, pv = self.phys[b], self.phys[v]
            self.phys[b], self.phys[v] = pv, pb
            self.owner[pv], self.owner[pb] = b, v
            self.moves += 1
        self.moved_bytes += moved
        return moved
