"""DeepSeek-V3 decoder: multi-head latent attention (MLA) over a latent paged KV cache, and
DeepSeek's grouped sigmoid routing of its experts.

Per layer: x -> [RMSNorm -> MLA -> +x] -> [RMSNorm -> dense SwiGLU (layers
``[0, first_k_dense_replace)``) or MoE (routed + shared experts) -> +x]; final RMSNorm, LM
head. Parameter names are transformers' (``model.layers.N.self_attn.kv_b_proj.weight``,
``mlp.experts.E.gate_proj.weight``, ``mlp.gate.e_score_correction_bias`` ...).

MLA of one token ``x`` (r = kv_lora_rank, dn / dr = qk_nope / qk_rope_head_dim, dv =
v_head_dim, H query heads)::

    q      = q_b(norm(q_a(x)))  (or q_proj(x))    [H, dn + dr] -> q_nope [H, dn] | q_pe [H, dr]
    kv_a(x)                                       [r + dr]     -> c_kv [r]       | k_pe [dr]
    c_kv   = norm(c_kv);  q_pe, k_pe = RoPE(q_pe), RoPE(k_pe)   (one k_pe for all heads)
    cache row of the token: [c_kv | k_pe]         [r + dr]      (kv_parts 1, one "head")
    kv_b   : c_kv -> per head k_nope [dn] and v [dv]:  W_kb [H, dn + dv, r] = W_uk | W_uv

The cache keeps the latent, never per-head K/V. Attention *absorbs* ``kv_b`` instead of
decompressing every cached row at every step (transformers decompresses; the two are equal
up to float rounding)::

    score_h(j) = q_nope_h . (W_uk_h c_j) + q_pe_h . k_pe_j
               = [q_nope_h W_uk_h | q_pe_h] . [c_j | k_pe_j]      (query absorbed: r + dr wide)
    out_h      = W_uv_h (sum_j p_h(j) c_j)                         (value = the row's c_kv)

so attention is multi-query attention with one kv head over the cache rows as they are
(``attention.paged_latent_attention``): a decode step reads r + dr numbers per cached token
and layer (576 for DeepSeek-V3) instead of H * (dn + dr + dv) after decompression. Prefill
attends at the same r + dr width per head (3x the dn + dr = 192 of decompressed keys for
DeepSeek-V3): a decompressed prefill would be cheaper for long prompts (not done).

Parallelism: tensor parallelism splits the query heads (q_b / q_proj and kv_b rows,
o_proj columns) and every MLP's intermediate dims (dense, shared and routed experts, which
``moe.MoeExperts`` runs); the latent is the same for all heads, so every TP rank computes and
caches the whole of it (replicated, as a kv head is when tp > kv heads): for DeepSeek-V3
(61 layers, rows of 512 + 64) that is 61 * 576 * 2 = 70,272 bytes per token on every rank in
bfloat16, whatever the TP size (decompressed per-head K/V would be 128 * (192 + 128) * 61 * 2
= 4,997,120 bytes per token, split over the ranks). Pipeline stages hold
layer ranges as in ``llama.py``. With expert parallelism (``enable_expert_parallel``) each
TP rank holds routed experts ``expert_range(E, tp, tp_rank)`` whole instead (shared experts
stay split).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from disagg.config import ConfigError, DeepseekMoEConfig, MLAConfig, ModelConfig
from disagg.model.attention import (
    AttentionMetadata,
    GatherWorkspace,
    paged_latent_attention,
)
from disagg.model.llama import GatedMLP, Linear, LlamaForCausalLM, RMSNorm, _split, apply_rope
from disagg.model.moe import QWEN_EXPERT_NAMES, MoeExperts, expert_range
from disagg.model.static_decode import StaticDecodeMeta

# transformers' q_a_layernorm / kv_a_layernorm use DeepseekV3RMSNorm's default eps, not
# config.rms_norm_eps.
LORA_NORM_EPS = 1e-6


# ---- RoPE: DeepSeek's rotary part, yarn ----------------------------------------------------


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_rope(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dr / 2], attention_factor)`` of the rotary dims (float32): the default
    ``theta^(-2i/dr)``, or YaRN's blend of interpolated (``/ factor``) and extrapolated
    frequencies, ramping between the dims that rotate ``beta_fast`` and ``beta_slow`` times
    over ``original_max_position_embeddings``; cos/sin are then scaled by
    ``attention_factor`` (transformers' ``_compute_yarn_parameters``)."""
    assert config.mla is not None
    dim = config.mla.qk_rope_head_dim
    base = config.rope_theta
    # On the CPU explicitly: the model is built under torch.device("meta").
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope_type != "yarn":
        raise ConfigError(f"rope_scaling: rope_type {rope_type!r} is not supported for "
                          f"DeepSeek-V3 (supported: 'default', 'yarn')")
    try:
        old_ctx = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ConfigError(f"rope_scaling: yarn needs key {e.args[0]!r}") from None
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else config.max_position_embeddings / old_ctx
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength fits `rotations` times into the original context
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the trained frequency, 0: interpolate it
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def softmax_scale(config: ModelConfig) -> float:
    """``(dn + dr) ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when the
    rope is scaled (transformers' ``yarn_apply_mscale``)."""
    assert config.mla is not None
    scale = config.mla.qk_head_dim ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        mscale_all = scaling.get("mscale_all_dim", 0)
        if mscale_all:
            m = _yarn_mscale(float(scaling["factor"]), mscale_all)
            scale *= m * m
    return scale


class LatentRotary(nn.Module):
    """cos/sin ``[T, 1, dr]`` (``cat(freqs, freqs)``, times the yarn attention factor)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer (llama.RotaryEmbedding says why).
        self.inv_freq, self.attention_factor = deepseek_rope(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dr/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """RoPE on adjacent pairs: ``(x0, x1), (x2, x3) ...`` rotate by frequencies 0, 1 ...;
    the result lists the pairs' first elements, then their second ones (transformers'
    layout, the same for q and k, so their dot products are those of the pairs)::

        x [.., dr] -> [x_even cos - x_odd sin | x_odd cos + x_even sin]   (cos: first half)
    """
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


# ---- MLA -----------------------------------------------------------------------------------


class LatentAttention(nn.Module):
    """Multi-head latent attention of one layer over the latent cache (module docstring)."""

    def __init__(self, config: ModelConfig, tp_size: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla: MLAConfig = mla
        h = config.hidden_size
        # This TP rank's query heads; the latent (c_kv, k_pe) is computed whole on every rank.
        self.num_heads = _split(config.num_attention_heads, tp_size, "num_attention_heads")
        hl, dq = self.num_heads, mla.qk_head_dim
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(h, hl * dq, bias=False)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, hl * dq, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, hl * (mla.qk_nope_head_dim + mla.v_head_dim),
                                bias=False)
        self.o_proj = Linear(hl * mla.v_head_dim, h, bias=bias)
        self.scale = softmax_scale(config)
        self.rope = apply_rope_interleaved if mla.rope_interleave else apply_rope
        self._reduce = reduce

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata | StaticDecodeMeta,
                workspace: GatherWorkspace | None = None) -> torch.Tensor:
        if isinstance(meta, StaticDecodeMeta):
            raise NotImplementedError("CUDA graph decode is not supported for MLA")
        m = self.mla
        t, hl = x.shape[0], self.num_heads
        r, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, hl, dn + dr).split((dn, dr), dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split((r, dr), dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)                                   # [T, r]
        q_pe = self.rope(q_pe, cos, sin)                                   # [T, hl, dr]
        k_pe = self.rope(k_pe.view(t, 1, dr), cos, sin).view(t, dr)        # [T, dr]
        # kv_b rows, per local head: [dn rows of W_uk | dv rows of W_uv], each [.., r].
        w_kb = self.kv_b_proj.weight.view(hl, dn + dv, r)
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_kb[:, :dn])         # [T, hl, r]
        query = torch.cat((q_lat, q_pe), dim=-1)                           # [T, hl, r + dr]
        latent = torch.cat((c_kv, k_pe), dim=-1)                           # [T, r + dr]
        o_lat = paged_latent_attention(query, latent, kv_layer, meta, self.scale, r,
                                       workspace)                          # [T, hl, r]
        o = torch.einsum("thr,hvr->thv", o_lat, w_kb[:, dn:])              # [T, hl, dv]
        # Row-parallel o_proj: partial sums reduced, the replicated bias added once.
        out = self._reduce(self.o_proj(o.reshape(t, hl * dv), add_bias=False))
        return out if self.o_proj.bias is None else out + self.o_proj.bias


# ---- feed-forward: dense, and DeepSeek's routed experts ------------------------------------


class SwiGLU(GatedMLP):
    """``down(silu(gate(x)) * up(x))`` with ``inter`` (this rank's share of) intermediate
    rows; returns the partial sum (the caller reduces)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DenseMLP(SwiGLU):
    """The first ``first_k_dense_replace`` layers' MLP (``intermediate_size``), reduced."""

    def __init__(self, config: ModelConfig, tp_size: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(config.hidden_size,
                         _split(config.intermediate_size, tp_size, "intermediate_size"))
        self._reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(super().forward(x))


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, moe: DeepseekMoEConfig
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (``noaux_tc``) of ``logits [T, E]`` -> ``(weights, ids)``, each
    ``[T, k]`` (float32, int64; ids in no particular order)::

        s      = sigmoid(logits)                       (float32)
        choice = s + bias                              (the bias steers selection only)
        group g score = sum of the 2 best `choice` of its E / n_group experts
        keep the topk_group best groups; ids = top k of `choice` inside them
        weights = s[ids] (unbiased), / their sum (+1e-20) when norm_topk_prob,
                  * routed_scaling_factor
    """
    t, e = logits.shape
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    groups = choice.view(t, moe.n_group, e // moe.n_group)
    group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)                  # [T, n_group]
    keep = group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1]     # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    expert_mask = group_mask[:, :, None].expand_as(groups).reshape(t, e)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = masked.topk(moe.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class DeepseekMoE(nn.Module):
    """Router (``gate``: weight and ``e_score_correction_bias``, replicated), the routed
    experts (``moe.MoeExperts``, intermediate dims split over TP) and the always-on shared
    experts (one SwiGLU of ``n_shared_experts * moe_intermediate_size``); one all-reduce.
    ``expert_parallel``: this rank runs routed experts ``expert_range(E, tp, tp_rank)`` whole
    (the others' pairs are skipped) instead of ``1 / tp`` of every expert."""

    def __init__(self, config: ModelConfig, tp_size: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor], tp_rank: int = 0,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        moe = config.deepseek_moe
        assert moe is not None
        self.moe = moe
        h = config.hidden_size
        inter = _split(moe.moe_intermediate_size, tp_size, "moe_intermediate_size")
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(moe.n_routed_experts, h))
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(moe.n_routed_experts))
        if expert_parallel:
            lo, hi = expert_range(moe.n_routed_experts, tp_size, tp_rank)
            self.experts = MoeExperts(h, moe.moe_intermediate_size, lo, hi - lo,
                                      QWEN_EXPERT_NAMES)
        else:
            self.experts = MoeExperts(h, inter, 0, moe.n_routed_experts, QWEN_EXPERT_NAMES)
        self.shared_experts = (SwiGLU(h, inter * moe.n_shared_experts)
                               if moe.n_shared_experts else None)
        self._reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(x.float(), self.gate.weight.float())
        weights, ids = grouped_topk(logits, self.gate.e_score_correction_bias, self.moe)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self._reduce(out)


# ---- the stack -------------------------------------------------------------------------------


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp_size: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor], tp_rank: int = 0,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        moe = config.deepseek_moe
        assert moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LatentAttention(config, tp_size, reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (DenseMLP(config, tp_size, reduce)
                               if layer < moe.first_k_dense_replace
                               else DeepseekMoE(config, tp_size, reduce, tp_rank,
                                                expert_parallel))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata | StaticDecodeMeta,
                workspace: GatherWorkspace | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``llama.DecoderLayer.forward``'s contract: the stream ``residual + x`` in,
        ``(mlp, h)`` out (the stream ``h + mlp``, added by the next norm or the stage)."""
        n, x = self.input_layernorm.add_norm(x, residual)  # x <- residual + x; n = norm(x)
        a = self.self_attn(n, cos, sin, kv_layer, meta, workspace)
        h, x = self.post_attention_layernorm.add_norm(a, x)  # x <- x + a; h = norm(x)
        return self.mlp(h), x


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 with ``LlamaForCausalLM``'s interface (forward over the paged cache, the
    logits, the TP/PP hooks, the kernels the runner sets); its KV cache is the latent one:
    ``[blocks, local layers, 1, 1, tokens_per_block, kv_lora_rank + qk_rope_head_dim]``."""

    # The loader keeps these in float32 at any dtype: the routing bias decides which experts
    # run, so it stays as precise as transformers keeps it.
    float32_parameters = (".e_score_correction_bias",)

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int] | None = None,
                 tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False) -> None:
        if config.mla is None or config.deepseek_moe is None:
            raise ConfigError("architecture: DeepseekV3ForCausalLM needs the MLA and MoE "
                              "fields of a deepseek_v3 config")
        super().__init__(config, layer_range, tp_rank, tp_size, expert_parallel)

    def _has_experts(self) -> bool:
        return True

    def _kv_head_range(self) -> tuple[int, int]:
        return (0, 1)  # one cache "head" (the latent), held whole by every TP rank

    def _rotary(self) -> nn.Module:
        return LatentRotary(self.config)

    def _layer(self, g: int) -> nn.Module:
        return DeepseekDecoderLayer(self.config, g, self.tp_size, self._reduce, self.tp_rank,
                                    self.expert_parallel)

    def fuse_projections(self) -> None:
        """Stack each MoE layer's expert weights (``MoeExperts.fuse``); attention keeps its
        projections apart (q_a and kv_a could share a GEMM: not done)."""
        for layer in self.model.layers.values():
            if isinstance(layer.mlp, DeepseekMoE):
                layer.mlp.experts.fuse()

    def tp_shard_dim(self, name: str) -> int | None:
        """Column-parallel (dim 0: rows are heads or intermediate dims): q_proj, q_b_proj,
        kv_b_proj, gate/up of every MLP; row-parallel (dim 1): o_proj, down_proj. The rest
        (q_a, kv_a, norms, router, embeddings, LM head) is replicated, and so are routed
        experts under expert parallelism (each rank reads its own experts whole)."""
        if self.expert_parallel and ".experts." in name:
            return None
        if any(p in name for p in ("q_proj.", "q_b_proj.", "kv_b_proj.", "gate_proj.",
                                   "up_proj.")):
            return 0
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return 1
        return None

    def tp_shard(self, name: str, local_size: int) -> tuple[int, int, int, int] | None:
        """Rank r's slice ``[r * local, (r + 1) * local)`` along ``tp_shard_dim`` (rows of
        q_b / kv_b are head-major, so that is whole heads)."""
        dim = self.tp_shard_dim(name)
        if dim is None or self.tp_size == 1:
            return None
        r = self.tp_rank
        return dim, r * local_size, (r + 1) * local_size, self.tp_size * local_size
