"""The Triton grouped-experts kernels (``disagg/model/triton_moe.py``) on CPU under the Triton
interpreter, against ``moe.grouped_experts``; run in a child process with
``TRITON_INTERPRET=1`` as ``test_triton_norm.py`` does. Skipped where triton is not installed
(CI); the pair layout they read is plain PyTorch and tested everywhere."""

from __future__ import annotations

import importlib

import pytest
import torch
from triton_fixtures import in_interpreter, run_interpreter_tests, spawns_interpreter

from disagg.model.moe import grouped_experts, softmax_topk
from disagg.model.triton_moe import (
    BLOCK_MS,
    SMEM_BUDGET,
    pair_layout,
    pick_block_m,
    pick_tiles,
    tiles_for,
)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("t,k,num_local,start", [(1, 2, 6, 0), (9, 2, 6, 0), (40, 3, 6, 0),
                                                 (40, 3, 3, 3), (5, 2, 2, 4), (200, 2, 8, 0)])
def test_pair_layout_places_each_local_pair_once(t, k, num_local, start, block_m) -> None:
    g = torch.Generator().manual_seed(t)
    _, ids = softmax_topk(torch.randn(t, 8, generator=g), k, renormalize=False)
    slot_pair, block_expert = pair_layout(ids, start, num_local, block_m)
    pairs = t * k
    assert slot_pair.shape[0] == block_expert.shape[0] * block_m
    # The launch bound holds whatever the routing: ceil(P / BM) + E_local blocks.
    assert block_expert.shape[0] == -(-pairs // block_m) + num_local
    expert_of_pair = ids.t().reshape(-1) - start  # pair j * T + t
    placed = slot_pair[slot_pair < pairs].tolist()
    mine = [p for p in range(pairs) if 0 <= expert_of_pair[p] < num_local]
    assert sorted(placed) == mine  # every local pair once, no other
    for b, e in enumerate(block_expert.tolist()):
        rows = slot_pair[b * block_m:(b + 1) * block_m]
        live = rows[rows < pairs]
        if e == num_local:  # unused block
            assert live.numel() == 0
        else:
            assert (expert_of_pair[live] == e).all()


def test_block_m_follows_the_rows_per_expert() -> None:
    """Twice the mean rows per local expert, a power of two in [16, 128]."""
    assert pick_block_m(8, 128) == 16             # Qwen3-30B-A3B decode, 1 token (top-8)
    assert pick_block_m(64 * 8, 128) == 16        # 64 tokens: 4 rows per expert
    assert pick_block_m(512 * 8, 128) == 64       # 512 tokens: 32 rows per expert
    assert pick_block_m(4096 * 8, 128) == 128     # prefill: 256 rows per expert
    assert pick_block_m(2, 8) == 16               # Mixtral-8x7B, 1 token (top-2)
    assert pick_block_m(64 * 2, 8) == 32          # 16 rows per expert
    assert pick_block_m(512 * 2, 8) == 128
    assert pick_block_m(0, 8) == 16 and pick_block_m(5, 0) == 16  # degenerate shapes
    for pairs in range(0, 5000, 37):
        assert pick_block_m(pairs, 16) in BLOCK_MS


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("block_m", BLOCK_MS)
def test_tiles_fit_shared_memory(block_m: int, itemsize: int) -> None:
    tiles = tiles_for(block_m, itemsize)
    assert tiles.block_m == block_m
    gate_up = (block_m + 2 * tiles.gate_up_n) * tiles.gate_up_k * itemsize
    down = (block_m + tiles.down_n) * tiles.down_k * itemsize
    assert gate_up * tiles.gate_up_stages <= SMEM_BUDGET
    assert down * tiles.down_stages <= SMEM_BUDGET
    assert tiles.gate_up_stages >= 2 and tiles.down_stages >= 2  # pipelined
    for n in (tiles.gate_up_n, tiles.gate_up_k, tiles.down_n, tiles.down_k):
        assert n >= 16 and n & (n - 1) == 0  # tl.dot: powers of two, at least 16
    assert pick_tiles(1 << 20, 4, itemsize) == tiles_for(128, itemsize)
    with pytest.raises(ValueError, match="block_m"):
        tiles_for(48, itemsize)


@spawns_interpreter
def test_kernels_in_interpreter_process() -> None:
    run_interpreter_tests(__file__)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,lo,hi", [(1, 0, 6), (7, 0, 6), (40, 0, 6), (40, 2, 5)])
@pytest.mark.parametrize("block_m", [None, *BLOCK_MS])
def test_kernels_are_grouped_experts(dtype: torch.dtype, t: int, lo: int, hi: int,
                                     block_m: int | None) -> None:
    """Every tile configuration (None: the one pick_tiles chooses), masked tails included."""
    tm = importlib.import_module("disagg.model.triton_moe")
    # Not multiples of the 32- to 128-wide tiles (masked tails), several K steps and column
    # tiles; 40 tokens make 11 blocks of 16 rows: a full and a partial group of GROUP_M.
    e, k, h, i = 6, 2, 160, 136
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    w, ids = softmax_topk(torch.randn(t, e, generator=g), k, renormalize=True)
    if lo:  # and router weights in the activations' dtype, as Qwen3-MoE gives them
        w = w.to(dtype)
    tiles = None if block_m is None else tm.tiles_for(block_m, x.element_size())
    got = tm.triton_grouped_experts(x, ids, w, w13[lo:hi].contiguous(), w2[lo:hi].contiguous(),
                                    lo, tiles)
    want = grouped_experts(x, ids, w, w13[lo:hi], w2[lo:hi], lo)
    assert got.dtype == dtype and got.shape == (t, h)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)

