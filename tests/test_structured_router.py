"""Structured outputs and forced tool calls through the router of a disaggregated cluster
(one context and one generation worker process, TCP KV transfer, different
``tokens_per_block``) equal one aggregated worker's answers, streamed or not, with the
``openai`` SDK: the same JSON for a schema, the same tool calls, the same finish_reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from router_fixtures import ROUTER_TOKEN, LoopThread, running_router
from server_fixtures import (
    serve_in_thread,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

NAME = "tiny"
LIMITS = ["--kv-cache-tokens", "16384", "--max-model-len", "2048", "--max-num-tokens", "1024",
          "--max-batch-size", "32"]
MESSAGES = [{"role": "user", "content": "Give me a record."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "ok": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["key"],
    "properties": {"key": {"type": "string", "maxLength": 6}}}}}]


@pytest.fixture(scope="module")
def cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory,
            loop: LoopThread) -> Iterator[dict[str, str]]:
    """The router of a context + generation worker pair, and an aggregated reference."""
    from disagg.engine import AsyncLLM
    from disagg.server.app import ServerSettings, build_app

    tmp = tmp_path_factory.mktemp("structured-logs")
    common = ["--served-model-name", NAME, "--log-level", "warning", "--kv-transfer-backend",
              "TCP", "--tool-call-parser", "hermes", *LIMITS]
    env = {"DISAGG_CLUSTER_TOKEN": ROUTER_TOKEN}
    ws = [start_worker_proc(tmp, model_dir, "ctx", ["--role", "context", "--tokens-per-block",
                                                    "16", *common], env),
          start_worker_proc(tmp, model_dir, "gen", ["--role", "generation",
                                                    "--tokens-per-block", "8", *common], env)]
    engine = AsyncLLM.from_options(model_dir, tokens_per_block=16, kv_cache_tokens=16384,
                                   max_model_len=2048, max_num_tokens=1024, max_batch_size=32)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                           tool_call_parser="hermes"))
    try:
        with serve_in_thread(app) as ref:
            wait_all_healthy(ws, 120.0)
            cfg = {"model": model_dir, "health_check_interval_sec": 0.2,
                   "context_servers": {"urls": [ws[0].addr]},
                   "generation_servers": {"urls": [ws[1].addr]}}
            with running_router(cfg, loop) as url:
                wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30,
                         what="router")
                yield {"router": url, "reference": ref}
    finally:
        stop_all(ws)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(url: str, stream: bool, **kw: Any) -> dict[str, Any]:
    """The answer's content, tool calls (name, arguments) and finish_reason; streamed
    answers assembled from their deltas as a client does."""
    c = _client(url)
    if not stream:
        ch = c.chat.completions.create(model=NAME, messages=MESSAGES, **kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        return {"content": ch.message.content or "", "calls": calls,
                "finish": ch.finish_reason}
    content, calls, finish = "", {}, None
    for ev in c.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, **kw):
        for ch in ev.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                name, args = calls.get(t.index, (t.function.name, ""))
                calls[t.index] = (name, args + (t.function.arguments or ""))
            finish = ch.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


CASES = {
    "schema-greedy": dict(temperature=0, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}),
    "schema-seeded": dict(temperature=1.3, seed=11, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}),
    "json-object-seeded": dict(temperature=1.0, seed=5, max_tokens=80,
                               response_format={"type": "json_object"}),
    "named-tool": dict(temperature=1.0, seed=2, max_tokens=80, tools=TOOLS,
                       tool_choice={"type": "function", "function": {"name": "lookup"}}),
    "required-tool": dict(temperature=0, max_tokens=120, tools=TOOLS, tool_choice="required"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_disaggregated_equals_aggregated(cluster: dict[str, str], case: str,
                                         stream: bool) -> None:
    kw = CASES[case]
    got = _chat(cluster["router"], stream, **kw)
    want = _chat(cluster["reference"], stream, **kw)
    assert got == want
    if "tools" in kw:
        assert got["calls"] and got["content"] == ""
        for _, args in got["calls"]:
            assert set(json.loads(args)) == {"key"}
        assert got["finish"] == ("stop" if case == "named-tool" else "tool_calls")
    else:
        assert isinstance(json.loads(got["content"]), dict) and got["finish"] == "stop"


def test_completions_regex_through_the_router(cluster: dict[str, str]) -> None:
    def run(url: str, stream: bool) -> str:
        c = _client(url)
        kw: dict[str, Any] = dict(model=NAME, prompt="code:", max_tokens=20, temperature=1.0,
                                  seed=9, extra_body={"structured_outputs": {
                                      "regex": "[A-Z]{2}[0-9]{3,5}"}})
        if not stream:
            return c.completions.create(**kw).choices[0].text
        return "".join(ch.text for ev in c.completions.create(**kw, stream=True)
                       for ch in ev.choices)
    for stream in (False, True):
        assert run(cluster["router"], stream) == run(cluster["reference"], stream)


def test_bad_grammars_are_400_through_the_router(cluster: dict[str, str]) -> None:
    """A regex the context worker cannot compile, or a grammar that accepts no string, is the
    client's 400 (naming the field), and tool_choice auto is answered by workers that have a
    parser."""
    r = httpx.post(cluster["router"] + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "(ab"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    r = httpx.post(cluster["router"] + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS,
        "structured_outputs": {"choice": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    # a grammar with an empty language: the context worker's 400, streamed chat too
    for grammar in ("start: start", "root ::= root", 'start: "a" start'):
        for stream in (False, True):
            r = httpx.post(cluster["router"] + "/v1/chat/completions", timeout=60, json={
                "model": NAME, "messages": MESSAGES, "max_tokens": 4, "stream": stream,
                "structured_outputs": {"grammar": grammar}})
            assert r.status_code == 400, (grammar, stream, r.text)
            err = r.json()["error"]
            assert err["param"] == "structured_outputs", err
            assert "the grammar accepts no string" in err["message"], err
    r = httpx.post(cluster["router"] + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS,
        "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
