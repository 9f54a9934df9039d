"""Scoring: prompt logprobs computed during prefill equal transformers' log-softmax, with
chunked prefill, a second identical request (no prefix-cache shortcut), and beside requests
that do not ask."""

from __future__ import annotations

import pytest
import torch

from disagg import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 13, 2, 7, 7, 8, 21, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
            30, 31, 40, 41, 42, 43, 44], [4, 5, 6], [12, 30, 2, 9, 9, 9, 17, 3, 40]]


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def test_prompt_logprobs_equal_transformers(tiny_llama: str) -> None:
    # max_num_tokens 16, blocks of 8: the 31-token prompt is prefilled in chunks.
    llm = LLM(tiny_llama, max_num_tokens=16, tokens_per_block=8, kv_cache_tokens=2048)
    asks = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=2)
    for rnd in range(2):  # the second round would hit the prefix cache
        outs = llm.generate([*PROMPTS, PROMPTS[0]], [asks] * len(PROMPTS) + [plain])
        assert outs[-1].prompt_logprobs is None
        for prompt, out in zip(PROMPTS, outs, strict=False):
            ref = hf_prompt_logprobs(tiny_llama, prompt)
            lps = out.prompt_logprobs
            assert lps is not None and len(lps) == len(prompt) and lps[0] is None
            for p in range(1, len(prompt)):
                entry = lps[p]
                assert entry is not None
                assert entry[prompt[p]] == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-3)
                want_rank = int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
                assert out.prompt_logprob_ranks is not None
                assert abs(out.prompt_logprob_ranks[p] - want_rank) <= 1  # (float near-ties)
                top = torch.topk(ref[p - 1], 3)
                for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                    assert entry[t] == pytest.approx(v, abs=1e-3)
            assert out.num_cached_tokens == 0, rnd  # no prefix hit skipped positions
    assert llm.engine.stats().steps_total > 4  # chunked


def test_prompt_logprobs_with_pipeline_parallel_ranks(tiny_llama: str) -> None:
    """The last stage computes the prompt-logprob rows and sends them to rank 0 with the
    sampled ones: the same values as one rank."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    one = LLM(tiny_llama, max_num_tokens=16, tokens_per_block=8, kv_cache_tokens=2048)
    want = [o.prompt_logprobs for o in one.generate(PROMPTS, params)]
    two = LLM(tiny_llama, max_num_tokens=16, tokens_per_block=8, kv_cache_tokens=2048,
              pipeline_parallel_size=2)
    try:
        got = [o.prompt_logprobs for o in two.generate(PROMPTS, params)]
    finally:
        two.engine.shutdown()
    for g, w in zip(got, want, strict=True):
        assert g is not None and w is not None and g[0] is None and w[0] is None
        for a, b in zip(g[1:], w[1:], strict=True):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
