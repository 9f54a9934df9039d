"""Triton paged attention for CUDA: reads K/V straight from the block-major cache through the
block table (no gather copy, no padding to the longest sequence, no boolean masks).

Cache layer as in ``attention.py``::

    kv_layer[N, 2 (K=0, V=1), H_kv, B, D]      token p of a sequence with table bt:
                                               block bt[p // B], offset p % B

Both kernels read keys one token row at a time (``D`` contiguous elements), so any block size
works (8, 16, 32, 64 or not a power of two); the tile of keys one iteration reads (``TILE_N``)
is independent of ``B``. GQA: the ``G = H_q / H_kv`` query heads of one kv head share a
program, so each K/V byte is read once per kv head, not once per query head.

``paged_decode`` (one query token per sequence; flash-decoding)::

    grid (S, H_kv, num_splits): program (s, h, j) walks keys [j*c, min((j+1)*c, L_s)) of
    sequence s, c = ceil(ceil(L_s / TILE_N) / num_splits) * TILE_N
    keys:   0 ......... c | c ........ 2c | ... | (num_splits-1)*c ... L_s
            split 0         split 1              split num_splits-1
    each split writes its normalised partial output and log-sum-exp; a reduce kernel
    (grid (S, H_q)) merges them. num_splits == 1: the split kernel writes the output itself.

    The grid and buffers depend on S, H_kv and num_splits only; lengths are read on the device
    (no host sync): the launch can be captured in a CUDA graph. seq_len 0 -> zeros.

``paged_prefill`` (varlen, causal; one launch for all prefill chunks of a step)::

    grid (T_p // BLOCK_Q + S_p, H_kv); sequence i owns q-blocks
    [qb_i, qb_i + ceil(n_i / BLOCK_Q)), qb_i = (qsl[i] - qsl[0]) // BLOCK_Q + i
    (a program finds its sequence by binary search over qsl; spare programs exit).
    A program holds BLOCK_Q tokens x G heads = BLOCK_M rows; row r = token r // G, head r % G.
    query token j of sequence i (position ctx + j, ctx = L_i - n_i) sees keys [0, ctx + j].

This module imports without triton (``HAS_TRITON`` False); callers check it.
"""

from __future__ import annotations

import functools
import math

import torch

try:  # triton is optional: CPU-only installs (and CI) lack it
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False

# exp(x) = exp2(x * log2(e)): the kernels work in base 2 (exp2 is one instruction).
_LOG2E = 1.4426950408889634
MAX_DECODE_SPLITS = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      device: torch.device | None = None, tile_n: int = 64) -> int:
    """Splits of the key range per (sequence, kv head) for ``paged_decode``.

    Enough programs to give every SM about two (``S * H_kv * splits >= 2 * SMs``), never more
    splits than key tiles the widest table can hold, at most ``MAX_DECODE_SPLITS``. A function
    of shapes only (never of the lengths), so a captured graph stays valid for any lengths.
    """
    if device is not None and device.type == "cuda":
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 132  # H100 SXM; only matters for interpreter runs
    base = max(1, num_seqs * num_kv_heads)
    splits = -(-2 * sms // base)
    max_tiles = max(1, -(-(max_blocks * block_size) // tile_n))
    return max(1, min(splits, max_tiles, MAX_DECODE_SPLITS))


if HAS_TRITON:

    @triton.jit
    def _dot(a, b):
        # float32 inputs: exact (IEEE) products, not TF32, so float32 runs stay comparable
        # with the PyTorch reference; 16-bit inputs: tensor cores, float32 accumulation.
        if a.dtype == tl.float32:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _seq_of_q_block(qsl_ptr, q0, num_seqs, pid, BLOCK_Q: tl.constexpr):
        """The sequence q-block ``pid`` belongs to: sequence i owns q-blocks
        [qb_i, qb_{i+1}) with qb_i = (qsl[i] - qsl[0]) // BLOCK_Q + i (every sequence starts a
        new block), so it is the last i with qb_i <= pid (binary search over qsl)."""
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            qb = (tl.load(qsl_ptr + mid) - q0) // BLOCK_Q + mid
            if qb <= pid:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _softmax_tile(qk, v, m_i, l_i, acc, MASKED: tl.constexpr):
        """One key tile of online softmax (log2 units): the running max ``m_i``, sum ``l_i``
        and output ``acc`` of every query row after the tile's scores ``qk`` and values
        ``v``. ``MASKED``: rows may have no key yet (-inf everywhere), kept at weight 0."""
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past q_len
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _decode_split_kernel(
        q_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        qk_scale, num_splits,                       # softmax scale * log2(e), grid dim 2
        stride_qs, stride_qh,                       # q [S, H_q, D]
        stride_kn, stride_kkv, stride_kh, stride_kb,  # kv [N, 2, H_kv, B, D]
        stride_bts,                                 # block table [S, M]
        stride_os, stride_oh,                       # out [S, H_q, D]
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_N: tl.constexpr,
        SPLIT: tl.constexpr,                        # num_splits > 1: write partials
    ):
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + s)
        # This split's keys [start, end): whole tiles, the last split takes the remainder.
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits)
        start = split * tiles_per_split * TILE_N
        end = tl.minimum(start + tiles_per_split * TILE_N, seq_len)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_PAD)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        head = kvh * GROUP + g                                  # query heads of this kv head
        q = tl.load(q_ptr + s * stride_qs + head[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)   # [GROUP_PAD, HEAD_PAD]

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        bt_row = bt_ptr + s.to(tl.int64) * stride_bts
        head_base = kv_ptr + kvh.to(tl.int64) * stride_kh
        for n0 in range(start, end, TILE_N):
            pos = n0 + tl.arange(0, TILE_N)                     # key positions of this tile
            p_ok = pos < end
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
            row = head_base + blk * stride_kn + (pos % BLOCK_SIZE) * stride_kb   # [TILE_N]
            k = tl.load(row[None, :] + d[:, None], mask=p_ok[None, :] & d_ok[:, None],
                        other=0.0)                              # [HEAD_PAD, TILE_N]
            v = tl.load(row[:, None] + stride_kkv + d[None, :],
                        mask=p_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
            qk = _dot(q.to(k.dtype), k) * qk_scale             # [GROUP_PAD, TILE_N], log2 units
            qk = tl.where(p_ok[None, :], qk, float("-inf"))
            # not MASKED: key n0 is always valid, so every row's max is finite
            m_i, l_i, acc = _softmax_tile(qk, v, m_i, l_i, acc, False)

        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe_l[:, None]                               # 0 where no key was read
        if not SPLIT:
            tl.store(out_ptr + s * stride_os + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            # part_o [S, H_q, num_splits, HEAD_PAD] float32, part_lse [S, H_q, num_splits]
            lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
            hq = tl.num_programs(1) * GROUP
            idx = (s * hq + head) * num_splits + split          # [GROUP_PAD]
            tl.store(part_lse_ptr + idx, lse, mask=g_ok)
            tl.store(part_o_ptr + idx[:, None] * HEAD_PAD + d[None, :], o,
                     mask=g_ok[:, None])

    @triton.jit
    def _decode_reduce_kernel(
        part_o_ptr, part_lse_ptr, out_ptr, num_splits, stride_os, stride_oh,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        s = tl.program_id(0)
        h = tl.program_id(1)
        hq = tl.num_programs(1)
        j = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_PAD)
        base = (s * hq + h) * num_splits
        lse = tl.load(part_lse_ptr + base + j, mask=j < num_splits, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)                # every split empty: weights 0
        w = tl.exp2(lse - m)                                    # [SPLITS_PAD]
        o = tl.load(part_o_ptr + (base + j)[:, None] * HEAD_PAD + d[None, :],
                    mask=(j < num_splits)[:, None], other=0.0)  # [SPLITS_PAD, HEAD_PAD]
        denom = tl.sum(w, 0)
        res = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(out_ptr + s * stride_os + h * stride_oh + d,
                 res.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _prefill_kernel(
        q_ptr, kv_ptr, bt_ptr, lens_ptr, qsl_ptr, out_ptr,
        qk_scale, num_seqs,
        stride_qt, stride_qh,                       # q [T, H_q, D]
        stride_kn, stride_kkv, stride_kh, stride_kb,  # kv [N, 2, H_kv, B, D]
        stride_bts,                                 # block table [S_p, M]
        stride_ot, stride_oh,                       # out [T, H_q, D]
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        q0 = tl.load(qsl_ptr)
        seq = _seq_of_q_block(qsl_ptr, q0, num_seqs, pid, BLOCK_Q)
        q_begin = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_begin
        first_tok = (pid - ((q_begin - q0) // BLOCK_Q + seq)) * BLOCK_Q
        if first_tok < q_len:
            seq_len = tl.load(lens_ptr + seq)
            ctx = seq_len - q_len                                # cached keys before the chunk

            r = tl.arange(0, BLOCK_M)
            tok = first_tok + r // GROUP                         # token of row r in the chunk
            head = kvh * GROUP + r % GROUP
            r_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
            d = tl.arange(0, HEAD_PAD)
            d_ok = d < HEAD_DIM
            q_rows = (q_begin + tok).to(tl.int64)
            q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
                        + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
            q_pos = ctx + tok                                    # [BLOCK_M] query positions

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
            bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
            head_base = kv_ptr + kvh.to(tl.int64) * stride_kh
            # keys [0, full_end): below every query of the tile, no mask;
            # keys [full_end, kv_end): the diagonal, causal mask.
            last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
            kv_end = ctx + last_tok + 1
            full_end = ((ctx + first_tok + 1) // TILE_N) * TILE_N
            for n0 in range(0, full_end, TILE_N):
                pos = n0 + tl.arange(0, TILE_N)
                blk = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
                row = head_base + blk * stride_kn + (pos % BLOCK_SIZE) * stride_kb
                k = tl.load(row[None, :] + d[:, None], mask=d_ok[:, None], other=0.0)
                v = tl.load(row[:, None] + stride_kkv + d[None, :], mask=d_ok[None, :],
                            other=0.0)
                qk = _dot(q.to(k.dtype), k) * qk_scale
                m_i, l_i, acc = _softmax_tile(qk, v, m_i, l_i, acc, False)
            for n0 in range(full_end, kv_end, TILE_N):
                pos = n0 + tl.arange(0, TILE_N)
                p_ok = pos < kv_end
                blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
                row = head_base + blk * stride_kn + (pos % BLOCK_SIZE) * stride_kb
                k = tl.load(row[None, :] + d[:, None], mask=p_ok[None, :] & d_ok[:, None],
                            other=0.0)
                v = tl.load(row[:, None] + stride_kkv + d[None, :],
                            mask=p_ok[:, None] & d_ok[None, :], other=0.0)
                qk = _dot(q.to(k.dtype), k) * qk_scale
                causal = (pos[None, :] <= q_pos[:, None]) & p_ok[None, :]
                qk = tl.where(causal, qk, float("-inf"))
                m_i, l_i, acc = _softmax_tile(qk, v, m_i, l_i, acc, True)
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
                     + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=r_ok[:, None] & d_ok[None, :])


def _check_common(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer must be [N, 2, H_kv, B, D], got {tuple(kv_layer.shape)}")
    if q.shape[-1] != kv_layer.shape[-1] or q.shape[1] % kv_layer.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_layer {tuple(kv_layer.shape)}")
    if kv_layer.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and kv_layer need a contiguous last (head_dim) dimension")
    if block_tables.dim() != 2:
        raise ValueError("block_tables must be [S, max_blocks]")


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                 out: torch.Tensor | None = None, tile_n: int = 64,
                 num_warps: int = 4) -> torch.Tensor:
    """Decode attention, one query per sequence, reading the paged cache in place.

    q ``[S, H_q, D]``, kv_layer ``[N, 2, H_kv, B, D]`` (a view of the cache is fine),
    block_tables ``[S, M]`` int32/int64, seq_lens ``[S]`` int32/int64 on q's device: sequence s
    attends keys ``[0, seq_lens[s])``, 0 gives a zero row. Returns ``out`` ``[S, H_q, D]``
    (q's dtype). ``num_splits`` None: ``choose_num_splits`` (shapes only). No host sync.
    """
    _check_common(q, kv_layer, block_tables)
    s, hq, d = q.shape
    _, _, hkv, bsz, _ = kv_layer.shape
    if out is None:
        out = torch.empty_like(q)
    if s == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(s, hkv, block_tables.shape[1], bsz, q.device, tile_n)
    num_splits = max(1, min(int(num_splits), MAX_DECODE_SPLITS))
    group = hq // hkv
    head_pad = max(16, _next_pow2(d))
    if num_splits > 1:
        part_o = torch.empty(s, hq, num_splits, head_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(s, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel
    _decode_split_kernel[(s, hkv, num_splits)](
        q, kv_layer, block_tables, seq_lens, out, part_o, part_lse,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=bsz, HEAD_DIM=d, HEAD_PAD=head_pad,
        GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), TILE_N=tile_n,
        SPLIT=num_splits > 1, num_warps=num_warps,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(s, hq)](
            part_o, part_lse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=d, HEAD_PAD=head_pad, SPLITS_PAD=_next_pow2(num_splits), num_warps=4,
        )
    return out


def prefill_config(dtype: torch.dtype, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) of ``paged_prefill`` for ``dtype``."""
    if dtype == torch.float32:
        block_m, tile_n, warps, stages = 64, 32, 4, 1
    else:
        block_m, tile_n, warps, stages = 128, 64, 8, 2
    return max(block_m, _next_pow2(group)), tile_n, warps, stages


def paged_prefill(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int,
                  scale: float, out: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Causal varlen attention over the paged cache for ``S_p`` chunks in one launch.

    q ``[T, H_q, D]`` (all rows of the step), query_start_loc ``[S_p + 1]`` (absolute rows of
    q: chunk i is rows ``[qsl[i], qsl[i+1])``, its last ``n_i`` positions of ``seq_lens[i]``),
    block_tables ``[S_p, M]``, ``num_tokens = qsl[S_p] - qsl[0]`` (a host int: sizes the grid).
    The chunks' K/V must already be in the cache. Writes rows ``[qsl[0], qsl[S_p])`` of ``out``
    (allocated like q when None) and returns it; other rows are left untouched.
    """
    _check_common(q, kv_layer, block_tables)
    _, hq, d = q.shape
    _, _, hkv, bsz, _ = kv_layer.shape
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = hq // hkv
    block_m, tile_n, warps, stages = config or prefill_config(q.dtype, group)
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, hkv)
    _prefill_kernel[grid](
        q, kv_layer, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=bsz, HEAD_DIM=d, HEAD_PAD=max(16, _next_pow2(d)),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        num_warps=warps, num_stages=stages,
    )
    return out


def reference_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: list[int], query_start_loc: list[int],
                        scale: float) -> torch.Tensor:
    """Float64 loop reference (tests and device checks): chunk i = rows
    ``[qsl[i], qsl[i+1])`` = the last ``n_i`` positions of its ``seq_lens[i]``, causal."""
    _, hq, d = q.shape
    _, _, hkv, bsz, _ = kv_layer.shape
    g = hq // hkv
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, seq_len in enumerate(seq_lens):
        a, b = query_start_loc[i], query_start_loc[i + 1]
        n = b - a
        if n == 0 or seq_len == 0:
            continue
        nb = math.ceil(seq_len / bsz)
        blocks = block_tables[i, :nb].long()
        kv = kv_layer[blocks].double()                          # [nb, 2, H_kv, B, D]
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(hkv, nb * bsz, d)[:, :seq_len]
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(hkv, nb * bsz, d)[:, :seq_len]
        k = k.repeat_interleave(g, 0)                           # [H_q, L, D]
        v = v.repeat_interleave(g, 0)
        qi = q[a:b].double().transpose(0, 1)                    # [H_q, n, D]
        scores = qi @ k.transpose(1, 2) * scale                 # [H_q, n, L]
        qpos = torch.arange(seq_len - n, seq_len, device=q.device)
        kpos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[a:b] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out
