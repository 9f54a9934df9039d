"""RoPE + the K/V cache write of a padded decode step in one launch
(``disagg/model/triton_rope.py``).

On every machine (CI): the PyTorch reference the kernel must equal (``rope_store_reference``:
``apply_rope``'s per-op roundings and ``store_kv``'s slots), and the model's side of it
(``Attention.forward`` hands un-rotated q/k to ``StaticDecodeMeta.rope_store``; the padded
engine gives the same bits with and without it). With triton: the kernel under the Triton
interpreter, in a child process with ``TRITON_INTERPRET=1`` (``triton_fixtures``), bit for
bit against the reference, the runner's device check, and the engine through it.
"""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys

import pytest
import torch
from triton_fixtures import (
    in_interpreter,
    round_like_the_gpu,
    run_interpreter_tests,
    spawns_interpreter,
)

import disagg.engine.llm_engine as engine_mod
from disagg import LLM, SamplingParams
from disagg.config import build_engine_config
from disagg.model.llama import apply_rope
from disagg.model.static_decode import RopeStoreFn, StaticDecodeMeta, paged_decode_reference
from disagg.model.triton_rope import bits_differ, rope_store_reference
from disagg.runner import ModelRunner

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _batch(dtype: torch.dtype, t: int = 5, hq: int = 4, hkv: int = 2, d: int = 64,
           bsz: int = 8, layout: str = "fused", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A decode batch as the model hands it over: q/k/v as column ranges of one fused output
    (``fused``), Qwen3's normed q|k heads split plus v apart (``qk``), or separate tensors
    (``separate``); cos/sin of spread positions; a layer view of a 3-layer cache; distinct
    slots, row 4 at the scratch block's offset 0 (a padding row)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "fused":
        fused = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
        q = fused[:, :hq * d].view(t, hq, d)
        k = fused[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = fused[:, (hq + hkv) * d:].view(t, hkv, d)
    elif layout == "qk":
        qk = (torch.randn(t, hq + hkv, d, generator=g) * 3).to(dtype)
        q, k = qk.split((hq, hkv), dim=1)
        v = (torch.randn(t, hkv, d, generator=g) * 3).to(dtype)
    else:
        q, k, v = ((torch.randn(t, h, d, generator=g) * 3).to(dtype) for h in (hq, hkv, hkv))
    positions = torch.tensor([0, 7, 130, 4095, 0][:t] + list(range(5, t)))
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions.float()[:, None] * inv_freq[None, :]] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    cache = torch.randn(6, 3, 2, hkv, bsz, d, generator=g).to(dtype)
    slot_block = torch.tensor([1, 3, 0, 1, 5][:t] + list(range(5, t)))
    slot_offset = torch.tensor([0, bsz - 1, 3, 1, 0][:t] + [0] * (t - 5))
    return q, k, v, cos, sin, cache, slot_block, slot_offset


# ---- the reference (CI) ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_rounds_every_op_and_writes_only_the_slots(dtype: torch.dtype) -> None:
    """What the kernel reproduces: x*cos, rot*sin and their sum each rounded to the dtype
    (apply_rope's torch ops), RoPE(k) and v in row t's slot, every other cache value kept."""
    q, k, v, cos, sin, cache, blk, off = _batch(dtype)
    before = cache.clone()
    out = rope_store_reference(q, k, v, cos, sin, cache[:, 1], blk, off)
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == dtype

    def by_op(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1).float()
        a = (x.float() * cos.float()).to(dtype).float()
        b = (rot * sin.float()).to(dtype).float()
        return (a + b).to(dtype)

    assert bits_differ(out, by_op(q)) == 0
    if dtype != torch.float32:
        # One rounding at the end instead gives other bits: the per-op roundings are what a
        # kernel must reproduce, and the bit-for-bit checks see a kernel that skips them.
        half = q.shape[-1] // 2
        rot = torch.cat((-q[..., half:], q[..., :half]), dim=-1).float()
        once = (q.float() * cos.float() + rot * sin.float()).to(dtype)
        assert bits_differ(out, once) > 0
    written = torch.zeros(cache.shape[:2] + cache.shape[4:5], dtype=torch.bool)  # [N, L, B]
    for t in range(q.shape[0]):
        b, o = int(blk[t]), int(off[t])
        assert bits_differ(cache[b, 1, 0, :, o], by_op(k)[t]) == 0
        assert bits_differ(cache[b, 1, 1, :, o], v[t]) == 0
        written[b, 1, o] = True
    kept = ~written[:, :, None, None, :, None].expand_as(cache)
    assert bits_differ(cache[kept], before[kept]) == 0


def _layer_attention(model_dir: str, dtype: str):  # type: ignore[no-untyped-def]
    config = build_engine_config(model_dir, dtype=dtype, tokens_per_block=8,
                                 kv_cache_tokens=256, max_model_len=64)
    return ModelRunner(config).model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch,qkv", [("llama", "fused"), ("llama", "apart"),
                                      ("qwen2", "fused"), ("qwen3", "fused"),
                                      ("qwen3", "fused, norms apart"), ("qwen3", "apart")])
def test_attention_hands_unrotated_heads_to_rope_store(tiny_dirs, arch: str, qkv: str,
                                                       dtype: str) -> None:
    """A layer's attention on a padded decode batch: with ``rope_store`` set it skips its own
    RoPE and passes q/k as they come (after Qwen3's norms) to it, and output and cache are the
    bits of the path without it. Every way q/k/v are produced: one fused GEMM, the fused GEMM
    with Qwen3's norms per q and k (``qk_norm_rows`` unset), three GEMMs."""
    model = _layer_attention(tiny_dirs[arch], dtype)
    att = model.model.layers["0"].self_attn
    if qkv != "fused":
        att.qk_norm_rows = None
    if qkv == "apart":
        att.qkv = None
    cfg = model.config
    t, tdtype = 5, getattr(torch, dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, cfg.hidden_size, generator=g).to(tdtype)
    positions = torch.tensor([3, 0, 17, 40, 0])
    cos, sin = model.rotary(positions, tdtype)
    cache = torch.randn(8, 2, att.num_kv_heads, 8, att.head_dim, generator=g).to(tdtype)
    tables = torch.tensor([[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0], [4, 5, 6, 0, 0, 0],
                           [0, 1, 2, 3, 4, 5], [7, 0, 0, 0, 0, 0]])
    seq_lens = positions + 1
    seq_lens[4] = 0  # a padding row
    blk = torch.tensor([1, 3, 6, 5, 7])
    off = positions % 8
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(q, k, v, cos_, sin_, kv_layer, slot_block, slot_offset):  # type: ignore[no-untyped-def]
        seen.append((q.clone(), k.clone()))
        return rope_store_reference(q, k, v, cos_, sin_, kv_layer, slot_block, slot_offset)

    outs, caches = [], []
    for store in (None, spy):
        kv = cache.clone()
        meta = StaticDecodeMeta(tables, seq_lens, blk, off, paged_decode_reference,
                                rope_store=store)
        with torch.inference_mode():
            outs.append(att(x, cos, sin, kv, meta))
        caches.append(kv)
    assert len(seen) == 1
    q_in, k_in = seen[0]
    # what reached rope_store is un-rotated: rotating it gives what the plain path wrote
    assert bits_differ(caches[0][blk, 0, :, off], apply_rope(k_in, cos, sin)) == 0
    assert q_in.shape == (t, att.num_heads, att.head_dim)
    assert bits_differ(outs[1], outs[0]) == 0
    assert bits_differ(caches[1], caches[0]) == 0


def _padded_llm(monkeypatch: pytest.MonkeyPatch, model_dir: str, store: RopeStoreFn | None,
                dtype: str = "float32") -> tuple[LLM, ModelRunner]:
    """An engine whose decode steps take the padded (graph bucket) path, run eagerly on CPU
    with ``paged_decode_reference``, and ``store`` as the graphs' ``rope_store``."""
    made: list[ModelRunner] = []

    def make(config, disagg=None):  # type: ignore[no-untyped-def]
        runner = ModelRunner(config, padded_decode=paged_decode_reference)
        made.append(runner)
        return runner

    with monkeypatch.context() as mp:
        mp.setattr(engine_mod, "make_executor", make)
        llm = LLM(model_dir, dtype=dtype, max_num_tokens=64, tokens_per_block=8,
                  kv_cache_tokens=2048, max_model_len=128, cuda_graph_max_batch_size=6)
    runner = made[0]
    assert runner.graphs is not None
    runner.graphs.rope_store = store
    return llm, runner


def _generate_padded(monkeypatch: pytest.MonkeyPatch, model_dir: str,
                     store: RopeStoreFn | None, dtype: str = "float32",
                     ) -> list[tuple[list[int], list[dict[int, float]]]]:
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(n)]
               for i, n in enumerate((3, 9, 17, 8, 5))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in (3, 5, 6, 4, 7)]
    llm, runner = _padded_llm(monkeypatch, model_dir, store, dtype)
    outs = llm.generate(prompts, params)
    assert runner.graphs is not None and runner.graphs.eager_runs > 0
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _counting(fn: RopeStoreFn) -> tuple[RopeStoreFn, list[int]]:
    calls: list[int] = []

    def spy(*args: torch.Tensor) -> torch.Tensor:
        calls.append(int(args[0].shape[0]))
        return fn(*args)

    return spy, calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_engine_with_the_reference_store_is_bit_identical(tiny_dirs, arch: str,
                                                                 monkeypatch) -> None:
    """The whole padded decode path with ``rope_store`` = the reference: the same greedy tokens
    and the same logprob values, to the bit, as without it."""
    want = _generate_padded(monkeypatch, tiny_dirs[arch], None)
    spy, calls = _counting(rope_store_reference)
    got = _generate_padded(monkeypatch, tiny_dirs[arch], spy)
    assert calls and set(calls) <= {1, 2, 4, 6}  # bucket sizes: the padded batches
    assert got == want


def test_cpu_never_imports_triton_rope(tiny_llama) -> None:
    """A CPU engine keeps apply_rope and never imports the kernel's module."""
    code = ("import sys; from disagg import LLM; llm = LLM(sys.argv[1], kv_cache_tokens=256); "
            "g = llm.engine.runner.graphs; assert g is None or g.rope_store is None; "
            "assert 'disagg.model.triton_rope' not in sys.modules, 'imported'")
    proc = subprocess.run([sys.executable, "-c", code, tiny_llama], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---- the kernel under the Triton interpreter ------------------------------------------------


@pytest.fixture(scope="module")
def tr():
    mp = pytest.MonkeyPatch()
    round_like_the_gpu(mp)
    yield importlib.import_module("disagg.model.triton_rope")
    mp.undo()


@spawns_interpreter
def test_kernel_in_interpreter_process() -> None:
    run_interpreter_tests(__file__)


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 96])  # a power of two and not (masked columns)
@pytest.mark.parametrize("layout", ["fused", "qk", "separate"])
def test_kernel_gives_the_reference_bits(tr, dtype: torch.dtype, d: int, layout: str) -> None:
    q, k, v, cos, sin, cache, blk, off = _batch(dtype, d=d, layout=layout, seed=d)
    want_cache = cache.clone()
    want = rope_store_reference(q, k, v, cos, sin, want_cache[:, 1], blk, off)
    got = tr.triton_rope_store(q, k, v, cos, sin, cache[:, 1], blk, off)
    assert got.is_contiguous() and got.shape == want.shape and got.dtype == dtype
    assert bits_differ(got, want) == 0
    assert bits_differ(cache, want_cache) == 0  # the slots, and nothing else (other layers)


@in_interpreter
def test_inputs_the_kernel_does_not_take_go_to_the_reference(tr, monkeypatch) -> None:
    """A cache of another dtype than q (a cast the kernel does not round like torch) and
    cos/sin broadcast from one row: the reference computes it, the kernel is not launched."""
    launched: list[int] = []
    real = tr._rope_store_kernel

    class Spy:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launched.append(1)
            return real[grid]

    monkeypatch.setattr(tr, "_rope_store_kernel", Spy())
    q, k, v, cos, sin, cache, blk, off = _batch(torch.bfloat16)
    for args in ((q, k, v, cos, sin, cache.float()[:, 1], blk, off),
                 (q, k, v, cos[:1], sin[:1], cache[:, 1], blk, off)):
        want_cache = args[5].clone()
        want = rope_store_reference(*args[:5], want_cache, blk, off)
        got = tr.triton_rope_store(*args)
        assert bits_differ(got, want) == 0 and bits_differ(args[5], want_cache) == 0
    assert launched == []
    tr.triton_rope_store(q, k, v, cos, sin, cache[:, 1], blk, off)
    assert launched == [1]


@in_interpreter
def test_the_runner_check_takes_a_good_kernel_and_refuses_a_bad_one(
        tr, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert tr.triton_rope_store_kernel(cpu, dtype, 4, 2, 64, 16) is tr.triton_rope_store
    kernel = tr.triton_rope_store

    def rounded_once(q, k, v, cos, sin, kv_layer, slot_block, slot_offset):  # type: ignore[no-untyped-def]
        # RoPE in float32 with one rounding at the end: close, but not PyTorch's bits
        def rope(x):  # type: ignore[no-untyped-def]
            return apply_rope(x.float(), cos.float(), sin.float()).to(x.dtype)
        return kernel(rope(q), rope(k), v, torch.ones_like(cos), torch.zeros_like(sin),
                      kv_layer, slot_block, slot_offset)

    monkeypatch.setattr(tr, "triton_rope_store", rounded_once)
    with caplog.at_level(logging.WARNING, logger="disagg.model"):
        assert tr.triton_rope_store_kernel(cpu, torch.bfloat16, 4, 2, 64, 16) is None
    assert "not used" in caplog.text and "bits" in caplog.text


@in_interpreter
@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                        ("qwen3", "float32")])
def test_engine_through_the_kernel_is_bit_identical(tr, tiny_dirs, arch: str, dtype: str,
                                                    monkeypatch) -> None:
    """The padded decode path (what the graphs replay) with the kernel, interpreted on CPU:
    the tokens and logprob values of the path without it, to the bit."""
    want = _generate_padded(monkeypatch, tiny_dirs[arch], None, dtype)
    spy, calls = _counting(tr.triton_rope_store)
    got = _generate_padded(monkeypatch, tiny_dirs[arch], spy, dtype)
    assert calls
    assert got == want

