"""Prometheus metrics of one worker server.

Every server owns a ``CollectorRegistry`` (never the process-global one) so that several servers
can live in one process (tests, a router beside workers). Two sources feed it:

- per-request observations made by the server as outputs stream out (latency histograms,
  token counters, finish reasons);
- a scrape-time collector reading ``engine.stats()`` (queue depths, last step's batch, KV blocks,
  prefix cache), so engine-side numbers are never stale and cost nothing between scrapes.

Why batches are small (seed 000) should be readable from these: compare
``disagg_iteration_batch_size`` with ``disagg_num_requests_running`` / ``_waiting`` (too little
load, or requests waiting), ``disagg_kv_blocks_used`` with ``disagg_kv_blocks_total`` (KV-capped),
``disagg_iteration_num_tokens`` with ``disagg_max_num_tokens`` (token-budget-capped), and the
``disagg_request_generation_tokens`` histogram (1-token outputs leave after one step).

Per-request phases (``disagg/timing.py``): ``disagg_request_phase_seconds{phase}``, one
observation per phase of every request that succeeded (admission, queue, prefill,
context_answer, kv_wait, kv_transfer, kv_install, first_token, decode, finish; each label set
exists from the start, at 0).

Speculative decoding (a worker with ``speculative_config``) adds the ``disagg_spec_decode_*``
counters (drafts, draft tokens, accepted tokens, accepted tokens by draft position) and two
gauges derived from them: the acceptance rate and the tokens emitted per verification forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from disagg import timing

if TYPE_CHECKING:
    from disagg.engine.client import EngineClient

logger = logging.getLogger(__name__)

PREFIX = "disagg_"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class ServerMetrics:
    """The collectors of one server; ``render()`` is the ``/metrics`` body."""

    def __init__(self, engine: EngineClient, model_name: str, max_batch_size: int | None = None,
                 max_num_tokens: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        self.requests_finished = Counter(
            PREFIX + "requests_finished", "Engine requests finished, by finish reason "
            "(stop, length, abort, error); each of n choices is one engine request.",
            labels + ["finish_reason"], registry=reg)
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected", "HTTP requests refused before reaching the engine, "
            "by reason (invalid_request, unauthorized, model_not_found, queue_full, draining, "
            "engine_unavailable).", labels + ["reason"], registry=reg)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of admitted engine requests.", labels,
            registry=reg)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens (counted as they stream out).",
            labels, registry=reg)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from request arrival at the server "
            "to its first generated token.", labels, buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between successive generated tokens "
            "of one request.", labels, buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival at the server to the "
            "request's last output.", labels, buckets=E2E_BUCKETS, registry=reg)
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Time from arrival in the engine to first "
            "being scheduled.", labels, buckets=TTFT_BUCKETS, registry=reg)
        self.prompt_len = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt length of finished requests.", labels,
            buckets=TOKEN_BUCKETS, registry=reg)
        self.gen_len = Histogram(
            PREFIX + "request_generation_tokens", "Generated tokens of finished requests.",
            labels, buckets=TOKEN_BUCKETS, registry=reg)
        self.phase_seconds = Histogram(
            timing.METRIC, "Seconds of one phase of a request on this worker (disagg/timing.py:"
            " admission, queue, prefill, context_answer, kv_wait, kv_transfer, kv_install, "
            "first_token, decode, finish), once per request that succeeded.",
            labels + ["phase"], buckets=timing.PHASE_BUCKETS, registry=reg)
        # resolved once (labels() takes a lock and joins the values each call)
        self._phase_children = {p: self.phase_seconds.labels(model_name, p)
                                for p in timing.WORKER_PHASES}
        reg.register(_EngineStatsCollector(engine, model_name, max_batch_size, max_num_tokens))
        reg.register(_TransferCollector(engine, model_name))

        # Pre-create the common label sets so that they appear (at 0) before any traffic.
        for reason in ("stop", "length", "abort", "error"):
            self.requests_finished.labels(model_name, reason)
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)

    # -- per-request observations (called by the server) --------------------------------------

    def rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def tokens(self, n: int, gap_s: float | None, first_token_s: float | None) -> None:
        """``n`` new tokens arrived; ``gap_s`` since the previous ones (spread evenly, as one
        output may carry several tokens when the server lags behind the engine)."""
        if n <= 0:
            return
        self.generation_tokens.labels(self.model_name).inc(n)
        if first_token_s is not None:
            self.ttft.labels(self.model_name).observe(first_token_s)
            n -= 1  # the first token has no inter-token gap
        if gap_s is not None and n > 0:
            itl = self.itl.labels(self.model_name)
            for _ in range(n):
                itl.observe(gap_s / n)

    def finished(self, finish_reason: str, num_prompt_tokens: int, num_generated: int,
                 e2e_s: float, queue_s: float | None) -> None:
        m = self.model_name
        self.requests_finished.labels(m, finish_reason or "abort").inc()
        self.e2e.labels(m).observe(e2e_s)
        self.prompt_len.labels(m).observe(num_prompt_tokens)
        self.gen_len.labels(m).observe(num_generated)
        if queue_s is not None:
            self.queue_time.labels(m).observe(queue_s)

    def phases(self, phases: Iterable[tuple[str, float]]) -> None:
        """One request's phases (``request_timing``)."""
        for name, seconds in phases:
            child = self._phase_children.get(name)
            if child is None:
                child = self._phase_children[name] = self.phase_seconds.labels(
                    self.model_name, name)
            child.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineStatsCollector(Collector):
    """Reads ``engine.stats()`` at scrape time."""

    def __init__(self, engine: EngineClient, model_name: str, max_batch_size: int | None,
                 max_num_tokens: int | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens

    def describe(self) -> Iterator[Metric]:
        return iter(())  # dynamic: do not call stats() at registration

    def collect(self) -> Iterator[Metric]:
        lv = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(lv, value)
            return c

        try:
            healthy = bool(self.engine.is_healthy())
        except Exception:  # a scrape must never fail because of the engine
            healthy = False
        yield gauge("engine_healthy", "1 when the engine loop is alive.", 1.0 if healthy else 0.0)
        if self.max_batch_size is not None:
            yield gauge("max_batch_size", "Configured limit: requests per iteration.",
                        self.max_batch_size)
        if self.max_num_tokens is not None:
            yield gauge("max_num_tokens", "Configured limit: tokens per iteration.",
                        self.max_num_tokens)
        try:
            s = self.engine.stats()
        except Exception:
            logger.exception("engine.stats() failed during a metrics scrape")
            return
        yield gauge("num_requests_running", "Requests in the running batch (scheduled each "
                    "iteration).", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting: for admission (queue depth) or "
                    "for their prompt KV from a context worker.", s.num_waiting)
        yield gauge("num_requests_waiting_for_kv", "Requests admitted that wait for their "
                    "prompt KV from a context worker (part of num_requests_waiting).",
                    s.num_waiting_for_kv)
        yield gauge("iteration_batch_size", "Requests scheduled in the last engine iteration.",
                    s.last_step_batch_size)
        yield gauge("iteration_num_tokens", "Tokens scheduled in the last engine iteration "
                    "(prefill chunks + 1 per decode).", s.last_step_num_tokens)
        yield gauge("kv_blocks_used", "KV cache blocks held by requests.", s.kv_blocks_used)
        yield gauge("kv_blocks_cached", "Free KV blocks still holding reusable prefix-cache "
                    "content.", s.kv_blocks_cached)
        yield gauge("kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        yield gauge("kv_cache_usage_ratio", "kv_blocks_used / kv_blocks_total.", usage)
        yield counter("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix "
                      "cache.", s.prefix_cache_queries_tokens)
        yield counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.",
                      s.prefix_cache_hit_tokens)
        yield counter("kv_peer_prefix_leases", "Prefix leases made for peers (POST "
                      "/kv_prefix, kv_peer_reuse).", getattr(s, "peer_prefix_leases", 0))
        yield counter("kv_peer_prefix_pulls", "Requests whose prompt prefix was pulled from "
                      "a peer's cache.", getattr(s, "peer_prefix_pulls", 0))
        yield counter("kv_peer_prefix_failed", "Pulls of a peer's prefix that failed (the "
                      "request computed it).", getattr(s, "peer_prefix_failed", 0))
        yield counter("kv_peer_prefix_tokens", "Prompt tokens whose KV was pulled from a "
                      "peer's cache instead of computed.", getattr(s, "peer_prefix_tokens", 0))
        yield counter("num_preemptions", "Requests preempted (KV blocks taken back, to be "
                      "recomputed).", s.num_preempted_total)
        yield counter("engine_steps", "Engine iterations run.", s.steps_total)
        yield from self._spec_decode(s, counter, gauge)
        yield from self._kv_offload(getattr(s, "kv_offload", None))

    def _kv_offload(self, o: Any) -> Iterator[Metric]:
        """The offload tiers' sizes and traffic (``engine/kv_offload.py``), when configured."""
        if o is None:
            return
        labels = ["model_name", "tier"]
        families = (
            (GaugeMetricFamily, "kv_offload_blocks", "Blocks held by each offload tier.",
             (o.host_blocks, o.disk_blocks)),
            (GaugeMetricFamily, "kv_offload_capacity_blocks", "Blocks each offload tier can "
             "hold (0: none, or the disk tier was turned off after a write failed).",
             (o.host_capacity, o.disk_capacity)),
            (CounterMetricFamily, "kv_offload_stored_blocks", "Blocks copied into each tier "
             "(evicted from the KV cache; disk: also demoted from the host tier).",
             (o.stored_host, o.stored_disk)),
            (CounterMetricFamily, "kv_offload_loaded_blocks", "Prefix blocks copied back "
             "into the KV cache from each tier (prefix hits).", (o.loaded_host, o.loaded_disk)),
        )
        for cls, name, doc, (host, disk) in families:
            m = cls(PREFIX + name, doc, labels=labels)
            m.add_metric([self.model_name, "host"], host)
            m.add_metric([self.model_name, "disk"], disk)
            yield m
        failed = CounterMetricFamily(
            PREFIX + "kv_offload_failed_blocks", "Tier blocks that failed their checksum or "
            "could not be read: never used, computed again.", labels=["model_name"])
        failed.add_metric([self.model_name], o.failed_loads)
        yield failed

    def _spec_decode(self, s: Any, counter: Callable[[str, str, float], Metric],
                     gauge: Callable[[str, str, float], Metric]) -> Iterator[Metric]:
        """Speculative decoding's counters (``disagg.spec_decode``), when the engine
        speculates (configured to, or drafts counted)."""
        drafts = getattr(s, "spec_num_drafts", 0)
        config = getattr(self.engine, "config", None)
        if getattr(config, "speculative", None) is None and not drafts:
            return
        proposed = s.spec_num_draft_tokens
        accepted = s.spec_num_accepted_tokens
        yield counter("spec_decode_num_drafts", "Verification rows that carried draft "
                      "tokens (one per request per speculative step).", drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed for "
                      "verification.", proposed)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the model accepted.",
                      accepted)
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
            "their position in the draft (0: the first draft token).",
            labels=["model_name", "position"])
        for pos, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens since "
                    "start (0 before any).", accepted / proposed if proposed else 0.0)
        yield gauge("spec_decode_mean_tokens_per_forward", "Tokens emitted per verification "
                    "forward of a request, (accepted + drafts) / drafts, since start (0 before "
                    "any): 1 + the accepted draft tokens per step.",
                    (accepted + drafts) / drafts if drafts else 0.0)


class _TransferCollector(Collector):
    """KV transfer metrics of a context / generation worker (``TransferStats`` and its lease
    table), read at scrape time. An aggregated worker exports none of them."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        rt = self.engine.transfer
        if rt is None:
            return
        try:
            s = rt.stats_snapshot()
        except Exception:
            logger.exception("transfer stats failed during a metrics scrape")
            return
        lv = [self.model_name]
        role = rt.role.value

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "role"])
            c.add_metric([*lv, role], value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "role"])
            g.add_metric([*lv, role], value)
            return g

        yield counter("kv_transfer_bytes", "KV bytes transferred (sent by a context worker, "
                      "received by a generation worker).", s.bytes_transferred)
        yield counter("kv_transfer_blocks", "KV blocks transferred.", s.blocks_transferred)
        yield counter("kv_transfers", "Successful KV reads.", s.transfers)
        failed = CounterMetricFamily(PREFIX + "kv_transfer_failures", "Failed KV transfers, "
                                     "by error code.", labels=["model_name", "role", "code"])
        for code, n in s.failures_by_code:
            failed.add_metric([*lv, role, code], n)
        yield failed
        yield counter("kv_transfer_failed", "Failed KV transfers (all codes).",
                      s.failed_transfers)
        buckets = [(("+Inf" if b == float("inf") else repr(b)), n) for b, n in s.latency_buckets]
        h = HistogramMetricFamily(PREFIX + "kv_transfer_seconds", "Latency of one KV read "
                                  "(request sent -> last payload byte).",
                                  labels=["model_name", "role"])
        h.add_metric([*lv, role], buckets, s.latency_sum_s)
        yield h
        yield counter("kv_install_seconds", "Seconds spent copying pulled KV into the cache "
                      "(generation worker, summed over ranks).", s.install_seconds_sum)
        yield counter("kv_installs", "Pulls installed (per rank).", s.installs)
        yield counter("kv_pull_seconds", "Seconds from a pull's reads submitted to its KV "
                      "installed (per rank, summed).", s.pull_seconds_sum)
        yield counter("kv_leases_expired", "Context leases that expired before their reader "
                      "confirmed.", s.expired_leases)
        yield gauge("kv_leases_active", "Live context leases.", s.active_leases)
        yield gauge("kv_leased_blocks", "KV blocks held for generation workers under "
                    "leases.", s.leased_blocks_held)
