"""Padded decode buckets (the CUDA-graph path) run eagerly on CPU: same tokens as the unpadded
engine, padding rows confined to the scratch block, buckets cover every batch size."""

from __future__ import annotations

import random

import pytest
import torch

import disagg.engine.llm_engine as engine_mod
from disagg import LLM, SamplingParams
from disagg.cuda_graph import graph_batch_sizes
from disagg.model.static_decode import paged_decode_reference
from disagg.runner import ModelRunner


def test_buckets_cover_every_batch_size() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert graph_batch_sizes(256)[:9] == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_batch_sizes(256)[-1] == 256
    for limit in (1, 3, 7, 64, 65, 100, 256, 300):
        sizes = graph_batch_sizes(limit)
        assert sizes == sorted(set(sizes)) and sizes[-1] == limit
        # every n <= limit has a bucket, and the padding never exceeds 50% past 2 rows
        for n in range(1, limit + 1):
            b = next(s for s in sizes if s >= n)
            assert b - n <= max(1, n // 2, 32), (limit, n, b)


def _loop_reference(q, kv_layer, tables, seq_lens, scale):
    """One sequence at a time, float64."""
    s, hq, d = q.shape
    _, _, hkv, bsz, _ = kv_layer.shape
    g = hq // hkv
    out = torch.zeros(s, hq, d, dtype=torch.float64)
    for i in range(s):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = tables[i].long()[pos // bsz]
        k = kv_layer[blocks, 0, :, pos % bsz].double()  # [n, Hkv, D]
        v = kv_layer[blocks, 1, :, pos % bsz].double()
        for h in range(hq):
            w = torch.softmax(k[:, h // g] @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ v[:, h // g]
    return out


@pytest.mark.parametrize("bsz", [8, 16])
def test_reference_decode_matches_a_loop(bsz: int) -> None:
    g = torch.Generator().manual_seed(0)
    nblocks, hkv, hq, d, m = 20, 2, 6, 16, 5
    kv = torch.randn(nblocks, 2, hkv, bsz, d, generator=g)
    q = torch.randn(4, hq, d, generator=g)
    tables = torch.randint(0, nblocks, (4, m), generator=g)
    seq_lens = torch.tensor([1, 0, m * bsz, 3 * bsz + 5])  # one padding row (seq_len 0)
    got = paged_decode_reference(q, kv, tables, seq_lens, 0.25, None)
    want = _loop_reference(q, kv, tables, seq_lens, 0.25)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert torch.count_nonzero(got[1]) == 0


def _layout(rows: list[tuple[int, int, list[int]]], b: int, m: int, bs: int,
            scratch: int) -> list[int]:
    """The static inputs of bucket ``b`` as the module docstring lays them out, from
    (token, position, block table) rows."""
    n = len(rows)
    head = [[t for t, _, _ in rows] + [0] * (b - n),
            [p for _, p, _ in rows] + [0] * (b - n),
            [tab[p // bs] for _, p, tab in rows] + [scratch] * (b - n),
            [p % bs for _, p, _ in rows] + [0] * (b - n),
            [p + 1 for _, p, _ in rows] + [0] * (b - n)]
    tables = [(tab + [0] * m)[:m] for _, _, tab in rows] + [[0] * m] * (b - n)
    return [x for part in head for x in part] + [x for tab in tables for x in tab]


def test_load_writes_the_documented_layout_whatever_came_before() -> None:
    """DecodeGraphs.load rewrites only the table rows that changed since the last load of the
    same bucket: after any sequence of loads (tables growing, shrinking, replaced, rows
    moving, batches shrinking, buckets changing, a caller's list changed in place) the host
    and device buffers hold exactly the documented layout, padding rows included."""
    from disagg.cuda_graph import DecodeGraphs
    from disagg.scheduler import ScheduledRequest

    bs, m, scratch = 4, 6, 50
    graphs = DecodeGraphs(torch.nn.Identity(), torch.zeros(51, 1), bs, m, scratch,
                          [1, 2, 4, 8, 16], paged_decode_reference, capture=False)
    rng = random.Random(3)
    tables = [[rng.randrange(50) for _ in range(rng.randint(1, m))] for _ in range(16)]
    shared = tables[0]  # handed to load as the same list object each time
    for step in range(400):  # (up to 8 rows and more take different paths)
        n = rng.choice([1, 2, 3, 5, 8, 8, 9, 12, 16, 16]) if step % 50 else 16
        for t in tables:
            if rng.random() < 0.2 and len(t) < m:
                t.append(rng.randrange(50))  # a decode reached a new block
            elif rng.random() < 0.05:  # preempted and recomputed: another, shorter table
                t[:] = [rng.randrange(50) for _ in range(rng.randint(1, len(t)))]
        if rng.random() < 0.1:
            rng.shuffle(tables)  # requests end and others take their rows
        rows = [(rng.randrange(1, 500), rng.randrange(len(t) * bs), t) for t in tables[:n]]
        sched = [ScheduledRequest(f"r{i}", [tok], p, t if t is shared else list(t), True)
                 for i, (tok, p, t) in enumerate(rows)]
        b = graphs.bucket_for(n)
        graphs.load(sched, b)
        want = _layout(rows, b, m, bs, scratch)
        k = len(want)
        assert graphs._host_np[:k].tolist() == want, step
        assert graphs._dev[:k].tolist() == want, step
    with pytest.raises(ValueError, match="r0: 7 blocks"):
        graphs.load([ScheduledRequest("r0", [1], 0, list(range(m + 1)), True)], 1)


def _padded_runner(monkeypatch: pytest.MonkeyPatch) -> list[ModelRunner]:
    made: list[ModelRunner] = []

    def make(config, disagg=None):  # type: ignore[no-untyped-def]
        runner = ModelRunner(config, padded_decode=paged_decode_reference)
        made.append(runner)
        return runner

    monkeypatch.setattr(engine_mod, "make_executor", make)
    return made


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_padded_decode_buckets_give_the_unpadded_tokens(tiny_dirs, arch, monkeypatch) -> None:
    model_dir = tiny_dirs[arch]
    opts = dict(max_num_tokens=64, tokens_per_block=8, kv_cache_tokens=2048,
                max_model_len=128, cuda_graph_max_batch_size=6)
    rng = random.Random(1)
    vocab = 500
    # 7 requests: decode batches of 7 (beyond the largest bucket: eager), then fewer as the
    # short ones finish (5, 3: padded to buckets 6 and 4).
    prompts = [[rng.randrange(3, vocab) for _ in range(L)] for L in (3, 9, 17, 8, 30, 5, 12)]
    max_tokens = [4, 6, 8, 10, 12, 14, 16]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in max_tokens]
    want = LLM(model_dir, **opts).generate(prompts, params)

    made = _padded_runner(monkeypatch)
    llm = LLM(model_dir, **opts)
    runner = made[0]
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 6]
    assert runner.graphs.captured == []  # CPU never captures
    assert runner.kv_cache.shape[0] == runner.num_blocks + 1  # + the scratch block
    scratch = runner.kv_cache[runner.num_blocks].clone()
    got = llm.generate(prompts, params)
    assert runner.graphs.eager_runs > 0  # the padded path served decode steps
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert lp_a.keys() == lp_b.keys()
            assert list(lp_a.values()) == pytest.approx(list(lp_b.values()), abs=1e-4)
    # Padding rows wrote only the scratch block (token 0 at position 0, offset 0).
    assert not torch.equal(runner.kv_cache[runner.num_blocks], scratch)


def test_padded_rows_never_touch_request_blocks(tiny_llama) -> None:
    """A padded step writes the real rows' slots and the scratch block, nothing else."""
    from disagg.config import build_engine_config
    from disagg.scheduler import ScheduledRequest, SchedulerOutput

    config = build_engine_config(tiny_llama, tokens_per_block=8, kv_cache_tokens=256,
                                 max_model_len=64, cuda_graph_max_batch_size=8)
    runner = ModelRunner(config, padded_decode=paged_decode_reference)
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    # 3 decodes -> bucket 4: one padding row.
    reqs = [ScheduledRequest("a", [5], 9, [3, 4], True),
            ScheduledRequest("b", [6], 0, [7], True),
            ScheduledRequest("c", [7], 17, [1, 2, 8], True)]
    ids, logits = runner.execute(SchedulerOutput(reqs, 3, 3, [], 3, 0))
    assert ids == ["a", "b", "c"] and logits.shape[0] == 3
    changed_slots = {(blk, off) for blk in range(runner.kv_cache.shape[0])
                     for off in range(8)
                     if bool((runner.kv_cache[blk, :, :, :, off] != before[blk, :, :, :, off])
                             .any())}
    assert changed_slots == {(4, 1), (7, 0), (8, 1), (runner.num_blocks, 0)}
    # The same step unpadded (plain path) gives the same logits.
    plain = ModelRunner(config)
    plain.kv_cache.copy_(before[: plain.num_blocks])
    _, want = plain.execute(SchedulerOutput(reqs, 3, 3, [], 3, 0))
    assert torch.allclose(logits, want, atol=1e-5)


def test_memory_and_graph_options_validate_and_flow_from_cli_and_yaml(tiny_llama, tmp_path) -> None:
    import argparse

    from disagg.config import CacheConfig, ConfigError, CudaGraphConfig, build_engine_config
    from disagg.contracts.options import load_worker_yaml
    from disagg.server.cli import add_cli, resolve_options

    for bad in (0.0, -0.1, 1.5, True, "0.5"):
        with pytest.raises(ConfigError, match="gpu_memory_fraction"):
            CacheConfig(gpu_memory_fraction=bad)
    with pytest.raises(ConfigError, match="cuda_graph_max_batch_size"):
        CudaGraphConfig(cuda_graph_max_batch_size=0)
    cfg = build_engine_config(tiny_llama, gpu_memory_fraction=0.45, enforce_eager=True,
                              cuda_graph_max_batch_size=32)
    assert cfg.cache.gpu_memory_fraction == 0.45
    assert cfg.cuda_graph == CudaGraphConfig(enforce_eager=True, cuda_graph_max_batch_size=32)

    yaml_path = tmp_path / "worker.yaml"
    yaml_path.write_text("gpu_memory_fraction: 0.4\nenforce_eager: true\n")
    assert load_worker_yaml(str(yaml_path)) == {"gpu_memory_fraction": 0.4,
                                                "enforce_eager": True}
    yaml_path.write_text("gpu_memory_fraction: lots\n")
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        load_worker_yaml(str(yaml_path))
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    # gpu_memory_fraction combines with kv_cache_tokens (the smaller capacity wins)
    args = parser.parse_args(["serve", "/m", "--gpu-memory-fraction", "0.5", "--kv-cache-tokens",
                              "4096", "--no-enforce-eager", "--cuda-graph-max-batch-size", "64"])
    opts = resolve_options(args)
    assert opts.gpu_memory_fraction == 0.5 and opts.kv_cache_tokens == 4096
    assert opts.enforce_eager is False and opts.cuda_graph_max_batch_size == 64


def test_cpu_runner_never_captures_and_keeps_its_cache_shape(tiny_llama) -> None:
    from disagg.config import build_engine_config

    config = build_engine_config(tiny_llama, tokens_per_block=8, kv_cache_tokens=256,
                                 gpu_memory_fraction=0.3)  # CUDA-only: no effect on CPU
    runner = ModelRunner(config)
    assert runner.graphs is None and runner.memory_profile is None
    assert runner.kv_cache.shape[0] == runner.num_blocks == 32
