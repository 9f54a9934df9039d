"""What rank 0's ``DisaggConnector`` knows of each request: one ``KVRecord`` per request id
(the lease id of a context request is its request id), its ``KVStatus`` one of the states
below. Torch-free.

Context side (``ranks``: where the request's lease is live, rank 0 included; tracked on
multi-rank workers only, where the blocks are freed once it ended on every rank)::

    add_request (may lease) ──► MAY_LEASE ──start_step: its prefill ends in this step,──► ANNOUNCED
                                    │        multi-rank: ranks 1..N-1 create the lease       │
                                    │ request_finished                                        │
                                    ├─ by length, blocks held ─► LEASED(ranks) ◄──────────────┤
                                    └─ otherwise ─► (none)  (ANNOUNCED: ReleaseLeases) ◄──────┘
    add_request (stream) ──► STREAMING(ranks) ──request_finished──► LEASED(ranks) | (none)
    LEASED ──get_finished: the lease ended on its last rank (leases_ended)──► (none)

A one-rank worker keeps no LEASED record: its lease table alone holds the lease, whose end
reaches ``get_finished`` through the table's callback. A STREAMING record outlives its
lease if that ends first (ranks empty): the request's prefill still runs.

Generation side (``ranks``: PULLING: ranks >= 1 yet to report ``FetchDone``; STOPPING: ranks,
0 included, whose cancelled reads may still write into the request's blocks)::

    add_request (remote params) ──► AWAITING_BLOCKS(params)
    AWAITING_BLOCKS ──start_load──► PULLING(params, pull, ranks)
    PULLING ──get_finished: every rank done──► (none): loaded, the lease given back
                                            └► FAILED(params): failed
    AWAITING_BLOCKS | PULLING | FAILED ──request_finished: the lease given back──► STOPPING(ranks)
    STOPPING ──get_finished: every rank quiet (loads_stopped)──► (none)

A peer's prefix (``add_prefix``, any role; ``prefix``): AWAITING_BLOCKS and PULLING as above;
when every rank is done, loaded or failed (``prefix_failed``: the request computes it), the
lease is given back and the record becomes ``after`` (a context request's MAY_LEASE: it still
prefills and may lease its own blocks) or goes. A prefix lease this worker made for a peer
(``lease_prefix``) is a LEASED record (multi-rank) or only a lease (one rank).
The thread hand-off queues (lease ends, quiet ranks) stay beside the records: they are events
from other threads, applied to the records on the engine thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from disagg.contracts.params import ContextParams
from disagg.kv_connector.errors import KVTransferError

if TYPE_CHECKING:
    from disagg.kv_connector.pull import Pull, Read


class KVStatus(enum.Enum):
    """Where a request is in its KV's life on this worker (module docstring)."""

    MAY_LEASE = "may_lease"  # context-only: its blocks are leased if it ends by length
    ANNOUNCED = "announced"  # ... and ranks 1..N-1 hold its lease already (multi-rank)
    STREAMING = "streaming"  # a streamed context request: leased since it was queued
    LEASED = "leased"  # ended; its lease lives on ``ranks`` (multi-rank)
    AWAITING_BLOCKS = "awaiting_blocks"  # generation-only: its KV is pulled once it has blocks
    PULLING = "pulling"  # reads in flight (rank 0's ``pull``, ``ranks`` still pulling)
    FAILED = "failed"  # its pull failed (reported); the lease goes back when it ends
    STOPPING = "stopping"  # ended while pulling: waits for ``ranks`` to stop writing


# The statuses whose lease may be live on several ranks.
LEASE_STATUSES = (KVStatus.STREAMING, KVStatus.LEASED)
# The statuses whose ``params`` name a remote lease not given back yet.
REMOTE_STATUSES = (KVStatus.AWAITING_BLOCKS, KVStatus.PULLING, KVStatus.FAILED)


@dataclass
class KVRecord:
    """One request's state (engine thread only)."""

    status: KVStatus
    ranks: set[int] = field(default_factory=set)  # its meaning depends on ``status``
    params: ContextParams | None = None  # REMOTE_STATUSES: the lease to give back
    pull: Pull | None = None  # PULLING: rank 0's share
    remote_error: KVTransferError | None = None  # PULLING: the first rank >= 1 to fail
    prefix: bool = False  # REMOTE_STATUSES: a peer's prefix (the request computes the rest)
    after: KVStatus | None = None  # a prefix pull's: the status once it is done (or none)

    @property
    def live_on(self) -> set[int] | None:
        """The ranks where its lease is live, if they are tracked (multi-rank, non-empty)."""
        return self.ranks if self.status in LEASE_STATUSES and self.ranks else None

    @property
    def in_flight(self) -> bool:
        """Reads into its blocks may still be running on some rank."""
        return self.status in (KVStatus.PULLING, KVStatus.STOPPING)

    def view(self) -> KVRequestState:
        return KVRequestState(self.status, frozenset(self.ranks),
                              tuple(self.pull.reads) if self.pull is not None else ())


@dataclass(frozen=True)
class KVRequestState:
    """A read-only view of a request's record (``DisaggConnector.request_state``): for
    tests and debugging."""

    status: KVStatus
    ranks: frozenset[int]
    reads: tuple[Read, ...]  # PULLING: rank 0's reads in flight
