"""Transfer counters for the worker's Prometheus metrics (torch-free).

A plain thread-safe object: the transfer thread records, the metrics endpoint reads a
``snapshot()``. The latency histogram keeps Prometheus-style cumulative buckets, so an exporter
can publish it as is.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from disagg.transfer.lease import LeaseStats

# Upper bounds in seconds (+Inf is implicit). 128 MiB at 5 GB/s is ~27 ms; at TCP speed ~50 ms.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)


class _LeaseSource(Protocol):
    def stats(self) -> LeaseStats: ...


@dataclass(frozen=True)
class TransferStatsSnapshot:
    transfers: int  # successful reads
    bytes_transferred: int
    blocks_transferred: int
    zero_copy_transfers: int
    failed_transfers: int
    failures_by_code: tuple[tuple[str, int], ...]  # sorted (code, count)
    latency_buckets: tuple[tuple[float, int], ...]  # (upper bound s, cumulative count); last inf
    latency_sum_s: float
    latency_count: int
    recent_latencies_s: tuple[float, ...]  # the last few samples, oldest first
    # From the bound lease table (zeros when none is bound).
    active_leases: int
    leased_blocks_held: int
    expired_leases: int
    # GPU caches, this end of each transfer: the payload left (server) or arrived in (client)
    # GPU memory through the transport itself, or crossed pinned host memory, and why.
    device_direct_transfers: int = 0
    host_staged_transfers: int = 0
    staging_reasons: tuple[tuple[str, int], ...] = ()  # sorted (reason, count)
    # Same host: reads whose bytes the generation rank gathered itself from the context rank's
    # cache, mapped into its process (``cuda_ipc.py``; no payload on the wire), and the reads
    # that could not, although the server offered it, by reason (they moved the bytes).
    mapped_transfers: int = 0
    mapped_fallbacks: tuple[tuple[str, int], ...] = ()  # sorted (reason, count)
    # Generation side, per request and rank: copying the pulled payloads into the request's
    # blocks, and the whole pull (reads submitted -> installed; transfer + wake-up + install).
    installs: int = 0
    install_seconds_sum: float = 0.0
    pulls: int = 0
    pull_seconds_sum: float = 0.0


class TransferStats:
    def __init__(
        self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S, recent_samples: int = 256
    ) -> None:
        if list(buckets) != sorted(buckets):
            raise ValueError("buckets must be increasing")
        self._lock = threading.Lock()
        self._bounds = tuple(buckets)
        self._bucket_counts = [0] * (len(buckets) + 1)  # per bucket (not cumulative); last: +Inf
        self._sum = 0.0
        self._count = 0
        self._recent: deque[float] = deque(maxlen=recent_samples)
        self._transfers = 0
        self._bytes = 0
        self._blocks = 0
        self._zero_copy = 0
        self._device_direct = 0
        self._host_staged = 0
        self._staging_reasons: dict[str, int] = {}
        self._mapped = 0
        self._mapped_fallbacks: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._leases: _LeaseSource | None = None
        self._installs = 0
        self._install_s = 0.0
        self._pulls = 0
        self._pull_s = 0.0

    def bind_leases(self, leases: _LeaseSource) -> None:
        """Report this lease table's gauges (held blocks, expired leases) in snapshots."""
        self._leases = leases

    def record_transfer(
        self, nbytes: int, nblocks: int, seconds: float, zero_copy: bool = False, *,
        device_direct: bool = False, staging_reason: str | None = None, mapped: bool = False,
    ) -> None:
        """``device_direct``: this end's payload memory was the GPU's; ``staging_reason`` (not
        None): this end stood for a GPU cache but went through pinned host memory, because;
        ``mapped``: the reader gathered the bytes from the server's mapped cache."""
        with self._lock:
            self._transfers += 1
            self._bytes += nbytes
            self._blocks += nblocks
            self._zero_copy += int(zero_copy)
            self._device_direct += int(device_direct)
            self._mapped += int(mapped)
            if staging_reason is not None:
                self._host_staged += 1
                reason = staging_reason or "unknown"
                self._staging_reasons[reason] = self._staging_reasons.get(reason, 0) + 1
            self._observe_locked(seconds)

    def record_install(self, install_s: float, pull_s: float) -> None:
        """A pull installed: the copy into the cache took ``install_s``, the pull ``pull_s``
        from its reads' submission (generation side)."""
        with self._lock:
            self._installs += 1
            self._install_s += install_s
            self._pulls += 1
            self._pull_s += pull_s

    def record_mapped_fallback(self, reason: str) -> None:
        """A read the server offered the mapped path moved its bytes instead, because."""
        with self._lock:
            reason = reason or "unknown"
            self._mapped_fallbacks[reason] = self._mapped_fallbacks.get(reason, 0) + 1

    def record_failure(self, code: str) -> None:
        with self._lock:
            self._failures[code] = self._failures.get(code, 0) + 1

    def _observe_locked(self, seconds: float) -> None:
        self._bucket_counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds
        self._count += 1
        self._recent.append(seconds)

    def snapshot(self) -> TransferStatsSnapshot:
        lease = self._leases.stats() if self._leases is not None else None
        with self._lock:
            cumulative, acc = [], 0
            for bound, n in zip((*self._bounds, float("inf")), self._bucket_counts, strict=True):
                acc += n
                cumulative.append((bound, acc))
            return TransferStatsSnapshot(
                transfers=self._transfers, bytes_transferred=self._bytes,
                blocks_transferred=self._blocks, zero_copy_transfers=self._zero_copy,
                failed_transfers=sum(self._failures.values()),
                failures_by_code=tuple(sorted(self._failures.items())),
                latency_buckets=tuple(cumulative), latency_sum_s=self._sum,
                latency_count=self._count, recent_latencies_s=tuple(self._recent),
                active_leases=lease.active_leases if lease else 0,
                leased_blocks_held=lease.leased_blocks if lease else 0,
                expired_leases=lease.expired_total if lease else 0,
                device_direct_transfers=self._device_direct,
                host_staged_transfers=self._host_staged,
                staging_reasons=tuple(sorted(self._staging_reasons.items())),
                mapped_transfers=self._mapped,
                mapped_fallbacks=tuple(sorted(self._mapped_fallbacks.items())),
                installs=self._installs, install_seconds_sum=self._install_s,
                pulls=self._pulls, pull_seconds_sum=self._pull_s,
            )


def merge_snapshots(snaps: list[TransferStatsSnapshot]) -> TransferStatsSnapshot:
    """One worker's counters from its ranks' snapshots (rank 0 first, same buckets).

    Transfers, bytes, failures and latencies add up over ranks (each rank moves its own slice;
    ``blocks_transferred`` counts a block once per rank that read a slice of it). Lease gauges
    are rank 0's: every rank leases the same block ids, so they describe the worker once.
    """
    if not snaps:
        raise ValueError("no snapshots")
    first = snaps[0]
    if len(snaps) == 1:
        return first
    failures: dict[str, int] = {}
    reasons: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for s in snaps:
        for code, n in s.failures_by_code:
            failures[code] = failures.get(code, 0) + n
        for reason, n in s.staging_reasons:
            reasons[reason] = reasons.get(reason, 0) + n
        for reason, n in s.mapped_fallbacks:
            fallbacks[reason] = fallbacks.get(reason, 0) + n
    buckets = tuple((bound, sum(s.latency_buckets[i][1] for s in snaps))
                    for i, (bound, _) in enumerate(first.latency_buckets))
    return TransferStatsSnapshot(
        transfers=sum(s.transfers for s in snaps),
        bytes_transferred=sum(s.bytes_transferred for s in snaps),
        blocks_transferred=sum(s.blocks_transferred for s in snaps),
        zero_copy_transfers=sum(s.zero_copy_transfers for s in snaps),
        failed_transfers=sum(s.failed_transfers for s in snaps),
        failures_by_code=tuple(sorted(failures.items())),
        latency_buckets=buckets,
        latency_sum_s=sum(s.latency_sum_s for s in snaps),
        latency_count=sum(s.latency_count for s in snaps),
        recent_latencies_s=tuple(x for s in snaps for x in s.recent_latencies_s),
        active_leases=first.active_leases, leased_blocks_held=first.leased_blocks_held,
        expired_leases=first.expired_leases,
        device_direct_transfers=sum(s.device_direct_transfers for s in snaps),
        host_staged_transfers=sum(s.host_staged_transfers for s in snaps),
        staging_reasons=tuple(sorted(reasons.items())),
        mapped_transfers=sum(s.mapped_transfers for s in snaps),
        mapped_fallbacks=tuple(sorted(fallbacks.items())),
        installs=sum(s.installs for s in snaps),
        install_seconds_sum=sum(s.install_seconds_sum for s in snaps),
        pulls=sum(s.pulls for s in snaps),
        pull_seconds_sum=sum(s.pull_seconds_sum for s in snaps),
    )
