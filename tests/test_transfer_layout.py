"""Layout conversion: every (ctx tp, pp) x (gen tp, pp) pair reassembles the exact KV."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from disagg.kv_connector.kvcopy import gather_tokens, scatter_tokens
from disagg.layout import (
    RankLayout,
    WorkerLayout,
    plan_pulls,
    readers_per_context_rank,
)
from disagg.transfer.base import ReadRequest
from disagg.transfer.payload import gather_into, payload_shape

L, H, D = 4, 2, 8  # layers, kv heads, head dim


def make_layout(tp: int, pp: int, block: int, num_layers: int = L,
                num_heads: int = H) -> WorkerLayout:
    """Even layer split per stage; heads split per tensor rank, replicated when tp > heads."""
    ranks = []
    for p, t in itertools.product(range(pp), range(tp)):
        layers = (p * num_layers // pp, (p + 1) * num_layers // pp)
        if tp <= num_heads:
            heads = (t * num_heads // tp, (t + 1) * num_heads // tp)
        else:
            h = t // (tp // num_heads)
            heads = (h, h + 1)
        ranks.append(RankLayout(p * tp + t, t, p, layers, heads))
    return WorkerLayout(tp, pp, num_layers, num_heads, D, block, "float32", tuple(ranks))


def place(full: torch.Tensor, layout: WorkerLayout, rng: random.Random):
    """Scatter a request's global KV ``[L, 2, H, T, D]`` into each rank's paged cache with a
    shuffled (non-contiguous) block table; returns per-rank (cache, block table)."""
    T = full.shape[3]
    B = layout.tokens_per_block
    nb = -(-T // B)
    out = []
    for r in layout.ranks:
        nl = r.layer_range[1] - r.layer_range[0]
        nh = r.kv_head_range[1] - r.kv_head_range[0]
        cache = torch.zeros(nb + 5, nl, 2, nh, B, D)
        table = rng.sample(range(nb + 5), nb)
        local = full[r.layer_range[0]:r.layer_range[1], :, r.kv_head_range[0]:r.kv_head_range[1]]
        scatter_tokens(cache, table, local, (0, nl), (0, nh))
        out.append((cache, table))
    return out


PAIRS = [(tp, pp) for tp in (1, 2) for pp in (1, 2)]


@pytest.mark.parametrize("src_tp,src_pp", PAIRS)
@pytest.mark.parametrize("dst_tp,dst_pp", PAIRS)
@pytest.mark.parametrize("src_block,dst_block", [(4, 4), (4, 8), (8, 2)])
def test_every_pair_reassembles_exactly(src_tp, src_pp, dst_tp, dst_pp, src_block, dst_block):
    rng = random.Random(src_tp * 100 + src_pp * 10 + dst_tp + dst_pp + src_block)
    T = 19
    full = torch.randn(L, 2, H, T, D, generator=torch.Generator().manual_seed(0))
    src = make_layout(src_tp, src_pp, src_block)
    dst = make_layout(dst_tp, dst_pp, dst_block)
    src_caches = place(full, src, rng)
    dst_caches = place(torch.zeros_like(full), dst, rng)  # allocated blocks, empty
    for d in dst.ranks:
        pieces = plan_pulls(src, dst, d.rank)
        assert len({p.src_rank for p in pieces}) == len(pieces)  # one read per rank pair
        for p in pieces:
            # The context side's real read path: a "tokens" READ gathered by the server code.
            cache, table = src_caches[p.src_rank]
            req = ReadRequest("lease", table, p.src_layer_slice, p.src_head_slice,
                              num_tokens=T, format="tokens")
            payload = torch.empty(payload_shape(tuple(cache.shape), req), dtype=cache.dtype)
            gather_into(cache, req, payload)
            dcache, dtable = dst_caches[d.rank]
            scatter_tokens(dcache, dtable, payload, p.dst_layer_slice, p.dst_head_slice)
    for d in dst.ranks:
        dcache, dtable = dst_caches[d.rank]
        nl = d.layer_range[1] - d.layer_range[0]
        nh = d.kv_head_range[1] - d.kv_head_range[0]
        got = gather_tokens(dcache, dtable, T, (0, nl), (0, nh))
        want = full[d.layer_range[0]:d.layer_range[1], :, d.kv_head_range[0]:d.kv_head_range[1]]
        assert torch.equal(got, want)


def test_replicated_heads_read_once_and_spread():
    # 1 kv head, tp 2 on both sides: both ranks hold head 0; each generation rank reads from
    # the context rank with its own tensor index.
    src = make_layout(2, 1, 4, num_heads=1)
    dst = make_layout(2, 1, 4, num_heads=1)
    assert [(p.src_rank, p.heads) for p in plan_pulls(src, dst, 0)] == [(0, (0, 1))]
    assert [(p.src_rank, p.heads) for p in plan_pulls(src, dst, 1)] == [(1, (0, 1))]
    # context tp2 (replicated) -> generation tp1: only one read.
    one = make_layout(1, 1, 4, num_heads=1)
    assert [p.src_rank for p in plan_pulls(src, one, 0)] == [0]
    assert readers_per_context_rank(src, one) == {0: 1, 1: 0}


def test_plan_ranges_exact():
    src = make_layout(2, 2, 4)   # r0 L[0,2) H[0,1), r1 L[0,2) H[1,2), r2 L[2,4) H[0,1), r3 ...
    dst = make_layout(1, 2, 4)   # r1 needs L[2,4) H[0,2)
    pieces = plan_pulls(src, dst, 1)
    assert [(p.src_rank, p.layers, p.heads, p.src_layer_slice, p.dst_layer_slice,
             p.dst_head_slice) for p in pieces] == [
        (2, (2, 4), (0, 1), (0, 2), (0, 2), (0, 1)),
        (3, (2, 4), (1, 2), (0, 2), (0, 2), (1, 2)),
    ]
    assert readers_per_context_rank(src, dst) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_layout_round_trip_and_validation():
    lay = make_layout(2, 2, 16)
    assert WorkerLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ValueError, match="malformed"):
        WorkerLayout.from_dict({"tp_size": 1})
    bad = lay.to_dict()
    bad["ranks"][1]["kv_head_range"] = [0, 1]  # head 1 of layers 0-1 held by nobody
    with pytest.raises(ValueError, match="missing kv heads"):
        WorkerLayout.from_dict(bad)
    other = make_layout(1, 1, 16, num_layers=L + 1)
    with pytest.raises(ValueError, match="num_layers differs"):
        plan_pulls(lay, other, 0)


def test_bfloat16_and_bad_block_count():
    kv = torch.zeros(4, 1, 2, 1, 4, D, dtype=torch.bfloat16)
    payload = torch.randn(1, 2, 1, 7, D).to(torch.bfloat16)
    scatter_tokens(kv, [3, 1], payload, (0, 1), (0, 1))
    assert torch.equal(gather_tokens(kv, [3, 1], 7, (0, 1), (0, 1)), payload)
    with pytest.raises(ValueError, match="cannot hold"):
        gather_tokens(kv, [3], 7, (0, 1), (0, 1))
