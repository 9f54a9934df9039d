"""BlockPool: exact ids, LRU eviction order, prefix hits, events; plus a stateful test driving
the KVCacheManager through the Scheduler and checking the pool's integrity after every op."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from disagg.config import CapacityPolicy, SchedulerConfig
from disagg.kv_cache.block_pool import (
    BlockPool,
    BlockPoolStats,
    KVCacheEvent,
    NoFreeBlocksError,
)
from disagg.kv_cache.manager import KVCacheManager
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.scheduler import Scheduler, SchedulerOutput

# -- allocation and the free queue ---------------------------------------------------------


def test_allocate_pops_exact_ids_from_the_front() -> None:
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(0) == []
    assert [pool.blocks[i].ref_cnt for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.free_queue() == [5, 6, 7]
    assert pool.stats() == BlockPoolStats(free=3, used=5, cached=0, total=8)


def test_allocate_too_many_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.free_queue() == [3]
    assert pool.allocate(1) == [3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_freed_blocks_go_to_the_back_in_the_order_given() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(2)  # [3, 4]
    pool.free(reversed(a))  # tail first, as the manager frees a request
    assert pool.free_queue() == [5, 2, 1, 0]
    pool.free(reversed(b))
    assert pool.free_queue() == [5, 2, 1, 0, 4, 3]
    # The front is reused first: the never-used block, then a's tail before its head.
    assert pool.allocate(4) == [5, 2, 1, 0]


def test_free_more_than_referenced_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([b])


# -- prefix cache: hits, touch, eviction, events ------------------------------------------


def test_cached_blocks_are_evicted_in_lru_order_with_removed_events() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)  # [0, 1, 2, 3]
    for block_id, h in zip(blocks, [100, 101, 102, 103], strict=True):
        assert pool.cache_block(block_id, h)
    assert pool.take_events() == [KVCacheEvent("stored", [100, 101, 102, 103])]
    pool.free(reversed(blocks))
    assert pool.stats() == BlockPoolStats(free=0, used=0, cached=4, total=4)
    assert pool.free_queue() == [3, 2, 1, 0]
    # All four are still hits.
    assert [pool.get_cached_block(h) for h in (100, 101, 102, 103)] == [0, 1, 2, 3]

    # Allocation evicts from the front: block 3 (hash 103) then block 2 (hash 102).
    assert pool.allocate(2) == [3, 2]
    assert pool.take_events() == [KVCacheEvent("removed", [103, 102])]
    assert pool.get_cached_block(103) is None
    assert pool.get_cached_block(102) is None
    assert pool.get_cached_block(101) == 1
    assert pool.blocks[3].block_hash is None
    assert pool.stats() == BlockPoolStats(free=0, used=2, cached=2, total=4)
    assert pool.take_events() == []  # drained


def test_touch_takes_a_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    pool.cache_block(0, 7)
    pool.free(reversed(a))
    assert pool.free_queue() == [2, 3, 1, 0]
    assert pool.stats() == BlockPoolStats(free=3, used=0, cached=1, total=4)

    pool.touch([0])  # prefix hit on a block nobody holds
    assert pool.blocks[0].ref_cnt == 1
    assert pool.free_queue() == [2, 3, 1]
    assert pool.stats() == BlockPoolStats(free=3, used=1, cached=0, total=4)
    pool.touch([0])  # a second request shares it
    assert pool.blocks[0].ref_cnt == 2
    # Allocating everything else cannot evict the touched block.
    assert pool.allocate(3) == [2, 3, 1]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.get_cached_block(7) == 0

    pool.free([0])
    assert pool.blocks[0].ref_cnt == 1
    assert pool.free_queue() == []  # still held by one request
    pool.free([0])
    assert pool.free_queue() == [0]  # back at the tail, still cached
    assert pool.get_cached_block(7) == 0
    assert pool.stats() == BlockPoolStats(free=0, used=3, cached=1, total=4)
    # Only the stored event: touching and freeing do not change the cached set.
    assert pool.take_events() == [KVCacheEvent("stored", [7])]


def test_touch_of_a_used_block_only_counts_a_reference() -> None:
    pool = BlockPool(3)
    pool.allocate(1)  # [0]
    pool.touch([0])
    assert pool.blocks[0].ref_cnt == 2
    assert pool.free_queue() == [1, 2]


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 5) is True
    assert pool.cache_block(b, 5) is False  # same content computed twice: first one wins
    assert pool.blocks[b].block_hash is None
    assert pool.cache_block(a, 5) is False  # re-registering is a no-op
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(a, 6)
    assert pool.take_events() == [KVCacheEvent("stored", [5])]
    pool.free([b, a])
    assert pool.stats() == BlockPoolStats(free=3, used=0, cached=1, total=4)


def test_cache_block_requires_a_held_block() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_block(0, 1)


def test_events_merge_consecutive_kinds_in_order() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], 10)
    pool.cache_block(blocks[1], 11)
    pool.free([blocks[1], blocks[0]])  # free queue [1, 0]
    assert pool.allocate(1) == [1]  # evicts 11
    pool.cache_block(1, 12)
    assert pool.allocate(1) == [0]  # evicts 10
    assert pool.take_events() == [
        KVCacheEvent("stored", [10, 11]),
        KVCacheEvent("removed", [11]),
        KVCacheEvent("stored", [12]),
        KVCacheEvent("removed", [10]),
    ]


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    assert pool.cache_block(b, 9) is False
    assert pool.get_cached_block(9) is None
    pool.free([b])
    assert pool.stats() == BlockPoolStats(free=2, used=0, cached=0, total=2)
    assert pool.take_events() == []


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


# -- integrity under random operations through the scheduler ------------------------------

EOS = 0
VOCAB = list(range(1, 6))  # small vocabulary: prompts share prefixes often


def check_pool_integrity(sched: Scheduler, cached_from_events: set[int]) -> None:
    """Exact accounting of every block against the requests that hold it."""
    kv = sched.kv
    pool = kv.pool
    blocks = pool.blocks

    # free + used + cached == total, and each count matches a scan.
    stats = pool.stats()
    assert stats.free + stats.used + stats.cached == stats.total == len(blocks)
    assert stats.used == sum(b.ref_cnt > 0 for b in blocks)
    assert stats.cached == sum(b.ref_cnt == 0 and b.block_hash is not None for b in blocks)
    assert kv.num_free_blocks == stats.free + stats.cached

    # The free queue holds exactly the ref-0 blocks, once each.
    queue = pool.free_queue()
    assert len(queue) == len(set(queue)) == pool.num_free_blocks
    assert set(queue) == {b.block_id for b in blocks if b.ref_cnt == 0}
    assert all(b.ref_cnt >= 0 for b in blocks)

    # The hash index matches the blocks, and the stored/removed events replay to it.
    hashed = {b.block_hash: b.block_id for b in blocks if b.block_hash is not None}
    assert len(hashed) == sum(b.block_hash is not None for b in blocks)
    for h, block_id in hashed.items():
        assert pool.get_cached_block(h) == block_id
    assert cached_from_events == set(hashed)

    # ref_cnt == the number of running tables holding the block; waiting requests hold none.
    expected = [0] * len(blocks)
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        table = kv.block_ids(req.request_id)
        # the table covers exactly the computed positions [0, num_computed_tokens)
        assert len(table) == kv.blocks_needed(req.num_computed_tokens)
        for block_id in table:
            expected[block_id] += 1
    assert [b.ref_cnt for b in blocks] == expected
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.num_computed_tokens == 0
        assert kv.block_ids(req.request_id) == []

    # Each unfinished request is in exactly one queue.
    ids = [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
    assert sorted(ids) == sorted(sched.requests)

    # No-evict: the blocks promised to running requests are still free.
    if sched.no_evict:
        promised = sum(
            max(0, kv.blocks_needed(sched.lifetime_tokens(r)) - len(kv.block_ids(r.request_id)))
            for r in sched.running)
        assert promised <= kv.num_free_blocks


class Harness:
    """Drives a Scheduler like the engine does, checking everything after every operation.

    A fake KV store (the token written in each (block, offset) slot) proves that prefix hits
    and reused blocks hold the right content: before a step, every position a planned request
    attends to ([0, start_pos)) must hold that request's token."""

    def __init__(self, policy: CapacityPolicy, chunked: bool, caching: bool, block_size: int,
                 pool_tokens: int, max_num_tokens: int, max_batch_size: int) -> None:
        config = SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                 enable_chunked_context=chunked, capacity_policy=policy)
        # Small pools (12..32 tokens) so that requests compete for blocks.
        self.kv = KVCacheManager(max(1, pool_tokens // block_size), block_size,
                                 enable_prefix_caching=caching)
        self.sched = Scheduler(config, self.kv, max_model_len=24)
        self.cached: set[int] = set()  # the cached hashes, replayed from events
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
        self.next_id = 0
        self.num_preempted = 0

    def add(self, prompt: list[int], max_tokens: int, min_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens))
        req = Request(f"r{self.next_id}", prompt, params, eos_token_ids=(EOS,))
        self.next_id += 1
        self.sched.add_request(req)
        if req.is_finished():  # larger than the whole cache
            assert req.status == RequestStatus.FINISHED_ERROR and req.error

    def finish(self, rid: str, status: RequestStatus) -> None:
        held = self.kv.block_ids(rid)
        refs_before = [self.kv.pool.blocks[b].ref_cnt for b in held]
        req = self.sched.finish_request(rid, status)
        assert req is not None and req.status == status
        # Freed at once: one reference less on each block it held, its table forgotten.
        assert [self.kv.pool.blocks[b].ref_cnt for b in held] == [r - 1 for r in refs_before]
        assert self.kv.block_ids(rid) == []
        assert self.sched.finish_request(rid, status) is None

    def step(self, draw_token: Callable[[], int]) -> None:
        sched, B = self.sched, self.kv.block_size
        out = sched.schedule()
        self.check_plan(out)
        self.num_preempted += len(out.preempted)
        for sr in out.scheduled:  # "run the model"
            tokens = sched.requests[sr.request_id].all_token_ids
            for p in range(sr.start_pos):
                assert self.slots.get((sr.block_ids[p // B], p % B)) == tokens[p], (sr, p)
            for i, t in enumerate(sr.token_ids):
                p = sr.start_pos + i
                self.slots[(sr.block_ids[p // B], p % B)] = t
        sampled = {sr.request_id: draw_token() for sr in out.scheduled if sr.sample}
        for req in sched.update_from_output(out, sampled):
            assert req.is_finished() and req.request_id not in sched.requests
            if req.status == RequestStatus.FINISHED_LENGTH:
                assert (req.num_output_tokens == req.sampling_params.max_tokens
                        or req.num_tokens == 24)
            if req.status == RequestStatus.FINISHED_STOPPED:
                assert req.output_token_ids[-1] == EOS
                assert req.num_output_tokens >= req.sampling_params.min_tokens

    def check_plan(self, out: SchedulerOutput) -> None:
        cfg, kv = self.sched.config, self.kv
        assert len(out.scheduled) <= cfg.max_batch_size
        assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_scheduled_tokens <= cfg.max_num_tokens
        assert all(len(s.token_ids) == 1 for s in out.scheduled[:out.num_decodes])
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        assert not set(out.preempted) & {s.request_id for s in out.scheduled}
        for sr in out.scheduled:
            req = self.sched.requests[sr.request_id]
            end = sr.start_pos + len(sr.token_ids)
            assert sr.start_pos == req.num_computed_tokens
            assert sr.token_ids == req.all_token_ids[sr.start_pos:end]
            assert len(sr.token_ids) >= 1
            assert sr.block_ids == kv.block_ids(sr.request_id)
            assert len(sr.block_ids) == kv.blocks_needed(end)
            assert sr.sample == (end == req.num_tokens)
            if not sr.sample and cfg.max_num_tokens >= kv.block_size:
                assert end % kv.block_size == 0  # non-final chunks end on a block boundary
        if cfg.capacity_policy == CapacityPolicy.GUARANTEED_NO_EVICT:
            assert out.preempted == []

    def check(self) -> None:
        for ev in self.kv.take_events():
            for h in ev.block_hashes:
                if ev.kind == "stored":
                    assert h not in self.cached
                    self.cached.add(h)
                else:
                    assert h in self.cached
                    self.cached.remove(h)
        check_pool_integrity(self.sched, self.cached)

    def drain(self) -> None:
        """Liveness: whatever happened, the queue drains (no request waits forever), within a
        bound of the work left: a step moves some request on by a token at least, and a
        preempted one recomputes what it had (hence the factor). A fixed bound (300 steps) was
        too few for 60 queued requests at 2 a step and 3 tokens a step (320 needed)."""
        work = sum(len(r.all_token_ids) + r.sampling_params.max_tokens
                   for r in self.sched.requests.values())
        for _ in range(4 * work + 50):
            if not self.sched.has_unfinished():
                break
            self.step(lambda: 1)
            self.check()
        assert not self.sched.has_unfinished()
        assert self.kv.stats().used == 0
        # Nothing is remembered about finished requests (no table, no hash chain).
        assert self.kv._tables == {} and self.kv._hashes == {}


PREFIXES = [(1, 2, 3, 4), (1, 2, 5, 5), (3, 3)]


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / finish operations; everything is checked after each one."""

    @initialize(
        policy=st.sampled_from(list(CapacityPolicy)),
        chunked=st.booleans(),
        caching=st.booleans(),
        block_size=st.sampled_from([1, 2, 4]),
        pool_tokens=st.integers(min_value=12, max_value=32),
        max_num_tokens=st.integers(min_value=3, max_value=16),
        max_batch_size=st.integers(min_value=1, max_value=4),
    )
    def setup(self, **kw: object) -> None:
        self.h = Harness(**kw)  # type: ignore[arg-type]

    @rule(prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.sampled_from(VOCAB), max_size=6),
          max_tokens=st.integers(min_value=1, max_value=6),
          min_tokens=st.integers(min_value=0, max_value=2),
          copies=st.integers(min_value=1, max_value=3))
    def add(self, prefix: tuple[int, ...], suffix: list[int], max_tokens: int,
            min_tokens: int, copies: int) -> None:
        for _ in range(copies):  # bursts of identical prompts: shared prefixes, pressure
            self.h.add(list(prefix) + suffix, max_tokens, min_tokens)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self.h.step(lambda: data.draw(st.sampled_from([EOS, *VOCAB])))

    @precondition(lambda self: bool(self.h.sched.requests))
    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED,
                                                  RequestStatus.FINISHED_STOPPED]))
    def finish(self, data: st.DataObject, status: RequestStatus) -> None:
        self.h.finish(data.draw(st.sampled_from(sorted(self.h.sched.requests))), status)

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "h"):
            self.h.check()

    def teardown(self) -> None:
        if hasattr(self, "h"):
            self.h.drain()


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_scheduler_random_operations = SchedulerMachine.TestCase


def _run_seed(seed: int) -> Harness:
    rng = random.Random(seed)
    h = Harness(policy=list(CapacityPolicy)[seed % 2], chunked=rng.random() < 0.7,
                caching=rng.random() < 0.8, block_size=rng.choice([1, 2, 4]),
                pool_tokens=rng.randint(16, 32), max_num_tokens=rng.randint(4, 16),
                max_batch_size=rng.randint(2, 6))
    for _ in range(200):
        op = rng.random()
        if op < 0.35:
            prompt = list(rng.choice(PREFIXES)) + rng.choices(VOCAB, k=rng.randint(0, 6))
            h.add(prompt, rng.randint(1, 8), rng.randint(0, 2))
        elif op < 0.9:
            h.step(lambda: rng.choice([EOS, *VOCAB, *VOCAB]))
        elif h.sched.requests:
            h.finish(rng.choice(sorted(h.sched.requests)),
                     rng.choice([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]))
        h.check()
    h.drain()
    return h


def test_random_sequences_under_pressure() -> None:
    """Seeded random workloads, busier than the stateful test: many requests at once on a small
    pool, so preemption (MAX_UTILIZATION) and reservation (GUARANTEED_NO_EVICT) both bite."""
    preempted = 0
    for seed in range(40):
        try:
            h = _run_seed(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
        preempted += h.num_preempted
    assert preempted >= 20  # the MAX_UTILIZATION runs did exercise preemption
