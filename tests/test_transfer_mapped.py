"""The same-host mapped path (``disagg/transfer/cuda_ipc.py``), everything but the CUDA IPC calls:
the gather against ``payload.gather_into``, the offer (host identity, switch, same process,
export failures), and the protocol over real connections with the "open" step replaced by a
sharing that maps CPU tensors within this process (``LocalSharing``): bytes, stats, fallbacks,
the pin held until DONE, and a read the server aborts under the gather never succeeding.

The CUDA half (two processes on one GPU) is in ``test_gpu.py``."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import pytest
import torch
from transfer_fixtures import BACKENDS, expected, same_bytes

from disagg.contracts.params import token_ids_hash
from disagg.transfer import (
    CONNECTION_FAILED,
    KVTransferClient,
    KVTransferServer,
    LeaseTable,
    ReadRequest,
    TransferError,
    TransferStats,
)
from disagg.transfer import cuda_ipc as ipc
from disagg.transfer.admission import ServerLimits
from disagg.transfer.base import BAD_REQUEST, PROTOCOL_ERROR
from disagg.transfer.cuda_ipc import (
    CacheExporter,
    CacheSharing,
    CudaIpcSharing,
    SharingError,
    answered_request,
    client_offer,
    gather_mapped,
    geometry,
    host_identity,
    rebuild,
)
from disagg.transfer.payload import gather_into, payload_shape
from disagg.transfer.progress import StreamProgress
from disagg.transfer.sender import READ_STALLED
from disagg.transfer.stats import merge_snapshots

N, L, H, B, D = 24, 4, 4, 8, 16
TOKEN = "mapped-secret"
WAIT = 10.0


def make_kv(seed: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = (
        N, L, 2, H, B, D)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def eventually(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class LocalSharing(CacheSharing):
    """Maps a CPU cache within this process: ``export`` files the tensor under a fresh key,
    ``open`` rebuilds it from the description over the same storage (``cuda_ipc.rebuild``, as
    the CUDA one does over the mapped storage)."""

    kind: ClassVar[str] = "local-test"
    same_process: ClassVar[bool] = True
    registry: ClassVar[dict[str, torch.Tensor]] = {}

    def __init__(self, fail_open: str = "") -> None:
        self.fail_open = fail_open
        self.exports = 0
        self.opens = 0

    def local_support(self) -> tuple[bool, str]:
        return True, "in-process"

    def exportable(self, kv: torch.Tensor) -> str | None:
        return None

    def export(self, kv: torch.Tensor) -> dict[str, Any]:
        self.exports += 1
        key = uuid.uuid4().hex
        self.registry[key] = kv
        return {**geometry(kv), "key": key}

    def locate(self, desc: Mapping[str, Any]) -> torch.device:
        return torch.device("cpu")

    def open(self, desc: Mapping[str, Any], device: torch.device) -> torch.Tensor:
        self.opens += 1
        if self.fail_open:
            raise SharingError(self.fail_open)
        return rebuild(self.registry[desc["key"]].untyped_storage(), desc)


# ---- the gather -------------------------------------------------------------------------------

SCATTERED = (17, 3, 9, 0, 22, 5, 11)  # 7 runs: one index_select
FEW_RUNS = (4, 5, 6, 12, 13, 20)  # 3 runs: a copy per run
CONSECUTIVE = (8, 9, 10, 11, 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ids", [SCATTERED, FEW_RUNS, CONSECUTIVE],
                         ids=["scattered", "few-runs", "consecutive"])
@pytest.mark.parametrize("layers,heads", [((0, L), (0, H)), ((1, 3), (0, H)),
                                          ((0, L), (1, 3)), ((2, 3), (3, 4))])
@pytest.mark.parametrize("fmt,tokens", [("blocks", 0), ("tokens", "full"), ("tokens", "tail")])
def test_gather_mapped_equals_gather_into(dtype: torch.dtype, ids: tuple[int, ...],
                                          layers: tuple[int, int], heads: tuple[int, int],
                                          fmt: str, tokens: Any) -> None:
    kv = make_kv(1, dtype)
    n = {0: 0, "full": len(ids) * B, "tail": (len(ids) - 1) * B + 3}[tokens]
    req = ReadRequest("r", ids, layers, heads, num_tokens=n, format=fmt)
    shape = payload_shape(tuple(kv.shape), req)
    got = torch.full(shape, -9.0, dtype=dtype)
    ref = torch.full(shape, 7.0, dtype=dtype)
    gather_mapped(kv, req, got)
    gather_into(kv, req, ref)
    assert same_bytes(got, ref)
    assert same_bytes(got, expected(kv, req))


@pytest.mark.parametrize("shape", [(10, 3, 1, 1, 4, 6), (10, 2, 2, 3, 4, 3)],
                         ids=["mla-latent", "odd-width"])
@pytest.mark.parametrize("fmt", ["blocks", "tokens"])
def test_gather_mapped_other_shapes(shape: tuple[int, ...], fmt: str) -> None:
    """An MLA latent (one part, one head) and a row of 12 bytes (int32, not int64, wide)."""
    kv = make_kv(2, torch.float32, shape)
    ids = (7, 1, 2, 9, 0, 4)
    req = ReadRequest("r", ids, (0, shape[1]), (0, shape[3]),
                      num_tokens=5 * shape[4] + 1 if fmt == "tokens" else 0, format=fmt)
    got = torch.zeros(payload_shape(tuple(kv.shape), req))
    ref = torch.ones(payload_shape(tuple(kv.shape), req))
    gather_mapped(kv, req, got)
    gather_into(kv, req, ref)
    assert same_bytes(got, ref)


def test_gather_mapped_refuses_a_wrong_out() -> None:
    kv = make_kv(3)
    req = ReadRequest("r", (1, 2), (0, L), (0, H))
    with pytest.raises(ValueError, match="contiguous"):
        gather_mapped(kv, req, torch.empty(3, L, 2, H, B, D))
    with pytest.raises(ValueError, match="float64"):
        gather_mapped(kv, req, torch.empty(2, L, 2, H, B, D, dtype=torch.float64))


def test_rebuild_over_a_storage_and_bad_descriptions() -> None:
    big = make_kv(4, shape=(2 * N, L, 2, H, B, D))
    kv = big[N:]  # a cache that starts inside its storage
    again = rebuild(kv.untyped_storage(), geometry(kv))
    assert same_bytes(again, kv) and again.data_ptr() == kv.data_ptr()
    with pytest.raises(SharingError, match="does not fit"):
        rebuild(kv.untyped_storage(), {**geometry(kv), "offset": kv.storage_offset() * 2})
    with pytest.raises(SharingError, match="malformed"):
        rebuild(kv.untyped_storage(), {**geometry(kv), "dtype": "no_such_dtype"})
    with pytest.raises(SharingError, match="malformed"):
        rebuild(kv.untyped_storage(), {**geometry(kv), "shape": [N, L, 2, H, B]})


def test_answered_request_checks_the_answer() -> None:
    kv = make_kv(5)
    req = ReadRequest("r", (3, 4), (0, L), (0, H))
    msg = req.to_wire("float32", 0)
    assert answered_request(msg, {"block_ids": [3, 4]}, kv) == req
    for bad in ([3, 5], [3, N], [], "3,4", [3, True]):
        with pytest.raises(ValueError):
            answered_request(msg, {"block_ids": bad}, kv)
    streamed = ReadRequest("s", (), (0, 2), (0, H), num_tokens=2 * B + 1, format="tokens",
                           wait_s=5.0, tokens_hash="ab" * 8)
    got = answered_request(streamed.to_wire("float32", 0), {"block_ids": [7, 1, 2]}, kv)
    assert got.block_ids == (7, 1, 2) and got.wait_s is None
    with pytest.raises(ValueError, match="need 3 blocks"):
        answered_request(streamed.to_wire("float32", 0), {"block_ids": [7, 1]}, kv)
    with pytest.raises(ValueError, match="beyond"):
        answered_request(ReadRequest("r", (1,), (0, L + 1), (0, H)).to_wire("float32", 0),
                         {"block_ids": [1]}, kv)


# ---- the offer --------------------------------------------------------------------------------


def _offer(**over: Any) -> dict[str, Any]:
    return {"kind": "local-test", "host": host_identity(), "pid": os.getpid() + 1,
            "client": "c1", **over}


def test_host_identity_is_the_boot_id_and_hostname() -> None:
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert host_identity().startswith(boot + "/") and len(host_identity()) > len(boot) + 1


def test_offer_accepted_on_the_same_host_only() -> None:
    sharing = LocalSharing()
    ex = CacheExporter(make_kv(6), sharing, enabled=True)
    assert ex.refusal(_offer()) is None
    assert ex.refusal(_offer(host="0000/elsewhere")) == "another host"
    assert ex.refusal(_offer(kind="cuda_ipc")) is not None
    for bad in ("x", {}, _offer(pid="1"), _offer(pid=True), _offer(client=""),
                _offer(client="c" * 65), _offer(host=None)):
        assert ex.refusal(bad) == "malformed ipc offer"
    answer = ex.answer(_offer())
    assert answer["ipc"]["kind"] == "local-test" and "key" in answer["ipc"]
    assert ex.answer(_offer())["ipc"] == answer["ipc"] and sharing.exports == 1  # per client
    assert ex.answer(_offer(client="c2"))["ipc"]["key"] != answer["ipc"]["key"]
    assert ex.answer(None) == {}
    assert ex.answer(_offer(host="0000/elsewhere")) == {"ipc_declined": "another host"}


def test_offer_refused_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "DISAGG_KV_IPC" in CacheExporter(make_kv(6), LocalSharing(),
                                            enabled=False).refusal(_offer())
    monkeypatch.setenv("DISAGG_KV_IPC", "0")
    server = KVTransferServer(make_kv(6), LeaseTable(), TOKEN, "tcp", sharing=LocalSharing())
    client = KVTransferClient("tcp", TOKEN, sharing=LocalSharing())
    try:
        assert not server.exports.enabled and not client.mapped
        assert client._ipc_offer is None  # no offer in AUTH at all
    finally:
        client.close()
    monkeypatch.setenv("DISAGG_KV_IPC", "1")
    client = KVTransferClient("tcp", TOKEN, sharing=LocalSharing())
    try:
        assert client.mapped and client._ipc_offer is not None
        assert client._ipc_offer["pid"] == os.getpid()
        assert client._ipc_offer["host"] == host_identity()
    finally:
        client.close()


def test_cuda_ipc_offer_rules() -> None:
    """The real sharing: a CPU cache is not exported, nor a handle to its own process."""
    ex = CacheExporter(make_kv(7), CudaIpcSharing(), enabled=True)
    assert ex.refusal(_offer(kind="cuda_ipc")) == "the cache is in cpu memory, not a GPU's"
    assert "same process" in ex.refusal(_offer(kind="cuda_ipc", pid=os.getpid()))
    assert ex.answer(_offer(kind="cuda_ipc")) == {
        "ipc_declined": "the cache is in cpu memory, not a GPU's"}
    ok, why = CudaIpcSharing().local_support()
    assert ok == torch.cuda.is_available() and why
    offer = client_offer(CudaIpcSharing(), "c")
    assert (offer is not None) == torch.cuda.is_available()
    with pytest.raises(SharingError, match="not a GPU"):
        CudaIpcSharing().export(make_kv(7))


def test_a_failed_export_is_not_offered_again(caplog: pytest.LogCaptureFixture) -> None:
    class Failing(LocalSharing):
        def export(self, kv: torch.Tensor) -> dict[str, Any]:
            self.exports += 1
            raise SharingError("no IPC in this container")

    sharing = Failing()
    ex = CacheExporter(make_kv(8), sharing, enabled=True)
    with caplog.at_level(logging.WARNING, logger="disagg.transfer"):
        first = ex.answer(_offer())
        second = ex.answer(_offer(client="c2"))
    assert first == second == {"ipc_declined": "export failed: no IPC in this container"}
    assert sharing.exports == 1
    assert sum("mapped path is off" in r.getMessage() for r in caplog.records) == 1


def test_client_offer_needs_local_support() -> None:
    class NoSupport(LocalSharing):
        def local_support(self) -> tuple[bool, str]:
            return False, "no GPU"

    assert client_offer(NoSupport(), "c") is None
    assert client_offer(LocalSharing(), "c") == {"kind": "local-test", "host": host_identity(),
                                                 "pid": os.getpid(), "client": "c"}


def test_stats_count_mapped_reads_and_fallbacks() -> None:
    a, b = TransferStats(), TransferStats()
    a.record_transfer(10, 1, 0.001, mapped=True, device_direct=True)
    a.record_mapped_fallback("open failed")
    b.record_transfer(10, 1, 0.001)
    b.record_mapped_fallback("open failed")
    b.record_mapped_fallback("")
    sa = a.snapshot()
    assert (sa.mapped_transfers, sa.device_direct_transfers) == (1, 1)
    m = merge_snapshots([sa, b.snapshot()])
    assert m.mapped_transfers == 1 and m.transfers == 2
    assert m.mapped_fallbacks == (("open failed", 2), ("unknown", 1))


# ---- over the wire, the open step in-process --------------------------------------------------


class Rig:
    def __init__(self, backend: str, server_sharing: CacheSharing | None = None,
                 client_sharing: CacheSharing | None = None, server_mapped: bool = True,
                 ttl_s: float = 30.0, limits: ServerLimits | None = None,
                 progress: StreamProgress | None = None) -> None:
        self.released: list[tuple[str, str]] = []
        self.leases = LeaseTable(default_ttl_s=ttl_s,
                                 on_release=lambda lease, why: self.released.append(
                                     (lease.lease_id, why)))
        self.kv = make_kv(9)
        self.server = KVTransferServer(
            self.kv, self.leases, TOKEN, backend, mapped=server_mapped,
            sharing=server_sharing or LocalSharing(), limits=limits, progress=progress,
            sweep_interval_s=0.05).start()
        self.client = KVTransferClient(backend, TOKEN, timeout_s=WAIT, mapped=True,
                                       sharing=client_sharing or LocalSharing())

    def read(self, req: ReadRequest, fill: float = -3.0) -> tuple[Any, torch.Tensor]:
        shape = payload_shape(tuple(self.kv.shape),
                              req if req.wait_s is None else ReadRequest(
                                  req.lease_id, tuple(range(-(-req.num_tokens // B))),
                                  req.layer_slice, req.head_slice, req.num_tokens,
                                  req.format))
        out = torch.full(shape, fill)
        return self.client.read(self.server.address, req, out), out

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def rig(backend: str) -> Iterator[Rig]:
    r = Rig(backend)
    yield r
    r.close()


def test_mapped_reads_move_no_payload(rig: Rig) -> None:
    ids = [17, 3, 4, 9, 0, 22]
    rig.leases.create("r", ids, readers=1)
    cases = [ReadRequest("r", ids, (0, L), (0, H)),
             ReadRequest("r", ids[1:3], (0, L), (0, H)),
             ReadRequest("r", ids, (1, 3), (2, 4)),
             ReadRequest("r", ids, (0, L), (0, H), num_tokens=5 * B + 3, format="tokens")]
    for req in cases:
        fut, out = rig.read(req)
        res = fut.result(WAIT)
        assert res.mapped and not res.zero_copy and not res.device_direct  # CPU memory here
        assert res.nbytes == out.numel() * 4 and res.num_blocks == len(req.block_ids)
        assert same_bytes(out, expected(rig.kv, req)), req
    # the server gathered nothing (the "tokens" read would have needed a staging buffer)
    assert rig.server.payload.staging.allocations == 0
    assert eventually(lambda: rig.server.stats.snapshot().mapped_transfers == len(cases))
    s, c = rig.server.stats.snapshot(), rig.client.stats.snapshot()
    assert (s.transfers, s.failed_transfers) == (len(cases), 0)
    assert (c.mapped_transfers, c.transfers, c.mapped_fallbacks) == (len(cases), len(cases), ())
    assert rig.client.release(rig.server.address, "r", "g").result(WAIT)
    assert eventually(lambda: rig.released == [("r", "confirmed")])


def test_mapped_read_errors_are_the_servers(rig: Rig) -> None:
    """Lease and validation errors are answered as for any READ, on a usable connection."""
    rig.leases.create("r", [1, 2], readers=1)
    for req, code in ((ReadRequest("nope", [1], (0, L), (0, H)), "unknown_lease"),
                      (ReadRequest("r", [1, 5], (0, L), (0, H)), BAD_REQUEST)):
        fut, out = rig.read(req)
        with pytest.raises(TransferError) as e:
            fut.result(WAIT)
        assert e.value.code == code and e.value.remote
        assert bool((out == -3.0).all())  # untouched
    fut, out = rig.read(ReadRequest("r", [1, 2], (0, L), (0, H)))
    assert fut.result(WAIT).mapped


def test_mapped_streaming_read_learns_its_blocks(backend: str) -> None:
    progress = StreamProgress(L, torch.device("cpu"))
    rig = Rig(backend, progress=progress)
    try:
        ids, n = [9, 3, 14], 2 * B + 5
        rig.leases.create("s", [], readers=1, ttl_s=60)
        tokens_hash = token_ids_hash(list(range(n)))
        progress.open("s", n, tokens_hash)
        rig.leases.extend("s", ids, ttl_s=60)
        progress.begin_step([("s", ids, 0, n)])
        for layer in range(L):
            progress.layer_done(layer)
        req = ReadRequest("s", (), (0, 2), (0, H), num_tokens=n, format="tokens", wait_s=5.0,
                          tokens_hash=tokens_hash)
        fut, out = rig.read(req)
        res = fut.result(WAIT)
        assert res.mapped and res.num_blocks == 3
        plain = ReadRequest("s", ids, (0, 2), (0, H), num_tokens=n, format="tokens")
        assert same_bytes(out, expected(rig.kv, plain))
        progress.close("s")
    finally:
        rig.close()


def test_server_switched_off_moves_the_bytes(backend: str) -> None:
    rig = Rig(backend, server_mapped=False)
    try:
        rig.leases.create("r", [5, 1], readers=1)
        req = ReadRequest("r", [5, 1], (0, L), (0, H))
        fut, out = rig.read(req)
        res = fut.result(WAIT)
        assert not res.mapped and same_bytes(out, expected(rig.kv, req))
        # declined, not a fallback: nothing counted
        assert rig.client.stats.snapshot().mapped_fallbacks == ()
        assert rig.server.stats.snapshot().mapped_transfers == 0
    finally:
        rig.close()


def test_client_on_another_host_is_not_offered(backend: str) -> None:
    rig = Rig(backend)
    try:
        assert rig.client._ipc_offer is not None
        rig.client._ipc_offer["host"] = "0000/another-machine"
        rig.leases.create("r", [5, 1], readers=1)
        req = ReadRequest("r", [5, 1], (0, L), (0, H), num_tokens=B + 2, format="tokens")
        fut, out = rig.read(req)
        res = fut.result(WAIT)
        assert not res.mapped and same_bytes(out, expected(rig.kv, req))
        assert rig.client._maps._peers == {}  # nothing was offered, nothing mapped
    finally:
        rig.close()


def test_a_failed_open_falls_back_counted_and_logged_once(
        backend: str, caplog: pytest.LogCaptureFixture) -> None:
    sharing = LocalSharing(fail_open="cannot map: no IPC between these containers")
    rig = Rig(backend, client_sharing=sharing)
    try:
        rig.leases.create("r", [5, 1, 7], readers=1)
        req = ReadRequest("r", [5, 1, 7], (0, L), (0, H))
        with caplog.at_level(logging.WARNING, logger="disagg.transfer"):
            for _ in range(3):
                fut, out = rig.read(req)
                res = fut.result(WAIT)
                assert not res.mapped and same_bytes(out, expected(rig.kv, req))
        assert sharing.opens == 1  # tried once per server instance
        assert rig.client.stats.snapshot().mapped_fallbacks == (
            ("cannot map: no IPC between these containers", 3),)
        told = [r for r in caplog.records if "move their bytes" in r.getMessage()]
        assert len(told) == 1 and "no IPC between these containers" in told[0].getMessage()
    finally:
        rig.close()


def test_a_mapped_read_where_none_was_offered_is_refused(backend: str) -> None:
    """A client that claims a mapping the server never offered gets bad_request."""
    rig = Rig(backend, server_mapped=False)
    sharing = LocalSharing()
    forged = {"kind": "local-test", **sharing.export(rig.kv)}

    async def forge(address: str, conn: Any, session: Any) -> dict[str, Any]:
        await KVTransferClient._handshake(rig.client, address, conn, session)
        return forged

    rig.client._handshake = forge  # type: ignore[method-assign]
    try:
        rig.leases.create("r", [2], readers=1)
        fut, out = rig.read(ReadRequest("r", [2], (0, L), (0, H)))
        with pytest.raises(TransferError) as e:
            fut.result(WAIT)
        assert e.value.code == BAD_REQUEST and "not offered" in e.value.message
        assert bool((out == -3.0).all())
    finally:
        rig.close()


def _hold_gathers(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make mapped gathers wait (yielding on the loop) until ``go`` is set; ``started`` is set
    when one began."""
    started, go = threading.Event(), threading.Event()
    real = ipc.MappedPeers.gather

    async def held(self: ipc.MappedPeers, cache: torch.Tensor, req: ReadRequest,
                   out: torch.Tensor) -> None:
        started.set()
        while not go.is_set():
            await asyncio.sleep(0.005)
        await real(self, cache, req, out)

    monkeypatch.setattr(ipc.MappedPeers, "gather", held)
    return started, go


def test_the_pin_holds_until_done(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease's owner ends it while the reader gathers: the blocks stay held (no release
    callback) and the read is not counted until the reader's DONE."""
    started, go = _hold_gathers(monkeypatch)
    rig = Rig(backend)
    try:
        rig.leases.create("r", [4, 2, 8], readers=1)
        req = ReadRequest("r", [4, 2, 8], (0, L), (0, H))
        fut, out = rig.read(req)
        assert started.wait(WAIT)
        # the gather began after the answer: a server that did not wait for DONE would have
        # unpinned by now
        assert rig.leases.release("r")  # the owner aborts: the pin keeps the blocks
        assert rig.released == [] and rig.server.stats.snapshot().transfers == 0
        assert rig.leases.stats().leased_blocks == 3
        go.set()
        res = fut.result(WAIT)
        assert res.mapped and same_bytes(out, expected(rig.kv, req))
        assert eventually(lambda: rig.released == [("r", "released")])
        assert rig.server.stats.snapshot().mapped_transfers == 1
        assert rig.leases.stats().leased_blocks == 0
    finally:
        go.set()
        rig.close()


def test_a_read_aborted_under_the_gather_never_succeeds(backend: str,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The reader gathers past its lease's end + grace: the server aborts the read (closes
    the connection, then frees the blocks); the gather ends later, and the read fails."""
    started, go = _hold_gathers(monkeypatch)
    rig = Rig(backend, ttl_s=0.3, limits=ServerLimits(read_grace_s=0.2))
    try:
        rig.leases.create("r", [4, 2, 8], readers=1)
        fut, _ = rig.read(ReadRequest("r", [4, 2, 8], (0, L), (0, H)))
        assert started.wait(WAIT)
        assert eventually(lambda: rig.released == [("r", "expired")])  # freed: aborted
        snap = rig.server.stats.snapshot()
        assert dict(snap.failures_by_code) == {READ_STALLED: 1} and snap.transfers == 0
        go.set()
        with pytest.raises(TransferError) as e:
            fut.result(WAIT)
        assert e.value.code == CONNECTION_FAILED and "aborted" in e.value.message
        assert rig.client.stats.snapshot().mapped_transfers == 0
        # the server serves on, mapped
        rig.leases.create("r2", [1], readers=1)
        fut2, out2 = rig.read(ReadRequest("r2", [1], (0, L), (0, H)))
        assert fut2.result(WAIT).mapped
        assert same_bytes(out2, expected(rig.kv, ReadRequest("r2", [1], (0, L), (0, H))))
    finally:
        go.set()
        rig.close()


def test_a_failed_gather_fails_the_read_and_later_reads_move_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken(kv: torch.Tensor, req: ReadRequest, out: torch.Tensor) -> None:
        calls.append(req)
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(ipc, "gather_mapped", broken)
    rig = Rig("tcp")
    try:
        rig.leases.create("r", [3, 4], readers=1)
        req = ReadRequest("r", [3, 4], (0, L), (0, H))
        fut, _ = rig.read(req)
        with pytest.raises(TransferError) as e:
            fut.result(WAIT)
        assert e.value.code == PROTOCOL_ERROR and "simulated kernel failure" in e.value.message
        # the server saw the connection close without a DONE: a failed read, blocks unpinned
        assert eventually(lambda: rig.server.stats.snapshot().failed_transfers == 1)
        fut, out = rig.read(req)
        res = fut.result(WAIT)
        assert not res.mapped and same_bytes(out, expected(rig.kv, req)) and len(calls) == 1
        assert rig.client.stats.snapshot().mapped_fallbacks[0][0].startswith("gather failed")
    finally:
        rig.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA failure paths")
def test_cuda_ipc_open_fails_cleanly_without_cuda() -> None:
    """Where the real mapping cannot work, it says why (a ``SharingError``, so the read moves
    its bytes), and a malformed handle is refused before any CUDA call."""
    sharing = CudaIpcSharing()
    desc = {**geometry(make_kv(10)), "device": 0, "uuid": "GPU-x", "handle": "00" * 64,
            "size_bytes": 1 << 20, "offset_bytes": 0, "ref_counter": "2f78", "event": "00" * 64,
            "ref_counter_offset": 0, "event_sync": True}
    with pytest.raises(SharingError, match="no CUDA device"):
        sharing.locate(desc)
    with pytest.raises(SharingError, match="cannot map the peer's cache"):
        sharing.open(desc, torch.device("cuda", 0))
    for key, bad in (("handle", "zz"), ("handle", 5), ("size_bytes", -1), ("ref_counter", None)):
        with pytest.raises(SharingError, match="malformed handle"):
            sharing.open({**desc, key: bad}, torch.device("cuda", 0))
    with pytest.raises(SharingError, match="malformed cache description"):
        sharing.open({**desc, "stride": [1, 2]}, torch.device("cuda", 0))
