"""Quantized-weight CPU kernels for decode (M = 1..16 rows): what exists, by the numbers.

    python -m bench.quant_kernels [--threads 2 1] [--rows 1 2 4 8 16] [--reps 7]
        [--model-dir DIR | --random] [--out bench/results/quant_kernels.md]

The weights are SmolLM2-135M's linears: q/k/v/o and gate/up/down of its 30 layers and the
49152 x 576 LM head, one decode step's worth (134.5 M weights, 538 MB in float32, so the
working set is far beyond the caches), taken from the imported SmolLM2 checkpoint
(``disagg model fetch``; its float32 tensors are the GGUF file's dequantized Q4_1 / Q8_0) or,
with ``--random``, seeded heavy-tailed random weights of the same shapes. They are quantized
GGUF-style by ``gguf.quants`` (the reference llama.cpp's Python package ships): Q8_0 (blocks of
32, one fp16 scale) and Q4_1 (blocks of 32, fp16 scale and minimum); the reference output of a
linear is float32 ``F.linear`` on the GGUF-dequantized weights.

Paths (each a whole step's linears, one call per linear, inputs already in the path's dtype):
``F.linear`` float32 (today's path) and bfloat16; the project's small-M C++ kernel
(``disagg.model.kernels.small_linear_kernel``, float32);
the project's C++ block kernel (``disagg.model.kernels.quant_kernel``, ``csrc/quant_gemm.h``,
as the engine runs it: ``gguf_blocks.kernel_blocks`` gives each linear's GGUF bytes, Q8_0 / Q4_1
as they are, 1.0625 / 0.625 bytes per weight; a ``quant.BlockWeight`` over them, whose
``linear`` rounds each float32 input row to 8 bits per block of 32 and does integer dot
products, as llama.cpp does; timed through the thin ``QuantKernel.linear`` wrapper, as the
small-M kernel through its own; one path per format, its stored bytes the blocks');
``aten._weight_int8pack_mm`` (int8, one scale per output channel, the scale in the activation
dtype: float32 or bfloat16);
``aten._weight_int4pack_mm_for_cpu`` (``_convert_weight_to_int4pack_for_cpu``: uint8 [N, K/2];
per-group scale and zero [K/G, N, 2] in the activation dtype, float32 / float16 / bfloat16;
w = (q - 8) * scale + zero); torchao's CPU weight-only tensors when ``import torchao`` works
(its ``Int8Tensor`` per row and per group of 32, eager; its ``Int4OpaqueTensor``, group 32,
bfloat16, over the int4pack op). torchao is not a dependency: install it beside the
environment without touching its torch, e.g. ``pip install --no-deps --target /tmp/tao
torchao`` and run with ``PYTHONPATH=/tmp/tao``.

Timing: for each thread count and row count M, every path runs the whole step once to warm,
then ``--reps`` rounds in which each path runs the step once, the starting path rotating by
round; the median per path is reported, as ms per step and as GB/s of the weight bytes the path
stores (weights + scales + zeros), beside the memory read bandwidth measured in the same
process (a large float32 tensor's ``sum``, at the same thread count, before and after). A path
whose warm-up step takes over ``--slow-s`` is timed by that one step, and one that takes over
``--give-up-s`` is not timed at larger M (some variants are 10-50x slower than the rest).

Agreement (one M, ``--err-rows``): max abs and relative (Frobenius) error of each path's
outputs against the reference, over all linears; how exactly the path's stored format holds
the GGUF weights (max |W_path - W_gguf| over all weights, from the path's own parameters), and
the kernel's own view of 32 input columns of each layer-0 linear (its output for unit-vector
inputs). Yardsticks: the GGUF quantization's own error, and llama.cpp's: its CPU dot products
round the activations to 8-bit blocks of 32 first; a path whose error stays within the latter
is called faithful (the block kernel's error is that rounding, with float32 input scales where
llama.cpp keeps fp16 ones: the report compares the two). Q4_0 and Q4_K (which needs K % 256 ==
0: the down projections here) are checked through int4pack and the block kernel too (Q4_K as
``Q4F`` blocks of 32 with float32 scale and minimum), each against both yardsticks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.baseline import cpu_line, git, machine_busy_s
from disagg.model.gguf import default_fetch_dir
from disagg.model.gguf_blocks import kernel_blocks
from disagg.model.kernels import QuantKernel, quant_kernel, small_linear_kernel
from disagg.model.quant import BlockWeight

QK = 32  # elements per Q8_0 / Q4_1 block
# torch's packed weight-only CPU ops are private aten names: looked up once, by name.
_AT = {name: getattr(torch.ops.aten, name) for name in (
    "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu",
    "_dyn_quant_pack_4bit_weight")}
INT4_GROUPS = (32, 64, 128)
FORMATS = ("Q8_0", "Q4_1")
# Stored bytes per weight of GGUF blocks (for the bound of a kernel that reads them as is).
GGUF_BYTES_PER_WEIGHT = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q4_K": 144 / 256}
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")

Tensor = torch.Tensor
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Shapes:
    """A Llama model's linear shapes (SmolLM2-135M by default); ``linears()`` in step order."""

    hidden: int = 576
    intermediate: int = 1536
    kv_dim: int = 192
    layers: int = 30
    vocab: int = 49152

    def layer(self) -> list[tuple[str, int, int]]:
        """(name, N out, K in) of one layer's seven projections."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        return [("q_proj", h, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, h),
                ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]

    def linears(self) -> list[tuple[str, int, int]]:
        out = [(f"layers.{n}.{name}", o, k) for n in range(self.layers)
               for name, o, k in self.layer()]
        return [*out, ("lm_head", self.vocab, self.hidden)]


# ---------------------------------------------------------------------------- weights


def random_weights(shapes: Shapes, seed: int) -> list[np.ndarray]:
    """Student-t (5 degrees of freedom) * 0.02: heavier tails than a normal, as trained
    weights have, so per-channel scaling pays for its outliers as it would on a real model."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_t(5, size=(n, k)) * 0.02).astype(np.float32)
            for _, n, k in shapes.linears()]


def checkpoint_weights(model_dir: str, shapes: Shapes) -> list[np.ndarray]:
    """The float32 linears of a Llama checkpoint folder (``model.safetensors``), in
    ``shapes.linears()`` order; the LM head is the embedding when they are tied."""
    from safetensors import safe_open

    path = os.path.join(model_dir, "model.safetensors")
    out = []
    with safe_open(path, "np") as f:
        keys = set(f.keys())
        for name, n, k in shapes.linears():
            if name == "lm_head":
                key = "lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight"
            else:
                layer, proj = name.split(".")[1:]
                part = "self_attn" if proj[0] in "qkvo" else "mlp"
                key = f"model.layers.{layer}.{part}.{proj}.weight"
            if key not in keys:
                raise SystemExit(f"{path}: no tensor {key}")
            w = np.ascontiguousarray(f.get_tensor(key), dtype=np.float32)
            if w.shape != (n, k):
                raise SystemExit(f"{path}: {key} is {w.shape}, expected {(n, k)} (--model-dir "
                                 f"must be a SmolLM2-135M-shaped checkpoint, or use --random)")
            out.append(w)
    return out


@dataclass
class Q8_0:
    """One matrix in GGUF Q8_0: w = d[block] * q, d fp16 (held as float32 here)."""

    d: Tensor    # [N, K / 32] float32 (fp16 values)
    q: Tensor    # [N, K] int8
    deq: Tensor  # [N, K] float32, gguf.quants.dequantize's
    raw: np.ndarray  # [N, K / 32 * 34] uint8: the GGUF blocks' bytes


@dataclass
class Q4_1:
    """One matrix in GGUF Q4_1: w = d[block] * q + m[block], q in 0..15, d and m fp16."""

    d: Tensor    # [N, K / 32] float32 (fp16 values)
    m: Tensor    # [N, K / 32] float32 (fp16 values)
    q: Tensor    # [N, K] uint8
    deq: Tensor  # [N, K] float32, gguf.quants.dequantize's
    raw: np.ndarray  # [N, K / 32 * 20] uint8: the GGUF blocks' bytes


def _halves(raw: np.ndarray, at: int) -> Tensor:
    """The fp16 at byte ``at`` of each block of raw [N, B, block bytes], as float32 [N, B]."""
    return torch.from_numpy(np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0]
                            .astype(np.float32))


def quantize_q8_0(w: np.ndarray) -> Q8_0:
    from gguf import GGMLQuantizationType, quants

    n, k = w.shape
    flat = quants.quantize(w, GGMLQuantizationType.Q8_0)
    raw = flat.reshape(n, k // QK, 2 + QK)
    q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k)
    deq = quants.dequantize(flat, GGMLQuantizationType.Q8_0).reshape(n, k)
    return Q8_0(_halves(raw, 0), torch.from_numpy(q.copy()), torch.from_numpy(deq),
                flat.reshape(n, -1))


def quantize_q4_1(w: np.ndarray) -> Q4_1:
    from gguf import GGMLQuantizationType, quants

    n, k = w.shape
    flat = quants.quantize(w, GGMLQuantizationType.Q4_1)
    raw = flat.reshape(n, k // QK, 4 + QK // 2)
    qs = raw[..., 4:]  # byte j: element j in the low nibble, element j + 16 in the high one
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    deq = quants.dequantize(flat, GGMLQuantizationType.Q4_1).reshape(n, k)
    return Q4_1(_halves(raw, 0), _halves(raw, 2), torch.from_numpy(np.ascontiguousarray(q)),
                torch.from_numpy(deq), flat.reshape(n, -1))


Int4Params = tuple[Tensor, Tensor, Tensor, Tensor]  # (q, scale, zero, gguf's weights)


def quantize_q4_0(w: np.ndarray) -> Int4Params:
    """GGUF Q4_0 (w = d (q - 8)) as int4pack's (q, scale = d, zero = 0) and gguf's weights."""
    return q4_0_blocks(w)[0]


def q4_0_blocks(w: np.ndarray) -> tuple[Int4Params, np.ndarray]:
    """``quantize_q4_0``'s parameters and the GGUF blocks' bytes ([N, K / 32 * 18] uint8)."""
    from gguf import GGMLQuantizationType, quants

    n, k = w.shape
    flat = quants.quantize(w, GGMLQuantizationType.Q4_0)
    raw = flat.reshape(n, k // QK, 2 + QK // 2)
    qs = raw[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    d = _halves(raw, 0)
    deq = quants.dequantize(flat, GGMLQuantizationType.Q4_0).reshape(n, k)
    return (torch.from_numpy(np.ascontiguousarray(q)), d, torch.zeros_like(d),
            torch.from_numpy(deq)), flat.reshape(n, -1)


def quantize_q4_k(w: np.ndarray) -> Int4Params:
    """GGUF Q4_K blocks (super-blocks of 256 = 8 x 32: fp16 d and dmin, 6-bit sc and m per
    32; w = d sc q - dmin m) from a plain min/max choice (gguf-py has no Q4_K quantizer; any
    valid block serves to check the representation), decoded by ``gguf.quants``; returned as
    int4pack's (q, scale = d sc, zero = 8 d sc - dmin m) and the decoded weights."""
    return q4_k_blocks(w)[0]


def q4_k_blocks(w: np.ndarray) -> tuple[Int4Params, np.ndarray]:
    """``quantize_q4_k``'s parameters and the GGUF blocks' bytes ([N, K / 256 * 144] uint8)."""
    from gguf import GGMLQuantizationType, quants

    n, k = w.shape
    kb = k // 256
    sb = w.reshape(n, kb, 8, 32)
    lo = np.minimum(sb.min(-1), 0)  # the block minimum is subtracted: m >= 0
    span = (sb.max(-1) - lo) / 15
    d = (span.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    d32, dm32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(span / np.where(d32 > 0, d32, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / np.where(dm32 > 0, dm32, 1)), 0, 63).astype(np.uint8)
    scale, mins = d32 * sc, dm32 * m
    q = np.clip(np.rint((sb + mins[..., None]) / np.where(scale > 0, scale, 1)[..., None]),
                0, 15).astype(np.uint8)
    packed_sc = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                                m[..., :4] | ((m[..., 4:] >> 4) << 6),
                                (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
    pairs = q.reshape(n, kb, 4, 2, 32)  # sub-blocks 2i (low nibbles) and 2i + 1 (high)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, kb, 128)
    raw = np.concatenate([d.reshape(n, kb, 1).view(np.uint8), dmin.reshape(n, kb, 1)
                          .view(np.uint8), packed_sc, qs], axis=-1)
    deq = quants.dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q4_K).reshape(n, k)
    s = torch.from_numpy(scale.reshape(n, k // QK))
    z = 8 * s - torch.from_numpy(mins.reshape(n, k // QK))
    return (torch.from_numpy(q.reshape(n, k)), s, z, torch.from_numpy(deq)), raw.reshape(n, -1)


# ---------------------------------------------------------------------------- paths


@dataclass
class Path:
    """One way to run a step's linears: ``fns[i](x)`` is linear i on ``x`` [M, K] of dtype
    ``act``; ``nbytes`` what it stores (and reads) for the weights; ``w_eff(i)`` the float32
    weights its parameters stand for (None when the format offers no way to read them back)."""

    key: str
    label: str
    act: torch.dtype
    fns: list[Callable[[Tensor], Tensor]]
    nbytes: int
    w_eff: Callable[[int], Tensor] | None
    weights: list[Tensor] | None = None  # the packed weights, where another path can share them


def _nbytes(*ts: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def dense_path(key: str, label: str, deqs: list[Tensor], dtype: torch.dtype,
               kernel: Callable[..., Tensor] | None = None) -> Path:
    ws = [w.to(dtype).contiguous() for w in deqs]
    if kernel is None:
        fns = [lambda x, w=w: F.linear(x, w) for w in ws]
    else:
        fns = [lambda x, w=w: kernel(x, w, None) for w in ws]
    return Path(key, label, dtype, fns, _nbytes(*ws), lambda i: ws[i].float())


def int8_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 with one float32 scale per output row (what int8pack_mm takes)."""
    s = w.abs().amax(1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8), s


def int8pack_path(qs: list[tuple[Tensor, Tensor]], act: torch.dtype) -> Path:
    """int8pack over ``int8_per_channel``'s (q, scale) per linear, the scale in ``act``."""
    op = _AT["_weight_int8pack_mm"]
    packed = [(q, s.to(act)) for q, s in qs]
    fns = [lambda x, q=q, s=s: op(x, q, s) for q, s in packed]
    name = DTYPE_NAMES[act]
    return Path(f"int8pack_{name}", f"`_weight_int8pack_mm`, {name} act (int8 per channel)",
                act, fns, sum(_nbytes(q, s) for q, s in packed),
                lambda i: packed[i][0].float() * packed[i][1].float()[:, None])


def int4_params_exact(b: Q4_1) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_1 as int4pack's (q, scale, zero), group 32: w = (q - 8) * d + (m + 8 d)."""
    return b.q, b.d, b.m + 8.0 * b.d


def int4_params_requant(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit groups of ``group`` along K from float weights (as torchao's tinygemm
    choice: scale = (max - min) / 15, zero = min + 8 scale)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = (hi - lo) / 15
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((g - lo[..., None]) / s[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), s, lo + 8 * s


def int4_weights(q: Tensor, s: Tensor, z: Tensor) -> Tensor:
    """The float32 weights int4pack's parameters stand for: (q - 8) * s + z per group."""
    n, k = q.shape
    g = k // s.shape[1]
    qf = q.float().reshape(n, -1, g) - 8
    return (qf * s[..., None] + z[..., None]).reshape(n, k)


def int4pack_path(params: list[tuple[Tensor, Tensor, Tensor]], act: torch.dtype, key: str,
                  label: str, weights: list[Tensor] | None = None) -> Path:
    """int4pack over (q, scale, zero) per linear, scales in ``act``; ``weights``: the packed
    q of an earlier path over the same q (``path.weights``), to pack once."""
    conv, op = _AT["_convert_weight_to_int4pack_for_cpu"], _AT["_weight_int4pack_mm_for_cpu"]
    if weights is None:
        weights = [conv(q.to(torch.int32).contiguous(), 1) for q, _, _ in params]
    packed = []
    for (q, s, z), pw in zip(params, weights, strict=True):
        group = q.shape[1] // s.shape[1]
        sz = torch.stack([s, z], -1).transpose(0, 1).contiguous().to(act)  # [K/G, N, 2]
        packed.append((pw, group, sz))
    fns = [lambda x, p=p, g=g, sz=sz: op(x, p, g, sz) for p, g, sz in packed]

    def w_eff(i: int) -> Tensor:
        q, _, _ = params[i]
        sz = packed[i][2].float()
        return int4_weights(q, sz[..., 0].T, sz[..., 1].T)

    return Path(key, label, act, fns, sum(_nbytes(p, sz) for p, _, sz in packed), w_eff,
                weights)


BLOCK_LABEL = "project C++ block kernel, int8 inputs"


def block_path(raws: list[np.ndarray], fmt: str, shapes: list[tuple[int, int]],
               kernel: QuantKernel) -> Path:
    """The project's kernel on GGUF blocks (``csrc/quant_gemm.h``): each linear's bytes as
    ``gguf_blocks.kernel_blocks`` lays them out (the file's bytes; Q4_K as Q4F blocks of 32)
    in a ``quant.BlockWeight`` (which checks them; its ``dequantize`` gives ``w_eff``). A call
    is ``QuantKernel.linear`` on the blocks, the thin wrapper (as the small-M kernel's path
    calls its own), without ``BlockWeight.linear``'s reshaping around it; the input rows are
    rounded to 8 bits per block of 32 inside the kernel, so it takes float32."""
    ws = []
    for raw, (n, k) in zip(raws, shapes, strict=True):
        blocks, type_name = kernel_blocks(raw, fmt, n, k)
        ws.append(BlockWeight(torch.from_numpy(blocks), type_name, k, kernel))
    fns = [lambda x, w=w, f=kernel.linear: f(x, w.blocks, w.type_name, w.in_features)
           for w in ws]
    kind = ws[0].type_name if ws else fmt
    name = fmt if kind == fmt else f"{fmt} as {kind}"
    return Path(f"block_{kind.lower()}", f"{BLOCK_LABEL} ({name} blocks)", torch.float32,
                fns, sum(w.nbytes for w in ws), lambda i: ws[i].dequantize())


def torchao_paths(deqs8: list[Tensor], deqs4: list[Tensor]) -> tuple[dict[str, list[Path]], str]:
    """torchao's CPU weight-only paths ({format: paths}), or ({}, why not)."""
    try:
        import torchao
        from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
        from torchao.quantization import Int8Tensor
        from torchao.quantization.granularity import PerGroup, PerRow
    except Exception as e:  # not installed, or built for another torch
        return {}, f"skipped: `import torchao` failed ({type(e).__name__}: {e})"

    def int8(deqs: list[Tensor], gran: Any, key: str, label: str) -> Path:
        ts = [Int8Tensor.from_hp(w, granularity=gran) for w in deqs]
        return Path(key, label, torch.float32, [lambda x, t=t: F.linear(x, t) for t in ts],
                    sum(_nbytes(t.qdata, t.scale) for t in ts),
                    lambda i: ts[i].dequantize(torch.float32))

    # bfloat16 weights (so scales / zeros and activations are bfloat16): the op's fast case
    ts4 = [Int4OpaqueTensor.from_hp(w.bfloat16(), [1, 32]) for w in deqs4]
    int4 = Path("torchao_int4_g32", "torchao `Int4OpaqueTensor` g32, bfloat16 (int4pack op)",
                torch.bfloat16, [lambda x, t=t: F.linear(x, t) for t in ts4],
                sum(_nbytes(t.qdata, t.scale_and_zero) for t in ts4), None)
    paths = {
        "Q8_0": [int8(deqs8, PerRow(), "torchao_int8_row",
                      "torchao `Int8Tensor` per row, float32 (eager)"),
                 int8(deqs8, PerGroup(32), "torchao_int8_g32",
                      "torchao `Int8Tensor` per group 32, float32 (eager)")],
        "Q4_1": [int4],
    }
    where = os.path.dirname(torchao.__file__)
    return paths, f"torchao {torchao.__version__} (from {where}), torch {torch.__version__}"


def build_paths(q8: list[Q8_0], q4: list[Q4_1], k_all: set[int],
                log: Callable[[str], None] | None = None) -> tuple[
        dict[str, list[Path]], list[str]]:
    """{format: the paths that can hold it}, and notes on what could not be built; ``log``
    hears of each stage."""
    log = log or (lambda _: None)
    notes = []
    kernel, qkernel = small_linear_kernel(), quant_kernel()
    out: dict[str, list[Path]] = {}
    for fmt, bs in (("Q8_0", q8), ("Q4_1", q4)):
        deqs = [b.deq for b in bs]
        paths = [dense_path("f32", "`F.linear` float32 (today)", deqs, torch.float32),
                 dense_path("bf16", "`F.linear` bfloat16", deqs, torch.bfloat16)]
        if kernel is not None:
            paths.append(dense_path("cpp_f32", "project C++ small-M kernel, float32", deqs,
                                    torch.float32, kernel))
        if qkernel is not None:
            paths.append(block_path([b.raw for b in bs], fmt,
                                    [tuple(b.q.shape) for b in bs], qkernel))
        per_row = [int8_per_channel(w) for w in deqs]
        paths += [int8pack_path(per_row, torch.float32), int8pack_path(per_row, torch.bfloat16)]
        out[fmt] = paths
        log(f"built {fmt}'s float and int8pack paths")
    if kernel is None:
        notes.append("the project's C++ small-M kernel could not be built here (see its "
                     "warning): not measured")
    if qkernel is None:
        notes.append("the project's C++ block kernel (`quant_kernel()`) could not be built "
                     "here (see its warning): not measured")
    exact = [int4_params_exact(b) for b in q4]
    deq4 = [b.deq for b in q4]
    g32 = int4pack_path(exact, torch.float32, "int4pack_g32_f32",
                        "`_weight_int4pack_mm_for_cpu` g32, float32 act/scales")
    out["Q4_1"] += [
        g32,
        int4pack_path(exact, torch.float16, "int4pack_g32_f16",
                      "`_weight_int4pack_mm_for_cpu` g32, float16 act/scales", g32.weights),
        int4pack_path(exact, torch.bfloat16, "int4pack_g32_bf16",
                      "`_weight_int4pack_mm_for_cpu` g32, bfloat16 act/scales", g32.weights)]
    log("built the int4pack g32 paths")
    for group in INT4_GROUPS[1:]:
        bad = sorted(k for k in k_all if k % group)
        if bad:
            notes.append(f"int4pack group {group}: not possible for these shapes (K = "
                         f"{', '.join(map(str, bad))} is not a multiple of {group}; the op "
                         f"requires it)")
            continue
        out["Q4_1"].append(int4pack_path(
            [int4_params_requant(w, group) for w in deq4], torch.bfloat16,
            f"int4pack_g{group}_bf16",
            f"`_weight_int4pack_mm_for_cpu` g{group}, bfloat16 (Q4_1 requantized)"))
    log("built the int4pack requantized paths")
    ao, ao_note = torchao_paths([b.deq for b in q8], deq4)
    log("built the torchao paths")
    for fmt, paths in ao.items():
        out[fmt] += paths
    notes.append(f"torchao: {ao_note}")
    return out, notes


def timing_paths(by_format: dict[str, list[Path]]) -> list[Path]:
    """Each kernel once (the Q4_1 build of a path shared by both formats: same speed)."""
    seen: dict[str, Path] = {}
    for fmt in ("Q4_1", "Q8_0"):
        for p in by_format[fmt]:
            seen.setdefault(p.key, p)
    return list(seen.values())


# ---------------------------------------------------------------------------- measuring


def read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """GB/s of ``sum`` over a float32 tensor of ``nbytes`` (the best of ``reps``: the limit,
    which other processes on the machine can only lower)."""
    a = torch.ones(nbytes // 4)
    a.sum()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.sum()
        ts.append(time.perf_counter() - t0)
    return nbytes / min(ts) / 1e9


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """GB/s (read + write) of ``copy_`` between two float32 tensors of ``nbytes`` (best of
    ``reps``)."""
    a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    b.copy_(a)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t0)
    return 2 * nbytes / min(ts) / 1e9


def inputs(ks: set[int], m: int, seed: int) -> dict[torch.dtype, dict[int, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x32 = {k: torch.randn(m, k, generator=g) for k in sorted(ks)}
    return {dt: {k: x.to(dt) for k, x in x32.items()} for dt in DTYPE_NAMES}


def time_step(paths: list[Path], kin: list[int], m: int, reps: int, slow_s: float,
              probe: Tensor) -> tuple[dict[str, tuple[float, int]], list[float]]:
    """(median seconds, samples) per whole step of each path at ``m`` rows, paths interleaved,
    and the read bandwidth (GB/s) of ``probe.sum()``, once per round among them. A path whose
    warm-up step takes more than ``slow_s`` is not repeated: that one step is its sample (it is
    many times slower than the others, and a round must stay short)."""
    xs = inputs(set(kin), m, seed=m)
    for p in paths:  # prime per-shape set-up (oneDNN's kernels etc.): layer 0 and the head
        for i in {*range(min(7, len(kin))), len(kin) - 1}:
            p.fns[i](xs[p.act][kin[i]])
    samples: dict[str, list[float]] = {}
    for p in paths:  # warm
        t0 = time.perf_counter()
        for fn, k in zip(p.fns, kin, strict=True):
            fn(xs[p.act][k])
        dt = time.perf_counter() - t0
        samples[p.key] = [dt] if dt > slow_s else []
    fast = [p for p in paths if not samples[p.key]]
    gbps = []
    for r in range(reps):
        t0 = time.perf_counter()
        probe.sum()
        gbps.append(probe.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        start = r % max(1, len(fast))
        for p in fast[start:] + fast[:start]:
            x = xs[p.act]
            t0 = time.perf_counter()
            for fn, k in zip(p.fns, kin, strict=True):
                fn(x[k])
            samples[p.key].append(time.perf_counter() - t0)
    return {key: (statistics.median(v), len(v)) for key, v in samples.items()}, gbps


def compute_peak_gflops(n: int = 512, reps: int = 20) -> float:
    """float32 GFLOP/s of an n x n x n ``torch.mm`` in cache (the best of ``reps``): the
    arithmetic floor of a kernel that widens its weights to float32 and runs M multiply-adds
    per weight."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_threads(paths: list[Path], kin: list[int], rows: list[int], reps: int,
                 slow_s: float, give_up_s: float, probe: Tensor) -> tuple[
        dict[str, dict[str, list[float]]], list[float]]:
    """{path: {M: [median s, samples]}} over ``rows`` in order, and the bandwidth probes; a
    path that took more than ``give_up_s`` per step is not timed at larger M (absent there)."""
    out: dict[str, dict[str, list[float]]] = {p.key: {} for p in paths}
    gbps: list[float] = []
    active = list(paths)
    for m in rows:
        res, bw = time_step(active, kin, m, reps, slow_s, probe)
        gbps += bw
        for key, (sec, n) in res.items():
            out[key][str(m)] = [sec, n]
        active = [p for p in active if res[p.key][0] <= give_up_s]
    return out, gbps


def agreement(path: Path, deqs: list[Tensor], kin: list[int], m: int,
              layer0: int) -> dict[str, Any]:
    """Output error against float32 ``F.linear`` on ``deqs``; weight representation errors."""
    xs = inputs(set(kin), m, seed=1234)[torch.float32]
    num = den = 0.0
    max_err = max_ref = 0.0
    for fn, w, k in zip(path.fns, deqs, kin, strict=True):
        ref = F.linear(xs[k], w)
        y = fn(xs[k].to(path.act)).float()
        d = y - ref
        num += float(d.double().square().sum())
        den += float(ref.double().square().sum())
        max_err = max(max_err, float(d.abs().max()))
        max_ref = max(max_ref, float(ref.abs().max()))
    w_all = None
    if path.w_eff is not None:
        w_all = max(float((path.w_eff(i) - w).abs().max()) for i, w in enumerate(deqs))
    readback = 0.0
    for i in range(layer0):  # unit vectors for up to 32 input columns spread along K
        cols = torch.arange(0, kin[i], max(1, kin[i] // 32))[:32]
        unit = torch.zeros(len(cols), kin[i])
        unit[torch.arange(len(cols)), cols] = 1.0
        seen = path.fns[i](unit.to(path.act)).float().T
        readback = max(readback, float((seen - deqs[i][:, cols]).abs().max()))
    return {"max_abs_err": max_err, "rel_err": (num / den) ** 0.5 if den else 0.0,
            "max_abs_ref": max_ref, "w_max_abs_diff": w_all, "layer0_readback_max_abs_diff":
            readback}


def round_inputs(x: Tensor) -> Tensor:
    """``x`` [M, K] float32 with each block of 32 rounded as the block kernel rounds it:
    d = max |x| / 127 (float32), q = round(x * (1 / d)) (ties to even, as nearbyint), q d."""
    m, k = x.shape
    xb = x.reshape(m, k // QK, QK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(m, k)


def block_agreement_of(path: Path, deqs: list[Tensor], kin: list[int], m: int,
                       layer0: int) -> dict[str, Any]:
    """``agreement`` of a block-kernel path, plus its error against float32 ``F.linear`` on
    the inputs rounded as it rounds them (``round_inputs``): what is left once that rounding
    is accounted for (the float summation order)."""
    out = agreement(path, deqs, kin, m, layer0)
    xs = inputs(set(kin), m, seed=1234)[torch.float32]
    num = den = 0.0
    max_err = 0.0
    for fn, w, k in zip(path.fns, deqs, kin, strict=True):
        ref = F.linear(round_inputs(xs[k]), w)
        d = fn(xs[k]) - ref
        num += float(d.double().square().sum())
        den += float(ref.double().square().sum())
        max_err = max(max_err, float(d.abs().max()))
    out["vs_rounded_inputs"] = {"max_abs_err": max_err,
                                "rel_err": (num / den) ** 0.5 if den else 0.0}
    return out


def quantization_error(orig: list[np.ndarray], deqs: list[Tensor], kin: list[int],
                       m: int) -> dict[str, float]:
    """The GGUF format's own error: outputs of the original float weights vs the reference."""
    xs = inputs(set(kin), m, seed=1234)[torch.float32]
    num = den = 0.0
    max_err = 0.0
    for w0, w, k in zip(orig, deqs, kin, strict=True):
        ref = F.linear(xs[k], w)
        d = F.linear(xs[k], torch.from_numpy(w0)) - ref
        num += float(d.double().square().sum())
        den += float(ref.double().square().sum())
        max_err = max(max_err, float(d.abs().max()))
    return {"max_abs_err": max_err, "rel_err": (num / den) ** 0.5}


def extra_formats(orig: list[np.ndarray], lin: list[tuple[str, int, int]],
                  m: int) -> dict[str, Any]:
    """Q4_0 and Q4_K through int4pack (group 32, float32) and the project's block kernel (when
    it builds), on the linears whose K is a multiple of 256 (K-quants need it):
    representation and output errors, and both yardsticks."""
    sub = [i for i, (_, _, k) in enumerate(lin) if k % 256 == 0]
    if not sub:
        return {}
    kin = [lin[i][2] for i in sub]
    qkernel = quant_kernel()
    out = {}
    for fmt, quant in (("Q4_0", q4_0_blocks), ("Q4_K", q4_k_blocks)):
        made = [quant(orig[i]) for i in sub]
        params, raws = [p for p, _ in made], [r for _, r in made]
        deqs = [p[3] for p in params]
        path = int4pack_path([p[:3] for p in params], torch.float32, "int4pack_g32_f32",
                             "`_weight_int4pack_mm_for_cpu` g32, float32 act/scales")
        out[fmt] = {"linears": f"{len(sub)} x {lin[sub[0]][0].split('.')[-1]}"
                               f" ({lin[sub[0]][1]} x {lin[sub[0]][2]})",
                    "agreement": agreement(path, deqs, kin, m, 1),
                    "gguf_error": quantization_error([orig[i] for i in sub], deqs, kin, m),
                    "act_rounding_error": act_rounding_error(deqs, kin, m), "block": None}
        if qkernel is not None:
            bp = block_path(raws, fmt, [(lin[i][1], lin[i][2]) for i in sub], qkernel)
            out[fmt]["block"] = {"key": bp.key, "label": bp.label, "nbytes": bp.nbytes,
                                 "agreement": block_agreement_of(bp, deqs, kin, m, 1)}
    return out


def act_rounding_error(deqs: list[Tensor], kin: list[int], m: int) -> dict[str, float]:
    """What llama.cpp's own CPU kernels deviate by: they round the activations to 8-bit blocks
    of 32 (Q8_0 / Q8_1 values: d = max |x| / 127 in fp16, q = round(x / d)) before the dot
    products with Q8_0 / Q4_x weights. Outputs with activations so rounded (``gguf.quants``)
    against the reference."""
    from gguf import GGMLQuantizationType, quants

    xs = inputs(set(kin), m, seed=1234)[torch.float32]
    q8 = GGMLQuantizationType.Q8_0
    xq = {k: torch.from_numpy(quants.dequantize(quants.quantize(x.numpy(), q8), q8)
                              .reshape(m, k)) for k, x in xs.items()}
    num = den = 0.0
    max_err = 0.0
    for w, k in zip(deqs, kin, strict=True):
        ref = F.linear(xs[k], w)
        d = F.linear(xq[k], w) - ref
        num += float(d.double().square().sum())
        den += float(ref.double().square().sum())
        max_err = max(max_err, float(d.abs().max()))
    return {"max_abs_err": max_err, "rel_err": (num / den) ** 0.5}


def dyn_quant_probe() -> str:
    """What ``aten._dyn_quant_pack_4bit_weight`` stores on this CPU, for a 64 x 128 int4
    matrix (KleidiAI's path on Arm; elsewhere a reference fallback)."""
    n, k, g = 64, 128, 32
    try:
        packed = _AT["_dyn_quant_pack_4bit_weight"](
            torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // g, 2), None,
            g, k, n)
    except Exception as e:
        return f"fails here ({type(e).__name__}: {str(e)[:120]})"
    per_w = packed.numel() * packed.element_size() / (n * k)
    return (f"packs to {packed.dtype} ({per_w:.2f} bytes per weight for a {n} x {k} int4 "
            f"matrix): no saving over float32 on this CPU, not measured further")


def cpu_flags() -> dict[str, bool]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return {name: name in flags for name in CPU_FLAGS}


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# ---------------------------------------------------------------------------- report

DENSE = ("f32", "bf16", "cpp_f32")  # the paths that keep float weights


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 1 else f"{s * 1e3:.0f}"


def limit_gbps(tm: dict[str, Any]) -> float:
    """The read bandwidth a thread count's timings are held against: the best of its probes
    (before, during and after them; other processes can only lower a probe)."""
    return max(*tm["read_gbps"], tm["read_gbps_during"][1])


def bound_s(res: dict[str, Any], fmt: str, t: int, m: int) -> tuple[float, str]:
    """(seconds, what binds) of a kernel that reads ``fmt``'s GGUF blocks as they are: the
    bytes at the read bandwidth, or M multiply-adds per weight at the float32 mm rate."""
    tm, n = res["timing"][str(t)], res["weights"]["n"]
    mem = n * GGUF_BYTES_PER_WEIGHT[fmt] / (limit_gbps(tm) * 1e9)
    arith = 2 * m * n / (tm["peak_gflops"] * 1e9)
    return (mem, "memory") if mem >= arith else (arith, "arithmetic")


def _sec(res: dict[str, Any], t: int, key: str, m: int) -> float | None:
    """Median seconds of ``key`` at ``t`` threads and ``m`` rows; None when not timed."""
    cell = res["timing"][str(t)]["seconds"].get(key, {}).get(str(m))
    return None if cell is None else cell[0]


def classify(res: dict[str, Any], fmt: str) -> tuple[set[str], set[str]]:
    """(exact, faithful) path keys for ``fmt``: exact holds the GGUF weights bit for bit (all
    weights, or the read-back where the format has no other) and takes its inputs as they are
    (not the block kernel, which rounds them); faithful keeps its output error within what
    llama.cpp's own activation rounding costs (``act_rounding_error``)."""
    errs, limit = res["agreement"][fmt], res["act_rounding_error"][fmt]["rel_err"]
    exact = {key for key, a in errs.items() if "vs_rounded_inputs" not in a
             and (a["w_max_abs_diff"] == 0.0
                  or (a["w_max_abs_diff"] is None and a["layer0_readback_max_abs_diff"] == 0.0))}
    return exact, {key for key, a in errs.items() if a["rel_err"] <= limit}


def best_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per format, thread count and M: today's path, the fastest exact, the fastest faithful
    and the fastest path of all (with its error), and the bound of a kernel that would read
    the GGUF blocks as they are."""
    out = []
    for fmt in FORMATS:
        exact, faithful = classify(res, fmt)
        errs = res["agreement"][fmt]
        for t in res["threads"]:
            for m in res["rows"]:
                ms = {key: v for key in errs if (v := _sec(res, t, key, m)) is not None}

                def fastest(keys: set[str], ms: dict[str, float] = ms) -> str | None:
                    return min((k for k in ms if k in keys), key=ms.__getitem__, default=None)

                bound, binds = bound_s(res, fmt, t, m)
                row = {"format": fmt, "threads": t, "m": m, "today_s": ms.get("f32"),
                       "bound_s": bound, "bound_by": binds}
                for name, keys in (("exact", exact), ("faithful", faithful), ("fast", set(ms))):
                    key = fastest(keys)
                    row[f"{name}_key"] = key
                    row[f"{name}_s"] = None if key is None else ms[key]
                    row[f"{name}_rel_err"] = None if key is None else errs[key]["rel_err"]
                out.append(row)
    return out


def render(res: dict[str, Any]) -> str:
    labels = res["labels"]
    L = ["# Quantized weights on the CPU: PyTorch's packed int8 / int4 kernels and the "
         "project's block kernel vs float, for decode", "",
         "Written by `python -m bench.quant_kernels` (method in its docstring); the command: "
         f"`python -m bench.quant_kernels {res['argv']}`.", ""]
    L += [f"- {ln}" for ln in res["machine"]]
    w = res["weights"]
    L.append(f"- weights: {w['source']}; {w['linears']} linears ({w['shape_note']}), "
             f"{w['n'] / 1e6:.1f} M weights = {w['n'] * 4 / 1e6:.0f} MB in float32, "
             f"{w['n'] * GGUF_BYTES_PER_WEIGHT['Q8_0'] / 1e6:.0f} MB as Q8_0, "
             f"{w['n'] * GGUF_BYTES_PER_WEIGHT['Q4_1'] / 1e6:.0f} MB as Q4_1")
    L += [f"- {n}" for n in res["notes"]]
    L.append("")
    L += ["## Memory bandwidth and arithmetic rate (the physical limits)", "",
          "Measured in this process at each thread count: `sum` of a "
          f"{res['bw_mib']} MiB float32 tensor (read; the best of 5 before and after the "
          "timings, and once per timing round among them) and `copy_` between two (read + "
          "write); a cache-resident 512^3 float32 `torch.mm` (the best of 20). A step reads "
          "each weight once, so a kernel's memory bound is its stored weight bytes over the "
          "read bandwidth; the fractions below use the best read figure (other processes can "
          "only lower a probe).", "",
          "| torch threads | read GB/s: before, during (median, best), after | copy GB/s: "
          "before, after | float32 mm GFLOP/s |", "|---|---|---|---|"]
    for t in res["threads"]:
        tm = res["timing"][str(t)]
        r, c, d = tm["read_gbps"], tm["copy_gbps"], tm["read_gbps_during"]
        L.append(f"| {t} | {r[0]:.1f}, ({d[0]:.1f}, {d[1]:.1f}), {r[1]:.1f} | {c[0]:.1f}, "
                 f"{c[1]:.1f} | {tm['peak_gflops']:.0f} |")
    L.append("")
    rows = res["rows"]
    for t in res["threads"]:
        tm = res["timing"][str(t)]
        bw = limit_gbps(tm)
        L += [f"## One decode step's linears, {t} torch thread(s): ms (median of "
              f"{res['reps']})", "",
              f"Other processes used {tm['others_cores']:.2f} cores on average during these "
              "timings (2 cores in all).", "",
              "Each cell: ms per step; then GB/s of the path's stored weight bytes and that as "
              f"a fraction of the read bandwidth. `*`: one run only (its warm-up step took over "
              f"{res['slow_s']} s); `-`: not timed (a smaller M took over {res['give_up_s']} s "
              f"per step).", "",
              "| path | MB stored | " + " | ".join(f"M={m}" for m in rows) + " |",
              "|---|---|" + "---|" * len(rows)]
        for key, per_m in tm["seconds"].items():
            nb = res["nbytes"][key]
            cells = []
            for m in rows:
                if str(m) not in per_m:
                    cells.append("-")
                    continue
                s, n = per_m[str(m)]
                cells.append(f"{_fmt_ms(s)} ({nb / s / 1e9:.1f} GB/s, {nb / s / 1e9 / bw:.0%})"
                             + (" *" if n == 1 and res["reps"] > 1 else ""))
            L.append(f"| {labels[key]} | {nb / 1e6:.3g} | " + " | ".join(cells) + " |")
        L.append("")
    L += [f"## Agreement with float32 `F.linear` on the GGUF-dequantized weights "
          f"(M = {res['err_rows']}, all linears)", "",
          "max |dW|: over all weights, the path's stored parameters against the GGUF weights "
          "(0 = held exactly; `-` where the format offers no read-back); read-back: the "
          "kernel's own output for unit-vector inputs (32 input columns of each layer-0 "
          "linear) against the same weights. Output errors: max abs, and ||y - y_ref|| / "
          "||y_ref|| over all outputs. Two yardsticks per format: the GGUF quantization's own "
          "error (the original float weights' outputs against the reference), and llama.cpp's "
          "own deviation: its CPU kernels round the activations to 8-bit blocks of 32 (Q8_0 / "
          "Q8_1) before the dot products. A path within the latter is called faithful below.",
          "", "| format | path | max \\|dW\\| | read-back max \\|dW\\| | max abs err | "
          "rel err |", "|---|---|---|---|---|---|"]
    for fmt in FORMATS:
        q, a_r = res["gguf_error"][fmt], res["act_rounding_error"][fmt]
        L.append(f"| {fmt} | (yardstick) the {fmt} quantization itself | | | "
                 f"{q['max_abs_err']:.2e} | {q['rel_err']:.2e} |")
        L.append(f"| {fmt} | (yardstick) llama.cpp's activation rounding (8-bit blocks) | | | "
                 f"{a_r['max_abs_err']:.2e} | {a_r['rel_err']:.2e} |")
        for key, a in res["agreement"][fmt].items():
            wd = "-" if a["w_max_abs_diff"] is None else f"{a['w_max_abs_diff']:.2e}"
            L.append(f"| {fmt} | {labels[key]} | {wd} | "
                     f"{a['layer0_readback_max_abs_diff']:.2e} | {a['max_abs_err']:.2e} | "
                     f"{a['rel_err']:.2e} |")
    for fmt, e in res["extra_formats"].items():
        q, a = e["gguf_error"], e["agreement"]
        L.append(f"| {fmt}, {e['linears']} | (yardstick) the {fmt} quantization itself | | | "
                 f"{q['max_abs_err']:.2e} | {q['rel_err']:.2e} |")
        r = e["act_rounding_error"]
        L.append(f"| {fmt}, {e['linears']} | (yardstick) llama.cpp's activation rounding "
                 f"(8-bit blocks) | | | {r['max_abs_err']:.2e} | {r['rel_err']:.2e} |")
        L.append(f"| {fmt}, {e['linears']} | {labels['int4pack_g32_f32']} | "
                 f"{a['w_max_abs_diff']:.2e} | {a['layer0_readback_max_abs_diff']:.2e} | "
                 f"{a['max_abs_err']:.2e} | {a['rel_err']:.2e} |")
        if e["block"] is not None:
            b = e["block"]["agreement"]
            L.append(f"| {fmt}, {e['linears']} | {e['block']['label']} | "
                     f"{b['w_max_abs_diff']:.2e} | {b['layer0_readback_max_abs_diff']:.2e} | "
                     f"{b['max_abs_err']:.2e} | {b['rel_err']:.2e} |")
    L.append("")
    L += block_agreement(res)
    L += representability(res)
    L += conclusion(res)
    return "\n".join(L) + "\n"


def _span(res: dict[str, Any], key: str, t: int) -> str:
    v = [s for m in res["rows"] if (s := _sec(res, t, key, m)) is not None]
    if not v:
        return "not timed"
    more = "" if len(v) == len(res["rows"]) else f" (M <= {res['rows'][len(v) - 1]})"
    return f"{_fmt_ms(min(v))}-{_fmt_ms(max(v))} ms{more}"


def _vs_f32(res: dict[str, Any], key: str, t: int) -> str:
    """Speedup range over float32 ``F.linear`` (x > 1: faster)."""
    v = [f / s for m in res["rows"] if (s := _sec(res, t, key, m)) is not None
         and (f := _sec(res, t, "f32", m)) is not None]
    return f"{min(v):.2f}-{max(v):.2f}x float32's speed" if v else "not timed"


def _by_threads(res: dict[str, Any], key: str) -> str:
    return "; ".join(f"{t} thread(s): {_span(res, key, t)}, {_vs_f32(res, key, t)}"
                     for t in res["threads"])


def _block_key(res: dict[str, Any], fmt: str) -> str | None:
    """The block kernel's path key for ``fmt`` (None when it was not built)."""
    return next((k for k in res["agreement"][fmt] if k.startswith("block_")), None)


def _block_cases(res: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(format, label, the block kernel's agreement, llama.cpp's yardstick) per format
    checked: Q8_0 and Q4_1 on all linears, then the extra formats on their subset."""
    out = []
    for fmt in FORMATS:
        key = _block_key(res, fmt)
        if key is not None:
            out.append((fmt, res["labels"][key], res["agreement"][fmt][key],
                        res["act_rounding_error"][fmt]))
    for fmt, e in res["extra_formats"].items():
        if e["block"] is not None:
            out.append((f"{fmt} ({e['linears']})", e["block"]["label"],
                        e["block"]["agreement"], e["act_rounding_error"]))
    return out


def block_agreement(res: dict[str, Any]) -> list[str]:
    """The block kernel's error against llama.cpp's activation-rounding yardstick."""
    cases = _block_cases(res)
    if not cases:
        return []
    L = ["The project's block kernel rounds each input row to 8 bits per block of 32 (float32 "
         "scale max |x| / 127) and multiplies integers, the scheme of llama.cpp's CPU kernels "
         "(which keep that scale in fp16); its weights are the GGUF ones exactly, so its whole "
         "error is that rounding's (the last figure below: what is left of it once the "
         "rounding is applied to the reference's inputs too). Against the yardstick:", ""]
    for fmt, label, a, y in cases:
        ratio = a["rel_err"] / y["rel_err"] if y["rel_err"] else float("inf")
        verdict = "within it" if a["rel_err"] <= y["rel_err"] else "**over it**"
        L.append(f"- {fmt}, {label}: rel err {a['rel_err']:.2e} against llama.cpp's "
                 f"{y['rel_err']:.2e} ({ratio:.3f}x: {verdict}); max abs err "
                 f"{a['max_abs_err']:.2e} against {y['max_abs_err']:.2e}; max |dW| "
                 f"{a['w_max_abs_diff']:.1e}; against float32 `F.linear` on the inputs "
                 f"rounded as it rounds them: rel err {a['vs_rounded_inputs']['rel_err']:.1e}, "
                 f"max abs {a['vs_rounded_inputs']['max_abs_err']:.1e}.")
    L.append("")
    return L


def representability(res: dict[str, Any]) -> list[str]:
    a8, a4 = res["agreement"]["Q8_0"], res["agreement"]["Q4_1"]
    q8, q4 = res["gguf_error"]["Q8_0"], res["gguf_error"]["Q4_1"]
    L = ["## How exactly each PyTorch format (and the project's block kernel) holds the GGUF "
         "formats", ""]
    cases = _block_cases(res)
    if cases:
        L.append("- **the project's block kernel** (`csrc/quant_gemm.h`) keeps Q8_0, Q4_1 and "
                 "Q4_0 as the file's bytes (1.0625 / 0.625 / 0.5625 bytes per weight) and Q4_K "
                 "as Q4F blocks of 32 with a float32 scale and minimum (0.75 bytes per weight "
                 "against Q4_K's 0.5625; each d sc and dmin m is exact in float32): max |dW| of "
                 "its own dequantizer against gguf's: " + ", ".join(
                     f"{fmt} {a['w_max_abs_diff']:.1e}" for fmt, _, a, _ in cases)
                 + ". Its outputs are not exact: the inputs are rounded (above).")
    if "int4pack_g32_f32" in a4:
        e = a4["int4pack_g32_f32"]
        extra = "" if not res["extra_formats"] else "; measured on {}: {}".format(
            next(iter(res["extra_formats"].values()))["linears"], ", ".join(
                f"{fmt} max |dW| = {x['agreement']['w_max_abs_diff']:.1e} (read-back "
                f"{x['agreement']['layer0_readback_max_abs_diff']:.1e})"
                for fmt, x in res["extra_formats"].items()))
        L.append(f"- **int4pack, group 32, float32 scales/zeros**: Q4_1's w = d q + m is "
                 f"(q - 8) d + (m + 8 d); d and m are fp16, so d is exact in float32 and so is "
                 f"m + 8d unless their exponents are far apart: measured max |dW| = "
                 f"{e['w_max_abs_diff']:.1e} over all weights, read-back "
                 f"{e['layer0_readback_max_abs_diff']:.1e}. Q4_0 is scale d, zero 0; Q4_K is "
                 f"scale d sc (fp16 x 6 bits: 17 significant bits, exact in float32), zero "
                 f"8 d sc - dmin m (one float32 rounding){extra}. The op takes scales/zeros "
                 f"in the activation dtype only (float32 activations with bfloat16 scales are "
                 f"refused), so exactness means float32 activations and 8 bytes of scales per "
                 f"32 weights (0.75 bytes per weight; Q4_1 has 0.625, Q4_K 0.5625) - and "
                 f"float32 (or float16) activations take a far slower path than bfloat16: "
                 f"{_by_threads(res, 'int4pack_g32_f32')}.")
    if "int4pack_g32_f16" in a4:
        e = a4["int4pack_g32_f16"]
        L.append(f"- **int4pack, float16 scales/zeros**: d is exact in fp16, m + 8d is "
                 f"rounded to fp16, activations to fp16: max |dW| = {e['w_max_abs_diff']:.1e}, "
                 f"output rel err {e['rel_err']:.1e}.")
    if "int4pack_g32_bf16" in a4:
        e = a4["int4pack_g32_bf16"]
        L.append(f"- **int4pack, bfloat16 scales/zeros**: not exact: bfloat16 keeps 8 "
                 f"significant bits, fp16's d and m have 11: max |dW| = "
                 f"{e['w_max_abs_diff']:.1e}, output rel err {e['rel_err']:.1e} (activations "
                 f"and outputs are bfloat16 too), against Q4_1's own {q4['rel_err']:.1e} and "
                 f"llama.cpp's activation rounding "
                 f"{res['act_rounding_error']['Q4_1']['rel_err']:.1e}.")
    g64 = a4.get("int4pack_g64_bf16")
    if g64:
        L.append(f"- **int4pack, group 64 / 128**: a Q4_1 block pair requantized to one group "
                 f"of 64 is a second 4-bit rounding: rel err {g64['rel_err']:.1e} on top of "
                 f"Q4_1's own {q4['rel_err']:.1e}. Group 128 needs K % 128 == 0 (see the notes).")
    if "int8pack_float32" in a8:
        e, eb = a8["int8pack_float32"], a8["int8pack_bfloat16"]
        L.append(f"- **int8pack (one scale per output channel)**: Q8_0 has a scale per 32 "
                 f"weights; one per row cannot hold it, so the weights are requantized with one "
                 f"scale per row (its max |w| / 127): max |dW| = {e['w_max_abs_diff']:.1e}, "
                 f"output rel err {e['rel_err']:.1e} (bfloat16 activations: "
                 f"{eb['rel_err']:.1e}), i.e. {e['rel_err'] / q8['rel_err']:.1f}x Q8_0's own "
                 f"quantization error ({q8['rel_err']:.1e}). Q4_1 through int8pack: rel err "
                 f"{a4['int8pack_float32']['rel_err']:.1e} at 1 byte per weight.")
    L.append("- **Q5_0 / Q5_1 / Q5_K / Q6_K**: PyTorch has no 5- or 6-bit CPU kernel; "
             "int8pack would requantize them per row (as Q8_0 above), so they need a C++ "
             "block kernel too (or dequantization to float32, today's path).")
    if "torchao_int8_g32" in a8:
        e = a8["torchao_int8_g32"]
        L.append(f"- **torchao `Int8Tensor` per group of 32** holds Q8_0 "
                 f"{'exactly' if e['w_max_abs_diff'] == 0 else 'not exactly'} (max |dW| = "
                 f"{e['w_max_abs_diff']:.1e}; float32 scales), but its linear dequantizes the "
                 f"whole matrix to float on every call: {_by_threads(res, 'torchao_int8_g32')}.")
    if "bf16" in a8:
        L.append(f"- **bfloat16 weights**: Q8_0's d q needs up to 18 significant bits, Q4_1's "
                 f"d q + m more: max |dW| = {a8['bf16']['w_max_abs_diff']:.1e} (Q8_0), "
                 f"{a4['bf16']['w_max_abs_diff']:.1e} (Q4_1); output rel err "
                 f"{a8['bf16']['rel_err']:.1e} / {a4['bf16']['rel_err']:.1e}.")
    L.append("")
    return L


def _vs_bound(res: dict[str, Any], fmt: str, key: str) -> str:
    """``key``'s ms per step against ``bound_s`` at each thread count and M."""
    parts = []
    for t in res["threads"]:
        cells = []
        for m in res["rows"]:
            s = _sec(res, t, key, m)
            if s is not None:
                b, by = bound_s(res, fmt, t, m)
                cells.append(f"M={m} {_fmt_ms(s)} ms = {s / b:.1f}x {_fmt_ms(b)} ({by})")
        if cells:
            parts.append(f"{t} thread(s): " + ", ".join(cells))
    return "; ".join(parts) or "not timed"


def _block_summary(res: dict[str, Any], fmt: str, key: str) -> str:
    """One sentence on the block kernel for ``fmt``: speed, error against the yardstick."""
    err, limit = res["agreement"][fmt][key]["rel_err"], res["act_rounding_error"][fmt]["rel_err"]
    return (f"The project's block kernel ({res['labels'][key]}; {res['nbytes'][key] / 1e6:.0f} "
            f"MB per step): {_by_threads(res, key)}; rel err {err:.1e}, "
            f"{'within' if err <= limit else 'over'} llama.cpp's {limit:.1e}; against the floor "
            f"of a kernel reading the GGUF blocks: {_vs_bound(res, fmt, key)}.")


def conclusion(res: dict[str, Any]) -> list[str]:
    labels, rows, nbytes = res["labels"], best_rows(res), res["nbytes"]

    def cell(r: dict[str, Any], name: str, err: bool = False) -> str:
        key = r[f"{name}_key"]
        if key is None:
            return "none"
        return (f"{labels[key]}, {_fmt_ms(r[f'{name}_s'])}"
                + (f", {r[f'{name}_rel_err']:.1e}" if err else ""))

    L = ["## By format: today, the fastest exact / faithful / any path, and the bound", "",
         "Exact: the GGUF weights held bit for bit and the inputs taken as they are (the "
         "block kernel rounds its inputs, so it can be faithful, not exact). "
         "Faithful: output rel err within llama.cpp's own activation rounding (table above). "
         "Bound: a kernel reading the GGUF blocks as they are (block-scaled GEMV/GEMM in C++; "
         "Q8_0 1.0625, Q4_1 0.625 bytes per weight) cannot beat the larger of the bytes at the "
         "best read bandwidth and M multiply-adds per weight at the float32 mm rate (which of "
         "the two binds in brackets; a kernel on int8 dot products, as the project's block "
         "kernel, can go below the arithmetic one).", "",
         "| format | threads | M | today (f32 F.linear) ms | fastest exact: path, ms | "
         "fastest faithful: path, ms, rel err | fastest: path, ms, rel err | GGUF-block bound "
         "ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        today = "-" if r["today_s"] is None else _fmt_ms(r["today_s"])
        L.append(f"| {r['format']} | {r['threads']} | {r['m']} | {today} | {cell(r, 'exact')} "
                 f"| {cell(r, 'faithful', True)} | {cell(r, 'fast', True)} | "
                 f"{_fmt_ms(r['bound_s'])} ({r['bound_by']}) |")
    L += ["", "## Conclusion", ""]
    t0 = res["threads"][0]
    for fmt in FORMATS:
        main = [r for r in rows if r["format"] == fmt and r["threads"] == t0]
        picks = [r["faithful_key"] for r in main if r["faithful_key"] is not None]
        if not picks:
            L.append(f"- {fmt}: no faithful path was timed with {t0} thread(s).")
            continue
        pick = max(picks, key=picks.count)  # the first of the most frequent
        limit = res["act_rounding_error"][fmt]["rel_err"]
        err = res["agreement"][fmt][pick]["rel_err"]
        wins = sum(p == pick for p in picks)
        bound = "; ".join(
            f"{t} thread(s): " + ", ".join(f"M={m} {_fmt_ms(b)} ms ({by})" for m in res["rows"]
                                           for b, by in [bound_s(res, fmt, t, m)])
            for t in res["threads"])
        facts = (f"output rel err {err:.1e}, within llama.cpp's {limit:.1e}; "
                 f"{nbytes[pick] / 1e6:.0f} MB per step; {_by_threads(res, pick)}")
        head = (f"fastest faithful path at {wins} of {len(main)} M with {t0} thread(s): "
                f"**{labels[pick]}** ({facts})")
        block = _block_key(res, fmt)
        if block is not None and pick == block:
            others = ""
            if fmt == "Q4_1":
                others = "".join(
                    f" {x[0]} through the same kernel: rel err {x[2]['rel_err']:.1e} against "
                    f"llama.cpp's {x[3]['rel_err']:.1e}."
                    for x in _block_cases(res) if x[0] not in FORMATS)
            L.append(f"- **{fmt}: build on {labels[pick]}**, the fastest faithful path at "
                     f"{wins} of {len(main)} M with {t0} thread(s) ({facts}). It reads the "
                     f"GGUF blocks as they are (the weights exact; its error is the inputs' "
                     f"8-bit rounding, as llama.cpp's); measured against the floor of such a "
                     f"kernel: {_vs_bound(res, fmt, pick)}.{others}")
        elif pick not in DENSE:
            same = [f for f, x in res["extra_formats"].items()
                    if fmt == "Q4_1" and pick.startswith("int4pack_g32")
                    and x["agreement"]["w_max_abs_diff"] == 0.0]
            also = (f" (and {' / '.join(same)}: the same group-32 parameters, exact with "
                    f"float32 scales)") if same else ""
            tail = (f"A C++ kernel reading the GGUF blocks as they are would be exact as well; "
                    f"its floor per step: {bound}." if block is None
                    else _block_summary(res, fmt, block))
            L.append(f"- **{fmt}{also}: build on {labels[pick]}**, the fastest faithful path "
                     f"at {wins} of {len(main)} M with {t0} thread(s) ({facts}). {tail}")
        else:
            quantized = sorted(k for k in res["agreement"][fmt] if k not in DENSE
                               and k != block and k in res["timing"][str(t0)]["seconds"])
            best_q = min(quantized, key=lambda k: _sec(res, t0, k, res["rows"][0]) or 1e9,
                         default=None)
            alt = ("" if best_q is None else
                   f" The fastest quantized PyTorch path, {labels[best_q]} "
                   f"({_by_threads(res, best_q)}), has rel err "
                   f"{res['agreement'][fmt][best_q]['rel_err']:.1e}, "
                   f"{res['agreement'][fmt][best_q]['rel_err'] / limit:.1f}x llama.cpp's.")
            if block is None:
                L.append(f"- **{fmt}: no quantized PyTorch kernel is faithful; the missing "
                         f"piece is a block-scaled {fmt} GEMV/GEMM in C++** (the small-M "
                         f"kernel's tiling with quantized weight tiles widened to float in "
                         f"registers). Until then the {head}.{alt} The C++ kernel's floor per "
                         f"step: {bound}.")
            elif res["agreement"][fmt][block]["rel_err"] <= limit:
                L.append(f"- **{fmt}**: the {head}; the block kernel is faithful too but not "
                         f"faster here.{alt} {_block_summary(res, fmt, block)}")
            else:
                L.append(f"- **{fmt}: no quantized kernel is faithful**; the {head}.{alt} "
                         f"{_block_summary(res, fmt, block)}")
    flags = res["cpu_flags"]
    if flags["avx512_vnni"] or flags["avx_vnni"]:
        t, m = res["threads"][0], res["rows"][-1]
        arith = 2 * m * res["weights"]["n"] / (res["timing"][str(t)]["peak_gflops"] * 1e9)
        timed = [(fmt, s) for fmt in FORMATS if (k := _block_key(res, fmt)) is not None
                 and (s := _sec(res, t, k, m)) is not None]
        measured = ("not measured here" if not timed else
                    "the project's block kernel, which does this, measured " + ", ".join(
                        f"{fmt} {_fmt_ms(s)} ms" for fmt, s in timed))
        L.append(f"- Beyond M of a few rows the floor is arithmetic, not memory ({_fmt_ms(arith)} "
                 f"ms at M={m} with {t} thread(s) in float32). This CPU has VNNI: a block "
                 f"kernel that rounds the activations to 8-bit blocks as llama.cpp does (so "
                 f"faithful by the yardstick's definition) can use int8 dot products, 64 "
                 f"multiply-adds per instruction against 16 in float32 (an estimate from the "
                 f"instruction widths: about {_fmt_ms(arith / 4)} ms; {measured}).")
    if "cpp_f32" in res["nbytes"]:
        home = ("is the block kernel's too (`csrc/quant_gemm.h`: Q4_0 / Q4_1 / Q4_K / Q8_0); "
                "Q5 / Q6, which PyTorch has no kernel for either, still have none"
                if any(_block_key(res, f) for f in FORMATS) else
                "is the home for block kernels (Q8_0, and Q5 / Q6, which PyTorch has no kernel "
                "for)")
        L.append(f"- The project's float32 C++ kernel: {_by_threads(res, 'cpp_f32')}. Its "
                 f"structure (each weight tile streamed once, all M rows against it in "
                 f"registers) {home}.")
    L.append(f"- bfloat16: AVX512-BF16 {'present' if flags['avx512_bf16'] else 'absent'}, AMX "
             f"{'present' if flags['amx_bf16'] else 'absent'} on this CPU; `F.linear` "
             f"bfloat16: {_by_threads(res, 'bf16')}.")
    L.append("")
    return L


# ---------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    shapes = Shapes(args.hidden, args.intermediate, args.kv_dim, args.layers, args.vocab)
    lin = shapes.linears()
    kin = [k for _, _, k in lin]
    if args.random:
        orig = random_weights(shapes, args.seed)
        source = f"random (Student-t, 5 dof, x 0.02; seed {args.seed})"
    else:
        orig = checkpoint_weights(args.model_dir, shapes)
        source = f"checkpoint {args.model_dir} (float32)"
    load0, busy0, own0, wall0 = os.getloadavg(), machine_busy_s(), own_cpu_s(), time.time()

    def log(what: str) -> None:
        print(f"[{time.time() - wall0:6.1f} s] {what}", file=sys.stderr, flush=True)

    q8 = [quantize_q8_0(w) for w in orig]
    q4 = [quantize_q4_1(w) for w in orig]
    log("quantized")
    by_format, notes = build_paths(q8, q4, set(kin), log)
    if not args.random:
        notes.append("the imported SmolLM2 checkpoint's float32 tensors are its GGUF file's "
                     "dequantized weights (layers Q4_1, embedding = LM head Q8_0), so "
                     "quantizing the layers to Q4_1 again gives back the file's own blocks: "
                     "the 'Q4_1 quantization itself' yardstick is then mostly the head's")
    log("paths built")
    notes.append(f"`_dyn_quant_matmul_4bit` (`_dyn_quant_pack_4bit_weight`): {dyn_quant_probe()}")
    torch.set_num_threads(args.threads[0])
    layer0 = min(len(shapes.layer()), len(lin))
    agree: dict[str, dict[str, Any]] = {}
    for fmt in FORMATS:
        deqs = [b.deq for b in (q8 if fmt == "Q8_0" else q4)]
        agree[fmt] = {}
        for p in by_format[fmt]:
            check = block_agreement_of if p.key.startswith("block_") else agreement
            agree[fmt][p.key] = check(p, deqs, kin, args.err_rows, layer0)
            log(f"agreement {fmt} {p.key}")
    gguf_err = {"Q8_0": quantization_error(orig, [b.deq for b in q8], kin, args.err_rows),
                "Q4_1": quantization_error(orig, [b.deq for b in q4], kin, args.err_rows)}
    act_err = {"Q8_0": act_rounding_error([b.deq for b in q8], kin, args.err_rows),
               "Q4_1": act_rounding_error([b.deq for b in q4], kin, args.err_rows)}
    extra = extra_formats(orig, lin, args.err_rows)
    del orig
    log("agreement measured")
    paths = timing_paths(by_format)
    bw_bytes = args.bw_mib << 20
    timing = {}
    for t in args.threads:
        torch.set_num_threads(t)
        b0, o0, w0 = machine_busy_s(), own_cpu_s(), time.time()
        r0, c0 = read_bandwidth(bw_bytes), copy_bandwidth(bw_bytes)
        flops = compute_peak_gflops()
        probe = torch.ones(bw_bytes // 4)
        secs, during = time_threads(paths, kin, args.rows, args.reps, args.slow_s,
                                    args.give_up_s, probe)
        del probe
        r1, c1 = read_bandwidth(bw_bytes), copy_bandwidth(bw_bytes)
        others_t = max(0.0, (machine_busy_s() - b0) - (own_cpu_s() - o0))
        timing[str(t)] = {"read_gbps": [r0, r1], "copy_gbps": [c0, c1], "seconds": secs,
                          "read_gbps_during": [statistics.median(during), max(during)],
                          "peak_gflops": flops,
                          "others_cores": others_t / max(time.time() - w0, 1e-9)}
        log(f"{t} thread(s) timed: " + ", ".join(
            f"{p.key} {secs[p.key][str(args.rows[0])][0] * 1e3:.1f} ms" for p in paths))
    wall = time.time() - wall0
    others = max(0.0, (machine_busy_s() - busy0) - (own_cpu_s() - own0))
    flags = cpu_flags()
    commit = git("rev-parse", "--short", "HEAD")
    machine = [cpu_line(), f"CPU flags: {', '.join(k for k, v in flags.items() if v)}; absent: "
               f"{', '.join(k for k, v in flags.items() if not v) or 'none'}",
               f"torch {torch.__version__} (CPU capability "
               f"{torch.backends.cpu.get_cpu_capability()}), numpy {np.__version__}, Python "
               f"{platform.python_version()}; git {commit or '?'}",
               f"load average before: {'/'.join(f'{x:.2f}' for x in load0)}; other processes "
               f"used {others:.0f} CPU-s during the {wall:.0f} s run "
               f"({others / wall:.2f} cores on average)"]
    labels = {p.key: p.label for ps in by_format.values() for p in ps}
    labels["f32"] = "`F.linear` float32 (today)"
    return {"argv": " ".join(args.argv), "machine": machine, "cpu_flags": flags,
            "weights": {"source": source, "linears": len(lin), "n": sum(n * k for _, n, k in lin),
                        "shape_note": f"{shapes.layers} layers x q/k/v/o/gate/up/down + the "
                                      f"{shapes.vocab} x {shapes.hidden} head"},
            "notes": notes, "threads": args.threads, "rows": args.rows, "reps": args.reps,
            "err_rows": args.err_rows, "bw_mib": args.bw_mib, "labels": labels,
            "slow_s": args.slow_s, "give_up_s": args.give_up_s,
            "nbytes": {p.key: p.nbytes for p in paths}, "timing": timing,
            "agreement": agree, "gguf_error": gguf_err, "act_rounding_error": act_err,
            "extra_formats": extra}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quant_kernels",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--err-rows", type=int, default=4, help="M of the agreement check")
    ap.add_argument("--slow-s", type=float, default=0.15,
                    help="a path slower than this per step is timed once per M")
    ap.add_argument("--give-up-s", type=float, default=0.6,
                    help="a path slower than this per step is not timed at larger M")
    ap.add_argument("--bw-mib", type=int, default=512, help="size of the bandwidth tensor")
    ap.add_argument("--model-dir", default=default_fetch_dir("smollm2"),
                    help="a SmolLM2-135M checkpoint folder (default: `disagg model fetch`'s)")
    ap.add_argument("--random", action="store_true", help="seeded random weights instead")
    ap.add_argument("--seed", type=int, default=0)
    for name, default in (("hidden", 576), ("intermediate", 1536), ("kv-dim", 192),
                          ("layers", 30), ("vocab", 49152)):
        ap.add_argument(f"--{name}", type=int, default=default, help="shape (default SmolLM2's)")
    ap.add_argument("--out", default=None, help="write the markdown report here (+ .json)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("hidden", "intermediate", "kv_dim"):
        if getattr(args, name) % QK:
            ap.error(f"--{name.replace('_', '-')} must be a multiple of {QK}")
    if min(args.threads) < 1 or min(args.rows) < 1 or args.reps < 1 or args.layers < 1:
        ap.error("--threads, --rows, --reps and --layers must be positive")
    res = run(args)
    report = render(res)
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
