"""RMSNorm, optionally after the residual add, as one Triton kernel (CUDA).

A decoder layer does ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``. In PyTorch each norm
is several kernels (upcast, normalise, cast, scale) and the add one more: on a GPU a decode
step is bound by those launches, not by their bytes. ``triton_rms_norm(x, w, eps, residual)``
computes what ``llama.rms_norm_reference`` does in one launch::

    h = residual + x            (in x's dtype, rounded as torch's add rounds; h = x if None)
    y = w * (h * rsqrt(mean(h^2) + eps))    normalised in float32, cast to x's dtype, scaled
                                            in it: the reference (transformers) rounding

and returns ``(y, h)``: one program per row, the whole row in registers (``BLOCK`` = the next
power of two of the hidden size). The runner hands it to the model's norms on CUDA
(``LlamaForCausalLM.use_norm_kernel``) only after ``triton_norm_kernel`` compiled it and
checked it against the reference on that device; CPU never imports this module.

Tested on CPU under ``TRITON_INTERPRET=1`` (``tests/test_triton_norm.py``).
"""

from __future__ import annotations

import logging

import torch

from disagg.model.llama import NormKernel
from disagg.model.norm import rms_norm_reference
from disagg.model.triton_attention import HAS_TRITON, tl, triton

logger = logging.getLogger("disagg.model")


if HAS_TRITON:
    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, n, eps,
                         stride_x, stride_res, stride_y, stride_h,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        # Program r: row r, columns [0, n) of x / residual / y / h (row strides given, columns
        # dense); the tail [n, BLOCK) is masked (zeros add nothing to the sum of squares).
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + r * stride_res + cols, mask=mask, other=0.0)
            x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # torch's add, rounded
            tl.store(h_ptr + r * stride_h + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        normed = (xf * rstd).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
        tl.store(y_ptr + r * stride_y + cols, y, mask=mask)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_reference`` in one Triton launch; ``x`` (and ``residual``) ``[T, n]``, dense rows;
    ``weight`` ``[n]`` in x's dtype. Anything else goes to ``reference``."""
    if (x.dim() != 2 or x.stride(-1) != 1 or weight.dtype != x.dtype
            or not weight.is_contiguous() or (residual is not None and (
                residual.shape != x.shape or residual.stride(-1) != 1
                or residual.dtype != x.dtype))):
        return rms_norm_reference(x, weight, eps, residual)
    t, n = x.shape
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    h = x if residual is None else torch.empty_like(y)
    res = residual if residual is not None else x  # (not read without a residual)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(t,)](x, res, weight, y, h, n, eps, x.stride(0), res.stride(0),
                           y.stride(0), h.stride(0), HAS_RESIDUAL=residual is not None,
                           BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return y, h


def triton_norm_kernel(device: torch.device, dtype: torch.dtype,
                       hidden_size: int) -> NormKernel | None:
    """``triton_rms_norm`` once it compiled and matched the reference on ``device`` at the
    model's dtype and hidden size (with and without a residual); None (with a warning) when
    triton is missing, switched off (``DISAGG_CUDA_ATTENTION=torch``) or the check fails."""
    from disagg.model.attention import triton_available

    if not (HAS_TRITON and triton_available()):
        return None
    g = torch.Generator(device=device).manual_seed(0)
    x, res = (torch.randn(3, hidden_size, generator=g, device=device).to(dtype)
              for _ in range(2))
    w = torch.randn(hidden_size, generator=g, device=device).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    try:
        for r in (None, res):
            got, want = triton_rms_norm(x, w, 1e-5, r), rms_norm_reference(x, w, 1e-5, r)
            for a, b in zip(got, want, strict=True):
                err = float((a.float() - b.float()).abs().max())
                if not err <= tol * (1.0 + float(b.float().abs().max())):
                    raise ValueError(f"max abs error {err:.3g} against PyTorch")
    except Exception as e:  # a compile error or a wrong result on this device
        logger.warning("the Triton RMSNorm kernel is not used (%r): PyTorch RMSNorm", e)
        return None
    return triton_rms_norm
