"""TCP backend: asyncio on raw non-blocking sockets.

``loop.sock_sendall`` straight from the KV cache / staging memory and ``loop.sock_recv_into``
straight into the caller's preallocated buffer: ~2.5 GB/s on loopback here, where asyncio
streams (``readexactly``, a copy per chunk) manage ~0.3 GB/s (UCX-NOTES). Each server and each
client gets its own loop thread.

The UCX backend uses the same listening socket and connections for its headers
(``tcp_listen`` / ``tcp_connect``): one bound, capped, authenticated door for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from disagg.transfer.base import (
    HEADER_MAX_BYTES,
    HEADER_PREFIX_BYTES,
    Connection,
    ConnectionClosedError,
    ConnectionHandler,
    Listener,
    LoopThread,
    TransportBackend,
    decode_header,
    encode_header,
    header_length,
)

logger = logging.getLogger("disagg.transfer")


def _iov_max() -> int:
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        n = -1
    return n if n > 0 else 1024  # Linux: 1024


IOV_MAX = _iov_max()


class IovCursor:
    """Where a ``sendmsg`` / ``recvmsg_into`` over many buffers stands: the next batch is at
    most ``max_iov`` buffers from the current position, the first one cut at the offset
    already done::

        views:   |--- v0 ---|--- v1 ---|--- v2 ---| ... |--- vk ---|
        done:    [=========[====)                      (index 1, offset 5 of v1)
        batch(): [v1[5:], v2, ..., v(1 + max_iov - 1)]
    """

    def __init__(self, views: Sequence[Any], max_iov: int | None = None) -> None:
        max_iov = IOV_MAX if max_iov is None else max_iov
        if max_iov < 1:
            raise ValueError(f"max_iov must be >= 1, got {max_iov}")
        self._views = [mv for mv in (memoryview(v).cast("B") for v in views) if mv.nbytes]
        self._max = max_iov
        self._index = 0
        self._offset = 0
        self.total = sum(v.nbytes for v in self._views)
        self.position = 0

    @property
    def done(self) -> bool:
        return self._index >= len(self._views)

    def batch(self) -> list[memoryview]:
        i = self._index
        return [self._views[i][self._offset:], *self._views[i + 1:i + self._max]]

    def advance(self, n: int) -> None:
        """``n`` more bytes were moved (what the last call returned)."""
        self.position += n
        while n:
            left = self._views[self._index].nbytes - self._offset
            if n < left:
                self._offset += n
                return
            n -= left
            self._index += 1
            self._offset = 0


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Headers are tiny request/answer pairs: do not let Nagle hold them back.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpConnection(Connection):
    def __init__(self, sock: socket.socket, peer: str, peer_host: str = "") -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self.peer = peer
        self._peer_host = peer_host
        self._prefix = bytearray(HEADER_PREFIX_BYTES)
        self._watch: asyncio.Future[bool] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peer_host(self) -> str:
        return self._peer_host

    async def _recv_exact(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        while pos < n:
            try:
                got = await self._loop.sock_recv_into(self._sock, view[pos:])
            except OSError as e:
                raise ConnectionClosedError(f"{self.peer}: {e}") from e
            if got == 0:
                raise ConnectionClosedError(f"{self.peer}: connection closed by peer "
                                            f"({pos}/{n} bytes received)")
            pos += got

    async def _send(self, data: bytes | memoryview) -> None:
        if self._closed:
            raise ConnectionClosedError(f"{self.peer}: connection closed")
        try:
            await self._loop.sock_sendall(self._sock, data)
        except OSError as e:
            raise ConnectionClosedError(f"{self.peer}: {e}") from e

    async def send_header(self, obj: Mapping[str, Any]) -> None:
        await self._send(encode_header(obj))

    async def send_encoded(self, data: bytes) -> None:
        await self._send(data)

    async def recv_header(self, max_bytes: int = HEADER_MAX_BYTES) -> dict[str, Any]:
        if self._closed:
            raise ConnectionClosedError(f"{self.peer}: connection closed")
        await self._recv_exact(memoryview(self._prefix))
        body = bytearray(header_length(self._prefix, max_bytes))  # bounded before allocating
        await self._recv_exact(memoryview(body))
        return decode_header(body)

    def watch_peer_close(self) -> asyncio.Future[bool]:
        """A future that resolves when the socket turns readable while no header is being
        read: True when the peer closed (EOF or reset), False when it sent bytes (it is alive;
        they stay unread). Call ``stop_watching()`` before the next read of this connection.
        (UCX payloads travel beside this socket: its EOF is how a dead peer is noticed.)"""
        self.stop_watching()
        fut: asyncio.Future[bool] = self._loop.create_future()
        if self._closed:
            fut.set_result(True)
            return fut
        fd = self._sock.fileno()

        def readable() -> None:
            try:
                data = self._sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            self._loop.remove_reader(fd)  # level-triggered: once is enough
            if not fut.done():
                fut.set_result(not data)

        self._loop.add_reader(fd, readable)
        self._watch = fut
        return fut

    def peer_closed(self) -> bool:
        """Whether the peer has closed (EOF or reset already here), asked without waiting:
        False while it is open, whether or not it sent bytes (they stay unread)."""
        if self._closed:
            return True
        try:
            return not self._sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def stop_watching(self) -> None:
        """Synchronously: a later ``sock_recv_into`` registers its own reader on this fd."""
        fut, self._watch = self._watch, None
        if fut is None:
            return
        fut.cancel()
        if not self._closed:
            with contextlib.suppress(OSError, ValueError):
                self._loop.remove_reader(self._sock.fileno())

    async def send_payload(self, data: np.ndarray) -> None:
        await self._send(memoryview(data).cast("B"))

    async def recv_payload_into(self, out: np.ndarray) -> None:
        if self._closed:
            raise ConnectionClosedError(f"{self.peer}: connection closed")
        await self._recv_exact(memoryview(out).cast("B"))

    async def send_payload_iov(self, views: Sequence[np.ndarray]) -> None:
        """``sendmsg`` over the views, at most ``IOV_MAX`` of them per call: runs of KV
        blocks go out straight from the cache, no gather."""
        cursor = IovCursor(views)
        while not cursor.done:
            if self._closed:
                raise ConnectionClosedError(f"{self.peer}: connection closed")
            try:
                n = self._sock.sendmsg(cursor.batch())
            except (BlockingIOError, InterruptedError):
                await self._ready(self._loop.add_writer, self._loop.remove_writer)
                continue
            except OSError as e:
                raise ConnectionClosedError(f"{self.peer}: {e}") from e
            cursor.advance(n)

    async def recv_payload_iov(self, views: Sequence[np.ndarray]) -> None:
        """``recvmsg_into`` across the views (e.g. runs of the request's own KV blocks)."""
        cursor = IovCursor(views)
        while not cursor.done:
            if self._closed:
                raise ConnectionClosedError(f"{self.peer}: connection closed")
            try:
                n = self._sock.recvmsg_into(cursor.batch())[0]
            except (BlockingIOError, InterruptedError):
                await self._ready(self._loop.add_reader, self._loop.remove_reader)
                continue
            except OSError as e:
                raise ConnectionClosedError(f"{self.peer}: {e}") from e
            if n == 0:
                raise ConnectionClosedError(f"{self.peer}: connection closed by peer "
                                            f"({cursor.position}/{cursor.total} bytes "
                                            f"received)")
            cursor.advance(n)

    async def _ready(self, add: Callable[..., Any], remove: Callable[[int], Any]) -> None:
        """Until the socket is writable (``add_writer``) or readable (``add_reader``)."""
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self._sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        add(fd, ready)
        try:
            await fut
        finally:
            if not self._closed:
                with contextlib.suppress(OSError, ValueError):
                    remove(fd)

    async def close(self) -> None:
        if not self._closed:
            self.stop_watching()  # unregister before the fd number can be reused
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.close()


class TcpListener(Listener):
    def __init__(self, sock: socket.socket, task: asyncio.Task[None]) -> None:
        self._sock = sock
        self._task = task
        self._port = sock.getsockname()[1]

    @property
    def port(self) -> int:
        return self._port

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(OSError):
            self._sock.close()


async def tcp_listen(host: str, port: int, handler: ConnectionHandler,
                     wrap: Callable[[TcpConnection], Connection] = lambda c: c) -> TcpListener:
    """A listening socket bound to ``host`` (an address or a name; ``0.0.0.0`` / ``::`` for
    every interface) and ``port`` (0: any free port); ``handler(wrap(conn))`` runs as a task
    per accepted connection."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = info[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A restarted server must be able to take its port back at once (TIME_WAIT).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(512)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    loop = asyncio.get_running_loop()
    task = loop.create_task(_accept_loop(sock, handler, wrap))
    return TcpListener(sock, task)


async def _accept_loop(sock: socket.socket, handler: ConnectionHandler,
                       wrap: Callable[[TcpConnection], Connection]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn_sock, addr = await loop.sock_accept(sock)
        except OSError as e:  # e.g. EMFILE: back off instead of spinning
            logger.warning("kv transfer accept failed: %s", e)
            await asyncio.sleep(0.1)
            continue
        _tune(conn_sock)
        conn = TcpConnection(conn_sock, f"{addr[0]}:{addr[1]}", peer_host=str(addr[0]))
        loop.create_task(handler(wrap(conn)))


async def tcp_connect(host: str, port: int, timeout_s: float) -> TcpConnection:
    """Raises ``ConnectionClosedError`` when ``host:port`` cannot be reached."""
    loop = asyncio.get_running_loop()
    try:
        info = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConnectionClosedError(f"{host}:{port}: {e}") from e
    family, _, _, _, addr = info[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, addr), timeout_s)
    except (OSError, asyncio.TimeoutError) as e:
        sock.close()
        raise ConnectionClosedError(f"{host}:{port}: connect failed: {e!r}") from e
    except BaseException:
        sock.close()
        raise
    _tune(sock)
    return TcpConnection(sock, f"{host}:{port}", peer_host=str(addr[0]))


class TcpBackend(TransportBackend):
    name: ClassVar[str] = "tcp"

    def acquire_loop(self, role: str) -> LoopThread:
        return LoopThread(f"kv-transfer-tcp-{role}")

    def release_loop(self, loop_thread: LoopThread) -> None:
        loop_thread.stop()

    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> Listener:
        return await tcp_listen(host, port, handler)

    async def connect(self, host: str, port: int, timeout_s: float) -> Connection:
        return await tcp_connect(host, port, timeout_s)
