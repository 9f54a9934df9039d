"""Async scheduling (``LLMEngine.step``): the next plan of plain decodes is launched before the
step's outputs are built. On by default on CUDA only; forced on here on CPU, where the same
code runs (the device simply does not run ahead), and every result must equal the synchronous
engine's: tokens, text, logprobs, finish reasons, stop strings that end a request whose next
token is already in flight, aborts of a request in flight, preemption, prefix-cache reuse of
blocks a dropped in-flight token wrote into."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from disagg import LLM, SamplingParams
from disagg.engine import LLMEngine

OPTS: dict[str, Any] = dict(tokens_per_block=8, kv_cache_tokens=4096, max_num_tokens=32)


def _prompts(n: int, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _summary(outs: list[Any]) -> list[tuple[Any, ...]]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
            for o in outs for c in o.outputs]


def _launches(engine: LLMEngine) -> Callable[[], int]:
    """Counts the plans the engine launched early (a spy on ``_launch``)."""
    count = [0]
    inner = engine._launch

    def spy(sched: Any) -> Any:
        count[0] += 1
        return inner(sched)

    engine._launch = spy  # type: ignore[method-assign]
    return lambda: count[0]


def _both(model: str, prompts: list[list[int]], params: Any, **opts: Any
          ) -> tuple[list[Any], list[Any], int]:
    with LLM(model, **{**OPTS, **opts}, async_scheduling=False) as llm:
        sync = llm.generate(prompts, params)
    with LLM(model, **{**OPTS, **opts}, async_scheduling=True) as llm:
        launched = _launches(llm.engine)
        asyn = llm.generate(prompts, params)
        assert llm.engine.kv.stats().used == 0
    return sync, asyn, launched()


def test_default_is_on_for_cuda_only(tiny_llama: str) -> None:
    with LLM(tiny_llama, **OPTS) as llm:
        assert llm.engine.async_scheduling is llm.engine.config.device.startswith("cuda")
    with LLM(tiny_llama, **OPTS, async_scheduling=True) as llm:
        assert llm.engine.async_scheduling is True
        with pytest.raises(ValueError, match="async_scheduling"):
            LLM(tiny_llama, **OPTS, async_scheduling="yes")


def test_mixed_sampling_is_identical(tiny_llama: str) -> None:
    prompts = _prompts(8)
    params = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=17, logprobs=1),
        SamplingParams(temperature=0, max_tokens=11, repetition_penalty=1.3,
                       frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=11, max_tokens=12,
                       presence_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=6),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
    ]
    sync, asyn, launched = _both(tiny_llama, prompts, params)
    assert _summary(asyn) == _summary(sync)
    assert launched > 10  # the decode steps were launched early


def test_stop_token_and_stop_string_with_the_next_token_in_flight(tiny_llama: str) -> None:
    prompt = _prompts(1, seed=4)[0]
    with LLM(tiny_llama, **OPTS, async_scheduling=False) as llm:
        full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 8
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stop_tok = full.token_ids[9]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    # the stop-string request ends while its batch-mates keep decoding, so its next token
    # was launched with them and is dropped
    sync, asyn, launched = _both(tiny_llama, [prompt] * 3, params)
    assert _summary(asyn) == _summary(sync)
    assert asyn[0].outputs[0].finish_reason == "stop"
    assert asyn[0].outputs[0].text == text[:text.index(stop)]
    assert launched > 0


def test_prefix_cache_after_a_dropped_in_flight_token(tiny_llama: str) -> None:
    """A request ended by a stop string had its next token's KV written (in flight) into a
    block it no longer owns; a later request reusing the cached prefix reads only full blocks
    of computed tokens, so it matches the synchronous engine."""
    prompt = _prompts(1, seed=9)[0] * 3  # several full blocks
    with LLM(tiny_llama, **OPTS, async_scheduling=False) as llm:
        full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                     ignore_eos=True))[0].outputs[0]
    stop = full.text[len(full.text) // 3: len(full.text) // 3 + 2]
    first = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
             SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    results = {}
    for mode in (False, True):
        with LLM(tiny_llama, **OPTS, async_scheduling=mode, enable_prefix_caching=True) as llm:
            a = llm.generate([prompt, prompt[:-1]], first)
            b = llm.generate([prompt + full.token_ids[:12]],
                             SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
            assert b[0].num_cached_tokens > 0
            results[mode] = _summary(a) + _summary(b)
    assert results[True] == results[False]


def test_abort_of_a_request_in_flight(tiny_llama: str) -> None:
    prompts = _prompts(3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    finals: dict[bool, dict[str, Any]] = {}
    for mode in (False, True):
        engine = LLMEngine.from_options(tiny_llama, **OPTS, async_scheduling=mode)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done: dict[str, Any] = {}
        steps = 0
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            steps += 1
            if steps == 5:
                assert engine._inflight is not None or not mode  # r1's next token in flight
                aborted = engine.abort_request("r1")
                assert aborted is not None and aborted.finished
        assert engine.kv.stats().used == 0
        finals[mode] = {rid: (o.outputs[0].token_ids, o.outputs[0].logprobs)
                        for rid, o in done.items()}
        engine.shutdown()
    assert set(finals[True]) == {"r0", "r2"}
    assert finals[True] == finals[False]


def test_preemption_while_decoding(tiny_llama: str) -> None:
    """A cache too small for every request's full output: the scheduler preempts while plans
    are launched early; the recomputed requests end with the synchronous engine's tokens."""
    prompts = _prompts(6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    opts = dict(kv_cache_tokens=256, capacity_policy="max_utilization")
    sync, asyn, launched = _both(tiny_llama, prompts, params, **opts)
    assert _summary(asyn) == _summary(sync)
    assert launched > 0


def test_requests_added_while_a_plan_is_in_flight(tiny_llama: str) -> None:
    """New requests wait for the next call (nothing is launched early while one waits) and
    are served exactly; seeded sampling does not depend on the batch."""
    prompts = _prompts(6, seed=8)
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    results = {}
    for mode in (False, True):
        engine = LLMEngine.from_options(tiny_llama, **OPTS, async_scheduling=mode)
        engine.add_request("a0", prompts[0], params)
        out: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished() or steps < 8:
            if 1 <= steps <= 5:
                engine.add_request(f"a{steps}", prompts[steps], params)
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
            steps += 1
        engine.shutdown()
        results[mode] = out
    assert results[True] == results[False] and len(results[True]) == 6


@pytest.mark.parametrize("n", [1, 3])
def test_parallel_sampling_n(tiny_llama: str, n: int) -> None:
    params = SamplingParams(temperature=1.0, seed=21, n=n, max_tokens=10, logprobs=0)
    sync, asyn, _ = _both(tiny_llama, _prompts(2, seed=1), params)
    assert _summary(asyn) == _summary(sync)


def test_padded_graph_path_is_identical(tiny_llama: str, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """The decode-graph path (padded buckets, run eagerly on CPU) under async scheduling: the
    graph's logits buffer is reused by the next plan, launched before this one is read."""
    from test_cuda_graph import _padded_runner

    opts = dict(max_num_tokens=64, tokens_per_block=8, kv_cache_tokens=2048, max_model_len=128,
                cuda_graph_max_batch_size=6)
    prompts = _prompts(7, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in (4, 6, 8, 10, 12, 14, 16)]
    made = _padded_runner(monkeypatch)
    with LLM(tiny_llama, **opts, async_scheduling=False) as llm:
        want = llm.generate(prompts, params)
    with LLM(tiny_llama, **opts, async_scheduling=True) as llm:
        launched = _launches(llm.engine)
        got = llm.generate(prompts, params)
    graphs = made[1].graphs
    assert graphs is not None and graphs.eager_runs + graphs.replays > 0  # (CUDA: captured)
    assert launched() > 0
    assert _summary(got) == _summary(want)
