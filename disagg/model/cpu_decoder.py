"""A decode step's decoder layers in one compiled call on CPU (``csrc/decoder.cpp``, the
``decoder`` kernel of ``DISAGG_CPU_KERNELS``).

A decode step of a small model on a CPU spends as much time between the kernels as in them:
per layer a dozen calls (norms, the fused linears, RoPE + the K/V write, attention, SwiGLU),
each with its Python, its argument checks and its tensors (bench/results/decode_profile.md).
``CpuDecoder`` runs them all in C++ for the batches where that is plain: every sequence has one
new token (a pure decode step), and the model is a dense Llama-family stack whose linears are
all GGUF blocks (``quant.BlockWeight``, 8-bit input rows: the same products as the op-by-op
path on those weights), on one rank holding every layer, float32 activations, a float32,
bfloat16 or float16 cache (``kv_cache_dtype``), no per-layer hook (KV streaming), no q/k
norms, no biases. Everything else (prefill, mixed steps, other models) keeps
``LlamaForCausalLM.forward``'s layer loop.

``cpu_decoder(model, kv_cache)`` says which: a ``CpuDecoder``, or None with the reason logged
once. The model calls ``CpuDecoder.forward`` from its own ``forward`` when ``applies``.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from disagg.model.attention import AttentionMetadata
from disagg.model.cpu_ops import CACHE_TYPES
from disagg.model.kernels import BLOCK_TYPES, decoder_library
from disagg.model.llama import GatedMLP, LlamaForCausalLM, QuantizedRows
from disagg.model.quant import BlockWeight

logger = logging.getLogger(__name__)

_F32, _I64, _num_threads = torch.float32, torch.int64, torch.get_num_threads
_ERRORS = {1: "sequence length out of range of its block table", 2: "block id out of range",
           3: "unsupported shape", 4: "slot out of range", 5: "unsupported cache dtype"}
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    """csrc/decoder.cpp's DecoderLayer."""

    _fields_ = [("ln1", _P), ("ln2", _P), ("qkv", _P), ("qkv_bias", _P), ("o", _P),
                ("gate_up", _P), ("down", _P), ("kv", _P), ("qkv_type", ctypes.c_int32),
                ("o_type", ctypes.c_int32), ("gate_up_type", ctypes.c_int32),
                ("down_type", ctypes.c_int32)]


class _Step(ctypes.Structure):
    """csrc/decoder.cpp's DecoderStep."""

    _fields_ = [("T", _I), ("H", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("I", _I),
                ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("x", _P), ("out", _P),
                ("cos", _P), ("sin", _P), ("slot_block", _P), ("slot_offset", _P),
                ("tables", _P), ("s_tab", _I), ("max_blocks", _I), ("lens", _P), ("N", _I),
                ("B", _I), ("s_blk", _I), ("s_kv", _I), ("s_h", _I), ("s_tok", _I),
                ("layers", _I), ("layer", ctypes.POINTER(_Layer)), ("final_norm", _P),
                ("threads", ctypes.c_int32), ("kv_dtype", ctypes.c_int32)]


def _library() -> ctypes.PyDLL | None:
    """``kernels.decoder_library()`` with its entry point declared (or None)."""
    lib = decoder_library()
    if lib is not None:
        lib.disagg_decode_layers.argtypes = [ctypes.POINTER(_Step)]
        lib.disagg_decode_layers.restype = ctypes.c_int
    return lib


def _block(weight: object) -> BlockWeight | None:
    return weight if isinstance(weight, BlockWeight) else None


def why_not(model: torch.nn.Module, kv_cache: torch.Tensor) -> str | None:
    """Why ``model`` cannot decode through the compiled stack (None: it can)."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not the dense Llama-family model"
    if model.tp_size != 1 or not (model.is_first_stage and model.is_last_stage):
        return "tensor or pipeline parallel"
    if not (kv_cache.device.type == "cpu" and kv_cache.dtype in CACHE_TYPES
            and kv_cache.dim() == 6 and kv_cache.shape[2] == 2 and kv_cache.stride(-1) == 1):
        return "not a float32, bfloat16 or float16 CPU cache of K and V"
    for layer in model.model.layers.values():
        att, mlp = layer.self_attn, layer.feed_forward
        if att.q_norm is not None or not isinstance(mlp, GatedMLP):
            return "q/k norms or routed experts"
        if not (isinstance(att.qkv, QuantizedRows) and _block(att.qkv.weight)
                and isinstance(mlp.gate_up, QuantizedRows) and _block(mlp.gate_up.weight)
                and _block(att.o_proj.qweight) and _block(mlp.down_proj.qweight)):
            return "a linear that is not GGUF blocks"
        if any(m.bias is not None for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj,
                                             mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "linear biases"
    return None


class CpuDecoder:
    """The compiled decode stack of one model over one KV cache (see the module docstring)."""

    def __init__(self, lib: ctypes.PyDLL, model: torch.nn.Module,
                 kv_cache: torch.Tensor) -> None:
        self._lib = lib  # the entry point looked up per call (a profiler may wrap it)
        cfg = model.config
        layers = list(model.model.layers.values())
        att0 = layers[0].self_attn
        self.kv_cache = kv_cache
        self.hidden = cfg.hidden_size
        n, _, _, hkv, b, d = kv_cache.shape
        s = kv_cache.stride()
        self._layers = (_Layer * len(layers))()
        # The tensors whose pointers the structs hold stay referenced here.
        self._held: list[torch.Tensor] = []
        for i, layer in enumerate(layers):
            att, mlp = layer.self_attn, layer.feed_forward
            qkv, o = att.qkv.weight, att.o_proj.qweight
            gu, down = mlp.gate_up.weight, mlp.down_proj.qweight
            ln1 = layer.input_layernorm.weight.detach().contiguous()
            ln2 = layer.post_attention_layernorm.weight.detach().contiguous()
            self._held += [ln1, ln2]
            self._layers[i] = _Layer(
                ln1.data_ptr(), ln2.data_ptr(), qkv.blocks.data_ptr(), None,
                o.blocks.data_ptr(), gu.blocks.data_ptr(), down.blocks.data_ptr(),
                kv_cache.data_ptr() + i * s[1] * kv_cache.element_size(),
                BLOCK_TYPES[qkv.type_name][0], BLOCK_TYPES[o.type_name][0],
                BLOCK_TYPES[gu.type_name][0], BLOCK_TYPES[down.type_name][0])
        final = model.model.norm.weight.detach().contiguous()
        self._held.append(final)
        self._step = _Step(
            T=0, H=cfg.hidden_size, Hq=att0.num_heads, Hkv=att0.num_kv_heads, D=att0.head_dim,
            I=layers[0].feed_forward.gate_up.sizes[0], eps=cfg.rms_norm_eps, scale=att0.scale,
            N=n, B=b, s_blk=s[0], s_kv=s[2], s_h=s[3], s_tok=s[4], layers=len(layers),
            layer=self._layers, final_norm=final.data_ptr(),
            kv_dtype=CACHE_TYPES[kv_cache.dtype])
        self._step_ref = ctypes.byref(self._step)
        if hkv != att0.num_kv_heads or d != att0.head_dim:
            raise ValueError(f"cache of {hkv} heads of {d} for a model of "
                             f"{att0.num_kv_heads} of {att0.head_dim}")

    def applies(self, meta: object, kv_cache: torch.Tensor, tokens: int) -> bool:
        """Whether this step is one the stack runs: a pure decode batch on its cache."""
        return (kv_cache is self.kv_cache and isinstance(meta, AttentionMetadata)
                and meta.num_decodes == tokens and tokens > 0
                and meta.block_tables.shape[0] == tokens
                and meta.block_tables.dtype is _I64 and meta.block_tables.stride(1) == 1
                and meta.decode_seq_lens.dtype is _I64
                and meta.decode_seq_lens.is_contiguous()
                and meta.slot_block.is_contiguous() and meta.slot_offset.is_contiguous())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``x`` the embedded tokens ``[T, H]`` float32, ``cos`` / ``sin`` ``[T, 1, D]`` ->
        the final normed hidden states ``[T, H]``; the cache gets each token's K/V."""
        t = x.shape[0]
        x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty(t, self.hidden, dtype=_F32)
        st = self._step
        tables, lens = meta.block_tables, meta.decode_seq_lens
        st.T, st.x, st.out = t, x.data_ptr(), out.data_ptr()
        st.cos, st.sin = cos.data_ptr(), sin.data_ptr()
        st.slot_block, st.slot_offset = meta.slot_block.data_ptr(), meta.slot_offset.data_ptr()
        st.tables, st.s_tab, st.max_blocks = tables.data_ptr(), tables.stride(0), tables.shape[1]
        st.lens, st.threads = lens.data_ptr(), _num_threads()
        err = self._lib.disagg_decode_layers(self._step_ref)
        if err:  # checked before the cache is touched
            raise RuntimeError(f"decode_layers: {_ERRORS.get(err, f'error {err}')}")
        return out


def cpu_decoder(model: torch.nn.Module, kv_cache: torch.Tensor) -> CpuDecoder | None:
    """The compiled decode stack for ``model`` on ``kv_cache``, or None (the reason logged)."""
    why = why_not(model, kv_cache)
    if why is None:
        lib = _library()
        if lib is None:
            why = "the decoder kernel is not available"
        else:
            return CpuDecoder(lib, model, kv_cache)
    logger.info("decode steps run layer by layer (no compiled decode stack: %s)", why)
    return None
