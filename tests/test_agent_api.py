"""Agent tool loops with the ``openai`` SDK, on every checkpoint family the engine serves, on an
aggregated worker and through the router of a disaggregated cluster (one context and one
generation worker process, TCP KV transfer).

Each family's tiny checkpoint gets a chat template with its family's demands
(``family_templates``) and its family's ``--tool-call-parser``. Turn 1 forces a call
(``tool_choice: "required"``: the tiny model's weights are random); turn 2 sends the history
back as agent frameworks do (the assistant message with ``content: null`` or no content beside
its ``tool_calls``, then a ``tool`` message) and must be answered; both equal between the
aggregated worker and the router (greedy).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from family_templates import FAMILIES
from router_fixtures import ROUTER_TOKEN, LoopThread, running_router
from server_fixtures import serve_in_thread, start_worker_proc, stop_all, wait_all_healthy, wait_for

from disagg.contracts import protocol as P
from disagg.contracts import tools as T
from disagg.contracts.chat_prompt import render_chat
from disagg.tokenizer import ChatTemplateError, load_tokenizer

pytestmark = pytest.mark.slow

NAME = "tiny"
LIMITS = ["--kv-cache-tokens", "16384", "--max-model-len", "2048", "--max-num-tokens", "1024",
          "--max-batch-size", "32"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 6}}}}}]
QUESTION = {"role": "user", "content": "Weather in Oslo?"}


def family_checkpoint(tiny_dirs: dict[str, str], family: str, tmp: Path) -> str:
    """A copy of the family's tiny checkpoint with its family's chat template."""
    out = tmp / f"{family}-tools"
    shutil.copytree(tiny_dirs[family], out)
    (out / "chat_template.jinja").write_text(FAMILIES[family][0])
    return str(out)


# -- the templates' demands, and the messages in the shape they expect ------------------------


def _history(call_id: str, content_key: bool) -> list[dict[str, Any]]:
    assistant: dict[str, Any] = {"role": "assistant", "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    if content_key:
        assistant["content"] = None
    return [QUESTION, assistant,
            {"role": "tool", "tool_call_id": call_id, "content": "sunny, 20 C"}]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tool_history_renders_for_every_family(tiny_dirs: dict[str, str], family: str,
                                               tmp_path: Path) -> None:
    """The history an agent sends (OpenAI-shaped ids, null or missing content) renders with
    each family's template, the call's arguments written as an object."""
    template, parser = FAMILIES[family]
    tok = load_tokenizer(family_checkpoint(tiny_dirs, family, tmp_path))
    for content_key in (True, False):
        raw = _history("call_0123456789abcdef01234567", content_key)
        msgs = P.plain_messages([P.ChatMessage.model_validate(m) for m in raw], parser)
        text = render_chat(tok, msgs, add_generation_prompt=True,
                           continue_final_message=False, template_vars={}, tools=TOOLS)
        assert '"city": "Oslo"' in text and "sunny, 20 C" in text  # arguments as an object
    if family == "mistral":
        # An OpenAI-shaped id becomes the same 9 hex digits in the call and in its result.
        mapped = T.template_call_id("call_0123456789abcdef01234567", "mistral")
        assert len(mapped) == 9 and mapped.isalnum()
        assert text.count(f'"{mapped}"') == 2
        assert T.template_call_id("abcDEF123", "mistral") == "abcDEF123"  # already valid
        with pytest.raises(ChatTemplateError, match="length 9"):
            tok.apply_chat_template(_history("call_0123456789abcdef01234567", True),
                                    tools=TOOLS)
        assert len(T.new_call_id("mistral")) == 9 and T.new_call_id("mistral").isalnum()
    assert T.template_call_id("call_x", "hermes") == "call_x"


# A template that writes every turn by concatenating its content (as SmolLM2's does).
CONCAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}")


def test_null_content_reaches_a_concatenating_template_as_empty(tiny_dirs: dict[str, str]
                                                                ) -> None:
    """What users saw (400 "'dict object' has no attribute 'content'"): the client's dicts
    fail such a template; the messages as the server passes them render."""
    tok = load_tokenizer(tiny_dirs["llama"])
    for content_key in (True, False):
        raw = _history("call_1", content_key)
        with pytest.raises(ChatTemplateError, match="content"):
            tok.apply_chat_template(raw, chat_template=CONCAT)
        msgs = P.plain_messages([P.ChatMessage.model_validate(m) for m in raw])
        assert msgs[1]["content"] == ""
        assert tok.apply_chat_template(msgs, chat_template=CONCAT).count("<|im_start|>") == 3


# -- live: aggregated worker and router ----------------------------------------------------------


@pytest.fixture(scope="module", params=list(FAMILIES))
def cluster(request: pytest.FixtureRequest, tiny_dirs: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory, loop: LoopThread
            ) -> Iterator[dict[str, str]]:
    """The router of a context + generation worker pair of one family, and an aggregated
    worker of the same checkpoint."""
    from disagg.engine import AsyncLLM
    from disagg.server.app import ServerSettings, build_app

    family = request.param
    tmp = tmp_path_factory.mktemp(f"agent-{family}")
    model = family_checkpoint(tiny_dirs, family, tmp)
    parser = FAMILIES[family][1]
    common = ["--served-model-name", NAME, "--log-level", "warning", "--kv-transfer-backend",
              "TCP", "--tool-call-parser", parser, *LIMITS]
    env = {"DISAGG_CLUSTER_TOKEN": ROUTER_TOKEN}
    ws = [start_worker_proc(tmp, model, "ctx", ["--role", "context", "--tokens-per-block",
                                                "16", *common], env),
          start_worker_proc(tmp, model, "gen", ["--role", "generation",
                                                "--tokens-per-block", "8", *common], env)]
    engine = AsyncLLM.from_options(model, tokens_per_block=16, kv_cache_tokens=16384,
                                   max_model_len=2048, max_num_tokens=1024, max_batch_size=32)
    app = build_app(engine, ServerSettings(model_dir=model, served_model_name=NAME,
                                           tool_call_parser=parser))
    try:
        with serve_in_thread(app) as ref:
            wait_all_healthy(ws, 120.0)
            cfg = {"model": model, "health_check_interval_sec": 0.2,
                   "context_servers": {"urls": [ws[0].addr]},
                   "generation_servers": {"urls": [ws[1].addr]}}
            with running_router(cfg, loop) as url:
                wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30,
                         what="router")
                yield {"router": url, "aggregated": ref, "family": family, "parser": parser}
    finally:
        stop_all(ws)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def _turn(url: str, messages: list[dict[str, Any]], stream: bool, **kw: Any
          ) -> dict[str, Any]:
    """One chat turn: content, tool calls (id, name, arguments), finish_reason; a stream
    assembled from its deltas as clients do."""
    c = _client(url)
    if not stream:
        ch = c.chat.completions.create(model=NAME, messages=messages, tools=TOOLS,
                                       temperature=0, **kw).choices[0]
        calls = [(t.id, t.function.name, t.function.arguments)
                 for t in ch.message.tool_calls or []]
        return {"content": ch.message.content or "", "calls": calls,
                "finish": ch.finish_reason}
    content, calls, finish = "", {}, None
    for ev in c.chat.completions.create(model=NAME, messages=messages, tools=TOOLS,
                                        temperature=0, stream=True, **kw):
        for ch in ev.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                cid, name, args = calls.get(t.index, (t.id, t.function.name, ""))
                calls[t.index] = (cid, name, args + (t.function.arguments or ""))
            finish = ch.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def _history_of(first: dict[str, Any], content_key: bool) -> list[dict[str, Any]]:
    """Turn 2's messages after turn 1's call, as an agent sends them back."""
    cid, name, args = first["calls"][0]
    assistant: dict[str, Any] = {"role": "assistant", "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]}
    if content_key:
        assistant["content"] = None
    return [QUESTION, assistant, {"role": "tool", "tool_call_id": cid, "content": "sunny"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_loop_finishes(cluster: dict[str, str], stream: bool) -> None:
    """Turn 1 (a forced call) and turn 2 (its result sent back; tool_choice auto) on the
    aggregated worker and through the router: 200 each, the same calls (ids aside: each
    server makes its own) and the same answer to the same history."""
    firsts = {}
    for side in ("aggregated", "router"):
        first = _turn(cluster[side], [QUESTION], stream, tool_choice="required",
                      max_tokens=120, parallel_tool_calls=False)
        assert first["finish"] == "tool_calls" and len(first["calls"]) == 1, first
        if cluster["parser"] == "mistral":  # ids its template takes
            assert len(first["calls"][0][0]) == 9 and first["calls"][0][0].isalnum()
        firsts[side] = first
    assert [c[1:] for c in firsts["router"]["calls"]] == [
        c[1:] for c in firsts["aggregated"]["calls"]]
    seconds = {}
    for content_key in (True, False):
        for side in ("aggregated", "router"):
            history = _history_of(firsts["aggregated"], content_key)
            seconds[side] = _turn(cluster[side], history, stream, tool_choice="auto",
                                  max_tokens=24)
            assert seconds[side]["finish"] in ("stop", "length", "tool_calls")
        for side in seconds:  # (a call's id is each server's own)
            seconds[side]["calls"] = [c[1:] for c in seconds[side]["calls"]]
        assert seconds["router"] == seconds["aggregated"]
