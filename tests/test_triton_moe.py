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
from disagg.model.triton_moe import BLOCK_M, pair_layout


@pytest.mark.parametrize("t,k,num_local,start", [(1, 2, 6, 0), (9, 2, 6, 0), (40, 3, 6, 0),
                                                 (40, 3, 3, 3), (5, 2, 2, 4)])
def test_pair_layout_places_each_local_pair_once(t, k, num_local, start) -> None:
    g = torch.Generator().manual_seed(t)
    _, ids = softmax_topk(torch.randn(t, 8, generator=g), k, renormalize=False)
    slot_pair, block_expert = pair_layout(ids, start, num_local)
    pairs = t * k
    assert slot_pair.shape[0] == block_expert.shape[0] * BLOCK_M
    expert_of_pair = ids.t().reshape(-1) - start  # pair j * T + t
    placed = slot_pair[slot_pair < pairs].tolist()
    mine = [p for p in range(pairs) if 0 <= expert_of_pair[p] < num_local]
    assert sorted(placed) == mine  # every local pair once, no other
    for b, e in enumerate(block_expert.tolist()):
        rows = slot_pair[b * BLOCK_M:(b + 1) * BLOCK_M]
        live = rows[rows < pairs]
        if e == num_local:  # unused block
            assert live.numel() == 0
        else:
            assert (expert_of_pair[live] == e).all()


@spawns_interpreter
def test_kernels_in_interpreter_process() -> None:
    run_interpreter_tests(__file__)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,lo,hi", [(1, 0, 6), (7, 0, 6), (40, 0, 6), (40, 2, 5)])
def test_kernels_are_grouped_experts(dtype: torch.dtype, t: int, lo: int, hi: int) -> None:
    tm = importlib.import_module("disagg.model.triton_moe")
    e, k, h, i = 6, 2, 48, 40  # neither a multiple of the 32-wide tiles: masked tails
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    w, ids = softmax_topk(torch.randn(t, e, generator=g), k, renormalize=True)
    got = tm.triton_grouped_experts(x, ids, w, w13[lo:hi].contiguous(), w2[lo:hi].contiguous(),
                                    lo)
    want = grouped_experts(x, ids, w, w13[lo:hi], w2[lo:hi], lo)
    assert got.dtype == dtype and got.shape == (t, h)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)

