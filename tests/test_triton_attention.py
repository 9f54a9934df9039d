"""Triton paged attention (``disagg/model/triton_attention.py``) on CPU under the Triton
interpreter, against a float64 PyTorch reference and the PyTorch paged-attention path.

The interpreter has to be chosen before triton is first imported (triton's own ``@jit``
helpers such as ``tl.cdiv`` are built then), and a process that imported triton for real
(a GPU test run) must keep compiled kernels. So the kernel tests run in a child pytest of
this file with ``TRITON_INTERPRET=1`` (``test_kernels_in_interpreter_process``); run
directly with ``TRITON_INTERPRET=1`` they run in place. Skipped where triton is not
installed (CI). The GPU build of the same kernels is checked by ``bench/gpu/check_attn.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch
from triton_fixtures import in_interpreter, run_interpreter_tests, spawns_interpreter

from disagg.model import attention
from disagg.model.attention import AttentionMetadata, paged_attention, triton_paged_attention


def _patch_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """triton 3.6's interpreter turns a scalar into an index with ``int(array of shape (1,))``,
    which numpy >= 2.4 refuses; loops with bounds loaded from memory need it. Take the one
    element instead (interpreter only; compiled kernels are not affected)."""
    from triton.runtime import interpreter as it

    orig = it._patch_lang_tensor

    def patched(tensor, scope) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(it, "_patch_lang_tensor", patched)


@pytest.fixture(scope="module")
def ta():
    """The kernels module, interpreted (this process started with TRITON_INTERPRET=1)."""
    mp = pytest.MonkeyPatch()
    _patch_interpreter(mp)
    mod = importlib.import_module("disagg.model.triton_attention")
    assert mod.HAS_TRITON
    yield mod
    mp.undo()


@spawns_interpreter
def test_kernels_in_interpreter_process() -> None:
    run_interpreter_tests(__file__)


def _cache(n: int, hkv: int, b: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # A layer view of a 2-layer cache: dim 0 is not contiguous, as in the model.
    full = torch.randn(n, 2, 2, hkv, b, d, generator=g).to(dtype)
    return full[:, 1]


def _tables(lens: list[int], b: int, n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Random distinct blocks per sequence, padded with 0 to the widest."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-x // b) for x in lens))
    return torch.stack([torch.randperm(n, generator=g)[:width] for _ in lens]).to(dtype)


def _tol(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 3e-3


@in_interpreter
@pytest.mark.parametrize("b,d,hq,hkv,splits,dtype", [
    (16, 64, 8, 2, 1, torch.float32),
    (16, 64, 8, 2, 3, torch.float32),
    (8, 128, 4, 4, 5, torch.float32),     # MHA, many splits (some empty)
    (32, 64, 8, 1, 2, torch.float16),     # MQA, half precision
    (64, 32, 6, 2, None, torch.float32),  # G = 3 (padded), automatic splits
    (12, 80, 4, 2, 2, torch.float32),     # block size and head_dim not powers of two
])
def test_decode_matches_reference(ta, b, d, hq, hkv, splits, dtype) -> None:
    lens = [1, 0, 17, 2 * b + 3, 5 * b, 70]
    n = 48
    kv = _cache(n, hkv, b, d, dtype)
    bt = _tables(lens, b, n, torch.int32)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    out = ta.paged_decode(q, kv, bt, sl, 0.3, num_splits=splits, tile_n=16)
    ref = ta.reference_attention(q, kv, bt, lens, list(range(len(lens) + 1)), 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=_tol(dtype), rtol=_tol(dtype))
    assert torch.all(out[1] == 0)  # seq_len 0: a padding row of a graph bucket reads nothing


@in_interpreter
def test_decode_split_count_does_not_change_result(ta) -> None:
    lens = [33, 1, 64]
    kv = _cache(16, 2, 16, 64, torch.float32)
    bt = _tables(lens, 16, 16, torch.int64)  # int64 tables work as well as int32
    q = torch.randn(3, 4, 64)
    sl = torch.tensor(lens, dtype=torch.int64)
    outs = [ta.paged_decode(q, kv, bt, sl, 0.125, num_splits=k, tile_n=16) for k in (1, 2, 4, 7)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


@in_interpreter
def test_decode_writes_into_out_view(ta) -> None:
    lens = [20, 9]
    kv = _cache(8, 2, 8, 32, torch.float32)
    bt = _tables(lens, 8, 8, torch.int32)
    q = torch.randn(2, 4, 32)
    out = torch.full((5, 4, 32), 7.0)
    ta.paged_decode(q, kv, bt, torch.tensor(lens, dtype=torch.int32), 0.2, num_splits=2,
                    out=out[1:3], tile_n=16)
    ref = ta.reference_attention(q, kv, bt, lens, [0, 1, 2], 0.2)
    torch.testing.assert_close(out[1:3].double(), ref, atol=2e-5, rtol=2e-5)
    assert torch.all(out[0] == 7.0) and torch.all(out[3:] == 7.0)


@in_interpreter
def test_choose_num_splits_depends_on_shapes_only(ta) -> None:
    assert ta.choose_num_splits(1, 8, 256, 16) == 33          # 2 * 132 SMs / 8 programs
    assert ta.choose_num_splits(1, 8, 64, 16) == 16           # 1024 keys = 16 tiles of 64
    assert ta.choose_num_splits(64, 8, 64, 16) == 1
    assert ta.choose_num_splits(1, 8, 1, 16) == 1              # one tile of keys at most
    assert ta.choose_num_splits(1, 1, 10_000, 16) == ta.MAX_DECODE_SPLITS


@in_interpreter
@pytest.mark.parametrize("b,d,hq,hkv,dtype,config", [
    (16, 64, 8, 2, torch.float32, (16, 16, 4, 1)),     # 4 tokens x 4 heads per program
    (8, 32, 4, 1, torch.float16, (32, 16, 4, 1)),      # MQA
    (32, 64, 6, 2, torch.float32, (16, 32, 4, 1)),     # G = 3: 5 tokens x 3 heads, 1 row spare
    (12, 80, 2, 2, torch.float32, None),               # default config, odd sizes
])
def test_prefill_matches_reference(ta, b, d, hq, hkv, dtype, config) -> None:
    # (context already cached, new tokens): whole prompts, chunks after a cached prefix,
    # a 1-token chunk, chunks crossing block and tile boundaries.
    chunks = [(0, 5), (37, 3), (0, 1), (20, 30), (b, 2 * b + 1), (3, 0 + 9)]
    lens = [c + n for c, n in chunks]
    nd = 2  # rows [0, 2) belong to decodes: the prefill rows start at an offset
    qsl = [nd]
    for _, n in chunks:
        qsl.append(qsl[-1] + n)
    t = qsl[-1]
    n_blocks = 64
    kv = _cache(n_blocks, hkv, b, d, dtype)
    bt = _tables(lens, b, n_blocks, torch.int32)
    q = torch.randn(t, hq, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = torch.full_like(q, 5.0)
    ta.paged_prefill(q, kv, bt, torch.tensor(lens, dtype=torch.int32),
                     torch.tensor(qsl, dtype=torch.int32), t - nd, 0.25, out=out, config=config)
    ref = ta.reference_attention(q, kv, bt, lens, qsl, 0.25)
    torch.testing.assert_close(out[nd:].double(), ref[nd:], atol=_tol(dtype), rtol=_tol(dtype))
    assert torch.all(out[:nd] == 5.0)  # rows outside the chunks are left alone


def _batch(seqs: list[tuple[int, int]], num_decodes: int, b: int, n_blocks: int, hq: int,
           hkv: int, d: int, with_tensors: bool):
    """q/k/v, a cache with every context position filled and the metadata of one step.

    ``seqs``: (cached tokens, new tokens) per sequence, decodes first."""
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(n_blocks, 2, hkv, b, d, generator=g)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, qsl, lens, sb, so = [], [0], [], [], []
    for ctx, n in seqs:
        nb = -(-(ctx + n) // b)
        tables.append([perm.pop() for _ in range(nb)])
        for p in range(ctx, ctx + n):
            sb.append(tables[-1][p // b])
            so.append(p % b)
        qsl.append(qsl[-1] + n)
        lens.append(ctx + n)
    width = max(len(x) for x in tables)
    bt = torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.int64)
    t = qsl[-1]
    extra = {}
    if with_tensors:
        extra = dict(seq_lens_t=torch.tensor(lens, dtype=torch.int32),
                     query_start_loc_t=torch.tensor(qsl, dtype=torch.int32),
                     max_query_len=max(n for _, n in seqs))
    meta = AttentionMetadata(
        num_decodes=num_decodes, query_start_loc=qsl, seq_lens=lens, block_tables=bt,
        slot_block=torch.tensor(sb), slot_offset=torch.tensor(so),
        decode_seq_lens=torch.tensor(lens[:num_decodes]), **extra)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    return q, k, v, kv, meta


@in_interpreter
@pytest.mark.parametrize("with_tensors", [True, False])
def test_mixed_batch_matches_pytorch_path(ta, with_tensors) -> None:
    # 3 decodes, then a whole prompt, a chunk after a cached prefix and another prompt.
    seqs = [(9, 1), (0, 1), (40, 1), (0, 13), (21, 6), (0, 3)]
    q, k, v, kv, meta = _batch(seqs, 3, 8, 40, 8, 2, 32, with_tensors)
    kv_t = kv.clone()
    ref = paged_attention(q, k, v, kv, meta, 0.2)          # PyTorch path (CPU)
    attention.write_kv(kv_t, k, v, meta)
    out = triton_paged_attention(q, kv_t, meta, 0.2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@in_interpreter
def test_model_greedy_tokens_same_through_triton_path(ta, tiny_llama, monkeypatch) -> None:
    """The whole engine with ``paged_attention`` dispatching to the Triton kernels (as on
    CUDA), here interpreted on CPU: the same greedy tokens as the CPU path."""
    from disagg import LLM, SamplingParams

    prompts = ["Hello there, how are", "a", "The quick brown fox jumps over the lazy dog"]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm = LLM(tiny_llama, max_num_tokens=16, tokens_per_block=8, kv_cache_tokens=1024)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    calls = []
    orig = attention.triton_paged_attention

    def spy(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    monkeypatch.setattr(attention, "_triton_applies", lambda q, kv_layer: True)
    monkeypatch.setattr(attention, "triton_paged_attention", spy)
    llm2 = LLM(tiny_llama, max_num_tokens=16, tokens_per_block=8, kv_cache_tokens=1024)
    got = [o.outputs[0].token_ids for o in llm2.generate(prompts, params)]
    assert calls
    assert got == expected


def test_runner_fills_kernel_metadata(tiny_llama) -> None:
    """prepare_inputs gives the CUDA kernels their device tensors (int32), matching the
    lists the CPU path reads (no triton needed)."""
    from disagg.config import build_engine_config
    from disagg.runner import ModelRunner
    from disagg.scheduler import ScheduledRequest, SchedulerOutput

    runner = ModelRunner(build_engine_config(tiny_llama, tokens_per_block=4,
                                             kv_cache_tokens=256))
    sched = SchedulerOutput(scheduled=[
        ScheduledRequest(request_id="d", token_ids=[5], start_pos=6, block_ids=[3, 4],
                         sample=True),
        ScheduledRequest(request_id="p", token_ids=[1, 2, 3, 4, 5], start_pos=2,
                         block_ids=[7, 8], sample=True),
    ], num_decodes=1, num_scheduled_tokens=6, preempted=[], num_running=2, num_waiting=0)
    meta = runner.prepare_inputs(sched).meta
    assert meta.seq_lens_t.dtype == torch.int32 and meta.seq_lens_t.tolist() == [7, 7]
    assert meta.query_start_loc_t.dtype == torch.int32
    assert meta.query_start_loc_t.tolist() == meta.query_start_loc == [0, 1, 6]
    assert meta.max_query_len == 5


def test_triton_only_on_cuda(monkeypatch) -> None:
    q = torch.zeros(2, 4, 16)
    kv = torch.zeros(4, 2, 2, 8, 16)
    assert not attention._triton_applies(q, kv)  # CPU tensors never take the Triton path
    monkeypatch.setenv("DISAGG_CUDA_ATTENTION", "torch")
    attention.triton_available.cache_clear()
    try:
        assert not attention.triton_available()
    finally:
        monkeypatch.delenv("DISAGG_CUDA_ATTENTION")
        attention.triton_available.cache_clear()
    assert os.environ.get("DISAGG_CUDA_ATTENTION") is None

