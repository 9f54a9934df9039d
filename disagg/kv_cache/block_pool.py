"""Block pool: ref-counted KV blocks, an LRU free queue and the prefix-cache index (torch-free).

Every block is in exactly one of three states:

- used:   ``ref_cnt > 0`` (held by one or more requests; shared when it is a prefix hit);
- cached: ``ref_cnt == 0`` with a ``block_hash`` (reusable by a prefix hit, else evictable);
- free:   ``ref_cnt == 0`` without a hash.

Cached and free blocks both sit in the free queue (all are allocatable). ``allocate`` pops from
the front, evicting the hash of a cached block it takes, so the front holds the least recently
freed blocks. Requests free their blocks tail first (the caller passes reversed order), so a
request's last blocks, the least likely to be shared, are evicted before its first ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

EventKind = Literal["stored", "removed"]


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than the free queue holds."""


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set while the block is registered in the prefix cache


@dataclass(frozen=True)
class BlockPoolStats:
    free: int  # ref 0, no hash
    used: int  # ref > 0
    cached: int  # ref 0, with a hash (allocatable, evicted on allocation)
    total: int  # free + used + cached


@dataclass(frozen=True)
class KVCacheEvent:
    """A change of the set of cached block hashes, for KV-aware routing.

    ``stored``: the hashes became available for prefix hits; ``removed``: they were evicted.
    Consecutive changes of the same kind are merged into one event, in order. ``medium``:
    where a stored hash is now, when it is not the KV cache: ``host`` or ``disk`` (it left
    the pool into that offload tier: a hit on it is copied back first); None: the KV cache."""

    kind: EventKind
    block_hashes: list[int]
    medium: str | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # Block ids with ref_cnt 0 in LRU order (front = evicted first). An OrderedDict gives
        # O(1) pop-front, append and remove-from-the-middle (a prefix hit on a free block).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block_hash -> block_id
        self._num_cached_free = 0  # blocks with ref 0 and a hash (kept for O(1) stats)
        # Pending events as (kind, hashes); merged while consecutive kinds agree.
        self._events: list[tuple[EventKind, list[int]]] = []
        # (block_id, block_hash) of cached blocks taken by allocate, oldest first, while
        # record_evictions is on (offload tiers copy them out before they are written).
        self.record_evictions = False
        self._evicted: list[tuple[int, int]] = []

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks: ref 0, cached or not."""
        return len(self._free)

    def get_cached_block(self, block_hash: int) -> int | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def free_queue(self) -> list[int]:
        """Block ids of the free queue, front (next evicted) first. O(n): for tests and debug."""
        return list(self._free)

    def stats(self) -> BlockPoolStats:
        num_free = len(self._free)
        return BlockPoolStats(
            free=num_free - self._num_cached_free,
            used=self.num_blocks - num_free,
            cached=self._num_cached_free,
            total=self.num_blocks,
        )

    def take_evicted(self) -> list[tuple[int, int]]:
        """Drain the ``(block_id, block_hash)`` evicted since the last call, oldest first."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the events recorded since the last call, oldest first."""
        events = [KVCacheEvent(kind, hashes) for kind, hashes in self._events]
        self._events = []
        return events

    # -- mutations ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front of the free queue (ref 1 each); a cached block popped
        loses its hash (a ``removed`` event). Raises NoFreeBlocksError, changing nothing, if
        fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        ids: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if self.record_evictions:
                    self._evicted.append((block_id, block.block_hash))
                del self._cached[block.block_hash]
                block.block_hash = None
                self._num_cached_free -= 1
            block.ref_cnt = 1
            ids.append(block_id)
        if evicted:
            self._record("removed", evicted)
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit); a block at ref 0 leaves the
        free queue, so it can no longer be evicted."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; blocks reaching ref 0 go to the back of the free
        queue in the order given (callers pass a request's table reversed)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full, computed block under ``block_hash`` (a ``stored`` event).

        Returns False (and registers nothing) when caching is off or another block already holds
        this hash (two requests computed the same prefix at once: the first one wins, the
        duplicate is freed as an ordinary block)."""
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block_id} is not in use; only held blocks can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block_id} already cached under another hash")
            return False
        if not self.enable_caching or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        self._record("stored", [block_hash])
        return True

    def _record(self, kind: EventKind, hashes: list[int]) -> None:
        if self._events and self._events[-1][0] == kind:
            self._events[-1][1].extend(hashes)
        else:
            self._events.append((kind, list(hashes)))
