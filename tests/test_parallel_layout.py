"""ParallelLayout arithmetic, config validation, option parsing, and sharded loading with
replicated kv heads (TP ranks as threads: no processes here)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from disagg.config import ConfigError, ModelConfig, ParallelConfig, build_engine_config
from disagg.layout import ParallelLayout, layer_ranges, tp_kv_head_range
from disagg.model.attention import AttentionMetadata
from disagg.model.loader import allocate_kv_cache, load_model

MODEL = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=8)


def test_layer_ranges_even_uneven_and_explicit() -> None:
    assert layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert layer_ranges(4, 2, [3, 1]) == [(0, 3), (3, 4)]
    assert layer_ranges(3, 1) == [(0, 3)]
    with pytest.raises(ConfigError, match="at least one layer"):
        layer_ranges(2, 3)
    with pytest.raises(ConfigError, match="summing to num_hidden_layers=4"):
        layer_ranges(4, 2, [2, 1])
    with pytest.raises(ConfigError, match="2 entries for pipeline_parallel_size=3"):
        layer_ranges(4, 3, [2, 2])


def test_kv_head_ranges_split_and_replicate() -> None:
    # 4 kv heads over 2 ranks: split; 2 over 4: ranks 0,1 hold head 0, ranks 2,3 head 1.
    assert [tp_kv_head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [tp_kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [tp_kv_head_range(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(ConfigError, match="not divisible"):
        tp_kv_head_range(6, 4, 0)
    with pytest.raises(ConfigError, match="not a multiple"):
        tp_kv_head_range(2, 3, 0)


def test_all_ranks_layout_tp2_pp2() -> None:
    lays = ParallelLayout.all_ranks(MODEL, ParallelConfig(2, 2, (3, 2)))
    assert [(lay.rank, lay.pp_rank, lay.tp_rank) for lay in lays] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [lay.layer_range for lay in lays] == [(0, 3), (0, 3), (3, 5), (3, 5)]
    assert [lay.kv_head_range for lay in lays] == [(0, 1), (1, 2), (0, 1), (1, 2)]
    assert [lay.head_range for lay in lays] == [(0, 4), (4, 8), (0, 4), (4, 8)]
    assert lays[0].is_first_stage and not lays[0].is_last_stage and lays[3].is_last_stage
    assert lays[1].stage_rank(1) == 3 and lays[3].stage_rank(0, 0) == 0
    assert lays[2].num_local_layers == 2 and lays[2].num_local_kv_heads == 1
    d = lays[3].to_dict()
    assert d["rank"] == 3 and d["layer_range"] == (3, 5)
    assert ParallelLayout.from_dict({**d, "layer_range": [3, 5]}) == lays[3]
    # tp 4 > 2 kv heads: each rank holds one, shared by pairs of ranks.
    lays4 = ParallelLayout.all_ranks(MODEL, ParallelConfig(4, 1))
    assert [lay.kv_head_range for lay in lays4] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert lays4[0].kv_head_replicas == 2


def test_engine_config_rejects_unsplittable_models(tiny_llama: str) -> None:
    # tiny: 4 heads, 2 kv heads, 2 layers, intermediate 128
    with pytest.raises(ConfigError, match="not divisible by tensor_parallel_size=3"):
        build_engine_config(tiny_llama, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="at least one layer"):
        build_engine_config(tiny_llama, pipeline_parallel_size=3)
    with pytest.raises(ConfigError, match="pp_partition"):
        build_engine_config(tiny_llama, pipeline_parallel_size=2, pp_partition=[2, 1])
    with pytest.raises(ConfigError, match="pp_partition"):
        build_engine_config(tiny_llama, pipeline_parallel_size=2, pp_partition=[2])
    cfg = build_engine_config(tiny_llama, tensor_parallel_size=4, pipeline_parallel_size=2,
                              pp_partition="1,1")
    assert cfg.parallel.pp_partition == (1, 1) and cfg.parallel.world_size == 8


def test_serve_flags_and_yaml_keys(tmp_path: Path) -> None:
    import argparse

    from disagg.contracts.options import load_worker_yaml
    from disagg.server.cli import add_cli, resolve_options

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["serve", "/m", "--tensor-parallel-size", "2",
                              "--pipeline-parallel-size", "2", "--pp-partition", "3,1"])
    opts = resolve_options(args)
    assert (opts.tensor_parallel_size, opts.pipeline_parallel_size,
            opts.pp_partition) == (2, 2, (3, 1))
    cfg = tmp_path / "w.yaml"
    cfg.write_text("tensor_parallel_size: 2\npipeline_parallel_size: 2\npp_partition: [1, 3]\n")
    assert load_worker_yaml(str(cfg))["pp_partition"] == [1, 3]
    cfg.write_text("pp_partition: [1, x]\n")
    with pytest.raises(ConfigError, match="pp_partition: expected a list of integers"):
        load_worker_yaml(str(cfg))
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "/m", "--pp-partition", "a,b"])


def _meta(n: int, block_size: int, blocks: list[int]) -> AttentionMetadata:
    pos = list(range(n))
    return AttentionMetadata(
        num_decodes=0, query_start_loc=[0, n], seq_lens=[n],
        block_tables=torch.tensor([blocks]),
        slot_block=torch.tensor([blocks[p // block_size] for p in pos]),
        slot_offset=torch.tensor([p % block_size for p in pos]),
        decode_seq_lens=torch.zeros(0, dtype=torch.long))


@pytest.mark.parametrize("kv_heads,tp", [(1, 2), (2, 4), (2, 2)])
def test_tp_ranks_with_replicated_kv_heads_match_the_full_model(tmp_path: Path, kv_heads: int,
                                                                tp: int) -> None:
    """Shards loaded for tp ranks (kv heads replicated when tp > kv heads), run as threads
    summing partial outputs, give the full model's logits; each rank reads only its kv head."""
    from disagg.model.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(str(tmp_path / "m"), num_key_value_heads=kv_heads, seed=3)
    full = load_model(path)
    ranks = [load_model(path, tp_rank=r, tp_size=tp) for r in range(tp)]
    d = full.config.head_dim
    full_k = full.model.layers["0"].self_attn.k_proj.weight
    for r, m in enumerate(ranks):
        lo, hi = tp_kv_head_range(kv_heads, tp, r)
        assert m.kv_head_range == (lo, hi)
        torch.testing.assert_close(m.model.layers["0"].self_attn.k_proj.weight,
                                   full_k[lo * d:hi * d])

    slots: list[torch.Tensor | None] = [None] * tp
    barrier = threading.Barrier(tp)

    def reducer(rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            slots[rank] = x
            barrier.wait()
            total = sum(slots[1:], slots[0])
            barrier.wait()
            return total
        return reduce

    n, block_size = 11, 4
    toks = torch.randint(0, full.config.vocab_size, (n,), generator=torch.Generator()
                         .manual_seed(0))
    pos = torch.arange(n)
    meta = _meta(n, block_size, [2, 0, 3])
    results: list[torch.Tensor | None] = [None] * tp

    def work(rank: int) -> None:
        m = ranks[rank]
        m.tp_all_reduce = reducer(rank)
        kv = allocate_kv_cache(m.config, 4, block_size, torch.float32, "cpu",
                               num_kv_heads=m.num_local_kv_heads)
        with torch.inference_mode():
            results[rank] = m.compute_logits(m(toks, pos, kv, meta))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    kv = allocate_kv_cache(full.config, 4, block_size, torch.float32, "cpu")
    with torch.inference_mode():
        ref = full.compute_logits(full(toks, pos, kv, meta))
    for r in range(tp):
        torch.testing.assert_close(results[r], ref, atol=1e-4, rtol=0)
