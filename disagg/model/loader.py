"""Load safetensors checkpoints into ``LlamaForCausalLM``; allocate the paged KV cache.

The model is built on the meta device (no random init, no memory), then each parameter this
rank holds is read from its checkpoint file, checked against the full (unsliced) shape, sliced
for tensor parallelism (``LlamaForCausalLM.tp_shard_dim``), cast and placed on the device.
Pipeline stages only list their own layers' parameters, so they read only those tensors.

Tensors are read with plain file reads into memory the process owns (``CheckpointFile``), not
mapped: a tensor of a mapped safetensors file keeps the whole file's mapping alive, so the
pages of weights copied afterwards (the fused q/k/v and gate/up matrices, casts, device
copies) stayed counted in the process's RSS beside their copies: the weights held twice.
"""

from __future__ import annotations

import json
import os
import struct
from collections import defaultdict

import torch

from disagg.config import ModelConfig
from disagg.model.deepseek import DeepseekV3ForCausalLM
from disagg.model.gguf import GGUF_SOURCE_FILE
from disagg.model.gguf_weights import load_gguf_model, set_parameter
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
        with CheckpointFile(single) as f:
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


# safetensors dtype names -> torch dtypes (the format's little-endian layout is the host's
# on every platform torch's CPU tensors run on here).
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointFile:
    """One safetensors file, its tensors read with ``os.preadv`` into tensors this process
    owns (the page cache is the kernel's, not the process's RSS). ``get_slice(name)`` has the
    part of ``safe_open``'s interface the loader uses: ``get_shape()`` and ``[:]``,
    ``[lo:hi]`` (rows: only their bytes are read), ``[:, lo:hi]`` (columns: the tensor is read
    whole, the slice copied out)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            if len(head) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: header length {n} beyond the file's end")
            try:
                header = json.loads(os.pread(self._fd, n, 8))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: not a safetensors header ({e})") from None
        except BaseException:
            os.close(self._fd)
            raise
        self._base = 8 + n
        self._size = size
        self._entries: dict[str, dict] = {k: v for k, v in header.items()
                                          if k != "__metadata__"}

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_slice(self, name: str) -> _TensorSlice:
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"{name}: tensor not found in {self.path}")
        dtype = _ST_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{name}: dtype {entry.get('dtype')!r} in {self.path} is not "
                                  f"supported (supported: {sorted(_ST_DTYPES)})")
        shape = tuple(int(d) for d in entry["shape"])
        lo, hi = (int(x) for x in entry["data_offsets"])
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if hi - lo != nbytes or self._base + hi > self._size:
            raise CheckpointError(f"{name}: data offsets {[lo, hi]} do not fit shape {shape} "
                                  f"of {entry['dtype']} in {self.path}")
        return _TensorSlice(self, name, dtype, shape, self._base + lo)

    def read(self, offset: int, nbytes: int, dtype: torch.dtype,
             shape: tuple[int, ...]) -> torch.Tensor:
        """``nbytes`` at ``offset`` as a new ``dtype`` tensor of ``shape``."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: file ends before byte {offset + nbytes}")
            done += got
        return buf.view(dtype).view(shape)


class _TensorSlice:
    """A tensor of a ``CheckpointFile``, not read yet."""

    def __init__(self, file: CheckpointFile, name: str, dtype: torch.dtype,
                 shape: tuple[int, ...], offset: int) -> None:
        self.file, self.name, self.dtype, self.shape, self.offset = (
            file, name, dtype, shape, offset)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key: slice | tuple[slice, ...]) -> torch.Tensor:
        rows, cols = (key, slice(None)) if isinstance(key, slice) else key
        if rows.step not in (None, 1) or cols.step not in (None, 1) or not self.shape:
            raise CheckpointError(f"{self.name}: unsupported slice {key!r}")
        lo, hi, _ = rows.indices(self.shape[0])
        hi = max(lo, hi)
        row_bytes = self.dtype.itemsize
        for d in self.shape[1:]:
            row_bytes *= d
        t = self.file.read(self.offset + lo * row_bytes, (hi - lo) * row_bytes, self.dtype,
                           (hi - lo, *self.shape[1:]))
        if cols == slice(None):
            return t
        return t[:, cols].contiguous()  # the whole rows go when this returns


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
    if os.path.isfile(os.path.join(model_dir, GGUF_SOURCE_FILE)):
        # A .gguf served with gguf_weights "quantized": the weights come from the file.
        return load_gguf_model(model_dir, config, dtype, device, layer_range, tp_rank, tp_size)
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
        with CheckpointFile(path) as f:
            for pname, src in entries:
                param = params[pname]
                dim = model.tp_shard_dim(pname)
                shard = None if dim is None else model.tp_shard(pname, param.shape[dim])
                tensor = _read_tensor(f, src, file_name, tuple(param.shape), shard)
                # Parameters a model keeps in float32 whatever the dtype (DeepSeek's routing
                # bias, as transformers keeps it).
                keep = pname.endswith(getattr(model, "float32_parameters", ()))
                set_parameter(model, pname, tensor.to(
                    device=device, dtype=torch.float32 if keep else dtype))
    model.tie_weights()
    model.fuse_projections()
    model.eval()
    return model


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
