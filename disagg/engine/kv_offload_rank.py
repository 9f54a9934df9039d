"""The KV offload tiers' part on ranks 1..N-1 of a multi-rank worker (tp * pp > 1).

Every rank holds its own slice of the KV cache (its layers, its kv heads), so every rank keeps
the tier bytes of its own slice: a host tier of as many slots as rank 0's, a disk tier in
``worker-N/rank-R`` under the folder rank 0 claimed. Which block is where is rank 0's index
alone; this part makes the copies rank 0 sends (``kv_offload_messages``), in order with the
steps, and reports its loads, a failed disk and skipped writes as events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from disagg.engine.kv_offload import TierLoader, TierStores, rank_disk_folder
from disagg.engine.kv_offload_messages import (
    TierDiskOff,
    TierEvent,
    TierLoad,
    TierLoaded,
    TierMessage,
    TierOps,
    TierSetup,
    TierSkipped,
)
from disagg.engine.kv_tiers import DiskTier, HostTier

logger = logging.getLogger(__name__)


class RankOffload:
    """Rank ``rank`` >= 1's tier bytes (module docstring). ``handle`` runs on the rank's main
    thread between steps; ``emit`` sends an event to rank 0 (thread-safe: the loader and the
    disk writer report)."""

    def __init__(self, setup: TierSetup, rank: int, kv_cache: torch.Tensor,
                 emit: Callable[[TierEvent], None]) -> None:
        self.rank = rank
        self._emit = emit
        block_shape = tuple(kv_cache.shape[1:])
        host = (HostTier(block_shape, kv_cache.dtype, setup.host_slots, pin=kv_cache.is_cuda,
                         check=setup.integrity) if setup.host_slots else None)
        disk = None
        if setup.disk_folder is not None:
            disk = DiskTier(rank_disk_folder(setup.disk_folder, rank), block_shape,
                            kv_cache.dtype)
            disk.on_disabled = lambda reason: emit(TierDiskOff(rank, reason))
        self.stores = TierStores(kv_cache, host, disk, setup.integrity)
        self._loader = TierLoader(self.stores, self._loaded)

    def handle(self, msg: TierMessage) -> None:
        """A control message from rank 0 (main thread, between steps)."""
        if isinstance(msg, TierOps):
            _, _, skipped = self.stores.run(msg.ops)
            if skipped:
                self._emit(TierSkipped(self.rank, tuple(skipped)))
        elif isinstance(msg, TierLoad):
            self._loader.submit(msg.seq, msg.block_ids, msg.block_hashes, msg.slots)
        else:
            raise RuntimeError(f"unexpected tier message {msg!r}")

    def _loaded(self, seq: int, n: int, bad: int | None) -> None:
        self._emit(TierLoaded(self.rank, seq, n, bad))

    def close(self) -> None:
        """Stop the loader (bounded) and the disk writer; the disk tier's files are deleted."""
        self._loader.close()
        self.stores.close()
