"""The router's Prometheus metrics (``GET /metrics``), one registry per app.

- ``disagg_router_requests_total{endpoint, outcome}``: outcome = success | client_error
  (4xx, ours or a worker's) | upstream_error (every try failed, or a worker's 5xx) |
  no_worker | stream_error (failed after the first byte) | disconnected (client gone);
- ``disagg_router_ctx_latency_seconds``: the context call (prefill + first token);
  ``disagg_router_gen_first_byte_seconds`` / ``disagg_router_gen_latency_seconds``: the
  generation (or aggregated) call to its first byte and to its end;
  ``disagg_router_request_latency_seconds``: the whole request as the router saw it;
- ``disagg_router_retries_total{role, reason}``: a try on another worker (or a new prefill);
- ``disagg_router_migrations_total{kind}``: a request moved to another worker after its
  generation worker failed while serving it (``flow``): kind = resume (the client's stream
  goes on after the tokens it got) | restart (nothing had reached the client);
- ``disagg_router_routing_decisions_total{role, policy, worker}``;
  ``disagg_router_local_prefill_total``: conditional disaggregation skipped the context side;
  ``disagg_router_lease_releases_total``: context leases freed because no generation worker
  took the request;
- ``disagg_router_kv_matched_tokens_total{role, worker}`` and
  ``disagg_router_kv_prompt_tokens_total{role}``: prompt tokens found in the chosen worker's
  cache by kv_cache_aware routing, of all prompt tokens it routed;
- KV prefix reuse across workers (``peer_reuse``, ``flow``):
  ``disagg_router_kv_prefix_leases_total{outcome}``: the router's ``POST /kv_prefix`` calls to
  a peer, outcome = got (a lease) | none (the peer held nothing to lease) | failed (an error
  answer, a timeout, a malformed answer); their sum is the calls asked.
  ``disagg_router_kv_prefix_tokens_total``: prompt tokens leased (the got answers'
  ``num_tokens``); ``disagg_router_kv_prefix_releases_total``: leases the router gave back
  (the chosen worker did not take the request, or the peer's answer was unusable);
- ``disagg_router_kv_stream_requests_total{outcome}`` (``kv_streaming`` only): streamed |
  fell_back | failed | not_streamable (``stream_flow``);
- the planner and role switches: ``disagg_router_planner_decisions_total{action, from_role,
  to_role}`` (action = flip | hold; the roles empty when a hold names none),
  ``disagg_router_role_switches_total{outcome}`` (done | failed | timeout),
  ``disagg_router_role_switch_seconds``; ``disagg_router_pool_workers{role}`` (the pool's
  members, read at scrape time);
- ``disagg_request_phase_seconds{phase}``: each phase of a request that succeeded, as the
  router saw it (``disagg/timing.py``): route, context_call, handover, generation_call, decode
  (a kv_streaming request's context call, which runs beside the generation call, is observed
  as context_call too);
- per worker, read at scrape time: ``disagg_router_worker_active_requests{role, worker}``,
  ``disagg_router_worker_healthy{role, worker}``, ``disagg_router_kv_index_blocks{role,
  worker}``.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from disagg import timing

if TYPE_CHECKING:
    from disagg.router.membership import Membership

P = "disagg_router_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, float("inf"))


class RouterMetrics:
    def __init__(self, membership: Membership) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Per request: the event loop's own counters and histograms (``LoopCounter``).
        self.requests = LoopCounter(P + "requests", "Requests by endpoint and outcome.",
                                    ("endpoint", "outcome"), registry=r)
        self.ctx_latency = LoopHistogram(P + "ctx_latency_seconds", "Context call: sent -> "
                                         "answer.", LATENCY_BUCKETS, registry=r)
        self.gen_first_byte = LoopHistogram(P + "gen_first_byte_seconds", "Generation call: "
                                            "sent -> first byte.", LATENCY_BUCKETS, registry=r)
        self.gen_latency = LoopHistogram(P + "gen_latency_seconds", "Generation call: sent -> "
                                         "end.", LATENCY_BUCKETS, registry=r)
        self.request_latency = LoopHistogram(P + "request_latency_seconds", "Whole request at "
                                             "the router.", LATENCY_BUCKETS, registry=r)
        self.ttft = LoopHistogram(P + "time_to_first_token_seconds", "Streamed answers: the "
                                  "request in -> its first event (the first token) sent to the "
                                  "client: a client's TTFT less the network.", LATENCY_BUCKETS,
                                  registry=r)
        self.decisions = LoopCounter(P + "routing_decisions", "Workers chosen, by policy.",
                                     ("role", "policy", "worker"), registry=r)
        self.retries = Counter(P + "retries", "Tries on another worker, or new prefills.",
                               ["role", "reason"], registry=r)
        self.migrations = Counter(P + "migrations", "Requests moved to another worker after "
                                  "their generation worker failed serving them, by kind: "
                                  "resume (the stream goes on), restart (nothing was sent).",
                                  ["kind"], registry=r)
        self.lease_releases = Counter(P + "lease_releases", "Context leases the router freed "
                                      "because no generation worker took the request.",
                                      registry=r)
        self.local_prefill = Counter(P + "local_prefill", "Requests prefilled on the generation "
                                     "worker (conditional disaggregation).", registry=r)
        self.kv_matched = Counter(P + "kv_matched_tokens", "Prompt tokens found in the chosen "
                                  "worker's KV cache (kv_cache_aware).", ["role", "worker"],
                                  registry=r)
        self.kv_prompt = Counter(P + "kv_prompt_tokens", "Prompt tokens routed by "
                                 "kv_cache_aware.", ["role"], registry=r)
        self.kv_prefix = Counter(P + "kv_prefix_leases", "POST /kv_prefix calls to peers "
                                 "(peer_reuse), by outcome: got (a lease), none (nothing to "
                                 "lease), failed (error, timeout, malformed answer).",
                                 ["outcome"], registry=r)
        self.kv_prefix_tokens = Counter(P + "kv_prefix_tokens", "Prompt tokens of the prefix "
                                        "leases got from peers (peer_reuse).", registry=r)
        self.kv_prefix_releases = Counter(P + "kv_prefix_releases", "Prefix leases the router "
                                          "gave back: the chosen worker did not take the "
                                          "request (or the peer's answer was unusable).",
                                          registry=r)
        self.planner_decisions = Counter(P + "planner_decisions", "Planner decisions (flip, or "
                                         "hold while a side is over its SLO).",
                                         ["action", "from_role", "to_role"], registry=r)
        self.role_switches = Counter(P + "role_switches", "Role switches run by the router, "
                                     "by outcome.", ["outcome"], registry=r)
        self.role_switch_seconds = Histogram(P + "role_switch_seconds", "Role switch: start "
                                             "-> back in rotation in the new pool.",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_stream = Counter(P + "kv_stream_requests", "Disaggregated requests with "
                                 "kv_streaming on, by outcome: streamed, fell_back (the two "
                                 "calls after a failed streaming try), failed (no fallback "
                                 "left, or the client left), not_streamable (the two calls).",
                                 ["outcome"], registry=r)
        self.phases = LoopPhaseHistogram(
            timing.METRIC, "Seconds of one phase of a request as the router saw it "
            "(disagg/timing.py: route, context_call, handover, generation_call, decode), once "
            "per request that succeeded.", timing.ROUTER_PHASES,
            (*timing.PHASE_BUCKETS, float("inf")), registry=r)
        r.register(_WorkerCollector(membership))
        # Labelled children resolved once: prometheus_client's labels() checks and joins the
        # values under a lock on every call (~1.5% of the router's time under load).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached."""
        key = (id(metric), values)  # (the metrics live as long as self)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def forget_worker(self, role: str, policy: str, url: str) -> None:
        """Drop the series labelled with a worker that left the cluster: with dynamic
        membership every restart on a new port is a new ``worker`` label, and the registry
        would otherwise keep each one's series for the router's lifetime."""
        for metric, labels in ((self.decisions, (role, policy, url)),
                               (self.kv_matched, (role, url))):
            self._children.pop((id(metric), labels), None)
            with contextlib.suppress(KeyError):  # never used (older prometheus_client raises)
                metric.remove(*labels)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Cell:
    """One labelled series of a ``LoopCounter``."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopCounter(Collector):
    """A labelled counter for the event loop's thread alone: ``labels(*values).inc(n)`` adds
    to a float, no lock (prometheus_client takes one per increment; the router counts on its
    loop and renders /metrics there too). Exposed as prometheus_client's Counter is
    (``name_total`` and ``name_created`` per series)."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], *,
                 registry: CollectorRegistry) -> None:
        self.name, self.doc, self.label_names = name, doc, list(labels)
        self.cells: dict[tuple[str, ...], _Cell] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Cell:
        cell = self.cells.get(values)
        if cell is None:
            if len(values) != len(self.label_names):
                raise ValueError(f"{self.name}: labels {self.label_names}, got {values}")
            cell = self.cells[values] = _Cell()
        return cell

    def remove(self, *values: str) -> None:
        del self.cells[values]

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.label_names)
        for values, cell in list(self.cells.items()):
            family.add_metric(list(values), cell.value, created=cell.created)
        yield family


class LoopHistogram(Collector):
    """A histogram for the event loop's thread alone (as ``LoopCounter``): ``observe`` is one
    bisect and two additions (prometheus_client's takes a lock for the sum and for the
    bucket)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], *,
                 registry: CollectorRegistry) -> None:
        assert buckets[-1] == float("inf") and list(buckets) == sorted(buckets)
        self.name, self.doc, self.bounds = name, doc, list(buckets)
        self.counts = [0] * len(buckets)  # counts[i]: observations in (bounds[i-1], bounds[i]]
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        cumulative, total = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            total += n
            cumulative.append((floatToGoString(bound), total))
        family = HistogramMetricFamily(self.name, self.doc)
        family.add_metric([], cumulative, self.sum)
        family.add_sample(self.name + "_created", {}, self.created)
        yield family


class LoopPhaseHistogram(Collector):
    """A histogram with one label, ``phase`` (as ``LoopHistogram``: the event loop's thread
    alone); the ``phases`` given exist from the start, at 0. A request's whole timeline is
    handed over at once (``observe_timeline``: one append) and bucketed at the next scrape, or
    once ``PENDING`` of them wait: off the request's path."""

    # (small: what waits is live objects, a few per request, and batching 32 saves as much
    # per-observation work as batching thousands)
    PENDING = 32

    def __init__(self, name: str, doc: str, phases: tuple[str, ...],
                 buckets: tuple[float, ...], *, registry: CollectorRegistry) -> None:
        assert buckets[-1] == float("inf") and list(buckets) == sorted(buckets)
        self.name, self.doc, self.bounds = name, doc, list(buckets)
        self.counts: dict[str, list[int]] = {p: [0] * len(buckets) for p in phases}
        self.sums: dict[str, float] = dict.fromkeys(phases, 0.0)
        self.created = time.time()
        self._pending: list[timing.Timeline] = []
        registry.register(self)

    def observe_timeline(self, tl: timing.Timeline) -> None:
        """Each phase of ``tl`` (``Timeline.phases``), observed by the next scrape."""
        pending = self._pending
        pending.append(tl)
        if len(pending) >= self.PENDING:
            self._drain()

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        counts, sums, bounds, find = self.counts, self.sums, self.bounds, bisect.bisect_left
        for tl in pending:
            at = tl.start
            for name, t in tl.ends:  # (timing.consecutive, inlined: the router's hot loop)
                if t > at:
                    d, at = t - at, t
                else:
                    d = 0.0
                c = counts.get(name)
                if c is None:
                    c = counts[name] = [0] * len(bounds)
                    sums[name] = 0.0
                c[find(bounds, d)] += 1
                sums[name] += d

    def observe(self, phase: str, value: float) -> None:
        counts = self.counts.get(phase)
        if counts is None:
            counts = self.counts[phase] = [0] * len(self.bounds)
            self.sums[phase] = 0.0
        counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sums[phase] += value

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        self._drain()
        family = HistogramMetricFamily(self.name, self.doc, labels=["phase"])
        for phase, counts in list(self.counts.items()):
            cumulative, total = [], 0
            for bound, n in zip(self.bounds, counts, strict=True):
                total += n
                cumulative.append((floatToGoString(bound), total))
            family.add_metric([phase], cumulative, self.sums[phase])
            family.add_sample(self.name + "_created", {"phase": phase}, self.created)
        yield family


class _WorkerCollector(Collector):
    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "worker"]
        active = GaugeMetricFamily(P + "worker_active_requests", "Router requests in flight on "
                                   "the worker.", labels=labels)
        healthy = GaugeMetricFamily(P + "worker_healthy", "1 while the worker is in rotation.",
                                    labels=labels)
        blocks = GaugeMetricFamily(P + "kv_index_blocks", "Block hashes in the router's index "
                                   "of the worker's KV cache.", labels=labels)
        pool_size = GaugeMetricFamily(P + "pool_workers", "Workers in the pool (in rotation "
                                      "or not).", labels=["role"])
        for pool, workers in self.membership.pools.items():
            pool_size.add_metric([pool], len(workers))
            for w in workers:
                active.add_metric([pool, w.url], w.active_requests)
                healthy.add_metric([pool, w.url], 1.0 if w.healthy else 0.0)
                if w.kv is not None:
                    blocks.add_metric([pool, w.url], len(w.kv.blocks))
        yield active
        yield healthy
        yield blocks
        yield pool_size
