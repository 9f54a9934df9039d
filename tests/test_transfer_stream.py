"""Layer-wise KV streaming, transfer half: ``StreamProgress`` (the ready rule, waking, errors),
``ReadRequest``'s ``wait_s`` / ``tokens_hash``, ``LeaseTable.extend``, and streaming READs
over TCP and UCX against a cache an "engine" thread writes layer by layer.

UCX cases skip with the reason when ucxx cannot be imported."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from transfer_fixtures import BACKENDS, expected, same_bytes

from disagg.contracts.params import token_ids_hash
from disagg.transfer import (
    KVTransferClient,
    KVTransferServer,
    LeaseTable,
    ReadRequest,
    TransferError,
)
from disagg.transfer.base import MAX_WAIT_S, LoopThread
from disagg.transfer.payload import payload_shape
from disagg.transfer.progress import StreamNotReady, StreamProgress

N, L, H, B, D = 16, 4, 2, 8, 4
TOKEN = "cluster-secret"
WAIT = 10.0  # seconds: every future here resolves far sooner
CPU = torch.device("cpu")



def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def hash_of(n: int) -> str:
    return token_ids_hash(list(range(100, 100 + n)))


# ---- StreamProgress on its own ---------------------------------------------------------------


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    loop = LoopThread("stream-test-loop")
    yield loop
    loop.stop()


def settle(lt: LoopThread) -> None:
    """Let the loop run whatever a writer's wake scheduled (so a read that became ready has
    returned), before asserting that a read has NOT returned."""
    async def spin() -> None:
        for _ in range(20):
            await asyncio.sleep(0)
    lt.run(spin(), 5)


def wait(lt: LoopThread, p: StreamProgress, sid: str, n: int, layers: tuple[int, int],
         h: str | None = None, timeout_s: float = WAIT) -> cf.Future[list[int]]:
    fut = lt.submit(p.wait_ready(sid, n, layers, h or hash_of(n), timeout_s))
    return fut


def error_of(fut: cf.Future[list[int]]) -> StreamNotReady:
    with pytest.raises(StreamNotReady) as e:
        fut.result(WAIT)
    return e.value


def test_token_ids_hash() -> None:
    assert token_ids_hash([1, 2, 3]) == token_ids_hash((1, 2, 3))
    assert token_ids_hash([1, 2, 3]) != token_ids_hash([1, 2, 4])
    assert token_ids_hash([1]) != token_ids_hash([1, 0])
    assert len(token_ids_hash([])) == 64


def test_layer_by_layer_then_commit(lt: LoopThread) -> None:
    p = StreamProgress(L, CPU)
    p.layer_done(0)  # no stream in the step: a no-op
    p.open("s", 20, hash_of(20))
    first = wait(lt, p, "s", 20, (0, 1))
    upto3 = wait(lt, p, "s", 20, (0, 3))
    later = wait(lt, p, "s", 20, (3, 4))
    until(lambda: p.num_waiting("s") == 3)
    p.begin_step([("s", [5, 2, 7], 0, 20)])
    settle(lt)
    assert p.num_waiting("s") == 3  # computed in this step, no layer done yet
    p.layer_done(0)
    assert first.result(WAIT) == [5, 2, 7]
    p.layer_done(1)
    settle(lt)
    assert not upto3.done() and not later.done()
    p.layer_done(2)
    assert upto3.result(WAIT) == [5, 2, 7]
    settle(lt)
    assert not later.done()
    # the next step commits this one: ready on every layer though layer 3 never reported
    p.begin_step([])
    assert later.result(WAIT) == [5, 2, 7]
    assert wait(lt, p, "s", 20, (0, L)).result(WAIT) == [5, 2, 7]
    assert p.num_waiting() == 0


def test_chunks_and_prefix_hit(lt: LoopThread) -> None:
    p = StreamProgress(L, CPU)
    p.open("c", 20, hash_of(20))
    fut = wait(lt, p, "c", 20, (0, 1))
    p.begin_step([("c", [1, 2], 0, 12)])  # first chunk: tokens [0, 12)
    for layer in range(L):
        p.layer_done(layer)
    settle(lt)
    assert not fut.done()  # 12 of 20 tokens
    p.begin_step([("c", [1, 2, 3], 12, 20)])  # commits [0, 12); computes [12, 20)
    settle(lt)
    assert not fut.done()
    p.layer_done(0)
    assert fut.result(WAIT) == [1, 2, 3]
    # a prefix hit that covers every token: ready on all layers at begin_step
    p.open("hit", 9, hash_of(9))
    hit = wait(lt, p, "hit", 9, (0, L))
    until(lambda: p.num_waiting("hit") == 1)
    p.begin_step([("hit", [4, 5], 9, 9)])
    assert hit.result(WAIT) == [4, 5]
    # a partial prefix hit: [0, 8) cached, [8, 9) computed; the read needs the layers
    p.open("part", 9, hash_of(9))
    part = wait(lt, p, "part", 9, (0, 2))
    p.begin_step([("part", [6, 7], 8, 9)])
    p.layer_done(0)
    settle(lt)
    assert not part.done()
    p.layer_done(1)
    assert part.result(WAIT) == [6, 7]


def test_close_wakes_waiters_with_unknown_lease(lt: LoopThread) -> None:
    p = StreamProgress(L, CPU)
    p.open("x", 5, hash_of(5))
    futs = [wait(lt, p, "x", 5, (0, L)), wait(lt, p, "x", 5, (0, 1))]
    until(lambda: p.num_waiting("x") == 2)
    t0 = time.monotonic()
    p.close("x")
    assert [error_of(f).code for f in futs] == ["unknown_lease"] * 2
    assert time.monotonic() - t0 < WAIT / 2  # woken, not timed out
    # a read arriving after the close fails at once too
    assert error_of(wait(lt, p, "x", 5, (0, 1))).code == "unknown_lease"
    p.close("x")  # idempotent
    assert p.num_waiting() == 0


def test_mismatches_are_bad_requests(lt: LoopThread) -> None:
    p = StreamProgress(L, CPU)
    p.open("m", 10, hash_of(10))
    assert error_of(wait(lt, p, "m", 10, (0, 1), h=hash_of(11))).code == "bad_request"
    assert error_of(wait(lt, p, "m", 11, (0, 1), h=hash_of(10))).code == "bad_request"
    assert error_of(wait(lt, p, "m", 10, (0, L + 1))).code == "bad_request"
    # a read waiting before its stream opens learns of the mismatch at the open
    early = wait(lt, p, "late", 10, (0, 1), h=hash_of(3))
    until(lambda: p.num_waiting("late") == 1)
    p.open("late", 10, hash_of(10))
    assert error_of(early).code == "bad_request"
    with pytest.raises(ValueError):
        p.open("m", 10, hash_of(10))  # already open
    with pytest.raises(ValueError):
        p.open("zero", 0, hash_of(0))


def test_timeouts(lt: LoopThread) -> None:
    p = StreamProgress(L, CPU)
    assert error_of(wait(lt, p, "never", 4, (0, 1), timeout_s=0.05)).code == "unknown_lease"
    p.open("slow", 4, hash_of(4))
    p.begin_step([("slow", [0], 0, 4)])
    p.layer_done(0)
    e = error_of(wait(lt, p, "slow", 4, (0, 2), timeout_s=0.05))
    assert e.code == "timeout" and "not ready" in e.message
    assert p.num_waiting() == 0


# ---- wire and lease pieces -------------------------------------------------------------------


def test_read_request_wait_fields() -> None:
    h = hash_of(5)
    plain = ReadRequest("a", [1], (0, 1), (0, 1))
    assert "wait_s" not in plain.to_wire("float32", 4)
    assert "tokens_hash" not in plain.to_wire("float32", 4)
    req = ReadRequest("a", [], (0, 2), (0, 1), num_tokens=5, wait_s=2, tokens_hash=h)
    wire = req.to_wire("float32", 4)
    assert wire["wait_s"] == 2.0 and wire["tokens_hash"] == h and wire["block_ids"] == []
    assert ReadRequest.from_wire(wire) == req
    bad = [
        dict(wait_s=0), dict(wait_s=MAX_WAIT_S + 1), dict(wait_s=math.nan),
        dict(wait_s=True), dict(wait_s="1"), dict(tokens_hash=None), dict(tokens_hash="XYZ"),
        dict(tokens_hash="ab"), dict(block_ids=[1]), dict(num_tokens=0),
    ]
    for change in bad:
        kw = dict(lease_id="a", block_ids=[], layer_slice=(0, 1), head_slice=(0, 1),
                  num_tokens=5, wait_s=1.0, tokens_hash=h) | change
        with pytest.raises(ValueError):
            ReadRequest(**kw)
    with pytest.raises(ValueError):  # a hash without a wait
        ReadRequest("a", [1], (0, 1), (0, 1), tokens_hash=h)
    with pytest.raises(ValueError):  # no blocks and no wait
        ReadRequest("a", [], (0, 1), (0, 1))


def test_lease_extend() -> None:
    now = [0.0]
    table = LeaseTable(default_ttl_s=5.0, clock=lambda: now[0])
    table.create("s", [], readers=1, ttl_s=100)
    assert table.stats().leased_blocks == 0
    now[0] = 10.0
    assert table.extend("s", [3, 4, 5], ttl_s=2.0)
    lease = table.check("s")
    assert lease.block_ids == (3, 4, 5) and lease.block_set == {3, 4, 5}
    assert (lease.created_at, lease.expires_at) == (10.0, 12.0)
    assert table.stats().leased_blocks == 3
    assert table.extend("s", [3], ttl_s=2.0) and table.stats().leased_blocks == 1
    now[0] = 20.0
    assert not table.extend("s", [3], ttl_s=2.0)  # expired: ended, not revived
    assert "s" not in table and table.stats().leased_blocks == 0
    assert not table.extend("nope", [1], ttl_s=1.0)
    with pytest.raises(ValueError):
        table.extend("s", [1], ttl_s=0)


# ---- streaming READs over the wire -----------------------------------------------------------


class Rig:
    """A server whose cache an "engine" (the test thread or a writer thread) fills layer by
    layer, with a StreamProgress; a client."""

    def __init__(self, backend: str, timeout_s: float = 5.0) -> None:
        self.leases = LeaseTable(default_ttl_s=30.0)
        self.kv = torch.full((N, L, 2, H, B, D), -1.0)  # "garbage" until a step writes it
        self.progress = StreamProgress(L, CPU)
        self.server = KVTransferServer(self.kv, self.leases, TOKEN, backend,
                                       progress=self.progress).start()
        self.client = KVTransferClient(backend, TOKEN, timeout_s=timeout_s)
        self.gen = torch.Generator().manual_seed(0)

    def open(self, sid: str, n: int) -> None:
        """The context request is queued: a lease without blocks, a stream."""
        self.leases.create(sid, [], readers=1, ttl_s=60)
        self.progress.open(sid, n, hash_of(n))

    def step(self, sid: str, ids: list[int], start: int, end: int,
             layers: range = range(L)) -> None:
        """One forward: the lease follows the table, each layer writes then reports."""
        self.leases.extend(sid, ids, ttl_s=60)
        self.progress.begin_step([(sid, ids, start, end)])
        for layer in layers:
            self.kv[ids, layer] = torch.randn(len(ids), 2, H, B, D, generator=self.gen)
            self.progress.layer_done(layer)

    def read(self, sid: str, n: int, layers: tuple[int, int], ids: list[int],
             fmt: str = "blocks", wait_s: float = WAIT) -> tuple[cf.Future, torch.Tensor,
                                                                  ReadRequest]:
        """A streaming read; also the plain request it must equal (``ids``: the stream's
        first ceil(n / B) blocks)."""
        req = ReadRequest(sid, [], layers, (0, H), num_tokens=n, format=fmt, wait_s=wait_s,
                          tokens_hash=hash_of(n))
        plain = ReadRequest(sid, ids, layers, (0, H), num_tokens=n, format=fmt)
        out = torch.full(payload_shape(tuple(self.kv.shape), plain), 7.0)
        return self.client.read(self.server.address, req, out), out, plain

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = Rig(request.param)
    yield r
    r.close()


def remote_error(fut: cf.Future) -> TransferError:
    with pytest.raises(TransferError) as e:
        fut.result(WAIT)
    return e.value


def test_read_before_open_gets_the_final_layers(rig: Rig) -> None:
    ids = [9, 3, 4, 12]  # scattered; 19 tokens need the first 3
    fut, out, plain = rig.read("early", 19, (0, L), ids[:3])
    until(lambda: rig.progress.num_waiting("early") == 1)  # at the server, before the open
    # another request on the same client and server is not held up by the waiting read
    rig.leases.create("plain", [0, 1], readers=1)
    rig.kv[[0, 1]] = 5.0
    other = torch.empty(payload_shape(tuple(rig.kv.shape),
                                      ReadRequest("plain", [0, 1], (0, L), (0, H))))
    rig.client.read(rig.server.address, ReadRequest("plain", [0, 1], (0, L), (0, H)),
                    other).result(WAIT)
    assert bool((other == 5.0).all()) and not fut.done()

    def engine() -> None:  # chunked prefill on its own thread: [0, 8), then [8, 19)
        rig.open("early", 19)
        rig.step("early", ids[:1], 0, 8)
        rig.step("early", ids, 8, 19)

    writer = threading.Thread(target=engine)
    writer.start()
    res = fut.result(WAIT)
    writer.join(WAIT)
    assert same_bytes(out, expected(rig.kv, plain))  # the last step's bytes, every layer
    assert res.num_blocks == 3 and res.nbytes == out.numel() * 4
    # the streamed read's own connection is closed once it is done; the plain one stays
    until(lambda: rig.server.num_connections == 1)
    rig.progress.close("early")


def test_layer_groups_complete_in_layer_order(rig: Rig) -> None:
    ids = [2, 7, 5]
    lo, lo_out, lo_plain = rig.read("groups", 20, (0, 2), ids, fmt="tokens")
    hi, hi_out, hi_plain = rig.read("groups", 20, (2, 4), ids, fmt="tokens")
    rig.open("groups", 20)
    rig.step("groups", ids, 0, 20, layers=range(2))
    lo.result(WAIT)
    assert same_bytes(lo_out, expected(rig.kv, lo_plain))
    until(lambda: rig.progress.num_waiting("groups") == 1)  # [2, 4) reached the server
    assert not hi.done()  # 2 layers done: [2, 4) waits at the server, unanswered
    for layer in (2, 3):
        rig.kv[ids, layer] = float(layer)
        rig.progress.layer_done(layer)
    hi.result(WAIT)
    assert same_bytes(hi_out, expected(rig.kv, hi_plain))
    assert bool((hi_out[0] == 2.0).all()) and bool((hi_out[1] == 3.0).all())
    rig.progress.close("groups")


def test_close_or_release_while_waiting(rig: Rig) -> None:
    fut, _, _ = rig.read("doomed", 8, (0, L), [1])
    rig.open("doomed", 8)
    until(lambda: rig.progress.num_waiting("doomed") == 1)
    rig.progress.close("doomed")
    e = remote_error(fut)
    assert (e.code, e.remote) == ("unknown_lease", True)
    rig.leases.release("doomed")
    # the lease ends (request aborted) while the read waits; the KV then "appears"
    fut, _, _ = rig.read("gone", 8, (0, L), [1])
    rig.open("gone", 8)
    until(lambda: rig.progress.num_waiting("gone") == 1)
    rig.leases.release("gone")
    rig.progress.begin_step([("gone", [1], 0, 8)])
    for layer in range(L):
        rig.progress.layer_done(layer)
    assert remote_error(fut).code == "unknown_lease"
    rig.progress.close("gone")


@pytest.mark.parametrize("backend", BACKENDS)
def test_client_close_ends_its_reads_at_once(backend: str) -> None:
    """A read waiting at the server and one submitted just before ``close`` (its start may
    run while the client closes) both end as ``closed`` with ``quiet`` set, long before their
    wait. (The server's side of the waiting read waits on until its ``wait_s``: the server
    does not watch the connection of a read it has not answered.)"""
    r = Rig(backend)
    try:
        waiting, _, _ = r.read("never", 8, (0, L), [1], wait_s=30.0)
        until(lambda: r.progress.num_waiting("never") == 1)
        racing, _, _ = r.read("never-either", 8, (0, L), [1], wait_s=30.0)
        t0 = time.monotonic()
        r.client.close()
        for fut in (waiting, racing):
            e = remote_error(fut)
            assert e.code == "closed" and fut.quiet.is_set(), e
        assert time.monotonic() - t0 < 5.0
    finally:
        r.close()


def test_errors_answered_by_the_server(rig: Rig) -> None:
    fut, _, _ = rig.read("nobody", 8, (0, L), [1], wait_s=0.2)
    assert remote_error(fut).code == "unknown_lease"  # never opened
    rig.open("stuck", 8)
    fut, _, _ = rig.read("stuck", 8, (0, L), [1], wait_s=0.2)
    e = remote_error(fut)
    assert (e.code, e.remote) == ("timeout", True)
    req = ReadRequest("stuck", [], (0, L), (0, H), num_tokens=8, wait_s=1.0,
                      tokens_hash=hash_of(9))
    out = torch.empty(payload_shape(tuple(rig.kv.shape), ReadRequest("stuck", [1], (0, L),
                                                                     (0, H))))
    e = remote_error(rig.client.read(rig.server.address, req, out))
    assert e.code == "bad_request" and "tokens_hash" in e.message
    rig.progress.close("stuck")
    rig.leases.release("stuck")
    assert rig.progress.num_waiting() == 0


def test_client_timeout_allows_the_wait() -> None:
    r = Rig("tcp", timeout_s=0.3)
    try:
        t0 = time.monotonic()
        fut, out, plain = r.read("long", 8, (0, L), [6], wait_s=5.0)
        until(lambda: r.progress.num_waiting("long") == 1)
        until(lambda: time.monotonic() - t0 > 0.6)  # past the client's own timeout
        assert not fut.done()
        r.open("long", 8)
        r.step("long", [6], 0, 8)
        fut.result(WAIT)
        assert same_bytes(out, expected(r.kv, plain))
    finally:
        r.close()


def test_stop_cancels_waiters_and_no_progress_refuses() -> None:
    r = Rig("tcp")
    fut, _, _ = r.read("w", 8, (0, L), [1], wait_s=60.0)
    until(lambda: r.progress.num_waiting("w") == 1)
    t0 = time.monotonic()
    r.server.stop()
    assert time.monotonic() - t0 < 3.0
    assert remote_error(fut).code == "connection_failed"
    assert r.progress.num_waiting() == 0
    r.client.close()
    # a server without progress refuses a streaming read
    leases = LeaseTable()
    with KVTransferServer(torch.zeros(N, L, 2, H, B, D), leases, TOKEN, "tcp") as server, \
            KVTransferClient("tcp", TOKEN, timeout_s=5.0) as client:
        req = ReadRequest("s", [], (0, L), (0, H), num_tokens=8, wait_s=1.0,
                          tokens_hash=hash_of(8))
        out = torch.empty(payload_shape((N, L, 2, H, B, D),
                                        ReadRequest("s", [1], (0, L), (0, H))))
        e = remote_error(client.read(server.address, req, out))
        assert e.code == "bad_request" and "wait_s" in e.message
    with pytest.raises(ValueError):
        KVTransferServer(torch.zeros(N, L, 2, H, B, D), leases, TOKEN, "tcp",
                         progress=StreamProgress(L + 1, CPU))
