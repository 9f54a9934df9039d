"""The router's one retry helper (``flow.retrying``) and the typed failures it retries on,
without workers: fake calls over a router that is not started."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from aiohttp import web
from router_fixtures import LoopThread, metric, running_router
from server_fixtures import wait_for

from disagg.contracts import protocol as P
from disagg.contracts.cluster import parse_cluster_config
from disagg.contracts.roles import Role
from disagg.router.app import Router
from disagg.router.flow import Tries
from disagg.router.membership import Worker
from disagg.router.policies import RouteRequest
from disagg.router.replies import Reply
from disagg.router.upstream import Failed, error_code

URLS = ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]


def _router(max_retries: int) -> Router:
    r = Router(parse_cluster_config({"max_retries": max_retries,
                                     "generation_servers": {"urls": URLS}}, "test"))
    for w in r.membership.by_url.values():
        w.healthy = True
    return r


def _retries(r: Router, reason: str) -> float:
    return r.metrics.retries.labels(Role.GENERATION, reason)._value.get()


def _run(r: Router, tries: Tries, call: Any) -> Any:
    return asyncio.run(r.flow.retrying(tries, RouteRequest(), call))


def test_error_code_reads_the_error_json_and_nothing_else() -> None:
    body = P.APIError(502, "kv transfer failed: expired_lease", type="kv_transfer_error",
                      code="kv_transfer_failed").body()
    assert error_code(json.dumps(body).encode()) == "kv_transfer_failed"
    # the words elsewhere in the body, bad JSON, other shapes: no code
    for raw in (b'{"error": {"message": "kv_transfer_failed", "code": null}}',
                b'{"error": "kv_transfer_failed"}', b'["kv_transfer_failed"]',
                b'{"error": {"code": 502}}', b"kv_transfer_failed", b"", b"\xff{",
                b"[" * 100_000):
        assert error_code(raw) is None, raw


def test_a_failed_try_goes_to_the_next_worker_and_counts_one_retry() -> None:
    r = _router(max_retries=2)
    seen: list[str] = []

    async def call(w: Worker) -> str:
        seen.append(w.url)
        if len(seen) == 1:
            raise Failed(f"{w.url}: refused", reached=False)
        return w.url

    tries = Tries(Role.GENERATION, 2)
    assert _run(r, tries, call) == seen[1] != seen[0]
    assert tries.tried == {seen[0]} and tries.failures == 1
    assert _retries(r, "unreachable") == 1


def test_the_budget_is_failures_per_side_then_the_last_answer_passes_through() -> None:
    r = _router(max_retries=1)
    calls: list[str] = []

    async def call(w: Worker) -> None:
        calls.append(w.url)
        raise Failed(f"{w.url} answered 500", Reply.error(500, "boom", "x"))

    with pytest.raises(Reply) as e:
        _run(r, Tries(Role.GENERATION, 1), call)
    assert len(calls) == 2 and len(set(calls)) == 2  # one try and one retry, two workers
    assert e.value.status == 500 and b"boom" in e.value.body
    assert _retries(r, "status_500") == 1


def test_no_worker_left_is_503_before_any_try_and_502_after_failures() -> None:
    r = _router(max_retries=5)

    async def call(w: Worker) -> None:
        raise Failed(f"{w.url}: reset")

    with pytest.raises(Reply) as e:
        _run(r, Tries(Role.GENERATION, 5), call)
    assert e.value.status == 502 and b"upstream_failed" in e.value.body  # 3 workers, all tried
    for w in r.membership.by_url.values():
        w.healthy = False
    with pytest.raises(Reply) as e:
        _run(r, Tries(Role.GENERATION, 5), call)
    assert e.value.status == 503 and e.value.outcome == "no_worker"


def test_on_failure_may_keep_a_worker_and_hand_the_failure_to_the_caller() -> None:
    """What the generation side does on a failed KV pull: the worker stays eligible and the
    caller prefills again."""
    r = _router(max_retries=3)
    first = r.membership.by_url[URLS[0]]
    tries = Tries(Role.GENERATION, 3, first=first)

    def on_failure(w: Worker, f: Failed) -> bool:
        tries.failed(w, f, exclude=False)
        return True

    async def call(w: Worker) -> None:
        raise Failed("kv", Reply.error(502, "x", code="kv_transfer_failed"), kv_transfer=True)

    with pytest.raises(Failed) as e:
        asyncio.run(r.flow.retrying(tries, RouteRequest(), call, on_failure))
    assert e.value.reason == "kv_transfer_failed" and not tries.tried
    assert tries.failures == 1


def test_failed_reasons() -> None:
    assert Failed("x", reached=False).reason == "unreachable"
    assert Failed("x").reason == "connection_failed"
    assert Failed("x", Reply.error(503, "y")).reason == "status_503"
    assert Failed("x", Reply.error(502, "y"), kv_transfer=True).reason == "kv_transfer_failed"


def test_models_needs_the_api_key_before_any_worker_is_asked() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from disagg.router.app import build_router_app

    async def main() -> tuple[int, int, dict[str, Any]]:
        app = build_router_app(parse_cluster_config(
            {"api_key": "k", "max_retries": 0, "health_check_interval_sec": 10,
             "generation_servers": {"urls": URLS[:1]}}, "test"))
        async with TestClient(TestServer(app)) as client:
            bare = await client.get("/v1/models")
            keyed = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
            return bare.status, keyed.status, await keyed.json()

    bare, keyed, body = asyncio.run(main())
    assert bare == 401
    assert keyed == 503 and body["error"]["code"] == "no_healthy_worker"  # nothing listens


# -- a stream the client has whole ------------------------------------------------------------


class _LingeringWorker:
    """An aggregated worker whose stream sends its last event, ``[DONE]``, and then keeps the
    response open until ``release`` is set (as a worker still finishing its request does)."""

    def __init__(self) -> None:
        self.release: asyncio.Event | None = None
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/v1/completions", self.completions)
        self.app = app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": "aggregated", "tokens_per_block": 16,
                                  "worker_id": "w", "model_dir": None})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.release = asyncio.Event()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        chunk = {"id": "c", "object": "text_completion", "choices": [
            {"index": 0, "text": "hi", "finish_reason": "length"}]}
        await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        await asyncio.wait_for(self.release.wait(), 30)
        return out


def test_a_client_closing_after_done_is_a_success_not_a_disconnect(loop: LoopThread) -> None:
    """The client read ``[DONE]`` and closed while the router still waited for the worker's
    end of stream: the router's handler is cancelled then, but the client got everything,
    so the request counts as a success (it was once counted "disconnected", a flaky
    failure of test_router_parallel under load)."""
    worker = _LingeringWorker()
    runner, wurl = loop.serve(worker.app)
    try:
        cfg = {"generation_servers": {"urls": [wurl.removeprefix("http://")]},
               "health_check_interval_sec": 0.2}
        with running_router(cfg, loop) as url:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
            body = {"model": "m", "prompt": "x", "max_tokens": 1, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if line == "data: [DONE]":
                        break  # closes the connection with the worker's stream still open
            assert lines[-1] == "data: [DONE]"

            def counted() -> float:
                return sum(metric(url, "disagg_router_requests_total", outcome=o)
                           for o in ("success", "disconnected"))

            wait_for(lambda: counted() == 1, 20, what="the request counted")
            assert metric(url, "disagg_router_requests_total", outcome="success") == 1
            assert metric(url, "disagg_router_requests_total", outcome="disconnected") == 0
            assert worker.release is not None
            loop.loop.call_soon_threadsafe(worker.release.set)
    finally:
        loop.run(runner.cleanup())


# -- Retry-After: a worker's passed on, the router's own set ------------------------------------


class _BusyWorker:
    """A worker of ``role`` whose OpenAI endpoints answer 503 ``queue_full`` with
    ``Retry-After: retry_after`` (as a worker's full waiting queue does)."""

    def __init__(self, role: str, retry_after: str) -> None:
        self.posts = 0
        app = web.Application()
        self.role = role
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.refuse)
        self.retry_after = retry_after
        self.app = app

    async def health(self, request: web.Request) -> web.Response:
        # (its member id: the audience a signing router's calls name; not checked here)
        return web.json_response({"status": "ok", "member_id": f"busy-{self.role}"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "tokens_per_block": 16,
                                  "worker_id": self.role, "model_dir": None})

    async def refuse(self, request: web.Request) -> web.Response:
        await request.read()
        self.posts += 1
        body = P.APIError(503, "the server is overloaded: waiting queue is full; retry later",
                          type="server_overloaded", code="queue_full").body()
        return web.json_response(body, status=503, headers={"Retry-After": self.retry_after})


def _free_address() -> str:
    """An address where nothing listens (a port just bound and closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# Each request as the router's own HTTP/1.1 server takes it and (a query string) as aiohttp's.
REQUESTS = [(path + query, stream) for path in ("/v1/completions", "/v1/chat/completions")
            for query in ("", "?via=aiohttp") for stream in (False, True)]


def _post(url: str, path: str, stream: bool) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "max_tokens": 2, "stream": stream}
    if path.startswith("/v1/chat"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return httpx.post(url + path, json=body, timeout=30)


@pytest.mark.parametrize("disaggregated", [False, True], ids=["aggregated", "context"])
def test_a_workers_retry_after_reaches_the_client(loop: LoopThread,
                                                  disaggregated: bool) -> None:
    """A worker's 503 ``queue_full`` is passed on with its ``Retry-After`` (its own value, not
    the router's), streamed or not, whichever server of the router carries the request; in a
    disaggregated cluster the context worker's refusal is the one passed on."""
    busy = _BusyWorker("context" if disaggregated else "aggregated", "7")
    spare = _BusyWorker("generation", "9")  # never reached: the context call failed first
    runners = [loop.serve(busy.app), loop.serve(spare.app)]
    try:
        urls = [u.removeprefix("http://") for _, u in runners]
        cfg: dict[str, Any] = {"max_retries": 1, "health_check_interval_sec": 0.2}
        if disaggregated:
            cfg |= {"context_servers": {"urls": urls[:1]},
                    "generation_servers": {"urls": urls[1:]}}
        else:
            cfg |= {"generation_servers": {"urls": urls[:1]}}
        with running_router(cfg, loop) as url:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
            for path, stream in REQUESTS:
                r = _post(url, path, stream)
                assert r.status_code == 503, (path, stream, r.text)
                assert r.json()["error"]["code"] == "queue_full", (path, stream, r.text)
                assert r.headers.get("Retry-After") == "7", (path, stream, r.headers)
            assert busy.posts == len(REQUESTS) and spare.posts == 0
    finally:
        for runner, _ in runners:
            loop.run(runner.cleanup())


def test_the_routers_own_503s_say_when_to_retry(loop: LoopThread) -> None:
    """No healthy worker: 503 ``no_healthy_worker`` with ``Retry-After:`` the router's
    ``RETRY_AFTER_S``, streamed or not, on either server, for /v1/models and /health too."""
    from disagg.router.replies import RETRY_AFTER_S

    cfg = {"max_retries": 1, "health_check_interval_sec": 0.2,
           "generation_servers": {"urls": [_free_address()]}}
    want = str(RETRY_AFTER_S)
    with running_router(cfg, loop, cluster_token=None) as url:
        for path, stream in REQUESTS:
            r = _post(url, path, stream)
            assert r.status_code == 503, (path, stream, r.text)
            assert r.json()["error"]["code"] == "no_healthy_worker", (path, stream, r.text)
            assert r.headers.get("Retry-After") == want, (path, stream, r.headers)
        r = httpx.get(url + "/v1/models", timeout=30)
        assert r.status_code == 503 and r.headers.get("Retry-After") == want, r.headers
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 503 and r.headers.get("Retry-After") == want, r.headers


def test_retry_after_passes_only_when_safe() -> None:
    from disagg.router.replies import retry_after

    assert retry_after("7") == {"Retry-After": "7"}
    assert retry_after("Wed, 21 Oct 2026 07:28:00 GMT") == {
        "Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}
    for bad in ("", "\x00", "\u00e9", "1" * 65):
        assert retry_after(bad) is None, bad
    # the router's own errors: a 503 carries it, others do not
    assert Reply.error(503, "x").headers == {"Retry-After": "1"}
    assert Reply.error(502, "x").headers is None
    assert Reply.error(503, "x").answer().headers == {"Retry-After": "1"}
