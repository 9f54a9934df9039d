"""A worker's KV cache event log, read by routers (torch-free).

The engine thread appends the block pool's events (``stored`` / ``removed`` block hashes) after
every step; an HTTP handler serves ``GET /kv_events?since=SEQ`` from another thread. Each event
gets a sequence number; a reader polls with ``since = next_seq`` of its previous answer.

Only the last ``max_events`` events are retained. A reader that fell behind (its ``since`` is
older than the oldest retained event) or that is newer than the log (``since > next_seq``: it
talked to a previous incarnation of the worker) gets a ``snapshot`` instead: every block hash
cached right now (as of ``next_seq``), to replace its whole index of this worker with. The
snapshot is a mirror set kept from the events themselves, so it never touches the block pool
from the reader's thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from disagg.kv_cache.block_pool import KVCacheEvent


@dataclass(frozen=True)
class KVEventBatch:
    """One answer of ``KVEventLog.since``."""

    next_seq: int
    events: list[tuple[int, str, list[int]]]  # (seq, "stored" | "removed", block hashes)
    snapshot: list[int] | None  # set instead of ``events`` when the reader must resync
    # seq -> the offload tier ("host" / "disk") a ``stored`` event's hashes are in now
    # (``KVCacheEvent.medium``); not in it: the KV cache
    media: dict[int, str] = field(default_factory=dict)


class KVEventLog:
    def __init__(self, max_events: int = 4096) -> None:
        if max_events < 1:
            raise ValueError("max_events must be >= 1")
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, list[int]]] = deque(maxlen=max_events)
        self._media: dict[int, str] = {}  # seq -> medium, for the retained events that have one
        self._next_seq = 0
        self._cached: set[int] = set()

    def append(self, events: Iterable[KVCacheEvent]) -> None:
        """Engine thread: record the pool's events in order."""
        with self._lock:
            for ev in events:
                if not ev.block_hashes:
                    continue
                hashes = list(ev.block_hashes)
                if ev.kind == "stored":
                    self._cached.update(hashes)
                else:
                    self._cached.difference_update(hashes)
                if len(self._events) == self._events.maxlen:  # the oldest one goes
                    self._media.pop(self._events[0][0], None)
                self._events.append((self._next_seq, ev.kind, hashes))
                if ev.medium is not None:
                    self._media[self._next_seq] = ev.medium
                self._next_seq += 1

    def since(self, seq: int) -> KVEventBatch:
        """Events with sequence number >= ``seq``, or a snapshot if they are not all here."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._next_seq
            if seq < oldest or seq > self._next_seq:
                return KVEventBatch(self._next_seq, [], sorted(self._cached))
            # seq in [oldest, next_seq]: events are consecutive, so the index is seq - oldest.
            start = seq - oldest
            events = [self._events[i] for i in range(start, len(self._events))]
            media = {s: m for s, m in self._media.items() if s >= seq}
            return KVEventBatch(self._next_seq, events, None, media)

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next_seq
