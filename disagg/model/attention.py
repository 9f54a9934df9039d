"""Paged attention in pure PyTorch (CPU and CUDA) over the block-major KV cache.

KV cache of one rank (DESIGN.md section 1)::

    kv_cache[num_blocks, num_local_layers, 2 (K=0, V=1), num_local_kv_heads, B, head_dim]

A layer works on ``kv_cache[:, i]`` = ``[num_blocks, 2, H_kv, B, D]``. Token at position ``p``
of a sequence with block table ``bt`` lives at block ``bt[p // B]``, offset ``p % B``.

An MLA (DeepSeek-V3) cache has one part and one head instead: ``[num_blocks, L, 1, 1, B, W]``,
a latent row of W = kv_lora_rank + qk_rope_head_dim per token (``paged_latent_attention``; the
PyTorch path on CPU and CUDA: the Triton kernels, the CPU decode kernel and CUDA graphs are
MHA-only).

One forward carries a batch laid out as (DESIGN.md section 5)::

    rows of q/k/v:    d_0 | d_1 | ... | d_{nd-1} | chunk nd ......... | chunk nd+1 ... |
    query_start_loc:  0     1           nd-1       nd                   nd+q_len_nd      T
                      <- num_decodes rows, 1 each -> <- q_len_nd rows -->

Each sequence's new tokens are the *last* ``q_len`` positions of its ``seq_len``-token context.

On CUDA (triton importable, ``DISAGG_CUDA_ATTENTION`` not ``torch``) the attention itself runs in
the Triton kernels of ``triton_attention.py`` (decodes: split-KV ``paged_decode``; prefill
chunks: one varlen ``paged_prefill`` launch), reading the cache through the block table in
place; CPU keeps the PyTorch / compiled-kernel path below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from disagg.env import CUDA_ATTENTION
from disagg.model.kernels import DecodeKernel

if TYPE_CHECKING:
    from disagg.model.cpu_ops import ElementwiseKernel


@dataclass(frozen=True)
class AttentionMetadata:
    num_decodes: int             # the first num_decodes sequences have exactly 1 query token
    query_start_loc: list[int]   # len B+1: sequence i's new tokens are rows [qsl[i], qsl[i+1])
    seq_lens: list[int]          # len B: context length after this step (cached + new tokens)
    block_tables: torch.Tensor   # [B, max_blocks] int64, padded with 0
    slot_block: torch.Tensor     # [T] int64: block id receiving each new token's K/V
    slot_offset: torch.Tensor    # [T] int64: offset in that block
    decode_seq_lens: torch.Tensor  # [num_decodes] int64 (for the batched decode mask)
    # Device copies for the CUDA kernels (the runner fills them; None: built from the lists on
    # use). A pure-decode step on CUDA reads only block_tables, seq_lens_t and num_decodes,
    # so a captured CUDA graph can refill them in place.
    seq_lens_t: torch.Tensor | None = None         # [B] int32: seq_lens
    query_start_loc_t: torch.Tensor | None = None  # [B+1] int32: query_start_loc
    max_query_len: int = -1                        # max new tokens of a sequence (-1: unknown)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def seq_lens_tensor(self, device: torch.device) -> torch.Tensor:
        if self.seq_lens_t is not None:
            return self.seq_lens_t
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=device)

    def query_start_loc_tensor(self, device: torch.device) -> torch.Tensor:
        if self.query_start_loc_t is not None:
            return self.query_start_loc_t
        return torch.tensor(self.query_start_loc, dtype=torch.int32, device=device)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Scatter the new tokens' K/V ``[T, H_kv, D]`` into ``kv_layer`` ``[N, 2, H_kv, B, D]``.

    Row t goes to ``kv_layer[slot_block[t], {0: K, 1: V}, :, slot_offset[t]]``.
    """
    # Advanced indices on dims 0 and 3 (split by the head slice) put the T dim first: the
    # indexed view is [T, H_kv, D], row t = (block slot_block[t], offset slot_offset[t]).
    kv_layer[meta.slot_block, 0, :, meta.slot_offset] = k.to(kv_layer.dtype)
    kv_layer[meta.slot_block, 1, :, meta.slot_offset] = v.to(kv_layer.dtype)


class GatherWorkspace:
    """A model's attention resources: a reusable buffer for gathered context K/V, and the
    optional compiled decode kernel that reads the paged cache in place (``kernels.py``).

    On CPU a fresh multi-megabyte tensor per layer costs more in page faults than the gather
    itself, so the gather writes into this buffer (grown on demand, reused by every layer of
    one model; one workspace per model, layers run one after another). On CUDA the caching
    allocator already reuses memory, so it is not used there.
    """

    def __init__(self, decode_kernel: DecodeKernel | None = None) -> None:
        self._buf: torch.Tensor | None = None
        # Set by the runner on CPU when the kernel builds; None: gather + SDPA for decodes.
        self.decode_kernel = decode_kernel
        # Set by the runner on CPU (float32) when it builds: RoPE + the K/V write in one call
        # (cpu_ops.ElementwiseKernel); None: apply_rope and write_kv.
        self.rope_store: ElementwiseKernel | None = None

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._buf
        if (buf is None or buf.numel() < n or buf.dtype != like.dtype
                or buf.device != like.device):
            buf = self._buf = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)


def _gather_parts(kv_layer: torch.Tensor, block_table: torch.Tensor,
                  workspace: GatherWorkspace | None) -> torch.Tensor:
    """Read the blocks of ``block_table`` ``[S, nb]`` as ``[P, H_kv, S, nb*B, D]``, P the
    cache's kv_parts (2: K and V; 1: an MLA latent).

    Key index ``j`` of sequence ``s`` is its context position ``j`` (block ``j // B``, offset
    ``j % B``); positions beyond a sequence's length are padding the caller masks out.
    Heads lead (SDPA takes any batch dims) so that one gather on a permuted *view* of the cache
    yields the attention layout directly: no second copy.
    """
    s, nb = block_table.shape
    _, p, h, b, d = kv_layer.shape
    kvp = kv_layer.permute(1, 2, 0, 3, 4)  # view [P, H_kv, N, B, D]
    idx = block_table.reshape(-1)          # [S*nb]: block of (seq s, chunk c) at s*nb + c
    shape = (p, h, s * nb, b, d)
    if (workspace is not None and kv_layer.device.type == "cpu"
            and not (kv_layer.requires_grad and torch.is_grad_enabled())):
        ctx = torch.index_select(kvp, 2, idx, out=workspace.take(shape, kv_layer))
    else:
        ctx = kvp[:, :, idx]                # [P, H_kv, S*nb, B, D]
    return ctx.view(p, h, s, nb * b, d)    # (S*nb, B) -> (S, nb*B): free, contiguous


def _gather_context(kv_layer: torch.Tensor, block_table: torch.Tensor,
                    workspace: GatherWorkspace | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[H_kv, S, nb*B, D]`` of the blocks of ``block_table`` (``_gather_parts``)."""
    ctx = _gather_parts(kv_layer, block_table, workspace)
    return ctx[0], ctx[1]


def _attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked GQA attention without expanding K/V.

    q ``[S, n, H_q, D]``, k/v ``[H_kv, S, L, D]``, mask ``[S, n, L]`` (True = attend) ->
    ``[S, n, H_q, D]``. Query head ``h`` reads kv head ``h // G`` (G = H_q / H_kv, the
    Hugging Face ``repeat_kv`` order), so the G query heads of one kv head are stacked on the
    query axis: ``[H_kv, S, G*n, D]``, row ``g*n + j`` = query head ``kv*G + g``, token ``j``.
    """
    s, n, hq, d = q.shape
    hkv, _, seq_l, _ = k.shape
    g = hq // hkv
    qg = q.view(s, n, hkv, g, d).permute(2, 0, 3, 1, 4).reshape(hkv, s, g * n, d)
    if g > 1 and n > 1:
        mask = mask[:, None].expand(s, g, n, seq_l).reshape(s, g * n, seq_l)
    out = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=mask.unsqueeze(0), scale=scale)
    dv = v.shape[-1]  # = D, except MLA's values (the latent's first columns)
    return out.view(hkv, s, g, n, dv).permute(1, 3, 0, 2, 4).reshape(s, n, hq, dv)


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """One sequence's prefill chunk over its cached context, on CPU.

    q ``[n, H_q, D]``, k/v ``[H_kv, 1, L, D]`` (``_gather_context`` of one sequence), mask
    ``[n, L]`` (True = attend) -> ``[n, H_q, D]``. SDPA's own GQA with the mask broadcast over
    the heads: the CPU flash kernel reads the ``[n, L]`` mask as it is, where
    ``_attend_grouped`` stacks the G query heads of a kv head and so copies the mask G times
    (and SDPA turns that copy into a float one): chunked prefill's attention without a
    ``[G*n, L]`` temporary, and faster (the same numbers: each query row's keys, scale and
    reduction order are unchanged).
    """
    qi = q.transpose(0, 1).unsqueeze(0)  # [1, H_q, n, D]
    ki = k.transpose(0, 1).to(q.dtype)   # [1, H_kv, L, D]
    vi = v.transpose(0, 1).to(q.dtype)
    o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask[None, None], scale=scale,
                                       enable_gqa=ki.shape[1] != qi.shape[1])
    return o[0].transpose(0, 1)


# 16-bit caches the CPU decode kernel reads under float32 queries (``kv_cache_dtype``).
_HALF_CACHE = (torch.float16, torch.bfloat16)

# Chunks of at most this many tokens over a cached context (speculative decoding's checks:
# the decoded token and its drafts) are attended in one batched call, not one call each.
SHORT_CHUNK = 33


def _short_chunks_end(meta: AttentionMetadata) -> int:
    """End of the run of sequences right after the decodes, ``[nd, end)``, whose chunks have
    at most SHORT_CHUNK tokens and a cached context before them (the engine puts decodes
    carrying drafts there)."""
    qsl, i = meta.query_start_loc, meta.num_decodes
    while (i < meta.num_seqs and qsl[i + 1] - qsl[i] <= SHORT_CHUNK
           and meta.seq_lens[i] > qsl[i + 1] - qsl[i]):
        i += 1
    return i


@dataclass(frozen=True)
class _ShortChunks:
    """Sequences ``[lo, hi)`` as one padded batch of ``S = hi - lo`` rows of ``n`` queries:
    query j of sequence s is token ``min(j, n_s - 1)`` of its chunk (pads repeat the last
    one), at position ``ctx_s + min(j, n_s - 1)``, attending keys ``<=`` that position."""

    q_rows: torch.Tensor  # [S * n]: row of q for each padded query
    mask: torch.Tensor    # [S, n, nb * B]
    keep: torch.Tensor    # [T_short]: padded rows that are real, in q's order
    nb: int               # blocks of the longest context


def _short_chunk_plan(meta: AttentionMetadata, lo: int, hi: int, block_size: int,
                      device: torch.device) -> _ShortChunks:
    qsl = meta.query_start_loc
    lens = [qsl[i + 1] - qsl[i] for i in range(lo, hi)]
    n = max(lens)
    rows: list[int] = []
    pos: list[int] = []
    keep: list[int] = []
    for s, i in enumerate(range(lo, hi)):
        ctx = meta.seq_lens[i] - lens[s]
        for j in range(n):
            jj = min(j, lens[s] - 1)
            rows.append(qsl[i] + jj)
            pos.append(ctx + jj)
            if j < lens[s]:
                keep.append(s * n + j)
    nb = -(-max(meta.seq_lens[lo:hi]) // block_size)
    keys = torch.arange(nb * block_size, device=device)
    pos_t = torch.tensor(pos, device=device).view(hi - lo, n, 1)
    return _ShortChunks(torch.tensor(rows, device=device), keys.view(1, 1, -1) <= pos_t,
                        torch.tensor(keep, device=device), nb)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Triton kernels usable for CUDA attention: triton imports and ``DISAGG_CUDA_ATTENTION``
    is not ``torch`` (which keeps the PyTorch path on CUDA, e.g. to compare)."""
    if CUDA_ATTENTION.get() == "torch":
        return False
    from disagg.model.triton_attention import HAS_TRITON
    return HAS_TRITON


def _triton_applies(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype == kv_layer.dtype
            and not (q.requires_grad and torch.is_grad_enabled()) and triton_available())


def triton_paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                           scale: float) -> torch.Tensor:
    """Attention over the paged cache (new K/V already written) with the Triton kernels.

    Rows ``[0, nd)``: decodes, one ``paged_decode`` launch (split-KV; reads block_tables,
    seq_lens_t and num_decodes only). Rows ``[nd, T)``: every prefill chunk in one
    ``paged_prefill`` launch. No host sync, no per-sequence loop.
    """
    from disagg.model import triton_attention as ta

    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    nd = meta.num_decodes
    num_seqs = len(meta.query_start_loc) - 1
    seq_lens = meta.seq_lens_tensor(q.device)
    if nd > 0:
        ta.paged_decode(q[:nd], kv_layer, meta.block_tables[:nd], seq_lens[:nd], scale,
                        out=out[:nd])
    if num_seqs > nd:
        qsl = meta.query_start_loc_tensor(q.device)
        ta.paged_prefill(q, kv_layer, meta.block_tables[nd:], seq_lens[nd:], qsl[nd:],
                         meta.query_start_loc[-1] - meta.query_start_loc[nd], scale, out=out)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    workspace: GatherWorkspace | None = None,
                    kv_written: bool = False) -> torch.Tensor:
    """Write the new K/V into the cache (unless ``kv_written``: the caller did), then attend.

    q ``[T, H_q, D]``, k/v ``[T, H_kv, D]`` (RoPE applied), kv_layer ``[N, 2, H_kv, B, D]``.
    Returns ``[T, H_q, D]``.
    """
    if not kv_written:
        write_kv(kv_layer, k, v, meta)
    if _triton_applies(q, kv_layer):
        return triton_paged_attention(q, kv_layer, meta, scale)
    nd = meta.num_decodes
    kernel = workspace.decode_kernel if workspace is not None else None
    use_kernel = (nd > 0 and kernel is not None and q.device.type == "cpu"
                  and (q.dtype == kv_layer.dtype or (q.dtype == torch.float32
                                                     and kv_layer.dtype in _HALF_CACHE))
                  and not (q.requires_grad and torch.is_grad_enabled()))
    if use_kernel and nd == q.shape[0] and nd == meta.block_tables.shape[0]:
        # Every row a decode (a decode step): the kernel's output is the whole answer.
        return kernel(q.contiguous(), kv_layer, meta.block_tables, meta.decode_seq_lens, scale)
    block_size = kv_layer.shape[3]
    out = torch.empty_like(q)
    qsl = meta.query_start_loc

    if use_kernel:
        # Decodes, in place: sequence i attends keys [0, decode_seq_lens[i]) of its blocks.
        out[:nd] = kernel(q[:nd].contiguous(), kv_layer, meta.block_tables[:nd],
                          meta.decode_seq_lens, scale)
    elif nd > 0:
        # Decodes: rows [0, nd), one query each; context of sequence i = keys [0, seq_lens[i]).
        # All padded to L = nb*B keys (nb = blocks of the longest), masked per sequence:
        #   key j attended  <=>  j < decode_seq_lens[i]
        nb = -(-max(meta.seq_lens[:nd]) // block_size)
        kc, vc = _gather_context(kv_layer, meta.block_tables[:nd, :nb], workspace)
        keys = torch.arange(nb * block_size, device=q.device)
        mask = (keys[None, :] < meta.decode_seq_lens[:, None]).unsqueeze(1)  # [nd, 1, L]
        out[:nd] = _attend_grouped(q[:nd].unsqueeze(1), kc, vc, mask, scale).squeeze(1)

    short = _short_chunks_end(meta) if meta.num_seqs > nd else nd
    if short > nd:
        # Short chunks over a context (decodes with drafts): one padded batch.
        plan = _short_chunk_plan(meta, nd, short, block_size, q.device)
        kc, vc = _gather_context(kv_layer, meta.block_tables[nd:short, :plan.nb], workspace)
        qp = q.index_select(0, plan.q_rows).view(short - nd, -1, *q.shape[1:])
        o = _attend_grouped(qp, kc, vc, plan.mask, scale)
        out[qsl[nd]:qsl[short]] = o.reshape(-1, *q.shape[1:]).index_select(0, plan.keep)

    for i in range(short, meta.num_seqs):
        # Prefill chunk: rows [qsl[i], qsl[i+1]) = positions [ctx, seq_len), ctx = seq_len - n.
        #
        #   keys:    0 ........ ctx-1 | ctx ........ seq_len-1
        #            (cached earlier)   (this chunk, written above)
        #   query j (position ctx + j) sees keys 0 .. ctx + j
        start, end = qsl[i], qsl[i + 1]
        n = end - start
        seq_len = meta.seq_lens[i]
        ctx = seq_len - n
        if ctx == 0:
            # Whole prompt in this chunk: plain causal attention over the new K/V, no gather
            # (lets CUDA pick the flash kernel).
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H_q, n, D]
            ki = k[start:end].transpose(0, 1).unsqueeze(0)  # [1, H_kv, n, D]
            vi = v[start:end].transpose(0, 1).unsqueeze(0)
            if kv_layer.dtype != q.dtype:
                # The values the cache holds (a 16-bit cache under float32 compute), as every
                # later read sees them: the same numbers however the prompt is chunked.
                ki = ki.to(kv_layer.dtype).to(q.dtype)
                vi = vi.to(kv_layer.dtype).to(q.dtype)
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                enable_gqa=ki.shape[1] != qi.shape[1])
            out[start:end] = oi[0].transpose(0, 1)
        else:
            nb = -(-seq_len // block_size)
            kc, vc = _gather_context(kv_layer, meta.block_tables[i:i + 1, :nb], workspace)
            keys = torch.arange(nb * block_size, device=q.device)
            rows = torch.arange(n, device=q.device)
            mask = (keys[None, :] <= rows[:, None] + ctx).unsqueeze(0)  # [1, n, L]
            if q.device.type == "cpu":
                out[start:end] = _attend_chunk(q[start:end], kc, vc, mask[0], scale)
            else:
                out[start:end] = _attend_grouped(q[start:end].unsqueeze(0), kc, vc, mask,
                                                 scale)[0]
    return out


def paged_latent_attention(q: torch.Tensor, latent: torch.Tensor, kv_layer: torch.Tensor,
                           meta: AttentionMetadata, scale: float, value_dim: int,
                           workspace: GatherWorkspace | None = None) -> torch.Tensor:
    """MLA over the latent cache: write the new rows, then attend (PyTorch, CPU and CUDA).

    kv_layer ``[N, 1, 1, B, W]``: per token one row ``[c_kv (value_dim) | k_pe]`` shared by
    every query head, so it is multi-query attention with one kv head whose keys are whole
    rows and whose values are their first ``value_dim`` columns::

        row:   c_kv[0 .. value_dim) | k_pe[value_dim .. W)
        key:   ----------------- whole row ----------------
        value: ------ c_kv -------

    q ``[T, H, W]`` (queries already absorbed into the latent space), latent ``[T, W]``.
    Returns ``[T, H, value_dim]``. The batch layout and masks are ``paged_attention``'s.
    """
    kv_layer[meta.slot_block, 0, 0, meta.slot_offset] = latent.to(kv_layer.dtype)
    block_size = kv_layer.shape[3]
    t, hq, _ = q.shape
    out = q.new_empty(t, hq, value_dim)
    nd = meta.num_decodes
    qsl = meta.query_start_loc
    if nd > 0:
        # Decodes: rows [0, nd); key j of sequence i attended  <=>  j < decode_seq_lens[i].
        nb = -(-max(meta.seq_lens[:nd]) // block_size)
        ctx = _gather_parts(kv_layer, meta.block_tables[:nd, :nb], workspace)[0]
        keys = torch.arange(nb * block_size, device=q.device)
        mask = (keys[None, :] < meta.decode_seq_lens[:, None]).unsqueeze(1)  # [nd, 1, L]
        out[:nd] = _attend_grouped(q[:nd].unsqueeze(1), ctx, ctx[..., :value_dim], mask,
                                   scale).squeeze(1)
    short = _short_chunks_end(meta) if meta.num_seqs > nd else nd
    if short > nd:
        # Short chunks over a context (decodes with drafts): one padded batch.
        plan = _short_chunk_plan(meta, nd, short, block_size, q.device)
        ctx = _gather_parts(kv_layer, meta.block_tables[nd:short, :plan.nb], workspace)[0]
        qp = q.index_select(0, plan.q_rows).view(short - nd, -1, *q.shape[1:])
        o = _attend_grouped(qp, ctx, ctx[..., :value_dim], plan.mask, scale)
        out[qsl[nd]:qsl[short]] = o.reshape(-1, hq, value_dim).index_select(0, plan.keep)
    for i in range(short, meta.num_seqs):
        # Prefill chunk: rows [qsl[i], qsl[i+1]) = positions [ctx, seq_len) (paged_attention).
        start, end = qsl[i], qsl[i + 1]
        n = end - start
        seq_len = meta.seq_lens[i]
        past = seq_len - n
        if past == 0:
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, W]
            # (through the cache's dtype: the values later reads see, as paged_attention)
            ki = latent[start:end].to(kv_layer.dtype).to(q.dtype)[None, None]  # [1, 1, n, W]
            oi = F.scaled_dot_product_attention(qi, ki, ki[..., :value_dim], is_causal=True,
                                                scale=scale, enable_gqa=hq > 1)
            out[start:end] = oi[0].transpose(0, 1)
        else:
            nb = -(-seq_len // block_size)
            ctx = _gather_parts(kv_layer, meta.block_tables[i:i + 1, :nb], workspace)[0]
            keys = torch.arange(nb * block_size, device=q.device)
            rows = torch.arange(n, device=q.device)
            mask = (keys[None, :] <= rows[:, None] + past).unsqueeze(0)  # [1, n, L]
            out[start:end] = _attend_grouped(q[start:end].unsqueeze(0), ctx,
                                             ctx[..., :value_dim], mask, scale)[0]
    return out
