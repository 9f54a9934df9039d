"""The ``bench.clients`` harness's own logic, offline: the shape checks of recorded exchanges,
the pass / server / model / client classification, the client modules' exception sorting
(bench/clients/common.py), and the recording proxy against a local stand-in upstream."""

from __future__ import annotations

import http.server
import importlib.util
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bench.clients import common
from bench.clients import harness as bc

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


def chat_answer(content: str | None = None, calls: list[tuple[str, str]] = (),
                finish: str = "stop") -> dict[str, Any]:
    tool_calls = [{"id": f"call_{i}", "type": "function",
                   "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": content,
                                     "tool_calls": tool_calls or None}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def exchange(request: dict[str, Any], response: Any, status: int = 200,
             path: str = "/v1/chat/completions") -> dict[str, Any]:
    e = {"kind": "exchange", "case": "c", "method": "POST", "path": path, "status": status,
         "request": request, "response": response}
    e["problems"] = bc.exchange_problems(e)
    return e


# -- shapes ---------------------------------------------------------------------------------------


def test_schema_errors_subset() -> None:
    schema = WEATHER_TOOL["function"]["parameters"]
    assert bc.schema_errors({"city": "Paris"}, schema) == []
    assert bc.schema_errors({}, schema) == ["$: missing 'city'"]
    assert bc.schema_errors({"city": "P", "x": 1}, schema) == ["$: unexpected 'x'"]
    assert bc.schema_errors({"city": 3}, schema) == ["$.city: int is not string"]
    ref = {"$defs": {"C": {"type": "object", "properties": {"n": {"type": "integer"}},
                           "required": ["n"]}},
           "type": "object", "properties": {"c": {"$ref": "#/$defs/C"}}}
    assert bc.schema_errors({"c": {"n": 1}}, ref) == []
    assert bc.schema_errors({"c": {"n": True}}, ref) == ["$.c.n: bool is not integer"]
    assert bc.schema_errors(None, {"anyOf": [{"type": "string"}, {"type": "null"}]}) == []
    assert bc.schema_errors(2, {"anyOf": [{"type": "string"}, {"type": "null"}]})


def test_chat_answer_shapes() -> None:
    req = {"model": "m", "messages": [], "tools": [WEATHER_TOOL]}
    assert exchange(req, chat_answer(calls=[("get_weather", '{"city": "Paris"}')],
                                     finish="tool_calls"))["problems"] == []
    assert exchange(req, chat_answer("hi"))["problems"] == []
    bad_args = exchange(req, chat_answer(calls=[("get_weather", "{city: Paris}")]))
    assert "arguments are not JSON" in bad_args["problems"][0]
    strict = exchange(req, chat_answer(calls=[("get_weather", '{"town": "Paris"}')]))
    assert any("strict tool's arguments break its schema" in p for p in strict["problems"])
    unknown = exchange(req, chat_answer(calls=[("get_time", "{}")]))
    assert "not one of the request's tools" in unknown["problems"][0]
    # Cut by max_tokens: the last call may stop mid-arguments, the ones before may not.
    cut = [("get_weather", '{"city": "Paris"}'), ("get_weather", "")]
    assert exchange(req, chat_answer(calls=cut, finish="length"))["problems"] == []
    assert "arguments are not JSON" in exchange(req, chat_answer(
        calls=cut[::-1], finish="length"))["problems"][0]
    forced = exchange({**req, "tool_choice": "required"}, chat_answer("no call"))
    assert "forced a call" in forced["problems"][0]
    # Cut short by max_tokens: the promises cannot hold yet, the shape still must.
    assert exchange({**req, "tool_choice": "required"},
                    chat_answer("no", finish="length"))["problems"] == []
    assert exchange(req, {"object": "text_completion"})["problems"] == [
        "answer is not a chat.completion object"]
    assert exchange(req, chat_answer("x", finish="done"))["problems"] == [
        "choices[0].finish_reason 'done' is not an OpenAI value"]


def test_response_format_checked() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "strict": True, "schema": {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
    req = {"messages": [], "response_format": fmt}
    assert exchange(req, chat_answer('{"name": "Paris"}'))["problems"] == []
    assert "asked for JSON" in exchange(req, chat_answer("Paris"))["problems"][0]
    assert "breaks the response_format schema" in exchange(
        req, chat_answer('{"city": "Paris"}'))["problems"][0]


def _sse(*events: Any, done: bool = True) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + (
        "data: [DONE]\n\n" if done else "")


def test_chat_stream_assembled() -> None:
    req = {"stream": True, "messages": [], "tools": [WEATHER_TOOL]}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    parts = [chunk({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1",
              "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}]}),
             chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}),
             chunk({}, "tool_calls")]
    assert exchange(req, _sse(*parts))["problems"] == []
    assert exchange(req, _sse(*parts, done=False))["problems"] == [
        "stream did not end with data: [DONE]"]
    assert "not a chat.completion.chunk" in exchange(
        req, _sse({"object": "x"}, *parts))["problems"][0]


def test_responses_shapes() -> None:
    tool = {"type": "function", "name": "get_weather", "strict": True,
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    req = {"model": "m", "input": "hi", "tools": [tool]}
    ok = {"id": "resp_1", "object": "response", "status": "completed", "output": [
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]}]}
    assert exchange(req, ok, path="/v1/responses")["problems"] == []
    no_call_id = json.loads(json.dumps(ok))
    del no_call_id["output"][0]["call_id"]
    assert exchange(req, no_call_id, path="/v1/responses")["problems"] == [
        "output[0]: function_call without a call_id"]
    stream = req | {"stream": True}
    events = "".join(f"event: {t}\ndata: {json.dumps(d)}\n\n" for t, d in (
        ("response.created", {"type": "response.created", "response": ok | {
            "status": "in_progress", "output": []}}),
        ("response.completed", {"type": "response.completed", "response": ok})))
    assert exchange(stream, events, path="/v1/responses")["problems"] == []
    assert exchange(stream, events.split("event: response.completed")[0],
                    path="/v1/responses")["problems"] == [
        "stream without response.completed / incomplete / failed"]


def test_error_bodies() -> None:
    assert exchange({}, {"error": {"message": "bad", "type": "invalid_request_error"}},
                    status=400)["problems"] == []
    assert exchange({}, "Not Found", status=404)["problems"] == [
        "error answer is not OpenAI error JSON ({\"error\": {\"message\": ...}})"]


# -- classification -----------------------------------------------------------------------------


def result(passed: bool = False, checks: list[tuple[str, bool]] = (),
           error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"case": "c", "passed": passed, "error": error,
            "checks": [{"name": n, "ok": ok, "detail": None} for n, ok in checks]}


def test_classify() -> None:
    good = exchange({"messages": []}, chat_answer("hi"))
    refused = exchange({"messages": []}, {"error": {"message": "the chat template rejected "
                                                               "them"}}, status=400)
    assert bc.classify(result(True, [("a", True)]), [good], False) == (bc.PASS, "")
    verdict, cause = bc.classify(result(True, [("a", True)]), [refused, good], False)
    assert verdict == bc.PASS and "passed regardless" in cause
    verdict, cause = bc.classify(result(error={"type": "openai.BadRequestError",
                                               "message": "x", "kind": "server"}),
                                 [good, refused], False)
    assert verdict == bc.SERVER and "-> 400: the chat template rejected them" in cause
    # All clean 2xx, the criteria failed on the model's text: the model's.
    verdict, cause = bc.classify(result(checks=[("the tool was called", False)]), [good],
                                 False)
    assert verdict == bc.MODEL and cause.startswith("the tool was called: no")
    model_err = {"type": "agents.exceptions.ModelBehaviorError", "message": "bad json",
                 "kind": "model"}
    assert bc.classify(result(error=model_err), [good], False)[0] == bc.MODEL
    # ... but the same model error over a malformed 2xx is the server's.
    broken = exchange({"messages": []}, {"object": "chat.completion", "choices": []})
    assert bc.classify(result(error=model_err), [broken], False)[0] == bc.SERVER
    sdk = {"type": "openai.APIResponseValidationError", "message": "x", "kind": "sdk"}
    assert bc.classify(result(error=sdk), [good], False)[0] == bc.SERVER
    other = {"type": "KeyError", "message": "x", "kind": "other"}
    assert bc.classify(result(error=other), [good], False)[0] == bc.UNCLEAR
    assert bc.classify(result(error=other), [], False)[0] == bc.CLIENT
    assert bc.classify(None, [], True, "ImportError: no module")[0] == bc.CLIENT
    hanging = {"method": "POST", "path": "/v1/responses", "status": None, "problems": []}
    verdict, cause = bc.classify(None, [hanging], True)
    assert verdict == bc.SERVER and "time limit" in cause


def test_pick_cases() -> None:
    agents = ["agents-chat", "agents-chat-required", "agents-responses",
              "agents-responses-required", "agents-chat-stream-required",
              "agents-responses-stream-required"]
    assert [c.name for c in bc.pick_cases("agents")] == agents
    assert [c.name for c in bc.pick_cases("instructor,agents-chat,agents")] == [
        "instructor-tools-strict", *agents]
    assert bc.CASES["langchain-tools-required"].extra == ("--tool-choice", "required")
    assert len(bc.pick_cases("all")) == len(bc.CASES)
    with pytest.raises(SystemExit, match="--clients: 'nope'"):
        bc.pick_cases("nope")
    for case in bc.CASES.values():  # every case names a client module that has it
        spec = importlib.util.find_spec(f"bench.clients.{case.module}")
        assert spec is not None and spec.origin is not None, case.module
        text = Path(spec.origin).read_text()
        assert f'"{case.arg}"' in text and case.venv in bc.VENVS


# -- the client side's exception sorting --------------------------------------------------------


def test_error_kind() -> None:
    class APIStatusError(Exception):
        pass

    class BadRequestError(APIStatusError):
        pass

    class ModelBehaviorError(Exception):
        pass

    class APIResponseValidationError(Exception):
        pass

    def raised(outer: Exception, inner: Exception | None = None) -> Exception:
        try:
            try:
                if inner is not None:
                    raise inner
            except Exception as e:
                raise outer from e
            raise outer
        except Exception as e:
            return e

    model = ("ModelBehaviorError",)
    assert common.error_kind(raised(ModelBehaviorError()), model) == "model"
    assert common.error_kind(raised(ModelBehaviorError(), BadRequestError()), model) == "server"
    assert common.error_kind(raised(RuntimeError(), APIResponseValidationError()),
                             model) == "sdk"
    assert common.error_kind(raised(KeyError()), model) == "other"
    class Group(Exception):  # an ExceptionGroup's shape (3.11+; the project takes 3.10)
        exceptions = (ValueError(), BadRequestError())

    assert common.error_kind(Group(), model) == "server"


def test_run_checks() -> None:
    run = common.Run("tools")
    run.tool(city="Paris, France")
    run.weather_checks("It is sunny.")
    assert [c["ok"] for c in run.checks] == [True, True, True]
    run = common.Run("tools")
    run.weather_checks(None)
    assert [c["ok"] for c in run.checks] == [False, False, False]


# -- the recording proxy ------------------------------------------------------------------------


class _Upstream(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/responses":
            data, status, ctype = b'{"error": {"message": "no such route"}}', 404, "json"
        elif body.get("stream"):
            data, status, ctype = _sse({"object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
                ).encode(), 200, "event-stream"
        else:
            data, status, ctype = json.dumps(chat_answer("hi")).encode(), 200, "json"
        self.send_response(status)
        self.send_header("Content-Type", f"application/{ctype}" if ctype == "json"
                         else "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_recorder_relays_and_records() -> None:
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    t = threading.Thread(target=upstream.serve_forever, daemon=True)
    t.start()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with opener.open(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    try:
        with bc.Recorder(f"http://127.0.0.1:{upstream.server_address[1]}", 10.0) as rec:
            status, data = post(f"{rec.url}/c/one/v1/chat/completions", {"messages": []})
            assert status == 200 and json.loads(data)["object"] == "chat.completion"
            status, data = post(f"{rec.url}/c/one/v1/chat/completions",
                                {"messages": [], "stream": True})
            assert status == 200 and data.endswith(b"data: [DONE]\n\n")
            status, _ = post(f"{rec.url}/c/two/v1/responses", {"input": "x"})
            assert status == 404
            one, two = rec.of_case("one"), rec.of_case("two")
    finally:
        upstream.shutdown()
        upstream.server_close()
        t.join(timeout=5)
    assert [(e["path"], e["status"], e["problems"]) for e in one] == [
        ("/v1/chat/completions", 200, []), ("/v1/chat/completions", 200, [])]
    assert one[0]["request"] == {"messages": []} and one[0]["response"]["choices"]
    assert isinstance(one[1]["response"], str) and "[DONE]" in one[1]["response"]
    assert [(e["path"], e["status"]) for e in two] == [("/v1/responses", 404)]
    assert two[0]["response"] == {"error": {"message": "no such route"}}


# -- the report -----------------------------------------------------------------------------------


def test_report_and_request_files(tmp_path: Path) -> None:
    refused = exchange({"model": "m", "input": "hi", "store": True},
                       {"error": {"message": "store: not supported"}}, status=400,
                       path="/v1/responses")
    good = exchange({"messages": []}, chat_answer("hi"))
    runs = []
    for name, ex, res in (("agents-responses", [refused], result(error={
            "type": "openai.BadRequestError", "message": "x", "kind": "server"})),
            ("langchain-structured", [good], result(True, [("a City instance", True)]))):
        run = bc.CaseRun(bc.CASES[name], 1, 1.0, False, res, ex, {}, "")
        run.verdict, run.cause = bc.classify(res, ex, False)
        runs.append(run)
    args = bc.parse_args(["--router-url", "http://127.0.0.1:1"])
    text = bc.report(runs, args, None, None, tmp_path / "clients.jsonl")
    assert "**Verdict: 1 of 2 cases pass (1 PASS, 1 FAIL (server)).**" in text
    assert ("| agents-responses | POST /v1/responses | 400: store: not supported | "
            '`{"model": "m", "input": "hi", "store": true}` |') in text
    assert "Passes when a `City(name, country)` instance came back" in text
    (tmp_path / "requests").mkdir()
    stale = tmp_path / "requests" / "agents-responses-03-v1_responses-404.json"
    other = tmp_path / "requests" / "agents-responses-required-00-v1_responses-200.json"
    stale.write_text("{}")
    other.write_text("{}")
    bc.write_requests(tmp_path / "requests", runs)
    assert not stale.exists() and other.exists()  # only the cases written are replaced
    saved = json.loads((tmp_path / "requests" / "agents-responses-00-v1_responses-400.json"
                        ).read_text())
    assert saved["request"]["store"] is True and saved["response"]["error"]
    index = (tmp_path / "requests" / "index.md").read_text()
    assert "langchain-structured-00-v1_chat_completions-200.json | 200 |" in index
