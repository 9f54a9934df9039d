"""KV plumbing of a single-rank context or generation worker (REFERENCE sections 4 and 6).

``DisaggRuntime`` sits beside the engine and is driven by the engine thread:

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

Single-rank workers only (this rank is rank 0 of a tp=1, pp=1 worker); the layout code already
handles any context layout, so a multi-rank context worker needs no change here.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from disagg.config import EngineConfig
from disagg.parallel.layout import ParallelLayout
from disagg.transfer.base import ReadRequest, TransferError, make_backend
from disagg.transfer.kvcopy import scatter_tokens
from disagg.transfer.layout import RankLayout, TransferPiece, WorkerLayout, plan_pulls
from disagg.transfer.lease import Lease, LeaseTable
from disagg.transfer.params import ContextParams
from disagg.transfer.stats import TransferStats

logger = logging.getLogger(__name__)

# Prefix of the error of a request whose KV could not be pulled; the server maps it to 502.
KV_TRANSFER_ERROR = "kv transfer failed"
SWEEP_INTERVAL_S = 0.25  # how often the engine loop ends expired leases


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


@dataclass
class _Read:
    piece: TransferPiece
    request: ReadRequest
    out: torch.Tensor
    future: cf.Future


@dataclass
class _Fetch:
    request_id: str
    params: ContextParams
    block_ids: list[int]  # this worker's blocks for the prompt
    reads: list[_Read] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)


class DisaggRuntime:
    def __init__(self, settings: DisaggSettings, config: EngineConfig, kv_cache: torch.Tensor,
                 wake: Callable[[], None]) -> None:
        if settings.role not in ("context", "generation"):
            raise ValueError(f"role: {settings.role!r} has no KV transfer")
        self.settings = settings
        self.role = settings.role
        self.worker_id = uuid.uuid4().hex  # a restarted worker is a new worker
        self.layout = worker_layout(config)
        self.kv_cache = kv_cache
        self.stats = TransferStats()
        self.backend = make_backend({"backend": settings.backend,
                                     "ucx_profile": settings.ucx_profile})
        self._wake = wake
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._next_sweep = 0.0
        self.leases: LeaseTable | None = None
        self.server = None
        self._clients: dict[str, object] = {}
        self._fetches: dict[str, _Fetch] = {}
        self.reader_id = f"{self.worker_id}:0"
        if self.role == "context":
            from disagg.transfer.service import KVTransferServer

            self.leases = LeaseTable(settings.lease_ttl_s, on_release=self._on_release)
            # The engine loop sweeps expiries (sweep_interval_s=None): one owner of the clock.
            self.server = KVTransferServer(kv_cache, self.leases, settings.cluster_token,
                                           self.backend, settings.host, stats=self.stats,
                                           sweep_interval_s=None).start()

    # ---- lifecycle / introspection ---------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        return [self.server.address] if self.server is not None else []

    def info(self) -> dict[str, object]:
        return {"role": self.role, "worker_id": self.worker_id,
                "backend": self.backend.name.upper(),
                "addresses": self.addresses,
                "lease_ttl_s": self.settings.lease_ttl_s if self.role == "context" else None}

    def busy(self) -> bool:
        """Something the engine loop must come back for soon (reads, leases to expire)."""
        return bool(self._fetches) or (self.leases is not None and len(self.leases) > 0)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        for client in self._clients.values():
            client.close()  # type: ignore[attr-defined]
        self._clients.clear()

    # ---- context side ----------------------------------------------------------------------

    def _on_release(self, lease: Lease, reason: str) -> None:
        # Any thread: only enqueue; the engine thread frees the blocks.
        logger.debug("lease %s ended (%s)", lease.lease_id, reason)
        self._released.put(lease.lease_id)
        self._wake()

    def drain_released(self) -> list[str]:
        """Engine thread: request ids whose held blocks may be freed now (sweeps expiries)."""
        now = time.monotonic()
        if self.leases is not None and now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self.leases.expire()
        out = []
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
        lease = self.leases.create(request_id, block_ids, readers=1)
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
            from disagg.transfer.service import KVTransferClient

            b = self.backend if backend == self.backend.name.upper() else make_backend(backend)
            client = KVTransferClient(b, self.settings.cluster_token,
                                      timeout_s=self.settings.read_timeout_s, stats=self.stats)
            self._clients[backend] = client
        return client

    def start_fetch(self, request_id: str, params: ContextParams, block_ids: list[int]) -> None:
        """Engine thread: submit the reads of one request (returns at once)."""
        src, dst = params.layout, self.layout
        # Same block size: whole blocks (server may send straight from its cache); else the
        # token-major format, scattered into our differently sized blocks.
        fmt = "blocks" if src.tokens_per_block == dst.tokens_per_block else "tokens"
        n_src_blocks = math.ceil(params.num_tokens / src.tokens_per_block)
        src_blocks = tuple(params.block_ids[:n_src_blocks])
        client = self._client(params.backend)
        fetch = _Fetch(request_id, params, list(block_ids))
        dtype = self.kv_cache.dtype
        for piece in plan_pulls(src, dst, 0):
            req = ReadRequest(lease_id=params.ctx_request_id, block_ids=src_blocks,
                              layer_slice=piece.src_layer_slice,
                              head_slice=piece.src_head_slice, num_tokens=params.num_tokens,
                              format=fmt)
            nl = piece.layers[1] - piece.layers[0]
            nh = piece.heads[1] - piece.heads[0]
            shape = ((len(src_blocks), nl, 2, nh, src.tokens_per_block, src.head_dim)
                     if fmt == "blocks" else (nl, 2, nh, params.num_tokens, src.head_dim))
            out = torch.empty(shape, dtype=dtype)  # private: never freed under a transfer
            fut = client.read(params.addresses[piece.src_rank], req, out)
            fut.add_done_callback(lambda _f: self._wake())
            fetch.reads.append(_Read(piece, req, out, fut))
        self._fetches[request_id] = fetch

    def poll_fetches(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Engine thread, non-blocking: (request ids whose KV is now in place, failures)."""
        ready: list[str] = []
        failed: list[tuple[str, str]] = []
        for rid, fetch in list(self._fetches.items()):
            if not all(r.future.done() for r in fetch.reads):
                continue
            del self._fetches[rid]
            err = next((r.future.exception() for r in fetch.reads
                        if r.future.exception() is not None), None)
            if err is not None:
                failed.append((rid, _describe(err, fetch)))
                continue
            try:
                self._install(fetch)
            except Exception as e:  # a malformed payload must fail the request, not the loop
                logger.exception("installing pulled KV of %s failed", rid)
                failed.append((rid, f"{KV_TRANSFER_ERROR}: {e!r}"))
                continue
            ready.append(rid)
        return ready, failed

    def _install(self, fetch: _Fetch) -> None:
        kv = self.kv_cache
        B = kv.shape[4]
        n = fetch.params.num_tokens
        for r in fetch.reads:
            p = r.piece
            if r.request.format == "tokens":
                scatter_tokens(kv, fetch.block_ids, r.out, p.dst_layer_slice, p.dst_head_slice)
                continue
            # Same block size: block i of the context table is block i of ours.
            blocks = torch.tensor(fetch.block_ids[:math.ceil(n / B)], dtype=torch.long)
            (l0, l1), (h0, h1) = p.dst_layer_slice, p.dst_head_slice
            if (l0, l1) == (0, kv.shape[1]) and (h0, h1) == (0, kv.shape[3]):
                kv.index_copy_(0, blocks, r.out)
            else:
                view = kv[:, l0:l1, :, h0:h1]
                view[blocks] = r.out

    def cancel_fetch(self, request_id: str) -> None:
        """Forget a request's reads (aborted); they finish into private buffers, unread."""
        fetch = self._fetches.pop(request_id, None)
        if fetch is not None:
            for r in fetch.reads:
                r.future.cancel()

    def release_remote(self, params: ContextParams) -> None:
        """Tell every context rank we read from that we are done (or gave up): the context
        worker frees the blocks now. Fire and forget; a dead peer just fails the future."""
        try:
            client = self._client(params.backend)
            ranks = {p.src_rank for p in plan_pulls(params.layout, self.layout, 0)}
        except Exception:
            logger.exception("cannot release lease %s", params.ctx_request_id)
            return
        for rank in sorted(ranks):
            fut = client.release(params.addresses[rank], params.ctx_request_id, self.reader_id)
            fut.add_done_callback(_log_release_failure)


def _log_release_failure(fut: cf.Future) -> None:
    if fut.cancelled():
        return
    e = fut.exception()
    if e is not None:  # expired / unknown lease or a dead context worker: nothing to free
        logger.info("lease release not confirmed: %s", e)


def _describe(err: BaseException, fetch: _Fetch) -> str:
    where = ", ".join(sorted({fetch.params.addresses[r.piece.src_rank] for r in fetch.reads}))
    if isinstance(err, TransferError):
        return (f"{KV_TRANSFER_ERROR} ({err.code}) pulling lease {fetch.params.ctx_request_id!r} "
                f"from {where}: {err.message or err.code}")
    return f"{KV_TRANSFER_ERROR} pulling from {where}: {err!r}"
