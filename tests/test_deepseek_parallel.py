"""DeepSeek-V3 over real rank processes (spawn, gloo, CPU, float32): tp2, pp2 and tp2 with
expert parallelism give transformers' greedy tokens; every rank caches the whole latent (one
part, one head, 48 wide) of its stage's layers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from parallel_fixtures import OPTS

from disagg import LLM
from disagg.parallel.executor import DistributedExecutor
from disagg.request import SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# Chunked prefills (max_num_tokens 48), a prompt sharing a prefix with another.
PROMPTS = [[5, 77, 300, 12, 9, 41, 250] * 3, [402, 17, 6, 6, 91],
           [5, 77, 300, 12, 9, 41, 250] * 3 + [8, 8]]
CASES = [(2, 1, False), (1, 2, False), (2, 1, True)]  # (tp, pp, enable_expert_parallel)


@pytest.fixture(scope="module")
def tiny_deepseek(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("tiny", arch="deepseek_v3", seed=1, num_hidden_layers=3)


@pytest.fixture(scope="module")
def reference(tiny_deepseek: str) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_deepseek, attn_implementation="eager", dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            gen = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize(("tp", "pp", "ep"), CASES,
                         ids=[f"tp{t}-pp{p}" + ("-ep" if e else "") for t, p, e in CASES])
def test_ranks_decode_like_transformers(tiny_deepseek: str, reference: list[list[int]],
                                        tp: int, pp: int, ep: bool) -> None:
    with LLM(tiny_deepseek, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             enable_expert_parallel=ep, **OPTS) as llm:
        ex = llm.engine.runner
        assert isinstance(ex, DistributedExecutor)
        lay = ex.layout
        assert (lay.cache_kind, lay.kv_parts, lay.kv_head_range) == ("mla", 1, (0, 1))
        assert tuple(ex.runner.kv_cache.shape[1:]) == (lay.num_local_layers, 1, 1,
                                                       OPTS["tokens_per_block"], 48)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
        assert [o.outputs[0].token_ids for o in outs] == reference
