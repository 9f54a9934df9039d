"""Shared fixtures: tiny checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores: keep torch from oversubscribing when several test processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Parallel-worker tests: a hung collective fails in a minute, not in the default five.
os.environ.setdefault("DISAGG_DIST_TIMEOUT_S", "60")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny random checkpoints: llama (GQA, llama3 rope scaling), qwen2 (q/k/v bias, tied
    embeddings), mistral (MQA-ish GQA)."""
    from disagg.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    specs = {
        "llama": dict(
            arch="llama", num_key_value_heads=2,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        "qwen2": dict(arch="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
        "mistral": dict(arch="mistral", num_key_value_heads=1),
    }
    for name, spec in specs.items():
        dirs[name] = write_tiny_checkpoint(str(Path(root) / name), seed=1, **spec)
    return dirs


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs: dict[str, str]) -> str:
    return tiny_dirs["llama"]
