"""Speculative decoding in the offline engine: greedy output is identical with and without it
(ngram and a draft model, on every architecture the engine serves), in batches mixing
speculating decodes with prefill chunks, plain decodes, prompt logprobs and requests added
mid-run; with chunked prompts, prefix-cache hits, preemption, max_model_len and max_tokens;
the KV pool is empty once every request is done. A draft that is the target itself is
accepted every time."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from disagg import LLM, SamplingParams
from disagg.engine import LLMEngine
from disagg.model.tiny import ARCHITECTURES

# Eager: compiling the step graph costs more than these short runs on a CPU.
OPTS: dict[str, Any] = dict(kv_cache_tokens=4096, tokens_per_block=8, enforce_eager=True)
K = 3


def _ngram(k: int = K, **kw: int) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, **kw}


def _draft(model: str, k: int = K) -> dict[str, Any]:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def _random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


# ngram proposes for the repetitive prompt at every step; for the random ones only where
# their last tokens happen to occur earlier (rarely with prompt_lookup_min above 1).
PROMPTS = [[7, 11, 13, 17] * 6, _random_prompt(19, 1), _random_prompt(45, 2)]
GREEDY = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)]
_BASELINES: dict[str, tuple[list[Any], Any]] = {}


def _generate(model: str, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
              spec: dict[str, Any] | None = None, **opts: Any) -> tuple[list[Any], Any]:
    """(outputs, engine stats) of one engine; checks the pool is empty at the end. Runs
    without speculation are kept for the module (several tests compare with the same)."""
    kw = {**OPTS, **opts}
    key = repr((model, prompts, params, sorted(kw.items())))
    if spec is None and key in _BASELINES:
        return _BASELINES[key]
    if spec is not None:
        kw["speculative_config"] = spec
    with LLM(model, **kw) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0 and llm.engine.kv.stats().used == 0
        # every ended request was forgotten by the draft model
        assert not getattr(llm.engine.proposer, "_tracks", {})
    if spec is None:
        _BASELINES[key] = (outs, stats)
    return outs, stats


def _tokens(outs: list[Any]) -> list[tuple[list[int], str | None]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _same_logprobs(a: list[Any], b: list[Any]) -> None:
    """The emitted tokens' logprobs agree (the verify forward batches positions differently:
    float rounding only)."""
    for x, y in zip(a, b, strict=True):
        la, lb = x.outputs[0].logprobs, y.outputs[0].logprobs
        assert (la is None) == (lb is None)
        if la is None:
            continue
        assert len(la) == len(lb) == len(x.outputs[0].token_ids)
        for ea, eb, t in zip(la, lb, x.outputs[0].token_ids, strict=True):
            assert list(ea) == list(eb)  # the same top-n, in order
            assert ea[t] == pytest.approx(eb[t], abs=1e-4)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., str]) -> Callable[[str, bool], str]:
    """``ckpt(arch, draft)``: the tiny target of ``arch`` (2 layers, seed 1) or its draft
    (1 layer, seed 7), written once per session."""
    def make(arch: str, draft: bool = False) -> str:
        if draft:
            return tiny_checkpoint(f"spec-{arch}-draft", arch=arch, seed=7, num_hidden_layers=1)
        return tiny_checkpoint(f"spec-{arch}", arch=arch, seed=1)
    return make


# ---- greedy identity on every architecture ---------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_identical_with_ngram_and_a_draft_model(ckpt: Callable[..., str],
                                                        arch: str) -> None:
    target, draft = ckpt(arch), ckpt(arch, True)
    params = GREEDY
    base, _ = _generate(target, PROMPTS, params)
    assert [len(o.outputs[0].token_ids) for o in base] == [p.max_tokens for p in params]
    for spec in (_ngram(), _draft(draft)):
        outs, st = _generate(target, PROMPTS, params, spec)
        assert _tokens(outs) == _tokens(base), spec["method"]
        _same_logprobs(outs, base)
        assert st.spec_num_draft_tokens > 0 and st.spec_num_drafts > 0
        assert 0 <= st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
        assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
        assert len(st.spec_accepted_per_pos) <= K


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_the_target_as_its_own_draft_is_always_accepted(ckpt: Callable[..., str],
                                                         arch: str) -> None:
    target = ckpt(arch)
    base, _ = _generate(target, PROMPTS, GREEDY)
    outs, st = _generate(target, PROMPTS, GREEDY, _draft(target))
    assert _tokens(outs) == _tokens(base)
    _same_logprobs(outs, base)
    assert st.spec_num_draft_tokens > 0
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    # every check accepts its first draft: K + 1 tokens per target forward but at the ends
    assert st.spec_accepted_per_pos[0] == st.spec_num_drafts
    assert st.spec_num_drafts <= sum(-(-p.max_tokens // (K + 1)) for p in GREEDY)


def test_self_draft_stays_exact_through_chunks_prefix_hits_and_preemption(
        ckpt: Callable[..., str]) -> None:
    """The draft's own KV (computed again after a prefix hit, a preemption, a rejected draft)
    is right at every step: a draft equal to the target is still accepted every time, with
    drafts spanning blocks of 4, catch-up chunks bounded by max_num_tokens, and preemption."""
    target = ckpt("llama")
    shared = _random_prompt(30, 20)
    prompts = [shared, [1, 2, 3] * 7, shared + [5], _random_prompt(37, 21), shared]
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True)
    base, _ = _generate(target, prompts, params)
    opts = dict(kv_cache_tokens=96, tokens_per_block=4, capacity_policy="max_utilization",
                max_num_tokens=16, enable_chunked_context=True)
    outs, st = _generate(target, prompts, params, _draft(target, 6), **opts)
    assert _tokens(outs) == _tokens(base)
    assert st.num_preempted_total > 0 and any(o.num_cached_tokens > 0 for o in outs)
    assert st.spec_num_draft_tokens > 0
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens


# ---- batch mixes -----------------------------------------------------------------------------


def _run_engine(model: str, spec: dict[str, Any] | None, **opts: Any
                ) -> tuple[dict[str, Any], list[Any], Any]:
    """Requests joining over time in a chunking engine: final outputs by id, every step's
    plan, the stats. a: repetitive (speculates), b: one token, c: prompt logprobs of a long
    chunked prompt, d and e join after a few steps (e: a long prompt, chunked beside the
    decodes), f is aborted mid-run."""
    # (30: a chunk is whole blocks of 8, the tokens left over go to draft slots)
    kw = {**OPTS, "max_num_tokens": 30, "enable_chunked_context": True, **opts}
    if spec is not None:
        kw["speculative_config"] = spec
    engine = LLMEngine.from_options(model, **kw)
    try:
        greedy = dict(temperature=0, ignore_eos=True)
        engine.add_request("a", [5, 6, 7, 8, 9] * 4, SamplingParams(max_tokens=24, **greedy))
        engine.add_request("b", _random_prompt(10, 3), SamplingParams(max_tokens=1, **greedy))
        engine.add_request("c", _random_prompt(40, 4),
                           SamplingParams(max_tokens=6, prompt_logprobs=1, logprobs=1,
                                          **greedy))
        engine.add_request("f", [3, 1, 3, 1] * 5, SamplingParams(max_tokens=30, **greedy))
        late = {2: ("d", [4, 4, 9, 9] * 3, 12), 4: ("e", _random_prompt(60, 5), 10)}
        final: dict[str, Any] = {}
        plans = []
        steps = 0
        while engine.has_unfinished() or late:
            if steps in late:
                rid, prompt, n = late.pop(steps)
                engine.add_request(rid, prompt, SamplingParams(max_tokens=n, **greedy))
            if steps == 5:  # f is aborted mid-run
                aborted = engine.abort_request("f")
                assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            plans.append(engine._last_sched)
            steps += 1
            assert steps < 500
        assert engine.kv.stats().used == 0 and engine.stats().kv_blocks_used == 0
        return final, plans, engine.stats()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_batch_mix_is_identical(ckpt: Callable[..., str], method: str) -> None:
    target = ckpt("llama")
    spec = _ngram(4, prompt_lookup_min=2) if method == "ngram" else _draft(ckpt("llama", True), 4)
    base, _, _ = _run_engine(target, None)
    got, plans, st = _run_engine(target, spec)
    assert sorted(got) == sorted(base) == list("abcde")
    for rid in base:
        a, b = got[rid], base[rid]
        assert (a.outputs[0].token_ids, a.outputs[0].finish_reason) == (
            b.outputs[0].token_ids, b.outputs[0].finish_reason), rid
        assert len(a.outputs[0].token_ids) == {"a": 24, "b": 1, "c": 6, "d": 12, "e": 10}[rid]
        assert a.error is None
    _same_logprobs([got["c"]], [base["c"]])
    pa, pb = got["c"].prompt_logprobs, base["c"].prompt_logprobs
    assert pa is not None and pb is not None and len(pa) == len(pb) == 40 and pa[0] is None
    for x, y in zip(pa[1:], pb[1:], strict=True):
        assert x is not None and y is not None and list(x) == list(y)
        assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-4)
    assert st.spec_num_draft_tokens > 0
    # some step checked drafts beside a prefill chunk and beside a decode without drafts
    def kinds(plan: Any) -> set[str]:
        return {"spec" if s.num_spec else "decode" if s.start_pos and len(s.token_ids) == 1
                and s.sample else "prefill" for s in plan.scheduled}
    # (draft slots come from the budget a prefill chunk leaves; a draft model proposes into
    # every slot, ngram only once a's output repeats: whether that overlaps e's chunks
    # depends on the model's tokens)
    if method == "draft_model":
        assert any({"spec", "prefill"} <= kinds(p) for p in plans)
    assert any({"spec", "decode"} <= kinds(p) for p in plans)
    # chunked: e's 60-token prompt took several steps
    assert sum(1 for p in plans for s in p.scheduled if s.request_id == "e" and not s.sample) >= 2


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_prefix_cache_hit_is_identical(ckpt: Callable[..., str], method: str) -> None:
    target = ckpt("llama")
    spec = _ngram() if method == "ngram" else _draft(ckpt("llama", True))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 5 + [7]  # 41 tokens: 5 full blocks of 8
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base, _ = _generate(target, [prompt], params)
    with LLM(target, **OPTS, speculative_config=spec) as llm:
        first = llm.generate([prompt], params)[0]
        second = llm.generate([prompt], params)[0]
        assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40
        # drafts were checked on both runs
        assert llm.engine.stats().spec_num_draft_tokens > 0
        assert llm.engine.kv.stats().used == 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == base[0].outputs[0].token_ids


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_preemption_under_max_utilization_is_identical(ckpt: Callable[..., str],
                                                       method: str) -> None:
    target = ckpt("llama")
    spec = _ngram() if method == "ngram" else _draft(ckpt("llama", True))
    prompts = [[9, 8, 7] * 4, *(_random_prompt(n, 10 + n) for n in (20, 27, 33, 40))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base, _ = _generate(target, prompts, params)
    # 36 blocks of 4 cannot hold five requests of up to 40 + 24 tokens at once
    small = dict(kv_cache_tokens=144, tokens_per_block=4, capacity_policy="max_utilization")
    outs, st = _generate(target, prompts, params, spec, **small)
    assert st.num_preempted_total > 0 and st.spec_num_draft_tokens > 0
    assert _tokens(outs) == _tokens(base)


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_a_stop_token_among_accepted_drafts_ends_there(ckpt: Callable[..., str],
                                                       method: str) -> None:
    """Stop tokens taken from the greedy answers (with the target as its own draft they fall
    inside accepted drafts); with min_tokens the stop token is banned until then (the answer
    changes, the same way with and without speculation)."""
    target = ckpt("llama")
    spec = _ngram(4) if method == "ngram" else _draft(target, 4)
    prompts = [PROMPTS[0], [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10]]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    (a, b, _), _ = _generate(target, prompts, free)
    ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1,
                             stop_token_ids=[ta[6]]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[tb[9]]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[tb[2]], min_tokens=8)]
    base, _ = _generate(target, prompts, params)
    assert base[0].outputs[0].token_ids == ta[:ta.index(ta[6]) + 1]
    assert base[1].outputs[0].token_ids == tb[:tb.index(tb[9]) + 1]
    assert len(base[2].outputs[0].token_ids) >= 8
    outs, st = _generate(target, prompts, params, spec)
    assert _tokens(outs) == _tokens(base)
    assert [o.outputs[0].stop_reason for o in outs] == [o.outputs[0].stop_reason for o in base]
    assert [o.outputs[0].stop_reason for o in outs][:2] == [ta[6], tb[9]]
    _same_logprobs(outs, base)
    assert st.spec_num_accepted_tokens > 0


# ---- length limits ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_max_model_len_and_max_tokens_are_honoured(ckpt: Callable[..., str], method: str) -> None:
    target = ckpt("llama")
    k = 4
    spec = _ngram(k) if method == "ngram" else _draft(ckpt("llama", True), k)
    rep = [2, 4, 6, 8, 10] * 5  # 25 tokens
    # max_model_len 32: the first request's 7 tokens end exactly there (a request can ask
    # for no more); the others end on max_tokens of 1 .. k + 2 (around the draft count)
    prompts = [rep, rep[:12], rep[:12], rep[:12], rep[:12], rep[:12], _random_prompt(9, 6)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (7, 1, 2, 3, k + 1, k + 2, 19)]
    base, _ = _generate(target, prompts, params, max_model_len=32)
    outs, st = _generate(target, prompts, params, spec, max_model_len=32)
    assert _tokens(outs) == _tokens(base)
    assert [len(t) for t, _ in _tokens(outs)] == [7, 1, 2, 3, k + 1, k + 2, 19]
    assert {r for _, r in _tokens(outs)} == {"length"}
    assert st.spec_num_draft_tokens > 0
