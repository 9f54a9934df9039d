"""Seeded sampling gives the same tokens whichever path serves the request: one aggregated
worker, or a context worker's first token followed by a generation worker's continuation (the
KV pulled over TCP, in this process), whatever the request's batch-mates."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from disagg.config import build_engine_config
from disagg.contracts.kv_mode import LOCAL, ContextOnly, KVMode, Pull
from disagg.contracts.params import ContextParams
from disagg.engine import AsyncLLM, RequestOutput
from disagg.kv_connector.settings import DisaggSettings
from disagg.request import SamplingParams

OPTIONS = dict(tokens_per_block=8, kv_cache_tokens=2048, max_model_len=256, max_num_tokens=64,
               max_batch_size=16)
PROMPT = [(11 * i + 7) % 250 + 3 for i in range(21)]
CASES = [  # seeds x filters; temperatures high enough that the tiny model's draws vary
    SamplingParams(temperature=2.0, seed=0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=3.0, seed=1234, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=2.5, top_p=0.95, seed=7, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=2.0, top_k=50, seed=2**40 + 3, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=3.0, top_k=100, top_p=0.9, seed=99, max_tokens=10,
                   ignore_eos=True, logprobs=2),
]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint(seed=4)  # the weights these tests were written against


async def _final(engine: AsyncLLM, rid: str, params: SamplingParams,
                 mode: KVMode = LOCAL) -> RequestOutput:
    last = None
    async for out in engine.generate(rid, PROMPT, params, mode=mode):
        last = out
    assert last is not None and last.finished, rid
    assert last.error is None, last.error
    return last


def test_seeded_tokens_same_aggregated_and_disaggregated(model_dir: str) -> None:
    config = build_engine_config(model_dir, **OPTIONS)

    async def main() -> None:
        agg = AsyncLLM(config)
        ctx = AsyncLLM(config, disagg=DisaggSettings(role="context", cluster_token="t",
                                                     backend="TCP"))
        gen = AsyncLLM(config, disagg=DisaggSettings(role="generation", cluster_token="t",
                                                     backend="TCP"))
        for e in (agg, ctx, gen):
            e.start()
        try:
            # Aggregated: all cases at once (batch-mates), plus unseeded noise beside them.
            noise = SamplingParams(temperature=1.5, max_tokens=14, ignore_eos=True)
            outs = await asyncio.gather(
                *(_final(agg, f"agg{i}", p) for i, p in enumerate(CASES)),
                *(_final(agg, f"noise{i}", noise) for i in range(3)))
            expected = [o.outputs[0].token_ids for o in outs[:len(CASES)]]
            assert len({tuple(t) for t in expected}) == len(CASES)  # the seeds do differ

            for i, p in enumerate(CASES):
                first = await _final(ctx, f"ctx{i}", p, mode=ContextOnly())
                assert first.disaggregated_params is not None  # not final: leased
                first_tokens = first.outputs[0].token_ids
                assert first_tokens == expected[i][:1], i
                remote = ContextParams.from_dict(first.disaggregated_params, PROMPT)
                rest = await _final(gen, f"gen{i}", p, mode=Pull(remote, trusted=False))
                assert rest.outputs[0].token_ids == expected[i], (i, p)
                if p.logprobs is not None:
                    agg_lp = outs[i].outputs[0].logprobs
                    assert agg_lp is not None and rest.outputs[0].logprobs is not None
                    assert list(map(set, rest.outputs[0].logprobs)) == list(map(set, agg_lp))
            # Every lease confirmed and every block back.
            for _ in range(500):
                if ctx.stats().kv_blocks_used == 0 and gen.stats().kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.01)
            assert ctx.stats().kv_blocks_used == 0 and gen.stats().kv_blocks_used == 0
        finally:
            for e in (agg, ctx, gen):
                await e.shutdown()

    asyncio.run(main())
