"""``KVPuller``: one rank's pulls of prompt KV (generation side), one object per rank, used by
rank 0 (``DisaggConnector``) and by ranks 1..N-1 (``RankTransfer``) alike. It owns the transfer
clients (one per backend), the receive buffers, the layout and the install::

    pull = puller.start(request_id, params, block_ids, on_read_done)  # reads in flight
    ... every read done (pull.done) ...
    outcome = puller.finish(pull)       # Loaded (installed in the blocks) | KVTransferError
    puller.cancel(pull, on_quiet)       # instead: the request ended; on_quiet once quiet
    puller.release(params)              # rank 0: the context lease goes back
    puller.close()

``start`` follows the pull plan (``pull_plan.plan_pull``: the reads, a pure function of the
params, the layouts, the rank and the cache's device). Where the payload's bytes are runs of
this rank's own blocks (a CPU cache, the same block size, a piece with all of this rank's kv
heads: tp equal, or this rank holding fewer heads than the context rank; pp may differ), the
read lands straight in the request's blocks (``payload.block_views``: one buffer per run of
consecutive block ids, or per block for a layer range) and there is nothing to install.
Otherwise it lands in a private receive buffer (never freed under a transfer in flight) and,
once every read of the request is done, ``finish`` copies (and converts) it into the
request's blocks.

Receiving into the blocks is safe because they are the request's own (fresh blocks, never a
prefix hit: nobody reads them until the pull is reported loaded) and because a pull that ends
early is cancelled with ``cancel``, which calls back once the transport has stopped writing
(``ReadFuture.quiet``): until then the scheduler keeps the blocks of the aborted or failed
request out of the pool (``Scheduler.draining``), so nothing can write into a block after it
was reused, and the engine loop never waits for a transport to unwind (a UCX endpoint abort
may take seconds). A failed pull's blocks were never registered in the prefix cache (that
happens when the pull is reported loaded), so a half-written block is never served as a hit.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from disagg.config import EngineConfig
from disagg.contracts.params import ContextParams, LeaseRef
from disagg.kv_connector.errors import KVTransferError
from disagg.kv_connector.kvcopy import scatter_tokens
from disagg.kv_connector.pull_plan import plan_pull
from disagg.kv_connector.recv_pool import ReceivePool
from disagg.kv_connector.settings import DisaggSettings
from disagg.layout import ParallelLayout, RankLayout, TransferPiece, WorkerLayout
from disagg.transfer.backends import make_backend
from disagg.transfer.base import ReadRequest, TransferError, TransportBackend
from disagg.transfer.payload import block_views
from disagg.transfer.service import KVTransferClient
from disagg.transfer.stats import TransferStats

logger = logging.getLogger("disagg.kv_connector")


def worker_layout(config: EngineConfig) -> WorkerLayout:
    """The ``WorkerLayout`` of a worker's ranks (``ParallelLayout`` -> transfer layout)."""
    ranks = ParallelLayout.all_ranks(config.model, config.parallel)
    first = ranks[0]
    return WorkerLayout(
        tp_size=first.tp_size, pp_size=first.pp_size, num_layers=first.num_layers_total,
        num_kv_heads=first.num_kv_heads_total, head_dim=first.head_dim,
        tokens_per_block=config.cache.tokens_per_block, dtype=config.kv_dtype,
        ranks=tuple(RankLayout(r.rank, r.tp_rank, r.pp_rank, r.layer_range, r.kv_head_range)
                    for r in ranks),
        cache_kind=first.cache_kind, kv_parts=first.kv_parts,
    )


# How long cancelling a pull waits for its reads to stop writing (a UCX endpoint abort may
# take up to 2 s; a TCP read stops at the loop's next turn).
CANCEL_WAIT_S = 10.0


@dataclass
class Read:
    """One read in flight: a piece of the plan, its request, where its payload lands."""

    piece: TransferPiece
    request: ReadRequest
    out: torch.Tensor | None  # the private receive buffer; None: straight into the blocks
    future: cf.Future
    base: torch.Tensor | None = None  # ``out``'s pooled buffer (CPU cache), see KVPuller.finish

    @property
    def direct(self) -> bool:
        return self.out is None


@dataclass
class Pull:
    """One rank's pull of one request: its reads in flight, the blocks they fill."""

    request_id: str
    params: ContextParams
    block_ids: list[int]  # this rank's blocks of the request
    reads: list[Read]
    t0: float  # when it started (perf_counter): the whole pull's time is recorded

    @property
    def done(self) -> bool:
        """Every read finished (or failed): ``finish`` may run."""
        return all(r.future.done() for r in self.reads)


@dataclass(frozen=True)
class Loaded:
    """A finished pull whose KV is in the request's blocks. ``first``: a streamed pull's first
    token(s) (rank 0; ``FinishedTransfers.first``), else None."""

    first: dict[str, Any] | None = None


class KVPuller:
    """One rank's pulls (module docstring). ``connect(backend name)`` makes the transfer
    client of a backend (``for_worker``: the worker's own backend object when it is that one);
    clients are made on first use and kept. ``start`` / ``finish`` / ``cancel`` run on the
    rank's thread that owns the pull; ``release`` from any thread."""

    def __init__(self, kv_cache: torch.Tensor, layout: WorkerLayout, rank: int,
                 connect: Callable[[str], Any], *, stats: TransferStats | None = None,
                 wait_s: float = 600.0, pool: ReceivePool | None = None,
                 reader_id: str | None = None) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.rank = rank
        self.stats = stats if stats is not None else TransferStats()
        self.wait_s = wait_s  # how long a streamed read waits for the context worker
        self.reader_id = reader_id if reader_id is not None else f"rank{rank}"
        self._connect = connect
        self._pool = pool  # receive buffers of a CPU cache (None: a fresh one a read)
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()  # the clients: release runs on any thread

    @classmethod
    def for_worker(cls, settings: DisaggSettings, backend: TransportBackend,
                   kv_cache: torch.Tensor, layout: WorkerLayout, rank: int,
                   stats: TransferStats, reader_id: str | None = None) -> KVPuller:
        """The puller of rank ``rank`` of a context / generation worker whose own backend
        is ``backend``; its receive pages stay mapped for later pulls (``ReceivePool``)."""

        def connect(name: str) -> KVTransferClient:
            b = backend if name == backend.name.upper() else make_backend(name)
            client = KVTransferClient(b, settings.cluster_token,
                                      timeout_s=settings.read_timeout_s, stats=stats,
                                      integrity=settings.kv_integrity)
            _log_kv_path(client, kv_cache, f"kv pulls of rank {rank} over {b.name}")
            return client

        return cls(kv_cache, layout, rank, connect, stats=stats, wait_s=settings.stream_wait_s,
                   pool=ReceivePool.from_env(), reader_id=reader_id)

    def client(self, backend: str) -> Any:
        """The transfer client over ``backend`` (made on first use; any thread)."""
        with self._lock:
            client = self._clients.get(backend)
            if client is None:
                client = self._clients[backend] = self._connect(backend)
            return client

    def start(self, request_id: str, params: ContextParams, block_ids: list[int],
              on_read_done: Callable[[cf.Future], None] | None = None) -> Pull:
        """Submit this rank's reads of ``request_id``'s prompt KV into ``block_ids``; returns
        at once (``on_read_done`` is called, on a transport thread, as each read ends).
        Raises if the pull cannot start (a backend that cannot be made, bad params).
        Payloads land in the blocks where the plan allows it and the client takes those
        buffers; else in GPU memory when the cache is on a GPU and the client's transport
        moves GPU memory; else in host memory (pinned for a GPU cache; for a CPU cache a
        buffer of the pool, whose pages are mapped already)."""
        t0 = time.perf_counter()
        kv = self.kv_cache
        client = self.client(params.backend)
        plan = plan_pull(params, self.layout, self.rank, cache_device=kv.device.type,
                         runs=bool(getattr(client, "runs", False)), wait_s=self.wait_s)
        device_direct = kv.device.type == "cuda" and bool(getattr(client, "device_payloads",
                                                                  False))
        into_blocks = plan.into_blocks and len(block_ids) >= plan.num_src_blocks
        reads: list[Read] = []
        for p in plan.reads:
            address = params.addresses[p.piece.src_rank]
            # Payload block i is this rank's block block_ids[i] (same block size).
            views = (block_views(kv, block_ids[:plan.num_src_blocks], p.piece.dst_layer_slice,
                                 p.piece.dst_head_slice) if into_blocks else None)
            if views is not None and client.accepts_segments([v.numel() * v.element_size()
                                                              for v in views]):
                read = Read(p.piece, p.request, None, client.read(address, p.request, views))
            else:
                base = None
                if self._pool is not None and kv.device.type == "cpu":
                    out, base = self._pool.take(p.shape, kv.dtype)  # private until installed
                else:
                    out = alloc_out(p.shape, kv, device_direct)  # never freed under a transfer
                read = Read(p.piece, p.request, out, client.read(address, p.request, out), base)
            if on_read_done is not None:
                read.future.add_done_callback(on_read_done)
            reads.append(read)
        return Pull(request_id, params, list(block_ids), reads, t0)

    def finish(self, pull: Pull, other_error: KVTransferError | None = None
               ) -> Loaded | KVTransferError:
        """A pull whose reads are all done: install it into its blocks (the pooled buffers
        then serve later pulls) and record the install and the whole pull in ``stats``, or
        say why not: a read's failure first, then ``other_error`` (another rank's), then a
        streamed pull's missing first token (rank 0), then an install that raised (a
        malformed payload fails the request, not the loop)."""
        err = _first_error(pull.reads)
        if err is not None:
            return _describe_failure(err, pull.params, pull.reads)
        if other_error is not None:
            return other_error
        first = None
        if pull.params.stream and self.rank == 0:
            try:
                first = _first_token(pull.reads)
            except ValueError as e:
                return KVTransferError.because(f": {e}")
        on_rank = f" on rank {self.rank}" if self.rank else ""
        t0 = time.perf_counter()
        try:
            install(self.kv_cache, pull.block_ids, pull.reads, pull.params.num_tokens)
        except Exception as e:
            logger.exception("rank %d: installing pulled KV of %s failed", self.rank,
                             pull.request_id)
            return KVTransferError.because(f"{on_rank}: {e!r}")
        t1 = time.perf_counter()
        self.stats.record_install(t1 - t0, t1 - pull.t0)
        # Only now: a failed or cancelled read may still be written by the transport, so its
        # buffer is just dropped.
        if self._pool is not None:
            for r in pull.reads:
                if r.base is not None:
                    self._pool.give(r.base)
        return Loaded(first)

    def cancel(self, pull: Pull | None, on_quiet: Callable[[], None]) -> None:
        """Cancel ``pull`` (None: nothing was submitted); returns at once, ``on_quiet`` once
        nothing can write into its blocks any more (``cancel_reads``)."""
        cancel_reads(pull.reads if pull is not None else [], on_quiet)

    def release(self, params: ContextParams | LeaseRef) -> None:
        """Tell every context rank that this worker is done with the lease ``params`` names
        (or gave up): the context worker frees the blocks now. Fire and forget; a dead peer
        just fails the future. Any thread (the client only submits to its own loop). Reads
        ``ctx_request_id``, ``backend`` and ``addresses`` only."""
        try:
            client = self.client(params.backend)
        except Exception:
            logger.exception("cannot release lease %s", params.ctx_request_id)
            return
        for address in params.addresses:
            fut = client.release(address, params.ctx_request_id, self.reader_id)
            fut.add_done_callback(_log_release_failure)

    def close(self) -> None:
        """Close every client (reads in flight fail)."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


# ---- receive buffers and the install ---------------------------------------------------------

_RECEIVE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_RECEIVE_STREAMS_LOCK = threading.Lock()


def _receive_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream no kernel ever runs on, under which GPU receive buffers are allocated: the
    caching allocator hands such a buffer out again only once every stream it was used on
    (``record_stream`` in ``install``) has finished with it, so the transport, which writes
    outside any stream, never lands in memory that queued work still reads."""
    with _RECEIVE_STREAMS_LOCK:
        stream = _RECEIVE_STREAMS.get(device)
        if stream is None:
            stream = _RECEIVE_STREAMS[device] = torch.cuda.Stream(device)
        return stream


def alloc_out(shape: tuple[int, ...], kv: torch.Tensor, device_direct: bool) -> torch.Tensor:
    """A private receive buffer: GPU memory when the transport moves it, pinned host memory
    for a GPU cache otherwise, plain host memory for a CPU cache."""
    if kv.device.type == "cuda" and device_direct:
        with torch.cuda.stream(_receive_stream(kv.device)):
            return torch.empty(shape, dtype=kv.dtype, device=kv.device)
    return torch.empty(shape, dtype=kv.dtype, pin_memory=kv.device.type == "cuda")


def install(kv: torch.Tensor, block_ids: list[int], reads: list[Read], num_tokens: int
            ) -> None:
    """Copy finished reads into this rank's blocks of the request. On a GPU the copies are
    queued on the device's current stream, ahead of any step that reads these blocks; a
    payload already in GPU memory (device-direct transfer) is read there, no host copy."""
    B = kv.shape[4]
    for r in reads:
        p = r.piece
        if r.out is None:  # landed in the blocks already
            continue
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


def cancel_reads(reads: list[Read], on_quiet: Callable[[], None],
                 timeout_s: float = CANCEL_WAIT_S) -> None:
    """Cancel a pull's reads; returns at once. ``on_quiet`` is called once none of them can
    write into the request's blocks any more (at once when none could: a thread waits for the
    transport otherwise; after ``timeout_s`` it is called anyway, with an error logged). Reads
    into private buffers are not waited for: their buffers are dropped, never reused."""
    for r in reads:
        r.future.cancel()
    waits = [q for r in reads if r.direct
             and (q := getattr(r.future, "quiet", None)) is not None and not q.is_set()]
    if not waits:
        on_quiet()
        return

    def wait() -> None:
        deadline = time.monotonic() + timeout_s
        if not all(q.wait(max(0.0, deadline - time.monotonic())) for q in waits):
            logger.error("a cancelled KV read did not stop within %.0fs: its blocks are "
                         "freed anyway and may still be written", timeout_s)
        on_quiet()

    threading.Thread(target=wait, name="kv-cancel-wait", daemon=True).start()


# ---- outcomes --------------------------------------------------------------------------------


def _first_token(reads: list[Read]) -> dict[str, Any]:
    """A streamed pull's first token(s), from the read that asked for them; ValueError when
    they are missing or malformed (a context worker that does not stream this way)."""
    got = next((r.future.result().first for r in reads if r.request.first_token), None)
    tokens = got.get("tokens") if isinstance(got, dict) else None
    if not (isinstance(tokens, list) and tokens and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)):
        raise ValueError("the context worker sent no valid first token with the KV")
    lps = got.get("logprobs")  # type: ignore[union-attr]
    try:
        if lps is not None:  # JSON keys are strings: {token id: logprob} again
            if not (isinstance(lps, list) and len(lps) == len(tokens)):
                raise TypeError
            lps = [{int(k): float(v) for k, v in lp.items()} for lp in lps]
    except (AttributeError, TypeError, ValueError):
        raise ValueError("the context worker's first-token logprobs are malformed") from None
    return {"tokens": tokens, "logprobs": lps}


def _first_error(reads: list[Read]) -> BaseException | None:
    return next((r.future.exception() for r in reads if r.future.exception() is not None),
                None)


def _describe_failure(err: BaseException, params: ContextParams, reads: list[Read]
                      ) -> KVTransferError:
    where = ", ".join(sorted({params.addresses[r.piece.src_rank] for r in reads}))
    if isinstance(err, TransferError):
        return KVTransferError.because(
            f" ({err.code}) pulling lease {params.ctx_request_id!r} from {where}: "
            f"{err.message or err.code}", code=err.code)
    return KVTransferError.because(f" pulling from {where}: {err!r}")


def _log_kv_path(client: Any, kv: torch.Tensor, where: str) -> None:
    """Say once per client how pulled KV reaches a GPU cache (and why not directly)."""
    if kv.device.type != "cuda":
        return
    ok, how = client.device_support
    if ok:
        logger.info("%s: pulled KV goes GPU to GPU (%s)", where, how)
    else:
        logger.warning("%s: pulled KV is staged in pinned host memory: %s", where, how)


def _log_release_failure(fut: cf.Future) -> None:
    if fut.cancelled():
        return
    e = fut.exception()
    if e is not None:  # expired / unknown lease or a dead context worker: nothing to free
        logger.info("lease release not confirmed: %s", e)
