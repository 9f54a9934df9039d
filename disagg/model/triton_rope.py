"""RoPE of a decode batch's q and k and the K/V cache write, as one Triton kernel (CUDA).

In a padded decode step (a CUDA graph bucket, ``StaticDecodeMeta``) PyTorch spends per layer
five elementwise kernels on RoPE (``llama.apply_rope``: neg, cat, two muls, an add) and two
``index_put`` kernels on the K/V write (``static_decode.store_kv``). ``triton_rope_store``
does all of it in one launch::

    grid (T, Hq + Hkv)      program (t, h):
        h <  Hq:  q_out[t, h]                                         = RoPE(q[t, h])
        h >= Hq:  kv_layer[slot_block[t], 0, h - Hq, slot_offset[t]]  = RoPE(k[t, h - Hq])
                  kv_layer[slot_block[t], 1, h - Hq, slot_offset[t]]  = v[t, h - Hq]

    RoPE(x)[i] = x[i] * cos[t, i] + rot[i] * sin[t, i],
                 rot = (-x[D/2:], x[:D/2])                            (rotate_half)

with the roundings of ``apply_rope`` in the tensors' dtype (each torch op computes in float32
and rounds once): ``x * cos`` rounded, ``rot * sin`` rounded, their sum rounded; contraction
into a fused multiply-add is switched off so float32 rounds the same way too. The result is
the PyTorch path's bits (``rope_store_reference``): graph and eager decode agree exactly.

q/k/v may be strided views (the column ranges of the fused q/k/v GEMM's output, or Qwen3's
normed heads); the last dimension must be dense. q's result is a new contiguous tensor (what
``paged_decode`` reads). The runner hands the kernel to the decode graphs
(``DecodeGraphs(rope_store=...)``) on CUDA only after ``triton_rope_store_kernel`` compiled it
and found it bit-identical to the reference on that device; CPU never imports this module.

Tested on CPU under ``TRITON_INTERPRET=1`` (``tests/test_triton_rope.py``).
"""

from __future__ import annotations

import logging

import torch

from disagg.model.llama import apply_rope
from disagg.model.static_decode import RopeStoreFn, store_kv
from disagg.model.triton_attention import HAS_TRITON, tl, triton

logger = logging.getLogger("disagg.model")


def rope_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, kv_layer: torch.Tensor, slot_block: torch.Tensor,
                         slot_offset: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in PyTorch: the model's ``apply_rope`` on q and k, then
    ``store_kv`` (``StaticDecodeMeta.attend``'s write); returns RoPE(q), contiguous."""
    store_kv(apply_rope(k, cos, sin), v, kv_layer, slot_block, slot_offset)
    return apply_rope(q, cos, sin).contiguous()


if HAS_TRITON:
    @triton.jit
    def _rope(x, x_partner, c, s, first_half):
        # apply_rope's roundings: x * cos, rot * sin and the sum each rounded to x's dtype
        # (no-op casts for float32); rot = -partner on the first half (exact in float32).
        xp = x_partner.to(tl.float32)
        rot = tl.where(first_half, -xp, xp)
        a = (x.to(tl.float32) * c).to(x.dtype)
        b = (rot * s).to(x.dtype)
        return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kv_ptr, blk_ptr, off_ptr,
                           out_ptr, num_q_heads,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_ct, stride_st,
                           stride_kvn, stride_kvkv, stride_kvh, stride_kvb,
                           stride_ot, stride_oh,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        # Program (t, h): one head row of token t (see the module docstring); columns
        # [HEAD_DIM, BLOCK_D) are masked (head dims that are not powers of two).
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < HEAD_DIM
        first_half = cols < HEAD_DIM // 2
        # rotate_half's pairing: column i with i + D/2 (first half), i - D/2 (second half)
        partner = tl.where(first_half, cols + HEAD_DIM // 2, cols - HEAD_DIM // 2)
        c = tl.load(cos_ptr + t * stride_ct + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
        if h < num_q_heads:
            src = q_ptr + t * stride_qt + h * stride_qh
            x = tl.load(src + cols, mask=mask, other=0.0)
            xp = tl.load(src + partner, mask=mask, other=0.0)
            tl.store(out_ptr + t * stride_ot + h * stride_oh + cols,
                     _rope(x, xp, c, s, first_half), mask=mask)
        else:
            hk = h - num_q_heads
            src = k_ptr + t * stride_kt + hk * stride_kh
            x = tl.load(src + cols, mask=mask, other=0.0)
            xp = tl.load(src + partner, mask=mask, other=0.0)
            blk = tl.load(blk_ptr + t).to(tl.int64)
            off = tl.load(off_ptr + t).to(tl.int64)
            slot = kv_ptr + blk * stride_kvn + hk * stride_kvh + off * stride_kvb
            tl.store(slot + cols, _rope(x, xp, c, s, first_half), mask=mask)
            val = tl.load(v_ptr + t * stride_vt + hk * stride_vh + cols, mask=mask, other=0.0)
            tl.store(slot + stride_kvkv + cols, val, mask=mask)


def _kernel_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_layer: torch.Tensor, slot_block: torch.Tensor,
                    slot_offset: torch.Tensor) -> bool:
    """The shapes, dtypes and strides the kernel is written for (anything else: reference)."""
    if q.dim() != 3 or k.dim() != 3 or kv_layer.dim() != 5:
        return False
    t, _, d = q.shape
    hkv = k.shape[1]
    return (d % 2 == 0 and k.shape == (t, hkv, d) and v.shape == k.shape
            and cos.shape == (t, 1, d) and sin.shape == cos.shape
            and kv_layer.shape[1] == 2 and kv_layer.shape[2] == hkv
            and kv_layer.shape[4] == d
            and slot_block.shape == (t,) and slot_offset.shape == (t,)
            and not slot_block.is_floating_point() and not slot_offset.is_floating_point()
            and slot_block.is_contiguous() and slot_offset.is_contiguous()
            and all(x.dtype == q.dtype for x in (k, v, cos, sin, kv_layer))
            and all(x.stride(-1) == 1 for x in (q, k, v, cos, sin, kv_layer)))


def triton_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv_layer: torch.Tensor, slot_block: torch.Tensor,
                      slot_offset: torch.Tensor) -> torch.Tensor:
    """``rope_store_reference`` in one Triton launch (``RopeStoreFn``): q ``[T, Hq, D]``,
    k/v ``[T, Hkv, D]``, cos/sin ``[T, 1, D]``, kv_layer ``[N, 2, Hkv, B, D]``, all one dtype,
    dense last dimensions; anything else goes to the reference. No host sync."""
    if not _kernel_applies(q, k, v, cos, sin, kv_layer, slot_block, slot_offset):
        return rope_store_reference(q, k, v, cos, sin, kv_layer, slot_block, slot_offset)
    t, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    block = triton.next_power_of_2(d)
    _rope_store_kernel[(t, hq + hkv)](
        q, k, v, cos, sin, kv_layer, slot_block, slot_offset, out, hq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block, num_warps=max(1, min(4, block // 64)),
        enable_fp_fusion=False)  # x*cos + rot*sin as two rounded products, as torch does
    return out


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shape, same-dtype tensors differ bit for bit (NaNs and
    signed zeros included, unlike ``torch.equal``)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.view(as_int) != b.view(as_int)).sum())


def _check_inputs(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                  head_dim: int, block_size: int
                  ) -> tuple[torch.Tensor, ...]:
    """A 3-token decode batch in the model's shapes as the graphs feed it: q/k/v column ranges
    of one fused projection output, cos/sin of real positions, a layer view of a 2-layer cache,
    slots in different blocks and offsets (the first and last offset of a block)."""
    g = torch.Generator(device=device).manual_seed(0)
    t, hq, hkv, d = 3, num_heads, num_kv_heads, head_dim
    fused = (torch.randn(t, (hq + 2 * hkv) * d, generator=g, device=device) * 2).to(dtype)
    q = fused[:, :hq * d].view(t, hq, d)
    k = fused[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = fused[:, (hq + hkv) * d:].view(t, hkv, d)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = torch.tensor([5.0, 0.0, 4099.0], device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    cache = torch.randn(4, 2, 2, hkv, block_size, d, generator=g, device=device).to(dtype)
    slot_block = torch.tensor([2, 0, 3], device=device)
    slot_offset = torch.tensor([block_size - 1, 0, 1 % block_size], device=device)
    return q, k, v, cos, sin, cache, slot_block, slot_offset


def triton_rope_store_kernel(device: torch.device, dtype: torch.dtype, num_heads: int,
                             num_kv_heads: int, head_dim: int,
                             block_size: int) -> RopeStoreFn | None:
    """``triton_rope_store`` once it compiled on ``device`` and gave the reference's bits at the
    model's dtype, local head counts, head dim and block size; None (with a warning) when
    triton is missing, switched off (``DISAGG_CUDA_ATTENTION=torch``) or the check fails."""
    from disagg.model.attention import triton_available

    if not (HAS_TRITON and triton_available()):
        return None
    try:
        q, k, v, cos, sin, cache, blk, off = _check_inputs(
            device, dtype, num_heads, num_kv_heads, head_dim, block_size)
        want_cache = cache.clone()
        want = rope_store_reference(q, k, v, cos, sin, want_cache[:, 1], blk, off)
        got = triton_rope_store(q, k, v, cos, sin, cache[:, 1], blk, off)
        if got.shape != want.shape or not got.is_contiguous():
            raise ValueError(f"q result {tuple(got.shape)}, contiguous {got.is_contiguous()}")
        for name, a, b in (("q", got, want), ("cache", cache, want_cache)):
            bad = bits_differ(a, b)
            if bad:
                raise ValueError(f"{bad} of {a.numel()} {name} values differ from PyTorch's "
                                 f"bits")
    except Exception as e:  # a compile error or a result that is not the reference's bits
        logger.warning("the Triton RoPE + KV write kernel is not used (%r): PyTorch RoPE and "
                       "index_put", e)
        return None
    return triton_rope_store
