"""Load safetensors checkpoints into ``LlamaForCausalLM``; allocate the paged KV cache.

The model is built on the meta device (no random init, no memory), then each parameter this
rank holds is read from its checkpoint file, checked against the full (unsliced) shape, sliced
for tensor parallelism (``LlamaForCausalLM.tp_shard_dim``), cast and placed on the device.
Pipeline stages only list their own layers' parameters, so they read only those tensors.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
from safetensors import safe_open
from torch import nn

from disagg.config import ModelConfig
from disagg.model.deepseek import DeepseekV3ForCausalLM
from disagg.model.llama import LlamaForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint's contents do not match the model (missing tensor, wrong shape, bad index)."""


def as_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def checkpoint_weight_map(model_dir: str) -> dict[str, str]:
    """Tensor name -> file name (relative to ``model_dir``) for a single or sharded checkpoint."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: model folder not found")
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from None
        return {str(k): str(v) for k, v in weight_map.items()}
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="pt", device="cpu") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    raise FileNotFoundError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _source_name(param_name: str, config: ModelConfig, weight_map: dict[str, str]) -> str:
    """The checkpoint tensor holding ``param_name`` (tied lm_head reads the embedding)."""
    if (param_name == "lm_head.weight" and config.tie_word_embeddings
            and "lm_head.weight" not in weight_map):
        return "model.embed_tokens.weight"
    return param_name


def _read_tensor(handle: object, name: str, file_name: str, local_shape: tuple[int, ...],
                 shard: tuple[int, int, int, int] | None) -> torch.Tensor:
    """Read ``name``, checking its full shape; return this TP rank's slice of it.

    ``shard = (dim, lo, hi, full)``: the full tensor has ``full`` along ``dim`` and this rank
    takes ``[lo, hi)`` of it (``LlamaForCausalLM.tp_shard``); other dimensions are read whole.
    """
    full = list(local_shape)
    if shard is not None:
        full[shard[0]] = shard[3]
    sl = handle.get_slice(name)  # lazy: reads only the bytes sliced below
    have = tuple(sl.get_shape())
    if have != tuple(full):
        raise CheckpointError(f"{name}: expected shape {tuple(full)}, checkpoint has {have} "
                              f"in {file_name}")
    if shard is None:
        return sl[:]
    dim, lo, hi, _ = shard
    return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


def load_model(model_dir: str, config: ModelConfig | None = None,
               dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
               layer_range: tuple[int, int] | None = None, tp_rank: int = 0,
               tp_size: int = 1, expert_parallel: bool = False) -> LlamaForCausalLM:
    """Build the model (or one pipeline stage / TP rank of it) with weights from ``model_dir``.

    ``expert_parallel``: a MoE model's TP rank holds and reads only its own experts, whole
    (``tp_shard_dim``), instead of a slice of every expert.

    ``config`` defaults to ``ModelConfig.from_dir(model_dir)``. Raises ``FileNotFoundError``
    for a missing folder / file and ``CheckpointError`` for a missing tensor or wrong shape,
    each naming the thing.
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: model folder not found")
    if config is None:
        config = ModelConfig.from_dir(model_dir)
    dtype = as_torch_dtype(dtype)
    device = torch.device(device)
    weight_map = checkpoint_weight_map(model_dir)

    # MLA (DeepSeek-V3) has its own decoder with the same interface.
    model_cls = DeepseekV3ForCausalLM if config.cache_kind == "mla" else LlamaForCausalLM
    with torch.device("meta"):
        model = model_cls(config, layer_range=layer_range, tp_rank=tp_rank, tp_size=tp_size,
                          expert_parallel=expert_parallel)

    # Group the parameters this rank holds by checkpoint file, so each file opens once.
    by_file: dict[str, list[tuple[str, str]]] = defaultdict(list)
    params = dict(model.named_parameters())  # tied lm_head shares embed's entry
    for pname in params:
        src = _source_name(pname, config, weight_map)
        if src not in weight_map:
            raise CheckpointError(f"{src}: tensor not found in the checkpoint in {model_dir} "
                                  f"(needed for parameter {pname})")
        by_file[weight_map[src]].append((pname, src))

    for file_name, entries in by_file.items():
        path = os.path.join(model_dir, file_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: checkpoint file not found (listed in "
                                    f"{INDEX_FILE})")
        with safe_open(path, framework="pt", device="cpu") as f:
            for pname, src in entries:
                param = params[pname]
                dim = model.tp_shard_dim(pname)
                shard = None if dim is None else model.tp_shard(pname, param.shape[dim])
                tensor = _read_tensor(f, src, file_name, tuple(param.shape), shard)
                # Parameters a model keeps in float32 whatever the dtype (DeepSeek's routing
                # bias, as transformers keeps it).
                keep = pname.endswith(getattr(model, "float32_parameters", ()))
                _set_parameter(model, pname, tensor.to(
                    device=device, dtype=torch.float32 if keep else dtype))
    model.tie_weights()
    model.fuse_projections()
    model.eval()
    return model


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int,
                   num_layers: int | None = None,
                   num_kv_heads: int | None = None) -> tuple[int, ...]:
    """``[num_blocks, num_local_layers, kv_parts, num_local_kv_heads, block_size, width]``:
    kv_parts 2 (K, V) and width head_dim for MHA/GQA; 1 (the latent), one head and width
    kv_lora_rank + qk_rope_head_dim for MLA (``ModelConfig.kv_parts`` / ``kv_cache_width``).
    """
    return (num_blocks, num_layers or config.num_hidden_layers, config.kv_parts,
            num_kv_heads or config.num_key_value_heads, block_size, config.kv_cache_width)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype | str,
                             num_layers: int | None = None,
                             num_kv_heads: int | None = None) -> int:
    """Bytes of one block (all local layers, every kv part, all local kv heads)."""
    _, layers, parts, heads, b, d = kv_cache_shape(config, 1, block_size, num_layers,
                                                   num_kv_heads)
    return layers * parts * heads * b * d * as_torch_dtype(dtype).itemsize


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype | str, device: torch.device | str,
                      num_layers: int | None = None,
                      num_kv_heads: int | None = None) -> torch.Tensor:
    """The zeroed KV cache of one rank (DESIGN.md section 1).

    ``num_layers`` / ``num_kv_heads`` default to the whole model (a PP stage passes its layer
    count, a TP rank its local kv heads).
    """
    return torch.zeros(kv_cache_shape(config, num_blocks, block_size, num_layers, num_kv_heads),
                       dtype=as_torch_dtype(dtype), device=device)
