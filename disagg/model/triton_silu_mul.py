"""SwiGLU's ``silu(gate) * up`` as one Triton kernel (CUDA).

PyTorch spends two elementwise kernels per dense MLP on it (``llama.silu_mul_reference``:
``F.silu``, then the multiply) and writes the SiLU result to memory in between; a decode step
of a 32-layer model launches 64 of them. ``triton_silu_mul(gate, up)`` is one launch::

    grid (T, cdiv(I, BLOCK))      program (t, j): columns [j * BLOCK, (j + 1) * BLOCK) of row t
    s   = g / (1 + exp(-g))       g = gate[t] in float32; rounded to the dtype (torch's silu:
                                  float32 math for bfloat16 / float16 inputs, one rounding)
    out = s * up[t]               the product of the two dtype values, rounded once (torch's mul)

with torch's CUDA arithmetic: ``exp`` is libdevice's ``expf`` (what ``::exp`` compiles to, not
``tl.exp``'s fast ``ex2.approx``) and the division rounds to nearest (``div_rn``, not the
approximate ``/``). The result is the PyTorch path's bits, so graph and eager decode agree.

gate and up may be strided views (the two column halves of the fused gate|up GEMM output,
``FusedRows``) or separate tensors; their last dimension must be dense. The result is a new
contiguous ``[T, I]`` tensor (what ``down_proj`` reads). The runner hands the kernel to the
model's dense MLPs (``LlamaForCausalLM.use_silu_mul_kernel``) on CUDA only after
``triton_silu_mul_kernel`` compiled it and found it bit-identical to PyTorch on that device at
the model's dtype; CPU never imports this module.

Tested on CPU under ``TRITON_INTERPRET=1`` (``tests/test_triton_silu_mul.py``): the interpreter
has no libdevice, so there ``exp`` is numpy's (``INTERPRETED``).
"""

from __future__ import annotations

import logging

import torch

from disagg.model.llama import SiluMulKernel, silu_mul_reference
from disagg.model.triton_attention import HAS_TRITON, tl, triton
from disagg.model.triton_rope import bits_differ

logger = logging.getLogger("disagg.model")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAS_TRITON:
    from triton.language.extra import libdevice

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, stride_g, stride_u, stride_o,
                         BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        # Program (t, j): row t, columns [j * BLOCK, (j + 1) * BLOCK) masked to [0, n).
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(gate_ptr + t * stride_g + cols, mask=mask, other=0.0)
        u = tl.load(up_ptr + t * stride_u + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-gf)  # expf, as torch's silu calls it
        else:
            e = tl.exp(-gf)
        s = tl.math.div_rn(gf, 1.0 + e).to(g.dtype)  # torch's silu result (no-op for float32)
        y = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)  # exact product, one rounding
        tl.store(out_ptr + t * stride_o + cols, y, mask=mask)

    # The interpreter (TRITON_INTERPRET=1: the CPU tests) raises on libdevice calls; numpy's
    # exp stands in there (every other step rounds as on the device).
    INTERPRETED = type(_silu_mul_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def _kernel_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """The shapes, dtypes and strides the kernel is written for (anything else: reference)."""
    return (gate.dim() == 2 and up.shape == gate.shape and up.dtype == gate.dtype
            and gate.dtype in _DTYPES and gate.stride(-1) == 1 and up.stride(-1) == 1)


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_reference`` in one Triton launch (``SiluMulKernel``): gate and up ``[T, I]``,
    one dtype, dense last dimension (row strides free); anything else goes to the reference.
    Returns a new contiguous ``[T, I]`` tensor."""
    if not _kernel_applies(gate, up):
        return silu_mul_reference(gate, up)
    t, n = gate.shape
    out = torch.empty((t, n), dtype=gate.dtype, device=gate.device)
    if t == 0 or n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](
        gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0),
        BLOCK=block, LIBDEVICE=not INTERPRETED, num_warps=max(1, min(4, block // 256)))
    return out


def _check_inputs(device: torch.device, dtype: torch.dtype, intermediate_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the MLP hands them over: the column halves of one fused ``[3, 2I]`` GEMM
    output, values spread over SiLU's range (large magnitudes where exp overflows to inf or
    underflows, signed zeros). Not subnormal gates (``|g| < 2**-126``, bfloat16 and float32):
    a flush to zero there is not checked."""
    g = torch.Generator(device=device).manual_seed(0)
    fused = torch.randn(3, 2 * intermediate_size, generator=g, device=device) * 4
    edge = torch.tensor([0.0, -0.0, 30.0, -30.0, 89.0, -89.0, 100.0, -100.0, 1e-3, -1e-3],
                        device=device)
    k = min(edge.numel(), intermediate_size)
    fused[0, :k] = edge[:k]
    fused = fused.to(dtype)
    return fused[:, :intermediate_size], fused[:, intermediate_size:]


def triton_silu_mul_kernel(device: torch.device, dtype: torch.dtype,
                           intermediate_size: int) -> SiluMulKernel | None:
    """``triton_silu_mul`` once it compiled on ``device`` and gave PyTorch's bits at the
    model's dtype and (local) intermediate size; None (with a warning) when triton is missing,
    switched off (``DISAGG_CUDA_ATTENTION=torch``) or the check fails."""
    from disagg.model.attention import triton_available

    if not (HAS_TRITON and triton_available()):
        return None
    try:
        gate, up = _check_inputs(device, dtype, intermediate_size)
        want = silu_mul_reference(gate, up)
        got = triton_silu_mul(gate, up)
        if got.shape != want.shape or got.dtype != want.dtype or not got.is_contiguous():
            raise ValueError(f"result {tuple(got.shape)} {got.dtype}, contiguous "
                             f"{got.is_contiguous()}")
        bad = bits_differ(got, want)
        if bad:
            raise ValueError(f"{bad} of {got.numel()} values differ from PyTorch's bits")
    except Exception as e:  # a compile error or a result that is not PyTorch's bits
        logger.warning("the Triton SiLU * mul kernel is not used (%r): PyTorch silu and mul", e)
        return None
    return triton_silu_mul
