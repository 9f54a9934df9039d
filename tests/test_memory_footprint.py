"""What a CPU worker holds in memory: weights read into memory of its own (never a mapping of
the checkpoint file beside a copy), and a KV cache sized by default from what the model and the
load can use, capped by a share of free RAM (``ModelRunner._decide_num_blocks``)."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys

import pytest

torch = pytest.importorskip("torch")

import disagg.runner as runner_mod  # noqa: E402
from disagg.config import (  # noqa: E402
    DEFAULT_CPU_KV_FRACTION,
    DEFAULT_CPU_KV_SEQUENCES,
    build_engine_config,
)
from disagg.model.loader import (  # noqa: E402
    CheckpointError,
    CheckpointFile,
    kv_cache_bytes_per_block,
    load_model,
)


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_weights_are_not_a_mapping_of_the_checkpoint(tiny_dirs) -> None:
    """A tensor of a mapped safetensors file keeps the whole mapping alive: the loaded (and
    fused) weights must own their memory, so no part of the file stays counted in RSS."""
    model_dir = tiny_dirs["qwen2"]  # tied embeddings, q/k/v biases
    model = load_model(model_dir)
    path = os.path.join(model_dir, "model.safetensors")
    assert _mapped_ranges(path) == []
    for name, p in model.named_parameters():
        ptr = p.data_ptr()
        assert not any(lo <= ptr < hi for lo, hi in _mapped_ranges(path)), name


def test_checkpoint_file_reads_what_safetensors_reads(tiny_dirs) -> None:
    from safetensors import safe_open

    path = os.path.join(tiny_dirs["llama"], "model.safetensors")
    with safe_open(path, framework="pt", device="cpu") as ref, CheckpointFile(path) as f:
        assert sorted(f.keys()) == sorted(ref.keys())
        for name in ref.keys():
            want = ref.get_tensor(name)
            sl = f.get_slice(name)
            assert sl.get_shape() == list(want.shape)
            assert torch.equal(sl[:], want), name
            if want.dim() == 2:
                n, k = want.shape
                assert torch.equal(sl[1:n - 1], want[1:n - 1])
                got = sl[:, 1:k - 1]
                assert got.is_contiguous() and torch.equal(got, want[:, 1:k - 1])


def test_checkpoint_file_names_what_is_wrong(tmp_path) -> None:
    bad = tmp_path / "short.safetensors"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="no header"):
        CheckpointFile(str(bad))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}})
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 10)
    with CheckpointFile(str(cut)) as f, pytest.raises(CheckpointError, match="do not fit"):
        f.get_slice("w")
    odd = json.dumps({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}})
    typ = tmp_path / "typ.safetensors"
    typ.write_bytes(struct.pack("<Q", len(odd)) + odd.encode() + b"\0" * 8)
    with CheckpointFile(str(typ)) as f, pytest.raises(CheckpointError, match="C64"):
        f.get_slice("w")


# -- the KV cache's size on CPU ------------------------------------------------------------


def _blocks(model_dir: str, free: int, monkeypatch, caplog, **opts) -> tuple[int, str]:
    monkeypatch.setattr(runner_mod, "free_memory_bytes", lambda device: free)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="disagg.runner"):
        runner = runner_mod.ModelRunner(build_engine_config(model_dir, **opts))
    lines = [r.getMessage() for r in caplog.records if "KV cache sizing" in r.getMessage()]
    assert len(lines) == 1, lines
    assert runner.kv_cache.shape[0] == runner.num_blocks
    return runner.num_blocks, lines[0]


def _per_block(model_dir: str, block: int) -> int:
    cfg = build_engine_config(model_dir, tokens_per_block=block)
    return kv_cache_bytes_per_block(cfg.model, block, torch.float32)


def test_cpu_default_is_what_the_model_and_load_use(tiny_llama, monkeypatch, caplog) -> None:
    big = 1 << 40  # plenty of RAM: the cap does not bind
    # 4 sequences of max_model_len (more than max_num_tokens)
    n, line = _blocks(tiny_llama, big, monkeypatch, caplog, tokens_per_block=16,
                      max_model_len=512, max_num_tokens=256)
    assert n == DEFAULT_CPU_KV_SEQUENCES * 512 // 16
    assert "set by the default" in line and "4 sequence(s) of max_model_len 512" in line
    # at least one step's tokens (max_num_tokens) when the sequences are short
    n, _ = _blocks(tiny_llama, big, monkeypatch, caplog, tokens_per_block=16,
                   max_model_len=64, max_num_tokens=1024)
    assert n == 1024 // 16
    # never more than max_batch_size sequences can use
    n, line = _blocks(tiny_llama, big, monkeypatch, caplog, tokens_per_block=16,
                      max_model_len=512, max_num_tokens=256, max_batch_size=2)
    assert n == 2 * 512 // 16
    n, line = _blocks(tiny_llama, big, monkeypatch, caplog, tokens_per_block=16,
                      max_model_len=128, max_num_tokens=1024, max_batch_size=1)
    assert n == 128 // 16 and "set by max_batch_size x max_model_len" in line


def test_cpu_default_is_capped_by_free_ram(tiny_llama, monkeypatch, caplog) -> None:
    per_block = _per_block(tiny_llama, 16)
    free = int(10 * per_block / DEFAULT_CPU_KV_FRACTION)  # room for 10 blocks
    n, line = _blocks(tiny_llama, free, monkeypatch, caplog, tokens_per_block=16,
                      max_model_len=512, max_num_tokens=256)
    assert n == 10 and "set by the default cap, 0.1 of free RAM" in line


def test_explicit_sizes_win_over_the_default(tiny_llama, monkeypatch, caplog) -> None:
    big = 1 << 40
    default = DEFAULT_CPU_KV_SEQUENCES * 512 // 16
    n, line = _blocks(tiny_llama, big, monkeypatch, caplog, tokens_per_block=16,
                      max_model_len=512, max_num_tokens=256, kv_cache_tokens=16 * 3 * default)
    assert n == 3 * default and "set by kv_cache_tokens" in line
    per_block = _per_block(tiny_llama, 16)
    free = 100 * per_block * 10  # kv_cache_fraction 0.5 of it: 500 blocks
    n, line = _blocks(tiny_llama, free, monkeypatch, caplog, tokens_per_block=16,
                      max_model_len=512, max_num_tokens=256, kv_cache_fraction=0.5)
    assert n == math.floor(0.5 * free) // per_block == 500
    assert "set by kv_cache_fraction 0.5 of free RAM" in line
