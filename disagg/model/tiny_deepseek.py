"""The DeepSeek-V3 part of ``tiny.write_tiny_checkpoint(arch="deepseek_v3")``: its
``config.json`` keys and random weights (MLA with low-rank q and kv, grouped routed experts
with a selection bias, one shared expert, the first layer dense).

Tiny shapes (hidden 64, 4 heads): kv_lora_rank 32, q_lora_rank 48, qk_nope / qk_rope / v
head dims 16, 8 routed experts in 2 groups (1 group kept, 2 experts per token), expert
intermediate ``moe_intermediate_size`` (default 32): the latent cache row is 32 + 16 = 48
wide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (name, value) of the MLA and routing keys a tiny DeepSeek-V3 config.json gets.
TINY_MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16, "v_head_dim": 16, "rope_interleave": True}


def deepseek_keys(cfg: dict[str, Any], num_experts: int, num_experts_per_tok: int,
                  moe_intermediate_size: int | None) -> dict[str, Any]:
    """The DeepSeek-V3 keys of ``config.json`` (replacing the Qwen-style ones
    ``_model_config`` wrote): MLA ranks and head dims, routing, dense first layer."""
    for key in ("use_sliding_window", "sliding_window", "max_window_layers"):
        cfg.pop(key, None)
    if num_experts < 4 or num_experts % 2:
        raise ValueError(f"num_experts: DeepSeek-V3's 2 groups need an even count >= 4, got "
                         f"{num_experts}")
    if not 1 <= num_experts_per_tok <= num_experts // 2:
        raise ValueError(f"num_experts_per_tok: must be in [1, {num_experts // 2}] (the one "
                         f"kept group's experts), got {num_experts_per_tok}")
    if moe_intermediate_size is not None and moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size: must be > 0, got {moe_intermediate_size}")
    heads = cfg["num_attention_heads"]
    return {
        **TINY_MLA,
        # transformers' eager MLA repeats the (expanded) kv heads H / num_key_value_heads
        # times: it must equal the heads; the engine caches one latent head whatever it says.
        "num_key_value_heads": heads,
        "head_dim": TINY_MLA["qk_rope_head_dim"],  # transformers: the rope part
        "attention_bias": False,
        "n_routed_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size or 32, "n_shared_experts": 1,
        "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "num_nextn_predict_layers": 0,
    }


def deepseek_layer_weights(cfg: dict[str, Any], layer: int, normal: Callable[..., Any],
                           ones: Callable[[int], Any], branch: float) -> dict[str, Any]:
    """One decoder layer's tensors under transformers' names, scaled like ``tiny._weights``
    (1/sqrt(fan_in) projections, router logits of std ~1, a selection bias that changes
    some choices)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    r, qr = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    w = {
        a + "q_a_proj.weight": normal(qr, h, std=h ** -0.5),
        a + "q_a_layernorm.weight": ones(qr),
        a + "q_b_proj.weight": normal(heads * (dn + dr), qr, std=qr ** -0.5),
        a + "kv_a_proj_with_mqa.weight": normal(r + dr, h, std=h ** -0.5),
        a + "kv_a_layernorm.weight": ones(r),
        a + "kv_b_proj.weight": normal(heads * (dn + dv), r, std=r ** -0.5),
        a + "o_proj.weight": normal(h, heads * dv, std=branch * (heads * dv) ** -0.5),
        p + "input_layernorm.weight": ones(h),
        p + "post_attention_layernorm.weight": ones(h),
    }

    def swiglu(prefix: str, inter: int) -> None:
        w[prefix + "gate_proj.weight"] = normal(inter, h, std=h ** -0.5)
        w[prefix + "up_proj.weight"] = normal(inter, h, std=h ** -0.5)
        w[prefix + "down_proj.weight"] = normal(h, inter, std=branch * inter ** -0.5)

    if layer < cfg["first_k_dense_replace"]:
        swiglu(p + "mlp.", cfg["intermediate_size"])
        return w
    e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    w[p + "mlp.gate.weight"] = normal(e, h, std=h ** -0.5)
    w[p + "mlp.gate.e_score_correction_bias"] = normal(e, std=0.1)
    for i in range(e):
        swiglu(f"{p}mlp.experts.{i}.", inter)
    swiglu(p + "mlp.shared_experts.", inter * cfg["n_shared_experts"])
    return w
