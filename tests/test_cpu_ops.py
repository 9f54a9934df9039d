"""The compiled elementwise CPU kernels (``disagg.model.cpu_ops``): the residual add + RMSNorm
against ``rms_norm_reference`` (to float32 rounding), RoPE + the K/V write bit for bit against
``apply_rope`` + ``write_kv``, and a model run with them against one without."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from disagg.model.attention import AttentionMetadata, write_kv  # noqa: E402
from disagg.model.cpu_ops import elementwise_kernel, rope_store_applies  # noqa: E402
from disagg.model.llama import apply_rope, rms_norm_reference  # noqa: E402

OPS = elementwise_kernel()
needs_ops = pytest.mark.skipif(OPS is None, reason="no C++ compiler (elementwise kernel)")


@needs_ops
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300: split over threads
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_is_the_reference(rows: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    big = torch.randn(rows, 3 * 96, generator=g) * 3
    x = big[:, 96:192]  # rows at a stride: a column range of a fused output
    residual = torch.randn(rows, 96, generator=g) if with_residual else None
    w = torch.randn(96, generator=g)
    with torch.inference_mode():
        out, h = OPS.add_rms_norm(x, w, 1e-5, residual)
        ref, ref_h = rms_norm_reference(x, w, 1e-5, residual)
    assert torch.equal(h, ref_h)  # the add is one rounding either way
    if residual is None:
        assert h is x
    # the sum of squares in double: the last bits of the scale may differ
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=2e-6)
    assert out.is_contiguous() and out.shape == (rows, 96)


@needs_ops
def test_add_rms_norm_leaves_other_inputs_to_the_reference() -> None:
    x = torch.randn(3, 4, 16)  # per-head norms (3-D)
    w = torch.randn(16)
    out, h = OPS.add_rms_norm(x, w, 1e-6)
    assert torch.equal(out, rms_norm_reference(x, w, 1e-6)[0]) and h is x
    xb, wb = x[0].bfloat16(), w.bfloat16()
    assert torch.equal(OPS.add_rms_norm(xb, wb, 1e-6)[0], rms_norm_reference(xb, wb, 1e-6)[0])
    xg = torch.randn(2, 16, requires_grad=True)  # autograd: the reference records it
    out, _ = OPS.add_rms_norm(xg, w, 1e-6)
    assert out.requires_grad


def _rope_case(t: int, hq: int, hkv: int, d: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    qk = fused[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    v = fused[:, (hq + hkv) * d:].view(t, hkv, d)
    pos = torch.randperm(4096, generator=g)[:t].float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    n, b = 40, 8
    slots = torch.randperm(n * b, generator=g)[:t]
    return qk, v, cos, sin, torch.zeros(n, 2, hkv, b, d), slots // b, slots % b


@needs_ops
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 9, 3, 64), (5, 4, 4, 32), (130, 6, 2, 16)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_store_is_apply_rope_and_write_kv_bit_for_bit(t: int, hq: int, hkv: int, d: int,
                                                           cache_dtype: torch.dtype) -> None:
    """float32 q/k/v; the cache float32 or 16-bit (kv_cache_dtype: each value rounded to
    nearest even, as write_kv's .to)."""
    qk, v, cos, sin, kv, blocks, offsets = _rope_case(t, hq, hkv, d, seed=t)
    kv = kv.to(cache_dtype)
    ref_qk = apply_rope(qk, cos, sin)
    ref_kv = kv.clone()
    meta = AttentionMetadata(0, [0, t], [t], torch.zeros(1, 1, dtype=torch.long), blocks,
                             offsets, torch.zeros(0, dtype=torch.long))
    write_kv(ref_kv, ref_qk[:, hq:], v, meta)
    assert rope_store_applies(qk, v, cos, sin, kv, blocks, offsets)
    with torch.inference_mode():
        OPS.rope_store(qk, v, cos, sin, kv, blocks, offsets)
    assert torch.equal(qk, ref_qk)  # in place, the same bits
    assert torch.equal(kv, ref_kv)  # only the slots written, with the same bits


@needs_ops
def test_rope_store_checks_slots_before_writing() -> None:
    qk, v, cos, sin, kv, blocks, offsets = _rope_case(3, 2, 1, 8, seed=0)
    before = qk.clone()
    for bad_blocks, bad_offsets, what in [(blocks + 40, offsets, "block id"),
                                          (blocks, offsets + 8, "block offset")]:
        with pytest.raises(RuntimeError, match=what):
            OPS.rope_store(qk, v, cos, sin, kv, bad_blocks, bad_offsets)
        assert torch.equal(qk, before) and not kv.any()


def test_rope_store_applies_only_to_its_layouts() -> None:
    qk, v, cos, sin, kv, blocks, offsets = _rope_case(2, 2, 1, 8, seed=0)
    assert rope_store_applies(qk, v, cos, sin, kv, blocks, offsets)
    assert not rope_store_applies(qk.double(), v, cos, sin, kv, blocks, offsets)
    assert not rope_store_applies(qk, v, cos, sin, kv, blocks.int(), offsets)
    assert not rope_store_applies(qk, v, cos.expand(2, 3, 8), sin, kv, blocks, offsets)
    assert not rope_store_applies(qk.transpose(1, 2), v, cos, sin, kv, blocks, offsets)
    assert rope_store_applies(qk, v, cos, sin, kv.bfloat16(), blocks, offsets)
    assert rope_store_applies(qk, v, cos, sin, kv.half(), blocks, offsets)
    assert not rope_store_applies(qk, v, cos, sin, kv.double(), blocks, offsets)


@needs_ops
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_with_the_kernels_decodes_as_without(tiny_dirs, arch) -> None:
    """Greedy tokens with the elementwise kernels (the runner sets them on CPU) equal those of
    the PyTorch ops; with RoPE + K/V write alone (bit for bit) the KV cache is identical."""
    from disagg import SamplingParams
    from disagg.engine import LLMEngine

    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(norm: bool, rope: bool) -> tuple[list[list[int]], torch.Tensor]:
        eng = LLMEngine.from_options(tiny_dirs[arch], max_num_tokens=64, tokens_per_block=8,
                                     kv_cache_tokens=1024, max_model_len=128,
                                     enable_prefix_caching=False)
        model = eng.runner.model
        assert model.workspace.rope_store is OPS  # the runner's CPU default
        if not norm:
            model.use_norm_kernel(None)
        if not rope:
            model.workspace.rope_store = None
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        done: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[f"r{i}"] for i in range(len(prompts))], eng.runner.kv_cache.clone()

    plain_tokens, plain_kv = run(norm=False, rope=False)
    rope_tokens, rope_kv = run(norm=False, rope=True)
    assert rope_tokens == plain_tokens and torch.equal(rope_kv, plain_kv)
    both_tokens, both_kv = run(norm=True, rope=True)
    assert both_tokens == plain_tokens
    torch.testing.assert_close(both_kv, plain_kv, atol=1e-5, rtol=1e-5)
