"""KV plumbing of a context or generation worker (REFERENCE sections 4 and 6).

``DisaggRuntime`` sits beside the engine on rank 0 and is driven by the engine thread:

- context role: a ``KVTransferServer`` over this rank's KV cache and a ``LeaseTable``; a
  context-only request that is not final keeps its blocks (``Scheduler.held``) under a lease.
  When the lease ends (confirmed by the reader, released, or expired) the table's callback —
  which may run on the transfer thread — only enqueues the request id; the engine thread frees
  the blocks in ``drain_released``.
- generation role: a ``KVTransferClient`` per backend. When the scheduler hands out a
  ``KVFetch`` the engine calls ``start_fetch``: one coalesced read per context rank
  (``plan_pulls``) into a private staging tensor, off the engine thread (client futures).
  ``poll_fetches`` never blocks: finished reads are copied into the request's own blocks on the
  engine thread (so an abort mid-transfer can never let a late write land in reused blocks),
  failed ones are reported. The lease is then confirmed (``release_remote``) — also on every
  abort or failure path, so the context side frees its blocks at once.

Multi-rank workers (tp * pp > 1): every rank holds its own slice of the KV cache, so every rank
serves (context) or pulls (generation) its own slice; ``RankTransfer`` is the part of ranks
1..N-1, driven by control messages from rank 0 (``RankPeers``: the executor's pipes) and
answering with events:

    context   rank 0 -> r  "leases" [(id, blocks)]  before the step that completes the prefill
                           (so a lease exists on every rank before rank 0 can answer)
              rank 0 -> r  "lease_release" [ids]     the answer was final / failed: drop them
              rank r -> 0  "lease_ended" id          confirmed by the generation worker, expired
                                                     (after in-flight reads) or released
              rank 0 frees the blocks once the lease ended on every rank.
    generation rank 0 -> r "fetch" (id, params, blocks)   rank r pulls its own slice and
                           installs it into its cache on its installer thread
              rank r -> 0  "fetched" id, error|None       the request decodes once every rank
                                                          (rank 0 included) has its slice
              rank 0 -> r  "cancel_fetch" id        abort: waits for an install in progress, so
                                                    no late write lands in reused blocks (the
                                                    next step reaches rank r after it)

The generation worker confirms a lease once, for all its ranks, at every context rank (one
reader per lease and rank): the context side need not know the generation layout.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from disagg.cluster_auth import PeerAllowlist
from disagg.config import EngineConfig
from disagg.layout import ParallelLayout, RankLayout, TransferPiece, WorkerLayout, plan_pulls
from disagg.transfer.backends import make_backend
from disagg.transfer.base import ReadRequest, TransferError
from disagg.transfer.kvcopy import scatter_tokens
from disagg.transfer.lease import Lease, LeaseTable
from disagg.transfer.params import ContextParams
from disagg.transfer.stats import TransferStats, TransferStatsSnapshot, merge_snapshots

logger = logging.getLogger(__name__)

# Prefix of the error of a request whose KV could not be pulled; the server maps it to 502.
KV_TRANSFER_ERROR = "kv transfer failed"
SWEEP_INTERVAL_S = 0.25  # how often the engine loop (and rank r's server) ends expired leases


@dataclass(frozen=True)
class DisaggSettings:
    """Transfer settings of a context / generation worker."""

    role: str  # "context" | "generation"
    cluster_token: str
    backend: str = "TCP"  # this worker's backend (the context side serves with it)
    host: str = "127.0.0.1"  # where the transfer server listens (context role)
    lease_ttl_s: float = 30.0
    ucx_profile: str = "same_host"
    read_timeout_s: float = 30.0
    # Generation role: context workers that requests not signed by the cluster may name.
    kv_peer_allowlist: PeerAllowlist = field(default_factory=PeerAllowlist)


def worker_layout(config: EngineConfig) -> WorkerLayout:
    """The ``WorkerLayout`` of a worker's ranks (``ParallelLayout`` -> transfer layout)."""
    ranks = ParallelLayout.all_ranks(config.model, config.parallel)
    first = ranks[0]
    return WorkerLayout(
        tp_size=first.tp_size, pp_size=first.pp_size, num_layers=first.num_layers_total,
        num_kv_heads=first.num_kv_heads_total, head_dim=first.head_dim,
        tokens_per_block=config.cache.tokens_per_block, dtype=config.dtype,
        ranks=tuple(RankLayout(r.rank, r.tp_rank, r.pp_rank, r.layer_range, r.kv_head_range)
                    for r in ranks),
    )


class RankPeers(Protocol):
    """Rank 0's line to ranks 1..N-1 of its worker (implemented by the parallel executor)."""

    world_size: int
    transfer_addresses: list[str | None]  # rank r's transfer server (context role), r >= 1

    def send_all(self, kind: str, payload: Any) -> None:
        """A control message to every other rank, in order with the steps (engine thread)."""

    def take_events(self) -> list[tuple[Any, ...]]:
        """Events the other ranks sent since the last call (non-blocking)."""

    def on_event(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a reader thread) whenever an event arrives."""


# ---- one generation rank's pull: shared by rank 0 and ranks 1..N-1 --------------------------


@dataclass
class _Read:
    piece: TransferPiece
    request: ReadRequest
    out: torch.Tensor
    future: cf.Future


_RECEIVE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_RECEIVE_STREAMS_LOCK = threading.Lock()


def _receive_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream no kernel ever runs on, under which GPU receive buffers are allocated: the
    caching allocator hands such a buffer out again only once every stream it was used on
    (``record_stream`` in ``_install``) has finished with it, so the transport, which writes
    outside any stream, never lands in memory that queued work still reads."""
    with _RECEIVE_STREAMS_LOCK:
        stream = _RECEIVE_STREAMS.get(device)
        if stream is None:
            stream = _RECEIVE_STREAMS[device] = torch.cuda.Stream(device)
        return stream


def _alloc_out(shape: tuple[int, ...], kv: torch.Tensor, device_direct: bool) -> torch.Tensor:
    """A private receive buffer: GPU memory when the transport moves it, pinned host memory
    for a GPU cache otherwise, plain host memory for a CPU cache."""
    if kv.device.type == "cuda" and device_direct:
        with torch.cuda.stream(_receive_stream(kv.device)):
            return torch.empty(shape, dtype=kv.dtype, device=kv.device)
    return torch.empty(shape, dtype=kv.dtype, pin_memory=kv.device.type == "cuda")


def log_kv_path(client: Any, kv: torch.Tensor, where: str) -> None:
    """Say once per client how pulled KV reaches a GPU cache (and why not directly)."""
    if kv.device.type != "cuda":
        return
    ok, how = client.device_support
    if ok:
        logger.info("%s: pulled KV goes GPU to GPU (%s)", where, how)
    else:
        logger.warning("%s: pulled KV is staged in pinned host memory: %s", where, how)


def _submit_reads(client: Any, params: ContextParams, dst: WorkerLayout, dst_rank: int,
                  kv: torch.Tensor, on_done: Callable[[cf.Future], None]) -> list[_Read]:
    """Start rank ``dst_rank``'s reads of a request: one per context rank it needs. Payloads
    land in GPU memory when ``kv``, this rank's cache, is on a GPU and the client's transport
    moves GPU memory; else in host memory (pinned for a GPU cache)."""
    device_direct = kv.device.type == "cuda" and bool(getattr(client, "device_payloads",
                                                              False))
    src = params.layout
    # Same block size: whole blocks (server may send straight from its cache); else the
    # token-major format, scattered into our differently sized blocks.
    fmt = "blocks" if src.tokens_per_block == dst.tokens_per_block else "tokens"
    n_src_blocks = math.ceil(params.num_tokens / src.tokens_per_block)
    src_blocks = tuple(params.block_ids[:n_src_blocks])
    reads: list[_Read] = []
    for piece in plan_pulls(src, dst, dst_rank):
        req = ReadRequest(lease_id=params.ctx_request_id, block_ids=src_blocks,
                          layer_slice=piece.src_layer_slice,
                          head_slice=piece.src_head_slice, num_tokens=params.num_tokens,
                          format=fmt)
        nl = piece.layers[1] - piece.layers[0]
        nh = piece.heads[1] - piece.heads[0]
        shape = ((len(src_blocks), nl, 2, nh, src.tokens_per_block, src.head_dim)
                 if fmt == "blocks" else (nl, 2, nh, params.num_tokens, src.head_dim))
        out = _alloc_out(shape, kv, device_direct)  # private: never freed under a transfer
        fut = client.read(params.addresses[piece.src_rank], req, out)
        fut.add_done_callback(on_done)
        reads.append(_Read(piece, req, out, fut))
    return reads


def _install(kv: torch.Tensor, block_ids: list[int], reads: list[_Read], num_tokens: int
             ) -> None:
    """Copy finished reads into this rank's blocks of the request. On a GPU the copies are
    queued on the device's current stream, ahead of any step that reads these blocks; a
    payload already in GPU memory (device-direct transfer) is read there, no host copy."""
    B = kv.shape[4]
    for r in reads:
        p = r.piece
        if r.out.device == kv.device:
            payload = r.out
            if kv.device.type == "cuda":
                # r.out was allocated under the receive stream: keep the allocator from
                # handing it out again before this stream's copies below have read it.
                payload.record_stream(torch.cuda.current_stream(kv.device))
        else:
            # Pinned host -> GPU without waiting; the caching host allocator keeps r.out
            # alive until the copy has run.
            payload = r.out.to(kv.device, non_blocking=True)
        if r.request.format == "tokens":
            scatter_tokens(kv, block_ids, payload, p.dst_layer_slice, p.dst_head_slice)
            continue
        # Same block size: block i of the context table is block i of ours.
        blocks = torch.tensor(block_ids[:math.ceil(num_tokens / B)], dtype=torch.long,
                              device=kv.device)
        (l0, l1), (h0, h1) = p.dst_layer_slice, p.dst_head_slice
        if (l0, l1) == (0, kv.shape[1]) and (h0, h1) == (0, kv.shape[3]):
            kv.index_copy_(0, blocks, payload)
        else:
            view = kv[:, l0:l1, :, h0:h1]
            view[blocks] = payload


def _first_error(reads: list[_Read]) -> BaseException | None:
    return next((r.future.exception() for r in reads if r.future.exception() is not None),
                None)


def _describe(err: BaseException, params: ContextParams, reads: list[_Read]) -> str:
    where = ", ".join(sorted({params.addresses[r.piece.src_rank] for r in reads}))
    if isinstance(err, TransferError):
        return (f"{KV_TRANSFER_ERROR} ({err.code}) pulling lease {params.ctx_request_id!r} "
                f"from {where}: {err.message or err.code}")
    return f"{KV_TRANSFER_ERROR} pulling from {where}: {err!r}"


@dataclass
class _Fetch:
    request_id: str
    params: ContextParams
    block_ids: list[int]  # this worker's blocks for the prompt
    reads: list[_Read] = field(default_factory=list)
    remote_pending: set[int] = field(default_factory=set)  # ranks r >= 1 yet to report
    remote_error: str | None = None
    t0: float = field(default_factory=time.perf_counter)


class DisaggRuntime:
    """Rank 0's KV plumbing (see the module docstring); ``peers`` for multi-rank workers."""

    def __init__(self, settings: DisaggSettings, config: EngineConfig, kv_cache: torch.Tensor,
                 wake: Callable[[], None], peers: RankPeers | None = None) -> None:
        if settings.role not in ("context", "generation"):
            raise ValueError(f"role: {settings.role!r} has no KV transfer")
        self.settings = settings
        self.role = settings.role
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
        self._clients: dict[str, object] = {}
        self._fetches: dict[str, _Fetch] = {}
        # Context, multi-rank: leases announced to ranks 1..N-1, and the ranks where a lease
        # is still live (rank 0 included); the blocks are freed when that set is empty.
        self._announced: set[str] = set()
        self._live_on: dict[str, set[int]] = {}
        self.reader_id = f"{self.worker_id}:0"
        if self.role == "context":
            from disagg.transfer.service import KVTransferServer

            self.leases = LeaseTable(settings.lease_ttl_s, on_release=self._on_release)
            # The engine loop sweeps expiries (sweep_interval_s=None): one owner of the clock.
            self.server = KVTransferServer(kv_cache, self.leases, settings.cluster_token,
                                           self.backend, settings.host, stats=self.stats,
                                           sweep_interval_s=None).start()
        if peers is not None:
            if self.role == "context" and any(a is None for a in peers.transfer_addresses):
                raise RuntimeError("a rank of this context worker has no KV transfer server")
            peers.on_event(wake)

    # ---- lifecycle / introspection ---------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """Every rank's transfer address, rank order (context role)."""
        if self.server is None:
            return []
        rest = list(self.peers.transfer_addresses) if self.peers is not None else []
        return [self.server.address, *rest]  # type: ignore[list-item]

    def info(self) -> dict[str, object]:
        return {"role": self.role, "worker_id": self.worker_id,
                "backend": self.backend.name.upper(),
                "addresses": self.addresses,
                "layout": self.layout.to_dict(),
                "lease_ttl_s": self.settings.lease_ttl_s if self.role == "context" else None}

    def stats_snapshot(self) -> TransferStatsSnapshot:
        """Transfer counters of the whole worker: rank 0's, plus the other ranks' latest."""
        # list(): one C-level copy under the GIL (the engine thread updates the dict).
        return merge_snapshots([self.stats.snapshot(), *list(self._rank_stats.values())])

    def busy(self) -> bool:
        """Something the engine loop must come back for soon (reads, leases to expire)."""
        return bool(self._fetches) or bool(self._live_on) or (
            self.leases is not None and len(self.leases) > 0)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        for client in self._clients.values():
            client.close()  # type: ignore[attr-defined]
        self._clients.clear()

    def _events(self) -> None:
        """Engine thread: take the other ranks' events (lease ends, finished pulls)."""
        if self.peers is None:
            return
        for ev in self.peers.take_events():
            kind, rank, key, detail, snap = ev
            self._rank_stats[rank] = snap
            if kind == "lease_ended":
                self._lease_ended_on(key, rank)
            elif kind == "fetched":
                fetch = self._fetches.get(key)
                if fetch is not None:
                    fetch.remote_pending.discard(rank)
                    if detail is not None and fetch.remote_error is None:
                        fetch.remote_error = detail

    # ---- context side ----------------------------------------------------------------------

    def announce_leases(self, items: list[tuple[str, list[int]]]) -> None:
        """Engine thread, before the step that completes these context-only prefills: every
        other rank creates the lease now, so it exists before rank 0 can answer."""
        if self.peers is None or not items:
            return
        self.peers.send_all("leases", items)
        self._announced.update(rid for rid, _ in items)

    def not_leased(self, request_id: str) -> None:
        """A context-only request ended without a lease (final answer, error): the other
        ranks drop the lease announced for it."""
        if request_id in self._announced:
            self._announced.discard(request_id)
            assert self.peers is not None
            self.peers.send_all("lease_release", [request_id])

    def release_lease(self, lease_id: str) -> bool:
        """Engine thread: end a lease nobody will read (the router gave up on handing the
        context answer to a generation worker). False if it was not live here."""
        if self.leases is None:
            return False
        if self.peers is not None and lease_id in self._live_on:
            self.peers.send_all("lease_release", [lease_id])
        return self.leases.release(lease_id)

    def _on_release(self, lease: Lease, reason: str) -> None:
        # Any thread: only enqueue; the engine thread frees the blocks.
        logger.debug("lease %s ended (%s)", lease.lease_id, reason)
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

    def drain_released(self) -> list[str]:
        """Engine thread: request ids whose held blocks may be freed now (sweeps expiries)."""
        now = time.monotonic()
        if self.leases is not None and now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self.leases.expire()
        out = []
        local: list[str] = []
        while True:
            try:
                local.append(self._released.get_nowait())
            except queue.Empty:
                break
        for lid in local:
            if lid in self._live_on:  # rank 0's local lease ended; others may still be live
                self._lease_ended_on(lid, 0)
            else:
                out.append(lid)
        self._events()  # may end leases on the last rank
        while True:
            try:
                out.append(self._released.get_nowait())
            except queue.Empty:
                return out

    def create_lease(self, request_id: str, block_ids: list[int], prompt_token_ids: list[int],
                     first_tokens: list[int],
                     first_logprobs: list[dict[int, float]] | None) -> ContextParams:
        """Lease a finished context-only request's blocks; the answer's params."""
        assert self.leases is not None
        if self.peers is not None:
            self._announced.discard(request_id)
            self._live_on[request_id] = set(range(self.world_size))
        try:
            lease = self.leases.create(request_id, block_ids, readers=1)
        except BaseException:
            self._live_on.pop(request_id, None)
            if self.peers is not None:
                self.peers.send_all("lease_release", [request_id])
            raise
        return ContextParams(
            ctx_request_id=request_id, first_gen_tokens=list(first_tokens),
            prompt_token_ids=list(prompt_token_ids), worker_id=self.worker_id,
            backend=self.backend.name.upper(), addresses=self.addresses,
            block_ids=list(block_ids), num_tokens=len(prompt_token_ids), layout=self.layout,
            lease_expiry=time.time() + (lease.expires_at - lease.created_at),
            first_gen_logprobs=first_logprobs,
        )

    # ---- generation side -------------------------------------------------------------------

    def _client(self, backend: str):  # noqa: ANN202 (KVTransferClient, imported lazily)
        client = self._clients.get(backend)
        if client is None:
            client = _make_client(self.backend, backend, self.settings, self.stats,
                                  self.kv_cache, "kv pulls of rank 0")
            self._clients[backend] = client
        return client

    def start_fetch(self, request_id: str, params: ContextParams, block_ids: list[int]) -> None:
        """Engine thread: submit the reads of one request (returns at once)."""
        client = self._client(params.backend)
        fetch = _Fetch(request_id, params, list(block_ids))
        fetch.reads = _submit_reads(client, params, self.layout, 0, self.kv_cache,
                                    lambda _f: self._wake())
        if self.peers is not None:
            fetch.remote_pending = set(range(1, self.world_size))
            self.peers.send_all("fetch", (request_id, params.to_dict(), list(block_ids)))
        self._fetches[request_id] = fetch

    def poll_fetches(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Engine thread, non-blocking: (request ids whose KV is now in place, failures)."""
        self._events()
        ready: list[str] = []
        failed: list[tuple[str, str]] = []
        for rid, fetch in list(self._fetches.items()):
            if fetch.remote_pending or not all(r.future.done() for r in fetch.reads):
                continue
            del self._fetches[rid]
            err = _first_error(fetch.reads)
            if err is not None:
                failed.append((rid, _describe(err, fetch.params, fetch.reads)))
                continue
            if fetch.remote_error is not None:
                failed.append((rid, fetch.remote_error))
                continue
            try:
                _install(self.kv_cache, fetch.block_ids, fetch.reads, fetch.params.num_tokens)
            except Exception as e:  # a malformed payload must fail the request, not the loop
                logger.exception("installing pulled KV of %s failed", rid)
                failed.append((rid, f"{KV_TRANSFER_ERROR}: {e!r}"))
                continue
            ready.append(rid)
        return ready, failed

    def cancel_fetch(self, request_id: str) -> None:
        """Forget a request's reads (aborted); they finish into private buffers, unread. The
        other ranks drop theirs before the next step reaches them."""
        fetch = self._fetches.pop(request_id, None)
        if fetch is not None:
            for r in fetch.reads:
                r.future.cancel()
            if self.peers is not None and fetch.remote_pending:
                self.peers.send_all("cancel_fetch", request_id)

    def release_remote(self, params: ContextParams) -> None:
        """Tell every context rank that this worker is done (or gave up): the context worker
        frees the blocks now. Fire and forget; a dead peer just fails the future. Any
        thread (the client only submits to its own loop)."""
        try:
            client = self._client(params.backend)
        except Exception:
            logger.exception("cannot release lease %s", params.ctx_request_id)
            return
        for address in params.addresses:
            fut = client.release(address, params.ctx_request_id, self.reader_id)
            fut.add_done_callback(_log_release_failure)


def _make_client(own: Any, backend: str, settings: DisaggSettings, stats: TransferStats,
                 kv: torch.Tensor, where: str) -> Any:
    from disagg.transfer.service import KVTransferClient

    b = own if backend == own.name.upper() else make_backend(backend)
    client = KVTransferClient(b, settings.cluster_token, timeout_s=settings.read_timeout_s,
                              stats=stats)
    log_kv_path(client, kv, f"{where} over {b.name}")
    return client


def _log_release_failure(fut: cf.Future) -> None:
    if fut.cancelled():
        return
    e = fut.exception()
    if e is not None:  # expired / unknown lease or a dead context worker: nothing to free
        logger.info("lease release not confirmed: %s", e)


# ---- ranks 1..N-1 ---------------------------------------------------------------------------


@dataclass
class _RankFetch:
    params: ContextParams
    block_ids: list[int]
    reads: list[_Read] = field(default_factory=list)
    pending: int = 0
    cancelled: bool = False


class RankTransfer:
    """The KV plumbing of rank ``rank`` >= 1 of a multi-rank worker (module docstring).

    ``handle`` runs on the rank's main thread between steps; ``emit`` sends an event to rank 0
    (thread-safe). Events: ``(kind, rank, id, detail, TransferStatsSnapshot)``.
    """

    def __init__(self, settings: DisaggSettings, config: EngineConfig, rank: int,
                 kv_cache: torch.Tensor, emit: Callable[[tuple[Any, ...]], None]) -> None:
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
        if settings.role == "context":
            from disagg.transfer.service import KVTransferServer

            self.leases = LeaseTable(settings.lease_ttl_s, on_release=self._on_release)
            self.server = KVTransferServer(kv_cache, self.leases, settings.cluster_token,
                                           self.backend, settings.host, stats=self.stats,
                                           sweep_interval_s=SWEEP_INTERVAL_S).start()
        else:
            # Installs run here, not on the transport's thread (which must keep progressing).
            self._installer = cf.ThreadPoolExecutor(1, thread_name_prefix=f"disagg-install{rank}")

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    def _send(self, kind: str, key: str, detail: Any = None) -> None:
        self._emit((kind, self.rank, key, detail, self.stats.snapshot()))

    def handle(self, kind: str, payload: Any) -> None:
        """A control message from rank 0 (main thread, between steps)."""
        if kind == "leases":
            assert self.leases is not None
            for lease_id, block_ids in payload:
                try:
                    self.leases.create(lease_id, block_ids, readers=1)
                except ValueError:  # a duplicate id: keep the live one
                    logger.warning("rank %d: lease %s exists already", self.rank, lease_id)
        elif kind == "lease_release":
            assert self.leases is not None
            for lease_id in payload:
                self.leases.release(lease_id)
        elif kind == "fetch":
            self._start_fetch(*payload)
        elif kind == "cancel_fetch":
            with self._lock:  # waits for an install in progress
                fetch = self._fetches.pop(payload, None)
                if fetch is not None:
                    fetch.cancelled = True
            if fetch is not None:
                for r in fetch.reads:
                    r.future.cancel()
        else:
            raise RuntimeError(f"unknown transfer message {kind!r}")

    def _on_release(self, lease: Lease, reason: str) -> None:
        # Any thread (reader confirm, sweep, release): rank 0 frees once every rank said so.
        self._send("lease_ended", lease.lease_id, reason)

    def _start_fetch(self, request_id: str, params_dict: dict[str, Any], block_ids: list[int]
                     ) -> None:
        params = ContextParams.from_dict(params_dict)
        fetch = _RankFetch(params, block_ids)
        client = self._clients.get(params.backend)
        if client is None:
            client = self._clients[params.backend] = _make_client(
                self.backend, params.backend, self.settings, self.stats, self.kv_cache,
                f"kv pulls of rank {self.rank}")
        with self._lock:
            self._fetches[request_id] = fetch
            try:
                fetch.reads = _submit_reads(
                    client, params, self.layout, self.rank, self.kv_cache,
                    lambda _f: None)
            except Exception as e:
                del self._fetches[request_id]
                self._send("fetched", request_id, f"{KV_TRANSFER_ERROR} on rank {self.rank}: "
                                                  f"{e!r}")
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
            err = _first_error(fetch.reads)
            detail = None
            if err is not None:
                detail = _describe(err, fetch.params, fetch.reads)
            else:
                try:
                    _install(self.kv_cache, fetch.block_ids, fetch.reads,
                             fetch.params.num_tokens)
                except Exception as e:
                    logger.exception("rank %d: installing pulled KV of %s failed", self.rank,
                                     request_id)
                    detail = f"{KV_TRANSFER_ERROR} on rank {self.rank}: {e!r}"
        self._send("fetched", request_id, detail)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        for client in self._clients.values():
            client.close()
        if self._installer is not None:
            self._installer.shutdown(wait=False, cancel_futures=True)
