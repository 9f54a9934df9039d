"""Model, paged attention and loader against Hugging Face transformers (CPU, float32, tiny)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from disagg.config import ConfigError, ModelConfig  # noqa: E402
from disagg.model.attention import AttentionMetadata  # noqa: E402
from disagg.model.llama import FusedRows, LlamaForCausalLM, rope_inv_freq  # noqa: E402
from disagg.model.loader import (  # noqa: E402
    CheckpointError,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    load_model,
)

ATOL = 1e-4
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

# name -> (transformers config class, extra config kwargs, save_pretrained kwargs)
VARIANTS: dict[str, tuple[str, dict, dict]] = {
    "llama": ("LlamaConfig", {"num_hidden_layers": 3}, {"max_shard_size": "40KB"}),  # sharded
    "llama_mqa": ("LlamaConfig", {"num_key_value_heads": 1}, {}),
    "llama3_rope": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, "rope_theta": 500000.0}, {}),
    "llama_tied_bias": ("LlamaConfig", {"tie_word_embeddings": True, "attention_bias": True},
                        {}),
    "mistral": ("MistralConfig", {"sliding_window": None}, {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}, {}),
    # per-head q/k RMSNorm; head_dim 32 != hidden / heads = 16 (q is 128 wide, o_proj 128->64)
    "qwen3": ("Qwen3Config", {"head_dim": 32}, {}),
}


def _make_checkpoint(out_dir: str, variant: str) -> str:
    cls_name, extra, save_kw = VARIANTS[variant]
    cfg = getattr(transformers, cls_name)(**{**SIZES, **extra})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    # The default init (std 0.02) makes near-constant logits; use weights large enough that
    # every part of the computation shows in the output.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(out_dir, safe_serialization=True, **save_kw)
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {v: _make_checkpoint(str(root / v), v) for v in VARIANTS}


@pytest.fixture(scope="module")
def hf_models(checkpoints: dict[str, str]) -> dict[str, torch.nn.Module]:
    return {v: transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
        for v, d in checkpoints.items()}


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


@dataclass
class Seq:
    block_table: list[int]
    start_pos: int   # tokens already in the cache
    tokens: list[int]  # the new tokens of this step


def make_batch(seqs: list[Seq], num_decodes: int, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids, positions and AttentionMetadata for one forward (decodes first)."""
    ids, pos, sb, so, qsl = [], [], [], [], [0]
    for s in seqs:
        for j, t in enumerate(s.tokens):
            p = s.start_pos + j
            ids.append(t)
            pos.append(p)
            sb.append(s.block_table[p // block_size])
            so.append(p % block_size)
        qsl.append(qsl[-1] + len(s.tokens))
    width = max(len(s.block_table) for s in seqs)
    bt = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                      dtype=torch.int64)
    seq_lens = [s.start_pos + len(s.tokens) for s in seqs]
    assert all(len(s.tokens) == 1 for s in seqs[:num_decodes])
    meta = AttentionMetadata(
        num_decodes=num_decodes, query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt,
        slot_block=torch.tensor(sb, dtype=torch.int64),
        slot_offset=torch.tensor(so, dtype=torch.int64),
        decode_seq_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.int64))
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta


def run(model: LlamaForCausalLM, kv: torch.Tensor, seqs: list[Seq], num_decodes: int,
        block_size: int) -> torch.Tensor:
    ids, pos, meta = make_batch(seqs, num_decodes, block_size)
    with torch.inference_mode():
        return model.compute_logits(model(ids, pos, kv, meta))


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SIZES["vocab_size"], (n,), generator=g).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_matches_transformers(variant, checkpoints, hf_models) -> None:
    model = load_model(checkpoints[variant], dtype=torch.float32, device="cpu")
    cfg = model.config
    kv = allocate_kv_cache(cfg, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    toks = prompt(21)
    logits = run(model, kv, [Seq([5, 1, 6, 0, 3, 7], 0, toks)], 0, 4)
    ref = hf_logits(hf_models[variant], toks)
    assert logits.dtype == torch.float32 and logits.shape == (21, cfg.vocab_size)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_then_decode_matches_transformers(variant, checkpoints,
                                                          hf_models) -> None:
    model = load_model(checkpoints[variant], dtype="float32", device="cpu")
    b = 4
    kv = allocate_kv_cache(model.config, num_blocks=12, block_size=b, dtype=torch.float32,
                           device="cpu")
    table = [9, 2, 11, 4, 7, 0]  # non-contiguous; 24 token slots
    toks = prompt(13, seed=2)
    outs = []
    start = 0
    for n in (6, 3, 4):  # chunks of different lengths, not block aligned
        outs.append(run(model, kv, [Seq(table, start, toks[start:start + n])], 0, b))
        start += n
    for _ in range(5):
        nxt = int(outs[-1][-1].argmax())
        toks.append(nxt)
        outs.append(run(model, kv, [Seq(table, len(toks) - 1, [nxt])], 1, b))
    ours = torch.cat(outs)
    ref = hf_logits(hf_models[variant], toks)
    torch.testing.assert_close(ours, ref[:len(toks)], atol=ATOL, rtol=0)


def test_mixed_batch_equals_separate_runs(checkpoints) -> None:
    model = load_model(checkpoints["llama"], dtype=torch.float32, device="cpu")
    b = 4
    kv = allocate_kv_cache(model.config, num_blocks=16, block_size=b, dtype=torch.float32,
                           device="cpu")
    a, bb, c, d = prompt(8, 3), prompt(11, 4), prompt(9, 5), prompt(6, 6)
    tables = {"a": [3, 12], "b": [1, 8, 14], "c": [15, 2, 6], "d": [10, 4]}
    # Earlier steps: a and b fully prefilled (minus their next token), c's first chunk.
    run(model, kv, [Seq(tables["a"], 0, a[:7])], 0, b)
    run(model, kv, [Seq(tables["b"], 0, bb[:10])], 0, b)
    run(model, kv, [Seq(tables["c"], 0, c[:5])], 0, b)
    kv_sep = kv.clone()

    step = [Seq(tables["a"], 7, a[7:]), Seq(tables["b"], 10, bb[10:]),  # 2 decodes
            Seq(tables["c"], 5, c[5:]), Seq(tables["d"], 0, d)]           # 2 prefill chunks
    mixed = run(model, kv, step, 2, b)
    separate = torch.cat([run(model, kv_sep, [s], int(len(s.tokens) == 1), b) for s in step])
    torch.testing.assert_close(mixed, separate, atol=1e-5, rtol=0)
    torch.testing.assert_close(kv, kv_sep, atol=1e-5, rtol=0)  # GEMM shapes differ
    # and the last rows (those a scheduler samples from) against a full recompute
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"],
                                                           attn_implementation="eager")
    qsl = [0, 1, 2, 6, 12]
    for toks, row in zip((a, bb, c, d), (r - 1 for r in qsl[1:]), strict=True):
        torch.testing.assert_close(mixed[row], hf_logits(hf, toks)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama_tied_bias", "qwen2", "llama_mqa", "qwen3"])
def test_fused_projections_are_the_separate_layers(variant, checkpoints,
                                                   monkeypatch) -> None:
    """q/k/v and gate/up run as one GEMM each; the layers' weights (and biases) are views of
    the fused matrix (no second copy in memory), and turning fusion off changes no output
    beyond float rounding (prefill through F.linear, decode through it and the CPU small-M
    kernel)."""
    from disagg.model.kernels import small_linear_kernel

    model = load_model(checkpoints[variant], dtype=torch.float32, device="cpu")
    att, mlp = model.model.layers["1"].self_attn, model.model.layers["1"].mlp
    assert att.qkv is not None and mlp.gate_up is not None
    base = att.qkv.weight.untyped_storage().data_ptr()
    rows = [(m, m.weight.data_ptr()) for m in (att.q_proj, att.k_proj, att.v_proj)]
    at = 0
    for m, ptr in rows:  # rows [at, at + out) of the fused matrix
        assert m.weight.untyped_storage().data_ptr() == base
        assert ptr == att.qkv.weight[at].data_ptr()
        at += m.out_features
    assert at == att.qkv.weight.shape[0]
    assert (att.qkv.bias is not None) == model.config.attention_bias
    # qwen3: the q/k norm weights stacked per head (q heads, then kv heads) for one norm call
    assert (att.qk_norm_rows is not None) == model.config.qk_norm
    if model.config.qk_norm:
        assert torch.equal(att.qk_norm_rows[-1], att.k_norm.weight)
        assert torch.equal(att.qk_norm_rows[att.num_heads - 1], att.q_norm.weight)
    # CPU: fused for the small-M kernel's rows, apart for more (measured slower fused)
    assert att.qkv.pays(torch.empty(32, 4)) and not att.qkv.pays(torch.empty(33, 4))
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    assert sum(storages.values()) == sum(p.nbytes for p in model.parameters())
    toks = prompt(10, seed=7)
    step = [Seq([2, 0, 3], 0, toks[:9])]
    decode = [Seq([2, 0, 3], 9, toks[9:])]
    fused_parts = {n: (layer.self_attn.qkv, layer.mlp.gate_up)
                   for n, layer in model.model.layers.items()}
    prefilled = allocate_kv_cache(model.config, 4, 4, torch.float32, "cpu")
    run(model, prefilled, step, 0, 4)
    for kernel in (None, small_linear_kernel()):
        model.use_linear_kernel(kernel)
        res = {}
        for fused in (True, False):
            for n, layer in model.model.layers.items():
                qkv, gate_up = fused_parts[n]
                layer.self_attn.qkv = qkv if fused else None
                layer.mlp.gate_up = gate_up if fused else None
            kv = allocate_kv_cache(model.config, 4, 4, torch.float32, "cpu")
            calls = []
            with monkeypatch.context() as mp:
                mp.setattr(FusedRows, "matmul", lambda self, x, f=FusedRows.matmul,
                           c=calls: (c.append(len(self.sizes)), f(self, x))[1])
                # a prefill each way, and a decode each way from the same cache
                res[fused] = (run(model, kv, step, 0, 4),
                              run(model, prefilled.clone(), decode, 1, 4))
            n = model.config.num_hidden_layers
            assert sorted(calls) == ([2] * 2 * n + [3] * 2 * n if fused else [])
        torch.testing.assert_close(res[True][0], res[False][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(res[True][1], res[False][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_reference_formula(dtype: torch.dtype) -> None:
    from disagg.model.llama import RMSNorm

    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(dtype)
    x = (torch.randn(7, 96) * 3).to(dtype)
    xf = x.float()  # transformers' LlamaRMSNorm
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(norm(x), ref, atol=1e-6 if dtype == torch.float32 else 1e-2,
                               rtol=1e-6 if dtype == torch.float32 else 1e-2)


def test_bfloat16_runs_close_to_float32(checkpoints) -> None:
    path = checkpoints["qwen2"]
    toks = prompt(12)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype=dt)
        assert model.model.layers["0"].mlp.up_proj.weight.dtype == dt
        kv = allocate_kv_cache(model.config, 6, 4, dt, "cpu")
        first = run(model, kv, [Seq([4, 0, 5, 1], 0, toks[:9])], 0, 4)
        rest = run(model, kv, [Seq([4, 0, 5, 1], 9, toks[9:])], 0, 4)
        out[dt] = torch.cat([first, rest])
    assert out[torch.bfloat16].dtype == torch.float32
    assert (out[torch.bfloat16] - out[torch.float32]).abs().max() < 0.25


def test_pipeline_stages_chain_to_full_model(checkpoints, hf_models) -> None:
    path = checkpoints["llama"]  # 3 layers, sharded
    cfg = ModelConfig.from_dir(path)
    first = load_model(path, cfg, torch.float32, "cpu", layer_range=(0, 2))
    last = load_model(path, cfg, torch.float32, "cpu", layer_range=(2, 3))
    assert first.lm_head is None and first.model.norm is None
    assert last.model.embed_tokens is None
    assert "model.layers.2.mlp.up_proj.weight" in dict(last.named_parameters())
    kv0 = allocate_kv_cache(cfg, 4, 4, torch.float32, "cpu", num_layers=2)
    kv1 = allocate_kv_cache(cfg, 4, 4, torch.float32, "cpu", num_layers=1)
    toks = prompt(10)
    ids, pos, meta = make_batch([Seq([2, 0, 3], 0, toks)], 0, 4)
    with torch.inference_mode():
        h = first(ids, pos, kv0, meta)
        logits = last.compute_logits(last(None, pos, kv1, meta, hidden_states=h))
    torch.testing.assert_close(logits, hf_logits(hf_models["llama"], toks), atol=ATOL, rtol=0)


# q/k/v (+ o) biases, tied; qwen3: q/k norms, head_dim != hidden / heads
@pytest.mark.parametrize("variant", ["qwen2", "llama_tied_bias", "qwen3"])
def test_tensor_parallel_slices_and_forward(variant, checkpoints, hf_models) -> None:
    """Two TP ranks (threads, summing partials through a barrier) reproduce the full model."""
    path = checkpoints[variant]
    ranks = [load_model(path, None, torch.float32, "cpu", tp_rank=r, tp_size=2)
             for r in range(2)]
    full = load_model(path)
    name = "model.layers.1.self_attn.q_proj"
    params = [dict(m.named_parameters()) for m in ranks]
    full_p = dict(full.named_parameters())
    for n, dim in ((f"{name}.weight", 0), (f"{name}.bias", 0),
                   ("model.layers.0.mlp.down_proj.weight", 1),
                   ("model.layers.1.self_attn.o_proj.weight", 1)):
        if n in full_p:
            torch.testing.assert_close(torch.cat([p[n] for p in params], dim), full_p[n])
    if model_cfg_has_qk_norm := full.config.qk_norm:  # one [head_dim] weight, every rank
        for p in params:
            torch.testing.assert_close(p["model.layers.1.self_attn.k_norm.weight"],
                                       full_p["model.layers.1.self_attn.k_norm.weight"])
    assert model_cfg_has_qk_norm == (variant == "qwen3")
    assert ranks[0].model.layers["0"].self_attn.num_kv_heads == 1

    slots: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2)

    def all_reduce_for(rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            slots[rank] = x
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # nobody overwrites a slot before both have read
            return total
        return reduce

    toks = prompt(9)
    results: list[torch.Tensor | None] = [None, None]

    def work(rank: int) -> None:
        m = ranks[rank]
        m.tp_all_reduce = all_reduce_for(rank)
        kv = allocate_kv_cache(m.config, 4, 4, torch.float32, "cpu",
                               num_kv_heads=m.num_local_kv_heads)
        results[rank] = run(m, kv, [Seq([1, 3, 0], 0, toks)], 0, 4)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    ref = hf_logits(hf_models[variant], toks)
    for r in range(2):
        torch.testing.assert_close(results[r], ref, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_changes_frequencies(checkpoints) -> None:
    cfg = ModelConfig.from_dir(checkpoints["llama3_rope"])
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
    assert not torch.allclose(rope_inv_freq(cfg), rope_inv_freq(plain))


def test_unsupported_rope_type_is_named(checkpoints) -> None:
    cfg = ModelConfig.from_dir(checkpoints["llama"])
    bad = ModelConfig(**{**cfg.__dict__, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="yarn"):
        LlamaForCausalLM(bad)


def test_qwen3_config_and_sliding_window_refusal() -> None:
    """Qwen3's config: its own head_dim (not hidden / heads), q/k norms; a sliding window on
    any layer (transformers' rule: use_sliding_window, then layer_types / max_window_layers)
    is refused naming the key, a window that reaches no layer is not."""
    def cfg(**kw) -> dict:
        c = transformers.Qwen3Config(**{**SIZES, "head_dim": 32, **kw}).to_dict()
        c["architectures"] = ["Qwen3ForCausalLM"]
        return c

    mc = ModelConfig.from_hf_dict(cfg())
    assert (mc.architecture, mc.head_dim, mc.qk_norm, mc.attention_bias) == (
        "qwen3", 32, True, False)
    assert not ModelConfig.from_hf_dict({**cfg(), "architectures": ["Qwen2ForCausalLM"]}).qk_norm
    with pytest.raises(ConfigError, match=r"use_sliding_window.*layers \[1\].*layer_types"):
        ModelConfig.from_hf_dict(cfg(use_sliding_window=True, sliding_window=8,
                                     max_window_layers=1))
    raw = {k: v for k, v in cfg(use_sliding_window=True, sliding_window=8).items()
           if k != "layer_types"}  # an older config.json: max_window_layers decides
    raw["max_window_layers"] = 0
    with pytest.raises(ConfigError, match=r"layers \[0, 1\].*max_window_layers"):
        ModelConfig.from_hf_dict(raw)
    raw["max_window_layers"] = 2  # no layer reaches the window: full attention, as transformers
    assert ModelConfig.from_hf_dict(raw).architecture == "qwen3"
    assert transformers.Qwen3Config(**{**SIZES, "use_sliding_window": True, "sliding_window": 8,
                                       "max_window_layers": 2}).layer_types == [
        "full_attention"] * 2


def test_tied_embeddings_share_storage(checkpoints) -> None:
    model = load_model(checkpoints["qwen2"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in load_file(os.path.join(checkpoints["qwen2"],
                                                          "model.safetensors"))


def test_kv_cache_allocation() -> None:
    cfg = ModelConfig(architecture="llama", vocab_size=8, hidden_size=64, intermediate_size=8,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16)
    kv = allocate_kv_cache(cfg, 5, 8, torch.bfloat16, "cpu")
    assert kv.shape == (5, 3, 2, 2, 8, 16) and kv.dtype == torch.bfloat16
    assert not kv.any()
    assert kv_cache_bytes_per_block(cfg, 8, torch.bfloat16, 3, 2) == kv[0].nbytes
    assert kv_cache_bytes_per_block(cfg, 8, "float32", num_layers=1, num_kv_heads=1) == \
        1 * 2 * 1 * 8 * 16 * 4


# -- loader errors -------------------------------------------------------------------------

def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_tensor_is_named(checkpoints, tmp_path) -> None:
    path = _copy(checkpoints["llama_mqa"], tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_wrong_shape_is_named(checkpoints, tmp_path) -> None:
    path = _copy(checkpoints["llama_mqa"], tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:32].contiguous()
    save_file(tensors, f)
    msg = (f"{name}: expected shape (64, 64), checkpoint has (32, 64) in model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert str(e.value) == msg


def test_missing_files_are_named(checkpoints, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"))

    no_config = _copy(checkpoints["llama_mqa"], tmp_path / "nc")
    os.remove(os.path.join(no_config, "config.json"))
    with pytest.raises(ConfigError, match="config.json"):
        load_model(no_config)

    no_weights = _copy(checkpoints["llama_mqa"], tmp_path / "nw")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(no_weights)

    no_shard = _copy(checkpoints["llama"], tmp_path / "ns")
    with open(os.path.join(no_shard, "model.safetensors.index.json")) as fh:
        shard = json.load(fh)["weight_map"]["model.norm.weight"]
    os.remove(os.path.join(no_shard, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(no_shard)
