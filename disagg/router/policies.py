"""Routing policies: which worker of one side (context or generation) gets a request.

A policy only ranks; the caller passes the candidates (healthy workers of the side, minus
those already tried for this request) and keeps the load counters (``Worker.active_requests``
/ ``active_tokens``: the router's own in-flight traffic, exact for it). A policy with
``needs_peers`` (kv_cache_aware with ``peer_reuse``) is also passed the peers: the workers, of
either side, whose cached prefix a candidate could pull (``Membership.peers``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from disagg.contracts.cluster import PolicyConfig
from disagg.router.kv_index import KVIndex, PromptHashes


class RoutedWorker(Protocol):
    """What a policy reads of a worker (``membership.Worker`` has it)."""

    url: str
    active_requests: int
    active_tokens: int
    kv: KVIndex | None
    kv_peer_reuse: bool  # it serves POST /kv_prefix and pulls a request's kv_prefix


@dataclass
class RouteRequest:
    """What the policies know of a request: its prompt tokens when a policy needs them."""

    num_tokens: int = 0  # prompt tokens (0 when unknown)
    prompt: PromptHashes | None = None  # token ids + their block hashes per block size

    @classmethod
    def from_token_ids(cls, token_ids: Sequence[int]) -> RouteRequest:
        return cls(len(token_ids), PromptHashes(token_ids))


@dataclass(frozen=True)
class Decision:
    worker: RoutedWorker
    matched_tokens: int = 0  # prompt tokens found in the worker's KV cache (kv_cache_aware)
    score: float | None = None
    scores: dict[str, float] = field(default_factory=dict)  # every candidate's (debugging)
    # peer_reuse: the peer whose cached prefix ``worker`` should pull, and that prefix's length
    # in prompt tokens as the router's index of the peer has it (None / 0: no pull)
    peer: RoutedWorker | None = None
    peer_tokens: int = 0


class RoutingPolicy(ABC):
    """Picks one worker among ``candidates`` (never empty) for ``request``.

    Rules every policy follows:
    - deterministic given the same state and call sequence (ties rotate round robin, so equal
      workers share the load instead of the first one taking everything);
    - never blocks or does I/O (it runs on the router's event loop for every request);
    - reads load from ``active_requests`` (or ``active_tokens`` with ``use_tokens``), which
      the router increments when it sends a request and decrements when the request ends;
    - ``peers`` (passed only when ``needs_peers``) are read like the candidates: their KV
      indexes and ``kv_peer_reuse``, nothing else.
    """

    name: str = ""
    needs_tokens = False  # the router must tokenize the prompt before calling select
    needs_kv_index = False  # the router must keep a KVIndex of each worker of this side
    needs_peers = False  # select takes the peers (the router keeps every worker's KVIndex)

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._turn = 0

    def _rotate(self, items: Sequence[RoutedWorker]) -> RoutedWorker:
        worker = items[self._turn % len(items)]
        self._turn += 1
        return worker

    @abstractmethod
    def select(self, candidates: Sequence[RoutedWorker], request: RouteRequest,
               peers: Sequence[RoutedWorker] = ()) -> Decision:
        ...


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next candidate in turn."""

    name = "round_robin"

    def select(self, candidates: Sequence[RoutedWorker], request: RouteRequest,
               peers: Sequence[RoutedWorker] = ()) -> Decision:
        return Decision(self._rotate(candidates))


class LoadBalancingPolicy(RoutingPolicy):
    """Least active requests (``use_tokens``: least active prompt tokens); ties round robin."""

    name = "load_balancing"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.needs_tokens = config.use_tokens

    def select(self, candidates: Sequence[RoutedWorker], request: RouteRequest,
               peers: Sequence[RoutedWorker] = ()) -> Decision:
        if self.config.use_tokens:
            loads = [w.active_tokens for w in candidates]
        else:
            loads = [w.active_requests for w in candidates]
        least = min(loads)
        return Decision(self._rotate([w for w, x in zip(candidates, loads, strict=True)
                                      if x == least]))


class KVCacheAwarePolicy(RoutingPolicy):
    """Most cached prefix against load, scored as TensorRT-LLM's KV-cache-aware router scores
    it: a worker that already holds more of the prompt's leading blocks wins, unless it is busier
    by more than those blocks are worth.

    ``score = match_weight * matched_blocks - load_weight * load``, highest wins, ties round
    robin. ``matched_blocks`` = leading prompt blocks found in the worker's KV index, counted in
    units of the smallest block size among the candidates (with equal block sizes: blocks).
    ``load`` = active requests, or with ``use_tokens`` active prompt tokens in the same block
    units. Defaults: match_weight 1, load_weight 0.25. A worker whose index is not synced yet
    (or whose block size just changed) matches nothing.

    ``peer_reuse`` (KV prefix reuse across workers): a candidate ``w`` that advertises
    ``kv_peer_reuse`` and matches ``m_w`` tokens itself, while a peer other than ``w`` holds
    ``M`` (the longest match among the ``peers``), is scored with the effective match ``m_w +
    peer_weight * (M - m_w)`` when ``M - m_w >= peer_min_tokens``: ``w`` would pull the peer's
    blocks, which costs more than holding them (``peer_weight`` < 1) and less than computing
    them. Below that advantage, or for a candidate that cannot pull, no pull is made and none
    is credited. The Decision then names the peer (the longest match; equal ones: the least
    loaded, then the first in ``peers``' order) and its ``peer_tokens`` (``M``). A peer's
    block that its KV events place in an offload tier (``KVIndex.tiered``) counts
    ``peer_tier_weight`` instead of ``peer_weight``: it is copied back before the transfer.
    """

    name = "kv_cache_aware"
    needs_tokens = True
    needs_kv_index = True

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.match_weight = float(config.option("match_weight"))
        self.load_weight = float(config.option("load_weight"))
        self.needs_peers = bool(config.option("peer_reuse"))
        self.peer_weight = float(config.option("peer_weight"))
        self.peer_min_tokens = int(config.option("peer_min_tokens"))
        self.peer_tier_weight = float(config.option("peer_tier_weight"))

    def select(self, candidates: Sequence[RoutedWorker], request: RouteRequest,
               peers: Sequence[RoutedWorker] = ()) -> Decision:
        prompt = request.prompt
        matched = [w.kv.match(prompt) if w.kv is not None and prompt is not None else 0
                   for w in candidates]
        sizes = [w.kv.tokens_per_block for w in candidates
                 if w.kv is not None and w.kv.tokens_per_block]
        unit = float(min(sizes)) if sizes else 1.0
        pulls: list[tuple[RoutedWorker, int] | None] = [None] * len(candidates)
        if self.needs_peers and peers and prompt is not None:
            pulls = self._pulls(candidates, matched, peers, prompt)
        scores = []
        for w, m, pull in zip(candidates, matched, pulls, strict=True):
            load = (w.active_tokens / unit) if self.config.use_tokens else w.active_requests
            effective = m if pull is None else m + self._credit(pull[0], m, pull[1], prompt)
            scores.append(self.match_weight * (effective / unit) - self.load_weight * load)
        best = max(scores)
        # Float noise must not break a tie between equal workers.
        tied = [i for i, s in enumerate(scores) if best - s <= 1e-9]
        i = tied[self._turn % len(tied)]
        self._turn += 1
        pull = pulls[i]
        return Decision(candidates[i], matched[i], scores[i],
                        {w.url: s for w, s in zip(candidates, scores, strict=True)},
                        peer=None if pull is None else pull[0],
                        peer_tokens=0 if pull is None else pull[1])

    def _credit(self, peer: RoutedWorker, m: int, M: int, prompt: PromptHashes | None
                ) -> float:
        """Tokens credited for pulling the peer's tokens [m, M): ``peer_weight`` each, or
        ``peer_tier_weight`` for those in a block the peer holds in an offload tier."""
        assert peer.kv is not None and prompt is not None
        B = peer.kv.tokens_per_block or 1
        tiered = peer.kv.match_tiered(prompt)
        # peer blocks [0, len(tiered)) hold tokens [i*B, (i+1)*B); the pull's [m, M)
        tier_tokens = sum(max(0, min(M, (i + 1) * B) - max(m, i * B))
                          for i, t in enumerate(tiered) if t)
        return self.peer_weight * (M - m - tier_tokens) + self.peer_tier_weight * tier_tokens

    def _pulls(self, candidates: Sequence[RoutedWorker], matched: Sequence[int],
               peers: Sequence[RoutedWorker], prompt: PromptHashes
               ) -> list[tuple[RoutedWorker, int] | None]:
        """Per candidate: the peer it would pull from and that peer's match, or None."""
        # The two best peers (a candidate that is itself the best peer takes the second).
        first: tuple[int, int, RoutedWorker] | None = None  # (tokens, -load, peer)
        second: tuple[int, int, RoutedWorker] | None = None
        known = {w.url: m for w, m in zip(candidates, matched, strict=True)}
        for p in peers:
            if not p.kv_peer_reuse or p.kv is None:
                continue
            m = known.get(p.url)
            if m is None:
                m = p.kv.match(prompt)
            if m <= 0:
                continue
            key = (m, -p.active_requests)
            if first is None or key > first[:2]:
                first, second = (m, -p.active_requests, p), first
            elif second is None or key > second[:2]:
                second = (m, -p.active_requests, p)
        if first is None:
            return [None] * len(candidates)
        out: list[tuple[RoutedWorker, int] | None] = []
        for w, m in zip(candidates, matched, strict=True):
            best = second if first[2].url == w.url else first
            if (w.kv_peer_reuse and best is not None
                    and best[0] - m >= self.peer_min_tokens):
                out.append((best[2], best[0]))
            else:
                out.append(None)
        return out


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobinPolicy, LoadBalancingPolicy, KVCacheAwarePolicy)}


def make_policy(config: PolicyConfig) -> RoutingPolicy:
    try:
        return POLICIES[config.type](config)
    except KeyError:
        raise ValueError(f"router.type: unknown router type {config.type!r}") from None
