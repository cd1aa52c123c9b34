"""Paged KV bookkeeping: reference-counted blocks and a prefix cache of full blocks.

The C side owns the F16 arena; this module decides which block ids a sequence uses.
A full block is identified by a hash chain over its tokens (the hash of block i covers
blocks 0..i), so a new sequence that starts with the same tokens (a system prompt, a
document, earlier turns) reuses the cached blocks instead of recomputing them.

Blocks whose reference count drops to zero stay cached but evictable, in LRU order;
allocation takes the least recently freed block first and forgets its hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KVCapacityError(ValueError):
    """A request that cannot fit in the KV cache."""


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError("n_blocks and block_size must be >= 1")
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.ref = [0] * n_blocks
        self.block_hash: list[int | None] = [None] * n_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * n_blocks
        self.cached: dict[int, int] = {}  # chain hash -> block id
        # every block with ref == 0, least recently freed first (cached ones included)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))
        self.hits = 0  # cached tokens served, for metrics
        self.queries = 0  # prompt tokens looked up

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable cached)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.n_blocks

    def chain_hashes(self, tokens: Sequence[int], n_full: int | None = None) -> list[int]:
        """Hashes of the first n_full full blocks of tokens."""
        bs = self.block_size
        n = len(tokens) // bs if n_full is None else n_full
        out: list[int] = []
        h = 0
        for i in range(n):
            h = hash((h, tuple(tokens[i * bs : (i + 1) * bs])))
            out.append(h)
        return out

    # ------------------------------------------------------------ lifecycle
    def take_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Reuse cached full blocks matching the start of tokens; returns their ids (ref'd)."""
        if not self.prefix_cache:
            return []
        bs = self.block_size
        taken: list[int] = []
        for i, h in enumerate(self.chain_hashes(tokens)):
            b = self.cached.get(h)
            if b is None or self.block_tokens[b] != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            taken.append(b)
        self.queries += len(tokens)
        self.hits += len(taken) * bs
        return taken

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting cached ones LRU-first; None (and nothing taken) if short."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
                self.block_tokens[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; tail blocks are released first, so the
        prefix blocks (the likeliest to be shared again) are evicted last."""
        for b in reversed(blocks):
            if self.ref[b] <= 0:
                raise ValueError(f"KV block {b} released more often than taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def register_full(self, blocks: Sequence[int], tokens: Sequence[int], first: int, last: int) -> None:
        """Publish blocks first..last-1 (now full of `tokens`) in the prefix cache."""
        if not self.prefix_cache or last <= first:
            return
        bs = self.block_size
        hashes = self.chain_hashes(tokens, last)
        for i in range(first, last):
            b, h = blocks[i], hashes[i]
            if self.block_hash[b] is not None:
                continue
            self.block_hash[b] = h
            self.block_tokens[b] = tuple(tokens[i * bs : (i + 1) * bs])
            self.cached.setdefault(h, b)
