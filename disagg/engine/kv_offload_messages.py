"""Rank 0 <-> rank r messages of a multi-rank worker's KV offload tiers (frozen, picklable,
torch-free).

Rank 0 holds the one ``TierIndex`` (the scheduler's: which block hash is in which tier) and
its own slice's byte stores; every other rank holds the byte stores of its own slice (its
layers, its kv heads) and does what rank 0 tells it, on the executor's control pipe, in order
with the steps. Events come back on the rank's event pipe (the KV connector's, shared: the
executor hands each kind to its own reader).

    TierSetup        once, after start-up: open the host tier (``host_slots`` slots of this
                     rank's block) and the disk tier (``disk_folder/rank-R``); the rank answers
                     ``TierSetupReply`` on the control pipe (``error``: why it could not)
    TierOps          right after ``schedule()``, before that plan's ``Step``: make these copies
                     in order (``kv_cache.tiers`` ops: ToHost, ToDisk, Demote, DiskDrop), so
                     every rank copies the blocks the plan evicted before a step writes them
    TierLoad         copy these tier blocks back into the KV cache (the rank's loader thread);
                     ``slots[i]`` is block i's host slot, None: read it from disk
    TierLoaded (ev)  rank r's part of load ``seq`` ended: its first ``num_loaded`` blocks are
                     in place, ``bad`` the hash of the block that failed (check or read)
    TierDiskOff (ev) rank r's disk tier failed (disk full ...): rank 0 turns the disk tier off
                     for the whole worker (the index forgets it)
    TierSkipped (ev) rank r's disk writer was too far behind: these blocks were not written
                     there; rank 0 forgets them (on every rank)
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.kv_cache.tiers import OffloadOp


class TierMessage:
    """Base of the control messages a rank's ``RankOffload`` handles."""

    __slots__ = ()


@dataclass(frozen=True)
class TierSetup(TierMessage):
    host_slots: int  # 0: no host tier
    disk_folder: str | None  # rank 0's disk folder (worker-N); the rank uses its rank-R
    integrity: bool  # checksums taken and checked (kv_integrity)


@dataclass(frozen=True)
class TierOps(TierMessage):
    ops: tuple[OffloadOp, ...]


@dataclass(frozen=True)
class TierLoad(TierMessage):
    seq: int  # rank 0's number for this load (a request id may come back while one drains)
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    slots: tuple[int | None, ...]


@dataclass(frozen=True)
class TierSetupReply:
    """Rank r's answer to ``TierSetup``: its tiers are open (``error`` None) or why not."""

    rank: int
    error: str | None


class TierEvent:
    """Base of the events a rank's ``RankOffload`` sends rank 0."""

    __slots__ = ()


@dataclass(frozen=True)
class TierLoaded(TierEvent):
    rank: int
    seq: int
    num_loaded: int
    bad: int | None


@dataclass(frozen=True)
class TierDiskOff(TierEvent):
    rank: int
    reason: str


@dataclass(frozen=True)
class TierSkipped(TierEvent):
    rank: int
    block_hashes: tuple[int, ...]
