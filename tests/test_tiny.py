"""Tiny checkpoints: files, determinism, loadable by transformers, usable for parity tests."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors import safe_open

from disagg.cli import main
from disagg.config import ModelConfig
from disagg.model import tiny
from disagg.model.tiny import (
    build_tokenizer,
    default_tiny_model_dir,
    ensure_tiny_model,
    write_tiny_checkpoint,
)

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "llama"))


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _hf_model(path: str):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def test_files_and_config(ckpt: str) -> None:
    assert sorted(os.listdir(ckpt)) == sorted(FILES)
    cfg = ModelConfig.from_dir(ckpt)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama", 512, 64, 128)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.max_position_embeddings == 2048 and not cfg.tie_word_embeddings
    tok = build_tokenizer(512)
    assert cfg.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert set(cfg.eos_token_ids) == {tok.token_to_id("<|end_of_text|>"),
                                      tok.token_to_id("<|eot_id|>")}
    with open(os.path.join(ckpt, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast" and tcfg["add_bos_token"]
    assert "<|start_header_id|>" in tcfg["chat_template"]


def test_weight_names_and_shapes(ckpt: str) -> None:
    w = _tensors(ckpt)
    assert w["model.embed_tokens.weight"].shape == (512, 64)
    assert w["lm_head.weight"].shape == (512, 64)
    assert w["model.layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)  # 2 kv heads x 16
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert torch.equal(w["model.norm.weight"], torch.ones(64))
    assert not any(k.endswith(".bias") for k in w)
    assert len(w) == 2 + 1 + 2 * 9
    assert all(t.dtype == torch.float32 for t in w.values())


def test_deterministic(tmp_path, ckpt: str) -> None:
    again = write_tiny_checkpoint(str(tmp_path / "again"))
    for name in FILES:
        with open(os.path.join(ckpt, name), "rb") as a, open(os.path.join(again, name),
                                                             "rb") as b:
            assert a.read() == b.read(), name
    other = write_tiny_checkpoint(str(tmp_path / "seed1"), seed=1)
    assert not torch.equal(_tensors(ckpt)["model.embed_tokens.weight"],
                           _tensors(other)["model.embed_tokens.weight"])
    with open(os.path.join(ckpt, "tokenizer.json"), "rb") as a, open(
            os.path.join(other, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()  # the tokenizer does not depend on the seed


def test_tokenizer_training_fast_and_complete() -> None:
    t0 = time.perf_counter()
    tok = build_tokenizer(512)
    assert time.perf_counter() - t0 < 2.0
    assert tok.get_vocab_size() == 512
    text = "Ünïcödé ✓ 😀 你好, \x00\t\r\n  bytes \U0010ffff"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text
    assert tok.get_vocab_size() - len(tiny.SPECIAL_TOKENS) >= 256 + 200  # bytes + merges
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(100)


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", False), ("mistral", False),
                                        ("qwen2", True), ("qwen3", False)])
def test_transformers_loads_and_generates(tmp_path, arch: str, tied: bool) -> None:
    path = write_tiny_checkpoint(str(tmp_path / arch), arch, num_hidden_layers=3,
                                 tie_word_embeddings=tied)
    cfg = ModelConfig.from_dir(path)
    assert cfg.architecture == arch and cfg.num_hidden_layers == 3
    assert cfg.attention_bias == (arch == "qwen2")
    if arch == "qwen2":
        assert "model.layers.2.self_attn.q_proj.bias" in _tensors(path)
    # qwen3: a head twice hidden / heads (q 4 x 32 = 128 wide on a 64 hidden), q/k norms
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    if arch == "qwen3":
        w = _tensors(path)
        assert w["model.layers.2.self_attn.q_proj.weight"].shape == (128, 64)
        assert w["model.layers.2.self_attn.o_proj.weight"].shape == (64, 128)
        assert w["model.layers.2.self_attn.k_norm.weight"].shape == (32,)
    model = _hf_model(path)
    assert type(model).__name__ == tiny.ARCHITECTURES[arch]
    ids = torch.tensor([[506, 40, 300, 77, 250]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, 5:].tolist()
    # A random model, but not a degenerate one: greedy output wanders.
    assert len(set(out)) >= 8, out


def test_logits_are_peaky_with_clear_top2_gaps(ckpt: str) -> None:
    model = _hf_model(ckpt)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (4, 48), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits.float().reshape(-1, 512)
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps < 1e-3).float().mean() < 0.01  # greedy parity tests need clear winners
    assert gaps.median() > 0.3
    assert logits.softmax(-1).max(-1).values.mean() > 0.3  # peaky
    # The random model does not emit special tokens (EOS) or unreadable bytes.
    special = [build_tokenizer(512).token_to_id(t) for t in tiny.SPECIAL_TOKENS]
    assert not set(logits.argmax(-1).tolist()) & set(special)


def test_tied_rope_scaling_and_dtype(tmp_path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    path = write_tiny_checkpoint(str(tmp_path / "t"), tie_word_embeddings=True,
                                 rope_scaling=rope, dtype="bfloat16", vocab_size=600)
    cfg = ModelConfig.from_dir(path)
    assert cfg.tie_word_embeddings and cfg.rope_scaling == rope
    assert cfg.torch_dtype == "bfloat16" and cfg.vocab_size == 600
    w = _tensors(path)
    assert "lm_head.weight" not in w
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    model = _hf_model(path)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.tensor([[10, 40, 300, 77, 250]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)[0, 5:].tolist()
    assert len(set(out)) >= 5, out


@pytest.mark.parametrize("kwargs, field", [
    ({"arch": "gpt2"}, "arch"),
    ({"num_attention_heads": 3}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": 200}, "vocab_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"dtype": "int8"}, "dtype"),
    ({"arch": "qwen3", "head_dim": 15}, "head_dim"),
])
def test_bad_arguments(tmp_path, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        write_tiny_checkpoint(str(tmp_path / "x"), **kwargs)


def test_cli(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["model", "tiny", str(out), "--arch", "qwen2", "--layers", "3", "--heads", "8",
                 "--kv-heads", "4", "--hidden-size", "128", "--intermediate-size", "96",
                 "--vocab-size", "520", "--seed", "3"]) == 0
    assert str(out) in capsys.readouterr().out
    cfg = ModelConfig.from_dir(str(out))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.hidden_size, cfg.intermediate_size,
            cfg.vocab_size) == ("qwen2", 3, 8, 4, 128, 96, 520)
    # A non-empty folder needs --force.
    assert main(["model", "tiny", str(out)]) == 1
    assert "--force" in capsys.readouterr().out
    assert main(["model", "tiny", str(out), "--force"]) == 0
    assert ModelConfig.from_dir(str(out)).architecture == "llama"
    assert main(["model", "tiny", str(tmp_path / "bad"), "--heads", "3"]) == 1
    assert "num_attention_heads" in capsys.readouterr().out
    # qwen3 with a head size of its own (hidden 64 / 4 heads would be 16)
    assert main(["model", "tiny", str(tmp_path / "q3"), "--arch", "qwen3", "--head-dim",
                 "24"]) == 0
    cfg = ModelConfig.from_dir(str(tmp_path / "q3"))
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm) == ("qwen3", 24, True)


def test_ensure_tiny_model(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path / "cache"))
    default = default_tiny_model_dir()
    assert default.startswith(str(tmp_path / "cache"))
    path = ensure_tiny_model()
    assert path == os.path.abspath(default)
    assert all(os.path.isfile(os.path.join(path, f)) for f in FILES)
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert ensure_tiny_model() == path  # second call: already there, nothing rewritten
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temp leftovers
    assert ModelConfig.from_dir(path).architecture == "llama"
    # An explicit empty folder is filled; a non-empty foreign one is refused.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ensure_tiny_model(str(empty)) == str(empty)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="other"):
        ensure_tiny_model(str(other))
