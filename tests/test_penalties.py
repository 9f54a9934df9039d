"""Penalties, logit_bias and min_p: the batched sampler equals a per-row reference of the rule
(vLLM's order), rows without them are untouched, and greedy generation with them equals the
same rule applied to transformers' logits."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from disagg import LLM
from disagg.request import SamplingParams, SamplingParamsError
from disagg.sampler import Sampler

V = 61


def reference_logits(x: torch.Tensor, p: SamplingParams, prompt: list[int],
                     out: list[int]) -> torch.Tensor:
    """The rule, one row, one token at a time: logit_bias, repetition (transformers:
    positive logits divided, negative multiplied, every token of prompt + output), then
    OpenAI's frequency / presence on the output's counts."""
    x = x.clone().double()
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(out):
        r = p.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(out).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def _random_params(rng: random.Random, **kw: object) -> SamplingParams:
    if rng.random() < 0.3:
        return SamplingParams(**kw)  # type: ignore[arg-type]
    bias = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(3))}
    return SamplingParams(
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.3, 3)]),
        logit_bias=bias, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(6))
def test_batched_greedy_equals_the_per_row_rule(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randrange(1, 12)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 4
    params = [_random_params(rng, temperature=0.0, logprobs=rng.choice([None, 2]))
              for _ in range(n)]
    hist = [([rng.randrange(V) for _ in range(rng.randrange(1, 20))],
             [rng.randrange(V) for _ in range(rng.randrange(0, 15))]) for _ in range(n)]
    out = Sampler().sample(logits, params, [len(o) for _, o in hist], None, hist)
    assert out.errors == [None] * n
    for i in range(n):
        ref = reference_logits(logits[i], params[i], *hist[i])
        assert ref[out.token_ids[i]] == pytest.approx(ref.max().item(), abs=1e-5)
        if params[i].logprobs is not None:  # the raw distribution's, before penalties
            raw = torch.log_softmax(logits[i], -1)
            lp = out.logprobs[i]
            assert lp is not None
            assert lp[out.token_ids[i]] == pytest.approx(raw[out.token_ids[i]].item(),
                                                         abs=1e-5)


def test_sampled_rows_draw_from_the_penalized_distribution() -> None:
    """A seeded sampled row equals the plain sampler on the reference logits."""
    rng = random.Random(7)
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(7)) * 2
    params = [_random_params(rng, temperature=0.9, top_p=0.9, seed=i) for i in range(8)]
    hist = [([rng.randrange(V) for _ in range(9)], [rng.randrange(V) for _ in range(5)])
            for _ in range(8)]
    got = Sampler().sample(logits, params, [5] * 8, None, hist).token_ids
    plain = [SamplingParams(temperature=0.9, top_p=0.9, seed=i) for i in range(8)]
    ref_x = torch.stack([reference_logits(logits[i], params[i], *hist[i]).float()
                         for i in range(8)])
    assert got == Sampler().sample(ref_x, plain, [5] * 8).token_ids


def test_min_p_keeps_only_tokens_above_its_share_of_the_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen: set[int] = set()
    for s in range(200):
        p = SamplingParams(temperature=1.0, min_p=0.35, seed=s)
        seen.add(Sampler().sample(logits, [p], [0]).token_ids[0])
    assert seen == {0, 1}  # 0.3 >= 0.35 * 0.5; 0.15 is not
    # min_p 0 (off) in the same batch as a row with it: the other row still sees all tokens.
    ps = [SamplingParams(temperature=1.0, min_p=1.0, seed=s) for s in range(20)]
    assert set(Sampler().sample(logits.expand(20, 4), ps, [0] * 20).token_ids) == {0}


def test_logit_bias_forces_and_bans() -> None:
    logits = torch.zeros(2, V)
    logits[:, 3] = 10.0
    ps = [SamplingParams(temperature=0, logit_bias={17: 100.0}),
          SamplingParams(temperature=0, logit_bias={3: -100.0, 5: 1.0})]
    out = Sampler().sample(logits, ps, [0, 0], None, [([1], []), ([1], [])])
    assert out.token_ids == [17, 5]


@pytest.mark.parametrize("kw,name", [
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": -0.01}, "min_p"),
    ({"logit_bias": {1: 100.01}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
])
def test_ranges_are_checked(kw: dict, name: str) -> None:
    with pytest.raises(SamplingParamsError, match=f"^{name}"):
        SamplingParams(**kw)


# ---- against transformers --------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

CASES = [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=0.6),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=1.5,
                   presence_penalty=0.7),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=-1.0,
                   logit_bias={5: 3.0, 9: -100.0}),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                   frequency_penalty=0.5, presence_penalty=0.5, logit_bias={11: 2.5}),
]


def hf_greedy_with_rule(model_dir: str, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding of transformers' LlamaForCausalLM with ``reference_logits`` applied
    at every step (full forward each step: the tiny model makes that cheap)."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out: list[int] = []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        out.append(int(reference_logits(logits, p, prompt, out).argmax()))
    return out


def test_greedy_with_penalties_equals_transformers(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, max_num_tokens=32, tokens_per_block=8, kv_cache_tokens=2048)
    vocab = llm.engine.config.model.vocab_size
    rng = random.Random(3)
    # Short repetitive prompts: the penalties change the greedy path of the random model.
    prompts = [[rng.randrange(3, 12) for _ in range(L)] for L in (5, 9, 14, 20, 7)]
    assert max(t for p in prompts for t in p) < vocab
    # One batch: each prompt with its own rule, and each again without one (beside them).
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([*prompts, *prompts], [*CASES, *[plain] * len(prompts)])
    got = [o.outputs[0].token_ids for o in outs]
    ruled, unruled = got[:len(prompts)], got[len(prompts):]
    for prompt, p, ids in zip(prompts, CASES, ruled, strict=True):
        assert ids == hf_greedy_with_rule(tiny_llama, prompt, p), p
    assert unruled[0] == hf_greedy_with_rule(tiny_llama, prompts[0], plain)
    # The rules change these outputs (else the test could not fail).
    assert sum(a != b for a, b in zip(ruled, unruled, strict=True)) >= 4
