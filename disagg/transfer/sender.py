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
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from typing import Any

import torch

from disagg.transfer.base import Connection, ReadRequest
from disagg.transfer.payload import (
    ReadPlan,
    StagingPool,
    as_byte_array,
    as_payload,
    block_views,
    byte_views,
    gather_into,
    gather_into_from_device,
    gather_views,
)

GATHER_INLINE_MAX_BYTES = 1 << 20  # bigger gathers run on a worker thread, not the I/O loop


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
    try:
        dst = staging[:plan.nbytes].view(kv.dtype).view(plan.shape)
        loop = asyncio.get_running_loop()
        if stream is not None:  # GPU cache: gather there (into GPU or pinned)
            await loop.run_in_executor(gather_pool, gather_into_from_device, kv, req, dst,
                                       stream)
        elif plan.nbytes <= GATHER_INLINE_MAX_BYTES or gather_pool is None:
            gather_into(kv, req, dst)
        else:  # numpy copies release the GIL: the loop keeps serving meanwhile
            await loop.run_in_executor(gather_pool, gather_into, kv, req, dst)
    except BaseException:
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
                await next(queued)
                yield dst

    await conn.send_payload_parts(produce(), len(pieces))
