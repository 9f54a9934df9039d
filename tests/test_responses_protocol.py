"""The Responses API as chat and back (``disagg/contracts/responses.py``), without a server: the
chat body a request means, the 400s, the store's bounds, and the event stream of a chat
stream, which must end in the same response object as the whole answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg.contracts import protocol as P
from disagg.contracts import responses as R

TOOL = {"type": "function", "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def call_of(body: dict[str, Any], store: R.ResponseStore | None = None) -> R.ResponsesCall:
    req = R.parse_request(body)
    prev = req.previous_response_id
    previous = None if prev is None or store is None else store.get(prev)
    return R.ResponsesCall.build(req, previous)


def bad(body: dict[str, Any]) -> P.APIError:
    with pytest.raises(P.APIError) as e:
        call_of(body)
    assert e.value.status == 400
    return e.value


def test_chat_body_of_a_full_request() -> None:
    call = call_of({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 40,
        "temperature": 0.5, "top_p": 0.9, "tools": [TOOL], "tool_choice": "auto",
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "strict": True,
                            "schema": {"type": "object"}}},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "seed": 7,
        "stream": True, "store": False, "metadata": {"k": "v"}, "user": "u",
        "truncation": "disabled", "background": False, "reasoning": {"effort": None},
        "service_tier": "auto", "prompt_cache_key": "x", "some_vendor_extra": 1,
        "input": [
            {"role": "user", "content": "Oslo?"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": "{\"city\":\"Oslo\"}", "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                              {"type": "input_text", "text": "b"}]},
        ]})
    assert call.chat_body() == {
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": 40, "temperature": 0.5, "top_p": 0.9,
        "parallel_tool_calls": False, "seed": 7,
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "weather", "parameters": TOOL["parameters"]}}],
        "tool_choice": "auto",
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": {"type": "object"}, "strict": True}},
        "logprobs": True, "top_logprobs": 2,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Oslo?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}},
                {"id": "c2", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "rain"},
            {"role": "developer", "content": "a\nb"}]}
    # The chat body is a request the chat endpoint accepts (its schema and checks).
    P.validate_request("/v1/chat/completions", call.chat_body())
    named = call_of({"input": "x", "tools": [TOOL], "tool_choice": {
        "type": "function", "name": "get_weather"}})
    assert named.chat_body()["tool_choice"] == {"type": "function",
                                                "function": {"name": "get_weather"}}


def test_text_input_and_nulls() -> None:
    call = call_of({"input": "hi", "instructions": None, "max_output_tokens": None,
                    "stream": None, "store": None, "tools": None, "temperature": None})
    assert call.chat_body() == {"messages": [{"role": "user", "content": "hi"}],
                                "stream": False}
    assert call.req.store is True


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": None}, "input", "input"),
    ({"input": ""}, "input", "must not be empty"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt", "not supported"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "reason"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include", "not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text", "text.format.type"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text", "verbosity"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"input": "x", "stream_options": {}}, "stream_options", "stream"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input",
     "input.0.content.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "input.0.call_id"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id",
     "not found"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata", "metadata"),
])
def test_bad_requests_are_400_naming_the_field(body: dict[str, Any], param: str,
                                               words: str) -> None:
    e = bad(body)
    assert e.param == param and words in e.message, (e.param, e.message)


def test_store_bounds_count_age_and_delete() -> None:
    now = [0.0]
    store = R.ResponseStore(max_responses=2, ttl_s=10.0, clock=lambda: now[0])
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
        now[0] += 1.0
    assert store.get("r0") is None and len(store) == 2  # the oldest dropped first
    now[0] = 11.5  # r1 stored at 1.0: older than 10 s
    assert store.get("r1") is None and store.get("r2") is not None
    assert store.delete("r2") and not store.delete("r2") and len(store) == 0
    off = R.ResponseStore(max_responses=0)
    off.put({"id": "x"}, [])
    assert off.get("x") is None
    with pytest.raises(ValueError):
        R.ResponseStore(ttl_s=0)


def _answer(text: str | None, calls: list[tuple[str, str, str]], finish: str,
            lps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]
    return {"id": "chatcmpl-1", "model": "m", "created": 1, "choices": [{
        "index": 0, "message": message, "finish_reason": finish,
        "logprobs": None if lps is None else {"content": lps}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 2}}}


def _chunks(text: list[str], calls: list[tuple[str, str, list[str]]], finish: str,
            lps: list[list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """A chat stream as a worker sends it: role delta, text deltas, each call's head then
    argument fragments, the finish, the usage."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: Any = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}], "usage": None}

    out = [chunk({"role": "assistant", "content": ""})]
    for k, t in enumerate(text):
        out.append(chunk({"content": t}, logprobs=None if lps is None else {
            "content": lps[k]}))
    for i, (cid, name, frags) in enumerate(calls):
        out.append(chunk({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": i, "function": {"arguments": f}}]})
                for f in frags]
    out.append(chunk({}, finish))
    out.append({**head, "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2}}})
    return out


def _events(stream: str) -> list[dict[str, Any]]:
    out = []
    for block in stream.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        out.append(event)
    return out


def _strip_ids(resp: dict[str, Any]) -> dict[str, Any]:
    resp = json.loads(json.dumps(resp))
    for item in resp["output"]:
        item.pop("id")
    resp.pop("completed_at", None)
    return resp


LP = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}


@pytest.mark.parametrize("case", ["text", "calls", "text+call", "length", "empty", "logprobs"])
def test_stream_events_end_in_the_whole_answer(case: str) -> None:
    """The event sequence (types, order, sequence numbers, indexes) of a chat stream, and its
    last event's response equal to the whole answer's (ids aside)."""
    body: dict[str, Any] = {"input": "x", "stream": True, "tools": [TOOL]}
    text, calls, finish, lps = ["Hel", "lo"], [], "stop", None
    if case == "calls":
        text, calls, finish = [], [("c1", "get_weather", ['{"ci', 'ty":1}']),
                                   ("c2", "get_weather", ["{}"])], "tool_calls"
    elif case == "text+call":
        calls, finish = [("c1", "get_weather", ["{}"])], "tool_calls"
    elif case == "length":
        finish = "length"
    elif case == "empty":
        text = []
    elif case == "logprobs":
        body["include"] = ["message.output_text.logprobs"]
        lps = [[LP], [LP, LP]]
    kept: list[dict[str, Any]] = []
    call = call_of(body)
    es = R.EventStream(call, kept.append)
    stream = "".join(es.feed(c) for c in _chunks(text, calls, finish, lps)) + es.finish()
    events = _events(stream)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    expect = ["response.created", "response.in_progress"]
    if text or not calls:
        expect += ["response.output_item.added", "response.content_part.added"]
        expect += ["response.output_text.delta"] * len(text)
        expect += ["response.output_text.done", "response.content_part.done",
                   "response.output_item.done"]
    for _, _, frags in calls:
        expect += ["response.output_item.added"]
        expect += ["response.function_call_arguments.delta"] * len(frags)
        expect += ["response.function_call_arguments.done", "response.output_item.done"]
    expect.append("response.incomplete" if finish == "length" else "response.completed")
    assert types == expect
    final = events[-1]["response"]
    assert kept == [final]
    for e in events:
        if "output_index" in e:  # the index of the item it belongs to in the final output
            assert final["output"][e["output_index"]]["type"] in ("message", "function_call")
    whole = call.response(_answer(
        "".join(text) if text or not calls else None,
        [(cid, n, "".join(f)) for cid, n, f in calls], finish,
        None if lps is None else [x for part in lps for x in part]))
    assert _strip_ids(final) == _strip_ids(whole)
    assert final["status"] == ("incomplete" if finish == "length" else "completed")
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2},
                              "output_tokens": 3, "output_tokens_details": {
                                  "reasoning_tokens": 0}, "total_tokens": 8}


def test_stream_error_ends_in_response_failed() -> None:
    es = R.EventStream(call_of({"input": "x", "stream": True}))
    head = {"model": "m", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    events = _events(es.feed(head) + es.feed({"error": {"message": "boom", "code": 500}})
                     + es.finish())
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "boom" and events[-1]["response"]["status"] == "failed"


def test_previous_response_carries_the_conversation_not_the_instructions() -> None:
    store = R.ResponseStore()
    first = call_of({"input": "Oslo?", "instructions": "A", "tools": [TOOL]}, store)
    resp = first.response(_answer(None, [("c1", "get_weather", '{"city":"Oslo"}')],
                                  "tool_calls"))
    first.keep(store, resp)
    assert resp["output"][0]["type"] == "function_call" and resp["status"] == "completed"
    second = call_of({"input": [{"type": "function_call_output", "call_id": "c1",
                                 "output": "sunny"}], "previous_response_id": resp["id"],
                      "instructions": "B"}, store)
    assert second.chat_body()["messages"] == [
        {"role": "system", "content": "B"}, {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    unstored = call_of({"input": "x", "store": False}, store)
    unstored.keep(store, unstored.response(_answer("y", [], "stop")))
    assert store.get(unstored.response_id) is None
