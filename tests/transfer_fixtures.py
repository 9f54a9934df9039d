"""Helpers for the KV transfer tests: the payload a read must return (``expected``, compared
with ``same_bytes``), and for the security and abuse tests raw-socket pieces: length-prefixed
JSON headers by hand, a recording fake server, a recording proxy, the listening sockets of a
port."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest
import torch

from disagg.transfer.ucx import ucx_available

if TYPE_CHECKING:
    from disagg.transfer import ReadRequest

LEN = struct.Struct("!I")

# Every transfer test runs over both backends; UCX skips with the reason when ucxx is absent.
UCX_OK, UCX_WHY = ucx_available()
BACKENDS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not UCX_OK, reason=UCX_WHY))]


def expected(kv: torch.Tensor, req: ReadRequest) -> torch.Tensor:
    """What ``req`` reads from ``kv`` (blocks, layers, 2, heads, block size, head dim): the
    selected blocks' layer and head slices, either as blocks or as one token-major run cut to
    ``num_tokens``."""
    # Ranges: blocks req.block_ids, layers [l0, l1), heads [h0, h1); "tokens" format flattens
    # (block, position in block) into one token axis and keeps the first num_tokens.
    (l0, l1), (h0, h1) = req.layer_slice, req.head_slice
    sel = kv[list(req.block_ids)][:, l0:l1, :, h0:h1]
    if req.format == "blocks":
        return sel.contiguous()
    n, nl, _, nh, b, d = sel.shape
    return sel.permute(1, 2, 3, 0, 4, 5).reshape(nl, 2, nh, n * b, d)[
        :, :, :, :req.num_tokens].contiguous()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same bytes (float comparison would let -0.0 == 0.0 and NaN fail)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return LEN.pack(len(body)) + body


def split_headers(data: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """The complete JSON headers at the start of ``data`` and whatever follows them (payload
    bytes, or a partial header)."""
    out: list[dict[str, Any]] = []
    pos = 0
    while len(data) - pos >= LEN.size:
        (n,) = LEN.unpack_from(data, pos)
        if n > 64 * 1024 or len(data) - pos - LEN.size < n:
            break
        try:
            obj = json.loads(data[pos + LEN.size:pos + LEN.size + n])
        except ValueError:
            break
        if not isinstance(obj, dict):
            break
        out.append(obj)
        pos += LEN.size + n
    return out, data[pos:]


def read_until_eof(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything the peer sends until it closes: (bytes, closed). ``closed`` is False when the
    peer still held the connection open after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, False
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk


def recv_header(sock: socket.socket, timeout_s: float = 5.0) -> dict[str, Any]:
    sock.settimeout(timeout_s)
    buf = b""
    while len(buf) < LEN.size:
        chunk = sock.recv(LEN.size - len(buf))
        if not chunk:
            raise ConnectionError("closed before a header")
        buf += chunk
    (n,) = LEN.unpack(buf)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            raise ConnectionError("closed inside a header")
        body += chunk
    return json.loads(body)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class FakeServer:
    """Listens like a KV transfer server and records every byte clients send. To the first
    header of a connection it answers with a HELLO answer whose proof it cannot know, then
    records until the client hangs up."""

    def __init__(self, backend: str = "tcp") -> None:
        self.backend = backend
        self._lst = socket.socket()
        self._lst.bind(("127.0.0.1", 0))
        self._lst.listen(16)
        self._lst.settimeout(0.1)
        self.address = f"127.0.0.1:{self._lst.getsockname()[1]}"
        self.connections: list[bytearray] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._lst.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            rec = bytearray()
            self.connections.append(rec)
            t = threading.Thread(target=self._serve, args=(conn, rec), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket, rec: bytearray) -> None:
        answered = False
        with conn:
            conn.settimeout(0.1)
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                rec += chunk
                headers, _ = split_headers(bytes(rec))
                if headers and not answered:
                    answered = True
                    conn.sendall(frame({
                        "ok": True, "version": 1, "server_nonce": "ab" * 16,
                        "server_id": "fake", "backend": self.backend, "proof": "0" * 64}))

    def stop(self) -> None:
        self._stop.set()
        self._acceptor.join(5)
        for t in self._threads:
            t.join(5)
        self._lst.close()


class RecordingProxy:
    """A TCP relay in front of ``target`` that keeps what clients sent, per connection."""

    def __init__(self, target: str) -> None:
        self.target = split_address(target)
        self._lst = socket.socket()
        self._lst.bind(("127.0.0.1", 0))
        self._lst.listen(16)
        self._lst.settimeout(0.1)
        self.address = f"127.0.0.1:{self._lst.getsockname()[1]}"
        self.sent: list[bytearray] = []  # client -> server bytes, one entry per connection
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._lst.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(self.target, timeout=5)
            self._socks += [down, up]
            rec = bytearray()
            self.sent.append(rec)
            for src, dst, r in ((down, up, rec), (up, down, None)):
                t = threading.Thread(target=self._pump, args=(src, dst, r), daemon=True)
                t.start()
                self._threads.append(t)

    def _down(self, chunk: bytearray, seen: int) -> bytearray:
        """A server -> client chunk at byte ``seen`` of its connection, as relayed (a
        subclass may change it)."""
        return chunk

    def _pump(self, src: socket.socket, dst: socket.socket, rec: bytearray | None) -> None:
        src.settimeout(0.1)
        seen = 0  # server -> client bytes relayed on this connection
        while not self._stop.is_set():
            try:
                chunk = src.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            if rec is not None:
                rec += chunk
            else:
                chunk = self._down(bytearray(chunk), seen)
                seen += len(chunk)
            try:
                dst.sendall(chunk)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        for s in self._socks:
            s.close()
        self._lst.close()


def _decode_proc_address(hex_addr: str) -> str:
    ip_hex, _ = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6 stores the address as four host-order 32-bit words
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
    return socket.inet_ntop(socket.AF_INET6, b"".join(words))


def listening_addresses(port: int) -> set[str]:
    """Local addresses of every socket listening on TCP ``port`` (this network namespace)."""
    found = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(_decode_proc_address(local))
    return found


class FlippingRelay(RecordingProxy):
    """A ``RecordingProxy`` that flips one bit of the server -> client stream: at byte
    ``flip_at`` of each connection, or (``flip_at`` None) in the middle of the first chunk of
    at least ``min_chunk`` bytes it relays (headers are far smaller: a payload's), ``times``
    times in all."""

    def __init__(self, target: str, flip_at: int | None = None, min_chunk: int = 2048,
                 times: int = 1 << 30) -> None:
        self.flip_at, self.min_chunk, self.times = flip_at, min_chunk, times
        self.flipped = 0
        super().__init__(target)

    def _down(self, chunk: bytearray, seen: int) -> bytearray:
        if self.flip_at is None:
            at = len(chunk) // 2 if len(chunk) >= self.min_chunk else None
        else:
            at = self.flip_at - seen if seen <= self.flip_at < seen + len(chunk) else None
        if at is not None and self.flipped < self.times:
            chunk[at] ^= 0x10
            self.flipped += 1
        return chunk
