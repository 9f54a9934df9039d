"""Per-request block tables on top of the block pool, with prefix caching (torch-free).

A request's block table maps its token positions to blocks: token ``p`` lives in block
``table[p // B]`` at offset ``p % B``. The table only grows while the request runs; ``free``
releases all of it (tail first), e.g. when the request finishes or is preempted.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.kv_cache.block_pool import BlockPool, BlockPoolStats, KVCacheEvent
from disagg.kv_cache.hashing import extend_block_hashes
from disagg.kv_cache.tiers import TierIndex
from disagg.request import Request

_NEVER = 1 << 62  # "registered up to" mark of a never_cache request: beyond any table


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, tiers: TierIndex | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # Offload tiers below the pool (None: none): evicted cached blocks are recorded for
        # them, and a prefix chain may go on in them after the pool's hits end.
        self.tiers = tiers if enable_prefix_caching else None
        self.pool.record_evictions = self.tiers is not None
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already registered in the prefix cache (or skipped as
        # duplicates): cache_blocks continues from here.
        self._num_registered: dict[str, int] = {}
        # Chained hashes of each request's full blocks, extended as tokens arrive. Kept across a
        # preemption (the tokens do not change), dropped once the request is finished.
        self._hashes: dict[str, list[int]] = {}

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of blocks held by requests (0..1); cached-but-unreferenced blocks count free."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """ceil(num_tokens / B): blocks holding positions [0, num_tokens)."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty when it holds none)."""
        return list(self._tables.get(request_id, ()))

    def block_ids_if_holding(self, request_id: str, num_tokens: int) -> list[int] | None:
        """``block_ids(request_id)`` when its table already holds positions
        ``[0, num_tokens)``, else None (the scheduler's decode fast path: one look-up)."""
        table = self._tables.get(request_id)
        if table is None or len(table) * self.block_size < num_tokens:
            return None
        return list(table)

    def num_held_blocks(self, request_id: str) -> int:
        """len(block_ids(request_id)) without the copy."""
        return len(self._tables.get(request_id, ()))

    def stats(self) -> BlockPoolStats:
        return self.pool.stats()

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's events; with offload tiers a block counts as cached while the pool or
        a tier holds it: a ``removed`` hash that went to a tier is reported ``stored`` in that
        tier (``medium``), and a hash that left the last tier (and is not in the pool) is
        reported removed then."""
        events = self.pool.take_events()
        if self.tiers is None:
            return events
        tiers, pool = self.tiers, self.pool

        def gone(h: int) -> bool:
            return tiers.lookup(h) is None and pool.get_cached_block(h) is None

        out: list[KVCacheEvent] = []
        for ev in events:
            if ev.kind == "removed":
                hashes = [h for h in ev.block_hashes if gone(h)]
                if hashes:
                    out.append(KVCacheEvent("removed", hashes))
                by_tier: dict[str, list[int]] = {}
                for h in ev.block_hashes:
                    if pool.get_cached_block(h) is None and (t := tiers.lookup(h)) is not None:
                        by_tier.setdefault(t, []).append(h)
                out.extend(KVCacheEvent("stored", hs, medium=t) for t, hs in by_tier.items())
            else:
                out.append(ev)
        left = [h for h in tiers.take_gone() if gone(h)]
        if left:
            out.append(KVCacheEvent("removed", left))
        return out

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks are at ref 0: a prefix hit on one takes it out of the free
        queue, so it can no longer be counted as allocatable."""
        return sum(1 for b in block_ids if self.pool.blocks[b].ref_cnt == 0)

    def block_hashes(self, req: Request) -> list[int]:
        """Chained hashes of the request's full blocks (all tokens, prompt and output)."""
        hashes = self._hashes.setdefault(req.request_id, [])
        if len(hashes) < req.num_tokens // self.block_size:  # only re-hash when a block filled
            extend_block_hashes(hashes, req.all_token_ids, self.block_size)
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """The longest chain of cached blocks matching the request's leading full blocks, and
        the tokens they cover. Leaves at least one token to compute (its logits are needed to
        sample), so at most (num_tokens - 1) // B blocks. Does not take references."""
        if not self.enable_prefix_caching or req.num_tokens == 0:
            return [], 0
        # blocks [0, k) cover tokens [0, k*B); k*B <= num_tokens - 1 keeps one token to compute
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self.block_hashes(req)[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break  # the chain breaks at the first miss: later blocks depend on this one
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def get_tier_blocks(self, req: Request, num_hit_blocks: int) -> list[int]:
        """Hashes of the request's full blocks after its ``num_hit_blocks`` pool hits that the
        offload tiers hold, as one unbroken chain (same cap as ``get_computed_blocks``: one
        token is left to compute)."""
        if self.tiers is None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(req)[num_hit_blocks:max_blocks]
        return hashes[:self.tiers.chain_hits(hashes)]

    def take_evicted(self) -> list[tuple[int, int]]:
        """``(block_id, block_hash)`` of the cached blocks evicted since the last call (only
        with tiers), oldest first: their bytes are still in place until the next step runs."""
        return self.pool.take_evicted()

    # -- mutations ---------------------------------------------------------------------------

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to hold positions
        [0, num_computed_tokens + len(new_computed_blocks)*B + num_new_tokens).

        ``new_computed_blocks`` (prefix hits from get_computed_blocks, first call only) are
        referenced and become the head of the table. Returns the newly allocated block ids, or
        None, changing nothing, when the pool cannot supply them."""
        rid = req.request_id
        table = self._tables.get(rid)
        if new_computed_blocks and table:
            raise ValueError(f"{rid}: prefix hits can only be added to an empty block table")
        held = len(table) if table else 0
        num_tokens = (req.num_computed_tokens + len(new_computed_blocks) * self.block_size
                      + num_new_tokens)
        num_new_blocks = max(0, self.blocks_needed(num_tokens) - held - len(new_computed_blocks))
        if num_new_blocks > self.pool.num_free_blocks - self.num_free_among(new_computed_blocks):
            return None
        if table is None:
            table = self._tables[rid] = []
        if new_computed_blocks:
            # Touch before allocating, so the allocation cannot evict the hits.
            self.pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
            self._num_registered[rid] = len(new_computed_blocks)  # hits are registered already
        new_ids = self.pool.allocate(num_new_blocks)
        table.extend(new_ids)
        return new_ids

    def never_cache(self, req: Request) -> None:
        """None of this request's blocks may ever serve a prefix hit (their contents are not
        what its tokens would compute: benchmark gen-only requests)."""
        self._num_registered[req.request_id] = _NEVER

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the blocks that became full and computed: table[i] for i in
        [already registered, num_computed_tokens // B)."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        table = self._tables.get(rid, [])
        num_full = num_computed_tokens // self.block_size
        if num_full > len(table):
            raise ValueError(f"{rid}: {num_computed_tokens} computed tokens but only "
                             f"{len(table)} blocks")
        start = self._num_registered.get(rid, 0)
        if num_full <= start:  # (always so for a never_cache request)
            return
        hashes = self.block_hashes(req)
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i])
        self._num_registered[rid] = num_full

    def detach(self, req: Request) -> list[int]:
        """Forget the finished request's table but keep its block references: the caller
        now owns them (a lease) and returns them with ``free_blocks``."""
        rid = req.request_id
        table = self._tables.pop(rid, [])
        self._num_registered.pop(rid, None)
        self._hashes.pop(rid, None)
        return table

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Release blocks taken over by ``detach`` (tail first, like ``free``)."""
        self.pool.free(reversed(list(block_ids)))

    def free(self, req: Request) -> None:
        """Release the request's blocks (tail first, so its tail is evicted first) and forget
        its table. Its hash chain is kept while it is unfinished (a preempted request reuses
        it) and dropped once it is finished."""
        rid = req.request_id
        table = self._tables.pop(rid, None)
        self._num_registered.pop(rid, None)
        if table:
            self.pool.free(reversed(table))
        if req.is_finished():
            self._hashes.pop(rid, None)
