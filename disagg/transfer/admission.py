"""What a ``KVTransferServer`` lets a peer cost, and who holds a connection now (torch-free).

``ServerLimits`` is the server's frozen knobs; ``Admission`` applies the connection caps on the
server's loop thread and counts what it refused. A connection's life at the door::

    accepted ─ admit() ─► pending (counts against max_pending_connections) ─ authenticated() ─►
    authenticated ─ ... ─► leave()
    (closing, or over a cap: closed unread, counted in connections_refused)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disagg.transfer.base import Connection

logger = logging.getLogger("disagg.transfer")

REFUSAL_LOG_INTERVAL_S = 10.0  # at most one warning per interval about refused connections
# How long a READ in flight may go on after its lease ended (expired, released, confirmed by
# the other readers) before the server aborts it, closing that connection: a stalled reader
# (a stopped or wedged generation worker) holds the blocks at most TTL + this. It bounds one
# read's transfer when it starts just before its lease expires: 10 s moves ~25 GB on loopback
# TCP (~2.5 GB/s here), ~10 GB at 1 GB/s across hosts; a rank's KV of a 128k-token prompt of
# an 8B model is 16 GiB (bf16; 8 at TP 2). A read that starts with its lease fresh (the usual
# case: the generation side pulls right after the context answer) has the whole TTL on top.
READ_GRACE_S = 10.0


@dataclass(frozen=True)
class ServerLimits:
    """A transfer server's limits. A connection must complete its handshake (HELLO and a
    proven AUTH) within ``handshake_timeout_s``; at most ``max_connections`` connections, of
    which at most ``max_pending_connections`` not yet authenticated (so stalled peers never
    take the slots of authenticated ones) and ``max_connections_per_peer`` from one peer host.
    An authenticated connection without a request for ``idle_timeout_s`` (None: never) is
    closed. ``max_staging_buffers``: staging buffers kept for gathered payloads (0: none).
    ``read_grace_s``: a READ still in flight that long after its lease ended is aborted and
    its connection closed (``READ_GRACE_S``)."""

    handshake_timeout_s: float = 10.0
    idle_timeout_s: float | None = 600.0
    max_connections: int = 512
    # (a generation host of 8 ranks pools up to 8 connections each, besides its streams)
    max_connections_per_peer: int = 128
    max_pending_connections: int = 128
    max_staging_buffers: int = 4
    read_grace_s: float = READ_GRACE_S

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "read_grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0 or None, got {self.idle_timeout_s!r}")
        for name, least in (("max_connections", 1), ("max_connections_per_peer", 1),
                            ("max_pending_connections", 1), ("max_staging_buffers", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


class Admission:
    """The open connections of one server and its caps (loop thread only)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.conns: set[Connection] = set()
        self.per_peer: Counter[str] = Counter()  # open connections per peer host
        self.pending = 0  # open connections that have not authenticated yet
        self.connections_refused = 0  # closed unread: over a connection cap
        self.handshake_timeouts = 0  # dropped: no proven AUTH within handshake_timeout_s
        self.closing = False  # the server is stopping: every new connection is closed
        self._last_refusal_log = float("-inf")

    def admit(self, conn: Connection, host: str) -> bool:
        """Take ``conn`` from ``host`` in, not yet authenticated; False: close it unread (the
        server is stopping, or a cap is reached: counted and logged at most every
        ``REFUSAL_LOG_INTERVAL_S``)."""
        if self.closing:
            return False
        lim = self.limits
        if not (len(self.conns) < lim.max_connections
                and self.pending < lim.max_pending_connections
                and self.per_peer[host] < lim.max_connections_per_peer):
            self.connections_refused += 1
            now = time.monotonic()
            if now - self._last_refusal_log >= REFUSAL_LOG_INTERVAL_S:
                self._last_refusal_log = now
                logger.warning(
                    "kv transfer server: refusing a connection from %s (open: %d of %d, not "
                    "yet authenticated: %d of %d, from this host: %d of %d; %d refused so far)",
                    host, len(self.conns), lim.max_connections, self.pending,
                    lim.max_pending_connections, self.per_peer[host],
                    lim.max_connections_per_peer, self.connections_refused)
            return False
        self.conns.add(conn)
        self.per_peer[host] += 1
        self.pending += 1
        return True

    def authenticated(self) -> None:
        """An admitted connection proved the token: its pending slot is free again."""
        self.pending -= 1

    def leave(self, conn: Connection, host: str, pending: bool) -> None:
        """An admitted connection ended (``pending``: before it authenticated)."""
        if pending:
            self.pending -= 1
        self.per_peer[host] -= 1
        if self.per_peer[host] <= 0:
            del self.per_peer[host]
        self.conns.discard(conn)
