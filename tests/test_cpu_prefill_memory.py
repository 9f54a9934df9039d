"""A CPU worker's prefill memory (issue 43, item 3): chunked prefill by default on CPU
(``DEFAULT_CPU_MAX_NUM_TOKENS``), the chunk-over-context attention without a ``[G*n, L]`` mask
copy (``attention._attend_chunk``), and the heap handed back after a prefill step
(``runner.TRIM_AFTER_TOKENS``), oneDNN's primitive cache bounded (``ONEDNN_PRIMITIVE_CACHE``), a
16-bit KV cache (``kv_cache_dtype``); outputs stay those of a whole-prompt step."""

from __future__ import annotations

import os
import random

import pytest
import torch

from disagg import SamplingParams
from disagg.config import DEFAULT_CPU_MAX_NUM_TOKENS, SchedulerConfig, build_engine_config
from disagg.engine import LLMEngine
from disagg.model.attention import _attend_chunk, _attend_grouped
from disagg.runner import ONEDNN_PRIMITIVE_CACHE, TRIM_AFTER_TOKENS


def test_cpu_default_chunks_the_prefill(tiny_llama: str) -> None:
    cfg = build_engine_config(tiny_llama, device="cpu")
    assert cfg.scheduler.max_num_tokens == DEFAULT_CPU_MAX_NUM_TOKENS
    assert cfg.scheduler.enable_chunked_context
    # what the user sets wins
    assert build_engine_config(tiny_llama, device="cpu",
                               max_num_tokens=4096).scheduler.max_num_tokens == 4096
    # without chunking a smaller budget would refuse long prompts: the general default stays
    no_chunks = build_engine_config(tiny_llama, device="cpu", enable_chunked_context=False)
    assert no_chunks.scheduler.max_num_tokens == SchedulerConfig().max_num_tokens
    # CUDA keeps it (the config is only built here, nothing runs on the device)
    cuda = build_engine_config(tiny_llama, device="cuda")
    assert cuda.scheduler.max_num_tokens == SchedulerConfig().max_num_tokens


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("n,ctx", [(5, 11), (32, 96), (1, 40)])
def test_chunk_attention_is_the_grouped_one(hq: int, hkv: int, n: int, ctx: int) -> None:
    g = torch.Generator().manual_seed(hq * 100 + n + ctx)
    d, length = 16, ctx + n
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(hkv, 1, length, d, generator=g)
    v = torch.randn(hkv, 1, length, d, generator=g)
    keys = torch.arange(length)
    mask = keys[None, :] <= torch.arange(n)[:, None] + ctx  # [n, L]
    want = _attend_grouped(q.unsqueeze(0), k, v, mask.unsqueeze(0), d ** -0.5)[0]
    got = _attend_chunk(q, k, v, mask, d ** -0.5)
    assert got.shape == want.shape == (n, hq, d)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # query j sees keys 0 .. ctx + j only: a change beyond them changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[:, :, ctx + 1:] += 5.0
    v2[:, :, ctx + 1:] -= 3.0
    assert torch.equal(_attend_chunk(q, k2, v2, mask, d ** -0.5)[0], got[0])


def _greedy(model: str, prompts: list[list[int]], **opts: object) -> list[list[int]]:
    eng = LLMEngine.from_options(model, device="cpu", tokens_per_block=16, max_model_len=1024,
                                 kv_cache_tokens=2048, enable_prefix_caching=False, **opts)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8,
                                                   ignore_eos=True))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_chunked_prefill_tokens_are_the_whole_prompts(tiny_llama: str) -> None:
    rng = random.Random(7)
    # longer than the CPU default (several chunks, the last one short), one chunk exactly,
    # and a short one
    prompts = [[rng.randrange(3, 200) for _ in range(n)]
               for n in (DEFAULT_CPU_MAX_NUM_TOKENS + 300, DEFAULT_CPU_MAX_NUM_TOKENS, 37)]
    whole = _greedy(tiny_llama, prompts, max_num_tokens=4096)
    assert _greedy(tiny_llama, prompts) == whole  # the CPU default: chunks of 256
    assert _greedy(tiny_llama, prompts, max_num_tokens=96) == whole  # many small chunks


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_16bit_cache_gives_the_same_tokens_however_the_prompt_is_chunked(
        tiny_llama: str, kv_dtype: str) -> None:
    """kv_cache_dtype on a float32 model (issue 43, item 3): the cache holds 16-bit K/V, and a
    prompt's first chunk attends to its own K/V as the cache holds them (rounded), so whole
    prompts, chunks and the decode kernel all see the same numbers."""
    eng = LLMEngine.from_options(tiny_llama, device="cpu", kv_cache_tokens=256,
                                 kv_cache_dtype=kv_dtype)
    assert eng.runner.kv_cache.dtype == getattr(torch, kv_dtype)
    assert eng.config.kv_dtype == kv_dtype and eng.config.dtype == "float32"
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (300, 97, 5)]
    whole = _greedy(tiny_llama, prompts, max_num_tokens=4096, kv_cache_dtype=kv_dtype)
    assert _greedy(tiny_llama, prompts, max_num_tokens=64, kv_cache_dtype=kv_dtype) == whole


def test_cpu_runner_bounds_onednn_primitive_cache(tiny_llama: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU engine sets oneDNN's primitive cache and ideep's LRU of matmuls to
    ONEDNN_PRIMITIVE_CACHE entries unless the user set them (both read their variable at first
    use, after the engine starts)."""
    names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    LLMEngine.from_options(tiny_llama, device="cpu", kv_cache_tokens=256)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_PRIMITIVE_CACHE)
    assert os.environ["LRU_CACHE_CAPACITY"] == "64"  # the user's


def test_prefill_steps_hand_the_heap_back(tiny_llama: str) -> None:
    eng = LLMEngine.from_options(tiny_llama, device="cpu", tokens_per_block=16,
                                 max_model_len=1024, kv_cache_tokens=2048,
                                 enable_prefix_caching=False, max_num_tokens=128)
    runner = eng.runner
    if runner._trim is None:
        pytest.skip("not glibc: no malloc_trim")
    calls: list[int] = []
    real = runner._trim
    runner._trim = lambda pad: calls.append(pad) or real(pad)
    big = TRIM_AFTER_TOKENS * 4  # two chunks of 128: two trims
    eng.add_request("a", list(range(3, 3 + big)),
                    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    assert steps == 2 + 5  # two prefill chunks, then five decode steps
    assert calls == [0, 0]  # the chunks only; decode steps never trim
