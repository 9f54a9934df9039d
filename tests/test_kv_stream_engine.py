"""KV streaming between two engines in this process (context and generation, TCP): the
generation side's reads are answered layer group by layer group while the context worker's
forward is still running, its greedy tokens equal an aggregated engine's, and every way a
stream can end frees the blocks on both sides."""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from disagg.config import build_engine_config
from disagg.contracts.kv_mode import ContextStream, Pull
from disagg.contracts.params import ContextParams, token_ids_hash
from disagg.contracts.roles import Role
from disagg.engine import LLMEngine
from disagg.kv_connector.records import KVStatus
from disagg.kv_connector.settings import DisaggSettings
from disagg.request import SamplingParams

TOKEN = "stream-secret"
WAIT = 20.0
# Chunks of 32 tokens on the context side: a 70-token prompt is prefilled in three steps.
OPTS = dict(tokens_per_block=8, kv_cache_tokens=1024, max_num_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model: str, role: Role | None, **opts: Any) -> LLMEngine:
    cfg = build_engine_config(model, **{**OPTS, **opts})
    return LLMEngine(cfg, DisaggSettings(role, TOKEN, backend="TCP", stream_wait_s=WAIT)
                     if role is not None else None)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("stream4", num_hidden_layers=4)  # one layer per read group


@pytest.fixture
def pair(model: str) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    ctx, gen = _engine(model, Role.CONTEXT), _engine(model, Role.GENERATION)
    try:
        yield ctx, gen
    finally:
        ctx.shutdown()
        gen.shutdown()


def _stream(ctx: LLMEngine, prompt: list[int]) -> tuple[str, ContextParams]:
    """A stream id and the generation side's params for ``prompt`` (as the router makes them)."""
    sid = uuid.uuid4().hex
    info = ctx.connector.info()  # type: ignore[union-attr]
    d = {"ctx_request_id": sid, **{k: info[k] for k in ("worker_id", "backend", "layout")},
         "addresses": ctx.connector.addresses}  # type: ignore[union-attr]
    return sid, ContextParams.from_stream(d, prompt)


def _add_context(ctx: LLMEngine, sid: str, prompt: list[int],
                 params: SamplingParams = GREEDY) -> None:
    ctx.add_request(sid, prompt, params,
                    mode=ContextStream(len(prompt), token_ids_hash(prompt)))


def _pump(eng: LLMEngine, until: Callable[[list[Any]], bool], what: str) -> list[Any]:
    """Run ``eng``'s loop (transfers, steps) until ``until(outputs so far)``; bounded."""
    outs: list[Any] = []
    deadline = time.monotonic() + WAIT
    while not until(outs):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        outs += eng.service_transfers()
        if eng.has_schedulable():
            outs += eng.step()
        else:
            time.sleep(0.002)  # waiting on transport threads
    return outs


def _finished(rid: str) -> Callable[[list[Any]], bool]:
    return lambda outs: any(o.request_id == rid and o.finished for o in outs)


def _tokens(outs: list[Any], rid: str) -> list[int]:
    return [t for o in outs if o.request_id == rid for t in o.outputs[0].delta_token_ids]


def _reference(model: str, prompt: list[int]) -> list[int]:
    agg = _engine(model, None)
    try:
        agg.add_request("r", prompt, GREEDY)
        return _tokens(_pump(agg, _finished("r"), "the aggregated answer"), "r")
    finally:
        agg.shutdown()


def test_reads_are_answered_layer_by_layer_during_the_last_prefill_step(
        pair: tuple[LLMEngine, LLMEngine], model: str) -> None:
    ctx, gen = pair
    prompt = [3 + (7 * i) % 400 for i in range(70)]
    sid, params = _stream(ctx, prompt)
    gen.add_request("g", prompt, GREEDY, mode=Pull(params, trusted=False))
    gen.step()  # allocates the blocks; the reads go out and wait for a lease not made yet
    state = gen.connector.request_state("g")  # type: ignore[attr-defined]
    assert state is not None and state.status is KVStatus.PULLING
    reads = state.reads
    assert [r.piece.layers for r in reads] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    _add_context(ctx, sid, prompt)

    seen: list[list[bool]] = []
    hook = ctx.runner.model.layer_hook
    assert hook is not None

    def pausing_hook(i: int) -> None:
        hook(i)
        last_step = ctx._last_sched.scheduled[0].start_pos + len(
            ctx._last_sched.scheduled[0].token_ids) == len(prompt)
        if last_step and i == 1:  # layers 0 and 1 of the last chunk are done: their reads go
            cf.wait([r.future for r in reads[:2]], timeout=WAIT)
            seen.append([r.future.done() and r.future.exception() is None for r in reads])

    ctx.runner.model.layer_hook = pausing_hook
    try:
        outs = _pump(ctx, _finished(sid), "the context prefill")
    finally:
        ctx.runner.model.layer_hook = hook
    # mid-forward: the first two groups moved; the last one waits for the first token too
    assert seen == [[True, True, False, False]]
    assert reads[3].request.first_token and not any(r.request.first_token for r in reads[:3])
    assert outs[-1].disaggregated_params["kv_stream_id"] == sid
    g = _pump(gen, _finished("g"), "the generation answer")
    assert _tokens(g, "g") == _reference(model, prompt)
    assert gen.stats().kv_blocks_used == 0
    _pump(ctx, lambda _o: ctx.stats().kv_blocks_used == 0, "the lease to be confirmed")


def _first_chunk_done(ctx: LLMEngine, gen: LLMEngine) -> str:
    """A 57-token prompt streamed as "g": its reads wait, the context side computed its
    first chunk (of two). Returns the stream id."""
    prompt = list(range(3, 60))
    sid, params = _stream(ctx, prompt)
    _add_context(ctx, sid, prompt)
    gen.add_request("g", prompt, GREEDY, mode=Pull(params, trusted=False))
    gen.step()
    ctx.step()
    return sid


def test_context_abort_fails_the_generation_request_cleanly(
        pair: tuple[LLMEngine, LLMEngine]) -> None:
    ctx, gen = pair
    sid = _first_chunk_done(ctx, gen)
    ctx.abort_request(sid)  # the stream is dropped: waiting reads fail at once
    outs = _pump(gen, _finished("g"), "the generation failure")
    assert outs[-1].outputs[0].finish_reason == "error"
    assert outs[-1].kv_transfer_error is not None
    assert "unknown_lease" in outs[-1].error
    assert gen.stats().kv_blocks_used == 0 and ctx.stats().kv_blocks_used == 0


def test_generation_abort_releases_the_stream_lease(pair: tuple[LLMEngine, LLMEngine]) -> None:
    ctx, gen = pair
    sid = _first_chunk_done(ctx, gen)
    gen.abort_request("g")  # gives the lease back to the context worker
    deadline = time.monotonic() + WAIT  # the release arrives on the transfer server's thread
    while ctx.connector.lease_is_live(sid):  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the release did not arrive"
        time.sleep(0.005)
    outs = _pump(ctx, _finished(sid), "the context prefill")
    assert outs[-1].disaggregated_params is None  # nobody will read it: not leased
    _pump(ctx, lambda _o: ctx.stats().kv_blocks_used == 0, "the blocks to be freed")
    # The generation side's blocks come free once its cancelled read stopped writing.
    _pump(gen, lambda _o: gen.stats().kv_blocks_used == 0, "the cancelled pull to stop")


def test_mismatched_prompt_is_refused_not_decoded(pair: tuple[LLMEngine, LLMEngine]) -> None:
    ctx, gen = pair
    prompt = list(range(3, 40))
    sid, params = _stream(ctx, prompt)
    _add_context(ctx, sid, [5, *prompt[1:]])  # the context side tokenized another prompt
    _pump(ctx, _finished(sid), "the context prefill")
    gen.add_request("g", prompt, GREEDY, mode=Pull(params, trusted=False))
    outs = _pump(gen, _finished("g"), "the generation failure")
    assert outs[-1].outputs[0].finish_reason == "error" and "bad_request" in outs[-1].error
    _pump(ctx, lambda _o: ctx.stats().kv_blocks_used == 0, "the lease to end")


@pytest.mark.parametrize("case", ["eos", "max_tokens_1", "logprobs"])
def test_the_first_token_comes_with_the_kv(pair: tuple[LLMEngine, LLMEngine], model: str,
                                           case: str) -> None:
    """The generation side goes on from the context worker's first token as after the two
    calls: a first token that ends the request ends it there (nothing cached from KV its
    context worker may have freed), and logprobs travel with it."""
    ctx, gen = pair
    prompt = list(range(3, 40))
    eos = ctx.eos_token_ids[0]
    params = {"eos": SamplingParams(temperature=0, max_tokens=5, logit_bias=((eos, 100.0),)),
              "max_tokens_1": SamplingParams(temperature=0, max_tokens=1),
              "logprobs": SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                         ignore_eos=True)}[case]
    sid, remote = _stream(ctx, prompt)
    gen.add_request("g", prompt, params, mode=Pull(remote, trusted=True))
    gen.step()
    _add_context(ctx, sid, prompt, params)
    _pump(ctx, _finished(sid), "the context prefill")
    outs = _pump(gen, _finished("g"), "the generation answer")
    agg = _engine(model, None)
    try:
        agg.add_request("r", prompt, params)
        ref = _pump(agg, _finished("r"), "the aggregated answer")
    finally:
        agg.shutdown()
    assert _tokens(outs, "g") == _tokens(ref, "r")
    assert outs[-1].outputs[0].finish_reason == ref[-1].outputs[0].finish_reason
    if case == "eos":
        assert _tokens(outs, "g") == [eos] and gen.stats().kv_blocks_cached == 0
    if case == "logprobs":
        got = outs[-1].outputs[0].logprobs
        want = ref[-1].outputs[0].logprobs
        assert len(got) == len(want) == 4
        for d, w in zip(got, want, strict=True):
            assert d == pytest.approx(w, abs=1e-4)
    assert gen.stats().kv_blocks_used == 0
    _pump(ctx, lambda _o: ctx.stats().kv_blocks_used == 0, "the lease to end")
