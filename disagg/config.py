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
}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family checkpoint, read from its ``config.json``."""

    architecture: str  # "llama" | "mistral" | "qwen2"
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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

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
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                torch_dtype=dtype,
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


DTYPES = {"float32", "bfloat16", "float16"}

# With no sizing option set: a CUDA worker may use this share of the GPU's total memory
# (vLLM's gpu_memory_utilization default); a CPU worker gives the KV cache this share of free
# RAM (the same memory also holds the process, the OS and often other workers). The runner
# applies them; `disagg serve --help` shows the first.
DEFAULT_GPU_MEMORY_FRACTION = 0.9
DEFAULT_CPU_KV_FRACTION = 0.1


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    ``kv_cache_tokens`` (an explicit token capacity), ``kv_cache_fraction`` (share of the device
    memory free after loading the weights and, on CUDA, after the activations a profiling
    forward at ``max_num_tokens`` peaked at) and ``gpu_memory_fraction`` (CUDA only: share of
    the GPU's *total* memory this worker may use for weights + activations + KV cache, so
    workers sharing one GPU split it, like vLLM's ``gpu_memory_utilization``) each bound the
    number of blocks; the smallest capacity wins, as in TensorRT-LLM. With none of them set a
    CUDA worker uses ``gpu_memory_fraction=0.9``, a CPU worker 0.1 of free RAM.
    """

    tokens_per_block: int = 32
    kv_cache_tokens: int | None = None
    kv_cache_fraction: float | None = None
    gpu_memory_fraction: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.tokens_per_block > 0, "tokens_per_block", "must be > 0")
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


@dataclass(frozen=True)
class SchedulerConfig:
    """In-flight batching limits (TensorRT-LLM names and defaults)."""

    max_batch_size: int = 2048  # requests per iteration
    max_num_tokens: int = 8192  # tokens per iteration: context tokens + 1 per generation request
    enable_chunked_context: bool = True
    capacity_policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    max_model_len: int | None = None  # prompt + output limit; None = model's max positions
    max_queue: int | None = None  # waiting requests beyond which new ones are refused

    def __post_init__(self) -> None:
        _require(self.max_batch_size > 0, "max_batch_size", "must be > 0")
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
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_partition: tuple[int, ...] | None = None

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
    if model.intermediate_size % tp:
        raise ConfigError(f"intermediate_size={model.intermediate_size} is not divisible "
                          f"by tensor_parallel_size={tp}")
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

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, "dtype", f"one of {sorted(DTYPES)}")
        # Fail on a model that cannot be split this way now, not in a spawned rank.
        check_parallel_split(self.model, self.parallel)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model.max_position_embeddings


def pick_device(requested: str | None = None) -> str:
    """``requested`` if given, else ``cuda`` when available, else ``cpu``."""
    if requested:
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


ENGINE_OPTION_NAMES = (
    # (option name accepted by LLM(...) / serve / YAML) -> where it goes; see build_engine_config
    "tokens_per_block", "kv_cache_tokens", "kv_cache_fraction", "gpu_memory_fraction",
    "enable_prefix_caching", "enforce_eager", "cuda_graph_max_batch_size",
    "max_batch_size", "max_num_tokens", "enable_chunked_context", "capacity_policy",
    "max_model_len", "max_queue", "tensor_parallel_size", "pipeline_parallel_size",
    "pp_partition", "dtype", "device", "seed",
)


def build_engine_config(model_dir: str, **options: Any) -> EngineConfig:
    """Build an EngineConfig from flat option names (the CLI / YAML / ``LLM(...)`` keywords)."""
    unknown = sorted(set(options) - set(ENGINE_OPTION_NAMES))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown engine option (known: "
                          f"{', '.join(ENGINE_OPTION_NAMES)})")
    from disagg.model.gguf import resolve_model_dir  # torch-free; a .gguf is imported once

    try:
        model_dir = resolve_model_dir(model_dir)
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
    return EngineConfig(
        model_dir=model_dir,
        model=model,
        cache=pick(CacheConfig),
        scheduler=pick(SchedulerConfig),
        parallel=pick(ParallelConfig),
        cuda_graph=pick(CudaGraphConfig),
        dtype=dtype,
        device=pick_device(options.get("device")),
        seed=int(options.get("seed") or 0),
    )
