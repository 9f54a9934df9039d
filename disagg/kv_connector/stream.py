"""The context side of KV streaming on one rank (rank 0's ``DisaggConnector`` and rank r's
``RankTransfer`` each hold one).

A streaming context-only request (``kv_stream_id``) gets its lease when it is queued, with no
blocks and a long TTL (``wait_s``: it may wait in the queue, then prefill), and the rank's
``StreamProgress`` says, step by step and layer by layer, which of its prompt KV exists: the
transfer server answers a generation rank's waiting READ as soon as the layers it asks for
are computed for every token it asks for. When the prefill ends by length the lease takes the
request's blocks and the normal TTL (then it is an ordinary lease: confirmed by the reader,
released, or expired); any other end drops it, which fails waiting reads (``unknown_lease``).

Per step (engine thread, before the forward): ``step`` hands the progress the streaming
requests of the plan; the model calls ``progress.layer_done(i)`` after each local layer (the
hook ``install_hook`` sets). Ranges::

    request's prompt:                        [0 ............................. num_tokens)
    committed before this step (all layers): [0, start)
    this step's chunk:                                  [start, end)  layer 0, 1, ... done
    a READ of tokens [0, num_tokens) x layers [l0, l1) is answered once end >= num_tokens
    and layers [l0, l1) are done in this step (or a later step committed them)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from disagg.scheduler import SchedulerOutput
from disagg.transfer.lease import LeaseTable
from disagg.transfer.progress import StreamProgress

logger = logging.getLogger("disagg.kv_connector")

StreamItem = tuple[str, tuple[int, ...], int, int]  # (stream id, blocks, start, end)


class StreamPublisher:
    """One rank's streaming leases and their progress (module docstring)."""

    def __init__(self, leases: LeaseTable, kv_cache: torch.Tensor, wait_s: float,
                 lease_ttl_s: float) -> None:
        # kv_cache: [num_blocks, local layers, 2, local kv heads, B, D] (DESIGN 1)
        self.progress = StreamProgress(kv_cache.shape[1], kv_cache.device)
        self.leases = leases
        self.wait_s = wait_s
        self.lease_ttl_s = lease_ttl_s
        self._open: set[str] = set()  # queued or prefilling
        self._last_step_had_items = False

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._open

    @property
    def active(self) -> bool:
        """Steps must be announced (``step``): a stream is open, or the last step had one
        (its tokens are committed by the next ``begin_step``)."""
        return bool(self._open) or self._last_step_had_items

    def open(self, stream_id: str, num_tokens: int, tokens_hash: str) -> None:
        """A streaming request was queued: its lease (no blocks yet) and its progress."""
        self.leases.create(stream_id, (), readers=1, ttl_s=self.wait_s)
        self._open.add(stream_id)
        self.progress.open(stream_id, num_tokens, tokens_hash)

    def step(self, items: Iterable[StreamItem]) -> None:
        items = list(items)
        self._last_step_had_items = bool(items)
        self.progress.begin_step(items)

    def finish(self, stream_id: str, block_ids: Iterable[int] | None) -> bool:
        """The request's prefill ended: with ``block_ids`` (it ended by length) the lease
        keeps them for the normal TTL; True if it still lives (a reader may have given up
        already). Else, or when it ended, the lease and the progress are dropped."""
        self._open.discard(stream_id)
        if block_ids is not None and self.leases.extend(stream_id, list(block_ids),
                                                        self.lease_ttl_s):
            return True
        self.leases.release(stream_id)
        self.progress.close(stream_id)
        return False

    def lease_ended(self, lease_id: str) -> None:
        """Any thread: the lease ended (confirmed, released, expired): reads stop waiting."""
        self.progress.close(lease_id)


def stream_items(sched: SchedulerOutput, streams: StreamPublisher) -> list[StreamItem]:
    """The plan's chunks of streaming requests: (id, block table, start, end)."""
    return [(r.request_id, tuple(r.block_ids), r.start_pos, r.start_pos + len(r.token_ids))
            for r in sched.scheduled if r.request_id in streams]


def install_hook(model: torch.nn.Module, progress: StreamProgress) -> None:
    """Have ``model`` report each local layer to ``progress`` (``LlamaForCausalLM.layer_hook``)."""
    model.layer_hook = progress.layer_done  # type: ignore[assignment]
