"""The server's gather / zero-copy decisions against straightforward advanced-indexing
references (no sockets)."""

from __future__ import annotations

import pytest
import torch

from disagg.transfer.base import ReadRequest, TransferError
from disagg.transfer.payload import (
    StagingPool,
    consecutive_runs,
    gather_into,
    payload_shape,
    plan_read,
)

N, L, H, B, D = 16, 4, 4, 8, 8


def make_kv(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, L, 2, H, B, D, generator=g).to(dtype)


def expected(kv: torch.Tensor, req: ReadRequest) -> torch.Tensor:
    """Reference: index the blocks, slice, and for "tokens" flatten the block table."""
    (l0, l1), (h0, h1) = req.layer_slice, req.head_slice
    sel = kv[list(req.block_ids)][:, l0:l1, :, h0:h1]  # [n, nl, 2, nh, B, D]
    if req.format == "blocks":
        return sel.contiguous()
    n, nl, _, nh, b, d = sel.shape
    seq = sel.permute(1, 2, 3, 0, 4, 5).reshape(nl, 2, nh, n * b, d)
    return seq[:, :, :, :req.num_tokens].contiguous()


def run(kv: torch.Tensor, req: ReadRequest) -> tuple[torch.Tensor, bool]:
    plan = plan_read(kv, req, frozenset(req.block_ids))
    assert plan.shape == payload_shape(tuple(kv.shape), req)
    if plan.zero_copy is not None:  # [n, nl, 2, nh, B, D]; bytes == the payload's
        return plan.zero_copy.reshape(plan.shape), True
    out = torch.full(plan.shape, 7, dtype=kv.dtype)
    assert out.numel() * out.element_size() == plan.nbytes
    gather_into(kv, req, out)
    return out, False


def test_consecutive_runs() -> None:
    assert consecutive_runs((5,)) == [(0, 5, 1)]
    assert consecutive_runs((3, 4, 5, 9, 1, 2)) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ids,layers,heads,fmt,tokens,zero_copy",
    [
        ((3, 4, 5, 6), (0, L), (0, H), "blocks", 0, True),  # one run, full slices
        ((9,), (1, 3), (0, H), "blocks", 0, True),  # one block, full heads: contiguous
        ((9,), (0, L), (1, 3), "blocks", 0, False),
        ((3, 4, 5, 6), (1, 3), (0, H), "blocks", 0, False),
        ((11, 2, 3, 15, 0), (1, 4), (2, 4), "blocks", 0, False),
        ((11, 2, 3, 15, 0), (0, L), (0, H), "tokens", 4 * B + 3, False),  # partial last block
        ((7, 8, 9), (0, 2), (1, 2), "tokens", 3 * B, False),
        ((5,), (0, L), (0, H), "tokens", B, True),  # one full block == its token layout
        ((5,), (0, L), (0, H), "tokens", 3, False),
        ((1, 2, 12, 13, 14), (2, 3), (0, 3), "tokens", 4 * B + 1, False),
    ],
)
def test_gather_matches_reference(
    dtype: torch.dtype, ids: tuple[int, ...], layers: tuple[int, int],
    heads: tuple[int, int], fmt: str, tokens: int, zero_copy: bool,
) -> None:
    kv = make_kv(dtype)
    req = ReadRequest("L", ids, layers, heads, num_tokens=tokens, format=fmt)
    got, zc = run(kv, req)
    assert zc == zero_copy
    ref = expected(kv, req)
    assert got.shape == ref.shape
    assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))
    if zc:  # really the cache's memory, not a copy
        assert got.data_ptr() == kv[ids[0], layers[0]].data_ptr()


@pytest.mark.parametrize(
    "kw,leased,match",
    [
        (dict(block_ids=(N,)), None, "block id"),
        (dict(layer_slice=(0, L + 1)), None, "layer_slice"),
        (dict(head_slice=(2, H + 1)), None, "head_slice"),
        (dict(block_ids=(1, 2)), frozenset({1}), "outside the lease"),
        (dict(block_ids=(1, 2), format="tokens", num_tokens=2 * B + 1), None, "num_tokens"),
        (dict(block_ids=(1, 2), format="tokens", num_tokens=B), None, "num_tokens"),
    ],
)
def test_plan_rejects(kw: dict, leased: frozenset[int] | None, match: str) -> None:
    base = dict(lease_id="L", block_ids=(1,), layer_slice=(0, L), head_slice=(0, H))
    base.update(kw)
    with pytest.raises(TransferError, match=match) as e:
        plan_read(make_kv(), ReadRequest(**base), leased)  # type: ignore[arg-type]
    assert e.value.code == "bad_request"


def test_staging_pool_reuses_buffers() -> None:
    pool = StagingPool(max_buffers=2)
    a = pool.acquire(1000)
    pool.release(a)
    assert pool.acquire(800) is a and pool.allocations == 1
    b = pool.acquire(500)  # `a` is lent out: a second buffer
    pool.release(a)
    pool.release(b)
    big = pool.acquire(5000)  # too big for both: replaces the largest
    assert pool.allocations == 3 and big.numel() == 5000
    pool.release(big)
    assert pool.acquire(4000) is big


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_format_matches_kvcopy(dtype: torch.dtype) -> None:
    """The server's allocation-free "tokens" gather agrees with the layout side's
    ``kvcopy.gather_tokens`` (which the receiver's scatter mirrors)."""
    from disagg.kv_connector.kvcopy import gather_tokens

    kv = make_kv(dtype, seed=3)
    ids, tokens, layers, heads = (6, 2, 3, 11, 15), 4 * B + 5, (1, 4), (0, 3)
    req = ReadRequest("L", ids, layers, heads, num_tokens=tokens, format="tokens")
    got, _ = run(kv, req)
    ref = gather_tokens(kv, list(ids), tokens, layers, heads)
    assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))
