"""Offload tiers' index (torch-free): LRU placement, demotion to disk, pins, the copies a
plan makes in order; and the scheduler's WAITING_FOR_TIER_KV state over it, with exact block
ids and the pool's integrity (free + used + cached == total)."""

from __future__ import annotations

import pytest

from disagg.config import CapacityPolicy, SchedulerConfig
from disagg.kv_cache.hashing import hash_token_blocks
from disagg.kv_cache.manager import KVCacheManager
from disagg.kv_cache.tiers import Demote, DiskDrop, TierIndex, TierStats, ToDisk, ToHost
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.scheduler import KVLoad, Scheduler

H = [0x100 + i for i in range(10)]  # block hashes h0..h9


def test_host_tier_fills_then_demotes_its_lru_entry_to_disk_before_reusing_the_slot() -> None:
    t = TierIndex(host_slots=2, disk_blocks=2)
    assert t.offload([(5, H[1]), (6, H[2])]) == [ToHost(5, 0, H[1]), ToHost(6, 1, H[2])]
    # full: h1 (least recently used) goes down to disk, its slot takes h3
    assert t.offload([(7, H[3])]) == [Demote(0, H[1]), ToHost(7, 0, H[3])]
    assert t.offload([(8, H[4])]) == [Demote(1, H[2]), ToHost(8, 1, H[4])]
    assert (t.host_order(), t.disk_order()) == ([H[3], H[4]], [H[1], H[2]])
    # disk full too: its oldest entry is dropped (its file deleted) first
    assert t.offload([(9, H[5])]) == [DiskDrop(H[1]), Demote(0, H[3]), ToHost(9, 0, H[5])]
    assert (t.host_order(), t.disk_order()) == ([H[4], H[5]], [H[2], H[3]])
    assert t.stats() == TierStats(host_blocks=2, host_capacity=2, disk_blocks=2,
                                  disk_capacity=2)
    assert [t.lookup(h) for h in (H[1], H[2], H[5])] == [None, "disk", "host"]
    assert t.host_slot(H[5]) == 0


def test_a_block_already_in_a_tier_is_only_marked_used_and_plans_keep_their_order() -> None:
    t = TierIndex(host_slots=2, disk_blocks=1)
    t.offload([(1, H[1]), (2, H[2])])
    assert t.offload([(3, H[1])]) == []  # the same bytes are there: no copy
    assert t.host_order() == [H[2], H[1]]
    # one plan that fills and demotes: Demote(slot 1) comes before ToHost(..., slot 1)
    ops = t.offload([(4, H[3]), (5, H[4])])
    assert ops == [Demote(1, H[2]), ToHost(4, 1, H[3]), DiskDrop(H[2]), Demote(0, H[1]),
                   ToHost(5, 0, H[4])]
    assert t.offload([(6, H[1])]) == []  # on disk already: marked used there


def test_pinned_entries_are_never_demoted_dropped_or_reused() -> None:
    t = TierIndex(host_slots=2, disk_blocks=1)
    t.offload([(1, H[1]), (2, H[2]), (3, H[3])])  # h1 -> disk, host [h2, h3]
    t.pin([H[1], H[2]])
    # host victim: h3 (h2 pinned); disk full of pinned h1: h3 has no room on disk -> dropped
    assert t.offload([(4, H[4])]) == [ToHost(4, 0, H[4])]
    assert (t.host_order(), t.disk_order()) == ([H[2], H[4]], [H[1]])
    t.pin([H[4]])
    assert t.offload([(5, H[5])]) == []  # every entry pinned: the block is not kept
    t.unpin([H[2], H[4]])
    t.pin([H[4]])
    t.unpin([H[4]])  # pins count: two pins, two unpins
    assert t.offload([(5, H[5])]) == [ToHost(5, 1, H[5])]  # h2 (LRU, unpinned) dropped
    with pytest.raises(KeyError):
        t.pin([H[9]])


def test_disk_only_tier_discard_and_drop_disk() -> None:
    t = TierIndex(disk_blocks=2)
    assert t.offload([(1, H[1]), (2, H[2]), (3, H[3])]) == [
        ToDisk(1, H[1]), ToDisk(2, H[2]), DiskDrop(H[1]), ToDisk(3, H[3])]
    assert t.chain_hits([H[2], H[3], H[1], H[2]]) == 2
    assert t.discard(H[2]) == "disk" and t.discard(H[2]) is None
    assert t.drop_disk() == [H[3]]
    assert t.offload([(4, H[4])]) == [] and t.stats().disk_capacity == 0
    h = TierIndex(host_slots=1)
    h.offload([(1, H[1])])
    assert h.discard(H[1]) == "host"
    assert h.offload([(2, H[2])]) == [ToHost(2, 0, H[2])]  # the discarded slot is free again
    with pytest.raises(ValueError):
        TierIndex(host_slots=-1)


# -- the scheduler over the tiers ------------------------------------------------------------

B = 4
A_PROMPT = list(range(10, 19))  # 9 tokens: full blocks [10..13], [14..17], then one token


def _sched(num_blocks: int, tiers: TierIndex) -> Scheduler:
    kv = KVCacheManager(num_blocks, B, tiers=tiers)
    return Scheduler(SchedulerConfig(capacity_policy=CapacityPolicy.MAX_UTILIZATION), kv)


def _req(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _run(s: Scheduler, rid: str) -> None:
    """Step until ``rid`` finished (every sampled token 7), offloading what each plan
    evicted as the engine does right after schedule()."""
    assert s.kv.tiers is not None
    for _ in range(20):
        out = s.schedule()
        s.kv.tiers.offload(s.kv.take_evicted())
        sampled = {r.request_id: 7 for r in out.scheduled if r.sample}
        if rid in [r.request_id for r in s.update_from_output(out, sampled)]:
            return
    raise AssertionError(f"{rid} did not finish")


def _integrity(s: Scheduler) -> None:
    st = s.kv.stats()
    assert st.free + st.used + st.cached == st.total


def _evict_a(tiers: TierIndex) -> Scheduler:
    """Run A (its 2 full blocks cached), then B whose 16 tokens take every block: A's
    cached blocks are evicted into the tiers."""
    s = _sched(4, tiers)
    s.add_request(_req("A", A_PROMPT))
    _run(s, "A")
    h0, h1 = hash_token_blocks(A_PROMPT, B)
    assert s.kv.pool.get_cached_block(h0) == 0 and s.kv.pool.get_cached_block(h1) == 1
    s.add_request(_req("B", list(range(50, 65))))  # 15 + 1 tokens: 4 blocks
    _run(s, "B")
    assert s.kv.pool.get_cached_block(h0) is None
    return s


def test_a_prefix_in_the_host_tier_is_loaded_then_only_the_rest_is_computed() -> None:
    tiers = TierIndex(host_slots=8)
    s = _evict_a(tiers)
    h0, h1 = hash_token_blocks(A_PROMPT, B)
    assert tiers.host_order() == [h1, h0]  # evicted tail first (the free queue's order)
    s.add_request(_req("C", A_PROMPT))
    out = s.schedule()
    assert out.scheduled == [] and s.kv.take_evicted() != []
    free_before = list(s.kv.block_ids("C"))
    assert out.kv_loads == [KVLoad("C", free_before[:2], [h0, h1])]
    c = s.get_request("C")
    assert c is not None and c.status == RequestStatus.WAITING_FOR_TIER_KV
    assert (c.num_computed_tokens, s.num_loading, s.num_waiting) == (0, 1, 0)
    assert s.schedule().scheduled == []  # nothing to compute while it loads
    _integrity(s)

    s.tier_kv_ready("C", 2)
    assert c.status == RequestStatus.RUNNING and c.num_computed_tokens == 8
    assert s.kv.pool.get_cached_block(h0) == free_before[0]  # back in the prefix cache
    out = s.schedule()
    [sr] = out.scheduled
    assert (sr.start_pos, sr.token_ids, sr.sample) == (8, [18], True)
    assert (c.num_cached_tokens, s.prefix_cache_hit_tokens) == (8, 8)
    assert s.prefix_cache_queries_tokens == 9 + 15 + 9
    s.update_from_output(out, {"C": 7})
    _integrity(s)


def test_a_partial_load_computes_the_blocks_that_failed() -> None:
    tiers = TierIndex(host_slots=8)
    s = _evict_a(tiers)
    s.add_request(_req("C", A_PROMPT))
    s.schedule()
    s.tier_kv_ready("C", 1)  # the second block failed its check
    [sr] = s.schedule().scheduled
    assert (sr.start_pos, sr.token_ids) == (4, A_PROMPT[4:])
    c = s.get_request("C")
    assert c is not None and c.num_cached_tokens == 4
    with pytest.raises(KeyError):
        s.tier_kv_ready("C", 1)  # not loading any more


def test_a_request_aborted_while_loading_drains_its_blocks_and_unpins() -> None:
    tiers = TierIndex(host_slots=1, disk_blocks=1)  # h1 -> host, then h0 demotes it
    s = _evict_a(tiers)
    h0, h1 = hash_token_blocks(A_PROMPT, B)
    assert (tiers.host_order(), tiers.disk_order()) == ([h0], [h1])
    s.add_request(_req("C", A_PROMPT))
    [load] = s.schedule().kv_loads
    assert load.block_hashes == [h0, h1]  # one from each tier
    s.abort_request("C")
    assert "C" in s.draining and s.num_loading == 0
    # unpinned again: the host entry can be demoted (the disk's h1 dropped for it)
    assert tiers.offload([(3, H[7])]) == [DiskDrop(h1), Demote(0, h0), ToHost(3, 0, H[7])]
    assert s.release_draining("C")
    _integrity(s)
    assert s.kv.stats().used == 0


def test_no_tier_hit_without_tiers_or_for_prompt_logprobs() -> None:
    s = _evict_a(TierIndex(host_slots=8))
    s.add_request(Request("C", A_PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    out = s.schedule()
    assert out.kv_loads == [] and out.scheduled[0].start_pos == 0


@pytest.mark.parametrize("host,disk", [(8, 0), (1, 0), (1, 1), (0, 2)])
def test_kv_events_count_a_block_cached_while_the_pool_or_a_tier_holds_it(host, disk) -> None:
    """What a KV-aware router rebuilds from the events equals pool + tiers, whatever moved
    where: a hash evicted into a tier is not reported removed; one that left the last tier
    is, then."""
    tiers = TierIndex(host_slots=host, disk_blocks=disk)
    s = _evict_a(tiers)
    s.add_request(_req("C", A_PROMPT))
    for _ in range(10):  # (loads are not run here: tier_kv_ready by hand)
        out = s.schedule()
        tiers.offload(s.kv.take_evicted())
        for load in out.kv_loads:
            s.tier_kv_ready(load.request_id, len(load.block_ids))
        done = s.update_from_output(out, {r.request_id: 7 for r in out.scheduled if r.sample})
        if any(r.request_id == "C" for r in done):
            break
    seen: set[int] = set()
    tiered: set[int] = set()  # what the events say left the pool for a tier
    for ev in s.kv.take_events():
        if ev.kind == "stored":
            seen.update(ev.block_hashes)
            (tiered.update if ev.medium is not None else tiered.difference_update)(
                ev.block_hashes)
            assert ev.medium in (None, "host", "disk")
        else:
            seen.difference_update(ev.block_hashes)
            tiered.difference_update(ev.block_hashes)
    pool = {b.block_hash for b in s.kv.pool.blocks if b.block_hash is not None}
    assert seen == pool | set(tiers.host_order()) | set(tiers.disk_order())
    assert tiered == seen - pool and tiered  # (the run evicted some into a tier)
    h0, _ = hash_token_blocks(A_PROMPT, B)
    assert h0 in seen  # A's first block: back in the pool or still in a tier
