"""Out-of-memory isolation: torch.cuda.OutOfMemoryError in a step (injected here, on CPU)
re-runs the step's requests in smaller groups; only a request that cannot run even alone
fails, the others produce exactly the tokens they produce without the error."""

from __future__ import annotations

import random

import pytest
import torch

from disagg.engine import LLMEngine
from disagg.request import SamplingParams

OPTS = dict(max_num_tokens=128, tokens_per_block=8, kv_cache_tokens=4096, max_model_len=256)


def _requests(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    reqs = {}
    for i, n in enumerate((5, 12, 40, 9, 23)):
        # greedy and seeded draws: both must not depend on how the step was split
        params = (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
                  if i % 2 else SamplingParams(temperature=0.9, top_p=0.9, seed=i,
                                               max_tokens=6, ignore_eos=True))
        reqs[f"r{i}"] = ([rng.randrange(3, vocab) for _ in range(n)], params)
    return reqs


def _run(engine: LLMEngine, reqs) -> dict[str, object]:  # type: ignore[no-untyped-def]
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _same_logprobs(a, b) -> None:  # type: ignore[no-untyped-def]
    """Same tokens; values within float32 noise (a smaller batch runs other GEMM shapes)."""
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or [], strict=True):
        assert x.keys() == y.keys()
        assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-4)


def _inject(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, fits) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """Make runner.execute raise OutOfMemoryError for a batch ``fits`` rejects."""
    calls: list[list[str]] = []
    real = engine.runner.execute

    def execute(sched):  # type: ignore[no-untyped-def]
        ids = [r.request_id for r in sched.scheduled]
        calls.append(ids)
        if not fits(sched):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB "
                                              "(injected)")
        return real(sched)

    monkeypatch.setattr(engine.runner, "execute", execute)
    return calls


def test_a_request_that_never_fits_fails_alone(tiny_llama, monkeypatch) -> None:
    engine = LLMEngine.from_options(tiny_llama, **OPTS)
    vocab = engine.config.model.vocab_size
    reqs = _requests(vocab)
    want = _run(LLMEngine.from_options(tiny_llama, **OPTS),
                {k: v for k, v in reqs.items() if k != "r2"})
    calls = _inject(engine, monkeypatch,
                    lambda sched: all(r.request_id != "r2" for r in sched.scheduled))
    got = _run(engine, reqs)
    assert got["r2"].error is not None and "out of device memory" in got["r2"].error
    assert "injected" in got["r2"].error
    assert any(ids == ["r2"] for ids in calls)  # it was tried alone before failing
    for rid, out in want.items():
        assert got[rid].error is None
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids, rid
        _same_logprobs(got[rid].outputs[0].logprobs, out.outputs[0].logprobs)


def test_a_step_too_large_is_split_and_every_request_finishes(tiny_llama, monkeypatch) -> None:
    engine = LLMEngine.from_options(tiny_llama, **OPTS)
    reqs = _requests(engine.config.model.vocab_size)
    want = _run(LLMEngine.from_options(tiny_llama, **OPTS), reqs)
    # "Memory" for 45 tokens per forward: the prefill step (89 tokens) and any group above it
    # fail; decode steps (5 tokens) fit.
    calls = _inject(engine, monkeypatch, lambda sched: sched.num_scheduled_tokens <= 45)
    got = _run(engine, reqs)
    assert any(len(ids) < len(reqs) for ids in calls)  # the step was split
    for rid, out in want.items():
        assert got[rid].error is None, got[rid].error
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids, rid
        _same_logprobs(got[rid].outputs[0].logprobs, out.outputs[0].logprobs)


def test_other_errors_still_fail_the_step(tiny_llama, monkeypatch) -> None:
    engine = LLMEngine.from_options(tiny_llama, **OPTS)
    reqs = _requests(engine.config.model.vocab_size)
    monkeypatch.setattr(engine.runner, "execute",
                        lambda sched: (_ for _ in ()).throw(RuntimeError("boom")))
    got = _run(engine, reqs)
    assert all(out.error is not None and "boom" in out.error for out in got.values())
