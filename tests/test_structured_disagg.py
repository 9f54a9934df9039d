"""Structured outputs under disaggregation, exactly: the context worker samples the first token
under the grammar; the generation worker builds a fresh matcher, replays that token and only
then computes its first mask, so greedy and seeded outputs equal an aggregated worker's (and
stay schema-valid). Engines in this process, KV over TCP, the two sides with different
``tokens_per_block``; tests/test_structured_router.py covers the HTTP path through the
router."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from disagg.config import build_engine_config
from disagg.contracts.kv_mode import LOCAL, ContextOnly, KVMode, Pull
from disagg.contracts.params import ContextParams
from disagg.engine import AsyncLLM, RequestOutput
from disagg.kv_connector.settings import DisaggSettings
from disagg.request import SamplingParams
from disagg.structured.spec import GrammarSpec

OPTIONS = dict(kv_cache_tokens=2048, max_model_len=256, max_num_tokens=64, max_batch_size=16)
PROMPT = [(11 * i + 7) % 250 + 3 for i in range(21)]
SCHEMA = GrammarSpec.json_schema({
    "type": "object", "additionalProperties": False, "required": ["id", "tag"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"type": "string", "maxLength": 5}}}, "response_format")
CASES = [
    SamplingParams(temperature=0.0, max_tokens=60, structured=SCHEMA),
    SamplingParams(temperature=1.5, seed=7, max_tokens=60, structured=SCHEMA),
    SamplingParams(temperature=2.0, top_p=0.9, seed=1234, max_tokens=60, structured=SCHEMA,
                   logprobs=1),
    SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                   structured=GrammarSpec("regex", r"[a-f]{3}-[0-9]{1,6}")),
]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint(seed=4)


async def _final(engine: AsyncLLM, rid: str, params: SamplingParams,
                 mode: KVMode = LOCAL) -> RequestOutput:
    last = None
    async for out in engine.generate(rid, PROMPT, params, mode=mode):
        last = out
    assert last is not None and last.finished and last.error is None, (rid, last)
    return last


def test_constrained_outputs_same_aggregated_and_disaggregated(model_dir: str) -> None:
    agg_cfg = build_engine_config(model_dir, tokens_per_block=16, **OPTIONS)
    ctx_cfg = build_engine_config(model_dir, tokens_per_block=16, **OPTIONS)
    gen_cfg = build_engine_config(model_dir, tokens_per_block=8, **OPTIONS)

    async def main() -> None:
        agg = AsyncLLM(agg_cfg)
        ctx = AsyncLLM(ctx_cfg, disagg=DisaggSettings(role="context", cluster_token="t",
                                                      backend="TCP"))
        gen = AsyncLLM(gen_cfg, disagg=DisaggSettings(role="generation", cluster_token="t",
                                                      backend="TCP"))
        for e in (agg, ctx, gen):
            e.start()
        try:
            # Aggregated: all cases as batch-mates, beside unconstrained noise.
            noise = SamplingParams(temperature=1.5, max_tokens=14, ignore_eos=True)
            outs = await asyncio.gather(
                *(_final(agg, f"agg{i}", p) for i, p in enumerate(CASES)),
                *(_final(agg, f"noise{i}", noise) for i in range(2)))
            for i, p in enumerate(CASES):
                want = outs[i].outputs[0]
                assert want.finish_reason == "stop", (i, want.text)  # the grammar ended it
                if p.structured is SCHEMA:
                    json.loads(want.text)
                first = await _final(ctx, f"ctx{i}", p, mode=ContextOnly())
                assert first.disaggregated_params is not None  # not final: leased
                assert first.outputs[0].token_ids == want.token_ids[:1], i
                remote = ContextParams.from_dict(first.disaggregated_params, PROMPT)
                rest = await _final(gen, f"gen{i}", p, mode=Pull(remote, trusted=False))
                got = rest.outputs[0]
                assert got.token_ids == want.token_ids and got.text == want.text, (i, p)
                assert got.finish_reason == "stop"
                if p.logprobs is not None:
                    assert got.logprobs is not None and want.logprobs is not None
                    assert list(map(set, got.logprobs)) == list(map(set, want.logprobs))

            # A first token that completes the grammar is final on the context worker: "stop",
            # no lease, nothing left for a generation worker.
            one = SamplingParams(temperature=0.0, max_tokens=10,
                                 structured=GrammarSpec("choice", json.dumps(["a"])))
            first = await _final(ctx, "ctx-final", one, mode=ContextOnly())
            assert first.outputs[0].finish_reason == "stop"
            assert first.disaggregated_params is None and first.outputs[0].text == "a"

            # A generation request whose context token breaks the grammar is refused.
            bad = ContextParams.from_dict(
                (await _final(ctx, "ctx-free", SamplingParams(temperature=0.0, max_tokens=5),
                              mode=ContextOnly())).disaggregated_params, PROMPT)
            with pytest.raises(ValueError, match="does not match the grammar"):
                await _final(gen, "gen-bad", SamplingParams(
                    temperature=0.0, max_tokens=5,
                    structured=GrammarSpec("regex", "[0-9]{4}")), mode=Pull(bad, trusted=False))
            for _ in range(500):  # every lease confirmed or released, every block back
                if ctx.stats().kv_blocks_used == 0 and gen.stats().kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.01)
            assert ctx.stats().kv_blocks_used == 0 and gen.stats().kv_blocks_used == 0
        finally:
            for e in (agg, ctx, gen):
                await e.shutdown()

    asyncio.run(main())
