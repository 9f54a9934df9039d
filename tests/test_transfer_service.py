"""KVTransferServer + KVTransferClient in one process (threads), over TCP and UCX.

UCX cases skip with the reason when ucxx cannot be imported."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from transfer_fixtures import BACKENDS, expected, same_bytes

from disagg.transfer import (
    KVTransferClient,
    KVTransferServer,
    LeaseTable,
    ReadRequest,
    TransferError,
)
from disagg.transfer.base import ConnectionClosedError
from disagg.transfer.payload import payload_shape

N, L, H, B, D = 24, 4, 4, 8, 16
TOKEN = "cluster-secret"
WAIT = 10.0  # seconds: every future in these tests resolves far sooner



def make_kv(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, L, 2, H, B, D, generator=g).to(dtype)


def eventually(cond: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    """Server-side counters are recorded just after the last byte leaves, which can be a
    moment after the client's future resolved."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def out_for(kv: torch.Tensor, req: ReadRequest, fill: float = -7.0) -> torch.Tensor:
    return torch.full(payload_shape(tuple(kv.shape), req), fill, dtype=kv.dtype)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Rig:
    """A server over a seeded cache, a lease table with a fake clock, a client."""

    def __init__(self, backend: str, dtype: torch.dtype = torch.float32, seed: int = 1,
                 port: int = 0, timeout_s: float = 5.0, connect_timeout_s: float = 5.0) -> None:
        self.backend = backend
        self.clock = FakeClock()
        self.released: list[tuple[str, str]] = []
        self.leases = LeaseTable(
            default_ttl_s=30.0, clock=self.clock,
            on_release=lambda lease, reason: self.released.append((lease.lease_id, reason)))
        self.kv = make_kv(seed, dtype)
        self.server = KVTransferServer(self.kv, self.leases, TOKEN, backend, port=port).start()
        self.client = KVTransferClient(backend, TOKEN, timeout_s=timeout_s,
                                       connect_timeout_s=connect_timeout_s)

    @property
    def address(self) -> str:
        return self.server.address

    def read(self, req: ReadRequest, out: torch.Tensor | None = None) -> torch.Tensor:
        out = out_for(self.kv, req) if out is None else out
        self.last = self.client.read(self.address, req, out).result(WAIT)
        return out

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if t.name.startswith("kv-transfer")]
        if not left:
            return
        time.sleep(0.05)
    pytest.fail(f"threads left running: {left}")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def rig(backend: str) -> Iterator[Rig]:
    r = Rig(backend)
    yield r
    r.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_and_tokens_byte_identical(backend: str, dtype: torch.dtype) -> None:
    r = Rig(backend, dtype=dtype)
    try:
        ids = [17, 3, 4, 9, 0, 22]  # non-consecutive, out of order
        r.leases.create("req-1", ids, readers=1)
        cases = [
            ReadRequest("req-1", ids, (1, 3), (2, 4)),  # partial layers and heads
            ReadRequest("req-1", ids[1:3], (0, L), (1, 2)),
            ReadRequest("req-1", ids, (0, L), (0, H), num_tokens=5 * B + 3, format="tokens"),
            ReadRequest("req-1", ids[:4], (2, 4), (0, 1), num_tokens=4 * B, format="tokens"),
        ]
        for req in cases:
            out = r.read(req)
            assert same_bytes(out, expected(r.kv, req)), req
            assert not r.last.zero_copy and r.last.nbytes == out.numel() * out.element_size()
        assert eventually(lambda: r.server.stats.snapshot().transfers == len(cases))
        snap = r.server.stats.snapshot()
        assert snap.failed_transfers == 0
        assert snap.blocks_transferred == 6 + 2 + 6 + 4
        assert r.client.stats.snapshot().bytes_transferred == snap.bytes_transferred
    finally:
        r.close()


def test_zero_copy_and_staging_reuse(rig: Rig) -> None:
    rig.leases.create("run", list(range(5, 13)), readers=1)
    full = ReadRequest("run", list(range(5, 13)), (0, L), (0, H))
    out = rig.read(full)
    assert rig.last.zero_copy and same_bytes(out, rig.kv[5:13])
    assert rig.server.payload.staging.allocations == 0  # sent straight from the cache
    # Gathers reuse one staging buffer: no allocation per request in steady state.
    part = ReadRequest("run", [12, 5, 6], (0, L), (1, 3))
    out = out_for(rig.kv, part)
    for _ in range(4):
        out.fill_(0)
        rig.read(part, out)
        assert not rig.last.zero_copy and same_bytes(out, expected(rig.kv, part))
    assert rig.server.payload.staging.allocations == 1
    assert eventually(lambda: rig.server.stats.snapshot().transfers == 5)
    assert rig.server.stats.snapshot().zero_copy_transfers == 1


# A wrong cluster token, fake servers, replayed bytes, raw requests with bad proofs:
# tests/test_transfer_security.py and tests/test_transfer_abuse.py.


def test_unknown_and_expired_lease(rig: Rig) -> None:
    req = ReadRequest("ghost", [1], (0, L), (0, H))
    out = out_for(rig.kv, req)
    with pytest.raises(TransferError) as e:
        rig.client.read(rig.address, req, out).result(WAIT)
    assert e.value.code == "unknown_lease"
    rig.leases.create("old", [1, 2], readers=1, ttl_s=5)
    rig.clock.t += 5
    req = ReadRequest("old", [1, 2], (0, L), (0, H))
    out = out_for(rig.kv, req)
    with pytest.raises(TransferError) as e:
        rig.client.read(rig.address, req, out).result(WAIT)
    assert e.value.code == "expired_lease"
    assert (out == -7.0).all()  # never a byte of (possibly reused) blocks
    assert rig.released == [("old", "expired")]
    with pytest.raises(TransferError) as e:
        rig.client.release(rig.address, "old", "g0").result(WAIT)
    assert e.value.code == "expired_lease"
    # Error answers leave the connection usable.
    rig.leases.create("ok", [3], readers=1)
    rig.read(ReadRequest("ok", [3], (0, L), (0, H)))
    snap = rig.server.stats.snapshot()
    assert snap.expired_leases == 1 and snap.leased_blocks_held == 1


def test_bad_requests_keep_connection(rig: Rig) -> None:
    rig.leases.create("a", [1, 2, 3], readers=1)
    req = ReadRequest("a", [1, 2], (0, L), (0, H))
    for bad_req, out in [
        (req, torch.empty(3, dtype=torch.float32)),  # receiver buffer of the wrong size
        (req, out_for(rig.kv, req).to(torch.float64)),  # wrong dtype
        (ReadRequest("a", [1, 5], (0, L), (0, H)), out_for(rig.kv, req)),  # 5 not leased
        (ReadRequest("a", [1], (0, L + 1), (0, H)), out_for(rig.kv, req)),
    ]:
        with pytest.raises(TransferError) as e:
            rig.client.read(rig.address, bad_req, out).result(WAIT)
        assert e.value.code == "bad_request", e.value
    assert same_bytes(rig.read(req), expected(rig.kv, req))


def test_release_confirms_and_frees(rig: Rig) -> None:
    rig.leases.create("a", [4, 5, 6], readers=2)
    assert rig.server.stats.snapshot().leased_blocks_held == 3
    assert rig.client.release(rig.address, "a", "gen-rank-0").result(WAIT) is False
    assert rig.client.release(rig.address, "a", "gen-rank-0").result(WAIT) is False
    assert rig.released == []
    assert rig.client.release(rig.address, "a", 1).result(WAIT) is True
    assert rig.released == [("a", "confirmed")]
    assert rig.server.stats.snapshot().leased_blocks_held == 0
    with pytest.raises(TransferError) as e:
        rig.client.release(rig.address, "a", 1).result(WAIT)
    assert e.value.code == "unknown_lease"


def test_concurrent_reads_from_threads(rig: Rig) -> None:
    ids = [2, 7, 8, 20, 21, 22]
    rig.leases.create("a", ids, readers=1)
    reqs = [ReadRequest("a", ids[i:i + 3], (i % L, L), (0, H - i % 2)) for i in range(4)]

    def worker(req: ReadRequest) -> bool:
        ok = True
        for _ in range(5):
            out = out_for(rig.kv, req)
            rig.client.read(rig.address, req, out).result(WAIT)
            ok &= same_bytes(out, expected(rig.kv, req))
        return ok

    with cf.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, reqs))
    assert eventually(lambda: rig.server.stats.snapshot().transfers == 20)


def test_restarted_server_invalidates_cached_connection(backend: str) -> None:
    a = Rig(backend, seed=1, connect_timeout_s=1.0)
    client = a.client
    try:
        a.leases.create("x", [1, 2, 3], readers=1)
        req = ReadRequest("x", [3, 1], (0, L), (0, H))
        a.read(req)  # caches the connection
        first_id = client.ping(a.address).result(WAIT)["server_id"]
        address = a.address
        a.server.stop()  # the peer goes away: the cached connection is now dead
        port = int(address.rsplit(":", 1)[1])
        b_kv = make_kv(2)
        b_leases = LeaseTable()
        b_leases.create("x", [1, 2, 3], readers=1)
        b = KVTransferServer(b_kv, b_leases, TOKEN, backend, port=port).start()
        try:
            assert b.address == address  # same address: the stale entry is replaced
            out = out_for(b_kv, req)
            client.read(address, req, out).result(WAIT)  # transparently reconnected
            assert same_bytes(out, expected(b_kv, req))
            assert client.ping(address).result(WAIT)["server_id"] != first_id
        finally:
            b.stop()
        with pytest.raises(TransferError) as e:  # nobody listens any more
            client.read(address, req, out).result(WAIT)
        assert e.value.code == "connection_failed"
    finally:
        a.close()


def test_server_dying_mid_transfer_fails_the_read(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = Rig(backend, timeout_s=20.0)  # long: a failure must come from detection, not timeout
    try:
        ids = list(range(0, 20, 2))
        r.leases.create("a", ids, readers=1)
        req = ReadRequest("a", ids, (0, L), (0, H))
        r.read(req)  # a healthy connection first

        if backend == "tcp":
            from disagg.transfer.tcp import TcpConnection as Conn

            async def die(self, views):  # part of the payload, then the peer is gone
                await self._send(memoryview(views[0]).cast("B")[: views[0].nbytes // 2])
                await self.close()
                raise ConnectionClosedError("injected death")

            method = "send_payload_iov"  # a scattered table goes out as views of its runs
        else:
            from disagg.transfer.ucx import UcxConnection as Conn

            async def die(self, parts, count):  # the endpoint dies before the payload
                await self.close()
                raise ConnectionClosedError("injected death")

            method = "send_payload_parts"

        monkeypatch.setattr(Conn, method, die)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as e:
            r.client.read(r.address, req, out_for(r.kv, req)).result(WAIT)
        assert e.value.code == "connection_failed"
        assert time.monotonic() - t0 < 5.0
        monkeypatch.undo()
        out = r.read(req)  # a fresh connection works again
        assert same_bytes(out, expected(r.kv, req))
        assert r.leases.stats().leased_blocks == len(ids)  # nothing freed or leaked by it
    finally:
        r.close()


def test_unresponsive_server_times_out() -> None:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    client = KVTransferClient("tcp", TOKEN, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        fut = client.read(f"127.0.0.1:{lst.getsockname()[1]}",
                          ReadRequest("a", [1], (0, 1), (0, 1)), torch.empty(8))
        assert not fut.done() and time.monotonic() - t0 < 0.2  # the caller never waits
        with pytest.raises(TransferError) as e:
            fut.result(WAIT)
        assert e.value.code == "timeout" and time.monotonic() - t0 < 3
        assert client.stats.snapshot().failures_by_code == (("timeout", 1),)
        with pytest.raises(ValueError):
            client.read("no-port", ReadRequest("a", [1], (0, 1), (0, 1)), torch.empty(8))
    finally:
        client.close()
        lst.close()


def test_closed_client_and_nothing_listening(backend: str) -> None:
    # Reserve then free a port so that nothing listens there.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    client = KVTransferClient(backend, TOKEN, timeout_s=5, connect_timeout_s=2)
    req = ReadRequest("a", [1], (0, 1), (0, 1))
    with pytest.raises(TransferError) as e:
        client.read(f"127.0.0.1:{port}", req, torch.empty(8)).result(WAIT)
    assert e.value.code in ("connection_failed", "timeout")
    client.close()
    with pytest.raises(TransferError) as e:
        client.read(f"127.0.0.1:{port}", req, torch.empty(8)).result(WAIT)
    assert e.value.code == "closed"
