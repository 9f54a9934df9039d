"""``DisaggConnector``: the KV connector of a context or generation worker (rank 0's part).

Context role: a ``KVTransferServer`` over this rank's KV cache and a ``LeaseTable``. A
context-only request that may go on after its first token keeps its blocks (the scheduler holds
them when it finishes by length) and ``request_finished`` puts them under a lease whose params
go out with the answer. The lease ends when the generation worker confirms its read, when the
router releases it, or when it expires; the table's callback (possibly on a transport thread)
only enqueues the id, and ``get_finished`` hands it to the engine thread, which frees the
blocks. A read of an expired lease fails the reader's request: it never returns stale KV.

Generation role: rank 0's ``KVPuller`` (``pull.py``: the clients, receive buffers, plan and
install). ``start_load`` starts a pull: one coalesced read per context rank the blocks need,
off the engine thread. ``get_finished`` never blocks: once every read is done the pull is
installed into the request's own blocks on the engine thread, or reported failed as a
``KVTransferError``. The context lease is then confirmed (``release_remote``), and on every
other path that ends the request without its KV (abort, failure, refusal) as well, so the
context worker frees the blocks at once instead of at expiry.

Each request's state is one ``KVRecord`` (``records.py`` draws the states and transitions);
the queues beside them only carry other threads' events (lease ends, quiet ranks) to the
engine thread.

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
from typing import Protocol

import torch

from disagg.config import EngineConfig
from disagg.contracts.kv_mode import ContextOnly, ContextStream, KVMode, Pull
from disagg.contracts.params import ContextParams, LeaseRef
from disagg.contracts.roles import Role
from disagg.kv_connector.base import FinishedTransfers, KVConnector
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
from disagg.kv_connector.pull import KVPuller, Loaded, worker_layout
from disagg.kv_connector.records import (
    REMOTE_STATUSES,
    KVRecord,
    KVRequestState,
    KVStatus,
)
from disagg.kv_connector.settings import SWEEP_INTERVAL_S, DisaggSettings
from disagg.kv_connector.stream import StreamPublisher, stream_items
from disagg.request import Request, RequestStatus
from disagg.scheduler import KVFetch, SchedulerOutput
from disagg.tracing import kv_read_hook
from disagg.transfer.backends import make_backend
from disagg.transfer.lease import Lease, LeaseTable
from disagg.transfer.service import KVTransferServer
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

    def sync(self) -> None:
        """Return once every other rank handled the messages sent before (engine thread)."""


class DisaggConnector(KVConnector):
    """Rank 0's KV connector (module docstring); ``peers`` for multi-rank workers."""

    def __init__(self, settings: DisaggSettings, config: EngineConfig, kv_cache: torch.Tensor,
                 wake: Callable[[], None], peers: RankPeers | None = None) -> None:
        # (an aggregated worker has a connector only for peer prefix reuse: kv_peer_reuse)
        self.settings = settings
        self.role = Role(settings.role)
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
        self.server: KVTransferServer | None = None
        # One record per request (records.py), and the ranks' quiet reports (any thread).
        self._records: dict[str, KVRecord] = {}
        self._quiet: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        # Both halves on every disaggregated worker, whatever its role at start: it can switch
        # role at run time (``set_role``) without building anything on any rank then. An idle
        # transfer server serves nothing: a read needs a live lease, and only a context-only
        # request makes one.
        self.puller = KVPuller.for_worker(settings, self.backend, kv_cache, self.layout, 0,
                                          self.stats, reader_id=f"{self.worker_id}:0")
        self.leases = LeaseTable(settings.kv_lease_ttl_s, on_release=self._on_release)
        self.streams = StreamPublisher(self.leases, kv_cache, settings.stream_wait_s,
                                       settings.kv_lease_ttl_s)
        # The engine loop sweeps expiries (sweep_interval_s=None): one owner of the clock.
        self.server = KVTransferServer(kv_cache, self.leases, settings.cluster_token,
                                       self.backend, settings.host, stats=self.stats,
                                       advertise_host=settings.advertise_host,
                                       sweep_interval_s=None,
                                       progress=self.streams.progress).start()
        # Traced READs (a generation worker's kv_transfer span named): a span each.
        self.server.on_traced_read = kv_read_hook(settings.otlp_traces_endpoint)
        if peers is not None:
            if any(a is None for a in peers.transfer_addresses):
                raise RuntimeError("a rank of this worker has no KV transfer server")
            peers.on_event(wake)
        # --kv-link-check: this layout's test blocks through this backend, pulled by another
        # process (transfer/linkcheck.py); logged, in info(); a failed pull stops the start.
        self.link_check: dict[str, object] | None = None
        if settings.kv_link_check:
            from disagg.transfer.linkcheck import startup_link_check

            try:
                self.link_check = startup_link_check(
                    self.backend, kv_cache, settings.cluster_token, settings.host,
                    settings.advertise_host)
            except BaseException:
                self.shutdown()
                raise

    # ---- introspection / lifecycle ------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """Every rank's transfer address, rank order (what a context answer's params name)."""
        if self.server is None:
            return []
        rest = list(self.peers.transfer_addresses) if self.peers is not None else []
        return [self.server.address, *rest]  # type: ignore[list-item]

    def set_role(self, role: Role) -> None:
        """The worker serves ``role`` from now on (engine thread, once the old role drained:
        ``drain_pending`` is all zero). Nothing is built or torn down: both halves exist."""
        if role not in (Role.CONTEXT, Role.GENERATION):
            raise ValueError(f"role: {role!r} has no KV transfer")
        logger.info("KV connector: role %s -> %s", self.role, role)
        self.role = Role(role)

    def drain_pending(self) -> tuple[int, int]:
        """(live leases, pulls in flight) on any rank: what a role switch waits for (engine
        thread)."""
        leases = 0 if self.leases is None else len(self.leases)
        leases += sum(1 for lid, rec in self._records.items() if rec.live_on is not None
                      and (self.leases is None or lid not in self.leases))
        return leases, sum(1 for rec in self._records.values() if rec.in_flight)

    def info(self) -> dict[str, object]:
        context = self.role == Role.CONTEXT
        return {"role": self.role.value, "worker_id": self.worker_id,
                "backend": self.backend.name.upper(),
                # a generation worker's idle transfer server is not advertised
                "addresses": self.addresses if context else [],
                "layout": self.layout.to_dict(),
                "lease_ttl_s": self.settings.kv_lease_ttl_s if context else None,
                # UCX: profile, UCX_TLS and the transports its context runs (None for TCP)
                "ucx": describe() if (describe := getattr(self.backend, "describe", None))
                else None,
                # --kv-link-check's result (None when off)
                "link_check": self.link_check}

    def stats_snapshot(self) -> TransferStatsSnapshot:
        # list(): one C-level copy under the GIL (the engine thread updates the dict).
        return merge_snapshots([self.stats.snapshot(), *list(self._rank_stats.values())])

    def busy(self) -> bool:
        return any(rec.in_flight or rec.live_on is not None
                   for rec in self._records.values()) or (
            self.leases is not None and len(self.leases) > 0)

    def request_state(self, request_id: str) -> KVRequestState | None:
        """A read-only view of the request's record (status, ranks, rank 0's reads in
        flight), or None when this worker keeps none for it (engine thread)."""
        rec = self._records.get(request_id)
        return rec.view() if rec is not None else None

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.puller.close()

    # ---- scheduler side -----------------------------------------------------------------------

    def add_request(self, request_id: str, mode: KVMode, lease: bool) -> bool:
        if isinstance(mode, Pull):
            self._records[request_id] = KVRecord(KVStatus.AWAITING_BLOCKS, params=mode.params)
        elif isinstance(mode, ContextStream):  # its lease exists from now on, on every rank
            self.streams.open(request_id, mode.num_tokens, mode.tokens_hash)
            self._records[request_id] = KVRecord(KVStatus.STREAMING, self._all_ranks())
            if self.peers is not None:
                self.peers.send_all(OpenStreams(
                    ((request_id, mode.num_tokens, mode.tokens_hash),)))
            return True
        elif isinstance(mode, ContextOnly) and lease:
            self._records[request_id] = KVRecord(KVStatus.MAY_LEASE)
            return True
        return False

    def add_prefix(self, request_id: str, params: ContextParams) -> None:
        before = self._records.pop(request_id, None)  # a context request's MAY_LEASE
        self._records[request_id] = KVRecord(
            KVStatus.AWAITING_BLOCKS, params=params, prefix=True,
            after=before.status if before is not None else None)

    def lease_prefix(self, lease_id: str, token_ids: list[int], block_ids: list[int]
                     ) -> ContextParams:
        if self.leases is None:
            raise RuntimeError("no lease table")
        # blocks [0, n) hold tokens [0, n * B): whole blocks only
        n = len(block_ids) * self.layout.tokens_per_block
        if not 0 < n < len(token_ids):
            raise ValueError(f"{len(block_ids)} blocks for a prompt of {len(token_ids)} tokens")
        if self.peers is not None:  # every rank leases its slice of the same blocks
            self.peers.send_all(AnnounceLeases(((lease_id, tuple(block_ids)),)))
            self._records[lease_id] = KVRecord(KVStatus.LEASED, self._all_ranks())
            # before the answer leaves: a peer's READ may reach rank r at once (a context
            # answer waits for its step instead, which rank r runs after the message)
            self.peers.sync()
        try:
            lease = self.leases.create(lease_id, list(block_ids), readers=1)
        except BaseException:
            self._records.pop(lease_id, None)
            self._send(ReleaseLeases((lease_id,)))
            raise
        return ContextParams(
            ctx_request_id=lease_id, first_gen_tokens=[], prompt_token_ids=list(token_ids[:n]),
            worker_id=self.worker_id, backend=self.backend.name.upper(),
            addresses=self.addresses, block_ids=list(block_ids), num_tokens=n,
            layout=self.layout,
            lease_expiry=time.time() + (lease.expires_at - time.monotonic()), cached_tokens=n)

    def _all_ranks(self) -> set[int]:
        """Where a new lease lives, when that is tracked (multi-rank workers; records.py)."""
        return set(range(self.world_size)) if self.peers is not None else set()

    def request_finished(self, request: Request, held_blocks: list[int] | None,
                         logprobs: list[dict[int, float]] | None) -> ContextParams | None:
        rid = request.request_id
        rec = self._records.get(rid)
        status = rec.status if rec is not None else None
        if rec is not None and status in REMOTE_STATUSES:
            # Ended before its KV was in place: the context side frees.
            assert rec.params is not None
            self._stop_pull(rid, rec)
            self.release_remote(rec.params)
        if status is KVStatus.STREAMING:
            return self._finish_stream(request, held_blocks, logprobs)
        if status in (KVStatus.MAY_LEASE, KVStatus.ANNOUNCED):
            del self._records[rid]
        if held_blocks is not None and request.status == RequestStatus.FINISHED_LENGTH:
            return self._create_lease(rid, held_blocks, request, logprobs)
        if status is KVStatus.ANNOUNCED:  # ended without a lease: the other ranks drop theirs
            self._send(ReleaseLeases((rid,)))
        return None

    def _create_lease(self, request_id: str, block_ids: list[int], request: Request,
                      logprobs: list[dict[int, float]] | None) -> ContextParams:
        """Lease a finished context-only request's blocks; the answer's params."""
        if self.leases is None:
            raise RuntimeError(f"a {self.role} worker has no lease table")
        if self.peers is not None:
            self._records[request_id] = KVRecord(KVStatus.LEASED, self._all_ranks())
        try:
            lease = self.leases.create(request_id, block_ids, readers=1)
        except BaseException:
            self._records.pop(request_id, None)
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
        rec = self._records.get(rid)
        if lease is None or rec is None or rec.live_on is None:
            self._records.pop(rid, None)  # no lease, or (one rank) the lease table holds it
        else:
            rec.status = KVStatus.LEASED
        if lease is None:
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
        may_lease = (KVStatus.MAY_LEASE, KVStatus.ANNOUNCED)
        items = tuple((r.request_id, tuple(r.block_ids)) for r in sched.scheduled
                      if r.sample and (rec := self._records.get(r.request_id)) is not None
                      and rec.status in may_lease)
        if items:
            self.peers.send_all(AnnounceLeases(items))
            for rid, _ in items:
                self._records[rid].status = KVStatus.ANNOUNCED

    def start_load(self, fetch: KVFetch) -> None:
        rid = fetch.request_id
        rec = self._records[rid]
        assert rec.status is KVStatus.AWAITING_BLOCKS and rec.params is not None, rec.status
        try:
            rec.pull = self.puller.start(rid, rec.params, list(fetch.block_ids),
                                         lambda _f: self._wake())
        except Exception as e:
            if not rec.prefix:
                raise
            # a peer's prefix: the request computes it (reported by the next get_finished)
            logger.warning("request %s: the pull of a peer's prefix cannot start: %r", rid, e)
            rec.status = KVStatus.FAILED
            rec.remote_error = KVTransferError.because(f": {e!r}")
            self._wake()
            return
        rec.status = KVStatus.PULLING
        if self.peers is not None:
            rec.ranks = set(range(1, self.world_size))
            self.peers.send_all(StartFetch(rid, rec.params, tuple(fetch.block_ids)))

    def get_finished(self) -> FinishedTransfers:
        leases_ended = self._drain_released()
        done = FinishedTransfers(leases_ended)
        self._poll_pulls(done)
        self._poll_stopping(done)
        return done

    def _poll_pulls(self, done: FinishedTransfers) -> None:
        """Pulls done on every rank: installed (rank 0's slice) and their lease given back
        (loaded; the data is here: the context side may free its blocks), or failed."""
        self._take_events()
        for rid, rec in list(self._records.items()):
            if rec.prefix and rec.status is KVStatus.FAILED and rec.pull is None:
                # (its pull could not start: start_load)
                assert rec.params is not None and rec.remote_error is not None
                self._prefix_done(rid, rec)
                done.prefix_failed.append((rid, rec.remote_error))
                continue
            if rec.status is not KVStatus.PULLING or rec.ranks:
                continue
            assert rec.pull is not None and rec.params is not None
            if not rec.pull.done:
                continue
            outcome = self.puller.finish(rec.pull, rec.remote_error)
            if rec.prefix:
                self._prefix_done(rid, rec)
                if isinstance(outcome, Loaded):
                    done.loaded.append(rid)
                else:
                    done.prefix_failed.append((rid, outcome))
            elif isinstance(outcome, Loaded):
                del self._records[rid]
                done.loaded.append(rid)
                if outcome.first is not None:
                    done.first[rid] = outcome.first
                self.release_remote(rec.params)
            else:
                self._records[rid] = KVRecord(KVStatus.FAILED, params=rec.params)
                done.failed.append((rid, outcome))

    def _prefix_done(self, request_id: str, rec: KVRecord) -> None:
        """A peer's prefix pull ended on every rank (in place or failed): the lease goes back,
        the record becomes what the request was before it (a context request's MAY_LEASE)."""
        assert rec.params is not None
        self.release_remote(rec.params)
        if rec.after is None:
            del self._records[request_id]
        else:
            self._records[request_id] = KVRecord(rec.after)

    def _stop_pull(self, request_id: str, rec: KVRecord) -> None:
        """Cancel the reads of a request that ended while its KV was arriving (or before it
        started); returns at once. Its blocks stay out of the pool (the scheduler's
        ``draining``) until ``get_finished`` reports it in ``loads_stopped``: once rank 0's
        reads into them are quiet and every rank still pulling answered ``CancelFetch``.
        Reads into private buffers finish there, unread."""
        pulling = rec.status is KVStatus.PULLING
        ranks = set(rec.ranks) if pulling else set()
        self._records[request_id] = KVRecord(KVStatus.STOPPING, ranks | {0})
        if ranks:
            assert self.peers is not None
            self.peers.send_all(CancelFetch(request_id))
        self.puller.cancel(rec.pull if pulling else None,
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
            rec = self._records.get(rid)
            if rec is not None and rec.status is KVStatus.STOPPING:
                rec.ranks.discard(rank)
        for rid, rec in list(self._records.items()):
            if rec.status is KVStatus.STOPPING and not rec.ranks:
                del self._records[rid]
                done.loads_stopped.append(rid)

    # ---- leases: ending them ------------------------------------------------------------------

    def release_lease(self, lease_id: str) -> bool:
        if self.leases is None:
            return False
        if (rec := self._records.get(lease_id)) is not None and rec.live_on is not None:
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
        rec = self._records.get(lease_id)
        live = rec.live_on if rec is not None else None
        if rec is None or live is None:
            return  # dropped (never leased), or a stale lease of a failed step
        live.discard(rank)
        if not live:
            if rec.status is KVStatus.LEASED:
                del self._records[lease_id]
            self._released.put(lease_id)  # the request id: drained below

    def _drain_released(self) -> list[str]:
        """Request ids whose held blocks may be freed now (sweeps expiries first)."""
        now = time.monotonic()
        if self.leases is not None and now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self.leases.expire()
        out = []
        for lid in _drain(self._released):
            rec = self._records.get(lid)
            if rec is not None and rec.live_on is not None:
                self._lease_ended_on(lid, 0)  # rank 0's lease ended; others may still be live
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
                rec = self._records.get(ev.request_id)
                if rec is not None and rec.status is KVStatus.PULLING:
                    rec.ranks.discard(ev.rank)
                    if ev.error is not None and rec.remote_error is None:
                        rec.remote_error = ev.error

    # ---- giving a remote lease back -----------------------------------------------------------

    def release_remote(self, params: ContextParams | LeaseRef) -> None:
        """Tell every context rank that this worker is done (or gave up): the context worker
        frees the blocks now. Fire and forget; a dead peer just fails the future. Any thread
        (the client only submits to its own loop)."""
        self.puller.release(params)


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
