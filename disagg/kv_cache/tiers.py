"""Where evicted prefix-cached blocks live below the KV cache: the offload tiers' index
(torch-free; the bytes are ``disagg.engine.kv_tiers``'s, the copies ``disagg.engine.kv_offload``'s).

Two tiers, each an LRU of block hashes (front = dropped first), both optional:

- host: ``host_slots`` block-sized slots in host memory; an entry is ``hash -> slot``;
- disk: up to ``disk_blocks`` files; an entry is the hash (the file is named after it).

A block evicted from the KV cache (the block pool's ``allocate`` took a cached block) goes
to the host tier; the host tier's least recently used entry, when it needs the slot, goes
down to the disk tier (demoted), and the disk tier's oldest entry is dropped when it is full.
Without a host tier evicted blocks go straight to disk. The tiers are inclusive: a block
loaded back into the KV cache keeps its tier entry, so evicting it again copies nothing.

Entries being loaded are pinned (``pin`` / ``unpin``): never demoted, dropped or reused
until the load ends. ``offload`` returns the copies to make as an ordered list of
operations; they must run in that order (a slot is demoted before a later operation of the
same plan writes it).

Capacity in blocks is fixed at construction (the engine turns GiB into blocks); the integrity
check is the byte stores' (a block whose check fails is ``discard``-ed here).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Tier = Literal["host", "disk"]


@dataclass(frozen=True)
class ToHost:
    """Copy KV block ``block_id`` (about to be reused) into host slot ``slot`` as ``block_hash``."""

    block_id: int
    slot: int
    block_hash: int


@dataclass(frozen=True)
class ToDisk:
    """Write KV block ``block_id`` (about to be reused) to disk as ``block_hash``."""

    block_id: int
    block_hash: int


@dataclass(frozen=True)
class Demote:
    """Write host slot ``slot`` (holding ``block_hash``) to disk before the slot is reused."""

    slot: int
    block_hash: int


@dataclass(frozen=True)
class DiskDrop:
    """Delete ``block_hash``'s file: it fell off the disk tier's LRU."""

    block_hash: int


OffloadOp = ToHost | ToDisk | Demote | DiskDrop


@dataclass(frozen=True)
class TierStats:
    host_blocks: int
    host_capacity: int
    disk_blocks: int
    disk_capacity: int


class TierIndex:
    """The offload tiers' contents: which block hash is in which tier (module docstring)."""

    def __init__(self, host_slots: int = 0, disk_blocks: int = 0) -> None:
        if host_slots < 0 or disk_blocks < 0:
            raise ValueError(f"tier sizes must be >= 0, got host {host_slots}, "
                             f"disk {disk_blocks}")
        self.host_capacity = host_slots
        self.disk_capacity = disk_blocks
        self._host: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU order
        self._free_slots: list[int] = list(range(host_slots - 1, -1, -1))  # pop() -> 0 first
        self._disk: OrderedDict[int, None] = OrderedDict()  # hash, LRU order
        self._pins: dict[int, int] = {}  # hash -> loads in flight
        # Hashes that left every tier since ``take_gone`` (dropped, discarded): the KV events
        # report them removed unless the pool holds them.
        self._gone: list[int] = []

    # -- queries -----------------------------------------------------------------------------

    def lookup(self, block_hash: int) -> Tier | None:
        """The highest tier holding ``block_hash`` (host before disk), or None."""
        if block_hash in self._host:
            return "host"
        if block_hash in self._disk:
            return "disk"
        return None

    def host_slot(self, block_hash: int) -> int:
        return self._host[block_hash]

    def chain_hits(self, hashes: Sequence[int]) -> int:
        """How many leading hashes of ``hashes`` some tier holds (a chain stops at a miss)."""
        n = 0
        for h in hashes:
            if h not in self._host and h not in self._disk:
                break
            n += 1
        return n

    def host_order(self) -> list[int]:
        """Host entries' hashes, the next dropped first (tests)."""
        return list(self._host)

    def disk_order(self) -> list[int]:
        """Disk entries' hashes, the next dropped first (tests)."""
        return list(self._disk)

    def take_gone(self) -> list[int]:
        """Hashes that left every tier since the last call, in order."""
        gone, self._gone = self._gone, []
        return gone

    def stats(self) -> TierStats:
        return TierStats(len(self._host), self.host_capacity, len(self._disk),
                         self.disk_capacity)

    # -- pins (loads in flight) ----------------------------------------------------------------

    def pin(self, hashes: Iterable[int]) -> None:
        """Keep these entries where they are until ``unpin`` (a load reads them), and mark
        them recently used."""
        for h in hashes:
            if h in self._host:
                self._host.move_to_end(h)
            elif h in self._disk:
                self._disk.move_to_end(h)
            else:
                raise KeyError(f"block hash {h:#x} is in no tier")
            self._pins[h] = self._pins.get(h, 0) + 1

    def unpin(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            n = self._pins.get(h, 0)
            if n <= 1:
                self._pins.pop(h, None)
            else:
                self._pins[h] = n - 1

    # -- changes -------------------------------------------------------------------------------

    def offload(self, evicted: Sequence[tuple[int, int]]) -> list[OffloadOp]:
        """Blocks ``(block_id, block_hash)`` evicted from the KV cache, oldest first: place
        each in the tiers and return the copies to make, in order. A block some tier holds
        already is only marked used; one that finds no room (every entry pinned) is dropped."""
        ops: list[OffloadOp] = []
        for block_id, h in evicted:
            if h in self._host:
                self._host.move_to_end(h)
                continue
            if h in self._disk:
                self._disk.move_to_end(h)
                continue
            if self.host_capacity:
                slot = self._take_slot(ops)
                if slot is not None:
                    self._host[h] = slot
                    ops.append(ToHost(block_id, slot, h))
            elif self.disk_capacity and self._make_disk_room(ops):
                self._disk[h] = None
                ops.append(ToDisk(block_id, h))
        return ops

    def discard(self, block_hash: int) -> Tier | None:
        """Forget ``block_hash`` (its bytes failed their check); returns the tier it was in.
        Its host slot is free again; a disk entry's file is the caller's to delete."""
        if block_hash in self._host:
            self._free_slots.append(self._host.pop(block_hash))
            self._gone.append(block_hash)
            return "host"
        if block_hash in self._disk:
            del self._disk[block_hash]
            self._gone.append(block_hash)
            return "disk"
        return None

    def drop_disk(self) -> list[int]:
        """The disk tier is gone (a write failed: disk full): forget its entries, and take
        no more; returns the hashes forgotten."""
        gone = list(self._disk)
        self._disk.clear()
        self.disk_capacity = 0
        self._gone.extend(gone)
        return gone

    # -- internals ---------------------------------------------------------------------------

    def _take_slot(self, ops: list[OffloadOp]) -> int | None:
        """A free host slot, else the slot of the least recently used unpinned entry (demoted
        to disk when there is a disk tier and room, else dropped)."""
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h in self._host if h not in self._pins), None)
        if victim is None:
            return None
        slot = self._host.pop(victim)
        if self.disk_capacity and victim not in self._disk and self._make_disk_room(ops):
            self._disk[victim] = None
            ops.append(Demote(slot, victim))
        elif victim not in self._disk:
            self._gone.append(victim)
        return slot

    def _make_disk_room(self, ops: list[OffloadOp]) -> bool:
        """Drop unpinned disk entries, oldest first, until one more fits; False if none can."""
        while len(self._disk) >= self.disk_capacity:
            victim = next((h for h in self._disk if h not in self._pins), None)
            if victim is None:
                return False
            del self._disk[victim]
            ops.append(DiskDrop(victim))
            self._gone.append(victim)
        return True
