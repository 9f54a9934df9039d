"""Leases on a context worker's KV blocks (torch-free).

After prefill the context side keeps a request's blocks under a lease until every generation
rank that must read them has confirmed, or the lease expires. A read after expiry fails with
``expired_lease`` (the generation worker then fails the request): the blocks may already hold
another request's KV, and decoding from them would return wrong text with a success status.
Every abort on the generation side releases the lease, so blocks never wait for expiry when
nobody will read them. The table is
shared by the transfer server's thread (check / pin / confirm) and the engine thread (create /
release / expire), hence the lock.

Lifecycle of one lease::

    create ──► live ──┬─ confirm by the last of `readers` distinct readers ─► "confirmed"
                      ├─ release(lease_id) (abort path)                    ─► "released"
                      └─ clock >= expires_at (found by expire/check/pin)   ─► "expired"
    leaving "live" removes the lease from the table at once (new reads fail), but
    ``on_release(lease, reason)`` — which frees the blocks — waits until no read of it is in
    flight (``pin`` / ``unpin``): blocks are never freed under a transfer. A read in flight is
    bounded though: the transfer server aborts one still running ``read_grace_s`` after its
    lease ended (``hold_left``), so a stalled reader holds no block past TTL + grace.

The callback runs on whichever thread ended the lease, outside the lock: it should only
enqueue the blocks for the engine to free on its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from disagg.contracts.options import WORKER_DEFAULTS

logger = logging.getLogger("disagg.transfer")

ReleaseReason = Literal["confirmed", "expired", "released"]
ReleaseCallback = Callable[["Lease", ReleaseReason], None]

# The error codes of a read or confirm of a lease that is not live; the transfer server answers
# them as they are (transfer/base.py's SERVER_CODES).
UNKNOWN_LEASE = "unknown_lease"  # never existed, or left the table long ago
EXPIRED_LEASE = "expired_lease"  # expired recently (remembered as a tombstone)


class LeaseError(Exception):
    """Reading or confirming a lease that is not live. ``code``: unknown_lease | expired_lease."""

    def __init__(self, code: str, lease_id: str, message: str = "") -> None:
        super().__init__(f"{code}: lease {lease_id!r}" + (f": {message}" if message else ""))
        self.code = code
        self.lease_id = lease_id


@dataclass(frozen=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    readers: int  # distinct readers that must confirm
    created_at: float
    expires_at: float
    block_set: frozenset[int] = field(default=frozenset(), repr=False, compare=False)


@dataclass(frozen=True)
class LeaseStats:
    active_leases: int  # live leases
    leased_blocks: int  # blocks held: live leases + ended ones whose reads are still in flight
    expired_total: int
    confirmed_total: int
    released_total: int


@dataclass
class _Record:
    lease: Lease
    confirmed: set[str] = field(default_factory=set)
    pins: int = 0
    ended: ReleaseReason | None = None  # set when it left the table; callback pending on pins
    ended_at: float | None = None  # when it ended (an expired one: its expiry), table clock


class LeaseTable:
    """Thread-safe table of leases; see the module docstring for the semantics."""

    def __init__(
        self,
        default_ttl_s: float = WORKER_DEFAULTS.kv_lease_ttl_s,  # the worker option's
        clock: Callable[[], float] = time.monotonic,
        on_release: ReleaseCallback | None = None,
        max_tombstones: int = 4096,
    ) -> None:
        if default_ttl_s <= 0:
            raise ValueError("default_ttl_s must be > 0")
        self.default_ttl_s = default_ttl_s
        self.on_release = on_release
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, _Record] = {}
        self._draining: dict[str, _Record] = {}  # ended, callback waits for in-flight reads
        # Recently expired ids, so a late reader gets "expired_lease" rather than "unknown".
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._max_tombstones = max_tombstones
        self._held_blocks = 0
        self._expired_total = 0
        self._confirmed_total = 0
        self._released_total = 0

    # ---- owner side -----------------------------------------------------------------------

    def create(
        self, lease_id: str, block_ids: Iterable[int], readers: int, ttl_s: float | None = None
    ) -> Lease:
        ids = tuple(int(b) for b in block_ids)
        if readers < 1:
            raise ValueError("readers must be >= 1")
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError("ttl_s must be > 0")
        with self._lock:
            if lease_id in self._live or lease_id in self._draining:
                raise ValueError(f"lease {lease_id!r} already exists")
            now = self._clock()
            lease = Lease(lease_id, ids, readers, now, now + ttl, frozenset(ids))
            self._live[lease_id] = _Record(lease)
            self._tombstones.pop(lease_id, None)
            self._held_blocks += len(ids)
        return lease

    def extend(self, lease_id: str, block_ids: Iterable[int], ttl_s: float) -> bool:
        """A live lease gets new block ids (the held-block count follows) and expires
        ``ttl_s`` from now; its ``created_at`` becomes now (so ``expires_at - created_at`` is
        the TTL just given). False (and nothing happens) if it is not live. Streaming: a
        lease created when its request is queued, with a long TTL and the blocks known so
        far, gets each step's block table and, once the prefill is done, the normal TTL."""
        ids = tuple(int(b) for b in block_ids)
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        with self._lock:
            rec, fire, _ = self._live_locked(lease_id)  # an expired one is ended here
            if rec is not None:
                old = rec.lease
                now = self._clock()
                # Lease is frozen (readers hold it): replace the record's lease.
                rec.lease = Lease(lease_id, ids, old.readers, now, now + ttl_s, frozenset(ids))
                self._held_blocks += len(ids) - len(old.block_ids)
        self._fire(fire)
        return rec is not None

    def release(self, lease_id: str) -> bool:
        """Abort path: end the lease now. False (and nothing happens) if it is not live."""
        with self._lock:
            rec = self._live.get(lease_id)
            fire = self._end_locked(rec, "released") if rec is not None else None
        self._fire(fire)
        return rec is not None

    def expire(self, now: float | None = None) -> list[Lease]:
        """Sweep: end every live lease whose time is up; returns them."""
        fired: list[tuple[Lease, ReleaseReason]] = []
        expired: list[Lease] = []
        with self._lock:
            t = self._clock() if now is None else now
            for rec in [r for r in self._live.values() if t >= r.lease.expires_at]:
                expired.append(rec.lease)
                f = self._end_locked(rec, "expired")
                if f is not None:
                    fired.append(f)
        for f in fired:
            self._fire(f)
        return expired

    # ---- reader side ----------------------------------------------------------------------

    def check(self, lease_id: str) -> Lease:
        """The live lease; raises ``LeaseError`` (an expired one is ended on the spot)."""
        with self._lock:
            rec, fire, err = self._live_locked(lease_id)
        self._fire(fire)
        if err is not None:
            raise err
        assert rec is not None
        return rec.lease

    def pin(self, lease_id: str) -> Lease:
        """``check`` + hold the lease's blocks until ``unpin`` (a read is in flight)."""
        with self._lock:
            rec, fire, err = self._live_locked(lease_id)
            if rec is not None:
                rec.pins += 1
        self._fire(fire)
        if err is not None:
            raise err
        assert rec is not None
        return rec.lease

    def unpin(self, lease_id: str) -> None:
        fire = None
        with self._lock:
            rec = self._live.get(lease_id) or self._draining.get(lease_id)
            if rec is None or rec.pins == 0:
                raise ValueError(f"lease {lease_id!r} is not pinned")
            rec.pins -= 1
            if rec.pins == 0 and rec.ended is not None:
                del self._draining[lease_id]
                self._held_blocks -= len(rec.lease.block_ids)
                fire = (rec.lease, rec.ended)
        self._fire(fire)

    def confirm(self, lease_id: str, reader_id: str) -> bool:
        """Reader ``reader_id`` has its data. True when this was the last expected reader (the
        lease is then released, reason "confirmed"); a repeated confirm counts once. Raises
        ``LeaseError`` if the lease is not live."""
        with self._lock:
            rec, fire, err = self._live_locked(lease_id)
            done = False
            if rec is not None:
                rec.confirmed.add(str(reader_id))
                if len(rec.confirmed) >= rec.lease.readers:
                    done = True
                    fire = self._end_locked(rec, "confirmed")
        self._fire(fire)
        if err is not None:
            raise err
        return done

    def hold_left(self, lease_id: str) -> float:
        """Seconds until the lease ends, negative once it has: a live lease's expiry (also
        when no sweep has ended it yet), or for an ended one whose reads are still in flight,
        when it ended (an expired one: at its expiry). 0.0 for an id in neither. The transfer
        server bounds a read in flight by this plus its grace (``ServerLimits.read_grace_s``);
        asked again, it follows an ``extend`` (later) or an early end (sooner)."""
        with self._lock:
            now = self._clock()
            rec = self._live.get(lease_id)
            if rec is not None:
                return rec.lease.expires_at - now
            rec = self._draining.get(lease_id)
            if rec is not None and rec.ended_at is not None:
                return rec.ended_at - now
            return 0.0

    # ---- introspection --------------------------------------------------------------------

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            rec = self._live.get(lease_id)
            return rec.lease if rec is not None else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def __contains__(self, lease_id: object) -> bool:
        with self._lock:
            return lease_id in self._live

    def stats(self) -> LeaseStats:
        with self._lock:
            return LeaseStats(
                active_leases=len(self._live), leased_blocks=self._held_blocks,
                expired_total=self._expired_total, confirmed_total=self._confirmed_total,
                released_total=self._released_total,
            )

    # ---- internals (lock held) ------------------------------------------------------------

    def _live_locked(
        self, lease_id: str
    ) -> tuple[_Record | None, tuple[Lease, ReleaseReason] | None, LeaseError | None]:
        rec = self._live.get(lease_id)
        if rec is None:
            code = EXPIRED_LEASE if lease_id in self._tombstones else UNKNOWN_LEASE
            return None, None, LeaseError(code, lease_id)
        if self._clock() >= rec.lease.expires_at:
            fire = self._end_locked(rec, "expired")
            return None, fire, LeaseError(EXPIRED_LEASE, lease_id)
        return rec, None, None

    def _end_locked(
        self, rec: _Record, reason: ReleaseReason
    ) -> tuple[Lease, ReleaseReason] | None:
        lease_id = rec.lease.lease_id
        del self._live[lease_id]
        rec.ended_at = min(self._clock(), rec.lease.expires_at)
        if reason == "expired":
            self._expired_total += 1
            self._tombstones[lease_id] = None
            while len(self._tombstones) > self._max_tombstones:
                self._tombstones.popitem(last=False)
        elif reason == "confirmed":
            self._confirmed_total += 1
        else:
            self._released_total += 1
        if rec.pins > 0:
            rec.ended = reason  # unpin fires the callback
            self._draining[lease_id] = rec
            return None
        self._held_blocks -= len(rec.lease.block_ids)
        return (rec.lease, reason)

    def _fire(self, fire: tuple[Lease, ReleaseReason] | None) -> None:
        if fire is None or self.on_release is None:
            return
        try:
            self.on_release(*fire)
        except Exception:  # a broken owner callback must not break the transfer server
            logger.exception("lease on_release callback failed for %s", fire[0].lease_id)
