"""Quantized linear weights for CPU: GGUF blocks kept quantized and multiplied as they are.

A ``QuantizedWeight`` stands in for a ``Linear``'s float weight (``llama.Linear.qweight``; the
GGUF loader, ``gguf_weights.py``, builds them from the file's blocks, ``gguf_blocks.py``):

- ``BlockWeight``: Q4_0 / Q4_1 / Q8_0 as the file's blocks (0.5625 / 0.625 / 1.0625 bytes per
  weight) and Q4_K as blocks of 32 with float32 scales (0.75; ``gguf_blocks.kernel_blocks``).
  Up to ``BLOCK_KERNEL_MAX_ROWS`` input rows it runs the C++ kernel (``kernels.quant_kernel``,
  ``csrc/quant_gemm.h``): each input row rounded to 8 bits per block of 32 and integer dot
  products, as llama.cpp's CPU backend computes them; not exact (the rounding of the inputs:
  ``tests/test_gguf_quantized.py`` states the agreement with the float32 import), and the
  fastest path measured (bench/results/quant_kernels.md). More rows (prefill) go to torch's
  GEMM on tiles of ``_DEQUANT_TILE_FLOATS`` dequantized weights (never the whole matrix of a
  large LM head at once): bfloat16 where the CPU multiplies it natively (``BF16_GEMM``: 2x
  float32's speed), else float32 (the file's weights exactly).
- ``Int4Weight`` (where the C++ kernel cannot be built): Q4_0 / Q4_1 / Q4_K as
  ``aten._weight_int4pack_mm_for_cpu`` holds them, group 32: 4-bit codes packed by
  ``_convert_weight_to_int4pack_for_cpu`` and a bfloat16 scale and zero per group
  (w = (q - 8) scale + zero; 0.625 bytes per weight); activations go in as bfloat16 and the
  output comes back as bfloat16, at every row count. Not exact: bfloat16 keeps 8 significant
  bits of fp16's 11 (``tests/test_gguf_quantized.py`` states the bound). The op needs
  N % 16 == 0 (``int4_unpackable`` says why a shape cannot be packed).

``rows(lo, hi)`` is the weight of a row range (the per-layer view of a fused q/k/v or
gate/up weight); ``QuantizedEmbedding`` looks rows up in a quantized table (a ``BlockWeight``
shared with a tied LM head, or raw GGUF blocks dequantized per lookup).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from disagg.model.kernels import QuantKernel

QK = 32  # weights per block / group
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
# Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX): then a many-row product
# (prefill) runs in bfloat16 on bfloat16 tiles of the weights, 2.0-2.5x float32's GEMM here.
BF16_GEMM = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
                 or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
# Up to this many rows the block kernel; more go to torch's GEMM on dequantized tiles.
# Measured on a SmolLM2 layer's Q4_1 linears (2 Zen 4 threads, tiles dequantized per call):
# the kernel 3.7 / 7.3 / 29.7 ms at 64 / 128 / 512 rows, bfloat16 tiles 4.0 / 5.5 / 16.9,
# float32 tiles 5.3 / 8.4 / 26.6.
BLOCK_KERNEL_MAX_ROWS = 64
_DEQUANT_TILE_FLOATS = 1 << 21  # 8 MiB of float32 weights per dequantized tile
_F32, _BF16 = torch.float32, torch.bfloat16
# Private aten ops (torch >= 2.6 on CPU); None where this torch has none.
_INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
_INT4_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)


class QuantizedWeight:
    """A linear's ``[out_features, in_features]`` weight in a quantized format: ``linear(x,
    bias)`` is ``F.linear(x, W, bias)`` on its weights, in ``x``'s dtype."""

    label = "quantized"  # for logs: the format and the kernel

    def __init__(self, out_features: int, in_features: int) -> None:
        self.out_features, self.in_features = out_features, in_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, lo: int, hi: int) -> QuantizedWeight:
        """The weight of output rows ``[lo, hi)``."""
        return _RowsOf(self, lo, hi)

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds (0 for a view of another's rows)."""
        return 0


def _rows2d(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as ``[M, K]`` with unit stride along K (a copy only when it has none)."""
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 or k <= 1 else x2.contiguous()


class BlockWeight(QuantizedWeight):
    """GGUF blocks as ``csrc/quant_gemm.h`` reads them (see the module docstring): ``blocks``
    uint8 ``[N, K / 32 * block bytes]`` of ``type_name`` (``kernels.BLOCK_TYPES``), run by
    ``kernel``."""

    def __init__(self, blocks: torch.Tensor, type_name: str, k: int,
                 kernel: QuantKernel) -> None:
        kernel.check(blocks, type_name, k)
        super().__init__(blocks.shape[0], k)
        self.blocks, self.type_name, self.kernel = blocks, type_name, kernel
        self.label = f"{type_name} blocks (C++ kernel)"

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k = self.in_features
        x2 = _rows2d(x if x.dtype is _F32 else x.float(), k)
        if x2.shape[0] <= BLOCK_KERNEL_MAX_ROWS:
            y = self.kernel.linear(x2, self.blocks, self.type_name, k, bias)
        else:
            y = self._dequantized_linear(x2, bias)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype is _F32 else y.to(x.dtype)

    def _dequantized_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Many rows (prefill): torch's GEMM on tiles of whole rows of the weights (never the
        whole matrix of a large LM head at once), in bfloat16 where the CPU has it
        (``BF16_GEMM``: inputs and weights rounded to bfloat16, the sums in float32), else in
        float32 on the file's weights exactly."""
        n, k = self.out_features, self.in_features
        step = max(1, _DEQUANT_TILE_FLOATS // k)
        dtype = _BF16 if BF16_GEMM else _F32
        xt = x.to(dtype)
        out = x.new_empty(x.shape[0], n)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            tile = self.kernel.dequantize(self.blocks, self.type_name, k, n0, n1, dtype)
            out[:, n0:n1] = F.linear(xt, tile)
        return out if bias is None else out + bias

    def rows(self, lo: int, hi: int) -> BlockWeight:
        return BlockWeight(self.blocks[lo:hi], self.type_name, self.in_features,
                           self.kernel)  # a view: nothing copied

    def dequantize(self) -> torch.Tensor:
        """The float32 weights (exactly the GGUF's)."""
        return self.kernel.dequantize(self.blocks, self.type_name, self.in_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` in float32 (an embedding lookup): exactly the dequantized rows."""
        rows = self.blocks[ids.reshape(-1)]
        out = self.kernel.dequantize(rows, self.type_name, self.in_features)
        return out.view(*ids.shape, self.in_features)


def int4_unpackable(n: int, k: int) -> str | None:
    """Why an ``[n, k]`` weight cannot be an ``Int4Weight`` here, or None when it can."""
    if _INT4_MM is None or _INT4_PACK is None:
        return (f"this torch ({torch.__version__}) has no aten._weight_int4pack_mm_for_cpu / "
                f"_convert_weight_to_int4pack_for_cpu")
    if n % INT4_N_MULTIPLE:
        return f"{n} output rows are not a multiple of {INT4_N_MULTIPLE} (int4pack's packing)"
    if k % QK:
        return f"{k} input columns are not a multiple of the group size {QK}"
    return None


class Int4Weight(QuantizedWeight):
    """4-bit codes packed for ``aten._weight_int4pack_mm_for_cpu`` with bfloat16 group-32
    scales and zeros (see the module docstring). Built from ``codes`` uint8 ``[N, K]`` (0..15)
    and float32 ``scale`` / ``zero`` ``[N, K / 32]``, w = (codes - 8) * scale + zero; the codes
    are not kept (the packed layout interleaves rows: slicing rows needs ``rows``)."""

    label = "int4pack g32 bf16"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        n, k = codes.shape
        why = int4_unpackable(n, k)
        if why is not None:
            raise ValueError(f"int4pack: {why}")
        if tuple(scale.shape) != (n, k // QK) or scale.shape != zero.shape:
            raise ValueError(f"int4pack: scale / zero must be [{n}, {k // QK}], got "
                             f"{tuple(scale.shape)} / {tuple(zero.shape)}")
        super().__init__(n, k)
        assert _INT4_PACK is not None
        self.packed = _INT4_PACK(codes.to(torch.int32), 1)  # uint8 [N, K / 2], packed by CPU
        # [K / 32, N, 2]: (scale, zero) of group g of row n
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).to(_BF16).contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k = self.in_features
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        assert _INT4_MM is not None
        y = _INT4_MM(x2.to(_BF16).contiguous(), self.packed, QK, self.scales_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias


class _RowsOf(QuantizedWeight):
    """Rows ``[lo, hi)`` of a weight whose rows cannot be viewed (a packed int4 one): the whole
    product, then the columns. Only a caller that runs one projection of a fused group alone
    gets here (the model runs the group: ``llama.QuantizedRows``)."""

    def __init__(self, whole: QuantizedWeight, lo: int, hi: int) -> None:
        super().__init__(hi - lo, whole.in_features)
        self.whole, self.lo, self.hi = whole, lo, hi
        self.label = whole.label

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.whole.linear(x)[..., self.lo:self.hi]
        return y if bias is None else y + bias


class RawBlocksTable:
    """An embedding table kept as the GGUF file stores it (``raw`` uint8 ``[V, row bytes]``
    of ``type_name`` blocks); ``lookup`` dequantizes the rows asked for (``gguf.quants``),
    exactly the import's values."""

    def __init__(self, raw: np.ndarray, type_name: str, dim: int) -> None:
        self.raw = torch.from_numpy(np.ascontiguousarray(raw))
        self.type_name, self.dim = type_name, dim

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = self.raw[ids.reshape(-1).cpu()].numpy()
        values = dequantize(rows, GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.ascontiguousarray(values, np.float32)).view(*ids.shape,
                                                                               self.dim)


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` over a quantized table: ``lookup(ids)`` gives the float32 rows (a
    ``BlockWeight``'s or a ``RawBlocksTable``'s), cast to ``dtype``."""

    def __init__(self, lookup: Callable[[torch.Tensor], torch.Tensor], num_embeddings: int,
                 embedding_dim: int, dtype: torch.dtype, label: str) -> None:
        super().__init__()
        self._lookup = lookup
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype, self.label = dtype, label

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._lookup(ids).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.label}"
