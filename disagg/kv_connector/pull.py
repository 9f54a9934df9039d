"""One rank's share of pulling a request's prompt KV: shared by rank 0 (``DisaggConnector``)
and ranks 1..N-1 (``RankTransfer``) of a generation worker.

For each context rank whose layers / kv heads overlap this rank's (``plan_pulls``), one coalesced
read. Where the payload's bytes are runs of this rank's own blocks (a CPU cache, the same block
size, a piece with all of this rank's kv heads: tp equal, or this rank holding fewer heads than
the context rank; pp may differ), the read lands straight in the
request's blocks (``payload.block_views``: one buffer per run of consecutive block ids, or per
block for a layer range) and there is nothing to install. Otherwise it lands in a private
receive buffer (never freed under a transfer in flight) and, once every read of the request is
done, ``install`` copies (and converts) it into the request's blocks.

Receiving into the blocks is safe because they are the request's own (fresh blocks, never a
prefix hit: nobody reads them until the pull is reported loaded) and because a pull that ends
early is cancelled with ``cancel_reads``, which calls back once the transport has stopped
writing (``ReadFuture.quiet``): until then the scheduler keeps the blocks of the aborted or
failed request out of the pool (``Scheduler.draining``), so nothing can write into a block
after it was reused, and the engine loop never waits for a transport to unwind (a UCX endpoint
abort may take seconds). A failed pull's blocks were never registered in the prefix cache (that
happens when the pull is reported loaded), so a half-written block is never served as a hit.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from disagg.config import EngineConfig
from disagg.contracts.params import ContextParams, token_ids_hash
from disagg.kv_connector.errors import KVTransferError
from disagg.kv_connector.recv_pool import ReceivePool
from disagg.kv_connector.settings import DisaggSettings
from disagg.layout import ParallelLayout, RankLayout, TransferPiece, WorkerLayout, plan_pulls
from disagg.transfer.backends import make_backend
from disagg.transfer.base import ReadRequest, TransferError
from disagg.transfer.kvcopy import scatter_tokens
from disagg.transfer.payload import block_views
from disagg.transfer.stats import TransferStats

logger = logging.getLogger("disagg.kv_connector")


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
    base: torch.Tensor | None = None  # ``out``'s pooled buffer (CPU cache), see give_back

    @property
    def direct(self) -> bool:
        return self.out is None


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


def log_kv_path(client: Any, kv: torch.Tensor, where: str) -> None:
    """Say once per client how pulled KV reaches a GPU cache (and why not directly)."""
    if kv.device.type != "cuda":
        return
    ok, how = client.device_support
    if ok:
        logger.info("%s: pulled KV goes GPU to GPU (%s)", where, how)
    else:
        logger.warning("%s: pulled KV is staged in pinned host memory: %s", where, how)


def submit_reads(client: Any, params: ContextParams, dst: WorkerLayout, dst_rank: int,
                  kv: torch.Tensor, on_done: Callable[[cf.Future], None],
                  pool: ReceivePool | None = None, block_ids: list[int] | None = None,
                  wait_s: float = 600.0) -> list[Read]:
    """Start rank ``dst_rank``'s reads of a request: one per context rank it needs (streamed
    params: one per group of its layers, each answered once the context worker computed
    those layers, waiting at most ``wait_s``). With the
    request's ``block_ids`` (this rank's cache ``kv`` on the CPU, the client's ``runs`` on), a
    payload whose bytes are runs of those blocks lands in them (module docstring). Else
    payloads land in GPU memory when ``kv`` is on a GPU and the client's transport moves GPU
    memory; else in host memory (pinned for a GPU cache; for a CPU cache a buffer of
    ``pool``, whose pages are mapped already, when given)."""
    device_direct = kv.device.type == "cuda" and bool(getattr(client, "device_payloads",
                                                              False))
    src = params.layout
    # Same block size: whole blocks (server may send straight from its cache); else the
    # token-major format, scattered into our differently sized blocks.
    fmt = "blocks" if src.tokens_per_block == dst.tokens_per_block else "tokens"
    # Prompt positions [0, num_tokens) live in the context table's first
    # ceil(num_tokens / B_src) blocks; a piece is layers [l0, l1) x kv heads [h0, h1) of them.
    n_src_blocks = math.ceil(params.num_tokens / src.tokens_per_block)
    # Streamed: the context worker's blocks are its own business (it fills them in).
    src_blocks = tuple(params.block_ids[:n_src_blocks])
    runs = bool(getattr(client, "runs", False)) and fmt == "blocks" and kv.device.type == "cpu"
    stream = _stream_fields(params, wait_s)
    pieces = stream_pieces(plan_pulls(src, dst, dst_rank), params.stream)
    # Streamed, rank 0: its last read from context rank 0 also brings the first token.
    first = (max(i for i, p in enumerate(pieces) if p.src_rank == 0)
             if params.stream and dst_rank == 0 else -1)
    reads: list[Read] = []
    for i, piece in enumerate(pieces):
        req = ReadRequest(lease_id=params.ctx_request_id, block_ids=src_blocks,
                          layer_slice=piece.src_layer_slice,
                          head_slice=piece.src_head_slice, num_tokens=params.num_tokens,
                          format=fmt, first_token=i == first, **stream)
        nl = piece.layers[1] - piece.layers[0]
        nh = piece.heads[1] - piece.heads[0]
        shape = ((n_src_blocks, nl, 2, nh, src.tokens_per_block, src.head_dim)
                 if fmt == "blocks" else (nl, 2, nh, params.num_tokens, src.head_dim))
        # Payload block i is this rank's block block_ids[i] (same block size).
        views = (block_views(kv, block_ids[:n_src_blocks], piece.dst_layer_slice,
                             piece.dst_head_slice)
                 if runs and block_ids is not None and len(block_ids) >= n_src_blocks
                 else None)
        if views is not None and client.accepts_segments([v.numel() * v.element_size()
                                                          for v in views]):
            fut = client.read(params.addresses[piece.src_rank], req, views)
            fut.add_done_callback(on_done)
            reads.append(Read(piece, req, None, fut))
            continue
        base = None
        if pool is not None and kv.device.type == "cpu":
            out, base = pool.take(shape, kv.dtype)  # private until given back after install
        else:
            out = alloc_out(shape, kv, device_direct)  # private: never freed under a transfer
        fut = client.read(params.addresses[piece.src_rank], req, out)
        fut.add_done_callback(on_done)
        reads.append(Read(piece, req, out, fut, base))
    return reads


# A streamed pull reads each context rank's layers in about this many groups: the first ones
# move while the context worker computes the later ones; the last group is the tail left after
# its prefill (more groups: a shorter tail, more requests).
STREAM_LAYER_GROUPS = 8


def stream_pieces(pieces: list[TransferPiece], stream: bool) -> list[TransferPiece]:
    """Each piece as it is (not streamed), or cut into layer groups in layer order::

        piece layers [a, b) -> [a, a+g) [a+g, a+2g) ... [.., b),  g = ceil((b - a) / 8)
        local slices move with them: src [s0 + (x - a), s0 + (y - a)) for group [x, y)
    """
    if not stream:
        return pieces
    out = []
    for p in pieces:
        a, b = p.layers
        g = math.ceil((b - a) / min(b - a, STREAM_LAYER_GROUPS))
        for x in range(a, b, g):
            y = min(b, x + g)
            s0, d0 = p.src_layer_slice[0], p.dst_layer_slice[0]
            out.append(replace(p, layers=(x, y), src_layer_slice=(s0 + x - a, s0 + y - a),
                               dst_layer_slice=(d0 + x - a, d0 + y - a)))
    return out


def _stream_fields(params: ContextParams, wait_s: float) -> dict[str, Any]:
    """The READ fields of a streamed pull: wait for the KV, and name the tokens it is of."""
    if not params.stream:
        return {}
    ids = params.prompt_token_ids[:params.num_tokens]
    return {"wait_s": wait_s, "tokens_hash": token_ids_hash(ids)}


def give_back(pool: ReceivePool | None, reads: list[Read]) -> None:
    """After ``install``: the reads' pooled buffers serve later pulls. Only then: a failed or
    cancelled read may still be written by the transport, so its buffer is just dropped."""
    if pool is None:
        return
    for r in reads:
        if r.base is not None:
            pool.give(r.base)


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


def first_token(reads: list[Read]) -> dict[str, Any]:
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


def first_error(reads: list[Read]) -> BaseException | None:
    return next((r.future.exception() for r in reads if r.future.exception() is not None),
                None)


def describe_failure(err: BaseException, params: ContextParams, reads: list[Read]
                     ) -> KVTransferError:
    where = ", ".join(sorted({params.addresses[r.piece.src_rank] for r in reads}))
    if isinstance(err, TransferError):
        return KVTransferError.because(
            f" ({err.code}) pulling lease {params.ctx_request_id!r} from {where}: "
            f"{err.message or err.code}", code=err.code)
    return KVTransferError.because(f" pulling from {where}: {err!r}")


def make_client(own: Any, backend: str, settings: DisaggSettings, stats: TransferStats,
                kv: torch.Tensor, where: str) -> Any:
    """A transfer client over ``backend`` (this worker's own backend object when it is the
    same one), logging once how its payloads reach ``kv``."""
    from disagg.transfer.service import KVTransferClient

    b = own if backend == own.name.upper() else make_backend(backend)
    client = KVTransferClient(b, settings.cluster_token, timeout_s=settings.read_timeout_s,
                              stats=stats)
    log_kv_path(client, kv, f"{where} over {b.name}")
    return client


def log_release_failure(fut: cf.Future) -> None:
    if fut.cancelled():
        return
    e = fut.exception()
    if e is not None:  # expired / unknown lease or a dead context worker: nothing to free
        logger.info("lease release not confirmed: %s", e)
