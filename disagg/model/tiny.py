"""Tiny random Llama-family checkpoints, built locally (no model hub needed).

``write_tiny_checkpoint(dir)`` writes a complete Hugging Face folder: ``config.json``,
``generation_config.json``, ``model.safetensors`` (random weights from a seeded generator),
``tokenizer.json`` (a byte-level BPE trained here on the prose below) and
``tokenizer_config.json`` (special tokens and a Llama-3-style chat template). Both
``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load it, so it serves as the
reference model in parity tests and as the demo model (``ensure_tiny_model``).

Same arguments, same bytes: the BPE trainer and the weight generator are deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

from disagg.env import cache_root
from disagg.model.tiny_deepseek import deepseek_keys, deepseek_layer_weights

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Families with routed experts (write_tiny_checkpoint's num_experts ... apply to them only).
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
    "<|pad|>",
)
# Smallest vocabulary: every byte must be a token so that any text encodes.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Bump when the files written change, so cached demo models are rebuilt.
TINY_FORMAT_VERSION = 1
# lm_head std = gain / sqrt(hidden): logits of std ~gain (peaky, wide top-2 gaps).
_LM_HEAD_GAIN = 8.0
# With tied embeddings, layer outputs are scaled up by this much (see _weights).
_TIED_BRANCH_GAIN = 32.0

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'You may call these tools:\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- tool | tojson }}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('unknown role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{%- if message['content'] is string %}\n"
    "{%- set content = message['content'] %}\n"
    "{%- elif message['content'] is none or message['content'] is undefined %}\n"
    "{%- set content = '' %}\n"
    "{%- else %}\n"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content | trim }}\n"
    "{%- if message['tool_calls'] is defined %}\n"
    "{%- for call in message['tool_calls'] %}\n"
    "{{- '\\n' + call | tojson }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Training text for the BPE: plain prose written for this module (no external data).
_CORPUS = """\
The harbour was quiet in the early morning, and the fishing boats rocked gently against the
stone wall. A few gulls circled above the water, waiting for the first crates of the day to
be opened. On the hill behind the town, the bakery had already lit its ovens, and the smell
of warm bread drifted down the narrow streets toward the sea.

Maria walked to the end of the pier with a cup of coffee in her hand. She had lived in the
town for almost twenty years, and she still liked to watch the light change over the bay.
First the sky turned grey, then pale yellow, and finally a clear, bright blue. When the sun
rose above the cliffs, the whole harbour seemed to wake up at once.

Computers follow instructions one step at a time. A program is a list of those steps,
written in a language that both people and machines can read. When a program runs, the
processor fetches an instruction, decodes it, and executes it, and then it moves on to the
next one. Modern processors do many of these things in parallel, but the idea is the same.

Memory is organised in small blocks. Each block has an address, and the program uses that
address to find the data it needs. When there is not enough memory for every request, the
system must decide which blocks to keep and which ones to give back. Good decisions make
the whole machine faster; bad decisions make it wait.

A language model reads a sequence of tokens and predicts the next one. It turns each token
into a vector, mixes the vectors together with attention, and produces a score for every
word in its vocabulary. The highest score is not always the best choice, so the model may
sample from the scores instead, which makes its answers more varied and often more natural.

In the garden, the tomatoes were finally ripe. The children picked them one by one and
placed them carefully in a wooden basket. Their grandmother told them to leave the green
ones on the vine for another week. Later that evening, the family sat outside and ate a
simple meal of bread, cheese, tomatoes and olive oil, while the sky slowly grew dark.

The train left the station at seven minutes past nine. It crossed the river, passed through
three small villages and climbed into the mountains. Most of the passengers were reading or
sleeping, but a young man by the window kept looking out at the snow on the peaks. He had
never seen mountains before, and he did not want to miss a single moment of the journey.

Questions are useful because they show us what we do not know. Why does the river flow
toward the sea? How do birds find their way home? What happens when two stars collide? Each
answer leads to new questions, and that is how knowledge grows: slowly, patiently, and with
a great deal of curiosity.

Numbers appear everywhere in daily life: 1, 2, 3, 10, 42, 100, 2024 and 3.14 are only a few
of them. We count coins, measure distances in kilometres and miles, and check the time on a
clock that shows hours, minutes and seconds. Even a recipe is full of numbers, such as two
cups of flour, one spoon of salt, and thirty minutes in a hot oven.

The library was the oldest building in the city. Its shelves held thousands of books about
history, science, music and art. Students came there to study, and old men came there to
read the newspaper in peace. The librarian knew where every book belonged, and she could
find a forgotten title in a few seconds, as if the building itself whispered it to her.

Good software is easy to change. It has small parts with clear names, and each part does
one thing well. Tests check that the parts still work after a change, and documentation
explains why they were built that way. When something breaks, a clear error message that
names the problem saves hours of searching.

The storm arrived late in the afternoon. Dark clouds rolled in from the west, the wind bent
the trees, and heavy rain hammered on the roofs. People hurried home with their coats over
their heads. By midnight the storm had passed, the streets were shining with water, and the
air smelled fresh and clean.
"""


def _corpus_lines() -> list[str]:
    # Paragraphs as training units; plus simple chat-like lines so that the role names and
    # common punctuation get merges of their own.
    paragraphs = [" ".join(p.split()) for p in _CORPUS.split("\n\n") if p.strip()]
    chat = [f"{role}\n\n{p.split('.')[0]}." for role in ("system", "user", "assistant")
            for p in paragraphs]
    return paragraphs + chat


def build_tokenizer(vocab_size: int = 512) -> Any:
    """Train the byte-level BPE (a ``tokenizers.Tokenizer``) with ``vocab_size`` tokens at most.

    Ids ``[0, 256)`` are the byte alphabet, then the merges, then the special tokens (last, as
    in Llama 3). If the corpus runs out of merges the tokenizer is smaller than asked.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size: must be >= {MIN_VOCAB_SIZE} (256 bytes + "
                         f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _tokenizer_config(tok: Any, vocab_size: int, max_len: int) -> dict[str, Any]:
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                   "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,  # instruct-style: a chat turn ends with <|eot_id|>
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character map, inverted (character -> byte value)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _unreadable_ids(tok: Any) -> list[int]:
    """Ids that the random model should not emit: special tokens and single-byte tokens that
    are not printable ASCII (control bytes and pieces of multi-byte UTF-8 characters)."""
    alphabet = _byte_level_alphabet()
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    for token, i in tok.get_vocab(with_added_tokens=False).items():
        if len(token) == 1 and not (0x20 <= alphabet[token] < 0x7F or alphabet[token] == 0x0A):
            ids.append(i)
    return sorted(ids)


def _weights(cfg: dict[str, Any], arch: str, seed: int, suppressed_ids: list[int],
             num_real_tokens: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads, head_dim = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                 cfg["head_dim"])
    vocab = cfg["vocab_size"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    # Scales: unit-variance embeddings and 1/sqrt(fan_in) projections keep every layer's
    # contribution comparable to the residual stream (so attention matters and greedy output
    # wanders instead of looping on one token); the larger lm_head scale gives peaky
    # distributions whose top-2 logit gap is rarely tiny (stable greedy parity tests).
    # With tied embeddings the logits are E @ norm(h): if the current token's own embedding
    # dominated h it would always win (the model would repeat one token), so the layers'
    # outputs (o_proj, down_proj) grow until h is mostly context.
    proj = hidden ** -0.5
    branch = _TIED_BRANCH_GAIN if cfg["tie_word_embeddings"] else 1.0
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        if arch == "deepseek_v3":  # MLA + grouped experts: tiny_deepseek
            w.update(deepseek_layer_weights(cfg, i, normal, torch.ones, branch))
            continue
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden, std=proj)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, std=proj)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, std=proj)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim,
                                                  std=branch * (heads * head_dim) ** -0.5)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(heads * head_dim, std=0.1)
            w[p + "self_attn.k_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
            w[p + "self_attn.v_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
        if arch in ("qwen3", "qwen3_moe"):  # per-head q/k norms; not all ones, so a lost
            # weight shows
            w[p + "self_attn.q_norm.weight"] = 1.0 + normal(head_dim, std=0.1)
            w[p + "self_attn.k_norm.weight"] = 1.0 + normal(head_dim, std=0.1)
        if _is_moe_layer(cfg, i):
            w.update(_expert_weights(cfg, p, normal, branch))
        else:
            w[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=proj)
            w[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=proj)
            w[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=branch * inter ** -0.5)
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    w["model.norm.weight"] = torch.ones(hidden)
    if not cfg["tie_word_embeddings"]:
        head = normal(vocab, hidden, std=_LM_HEAD_GAIN * proj)
        # Special tokens, unreadable bytes and vocabulary padding get zero rows: logit 0 is far
        # below the top logit (std ~_LM_HEAD_GAIN), so the random model (almost) never emits
        # EOS, control bytes, broken UTF-8 or ids the tokenizer lacks: demo text is readable.
        head[suppressed_ids] = 0.0
        head[num_real_tokens:] = 0.0
        w["lm_head.weight"] = head
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[cfg["torch_dtype"]]
    return {k: v.to(dtype).contiguous() for k, v in w.items()}


def _is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    """transformers' rule: routed experts on layers ``(i + 1) % decoder_sparse_step == 0``
    outside ``mlp_only_layers`` (every layer of a Mixtral)."""
    if cfg["model_type"] not in MOE_ARCHITECTURES:
        return False
    return (layer not in cfg.get("mlp_only_layers", [])
            and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def _expert_weights(cfg: dict[str, Any], p: str, normal: Any, branch: float
                    ) -> dict[str, Any]:
    """A MoE layer's router and experts under the checkpoint names of its family (Mixtral:
    ``block_sparse_moe.experts.E.w1/w3/w2``, Qwen3-MoE: ``mlp.experts.E.gate/up/down_proj``),
    scaled like the dense MLP (router logits of std ~1: varied, rarely tied top-k choices)."""
    hidden = cfg["hidden_size"]
    if cfg["model_type"] == "mixtral":
        experts, inter = cfg["num_local_experts"], cfg["intermediate_size"]
        prefix, names = "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        experts, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
        prefix, names = "mlp.", ("gate_proj", "up_proj", "down_proj")
    w = {f"{p}{prefix}gate.weight": normal(experts, hidden, std=hidden ** -0.5)}
    for e in range(experts):
        q = f"{p}{prefix}experts.{e}."
        w[q + names[0] + ".weight"] = normal(inter, hidden, std=hidden ** -0.5)
        w[q + names[1] + ".weight"] = normal(inter, hidden, std=hidden ** -0.5)
        w[q + names[2] + ".weight"] = normal(hidden, inter, std=branch * inter ** -0.5)
    return w


def _moe_keys(arch: str, num_experts: int, num_experts_per_tok: int,
              moe_intermediate_size: int | None, mlp_only_layers: tuple[int, ...],
              num_layers: int) -> dict[str, Any]:
    """The MoE keys of ``config.json`` (as the hub checkpoints spell them); {} if dense."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    if num_experts < 1:
        raise ValueError(f"num_experts: must be > 0, got {num_experts}")
    if not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok: must be in [1, num_experts={num_experts}], "
                         f"got {num_experts_per_tok}")
    if arch == "mixtral":
        if mlp_only_layers:
            raise ValueError("mlp_only_layers: Mixtral has experts on every layer")
        return {"num_local_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
                "router_jitter_noise": 0.0, "output_router_logits": False}
    bad = [i for i in mlp_only_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"mlp_only_layers: {bad} not in [0, {num_layers})")
    if moe_intermediate_size is not None and moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size: must be > 0, got {moe_intermediate_size}")
    return {"num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": moe_intermediate_size or 32, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": list(mlp_only_layers),
            "output_router_logits": False}


def _check_shape(arch: str, dtype: str, sizes: dict[str, int],
                 head_dim: int | None = None) -> int:
    """Raise ValueError for arguments no checkpoint can have; returns ``head_dim`` (default
    hidden / heads; qwen3 twice that, as Qwen3-0.6B's 128 with 1024 hidden over 16 heads, so
    a test covers a head size independent of the hidden size)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch: {arch!r} is not one of {sorted(ARCHITECTURES)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: {dtype!r} is not one of float32, bfloat16, float16")
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name}: must be > 0, got {value}")
    hidden, heads, kv_heads = (sizes["hidden_size"], sizes["num_attention_heads"],
                               sizes["num_key_value_heads"])
    if hidden % heads:
        raise ValueError(f"num_attention_heads: {heads} must divide hidden_size {hidden}")
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads: {kv_heads} must divide "
                         f"num_attention_heads {heads}")
    if head_dim is not None:
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim: must be even and > 0 (RoPE pairs), got {head_dim}")
        return head_dim
    head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError(f"hidden_size / num_attention_heads = {head_dim} must be even (RoPE)")
    return 2 * head_dim if arch == "qwen3" else head_dim


def _model_config(arch: str, tok: Any, vocab_size: int, sizes: dict[str, int], head_dim: int,
                  tie_word_embeddings: bool, rope_scaling: dict[str, Any] | None,
                  rope_theta: float, dtype: str) -> dict[str, Any]:
    """``config.json``: the Hugging Face config of ``arch`` with the tokenizer's special ids."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        **{k: sizes[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads")},
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": sizes["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": tok.token_to_id(BOS_TOKEN),
        "eos_token_id": [tok.token_to_id(EOS_TOKEN), tok.token_to_id(EOT_TOKEN)],
        "pad_token_id": tok.token_to_id("<|pad|>"),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch in ("mistral", "mixtral"):
        cfg["sliding_window"] = None  # full attention, like the engine
    else:  # qwen2: q/k/v carry a bias; qwen3: no bias, q/k norms; no sliding window
        cfg.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=sizes["num_hidden_layers"])
        if arch in ("qwen3", "qwen3_moe"):
            cfg["attention_bias"] = False
    return cfg


def _save(out_dir: str, cfg: dict[str, Any], tok: Any, weights: dict[str, Any]) -> None:
    """The checkpoint's files into ``out_dir`` (created; files overwritten)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)

    def dump(name: str, obj: Any) -> None:
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")

    dump("config.json", cfg)
    dump("generation_config.json", {"bos_token_id": cfg["bos_token_id"],
                                    "eos_token_id": cfg["eos_token_id"],
                                    "pad_token_id": cfg["pad_token_id"]})
    dump("tokenizer_config.json",
         _tokenizer_config(tok, cfg["vocab_size"], cfg["max_position_embeddings"]))
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def write_tiny_checkpoint(
    out_dir: str,
    arch: str = "llama",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    seed: int = 0,
    dtype: str = "float32",
    head_dim: int | None = None,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    mlp_only_layers: tuple[int, ...] = (),
) -> str:
    """Write a tiny random checkpoint of ``arch`` into ``out_dir`` (created; files overwritten).

    Returns ``out_dir``. The tokenizer has at most ``vocab_size`` tokens (the model's
    vocabulary is exactly ``vocab_size``; extra rows are padding). MoE families
    (``MOE_ARCHITECTURES``) get ``num_experts`` experts, ``num_experts_per_tok`` per token;
    Mixtral's are ``intermediate_size`` wide, Qwen3-MoE's ``moe_intermediate_size`` (default
    32; renormalised top-k) with a dense MLP on ``mlp_only_layers``.
    ``deepseek_v3``: MLA and grouped routed experts (``num_experts``, ``num_experts_per_tok``,
    ``moe_intermediate_size``) plus a shared one, the first layer dense; its latent sizes are
    ``tiny_deepseek.TINY_MLA`` (``num_key_value_heads`` does not apply).
    """
    sizes = {"hidden_size": hidden_size, "intermediate_size": intermediate_size,
             "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
             "num_key_value_heads": num_key_value_heads,
             "max_position_embeddings": max_position_embeddings}
    head_dim = _check_shape(arch, dtype, sizes, head_dim)
    tok = build_tokenizer(vocab_size)
    cfg = _model_config(arch, tok, vocab_size, sizes, head_dim, tie_word_embeddings,
                        rope_scaling, rope_theta, dtype)
    cfg.update(_moe_keys(arch, num_experts, num_experts_per_tok, moe_intermediate_size,
                         tuple(mlp_only_layers), num_hidden_layers))
    if arch == "deepseek_v3":
        cfg.update(deepseek_keys(cfg, num_experts, num_experts_per_tok, moe_intermediate_size))
    weights = _weights(cfg, arch, seed, _unreadable_ids(tok),
                       tok.get_vocab_size(with_added_tokens=True))
    _save(out_dir, cfg, tok, weights)
    return out_dir


# -- demo model cache ------------------------------------------------------------------------

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_tiny_model_dir(arch: str = "llama") -> str:
    """Where the built-in tiny model of ``arch`` lives: ``$DISAGG_CACHE/tiny-ARCH-vN`` (default
    ``~/.cache/disagg``; the demo's is ``tiny-llama-vN``)."""
    return os.path.join(cache_root(), f"tiny-{arch}-v{TINY_FORMAT_VERSION}")


def _is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in _REQUIRED_FILES)


def ensure_tiny_model(path: str | None = None, arch: str = "llama") -> str:
    """Return ``path`` (default: ``default_tiny_model_dir(arch)``), writing the default tiny
    ``arch`` checkpoint there first if it is not there yet.

    Atomic: the checkpoint is written to a temporary folder beside ``path`` and renamed into
    place, so concurrent callers and interrupted runs never see half a checkpoint.
    """
    path = os.path.abspath(path or default_tiny_model_dir(arch))
    if _is_complete(path):
        return path
    if os.path.isdir(path) and os.listdir(path):
        raise FileExistsError(f"{path}: exists but is not a complete checkpoint (missing one of "
                              f"{', '.join(_REQUIRED_FILES)}); remove it to rebuild")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
        write_tiny_checkpoint(tmp, arch)
        try:
            os.rename(tmp, path)  # replaces an empty folder; fails if another writer won
        except OSError:
            if not _is_complete(path):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# -- CLI ---------------------------------------------------------------------------------------


def _cmd_tiny(args: argparse.Namespace) -> int:
    out = args.dir
    if os.path.exists(out) and not os.path.isdir(out):
        print(f"error: {out}: exists and is not a folder")
        return 1
    if os.path.isdir(out) and os.listdir(out) and not args.force:
        print(f"error: {out}: folder is not empty (use --force to overwrite)")
        return 1
    try:
        write_tiny_checkpoint(
            out, args.arch, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.max_position_embeddings,
            tie_word_embeddings=args.tie_word_embeddings, seed=args.seed, dtype=args.dtype,
            head_dim=args.head_dim, num_experts=args.num_experts,
            num_experts_per_tok=args.experts_per_token,
            moe_intermediate_size=args.moe_intermediate_size)
    except ValueError as e:
        print(f"error: {e}")
        return 1
    print(f"wrote tiny {args.arch} checkpoint to {os.path.abspath(out)}")
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``disagg model tiny DIR`` (and ``model import`` / ``model fetch``)."""
    model = subparsers.add_parser("model", help="model utilities",
                                  description="Model utilities.")
    sub = model.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    model.set_defaults(func=lambda args: (model.print_help(), 2)[1])
    p = sub.add_parser("tiny", help="write a tiny random checkpoint (HF format)",
                       description="Write a tiny random Llama-family checkpoint with a locally "
                                   "trained byte-level BPE tokenizer.")
    p.add_argument("dir", help="output folder")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2, help="number of decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="size of a head (default hidden / heads; qwen3: twice that)")
    p.add_argument("--num-experts", type=int, default=8,
                   help="experts per MoE layer (mixtral, qwen3_moe)")
    p.add_argument("--experts-per-token", type=int, default=2,
                   help="experts each token is routed to (MoE)")
    p.add_argument("--moe-intermediate-size", type=int, default=None,
                   help="qwen3_moe: an expert's intermediate size (default 32); Mixtral's "
                        "experts use --intermediate-size")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite a non-empty folder")
    p.set_defaults(func=_cmd_tiny)

    from disagg.model.gguf import add_model_cli  # model import FILE.gguf DIR, model fetch

    add_model_cli(sub)
