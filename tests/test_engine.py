"""Engine correctness against transformers, prefix caching, preemption, sampling, aborts."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from server_fixtures import protocol_gaps

from disagg import LLM, SamplingParams
from disagg.engine import AsyncLLM, EngineClient, LLMEngine, QueueFullError
from disagg.request import SamplingParamsError

transformers = pytest.importorskip("transformers")

MAX_NEW = 12


def _prompts(vocab_size: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 7, 16, 17, 31, 40, 55, 64][:n]
    return [[rng.randrange(3, vocab_size) for _ in range(L)] for L in lengths]


def _hf_reference(model_dir: str, prompts: list[list[int]], max_new: int):
    """Greedy ids and per-token logprobs from transformers' generate(), one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # never stop early: compare max_new tokens
    model.generation_config.pad_token_id = 0
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                return_dict_in_generate=True, output_logits=True,
            )
        ids = out.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(lg[0].float(), -1)[t].item()
               for lg, t in zip(out.logits, ids, strict=True)]
        refs.append((ids, lps))
    return refs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_greedy_parity_with_transformers_chunked_batch(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    llm = LLM(model_dir, max_num_tokens=24, tokens_per_block=8, kv_cache_tokens=4096)
    vocab = llm.engine.config.model.vocab_size
    prompts = _prompts(vocab)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    refs = _hf_reference(model_dir, prompts, MAX_NEW)
    for out, (ref_ids, ref_lps) in zip(outs, refs, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == ref_ids
        got = [lp[t] for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        assert got == pytest.approx(ref_lps, abs=1e-4)
        assert comp.finish_reason == "length"
    # Prompts up to 64 tokens with max_num_tokens=24: prefills were chunked.
    assert llm.engine.stats().steps_total > len(prompts)

    # The same prompts again: full blocks come from the prefix cache, same tokens.
    before = llm.engine.stats()
    outs2 = llm.generate(prompts, params)
    after = llm.engine.stats()
    B = 8
    expected_hits = sum(((len(p) - 1) // B) * B for p in prompts)
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == expected_hits
    assert [o.num_cached_tokens for o in outs2] == [((len(p) - 1) // B) * B for p in prompts]
    assert [o.outputs[0].token_ids for o in outs2] == [r[0] for r in refs]


def test_max_utilization_preempts_and_stays_exact(tiny_llama):
    prompts = _prompts(256, n=6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(tiny_llama, kv_cache_tokens=4096, tokens_per_block=4)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    # 48 blocks of 4 tokens cannot hold 6 requests of up to 40 + 24 tokens at once.
    llm = LLM(tiny_llama, kv_cache_tokens=192, tokens_per_block=4,
              capacity_policy="max_utilization", enable_prefix_caching=False)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preempted_total > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0


def test_guaranteed_no_evict_never_preempts(tiny_llama):
    prompts = _prompts(256, n=6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(tiny_llama, kv_cache_tokens=192, tokens_per_block=4)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preempted_total == 0
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)


def test_seeded_sampling_independent_of_batch_mates(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_tokens=4096)
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234, max_tokens=16,
                       ignore_eos=True)
    alone = llm.generate("Hello there", p)[0].outputs[0].token_ids
    mates = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    batch = llm.generate(["Hello there", "other", "more text here"], [p, mates, mates])
    assert batch[0].outputs[0].token_ids == alone
    # n > 1: seeds seed+i, reproducible, and different from each other
    p3 = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=16, ignore_eos=True)
    a = [c.token_ids for c in llm.generate("abc", p3)[0].outputs]
    b = [c.token_ids for c in llm.generate("abc", p3)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) > 1


def test_stop_strings_and_tokens(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_tokens=4096)
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate("The sky", base)[0].outputs[0]
    assert len(full.token_ids) == 20
    # a stop token: generation ends right at its first occurrence
    stop_tok = full.token_ids[5]
    first = full.token_ids.index(stop_tok)
    out = llm.generate("The sky", SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens masks the stop token until it is reached
    out = llm.generate("The sky", SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok],
        min_tokens=first + 2))[0].outputs[0]
    assert len(out.token_ids) >= first + 2 and stop_tok not in out.token_ids[: first + 2]
    # a stop string taken from the middle of the greedy text cuts the text before it
    text = full.text
    if len(text.strip()) >= 6:
        i = len(text) // 2
        stop = text[i : i + 3]
        out = llm.generate("The sky", SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: text.index(stop)]


def test_bad_requests_rejected_and_engine_goes_on(tiny_llama):
    engine = LLMEngine.from_options(tiny_llama, kv_cache_tokens=1024, max_model_len=128)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("b", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("c", [1] * 100, SamplingParams(max_tokens=64))
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0)
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1, 2, 3], SamplingParams())
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"]
    assert len(done[0].outputs[0].token_ids) <= 4


def test_abort_frees_blocks_at_once(tiny_llama):
    engine = LLMEngine.from_options(tiny_llama, kv_cache_tokens=1024, tokens_per_block=4)
    engine.add_request("x", list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("y", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    out = engine.abort_request("x")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.stats().kv_blocks_used == engine.kv.blocks_needed(17 + 2)
    engine.abort_request("y")
    assert engine.stats().kv_blocks_used == 0
    assert not engine.has_unfinished()


def test_async_engine_streams_aborts_and_limits_queue(tiny_llama):
    async def main() -> None:
        engine = AsyncLLM.from_options(tiny_llama, kv_cache_tokens=2048, max_queue=2,
                                       max_batch_size=1)
        engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            deltas, final = [], None
            async for out in engine.generate("r1", [5, 6, 7], params):
                deltas += out.outputs[0].delta_token_ids
                final = out
            assert final.finished and deltas == final.outputs[0].token_ids
            assert len(deltas) == 8

            # A consumer that stops early aborts its request and frees its blocks.
            long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            agen = engine.generate("r2", [5, 6, 7], long)
            await agen.__anext__()
            await agen.aclose()
            for _ in range(200):
                if engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats().kv_blocks_used == 0

            # max_queue=2 with batch size 1: the fourth concurrent request is refused.
            gens = [engine.generate(f"q{i}", [5, 6], long) for i in range(3)]
            firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError):
                async for _ in engine.generate("q3", [5, 6], long):
                    pass
            for f in firsts:
                f.cancel()  # cancelling a consumer aborts its request
            await asyncio.gather(*firsts, return_exceptions=True)
            for _ in range(200):
                if engine.stats().kv_blocks_used == 0 and engine.stats().num_waiting == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats().kv_blocks_used == 0
            assert engine.is_healthy()
        finally:
            await engine.shutdown()
        assert not engine.is_healthy()

    asyncio.run(main())


def test_async_llm_is_the_engine_client(tiny_llama):
    """What the server may use of the engine (EngineClient) is what AsyncLLM offers: every
    member, methods with the same parameters; close() without a start is fine."""
    engine = AsyncLLM.from_options(tiny_llama, kv_cache_tokens=512)
    try:
        assert protocol_gaps(engine, EngineClient) == []
        assert engine.transfer is None and engine.role_drain_now is None
    finally:
        engine.close()
        engine.close()  # idempotent
    assert not engine.is_healthy()


def test_failed_step_fails_its_requests_and_the_loop_goes_on(tiny_llama, monkeypatch):
    engine = LLMEngine.from_options(tiny_llama, kv_cache_tokens=1024, tokens_per_block=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(sched)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    engine.step()  # prefill of "a"
    failed = engine.step()  # the injected failure hits the step that decodes "a"
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in failed] == [
        ("a", True, "error")]
    assert "injected failure" in failed[0].error
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
    engine.add_request("b", [5, 6, 7], params)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert done[0].request_id == "b" and len(done[0].outputs[0].token_ids) == 6


def _run_all(engine: LLMEngine) -> dict[str, object]:
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return final


# Values SamplingParams accepts that used to break the sampler (inf / NaN probabilities, an
# empty nucleus) and fail every request of the step.
PATHOLOGICAL = [
    SamplingParams(temperature=1e-39, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=5e-324, seed=3, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=1e-300, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1e-38, top_p=5e-324, top_k=1, logprobs=3, max_tokens=6,
                   ignore_eos=True),
]


def test_pathological_params_never_fail_batch_mates(tiny_llama):
    engine = LLMEngine.from_options(tiny_llama, kv_cache_tokens=2048, tokens_per_block=4)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    engine.add_request("alone", prompt, greedy)
    alone = _run_all(engine)["alone"].outputs[0].token_ids
    engine.add_request("greedy", prompt, greedy)
    for i, p in enumerate(PATHOLOGICAL):
        engine.add_request(f"bad{i}", [11 + i, 12, 13], p)
    final = _run_all(engine)
    assert final["greedy"].error is None and final["greedy"].outputs[0].token_ids == alone
    for i in range(len(PATHOLOGICAL)):
        out = final[f"bad{i}"]
        assert out.error is None and out.outputs[0].finish_reason == "length", out.error
        assert len(out.outputs[0].token_ids) == 6
    # A sub-normal temperature is greedy: the same tokens as temperature 0.
    engine.add_request("tiny_t", prompt, PATHOLOGICAL[0])
    assert _run_all(engine)["tiny_t"].outputs[0].token_ids == alone
    assert engine.stats().kv_blocks_used == 0


def test_a_request_whose_sampling_fails_fails_alone(tiny_llama, monkeypatch):
    from disagg.sampler import Sampler

    engine = LLMEngine.from_options(tiny_llama, kv_cache_tokens=2048, tokens_per_block=4)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    doomed = SamplingParams(temperature=1.0, seed=13, max_tokens=6, ignore_eos=True)
    engine.add_request("g", [5, 6, 7], greedy)
    engine.add_request("s", [8, 9], seeded)
    expected = {rid: o.outputs[0].token_ids for rid, o in _run_all(engine).items()}
    real = Sampler._sample_rows
    calls = {"n": 0}

    def broken(self, logits, params, positions, banned, histories=None):
        if any(p.seed == 13 for p in params):
            calls["n"] += 1
            if calls["n"] > 2:  # the doomed request's third token cannot be sampled
                raise RuntimeError("injected sampling failure")
        return real(self, logits, params, positions, banned, histories)

    monkeypatch.setattr(Sampler, "_sample_rows", broken)
    engine.add_request("g2", [5, 6, 7], greedy)
    engine.add_request("doomed", [4, 4, 4], doomed)
    engine.add_request("s2", [8, 9], seeded)
    final = _run_all(engine)
    bad = final["doomed"]
    assert bad.outputs[0].finish_reason == "error" and "injected" in bad.error
    assert len(bad.outputs[0].token_ids) == 2
    assert final["g2"].error is None and final["g2"].outputs[0].token_ids == expected["g"]
    assert final["s2"].error is None and final["s2"].outputs[0].token_ids == expected["s"]
    assert engine.stats().kv_blocks_used == 0


def test_requests_that_could_never_run_are_refused_by_validate(tiny_llama):
    """A prompt longer than max_num_tokens without chunked context, stop_token_ids the model
    can never produce: ValueError naming the field (the server's 400), before the scheduler
    takes them (it would finish the first with an error: a 500). The sampler still ignores
    banned ids beyond the vocabulary (an EOS id of a larger tokenizer; test_sampler)."""
    engine = LLMEngine.from_options(tiny_llama, kv_cache_tokens=2048, tokens_per_block=4,
                                    max_num_tokens=16, enable_chunked_context=False)
    vocab = engine.config.model.vocab_size
    with pytest.raises(ValueError, match="^prompt: .*max_num_tokens=16"):
        engine.add_request("long", list(range(5, 22)), SamplingParams(max_tokens=2))
    for bad in (vocab, 10**9):
        with pytest.raises(ValueError, match=f"^stop_token_ids: token id {bad} "):
            engine.add_request("stop", [5, 6], SamplingParams(min_tokens=1, max_tokens=3,
                                                              stop_token_ids=[1, bad]))
    engine.add_request("ok", list(range(5, 21)), SamplingParams(
        temperature=0, max_tokens=3, stop_token_ids=[vocab - 1]))
    assert _run_all(engine)["ok"].error is None
    assert engine.stats().kv_blocks_used == 0


def test_abort_of_a_refused_request_before_the_next_step(tiny_llama):
    """A request the scheduler refuses (longer than max_num_tokens without chunking) and that
    is aborted before the next step (a client gone at once) must not kill the engine loop."""
    engine = LLMEngine.from_options(tiny_llama, kv_cache_tokens=2048, tokens_per_block=4,
                                    max_num_tokens=16, enable_chunked_context=False)
    engine.validate = lambda ids, params: None  # the scheduler's own refusal (a backstop)
    engine.add_request("long", list(range(5, 45)), SamplingParams(max_tokens=2))
    assert engine.abort_request("long").finished
    engine.add_request("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    final = _run_all(engine)
    assert list(final) == ["ok"] and final["ok"].error is None
    assert engine.stats().kv_blocks_used == 0
