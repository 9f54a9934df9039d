"""Rank 0 <-> rank r messages of a multi-rank worker's KV connector (frozen, picklable).

Control messages go from rank 0 to every other rank on the executor's control pipe, in order
with the steps (rank r handles one before the next step reaches it); events come back on a
separate event pipe, from whatever thread of rank r noticed them.

    context     AnnounceLeases   before the step that completes these context-only prefills,
                                 so a lease exists on every rank before rank 0 can answer
                ReleaseLeases    the answer was final, failed, or the router gave up: drop them
                LeaseEnded (ev)  rank r's lease was confirmed by the reader, expired (after its
                                 in-flight reads) or released; rank 0 frees the blocks once the
                                 lease ended on every rank
                OpenStreams      streaming context-only requests were queued: every rank
                                 makes their lease and lets reads wait on them
                StreamStep       before every step while streams are open: the streaming
                                 requests of this step, their blocks and token ranges
                FinishStreams    their prefill ended: keep the lease (blocks) or drop it
    generation  StartFetch       rank r pulls its own slice and installs it into its cache
                FetchDone (ev)   rank r's slice is in place (or failed); the request decodes
                                 once every rank, rank 0 included, has its slice
                CancelFetch      the request ended (abort, error): rank r drops its pull
                FetchStopped (ev) rank r's cancelled reads can no longer write into the blocks
                                 (an install in progress finished); rank 0 frees the blocks
                                 once every rank still pulling said so
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.contracts.params import ContextParams
from disagg.kv_connector.errors import KVTransferError
from disagg.transfer.stats import TransferStatsSnapshot


class TransferMessage:
    """Base of the control messages a rank's ``RankTransfer`` handles."""

    __slots__ = ()


@dataclass(frozen=True)
class AnnounceLeases(TransferMessage):
    leases: tuple[tuple[str, tuple[int, ...]], ...]  # (lease id = request id, block ids)


@dataclass(frozen=True)
class ReleaseLeases(TransferMessage):
    lease_ids: tuple[str, ...]


@dataclass(frozen=True)
class OpenStreams(TransferMessage):
    streams: tuple[tuple[str, int, str], ...]  # (stream id, tokens to publish, tokens hash)


@dataclass(frozen=True)
class StreamStep(TransferMessage):
    # (stream id, block ids, first position computed in this step, end of this step's chunk)
    items: tuple[tuple[str, tuple[int, ...], int, int], ...]


@dataclass(frozen=True)
class FinishStreams(TransferMessage):
    # (stream id, its block ids to keep under the lease, or None: the prefill failed)
    streams: tuple[tuple[str, tuple[int, ...] | None], ...]


@dataclass(frozen=True)
class StartFetch(TransferMessage):
    request_id: str
    params: ContextParams
    block_ids: tuple[int, ...]  # this worker's blocks for the prompt (the same on every rank)


@dataclass(frozen=True)
class CancelFetch(TransferMessage):
    request_id: str


@dataclass(frozen=True)
class LeaseEnded:
    """Event: rank ``rank``'s lease ``lease_id`` ended (``reason``: confirmed, expired, ...)."""

    rank: int
    lease_id: str
    reason: str
    stats: TransferStatsSnapshot  # the rank's transfer counters, for the worker's metrics


@dataclass(frozen=True)
class FetchDone:
    """Event: rank ``rank`` installed its slice of ``request_id``'s KV (``error`` None) or not."""

    rank: int
    request_id: str
    error: KVTransferError | None
    stats: TransferStatsSnapshot


@dataclass(frozen=True)
class FetchStopped:
    """Event: rank ``rank`` dropped ``request_id``'s pull (``CancelFetch``) and nothing of it
    can write into the request's blocks there any more (also sent when it had nothing left)."""

    rank: int
    request_id: str
    stats: TransferStatsSnapshot


TransferEvent = LeaseEnded | FetchDone | FetchStopped
