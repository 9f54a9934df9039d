"""End-to-end KV payload checksums (issue 41, item 3): ``integrity.payload_checksum`` and its
use by ``KVTransferServer`` / ``KVTransferClient``.

A byte flipped on the wire (a TCP relay that flips one byte of the payload) or in the
reader's buffer after it landed (TCP and UCX) fails that read with ``integrity_error``,
counted by the client's stats; the same corruption with the check off is read as if it were
fine (the check is what catches it). Reads into the reader's own blocks (a list ``out``) and
scattered reads (gathered on the server) are checked too."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from transfer_fixtures import BACKENDS, FlippingRelay, expected, same_bytes

from disagg.transfer import KVTransferClient, KVTransferServer, LeaseTable, ReadRequest
from disagg.transfer.base import TransferError
from disagg.transfer.integrity import INTEGRITY_ERROR, payload_checksum
from disagg.transfer.payload import block_views, payload_shape
from disagg.transfer.tcp import TcpConnection
from disagg.transfer.ucx import UcxConnection

N, L, H, B, D = 32, 4, 4, 16, 32  # 32 KiB per float32 block
TOKEN = "integrity-secret"
WAIT = 20.0


def make_kv(seed: int = 41) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, L, 2, H, B, D, generator=g)


# ---- the checksum --------------------------------------------------------------------------


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", [4, 4096, (1 << 20) + 12, (3 << 20) + 7])
def test_checksum_does_not_depend_on_how_the_stream_is_cut(n: int) -> None:
    data = _bytes(n)
    whole = payload_checksum([data])
    rng = random.Random(n)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, n), min(5, n - 1)))
        views = [data[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        assert payload_checksum(views) == whole, cuts
    # word-aligned cuts (the payload parts' case) go view by view, unjoined
    aligned = [data[a:a + 4096] for a in range(0, n, 4096)]
    assert payload_checksum(aligned) == whole
    # a torch tensor view of the same bytes, and an empty view, change nothing
    assert payload_checksum([torch.from_numpy(data.copy()), data[:0]]) == whole


def test_checksum_catches_every_single_bit_flip_and_moved_words() -> None:
    data = _bytes((1 << 20) + 64, seed=1)
    whole = payload_checksum([data])
    rng = random.Random(7)
    for _ in range(200):
        pos, bit = rng.randrange(data.size), rng.randrange(8)
        bad = data.copy()
        bad[pos] ^= 1 << bit
        assert payload_checksum([bad]) != whole, (pos, bit)
    words = data.view(np.uint32)
    for a, b in [(0, 1), (5, 200_000), (1000, 1001), (0, words.size - 1)]:
        if words[a] == words[b]:
            continue
        swapped = words.copy()
        swapped[[a, b]] = swapped[[b, a]]
        assert payload_checksum([swapped.view(np.uint8)]) != whole, (a, b)
    # a block landing in another block's place (two 32 KiB runs exchanged)
    moved = data.copy()
    moved[:32768], moved[32768:65536] = data[32768:65536], data[:32768]
    assert payload_checksum([moved]) != whole


@pytest.mark.gpu
def test_checksum_is_the_same_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    data = _bytes((2 << 20) + 8, seed=3)
    on_gpu = torch.from_numpy(data).cuda()
    assert payload_checksum([on_gpu[:1000], on_gpu[1000:]]) == payload_checksum([data])


# ---- through the transfer service -----------------------------------------------------------


@pytest.fixture()
def served(request: pytest.FixtureRequest) -> Iterator[tuple[torch.Tensor, LeaseTable,
                                                              KVTransferServer]]:
    backend = getattr(request, "param", "tcp")
    kv = make_kv()
    leases = LeaseTable()
    server = KVTransferServer(kv, leases, TOKEN, backend).start()
    try:
        yield kv, leases, server
    finally:
        server.stop()


def _read(client: KVTransferClient, address: str, kv: torch.Tensor, req: ReadRequest
          ) -> torch.Tensor:
    out = torch.full(payload_shape(tuple(kv.shape), req), -7.0)
    client.read(address, req, out).result(WAIT)
    return out


def test_a_bit_flipped_on_the_wire_fails_the_read(served: Any) -> None:
    kv, leases, server = served
    leases.create("l", list(range(N)), readers=2, ttl_s=60.0)
    req = ReadRequest("l", list(range(N)), (0, L), (0, H))  # 1 MiB, one message
    relay = FlippingRelay(server.address, flip_at=300_000)
    try:
        with KVTransferClient("tcp", TOKEN, timeout_s=WAIT) as client:
            with pytest.raises(TransferError) as e:
                _read(client, relay.address, kv, req)
            assert e.value.code == INTEGRITY_ERROR, e.value
            assert "does not match its checksum" in str(e.value)
            assert dict(client.stats.snapshot().failures_by_code) == {INTEGRITY_ERROR: 1}
        assert relay.flipped == 1
        # The check is what caught it: unchecked, the same flip is read as good data.
        with KVTransferClient("tcp", TOKEN, timeout_s=WAIT, integrity=False) as client:
            out = _read(client, relay.address, kv, req)
        assert relay.flipped == 2
        good = expected(kv, req)
        assert not same_bytes(out, good)
        assert int((out.view(torch.uint8) != good.view(torch.uint8)).sum()) == 1
    finally:
        relay.stop()
    # Straight to the server, the lease's next read is whole (nothing was corrupted there).
    with KVTransferClient("tcp", TOKEN, timeout_s=WAIT) as client:
        assert same_bytes(_read(client, server.address, kv, req), expected(kv, req))


@pytest.mark.parametrize("served", BACKENDS, indirect=True)
def test_a_payload_corrupted_on_arrival_fails_the_read(served: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    kv, leases, server = served
    backend = server.backend.name
    flips: list[int] = []

    def corrupting(orig: Any) -> Any:
        async def recv_payload_iov(self: Any, views: Any) -> None:
            await orig(self, views)
            if flips:
                views[-1][flips.pop()] ^= 0x01  # after the transport wrote it
        return recv_payload_iov

    for cls in (TcpConnection, UcxConnection):
        monkeypatch.setattr(cls, "recv_payload_iov", corrupting(cls.recv_payload_iov))
    blocks = [3, 4, 5, 9, 20, 21]  # scattered: the server gathers, parts over a message link
    leases.create("l", blocks, readers=9, ttl_s=60.0)
    with KVTransferClient(backend, TOKEN, timeout_s=WAIT) as client:
        for req in (ReadRequest("l", blocks, (0, L), (0, H)),
                    ReadRequest("l", blocks, (1, 3), (2, 4)),
                    ReadRequest("l", blocks, (0, L), (0, H), format="tokens",
                                num_tokens=len(blocks) * B - 5)):
            assert same_bytes(_read(client, server.address, kv, req), expected(kv, req))
            flips.append(17)
            with pytest.raises(TransferError) as e:
                _read(client, server.address, kv, req)
            assert e.value.code == INTEGRITY_ERROR, e.value
        # Into the reader's own blocks (a list out: the payload lands in them directly).
        mine = make_kv(seed=5)
        dst = [0, 1, 2, 7, 8, 30]
        req = ReadRequest("l", blocks, (0, L), (0, H))
        views = block_views(mine, dst, (0, L), (0, H))
        assert views is not None
        client.read(server.address, req, views).result(WAIT)
        assert same_bytes(mine[dst], kv[blocks])
        flips.append(0)
        with pytest.raises(TransferError) as e:
            client.read(server.address, req, block_views(mine, dst, (0, L), (0, H))
                        ).result(WAIT)
        assert e.value.code == INTEGRITY_ERROR
        assert dict(client.stats.snapshot().failures_by_code) == {INTEGRITY_ERROR: 4}
