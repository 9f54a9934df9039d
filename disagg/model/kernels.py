"""Optional compiled CPU kernels, built on first use with the local C++ compiler.

- ``paged_decode_kernel()``: the decode attention of ``csrc/paged_attention.cpp`` (reads the
  paged KV cache in place instead of gathering it);
- ``small_linear_kernel()``: ``csrc/small_gemm.cpp``, ``x @ w.T (+ bias)`` for a few rows
  (decode batches), where BLAS is slow; ``small_linear_applies`` says when to use it;
- ``quant_kernel()``: the same library's linear on GGUF blocks (Q4_0, Q4_1, Q4_K's sub-blocks,
  Q8_0; ``csrc/quant_gemm.h``: the input rows rounded to 8 bits per block of 32, integer dot
  products, as llama.cpp computes them) and its dequantizer (``disagg.model.quant`` uses them).

Each returns None when it cannot be had: not on a CPU, no C++ compiler, a failed build, or
switched off by ``DISAGG_CPU_KERNELS``: ``0`` (or false/no/off) disables both, a comma list
such as ``attention`` or ``linear`` enables only those named, unset / ``1`` enables all.
Callers then use the pure-PyTorch path, which gives the same results (tests compare the two).
``status()`` says which kernels this process has (for benchmark reports).

The sources are plain C++ with a C ABI over raw pointers, strides and sizes, without torch's
headers: the system compiler (``c++``, ``kernel_build.COMPILE_FLAGS``) builds each into a shared
library in seconds (``bench/kernel_build.py`` times it against the former
``torch.utils.cpp_extension`` build; ``bench/results/kernel_build.md``), and ctypes loads it.
The Python wrappers here check dtypes, layouts and devices, allocate the output and pass
``data_ptr()``s; the kernels check the block ids before reading the cache. They use torch's
thread count and its OpenMP runtime, with the GIL held (ctypes.PyDLL) as an extension would.

Building and caching (``$DISAGG_CACHE_DIR/kernels/``, one build at a time, never silent) is
``model/kernel_build.py``, torch-free so that ``disagg launch`` can build the kernels while it
imports the model.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from disagg.env import CPU_KERNEL_NAMES
from disagg.model.cpu_ops import elementwise_kernel
from disagg.model.kernel_build import build_kernel, kernels_enabled

__all__ = ["BLOCK_TYPES", "DecodeKernel", "LinearKernel", "QuantKernel",
           "SMALL_LINEAR_MAX_ROWS", "decoder_library", "kernels_enabled", "paged_decode_kernel",
           "quant_kernel", "small_linear_applies", "small_linear_kernel", "status"]

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                        torch.Tensor]
# (x [M, K], w [N, K], bias [N] | None) -> x @ w.T (+ bias), float32, [M, N]
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

# Up to this many rows the small-M kernel beats torch's GEMM (one Zen 3 core: 1.1-2.4x for
# 1..32 rows with K = 512..4096; at 48 rows from +4% to -4% by shape, even at 64; see
# docs/DESIGN.md section 5); more rows (prefill) go to F.linear.
SMALL_LINEAR_MAX_ROWS = 32

# Looked up once: the wrappers below run for every projection and layer of a decode step.
_F32, _I64, _num_threads = torch.float32, torch.int64, torch.get_num_threads
_DECODE_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
_DECODE_ERRORS = {1: "sequence length out of range of its block table",
                  2: "block id out of range", 3: "unsupported dtype"}


class _PagedDecode:
    """``(q [S, Hq, D], kv_layer [N, 2, Hkv, B, D], tables [S, max_blocks] int64, lens [S]
    int64, scale) -> out [S, Hq, D]`` over ``disagg_paged_decode_attention``. Called once per
    layer and step: the checks are plain conditions, their messages built only on failure."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        fn = lib.disagg_paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, *[i64] * 12,
                       ctypes.c_double, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
        if not (q.is_cpu and kv_layer.is_cpu and tables.is_cpu and lens.is_cpu):
            raise RuntimeError("CPU tensors only")
        if not (q.dim() == 3 and q.is_contiguous()):
            raise RuntimeError("q must be a contiguous [S, Hq, D]")
        strides = kv_layer.stride()
        if not (len(strides) == 5 and kv_layer.shape[1] == 2 and strides[4] == 1):
            raise RuntimeError("kv_layer must be [N, 2, Hkv, B, D] with a dense last dim")
        dtype = _DECODE_DTYPES.get(q.dtype)
        kv_dtype = _DECODE_DTYPES.get(kv_layer.dtype)
        if dtype is None or kv_dtype is None or not (
                dtype == kv_dtype or (q.dtype is _F32 and kv_dtype in (2, 3))):
            raise RuntimeError(f"paged_decode_attention: q {q.dtype} over a {kv_layer.dtype} "
                               "cache not supported (the same dtype, or float32 over a 16-bit "
                               "cache)")
        s, hq, d = q.shape
        n, _, hkv, b, kv_d = kv_layer.shape
        if d != kv_d:
            raise RuntimeError("head_dim differs")
        if hq % hkv:
            raise RuntimeError("query heads not a multiple of kv heads")
        t_strides = tables.stride()
        if not (tables.dtype is _I64 and len(t_strides) == 2 and t_strides[1] == 1
                and tables.shape[0] == s):
            raise RuntimeError("tables must be [S, max_blocks] int64 with dense rows")
        if not (lens.dtype is _I64 and lens.is_contiguous() and lens.numel() == s):
            raise RuntimeError("lens must be [S] int64")
        out = torch.empty_like(q)
        err = self._fn(q.data_ptr(), kv_layer.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                       out.data_ptr(), dtype, kv_dtype, s, hq, d, hkv, b, n, strides[0], strides[1],
                       strides[2], strides[3], t_strides[0], tables.shape[1], scale,
                       _num_threads())
        if err:  # checked by the kernel before reading anything
            raise RuntimeError(_DECODE_ERRORS.get(err, f"error {err}"))
        return out


class _SmallLinear:
    """``(x [M, K], w [N, K], bias [N] | None) -> x @ w.T (+ bias)`` over
    ``disagg_small_linear``; float32 CPU tensors, ``x`` dense along K, ``w`` contiguous.
    Called for every projection of a decode step: the checks are plain conditions, their
    messages built only on failure."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        fn = lib.disagg_small_linear
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
        fn.restype = None
        self._fn = fn

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if not (x.is_cpu and w.is_cpu):
            raise RuntimeError("small_linear: CPU tensors only")
        if not (x.dtype is _F32 and w.dtype is _F32):
            raise RuntimeError("small_linear: float32 only")
        x_strides = x.stride()
        if not (len(x_strides) == 2 and (x_strides[1] == 1 or x.shape[1] <= 1)):
            raise RuntimeError("small_linear: x must be [M, K] with unit stride along K")
        if not (w.dim() == 2 and w.is_contiguous()):
            raise RuntimeError("small_linear: w must be a contiguous [N, K]")
        m, k = x.shape
        n, w_k = w.shape
        if k != w_k:
            raise RuntimeError(f"small_linear: x has K={k}, w has K={w_k}")
        bp = None
        if bias is not None:
            if not (bias.is_cpu and bias.dtype is _F32 and bias.dim() == 1
                    and bias.shape[0] == n and bias.is_contiguous()):
                raise RuntimeError("small_linear: bias must be a contiguous float32 [N]")
            bp = bias.data_ptr()
        out = x.new_empty(m, n)  # float32 on the CPU, as x
        if m and n:
            self._fn(x.data_ptr(), w.data_ptr(), bp, out.data_ptr(), m, k, n, x_strides[0],
                     _num_threads())
        return out


# csrc/quant_gemm.h's block types: name -> (kernel code, bytes per block of 32 weights)
BLOCK_TYPES = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q4F": (2, 24), "Q8_0": (3, 34)}


class QuantKernel:
    """Linears on GGUF blocks (``blocks`` uint8 ``[N, K / 32 * block bytes]`` of a
    ``BLOCK_TYPES`` type) over ``disagg_quant_linear`` / ``disagg_quant_dequantize``.
    ``disagg.model.quant.BlockWeight`` checks the blocks once, when it is built; the per-call
    checks here are the input's."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._linear = lib.disagg_quant_linear
        self._linear.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int, i64, ptr, ptr,
                                 ctypes.c_int]
        self._linear.restype = None
        self._deq = {}
        for dtype, name in ((_F32, "disagg_quant_dequantize"),
                            (torch.bfloat16, "disagg_quant_dequantize_bf16")):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int]
            fn.restype = None
            self._deq[dtype] = fn

    @staticmethod
    def check(blocks: torch.Tensor, type_name: str, k: int) -> None:
        """Raise unless ``blocks`` are rows of ``k`` weights the kernel reads: a contiguous
        CPU uint8 ``[N, K / 32 * block bytes]``, K % 32 == 0."""
        if type_name not in BLOCK_TYPES:
            raise RuntimeError(f"quant: block type {type_name!r} is not one of "
                               f"{list(BLOCK_TYPES)}")
        nbytes = BLOCK_TYPES[type_name][1]
        if not (blocks.is_cpu and blocks.dtype is torch.uint8 and blocks.dim() == 2
                and blocks.is_contiguous() and k > 0 and k % 32 == 0
                and blocks.shape[1] == k // 32 * nbytes):
            raise RuntimeError(f"quant: {type_name} blocks of rows of {k} weights must be a "
                               f"contiguous CPU uint8 [N, {k // 32 * nbytes}] (K % 32 == 0); "
                               f"got {blocks.dtype} {tuple(blocks.shape)}")

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, type_name: str, k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K] @ W.T (+ bias)``: float32 CPU ``x`` dense along K; its rows rounded to
        8 bits per block of 32 (``csrc/quant_gemm.h``)."""
        if not (x.is_cpu and x.dtype is _F32 and x.dim() == 2
                and (x.stride(1) == 1 or x.shape[1] <= 1)):
            raise RuntimeError("quant: x must be a float32 CPU [M, K] with unit stride along K")
        m, xk = x.shape
        n = blocks.shape[0]
        if xk != k:
            raise RuntimeError(f"quant: x has K={xk}, the weights K={k}")
        bp = None
        if bias is not None:
            if not (bias.is_cpu and bias.dtype is _F32 and bias.dim() == 1
                    and bias.shape[0] == n and bias.is_contiguous()):
                raise RuntimeError("quant: bias must be a contiguous float32 [N]")
            bp = bias.data_ptr()
        out = x.new_empty(m, n)
        if m and n:
            self._linear(x.data_ptr(), x.stride(0), m, k, blocks.data_ptr(),
                         BLOCK_TYPES[type_name][0], n, bp, out.data_ptr(), _num_threads())
        return out

    def dequantize(self, blocks: torch.Tensor, type_name: str, k: int, n0: int = 0,
                   n1: int | None = None, dtype: torch.dtype = _F32) -> torch.Tensor:
        """The weights of rows ``[n0, n1)`` (default: all), ``[n1 - n0, K]``, in float32 (the
        file's exactly) or bfloat16 (rounded to nearest even)."""
        n1 = blocks.shape[0] if n1 is None else n1
        if not 0 <= n0 <= n1 <= blocks.shape[0]:
            raise RuntimeError(f"quant: rows [{n0}, {n1}) out of range of {blocks.shape[0]}")
        if dtype not in self._deq:
            raise RuntimeError(f"quant: dequantize to {dtype}: only float32 or bfloat16")
        out = torch.empty(n1 - n0, k, dtype=dtype)
        if n1 > n0:
            self._deq[dtype](BLOCK_TYPES[type_name][0], blocks.data_ptr(), k, n0, n1,
                             out.data_ptr(), _num_threads())
        return out


@functools.lru_cache(maxsize=1)
def paged_decode_kernel() -> DecodeKernel | None:
    """The compiled decode attention (built once per process, cached on disk), or None."""
    if not kernels_enabled("attention"):
        return None
    lib = build_kernel("attention")
    return None if lib is None else _PagedDecode(lib)


@functools.lru_cache(maxsize=1)
def small_linear_kernel() -> LinearKernel | None:
    """The compiled small-M linear (built once per process, cached on disk), or None.

    Only for the inputs ``small_linear_applies`` accepts; it raises on others.
    """
    if not kernels_enabled("linear"):
        return None
    lib = build_kernel("linear")
    return None if lib is None else _SmallLinear(lib)


@functools.lru_cache(maxsize=1)
def quant_kernel() -> QuantKernel | None:
    """The compiled linear on GGUF blocks of the ``linear`` library (built once per process,
    cached on disk), or None: then the GGUF loader falls back (``gguf_weights.py``)."""
    if not kernels_enabled("linear"):
        return None
    lib = build_kernel("linear")
    return None if lib is None else QuantKernel(lib)


@functools.lru_cache(maxsize=1)
def decoder_library() -> ctypes.PyDLL | None:
    """The compiled decode stack's library (``csrc/decoder.cpp``; ``cpu_decoder.py`` declares
    its entry point), built once per process, cached on disk; or None."""
    if not kernels_enabled("decoder"):
        return None
    return build_kernel("decoder")


_KERNELS = {"attention": paged_decode_kernel, "linear": small_linear_kernel,
            "elementwise": elementwise_kernel, "decoder": decoder_library}


def status() -> dict[str, bool]:
    """Which kernels this process has, by ``DISAGG_CPU_KERNELS`` name: enabled and built
    (building them if not yet done). For benchmark reports."""
    return {name: _KERNELS[name]() is not None for name in CPU_KERNEL_NAMES}


def small_linear_applies(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> bool:
    """Whether ``small_linear_kernel()(x, weight, bias)`` serves ``F.linear(x, weight, bias)``:
    float32 CPU tensors, ``x`` 2-D with 1..SMALL_LINEAR_MAX_ROWS rows and a dense last dim, a
    contiguous weight (and bias), and no autograd to record."""
    return (x.dim() == 2 and 0 < x.shape[0] <= SMALL_LINEAR_MAX_ROWS
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.stride(1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"
                                  and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))
