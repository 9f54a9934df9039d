"""A model loaded straight from its GGUF file, the quantized weights kept quantized on CPU.

A folder ``gguf.import_gguf(..., weights="quantized")`` wrote (``gguf_weights: quantized``,
the default for a served ``.gguf``) holds the config and tokenizer and names its GGUF file
(``gguf.GGUF_SOURCE_FILE``); ``loader.load_model`` hands it here. Tensors are read one at a
time with plain file reads (``GGUFFile.read``): neither the file's pages nor a float32 copy of
the model are ever held, only what the model keeps and one tensor in flight.

On CPU:

- a linear of a type with a kernel becomes a ``quant.QuantizedWeight`` (``Linear.qweight``):
  Q4_0 / Q4_1 / Q4_K / Q8_0 -> ``BlockWeight`` (the C++ block kernel). Where that cannot be
  built (no compiler, or ``DISAGG_CPU_KERNELS`` leaves out ``linear``), Q4_0 / Q4_1 / Q4_K
  become ``Int4Weight`` (PyTorch's int4pack op) and Q8_0 is dequantized to float32. q/k/v and
  gate/up of one format are concatenated: one product each (``llama.QuantizedRows``).
  llama.cpp's q/k row permutation moves whole rows, so it is undone on the blocks' rows. A
  tensor that cannot be packed (int4pack needs N % 16 == 0), or a tensor-parallel column shard
  that does not start and end on a block of 32 (256 for Q4_K), is dequantized instead, with a
  log line that says why;
- the token embedding of a kernel type is one ``BlockWeight`` shared with a tied LM head (rows
  dequantized when looked up); another quantized type keeps its raw blocks
  (``quant.RawBlocksTable``), its tied head quantized as a linear of that type can be;
- everything else (norms; F32 / F16 / BF16; Q5_0, Q5_1, Q5_K, Q6_K, which have no kernel here)
  is dequantized to the compute dtype: the float32 import's values.

Elsewhere (CUDA) nothing stays quantized: every tensor is dequantized, to the float32 import's
values, and moved to the device one at a time.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from disagg.config import ModelConfig
from disagg.model.gguf import GGUFWeights, open_gguf_weights, rotary_heads, unpermute_rotary_rows
from disagg.model.gguf_blocks import INT4_TYPES, KERNEL_TYPES, Q8_TYPES, decode, kernel_blocks
from disagg.model.kernels import QuantKernel, quant_kernel
from disagg.model.llama import Linear, LlamaForCausalLM, QuantizedRows
from disagg.model.quant import (
    QK,
    BlockWeight,
    Int4Weight,
    QuantizedEmbedding,
    QuantizedWeight,
    RawBlocksTable,
    int4_unpackable,
)

logger = logging.getLogger("disagg.model.gguf_weights")

_FLOAT_TYPES = ("F32", "F16", "BF16")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass
class _Parts:
    """A linear's decoded blocks (``gguf_blocks``): ``blocks`` (the kernel's blocks, ``kind``
    ``blocks:<block type>``) or ``int4`` (codes, scale, zero), rows in HF order and this
    rank's shard."""

    kind: str
    arrays: tuple[np.ndarray, ...]

    @staticmethod
    def cat(parts: list[_Parts]) -> _Parts:
        return _Parts(parts[0].kind, tuple(np.concatenate(a) for a in zip(
            *(p.arrays for p in parts), strict=True)))


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; nothing where
    there is none). The blocks decoded for one tensor are freed before the next, but in the
    heap, among the weights kept, and stay in the process's RSS without this: measured on
    SmolLM2-135M Q4_1 (94 MiB of weights), 484 MB after loading and a 502 MB peak without,
    345 and 363 MB with (torch alone: 236 MB)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None)
except (OSError, TypeError):  # no C library to look symbols up in (not a POSIX system)
    _LIBC = None


class _GGUFLoader:
    """Fills a meta-built model from ``weights`` (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM, weights: GGUFWeights, dtype: torch.dtype,
                 device: torch.device, quantize: bool) -> None:
        self.model, self.w, self.dtype, self.device = model, weights, dtype, device
        self.quantize = quantize
        self.kernel: QuantKernel | None = quant_kernel() if self.quantize else None
        self.formats: Counter[str] = Counter()  # linears (and tables) by how they are held
        self.fallbacks: list[str] = []
        self.nbytes = 0

    # -- one tensor --------------------------------------------------------------------------

    def _shard(self, pname: str) -> tuple[int, int, int, int] | None:
        dim = self.model.tp_shard_dim(pname)
        if dim is None:
            return None
        return self.model.tp_shard(pname, self.model.get_parameter(pname).shape[dim])

    def _decode(self, pname: str, src: str) -> tuple[_Parts | None, str]:
        """The blocks of ``src`` for parameter ``pname`` (this rank's shard), or None and why
        it has to be dequantized."""
        type_name = self.w.type_name(src)
        if type_name in _FLOAT_TYPES:
            return None, ""  # a float tensor: nothing to keep
        if type_name not in Q8_TYPES + INT4_TYPES:
            return None, f"{type_name} has no quantized CPU kernel here"
        if type_name in Q8_TYPES and self.kernel is None:
            return None, "the block kernel is not available (no C++ compiler, or " \
                         "DISAGG_CPU_KERNELS leaves out linear)"
        n, k = self.w.shape(src)
        if self.kernel is not None and type_name in KERNEL_TYPES:
            blocks, block_type = kernel_blocks(self.w.raw(src), type_name, n, k)
            arrays: tuple[np.ndarray, ...] = (blocks,)
            kind = f"blocks:{block_type}"
        else:
            decoded = decode(self.w.raw(src), type_name, n, k)
            assert decoded is not None
            arrays, kind = decoded, "int4"
        heads = rotary_heads(src, self.w.cfg)
        if heads is not None:  # whole rows move: the same permutation for every array
            arrays = tuple(unpermute_rotary_rows(a, heads) for a in arrays)
        shard = self._shard(pname)
        if shard is not None:
            dim, lo, hi, _ = shard
            if dim == 0:
                arrays = tuple(a[lo:hi] for a in arrays)
            elif lo % QK or hi % QK:
                return None, (f"this tensor-parallel rank's columns [{lo}, {hi}) do not fall on "
                              f"blocks of {QK}")
            elif kind != "int4":  # whole blocks of 32 along a row: their bytes
                per = arrays[0].shape[1] // (k // QK)
                arrays = (arrays[0][:, lo // QK * per:hi // QK * per],)
            else:
                arrays = (arrays[0][:, lo:hi], *(a[:, lo // QK:hi // QK] for a in arrays[1:]))
        return _Parts(kind, tuple(np.ascontiguousarray(a) for a in arrays)), ""

    def _build(self, parts: _Parts, k: int) -> tuple[QuantizedWeight | None, str]:
        if parts.kind.startswith("blocks:"):
            assert self.kernel is not None
            return BlockWeight(_tensor(parts.arrays[0]), parts.kind.split(":", 1)[1], k,
                               self.kernel), ""
        codes, scale, zero = parts.arrays
        why = int4_unpackable(*codes.shape)
        if why is not None:
            return None, why
        return Int4Weight(_tensor(codes), _tensor(scale), _tensor(zero)), ""

    def _held(self, weight: QuantizedWeight, count: int = 1) -> None:
        self.formats[weight.label] += count
        self.nbytes += weight.nbytes

    def _float(self, pname: str, src: str, why: str = "") -> None:
        """Parameter ``pname`` <- ``src`` dequantized (this rank's shard, the dtype, the
        device); ``why`` a quantized linear is not kept quantized (logged)."""
        if why:
            self.fallbacks.append(pname)
            logger.info("%s: %s (%s) dequantized to %s: %s", pname, self.w.tensors[src].name,
                        self.w.type_name(src), str(self.dtype).removeprefix("torch."), why)
        value = torch.from_numpy(self.w.float32(src))
        shard = self._shard(pname)
        if shard is not None:
            dim, lo, hi, _ = shard
            value = value[lo:hi] if dim == 0 else value[:, lo:hi]
        value = value.to(device=self.device, dtype=self.dtype)
        set_parameter(self.model, pname, value)
        self.formats[f"{str(self.dtype).removeprefix('torch.')} ({self.w.type_name(src)})"] += 1
        self.nbytes += value.numel() * value.element_size()

    # -- linears -----------------------------------------------------------------------------

    def linears(self, members: list[tuple[str, str, Linear]], owner: object = None,
                attr: str = "") -> None:
        """Linears ``(parameter, GGUF source, module)`` that read the same input; with an
        ``owner``, fused as its ``attr`` (``QuantizedRows``) when all are of one format."""
        if not self.quantize:
            for pname, src, _ in members:
                self._float(pname, src)
            return
        decoded = [self._decode(pname, src) for pname, src, _ in members]
        self._place(members, decoded, owner, attr)
        del decoded
        _trim_heap()

    def _place(self, members: list[tuple[str, str, Linear]],
               decoded: list[tuple[_Parts | None, str]], owner: object, attr: str) -> None:
        kinds = {p.kind if p is not None else None for p, _ in decoded}
        if owner is not None and len(members) > 1 and len(kinds) == 1 and None not in kinds:
            fused, _ = self._build(_Parts.cat([p for p, _ in decoded if p is not None]),
                                   members[0][2].in_features)
            if fused is not None:  # else (int4 rows not packable) each on its own, below
                modules = [m for _, _, m in members]
                setattr(owner, attr, QuantizedRows(modules, fused))
                lo = 0
                for m in modules:
                    m.qweight = fused.rows(lo, lo + m.out_features)
                    lo += m.out_features
                self._held(fused, len(members))
                return
        for (pname, src, module), (parts, why) in zip(members, decoded, strict=True):
            weight = None
            if parts is not None:
                weight, why = self._build(parts, module.in_features)
            if weight is None:
                self._float(pname, src, why)
            else:
                module.qweight = weight
                self._held(weight)

    # -- the model ---------------------------------------------------------------------------

    def load(self) -> None:
        model, cfg = self.model, self.model.config
        embed, head = model.model.embed_tokens, model.lm_head
        tied = cfg.tie_word_embeddings and HEAD not in self.w.tensors
        shared: BlockWeight | None = None
        if embed is not None:
            shared = self._embedding(embed.num_embeddings, embed.embedding_dim)
            _trim_heap()
        if head is not None:
            if tied and shared is not None:
                head.qweight = shared
            elif tied and isinstance(model.model.embed_tokens, nn.Embedding):
                head.weight = model.model.embed_tokens.weight  # float: one tensor for both
            else:
                self.linears([(HEAD, EMBED if tied else HEAD, head)])
        for g, layer in model.model.layers.items():
            att, mlp = layer.self_attn, layer.feed_forward
            p = f"model.layers.{g}."
            self.linears([(f"{p}self_attn.{n}.weight",) * 2 + (getattr(att, n),)
                          for n in ("q_proj", "k_proj", "v_proj")], att, "qkv")
            self.linears([(f"{p}self_attn.o_proj.weight",) * 2 + (att.o_proj,)])
            self.linears([(f"{p}mlp.{n}.weight",) * 2 + (getattr(mlp, n),)
                          for n in ("gate_proj", "up_proj")], mlp, "gate_up")
            self.linears([(f"{p}mlp.down_proj.weight",) * 2 + (mlp.down_proj,)])
        quantized = {f"{name}.weight" for name, m in model.named_modules()
                     if isinstance(m, Linear) and m.qweight is not None}
        for pname, param in list(model.named_parameters()):
            if param.is_meta and pname not in quantized:  # norms; F32 ... tensors
                self._float(pname, EMBED if pname == HEAD and tied else pname)
        model.fuse_projections()  # the float linears' groups (the quantized ones are fused)
        model.eval()

    def _embedding(self, vocab: int, dim: int) -> BlockWeight | None:
        """Load the token embedding; the ``BlockWeight`` a tied head can share, if it is one."""
        type_name = self.w.type_name(EMBED)
        if not self.quantize or type_name in _FLOAT_TYPES:
            self._float(EMBED, EMBED)
            return None
        model = self.model
        if type_name in KERNEL_TYPES and self.kernel is not None:
            blocks, block_type = kernel_blocks(self.w.raw(EMBED), type_name, vocab, dim)
            table = BlockWeight(_tensor(blocks), block_type, dim, self.kernel)
            model.model.embed_tokens = QuantizedEmbedding(table.lookup, vocab, dim, self.dtype,
                                                          type_name)
            self._held(table)
            return table
        raw = RawBlocksTable(self.w.raw(EMBED), type_name, dim)
        model.model.embed_tokens = QuantizedEmbedding(raw.lookup, vocab, dim, self.dtype,
                                                      f"{type_name} blocks")
        self.formats[f"{type_name} blocks (embedding)"] += 1
        self.nbytes += raw.nbytes
        return None

    def summary(self) -> str:
        held = ", ".join(f"{n} {label}" for label, n in self.formats.most_common())
        return (f"GGUF weights from {self.w.path} on {self.device}: {held}; "
                f"{self.nbytes / 2**20:.1f} MiB")


def load_gguf_model(model_dir: str, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device, layer_range: tuple[int, int] | None = None,
                    tp_rank: int = 0, tp_size: int = 1,
                    quantize: bool | None = None) -> LlamaForCausalLM:
    """The model (or this rank's part of it) with the weights of the GGUF file behind
    ``model_dir`` (a folder ``import_gguf`` wrote without weights). ``quantize``: keep
    quantized what can be (default: on a CPU device only; False: every tensor dequantized, as
    on CUDA). GGUFError when the file is gone or changed."""
    if quantize is None:
        quantize = device.type == "cpu"
    elif quantize and device.type != "cpu":
        raise ValueError(f"quantized GGUF weights are for CPU only, not {device}")
    weights = open_gguf_weights(model_dir)
    if weights is None:
        raise FileNotFoundError(f"{model_dir}: not a folder of GGUF weights (no gguf_source)")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, layer_range=layer_range, tp_rank=tp_rank,
                                 tp_size=tp_size)
    loader = _GGUFLoader(model, weights, dtype, device, quantize)
    if not loader.quantize:
        logger.info("GGUF weights of %s dequantized to %s on %s (the quantized kernels are "
                    "for CPU)", weights.path, dtype, device)
    loader.load()
    logger.info("%s", loader.summary())
    if loader.fallbacks:
        logger.info("%d linear(s) not quantized: %s", len(loader.fallbacks),
                    ", ".join(loader.fallbacks[:8]) + (" ..." if len(loader.fallbacks) > 8
                                                         else ""))
    return model


def set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """``model``'s parameter ``name`` (dotted) becomes ``value`` (frozen), replacing the one
    the module was built with (the loader's too: loader.py imports it from here)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))
