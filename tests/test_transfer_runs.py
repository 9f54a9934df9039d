"""Scattered block tables sent and received as runs of blocks, no staging copy (issue 19,
gap 2): the views of a payload (``payload.block_views``), TCP's ``sendmsg`` / ``recvmsg_into``
over an iovec cut to ``IOV_MAX``, UCX's parts, reads straight into the receiver's own blocks
(``kv_connector.pull.KVPuller``), and a cancelled read that stops writing before its blocks
are freed.

UCX cases skip with the reason when ucxx cannot be imported."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from typing import Any

import numpy as np
import pytest
import torch
from transfer_fixtures import BACKENDS, expected, same_bytes

from disagg.contracts.params import ContextParams
from disagg.kv_connector.pull import KVPuller, Loaded, Read, cancel_reads
from disagg.layout import RankLayout, WorkerLayout, plan_pulls
from disagg.transfer import KVTransferClient, KVTransferServer, LeaseTable, ReadRequest
from disagg.transfer import tcp as tcp_mod
from disagg.transfer.base import TransferError
from disagg.transfer.payload import block_views, byte_views, payload_shape, slice_views
from disagg.transfer.service import (
    BAD_REQUEST,
    ReadFuture,
    parse_parts,
    split_parts,
)
from disagg.transfer.tcp import IovCursor

N, L, H, B, D = 40, 4, 2, 4, 8
TOKEN = "runs-secret"
WAIT = 10.0
# Runs of 3, 2, 1, 2, 1 and 4 blocks, out of order: several non-contiguous runs.
SCATTERED = [5, 6, 7, 2, 3, 11, 0, 1, 20, 30, 31, 32, 33]


def make_kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, L, 2, H, B, D, generator=g)


def concat(views: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).view(torch.uint8) for v in views])


# ---- the views of a payload ------------------------------------------------------------------


def test_block_views_are_runs_of_the_cache_in_payload_order() -> None:
    kv = make_kv(0)
    views = block_views(kv, SCATTERED, (0, L), (0, H))
    assert views is not None and len(views) == 6  # one view per run of consecutive ids
    assert all(v.data_ptr() >= kv.data_ptr() for v in views)  # views, not copies
    req = ReadRequest("x", SCATTERED, (0, L), (0, H))
    assert same_bytes(concat(views), expected(kv, req).reshape(-1).view(torch.uint8))


def test_block_views_of_a_layer_range_are_one_per_block_and_heads_subset_has_none() -> None:
    kv = make_kv(1)
    views = block_views(kv, SCATTERED, (1, 3), (0, H))  # pp differs: a layer range
    assert views is not None and len(views) == len(SCATTERED)
    req = ReadRequest("x", SCATTERED, (1, 3), (0, H))
    assert same_bytes(concat(views), expected(kv, req).reshape(-1).view(torch.uint8))
    assert block_views(kv, SCATTERED, (0, L), (0, 1)) is None  # K and V split per layer


def test_slice_views_picks_the_byte_range_across_views() -> None:
    data = np.arange(30, dtype=np.uint8)
    views = [data[0:7], data[7:8], data[8:20], data[20:30]]
    for a, b in [(0, 30), (3, 9), (7, 8), (8, 20), (19, 21), (29, 30)]:
        got = slice_views(views, a, b)
        assert np.array_equal(np.concatenate(got), data[a:b]), (a, b)
        assert all(g.base is not None for g in got)  # still views of `data`
    assert len(slice_views(views, 8, 20)) == 1  # inside one view: sent as it is


def test_iov_cursor_batches_at_most_max_iov_and_resumes_mid_view() -> None:
    views = [np.full(n, i, dtype=np.uint8) for i, n in enumerate([5, 3, 0, 7, 2, 4])]
    cur = IovCursor(views, max_iov=2)
    assert cur.total == 21
    seen = bytearray()
    steps = iter([4, 1, 5, 2, 1, 3])  # partial sends: some end inside a view, some on an edge
    while not cur.done:
        batch = cur.batch()
        assert 1 <= len(batch) <= 2
        data = b"".join(bytes(b) for b in batch)
        step = min(next(steps, len(data)), len(data))
        seen += data[:step]
        cur.advance(step)
    assert cur.position == 21
    assert bytes(seen) == b"".join(v.tobytes() for v in views)


def test_parts_are_validated_and_split_within_buffers() -> None:
    assert parse_parts(None, 10) == [10]
    assert parse_parts([4, 6], 10) == [4, 6]
    for bad in ([4, 5], [10, 0], "10", [True, 9], list(range(1, 5000))):
        with pytest.raises(TransferError) as e:
            parse_parts(bad, 10)
        assert e.value.code == BAD_REQUEST
    cuts = split_parts([40 << 20, 1 << 20])
    assert all(b - a <= 16 << 20 for _, a, b in cuts)  # at most the part size
    for i, n in enumerate([40 << 20, 1 << 20]):  # each buffer covered, in order, no gaps
        mine = [(a, b) for j, a, b in cuts if j == i]
        assert mine[0][0] == 0 and mine[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(mine, mine[1:], strict=False))


# ---- server and client ---------------------------------------------------------------------


class Rig:
    def __init__(self, backend: str, kv: torch.Tensor | None = None, runs: bool = True) -> None:
        self.kv = make_kv(2) if kv is None else kv
        self.leases = LeaseTable(default_ttl_s=60.0)
        self.server = KVTransferServer(self.kv, self.leases, TOKEN, backend, runs=runs).start()
        self.client = KVTransferClient(backend, TOKEN, timeout_s=WAIT, runs=runs)
        self.address = self.server.address

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture(params=BACKENDS)
def rig(request: pytest.FixtureRequest) -> Any:
    r = Rig(request.param)
    yield r
    r.close()


@pytest.mark.parametrize("layers", [(0, L), (1, 3)])
def test_scattered_table_into_one_buffer_exact_and_not_staged(rig: Rig,
                                                              layers: tuple[int, int]) -> None:
    rig.leases.create("a", SCATTERED, readers=1)
    req = ReadRequest("a", SCATTERED, layers, (0, H))
    out = torch.full(payload_shape(tuple(rig.kv.shape), req), -3.0)
    res = rig.client.read(rig.address, req, out).result(WAIT)
    assert same_bytes(out, expected(rig.kv, req))
    if rig.client.backend.stream_payloads:  # TCP: straight from the cache's runs
        assert res.zero_copy and rig.server.payload.staging.allocations == 0
    else:  # UCX: parts spanning runs are gathered (into staging), part by part
        assert not res.zero_copy


def test_scattered_table_straight_into_scattered_receiver_blocks(rig: Rig) -> None:
    """The receiver's own table is scattered too (other runs than the sender's): the payload
    lands in exactly its blocks, every other block untouched."""
    dst_ids = [9, 10, 3, 4, 5, 6, 17, 25, 26, 27, 0, 1, 2]
    dst = torch.full((N, L, 2, H, B, D), 5.0)
    before = dst.clone()
    rig.leases.create("a", SCATTERED, readers=1)
    req = ReadRequest("a", SCATTERED, (0, L), (0, H))
    views = block_views(dst, dst_ids, (0, L), (0, H))
    assert views is not None and len(views) == 5
    rig.client.read(rig.address, req, views).result(WAIT)
    for i, b in enumerate(dst_ids):
        assert same_bytes(dst[b], rig.kv[SCATTERED[i]])
    others = [b for b in range(N) if b not in dst_ids]
    assert same_bytes(dst[others], before[others])


def test_more_runs_than_iov_max_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table of 1100 single-block runs on both sides: more buffers than one sendmsg /
    recvmsg_into takes (IOV_MAX, 1024 on Linux); then a tiny IOV_MAX, forcing many calls."""
    kv = torch.randn(1200, 1, 2, 1, 2, 4)  # 64 bytes a block
    ids = [int(b) for b in np.random.default_rng(0).permutation(1200)[:1100]]
    dst = torch.zeros(2200, 1, 2, 1, 2, 4)
    dst_ids = list(range(0, 2200, 2))  # every other block: 1100 runs
    r = Rig("tcp", kv)
    try:
        r.leases.create("a", ids, readers=1)
        req = ReadRequest("a", ids, (0, 1), (0, 1))
        batches: list[int] = []
        real_batch = IovCursor.batch

        def spy(self: IovCursor) -> list[memoryview]:
            out = real_batch(self)
            batches.append(len(out))
            return out

        monkeypatch.setattr(IovCursor, "batch", spy)
        assert tcp_mod.IOV_MAX < 1100
        for iov_max in (tcp_mod.IOV_MAX, 7):
            monkeypatch.setattr(tcp_mod, "IOV_MAX", iov_max)
            dst.zero_()
            batches.clear()
            views = block_views(dst, dst_ids, (0, 1), (0, 1))
            assert views is not None and len(views) == 1100
            r.client.read(r.address, req, views).result(WAIT)
            # both sides cut their 1100 buffers into batches of at most IOV_MAX
            assert max(batches) == iov_max and len(batches) >= 2 * -(-1100 // iov_max)
            assert same_bytes(dst[dst_ids], kv[ids])
            assert not dst[1::2].any()
    finally:
        r.close()


def test_runs_off_is_the_staged_path(request: pytest.FixtureRequest) -> None:
    r = Rig("tcp", runs=False)
    try:
        r.leases.create("a", SCATTERED, readers=1)
        req = ReadRequest("a", SCATTERED, (0, L), (0, H))
        out = torch.empty(payload_shape(tuple(r.kv.shape), req))
        res = r.client.read(r.address, req, out).result(WAIT)
        assert same_bytes(out, expected(r.kv, req))
        assert not res.zero_copy and r.server.payload.staging.allocations == 1
    finally:
        r.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_read_into_blocks_stops_writing_before_cancel_returns(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server sends part of the payload, then stalls; the reader cancels. Once
    ``cancel_and_wait`` returns (the blocks would be freed now), the rest of the payload may
    go out: not one more byte lands in the blocks."""
    from disagg.transfer.tcp import TcpConnection
    from disagg.transfer.ucx import UcxConnection

    r = Rig(backend)
    go, stalled, sent = threading.Event(), threading.Event(), threading.Event()

    async def wait_for(ev: threading.Event) -> None:
        await asyncio.get_running_loop().run_in_executor(None, ev.wait, WAIT)

    async def tcp_stall(self: TcpConnection, views: Any) -> None:
        first = views[0]
        await self._send(memoryview(first).cast("B")[: first.nbytes // 2])
        stalled.set()
        await wait_for(go)
        try:
            await self._send(memoryview(first).cast("B")[first.nbytes // 2:])
            for v in views[1:]:
                await self._send(memoryview(v).cast("B"))
        finally:
            sent.set()

    real_parts = UcxConnection.send_payload_parts

    async def ucx_stall(self: UcxConnection, parts: Any, count: int) -> None:
        stalled.set()
        await wait_for(go)
        try:
            await real_parts(self, parts, count)
        finally:
            sent.set()

    monkeypatch.setattr(TcpConnection, "send_payload_iov", tcp_stall)
    monkeypatch.setattr(UcxConnection, "send_payload_parts", ucx_stall)
    try:
        r.leases.create("a", SCATTERED, readers=1)
        req = ReadRequest("a", SCATTERED, (0, L), (0, H))
        dst = torch.full((N, L, 2, H, B, D), 5.0)
        views = block_views(dst, list(range(len(SCATTERED))), (0, L), (0, H))
        fut = r.client.read(r.address, req, views)
        assert stalled.wait(WAIT)
        assert r.client.cancel_and_wait(fut, WAIT) and fut.quiet.is_set()
        snapshot = dst.clone()
        go.set()
        assert sent.wait(WAIT)
        assert same_bytes(dst, snapshot)
        assert fut.cancelled()
    finally:
        go.set()
        r.close()


def test_cancel_reads_calls_back_once_direct_reads_are_quiet() -> None:
    """``cancel_reads`` returns at once; its callback runs once every read into the blocks is
    quiet (here a thread that stands in for the transport finishes its write first), on
    another thread; private-buffer reads are not waited for."""
    fut = ReadFuture()
    go, stopped, called = threading.Event(), [], threading.Event()
    order: list[str] = []

    def transport() -> None:
        assert go.wait(WAIT)  # the transport unwinds only after cancel_reads returned
        stopped.append(fut.cancelled())
        order.append("quiet")
        fut.quiet.set()

    t = threading.Thread(target=transport)
    t.start()
    never = ReadFuture()  # a private-buffer read whose transport never reports
    reads = [Read(None, None, None, fut),  # type: ignore[arg-type]
             Read(None, None, torch.empty(1), never)]  # type: ignore[arg-type]
    cancel_reads(reads, lambda: (order.append("callback"), called.set()), timeout_s=WAIT)
    assert not called.is_set() and never.cancelled()  # returned without waiting
    go.set()
    assert called.wait(WAIT)
    assert stopped == [True] and order == ["quiet", "callback"]
    t.join(WAIT)


def test_cancel_reads_with_nothing_writing_calls_back_at_once() -> None:
    quiet = ReadFuture()
    quiet.quiet.set()
    calls: list[int] = []
    cancel_reads([Read(None, None, None, quiet)], lambda: calls.append(1))  # type: ignore
    cancel_reads([], lambda: calls.append(2))
    assert calls == [1, 2]


def test_cancel_reads_gives_up_after_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """A transport that never stops: the callback still comes (blocks are always freed),
    with an error logged."""
    called = threading.Event()
    cancel_reads([Read(None, None, None, ReadFuture())],  # type: ignore[arg-type]
                 called.set, timeout_s=0.05)
    assert called.wait(WAIT)
    assert "did not stop within" in caplog.text


# ---- the generation side's pull ------------------------------------------------------------


def layout(tp: int = 1, pp: int = 1, block: int = B) -> WorkerLayout:
    ranks = []
    for p in range(pp):
        for t in range(tp):
            nl, nh = L // pp, H // tp
            ranks.append(RankLayout(p * tp + t, t, p, (p * nl, (p + 1) * nl),
                                    (t * nh, (t + 1) * nh)))
    return WorkerLayout(tp_size=tp, pp_size=pp, num_layers=L, num_kv_heads=H, head_dim=D,
                        tokens_per_block=block, dtype="float32", ranks=tuple(ranks))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_lands_in_the_request_blocks_and_installs_nothing(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.transfer import service

    r = Rig(backend)
    if backend == "ucx":
        # One message per run pays for runs of >= 1 MiB; these test blocks are 2 KiB.
        assert not r.client.accepts_segments([16 << 10, 10 << 10])
        assert r.client.accepts_segments([26 << 10])  # one buffer: one message anyway
        monkeypatch.setattr(service, "DIRECT_PART_MIN_BYTES", 1 << 10)
    try:
        src = layout()
        num_tokens = len(SCATTERED) * B - 1  # the last block partly used
        r.leases.create("a", SCATTERED, readers=1)
        params = ContextParams(
            ctx_request_id="a", first_gen_tokens=[1], prompt_token_ids=[1] * num_tokens,
            worker_id="w", backend=backend.upper(), addresses=[r.address],
            block_ids=SCATTERED, num_tokens=num_tokens, layout=src, lease_expiry=0.0)
        dst_kv = torch.zeros(N, L, 2, H, B, D)
        dst_ids = [12, 13, 14, 15, 16, 17, 18, 19, 3, 4, 5, 6, 7]  # two runs
        done: list[cf.Future] = []
        puller = KVPuller(dst_kv, layout(), 0, lambda _backend: r.client)
        pull = puller.start("g", params, dst_ids, done.append)
        assert [rd.direct for rd in pull.reads] == [True]
        for rd in pull.reads:
            rd.future.result(WAIT)
        assert pull.done and len(done) == 1
        assert puller.finish(pull) == Loaded()  # nothing left to copy
        for i, b in enumerate(dst_ids):
            assert same_bytes(dst_kv[b], r.kv[SCATTERED[i]])
    finally:
        r.close()


def test_pull_converts_where_layouts_differ() -> None:
    """tp 1 -> tp 2: each receiving rank holds all of its own heads, so its head slice
    lands in its blocks directly (the sender gathers the subset); another block size
    ("tokens" format) goes through a receive buffer + install. Both exact."""
    r = Rig("tcp")
    try:
        num_tokens = len(SCATTERED) * B
        r.leases.create("a", SCATTERED, readers=2)
        params = ContextParams(
            ctx_request_id="a", first_gen_tokens=[1], prompt_token_ids=[1] * num_tokens,
            worker_id="w", backend="TCP", addresses=[r.address], block_ids=SCATTERED,
            num_tokens=num_tokens, layout=layout(), lease_expiry=0.0)
        for dst, ids in ((layout(tp=2), list(range(13))), (layout(block=2 * B),
                                                           list(range(7)))):
            rank = 1 if dst.tp_size == 2 else 0
            rl = dst.ranks[rank]
            nh = rl.kv_head_range[1] - rl.kv_head_range[0]
            kv = torch.zeros(N, L, 2, nh, dst.tokens_per_block, D)
            puller = KVPuller(kv, dst, rank, lambda _backend: r.client)
            pull = puller.start("g", params, ids)
            assert [rd.direct for rd in pull.reads] == [dst.tokens_per_block == B]
            for rd in pull.reads:
                rd.future.result(WAIT)
            assert puller.finish(pull) == Loaded()
            (h0, h1) = rl.kv_head_range
            want = r.kv[SCATTERED][:, :, :, h0:h1]  # [n, L, 2, nh, B, D] in table order
            got = kv[ids].permute(1, 2, 3, 0, 4, 5).reshape(L, 2, nh, -1, D)
            assert same_bytes(got[:, :, :, :num_tokens],
                              want.permute(1, 2, 3, 0, 4, 5).reshape(L, 2, nh, -1, D))
        assert plan_pulls(layout(), layout(tp=2), 1)
    finally:
        r.close()


def test_byte_views_share_memory() -> None:
    t = torch.arange(8, dtype=torch.float32)
    (v,) = byte_views([t])
    v[:4] = 0
    assert t[0].item() == 0.0
