"""The router in front of real workers (2 context + 1 generation subprocesses, TCP transfer).

Checks: the official ``openai`` client through the router (completions and chat, streamed or
not) gets the greedy text of an aggregated worker; retries and error paths (with scripted
fake workers); KV-aware routing and a worker restarted with another block size; a client
disconnect frees the KV on both sides; killing a context worker under load.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from router_fixtures import ROUTER_TOKEN, LoopThread, metric, running_router
from server_fixtures import (
    WorkerProc,
    reference_server,
    signed,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

from disagg.contracts.cluster import parse_cluster_config

NAME = "tiny"
TOKEN = ROUTER_TOKEN
COMMON = ["--kv-cache-tokens", "4096", "--max-model-len", "512", "--max-num-tokens", "256",
          "--max-batch-size", "32"]
START_TIMEOUT = 120.0
C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["The harbour was quiet", "Memory is organised in small blocks of tokens, and every "
           "block holds sixteen of them.", "Numbers: 1, 2, 3"]
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


# ---- helpers shared with the other router tests ----------------------------------------------


Worker = WorkerProc


def start_worker(tmp: Path, model_dir: str, name: str, role: str, *flags: str,
                 port: int | None = None, env: dict[str, str] | None = None) -> Worker:
    backend = ["--kv-transfer-backend", "TCP"] if role != "aggregated" else []
    return start_worker_proc(tmp, model_dir, name, [
        "--role", role, "--served-model-name", NAME, "--log-level", "warning", *COMMON,
        *backend, *flags], {"DISAGG_CLUSTER_TOKEN": TOKEN, **(env or {})}, port=port)


def wait_healthy(workers: list[Worker]) -> None:
    wait_all_healthy(workers, START_TIMEOUT)


stop_workers = stop_all


def cluster(url: str) -> dict[str, Any]:
    return httpx.get(url + "/cluster_info", timeout=10).json()


def worker_info(url: str, addr: str) -> dict[str, Any]:
    for ws in cluster(url)["workers"].values():
        for w in ws:
            if w["url"] == addr:
                return w
    raise KeyError(addr)


def sse_text(path: str, r: httpx.Response) -> tuple[str, list[dict[str, Any]]]:
    text, events = "", []
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        events.append(ev)
        for ch in ev.get("choices", []):
            text += ch.get("text", "") if path == C else ch["delta"].get("content", "") or ""
    return text, events


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(model_dir: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Worker]]:
    tmp = tmp_path_factory.mktemp("router-logs")
    ws = {
        "ctx1": start_worker(tmp, model_dir, "ctx1", "context", "--tokens-per-block", "16"),
        "ctx2": start_worker(tmp, model_dir, "ctx2", "context", "--tokens-per-block", "16"),
        "gen": start_worker(tmp, model_dir, "gen", "generation", "--tokens-per-block", "16"),
    }
    ws["_tmp"] = tmp  # type: ignore[assignment]
    try:
        wait_healthy([w for k, w in ws.items() if k != "_tmp"])
        yield ws
    finally:
        stop_workers([w for k, w in ws.items() if k != "_tmp"])


@pytest.fixture(scope="module")
def reference(model_dir: str) -> Iterator[str]:
    """An aggregated worker in this process: the expected outputs."""
    with reference_server(model_dir, NAME) as url:
        yield url


def disagg_config(ws: dict[str, Worker], model_dir: str, ctx_router: dict | None = None,
                  **extra: Any) -> dict[str, Any]:
    return {"model": model_dir, "health_check_interval_sec": 0.2,
            "context_servers": {"urls": [ws["ctx1"].addr, ws["ctx2"].addr],
                                "router": ctx_router or {"type": "round_robin"}},
            "generation_servers": {"urls": [ws["gen"].addr]}, **extra}


@pytest.fixture(scope="module")
def router(workers: dict[str, Worker], model_dir: str, loop: LoopThread) -> Iterator[str]:
    with running_router(disagg_config(workers, model_dir), loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
        yield url


# ---- the openai client through the router ----------------------------------------------------


def _client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=60, max_retries=0)


def _complete(client: openai.OpenAI, path: str, stream: bool, max_tokens: int = 10,
              prompt: str = PROMPTS[1]) -> tuple[str, Any]:
    extra = {"ignore_eos": True}
    if path == C:
        if not stream:
            r = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0, extra_body=extra)
            return r.choices[0].text, r.usage
        text, usage = "", None
        for ev in client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body=extra,
                                            stream_options={"include_usage": True}):
            text += "".join(c.text for c in ev.choices)
            usage = ev.usage or usage
        return text, usage
    if not stream:
        r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=max_tokens,
                                           temperature=0, extra_body=extra)
        return r.choices[0].message.content or "", r.usage
    text, usage = "", None
    for ev in client.chat.completions.create(model=NAME, messages=MESSAGES,
                                             max_tokens=max_tokens, temperature=0, stream=True,
                                             extra_body=extra,
                                             stream_options={"include_usage": True}):
        text += "".join(c.delta.content or "" for c in ev.choices)
        usage = ev.usage or usage
    return text, usage


CASES = [(C, False), (C, True), (CHAT, False), (CHAT, True)]


@pytest.mark.parametrize("path,stream", CASES, ids=["cmpl", "cmpl-stream", "chat",
                                                    "chat-stream"])
def test_openai_client_disaggregated_matches_aggregated(router: str, reference: str,
                                                        workers: dict[str, Worker], path: str,
                                                        stream: bool) -> None:
    got, usage = _complete(_client(router), path, stream)
    want, ref_usage = _complete(_client(reference), path, stream)
    assert got == want and got
    assert usage.prompt_tokens == ref_usage.prompt_tokens
    assert usage.completion_tokens == ref_usage.completion_tokens == 10
    assert usage.total_tokens == ref_usage.total_tokens


def test_first_token_final_answer_is_returned_by_the_router(router: str,
                                                           reference: str) -> None:
    for path, stream in CASES:
        got, usage = _complete(_client(router), path, stream, max_tokens=1)
        want, _ = _complete(_client(reference), path, stream, max_tokens=1)
        assert got == want, (path, stream)
        assert usage.completion_tokens == 1
    assert _client(router).models.list().data[0].id == NAME


def test_client_ttft_is_observed_for_streamed_answers(router: str) -> None:
    # disagg_router_time_to_first_token_seconds: a streamed answer's request in -> first event
    # out, inside its request's latency; a whole answer has none.
    ttft, lat = "disagg_router_time_to_first_token_seconds", "disagg_router_request_latency_seconds"
    n0, s0 = metric(router, ttft + "_count"), metric(router, ttft + "_sum")
    c0, l0 = metric(router, lat + "_count"), metric(router, lat + "_sum")
    _complete(_client(router), CHAT, stream=False)
    wait_for(lambda: metric(router, lat + "_count") >= c0 + 1, 10, what="the request's end")
    l1 = metric(router, lat + "_sum")
    _complete(_client(router), CHAT, stream=True)
    wait_for(lambda: metric(router, lat + "_count") >= c0 + 2, 10, what="the stream's end")
    assert metric(router, ttft + "_count") == n0 + 1
    first = metric(router, ttft + "_sum") - s0
    assert 0 < first < metric(router, lat + "_sum") - l1
    assert l1 > l0


def test_aggregated_cluster_behind_the_router(reference: str, loop: LoopThread) -> None:
    addr = reference.removeprefix("http://")
    cfg = {"health_check_interval_sec": 0.2, "generation_servers": {
        "urls": [addr], "router": {"type": "load_balancing"}}}
    with running_router(cfg, loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
        for path, stream in CASES:
            assert _complete(_client(url), path, stream)[0] == _complete(
                _client(reference), path, stream)[0]
        # batched prompts and n > 1 pass through whole
        r = httpx.post(url + C, json={"model": NAME, "prompt": PROMPTS[:2], "max_tokens": 3,
                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert metric(url, "disagg_router_routing_decisions_total", role="generation",
                      policy="load_balancing", worker=addr) >= 5


def test_bad_requests_get_openai_errors(router: str) -> None:
    r = httpx.post(router + C, content=b"{not json", timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(router + C, json=["a"], timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(router + C, json={"model": NAME, "prompt": "x", "disaggregated_params": {
        "request_type": "generation_only"}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params"
    # the workers' own 4xx pass through with their status
    r = httpx.post(router + C, json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(router + C, json={"model": NAME, "prompt": "x", "temperature": -1},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        _client(router).chat.completions.create(model=NAME, messages=[], max_tokens=2)
    r = httpx.get(router + "/v2/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert metric(router, "disagg_router_requests_total", outcome="client_error") >= 5


MALFORMED = [  # (what the body adds, the field the 400 names)
    ({"stream": "maybe"}, "stream"),  # (null is absent: no error)
    ({"stream": True, "stream_options": 5}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "x"}}, "stream_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream: true
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),  # not with a stream
    ({"n": "two"}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
]


def test_what_the_generation_worker_would_refuse_holds_no_kv(
        router: str, workers: dict[str, Worker]) -> None:
    """The context worker gets the request as the client sent it (``stream`` too, though its
    answer is whole) and refuses what the generation worker would, naming the field."""
    for extra, param in MALFORMED:
        for path, base in ((C, {"model": NAME, "prompt": "x", "max_tokens": 4}),
                           (CHAT, {"model": NAME, "messages": MESSAGES, "max_tokens": 4})):
            r = httpx.post(router + path, json={**base, **extra}, timeout=30)
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.text)
    r = httpx.post(router + C, json={"model": NAME, "prompt": [[1, 2], [3, 1.5]]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    for name in ("ctx1", "ctx2", "gen"):
        workers[name].wait_blocks(0)  # no lease left behind
    # Lax forms the workers accept are read as they read them, a final context answer's too.
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
    r = httpx.post(router + C, json={**body, "stream": "false"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    r = httpx.post(router + C, json={**body, "stream": "true",
                                     "stream_options": {"include_usage": 1}}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 1 and r.text.endswith("[DONE]\n\n")


def test_api_key(workers: dict[str, Worker], model_dir: str, loop: LoopThread) -> None:
    cfg = disagg_config(workers, model_dir, api_key="s3cret")
    with running_router(cfg, loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
        with pytest.raises(openai.AuthenticationError):
            _complete(_client(url, "wrong"), C, False, max_tokens=2)
        assert httpx.get(url + "/cluster_info").status_code == 401
        assert _complete(_client(url, "s3cret"), C, False, max_tokens=2)[0]


def test_router_tokenizes_as_the_workers_do(workers: dict[str, Worker], model_dir: str) -> None:
    """The ids the router hashes for KV-aware routing are the context worker's own."""
    from disagg.router.app import Router

    r = Router(parse_cluster_config({"model": model_dir, "generation_servers": {
        "urls": ["127.0.0.1:9"], "router": {"type": "kv_cache_aware"}}}))
    bodies = [(C, {"prompt": PROMPTS[1]}), (C, {"prompt": [5, 6, 7, 8]}),
              (CHAT, {"messages": MESSAGES}),
              (CHAT, {"messages": [{"role": "developer", "content": "Be brief."},
                                   {"role": "user", "content": [
                                       {"type": "text", "text": "Hi "},
                                       {"type": "text", "text": "there"}]}]}),
              (CHAT, {"messages": MESSAGES, "add_generation_prompt": False}),
              (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "content": "The sea"}],
                      "add_generation_prompt": False, "continue_final_message": True}),
              (C, {"prompt": PROMPTS[0], "add_special_tokens": False})]
    for path, extra in bodies:
        body = {"model": NAME, "max_tokens": 1, "disaggregated_params": {
            "request_type": "context_only"}, **extra}
        answer = httpx.post(workers["ctx1"].url + path, json=body, timeout=60).json()
        route = r.route_request(path, body)
        assert route.prompt is not None
        assert list(route.prompt.token_ids) == answer["prompt_token_ids"], (path, extra)
    assert r.route_request(CHAT, {"messages": "nonsense"}).prompt is None


# ---- faults with scripted fake workers ---------------------------------------------------------


class FakeWorker:
    """A worker that passes its health checks and misbehaves on /v1/* as scripted (then
    proxies to ``upstream``, a real worker, so that leases are consumed as a real one would).

    Actions: ``proxy``; ``status:N`` (answer N; a generation fake first forwards the request
    whole, consuming the lease; ``status:502kv`` answers a KV transfer failure); ``drop``
    (close the connection, answering nothing); ``cut`` (relay the first streamed event, then
    close the connection). Every answer says ``Connection: close``: each request comes on a new
    connection, so a drop is the worker's failure (on a reused keep-alive connection the router
    would take it for a stale connection and send again at once)."""

    def __init__(self, role: str, script: list[str], upstream: str | None = None) -> None:
        self.role = role
        self.script = collections.deque(script)
        self.upstream = upstream
        self.calls = 0
        app = web.Application(middlewares=[_close_after])
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/v1/{tail:.*}", self.handle)
        self.app = app

    async def health(self, request: web.Request) -> web.Response:
        """Healthy; in front of a real worker, under that worker's member id (a transparent
        proxy: the router signs for the member its forwarded calls reach)."""
        answer = {"status": "ok"}
        if self.upstream:
            import aiohttp

            from disagg.cluster_auth import MEMBER_ID_FIELD

            async with aiohttp.ClientSession() as s, s.get(self.upstream + "/health") as r:
                answer[MEMBER_ID_FIELD] = (await r.json())[MEMBER_ID_FIELD]
        return web.json_response(answer)

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "tokens_per_block": 16,
                                  "worker_id": "fake", "model_dir": None})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        import aiohttp

        self.calls += 1
        action = self.script.popleft() if self.script else "proxy"
        body = await request.read()
        if action == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        async with aiohttp.ClientSession() as s:
            if action.startswith("status:"):
                if self.upstream and self.role == "generation":
                    # a generation worker's error answer comes after it released the lease
                    data = json.loads(body)
                    data["stream"] = False
                    data.pop("stream_options", None)
                    kw = signed(TOKEN, "POST", request.path, data,  # as the router signs
                                to=self.upstream)
                    async with s.post(self.upstream + request.path, data=kw["content"],
                                      headers=kw["headers"]) as r:
                        await r.read()
                code = action.split(":")[1]
                kv = code == "502kv"
                return web.json_response({"error": {
                    "message": "kv transfer failed: expired_lease" if kv else "boom",
                    "type": "x", "param": None, "code": "kv_transfer_failed" if kv else None}},
                    status=502 if kv else int(code))
            assert self.upstream
            # the router's signature covers what is forwarded unchanged (its nonce is unspent)
            auth = {k: v for k, v in request.headers.items() if k.lower() == "x-disagg-auth"}
            async with s.post(self.upstream + request.path, data=body,
                              headers={"Content-Type": "application/json", **auth}) as r:
                if action == "proxy" or r.content_type != "text/event-stream":
                    return web.Response(status=r.status, body=await r.read(),
                                        content_type=r.content_type)
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    if b"\n\n" in buf:
                        await out.write(buf[:buf.index(b"\n\n") + 2])
                        break
                assert request.transport is not None
                request.transport.abort()  # cut: closing r too aborts the real request
                return out


@web.middleware
async def _close_after(request: web.Request, handler: Any) -> web.StreamResponse:
    resp = await handler(request)
    resp.force_close()
    return resp


def _retries(url: str, role: str) -> float:
    return metric(url, "disagg_router_retries_total", role=role)


def test_context_failures_are_retried(workers: dict[str, Worker], model_dir: str,
                                      reference: str, loop: LoopThread) -> None:
    bad = FakeWorker("context", ["status:500", "drop"], upstream=workers["ctx1"].url)
    runner, fake_url = loop.serve(bad.app)
    try:
        fake = fake_url.removeprefix("http://")
        cfg = disagg_config(workers, model_dir)
        cfg["context_servers"]["urls"] = [fake, workers["ctx1"].addr]
        with running_router(cfg, loop) as url:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
            want = _complete(_client(reference), C, False)[0]
            for _ in range(4):  # round robin: every other request tries the fake first
                assert _complete(_client(url), C, False)[0] == want
            assert bad.calls >= 2 and _retries(url, "context") == 2
            assert metric(url, "disagg_router_retries_total", role="context",
                          reason="status_500") == 1
            # With max_retries 0 the fake's own 500 comes back to the client.
            cfg["max_retries"] = 0
            bad.script.extend(["status:500", "status:500"])
            with running_router(cfg, loop) as url0:
                wait_for(lambda: httpx.get(url0 + "/health").status_code == 200, 30,
                         what="router")
                codes = sorted(httpx.post(url0 + C, json={"model": NAME, "prompt": "x",
                                                          "max_tokens": 4},
                                          timeout=60).status_code for _ in range(2))
                assert codes == [200, 500]
    finally:
        loop.run(runner.cleanup())
    workers["ctx1"].wait_blocks(0)
    workers["gen"].wait_blocks(0)


def test_generation_failures_before_and_after_the_first_byte(
        workers: dict[str, Worker], model_dir: str, reference: str, loop: LoopThread) -> None:
    gen = workers["gen"]
    flaky = FakeWorker("generation", ["drop", "status:502kv", "cut"], upstream=gen.url)
    runner, fake_url = loop.serve(flaky.app)
    try:
        cfg = disagg_config(workers, model_dir)
        cfg["generation_servers"]["urls"] = [fake_url.removeprefix("http://"), gen.addr]
        cfg["max_migrations"] = 0  # the retries alone (migration: test_router_migration.py)
        with running_router(cfg, loop) as url:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
            want = _complete(_client(reference), C, True)[0]
            # drop: never answered, the lease is intact -> the other generation worker
            assert _complete(_client(url), C, True)[0] == want
            # kv transfer failed (lease gone) -> a fresh prefill, then the other worker
            assert _complete(_client(url), C, True)[0] == want
            assert metric(url, "disagg_router_retries_total",
                          reason="kv_transfer_failed") == 1
            # cut after the first byte: the stream ends with an error event
            body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + C, json=body, timeout=60) as r:
                assert r.status_code == 200
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            err = json.loads(lines[-2][6:])["error"]
            assert "failed mid-stream" in err["message"] and err["code"] == "upstream_failed"
            assert metric(url, "disagg_router_requests_total", outcome="stream_error") == 1
            # the flaky worker was taken out of rotation and put back by its health check
            wait_for(lambda: worker_info(url, fake_url.removeprefix("http://"))["healthy"],
                     10, what="flaky worker back in rotation")
    finally:
        loop.run(runner.cleanup())
    for w in (workers["ctx1"], workers["ctx2"], gen):
        w.wait_blocks(0)


def test_client_disconnect_frees_kv_on_both_sides(router: str,
                                                  workers: dict[str, Worker]) -> None:
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router + C, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then hang up
    for w in (workers["ctx1"], workers["ctx2"], workers["gen"]):
        w.wait_blocks(0)
    wait_for(lambda: all(w["active_requests"] == 0 for ws in cluster(router)["workers"].values()
                         for w in ws), 10, what="router: no active requests")
    wait_for(lambda: metric(router, "disagg_router_requests_total", outcome="disconnected")
             >= 1, 10, what="disconnect counted")


# ---- KV-aware routing -------------------------------------------------------------------------


LONG = ("Disaggregated serving splits the prompt phase from the decode phase, so that each "
        "runs on hardware sized for it; the router keeps both sides busy. ") * 3


def _warm(w: Worker, prompt: str) -> None:
    """Prefill ``prompt`` on ``w`` directly (an ordinary request), caching its blocks."""
    r = httpx.post(w.url + C, json={"model": NAME, "prompt": prompt, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text


def _index_blocks(url: str, w: Worker) -> int:
    kv = worker_info(url, w.addr)["kv_index"]
    return kv["blocks"] if kv and kv["synced"] else 0


def test_kv_aware_routes_shared_prefix_to_the_worker_holding_it(
        workers: dict[str, Worker], model_dir: str, reference: str, loop: LoopThread) -> None:
    ctx1, ctx2 = workers["ctx1"], workers["ctx2"]
    cfg = disagg_config(workers, model_dir, {"type": "kv_cache_aware",
                                             "kv_events_poll_interval_sec": 0.05})
    with running_router(cfg, loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
        for target, other in ((ctx2, ctx1), (ctx1, ctx2)):
            prefix = f"[{target.name}] {LONG}"
            before = _index_blocks(url, target)
            _warm(target, prefix)
            wait_for(lambda t=target, b=before: _index_blocks(url, t) >= b + 10, 15,
                     what="router index fed by the worker's KV events")
            n0 = metric(url, "disagg_router_routing_decisions_total", role="context",
                        worker=target.addr)
            m0 = metric(url, "disagg_router_kv_matched_tokens_total", role="context",
                        worker=target.addr)
            o0 = metric(url, "disagg_router_routing_decisions_total", role="context",
                        worker=other.addr)
            for i in range(3):
                prompt = f"{prefix} Question {i}: what next?"
                body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                        "ignore_eos": True}
                r = httpx.post(url + C, json=body, timeout=60)
                assert r.status_code == 200
                ref = httpx.post(reference + C, json=body, timeout=60).json()
                assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
                # the prefill hit the context worker's prefix cache; usage says so
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160
            assert metric(url, "disagg_router_routing_decisions_total", role="context",
                          worker=target.addr) == n0 + 3
            assert metric(url, "disagg_router_routing_decisions_total", role="context",
                          worker=other.addr) == o0
            assert metric(url, "disagg_router_kv_matched_tokens_total", role="context",
                          worker=target.addr) >= m0 + 3 * 160


def test_conditional_disaggregation_prefills_short_uncached_parts_locally(
        workers: dict[str, Worker], model_dir: str, reference: str, loop: LoopThread) -> None:
    gen = workers["gen"]
    cfg = disagg_config(workers, model_dir, conditional_disagg_config={
        "max_local_prefill_length": 40})
    cfg["generation_servers"]["router"] = {"type": "round_robin",
                                           "kv_events_poll_interval_sec": 0.05}
    with running_router(cfg, loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")

        def send(prompt: str) -> None:
            body = {"model": NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(url + C, json=body, timeout=60)
            ref = httpx.post(reference + C, json=body, timeout=60).json()
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[
                "choices"][0]["text"]

        def ctx_calls() -> float:
            return metric(url, "disagg_router_routing_decisions_total", role="context")

        local = "disagg_router_local_prefill_total"
        # a long prompt nobody holds: context worker, then KV transfer
        first = f"[conditional] {LONG}"
        send(first)
        assert ctx_calls() == 1 and metric(url, local) == 0
        # the generation worker now holds it (it caches what it pulled): a follow-up whose
        # uncached tail is short is prefilled there, without a context call
        wait_for(lambda: _index_blocks(url, gen) >= 14, 15, what="generation worker's index")
        send(first + " Then the tide turned.")
        assert ctx_calls() == 1 and metric(url, local) == 1
        # a short prompt: nothing cached, but at most 40 tokens to prefill
        send("Numbers: 4, 5")
        assert ctx_calls() == 1 and metric(url, local) == 2
        # a long new prompt goes through the context side again
        send(f"[other] {LONG}")
        assert ctx_calls() == 2 and metric(url, local) == 2
    for w in (workers["ctx1"], workers["ctx2"], gen):
        w.wait_blocks(0)


# ---- a context worker killed under load, then back with another block size -------------------


def _kill_test_requests(reference: str) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """20 requests, every other one streamed, and the reference worker's text for each."""
    bodies = [{"model": NAME, "prompt": f"{PROMPTS[i % 3]} #{i}", "max_tokens": 32,
               "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0} for i in range(20)]
    expected = {}
    for i, b in enumerate(bodies):
        r = httpx.post(reference + C, json={**b, "stream": False}, timeout=60)
        expected[i] = r.json()["choices"][0]["text"]
    return bodies, expected


def _send(url: str, b: dict[str, Any]) -> tuple[str | None, str | None]:
    """(text, None) for a completion, (None, its error message) for a failed one."""
    if b["stream"]:
        with httpx.stream("POST", url + C, json=b, timeout=60) as r:
            if r.status_code != 200:
                return None, r.read().decode()
            text, events = sse_text(C, r)
            errs = [e["error"]["message"] for e in events if "error" in e]
            return (None if errs else text), (errs[0] if errs else None)
    r = httpx.post(url + C, json=b, timeout=60)
    if r.status_code != 200:
        return None, r.json()["error"]["message"]
    return r.json()["choices"][0]["text"], None


def _kill_under_load(url: str, bodies: list[dict[str, Any]], victim: Worker
                     ) -> tuple[int, list[tuple[int, str | None, str | None]]]:
    """A steady stream of the requests; ``victim`` killed once 4 have finished. (Requests
    left when it died, (i, text, error) of each request.)"""
    done = threading.Event()
    finished: list[int] = []

    def one(i: int) -> tuple[int, str | None, str | None]:
        try:
            return i, *_send(url, bodies[i])
        finally:
            finished.append(i)
            if len(finished) >= 4:
                done.set()

    with cf.ThreadPoolExecutor(6) as pool:  # a steady stream of requests
        futures = [pool.submit(one, i) for i in range(20)]
        done.wait(60)
        victim.proc.kill()  # mid-way: some requests are on it, prefilling or being read
        left = 20 - len(finished)
        victim.proc.wait(10)
        results = [f.result(90) for f in futures]
    return left, results


def _check_kill_outcome(url: str, left: int, results: list[tuple[int, str | None, str | None]],
                        expected: dict[int, str]) -> None:
    """Right text or a clear error for every request; the kill noticed."""
    assert left >= 6, f"only {left} requests were left when ctx2 died"
    errors = []
    for i, text, err in results:
        if text is not None:
            assert text == expected[i], (i, text, expected[i])  # never wrong text
        else:
            assert err, i  # a clear error
            errors.append(err)
    assert len(errors) <= 10, errors
    # the kill was noticed: a retry elsewhere (or a clear error) for what was on ctx2
    assert errors or metric(url, "disagg_router_retries_total", role="context") >= 1


def _check_serves_without(url: str, dead: Worker, bodies: list[dict[str, Any]],
                          expected: dict[int, str], survivors: list[Worker]) -> None:
    """The router took ``dead`` out of rotation and keeps serving; nothing leaked."""
    wait_for(lambda: not worker_info(url, dead.addr)["healthy"], 10, what="ctx2 out")
    for i in range(4):
        r = httpx.post(url + C, json={**bodies[i], "stream": False}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[i]
    for w in survivors:  # nothing leaked on the survivors
        w.wait_blocks(0)


def _restart_with_block_size_8(workers: dict[str, Worker], model_dir: str, url: str,
                               old: Worker) -> Worker:
    """``old`` back on the same port with tokens_per_block 8, once the router has it healthy
    and indexed in the new block size."""
    back = start_worker(workers["_tmp"], model_dir, "ctx2b", "context",  # type: ignore[arg-type]
                        "--tokens-per-block", "8", port=old.port)
    workers["ctx2"] = back
    wait_healthy([back])
    wait_for(lambda: worker_info(url, back.addr)["healthy"], 20, what="ctx2 back")
    wait_for(lambda: (worker_info(url, back.addr)["kv_index"] or {}).get(
        "tokens_per_block") == 8, 20, what="index in the new block size")
    return back


def _check_matches_in_blocks_of_8(url: str, back: Worker) -> None:
    prefix = f"[restarted] {LONG}"
    _warm(back, prefix)
    wait_for(lambda: _index_blocks(url, back) >= 20, 15, what="index of ctx2 (B=8)")
    m0 = metric(url, "disagg_router_kv_matched_tokens_total", role="context",
                worker=back.addr)
    r = httpx.post(url + C, json={"model": NAME, "prompt": prefix + " And then?",
                                  "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    matched = metric(url, "disagg_router_kv_matched_tokens_total", role="context",
                     worker=back.addr) - m0
    # matched in blocks of 8 (a stale block size of 16 would match nothing at all)
    assert matched >= 160 and matched % 8 == 0
    assert worker_info(url, back.addr)["tokens_per_block"] == 8


def test_kill_context_worker_under_load_then_restart_with_other_block_size(
        workers: dict[str, Worker], model_dir: str, reference: str, loop: LoopThread) -> None:
    ctx1, ctx2, gen = workers["ctx1"], workers["ctx2"], workers["gen"]
    bodies, expected = _kill_test_requests(reference)
    cfg = disagg_config(workers, model_dir, {"type": "kv_cache_aware",
                                             "kv_events_poll_interval_sec": 0.05})
    # Healthy workers checked rarely: the requests, not a health check, find ctx2 dead.
    cfg["health_check_interval_sec"] = 10
    with running_router(cfg, loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
        left, results = _kill_under_load(url, bodies, ctx2)
        _check_kill_outcome(url, left, results, expected)
        _check_serves_without(url, ctx2, bodies, expected, [ctx1, gen])
        # ctx2 comes back on the same port with tokens_per_block 8: the router re-checks it,
        # rebuilds its index in the new block size and matches with it.
        back = _restart_with_block_size_8(workers, model_dir, url, ctx2)
        _check_matches_in_blocks_of_8(url, back)
    for w in (ctx1, back, gen):
        w.wait_blocks(0)


def test_lease_freed_when_no_generation_worker_takes_the_request(
        workers: dict[str, Worker], model_dir: str, loop: LoopThread) -> None:
    """Every generation worker drops the request unanswered: the router ends with an error
    and tells the context worker to free the KV now, not at lease expiry (30 s), with a signed
    call (the release endpoint answers nothing else)."""
    dead = FakeWorker("generation", ["drop", "drop"])
    runner, fake_url = loop.serve(dead.app)
    try:
        cfg = disagg_config(workers, model_dir, max_retries=1)
        cfg["generation_servers"]["urls"] = [fake_url.removeprefix("http://")]
        cfg["max_migrations"] = 0  # (else a context worker serves the move: migration)
        with running_router(cfg, loop) as url:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
            body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
            r = httpx.post(url + C, json=body, timeout=60)
            assert r.status_code >= 500 and "error" in r.json(), r.text
            assert dead.calls == 1  # no other generation worker to try
            for w in (workers["ctx1"], workers["ctx2"]):
                w.wait_blocks(0, timeout=5)
            assert metric(url, "disagg_router_lease_releases_total") == 1
    finally:
        loop.run(runner.cleanup())


def test_lease_release_endpoint_needs_a_cluster_signature(workers: dict[str, Worker]) -> None:
    ctx, path = workers["ctx1"], "/kv_leases/release"
    body = {"ctx_request_id": "no-such-lease"}
    r = httpx.post(ctx.url + path, json=body, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # the token itself in a header is no proof: it must never cross the wire
    r = httpx.post(ctx.url + path, json=body, timeout=10,
                   headers={"X-Disagg-Cluster-Token": TOKEN})
    assert r.status_code == 401
    r = httpx.post(ctx.url + path, timeout=10, **signed(TOKEN, "POST", path, body, to=ctx.url))
    assert r.status_code == 200 and r.json() == {"ctx_request_id": "no-such-lease",
                                                 "released": False}
    r = httpx.post(ctx.url + path, timeout=10,
                   **signed(TOKEN, "POST", path, {"x": 1}, to=ctx.url))
    assert r.status_code == 400 and r.json()["error"]["param"] == "ctx_request_id"
    r = httpx.post(workers["gen"].url + path, timeout=10,
                   **signed(TOKEN, "POST", path, body, to=workers["gen"].url))
    assert r.status_code == 404
