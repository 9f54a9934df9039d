"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3; Mixtral, Qwen3-MoE) over a paged
KV cache.

Reads like the paper: x -> [RMSNorm -> attention (RoPE, GQA) -> +x] -> [RMSNorm -> SwiGLU
-> +x] per layer, final RMSNorm, LM head. Qwen3 adds an RMSNorm over each query and key head
before RoPE (``q_norm`` / ``k_norm``) and sizes heads by its own ``head_dim`` (not
hidden / heads: q is ``[heads * head_dim]`` wide, o_proj maps that back to hidden). Mixtral
(Mistral attention) and Qwen3-MoE (Qwen3 attention) replace the SwiGLU of their sparse layers
with routed experts (``moe.SparseMoeBlock``: Mixtral's ``block_sparse_moe``, Qwen3-MoE's
``mlp``; Qwen3-MoE keeps the dense SwiGLU on its ``mlp_only_layers``). Parameter names
follow Hugging Face (``model.layers.N.self_attn.q_proj.weight`` ...) so safetensors
checkpoints load as they are.

Tokens of the whole batch are flattened: activations are ``[T, hidden]``; the paged attention
op (``attention.py``) splits them back into sequences with ``AttentionMetadata``.

Parallelism hooks (used by later issues):
- pipeline: ``layer_range=(start, end)`` holds global layers ``[start, end)``; the first stage
  owns ``embed_tokens``, the last ``norm`` + ``lm_head``; layer ``g`` uses KV cache layer
  ``g - start``. A non-first stage receives ``hidden_states`` instead of ``input_ids``.
- tensor: q/k/v and gate/up are column-parallel (output rows split over ranks), o/down are
  row-parallel (input columns split; partial sums all-reduced through ``tp_all_reduce``).
  Modules already use the local head counts / intermediate size; ``tp_shard`` tells the
  loader which slice of each checkpoint tensor to read. With more TP ranks than kv heads,
  each rank holds the one kv head its query heads read (replicated, as vLLM does).
  Embeddings, norms and the LM head are replicated on the ranks of their stage.
- experts: under TP each expert's w1/w3 (gate/up) rows and w2 (down) columns split like the
  dense MLP's; with ``expert_parallel`` each TP rank holds ``E / tp`` whole experts instead
  (``moe.expert_range``). Routers are replicated; either way one all-reduce per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from disagg.config import ConfigError, ModelConfig
from disagg.layout import kv_head_replicas, tp_kv_head_range
from disagg.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from disagg.model.cpu_ops import rope_store_applies
from disagg.model.kernels import SMALL_LINEAR_MAX_ROWS, LinearKernel, small_linear_applies
from disagg.model.moe import (
    MIXTRAL_EXPERT_NAMES,
    QWEN_EXPERT_NAMES,
    MoeExperts,
    SparseMoeBlock,
    expert_range,
)
from disagg.model.norm import rms_norm_reference  # (re-exported: tests and kernels name it here)
from disagg.model.quant import QuantizedWeight
from disagg.model.static_decode import StaticDecodeMeta

if TYPE_CHECKING:
    from disagg.model.cpu_decoder import CpuDecoder

# (x, weight, eps, residual) -> (weight * rms_norm(h), h), h = residual + x (x when None)
NormKernel = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None],
                      tuple[torch.Tensor, torch.Tensor]]
# (gate, up) -> silu(gate) * up, rounded as silu_mul_reference rounds
SiluMulKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """``rms_norm_reference``, or ``kernel`` when set (one launch: ``triton_norm``; the runner
    sets it on CUDA, ``use_norm_kernel``)."""

    kernel: NormKernel | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_norm(x, None)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(h), h)``, ``h = residual + x`` (``x`` when None): the add and the norm in
        one kernel when there is one."""
        fn = self.kernel if self.kernel is not None else rms_norm_reference
        return fn(x, self.weight, self.eps, residual)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` in PyTorch: two kernels on CUDA, each rounding to the
    dtype once (silu computed in float32 for half precision). The product is written over
    silu's output (the same bits as ``*``; one ``[T, I]`` temporary fewer in a prefill)."""
    return nn.functional.silu(gate).mul_(up)


class GatedMLP(nn.Module):
    """Base of a dense SwiGLU feed-forward: its ``silu(gate) * up`` is ``silu_mul_reference``,
    or ``silu_mul_kernel`` when set (one launch, the same bits: ``triton_silu_mul``; the
    runner sets it on CUDA, ``use_silu_mul_kernel``)."""

    silu_mul_kernel: SiluMulKernel | None = None

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        fn = self.silu_mul_kernel if self.silu_mul_kernel is not None else silu_mul_reference
        return fn(gate, up)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           kernel: LinearKernel | None) -> torch.Tensor:
    """``F.linear``, or the compiled small-M kernel for few-row float32 CPU inputs."""
    if kernel is not None and small_linear_applies(x, weight, bias):
        return kernel(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` that hands few-row float32 CPU inputs (decode batches) to the compiled
    small-M kernel when the model was given one (``use_linear_kernel``; ``kernels.py``).

    ``qweight``: a quantized weight in place of ``weight`` (``quant.py``; set by the GGUF
    loader on CPU, ``gguf_weights.py``), which then stays an unloaded placeholder on the meta
    device."""

    small_m_kernel: LinearKernel | None = None
    qweight: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.linear(x, self.bias if add_bias else None)
        return linear(x, self.weight, self.bias if add_bias else None, self.small_m_kernel)


class FusedRows:
    """Linear layers that read the same input, run as one GEMM (``fuse_projections``): their
    weights become consecutive row ranges of one matrix, the layers' parameters views of it (so
    checkpoints, TP slices and tests still see them by name); ``matmul`` is the fused output,
    ``__call__`` splits it::

        weight [sum(n_i), in]     rows [0, n_0) layer 0 | [n_0, n_0 + n_1) layer 1 | ...
        out    [T, sum(n_i)]  ->  one column range per layer (views, not copies)

    Built after the weights are loaded, on their device; moving the model later is not
    supported (the views would move, the fused matrix not).
    """

    def __init__(self, layers: list[Linear]) -> None:
        self.layers = layers
        self.sizes = [m.out_features for m in layers]
        self.weight = torch.cat([m.weight.detach() for m in layers])
        biases = [m.bias for m in layers]
        self.bias = (torch.cat([b.detach() for b in biases])  # type: ignore[union-attr]
                     if all(b is not None for b in biases) else None)
        if self.bias is None and any(b is not None for b in biases):
            raise ValueError("fused layers need a bias on all of them or none")
        at = 0
        for m, n in zip(layers, self.sizes, strict=True):
            m.weight = nn.Parameter(self.weight[at:at + n], requires_grad=False)
            if self.bias is not None:
                m.bias = nn.Parameter(self.bias[at:at + n], requires_grad=False)
            at += n

    def pays(self, x: torch.Tensor) -> bool:
        """Fused on CUDA (fewer launches in a step) and for few rows on CPU (the small-M
        kernel's range); a CPU batch of more rows runs the layers apart: fused measured a few
        percent slower there at batch 64 (bench/results/fused_projections.md)."""
        return x.device.type != "cpu" or x.shape[0] <= SMALL_LINEAR_MAX_ROWS

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output ``[T, sum(n_i)]``."""
        return linear(x, self.weight, self.bias, self.layers[0].small_m_kernel)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # split_with_sizes: Tensor.split's Python wrapper costs more than the views (decode)
        return self.matmul(x).split_with_sizes(self.sizes, dim=-1)


class QuantizedRows:
    """``FusedRows`` of quantized layers: one quantized weight holds their rows, fused before
    it was packed (the GGUF loader builds it; each layer's ``qweight`` is its rows of it).
    Always run fused: the quantized kernels take any row count."""

    def __init__(self, layers: list[Linear], weight: QuantizedWeight) -> None:
        self.layers, self.weight = layers, weight
        self.sizes = [m.out_features for m in layers]
        self.bias = None  # GGUF linears have none

    def pays(self, x: torch.Tensor) -> bool:
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(x)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.matmul(x).split_with_sizes(self.sizes, dim=-1)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/D)``, i < D/2, with optional llama3 scaling (float32)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ConfigError(f"rope_scaling: rope_type {rope_type!r} is not supported "
                          f"(supported: 'default', 'llama3')")
    try:
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ConfigError(f"rope_scaling: llama3 needs key {e.args[0]!r}") from None
    # Llama 3.1: long wavelengths (> old_ctx / low) are slowed by `factor`, short ones
    # (< old_ctx / high) kept, the band in between interpolated smoothly.
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary positions; rotates halves (``rotate_half`` convention)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: weights are loaded into a meta-built model with
        # ``to_empty`` which would wipe a buffer; moved lazily to the positions' device.
        self.inv_freq = rope_inv_freq(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2], float32
        emb = torch.cat((freqs, freqs), dim=-1)                      # [T, D]
        # [T, 1, D]: broadcasts over heads of q/k [T, H, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]: dims [0, D/2) pair with [D/2, D)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _split(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise ConfigError(f"{what}={total} is not divisible by tensor_parallel_size={tp_size}")
    return total // tp_size


class Attention(nn.Module):
    """Paged GQA self-attention: q/k/v projections (column-parallel), optional per-head q/k
    RMSNorm (Qwen3), RoPE, paged attention, o_proj (row-parallel, partials summed)."""

    def __init__(self, config: ModelConfig, tp_size: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        d = config.head_dim
        self.head_dim = d
        # Local (this TP rank's) head counts; the projections below are sized by them. With
        # more TP ranks than kv heads each rank holds one (replicated) kv head.
        self.num_heads = _split(config.num_attention_heads, tp_size, "num_attention_heads")
        lo, hi = tp_kv_head_range(config.num_key_value_heads, tp_size, 0)
        self.num_kv_heads = hi - lo
        self.scale = d ** -0.5
        qkv_bias = config.attention_bias
        # Llama's `attention_bias` also adds an o_proj bias; Qwen2 has q/k/v bias only.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        h = config.hidden_size
        self.q_proj = Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=o_bias)
        # Qwen3: RMSNorm over each head's d dims, one [d] weight for all q heads and one for
        # all k heads (so every TP rank holds them whole).
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self._reduce = reduce
        # fuse_projections (or the GGUF loader): q, k, v in one GEMM
        self.qkv: FusedRows | QuantizedRows | None = None
        # fuse_projections (Qwen3): the q/k norm weights as one [hq + hkv, d] matrix, row h
        # the weight of head h of the fused q|k columns, so one norm and one RoPE cover both.
        self.qk_norm_rows: torch.Tensor | None = None
        self.qk_norm_eps = config.rms_norm_eps

    def fuse_qk_norms(self) -> None:
        """Stack the q/k norm weights into ``qk_norm_rows`` (a copy: call once the weights
        are loaded; nothing without q/k norms)."""
        if self.q_norm is not None and self.k_norm is not None:
            q_rows = self.q_norm.weight.detach().expand(self.num_heads, -1)
            k_rows = self.k_norm.weight.detach().expand(self.num_kv_heads, -1)
            self.qk_norm_rows = torch.cat([q_rows, k_rows])

    def _norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, rope: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, hq, d]``, k ``[T, hkv, d]`` -> RoPE(q_norm(q)), RoPE(k_norm(k)) (no norms
        outside Qwen3; no RoPE when ``rope`` is False). The norm comes first, as transformers'
        Qwen3Attention applies it."""
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return (apply_rope(q, cos, sin), apply_rope(k, cos, sin)) if rope else (q, k)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata | StaticDecodeMeta,
                workspace: GatherWorkspace | None = None) -> torch.Tensor:
        t, d, hq, hkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        # A padded decode batch with the fused RoPE + K/V-write kernel: RoPE is its job.
        rope = not (isinstance(meta, StaticDecodeMeta) and meta.rope_store is not None)
        written = False  # the new K/V already in the cache (the CPU's compiled RoPE did it)
        if self.qkv is not None and self.qkv.pays(x):
            # One GEMM; q and k are adjacent column ranges:
            #   out [T, (hq + 2 hkv) d]: cols [0, hq d) q | [hq d, (hq + hkv) d) k | v
            out = self.qkv.matmul(x)
            v = out[:, (hq + hkv) * d:].view(t, hkv, d)
            qk = out[:, :(hq + hkv) * d].view(t, hq + hkv, d)
            if self.q_norm is None or self.qk_norm_rows is not None:
                if self.qk_norm_rows is not None:  # Qwen3: every head normalised at once
                    qk = rms_norm_reference(qk, self.qk_norm_rows, self.qk_norm_eps)[0]
                store = (workspace.rope_store if workspace is not None and rope
                         and not isinstance(meta, StaticDecodeMeta) else None)
                if store is not None and rope_store_applies(qk, v, cos, sin, kv_layer,
                                                            meta.slot_block, meta.slot_offset):
                    # CPU: RoPE in place and the K/V write, one compiled call (same bits)
                    store.rope_store(qk, v, cos, sin, kv_layer, meta.slot_block,
                                     meta.slot_offset)
                    written = True
                elif rope:
                    qk = apply_rope(qk, cos, sin)  # one RoPE for both
                q, k = qk.split_with_sizes((hq, hkv), dim=1)
            else:
                q, k = self._norm_rope(qk[:, :hq], qk[:, hq:], cos, sin, rope)
        else:
            q, k = self._norm_rope(self.q_proj(x).view(t, hq, d), self.k_proj(x).view(t, hkv, d),
                                   cos, sin, rope)
            v = self.v_proj(x).view(t, hkv, d)
        if isinstance(meta, StaticDecodeMeta):  # a padded decode batch (CUDA graph bucket)
            o = (meta.attend(q, k, v, kv_layer, self.scale) if rope
                 else meta.rope_attend(q, k, v, cos, sin, kv_layer, self.scale))
        else:
            o = paged_attention(q, k, v, kv_layer, meta, self.scale, workspace,
                                kv_written=written)
        # Row-parallel o_proj: sum the ranks' partial products, then add the (replicated)
        # bias once.
        out = self._reduce(self.o_proj(o.reshape(t, self.num_heads * self.head_dim),
                                       add_bias=False))
        return out if self.o_proj.bias is None else out + self.o_proj.bias


class MLP(GatedMLP):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, tp_size: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        h = config.hidden_size
        self.intermediate_size = _split(config.intermediate_size, tp_size, "intermediate_size")
        self.gate_proj = Linear(h, self.intermediate_size, bias=False)
        self.up_proj = Linear(h, self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, h, bias=False)
        self._reduce = reduce
        # fuse_projections (or the GGUF loader): gate and up in one GEMM
        self.gate_up: FusedRows | QuantizedRows | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.gate_up.pays(x):
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = self.silu_mul(gate, up)
        del gate, up  # the [T, 2I] product freed before the down projection's temporaries
        return self._reduce(self.down_proj(act))


def sparse_moe(config: ModelConfig, tp_rank: int, tp_size: int, expert_parallel: bool,
               reduce: Callable[[torch.Tensor], torch.Tensor]) -> SparseMoeBlock:
    """The routed experts of one Mixtral / Qwen3-MoE layer on this rank. Tensor parallel:
    every expert, ``I / tp`` of each one's intermediate rows. Expert parallel: experts
    ``expert_range(E, tp, tp_rank)``, whole."""
    moe = config.moe
    assert moe is not None
    if expert_parallel:
        lo, hi = expert_range(moe.num_experts, tp_size, tp_rank)
        inter = moe.moe_intermediate_size
    else:
        lo, hi = 0, moe.num_experts
        inter = _split(moe.moe_intermediate_size, tp_size, "moe_intermediate_size")
    mixtral = config.architecture == "mixtral"
    return SparseMoeBlock(
        config.hidden_size, inter, moe.num_experts, moe.num_experts_per_tok,
        moe.norm_topk_prob, reduce, expert_start=lo, num_local=hi - lo,
        names=MIXTRAL_EXPERT_NAMES if mixtral else QWEN_EXPERT_NAMES,
        # Qwen3-MoE casts the router weights to the activations' dtype; Mixtral keeps float32.
        weights_in_act_dtype=not mixtral)


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm feed-forward, each added to the residual stream. The
    feed-forward is the dense ``mlp``, or routed experts on a MoE model's sparse layers:
    ``block_sparse_moe`` (Mixtral's name) or ``mlp`` (Qwen3-MoE's).

    The feed-forward's add is left to what comes next: ``forward`` returns ``(ffn, h)``, the
    stream being ``h + ffn``, and the next layer's first norm (or the final norm) adds it in
    its own launch (``RMSNorm.add_norm``), to the bits ``h + ffn`` rounds to."""

    def __init__(self, config: ModelConfig, tp_size: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor], layer: int = 0,
                 tp_rank: int = 0, expert_parallel: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp_size, reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        ffn: nn.Module = (sparse_moe(config, tp_rank, tp_size, expert_parallel, reduce)
                          if config.is_moe_layer(layer) else MLP(config, tp_size, reduce))
        self.ffn_name = "block_sparse_moe" if config.architecture == "mixtral" else "mlp"
        setattr(self, self.ffn_name, ffn)

    @property
    def feed_forward(self) -> nn.Module:
        """The layer's MLP or ``SparseMoeBlock``, whatever the checkpoint calls it."""
        return getattr(self, self.ffn_name)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata | StaticDecodeMeta,
                workspace: GatherWorkspace | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the stream ``residual + x`` (``x`` when None) -> ``(ffn, h)``: the
        layer's output stream is ``h + ffn``, not added here (``LlamaForCausalLM.forward``)."""
        n, x = self.input_layernorm.add_norm(x, residual)  # x <- residual + x; n = norm(x)
        a = self.self_attn.forward(n, cos, sin, kv_layer, meta, workspace)
        h, x = self.post_attention_layernorm.add_norm(a, x)  # x <- x + a; h = norm(x)
        return self.feed_forward.forward(h), x


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage (HF's ``model.`` prefix); ``make_layer(g)``
    builds global layer ``g`` (the family's decoder layer)."""

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int],
                 make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        start, end = layer_range
        self.is_first = start == 0
        self.is_last = end == config.num_hidden_layers
        # _weight: no random init (the loader fills it). Under ``torch.device("meta")`` the
        # init's normal_ would import torch._dynamo: ~2 s of every worker start.
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size,
                                          _weight=torch.empty(config.vocab_size,
                                                              config.hidden_size))
                             if self.is_first else None)
        # Keyed by the *global* layer index so names match the checkpoint
        # ("model.layers.5..." on a stage holding layers [4, 8)).
        self.layers = nn.ModuleDict({str(g): make_layer(g) for g in range(start, end)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last else None


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, layer_range: tuple[int, int] | None = None,
                 tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False) -> None:
        super().__init__()
        n = config.num_hidden_layers
        start, end = layer_range if layer_range is not None else (0, n)
        if not 0 <= start < end <= n:
            raise ConfigError(f"layer_range: ({start}, {end}) is not a non-empty range "
                              f"within [0, {n}]")
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank: {tp_rank} not in [0, {tp_size})")
        self.config = config
        self.layer_range = (start, end)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        # MoE layers: whole experts per TP rank (``sparse_moe``) instead of split experts.
        self.expert_parallel = expert_parallel and self._has_experts()
        # Sum of the row-parallel partial outputs across TP ranks; identity at tp_size == 1.
        # The TP issue sets this (e.g. to a torch.distributed all-reduce).
        self.tp_all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Called with local layer i once layer i wrote this step's KV (KV streaming: a context
        # worker's transfer server may send that layer while the next ones compute).
        self.layer_hook: Callable[[int], None] | None = None
        self.num_local_layers = end - start
        # Global kv heads [lo, hi) of this rank (see disagg/layout.py for the drawing).
        self.kv_head_range = self._kv_head_range()
        self.num_local_kv_heads = self.kv_head_range[1] - self.kv_head_range[0]
        self.rotary = self._rotary()
        self.workspace = GatherWorkspace()  # scratch for paged attention, shared by the layers
        # (cache, [cache[:, i] per local layer]): the runner's cache and its layer views, made
        # once (``use_kv_cache``); forward on another cache slices it per step.
        self.kv_layer_views: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        # Pure decode steps in one compiled call (``cpu_decoder.py``; the runner sets it on
        # CPU for the models it takes); None: the layer loop below.
        self.cpu_decoder: CpuDecoder | None = None
        self.model = LlamaModel(config, self.layer_range, self._layer)
        self.lm_head = (Linear(config.hidden_size, config.vocab_size, bias=False)
                        if self.model.is_last else None)
        self.tie_weights()

    # What a family that reuses this class (deepseek.py) builds differently:
    def _has_experts(self) -> bool:
        return self.config.moe is not None

    def _kv_head_range(self) -> tuple[int, int]:
        return tp_kv_head_range(self.config.num_key_value_heads, self.tp_size, self.tp_rank)

    def _rotary(self) -> nn.Module:
        return RotaryEmbedding(self.config)

    def _layer(self, g: int) -> nn.Module:
        return DecoderLayer(self.config, self.tp_size, self._reduce, g, self.tp_rank,
                            self.expert_parallel)

    def tie_weights(self) -> None:
        """Share embed_tokens' weight with lm_head when tied and both live on this stage."""
        if (self.config.tie_word_embeddings and self.lm_head is not None
                and self.model.embed_tokens is not None):
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one GEMM each (``FusedRows``): fewer, larger matrix products
        (a decode step's GEMMs per layer go from 7 to 4); a MoE layer's experts stacked into
        ``[E, 2I, H]`` / ``[E, H, I]`` (``MoeExperts.fuse``). Call once the weights are loaded."""
        for layer in self.model.layers.values():
            att, mlp = layer.self_attn, layer.feed_forward
            # Quantized layers are fused by the GGUF loader or not at all (of mixed formats).
            qkv = [att.q_proj, att.k_proj, att.v_proj]
            if att.qkv is None and all(m.qweight is None for m in qkv):
                att.qkv = FusedRows(qkv)
            if att.qkv is not None and att.qk_norm_rows is None:
                att.fuse_qk_norms()
            if isinstance(mlp, SparseMoeBlock):
                mlp.experts.fuse()
            elif mlp.gate_up is None and mlp.gate_proj.qweight is None \
                    and mlp.up_proj.qweight is None:
                mlp.gate_up = FusedRows([mlp.gate_proj, mlp.up_proj])

    def use_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Make the per-layer views of the cache the runner will pass to ``forward`` once,
        not per step (``kv_layer_views``; the model then holds the cache)."""
        self.kv_layer_views = (kv_cache, [kv_cache[:, i]
                                          for i in range(self.num_local_layers)])

    def use_norm_kernel(self, kernel: NormKernel | None) -> None:
        """Let every RMSNorm use ``kernel`` (None: PyTorch). The runner sets it on CUDA once
        ``triton_norm.triton_norm_kernel`` checked it on the device."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernel

    def use_silu_mul_kernel(self, kernel: SiluMulKernel | None) -> None:
        """Let every dense SwiGLU (``GatedMLP``) use ``kernel`` for ``silu(gate) * up`` (None:
        PyTorch). The runner sets it on CUDA once ``triton_silu_mul.triton_silu_mul_kernel``
        found it bit-identical on the device."""
        for module in self.modules():
            if isinstance(module, GatedMLP):
                module.silu_mul_kernel = kernel

    def use_linear_kernel(self, kernel: LinearKernel | None) -> None:
        """Let every projection and the LM head use ``kernel`` for few-row inputs (None: torch
        only). The runner sets it on CPU, as it sets the attention kernel."""
        for module in self.modules():
            if isinstance(module, Linear | MoeExperts):
                module.small_m_kernel = kernel

    @property
    def is_first_stage(self) -> bool:
        return self.model.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.model.is_last

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        if self.tp_all_reduce is None:
            raise NotImplementedError("tensor parallel forward needs tp_all_reduce to be set")
        return self.tp_all_reduce(x)

    def tp_shard_dim(self, name: str) -> int | None:
        """Dimension along which a checkpoint tensor is split across TP ranks (None: whole).

        Column-parallel q/k/v/gate/up split their output rows (dim 0, biases too);
        row-parallel o/down split their input columns (dim 1; o_proj's bias is replicated).
        Experts (Mixtral's w1/w3 gate/up, w2 down) split the same way, or not at all under
        expert parallelism (each rank holds its experts whole); routers are replicated.
        """
        if self.expert_parallel and ".experts." in name:
            return None
        if any(p in name for p in ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.",
                                   ".w1.", ".w3.")):
            return 0
        if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
            return 1
        return None

    def tp_shard(self, name: str, local_size: int) -> tuple[int, int, int, int] | None:
        """This rank's slice of checkpoint tensor ``name``: ``(dim, lo, hi, full_size)``.

        ``local_size`` is the parameter's size along ``dim`` on this rank. Evenly split
        tensors: rank r takes ``[r * local, (r + 1) * local)`` of ``tp * local``. k/v with
        replicated kv heads (tp > kv heads): rank r takes kv head ``h = r // replicas``, rows
        ``[h * D, (h + 1) * D)`` of the full ``[H_kv * D, ...]`` tensor. None: read whole.
        """
        dim = self.tp_shard_dim(name)
        if dim is None or self.tp_size == 1:
            return None
        cfg = self.config
        if (("k_proj." in name or "v_proj." in name)
                and kv_head_replicas(cfg.num_key_value_heads, self.tp_size) > 1):
            d = cfg.head_dim
            lo, hi = self.kv_head_range
            return 0, lo * d, hi * d, cfg.num_key_value_heads * d
        r = self.tp_rank
        return dim, r * local_size, (r + 1) * local_size, self.tp_size * local_size

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata | StaticDecodeMeta,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers on ``T`` flattened tokens -> ``[T, hidden]``.

        The first stage embeds ``input_ids`` (``[T]``); others take ``hidden_states``
        (``[T, hidden]``, the previous stage's output). The last stage returns the final
        normed hidden states, others the residual stream. ``kv_cache`` is this rank's cache;
        local layer ``i`` uses ``kv_cache[:, i]``.

        A layer hands its feed-forward output and the stream before it apart (``DecoderLayer``);
        the next layer's first norm, or the final one, adds them in its launch. A non-last
        stage adds them at its end: its output crosses to the next stage as one tensor.
        """
        if self.model.embed_tokens is not None and hidden_states is None:
            x = self.model.embed_tokens(input_ids)
        elif hidden_states is not None:
            x = hidden_states
        else:
            raise ValueError("a non-first pipeline stage needs hidden_states")
        if kv_cache.shape[1] != self.num_local_layers:
            raise ValueError(f"kv_cache holds {kv_cache.shape[1]} layers, this stage has "
                             f"{self.num_local_layers}")
        cos, sin = self.rotary(positions, x.dtype)
        fast = self.cpu_decoder
        if (fast is not None and hidden_states is None and self.layer_hook is None
                and fast.applies(meta, kv_cache, x.shape[0])):
            return fast.forward(x, cos, sin, meta)  # type: ignore[arg-type]
        hook = self.layer_hook
        residual: torch.Tensor | None = None
        views = self.kv_layer_views
        layers = views[1] if views is not None and views[0] is kv_cache else None
        # forward, not __call__ (here and inside the layers): no module hooks are used, and a
        # one-token decode step pays nn.Module.__call__'s checks per module and layer.
        for i, layer in enumerate(self.model.layers.values()):
            kv_layer = layers[i] if layers is not None else kv_cache[:, i]
            x, residual = layer.forward(x, cos, sin, kv_layer, meta, self.workspace, residual)
            if hook is not None:
                hook(i)
        if self.model.norm is not None:
            return self.model.norm.add_norm(x, residual)[0]
        return x if residual is None else residual + x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[S, hidden]`` (final normed states of the rows to sample) -> float32 ``[S, vocab]``."""
        if self.lm_head is None:
            raise RuntimeError("compute_logits on a non-last pipeline stage")
        return self.lm_head(hidden).float()
