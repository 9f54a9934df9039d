"""Routing policies and the KV index, with fake workers and fake /kv_events answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

import pytest

from disagg.contracts.cluster import PolicyConfig
from disagg.kv_cache.events import KVEventLog
from disagg.kv_cache.hashing import BLOCK_HASH_SCHEME, hash_token_blocks
from disagg.kv_cache.manager import KVCacheManager
from disagg.request import Request, SamplingParams
from disagg.router.kv_index import KVEventsError, KVIndex, PromptHashes
from disagg.router.policies import (
    KVCacheAwarePolicy,
    LoadBalancingPolicy,
    RoundRobinPolicy,
    RouteRequest,
    make_policy,
)


@dataclass(eq=False)
class FakeWorker:
    url: str
    active_requests: int = 0
    active_tokens: int = 0
    kv: KVIndex | None = field(default_factory=KVIndex)
    kv_peer_reuse: bool = False


def _policy(kind: str, use_tokens: bool = False, **options: float | bool):
    return make_policy(PolicyConfig(kind, use_tokens, MappingProxyType(options)))


def _answer(worker_id: str, next_seq: int, events=(), snapshot=None, block_size: int = 4,
            scheme: str = BLOCK_HASH_SCHEME) -> dict:
    return {"worker_id": worker_id, "tokens_per_block": block_size, "block_hash_scheme": scheme,
            "next_seq": next_seq, "snapshot": snapshot,
            "events": [{"seq": s, "type": t, "block_hashes": list(h)} for s, t, h in events]}


def _holding(url: str, tokens: list[int], block_size: int = 4, **kw) -> FakeWorker:
    w = FakeWorker(url, **kw)
    assert w.kv is not None
    w.kv.apply(_answer(url, 0, snapshot=hash_token_blocks(tokens, block_size),
                       block_size=block_size))
    return w


def test_round_robin_cycles_over_candidates() -> None:
    ws = [FakeWorker(f"w{i}") for i in range(3)]
    policy = _policy("round_robin")
    assert isinstance(policy, RoundRobinPolicy) and not policy.needs_tokens
    picks = [policy.select(ws, RouteRequest()).worker.url for _ in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]
    # a retry excludes the failed worker: the candidates shrink, rotation goes on
    assert policy.select(ws[1:], RouteRequest()).worker.url in ("w1", "w2")


def test_load_balancing_least_requests_ties_round_robin() -> None:
    a, b, c = FakeWorker("a", 2), FakeWorker("b", 0), FakeWorker("c", 0)
    policy = _policy("load_balancing")
    assert isinstance(policy, LoadBalancingPolicy) and not policy.needs_tokens
    picks = {policy.select([a, b, c], RouteRequest()).worker.url for _ in range(4)}
    assert picks == {"b", "c"}  # both least loaded, shared
    b.active_requests = 5
    assert policy.select([a, b, c], RouteRequest()).worker.url == "c"


def test_load_balancing_by_tokens() -> None:
    a, b = FakeWorker("a", 1, 10), FakeWorker("b", 0, 500)
    policy = _policy("load_balancing", use_tokens=True)
    assert policy.needs_tokens
    assert policy.select([a, b], RouteRequest(10)).worker.url == "a"  # fewer tokens, more reqs
    assert _policy("load_balancing").select([a, b], RouteRequest(10)).worker.url == "b"


def test_kv_aware_prefers_the_worker_holding_the_prefix() -> None:
    prefix = list(range(100, 164))  # 16 blocks of 4
    a = _holding("a", prefix)
    b = _holding("b", prefix[:8])
    c = FakeWorker("c")
    policy = _policy("kv_cache_aware")
    assert isinstance(policy, KVCacheAwarePolicy) and policy.needs_kv_index
    req = RouteRequest.from_token_ids(prefix + [7, 8, 9])
    d = policy.select([c, b, a], req)
    assert d.worker is a and d.matched_tokens == 64 and d.score == pytest.approx(16.0)
    assert d.scores == {"c": 0.0, "b": 2.0, "a": 16.0}
    # load counts against the match: 0.25 per active request
    a.active_requests = 57  # 16 - 14.25 < 2 - 0
    assert policy.select([c, b, a], req).worker is b
    # no match anywhere: least loaded wins (ties round robin)
    other = RouteRequest.from_token_ids([1, 2, 3, 4, 5])
    assert policy.select([c, b, a], other).worker.url in ("c", "b")


def test_kv_aware_weights_are_options() -> None:
    prefix = list(range(32))
    a = _holding("a", prefix, active_requests=3)
    b = FakeWorker("b")
    req = RouteRequest.from_token_ids(prefix)
    assert _policy("kv_cache_aware").select([a, b], req).worker is a  # 8 - 0.75 > 0
    assert _policy("kv_cache_aware", load_weight=4.0).select([a, b], req).worker is b
    assert _policy("kv_cache_aware", match_weight=0.0).select([a, b], req).worker is b


def test_kv_aware_mixed_block_sizes_count_in_smallest_blocks() -> None:
    prefix = list(range(64))
    a = _holding("a", prefix[:32], block_size=16)  # 32 tokens matched
    b = _holding("b", prefix[:24], block_size=8)  # 24 tokens matched
    d = _policy("kv_cache_aware").select([b, a], RouteRequest.from_token_ids(prefix))
    assert d.worker is a and d.matched_tokens == 32 and d.score == pytest.approx(4.0)


def test_kv_index_events_and_resync() -> None:
    tokens = list(range(40))
    h = hash_token_blocks(tokens, 4)  # 10 blocks
    idx = KVIndex()
    assert not idx.usable and idx.match(PromptHashes(tokens)) == 0
    idx.apply(_answer("w1", 2, events=[(0, "stored", h[:6]), (1, "removed", h[4:6])]))
    assert idx.usable and idx.next_seq == 2 and idx.match(PromptHashes(tokens)) == 16
    idx.apply(_answer("w1", 3, events=[(2, "stored", h[4:])]))
    assert idx.match(PromptHashes(tokens)) == 40
    # a gap in the chain ends the match
    idx.apply(_answer("w1", 4, events=[(3, "removed", h[2:3])]))
    assert idx.match(PromptHashes(tokens)) == 8
    # fell behind: a snapshot replaces everything
    idx.apply(_answer("w1", 90, snapshot=h[:3]))
    assert idx.blocks == set(h[:3]) and idx.next_seq == 90 and idx.resyncs == 1


def test_kv_index_restart_with_another_block_size_is_never_matched_stale() -> None:
    tokens = list(range(64))
    idx = KVIndex()
    idx.apply(_answer("w1", 1, events=[(0, "stored", hash_token_blocks(tokens, 4))]))
    assert idx.match(PromptHashes(tokens)) == 64
    # Restarted with B=16 and already 3 events in: its events (not from 0) are no base.
    h16 = hash_token_blocks(tokens, 16)
    idx.apply(_answer("w2", 3, events=[(1, "stored", h16[:2])], block_size=16))
    assert not idx.usable and idx.match(PromptHashes(tokens)) == 0 and idx.next_seq == 0
    # The next poll (since=0) gets the full picture in the new block size.
    idx.apply(_answer("w2", 3, snapshot=h16[:2], block_size=16))
    assert idx.tokens_per_block == 16 and idx.match(PromptHashes(tokens)) == 32
    # a scheme we cannot reproduce: nothing matches
    with pytest.raises(KVEventsError, match="block_hash_scheme"):
        idx.apply(_answer("w2", 4, scheme="xxhash"))
    assert idx.match(PromptHashes(tokens)) == 0


def test_kv_index_rejects_malformed_answers_without_change() -> None:
    idx = KVIndex()
    idx.apply(_answer("w", 1, events=[(0, "stored", [5])]))
    with pytest.raises(KVEventsError):
        idx.apply({"worker_id": "w", "next_seq": 2})
    with pytest.raises(KVEventsError):
        idx.apply(_answer("w", 2, events=[(1, "stored", ["x"])]))
    assert idx.blocks == {5} and idx.next_seq == 1


def test_router_hashes_match_a_real_workers_events() -> None:
    """The index fed by a real KV manager's event log matches prompts as the manager does."""
    B = 4
    kv = KVCacheManager(num_blocks=32, block_size=B)
    log = KVEventLog(max_events=8)
    prompt = list(range(3, 25))  # 22 tokens: 5 full blocks
    req = Request("r1", prompt, SamplingParams(max_tokens=1))
    kv.allocate_slots(req, len(prompt))
    kv.cache_blocks(req, len(prompt))
    log.append(kv.take_events())

    def answer(since: int) -> dict:
        batch = log.since(since)
        return _answer("w", batch.next_seq, events=batch.events, snapshot=batch.snapshot,
                       block_size=B)

    idx = KVIndex()
    idx.apply(answer(idx.next_seq))
    follow = prompt[:12] + [99, 98, 97, 96, 95]
    computed, n = kv.get_computed_blocks(Request("r2", follow, SamplingParams(max_tokens=1)))
    assert idx.match(PromptHashes(follow)) == 12 == len(computed) * B == n
    # many events later the index falls behind the log's window and resyncs from a snapshot
    kv.free(req)
    for i in range(20):
        other = Request(f"x{i}", [1000 + i] * 8, SamplingParams(max_tokens=1))
        kv.allocate_slots(other, 8)
        kv.cache_blocks(other, 8)
        kv.free(other)
        log.append(kv.take_events())
    idx.apply(answer(idx.next_seq))
    assert idx.resyncs == 1
    assert idx.match(PromptHashes(follow)) == kv.get_computed_blocks(
        Request("r3", follow, SamplingParams(max_tokens=1)))[1]


# ---- peer_reuse: KV prefix reuse across workers ----------------------------------------------


def _peer_policy(**options: float | bool) -> KVCacheAwarePolicy:
    policy = _policy("kv_cache_aware", **{"peer_reuse": True, "peer_min_tokens": 16,
                                          **options})
    assert isinstance(policy, KVCacheAwarePolicy) and policy.needs_peers
    return policy


def test_peer_reuse_scores_a_peers_prefix_at_peer_weight() -> None:
    prompt = list(range(200, 280))  # 80 tokens: 20 blocks of 4
    req = RouteRequest.from_token_ids(prompt)
    a = _holding("a", prompt[:64], kv_peer_reuse=True)  # 64 tokens, 16 blocks
    b = _holding("b", prompt[:8], kv_peer_reuse=True, active_requests=0)
    a.active_requests = 40  # 16 - 10 = 6
    policy = _peer_policy()
    d = policy.select([a, b], req, peers=[a, b])
    # b: 8 own tokens + 0.5 * (64 - 8) = 36 tokens = 9 blocks; a: 16 - 0.25 * 40 = 6
    assert d.scores == {"a": pytest.approx(6.0), "b": pytest.approx(9.0)}
    assert d.worker is b and d.matched_tokens == 8
    assert d.peer is a and d.peer_tokens == 64
    # peer_weight 0: a peer's blocks count nothing, b's own 2 blocks lose to a's 6
    d = _peer_policy(peer_weight=0.0).select([a, b], req, peers=[a, b])
    assert d.worker is a and d.peer is None and d.peer_tokens == 0
    # without peer_reuse the peers change nothing (and none is named)
    d = _policy("kv_cache_aware").select([a, b], req, peers=[a, b])
    assert d.scores == {"a": pytest.approx(6.0), "b": pytest.approx(2.0)} and d.peer is None


def test_peer_reuse_names_no_peer_below_min_tokens() -> None:
    prompt = list(range(300, 400))
    req = RouteRequest.from_token_ids(prompt)
    a = _holding("a", prompt[:40], kv_peer_reuse=True, active_requests=100)
    b = _holding("b", prompt[:20], kv_peer_reuse=True)
    # advantage 40 - 20 = 20 tokens: a pull at min 16, none at min 24 (nor any credit)
    d = _peer_policy().select([a, b], req, peers=[a, b])
    assert d.worker is b and d.peer is a and d.peer_tokens == 40
    assert d.score == pytest.approx((20 + 0.5 * 20) / 4)
    d = _peer_policy(peer_min_tokens=24).select([a, b], req, peers=[a, b])
    assert d.worker is b and d.peer is None and d.score == pytest.approx(20 / 4)


def test_peer_reuse_needs_both_ends_to_advertise_it() -> None:
    prompt = list(range(500, 600))
    req = RouteRequest.from_token_ids(prompt)
    policy = _peer_policy()
    # a peer without kv_peer_reuse (it cannot lease) is no peer
    a = _holding("a", prompt[:64], kv_peer_reuse=False, active_requests=100)
    b = FakeWorker("b", kv_peer_reuse=True)
    d = policy.select([a, b], req, peers=[a, b])
    assert d.worker is b and d.peer is None and d.scores["b"] == 0.0
    # a candidate without kv_peer_reuse (it cannot pull) gets no credit and names no peer
    a.kv_peer_reuse = True
    b.kv_peer_reuse = False
    d = policy.select([a, b], req, peers=[a, b])
    assert d.worker is b and d.peer is None and d.scores["b"] == 0.0
    b.kv_peer_reuse = True
    d = policy.select([a, b], req, peers=[a, b])
    assert d.worker is b and d.peer is a and d.scores["b"] == pytest.approx(8.0)


def test_peer_reuse_a_candidate_is_not_its_own_peer() -> None:
    """The best peer of the candidate holding the longest prefix is the next best one; a
    peer outside the candidates (another pool, a tried worker) counts too."""
    prompt = list(range(700, 800))
    req = RouteRequest.from_token_ids(prompt)
    a = _holding("a", prompt[:80], kv_peer_reuse=True)
    b = _holding("b", prompt[:48], kv_peer_reuse=True)
    g = _holding("g", prompt[:96], kv_peer_reuse=True)  # a generation worker, say
    policy = _peer_policy(load_weight=0.0)
    d = policy.select([a, b], req, peers=[a, b, g])
    # a: 80 + 0.5 * 16 = 88; b: 48 + 0.5 * 48 = 72
    assert d.worker is a and d.peer is g and d.peer_tokens == 96
    assert d.scores == {"a": pytest.approx(22.0), "b": pytest.approx(18.0)}
    # with g gone, a's best peer would be b (shorter: none), b's is a
    d = policy.select([b], req, peers=[a, b])
    assert d.worker is b and d.peer is a and d.peer_tokens == 80
    d = policy.select([a], req, peers=[a, b])
    assert d.peer is None and d.score == pytest.approx(20.0)


def test_peer_reuse_ties_are_deterministic() -> None:
    """Equal peers: the least loaded, then the first in the peers' order; equal candidates
    rotate as always."""
    prompt = list(range(900, 1000))
    req = RouteRequest.from_token_ids(prompt)
    p1 = _holding("p1", prompt[:64], kv_peer_reuse=True, active_requests=2)
    p2 = _holding("p2", prompt[:64], kv_peer_reuse=True, active_requests=1)
    p3 = _holding("p3", prompt[:64], kv_peer_reuse=True, active_requests=1)
    c1, c2 = FakeWorker("c1", kv_peer_reuse=True), FakeWorker("c2", kv_peer_reuse=True)
    policy = _peer_policy()
    picks = [policy.select([c1, c2], req, peers=[p1, p2, p3]) for _ in range(4)]
    assert [d.worker.url for d in picks] == ["c1", "c2", "c1", "c2"]
    assert {d.peer.url for d in picks if d.peer is not None} == {"p2"}
    assert all(d.peer_tokens == 64 for d in picks)
    p2.active_requests = 5
    assert policy.select([c1, c2], req, peers=[p1, p2, p3]).peer is p3
    # the same state and call sequence: the same decisions
    again = _peer_policy()
    p2.active_requests = 1
    assert [again.select([c1, c2], req, peers=[p1, p2, p3]).worker.url
            for _ in range(4)] == [d.worker.url for d in picks]


def test_peer_reuse_ignores_peers_with_unusable_indexes() -> None:
    prompt = list(range(40, 140))
    req = RouteRequest.from_token_ids(prompt)
    stale = FakeWorker("stale", kv_peer_reuse=True)  # never synced: matches nothing
    none = FakeWorker("none", kv=None, kv_peer_reuse=True)
    c = FakeWorker("c", kv_peer_reuse=True)
    d = _peer_policy().select([c], req, peers=[stale, none])
    assert d.worker is c and d.peer is None
    d = _peer_policy().select([c], RouteRequest(), peers=[stale])  # no prompt known
    assert d.peer is None


def test_a_peers_blocks_in_an_offload_tier_count_peer_tier_weight() -> None:
    """KV events place a block that left a worker's KV cache for a tier (``medium``): the
    index keeps it a hit, marked tiered until it is stored in the pool again or removed; a
    peer's tiered blocks are credited at peer_tier_weight."""
    prompt = list(range(200, 280))  # 80 tokens: 20 blocks of 4
    req = RouteRequest.from_token_ids(prompt)
    a = _holding("a", prompt[:64], kv_peer_reuse=True, active_requests=40)
    b = _holding("b", prompt[:8], kv_peer_reuse=True)
    hashes = hash_token_blocks(prompt[:64], 4)
    assert a.kv is not None
    # blocks 8..15 (tokens 32..63) went to a's host tier
    a.kv.apply({**_answer("a", 2), "events": [
        {"seq": 1, "type": "stored", "block_hashes": hashes[8:16], "medium": "host"}]})
    assert a.kv.match(req.prompt) == 64  # still hits
    assert a.kv.match_tiered(req.prompt) == [False] * 8 + [True] * 8
    d = _peer_policy(peer_tier_weight=0.25).select([a, b], req, peers=[a, b])
    # b: 8 + 0.5 * (32 - 8) + 0.25 * (64 - 32) = 28 tokens = 7 blocks
    assert d.scores["b"] == pytest.approx(7.0) and d.peer is a
    # back in a's KV cache (stored without a medium): full peer_weight again
    a.kv.apply({**_answer("a", 3), "events": [
        {"seq": 2, "type": "stored", "block_hashes": hashes[8:16]}]})
    assert not any(a.kv.match_tiered(req.prompt))
    d = _peer_policy(peer_tier_weight=0.25).select([a, b], req, peers=[a, b])
    assert d.scores["b"] == pytest.approx(9.0)
    # removed: gone from both
    a.kv.apply({**_answer("a", 4), "events": [
        {"seq": 3, "type": "removed", "block_hashes": hashes[12:16]}]})
    assert a.kv.match(req.prompt) == 48 and not a.kv.tiered
