"""The KV connector's part on ranks 1..N-1 of a multi-rank worker (tp * pp > 1).

Every rank holds its own slice of the KV cache (its layers, its kv heads), so every rank serves
(context role) or pulls (generation role) its own slice. A rank builds both halves (a transfer
server over a lease table; a ``KVPuller`` and an installer thread) whatever the worker's role at
start: the role lives on rank 0 only (it may change at run time), this part just answers rank
0's messages.

Rank 0's ``DisaggConnector`` drives this part with the control messages of
``disagg.kv_connector.messages``; this part answers with events. A generation worker confirms
each lease once per context rank, for all its own ranks
(one reader per lease and rank): the context side need not know the generation layout.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

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
from disagg.kv_connector.pull import KVPuller, Pull, worker_layout
from disagg.kv_connector.settings import SWEEP_INTERVAL_S, DisaggSettings
from disagg.kv_connector.stream import StreamPublisher, install_hook
from disagg.tracing import kv_read_hook
from disagg.transfer.backends import make_backend
from disagg.transfer.lease import Lease, LeaseTable
from disagg.transfer.service import KVTransferServer
from disagg.transfer.stats import TransferStats

logger = logging.getLogger("disagg.kv_connector")


@dataclass
class _RankFetch:
    pull: Pull
    pending: int  # reads not done yet: the last one hands the pull to the installer


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
        self.server: KVTransferServer | None = None
        self.leases: LeaseTable | None = None
        self._fetches: dict[str, _RankFetch] = {}
        self._lock = threading.Lock()  # the fetch table: main thread vs the installer
        self._installer: cf.ThreadPoolExecutor | None = None
        # Both halves whatever the role at start (the worker may switch role at run time; rank
        # 0 decides what runs, this rank only answers its messages).
        self.puller = KVPuller.for_worker(settings, self.backend, kv_cache, self.layout, rank,
                                          self.stats)
        self.leases = LeaseTable(settings.kv_lease_ttl_s, on_release=self._on_release)
        self.streams = StreamPublisher(self.leases, kv_cache, settings.stream_wait_s,
                                       settings.kv_lease_ttl_s)
        if model is not None:  # this rank's layers report to its own progress
            install_hook(model, self.streams.progress)
        self.server = KVTransferServer(kv_cache, self.leases, settings.cluster_token,
                                       self.backend, settings.host, stats=self.stats,
                                       advertise_host=settings.advertise_host,
                                       sweep_interval_s=SWEEP_INTERVAL_S,
                                       progress=self.streams.progress).start()
        # Traced READs (a generation worker's kv_transfer span named): a span each.
        self.server.on_traced_read = kv_read_hook(settings.otlp_traces_endpoint)
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
            # Rank 0 keeps the blocks until this rank (and every other) says nothing writes.
            self.puller.cancel(fetch.pull if fetch is not None else None, lambda: self._emit(
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
        try:
            pull = self.puller.start(request_id, params, block_ids)
        except Exception as e:
            self._fetched(request_id, KVTransferError.because(f" on rank {self.rank}: {e!r}"))
            return
        with self._lock:
            self._fetches[request_id] = _RankFetch(pull, len(pull.reads))
        if not pull.reads:
            self._finish(request_id)
        for r in pull.reads:
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
        """Every read of the pull is done (installer thread): install it, tell rank 0. Under
        the lock, so a ``CancelFetch`` meanwhile waits for the install to end."""
        with self._lock:
            fetch = self._fetches.pop(request_id, None)
            if fetch is None:  # cancelled
                return
            outcome = self.puller.finish(fetch.pull)
        self._fetched(request_id, outcome if isinstance(outcome, KVTransferError) else None)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.puller.close()
        if self._installer is not None:
            self._installer.shutdown(wait=False, cancel_futures=True)
