"""The router's lean HTTP/1.1 client of its workers (an asyncio Protocol + httptools' parser).

The hot path (an OpenAI request relayed to a worker) needs little of a general client: POST
with a body, keep-alive connections to a few hosts, the status and Content-Type, and the body
as it comes, passed on as bytes. aiohttp's client spent ~24% of the router's CPU on it
(``bench/results/router.md``'s profile); this one does the same in a few calls a request:

- ``Pool.post``: one request on an idle keep-alive connection to the host (the most recently
  used first) or a new one; the request head is one ``bytes`` join, its fixed headers
  prepared once by the caller (``head``);
- ``Response``: the answer's status and Content-Type once its head arrived, then ``read()``
  (the whole body) or ``iter_any()`` (body bytes as they arrive, chunked encoding removed);
  ``close()`` returns a fully read connection to the pool and aborts any other (the worker
  sees the disconnect and aborts the request: a client that went away frees its KV).

Errors: ``ConnectError`` (never connected: the worker saw nothing), ``StaleConnection`` (a
pooled connection the worker had closed before any byte of the answer: it never saw the
request, so the caller sends it again on a new connection), ``UpstreamError`` (reset, cut
mid-answer, malformed answer) and ``asyncio.TimeoutError`` (no byte for ``read_timeout_s``).
A connection idle for ``keep_alive_s`` is not reused (closed when next looked at), so the
router never sends on a connection the worker is about to close (its keep-alive is longer).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from typing import Any

import httptools

# Body bytes buffered from a worker before reading from it pauses (the client reads slower
# than the worker writes); reading resumes once the relay took them.
HIGH_WATER_BYTES = 1 << 20


class UpstreamError(Exception):
    """The connection failed (reset, closed mid-answer, malformed answer)."""


class ConnectError(UpstreamError):
    """Could not connect: the worker saw nothing of the request."""


class StaleConnection(UpstreamError):
    """A reused keep-alive connection closed before any byte of the answer."""


class Response:
    """A worker's answer: its head is in once ``Pool.post`` returns; its body follows."""

    __slots__ = ("status", "content_type", "retry_after", "_conn", "_chunks", "_buffered",
                 "_done", "_error", "_waiter")

    def __init__(self, conn: _Conn) -> None:
        self.status = 0
        self.content_type = ""
        self.retry_after = ""  # its Retry-After header ("": none), passed on to the client
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False  # the whole body arrived
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection ------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER_BYTES:
            self._conn.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if not self._done and self._error is None:
            if error is None:
                self._done = True
            else:
                self._error = error
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- read by the router ---------------------------------------------------------------------

    async def _wait(self) -> None:
        """Until more body bytes, its end or an error arrive (TimeoutError after the read
        timeout without any)."""
        conn = self._conn
        self._waiter = fut = conn.loop.create_future()
        conn.watch()
        try:
            await fut
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        data = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks.clear()
        if self._buffered > HIGH_WATER_BYTES:
            self._conn.resume()
        self._buffered = 0
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (each item all that had arrived)."""
        while True:
            if self._chunks:
                yield self._take()
                continue
            if self._error is not None:
                raise self._error
            if self._done:
                return
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        while not self._done:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._take()

    def close(self) -> None:
        """Give the connection back when the answer was read whole; else abort it."""
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self._done and conn.keep_alive:
            conn.release()
        else:
            conn.abort()

    release = close


def _expire(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_exception(asyncio.TimeoutError("no answer from the worker within the read "
                                               "timeout"))


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a worker: at most one request at a time."""

    def __init__(self, pool: Pool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.head_waiter: asyncio.Future[None] | None = None
        self.got_bytes = False  # any byte of the current answer arrived
        self.used = False  # carried a request before this one
        self.keep_alive = False
        self.closed = False
        self.idle_since = 0.0
        self.paused = False
        self._content_type = b""
        self._framed = False  # Content-Length or chunked: not ended by the connection's close
        # The read timeout: one timer a connection, moved on lazily (a timer per wait cost ~6%
        # of the router's time): it fires at the latest wait's start or last byte + timeout.
        self._timer: asyncio.TimerHandle | None = None
        self._progress = 0.0  # when the latest wait started or a byte came (loop time)

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # aborted: the rest is not read
            return
        self.got_bytes = True
        if self._timer is not None:
            self._progress = self.loop.time()
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed answer: {e}"))
            self.abort()

    def eof_received(self) -> bool:
        resp = self.resp
        if resp is not None and resp.status and not self._framed and not resp._done:
            resp._finish()  # a body that ends with the connection
            self.keep_alive = False
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        self._unlink()
        why = f"connection lost: {exc}" if exc else "the worker closed the connection"
        self._fail(StaleConnection(why) if self.used and not self.got_bytes
                   else UpstreamError(why))

    # -- httptools callbacks --------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-type":
            self._content_type = value
        elif n == b"content-length" or n == b"transfer-encoding":
            self._framed = True
        elif n == b"retry-after" and self.resp is not None:
            self.resp.retry_after = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        resp.status = self.parser.get_status_code()
        resp.content_type = (self._content_type.split(b";", 1)[0].strip().lower()
                             .decode("latin-1"))
        w = self.head_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.resp is not None:
            self.resp._finish()

    # -- the pool's side ------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        w = self.head_waiter
        if w is not None and not w.done():
            w.set_exception(error)
        if self.resp is not None:
            self.resp._finish(error)

    def send(self, data: bytes) -> Response:
        self.resp = resp = Response(self)
        self.got_bytes = False
        self._content_type = b""
        self._framed = False
        self.head_waiter = self.loop.create_future()
        assert self.transport is not None
        self.transport.write(data)
        return resp

    def watch(self) -> None:
        """A wait starts: the read timeout counts from now (and from each byte that comes)."""
        self._progress = now = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(now + self.pool.read_timeout_s, self._check)

    def _check(self) -> None:
        """The read timer: expire the waits that got no byte for the read timeout."""
        self._timer = None
        resp = self.resp
        waiting = ((self.head_waiter is not None and not self.head_waiter.done())
                   or (resp is not None and resp._waiter is not None))
        if not waiting or self.closed:
            return
        due = self._progress + self.pool.read_timeout_s
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._check)
            return
        _expire(self.head_waiter)
        if resp is not None:
            _expire(resp._waiter)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def release(self) -> None:
        self.resp = None
        self.head_waiter = None
        self.resume()
        if self.closed or not self.keep_alive:
            self.abort()
            return
        self.used = True
        self.idle_since = time.monotonic()
        self.pool._idle(self)

    def abort(self) -> None:
        self.resp = None
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()
        self._unlink()

    def _unlink(self) -> None:
        """A connection that ended lets go of what holds it: its read timer (held by the loop
        until it fires), its parser (this protocol's bound methods) and transport. The last two
        were reference cycles that kept every ended connection (transport, answer, futures)
        alive until the next cycle collection, which the router runs rarely (``cli.tune_gc``)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.parser = None  # type: ignore[assignment]  # data_received checks
        self.transport = None


class Pool:
    """Keep-alive connections to the workers, any number per host (a long stream must not
    starve the others of connections)."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float,
                 keep_alive_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keep_alive_s = keep_alive_s
        self._idle_conns: dict[tuple[str, int], list[_Conn]] = {}
        self._all: set[_Conn] = set()

    async def post(self, host: str, port: int, head: bytes, body: bytes, *,
                   fresh: bool = False) -> Response:
        """Send ``head`` (the request line and headers up to, not including, the blank line
        that ends them: Content-Length is added here) and ``body``; returns once the answer's
        head arrived. ``fresh``: on a new connection."""
        key = (host, port)
        conn = None if fresh else self._take_idle(key)
        if conn is None:
            conn = await self._connect(key)
        resp = conn.send(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
        fut = conn.head_waiter
        assert fut is not None
        try:  # until the answer's head arrived (TimeoutError after the read timeout)
            if not fut.done():
                conn.watch()
                await fut
            fut.result()
        except BaseException:  # failed, timed out or cancelled: the connection is done
            conn.abort()
            raise
        return resp

    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle_conns.get(key)
        deadline = time.monotonic() - self.keep_alive_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > deadline:
                return conn
            conn.abort()  # idle too long (the worker may be closing it) or gone
        return None

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        made: list[_Conn] = []

        def protocol() -> _Conn:
            made.append(_Conn(self, key))
            return made[-1]

        try:
            _, conn = await asyncio.wait_for(self.loop.create_connection(protocol, *key),
                                             self.connect_timeout_s)
        except BaseException as e:
            # Cancelled once connected (the client left): uvloop closes the socket without
            # calling connection_lost, so the protocol is ended here.
            for c in made:
                c.abort()
            if isinstance(e, (OSError, asyncio.TimeoutError)):
                raise ConnectError(f"cannot connect to {key[0]}:{key[1]}: "
                                   f"{type(e).__name__}: {e}") from None
            raise
        self._all.add(conn)
        return conn

    def _idle(self, conn: _Conn) -> None:
        self._idle_conns.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)
        idle = self._idle_conns.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self, host: str, port: int) -> int:
        """Idle keep-alive connections to ``host:port`` (tests, ``/cluster_info``)."""
        return len(self._idle_conns.get((host, port), ()))

    def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._all.clear()
        self._idle_conns.clear()


def request_head(method: str, authority: str, path: str, headers: dict[str, str] | Any
                 ) -> bytes:
    """A request's line and headers (the last ends with CRLF), for ``Pool.post``;
    ``authority``: the Host header (``host:port``, an IPv6 host in brackets)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {authority}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")
