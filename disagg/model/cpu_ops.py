"""The elementwise work around a decoder layer's linears on the CPU, compiled
(``csrc/elementwise.cpp``, the ``elementwise`` kernel of ``DISAGG_CPU_KERNELS``).

In a decode step of one token each PyTorch op costs its dispatch, not its arithmetic: the
residual add and RMSNorm were ten small ops, RoPE on q and k five, the K/V cache write two
``index_put`` (``bench/results/decode_profile.md``). Here each is one call:

- ``ElementwiseKernel.add_rms_norm(x, weight, eps, residual)``: a ``NormKernel``
  (``llama.RMSNorm.kernel``): ``(weight * rms_norm(h), h)``, ``h = residual + x``. The sum of
  squares is accumulated in double, so the result may differ from ``rms_norm_reference`` in
  the last bits (as the small-M linear differs from BLAS); inputs it does not take (not
  float32 2-D CPU rows, autograd) go to the reference.
- ``ElementwiseKernel.rope_store(qk, v, cos, sin, kv_layer, slot_block, slot_offset)``: RoPE
  of the fused q|k heads in place and the new K/V written into the paged cache, bit for bit
  what ``apply_rope`` and ``attention.write_kv`` compute (``rope_store_applies`` says when).

``elementwise_kernel()`` is None when the library cannot be had (as ``kernels.py``'s); the
runner then leaves the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from disagg.model.kernel_build import build_kernel, kernels_enabled
from disagg.model.norm import rms_norm_reference

_F32, _I64, _num_threads = torch.float32, torch.int64, torch.get_num_threads
_ROPE_ERRORS = {1: "block id out of range", 2: "block offset out of range",
                3: "head dim odd or above 1024", 5: "unsupported cache dtype"}
# KV cache dtypes the compiled kernels read and write (csrc/half.h's codes): float32, and the
# 16-bit caches of kv_cache_dtype under float32 compute.
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 2, torch.float16: 3}


class ElementwiseKernel:
    """The ``disagg_add_rms_norm`` and ``disagg_rope_store`` entry points. Called for every
    norm and layer of a step: the checks are plain conditions, messages built on failure."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._norm = lib.disagg_add_rms_norm
        self._norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_double,
                               ctypes.c_int]
        self._norm.restype = None
        self._rope = lib.disagg_rope_store
        self._rope.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int, *[i64] * 10,
                               ptr, ptr, ctypes.c_int]
        self._rope.restype = ctypes.c_int

    def add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight * rms_norm(h), h)``, ``h = residual + x`` (``x`` when None), as
        ``norm.rms_norm_reference``; inputs the kernel does not take go there."""
        if not _norm_applies(x, weight, residual):
            return rms_norm_reference(x, weight, eps, residual)
        rows, dim = x.shape
        out = torch.empty(rows, dim, dtype=_F32)
        if residual is None:
            h, hp, rp, rs = x, None, None, 0
        else:
            h = torch.empty(rows, dim, dtype=_F32)
            hp, rp, rs = h.data_ptr(), residual.data_ptr(), residual.stride(0)
        if rows:
            self._norm(x.data_ptr(), x.stride(0), rp, rs, weight.data_ptr(), out.data_ptr(),
                       hp, rows, dim, eps, _num_threads())
        return out, h

    def rope_store(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, kv_layer: torch.Tensor, slot_block: torch.Tensor,
                   slot_offset: torch.Tensor) -> None:
        """RoPE of ``qk`` ``[T, Hq + Hkv, D]`` in place (``apply_rope``'s bits), then row t's
        k heads (``qk[t, Hq:]``) and ``v[t]`` written to ``kv_layer`` ``[N, 2, Hkv, B, D]``
        at block ``slot_block[t]``, offset ``slot_offset[t]`` (a 16-bit cache gets them rounded
        to nearest even, as ``write_kv``'s ``.to``). Only for what ``rope_store_applies``
        accepts."""
        t, heads, d = qk.shape
        n, _, hkv, b, _ = kv_layer.shape
        ks = kv_layer.stride()
        err = self._rope(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0),
                         cos.data_ptr(), sin.data_ptr(), kv_layer.data_ptr(),
                         CACHE_TYPES[kv_layer.dtype], t, heads - hkv,
                         hkv, d, n, b, ks[0], ks[1], ks[2], ks[3], slot_block.data_ptr(),
                         slot_offset.data_ptr(), _num_threads())
        if err:  # checked by the kernel before writing anything
            raise RuntimeError(f"rope_store: {_ROPE_ERRORS.get(err, f'error {err}')}")


def _norm_applies(x: torch.Tensor, weight: torch.Tensor,
                  residual: torch.Tensor | None) -> bool:
    """float32 CPU ``[rows, dim]`` rows with a dense last dim (and the same for the residual),
    a contiguous ``[dim]`` weight, no autograd to record."""
    if not (x.dim() == 2 and x.dtype is _F32 and x.is_cpu and weight.dtype is _F32
            and weight.is_cpu and weight.dim() == 1 and weight.is_contiguous()
            and weight.shape[0] == x.shape[1] and (x.stride(1) == 1 or x.shape[1] <= 1)):
        return False
    if residual is not None and not (
            residual.dtype is _F32 and residual.is_cpu and residual.shape == x.shape
            and (residual.stride(1) == 1 or x.shape[1] <= 1)):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (
        residual is not None and residual.requires_grad)))


def rope_store_applies(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, kv_layer: torch.Tensor, slot_block: torch.Tensor,
                       slot_offset: torch.Tensor) -> bool:
    """Whether ``rope_store`` serves ``apply_rope`` + ``write_kv`` here: float32 CPU tensors
    (the cache float32, bfloat16 or float16),
    ``qk`` ``[T, Hq + Hkv, D]`` and ``v`` ``[T, Hkv, D]`` with dense heads, ``cos`` and
    ``sin`` ``[T, 1, D]`` contiguous, a ``[N, 2, Hkv, B, D]`` cache with a dense last dim,
    contiguous int64 ``[T]`` slots, no autograd to record."""
    if not (qk.dim() == 3 and v.dim() == 3 and kv_layer.dim() == 5 and qk.dtype is _F32
            and v.dtype is _F32 and kv_layer.dtype in CACHE_TYPES and cos.dtype is _F32
            and qk.is_cpu and v.is_cpu and kv_layer.is_cpu and cos.is_cpu):
        return False
    t, _, d = qk.shape
    hkv = v.shape[1]
    return (qk.stride(2) == 1 and qk.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d
            and v.shape[0] == t and v.shape[2] == d and kv_layer.shape[2] == hkv
            and kv_layer.shape[4] == d and kv_layer.stride(4) == 1 and kv_layer.shape[1] == 2
            and tuple(cos.shape) == (t, 1, d) and cos.is_contiguous()
            and sin.dtype is _F32 and sin.is_cpu and sin.shape == cos.shape
            and sin.is_contiguous() and slot_block.dtype is _I64 and slot_offset.dtype is _I64
            and slot_block.is_contiguous() and slot_offset.is_contiguous()
            and slot_block.numel() == t and slot_offset.numel() == t
            and not (torch.is_grad_enabled() and (qk.requires_grad or v.requires_grad
                                                  or kv_layer.requires_grad)))


@functools.lru_cache(maxsize=1)
def elementwise_kernel() -> ElementwiseKernel | None:
    """The compiled elementwise kernels (built once per process, cached on disk), or None."""
    if not kernels_enabled("elementwise"):
        return None
    lib = build_kernel("elementwise")
    return None if lib is None else ElementwiseKernel(lib)
