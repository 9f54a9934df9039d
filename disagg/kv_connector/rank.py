"""The KV connector's part on ranks 1..N-1 of a multi-rank worker (tp * pp > 1).

Every rank holds its own slice of the KV cache (its layers, its kv heads), so every rank serves
(context role) or pulls (generation role) its own slice. A rank builds both halves (a transfer
server over a lease table, an installer) whatever the worker's role at start: the role lives on
rank 0 only (it may change at run time), this part just answers rank 0's messages.

Rank 0's ``DisaggConnector`` drives this part with the control messages of
``disagg.kv_connector.messages``; this part answers with events. A generation worker confirms
each lease once per context rank, for all its own ranks
(one reader per lease and rank): the context side need not know the generation layout.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg.config import EngineConfig
from disagg.contracts.params import ContextParams
from disagg.kv_connector.errors import KVTransferError
from disagg.kv_connector.messages import (
    AnnounceLeases,
    CancelFetch,
    FetchDone,
    FetchStopped,
    FinishStreams,
    LeaseEnded,
    OpenStreams,
    ReleaseLeases,
    StartFetch,
    StreamStep,
    TransferEvent,
    TransferMessage,
)
from disagg.kv_connector.pull import (
    Read,
    cancel_reads,
    describe_failure,
    first_error,
    give_back,
    install,
    make_client,
    submit_reads,
    worker_layout,
)
from disagg.kv_connector.recv_pool import ReceivePool
from disagg.kv_connector.settings import SWEEP_INTERVAL_S, DisaggSettings
from disagg.kv_connector.stream import StreamPublisher, install_hook
from disagg.transfer.backends import make_backend
from disagg.transfer.lease import Lease, LeaseTable
from disagg.transfer.stats import TransferStats

logger = logging.getLogger("disagg.kv_connector")


@dataclass
class _RankFetch:
    params: ContextParams
    block_ids: list[int]
    reads: list[Read] = field(default_factory=list)
    pending: int = 0
    cancelled: bool = False
    t0: float = field(default_factory=time.perf_counter)


class RankTransfer:
    """The KV plumbing of rank ``rank`` >= 1 of a multi-rank worker (module docstring).

    ``handle`` runs on the rank's main thread between steps; ``emit`` sends an event to rank 0
    (thread-safe: the transfer server, the lease sweeper and the installer all report).
    """

    def __init__(self, settings: DisaggSettings, config: EngineConfig, rank: int,
                 kv_cache: torch.Tensor, emit: Callable[[TransferEvent], None],
                 model: torch.nn.Module | None = None) -> None:
        self.settings = settings
        self.rank = rank
        self.layout = worker_layout(config)
        self.kv_cache = kv_cache
        self.stats = TransferStats()
        self.backend = make_backend({"backend": settings.backend,
                                     "ucx_profile": settings.ucx_profile})
        self._emit = emit
        self.reader_id = f"rank{rank}"
        self.server = None
        self.leases: LeaseTable | None = None
        self._clients: dict[str, Any] = {}
        self._fetches: dict[str, _RankFetch] = {}
        self._lock = threading.Lock()  # the fetch table: main thread vs the installer
        self._installer: cf.ThreadPoolExecutor | None = None
        self._recv_pool = ReceivePool.from_env()
        # Both halves whatever the role at start (the worker may switch role at run time; rank
        # 0 decides what runs, this rank only answers its messages).
        from disagg.transfer.service import KVTransferServer

        self.leases = LeaseTable(settings.lease_ttl_s, on_release=self._on_release)
        self.streams = StreamPublisher(self.leases, kv_cache, settings.stream_wait_s,
                                       settings.lease_ttl_s)
        if model is not None:  # this rank's layers report to its own progress
            install_hook(model, self.streams.progress)
        self.server = KVTransferServer(kv_cache, self.leases, settings.cluster_token,
                                       self.backend, settings.host, stats=self.stats,
                                       advertise_host=settings.advertise_host,
                                       sweep_interval_s=SWEEP_INTERVAL_S,
                                       progress=self.streams.progress).start()
        # Installs run here, not on the transport's thread (which must keep progressing).
        self._installer = cf.ThreadPoolExecutor(1, thread_name_prefix=f"disagg-install{rank}")

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    def handle(self, msg: TransferMessage) -> None:
        """A control message from rank 0 (main thread, between steps)."""
        if isinstance(msg, AnnounceLeases):
            assert self.leases is not None
            for lease_id, block_ids in msg.leases:
                try:
                    self.leases.create(lease_id, list(block_ids), readers=1)
                except ValueError:  # a duplicate id: keep the live one
                    logger.warning("rank %d: lease %s exists already", self.rank, lease_id)
        elif isinstance(msg, ReleaseLeases):
            assert self.leases is not None
            for lease_id in msg.lease_ids:
                self.leases.release(lease_id)
        elif isinstance(msg, StreamStep):
            self.streams.step(msg.items)
        elif isinstance(msg, OpenStreams):
            for stream_id, num_tokens, tokens_hash in msg.streams:
                try:
                    self.streams.open(stream_id, num_tokens, tokens_hash)
                except ValueError:  # a duplicate id: keep the live one
                    logger.warning("rank %d: stream %s exists already", self.rank, stream_id)
        elif isinstance(msg, FinishStreams):
            for stream_id, block_ids in msg.streams:
                self.streams.finish(stream_id, block_ids)
        elif isinstance(msg, StartFetch):
            self._start_fetch(msg.request_id, msg.params, list(msg.block_ids))
        elif isinstance(msg, CancelFetch):
            rid = msg.request_id
            with self._lock:  # waits for an install in progress
                fetch = self._fetches.pop(rid, None)
                if fetch is not None:
                    fetch.cancelled = True
            # Rank 0 keeps the blocks until this rank (and every other) says nothing writes.
            cancel_reads(fetch.reads if fetch is not None else [], lambda: self._emit(
                FetchStopped(self.rank, rid, self.stats.snapshot())))
        else:
            raise RuntimeError(f"unknown transfer message {msg!r}")

    def _on_release(self, lease: Lease, reason: str) -> None:
        # Any thread (reader confirm, sweep, release): rank 0 frees once every rank said so.
        self.streams.lease_ended(lease.lease_id)
        self._emit(LeaseEnded(self.rank, lease.lease_id, reason, self.stats.snapshot()))

    def _fetched(self, request_id: str, error: KVTransferError | None) -> None:
        self._emit(FetchDone(self.rank, request_id, error, self.stats.snapshot()))

    def _start_fetch(self, request_id: str, params: ContextParams, block_ids: list[int]) -> None:
        fetch = _RankFetch(params, block_ids)
        client = self._clients.get(params.backend)
        if client is None:
            client = self._clients[params.backend] = make_client(
                self.backend, params.backend, self.settings, self.stats, self.kv_cache,
                f"kv pulls of rank {self.rank}")
        with self._lock:
            self._fetches[request_id] = fetch
            try:
                fetch.reads = submit_reads(client, params, self.layout, self.rank,
                                           self.kv_cache, lambda _f: None, self._recv_pool,
                                           block_ids, wait_s=self.settings.stream_wait_s)
            except Exception as e:
                del self._fetches[request_id]
                self._fetched(request_id, KVTransferError.because(f" on rank {self.rank}: {e!r}"))
                return
            fetch.pending = len(fetch.reads)
        if not fetch.reads:
            self._finish(request_id)
        for r in fetch.reads:
            r.future.add_done_callback(lambda _f, rid=request_id: self._read_done(rid))

    def _read_done(self, request_id: str) -> None:
        with self._lock:
            fetch = self._fetches.get(request_id)
            if fetch is None:
                return
            fetch.pending -= 1
            if fetch.pending > 0:
                return
        assert self._installer is not None
        self._installer.submit(self._finish, request_id)

    def _finish(self, request_id: str) -> None:
        with self._lock:
            fetch = self._fetches.pop(request_id, None)
            if fetch is None or fetch.cancelled:
                return
            err = first_error(fetch.reads)
            error = None
            if err is not None:
                error = describe_failure(err, fetch.params, fetch.reads)
            else:
                try:
                    t0 = time.perf_counter()
                    install(self.kv_cache, fetch.block_ids, fetch.reads, fetch.params.num_tokens)
                    t1 = time.perf_counter()
                    self.stats.record_install(t1 - t0, t1 - fetch.t0)
                    give_back(self._recv_pool, fetch.reads)
                except Exception as e:
                    logger.exception("rank %d: installing pulled KV of %s failed", self.rank,
                                     request_id)
                    error = KVTransferError.because(f" on rank {self.rank}: {e!r}")
        self._fetched(request_id, error)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        for client in self._clients.values():
            client.close()
        if self._installer is not None:
            self._installer.shutdown(wait=False, cancel_futures=True)
