"""Paged KV bookkeeping: reference-counted blocks and a prefix cache of full blocks.

The C side owns the F16 arena; this module decides which block ids a sequence uses.
A full block is found by a chain digest: ``blake2b(parent digest + the block's token
bytes)``, so the digest of block i covers blocks 0..i and a new sequence that starts with
the same tokens (a system prompt, a document, earlier turns) reuses the cached blocks
instead of recomputing them.

A digest only *finds* a candidate; a hit is accepted only when the candidate holds the same
tokens AND was computed after exactly the parent block the new sequence already took (same
block id, same allocation generation). So even a digest collision (crafted or forced in a
test) can never hand one prompt another prompt's K/V: the class of vLLM CVE-2025-25183,
where Python's ``hash()`` chained blocks and only a block's own tokens were compared.

Blocks whose reference count drops to zero stay cached but evictable, in LRU order;
allocation takes the least recently freed block first and forgets its digest.

Every public method holds one lock: a lane's scheduler thread and, in one process, other
users of the same engine (tests, ``Engine.generate`` through its own scheduler) may share it.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["ROOT_DIGEST", "BlockManager", "KVCapacityError", "block_digest"]

ROOT_DIGEST = b""  # the "parent" of block 0
_DIGEST_BYTES = 16


class KVCapacityError(ValueError):
    """A request that cannot fit in the KV cache."""


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Chain digest of one full block: blake2b over the parent's digest and the token ids
    as little-endian uint32 (token ids are checked to be in [0, n_vocab) before they get here)."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


def extend_digests(digests: list[bytes], tokens: Sequence[int], block_size: int) -> int:
    """Append the digests of the full blocks of ``tokens`` not yet in ``digests``; returns how
    many were added. Only new blocks are hashed: O(block_size) per completed block."""
    n_full = len(tokens) // block_size
    added = 0
    for i in range(len(digests), n_full):
        parent = digests[i - 1] if i else ROOT_DIGEST
        digests.append(block_digest(parent, tokens[i * block_size : (i + 1) * block_size]))
        added += 1
    return added


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError("n_blocks and block_size must be >= 1")
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.ref = [0] * n_blocks
        self.gen = [0] * n_blocks  # bumped at every allocation: (id, gen) names one block's contents
        self.block_digest: list[bytes | None] = [None] * n_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * n_blocks
        self.block_parent: list[tuple[int, int] | None] = [None] * n_blocks  # (id, gen); (-1, 0) at the root
        self.cached: dict[bytes, int] = {}  # chain digest -> block id
        # every block with ref == 0, least recently freed first (cached ones included)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))
        self.hits = 0  # cached tokens served, for metrics
        self.queries = 0  # prompt tokens looked up
        self._lock = threading.Lock()

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable cached)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.n_blocks

    def chain_digests(self, tokens: Sequence[int]) -> list[bytes]:
        """Digests of every full block of tokens (a fresh chain; the scheduler keeps its own
        per request and extends it incrementally)."""
        out: list[bytes] = []
        extend_digests(out, tokens, self.block_size)
        return out

    # ------------------------------------------------------------ lifecycle
    def take_prefix(self, tokens: Sequence[int], digests: Sequence[bytes] | None = None) -> list[int]:
        """Reuse cached full blocks matching the start of tokens; returns their ids (ref'd).

        ``digests`` are the chain digests of tokens' full blocks (computed here when None).
        """
        if not self.prefix_cache:
            return []
        bs = self.block_size
        if digests is None:
            digests = self.chain_digests(tokens)
        taken: list[int] = []
        with self._lock:
            parent = (-1, 0)
            for i, d in enumerate(digests):
                b = self.cached.get(d)
                if b is None or self.block_parent[b] != parent:
                    break
                block = tokens[i * bs : (i + 1) * bs]
                if self.block_tokens[b] != tuple(block):
                    break
                if self.ref[b] == 0:
                    del self.free[b]
                self.ref[b] += 1
                taken.append(b)
                parent = (b, self.gen[b])
            self.queries += len(tokens)
            self.hits += len(taken) * bs
        return taken

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting cached ones LRU-first; None (and nothing taken) if short."""
        with self._lock:
            if n > len(self.free):
                return None
            out = []
            for _ in range(n):
                b, _ = self.free.popitem(last=False)
                d = self.block_digest[b]
                if d is not None:
                    if self.cached.get(d) == b:
                        del self.cached[d]
                    self.block_digest[b] = None
                    self.block_tokens[b] = None
                    self.block_parent[b] = None
                self.gen[b] += 1
                self.ref[b] = 1
                out.append(b)
            return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; tail blocks are released first, so the
        prefix blocks (the likeliest to be shared again) are evicted last."""
        with self._lock:
            for b in reversed(blocks):
                if self.ref[b] <= 0:
                    raise ValueError(f"KV block {b} released more often than taken")
                self.ref[b] -= 1
                if self.ref[b] == 0:
                    self.free[b] = None

    def register_full(self, blocks: Sequence[int], tokens: Sequence[int], digests: Sequence[bytes],
                      first: int, last: int) -> None:
        """Publish blocks first..last-1 (now full of ``tokens``) in the prefix cache.

        ``digests`` holds at least ``last`` chain digests of tokens' blocks. A block is
        published with its parent's identity (id, generation), checked on every hit.
        """
        if not self.prefix_cache or last <= first:
            return
        if len(digests) < last:
            raise ValueError(f"{len(digests)} digests for {last} full blocks")
        bs = self.block_size
        with self._lock:
            for i in range(first, last):
                b, d = blocks[i], digests[i]
                if self.block_digest[b] is not None:
                    continue
                self.block_digest[b] = d
                self.block_tokens[b] = tuple(tokens[i * bs : (i + 1) * bs])
                self.block_parent[b] = (blocks[i - 1], self.gen[blocks[i - 1]]) if i else (-1, 0)
                self.cached.setdefault(d, b)
