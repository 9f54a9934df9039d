"""The engine's side of the KV offload tiers (issue 41): copies evicted prefix-cached blocks
down into the host and disk tiers and copies tier hits back up.

Who does what:

- ``kv_cache/tiers.TierIndex`` (torch-free, engine thread): which hash is in which tier; the
  scheduler reads it at admission and pins what a load will read;
- ``engine/kv_tiers`` ``HostTier`` / ``DiskTier``: the bytes, each block with the checksum
  of its bytes taken when it left the KV cache, checked whenever it is read back (unless
  ``kv_integrity`` is off: then neither);
- ``TierStores`` (this module): one rank's byte stores over its own KV cache, making the
  index's copies (``run``) and copying blocks back (``load``);
- ``KVOffload`` (this module, rank 0): ``offload`` runs on the engine thread right after
  ``schedule()`` (the evicted blocks still hold their bytes: nothing has written them yet)
  and makes the index's copies in order; ``start`` hands a plan's ``KVLoad`` s to one loader
  thread, which copies each load's blocks into the KV cache in order and stops at the first
  block that fails its check (or cannot be read): the blocks before it count, the rest are
  computed; ``poll`` (engine thread) returns the finished loads and forgets the entries that
  failed.

Multi-rank workers (TP / PP; ``kv_offload_rank.RankOffload`` on ranks 1..N-1): every rank
holds the byte stores of its own slice (its layers, its kv heads), rank 0 the one index. The
copies of each plan go to every rank on the control pipe before that plan's step
(``TierOps``: the pipe is in order, so a rank copies the evicted blocks before its step can
write them), and so does each load (``TierLoad``); a load is done once every rank reported,
with the blocks every rank installed (the minimum over ranks: a block that failed on any rank
is computed, its entry forgotten on all). A disk tier that fails on any rank is turned off for
the worker (the index forgets it; every rank's files are deleted when it stops). Sizes are the
worker's: a block's bytes are the sum of its slices over the ranks.

Sizes: ``kv_offload_host_gib`` and ``kv_offload_disk_gib`` turned into whole blocks (a
disk block is its file(s): header + payload). Workers may share a ``kv_offload_disk_dir``:
each uses the first ``worker-N`` folder in it that no live worker holds, emptied when it
starts (rank r >= 1 of a multi-rank worker: ``worker-N/rank-r``); when a write fails (disk
full) it is dropped with a warning and the worker goes on with the host tier alone: no
request fails for a tier.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from disagg.config import CacheConfig, ConfigError
from disagg.engine.kv_offload_messages import (
    TierDiskOff,
    TierEvent,
    TierLoad,
    TierLoaded,
    TierMessage,
    TierOps,
    TierSetup,
    TierSetupReply,
    TierSkipped,
)
from disagg.engine.kv_tiers import HEADER_BYTES, UNCHECKED, DiskTier, FolderInUseError, HostTier
from disagg.env import STARTUP_TIMEOUT_S
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
    """A finished load: its first ``num_loaded`` blocks are in place (on every rank); ``bad``
    is the hash of the block that failed (its check or its read, on some rank), None when
    all came."""

    request_id: str
    num_loaded: int
    bad: int | None
    from_host: int  # blocks copied from each tier
    from_disk: int


@dataclass(frozen=True)
class OffloadStats:
    """The worker's tier figures (multi-rank: a block counts once, not once per rank)."""

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


def rank_disk_folder(worker_folder: str, rank: int) -> str:
    """Where rank ``rank`` >= 1 of a multi-rank worker keeps its disk blocks (rank 0: the
    worker's folder itself, which its lock claims for the whole worker)."""
    return os.path.join(worker_folder, f"rank-{rank}")


def empty_stale_rank_folders(worker_folder: str, world_size: int) -> None:
    """Delete the block files an earlier worker with more ranks left in ``worker-N/rank-r``
    (r >= ``world_size``) when it did not stop cleanly: this worker holds ``worker-N``'s lock,
    so nothing else uses them (its own ranks empty their folders themselves)."""
    try:
        names = os.listdir(worker_folder)
    except OSError:
        return
    for name in names:
        r = name.removeprefix("rank-")
        if r == name or not r.isdigit() or int(r) < world_size:
            continue
        sub = os.path.join(worker_folder, name)
        try:
            for f in os.listdir(sub):
                if f.endswith(".kv") or f.endswith(".kv.tmp"):
                    os.unlink(os.path.join(sub, f))
        except OSError as e:
            logger.warning("KV offload: cannot empty %s: %s", sub, e)


class TierStores:
    """One rank's tier bytes over its own KV cache: the host tier and the disk tier (either
    may be None), the copies the index decides (``run``) and loads back (``load``)."""

    def __init__(self, kv_cache: torch.Tensor, host: HostTier | None, disk: DiskTier | None,
                 integrity: bool) -> None:
        self.kv_cache = kv_cache
        self.host = host
        self.disk = disk
        self.integrity = integrity

    def run(self, ops: Sequence[OffloadOp]) -> tuple[int, int, list[int]]:
        """Make a plan's copies in order; consecutive host stores go as one gather (a slot
        written twice in one plan, its first block dropped again at once, splits it).
        Returns (blocks stored in the host tier, on disk, hashes not written to disk: the
        writer is ``MAX_DISK_QUEUE`` blocks behind)."""
        stored_host = stored_disk = 0
        skipped: list[int] = []
        batch: list[ToHost] = []
        for op in ops:
            if isinstance(op, ToHost):
                if any(b.slot == op.slot for b in batch):
                    stored_host += self._store_host(batch)
                    batch = []
                batch.append(op)
                continue
            stored_host += self._store_host(batch)
            batch = []
            if isinstance(op, Demote | ToDisk):
                assert self.disk is not None
                if len(self.disk.pending) >= MAX_DISK_QUEUE:
                    skipped.append(op.block_hash)
                    continue
            if isinstance(op, Demote):
                assert self.host is not None and self.disk is not None
                data, checksum = self.host.block(op.slot)
                self.disk.write(op.block_hash, data, checksum)
                stored_disk += 1
            elif isinstance(op, ToDisk):
                assert self.disk is not None
                data = self.kv_cache[op.block_id].to("cpu", copy=True)
                self.disk.write(op.block_hash, data,
                                payload_checksum([data]) if self.integrity else UNCHECKED)
                stored_disk += 1
            elif isinstance(op, DiskDrop):
                assert self.disk is not None
                self.disk.remove(op.block_hash)
        stored_host += self._store_host(batch)
        return stored_host, stored_disk, skipped

    def _store_host(self, batch: list[ToHost]) -> int:
        if batch:
            assert self.host is not None
            self.host.store([op.slot for op in batch], self.kv_cache,
                            [op.block_id for op in batch])
        return len(batch)

    def load(self, block_ids: Sequence[int], block_hashes: Sequence[int],
             slots: Sequence[int | None]) -> tuple[int, int | None]:
        """Copy tier blocks into ``kv_cache[block_ids[i]]`` in order (``slots[i]``: the host
        slot, None: on disk), stopping at the first that fails its check or its read:
        (blocks in place, the hash of the one that failed or None)."""
        n = 0
        for block_id, h, slot in zip(block_ids, block_hashes, slots, strict=True):
            try:
                if slot is not None:
                    ok = self.host is not None and self.host.load(slot, self.kv_cache, block_id)
                else:
                    ok = self.disk is not None and self.disk.read_into(h, self.kv_cache,
                                                                        block_id)
            except Exception:  # never let the loader die: the block is computed instead
                logger.exception("KV offload: loading block %#x failed", h)
                ok = False
            if not ok:
                return n, h
            n += 1
        return n, None

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


@dataclass(frozen=True)
class _Job:
    seq: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    slots: tuple[int | None, ...]


class TierLoader:
    """One loader thread over a rank's ``TierStores``: runs loads in order and reports each
    ``(seq, num_loaded, bad)`` to ``on_done`` (from its thread)."""

    def __init__(self, stores: TierStores,
                 on_done: Callable[[int, int, int | None], None]) -> None:
        self._stores = stores
        self._on_done = on_done
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kv-offload-loader",
                                        daemon=True)
        self._thread.start()

    def submit(self, seq: int, block_ids: Sequence[int], block_hashes: Sequence[int],
               slots: Sequence[int | None]) -> None:
        self._jobs.put(_Job(seq, tuple(block_ids), tuple(block_hashes), tuple(slots)))

    def close(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            n, bad = self._stores.load(job.block_ids, job.block_hashes, job.slots)
            self._on_done(job.seq, n, bad)


class TierPeers(Protocol):
    """Rank 0's line to ranks 1..N-1 of its worker (implemented by the parallel executor)."""

    @property
    def world_size(self) -> int: ...

    @property
    def kv_block_bytes(self) -> list[int]:
        """Bytes of one KV block on each rank (rank order)."""
        ...

    def send_all(self, msg: TierMessage) -> None:
        """A control message to every other rank, in order with the steps (engine thread)."""

    def ask_all(self, msg: TierMessage, kind: type, timeout_s: float) -> list[object]:
        """Send ``msg`` to every other rank and return each one's ``kind`` answer."""
        ...

    def take_tier_events(self) -> list[TierEvent]:
        """Tier events the other ranks sent since the last call (non-blocking)."""
        ...

    def on_tier_event(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a reader thread) whenever a tier event arrives."""


@dataclass
class _Load:
    """A load in flight (engine thread): what each rank reported, ``(num_loaded, bad)``."""

    request_id: str
    block_hashes: tuple[int, ...]
    slots: tuple[int | None, ...]
    results: dict[int, tuple[int, int | None]] = field(default_factory=dict)


class KVOffload:
    """One worker's offload tiers over its KV cache (module docstring); ``peers``: the other
    ranks of a multi-rank worker (each keeps the bytes of its own slice)."""

    def __init__(self, cache: CacheConfig, kv_cache: torch.Tensor,
                 wake: Callable[[], None] | None = None, peers: TierPeers | None = None) -> None:
        self.kv_cache = kv_cache
        self.integrity = cache.kv_integrity  # checksums taken and checked (kv_integrity)
        self.peers = peers
        self.world_size = peers.world_size if peers is not None else 1
        self._wake = wake or (lambda: None)
        block_shape = tuple(kv_cache.shape[1:])
        own_bytes = kv_cache[0].numel() * kv_cache.element_size()
        # a tier block is the block's slices on every rank
        rank_bytes = list(peers.kv_block_bytes) if peers is not None else [own_bytes]
        block_bytes = sum(rank_bytes)
        over = f" over {len(rank_bytes)} ranks" if len(rank_bytes) > 1 else ""
        host: HostTier | None = None
        host_slots = 0
        if cache.kv_offload_host_gib is not None:
            host_slots = int(cache.kv_offload_host_gib * GIB) // block_bytes
            if host_slots < 1:
                raise ConfigError(f"kv_offload_host_gib: {cache.kv_offload_host_gib} GiB holds "
                                  f"no KV block ({block_bytes} bytes{over})")
            host = HostTier(block_shape, kv_cache.dtype, host_slots, pin=kv_cache.is_cuda,
                            check=cache.kv_integrity)
        disk: DiskTier | None = None
        disk_blocks = 0
        if cache.kv_offload_disk_dir is not None and cache.kv_offload_disk_gib is not None:
            disk = open_disk_tier(cache.kv_offload_disk_dir, block_shape, kv_cache.dtype)
            file_bytes = sum(HEADER_BYTES + b for b in rank_bytes)
            disk_blocks = int(cache.kv_offload_disk_gib * GIB) // file_bytes
            if disk_blocks < 1:
                disk.close()
                what = f"of files{over}" if over else "a file"
                raise ConfigError(f"kv_offload_disk_gib: {cache.kv_offload_disk_gib} GiB holds "
                                  f"no KV block ({file_bytes} bytes {what})")
            disk.on_disabled = self._disk_failed
            empty_stale_rank_folders(disk.folder, self.world_size)
        self.stores = TierStores(kv_cache, host, disk, cache.kv_integrity)
        self.index = TierIndex(host_slots, disk_blocks)
        self._disk_lost: str | None = None  # set by the writer thread; handled on ours
        self._stored = {"host": 0, "disk": 0}
        self._loaded = {"host": 0, "disk": 0}
        self._failed = 0
        self._dropped = 0  # blocks not written to disk: a writer was too far behind
        self._seq = 0
        self._loads: dict[int, _Load] = {}  # in flight, in start order (engine thread)
        self._done: deque[tuple[int, int, int | None]] = deque()  # rank 0's loader's results
        self._done_event = threading.Event()
        if peers is not None:
            peers.on_tier_event(self._rank_event)
            try:
                self._setup_ranks(host_slots, disk)
            except BaseException:
                self.stores.close()
                raise
        self._loader = TierLoader(self.stores, self._loaded_here)

    @property
    def host(self) -> HostTier | None:
        """Rank 0's host tier bytes."""
        return self.stores.host

    @property
    def disk(self) -> DiskTier | None:
        """Rank 0's disk tier (its folder is the worker's ``worker-N``)."""
        return self.stores.disk

    def _setup_ranks(self, host_slots: int, disk: DiskTier | None) -> None:
        assert self.peers is not None
        msg = TierSetup(host_slots, disk.folder if disk is not None else None, self.integrity)
        # (a large pinned host tier takes a while: the ranks' start-up timeout)
        for reply in self.peers.ask_all(msg, TierSetupReply, STARTUP_TIMEOUT_S.get()):
            assert isinstance(reply, TierSetupReply)
            if reply.error is not None:
                raise ConfigError(f"{reply.error} (on rank {reply.rank})")

    # -- engine thread -------------------------------------------------------------------------

    def offload(self, evicted: list[tuple[int, int]]) -> None:
        """Blocks ``(block_id, hash)`` that this plan evicted from the KV cache: copy them
        into the tiers (before anything writes them: the caller runs the step after this),
        on every rank."""
        self._take_rank_events()
        if self._disk_lost is not None:
            self._drop_disk()
        if not evicted:
            return
        ops = self.index.offload(evicted)
        if not ops:
            return
        if self.peers is not None:  # first: the ranks copy while this one does
            self.peers.send_all(TierOps(tuple(ops)))
        host, disk, skipped = self.stores.run(ops)
        self._stored["host"] += host
        self._stored["disk"] += disk
        if skipped:  # not written here: forgotten (the other ranks' files deleted)
            self._dropped += len(skipped)
            self._forget_disk(skipped, remove_here=False)

    def start(self, loads: list[KVLoad]) -> None:
        """Copy these loads' blocks back from the tiers on the loader thread(s) (their
        entries are pinned by the scheduler until the load is polled)."""
        for load in loads:
            # host slot of each block, or None: on disk (read under its hash)
            slots = tuple(self.index.host_slot(h) if self.index.lookup(h) == "host" else None
                          for h in load.block_hashes)
            self._seq += 1
            seq = self._seq
            self._loads[seq] = _Load(load.request_id, tuple(load.block_hashes), slots)
            if self.peers is not None:
                self.peers.send_all(TierLoad(seq, tuple(load.block_ids),
                                             tuple(load.block_hashes), slots))
            self._loader.submit(seq, load.block_ids, load.block_hashes, slots)

    def poll(self, loading: Callable[[str], bool]) -> list[LoadDone]:
        """Loads finished (on every rank) since the last call. A block that failed its check
        is forgotten by its tier (its files deleted) unless its request ended meanwhile
        (``loading(rid)`` False: its pins were dropped, the slot may hold other bytes by
        now)."""
        self._take_rank_events()
        if self._disk_lost is not None:
            self._drop_disk()
        while self._done:
            seq, n, bad = self._done.popleft()
            self._loads[seq].results[0] = (n, bad)
        done: list[LoadDone] = []
        for seq in [s for s, ld in self._loads.items() if len(ld.results) == self.world_size]:
            done.append(self._finish(self._loads.pop(seq), loading))
        return done

    def _finish(self, ld: _Load, loading: Callable[[str], bool]) -> LoadDone:
        n = min(r[0] for r in ld.results.values())
        bads = sorted({r[1] for r in ld.results.values() if r[1] is not None})
        # a rank stops only at a block that failed: the first block not in place did
        bad = ld.block_hashes[n] if n < len(ld.block_hashes) else None
        host = sum(1 for s in ld.slots[:n] if s is not None)
        self._loaded["host"] += host
        self._loaded["disk"] += n - host
        if bads:
            self._failed += len(bads)
            if loading(ld.request_id):
                self._forget_disk([h for h in bads if self.index.discard(h) == "disk"],
                                  discarded=True)
        return LoadDone(ld.request_id, n, bad, host, n - host)

    @property
    def busy(self) -> bool:
        """Loads are in flight (the engine loop should come back soon)."""
        return bool(self._loads)

    def wait(self, timeout: float) -> None:
        """Block until a load finished (on some rank) or ``timeout`` passed (an offline loop
        with nothing else to do)."""
        if self._done_event.wait(timeout):
            self._done_event.clear()

    def stats(self) -> OffloadStats:
        s = self.index.stats()
        return OffloadStats(s.host_blocks, s.host_capacity, s.disk_blocks, s.disk_capacity,
                            self._stored["host"], self._stored["disk"], self._loaded["host"],
                            self._loaded["disk"], self._failed,
                            self.disk is not None and self._disk_lost is None, self._dropped)

    def close(self) -> None:
        """Stop the loader (bounded) and the disk tier's writer (the other ranks close
        theirs when they stop)."""
        self._loader.close()
        self.stores.close()

    # -- internals -------------------------------------------------------------------------------

    def _loaded_here(self, seq: int, n: int, bad: int | None) -> None:
        """Loader thread: rank 0's part of load ``seq`` ended."""
        self._done.append((seq, n, bad))
        self._done_event.set()
        self._wake()

    def _rank_event(self) -> None:
        """Reader thread: another rank sent a tier event (taken on the engine thread)."""
        self._done_event.set()
        self._wake()

    def _take_rank_events(self) -> None:
        if self.peers is None:
            return
        for ev in self.peers.take_tier_events():
            if isinstance(ev, TierLoaded):
                ld = self._loads.get(ev.seq)
                if ld is not None:
                    ld.results[ev.rank] = (ev.num_loaded, ev.bad)
            elif isinstance(ev, TierDiskOff):
                if self._disk_lost is None:
                    self._disk_lost = f"rank {ev.rank}: {ev.reason}"
            elif isinstance(ev, TierSkipped):
                self._dropped += len(ev.block_hashes)
                self._forget_disk(list(ev.block_hashes))

    def _forget_disk(self, hashes: list[int], remove_here: bool = True,
                     discarded: bool = False) -> None:
        """Forget these disk entries (``discarded``: the index did already) and delete their
        files on every rank (``remove_here`` False: not on this one, which has none)."""
        if not discarded:
            hashes = [h for h in hashes
                      if self.index.lookup(h) == "disk" and self.index.discard(h) == "disk"]
        if not hashes:
            return
        if remove_here:
            assert self.disk is not None
            for h in hashes:
                self.disk.remove(h)
        if self.peers is not None:
            self.peers.send_all(TierOps(tuple(DiskDrop(h) for h in hashes)))

    def _disk_failed(self, reason: str) -> None:
        """Writer thread: the disk tier failed (DiskTier logged it); dropped on our thread."""
        self._disk_lost = reason
        self._wake()

    def _drop_disk(self) -> None:
        if self.index.disk_capacity:
            gone = self.index.drop_disk()
            logger.warning("KV offload: the disk tier is off (%s); %d blocks forgotten, the "
                           "host tier goes on", self._disk_lost, len(gone))
