"""Speculative decoding under disaggregation (issue 39), with real multi-rank worker processes.

The generation worker speculates (``--speculative-config``): ngram prompt lookup, or a draft
model (the tiny llama cut to one layer, same tokenizer), whose prompt KV the generation worker
computes itself while the target's KV is pulled from the context worker. Every context
layout in {tp1, tp2, pp2, tp2 pp2} is paired with every generation layout of that set (the 16
llama pairs of ``test_disagg_parallel``), once with an ngram generation worker and once with a
draft-model one. A tp2 / pp2 generation worker verifies through the distributed executor
while the draft model runs on its rank 0. Each answer (``test_disagg_parallel``'s greedy
completion, SSE-streamed chat, json_schema and seeded + SSE-streamed json_object; a longer
seeded completion; a response_format json_schema; then KV-streamed pulls) must equal the
aggregated worker's without speculation, and the aggregated workers with speculation must
give the same texts. A context worker started with a speculative config only samples its
first token: the same answers too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest
from server_fixtures import device_for_ranks
from test_disagg_e2e import (
    CHAT,
    CHAT_PATH,
    NAME,
    PROMPTS,
    C,
    Worker,
    _start,
    _stop,
    _wait_healthy,
    context_call,
    disagg_text,
    ref_text,
    streamed_text,
)
from test_disagg_parallel import GEN_BLOCK, LAYOUTS, _bodies, _counter

from disagg.layout import WorkerLayout

DEVICE = device_for_ranks(4)
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})
DRAFTS = "disagg_spec_decode_num_draft_tokens_total"
ACCEPTED = "disagg_spec_decode_num_accepted_tokens_total"


def _requests() -> list[tuple[str, dict]]:
    """``test_disagg_parallel``'s four requests, a longer seeded completion (SSE-streamed:
    many rows to verify against the seeded draws) and a response_format json_schema."""
    seeded = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 1.5,
              "top_p": 0.95, "seed": 11, "ignore_eos": True, "stream": True}
    schema = {"type": "object", "required": ["id", "tags"], "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}
    json_schema = {"model": NAME, "messages": CHAT, "max_tokens": 40, "temperature": 0,
                   "response_format": {"type": "json_schema", "json_schema": {
                       "name": "rec", "schema": schema}}}
    return [*_bodies(), (C, seeded), (CHAT_PATH, json_schema)]


def _draft(model: str) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": 3})


def _par(tp: int, pp: int) -> list[str]:
    return ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--device", DEVICE]


@pytest.fixture(scope="module")
def draft_dir(tiny_checkpoint: Callable[..., str]) -> str:
    """The target's family and tokenizer (same seed), one layer instead of two."""
    return tiny_checkpoint("tiny-draft", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def ws(model_dir: str, draft_dir: str,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    """Per layout a context worker, an ngram generation worker and a draft-model generation
    worker; the aggregated references (plain, ngram, draft model) and a context worker that
    has a speculative config; all started at once, stopped at the module's end."""
    tmp = tmp_path_factory.mktemp("spec-disagg-logs")
    tcp = ["--kv-transfer-backend", "TCP"]
    out: dict[str, Worker] = {}
    for tp, pp in LAYOUTS:
        out[f"ctx{tp}{pp}"] = _start(tmp, model_dir, f"ctx{tp}{pp}", "context", *_par(tp, pp),
                                     *tcp, "--tokens-per-block", "16")
        out[f"ngram{tp}{pp}"] = _start(tmp, model_dir, f"ngram{tp}{pp}", "generation",
                                       *_par(tp, pp), *tcp, "--tokens-per-block",
                                       GEN_BLOCK[(tp, pp)], "--speculative-config", NGRAM)
        out[f"draft{tp}{pp}"] = _start(tmp, model_dir, f"draft{tp}{pp}", "generation",
                                       *_par(tp, pp), *tcp, "--tokens-per-block",
                                       GEN_BLOCK[(tp, pp)], "--speculative-config",
                                       _draft(draft_dir))
    out["ctx_spec"] = _start(tmp, model_dir, "ctx_spec", "context", *_par(1, 1), *tcp,
                             "--tokens-per-block", "16", "--speculative-config",
                             _draft(draft_dir))
    blk = ["--tokens-per-block", "16", "--device", DEVICE]
    out["agg"] = _start(tmp, model_dir, "agg", "aggregated", *blk)
    out["agg_ngram"] = _start(tmp, model_dir, "agg_ngram", "aggregated", *blk,
                              "--speculative-config", NGRAM)
    out["agg_draft"] = _start(tmp, model_dir, "agg_draft", "aggregated", *blk,
                              "--speculative-config", _draft(draft_dir))
    try:
        _wait_healthy(list(out.values()))
        yield out
    finally:
        _stop(list(out.values()))


@pytest.fixture(scope="module")
def expected(ws: dict[str, Worker]) -> list[str]:
    """The aggregated worker's texts without speculation, one per ``_requests()`` request."""
    return [ref_text(ws["agg"].url, path, body) for path, body in _requests()]


def _check_pair(expected: list[str], ctx: Worker, gen: Worker) -> None:
    """Every request disaggregated equals the plain aggregated text; the generation worker
    proposed drafts for them; no block stays in use on either side."""
    before = _counter(gen.url, DRAFTS)
    for (path, body), want in zip(_requests(), expected, strict=True):
        assert disagg_text(ctx, gen, path, body) == want, (ctx.name, gen.name, path, body)
    assert _counter(gen.url, DRAFTS) > before, f"{gen.name} proposed no draft tokens"
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def test_aggregated_with_speculation_matches_plain(ws: dict[str, Worker],
                                                   expected: list[str]) -> None:
    # The requests are worth checking: schema-valid JSON, a long seeded draw.
    assert isinstance(json.loads(expected[2])["n"], int)
    assert set(json.loads(expected[5])) == {"id", "tags"}
    assert len(expected[4]) > 24
    for name in ("agg_ngram", "agg_draft"):
        for (path, body), want in zip(_requests(), expected, strict=True):
            assert ref_text(ws[name].url, path, body) == want, (name, path, body)
        assert _counter(ws[name].url, DRAFTS) > 0, name
    # Some drafts accepted (rows past the first kept): the random tiny draft model rarely
    # agrees with its target, ngram lookups on the repetitive outputs do.
    assert _counter(ws["agg_ngram"].url, ACCEPTED) > 0


@pytest.mark.parametrize("gen_layout", LAYOUTS, ids=lambda x: f"gen-tp{x[0]}pp{x[1]}")
@pytest.mark.parametrize("ctx_layout", LAYOUTS, ids=lambda x: f"ctx-tp{x[0]}pp{x[1]}")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculating_generation_every_layout_pair(ws: dict[str, Worker], expected: list[str],
                                                  method: str, ctx_layout: tuple[int, int],
                                                  gen_layout: tuple[int, int]) -> None:
    """Plain pulls (every ``_requests()`` request), then KV-streamed pulls (greedy
    completion, SSE chat: the generation worker's reads overlap the context worker's
    prefill)."""
    ctx = ws["ctx{}{}".format(*ctx_layout)]
    gen = ws[method + "{}{}".format(*gen_layout)]
    layout = WorkerLayout.from_dict(gen.info()["kv_transfer"]["layout"])
    assert (layout.tp_size, layout.pp_size) == gen_layout
    _check_pair(expected, ctx, gen)
    for (path, body), want in zip(_bodies()[:2], expected, strict=False):
        assert streamed_text(ctx, gen, path, body) == want, (ctx.name, gen.name, path, body)
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def test_context_worker_with_speculation_is_exact(ws: dict[str, Worker],
                                                  expected: list[str]) -> None:
    """A context worker only samples the first token (its speculative config proposes
    nothing): its handover continues exactly on plain and speculating generation workers,
    and its first token and params equal a plain context worker's."""
    ctx = ws["ctx_spec"]
    for gen in ("ngram11", "draft21", "ngram12"):
        for (path, body), want in zip(_requests(), expected, strict=True):
            assert disagg_text(ctx, ws[gen], path, body) == want, (gen, path, body)
        ws[gen].wait_blocks(0)
    # (max_tokens 1: the first token is the whole answer, nothing leased)
    body = {"model": NAME, "prompt": "Numbers: 1, 2, 3", "max_tokens": 1, "temperature": 0,
            "ignore_eos": True}
    a, b = context_call(ctx, C, body), context_call(ws["ctx11"], C, body)
    assert a["disaggregated_params"] is None and b["disaggregated_params"] is None
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    assert _counter(ctx.url, DRAFTS) == 0  # the context side never speculates
    ctx.wait_blocks(0)
    ws["ctx11"].wait_blocks(0)


def test_generation_metrics_count_drafts(ws: dict[str, Worker], expected: list[str]) -> None:
    """Every speculating generation worker's /metrics, after a request of its own: drafts
    proposed, and accepted ones counted beside them."""
    path, body = _requests()[0]
    for name, w in ws.items():
        if name.startswith(("ngram", "draft")):
            assert disagg_text(ws["ctx11"], w, path, body) == expected[0], name
            assert _counter(w.url, DRAFTS) > 0, name
            text = httpx.get(w.url + "/metrics", timeout=10).text
            assert ACCEPTED in text and "disagg_spec_decode_acceptance_rate" in text, name
    assert _counter(ws["ngram11"].url, ACCEPTED) > 0
