"""The prefix cache's chain: blake2b digests, parent identity checked on every hit, collisions harmless."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

import engine.block_manager as bm
from engine.block_manager import BlockManager, block_digest, extend_digests

BS = 4


def publish(m: BlockManager, tokens: list[int]) -> list[int]:
    """What the scheduler does for a sequence: take the cached prefix, allocate the rest,
    compute (nothing to compute here), publish the full blocks; returns the block ids."""
    digests = m.chain_digests(tokens)
    blocks = m.take_prefix(tokens, digests)
    n_hit = len(blocks)
    more = m.allocate(-(-len(tokens) // BS) - len(blocks))
    assert more is not None
    blocks += more
    m.register_full(blocks, tokens, digests, n_hit, len(tokens) // BS)
    return blocks


def test_digest_is_blake2b_over_parent_and_token_bytes() -> None:
    d0 = block_digest(bm.ROOT_DIGEST, [1, 2, 3, 4])
    assert d0 == hashlib.blake2b((1).to_bytes(4, "little") + (2).to_bytes(4, "little") + (3).to_bytes(4, "little")
                                 + (4).to_bytes(4, "little"), digest_size=16).digest()
    d1 = block_digest(d0, [5, 6, 7, 8])
    assert d1 != block_digest(bm.ROOT_DIGEST, [5, 6, 7, 8])  # the parent is part of the digest
    assert block_digest(d0, [5, 6, 7, 8]) == d1  # stable across calls and processes (no hash seed)


def test_incremental_digests_equal_a_fresh_chain() -> None:
    m = BlockManager(8, BS)
    toks = list(range(3, 30))
    inc: list[bytes] = []
    for n in range(1, len(toks) + 1):  # one token at a time, as decoding appends them
        extend_digests(inc, toks[:n], BS)
    assert inc == m.chain_digests(toks)
    assert len(inc) == len(toks) // BS


def test_same_prefix_hits_and_a_different_one_does_not() -> None:
    m = BlockManager(16, BS)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    blocks_a = publish(m, a)
    m.release(blocks_a)
    b = [1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44]  # the same two full blocks, then its own tail
    hit = m.take_prefix(b)
    assert hit == blocks_a[:2]
    m.release(hit)
    c = [1, 2, 3, 4, 99, 6, 7, 8]  # same first block only
    assert m.take_prefix(c) == blocks_a[:1]


def test_forced_collision_of_every_digest_never_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block gets the same digest: only the token and parent checks stand between a
    prompt and another prompt's K/V."""
    monkeypatch.setattr(bm, "block_digest", lambda parent, tokens: b"\0" * 16)
    m = BlockManager(16, BS)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    m.release(publish(m, a))
    assert m.take_prefix([9, 9, 9, 9, 5, 6, 7, 8]) == []  # digest found, tokens differ
    assert m.take_prefix([1, 2, 3, 4, 1, 2, 3, 4])[1:] == []  # block 1 finds block 0 (the only entry): wrong parent


def test_collision_with_equal_tokens_but_another_parent_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest that ignores the parent (a collision in the chain): block [5,6,7,8] after
    [1,2,3,4] and after [9,9,9,9] look alike and hold the same tokens; their K/V differ (it
    depends on everything before). Only the parent identity check refuses the hit."""
    def parentless(parent: bytes, tokens: Sequence[int]) -> bytes:
        return hashlib.blake2b(bytes(str(list(tokens)), "ascii"), digest_size=16).digest()

    monkeypatch.setattr(bm, "block_digest", parentless)
    m = BlockManager(16, BS)
    blocks_a = publish(m, [1, 2, 3, 4, 5, 6, 7, 8])
    blocks_c = publish(m, [9, 9, 9, 9, 0, 0, 0, 0])
    m.release(blocks_a)
    m.release(blocks_c)
    got = m.take_prefix([9, 9, 9, 9, 5, 6, 7, 8])
    assert got == blocks_c[:1]  # its own first block, and NOT blocks_a[1]
    m.release(got)
    # the same probe with the parent check disabled would have served block a[1]: prove the setup
    assert m.cached[parentless(b"", [5, 6, 7, 8])] == blocks_a[1]


def test_eviction_takes_tails_first_and_forgets_them() -> None:
    m = BlockManager(3, BS)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    blocks_a = publish(m, a)
    m.release(blocks_a)  # both cached and evictable; the tail a[1] is freed first, so evicted first
    other = m.allocate(2)  # the never-used block and a[1]
    assert other is not None and blocks_a[1] in other and blocks_a[0] not in other
    m.release(other)
    hit = m.take_prefix(a)
    assert hit == blocks_a[:1]
    m.release(hit)
    assert all(r == 0 for r in m.ref)


def test_locked_api_keeps_counts_consistent_across_threads() -> None:
    import threading

    m = BlockManager(64, BS)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            for i in range(2000):
                toks = [seed, i % 7, 1, 2, 3, 4, 5, 6]
                blocks = publish(m, toks)
                m.release(blocks)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(r == 0 for r in m.ref) and m.num_free == m.n_blocks
