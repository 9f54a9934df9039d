"""Raw-socket abuse of the KV transfer port (issues #15, #22 item 6): garbage, a huge length
prefix, a wrong proof, an unknown lease, a slowloris, a flood of 1 MiB length prefixes, too
many connections. For each: nothing but an error header comes back (never payload bytes), the
server stays alive and serves a real client afterwards, stalled peers are dropped within the
handshake timeout, memory stays bounded."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_transfer_service import (
    TOKEN,
    WAIT,
    make_kv,
    no_leaked_threads,  # noqa: F401 (autouse fixture)
    out_for,
)
from transfer_fixtures import (
    BACKENDS,
    UCX_OK,
    UCX_WHY,
    expected,
    frame,
    read_until_eof,
    recv_header,
    same_bytes,
    split_address,
    split_headers,
)

from disagg.transfer import (
    KVTransferClient,
    KVTransferServer,
    LeaseTable,
    ReadRequest,
    ServerLimits,
    TransferError,
)

L, H = 4, 4
HANDSHAKE_S = 0.5  # the servers here drop a peer that has not authenticated within this
SLACK_S = 3.0  # scheduling delay allowed on a busy 2-core host


class Served:
    """A transfer server with short timeouts over a seeded cache, one live lease. (Both
    backends take connections on the same TCP door; UCX carries only payloads.)"""

    def __init__(self, backend: str = "tcp", **limits: Any) -> None:
        self.backend = backend
        self.kv = make_kv(5)
        self.leases = LeaseTable()
        self.leases.create("live", [2, 7, 11], readers=1)
        limits.setdefault("handshake_timeout_s", HANDSHAKE_S)
        self.server = KVTransferServer(self.kv, self.leases, TOKEN, backend,
                                       limits=ServerLimits(**limits)).start()
        self.host, self.port = split_address(self.server.address)

    def connect(self, source: str | None = None) -> socket.socket:
        s = socket.socket()
        if source is not None:
            s.bind((source, 0))
        s.settimeout(5)
        s.connect((self.host, self.port))
        return s

    def real_read_works(self) -> bool:
        req = ReadRequest("live", [2, 7, 11], (0, L), (0, H))
        out = out_for(self.kv, req)
        with KVTransferClient(self.backend, TOKEN, timeout_s=10) as client:
            client.read(self.server.address, req, out).result(WAIT)
        return same_bytes(out, expected(self.kv, req))

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served("tcp")  # the UCX backend's door is the same code: test_ucx_door_* below
    yield s
    s.stop()


def only_error_headers(data: bytes) -> list[dict[str, Any]]:
    """``data`` is nothing but complete headers, none of them a successful READ answer."""
    headers, rest = split_headers(data)
    assert rest == b"", f"{len(rest)} bytes that are not a header: {rest[:64]!r}"
    assert all(h.get("ok") is False or "server_nonce" in h for h in headers), headers
    assert not any("nbytes" in h for h in headers), headers
    return headers


@pytest.mark.parametrize("blob", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # "GET " is a 1.2 GB length prefix
    b"\x00\x00\x00\x05hello",  # a short header that is not JSON
    b"\x00\x00\x00\x02[]",  # JSON, not an object
    b"\xff\xff\xff\xff" + b"x" * 100,  # the largest length prefix
    struct.pack("!I", (1 << 20) - 8) + b"{",  # ~1 MiB announced (the old limit), one byte sent
    struct.pack("!I", 9000) + b"{" * 9000,  # bigger than any header before authentication
    struct.pack("!I", 6000) + b"[" * 6000,  # JSON nested deeper than the parser goes
    os.urandom(64),
], ids=["http", "not-json", "not-object", "huge-prefix", "1mib-prefix", "9k-header", "deep",
        "random"])
def test_garbage_gets_an_error_at_most_and_a_hangup(
    served: Served, blob: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with served.connect() as s:
        s.sendall(blob)
        t0 = time.monotonic()
        data, closed = read_until_eof(s, 5.0)
    assert closed and time.monotonic() - t0 < HANDSHAKE_S + SLACK_S
    headers = only_error_headers(data)
    assert all(h["code"] in ("bad_request", "unauthorized") for h in headers), headers
    assert served.real_read_works()
    # Handled as bad input, not as a server bug (which logs a traceback per connection).
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_wrong_proof_after_hello_gets_unauthorized(served: Served) -> None:
    with served.connect() as s:
        s.sendall(frame({"op": "HELLO", "version": 1, "client_nonce": "a1" * 16}))
        hello = recv_header(s)
        assert hello["ok"] and set(hello) >= {"server_nonce", "server_id", "backend", "proof"}
        s.sendall(frame({"op": "AUTH", "proof": "0" * 64}))
        data, closed = read_until_eof(s, 5.0)
    assert closed
    assert [h["code"] for h in only_error_headers(data)] == ["unauthorized"]
    assert served.real_read_works()


@pytest.mark.parametrize("hello", [
    {"op": "HELLO", "version": 99, "client_nonce": "a1" * 16},
    {"op": "HELLO", "version": 1, "client_nonce": "short"},
    {"op": "HELLO", "version": 1, "client_nonce": ["a1" * 16]},
    {"op": "HELLO", "version": 1},
    {"op": "PING"},
], ids=["version", "short-nonce", "nonce-type", "no-nonce", "no-hello"])
def test_bad_hello_is_refused(served: Served, hello: dict[str, Any]) -> None:
    with served.connect() as s:
        s.sendall(frame(hello))
        data, closed = read_until_eof(s, 5.0)
    assert closed
    headers = only_error_headers(data)
    assert len(headers) == 1 and headers[0]["ok"] is False


def test_unknown_lease_after_a_real_handshake(served: Served) -> None:
    with KVTransferClient(served.backend, TOKEN, timeout_s=10) as client:
        req = ReadRequest("ghost", [1], (0, L), (0, H))
        out = out_for(served.kv, req)
        before = out.clone()
        with pytest.raises(TransferError) as e:
            client.read(served.server.address, req, out).result(WAIT)
        assert e.value.code == "unknown_lease" and e.value.remote
        assert torch.equal(out, before)
        # The same (authenticated) connection goes on serving.
        req = ReadRequest("live", [2, 7, 11], (0, L), (0, H))
        out = out_for(served.kv, req)
        client.read(served.server.address, req, out).result(WAIT)
        assert same_bytes(out, expected(served.kv, req))


@pytest.mark.parametrize("sent", [b"", b"\x00\x00\x00\x64", frame({"op": "HELLO"})[:10]],
                         ids=["silent", "prefix-only", "half-header"])
def test_slowloris_is_dropped_within_the_handshake_timeout(served: Served, sent: bytes) -> None:
    with served.connect() as s:
        s.sendall(sent)
        t0 = time.monotonic()
        data, closed = read_until_eof(s, HANDSHAKE_S + 2 * SLACK_S)
        took = time.monotonic() - t0
    assert closed, "a stalled peer kept its connection"
    assert HANDSHAKE_S * 0.8 <= took < HANDSHAKE_S + SLACK_S
    only_error_headers(data)
    assert served.real_read_works()


def test_hello_then_stall_is_dropped(served: Served) -> None:
    """Half a handshake (HELLO answered, no AUTH) does not hold a connection either."""
    with served.connect() as s:
        s.sendall(frame({"op": "HELLO", "version": 1, "client_nonce": "b2" * 16}))
        assert recv_header(s)["ok"]
        t0 = time.monotonic()
        data, closed = read_until_eof(s, HANDSHAKE_S + 2 * SLACK_S)
    assert closed and time.monotonic() - t0 < HANDSHAKE_S + SLACK_S
    only_error_headers(data)


def test_connection_caps() -> None:
    s = Served(max_connections=6, max_connections_per_peer=3, max_pending_connections=5,
               handshake_timeout_s=30.0)
    socks: list[socket.socket] = []
    try:
        socks = [s.connect("127.0.0.1") for _ in range(3)]  # idle, unauthenticated
        with s.connect("127.0.0.1") as extra:  # a 4th from the same peer: closed unread
            data, closed = read_until_eof(extra, 2 * SLACK_S)
        assert closed and data == b""
        assert s.server.admission.connections_refused == 1
        # Another peer address still gets in (the cap is per peer)...
        socks += [s.connect("127.0.0.2") for _ in range(2)]
        # ...until the pending (not yet authenticated) connections reach their own cap.
        with s.connect("127.0.0.3") as extra:
            data, closed = read_until_eof(extra, 2 * SLACK_S)
        assert closed and data == b""
        assert s.server.admission.connections_refused == 2
        # The stalled ones are still open (their handshake time has not run out)...
        socks[0].settimeout(0.2)
        with pytest.raises(TimeoutError):
            socks[0].recv(1)
        # ...and they block a real client from the same address, not from another one.
        with pytest.raises(TransferError) as e:
            with KVTransferClient("tcp", TOKEN, timeout_s=5) as client:
                client.ping(s.server.address).result(WAIT)
        assert e.value.code == "connection_failed"
        for sock in socks:
            sock.close()
        socks = []
        deadline = time.monotonic() + 5
        while s.server.num_connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.server.num_connections == 0
        assert s.real_read_works()
    finally:
        for sock in socks:
            sock.close()
        s.stop()


def test_idle_authenticated_connection_is_closed_and_client_reconnects() -> None:
    s = Served(idle_timeout_s=0.3)
    try:
        with KVTransferClient("tcp", TOKEN, timeout_s=10) as client:
            assert client.ping(s.server.address).result(WAIT)["ok"]
            assert s.server.num_connections == 1
            deadline = time.monotonic() + 5
            while s.server.num_connections and time.monotonic() < deadline:
                time.sleep(0.02)
            assert s.server.num_connections == 0  # dropped while idle
            # The client's cached connection is stale now: it reconnects transparently.
            req = ReadRequest("live", [2, 7, 11], (0, L), (0, H))
            out = out_for(s.kv, req)
            client.read(s.server.address, req, out).result(WAIT)
            assert same_bytes(out, expected(s.kv, req))
    finally:
        s.stop()


@pytest.mark.skipif(not UCX_OK, reason=UCX_WHY)
def test_ucx_door_refuses_like_tcp() -> None:
    """The UCX backend takes connections on the same bound, capped TCP door: the same abuse
    gets the same answers, and no UCX endpoint exists before AUTH."""
    s = Served("ucx")
    try:
        for blob in (struct.pack("!I", (1 << 20) - 8) + b"{", b"\x00\x00\x00\x05hello"):
            with s.connect() as sock:
                sock.sendall(blob)
                data, closed = read_until_eof(sock, 5.0)
            assert closed
            only_error_headers(data)
        with s.connect() as sock:  # a proper HELLO, then AUTH with a made-up worker address
            sock.sendall(frame({"op": "HELLO", "version": 1, "client_nonce": "c3" * 16}))
            hello = recv_header(sock)
            assert hello["ok"] and hello["backend"] == "ucx" and "ucx_address" not in hello
            sock.sendall(frame({"op": "AUTH", "proof": "0" * 64, "ucx_address": "00" * 64,
                                "ucx_tag": 1}))
            data, closed = read_until_eof(sock, 5.0)
        assert closed and [h["code"] for h in only_error_headers(data)] == ["unauthorized"]
        with s.connect() as sock:  # slowloris
            sock.sendall(b"\x00\x00\x00\x64")
            t0 = time.monotonic()
            data, closed = read_until_eof(sock, HANDSHAKE_S + 2 * SLACK_S)
        assert closed and time.monotonic() - t0 < HANDSHAKE_S + SLACK_S
        assert s.real_read_works()
        with KVTransferClient("ucx", TOKEN, timeout_s=10) as client:
            with pytest.raises(TransferError) as e:
                req = ReadRequest("ghost", [1], (0, L), (0, H))
                client.read(s.server.address, req, out_for(s.kv, req)).result(WAIT)
            assert e.value.code == "unknown_lease"
    finally:
        s.stop()


# ---- memory: a flood of 1 MiB length prefixes ------------------------------------------------


def _server_main(backend: str, limits: dict[str, Any], events: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    kv = make_kv(1)
    leases = LeaseTable()
    server = KVTransferServer(kv, leases, TOKEN, backend, limits=ServerLimits(**limits)).start()
    events.put(server.address)
    stop.wait(120)
    server.stop()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.parametrize("backend", BACKENDS)
def test_length_prefix_flood_costs_no_memory_and_is_closed(backend: str) -> None:
    ctx = mp.get_context("spawn")  # a UCX context must be created after any fork
    events, stop = ctx.Queue(), ctx.Event()
    limits = {"handshake_timeout_s": 2.0, "max_connections": 1000,
              "max_connections_per_peer": 1000, "max_pending_connections": 1000}
    proc = ctx.Process(target=_server_main, args=(backend, limits, events, stop), daemon=True)
    proc.start()
    socks: list[socket.socket] = []
    try:
        address = events.get(timeout=60)
        host, port = split_address(address)
        time.sleep(0.2)
        rss0 = _rss_mib(proc.pid)
        t0 = time.monotonic()
        for _ in range(300):
            c = socket.create_connection((host, port), timeout=5)
            c.sendall(struct.pack("!I", (1 << 20) - 8) + b"{")
            socks.append(c)
        peak = rss0
        open_socks = list(socks)
        deadline = t0 + limits["handshake_timeout_s"] + 3 * SLACK_S
        while open_socks and time.monotonic() < deadline:
            peak = max(peak, _rss_mib(proc.pid))
            still = []
            for c in open_socks:
                c.settimeout(0.001)
                try:
                    if c.recv(1 << 16):
                        still.append(c)  # an error header; EOF comes next
                except TimeoutError:
                    still.append(c)
                except ConnectionResetError:
                    pass
            open_socks = still
        peak = max(peak, _rss_mib(proc.pid))
        print(f"{backend}: server RSS {rss0:.1f} -> peak {peak:.1f} MiB, 300 connections closed "
              f"after {time.monotonic() - t0:.2f} s")
        assert peak - rss0 < 30, f"server RSS grew {peak - rss0:.0f} MiB ({rss0:.0f} -> {peak:.0f})"
        assert not open_socks, f"{len(open_socks)} of 300 connections still open"
        assert proc.is_alive()
    finally:
        for c in socks:
            c.close()
        stop.set()
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
