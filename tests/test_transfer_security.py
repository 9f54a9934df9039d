"""The KV transfer wire never carries the cluster token: a mutual challenge-response (issue #15).

- a fake server (or a UCX peer that is not a disagg server) learns nothing: the client sends it
  a HELLO and nothing else, never the token or a piece of it;
- bytes captured from a real client's connection are worthless on another connection;
- a client with the wrong token gets no data;
- the listening socket is bound to the configured host, for both backends (UCX used to listen
  on every interface).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch
from test_transfer_service import (
    TOKEN,
    WAIT,
    Rig,
    make_kv,
    no_leaked_threads,  # noqa: F401 (autouse fixture)
    out_for,
)
from transfer_fixtures import (
    BACKENDS,
    UCX_OK,
    UCX_WHY,
    FakeServer,
    RecordingProxy,
    expected,
    frame,
    listening_addresses,
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
    TransferError,
)

SECRET = "Xq7-cluster-token-that-must-stay-home-93kd"
L, H = 4, 4


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def leaked_pieces(data: bytes, secret: str, n: int = 8) -> list[str]:
    """Substrings of ``secret`` of ``n`` characters found in ``data``, raw or hex-encoded."""
    hexed = data.hex()
    return [secret[i:i + n] for i in range(len(secret) - n + 1)
            if secret[i:i + n].encode() in data or secret[i:i + n].encode().hex() in hexed]


def test_token_never_reaches_a_fake_server(backend: str) -> None:
    fake = FakeServer(backend)
    client = KVTransferClient(backend, SECRET, timeout_s=5.0, connect_timeout_s=2.0)
    req = ReadRequest("lease-1", [1, 2], (0, L), (0, H))
    out = torch.full((2, L, 2, H, 8, 16), -1.0)
    try:
        calls = [
            lambda: client.read(fake.address, req, out),
            lambda: client.release(fake.address, "lease-1", "reader-0"),
            lambda: client.ping(fake.address),
        ]
        for call in calls:
            with pytest.raises(TransferError) as e:
                call().result(WAIT)
            assert e.value.code == "unauthorized", e.value
            assert "prove" in e.value.message
    finally:
        client.close()
        fake.stop()
    assert (out == -1.0).all()
    assert len(fake.connections) == 3  # one connection per call (each failed handshake drops it)
    for rec in fake.connections:
        data = bytes(rec)
        assert leaked_pieces(data, SECRET) == []
        headers, rest = split_headers(data)
        # It refused to go on: a HELLO and nothing else, not a READ / RELEASE / PING.
        assert rest == b"" and len(headers) == 1, headers
        assert headers[0]["op"] == "HELLO"
        assert set(headers[0]) == {"op", "version", "client_nonce"}


@pytest.mark.skipif(not UCX_OK, reason=UCX_WHY)
def test_ucx_peer_that_is_not_a_server_learns_nothing() -> None:
    """A plain ucxx listener that records every message sent to it: the UCX client never
    talks UCX to a peer that has not proven the token (it used to send the token there)."""
    import asyncio

    import numpy as np

    from disagg.transfer.ucx import UcxBackend

    ucx_backend = UcxBackend()
    loop = ucx_backend.acquire_loop("test")
    received: list[bytes] = []
    listener = None
    client = KVTransferClient(ucx_backend, SECRET, timeout_s=3.0, connect_timeout_s=2.0)
    try:
        import ucxx

        async def record(ep: object) -> None:
            buf = np.zeros(1 << 16, dtype=np.uint8)
            try:
                while True:
                    await ep.recv(buf)  # type: ignore[attr-defined]
                    received.append(buf.tobytes().rstrip(b"\0"))
            except Exception:
                return

        async def start() -> object:
            return ucxx.create_listener(record, 0)

        listener = loop.run(start())
        address = f"127.0.0.1:{listener.port}"  # type: ignore[attr-defined]
        with pytest.raises(TransferError) as e:
            client.ping(address).result(WAIT)
        assert e.value.code in ("connection_failed", "timeout", "protocol_error", "unauthorized")
        time.sleep(0.2)
        assert received == []
    finally:
        client.close()
        if listener is not None:
            async def close() -> None:
                listener.close()  # type: ignore[attr-defined]
                await asyncio.sleep(0)
            loop.run(close())
        ucx_backend.release_loop(loop)


def test_replayed_connection_bytes_get_no_payload(backend: str) -> None:
    rig = Rig(backend)
    proxy = RecordingProxy(rig.address)
    try:
        ids = [3, 9, 4]
        rig.leases.create("a", ids, readers=2)
        req = ReadRequest("a", ids, (0, L), (0, H))
        out = out_for(rig.kv, req)
        rig.client.read(proxy.address, req, out).result(WAIT)  # through the proxy
        assert same_bytes(out, expected(rig.kv, req))
        rig.client.close()  # the connection through the proxy ends: proxy.sent is complete
        transfers = rig.server.stats.snapshot().transfers
        assert len(proxy.sent) == 1
        captured = bytes(proxy.sent[0])
        assert leaked_pieces(captured, TOKEN) == []
        # Replay everything the real client sent, on a fresh connection to the real server.
        with socket.create_connection(split_address(rig.address), timeout=5) as s:
            s.sendall(captured)
            data, closed = read_until_eof(s, 5.0)
        assert closed  # the server hung up
        headers, rest = split_headers(data)
        assert rest == b"", f"{len(rest)} bytes beyond the headers (payload?)"
        assert not any("nbytes" in h for h in headers), headers  # no READ was answered
        assert headers and headers[-1].get("code") == "unauthorized", headers
        assert rig.server.stats.snapshot().transfers == transfers
        assert "a" in rig.leases
    finally:
        proxy.stop()
        rig.close()


def test_wrong_token_client_gets_unauthorized_and_no_data(backend: str) -> None:
    rig = Rig(backend)
    try:
        rig.leases.create("a", [1, 2], readers=1)
        req = ReadRequest("a", [1, 2], (0, L), (0, H))
        out = out_for(rig.kv, req)
        before = out.clone()
        bad = KVTransferClient(backend, "wrong-token", timeout_s=5)
        try:
            for call in (lambda: bad.read(rig.address, req, out),
                         lambda: bad.release(rig.address, "a", "r"),
                         lambda: bad.ping(rig.address)):
                with pytest.raises(TransferError) as e:
                    call().result(WAIT)
                assert e.value.code == "unauthorized"
        finally:
            bad.close()
        assert torch.equal(out, before)
        assert rig.server.stats.snapshot().bytes_transferred == 0
        assert "a" in rig.leases and rig.released == []  # the bad RELEASE changed nothing
        rig.read(req)  # the lease is intact for the real reader
    finally:
        rig.close()


def test_raw_request_with_wrong_proof_is_refused() -> None:
    """A peer that completes the HELLO but cannot sign: unauthorized, hang-up, no payload —
    whether it sends a READ with a token (the old protocol) or a request with a made-up
    proof."""
    rig = Rig("tcp")
    try:
        rig.leases.create("a", [1], readers=1)
        nbytes = 4 * L * 2 * H * 8 * 16
        read = {"op": "READ", "lease_id": "a", "block_ids": [1], "layer_slice": [0, L],
                "head_slice": [0, H], "num_tokens": 0, "format": "blocks", "dtype": "float32",
                "nbytes": nbytes}
        for second in ({**read, "token": TOKEN}, {"op": "AUTH", "proof": "f" * 64},
                       {**read, "proof": "0" * 64}):
            with socket.create_connection(split_address(rig.address), timeout=5) as s:
                s.sendall(frame({"op": "HELLO", "version": 1, "client_nonce": "12" * 16}))
                hello = recv_header(s)
                assert hello["ok"] and len(hello["server_nonce"]) == 32 and hello["proof"]
                s.sendall(frame(second))
                data, closed = read_until_eof(s, 5.0)
            headers, rest = split_headers(data)
            assert closed and rest == b""
            assert [h.get("code") for h in headers] == ["unauthorized"]
        assert rig.server.stats.snapshot().bytes_transferred == 0
        assert rig.server.stats.snapshot().failures_by_code == (("unauthorized", 3),)
    finally:
        rig.close()


def test_handshake_sessions() -> None:
    """The proofs themselves: bound to both nonces, the sequence number and the header."""
    from disagg.transfer.handshake import ClientSession, HandshakeError, ServerSession

    def pair(client_token: str = SECRET) -> tuple[ClientSession, ServerSession]:
        c, s = ClientSession(client_token), ServerSession(SECRET, "srv", "tcp")
        answer = s.answer_hello(c.hello())
        assert SECRET not in str(answer)
        c.accept(answer)
        return c, s

    c, s = pair()
    read = {"op": "READ", "lease_id": "a", "block_ids": [1, 2]}
    first = c.sign(read)
    assert s.verify(first)
    assert not s.verify(first)  # the same request again: the sequence number moved on
    c2, s2 = pair()
    assert not s2.verify(first)  # another connection: other nonces
    assert not s2.verify({**c2.sign(read), "block_ids": [1, 3]})  # tampered after signing
    c3, s3 = pair()
    assert s3.verify(c3.sign({"b": 1, "a": [2]}))  # key order does not matter
    with pytest.raises(HandshakeError) as e:
        pair("another-token")  # the client rejects the server's proof
    assert e.value.code == "unauthorized"
    with pytest.raises(HandshakeError) as e:
        ClientSession(SECRET).accept({**ServerSession(SECRET, "x", "tcp").answer_hello(
            ClientSession(SECRET).hello())})  # a proof made for another client nonce
    assert e.value.code == "unauthorized"


# ---- where the server listens ----------------------------------------------------------------


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture
def servers() -> Iterator[list[KVTransferServer]]:
    started: list[KVTransferServer] = []
    yield started
    for s in started:
        s.stop()


def test_listener_binds_the_configured_host(backend: str, servers: list[KVTransferServer]
                                            ) -> None:
    kv = make_kv(3)
    leases = LeaseTable()
    leases.create("a", [5, 6], readers=1)
    a = KVTransferServer(kv, leases, TOKEN, backend, host="127.0.0.1").start()
    servers.append(a)
    port = int(a.address.rsplit(":", 1)[1])
    assert listening_addresses(port) == {"127.0.0.1"}  # not 0.0.0.0 / ::
    assert _refused("127.0.0.2", port)  # another address of this host reaches nothing

    b = KVTransferServer(kv, leases, TOKEN, backend, host="127.0.0.2").start()
    servers.append(b)
    port_b = int(b.address.rsplit(":", 1)[1])
    assert b.address == f"127.0.0.2:{port_b}"
    assert listening_addresses(port_b) == {"127.0.0.2"}
    assert _refused("127.0.0.1", port_b)
    with KVTransferClient(backend, TOKEN, timeout_s=10) as client:
        req = ReadRequest("a", [5, 6], (0, L), (0, H))
        out = out_for(kv, req)
        client.read(b.address, req, out).result(WAIT)
        assert same_bytes(out, expected(kv, req))
