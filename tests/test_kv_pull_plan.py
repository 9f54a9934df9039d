"""The pull plan (``kv_connector/pull_plan.py``) without a transport: which reads a generation
rank makes, in which format, with which payload shape, and whether they may land in the
request's own blocks; streamed pulls cut into layer groups, the first token asked once."""

from __future__ import annotations

import pytest

from disagg.contracts.params import ContextParams, token_ids_hash
from disagg.kv_connector.pull_plan import STREAM_LAYER_GROUPS, plan_pull, stream_pieces
from disagg.layout import RankLayout, WorkerLayout, plan_pulls

L, H, D, B = 4, 2, 8, 4


def layout(tp: int = 1, pp: int = 1, block: int = B, layers: int = L) -> WorkerLayout:
    ranks = []
    for p in range(pp):
        for t in range(tp):
            nl, nh = layers // pp, H // tp
            ranks.append(RankLayout(p * tp + t, t, p, (p * nl, (p + 1) * nl),
                                    (t * nh, (t + 1) * nh)))
    return WorkerLayout(tp_size=tp, pp_size=pp, num_layers=layers, num_kv_heads=H, head_dim=D,
                        tokens_per_block=block, dtype="float32", ranks=tuple(ranks))


def params(src: WorkerLayout, num_tokens: int = 10, stream: bool = False) -> ContextParams:
    n_blocks = -(-num_tokens // src.tokens_per_block)
    return ContextParams(
        ctx_request_id="c", first_gen_tokens=[] if stream else [1],
        prompt_token_ids=list(range(3, 3 + num_tokens)), worker_id="w", backend="TCP",
        addresses=[f"10.0.0.{r}:7" for r in range(len(src.ranks))],
        block_ids=[] if stream else list(range(20, 20 + n_blocks)), num_tokens=num_tokens,
        layout=src, lease_expiry=0.0, stream=stream)


def test_same_block_size_moves_whole_blocks_and_may_land_in_the_blocks() -> None:
    src = layout()
    plan = plan_pull(params(src), layout(), 0, cache_device="cpu", runs=True, wait_s=5.0)
    assert plan.num_src_blocks == 3 and plan.into_blocks
    [read] = plan.reads
    assert read.request.format == "blocks" and read.request.block_ids == (20, 21, 22)
    assert read.request.lease_id == "c" and read.request.num_tokens == 10
    assert read.shape == (3, L, 2, H, B, D)
    assert read.request.wait_s is None and not read.request.first_token
    # no runs, or a GPU cache: a receive buffer + install
    for device, runs in (("cpu", False), ("cuda", True)):
        assert not plan_pull(params(src), layout(), 0, cache_device=device, runs=runs,
                             wait_s=5.0).into_blocks


def test_another_block_size_moves_tokens_into_a_buffer() -> None:
    plan = plan_pull(params(layout()), layout(block=2 * B), 0, cache_device="cpu", runs=True,
                     wait_s=5.0)
    [read] = plan.reads
    assert read.request.format == "tokens" and not plan.into_blocks
    assert read.shape == (L, 2, H, 10, D)


@pytest.mark.parametrize(("src", "dst"), [((1, 1), (2, 1)), ((2, 2), (1, 2)), ((1, 2), (2, 1))])
def test_each_rank_reads_what_plan_pulls_gives_it(src: tuple[int, int],
                                                  dst: tuple[int, int]) -> None:
    s, d = layout(*src), layout(*dst)
    p = params(s)
    for rank in range(len(d.ranks)):
        plan = plan_pull(p, d, rank, cache_device="cpu", runs=True, wait_s=5.0)
        pieces = plan_pulls(s, d, rank)
        assert [r.piece for r in plan.reads] == pieces
        for r in plan.reads:
            nl = r.piece.layers[1] - r.piece.layers[0]
            nh = r.piece.heads[1] - r.piece.heads[0]
            assert r.shape == (3, nl, 2, nh, B, D)
            assert (r.request.layer_slice, r.request.head_slice) == (
                r.piece.src_layer_slice, r.piece.src_head_slice)


def test_a_streamed_pull_reads_layer_groups_and_asks_for_the_first_token_once() -> None:
    src = layout(pp=2, layers=32)  # 16 layers a context rank: 8 groups of 2 each
    p = params(src, num_tokens=10, stream=True)
    plan = plan_pull(p, layout(layers=32), 0, cache_device="cpu", runs=True, wait_s=7.0)
    layers = [r.piece.layers for r in plan.reads]
    assert layers == [(i, i + 2) for i in range(0, 32, 2)]
    assert [r.piece.src_rank for r in plan.reads] == [0] * 8 + [1] * 8
    # the last read from context rank 0 asks for the first token; no other read does
    assert [r.request.first_token for r in plan.reads] == [False] * 7 + [True] + [False] * 8
    for r in plan.reads:
        assert r.request.block_ids == () and r.request.wait_s == 7.0
        assert r.request.tokens_hash == token_ids_hash(p.prompt_token_ids[:10])
    # another generation rank never asks for the first token
    other = plan_pull(p, layout(tp=2, layers=32), 1, cache_device="cpu", runs=True, wait_s=7.0)
    assert other.reads and not any(r.request.first_token for r in other.reads)


def test_stream_pieces_cut_layers_into_groups_keeping_the_local_slices() -> None:
    [piece] = plan_pulls(layout(pp=2, layers=20), layout(layers=20), 0)[1:]  # layers [10, 20)
    assert stream_pieces([piece], False) == [piece]
    groups = stream_pieces([piece], True)
    assert len(groups) <= STREAM_LAYER_GROUPS
    assert groups[0].layers[0] == 10 and groups[-1].layers[1] == 20
    assert all(a.layers[1] == b.layers[0] for a, b in zip(groups, groups[1:], strict=False))
    for g in groups:
        assert g.src_layer_slice == (g.layers[0] - 10, g.layers[1] - 10)  # context rank 1
        assert g.dst_layer_slice == g.layers  # one generation rank holds every layer
