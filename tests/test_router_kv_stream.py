"""The router's side of KV streaming (``kv_streaming``, ``disagg.router.stream_flow``) over a
scripted context + generation stub pair (aiohttp, no model) that records every call.

The stubs make concurrency observable: a streaming context call answers only once the
generation call of the same stream arrived (else, after a deadline, it fails), and the
generation call answers only once the context call answered. A router that sent the calls one
after the other would fail every streaming test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web
from router_fixtures import ROUTER_TOKEN, LoopThread, metric, running_router
from server_fixtures import wait_for

from disagg.cluster_auth import AUTH_HEADER, HttpVerifier
from disagg.contracts.cluster import RouterConfigError, parse_cluster_config
from disagg.router import cli as router_cli

C, CHAT = "/v1/completions", "/v1/chat/completions"
DEADLINE_S = 5.0  # how long a stub waits for the other call of its stream
KV_INFO = {"role": "context", "worker_id": "ctx-worker-1", "backend": "TCP",
           "addresses": ["127.0.0.1:47001"], "layout": {"num_layers": 2, "rank": 0},
           "lease_ttl_s": 30.0, "ucx": None}
STREAM_METRIC = "disagg_router_kv_stream_requests_total"
USAGE = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


class Pair:
    """A context and a generation stub sharing the events of each stream (one loop).

    Knobs: ``kv_info`` (the context worker's /server_info ``kv_transfer``), ``ctx_mode`` for
    streaming context calls (ok | fail: 500 | refuse: 409 | late: lets the generation call
    go on but answers only once ``ctx_hold`` is set), ``gen_mode`` for streaming generation
    calls (ok | kv_fail: 502 kv_transfer_failed | drop: connection closed unanswered |
    refuse_param: 400 naming disaggregated_params), ``hold``: a streamed answer waits for
    ``release`` after its first event."""

    def __init__(self) -> None:
        self.verifier = HttpVerifier(ROUTER_TOKEN)
        self.reset()
        self.ctx = self._app(self.context, "context")
        self.gen = self._app(self.generation, "generation")

    def reset(self) -> None:
        self.kv_info: dict[str, Any] | None = dict(KV_INFO)
        self.ctx_mode = "ok"
        self.gen_mode = "ok"
        self.hold = False
        self.calls: list[dict[str, Any]] = []
        self.releases: list[str] = []
        self.events: dict[tuple[str, str], asyncio.Event] = {}
        self.notes: list[str] = []  # what the stubs saw: "ctx saw gen", "gen cancelled", ...
        self.release: asyncio.Event | None = None
        self.ctx_hold: asyncio.Event | None = None
        self.ctx_transports: list[Any] = []

    def event(self, what: str, stream_id: str) -> asyncio.Event:
        return self.events.setdefault((what, stream_id), asyncio.Event())

    def _app(self, handler: Any, role: str) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "member_id": self.verifier.member_id})

        async def server_info(request: web.Request) -> web.Response:
            return self.server_info(role)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/server_info", server_info)
        app.router.add_post("/kv_leases/release", self.lease_release)
        app.router.add_post("/v1/{tail:.*}", handler)
        return app

    def server_info(self, role: str) -> web.Response:
        ctx = role == "context"
        return web.json_response({
            "role": "context" if ctx else "generation", "tokens_per_block": 16,
            "worker_id": "ctx-worker-1" if ctx else "gen-worker-1", "model_dir": None,
            "kv_transfer": self.kv_info if ctx else {**KV_INFO, "role": "generation",
                                                      "addresses": []}})

    async def lease_release(self, request: web.Request) -> web.Response:
        lease = (await request.json())["ctx_request_id"]
        self.releases.append(lease)
        return web.json_response({"ctx_request_id": lease, "released": True})

    async def _record(self, request: web.Request, role: str) -> dict[str, Any]:
        raw = await request.read()
        body = json.loads(raw)
        dp = body.get("disaggregated_params") or {}
        kind = ("stream" if "kv_stream_id" in dp or "kv_stream" in dp else
                "plain" if dp else "whole")
        header = request.headers.get(AUTH_HEADER)
        call = {"role": role, "kind": kind, "path": request.path, "body": body,
                "signed": header is not None, "t": time.monotonic(),
                "valid": self.verifier.is_valid(header, "POST", request.raw_path, raw)}
        self.calls.append(call)
        return call

    async def context(self, request: web.Request) -> web.StreamResponse:
        call = await self._record(request, "context")
        dp = call["body"]["disaggregated_params"]
        if call["kind"] == "plain":
            return web.json_response({**_answer(call["path"], " a", False),
                                      "prompt_token_ids": [1, 2, 3, 4],
                                      "disaggregated_params": {"ctx_request_id": "lease-1",
                                                               "first_gen_tokens": [5],
                                                               "prompt_token_ids": [1, 2, 3, 4]}})
        self.ctx_transports.append(request.transport)
        sid = dp["kv_stream_id"]
        try:
            await asyncio.wait_for(self.event("gen", sid).wait(), DEADLINE_S)
            self.notes.append("ctx saw gen")
        except asyncio.TimeoutError:
            return _error(500, "the generation call never came", "no_gen")
        if self.ctx_mode == "fail":
            return _error(500, "prefill failed", "internal")
        if self.ctx_mode == "refuse":
            return _error(409, "kv_stream_id in use", "conflict")
        self.event("ctx", sid).set()
        if self.ctx_mode == "late":  # G goes on; C's answer waits for the test
            self.ctx_hold = asyncio.Event()
            try:
                await asyncio.wait_for(self.ctx_hold.wait(), DEADLINE_S)
            except asyncio.TimeoutError:
                self.notes.append("ctx hold timed out")
        return web.json_response({**_answer(call["path"], " ignored", False),
                                  "disaggregated_params": {"ctx_request_id": sid,
                                                           "kv_stream_id": sid}})

    async def generation(self, request: web.Request) -> web.StreamResponse:
        call = await self._record(request, "generation")
        body = call["body"]
        if call["kind"] != "stream":
            return await self._answer(request, body, " two-call")
        sid = body["disaggregated_params"]["kv_stream"]["ctx_request_id"]
        self.event("gen", sid).set()
        if self.gen_mode == "kv_fail":
            return _error(502, "kv transfer failed: unknown_lease", "kv_transfer_failed")
        if self.gen_mode == "drop":  # died before answering
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if self.gen_mode == "refuse_param":
            return _error(400, "unknown field", "bad", "disaggregated_params.kv_stream")
        try:
            await asyncio.wait_for(self.event("ctx", sid).wait(), DEADLINE_S)
        except asyncio.CancelledError:
            self.notes.append("gen cancelled")  # the router closed the call
            raise
        except asyncio.TimeoutError:
            return _error(502, "the context worker never answered", "kv_transfer_failed")
        return await self._answer(request, body, " streamed")

    async def _answer(self, request: web.Request, body: dict[str, Any], text: str
                      ) -> web.StreamResponse:
        chat = request.path == CHAT
        if not body.get("stream"):
            return web.json_response(_answer(request.path, text, chat))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(_event(_chunk(text, chat)))
        if self.hold:
            self.release = asyncio.Event()
            try:
                await asyncio.wait_for(self.release.wait(), DEADLINE_S)
            except asyncio.TimeoutError:
                self.notes.append("hold timed out")
        await out.write(_event(_chunk(" more", chat)))
        if (body.get("stream_options") or {}).get("include_usage"):
            await out.write(_event({"id": "g", "object": "x", "choices": [], "usage": USAGE}))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "x", "param": param,
                                        "code": code}}, status=status)


def _answer(path: str, text: str, chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": "g", "object": "chat.completion" if chat else "text_completion",
            "created": 0, "model": "m", "choices": [choice], "usage": USAGE}


def _chunk(text: str, chat: bool) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"id": "g", "object": "x", "created": 0, "model": "m",
            "choices": [{**choice, "finish_reason": None}]}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.fixture(scope="module")
def pair(loop: LoopThread) -> Iterator[Pair]:
    p = Pair()
    runners = []
    try:
        for name in ("ctx", "gen"):
            runner, url = loop.serve(getattr(p, name))
            runners.append(runner)
            setattr(p, f"{name}_addr", url.removeprefix("http://"))
        yield p
    finally:
        for runner in runners:
            loop.run(runner.cleanup())


def _config(pair: Pair, **extra: Any) -> dict[str, Any]:
    return {"health_check_interval_sec": 0.2, "max_retries": 1, "kv_streaming": True,
            "context_servers": {"urls": [pair.ctx_addr]},
            "generation_servers": {"urls": [pair.gen_addr]}, **extra}


def _ctx_info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/cluster_info", timeout=5).json()["workers"]["context"][0]


def _ready(url: str, kv_transfer: bool = True) -> None:
    """The router serves and knows (or, ``kv_transfer`` False, no longer knows) the context
    worker's kv_transfer."""
    wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 20,
             what="router ready")
    wait_for(lambda: (_ctx_info(url)["kv_transfer"] is not None) == kv_transfer, 20,
             what="the context worker's kv_transfer")


@pytest.fixture()
def router(pair: Pair, loop: LoopThread) -> Iterator[SimpleNamespace]:
    pair.reset()
    with running_router(_config(pair), loop) as url:
        _ready(url)
        yield SimpleNamespace(url=url, pair=pair)


def _streaming_calls(pair: Pair) -> tuple[dict[str, Any], dict[str, Any]]:
    ctx = [c for c in pair.calls if c["role"] == "context" and c["kind"] == "stream"]
    gen = [c for c in pair.calls if c["role"] == "generation" and c["kind"] == "stream"]
    assert len(ctx) == 1 and len(gen) == 1, pair.calls
    return ctx[0], gen[0]


def _sse_texts(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return out


# ---- the streaming flow ----------------------------------------------------------------------


def test_both_calls_go_at_once_signed_with_the_contract_bodies(router: SimpleNamespace) -> None:
    url, pair = router.url, router.pair
    body = {"model": "m", "prompt": "The harbour was quiet", "max_tokens": 3}
    r = httpx.post(url + C, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == _answer(C, " streamed", False)  # G's answer, as it sent it
    ctx, gen = _streaming_calls(pair)
    assert [c["kind"] for c in pair.calls] == ["stream", "stream"]  # nothing else was sent
    assert pair.notes == ["ctx saw gen"]  # C was still prefilling when G's call arrived
    sid = ctx["body"]["disaggregated_params"]["kv_stream_id"]
    assert len(sid) == 32 and int(sid, 16) >= 0  # uuid4 hex
    assert ctx["body"] == {**body, "disaggregated_params": {  # (the request as sent: C
        "request_type": "context_only", "kv_stream_id": sid}}  # checks it as G will)
    assert gen["body"] == {**body, "disaggregated_params": {
        "request_type": "generation_only", "kv_stream": {
            "ctx_request_id": sid, "worker_id": "ctx-worker-1", "backend": "TCP",
            "addresses": ["127.0.0.1:47001"], "layout": {"num_layers": 2, "rank": 0}}}}
    assert ctx["valid"] and gen["valid"]  # both signed with the cluster token
    assert metric(url, STREAM_METRIC, outcome="streamed") == 1
    wait_for(lambda: metric(url, "disagg_router_ctx_latency_seconds_count") == 1, 10,
             what="the context answer read")
    assert pair.releases == []  # G took the stream (it frees the lease)
    info = httpx.get(url + "/cluster_info", timeout=5).json()
    assert info["kv_streaming"] is True
    assert info["workers"]["context"][0]["kv_transfer"] == {
        "backend": "TCP", "addresses": ["127.0.0.1:47001"]}


def test_a_stream_is_relayed_as_it_comes(router: SimpleNamespace, loop: LoopThread) -> None:
    """Chat, streamed, with usage: G's first event reaches the client while G still holds
    the rest; the client's messages and stream options reach G as sent."""
    url, pair = router.url, router.pair
    pair.hold = True
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + CHAT, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert _sse_texts(first) == [" streamed"]  # before G sent the rest
        assert pair.release is not None
        loop.loop.call_soon_threadsafe(pair.release.set)
        rest = "\n".join(lines)
    assert _sse_texts(rest) == [" more"] and rest.rstrip().endswith("data: [DONE]")
    assert '"usage": {"prompt_tokens": 4' in rest  # G's usage, not fixed up
    assert "hold timed out" not in pair.notes
    ctx, gen = _streaming_calls(pair)
    assert gen["body"]["messages"] == body["messages"] and gen["body"]["stream"] is True
    assert gen["body"]["stream_options"] == {"include_usage": True}
    assert ctx["body"]["stream"] is True  # as sent: C's answer is whole all the same
    assert ctx["body"]["stream_options"] == {"include_usage": True}


def test_a_context_answer_after_the_generation_answer_is_still_read(
        router: SimpleNamespace, loop: LoopThread) -> None:
    """G answered while C's answer was still on its way: the client is not kept waiting, the
    router reads C's answer to its end and reuses the connection for the next stream."""
    url, pair = router.url, router.pair
    pair.ctx_mode = "late"
    for i in (1, 2):
        r = httpx.post(url + C, json={"model": "m", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " streamed"
        # the client has its answer while C's is still held
        assert metric(url, "disagg_router_ctx_latency_seconds_count") == i - 1
        assert pair.ctx_hold is not None
        loop.loop.call_soon_threadsafe(pair.ctx_hold.set)
        wait_for(lambda n=i: metric(url, "disagg_router_ctx_latency_seconds_count") == n,
                 10, what="the context answer read")
    assert pair.ctx_transports[0] is pair.ctx_transports[1]  # one keep-alive connection
    assert pair.releases == [] and metric(url, STREAM_METRIC, outcome="streamed") == 2
    assert "ctx hold timed out" not in pair.notes


# ---- fallbacks -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_failed_context_call_closes_the_generation_call_and_falls_back(
        router: SimpleNamespace, stream: bool) -> None:
    url, pair = router.url, router.pair
    pair.ctx_mode = "fail"
    body = {"model": "m", "prompt": "hello", "max_tokens": 2, "stream": stream}
    r = httpx.post(url + C, json=body, timeout=30)
    assert r.status_code == 200, r.text
    texts = _sse_texts(r.text) if stream else [r.json()["choices"][0]["text"]]
    assert texts[0] == " two-call"
    wait_for(lambda: "gen cancelled" in pair.notes, 10, what="the generation call closed")
    assert sorted((c["role"], c["kind"]) for c in pair.calls[:2]) == [
        ("context", "stream"), ("generation", "stream")]
    plain = [c for c in pair.calls if c["kind"] == "plain"]
    assert [c["role"] for c in plain] == ["context", "generation"]
    # the two calls: prefill, then generation with the lease and the context's token ids
    assert plain[0]["body"]["disaggregated_params"] == {"request_type": "context_only"}
    assert plain[1]["body"]["disaggregated_params"]["ctx_request_id"] == "lease-1"
    assert plain[1]["body"]["disaggregated_params"]["prompt_token_ids"] == [1, 2, 3, 4]
    assert plain[1]["body"]["prompt"] == "hello"  # (as sent: the ids above are the prompt)
    sid = _streaming_calls(pair)[0]["body"]["disaggregated_params"]["kv_stream_id"]
    wait_for(lambda: pair.releases == [sid], 10, what="the stream's lease released")
    assert metric(url, STREAM_METRIC, outcome="fell_back") == 1
    assert metric(url, "disagg_router_retries_total", role="context",
                  reason="status_500") == 1


@pytest.mark.parametrize(("gen_mode", "role", "reason"), [
    ("kv_fail", "context", "kv_transfer_failed"), ("drop", "generation", "connection_failed")])
def test_a_failed_generation_call_falls_back(router: SimpleNamespace, gen_mode: str,
                                             role: str, reason: str) -> None:
    url, pair = router.url, router.pair
    pair.gen_mode = gen_mode
    r = httpx.post(url + C, json={"model": "m", "prompt": "hello", "max_tokens": 2,
                                  "stream": True}, timeout=30)
    assert r.status_code == 200 and _sse_texts(r.text)[0] == " two-call"
    assert [c["kind"] for c in pair.calls if c["role"] == "generation"] == ["stream", "plain"]
    sid = _streaming_calls(pair)[0]["body"]["disaggregated_params"]["kv_stream_id"]
    wait_for(lambda: sid in pair.releases, 10, what="the stream's lease released")
    assert metric(url, STREAM_METRIC, outcome="fell_back") == 1
    # a failed pull is the context side's fault, as in the two calls: a new prefill is the
    # retry; a lost generation call is the generation side's
    assert metric(url, "disagg_router_retries_total", role=role, reason=reason) == 1
    assert metric(url, "disagg_router_retries_total") == 1


def test_refusals_of_streaming_fall_back_without_spending_retries(pair: Pair,
                                                                  loop: LoopThread) -> None:
    """A context worker's 4xx, or a generation worker that does not know kv_stream: the same
    workers serve the two calls, even with max_retries 0."""
    pair.reset()
    with running_router(_config(pair, max_retries=0), loop) as url:
        _ready(url)
        for ctx_mode, gen_mode in (("refuse", "ok"), ("ok", "refuse_param")):
            pair.ctx_mode, pair.gen_mode = ctx_mode, gen_mode
            r = httpx.post(url + C, json={"model": "m", "prompt": "x", "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200, (ctx_mode, gen_mode, r.text)
            assert r.json()["choices"][0]["text"] == " two-call"
        assert metric(url, STREAM_METRIC, outcome="fell_back") == 2
        assert metric(url, "disagg_router_retries_total") == 0
        assert metric(url, "disagg_router_requests_total", outcome="success") == 2


def test_without_retries_a_failed_stream_is_the_answer(pair: Pair, loop: LoopThread) -> None:
    pair.reset()
    pair.ctx_mode = "fail"
    with running_router(_config(pair, max_retries=0), loop) as url:
        _ready(url)
        r = httpx.post(url + C, json={"model": "m", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 500 and r.json()["error"]["message"] == "prefill failed"
        assert [c["kind"] for c in pair.calls] == ["stream", "stream"]
        assert metric(url, STREAM_METRIC, outcome="failed") == 1


# ---- when the two calls serve it -------------------------------------------------------------


def _assert_two_calls(pair: Pair) -> None:
    kinds = [(c["role"], c["kind"]) for c in pair.calls]
    assert kinds == [("context", "plain"), ("generation", "plain")], kinds
    ctx, gen = pair.calls
    assert ctx["body"]["disaggregated_params"] == {"request_type": "context_only"}
    assert not ctx["signed"] and gen["valid"]
    assert gen["body"]["disaggregated_params"] == {
        "ctx_request_id": "lease-1", "first_gen_tokens": [5], "prompt_token_ids": [1, 2, 3, 4],
        "request_type": "generation_only"}


def test_option_off_keeps_the_two_calls(pair: Pair, loop: LoopThread) -> None:
    pair.reset()
    with running_router(_config(pair, kv_streaming=False), loop) as url:
        _ready(url)
        r = httpx.post(url + C, json={"model": "m", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " two-call"
        _assert_two_calls(pair)
        assert httpx.get(url + "/cluster_info", timeout=5).json()["kv_streaming"] is False
        assert metric(url, STREAM_METRIC) == 0


def test_prompt_logprobs_and_unknown_transfer_info_take_the_two_calls(
        router: SimpleNamespace) -> None:
    url, pair = router.url, router.pair
    r = httpx.post(url + C, json={"model": "m", "prompt": "x", "max_tokens": 2,
                                  "prompt_logprobs": 1}, timeout=30)
    assert r.status_code == 200, r.text
    _assert_two_calls(pair)
    pair.calls.clear()
    pair.kv_info = {**KV_INFO, "addresses": []}  # a context worker without a transfer server
    wait_for(lambda: _ctx_info(url)["kv_transfer"]["addresses"] == [], 20,
             what="the new kv_transfer")
    r = httpx.post(url + C, json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " two-call"
    _assert_two_calls(pair)
    assert metric(url, STREAM_METRIC, outcome="not_streamable") == 2
    # n > 1 is sent whole, as without streaming
    pair.calls.clear()
    r = httpx.post(url + C, json={"model": "m", "prompt": "x", "max_tokens": 2, "n": 2},
                   timeout=30)
    assert [(c["role"], c["kind"]) for c in pair.calls] == [("generation", "whole")]


# ---- configuration ---------------------------------------------------------------------------


BASE = {"context_servers": {"urls": ["127.0.0.1:9001"]},
        "generation_servers": {"urls": ["127.0.0.1:9002"]}}


def test_yaml_kv_streaming_is_a_validated_bool() -> None:
    assert parse_cluster_config(BASE, "t").kv_streaming is False
    assert parse_cluster_config({**BASE, "kv_streaming": True}, "t").kv_streaming is True
    for bad in ("yes", 1, [True]):
        with pytest.raises(RouterConfigError, match=r"^t: kv_streaming: expected bool"):
            parse_cluster_config({**BASE, "kv_streaming": bad}, "t")
    with pytest.raises(RouterConfigError, match=r"^t: kv_streaming: .*context_servers"):
        parse_cluster_config({"kv_streaming": True,
                              "generation_servers": {"urls": ["127.0.0.1:9002"]}}, "t")


def _args(path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router_cli.add_cli(parser.add_subparsers())
    return parser.parse_args(["router", "-c", str(path), *extra])


def test_the_command_line_overrides_the_yaml(tmp_path: Path) -> None:
    on = tmp_path / "on.yaml"
    on.write_text(yaml.safe_dump({**BASE, "kv_streaming": True}))
    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump(BASE))
    assert router_cli.configured(_args(on)).kv_streaming is True
    assert router_cli.configured(_args(on, "--no-kv-streaming")).kv_streaming is False
    assert router_cli.configured(_args(off, "--kv-streaming")).kv_streaming is True
    # the processes of --processes N get the override too
    argv = router_cli._child_argv(_args(off, "--kv-streaming"), "127.0.0.1")
    assert "--kv-streaming" in argv
    assert "--no-kv-streaming" in router_cli._child_argv(_args(on, "--no-kv-streaming"), "h")
    agg = tmp_path / "agg.yaml"
    agg.write_text(yaml.safe_dump({"generation_servers": {"urls": ["127.0.0.1:9002"]}}))
    with pytest.raises(RouterConfigError, match="^--kv-streaming: .*no context_servers"):
        router_cli.configured(_args(agg, "--kv-streaming"))


def test_disagg_launch_hands_the_option_to_the_router(tmp_path: Path, tiny_llama: str) -> None:
    """`disagg launch` starts the router on its resolved copy of the YAML: the option is there."""
    from disagg.launch import build_plan

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "hostname": "127.0.0.1", "port": 0, "model": "tiny", "kv_streaming": True,
        "context_servers": {"urls": ["127.0.0.1:18101"]},
        "generation_servers": {"urls": ["127.0.0.1:18102"]}}))
    plan = build_plan(str(path), tmp_path / "logs", model_override=tiny_llama)
    assert str(plan.cluster_yaml) in plan.router.cmd
    assert parse_cluster_config(yaml.safe_load(plan.cluster_yaml.read_text())).kv_streaming
