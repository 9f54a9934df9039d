"""DeepSeek-V3's latent (MLA) KV cache between real context and generation workers of every
pair of layouts over {tp1, tp2, pp2, tp2 + expert parallel}, plain (a completion, an
SSE-streamed chat, json_schema, seeded json_object) and KV-streamed, greedy text equal to an
aggregated worker's; the latent crosses once per context block and generation
rank (never once per context TP rank, though every one of them holds it), read from the
transfer metrics; a context answer whose layout says "mha" is a 400 naming cache_kind.

The tiny DeepSeek-V3 (``disagg model tiny --arch deepseek_v3``): 2 layers (the first dense),
4 heads, latent rows of kv_lora_rank 32 + qk_rope_head_dim 16 = 48 float32 per token and
layer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import device_for_ranks, wait_for
from test_disagg_e2e import (
    CHAT,
    CHAT_PATH,
    NAME,
    PROMPTS,
    UCX_OK,
    C,
    Worker,
    _post,
    _start,
    _stop,
    _wait_healthy,
    context_call,
    disagg_text,
    generation_body,
    ref_text,
    streamed_text,
)
from test_disagg_parallel import _bodies

from disagg.contracts.params import ContextParams
from disagg.layout import WorkerLayout

pytestmark = pytest.mark.slow

DEVICE = device_for_ranks(2)
WIDTH = 32 + 16  # kv_lora_rank + qk_rope_head_dim of the tiny checkpoint
LAYERS = 2
# Layouts (tp, pp, expert parallel) by worker-name suffix, and the generation workers'
# tokens_per_block (the context workers' is 16): a generation worker's 8 makes every pull into
# it convert the block size ("tokens" payloads). Expert parallelism changes where the experts
# run, not the cache: its pulls are tp2's.
LAYOUTS = {"11": (1, 1, False), "21": (2, 1, False), "12": (1, 2, False),
           "21ep": (2, 1, True)}
GEN_BLOCK = {"11": "16", "21": "8", "12": "8", "21ep": "16"}
PAIRS = [(c, g) for c in LAYOUTS for g in LAYOUTS]


def _par(name: str) -> list[str]:
    tp, pp, ep = LAYOUTS[name]
    return (["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
             "--device", DEVICE] + (["--enable-expert-parallel"] if ep else []))


@pytest.fixture(scope="module")
def ws(tiny_checkpoint: Callable[..., str],
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    model = tiny_checkpoint("tiny", arch="deepseek_v3", seed=1)
    tmp: Path = tmp_path_factory.mktemp("deepseek-logs")
    workers: dict[str, Worker] = {}
    try:
        for name in LAYOUTS:
            # The tp2 context worker serves over UCX when it can (zero-copy block views of
            # the latent cache), the others over TCP.
            backend = "UCX" if name == "21" and UCX_OK else "TCP"
            workers[f"ctx{name}"] = _start(tmp, model, f"ctx{name}", "context", *_par(name),
                                           "--kv-transfer-backend", backend,
                                           "--tokens-per-block", "16")
            workers[f"gen{name}"] = _start(tmp, model, f"gen{name}", "generation",
                                           *_par(name), "--kv-transfer-backend", "TCP",
                                           "--tokens-per-block", GEN_BLOCK[name])
        workers["agg"] = _start(tmp, model, "agg", "aggregated", "--tokens-per-block", "16",
                                "--device", DEVICE)
        _wait_healthy(list(workers.values()))
        yield workers
    finally:
        _stop(list(workers.values()))


def _name(layout: str) -> str:
    tp, pp, ep = LAYOUTS[layout]
    return f"tp{tp}pp{pp}" + ("ep" if ep else "")


@pytest.mark.parametrize(("ctx_layout", "gen_layout"), PAIRS,
                         ids=[f"{_name(c)}-{_name(g)}" for c, g in PAIRS])
def test_layout_pair_matches_aggregated(ws: dict[str, Worker], ctx_layout: str,
                                        gen_layout: str) -> None:
    """Plain pulls (greedy completion, SSE-streamed chat, json_schema, seeded json_object),
    then the chat KV-streamed: the aggregated worker's text each time, no block left in use
    on either side."""
    ctx, gen = ws[f"ctx{ctx_layout}"], ws[f"gen{gen_layout}"]
    layout = WorkerLayout.from_dict(gen.info()["kv_transfer"]["layout"])
    assert (layout.cache_kind, layout.kv_parts, layout.num_kv_heads, layout.head_dim) == (
        "mla", 1, 1, WIDTH)
    for path, body in _bodies():
        assert disagg_text(ctx, gen, path, body) == ref_text(ws["agg"].url, path, body), (
            path, body)
    chat = {"model": NAME, "messages": CHAT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    assert streamed_text(ctx, gen, CHAT_PATH, chat) == ref_text(ws["agg"].url, CHAT_PATH, chat)
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("ctx_name", ["ctx21", "ctx11"])
def test_the_latent_crosses_once_per_block_and_generation_rank(ws: dict[str, Worker],
                                                               ctx_name: str) -> None:
    """tp2 (and tp1) context -> tp2 generation: both generation ranks need every layer's
    latent, each reads it from one context rank, so the bytes moved (the generation worker's
    received and the context worker's sent, over all ranks) are the prompt's latent rows
    once per generation rank: 2 x layers x T x 48 x 4 bytes (the B=8 generation worker reads
    token-major payloads, exactly T rows). Reading from every context rank that holds the
    latent would double that for the tp2 context worker."""
    ctx, gen = ws[ctx_name], ws["gen21"]
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    answer = context_call(ctx, C, body)
    params = ContextParams.from_dict(answer["disaggregated_params"])
    assert params.layout.cache_kind == "mla" and params.layout.tp_size == int(ctx_name[3])
    latent_bytes = LAYERS * params.num_tokens * WIDTH * 4  # float32 rows of the prompt
    assert math.ceil(params.num_tokens / 16) >= 2  # several context blocks
    name = "disagg_kv_transfer_bytes_total"
    got0, sent0 = _counter(gen.url, name), _counter(ctx.url, name)
    r = _post(gen.url, C, generation_body(C, body, answer))
    assert r.status_code == 200, r.text
    want = 2 * latent_bytes
    wait_for(lambda: _counter(gen.url, name) - got0 == want, 15, 0.05,
             what=f"{want} bytes received over the generation ranks")
    wait_for(lambda: _counter(ctx.url, name) - sent0 == want, 15, 0.05,
             what=f"{want} bytes sent over the context ranks")
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def test_an_mha_layout_is_a_400_naming_cache_kind(ws: dict[str, Worker]) -> None:
    """Params whose layout is an MHA cache's (what a Llama-family context worker, or an older
    one that names no kind, sends) are refused by the MLA generation worker with a 400 naming
    cache_kind; the refusal releases the context worker's lease."""
    ctx, gen = ws["ctx11"], ws["gen11"]
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    answer = context_call(ctx, C, body)
    good = generation_body(C, body, answer)
    dp = good["disaggregated_params"]
    older = {k: v for k, v in dp["layout"].items() if k not in ("cache_kind", "kv_parts")}
    for layout in (older, {**dp["layout"], "cache_kind": "mha", "kv_parts": 2}):
        r = _post(gen.url, C, {**good, "disaggregated_params": {**dp, "layout": layout}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "cache_kind differs" in err["message"] and "(mla)" in err["message"], err
        assert err["param"] == "disaggregated_params"
    ctx.wait_blocks(0)  # released by the first refusal
    gen.wait_blocks(0)
