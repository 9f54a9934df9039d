"""Reusable host receive buffers for pulled KV (generation side, CPU caches).

A fresh ``torch.empty`` of tens of MiB is fresh ``mmap`` memory: the transport's first write
to each 4 KiB page takes a page fault, and freeing it unmaps the pages again, so every pull
paid that again (32 MiB: 10-30 ms on the 2-core benchmark host, several times the wire time;
``bench/results/kv_e2e.md``). The pool keeps the buffers of installed pulls and hands them to
the next pull, whose pages are then already mapped.

A buffer comes back only from ``give`` after its read finished and was installed: a failed or
cancelled read's buffer is never reused (the transport may still write into it), it is freed
when the last reference goes. GPU caches do not use the pool: their receive buffers come from
torch's caching allocators (device or pinned host), which already reuse memory.
"""

from __future__ import annotations

import threading

import torch

from disagg.env import KV_RECV_POOL

# What an idle generation worker may keep mapped for the next pulls: two 8192-token reads of
# the benchmark model (128 MiB each); a larger buffer is used once and freed.
RECV_POOL_MAX_BYTES = 256 << 20


class ReceivePool:
    """Host byte buffers for ``pull.KVPuller``; thread-safe (a rank installs on its own
    thread while its main thread submits)."""

    def __init__(self, max_bytes: int = RECV_POOL_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocations = 0  # buffers ever created (tests)

    @classmethod
    def from_env(cls) -> ReceivePool:
        """``DISAGG_KV_RECV_POOL=0`` gives a pool that keeps nothing (a fresh buffer a read)."""
        return cls(RECV_POOL_MAX_BYTES if KV_RECV_POOL.get() else 0)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
        """(out, base): a contiguous ``out`` of ``shape``/``dtype`` viewing bytes
        ``[0, nbytes)`` of ``base``, the buffer to ``give`` back once the read is installed."""
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        with self._lock:
            # Smallest free buffer that fits (indices: tensors compare elementwise).
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            base = (self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                    if fits else None)
            if base is None:
                self.allocations += 1
        if base is None:
            base = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return base[:nbytes].view(dtype).view(shape), base

    def give(self, base: torch.Tensor) -> None:
        """Keep ``base`` for a later read, the largest buffers first, within ``max_bytes``."""
        with self._lock:
            kept = sorted([*self._free, base], key=lambda b: -b.numel())
            self._free, total = [], 0
            for b in kept:
                if total + b.numel() <= self.max_bytes:
                    self._free.append(b)
                    total += b.numel()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)
