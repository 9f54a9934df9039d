"""``DisaggConnector``: the KV connector of a context or generation worker (rank 0's part).

Context role: a ``KVTransferServer`` over this rank's KV cache and a ``LeaseTable``. A
context-only request that may go on after its first token keeps its blocks (the scheduler holds
them when it finishes by length) and ``request_finished`` puts them under a lease whose params
go out with the answer. The lease ends when the generation worker confirms its read, when the
router releases it, or when it expires; the table's callback (possibly on a transport thread)
only enqueues the id, and ``get_finished`` hands it to the engine thread, which frees the
blocks. A read of an expired lease fails the reader's request: it never returns stale KV.

Generation role: a ``KVTransferClient`` per backend. ``start_load`` submits one coalesced read
per context rank the blocks need (``pull.submit_reads``) into private receive buffers, off the
engine thread. ``get_finished`` never blocks: finished reads are installed into the request's
own blocks on the engine thread, failures reported as ``KVTransferError``. The context lease is
then confirmed (``release_remote``), and on every other path that ends the request without its
KV (abort, failure, refusal) as well, so the context worker frees the blocks at once instead of
at expiry.

Both halves exist on every context / generation worker, built at start on every rank: the
worker can switch role at run time (``set_role``, once ``drain_pending`` is zero; the server's
``role_switch`` drives it), and the role is only what rank 0 lets happen.

Multi-rank workers: rank 0 drives ranks 1..N-1 (``rank.RankTransfer``) through ``RankPeers``
(the parallel executor's pipes) with the messages of ``messages``; a lease's blocks are freed
once it ended on every rank, a pull is done once every rank installed its slice.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from disagg.config import EngineConfig
from disagg.contracts.params import ContextParams
from disagg.contracts.roles import Role
from disagg.kv_connector.base import FinishedTransfers, KVConnector, RequestKV
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
    first_token,
    give_back,
    install,
    log_release_failure,
    make_client,
    submit_reads,
    worker_layout,
)
from disagg.kv_connector.recv_pool import ReceivePool
from disagg.kv_connector.settings import SWEEP_INTERVAL_S, DisaggSettings
from disagg.kv_connector.stream import StreamPublisher, stream_items
from disagg.request import Request, RequestStatus
from disagg.scheduler import KVFetch, SchedulerOutput
from disagg.transfer.backends import make_backend
from disagg.transfer.lease import Lease, LeaseTable
from disagg.transfer.stats import TransferStats, TransferStatsSnapshot, merge_snapshots

logger = logging.getLogger("disagg.kv_connector")


class RankPeers(Protocol):
    """Rank 0's line to ranks 1..N-1 of its worker (implemented by the parallel executor)."""

    world_size: int
    transfer_addresses: list[str | None]  # rank r's transfer server (context role), r >= 1

    def send_all(self, msg: TransferMessage) -> None:
        """A control message to every other rank, in order with the steps (engine thread)."""

    def take_events(self) -> list[TransferEvent]:
        """Events the other ranks sent since the last call (non-blocking)."""

    def on_event(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a reader thread) whenever an event arrives."""


@dataclass
class _Fetch:
    request_id: str
    params: ContextParams
    block_ids: list[int]  # this worker's blocks for the prompt
    reads: list[Read] = field(default_factory=list)
    remote_pending: set[int] = field(default_factory=set)  # ranks r >= 1 yet to report
    remote_error: KVTransferError | None = None
    t0: float = field(default_factory=time.perf_counter)


class DisaggConnector(KVConnector):
    """Rank 0's KV connector (module docstring); ``peers`` for multi-rank workers."""

    def __init__(self, settings: DisaggSettings, config: EngineConfig, kv_cache: torch.Tensor,
                 wake: Callable[[], None], peers: RankPeers | None = None) -> None:
        if settings.role not in (Role.CONTEXT, Role.GENERATION):
            raise ValueError(f"role: {settings.role!r} has no KV transfer")
        self.settings = settings
        self.role = str(settings.role)
        self.worker_id = uuid.uuid4().hex  # a restarted worker is a new worker
        self.layout = worker_layout(config)
        self.kv_cache = kv_cache
        self.stats = TransferStats()
        self.peers = peers
        self.world_size = peers.world_size if peers is not None else 1
        self._rank_stats: dict[int, TransferStatsSnapshot] = {}
        self.backend = make_backend({"backend": settings.backend,
                                     "ucx_profile": settings.ucx_profile})
        self._wake = wake
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._next_sweep = 0.0
        self.leases: LeaseTable | None = None
        self.server = None
        self._clients: dict[str, Any] = {}
        self._recv_pool = ReceivePool.from_env()  # pages of past pulls' buffers stay mapped
        # Per request: context-only requests that may be leased, generation-only requests'
        # leases not given back yet, and pulls in flight.
        self._may_lease: set[str] = set()
        self._remote: dict[str, ContextParams] = {}
        self._fetches: dict[str, _Fetch] = {}
        # Requests that ended while their KV was arriving: the ranks (0 included) whose
        # cancelled reads may still write into the blocks; reported in loads_stopped once empty.
        self._stopping: dict[str, set[int]] = {}
        self._quiet: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        # Context, multi-rank: leases announced to ranks 1..N-1, and the ranks where a lease
        # is still live (rank 0 included); the blocks are freed when that set is empty.
        self._announced: set[str] = set()
        self._live_on: dict[str, set[int]] = {}
        self.reader_id = f"{self.worker_id}:0"
        # Both halves on every disaggregated worker, whatever its role at start: it can switch
        # role at run time (``set_role``) without building anything on any rank then. An idle
        # transfer server serves nothing: a read needs a live lease, and only a context-only
        # request makes one.
        from disagg.transfer.service import KVTransferServer

        self.leases = LeaseTable(settings.lease_ttl_s, on_release=self._on_release)
        self.streams = StreamPublisher(self.leases, kv_cache, settings.stream_wait_s,
                                       settings.lease_ttl_s)
        # The engine loop sweeps expiries (sweep_interval_s=None): one owner of the clock.
        self.server = KVTransferServer(kv_cache, self.leases, settings.cluster_token,
                                       self.backend, settings.host, stats=self.stats,
                                       advertise_host=settings.advertise_host,
                                       sweep_interval_s=None,
                                       progress=self.streams.progress).start()
        if peers is not None:
            if any(a is None for a in peers.transfer_addresses):
                raise RuntimeError("a rank of this worker has no KV transfer server")
            peers.on_event(wake)

    # ---- introspection / lifecycle ------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """Every rank's transfer address, rank order (what a context answer's params name)."""
        if self.server is None:
            return []
        rest = list(self.peers.transfer_addresses) if self.peers is not None else []
        return [self.server.address, *rest]  # type: ignore[list-item]

    def set_role(self, role: Role | str) -> None:
        """The worker serves ``role`` from now on (engine thread, once the old role drained:
        ``drain_pending`` is all zero). Nothing is built or torn down: both halves exist."""
        if role not in (Role.CONTEXT, Role.GENERATION):
            raise ValueError(f"role: {role!r} has no KV transfer")
        logger.info("KV connector: role %s -> %s", self.role, role)
        self.role = str(role)

    def drain_pending(self) -> tuple[int, int]:
        """(live leases, pulls in flight) on any rank: what a role switch waits for (engine
        thread)."""
        leases = 0 if self.leases is None else len(self.leases)
        leases += sum(1 for lid in self._live_on if self.leases is None or lid not in self.leases)
        return leases, len(self._fetches) + len(self._stopping)

    def info(self) -> dict[str, object]:
        context = self.role == Role.CONTEXT
        return {"role": self.role, "worker_id": self.worker_id,
                "backend": self.backend.name.upper(),
                # a generation worker's idle transfer server is not advertised
                "addresses": self.addresses if context else [],
                "layout": self.layout.to_dict(),
                "lease_ttl_s": self.settings.lease_ttl_s if context else None,
                # UCX: profile, UCX_TLS and the transports its context runs (None for TCP)
                "ucx": describe() if (describe := getattr(self.backend, "describe", None))
                else None}

    def stats_snapshot(self) -> TransferStatsSnapshot:
        # list(): one C-level copy under the GIL (the engine thread updates the dict).
        return merge_snapshots([self.stats.snapshot(), *list(self._rank_stats.values())])

    def busy(self) -> bool:
        return bool(self._fetches) or bool(self._stopping) or bool(self._live_on) or (
            self.leases is not None and len(self.leases) > 0)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    # ---- scheduler side -----------------------------------------------------------------------

    def add_request(self, request_id: str, kv: RequestKV) -> bool:
        if kv.remote is not None:
            self._remote[request_id] = kv.remote
        if kv.stream is not None:  # its lease exists from now on, on every rank
            num_tokens, tokens_hash = kv.stream
            self.streams.open(request_id, num_tokens, tokens_hash)
            if self.peers is not None:
                self._live_on[request_id] = set(range(self.world_size))
                self.peers.send_all(OpenStreams(((request_id, num_tokens, tokens_hash),)))
            return True
        if kv.lease:
            self._may_lease.add(request_id)
        return kv.lease

    def request_finished(self, request: Request, held_blocks: list[int] | None,
                         logprobs: list[dict[int, float]] | None) -> ContextParams | None:
        rid = request.request_id
        self._may_lease.discard(rid)
        remote = self._remote.pop(rid, None)
        if remote is not None:  # ended before its KV was in place: the context side frees
            self._cancel_fetch(rid)
            self.release_remote(remote)
        if rid in self.streams:
            return self._finish_stream(request, held_blocks, logprobs)
        if held_blocks is not None and request.status == RequestStatus.FINISHED_LENGTH:
            return self._create_lease(rid, held_blocks, request, logprobs)
        if rid in self._announced:  # ended without a lease: the other ranks drop theirs
            self._announced.discard(rid)
            self._send(ReleaseLeases((rid,)))
        return None

    def _create_lease(self, request_id: str, block_ids: list[int], request: Request,
                      logprobs: list[dict[int, float]] | None) -> ContextParams:
        """Lease a finished context-only request's blocks; the answer's params."""
        if self.leases is None:
            raise RuntimeError(f"a {self.role} worker has no lease table")
        if self.peers is not None:
            self._announced.discard(request_id)
            self._live_on[request_id] = set(range(self.world_size))
        try:
            lease = self.leases.create(request_id, block_ids, readers=1)
        except BaseException:
            self._live_on.pop(request_id, None)
            self._send(ReleaseLeases((request_id,)))
            raise
        return self._params(request, block_ids, lease, logprobs)

    def _params(self, request: Request, block_ids: list[int], lease: Lease,
                logprobs: list[dict[int, float]] | None, stream: bool = False
                ) -> ContextParams:
        return ContextParams(
            ctx_request_id=request.request_id, first_gen_tokens=list(request.output_token_ids),
            prompt_token_ids=list(request.prompt_token_ids), worker_id=self.worker_id,
            backend=self.backend.name.upper(), addresses=self.addresses,
            block_ids=list(block_ids), num_tokens=request.num_prompt_tokens,
            layout=self.layout, lease_expiry=time.time() + (lease.expires_at - time.monotonic()),
            first_gen_logprobs=logprobs, stream=stream,
            cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _finish_stream(self, request: Request, held_blocks: list[int] | None,
                       logprobs: list[dict[int, float]] | None) -> ContextParams | None:
        """A streaming request's prefill ended. With its first token sampled, that token goes
        to the reader (with its last read) and the lease lives on: by length it keeps the
        blocks, after a stop (the token ends the request: the reader needs no KV) none. Else
        (an abort, an error; or when the reader gave up already) the lease is dropped on every
        rank and the engine frees the blocks."""
        rid = request.request_id
        sampled = request.status in (RequestStatus.FINISHED_LENGTH,
                                     RequestStatus.FINISHED_STOPPED)
        if sampled:
            self.streams.progress.set_first(rid, {
                "tokens": list(request.output_token_ids),
                "logprobs": None if logprobs is None else [
                    {str(k): v for k, v in lp.items()} for lp in logprobs]})
        keep = ((held_blocks or []) if request.status == RequestStatus.FINISHED_LENGTH
                else [] if sampled else None)
        alive = self.streams.finish(rid, keep)
        lease = self.leases.get(rid) if alive and self.leases is not None else None
        kept = tuple(keep) if lease is not None and keep is not None else None
        self._send(FinishStreams(((rid, kept),)))
        if lease is None:
            self._live_on.pop(rid, None)
            return None
        return self._params(request, list(kept or ()), lease, logprobs, stream=True)

    # ---- worker side --------------------------------------------------------------------------

    def start_step(self, sched: SchedulerOutput) -> None:
        """Context-only prefills completing in this step: every other rank creates the lease
        now, so it exists before rank 0 can answer. Streaming requests' chunks: every rank's
        progress learns them (the model then reports each layer)."""
        if self.streams.active:
            items = stream_items(sched, self.streams)
            self.streams.step(items)
            self._send(StreamStep(tuple(items)))
        if self.peers is None:
            return
        items = tuple((r.request_id, tuple(r.block_ids)) for r in sched.scheduled
                      if r.sample and r.request_id in self._may_lease)
        if items:
            self.peers.send_all(AnnounceLeases(items))
            self._announced.update(rid for rid, _ in items)

    def start_load(self, fetch: KVFetch) -> None:
        rid = fetch.request_id
        params = self._remote[rid]
        client = self._client(params.backend)
        f = _Fetch(rid, params, list(fetch.block_ids))  # t0: now
        f.reads = submit_reads(client, params, self.layout, 0, self.kv_cache,
                               lambda _f: self._wake(), self._recv_pool, f.block_ids,
                               wait_s=self.settings.stream_wait_s)
        if self.peers is not None:
            f.remote_pending = set(range(1, self.world_size))
            self.peers.send_all(StartFetch(rid, params, tuple(fetch.block_ids)))
        self._fetches[rid] = f

    def get_finished(self) -> FinishedTransfers:
        leases_ended = self._drain_released()
        done = FinishedTransfers(leases_ended)
        self._poll_fetches(done)
        self._poll_stopping(done)
        for rid in done.loaded:  # the data is here: the context side may free its blocks
            remote = self._remote.pop(rid, None)
            if remote is not None:
                self.release_remote(remote)
        return done

    def _poll_fetches(self, done: FinishedTransfers) -> None:
        """Pulls done on every rank: installed (rank 0's slice) or failed."""
        self._take_events()
        loaded, failed = done.loaded, done.failed
        for rid, fetch in list(self._fetches.items()):
            if fetch.remote_pending or not all(r.future.done() for r in fetch.reads):
                continue
            del self._fetches[rid]
            err = first_error(fetch.reads)
            if err is not None:
                failed.append((rid, describe_failure(err, fetch.params, fetch.reads)))
                continue
            if fetch.remote_error is not None:
                failed.append((rid, fetch.remote_error))
                continue
            if fetch.params.stream:
                try:
                    done.first[rid] = first_token(fetch.reads)
                except ValueError as e:
                    failed.append((rid, KVTransferError.because(f": {e}")))
                    continue
            t0 = time.perf_counter()
            try:
                install(self.kv_cache, fetch.block_ids, fetch.reads, fetch.params.num_tokens)
            except Exception as e:  # a malformed payload must fail the request, not the loop
                logger.exception("installing pulled KV of %s failed", rid)
                failed.append((rid, KVTransferError.because(f": {e!r}")))
                continue
            t1 = time.perf_counter()
            self.stats.record_install(t1 - t0, t1 - fetch.t0)
            give_back(self._recv_pool, fetch.reads)
            loaded.append(rid)

    def _cancel_fetch(self, request_id: str) -> None:
        """Cancel the reads of a request that ended while its KV was arriving; returns at once.
        Its blocks stay out of the pool (the scheduler's ``draining``) until ``get_finished``
        reports it in ``loads_stopped``: once rank 0's reads into them are quiet
        (``cancel_reads``) and every rank still pulling answered ``CancelFetch``. Reads into
        private buffers finish there, unread."""
        fetch = self._fetches.pop(request_id, None)
        ranks = set(fetch.remote_pending) if fetch is not None else set()
        self._stopping[request_id] = ranks | {0}
        if ranks:
            assert self.peers is not None
            self.peers.send_all(CancelFetch(request_id))
        cancel_reads(fetch.reads if fetch is not None else [],
                     lambda: self._on_quiet(request_id, 0))

    def _on_quiet(self, request_id: str, rank: int) -> None:
        # Any thread: only enqueue (get_finished takes it on the engine thread).
        self._quiet.put((request_id, rank))
        self._wake()

    def _poll_stopping(self, done: FinishedTransfers) -> None:
        """Cancelled loads whose reads stopped on every rank: their blocks may be freed."""
        while True:
            try:
                rid, rank = self._quiet.get_nowait()
            except queue.Empty:
                break
            ranks = self._stopping.get(rid)
            if ranks is not None:
                ranks.discard(rank)
        for rid, ranks in list(self._stopping.items()):
            if not ranks:
                del self._stopping[rid]
                done.loads_stopped.append(rid)

    # ---- leases: ending them ------------------------------------------------------------------

    def release_lease(self, lease_id: str) -> bool:
        if self.leases is None:
            return False
        if lease_id in self._live_on:
            self._send(ReleaseLeases((lease_id,)))
        return self.leases.release(lease_id)

    def lease_is_live(self, lease_id: str) -> bool:
        return self.leases is not None and lease_id in self.leases

    def _on_release(self, lease: Lease, reason: str) -> None:
        # Any thread: only enqueue; the engine thread frees the blocks.
        logger.debug("lease %s ended (%s)", lease.lease_id, reason)
        self.streams.lease_ended(lease.lease_id)
        self._released.put(lease.lease_id)
        self._wake()

    def _lease_ended_on(self, lease_id: str, rank: int) -> None:
        live = self._live_on.get(lease_id)
        if live is None:
            return  # dropped (never leased), or a stale lease of a failed step
        live.discard(rank)
        if not live:
            del self._live_on[lease_id]
            self._released.put(lease_id)  # the request id: drained below

    def _drain_released(self) -> list[str]:
        """Request ids whose held blocks may be freed now (sweeps expiries first)."""
        now = time.monotonic()
        if self.leases is not None and now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self.leases.expire()
        out = []
        for lid in _drain(self._released):
            if lid in self._live_on:  # rank 0's local lease ended; others may still be live
                self._lease_ended_on(lid, 0)
            else:
                out.append(lid)
        self._take_events()  # may end leases on the last rank
        out.extend(_drain(self._released))
        return out

    # ---- the other ranks ----------------------------------------------------------------------

    def _send(self, msg: TransferMessage) -> None:
        if self.peers is not None:
            self.peers.send_all(msg)

    def _take_events(self) -> None:
        """The other ranks' events (lease ends, finished pulls)."""
        if self.peers is None:
            return
        for ev in self.peers.take_events():
            self._rank_stats[ev.rank] = ev.stats
            if isinstance(ev, LeaseEnded):
                self._lease_ended_on(ev.lease_id, ev.rank)
            elif isinstance(ev, FetchStopped):
                self._quiet.put((ev.request_id, ev.rank))
            elif isinstance(ev, FetchDone):
                fetch = self._fetches.get(ev.request_id)
                if fetch is not None:
                    fetch.remote_pending.discard(ev.rank)
                    if ev.error is not None and fetch.remote_error is None:
                        fetch.remote_error = ev.error

    # ---- giving a remote lease back -----------------------------------------------------------

    def _client(self, backend: str) -> Any:
        client = self._clients.get(backend)
        if client is None:
            client = make_client(self.backend, backend, self.settings, self.stats,
                                 self.kv_cache, "kv pulls of rank 0")
            self._clients[backend] = client
        return client

    def release_remote(self, params: ContextParams) -> None:
        """Tell every context rank that this worker is done (or gave up): the context worker
        frees the blocks now. Fire and forget; a dead peer just fails the future. Any thread
        (the client only submits to its own loop)."""
        try:
            client = self._client(params.backend)
        except Exception:
            logger.exception("cannot release lease %s", params.ctx_request_id)
            return
        for address in params.addresses:
            fut = client.release(address, params.ctx_request_id, self.reader_id)
            fut.add_done_callback(log_release_failure)


def _drain(q: queue.SimpleQueue[str]) -> list[str]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def make_connector(settings: DisaggSettings, config: EngineConfig, kv_cache: torch.Tensor,
                   wake: Callable[[], None], peers: RankPeers | None = None) -> KVConnector:
    """The connector of a context / generation worker whose rank 0 holds ``kv_cache``."""
    return DisaggConnector(settings, config, kv_cache, wake, peers=peers)
