"""The server side of one READ's payload: where its bytes come from (views of the cache, or a
staging buffer) and how a message transport sends them part by part.

A READ's payload is a list of contiguous byte views, in payload order (``payload_source``):

- one view of the cache: a consecutive run that is contiguous (``plan_read``'s zero copy);
- with runs on (CPU cache, ``"blocks"`` format, all kv heads of the rank): one view per run of
  consecutive block ids, or per block for a layer range (``payload.block_views``): a stream
  transport (TCP) sends them as they are, one ``sendmsg`` over up to IOV_MAX of them;
- else one view of a staging buffer the selection was gathered into first.

A message transport (UCX) sends one message per part of the READ (``parts``: byte lengths
the client chose, ``service.split_parts``). A part that lies inside one view goes as that view;
one that spans several is gathered into its own byte range of a staging buffer on the gather
thread (``send_parts``), all gathers queued at once, so part k+1 is gathered while part k is on
the wire::

    views:   |-- run 0 --|-- run 1 --|-- run 2 --|-- run 3 --|
    parts:   [--- part 0 ---)[------ part 1 ------)[ part 2 )
    part 0 spans runs 0-1: gathered into staging[0:a]; part 2 lies in run 3: sent as is.

``PayloadSource`` is a server's whole payload path: its cache, staging pool, gather thread
and (GPU cache) whether payloads leave GPU memory through the transport itself.

``within_lease`` bounds a READ from its pin to its end: a reader that stops reading (a stopped
or wedged process: the socket's buffers fill, a UCX rendezvous is never answered) would hold
the lease's blocks for ever; the server cancels a read still in flight ``read_grace_s`` after
its lease ended and closes that connection. A cancelled read's gathers run to their end before
its staging buffer is given back (the copies on the gather thread cannot be stopped).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from disagg.transfer.base import Connection, ReadRequest, TransportBackend
from disagg.transfer.integrity import payload_checksum
from disagg.transfer.lease import LeaseTable
from disagg.transfer.payload import (
    ReadPlan,
    StagingPool,
    as_byte_array,
    as_payload,
    block_views,
    byte_views,
    dtype_name,
    gather_into,
    gather_into_from_device,
    gather_views,
    plan_read,
)

logger = logging.getLogger("disagg.transfer")

GATHER_INLINE_MAX_BYTES = 1 << 20  # bigger gathers run on a worker thread, not the I/O loop
# A read in flight asks its lease's end again at least this often (seconds): an ``extend``
# moves it later, an early end (released, confirmed) sooner.
HOLD_CHECK_S = 1.0
# The stats code (``disagg_kv_transfer_failures_total{code}``) of a read aborted by
# ``within_lease``; never sent on the wire (the reader sees its connection closed).
READ_STALLED = "read_stalled"

T = TypeVar("T")


class ReadStalled(Exception):
    """A read was still in flight ``grace_s`` after its lease ended (``within_lease``)."""

    def __init__(self, lease_id: str, grace_s: float) -> None:
        super().__init__(f"{READ_STALLED}: the read of lease {lease_id!r} was still in flight "
                         f"{grace_s:g}s after the lease ended")
        self.lease_id = lease_id
        self.grace_s = grace_s


async def within_lease(work: Coroutine[Any, Any, T], leases: LeaseTable, lease_id: str,
                       grace_s: float) -> T:
    """Run ``work`` (a read of pinned lease ``lease_id``) to its end, or until ``grace_s``
    after the lease ends (``LeaseTable.hold_left``, asked again at least every
    ``HOLD_CHECK_S``); then cancel it, let it unwind (its cleanup runs: the transport's I/O
    stopped, staging given back) and raise ``ReadStalled``. ``work`` runs in the calling task
    (a timer cancels it): a read costs one timer, no task of its own."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    fired = False
    timer: asyncio.TimerHandle | None = None

    def check() -> None:
        nonlocal fired, timer
        left = leases.hold_left(lease_id) + grace_s
        if left <= 0:
            fired = True
            task.cancel()
        else:
            timer = loop.call_later(min(left, HOLD_CHECK_S), check)

    check()  # (the lease was just pinned: live, so this arms the timer)
    try:
        return await work
    except asyncio.CancelledError:
        if not fired:
            raise
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+: tell ours from others
        if uncancel is not None and uncancel() > 0:
            raise  # cancelled from outside too (the server stops)
        raise ReadStalled(lease_id, grace_s) from None
    finally:
        if timer is not None:
            timer.cancel()


class PayloadSource:
    """Where one server's READ payloads come from (module docstring). ``kv_cache``:
    ``[num_blocks, num_local_layers, 2, num_local_kv_heads, tokens_per_block, head_dim]`` on
    the CPU or a CUDA device. ``runs``: a scattered table of a CPU cache goes out as views of
    its runs. ``staging``, the gathers and the device stream are used on the server's loop
    thread (and its gather thread) only.

    A GPU cache's payloads go GPU to GPU where the backend moves GPU memory (decided by
    ``use_backend``, once the backend runs: sent straight from the cache, or gathered on the GPU
    into device staging); otherwise they are gathered on the GPU and sent from pinned host
    memory, and ``staging_reason`` says why ("" for a CPU cache: nothing to stage)."""

    def __init__(self, kv_cache: torch.Tensor, max_staging_buffers: int, runs: bool) -> None:
        self.kv_cache = kv_cache
        self.runs = runs
        self.on_gpu = kv_cache.device.type == "cuda"
        self.dtype = dtype_name(kv_cache.dtype)
        self.device_direct = False
        self.staging_reason = ""
        self._max_staging = max_staging_buffers
        # pinned for a GPU cache staged on the host, device memory when the transport sends
        # GPU memory (decided in start(), once UCX runs)
        self.staging = StagingPool(max_staging_buffers, pinned=self.on_gpu)
        self._stream = torch.cuda.Stream(kv_cache.device) if self.on_gpu else None
        self._gather_pool: cf.ThreadPoolExecutor | None = None

    @property
    def tokens_per_block(self) -> int:
        return self.kv_cache.shape[4]

    def start(self) -> None:
        """Start the gather thread (before the server takes connections)."""
        self._gather_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-transfer-gather")

    def use_backend(self, backend: TransportBackend) -> None:
        """A GPU cache: whether ``backend`` sends GPU memory (known once it runs; logged)."""
        if not self.on_gpu:
            return
        ok, how = backend.device_memory_support()
        self.device_direct, self.staging_reason = ok, ("" if ok else how)
        self.staging = StagingPool(self._max_staging, pinned=not ok,
                                   device=self.kv_cache.device if ok else None)
        if ok:
            logger.info("kv transfer server: GPU cache payloads are sent from GPU memory (%s)",
                        how)
        else:
            logger.warning("kv transfer server: GPU cache payloads are staged in pinned host "
                           "memory: %s", how)

    def stop(self) -> None:
        """Wait for the gather thread's jobs and end it."""
        if self._gather_pool is not None:
            self._gather_pool.shutdown(wait=True)
            self._gather_pool = None

    def plan(self, req: ReadRequest, leased: frozenset[int] | None, view: bool = True
             ) -> ReadPlan:
        """``plan_read`` over this cache (``leased``: the lease's blocks; None: any;
        ``view``: False when no payload is sent, so no zero-copy view is looked for)."""
        return plan_read(self.kv_cache, req, leased, self.device_direct, view)

    @property
    def answer_device(self) -> bool:
        """What a READ answer's ``device`` says: the payload leaves GPU memory as it is."""
        return self.on_gpu and self.device_direct

    @property
    def answer_staging(self) -> str | None:
        """A GPU cache's reason for pinned host memory (None for a CPU cache)."""
        return self.staging_reason if self.on_gpu else None

    async def source(self, req: ReadRequest, plan: ReadPlan
                     ) -> tuple[list[Any], torch.Tensor | None]:
        """``payload_source`` for this cache (the caller gives a staging buffer back)."""
        return await payload_source(self.kv_cache, req, plan, self.staging,
                                    self.runs and not self.on_gpu, self._gather_pool,
                                    self._stream)

    def checksum(self, source: list[Any]) -> str:
        """``integrity.payload_checksum`` of a payload ``source`` of this cache (any thread;
        on a GPU, on the gather stream, behind the gathers that filled it)."""
        if self._stream is None:
            return payload_checksum(source)
        with torch.cuda.stream(self._stream):
            return payload_checksum(source)

    async def send_parts(self, conn: Connection, pieces: list[list[Any]],
                         staging: torch.Tensor | None, gathers: list[asyncio.Future[Any]]
                         ) -> None:
        """``send_parts`` with this source's gather thread."""
        await send_parts(conn, pieces, staging, self._gather_pool, gathers)


async def payload_source(kv: torch.Tensor, req: ReadRequest, plan: ReadPlan,
                         staging_pool: StagingPool, runs: bool,
                         gather_pool: cf.ThreadPoolExecutor | None,
                         stream: torch.cuda.Stream | None
                         ) -> tuple[list[Any], torch.Tensor | None]:
    """The payload as contiguous byte views, in order, and the staging buffer they live in
    (None: straight from the cache; the caller gives the buffer back). ``runs``: a scattered
    table of a CPU cache may go as views of its runs (module docstring). ``stream``: the
    cache is on a GPU, gather there."""
    if plan.zero_copy is not None:
        # CPU cache, or a GPU cache over a transport that sends GPU memory (the prefill that
        # wrote these blocks finished before the lease existed)
        return [as_payload(plan.zero_copy)], None
    if runs and req.format == "blocks" and kv.device.type == "cpu":
        views = block_views(kv, req.block_ids, req.layer_slice, req.head_slice)
        if views is not None:
            return byte_views(views), None
    staging = staging_pool.acquire(plan.nbytes)
    job: asyncio.Future[Any] | None = None
    try:
        dst = staging[:plan.nbytes].view(kv.dtype).view(plan.shape)
        loop = asyncio.get_running_loop()
        if stream is not None:  # GPU cache: gather there (into GPU or pinned)
            job = loop.run_in_executor(gather_pool, gather_into_from_device, kv, req, dst,
                                       stream)
        elif plan.nbytes <= GATHER_INLINE_MAX_BYTES or gather_pool is None:
            gather_into(kv, req, dst)
        else:  # numpy copies release the GIL: the loop keeps serving meanwhile
            job = loop.run_in_executor(gather_pool, gather_into, kv, req, dst)
        if job is not None:
            await asyncio.shield(job)  # a cancel must not orphan the copy (below)
    except BaseException:
        if job is not None and not job.done():
            # cancelled mid-gather: the copy still writes into the buffer, let it end first
            await asyncio.wait((job,))
            if not job.cancelled():
                job.exception()  # retrieved: the cancel is what propagates
        staging_pool.release(staging)
        raise
    return [as_payload(staging[:plan.nbytes])], staging


async def send_parts(conn: Connection, pieces: list[list[Any]], staging: torch.Tensor | None,
                     gather_pool: cf.ThreadPoolExecutor | None,
                     gathers: list[asyncio.Future[Any]]) -> None:
    """One message per part (``pieces[k]``: the views holding part k's bytes). A part in one
    view goes as that view; a part spanning several is gathered into its bytes ``[a, b)`` of
    ``staging`` on the gather thread. ``gathers`` collects those jobs: the caller awaits them
    before ``staging`` serves another read, whatever happened to the connection."""
    loop = asyncio.get_running_loop()
    dsts: list[Any] = []
    a = 0
    for p in pieces:
        b = a + sum(v.nbytes for v in p)
        if len(p) == 1:
            dsts.append(None)
        else:
            if staging is None:
                raise ValueError("a part spanning several views needs a staging buffer")
            dst = as_byte_array(staging[a:b])
            dsts.append(dst)
            gathers.append(loop.run_in_executor(gather_pool, gather_views, p, dst))
        a = b

    async def produce() -> Any:
        queued = iter(gathers)
        for p, dst in zip(pieces, dsts, strict=True):
            if dst is None:
                yield p[0]
            else:
                # shielded: a cancel leaves the job in ``gathers`` for the caller to await
                await asyncio.shield(next(queued))
                yield dst

    await conn.send_payload_parts(produce(), len(pieces))
