"""The byte stores of the KV offload tiers (issue 41): host memory and local disk.

Which block hash lives in which slot or file is decided elsewhere (``disagg/kv_cache/tiers.py``,
torch-free); this module only moves a block's bytes and proves they come back unchanged. A block
is ``kv_cache[block_id]`` (docs/DESIGN.md section 1), one contiguous chunk; every stored block
carries its ``wsum32x2`` checksum (``disagg.transfer.integrity``) computed from the source
block's bytes, and a load or read that finds other bytes installs nothing and answers False:
the caller treats it as a miss (recomputes), never serves corrupted KV.

``HostTier``: ``num_slots`` block-sized slots in one host tensor (pinned for a CUDA cache).
``store`` runs on the engine thread: it gathers the blocks on their device (in batches of at
most ``_GATHER_BYTES``: the cache fills most of the GPU), checksums them there, copies them into
the slots and returns when the copies are complete, so the device blocks may be reused at
once. ``load`` runs on a loader thread while the engine thread runs steps on other blocks: it
touches ``kv_cache[block_id]`` only. On a CUDA cache it works on a stream of its own that first
waits for the work already queued on the device's default stream (where the engine's steps run:
a step queued before the block was freed may still write it); it copies the slot into a device
buffer, checksums the bytes that landed, copies them into the block, and synchronizes its
stream before it returns. The caller does not ``store`` into a slot while a ``load`` or
``block`` of that slot runs (the index owns that rule).

``DiskTier``: one file per block, ``<folder>/<key:016x>.kv`` (``key``: the block hash, an
unsigned 64-bit int). A file is a fixed header of ``HEADER_BYTES`` (little-endian)::

    magic 8s  b"DKVTIER\\0"       version u32 (1)       header_bytes u32 (128)
    key u64                       payload_bytes u64     ndim u32   (pad u32)
    shape 8 x u32 (unused dims 0) dtype 16s ("bfloat16", NUL-padded)
    checksum 16s (16 hex digits of wsum32x2)            zero padding to 128 bytes

then the block's raw bytes (``payload_bytes``). One daemon writer thread writes each file under
``<key:016x>.kv.tmp`` and renames it into place (``os.replace``): the final name never holds a
torn file. ``write`` only queues: until the file is in place its block stays in ``pending`` and
``read_into`` serves it from there. Reads run on the caller's (loader) thread and check the
file's size, header and checksum before anything is installed. No fsync: the tier is emptied
whenever it starts (a worker's disk blocks do not outlive it), so a crash cannot leave a file
that is later trusted. The first failed write (disk full, permission, any OSError) disables the
tier for good: one warning naming the folder, ``on_disabled(reason)`` called once from the writer
thread, later writes are no-ops and reads answer False. An exclusive ``flock`` on
``<folder>/.lock``, held while the tier is open, keeps two workers out of one folder.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from disagg.config import ConfigError
from disagg.transfer.integrity import payload_checksum

logger = logging.getLogger(__name__)

# Transient device memory one store gathers at a time (at least one block).
_GATHER_BYTES = 64 << 20

MAGIC = b"DKVTIER\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 128  # payload starts 64-byte aligned
_MAX_DIMS = 8
_HEADER = struct.Struct(f"<8sIIQQII{_MAX_DIMS}I16s16s")
assert _HEADER.size <= HEADER_BYTES
_FILE_SUFFIX = ".kv"
_TMP_SUFFIX = ".kv.tmp"
_KEY_LIMIT = 1 << 64


# ---- CUDA loads: a stream per device, ordered after the engine's queued work ------------------

_LOAD_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_LOAD_STREAMS_LOCK = threading.Lock()


def _load_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream loads into ``device``'s cache run on (shared by every tier and loader)."""
    with _LOAD_STREAMS_LOCK:
        stream = _LOAD_STREAMS.get(device)
        if stream is None:
            stream = _LOAD_STREAMS[device] = torch.cuda.Stream(device)
        return stream


# The checksum recorded for a block stored with the check off (``kv_integrity`` false): not
# hex, so no real checksum equals it; such a block is installed unchecked.
UNCHECKED = "unchecked-------"


def _verified_install(src: torch.Tensor, expected: str, kv_cache: torch.Tensor,
                      block_id: int) -> str:
    """Copy ``src`` (one block in host memory) into ``kv_cache[block_id]`` if its checksum is
    ``expected``; returns the checksum found (the block is untouched when it differs). On a GPU
    the checksum is taken over the bytes that landed in device memory, and the copy is complete
    when this returns. ``expected`` UNCHECKED: copied without a check."""
    if expected == UNCHECKED:
        kv_cache[block_id].copy_(src)
        if kv_cache.device.type == "cuda":
            torch.cuda.current_stream(kv_cache.device).synchronize()
        return UNCHECKED
    if kv_cache.device.type != "cuda":
        found = payload_checksum([src])
        if found == expected:
            kv_cache[block_id].copy_(src)
        return found
    device = kv_cache.device
    stream = _load_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        # a step queued before the block was freed may still write it: go after it
        stream.wait_stream(torch.cuda.default_stream(device))
        staged = torch.empty(src.shape, dtype=src.dtype, device=device)
        staged.copy_(src, non_blocking=True)
        found = payload_checksum([staged])  # reads its sums back: the copy has landed
        if found == expected:
            kv_cache[block_id].copy_(staged)
        stream.synchronize()
    return found


def _check_cache(kv_cache: torch.Tensor, block_shape: tuple[int, ...], dtype: torch.dtype,
                 who: str) -> None:
    if tuple(kv_cache.shape[1:]) != block_shape or kv_cache.dtype != dtype:
        raise ValueError(f"{who}: kv_cache blocks are {tuple(kv_cache.shape[1:])} "
                         f"{kv_cache.dtype}, the tier holds {block_shape} {dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"{who}: kv_cache must be contiguous")


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of ``values`` (sorted) whose values are consecutive."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


# ---- host memory ------------------------------------------------------------------------------

class HostTier:
    """``num_slots`` block-sized slots in host memory (pinned when the KV cache is on CUDA),
    each with the checksum of the block last stored in it."""

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, num_slots: int,
                 pin: bool, check: bool = True) -> None:
        """``check`` False (``kv_integrity`` off): no checksum is taken or checked."""
        self.check = check
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self.num_slots = num_slots
        # pinning needs a CUDA runtime; only a CUDA cache asks for it
        self.pinned = bool(pin) and torch.cuda.is_available()
        self.data = torch.empty((num_slots, *self.block_shape), dtype=dtype,
                                pin_memory=self.pinned)
        self.block_bytes = self.data[0].numel() * self.data.element_size()
        self._checksums: list[str | None] = [None] * num_slots

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is out of range [0, {self.num_slots})")

    def store(self, slots: list[int], kv_cache: torch.Tensor, block_ids: list[int]) -> None:
        """Copy ``kv_cache[block_ids[i]]`` into slot ``slots[i]`` and record each slot's
        checksum (of the source block's bytes). Complete when it returns: the device blocks
        may be overwritten at once."""
        if len(slots) != len(block_ids):
            raise ValueError(f"store: {len(slots)} slots for {len(block_ids)} blocks")
        if not slots:
            return
        _check_cache(kv_cache, self.block_shape, self.dtype, "HostTier.store")
        for slot in slots:
            self._check_slot(slot)
        if len(set(slots)) != len(slots):
            raise ValueError(f"store: a slot appears twice in {slots}")
        # slot order: consecutive slots take one copy each run
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slots_sorted = [slots[i] for i in order]
        ids_sorted = [block_ids[i] for i in order]
        per_batch = max(1, _GATHER_BYTES // max(1, self.block_bytes))
        device = kv_cache.device
        for lo in range(0, len(slots_sorted), per_batch):
            batch_slots = slots_sorted[lo:lo + per_batch]
            ids = torch.tensor(ids_sorted[lo:lo + per_batch], dtype=torch.long, device=device)
            gathered = kv_cache.index_select(0, ids)  # one gather, on the cache's device
            sums = ([payload_checksum([gathered[i]]) for i in range(len(batch_slots))]
                    if self.check else [UNCHECKED] * len(batch_slots))
            for slot in batch_slots:  # a load racing this sees "never stored", not old sums
                self._checksums[slot] = None
            for start, stop in _runs(batch_slots):
                first = batch_slots[start]
                self.data[first:first + stop - start].copy_(gathered[start:stop],
                                                            non_blocking=self.pinned)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the slots hold the bytes
            for slot, checksum in zip(batch_slots, sums, strict=True):
                self._checksums[slot] = checksum

    def load(self, slot: int, kv_cache: torch.Tensor, block_id: int) -> bool:
        """Copy the slot's bytes into ``kv_cache[block_id]`` if they match the recorded
        checksum (True); otherwise, or for a slot never stored, write nothing, log a warning
        and answer False. Touches no other block of ``kv_cache``."""
        self._check_slot(slot)
        _check_cache(kv_cache, self.block_shape, self.dtype, "HostTier.load")
        expected = self._checksums[slot]
        if expected is None:
            logger.warning("KV host tier: slot %d holds no stored block; not loaded", slot)
            return False
        found = _verified_install(self.data[slot], expected, kv_cache, block_id)
        if found != expected:
            logger.warning("KV host tier: slot %d fails its checksum (stored %s, found %s); "
                           "not loaded", slot, expected, found)
            return False
        return True

    def block(self, slot: int) -> tuple[torch.Tensor, str]:
        """A CPU copy of the slot's bytes and the checksum recorded for them."""
        self._check_slot(slot)
        checksum = self._checksums[slot]
        if checksum is None:
            raise LookupError(f"slot {slot} holds no stored block")
        return self.data[slot].clone(), checksum


class FolderInUseError(ConfigError):
    """Another live process holds the disk tier's folder."""


# ---- disk -------------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_block_file(path: str, header: bytes, payload: memoryview) -> None:
    """Write one block's file (the writer thread's only file output: tests replace it)."""
    with open(path, "wb") as f:
        f.write(header)
        f.write(payload)


@dataclass(frozen=True)
class _Pending:
    """A block queued for writing; ``seq`` tells a cancelled or superseded write apart."""

    data: torch.Tensor
    checksum: str
    seq: int


class DiskTier:
    """Blocks as files under a folder this worker owns, written off the engine thread.

    The tier is emptied when it starts: every ``*.kv`` file and ``*.kv.tmp`` temporary left in
    the folder by an earlier run is removed (their blocks' index died with that run); a clean
    ``close`` deletes them too. The
    folder is locked (``flock`` on ``.lock``) while the tier is open; a folder another live
    process holds is a ``ConfigError`` naming ``kv_offload_disk_dir``.
    """

    def __init__(self, folder: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.folder = os.path.abspath(folder)
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self._dtype_name = _dtype_name(dtype)
        if len(self.block_shape) > _MAX_DIMS:
            raise ValueError(f"a block has at most {_MAX_DIMS} dims, got {self.block_shape}")
        if len(self._dtype_name.encode()) > 16:
            raise ValueError(f"dtype name {self._dtype_name!r} is longer than 16 bytes")
        numel = 1
        for d in self.block_shape:
            numel *= d
        self.payload_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self.file_bytes = HEADER_BYTES + self.payload_bytes
        self.disabled = False
        self.on_disabled: Callable[[str], None] | None = None
        self.pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0  # queued items not yet processed (flush waits for 0)
        self._seq = 0
        self._closed = False
        self._queue: queue.Queue[tuple[str, int, int]] = queue.Queue()
        self._lock_fd = self._take_folder()
        try:
            self._empty_folder()
        except BaseException:
            self._release_folder()
            raise
        self._writer = threading.Thread(target=self._run_writer, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    # -- the folder ---------------------------------------------------------------------------

    def _take_folder(self) -> int:
        """Create the folder and hold its lock; the lock file names the holder's pid."""
        lock_path = os.path.join(self.folder, ".lock")
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"kv_offload_disk_dir: cannot use {self.folder}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f" (pid {holder})" if holder.isdigit() else ""
                raise FolderInUseError(
                    f"kv_offload_disk_dir: {self.folder} is in use by another worker{who}; "
                    "give each worker a folder of its own") from e
            raise ConfigError(f"kv_offload_disk_dir: cannot lock {lock_path}: {e}") from e
        try:  # for the operator who wonders who holds it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        return fd

    def _release_folder(self) -> None:
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)

    def _empty_folder(self) -> None:
        try:
            names = os.listdir(self.folder)
            for name in names:
                if name.endswith(_FILE_SUFFIX) or name.endswith(_TMP_SUFFIX):
                    try:
                        os.unlink(os.path.join(self.folder, name))
                    except FileNotFoundError:
                        pass
        except OSError as e:
            raise ConfigError(f"kv_offload_disk_dir: cannot empty {self.folder}: {e}") from e

    def _path(self, key: int) -> str:
        return os.path.join(self.folder, f"{key:016x}{_FILE_SUFFIX}")

    # -- the caller's side ----------------------------------------------------------------------

    def _enqueue_locked(self, op: str, key: int, seq: int) -> None:
        self._outstanding += 1
        self._queue.put((op, key, seq))

    def write(self, key: int, data: torch.Tensor, checksum: str) -> None:
        """Queue ``data`` (one block on the CPU, which the tier keeps: do not change it) for
        writing as ``key``'s file; ``read_into`` finds it from now on. A no-op once disabled
        or closed."""
        if self.disabled or self._closed:
            return
        if not 0 <= key < _KEY_LIMIT:
            raise ValueError(f"key {key} is not an unsigned 64-bit int")
        if (tuple(data.shape) != self.block_shape or data.dtype != self.dtype
                or data.device.type != "cpu"):
            raise ValueError(f"DiskTier.write: data is {tuple(data.shape)} {data.dtype} on "
                             f"{data.device}, the tier holds {self.block_shape} {self.dtype} "
                             "on the CPU")
        if len(checksum) != 16:
            raise ValueError(f"checksum {checksum!r} is not 16 hex digits (payload_checksum)")
        data = data.contiguous()
        with self._lock:
            if self.disabled or self._closed:
                return
            self._seq += 1
            self.pending[key] = _Pending(data, checksum, self._seq)
            self._enqueue_locked("write", key, self._seq)

    def remove(self, key: int) -> None:
        """Drop ``key``'s block: a write not yet done is cancelled, a file is deleted by the
        writer thread (after any write of it already under way)."""
        with self._lock:
            if self._closed:
                return
            self.pending.pop(key, None)
            self._enqueue_locked("remove", key, 0)

    def read_into(self, key: int, kv_cache: torch.Tensor, block_id: int) -> bool:
        """Install ``key``'s block into ``kv_cache[block_id]`` (True), from ``pending`` or its
        file, once its header and checksum check out. Anything wrong (no file, short file, bad
        header, checksum mismatch, an OSError): nothing written, a warning, False. Never
        raises for the file's sake; touches no other block of ``kv_cache``."""
        _check_cache(kv_cache, self.block_shape, self.dtype, "DiskTier.read_into")
        if self.disabled or self._closed:
            return False
        with self._lock:
            entry = self.pending.get(key)
        path = self._path(key)
        try:
            if entry is not None:
                src, expected, where = entry.data, entry.checksum, "its pending write"
            else:
                loaded = self._read_file(key, path)
                if loaded is None:
                    return False
                src, expected = loaded
                where = path
            found = _verified_install(src, expected, kv_cache, block_id)
        except Exception as e:  # noqa: BLE001 - a failed read is a miss, never a crash
            logger.warning("KV disk tier: cannot read block %016x from %s: %s", key, path, e)
            return False
        if found != expected:
            logger.warning("KV disk tier: block %016x from %s fails its checksum (stored %s, "
                           "found %s); not loaded", key, where, expected, found)
            return False
        return True

    def _read_file(self, key: int, path: str) -> tuple[torch.Tensor, str] | None:
        """The payload and recorded checksum of ``key``'s file, or None (warned) when the
        file is missing or its size or header is wrong."""
        def bad(why: str) -> None:
            logger.warning("KV disk tier: block %016x: %s %s; not loaded", key, path, why)

        try:
            f = open(path, "rb")
        except FileNotFoundError:
            bad("does not exist")
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != self.file_bytes:
                bad(f"holds {size} bytes, a block's file holds {self.file_bytes}")
                return None
            header = f.read(HEADER_BYTES)
            if len(header) != HEADER_BYTES:
                bad("is short")
                return None
            (magic, version, header_bytes, file_key, payload_bytes, ndim, _pad, *rest
             ) = _HEADER.unpack_from(header)
            dims, dtype_raw, checksum_raw = rest[:_MAX_DIMS], rest[_MAX_DIMS], rest[-1]
            if magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
                bad(f"has no block header of format {FORMAT_VERSION}")
                return None
            if file_key != key:
                bad(f"holds block {file_key:016x}")
                return None
            shape = tuple(dims[:ndim]) if ndim <= _MAX_DIMS else None
            dtype_name = dtype_raw.rstrip(b"\x00").decode(errors="replace")
            if (shape != self.block_shape or dtype_name != self._dtype_name
                    or payload_bytes != self.payload_bytes):
                bad(f"holds a {shape} {dtype_name} block of {payload_bytes} bytes, the tier "
                    f"holds {self.block_shape} {self._dtype_name}")
                return None
            buf = torch.empty(self.payload_bytes, dtype=torch.uint8)
            got = f.readinto(memoryview(buf.numpy()))
            if got != self.payload_bytes:
                bad(f"is short ({got} of {self.payload_bytes} payload bytes)")
                return None
        checksum = checksum_raw.rstrip(b"\x00").decode(errors="replace")
        return buf.view(self.dtype).view(self.block_shape), checksum

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write and removal is done; True if that happened within
        ``timeout`` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Drop the writes not yet done, stop the writer (waiting at most ``timeout``
        seconds), delete the tier's files (nothing can use them: the next start empties the
        folder anyway) and release the folder. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.pending.clear()
            self._enqueue_locked("stop", 0, 0)
        self._writer.join(timeout)
        if self._writer.is_alive():
            logger.warning("KV disk tier: the writer of %s did not stop within %.0f s",
                           self.folder, timeout)
        else:
            try:
                self._empty_folder()
            except ConfigError as e:
                logger.warning("KV disk tier: %s", e)
        self._release_folder()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer thread ----------------------------------------------------------------------

    def _header(self, key: int, checksum: str) -> bytes:
        dims = list(self.block_shape) + [0] * (_MAX_DIMS - len(self.block_shape))
        packed = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, key, self.payload_bytes,
                              len(self.block_shape), 0, *dims, self._dtype_name.encode(),
                              checksum.encode())
        return packed.ljust(HEADER_BYTES, b"\x00")

    def _run_writer(self) -> None:
        while True:
            op, key, seq = self._queue.get()
            try:
                if op == "stop":
                    return
                if op == "write":
                    self._write_one(key, seq)
                else:
                    self._remove_one(key)
            except Exception as e:  # noqa: BLE001 - the writer must outlive any one item
                self._disable(f"{type(e).__name__}: {e}")
            finally:
                with self._idle:
                    self._outstanding -= 1
                    if self._outstanding == 0:
                        self._idle.notify_all()

    def _write_one(self, key: int, seq: int) -> None:
        with self._lock:
            entry = self.pending.get(key)
        if entry is None or entry.seq != seq:
            return  # cancelled (removed, closed, disabled) or superseded by a later write
        final = self._path(key)
        tmp = final[:-len(_FILE_SUFFIX)] + _TMP_SUFFIX
        payload = memoryview(entry.data.reshape(-1).view(torch.uint8).numpy())
        try:
            _write_block_file(tmp, self._header(key, entry.checksum), payload)
            os.replace(tmp, final)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._disable(f"writing {final} failed: {e}")
            return
        with self._lock:
            if self.pending.get(key) is entry:
                del self.pending[key]

    def _remove_one(self, key: int) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("KV disk tier: cannot delete %s: %s", self._path(key), e)

    def _disable(self, reason: str) -> None:
        with self._lock:
            if self.disabled:
                return
            self.disabled = True
            self.pending.clear()
        logger.warning("KV disk tier in %s disabled: %s", self.folder, reason)
        callback = self.on_disabled
        if callback is not None:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - the caller's hook must not kill the writer
                logger.exception("KV disk tier: on_disabled raised")
