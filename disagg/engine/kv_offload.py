"""The engine's side of the KV offload tiers (issue 41): copies evicted prefix-cached blocks
down into the host and disk tiers and copies tier hits back up.

Who does what:

- ``kv_cache/tiers.TierIndex`` (torch-free, engine thread): which hash is in which tier; the
  scheduler reads it at admission and pins what a load will read;
- ``engine/kv_tiers`` ``HostTier`` / ``DiskTier``: the bytes, each block with the checksum
  of its bytes taken when it left the KV cache, checked whenever it is read back (unless
  ``kv_integrity`` is off: then neither);
- this module: ``offload`` runs on the engine thread right after ``schedule()`` (the
  evicted blocks still hold their bytes: nothing has written them yet) and makes the
  index's copies in order; ``start`` hands a plan's ``KVLoad`` s to one loader thread,
  which copies each load's blocks into the KV cache in order and stops at the first block
  that fails its check (or cannot be read): the blocks before it count, the rest are
  computed; ``poll`` (engine thread) returns the finished loads and forgets the entries
  that failed.

Sizes: ``kv_offload_host_gib`` and ``kv_offload_disk_gib`` turned into whole blocks (a
disk block is its file: header + payload). Workers may share a ``kv_offload_disk_dir``:
each uses the first ``worker-N`` folder in it that no live worker holds, emptied when it
starts; when a write fails (disk full) it is dropped with a warning and the worker goes on
with the host tier alone: no request fails for a tier.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.config import CacheConfig, ConfigError
from disagg.engine.kv_tiers import UNCHECKED, DiskTier, FolderInUseError, HostTier
from disagg.kv_cache.tiers import Demote, DiskDrop, OffloadOp, TierIndex, ToDisk, ToHost
from disagg.scheduler import KVLoad
from disagg.transfer.integrity import payload_checksum

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Workers sharing one kv_offload_disk_dir (a cluster YAML section names one for all its
# instances) each take the first of its worker-N subfolders no live worker holds.
MAX_DISK_WORKERS = 64
# Blocks queued for the disk writer at most: past it (a disk slower than the evictions) a
# block going to disk is dropped instead of held in memory until written.
MAX_DISK_QUEUE = 256


@dataclass(frozen=True)
class LoadDone:
    """A finished load: its first ``num_loaded`` blocks are in place; ``bad`` is the hash
    of the block that failed (its check or its read), None when all came."""

    request_id: str
    num_loaded: int
    bad: int | None
    from_host: int  # blocks copied from each tier
    from_disk: int


@dataclass(frozen=True)
class OffloadStats:
    host_blocks: int
    host_capacity: int
    disk_blocks: int
    disk_capacity: int
    stored_host: int  # blocks copied into each tier (demotions count for disk)
    stored_disk: int
    loaded_host: int  # blocks copied back from each tier
    loaded_disk: int
    failed_loads: int  # blocks that failed their check or could not be read (never used)
    disk_enabled: bool
    dropped_disk: int = 0  # blocks not written to disk: the writer was too far behind


def open_disk_tier(folder: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> DiskTier:
    """The disk tier in ``folder/worker-N`` for the first N no other live worker holds (its
    lock); emptied as it opens."""
    for n in range(MAX_DISK_WORKERS):
        try:
            return DiskTier(os.path.join(folder, f"worker-{n}"), block_shape, dtype)
        except FolderInUseError:
            continue
    raise ConfigError(f"kv_offload_disk_dir: {folder}: its {MAX_DISK_WORKERS} worker-N "
                      f"folders are all in use by other workers")


class KVOffload:
    """One worker's offload tiers over its KV cache (module docstring)."""

    def __init__(self, cache: CacheConfig, kv_cache: torch.Tensor,
                 wake: Callable[[], None] | None = None) -> None:
        self.kv_cache = kv_cache
        self.integrity = cache.kv_integrity  # checksums taken and checked (kv_integrity)
        self._wake = wake or (lambda: None)
        block_shape = tuple(kv_cache.shape[1:])
        block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self.host: HostTier | None = None
        host_slots = 0
        if cache.kv_offload_host_gib is not None:
            host_slots = int(cache.kv_offload_host_gib * GIB) // block_bytes
            if host_slots < 1:
                raise ConfigError(f"kv_offload_host_gib: {cache.kv_offload_host_gib} GiB holds "
                                  f"no KV block ({block_bytes} bytes)")
            self.host = HostTier(block_shape, kv_cache.dtype, host_slots, pin=kv_cache.is_cuda,
                                 check=cache.kv_integrity)
        self.disk: DiskTier | None = None
        disk_blocks = 0
        if cache.kv_offload_disk_dir is not None and cache.kv_offload_disk_gib is not None:
            disk = open_disk_tier(cache.kv_offload_disk_dir, block_shape, kv_cache.dtype)
            disk_blocks = int(cache.kv_offload_disk_gib * GIB) // disk.file_bytes
            if disk_blocks < 1:
                disk.close()
                raise ConfigError(f"kv_offload_disk_gib: {cache.kv_offload_disk_gib} GiB holds "
                                  f"no KV block ({disk.file_bytes} bytes a file)")
            self.disk = disk
            disk.on_disabled = self._disk_failed
        self.index = TierIndex(host_slots, disk_blocks)
        self._disk_lost: str | None = None  # set by the writer thread; handled on ours
        self._stored = {"host": 0, "disk": 0}
        self._loaded = {"host": 0, "disk": 0}
        self._failed = 0
        self._dropped = 0  # blocks not written to disk: its writer was too far behind
        self._in_flight = 0  # loads handed to the loader and not polled yet (engine thread)
        self._jobs: queue.Queue[tuple[KVLoad, list[int | None]] | None] = queue.Queue()
        self._done: deque[LoadDone] = deque()
        self._done_event = threading.Event()
        self._loader = threading.Thread(target=self._load_loop, name="kv-offload-loader",
                                        daemon=True)
        self._loader.start()

    # -- engine thread -------------------------------------------------------------------------

    def offload(self, evicted: list[tuple[int, int]]) -> None:
        """Blocks ``(block_id, hash)`` that this plan evicted from the KV cache: copy them
        into the tiers (before anything writes them: the caller runs the step after this)."""
        if self._disk_lost is not None:
            self._drop_disk()
        if evicted:
            self._run(self.index.offload(evicted))

    def start(self, loads: list[KVLoad]) -> None:
        """Copy these loads' blocks back from the tiers on the loader thread (their entries
        are pinned by the scheduler until the load is polled)."""
        for load in loads:
            # host slot of each block, or None: on disk (read under its hash)
            slots = [self.index.host_slot(h) if self.index.lookup(h) == "host" else None
                     for h in load.block_hashes]
            self._in_flight += 1
            self._jobs.put((load, slots))

    def poll(self, loading: Callable[[str], bool]) -> list[LoadDone]:
        """Loads finished since the last call. A block that failed its check is forgotten
        by its tier (its file deleted) unless its request ended meanwhile (``loading(rid)``
        False: its pins were dropped, the slot may hold other bytes by now)."""
        if self._disk_lost is not None:
            self._drop_disk()
        done: list[LoadDone] = []
        while self._done:
            d = self._done.popleft()
            done.append(d)
            self._in_flight -= 1
            self._loaded["host"] += d.from_host
            self._loaded["disk"] += d.from_disk
            if d.bad is not None:
                self._failed += 1
                if loading(d.request_id) and self.index.discard(d.bad) == "disk":
                    assert self.disk is not None
                    self.disk.remove(d.bad)
        return done

    @property
    def busy(self) -> bool:
        """Loads are in flight (the engine loop should come back soon)."""
        return self._in_flight > 0

    def wait(self, timeout: float) -> None:
        """Block until a load finished or ``timeout`` passed (an offline loop with nothing
        else to do)."""
        if self._done_event.wait(timeout):
            self._done_event.clear()

    def stats(self) -> OffloadStats:
        s = self.index.stats()
        return OffloadStats(s.host_blocks, s.host_capacity, s.disk_blocks, s.disk_capacity,
                            self._stored["host"], self._stored["disk"], self._loaded["host"],
                            self._loaded["disk"], self._failed,
                            self.disk is not None and self._disk_lost is None, self._dropped)

    def close(self) -> None:
        """Stop the loader (bounded) and the disk tier's writer."""
        self._jobs.put(None)
        self._loader.join(timeout=10)
        if self.disk is not None:
            self.disk.close()

    # -- internals -------------------------------------------------------------------------------

    def _run(self, ops: list[OffloadOp]) -> None:
        """Make the plan's copies in order; consecutive host stores go as one gather (a slot
        written twice in one plan, its first block dropped again at once, splits it)."""
        batch: list[ToHost] = []
        for op in ops:
            if isinstance(op, ToHost):
                if any(b.slot == op.slot for b in batch):
                    self._store_host(batch)
                    batch = []
                batch.append(op)
                continue
            self._store_host(batch)
            batch = []
            if isinstance(op, Demote | ToDisk) and self._disk_backlogged(op.block_hash):
                continue
            if isinstance(op, Demote):
                assert self.host is not None and self.disk is not None
                data, checksum = self.host.block(op.slot)
                self.disk.write(op.block_hash, data, checksum)
                self._stored["disk"] += 1
            elif isinstance(op, ToDisk):
                assert self.disk is not None
                data = self.kv_cache[op.block_id].to("cpu", copy=True)
                self.disk.write(op.block_hash, data,
                                payload_checksum([data]) if self.integrity else UNCHECKED)
                self._stored["disk"] += 1
            elif isinstance(op, DiskDrop):
                assert self.disk is not None
                self.disk.remove(op.block_hash)
        self._store_host(batch)

    def _disk_backlogged(self, block_hash: int) -> bool:
        """The disk writer is ``MAX_DISK_QUEUE`` blocks behind: forget this block."""
        assert self.disk is not None
        if len(self.disk.pending) < MAX_DISK_QUEUE:
            return False
        self.index.discard(block_hash)
        self._dropped += 1
        return True

    def _store_host(self, batch: list[ToHost]) -> None:
        if batch:
            assert self.host is not None
            self.host.store([op.slot for op in batch], self.kv_cache,
                            [op.block_id for op in batch])
            self._stored["host"] += len(batch)

    def _disk_failed(self, reason: str) -> None:
        """Writer thread: the disk tier failed (DiskTier logged it); dropped on our thread."""
        self._disk_lost = reason
        self._wake()

    def _drop_disk(self) -> None:
        if self.index.disk_capacity:
            gone = self.index.drop_disk()
            logger.warning("KV offload: the disk tier is off (%s); %d blocks forgotten, the "
                           "host tier goes on", self._disk_lost, len(gone))

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            load, slots = job
            n, bad, host, disk = 0, None, 0, 0
            for block_id, h, slot in zip(load.block_ids, load.block_hashes, slots, strict=True):
                try:
                    if slot is not None:
                        assert self.host is not None
                        ok = self.host.load(slot, self.kv_cache, block_id)
                    else:
                        ok = self.disk is not None and self.disk.read_into(h, self.kv_cache,
                                                                            block_id)
                except Exception:  # never let the loader die: the block is computed instead
                    logger.exception("KV offload: loading block %#x failed", h)
                    ok = False
                if not ok:
                    bad = h
                    break
                n += 1
                if slot is not None:
                    host += 1
                else:
                    disk += 1
            self._done.append(LoadDone(load.request_id, n, bad, host, disk))
            self._done_event.set()
            self._wake()
