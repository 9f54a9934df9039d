"""Structured outputs and tool calls on one live worker (the tiny model, random weights), with
the ``openai`` SDK: whatever the weights, a constrained answer matches its schema / regex /
choices, ends with "stop" when the grammar completes, forced tool calls parse against the
tool's schema, streamed deltas assemble to the whole answer, and bad grammars are the
request's own 400 (or, found mid-generation, its own error: the batch goes on)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pydantic
import pytest
from server_fixtures import serve_in_thread

from disagg.contracts import tools as T
from disagg.engine import AsyncLLM
from disagg.request import SamplingParams
from disagg.server.app import ServerSettings, build_app
from disagg.server.tool_calls import ToolCalls
from disagg.structured.spec import GrammarSpec

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Who is it?"}]


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=10)
    days: int = pydantic.Field(ge=1, le=7)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                      "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
        "required": ["tz"], "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def live(model_dir: str) -> Iterator[SimpleNamespace]:
    """One engine behind two apps: one with the hermes tool-call parser, one without."""
    # The tools' schemas make long prompts with the tiny model's small vocabulary.
    engine = AsyncLLM.from_options(model_dir, tokens_per_block=16, kv_cache_tokens=16384,
                                   max_model_len=2048, max_num_tokens=1024, max_batch_size=32)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                           tool_call_parser="hermes"))
    bare = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                            owns_engine=False))
    with serve_in_thread(app) as url, serve_in_thread(bare) as bare_url:
        yield SimpleNamespace(url=url, bare=bare_url, engine=engine,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="x",
                                                   max_retries=0, timeout=120))


def test_json_schema_answers_match_their_schema(live: SimpleNamespace) -> None:
    rf = {"type": "json_schema", "json_schema": {
        "name": "person", "strict": True, "schema": Person.model_json_schema()}}
    for temperature, seed in ((0.0, None), (1.0, 1), (1.5, 2)):
        r = live.client.chat.completions.create(
            model=NAME, messages=MESSAGES, response_format=rf, max_tokens=120,
            temperature=temperature, seed=seed)
        ch = r.choices[0]
        Person.model_validate_json(ch.message.content)
        # The grammar's accepting state ended the request, not max_tokens.
        assert ch.finish_reason == "stop", ch.message.content
    r = live.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=120,
                                            response_format={"type": "json_object"}, seed=3,
                                            temperature=1.0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].finish_reason == "stop"


def test_sdk_parse_with_a_pydantic_model(live: SimpleNamespace) -> None:
    r = live.client.chat.completions.parse(model=NAME, messages=MESSAGES, response_format=Person,
                                           max_tokens=120, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_vllm_structured_outputs_and_guided_fields(live: SimpleNamespace) -> None:
    c = live.client
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"structured_outputs": {"regex": r"[a-c]{2}-[0-9]{3}"}},
         lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
        ({"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
         lambda t: t in ("yes", "no", "maybe so")),
        ({"structured_outputs": {"grammar": 'start: "x" NUM\nNUM: /[0-9]{2}/'}},
         lambda t: re.fullmatch(r"x[0-9]{2}", t)),
        ({"structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")'}},  # GBNF
         lambda t: t in ("ab", "ac")),
        ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"},
                                          "minItems": 1, "maxItems": 3}}},
         lambda t: 1 <= len(json.loads(t)) <= 3),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_json": json.dumps(Person.model_json_schema())}, Person.model_validate_json),
    ]
    for extra, ok in cases:
        for seed in (0, 1):
            r = c.completions.create(model=NAME, prompt="answer:", max_tokens=60,
                                     temperature=1.0, seed=seed, extra_body=extra)
            text = r.choices[0].text
            assert ok(text), (extra, text)
            assert r.choices[0].finish_reason == "stop", (extra, text)


@pytest.mark.parametrize("body,field", [
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"colour": "red"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_constraints_are_the_requests_own_400(live: SimpleNamespace, body: dict[str, Any],
                                                  field: str) -> None:
    r = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                   json={"model": NAME, "messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field), err


@pytest.mark.parametrize("body,field,kind", [
    ({"structured_outputs": {"grammar": "start: start"}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"grammar": "start: a\na: a"}}, "structured_outputs", "grammar"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "regex"),
    ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex", "regex"),
    # a forced prefix that never ends (it failed at the first sampled token)
    ({"structured_outputs": {"grammar": 'start: "a" start'}}, "structured_outputs", "grammar"),
    ({"guided_grammar": 'root ::= "{" root "}"'}, "guided_grammar", "grammar"),
    # a start that branches but never ends (every mask allows a token: it ran to max_tokens)
    ({"structured_outputs": {"grammar": 'start: ("a" | "b") start'}}, "structured_outputs",
     "grammar"),
    ({"guided_grammar": 'root ::= ("x" | "y" root) root'}, "guided_grammar", "grammar"),
])
def test_an_empty_language_is_the_requests_own_400(live: SimpleNamespace, body: dict[str, Any],
                                                   field: str, kind: str) -> None:
    """A grammar or regex that accepts no string (llguidance compiles it and fails at its
    first mask or first token: it was a 500) is a 400 naming the field, for chat streamed or
    not and for completions, before the engine takes a step for it."""
    steps = live.engine.stats().steps_total
    for path, extra in (("/v1/chat/completions", {"messages": MESSAGES}),
                        ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
                        ("/v1/completions", {"prompt": "x", "stream": True}),
                        ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(live.url + path, timeout=60,
                       json={"model": NAME, "max_tokens": 4, **extra, **body})
        assert r.status_code == 400, (path, extra, r.text)
        err = r.json()["error"]
        assert err["param"] == field, err
        assert err["message"].startswith(f"{field}: the {kind} accepts no string"), err
    assert live.engine.stats().steps_total == steps  # refused before it was queued


def test_auto_tool_choice_needs_a_parser(live: SimpleNamespace) -> None:
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS}
    r = httpx.post(live.bare + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    # Forced calls need none; with a parser, auto answers (plain text from random weights).
    r = httpx.post(live.bare + "/v1/chat/completions", timeout=60,
                   json={**body, "tool_choice": "required", "max_tokens": 100})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def _assemble(stream: Any) -> tuple[list[dict[str, str]], str | None, str]:
    """Tool calls and content assembled from stream chunks as a client does (by index)."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for ev in stream:
        for ch in ev.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: id, type, name
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def _calls(message: Any) -> list[dict[str, str]]:
    return [{"name": t.function.name, "arguments": t.function.arguments}
            for t in message.tool_calls]


@pytest.mark.parametrize("choice,parallel", [
    ({"type": "function", "function": {"name": "get_weather"}}, None),
    ("required", None), ("required", False)])
def test_forced_tool_calls_parse_and_stream(live: SimpleNamespace, choice: Any,
                                            parallel: bool | None) -> None:
    kw: dict[str, Any] = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                              max_tokens=200, temperature=0)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    r = live.client.chat.completions.create(**kw)
    ch = r.choices[0]
    calls = _calls(ch.message)
    assert calls and ch.message.content is None
    schemas = {"get_weather": Weather}
    for call in calls:
        model = schemas.get(call["name"])
        args = json.loads(call["arguments"])
        if model is not None:
            model.model_validate(args)
        else:
            assert args["tz"] in ("UTC", "CET")
    if isinstance(choice, dict):
        assert [c["name"] for c in calls] == ["get_weather"] and ch.finish_reason == "stop"
    else:
        assert ch.finish_reason == "tool_calls"
    if parallel is False:
        assert len(calls) == 1
    streamed, finish, content = _assemble(live.client.chat.completions.create(**kw,
                                                                              stream=True))
    assert streamed == calls and finish == ch.finish_reason and content == ""


def test_seeded_forced_calls_vary_but_always_parse(live: SimpleNamespace) -> None:
    seen = set()
    for seed in range(4):
        r = live.client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2,
            max_tokens=200, temperature=1.2, seed=seed)
        for ch in r.choices:
            for call in _calls(ch.message):
                args = json.loads(call["arguments"])
                if call["name"] == "get_weather":
                    Weather.model_validate(args)
                seen.add(call["arguments"])
    assert len(seen) > 1


def test_a_matcher_error_fails_its_request_only(live: SimpleNamespace) -> None:
    """A token the grammar refuses mid-generation (here: the mask left out, as a grammar the
    mask cannot express would) ends that request with an error; its batch-mate finishes."""
    eng = live.engine.engine
    spec = GrammarSpec("regex", "a{40}")
    real = eng._masks.forbidden
    eng._masks.forbidden = lambda matchers, device: None  # the engine thread reads it per step

    async def main() -> list[Any]:
        async def last(rid: str, params: SamplingParams) -> Any:
            outs = [o async for o in live.engine.generate(rid, [5, 6, 7], params)]
            return outs[-1]
        return await asyncio.gather(
            last("bad", SamplingParams(max_tokens=8, temperature=0, structured=spec)),
            last("good", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))

    try:
        bad, good = asyncio.run(main())
    finally:
        eng._masks.forbidden = real
    assert bad.outputs[0].finish_reason == "error"
    assert "does not match the grammar" in bad.error
    assert good.error is None and len(good.outputs[0].token_ids) == 8


def test_compiled_grammars_are_cached(live: SimpleNamespace) -> None:
    cache = live.engine.engine.grammars
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {"zz": {"type": "boolean"}}, "required": ["zz"]}}}
    misses = cache.misses
    for _ in range(3):
        live.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=30,
                                            response_format=rf, temperature=0)
    assert cache.misses == misses + 1


# ---- tool-call parsers (pure) ----------------------------------------------------------------

ARGS = {"city": "Oslo", "days": 2}


@pytest.mark.parametrize("parser,text,content", [
    ("hermes", 'Sure. <tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS)
     + '}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}'
     '</tool_call>', "Sure. "),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(ARGS)
     + '}; {"name": "get_time", "parameters": {"tz": "UTC"}}', ""),
    ("mistral", 'ok[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(ARGS)
     + '}, {"name": "get_time", "arguments": {"tz": "UTC"}}]', "ok"),
])
def test_parsers_read_calls_whole_and_streamed(parser: str, text: str, content: str) -> None:
    choice = T.resolve(TOOLS, "auto", None)
    msg, finish = ToolCalls(choice, parser).message(text, "stop")
    assert finish == "tool_calls" and (msg["content"] or "") == content
    want = [{"name": "get_weather", "arguments": json.dumps(ARGS)},
            {"name": "get_time", "arguments": json.dumps({"tz": "UTC"})}]
    assert [c["function"] for c in msg["tool_calls"]] == want
    # Streamed a few characters at a time: the same content and calls, each call's name
    # before its arguments.
    tc = ToolCalls(choice, parser)
    deltas = []
    for i in range(0, len(text), 3):
        deltas += tc.stream_delta(text[i:i + 3], finished=i + 3 >= len(text))
    got_content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    fragments = 0
    for d in deltas:
        for t in d.get("tool_calls", []):
            if t["index"] not in calls:
                assert t["function"]["name"]
                # ids: OpenAI's shape, or the 9 letters and digits Mistral's templates take
                assert (len(t["id"]) == 9 and t["id"].isalnum() if parser == "mistral"
                        else t["id"].startswith("call_"))
                calls[t["index"]] = {"name": t["function"]["name"], "arguments": ""}
            else:
                assert "name" not in t["function"]  # the name once, first
                fragments += 1
            calls[t["index"]]["arguments"] += t["function"]["arguments"]
    assert got_content == content and [calls[i] for i in sorted(calls)] == want
    assert fragments > len(want)  # the arguments arrive in pieces as they are written
    assert tc.stream_finish_reason("stop") == "tool_calls"


def test_calls_cut_short_read_the_same_whole_and_streamed() -> None:
    """An answer cut by max_tokens inside a call's arguments: whole and streamed agree (the
    call with its partial arguments; finish_reason "length" tells the client)."""
    choice = T.resolve(TOOLS, "required", None)
    text = '[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", ' \
           '"parameters": {"city": "Os'
    msg, finish = ToolCalls(choice, None).message(text, "length")
    assert finish == "length"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "Os')]
    tc = ToolCalls(choice, None)
    args: dict[int, str] = {}
    for i in range(0, len(text), 5):
        for d in tc.stream_delta(text[i:i + 5], i + 5 >= len(text)):
            for t in d.get("tool_calls", []):
                args[t["index"]] = args.get(t["index"], "") + t["function"]["arguments"]
    assert args == {0: '{"tz": "UTC"}', 1: '{"city": "Os'}


def test_parsers_leave_plain_text_alone() -> None:
    choice = T.resolve(TOOLS, "auto", None)
    for parser in T.PARSERS:
        text = "No tools needed <tool but plain text"
        msg, finish = ToolCalls(choice, parser).message(text, "stop")
        assert msg == {"role": "assistant", "content": text} and finish == "stop"
        tc = ToolCalls(choice, parser)
        streamed = "".join(d.get("content", "") for i in range(0, len(text), 4)
                           for d in tc.stream_delta(text[i:i + 4], i + 4 >= len(text)))
        assert streamed == text


# ---- request fields -> one GrammarSpec (pure) ------------------------------------------------


def test_every_request_field_maps_to_one_spec() -> None:
    from disagg.contracts import protocol as P

    def spec(**body: Any) -> GrammarSpec | None:
        req = P.ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
        return req.to_sampling_params(10, 1000).structured

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    same = GrammarSpec.json_schema(schema, "x")
    assert spec() is None and spec(response_format={"type": "text"}) is None
    got = spec(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema, "strict": True}})
    assert got is not None and got.kind == "json" and got.text == same.text
    # The client's key order is kept: llguidance writes properties in the schema's order.
    assert list(json.loads(got.text)["properties"]) == ["b", "a"]
    # The default string bound comes from max_tokens (here the chat default, 1000 - 10: half
    # of it, 495, rounded down to a power of two); a bare spec has none.
    assert got.string_bound == 256 and same.string_bound is None
    assert spec(structured_outputs={"json": schema}).text == same.text
    assert spec(guided_json=json.dumps(schema)).text == same.text
    assert spec(response_format={"type": "json_object"}).text == '{"type":"object"}'
    assert spec(guided_regex="a+").kind == "regex"
    assert json.loads(spec(structured_outputs={"choice": ["x", "y"]}).text) == ["x", "y"]
    assert spec(guided_grammar="start: \"a\"").kind == "grammar"
    forced = spec(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert forced is not None and json.loads(forced.text)["maxItems"] == 1
    assert spec(tools=TOOLS, tool_choice="none") is None
    assert spec(tools=TOOLS) is None  # auto: the model chooses, nothing is forced


def test_a_tool_round_trip_reaches_the_chat_template(live: SimpleNamespace) -> None:
    """The tools and an earlier call (arguments as an object) reach the template."""
    from disagg.contracts import protocol as P

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    req = P.ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS})
    msgs = req.chat_messages()
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    text = live.engine.tokenizer.apply_chat_template(msgs, tools=TOOLS)
    assert '"get_weather"' in text and '{"tz": "UTC"}' in text.replace("\\", "")
    r = live.client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None
