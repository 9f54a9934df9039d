"""RMSNorm as the model computes it in PyTorch: the reference every norm kernel (the CPU
``cpu_ops``, the CUDA ``triton_norm``) matches and falls back to. Its own module, below
``llama`` and the kernels, so that each can import it."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rms_norm(h), h)``, ``h = residual + x`` (``x`` when None), in PyTorch:
    normalised in float32 (``F.rms_norm``: one kernel on CUDA), cast to x's dtype, scaled in
    it, as transformers' LlamaRMSNorm rounds."""
    h = x if residual is None else residual + x
    y = nn.functional.rms_norm(h.float(), (h.shape[-1],), None, eps)
    return weight * y.to(h.dtype), h
