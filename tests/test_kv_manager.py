"""Block hashing and the KVCacheManager: block tables, prefix hits, caching, freeing."""

from __future__ import annotations

import hashlib

import pytest

from disagg.kv_cache.block_pool import BlockPoolStats, KVCacheEvent
from disagg.kv_cache.hashing import (
    BLOCK_HASH_SCHEME,
    extend_block_hashes,
    hash_block_tokens,
    hash_token_blocks,
)
from disagg.kv_cache.manager import KVCacheManager
from disagg.request import Request, RequestStatus, SamplingParams

B = 4


def make_req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens))


def compute(kv: KVCacheManager, req: Request, n: int, hits: list[int] | None = None,
            num_hit_tokens: int = 0) -> list[int] | None:
    """What the scheduler + engine do for one step: allocate, advance, cache full blocks."""
    new = kv.allocate_slots(req, n, hits or [])
    assert new is not None
    req.num_computed_tokens += num_hit_tokens + n
    kv.cache_blocks(req, req.num_computed_tokens)
    return new


# -- hashing --------------------------------------------------------------------------------


def _spec_hash(parent: int | None, tokens: list[int]) -> int:
    # DESIGN.md section 2, written out independently.
    data = (b"" if parent is None else parent.to_bytes(8, "big")) + b"".join(
        t.to_bytes(4, "little") for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def test_hash_matches_the_spec_and_is_pinned() -> None:
    assert BLOCK_HASH_SCHEME == "sha256-chain-v1"
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == _spec_hash(None, [1, 2, 3, 4]) == 14958615928728313947
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h1 == _spec_hash(h0, [5, 6, 7, 8]) == 8346526195554102094
    assert 0 <= h0 < 2**64
    # Same tokens after a different parent give a different hash (the chain matters).
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != h1
    assert hash_block_tokens(None, [5, 6, 7, 8]) != h1


def test_hash_token_blocks_hashes_full_blocks_only() -> None:
    tokens = list(range(1, 11))  # 10 tokens: blocks [1..4], [5..8], partial [9, 10]
    h = hash_token_blocks(tokens, B)
    assert h == [_spec_hash(None, [1, 2, 3, 4]), _spec_hash(h[0], [5, 6, 7, 8])]
    assert hash_token_blocks(tokens[:3], B) == []
    assert hash_token_blocks(tokens[:8], B) == h
    # Extending a chain only hashes the new full blocks and gives the same result.
    chain = hash_token_blocks(tokens[:5], B)
    assert extend_block_hashes(chain, tokens + [11, 12], B) == hash_token_blocks(
        tokens + [11, 12], B)
    assert len(chain) == 3
    with pytest.raises(ValueError):
        hash_token_blocks(tokens, 0)


# -- block tables -------------------------------------------------------------------------


def test_blocks_needed_and_allocate_slots_grow_the_table() -> None:
    kv = KVCacheManager(8, B)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    req = make_req("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]  # positions [0, 10) -> 3 blocks
    assert kv.block_ids("a") == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1) == []  # position 10 still in block 2
    assert kv.allocate_slots(req, 2) == []  # positions 10, 11: block 2 is full at 12
    assert kv.allocate_slots(req, 3) == [3]  # position 12 needs block 3
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.block_ids("nobody") == []
    assert kv.num_free_blocks == 4
    assert kv.usage == 0.5


def test_allocate_slots_returns_none_and_changes_nothing_when_short() -> None:
    kv = KVCacheManager(3, B)
    a = make_req("a", list(range(8)))
    assert kv.allocate_slots(a, 8) == [0, 1]
    b = make_req("b", list(range(100, 109)))
    assert kv.allocate_slots(b, 9) is None  # needs 3, 1 free
    assert kv.block_ids("b") == []
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4) == [2]


def test_free_releases_the_table_tail_first() -> None:
    kv = KVCacheManager(6, B)
    a = make_req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    kv.free(a)
    assert kv.block_ids("a") == []
    assert kv.pool.free_queue() == [3, 4, 5, 2, 1, 0]
    assert kv.stats() == BlockPoolStats(free=6, used=0, cached=0, total=6)
    kv.free(a)  # nothing held: a no-op


# -- prefix caching -----------------------------------------------------------------------


def test_cache_blocks_registers_only_new_full_computed_blocks() -> None:
    kv = KVCacheManager(8, B)
    prompt = list(range(1, 11))  # 10 tokens
    a = make_req("a", prompt)
    compute(kv, a, 10)  # blocks [0, 1, 2]; 0 and 1 are full
    h = hash_token_blocks(prompt, B)
    assert kv.take_events() == [KVCacheEvent("stored", h)]
    assert [kv.pool.blocks[i].block_hash for i in (0, 1, 2)] == [h[0], h[1], None]
    # Decode steps: tokens 11 (pos 10) and 12 (pos 11) fill block 2 only after pos 11 is
    # computed.
    a.output_token_ids.append(11)
    compute(kv, a, 1)
    assert kv.take_events() == []
    a.output_token_ids.append(12)
    compute(kv, a, 1)
    h2 = hash_block_tokens(h[1], [9, 10, 11, 12])
    assert kv.take_events() == [KVCacheEvent("stored", [h2])]
    assert kv.pool.blocks[2].block_hash == h2
    assert kv.stats() == BlockPoolStats(free=5, used=3, cached=0, total=8)
    kv.free(a)
    assert kv.stats() == BlockPoolStats(free=5, used=0, cached=3, total=8)


def test_get_computed_blocks_longest_chain_leaving_one_token() -> None:
    kv = KVCacheManager(8, B)
    prompt = list(range(1, 11))  # 10 tokens, full blocks [1..4], [5..8]
    a = make_req("a", prompt)
    compute(kv, a, 10)
    kv.free(a)  # cached blocks 0 and 1 stay hits after the request is gone

    assert kv.get_computed_blocks(make_req("same", prompt)) == ([0, 1], 8)
    # 12 tokens: 3 full blocks, but only 2 are cached.
    assert kv.get_computed_blocks(make_req("longer", prompt + [11, 12])) == ([0, 1], 8)
    # Exactly 8 tokens: a hit on both blocks would leave nothing to compute -> 1 block.
    assert kv.get_computed_blocks(make_req("eight", prompt[:8])) == ([0], 4)
    assert kv.get_computed_blocks(make_req("nine", prompt[:9])) == ([0, 1], 8)
    # Differs in block 1: only block 0 hits. Differs in block 0: the chain breaks at once,
    # even though block 1's tokens match.
    assert kv.get_computed_blocks(make_req("b1", prompt[:4] + [0, 6, 7, 8, 9])) == ([0], 4)
    assert kv.get_computed_blocks(make_req("b0", [0, 2, 3, 4] + prompt[4:])) == ([], 0)
    assert kv.get_computed_blocks(make_req("short", prompt[:3])) == ([], 0)
    # Looking up takes no references.
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [0, 0]


def test_allocate_slots_with_hits_touches_them_first() -> None:
    kv = KVCacheManager(6, B)
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    compute(kv, a, 10)  # [0, 1, 2]
    b = make_req("b", prompt)
    hits, n_hit = kv.get_computed_blocks(b)
    assert (hits, n_hit) == ([0, 1], 8)
    # While a still holds them, b shares blocks 0 and 1 and gets one new block for [8, 10).
    assert compute(kv, b, 2, hits, n_hit) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert b.num_computed_tokens == 10
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert kv.pool.free_queue() == [4, 5, 2]
    with pytest.raises(ValueError, match="empty block table"):
        kv.allocate_slots(b, 1, [0])


def test_hits_on_free_blocks_are_not_counted_as_allocatable() -> None:
    kv = KVCacheManager(4, B)
    prompt = list(range(1, 11))
    a = make_req("a", prompt)
    compute(kv, a, 10)  # [0, 1, 2], blocks 0, 1 cached
    kv.free(a)
    assert kv.pool.free_queue() == [3, 2, 1, 0]

    # 17 tokens = 5 blocks > 4 in the pool; with 2 hits it needs 3 new, but only 2 blocks are
    # free besides the hits themselves.
    c = make_req("c", prompt[:8] + list(range(20, 29)))
    hits, n_hit = kv.get_computed_blocks(c)
    assert (hits, n_hit) == ([0, 1], 8)
    assert kv.allocate_slots(c, 17 - n_hit, hits) is None
    assert kv.block_ids("c") == []
    assert kv.pool.free_queue() == [3, 2, 1, 0]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [0, 0, 0, 0]

    # 16 tokens fit exactly: the hits leave the free queue, the new blocks come from its front
    # (block 3, never used, then block 2, which held no full block: nothing is evicted).
    d = make_req("d", prompt[:8] + list(range(20, 28)))
    hits, n_hit = kv.get_computed_blocks(d)
    assert compute(kv, d, 16 - n_hit, hits, n_hit) == [3, 2]
    assert kv.block_ids("d") == [0, 1, 3, 2]
    assert kv.num_free_blocks == 0


def test_allocation_evicts_cached_blocks_and_the_hit_is_gone() -> None:
    kv = KVCacheManager(3, B)
    p1 = [1, 2, 3, 4, 5]
    a = make_req("a", p1)
    compute(kv, a, 5)  # [0, 1]; block 0 cached
    h0 = hash_token_blocks(p1, B)[0]
    kv.free(a)  # free queue [2, 1, 0]
    kv.take_events()
    b = make_req("b", list(range(50, 62)))  # 12 tokens, no hit: takes 2, 1, then evicts 0
    assert compute(kv, b, 12) == [2, 1, 0]
    assert kv.take_events() == [KVCacheEvent("removed", [h0]),
                                KVCacheEvent("stored", hash_token_blocks(b.prompt_token_ids, B))]
    assert kv.get_computed_blocks(make_req("again", p1)) == ([], 0)


def test_same_prompt_computed_twice_registers_the_first_only() -> None:
    kv = KVCacheManager(8, B)
    prompt = list(range(1, 9))
    a, b = make_req("a", prompt), make_req("b", prompt)
    compute(kv, a, 8)  # [0, 1]
    compute(kv, b, 8)  # [2, 3]: same content, computed before a's blocks could be hit
    assert len(kv.take_events()) == 1
    assert [kv.pool.blocks[i].block_hash is not None for i in range(4)] == [True, True,
                                                                             False, False]
    kv.free(b)
    kv.free(a)
    assert kv.stats() == BlockPoolStats(free=6, used=0, cached=2, total=8)
    assert kv.get_computed_blocks(make_req("c", prompt + [9])) == ([0, 1], 8)


def test_preempted_request_finds_its_own_blocks() -> None:
    kv = KVCacheManager(8, B)
    a = make_req("a", list(range(1, 8)))  # 7 tokens
    compute(kv, a, 7)
    a.output_token_ids += [8, 9]
    compute(kv, a, 1)  # pos 7: block 1 now full
    # Preemption: free, recompute everything later.
    a.status = RequestStatus.PREEMPTED
    kv.free(a)
    a.num_computed_tokens = 0
    assert a.num_tokens == 9
    assert kv.get_computed_blocks(a) == ([0, 1], 8)


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(4, B, enable_prefix_caching=False)
    prompt = list(range(1, 10))
    a = make_req("a", prompt)
    compute(kv, a, 9)
    kv.free(a)
    assert kv.take_events() == []
    assert kv.stats() == BlockPoolStats(free=4, used=0, cached=0, total=4)
    assert kv.get_computed_blocks(make_req("b", prompt)) == ([], 0)
