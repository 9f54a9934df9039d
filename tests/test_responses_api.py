"""``/v1/responses`` with the ``openai`` SDK, on an aggregated worker and through the router of
a disaggregated cluster (one context and one generation worker process, TCP KV transfer):
text, the stream's events, a function call round trip with ``previous_response_id``, a
json_schema ``text.format``, the store (``GET`` / ``DELETE``, ``store: false``), the 400s; the
router's answers equal the aggregated worker's (greedy). And a router of two processes,
each keeping its own store, finding a response the other one stored."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from pydantic import BaseModel
from router_fixtures import ROUTER_TOKEN, LoopThread, running_router
from server_fixtures import serve_in_thread, start_worker_proc, stop_all, wait_all_healthy, wait_for

from disagg import procs

pytestmark = pytest.mark.slow

NAME = "tiny"
LIMITS = ["--kv-cache-tokens", "16384", "--max-model-len", "2048", "--max-num-tokens", "1024",
          "--max-batch-size", "32"]
TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 6}}}}


class Record(BaseModel):
    id: int
    ok: bool


RECORD_FORMAT = {"type": "json_schema", "name": "record", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["id", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}}}}


@pytest.fixture(scope="module")
def cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory,
            loop: LoopThread) -> Iterator[dict[str, str]]:
    from disagg.engine import AsyncLLM
    from disagg.server.app import ServerSettings, build_app

    tmp = tmp_path_factory.mktemp("responses")
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
                yield {"router": url, "aggregated": ref, "tmp": str(tmp)}
    finally:
        stop_all(ws)


SIDES = ("aggregated", "router")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def _outputs(resp: Any) -> list[tuple[Any, ...]]:
    """A response's output items without their ids."""
    out = []
    for item in resp.output:
        if item.type == "message":
            out.append(("message", item.status, tuple(p.text for p in item.content)))
        else:
            out.append((item.type, item.name, item.arguments, item.status))
    return out


def test_text_equal_on_worker_and_router(cluster: dict[str, str]) -> None:
    got = {}
    for side in SIDES:
        r = _client(cluster[side]).responses.create(
            model=NAME, input="Tell me a story.", instructions="Be brief.",
            max_output_tokens=12, temperature=0)
        assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 12 and r.usage.total_tokens == (
            r.usage.input_tokens + 12)
        assert r.instructions == "Be brief." and r.store is True
        got[side] = (_outputs(r), r.output_text, r.usage.input_tokens)
    assert got["router"] == got["aggregated"]


def _stream(url: str, **kw: Any) -> tuple[list[str], Any]:
    """The event types of a streamed response and its last event's response."""
    types, last = [], None
    seqs = []
    with _client(url).responses.create(model=NAME, stream=True, temperature=0, **kw) as s:
        for ev in s:
            types.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type in ("response.completed", "response.incomplete", "response.failed"):
                last = ev.response
    assert seqs == list(range(len(seqs)))
    return types, last


@pytest.mark.parametrize("case", ["text", "json_schema", "function_call"])
def test_stream_events_equal_on_worker_and_router(cluster: dict[str, str], case: str
                                                  ) -> None:
    kw: dict[str, Any] = {"input": "Give me a record.", "max_output_tokens": 80}
    if case == "json_schema":
        kw["text"] = {"format": RECORD_FORMAT}
    elif case == "function_call":
        kw.update(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    got = {}
    for side in SIDES:
        types, final = _stream(cluster[side], **kw)
        whole = _client(cluster[side]).responses.create(model=NAME, temperature=0, **kw)
        assert _outputs(final) == _outputs(whole)  # the stream ends in the whole answer
        got[side] = (types, _outputs(final), final.status)
        assert types[:2] == ["response.created", "response.in_progress"]
        if case == "text":
            assert types[-1] == "response.incomplete"
        else:
            assert types[-1] == "response.completed", types
        if case == "function_call":
            assert "response.function_call_arguments.delta" in types
            assert final.output[0].type == "function_call"
    assert got["router"] == got["aggregated"]


def test_sdk_stream_helper_and_parse(cluster: dict[str, str]) -> None:
    """``responses.stream`` (the SDK's event accumulator) and ``responses.parse``."""
    for side in SIDES:
        c = _client(cluster[side])
        with c.responses.stream(model=NAME, input="Give me a record.", temperature=0,
                                max_output_tokens=40, text_format=Record) as s:
            final = s.get_final_response()
        assert isinstance(final.output_parsed, Record)
        parsed = c.responses.parse(model=NAME, input="Give me a record.", temperature=0,
                                   max_output_tokens=40, text_format=Record)
        assert parsed.output_parsed == final.output_parsed


def test_function_call_round_trip_with_previous_response_id(cluster: dict[str, str]) -> None:
    """Turn 1 calls the tool; turn 2 sends only the call's output and the previous
    response's id: the server supplies the conversation. Equal on both sides."""
    got = {}
    for side in SIDES:
        c = _client(cluster[side])
        r1 = c.responses.create(model=NAME, input="Weather in Oslo?", tools=[TOOL],
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=80, temperature=0)
        call = r1.output[0]
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id and call.status == "completed"
        r2 = c.responses.create(model=NAME, previous_response_id=r1.id, tools=[TOOL],
                                input=[{"type": "function_call_output",
                                        "call_id": call.call_id, "output": "sunny"}],
                                max_output_tokens=10, temperature=0)
        assert r2.previous_response_id == r1.id and r2.status in ("completed", "incomplete")
        # Without the store the same turn needs the whole history as items (what a
        # stateless client sends): the same answer.
        r2b = c.responses.create(model=NAME, tools=[TOOL], store=False, input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
            max_output_tokens=10, temperature=0)
        assert _outputs(r2b) == _outputs(r2)
        assert r2.usage.input_tokens == r2b.usage.input_tokens
        # (The call's id is each server's own and this template writes it: the sides'
        # second turns are compared over one history.)
        same = c.responses.create(model=NAME, tools=[TOOL], store=False, input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
            max_output_tokens=10, temperature=0)
        got[side] = (_outputs(r1), _outputs(same))
    assert got["router"] == got["aggregated"]


def test_store_get_delete_and_store_false(cluster: dict[str, str]) -> None:
    for side in SIDES:
        c = _client(cluster[side])
        r = c.responses.create(model=NAME, input="hi", max_output_tokens=4, temperature=0)
        again = c.responses.retrieve(r.id)
        assert again.id == r.id and _outputs(again) == _outputs(r)
        c.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.delete(r.id)
        with pytest.raises(openai.BadRequestError, match="not found"):
            c.responses.create(model=NAME, input="x", previous_response_id=r.id)
        gone = c.responses.create(model=NAME, input="hi", max_output_tokens=4, store=False)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(gone.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image"}]}, "input"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"model": "other", "input": "x"}, "model"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                       "schema": {"type": "nonsense"}}}}, "response_format"),
])
def test_bad_requests_name_the_field(cluster: dict[str, str], body: dict[str, Any],
                                     param: str) -> None:
    for side in SIDES:
        r = httpx.post(cluster[side] + "/v1/responses", json=body, timeout=60)
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_nulls_are_absent(cluster: dict[str, str]) -> None:
    for side in SIDES:
        r = httpx.post(cluster[side] + "/v1/responses", timeout=60, json={
            "model": NAME, "input": "hi", "instructions": None, "max_output_tokens": 3,
            "temperature": None, "tools": None, "stream": None, "store": None,
            "previous_response_id": None, "text": None, "include": None})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "incomplete"


def test_router_processes_share_the_store(cluster: dict[str, str], tmp_path: Path) -> None:
    """Two router processes on one port, each with its own store: a response stored by one
    is found by the other (GET, previous_response_id, DELETE), whichever process a new
    connection reaches."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({
        "hostname": "127.0.0.1", "port": 0, "health_check_interval_sec": 0.2,
        "generation_servers": {"urls": [cluster["aggregated"].removeprefix("http://")]}}))
    log = tmp_path / "router.log"
    proc = procs.spawn([sys.executable, "-m", "disagg.cli", "router", "-c", str(cfg),
                        "--processes", "2"], log,
                       env={**os.environ, "DISAGG_CLUSTER_TOKEN": ROUTER_TOKEN})
    try:
        def listening() -> str | None:
            if proc.poll() is not None:
                raise AssertionError(f"router exited {proc.returncode}:\n{log.read_text()}")
            m = re.search(r"listening on (http://\S+) \(2 processes\)", log.read_text())
            return m.group(1) if m else None

        url = wait_for(listening, 60, what="the router's listening line")
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="health")
        ids: list[str] = []
        # A new connection per request: the kernel spreads them over the two processes.
        while len({i[-2:] for i in ids}) < 2 and len(ids) < 40:
            r = httpx.post(url + "/v1/responses", timeout=60, json={
                "model": NAME, "input": "hi", "max_output_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        assert {i[-2:] for i in ids} == {"p0", "p1"}, ids
        for rid in ids[-2:]:
            for _ in range(6):
                got = httpx.get(f"{url}/v1/responses/{rid}", timeout=60)
                assert got.status_code == 200 and got.json()["id"] == rid, got.text
                follow = httpx.post(url + "/v1/responses", timeout=60, json={
                    "model": NAME, "input": "more", "previous_response_id": rid,
                    "max_output_tokens": 2, "store": False})
                assert follow.status_code == 200, follow.text
            assert httpx.delete(f"{url}/v1/responses/{rid}", timeout=60).status_code == 200
            assert httpx.get(f"{url}/v1/responses/{rid}", timeout=60).status_code == 404
    finally:
        procs.stop_all([proc], grace_s=20.0, kill_wait_s=10.0)
