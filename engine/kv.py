"""Block bookkeeping for the paged KV cache (the C side owns the memory)."""

from __future__ import annotations

from collections.abc import Iterable


class KVCapacityError(ValueError):
    """A request that cannot fit in the KV cache."""


class BlockAllocator:
    """A free list of fixed-size KV blocks, identified by index."""

    def __init__(self, n_blocks: int) -> None:
        if n_blocks < 1:
            raise ValueError("n_blocks must be >= 1")
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCapacityError(f"need {n} KV blocks, {len(self._free)} free of {self.n_blocks}")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"KV block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)
