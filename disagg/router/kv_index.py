"""The router's picture of one worker's KV cache: the set of block hashes it holds.

Fed by the worker's ``GET /kv_events?since=SEQ`` answers (``apply``): ``stored`` / ``removed``
events update the set; a ``snapshot`` (the reader fell behind, or the worker restarted and its
``worker_id`` changed) replaces it. The hashes depend on the worker's block size, so the index
keeps the ``tokens_per_block`` they were made with, and a change of block size or hash scheme
drops everything until a snapshot made with the new one arrives: a match is never computed
with a stale block size.

Matching hashes the prompt with the worker's block size exactly as the workers do
(``disagg.kv_cache.hashing``) and counts the leading blocks found: the chain hash of block
``i`` covers blocks ``0..i``, so the first miss ends the match.

With offload tiers a worker reports a block that left its KV cache for a tier as ``stored``
with that ``medium`` (``host`` / ``disk``): it is still a hit, but one copied back first;
``tiered`` keeps those hashes until the block is stored in the KV cache again or removed (a
snapshot carries no medium: it clears ``tiered``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.kv_cache.hashing import BLOCK_HASH_SCHEME, extend_block_hashes


class KVEventsError(ValueError):
    """A malformed /kv_events answer."""


@dataclass
class PromptHashes:
    """A prompt's chained block hashes, computed once per block size (workers may differ)."""

    token_ids: Sequence[int]
    _by_block_size: dict[int, list[int]] = field(default_factory=dict)

    def for_block_size(self, block_size: int) -> list[int]:
        hashes = self._by_block_size.get(block_size)
        if hashes is None:
            hashes = extend_block_hashes([], self.token_ids, block_size)
            self._by_block_size[block_size] = hashes
        return hashes


class KVIndex:
    """Cached block hashes of one worker (see the module docstring)."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.tiered: set[int] = set()  # of ``blocks``: held in an offload tier only
        self.worker_id: str | None = None
        self.tokens_per_block: int | None = None
        self.next_seq = 0  # the ``since`` of the next poll
        self.synced = False  # a snapshot (or the log from seq 0) has been applied
        self.resyncs = 0  # snapshots applied (restarts, fell behind, block size changes)

    @property
    def usable(self) -> bool:
        return self.synced and self.tokens_per_block is not None

    def reset(self) -> None:
        """Forget everything: the next poll asks from seq 0, which gets a full picture."""
        self.blocks = set()
        self.tiered = set()
        self.worker_id = None
        self.tokens_per_block = None
        self.next_seq = 0
        self.synced = False

    def apply(self, answer: Mapping[str, Any]) -> None:
        """Apply one /kv_events answer (validated first: a bad answer changes nothing)."""
        try:
            worker_id = answer["worker_id"]
            block_size = int(answer["tokens_per_block"])
            scheme = answer.get("block_hash_scheme", BLOCK_HASH_SCHEME)
            next_seq = int(answer["next_seq"])
            events = answer.get("events") or []
            snapshot = answer.get("snapshot")
            parsed = [(int(ev["seq"]), str(ev["type"]), [int(h) for h in ev["block_hashes"]],
                       ev.get("medium")) for ev in events]
            snap = None if snapshot is None else {int(h) for h in snapshot}
        except (KeyError, TypeError, ValueError) as e:
            raise KVEventsError(f"malformed /kv_events answer: {e!r}") from None
        if scheme != BLOCK_HASH_SCHEME:
            # Hashes we cannot reproduce: never match against them.
            self.reset()
            raise KVEventsError(f"block_hash_scheme {scheme!r} is not {BLOCK_HASH_SCHEME!r}")
        if block_size <= 0:
            raise KVEventsError(f"tokens_per_block {block_size} must be > 0")
        changed = worker_id != self.worker_id or block_size != self.tokens_per_block
        if changed and snap is None:
            if self.next_seq == 0 and not parsed or parsed and parsed[0][0] == 0:
                snap = set()  # the worker's whole log from its start: an empty base is exact
            else:
                # A restarted worker (new id) answered events of its own log: ask again
                # from 0, which the worker answers with a full picture.
                self.reset()
                return
        if snap is not None:
            self.blocks = snap
            self.tiered = set()
            self.resyncs += self.synced
            self.synced = True
        elif not self.synced:
            return
        self.worker_id = worker_id
        self.tokens_per_block = block_size
        for _seq, kind, hashes, medium in parsed:
            if kind == "stored":
                self.blocks.update(hashes)
                if medium in ("host", "disk"):
                    self.tiered.update(hashes)
                else:
                    self.tiered.difference_update(hashes)
            elif kind == "removed":
                self.blocks.difference_update(hashes)
                self.tiered.difference_update(hashes)
        self.next_seq = next_seq

    def match_tiered(self, prompt: PromptHashes) -> list[bool]:
        """Per leading block found (as ``match`` counts them): whether it is held in an
        offload tier only (a hit copied back first)."""
        if not self.usable:
            return []
        assert self.tokens_per_block is not None
        out = []
        for h in prompt.for_block_size(self.tokens_per_block):
            if h not in self.blocks:
                break
            out.append(h in self.tiered)
        return out

    def match(self, prompt: PromptHashes) -> int:
        """Prompt tokens whose KV this worker holds: leading full blocks found, times B."""
        if not self.usable:
            return 0
        assert self.tokens_per_block is not None
        hashes = prompt.for_block_size(self.tokens_per_block)
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n * self.tokens_per_block
