"""The compiled decode stack (``model/cpu_decoder.py``, ``csrc/decoder.cpp``): a pure decode
step of a GGUF-blocks model in one call gives the layer-by-layer forward's hidden states (the
same kernels, float rounding order aside), for one sequence and for batches of different
lengths; which models and steps it takes; bad block tables refused before the cache is
touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from test_gguf import PROMPTS  # noqa: E402
from test_gguf_quantized import (  # noqa: E402
    KERNEL,
    _models,
    _teacher_forced,
    _write,
    cache,  # noqa: F401 (a fixture)
    teacher_forced_cache,
)

from disagg.model.attention import AttentionMetadata  # noqa: E402
from disagg.model.cpu_decoder import _library, cpu_decoder, why_not  # noqa: E402
from disagg.model.loader import allocate_kv_cache  # noqa: E402

pytestmark = pytest.mark.skipif(KERNEL is None or _library() is None,
                                reason="the CPU kernels did not build here")

MIXED = {"q_proj.weight": QT.Q4_0, "k_proj.weight": QT.Q4_0, "v_proj.weight": QT.Q4_0,
         "gate_proj.weight": QT.Q4_1, "up_proj.weight": QT.Q4_1, "down_proj.weight": QT.Q8_0}


def _decode_logits(model: torch.nn.Module, tokens: list[int], prompt_len: int,
                   stack: bool, dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, int]:
    """``_teacher_forced``'s logits on a cache of our own (of ``dtype``), with the stack on it
    or not; and how many forwards the stack ran."""
    kv = teacher_forced_cache(model, tokens, dtype)
    model.cpu_decoder = cpu_decoder(model, kv) if stack else None
    ran = 0
    if stack:
        assert model.cpu_decoder is not None
        inner = model.cpu_decoder.forward

        def counted(*args: object) -> torch.Tensor:
            nonlocal ran
            ran += 1
            return inner(*args)  # type: ignore[arg-type]

        model.cpu_decoder.forward = counted  # type: ignore[method-assign]
    try:
        return _teacher_forced(model, tokens, prompt_len, kv), ran
    finally:
        model.cpu_decoder = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_sequence_matches_the_layer_loop(cache: Path, tmp_path: Path,  # noqa: F811
                                             dtype: torch.dtype) -> None:
    """Teacher-forced decode steps (one token a forward after the prompt) with the stack and
    without, on a float32 or 16-bit cache (kv_cache_dtype): the same logits to float rounding,
    the same greedy tokens; the prefill stays in the layer loop."""
    quant, _ = _models(_write(tmp_path, "mixed", MIXED, tie=True))
    tokens = [5, 9, 200, 31, 77, 4, 300, 12, 8, 66, 2, 140, 141, 7, 99, 3, 250, 17, 18, 19]
    ref, ran_ref = _decode_logits(quant, tokens, 5, stack=False, dtype=dtype)
    got, ran = _decode_logits(quant, tokens, 5, stack=True, dtype=dtype)
    assert (ran_ref, ran) == (0, len(tokens) - 5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 * float(ref.abs().max()))
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_batched_decodes_through_the_engine(cache: Path, tmp_path: Path) -> None:  # noqa: F811
    """Several prompts of different lengths decoded together (batches of 1..4 sequences, each
    with its own block table and length): the engine's greedy tokens with the stack are those
    of the layer loop."""
    from disagg import LLM, SamplingParams

    path = _write(tmp_path, "batch", MIXED)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for stack in (True, False):
        llm = LLM(str(path), max_num_tokens=256, kv_cache_tokens=1024)
        model = llm.engine.runner.model
        assert model.cpu_decoder is not None
        if not stack:
            model.cpu_decoder = None
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)])
        llm.shutdown()
    assert outs[0] == outs[1]


def test_which_models_it_takes(cache: Path, tmp_path: Path) -> None:  # noqa: F811
    """A linear that is not blocks (Q5_0 dequantized to float32), the float32 import, or a
    float64 cache: the layer loop, with the reason."""
    path = _write(tmp_path, "q5", {"v_proj.weight": QT.Q5_0})
    quant, f32 = _models(path)
    kv = allocate_kv_cache(quant.config, 3, 16, torch.float32, "cpu")
    assert why_not(quant, kv) == "a linear that is not GGUF blocks"
    assert why_not(f32, kv) == "a linear that is not GGUF blocks"
    assert cpu_decoder(quant, kv) is None
    ok, _ = _models(_write(tmp_path, "ok", MIXED))
    wide = allocate_kv_cache(ok.config, 3, 16, torch.float64, "cpu")
    assert why_not(ok, wide) == "not a float32, bfloat16 or float16 CPU cache of K and V"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert why_not(ok, allocate_kv_cache(ok.config, 3, 16, dtype, "cpu")) is None


def test_bad_block_table_is_refused(cache: Path, tmp_path: Path) -> None:  # noqa: F811
    quant, _ = _models(_write(tmp_path, "bad", MIXED))
    kv = allocate_kv_cache(quant.config, 2, 16, torch.float32, "cpu")
    dec = cpu_decoder(quant, kv)
    assert dec is not None
    before = kv.clone()
    x = torch.randn(1, quant.config.hidden_size)
    cos, sin = quant.rotary(torch.tensor([20]), torch.float32)

    def meta(table: list[int], seq_len: int, slot: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=1, query_start_loc=[0, 1], seq_lens=[seq_len],
            block_tables=torch.tensor([table]), slot_block=torch.tensor([slot]),
            slot_offset=torch.tensor([4]), decode_seq_lens=torch.tensor([seq_len]))

    with pytest.raises(RuntimeError, match="block id out of range"):
        dec.forward(x, cos, sin, meta([0, 7], 21, 1))
    with pytest.raises(RuntimeError, match="sequence length out of range"):
        dec.forward(x, cos, sin, meta([0, 1], 40, 1))
    with pytest.raises(RuntimeError, match="slot out of range"):
        dec.forward(x, cos, sin, meta([0, 1], 21, 2))
    assert torch.equal(kv, before)
    out = dec.forward(x, cos, sin, meta([0, 1], 21, 1))
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
    assert not torch.equal(kv, before)  # the token's K/V written
