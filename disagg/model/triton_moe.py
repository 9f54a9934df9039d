"""Grouped MoE experts as two Triton kernels (CUDA): ``moe.grouped_experts`` without a host
sync and without a Python loop over the experts.

The (token, expert) pairs are laid out by expert on the device, each expert's run padded to a
multiple of ``BLOCK_M`` rows, so that a program's ``BLOCK_M`` rows all belong to one expert::

    pairs p = j * T + t (choice-major, as moe.group_by_expert)
    slots  [0, BM)      [BM, 2 BM)   ...  expert 0's pairs, then padding (p = P: none)
           [s_1, ...)                     expert 1's pairs ...          s_e multiple of BM
    block b -> expert block_expert[b] (E_local past the last used block: the program exits)

The number of blocks is bounded by shapes alone (``ceil(P / BM) + E_local``), so the launch
sizes never depend on the routing: no ``.item()``, and the launch can be captured in a graph.

``_gate_up_kernel``: program (b, n) computes for its rows
``silu(x @ gate[e, n-range].T) * (x @ up[e, n-range].T)`` (two float32 accumulators over
``H`` in ``BK`` steps) into ``act[slot, n-range]``.
``_down_kernel``: program (b, n) computes ``weight[p] * act[slots] @ down[e, n-range, :].T``
and writes row ``p`` of ``by_pair [P, H]`` (every pair once: no atomics). The caller sums
``by_pair.view(k, T, H)`` over the choices, as ``grouped_experts`` does. Pairs of other ranks'
experts (expert parallel) are never placed: their rows stay zero.

Both grids are one-dimensional in grouped order (``GROUP_M`` row blocks sweep every column
tile before the next group starts), so the blocks of one expert read its weight tiles, and a
block re-reads its rows, mostly from L2.

Tiles (``MoeTiles``, ``pick_tiles``): each block reads its expert's weights once, so the
weight traffic is ``sum_e ceil(n_e / BM)`` expert matrices. ``BM`` follows the rows per
expert the shapes promise (``2 * T * k / E_local``, a power of two in [16, 128]; no sync):
decode batches keep 16-row blocks (one block per expert hit, many programs to stream the
weights), prefill reads each expert's weights about once per 128 rows instead of once per 16
(the fixed ``BM = 16`` read Mixtral-8x7B's experts 64 times at 4096 tokens: 33.7 ms against
grouped_experts' 5.4 ms, ``bench/results/gpu_moe_check.txt``). ``BN`` / ``BK`` are 32..128 x
64..128 bf16 tiles with 3-4 pipeline stages, kept under ~96 KiB of shared memory (Hopper has
228 KiB; the bound keeps the kernels compiling on Ampere and Ada as well).

Checked against ``grouped_experts`` on CPU under ``TRITON_INTERPRET=1``
(``tests/test_triton_moe.py``); ``triton_experts_kernel`` checks it on the device before a
caller uses it. This module imports without triton (``HAS_TRITON`` False).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from disagg.model.moe import ExpertsFn, grouped_experts
from disagg.model.triton_attention import HAS_TRITON, tl, triton

logger = logging.getLogger("disagg.model")

BLOCK_MS = (16, 32, 64, 128)  # the row-block sizes pick_tiles chooses from (tl.dot: >= 16)
BLOCK_M = BLOCK_MS[0]         # pair_layout's default
GROUP_M = 8                   # row blocks per group of the grouped program order
SMEM_BUDGET = 96 * 1024       # bytes of pipelined tiles per program (see the module doc)


@dataclass(frozen=True)
class MoeTiles:
    """One launch configuration of the two kernels: ``block_m`` rows per program (the
    layout's padding), each kernel's column and reduction tile, warps and pipeline stages."""

    block_m: int
    gate_up_n: int
    gate_up_k: int
    gate_up_stages: int
    down_n: int
    down_k: int
    down_stages: int
    num_warps: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _stages(want: int, rows: int, cols: int, block_k: int, mats: int, itemsize: int) -> int:
    """At most ``want`` stages of one program's tiles (``rows x BK`` activations and
    ``mats`` weight tiles ``BK x cols``) within ``SMEM_BUDGET``."""
    per_stage = (rows + mats * cols) * block_k * itemsize
    return max(1, min(want, SMEM_BUDGET // per_stage))


def tiles_for(block_m: int, itemsize: int) -> MoeTiles:
    """The tiles of ``block_m``-row blocks for ``itemsize``-byte activations and weights.

    16 rows (decode): memory-bound, so narrow column tiles (more programs stream the weights
    at once) and deep K tiles with 4 stages; 32 and 64: 64 x 64 tiles; 128 (prefill): 64-wide
    gate/up tiles (two float32 accumulators) and 128-wide down tiles on 8 warps. float32
    halves K so the stages still fit."""
    if block_m not in BLOCK_MS:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, got {block_m}")
    if block_m == 16:
        gn, dn, bk, stages, warps = 32, 32, 128, 4, 4
    elif block_m == 32:
        gn, dn, bk, stages, warps = 64, 64, 64, 4, 4
    elif block_m == 64:
        gn, dn, bk, stages, warps = 64, 128, 64, 3, 4
    else:
        gn, dn, bk, stages, warps = 64, 128, 64, 3, 8
    if itemsize >= 4:
        bk //= 2
    return MoeTiles(block_m=block_m,
                    gate_up_n=gn, gate_up_k=bk,
                    gate_up_stages=_stages(stages, block_m, gn, bk, 2, itemsize),
                    down_n=dn, down_k=bk,
                    down_stages=_stages(stages, block_m, dn, bk, 1, itemsize),
                    num_warps=warps)


def pick_block_m(num_pairs: int, num_local: int) -> int:
    """Rows per block for ``num_pairs`` (token, expert) pairs over ``num_local`` experts:
    twice the mean rows per expert (routing is uneven: most experts then fit one block), as
    a power of two in [16, 128]. Shapes only (no sync); under expert parallelism the pairs
    include other ranks', so it errs large (one block per expert: the weights still read
    once)."""
    rows = -(-2 * max(num_pairs, 0) // max(num_local, 1))
    return min(BLOCK_MS[-1], max(BLOCK_MS[0], _next_pow2(rows)))


def pick_tiles(num_pairs: int, num_local: int, itemsize: int) -> MoeTiles:
    """``tiles_for(pick_block_m(...))``: the configuration a call of these shapes uses."""
    return tiles_for(pick_block_m(num_pairs, num_local), itemsize)


if HAS_TRITON:
    @triton.jit
    def _mma(a, b, acc):
        # float32 inputs: IEEE products (tl.dot's default is TF32, 3e-3 off the PyTorch
        # reference on an H200, and the runner's check then refuses the kernel); 16-bit
        # inputs: tensor cores, float32 accumulation.
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _block_and_tile(num_blocks, num_n, GROUP_M: tl.constexpr):
        # Grouped order: GROUP_M row blocks take every column tile before the next group.
        pid = tl.program_id(0)
        in_group = GROUP_M * num_n
        first = (pid // in_group) * GROUP_M
        size = tl.minimum(num_blocks - first, GROUP_M)
        b = first + (pid % in_group) % size
        n = (pid % in_group) // size
        return b, n

    # Arguments that change with the batch, or differ between the runner's check and the
    # model (expert count, top-k), are not specialised on: a decode graph's capture then
    # finds every variant compiled (the check compiles each tile configuration) even when
    # the eager warm-up before it took another path.
    @triton.jit(do_not_specialize=["num_tokens", "num_pairs", "num_blocks", "num_local"])
    def _gate_up_kernel(x_ptr, w13_ptr, act_ptr, slot_pair_ptr, block_expert_ptr,
                        num_tokens, num_pairs, num_blocks, hidden, inter, num_local,
                        stride_x, stride_we, stride_wn, stride_act,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
        b, n = _block_and_tile(num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
        e = tl.load(block_expert_ptr + b)
        if e >= num_local:  # a block past the used ones
            return
        slots = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(slot_pair_ptr + slots)
        live = pairs < num_pairs
        tokens = tl.where(live, pairs % num_tokens, 0).to(tl.int64)
        cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        w_e = w13_ptr + e.to(tl.int64) * stride_we
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = (k0 + ks) < hidden
            xa = tl.load(x_ptr + tokens[:, None] * stride_x + (k0 + ks)[None, :],
                         mask=live[:, None] & k_ok[None, :], other=0.0)
            # gate rows [0, I) and up rows [I, 2I) of w13[e], read transposed: [BK, BN]
            wg = tl.load(w_e + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                         mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            wu = tl.load(w_e + (inter + cols)[None, :] * stride_wn + (k0 + ks)[:, None],
                         mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g = _mma(xa, wg, acc_g)
            acc_u = _mma(xa, wu, acc_u)
        # The activation rounds like PyTorch's: gate and up in the activations' dtype first.
        g = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(act_ptr + slots[:, None].to(tl.int64) * stride_act + cols[None, :],
                 h.to(act_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])

    @triton.jit(do_not_specialize=["num_tokens", "num_pairs", "num_blocks", "num_local",
                                   "stride_wt_t"])
    def _down_kernel(act_ptr, w2_ptr, out_ptr, slot_pair_ptr, block_expert_ptr, weight_ptr,
                     num_tokens, num_pairs, num_blocks, hidden, inter, num_local,
                     stride_act, stride_we, stride_wn, stride_out, stride_wt_t, stride_wt_j,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
        b, n = _block_and_tile(num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
        e = tl.load(block_expert_ptr + b)
        if e >= num_local:
            return
        slots = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(slot_pair_ptr + slots)
        live = pairs < num_pairs
        cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        w_e = w2_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = (k0 + ks) < inter
            a = tl.load(act_ptr + slots[:, None].to(tl.int64) * stride_act + (k0 + ks)[None, :],
                        mask=live[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_e + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc = _mma(a, w, acc)
        # The expert's output rounds to the activations' dtype, then the router weight
        # scales it in float32 (``grouped_experts``: ys * weights, cast after). Pair
        # p = j * T + t has weight weights[t, j].
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        p = tl.where(live, pairs, 0)
        wt = tl.load(weight_ptr + (p % num_tokens) * stride_wt_t + (p // num_tokens) * stride_wt_j,
                     mask=live, other=0.0)
        y = y * wt.to(tl.float32)[:, None]
        rows = p.to(tl.int64)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])


def pair_layout(ids: torch.Tensor, expert_start: int, num_local: int, block_m: int = BLOCK_M
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_pair, block_expert)`` on ``ids``' device, without a host sync (see the module
    doc): ``slot_pair[s]`` the pair in slot ``s`` (``P = ids.numel()`` for padding),
    ``block_expert[b]`` the local expert of block ``b`` (``num_local`` for unused blocks)."""
    t, k = ids.shape
    num_pairs = t * k
    dev = ids.device
    local = ids.t().reshape(-1) - expert_start
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    order = torch.argsort(local, stable=True)
    # scatter_add, not bincount: bincount reads the maximum on the host (a sync)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, local, torch.ones_like(local))[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts           # first sorted position of expert e
    pstart = torch.cumsum(padded, 0) - padded          # its first slot
    num_blocks = -(-num_pairs // block_m) + num_local  # bound: shapes only
    slot_pair = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=dev)
    sorted_e = local[order]
    mine = sorted_e < num_local
    e_safe = torch.where(mine, sorted_e, 0)
    pos = torch.arange(num_pairs, device=dev)
    dest = pstart[e_safe] + (pos - start[e_safe])
    # Other ranks' pairs go to a slot past the end (dropped).
    dest = torch.where(mine, dest, num_blocks * block_m)
    spill = torch.cat([slot_pair, slot_pair.new_empty(1)])
    spill.index_copy_(0, dest, order)
    slot_pair = spill[:-1]
    block_first = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), block_first, right=True)
    return slot_pair, block_expert


def triton_grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           w13: torch.Tensor, w2: torch.Tensor, expert_start: int = 0,
                           tiles: MoeTiles | None = None) -> torch.Tensor:
    """``moe.grouped_experts`` in two Triton launches (an ``ExpertsFn``). ``x [T, H]`` dense
    rows; ``w13 [E_local, 2I, H]`` / ``w2 [E_local, H, I]`` contiguous, in x's dtype.
    ``tiles``: the launch configuration (default ``pick_tiles`` of these shapes)."""
    t, k = ids.shape
    num_local, inter, hidden = w13.shape[0], w2.shape[-1], x.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    num_pairs = t * k
    if tiles is None:
        tiles = pick_tiles(num_pairs, num_local, x.element_size())
    bm = tiles.block_m
    slot_pair, block_expert = pair_layout(ids, expert_start, num_local, bm)
    num_blocks = block_expert.shape[0]
    act = torch.empty((slot_pair.shape[0], inter), dtype=x.dtype, device=x.device)
    by_pair = torch.zeros((num_pairs, hidden), dtype=x.dtype, device=x.device)
    # One weight dtype for the kernel (it scales in float32 anyway: same values), so the
    # runner's check compiled the variant every model uses.
    weights = weights.float()
    gn, dn = tiles.gate_up_n, tiles.down_n
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, gn),)](
        x, w13, act, slot_pair, block_expert, t, num_pairs, num_blocks, hidden, inter,
        num_local, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=bm, BLOCK_N=gn, BLOCK_K=tiles.gate_up_k, GROUP_M=GROUP_M,
        num_warps=tiles.num_warps, num_stages=tiles.gate_up_stages)
    _down_kernel[(num_blocks * triton.cdiv(hidden, dn),)](
        act, w2, by_pair, slot_pair, block_expert, weights, t, num_pairs, num_blocks, hidden,
        inter, num_local, act.stride(0), w2.stride(0), w2.stride(1), by_pair.stride(0),
        weights.stride(0), weights.stride(1),
        BLOCK_M=bm, BLOCK_N=dn, BLOCK_K=tiles.down_k, GROUP_M=GROUP_M,
        num_warps=tiles.num_warps, num_stages=tiles.down_stages)
    return by_pair.view(k, t, hidden).sum(dim=0)


def triton_experts_kernel(device: torch.device, dtype: torch.dtype, hidden: int,
                          inter: int) -> ExpertsFn | None:
    """``triton_grouped_experts`` once it compiled and matched ``grouped_experts`` on
    ``device`` at the model's dtype and sizes, with every tile configuration ``pick_tiles``
    can choose (so none compiles later, inside a graph capture) and with and without expert
    parallelism; None (with a warning) when triton is missing or a check fails."""
    from disagg.model.attention import triton_available

    if not (HAS_TRITON and triton_available()):
        return None
    g = torch.Generator(device=device).manual_seed(0)
    e, k, t = 4, 2, 37
    x = torch.randn(t, hidden, generator=g, device=device).to(dtype)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g, device=device) / hidden ** 0.5
           ).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=g, device=device) / inter ** 0.5).to(dtype)
    probs = torch.softmax(torch.randn(t, e, generator=g, device=device), -1)
    weights, ids = torch.topk(probs, k, dim=-1)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    itemsize = torch.empty((), dtype=dtype).element_size()
    try:
        for bm in BLOCK_MS:
            tiles = tiles_for(bm, itemsize)
            for lo, hi in ((0, e), (2, 4)):
                got = triton_grouped_experts(x, ids, weights, w13[lo:hi], w2[lo:hi], lo, tiles)
                want = grouped_experts(x, ids, weights, w13[lo:hi], w2[lo:hi], lo)
                err = float((got.float() - want.float()).abs().max())
                if not err <= tol * (1.0 + float(want.float().abs().max())):
                    raise ValueError(f"max abs error {err:.3g} against grouped_experts "
                                     f"({tiles})")
    except Exception as exc:  # a compile error or a wrong result on this device
        logger.warning("the Triton MoE kernel is not used (%r): PyTorch experts", exc)
        return None
    return triton_grouped_experts
