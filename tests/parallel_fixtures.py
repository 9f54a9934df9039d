"""Shared by the parallel tests: tiny model specs, engine options, prompts, process checks."""

from __future__ import annotations

from disagg import SamplingParams

# Small blocks and a small token budget: prompts are prefilled in chunks and decodes mix
# with prefills, so every rank sees every kind of step.
OPTS = dict(tokens_per_block=8, kv_cache_tokens=2048, max_num_tokens=48, max_batch_size=8,
            device="cpu")
PROMPTS = [
    "The harbour was quiet before the storm, and the boats lay still in the grey water.",
    "Memory is organised in small blocks.",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
    "Hi",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
# A second round sharing the first prompts' prefixes: prefix-cache hits on every rank.
PREFIXED = [PROMPTS[0] + " Then the wind rose.", PROMPTS[2] + ", 21, 22"]

SPECS = {
    # 3 layers: the even pp=2 split is uneven, [0, 2) + [2, 3); 2 kv heads
    "llama3": dict(arch="llama", num_hidden_layers=3, num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    # one kv head: tp=2 replicates it
    "mqa": dict(arch="mistral", num_key_value_heads=1),
    # q/k/v biases, embeddings tied to the LM head (which lives on another pp stage)
    "qwen2": dict(arch="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    # per-head q/k norms (replicated on TP ranks), head_dim 32 != hidden / heads = 16
    "qwen3": dict(arch="qwen3", num_hidden_layers=3, num_key_value_heads=2),
}


def pid_alive(pid: int) -> bool:
    """Running (a zombie, not yet reaped by a foreign parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def write_models(root: str) -> dict[str, str]:
    """The SPECS checkpoints under ``root`` (name -> folder)."""
    import os

    from disagg.model.tiny import write_tiny_checkpoint

    return {name: write_tiny_checkpoint(os.path.join(root, name), seed=2, **spec)
            for name, spec in SPECS.items()}
