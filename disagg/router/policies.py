"""Routing policies: which worker of one side (context or generation) gets a request.

A policy only ranks; the caller passes the candidates (healthy workers of the side, minus
those already tried for this request) and keeps the load counters (``Worker.active_requests``
/ ``active_tokens``: the router's own in-flight traffic, exact for it).
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


class RoutingPolicy(ABC):
    """Picks one worker among ``candidates`` (never empty) for ``request``.

    Rules every policy follows:
    - deterministic given the same state and call sequence (ties rotate round robin, so equal
      workers share the load instead of the first one taking everything);
    - never blocks or does I/O (it runs on the router's event loop for every request);
    - reads load from ``active_requests`` (or ``active_tokens`` with ``use_tokens``), which
      the router increments when it sends a request and decrements when the request ends.
    """

    name: str = ""
    needs_tokens = False  # the router must tokenize the prompt before calling select
    needs_kv_index = False  # the router must keep a KVIndex of each worker of this side

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._turn = 0

    def _rotate(self, items: Sequence[RoutedWorker]) -> RoutedWorker:
        worker = items[self._turn % len(items)]
        self._turn += 1
        return worker

    @abstractmethod
    def select(self, candidates: Sequence[RoutedWorker], request: RouteRequest) -> Decision:
        ...


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next candidate in turn."""

    name = "round_robin"

    def select(self, candidates: Sequence[RoutedWorker], request: RouteRequest) -> Decision:
        return Decision(self._rotate(candidates))


class LoadBalancingPolicy(RoutingPolicy):
    """Least active requests (``use_tokens``: least active prompt tokens); ties round robin."""

    name = "load_balancing"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.needs_tokens = config.use_tokens

    def select(self, candidates: Sequence[RoutedWorker], request: RouteRequest) -> Decision:
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
    """

    name = "kv_cache_aware"
    needs_tokens = True
    needs_kv_index = True

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.match_weight = float(config.option("match_weight"))
        self.load_weight = float(config.option("load_weight"))

    def select(self, candidates: Sequence[RoutedWorker], request: RouteRequest) -> Decision:
        matched = [w.kv.match(request.prompt) if w.kv is not None and request.prompt
                   is not None else 0 for w in candidates]
        sizes = [w.kv.tokens_per_block for w in candidates
                 if w.kv is not None and w.kv.tokens_per_block]
        unit = float(min(sizes)) if sizes else 1.0
        scores = []
        for w, m in zip(candidates, matched, strict=True):
            load = (w.active_tokens / unit) if self.config.use_tokens else w.active_requests
            scores.append(self.match_weight * (m / unit) - self.load_weight * load)
        best = max(scores)
        # Float noise must not break a tie between equal workers.
        tied = [i for i, s in enumerate(scores) if best - s <= 1e-9]
        i = tied[self._turn % len(tied)]
        self._turn += 1
        return Decision(candidates[i], matched[i], scores[i],
                        {w.url: s for w, s in zip(candidates, scores, strict=True)})


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobinPolicy, LoadBalancingPolicy, KVCacheAwarePolicy)}


def make_policy(config: PolicyConfig) -> RoutingPolicy:
    try:
        return POLICIES[config.type](config)
    except KeyError:
        raise ValueError(f"router.type: unknown router type {config.type!r}") from None
