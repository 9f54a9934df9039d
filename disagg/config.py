"""Frozen, validated configuration objects.

Every config is a frozen dataclass checked in ``__post_init__``; a bad value raises
``ConfigError`` naming the field, so a CLI or HTTP layer can report it as is.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from disagg.model.gguf_modes import GGUF_WEIGHT_MODES  # (re-exported: options import it)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def read_yaml(path: str | os.PathLike[str], error: type[Exception] = ConfigError) -> Any:
    """The parsed YAML document of ``path``; an unreadable file or invalid YAML raises
    ``error`` with a message naming the file."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise error(f"{os.fspath(path)}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise error(f"{os.fspath(path)}: invalid YAML: {e}") from None


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


class CapacityPolicy(str, enum.Enum):
    """How the scheduler admits requests when KV blocks are scarce (TensorRT-LLM's two
    policies and names; guaranteed_no_evict is the default)."""

    # Admit only if blocks for the request's whole lifetime (prompt + max_tokens) can be
    # reserved; never pause a running request.
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    # Admit on the blocks needed now; when blocks run out, pause (preempt, later recompute)
    # the most recently started request.
    MAX_UTILIZATION = "max_utilization"


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

# Architectures whose attention RMS-normalises each query and key head (over its head_dim
# dims, one weight per q / k shared by the heads) before RoPE: Qwen3's q_norm / k_norm.
QK_NORM_ARCHITECTURES = {"qwen3", "qwen3_moe"}
# Architectures whose config.json may switch on sliding windows (use_sliding_window,
# max_window_layers, layer_types): refused, see _refuse_sliding_window.
SLIDING_WINDOW_KEYS = {"qwen2", "qwen3"}


def _refuse_sliding_window(cfg: dict[str, Any], source: str) -> None:
    """``ConfigError`` naming the key when some layer of a Qwen-family config would attend
    through a sliding window (the engine attends to the whole context). transformers' rule: a
    window only with ``use_sliding_window`` and a ``sliding_window`` size, on the layers that
    ``layer_types`` marks ``sliding_attention``, else on layers ``>= max_window_layers``."""
    if not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        return
    layers = int(cfg.get("num_hidden_layers") or 0)
    types = cfg.get("layer_types")
    if isinstance(types, list):
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
        key = "layer_types"
    else:
        sliding = list(range(int(cfg.get("max_window_layers", 28)), layers))
        key = "max_window_layers"
    if sliding:
        raise ConfigError(f"{source}: use_sliding_window: true gives layers {sliding} "
                          f"(per {key}) a window of {cfg['sliding_window']} tokens; "
                          f"sliding-window attention is not supported (set it false)")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family checkpoint, read from its ``config.json``."""

    architecture: str  # a value of SUPPORTED_ARCHITECTURES ("llama", "qwen3_moe", ...)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # DeepSeek-V3: multi-head latent attention and its routed experts (None elsewhere).
    mla: MLAConfig | None = None
    deepseek_moe: DeepseekMoEConfig | None = None
    # Mixtral / Qwen3-MoE: softmax top-k routed experts (None: a dense model).
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        _require(self.architecture in SUPPORTED_ARCHITECTURES.values(), "architecture",
                 f"unsupported {self.architecture!r}; supported: "
                 f"{sorted(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 "num_key_value_heads", "must divide num_attention_heads")
        _require(self.torch_dtype in DTYPES, "torch_dtype", f"one of {sorted(DTYPES)}")
        if self.mla is not None:
            # The latent is one cache "head" shared by every query head.
            _require(self.num_key_value_heads == 1, "num_key_value_heads",
                     "must be 1 with MLA (the latent is one cache head)")

    # The KV cache kind (DESIGN.md section 1): a rank's cache is
    # [blocks, layers, kv_parts, cache heads, tokens_per_block, kv_cache_width].
    @property
    def cache_kind(self) -> str:
        """``"mha"`` (K and V per kv head) or ``"mla"`` (one latent row per token)."""
        return "mla" if self.mla is not None else "mha"

    @property
    def kv_parts(self) -> int:
        """2 (K, V) for MHA/GQA; 1 for MLA (the latent: normalised c_kv then roped k_pe)."""
        return 1 if self.mla is not None else 2

    @property
    def kv_cache_width(self) -> int:
        """Last dim of the cache: head_dim (MHA), kv_lora_rank + qk_rope_head_dim (MLA)."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None and not archs and cfg.get("model_type") in SUPPORTED_ARCHITECTURES.values():
            arch = cfg["model_type"]
        if arch is None:
            raise ConfigError(f"{source}: architectures={archs!r} is not supported; supported: "
                              f"{sorted(SUPPORTED_ARCHITECTURES)}")
        if arch in SLIDING_WINDOW_KEYS:
            _refuse_sliding_window(cfg, source)
        if arch == "deepseek_v3":
            # MLA caches one latent "head" per token (config.json's num_key_value_heads is
            # not used by the model); head_dim is the rope part, as transformers sets it.
            cfg = {**cfg, "num_key_value_heads": 1,
                   "head_dim": cfg.get("qk_rope_head_dim", 64)}
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
            # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older
            # checkpoints write `rope_theta` + `rope_scaling`.
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            rope_theta = float(cfg.get("rope_theta") or rope.pop("rope_theta", 10000.0))
            rope.pop("rope_theta", None)
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = {}
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope or None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
                qk_norm=arch in QK_NORM_ARCHITECTURES,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                torch_dtype=dtype,
                **_deepseek_fields(cfg, arch),
                **_moe_fields(cfg, arch),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: file not found (is {model_dir!r} a Hugging Face "
                              f"checkpoint folder?)")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), source=path)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts (``moe``) or a dense MLP."""
        return self.moe is not None and self.moe.is_moe_layer(layer)


@dataclass(frozen=True)
class MoEConfig:
    """Softmax top-k mixture of experts (Mixtral, Qwen3-MoE; transformers' names).

    ``num_experts`` experts of ``moe_intermediate_size`` rows each, ``num_experts_per_tok``
    chosen per token, their weights divided by their sum when ``norm_topk_prob``. Layer ``i``
    is sparse when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
    ``mlp_only_layers``; the others use the dense MLP (``intermediate_size``).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "decoder_sparse_step"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 f"must be <= num_experts={self.num_experts}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's ``moe`` of a Mixtral / Qwen3-MoE config.json ({} otherwise)."""
    if arch not in ("mixtral", "qwen3_moe"):
        return {}
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: {cfg['hidden_act']!r} is not supported (silu)")
    # Both window every layer when set (Qwen3-MoE only with use_sliding_window); the engine
    # attends to the whole context.
    window = cfg.get("sliding_window") if (arch == "mixtral"
                                           or cfg.get("use_sliding_window")) else None
    if window is not None and int(window) < int(cfg.get("max_position_embeddings", 2048)):
        raise ConfigError(f"sliding_window: {window} gives every layer a window of {window} "
                          f"tokens; sliding-window attention is not supported (set it null)")
    # transformers >= 5 writes num_local_experts for both; Qwen3-MoE checkpoints num_experts.
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts is None:
        raise ConfigError("num_local_experts: missing (the number of experts)")
    if arch == "mixtral":  # every layer sparse, weights always renormalised
        return {"moe": MoEConfig(int(experts), int(cfg["num_experts_per_tok"]),
                                 int(cfg["intermediate_size"]))}
    return {"moe": MoEConfig(
        int(experts), int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))}


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): transformers' names and defaults.

    Per token the cache holds ``kv_lora_rank`` dims of normalised latent ``c_kv`` then the
    ``qk_rope_head_dim`` dims of the roped key ``k_pe`` shared by all heads; ``kv_b_proj``
    maps ``c_kv`` to each head's ``qk_nope_head_dim`` key dims and ``v_head_dim`` value dims.
    ``q_lora_rank`` None: queries come from one ``q_proj`` instead of ``q_a``/``q_b``.
    """

    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True  # k_pe / q_pe rotate adjacent pairs (x0, x1), (x2, x3) ...

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        if self.q_lora_rank is not None:
            _require(self.q_lora_rank > 0, "q_lora_rank", "must be > 0 (or null)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekMoEConfig:
    """DeepSeek-V3's mixture of experts (transformers' names): ``n_routed_experts`` in
    ``n_group`` groups, ``topk_group`` of them kept, ``num_experts_per_tok`` chosen inside;
    ``n_shared_experts`` always on; layers ``[0, first_k_dense_replace)`` use a dense MLP."""

    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5

    def __post_init__(self) -> None:
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "n_group", "topk_group"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        _require(self.first_k_dense_replace >= 0, "first_k_dense_replace", "must be >= 0")
        _require(self.n_routed_experts % self.n_group == 0, "n_group",
                 f"must divide n_routed_experts={self.n_routed_experts}")
        per_group = self.n_routed_experts // self.n_group
        # Groups are scored by the sum of their best two experts.
        _require(per_group >= 2, "n_group", f"leaves {per_group} expert per group (needs 2)")
        _require(self.topk_group <= self.n_group, "topk_group", "must be <= n_group")
        _require(self.num_experts_per_tok <= self.topk_group * per_group,
                 "num_experts_per_tok", f"must be <= topk_group * experts per group "
                 f"({self.topk_group * per_group})")


def _deepseek_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's ``mla`` / ``deepseek_moe`` of a DeepSeek-V3 config.json ({} otherwise)."""
    if arch != "deepseek_v3":
        return {}
    mla_names = {f.name for f in fields(MLAConfig)}
    moe_names = {f.name for f in fields(DeepseekMoEConfig)}
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"topk_method: {cfg['topk_method']!r} is not supported "
                          f"(DeepSeek-V3 routing is 'noaux_tc')")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: {cfg['hidden_act']!r} is not supported (silu)")
    if cfg.get("quantization_config"):
        # The released DeepSeek-V3 weights are block-quantized FP8 (weight_scale_inv
        # tensors): read as plain weights they would be wrong, not refused.
        method = cfg["quantization_config"].get("quant_method", "?") if isinstance(
            cfg["quantization_config"], dict) else "?"
        raise ConfigError(f"quantization_config: quantized checkpoints ({method!r}) are not "
                          f"supported; use a bfloat16 / float32 conversion")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope_scaling: rope_type {rope_type!r} is not supported for "
                          f"DeepSeek-V3 (supported: 'default', 'yarn')")
    if rope_type == "yarn" and "original_max_position_embeddings" not in rope:
        raise ConfigError("rope_scaling: yarn needs key 'original_max_position_embeddings'")
    return {
        "mla": MLAConfig(**{k: cfg[k] for k in mla_names if cfg.get(k) is not None
                            or k == "q_lora_rank" and k in cfg}),
        "deepseek_moe": DeepseekMoEConfig(**{k: cfg[k] for k in moe_names
                                             if cfg.get(k) is not None}),
    }


DTYPES = {"float32", "bfloat16", "float16"}
# CacheConfig.kv_cache_dtype: auto (the compute dtype; see CacheConfig) or a dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# With no sizing option set: a CUDA worker may use this share of the GPU's total memory
# (vLLM's gpu_memory_utilization default); a CPU worker sizes its KV cache for what the model
# and the load can use: DEFAULT_CPU_KV_SEQUENCES sequences of max_model_len tokens (at most
# max_batch_size of them; at least max_num_tokens tokens, one full step), never more than
# DEFAULT_CPU_KV_FRACTION of free RAM (the same memory also holds the process, the OS and
# often other workers). The runner applies them; `disagg serve --help` shows the first.
DEFAULT_GPU_MEMORY_FRACTION = 0.9
DEFAULT_CPU_KV_FRACTION = 0.1
# Four full-length requests at once (a chat request without max_tokens reserves max_model_len
# under GUARANTEED_NO_EVICT), or as many shorter ones as fit in as many tokens.
DEFAULT_CPU_KV_SEQUENCES = 4
# A CPU worker's tokens per step when max_num_tokens is not given (and chunked context is on):
# a long prompt is prefilled in chunks of this many tokens, so a step's activations (and the
# heap they leave behind) are those of 256 rows, not of the whole prompt (SmolLM2 Q4_1 with a
# float16 cache, 2,048-token prefill, Xeon 2 cores: peak RSS 458-469 MiB in chunks of 512,
# 444-450 in chunks of 256, 442 in chunks of 128; seconds 1.75-2.17 / 2.02-2.14 / 2.80, so
# 256 costs no speed and 128 does). CUDA keeps SchedulerConfig's 8192.
DEFAULT_CPU_MAX_NUM_TOKENS = 256


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    ``kv_cache_tokens`` (an explicit token capacity), ``kv_cache_fraction`` (share of the device
    memory free after loading the weights and, on CUDA, after the activations a profiling
    forward at ``max_num_tokens`` peaked at) and ``gpu_memory_fraction`` (CUDA only: share of
    the GPU's *total* memory this worker may use for weights + activations + KV cache, so
    workers sharing one GPU split it, like vLLM's ``gpu_memory_utilization``) each bound the
    number of blocks; the smallest capacity wins, as in TensorRT-LLM. With none of them set a
    CUDA worker uses ``gpu_memory_fraction=0.9``; a CPU worker holds 4 sequences of
    ``max_model_len`` tokens (no more than ``max_batch_size`` of them, no fewer tokens than
    ``max_num_tokens``), capped at 0.1 of free RAM.

    Offload tiers (``disagg.engine.kv_offload``; all unset: none): prefix-cached blocks
    evicted from the pool go to a host-memory tier of ``kv_offload_host_gib`` and from there
    (or directly, without a host tier) to a disk tier of ``kv_offload_disk_gib`` under
    ``kv_offload_disk_dir``; a prefix hit in a tier is copied back before the request runs.
    The sizes are the worker's: on a TP/PP worker every rank keeps its own slice of each block,
    and a block's bytes are its slices on all ranks together.

    ``kv_cache_dtype`` is the cache's element type: ``auto`` is the compute dtype, except for
    a GGUF served with its weights quantized on CPU, where it is ``float16`` (llama.cpp's
    default cache type: half the bytes of float32; ``build_engine_config`` resolves it). A
    16-bit cache under float32 compute stores each K/V value rounded to nearest even and
    attention reads it back as float32; CPU only (``EngineConfig`` checks).
    """

    tokens_per_block: int = 32
    kv_cache_tokens: int | None = None
    kv_cache_fraction: float | None = None
    gpu_memory_fraction: float | None = None
    enable_prefix_caching: bool = True
    # Checksums of KV bytes from elsewhere: tier blocks here, pulled payloads in the connector.
    kv_integrity: bool = True
    kv_offload_host_gib: float | None = None
    kv_offload_disk_dir: str | None = None
    kv_offload_disk_gib: float | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.tokens_per_block > 0, "tokens_per_block", "must be > 0")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_tokens is not None:
            _require(self.kv_cache_tokens >= self.tokens_per_block, "kv_cache_tokens",
                     f"must hold at least one block ({self.tokens_per_block} tokens)")
        if self.kv_cache_fraction is not None:
            _require(0.0 < self.kv_cache_fraction <= 1.0, "kv_cache_fraction",
                     "must be in (0, 1]")
        if self.gpu_memory_fraction is not None:
            _require(isinstance(self.gpu_memory_fraction, (int, float))
                     and not isinstance(self.gpu_memory_fraction, bool)
                     and 0.0 < self.gpu_memory_fraction <= 1.0, "gpu_memory_fraction",
                     f"must be a number in (0, 1], got {self.gpu_memory_fraction!r}")
        for name in ("kv_offload_host_gib", "kv_offload_disk_gib"):
            value = getattr(self, name)
            if value is not None:
                _require(isinstance(value, (int, float)) and not isinstance(value, bool)
                         and 0.0 < value < float("inf"), name,
                         f"must be a positive number of GiB, got {value!r}")
        _require((self.kv_offload_disk_dir is None) == (self.kv_offload_disk_gib is None),
                 "kv_offload_disk_dir" if self.kv_offload_disk_dir is None
                 else "kv_offload_disk_gib",
                 "a disk tier needs both kv_offload_disk_dir and kv_offload_disk_gib")
        if self.kv_offload and not self.enable_prefix_caching:
            _require(False, "kv_offload_host_gib" if self.kv_offload_host_gib is not None
                     else "kv_offload_disk_dir",
                     "offload tiers keep prefix-cached blocks: they need "
                     "enable_prefix_caching")

    @property
    def kv_offload(self) -> bool:
        """Whether any offload tier is configured."""
        return self.kv_offload_host_gib is not None or self.kv_offload_disk_dir is not None


@dataclass(frozen=True)
class SchedulerConfig:
    """In-flight batching limits (TensorRT-LLM names and defaults)."""

    max_batch_size: int = 2048  # requests per iteration
    # tokens per iteration: context tokens + 1 per generation request (build_engine_config gives
    # a CPU worker DEFAULT_CPU_MAX_NUM_TOKENS when it is not set)
    max_num_tokens: int = 8192
    enable_chunked_context: bool = True
    capacity_policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    max_model_len: int | None = None  # prompt + output limit; None = model's max positions
    max_queue: int | None = None  # waiting requests beyond which new ones are refused
    # Launch the next plan of plain decodes before this step's outputs are built (the device
    # computes while the host detokenizes); None: on for a CUDA worker (LLMEngine.step).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _require(self.max_batch_size > 0, "max_batch_size", "must be > 0")
        _require(self.async_scheduling in (None, True, False), "async_scheduling",
                 "must be true or false")
        _require(self.max_num_tokens > 0, "max_num_tokens", "must be > 0")
        if not isinstance(self.capacity_policy, CapacityPolicy):
            try:
                object.__setattr__(self, "capacity_policy", CapacityPolicy(self.capacity_policy))
            except ValueError:
                raise ConfigError(
                    f"capacity_policy: {self.capacity_policy!r} is not one of "
                    f"{[p.value for p in CapacityPolicy]}") from None
        if self.max_model_len is not None:
            _require(self.max_model_len > 0, "max_model_len", "must be > 0")
        if self.max_queue is not None:
            _require(self.max_queue >= 0, "max_queue", "must be >= 0")


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks of one worker: ``tensor_parallel_size * pipeline_parallel_size`` processes.

    ``pp_partition`` (layers per stage, e.g. ``(3, 1)``) overrides the even layer split; the
    layout of every rank is ``disagg.layout.ParallelLayout.all_ranks``.
    ``enable_expert_parallel``: a MoE model's experts are partitioned over the TP ranks of a
    stage (whole experts, ``num_experts / tp`` each) instead of each expert's intermediate
    dim being split; attention stays tensor-parallel.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_partition: tuple[int, ...] | None = None
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        if self.pp_partition is not None:
            # Lists come from YAML / keyword arguments; keep the dataclass hashable.
            raw = self.pp_partition
            try:  # "3,1" (a flag) or [3, 1]
                part = tuple(int(n) for n in (raw.split(",") if isinstance(raw, str) else raw))
            except (TypeError, ValueError):
                raise ConfigError(f"pp_partition: expected a list of layer counts, got "
                                  f"{self.pp_partition!r}") from None
            object.__setattr__(self, "pp_partition", part)
            _require(len(part) == self.pipeline_parallel_size, "pp_partition",
                     f"{list(part)} has {len(part)} entries for pipeline_parallel_size="
                     f"{self.pipeline_parallel_size}")
            _require(all(n >= 1 for n in part), "pp_partition",
                     f"{list(part)}: every stage needs at least one layer")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# How a model splits over tp * pp ranks: the rules. ``disagg.layout`` builds each rank's
# layout from them; ``EngineConfig`` checks them up front (``check_parallel_split``).


def layer_ranges(num_layers: int, pp_size: int,
                 partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges of the ``pp_size`` stages.

    Without ``partition`` the split is even, the first ``num_layers % pp_size`` stages taking
    one layer more: 7 layers over 3 stages -> [0, 3) [3, 5) [5, 7). With it, stage ``s`` holds
    ``partition[s]`` layers: [3, 1] -> [0, 3) [3, 4).
    """
    if pp_size > num_layers:
        raise ConfigError(f"pipeline_parallel_size: {pp_size} stages for {num_layers} layers "
                          f"(each stage needs at least one layer)")
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (1 if s < extra else 0) for s in range(pp_size)]
    else:
        sizes = [int(n) for n in partition]
        if len(sizes) != pp_size:
            raise ConfigError(f"pp_partition: {list(sizes)} has {len(sizes)} entries for "
                              f"pipeline_parallel_size={pp_size}")
        if any(n < 1 for n in sizes) or sum(sizes) != num_layers:
            raise ConfigError(f"pp_partition: {list(sizes)} must be positive layer counts "
                              f"summing to num_hidden_layers={num_layers}")
    ranges, start = [], 0
    for n in sizes:  # stage s: [start, start + sizes[s])
        ranges.append((start, start + n))
        start += n
    return ranges


def kv_head_replicas(num_kv_heads: int, tp_size: int) -> int:
    """How many TP ranks hold each kv head: 1, or ``tp / num_kv_heads`` when TP exceeds them."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ConfigError(f"num_key_value_heads={num_kv_heads} is not divisible by "
                              f"tensor_parallel_size={tp_size}")
        return 1
    if tp_size % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size={tp_size} is not a multiple of "
                          f"num_key_value_heads={num_kv_heads} (needed to replicate kv heads)")
    return tp_size // num_kv_heads


def tp_heads_per_rank(num_heads: int, tp_size: int) -> int:
    """Query heads per TP rank: an even split, never replicated."""
    if num_heads % tp_size:
        raise ConfigError(f"num_attention_heads={num_heads} is not divisible by "
                          f"tensor_parallel_size={tp_size}")
    return num_heads // tp_size


def check_parallel_split(model: ModelConfig, parallel: ParallelConfig,
                         partition: Sequence[int] | None = None) -> None:
    """``ConfigError`` if ``model`` cannot be split over ``parallel``'s ranks (the first error
    ``ParallelLayout.all_ranks`` would meet). ``partition`` defaults to ``parallel.pp_partition``.
    """
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if partition is None:
        partition = parallel.pp_partition
    # The dense MLP's (a Mixtral, or a Qwen3-MoE sparse on every layer, has none).
    dense = model.moe is None or not all(model.is_moe_layer(i)
                                         for i in range(model.num_hidden_layers))
    if dense and model.intermediate_size % tp:
        raise ConfigError(f"intermediate_size={model.intermediate_size} is not divisible "
                          f"by tensor_parallel_size={tp}")
    moe = model.deepseek_moe
    if moe is not None and moe.moe_intermediate_size % tp:
        # Shared (and, without expert parallelism, routed) experts split their
        # intermediate dims like the dense MLP.
        raise ConfigError(f"moe_intermediate_size={moe.moe_intermediate_size} is not "
                          f"divisible by tensor_parallel_size={tp}")
    if moe is not None and parallel.enable_expert_parallel and moe.n_routed_experts % tp:
        raise ConfigError(f"n_routed_experts={moe.n_routed_experts} is not divisible by "
                          f"tensor_parallel_size={tp} (enable_expert_parallel partitions the "
                          f"experts over the ranks)")
    if parallel.enable_expert_parallel and model.moe is None and model.deepseek_moe is None:
        raise ConfigError(f"enable_expert_parallel: {model.architecture} has no experts")
    if model.moe is not None:
        if parallel.enable_expert_parallel:
            if model.moe.num_experts % tp:
                raise ConfigError(f"num_experts={model.moe.num_experts} is not divisible by "
                                  f"tensor_parallel_size={tp} (enable_expert_parallel "
                                  f"partitions the experts over the ranks)")
        elif model.moe.moe_intermediate_size % tp:
            raise ConfigError(f"moe_intermediate_size={model.moe.moe_intermediate_size} is "
                              f"not divisible by tensor_parallel_size={tp}")
    layer_ranges(model.num_hidden_layers, pp, partition)
    kv_head_replicas(model.num_key_value_heads, tp)
    tp_heads_per_rank(model.num_attention_heads, tp)


@dataclass(frozen=True)
class CudaGraphConfig:
    """Pure-decode steps captured as CUDA graphs, one per batch-size bucket (CUDA only; a CPU
    worker never captures). ``enforce_eager`` turns them off; batches above
    ``cuda_graph_max_batch_size`` (capped by ``max_batch_size``) run eagerly."""

    enforce_eager: bool = False
    cuda_graph_max_batch_size: int = 256

    def __post_init__(self) -> None:
        _require(isinstance(self.enforce_eager, bool), "enforce_eager", "must be true or false")
        _require(self.cuda_graph_max_batch_size >= 1, "cuda_graph_max_batch_size",
                 "must be >= 1")


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of one worker (``--speculative-config``, vLLM's JSON shape).

    ``method``: ``ngram`` (prompt lookup: the ``num_speculative_tokens`` tokens that followed
    the most recent earlier occurrence of the sequence's last n tokens, n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``) or ``draft_model`` (``model``: a
    smaller checkpoint with the same vocabulary, run greedily for ``num_speculative_tokens``
    steps on its own paged KV cache). The target checks every proposal in one forward
    (``disagg.spec_decode``).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    # No drafts in a step with at least this many decodes (vLLM's name): a large batch is
    # compute-bound, where checking drafts costs more than it saves. None: always.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        name = "speculative_config"
        d = self.disable_by_batch_size
        _require(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 1),
                 f"{name}.disable_by_batch_size", f"must be an integer >= 1, got {d!r}")
        _require(self.method in SPEC_METHODS, f"{name}.method",
                 f"one of {list(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        _require(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 32,
                 f"{name}.num_speculative_tokens", f"must be an integer in [1, 32], got {k!r}")
        if self.method == "ngram":
            _require(self.model is None, f"{name}.model", "is for method draft_model only")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for field_name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                _require(v is None or (isinstance(v, int) and not isinstance(v, bool)
                                       and v >= 1),
                         f"{name}.{field_name}", f"must be an integer >= 1, got {v!r}")
            # One given: the other equals it; none: n-grams of 1 to 4 tokens.
            lo, hi = (lo if lo is not None else (hi if hi is not None else 1),
                      hi if hi is not None else (lo if lo is not None else 4))
            _require(lo <= hi, f"{name}.prompt_lookup_min",
                     f"must be <= prompt_lookup_max ({lo} > {hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            _require(isinstance(self.model, str) and bool(self.model), f"{name}.model",
                     "method draft_model needs the draft checkpoint's folder (or .gguf file)")
            for field_name in ("prompt_lookup_min", "prompt_lookup_max"):
                _require(getattr(self, field_name) is None, f"{name}.{field_name}",
                         "is for method ngram only")

    @classmethod
    def parse(cls, value: SpeculativeConfig | str | dict[str, Any] | None
              ) -> SpeculativeConfig | None:
        """From a JSON text (the CLI flag), a mapping (YAML, ``LLM(...)``) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config: must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]}: unknown key (known: "
                              f"{', '.join(sorted(known))})")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ConfigError(f"speculative_config.{key}: required")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights."""

    model_dir: str
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    cuda_graph: CudaGraphConfig = CudaGraphConfig()
    dtype: str = "float32"  # compute dtype actually used
    device: str = "cpu"  # "cpu" or "cuda[:N]"; picked at run time by ``pick_device``
    seed: int = 0
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, "dtype", f"one of {sorted(DTYPES)}")
        # The CUDA kernels and graphs read a cache of the compute dtype.
        _require(self.kv_dtype == self.dtype or self.device.split(":")[0] == "cpu",
                 "kv_cache_dtype", f"{self.kv_dtype} differs from the compute dtype "
                 f"{self.dtype}: a cache of another dtype is CPU-only (on {self.device} use "
                 "auto)")
        # Fail on a model that cannot be split this way now, not in a spawned rank.
        check_parallel_split(self.model, self.parallel)
        if self.cache.kv_offload:
            name = ("kv_offload_host_gib" if self.cache.kv_offload_host_gib is not None
                    else "kv_offload_disk_dir")
            # A tier copies the target model's blocks (every rank its own slice): a draft
            # model's cache would be left behind.
            _require(self.speculative is None or self.speculative.method != "draft_model",
                     name, "offload tiers do not keep a draft model's KV: not with "
                     "speculative_config method draft_model")

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model.max_position_embeddings

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype: ``cache.kv_cache_dtype``, ``auto`` being ``dtype``."""
        kv = self.cache.kv_cache_dtype
        return self.dtype if kv == "auto" else kv


def pick_device(requested: str | None = None) -> str:
    """``requested`` if given, else ``cuda`` when available, else ``cpu``."""
    if requested:
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


ENGINE_OPTION_NAMES = (
    # (option name accepted by LLM(...) / serve / YAML) -> where it goes; see build_engine_config
    "tokens_per_block", "kv_cache_tokens", "kv_cache_fraction", "gpu_memory_fraction",
    "enable_prefix_caching", "kv_integrity", "kv_offload_host_gib", "kv_offload_disk_dir",
    "kv_offload_disk_gib",
    "enforce_eager", "cuda_graph_max_batch_size",
    "max_batch_size", "max_num_tokens", "enable_chunked_context", "capacity_policy",
    "max_model_len", "max_queue", "tensor_parallel_size", "pipeline_parallel_size",
    "pp_partition", "enable_expert_parallel", "dtype", "device", "seed", "speculative_config",
    "async_scheduling", "gguf_weights", "kv_cache_dtype",
)


def build_engine_config(model_dir: str, **options: Any) -> EngineConfig:
    """Build an EngineConfig from flat option names (the CLI / YAML / ``LLM(...)`` keywords)."""
    unknown = sorted(set(options) - set(ENGINE_OPTION_NAMES))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown engine option (known: "
                          f"{', '.join(ENGINE_OPTION_NAMES)})")
    # torch-free; a .gguf is imported once
    from disagg.model.gguf import is_quantized_import, resolve_model_dir

    gguf_weights = options.get("gguf_weights") or GGUF_WEIGHT_MODES[0]
    if gguf_weights not in GGUF_WEIGHT_MODES:
        raise ConfigError(f"gguf_weights: {gguf_weights!r} is not one of "
                          f"{list(GGUF_WEIGHT_MODES)}")
    try:
        model_dir = resolve_model_dir(model_dir, gguf_weights)
    except (ValueError, OSError) as e:  # unreadable or unsupported GGUF
        raise ConfigError(str(e)) from None
    model = ModelConfig.from_dir(model_dir)

    def pick(cls: type, **extra: Any) -> Any:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in options.items() if k in names and v is not None}
        kw.update(extra)
        return cls(**kw)

    dtype = options.get("dtype") or model.torch_dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    device = pick_device(options.get("device"))
    cache_defaults: dict[str, Any] = {}
    if (options.get("kv_cache_dtype") in (None, "auto") and device.split(":")[0] == "cpu"
            and dtype == "float32" and is_quantized_import(model_dir)):
        # A GGUF kept quantized: a float16 cache as llama.cpp keeps for the same file.
        cache_defaults["kv_cache_dtype"] = "float16"
    sched_defaults: dict[str, Any] = {}
    if (device.split(":")[0] == "cpu" and options.get("max_num_tokens") is None
            and options.get("enable_chunked_context") is not False):
        # Without chunking a smaller budget would refuse long prompts: only with it.
        sched_defaults["max_num_tokens"] = DEFAULT_CPU_MAX_NUM_TOKENS
    return EngineConfig(
        model_dir=model_dir,
        model=model,
        cache=pick(CacheConfig, **cache_defaults),
        scheduler=pick(SchedulerConfig, **sched_defaults),
        parallel=pick(ParallelConfig),
        cuda_graph=pick(CudaGraphConfig),
        dtype=dtype,
        device=device,
        seed=int(options.get("seed") or 0),
        speculative=SpeculativeConfig.parse(options.get("speculative_config")),
    )
