"""Fault isolation at the router (issue 22): one bad request or one bad connection never fails
another request, nothing holds resources it should not.

Most tests put the router (in process) in front of scripted stub workers (aiohttp, no model):
stale keep-alive connections, a single failed request, validation before the context call,
lease release on a generation refusal, bad input, slow and odd HTTP, bounded bookkeeping
under load. The last ones use a real context + generation worker pair (subprocesses).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from aiohttp import web
from router_fixtures import LoopThread, metric
from server_fixtures import (
    raw_exchange,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

from disagg.contracts.cluster import parse_cluster_config
from disagg.contracts.roles import Role
from disagg.router.app import LINGER_S, ROUTER_KEY, build_router_app, start_router
from disagg.router.membership import (
    HEALTH_TIMEOUT_S,
    REQUEST_FAILURE_THRESHOLD,
    UNRESPONSIVE_AFTER_S,
    UNRESPONSIVE_FACTOR,
    Membership,
)

TOKEN = "router-faults-secret"
C, CHAT = "/v1/completions", "/v1/chat/completions"


# ---- a scripted stub worker ---------------------------------------------------------------------


class StubWorker:
    """Passes its health checks and answers /v1/* as a ``role`` worker would (a context worker
    with a lease, a generation or aggregated worker with a completion or an SSE stream).

    Knobs: ``drop_reused``: a /v1 request arriving on a connection that already answered one
    is dropped unanswered (as by a worker that closed that idle keep-alive connection: the
    client finds out only when it sends on it); ``fail_next``: drop the next N /v1 requests;
    ``close``: every answer says ``Connection: close``; ``health_delay``: seconds /health
    takes; ``frozen``: /health answers nothing until it is cleared; ``status``: answer /v1
    with this error status instead."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.drop_reused = False
        self.fail_next = 0
        self.close = False
        self.health_delay = 0.0
        self.frozen = False  # /health answers nothing while set (a stopped process)
        self.status: int | None = None
        self.calls = 0  # /v1 requests received
        self.dropped = 0
        self.releases: list[str] = []
        self.bodies: list[bytes] = []  # /v1 request bodies as received
        self.answers: list[bytes] = []  # the whole (non-streamed) answers' bodies as sent
        self._answered: set[Any] = set()  # transports that answered (held: ids get reused)
        app = web.Application(middlewares=[self._after])
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/kv_leases/release", self.release)
        app.router.add_post("/v1/{tail:.*}", self.v1)
        self.app = app

    @web.middleware
    async def _after(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        if self.close:
            resp.force_close()
        self._answered.add(request.transport)
        return resp

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay)
        while self.frozen:
            await asyncio.sleep(0.02)
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "tokens_per_block": 16,
                                  "worker_id": f"stub-{self.role}", "model_dir": None,
                                  "kv_blocks_used": 0})

    async def release(self, request: web.Request) -> web.Response:
        lease = (await request.json())["ctx_request_id"]
        self.releases.append(lease)
        return web.json_response({"ctx_request_id": lease, "released": True})

    async def v1(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        body = json.loads(raw)
        self.calls += 1
        drop = self.drop_reused and request.transport in self._answered
        if not drop and self.fail_next > 0:
            self.fail_next -= 1
            drop = True
        if drop:
            self.dropped += 1
            assert request.transport is not None
            request.transport.abort()  # closed before any response byte
            return web.Response()
        if self.status is not None:
            return web.json_response({"error": {"message": "refused", "type": "x",
                                                "param": None, "code": None}},
                                     status=self.status)
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        dp = body.get("disaggregated_params") or {}
        if dp.get("request_type") == "context_only":
            return web.json_response({
                "id": "cmpl-c", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": " a", "finish_reason": "length",
                             "logprobs": None}],
                "usage": usage, "prompt_token_ids": [1, 2, 3],
                "disaggregated_params": {"ctx_request_id": f"lease-{self.calls}",
                                         "first_gen_tokens": [5]}})
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"id":"cmpl-g","object":"text_completion","created":0,'
                             b'"model":"m","choices":[{"index":0,"text":" a b",'
                             b'"finish_reason":"length"}]}\n\ndata: [DONE]\n\n')
            await resp.write_eof()
            return resp
        answer = web.json_response({
            "id": "cmpl-g", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": " a b", "finish_reason": "length",
                         "logprobs": None}], "usage": usage})
        assert isinstance(answer.body, bytes)
        self.answers.append(answer.body)
        return answer


@contextlib.contextmanager
def stubs(loop: LoopThread, *roles: str) -> Iterator[list[SimpleNamespace]]:
    """Stub workers served on ephemeral ports: [(stub, addr)]."""
    served = []
    try:
        for role in roles:
            stub = StubWorker(role)
            runner, url = loop.serve(stub.app)
            served.append((runner, SimpleNamespace(stub=stub, addr=url.removeprefix(
                "http://"))))
        yield [s for _, s in served]
    finally:
        for runner, _ in served:
            loop.run(runner.cleanup())


@contextlib.contextmanager
def router(loop: LoopThread, config: dict[str, Any], *, keep_alive_s: float | None = None,
           body_timeout_s: float | None = None, ready: bool = True
           ) -> Iterator[SimpleNamespace]:
    app = build_router_app(parse_cluster_config(config, "test"))
    r = app[ROUTER_KEY]
    if body_timeout_s is not None:
        r.body_timeout_s = body_timeout_s
    kw = {} if keep_alive_s is None else {"keep_alive_s": keep_alive_s}
    runner, port = loop.run(start_router(app, "127.0.0.1", 0, **kw))
    url = f"http://127.0.0.1:{port}"
    try:
        if ready:
            wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 30,
                     what="router ready")
        yield SimpleNamespace(url=url, port=port, router=r)
    finally:
        loop.run(runner.cleanup())


def aggregated(addr: str, **extra: Any) -> dict[str, Any]:
    return {"health_check_interval_sec": 10, "max_retries": 0,
            "generation_servers": {"urls": [addr]}, **extra}


def disaggregated(ctx: str, gen: str, **extra: Any) -> dict[str, Any]:
    return {"health_check_interval_sec": 10, "max_retries": 0,
            "context_servers": {"urls": [ctx]}, "generation_servers": {"urls": [gen]}, **extra}


def healthy(url: str, addr: str) -> bool:
    info = httpx.get(url + "/cluster_info", timeout=5).json()
    return any(w["url"] == addr and w["healthy"] for ws in info["workers"].values() for w in ws)


BODY = {"model": "m", "prompt": "hello", "max_tokens": 2}


# ---- item 4: a stale keep-alive connection, one failed request ---------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_stale_keep_alive_connection_is_retried_at_once(loop: LoopThread,
                                                          stream: bool) -> None:
    """The worker closed the router's pooled connection (as uvicorn did after each 500): the
    router's next request on it is reset before any answer. It is sent again on a new
    connection, the client never sees it, and the worker stays in rotation."""
    with stubs(loop, "aggregated") as (w,):
        w.stub.drop_reused = True
        with router(loop, aggregated(w.addr)) as rt, httpx.Client(timeout=30) as client:
            for i in range(12):
                r = client.post(rt.url + C, json={**BODY, "stream": stream})
                assert r.status_code == 200, (i, r.text)
            # every other request found its pooled connection stale (the retry's own new
            # connection is not pooled; the next request opens one that is)
            assert w.stub.dropped >= 5
            assert healthy(rt.url, w.addr)
            assert metric(rt.url, "disagg_router_requests_total", outcome="success") == 12


def test_one_failed_request_does_not_take_a_worker_out(loop: LoopThread) -> None:
    """A request reset on a new connection (a real failure) answers 502 to that request only;
    the worker stays in rotation (its health check runs, and it is slow here, so the next
    request would find it out of rotation if one failure took it out). Only
    REQUEST_FAILURE_THRESHOLD failures in a row do."""
    with stubs(loop, "aggregated") as (w,):
        w.stub.close = True  # no pooled connections: every drop is a real failure
        with router(loop, aggregated(w.addr)) as rt, httpx.Client(timeout=30) as client:
            w.stub.health_delay = 1.0
            w.stub.fail_next = 1
            assert client.post(rt.url + C, json=BODY).status_code == 502
            r = client.post(rt.url + C, json=BODY)
            assert r.status_code == 200, r.text  # before: 503 "no healthy generation worker"
            assert healthy(rt.url, w.addr)
            w.stub.fail_next = REQUEST_FAILURE_THRESHOLD
            for _ in range(REQUEST_FAILURE_THRESHOLD):
                assert client.post(rt.url + C, json=BODY).status_code == 502
            assert not healthy(rt.url, w.addr)  # consecutive failures did take it out
            w.stub.health_delay = 0.0
            wait_for(lambda: healthy(rt.url, w.addr), 10, 0.05, what="back in rotation")
            assert client.post(rt.url + C, json=BODY).status_code == 200


def test_a_worker_that_stops_answering_leaves_rotation_before_its_check_times_out(
        loop: LoopThread) -> None:
    """Issue 40: a stopped worker (it accepts connections, answers nothing) got new requests
    until its health check timed out (interval + HEALTH_TIMEOUT_S). Its check unanswered for
    UNRESPONSIVE_AFTER_S takes it out while the other worker serves; answered again, it is
    back."""
    with stubs(loop, "aggregated", "aggregated") as (a, b):
        cfg = {"health_check_interval_sec": 0.5, "max_retries": 0,
               "generation_servers": {"urls": [a.addr, b.addr]}}
        with router(loop, cfg) as rt, httpx.Client(timeout=30) as client:
            wait_for(lambda: healthy(rt.url, a.addr) and healthy(rt.url, b.addr), 10,
                     what="both in rotation")
            a.stub.frozen = True
            t0 = time.monotonic()
            wait_for(lambda: not healthy(rt.url, a.addr), 10, 0.02, what="a out of rotation")
            took = time.monotonic() - t0
            # (at most one interval until the next check, UNRESPONSIVE_AFTER_S, one tick)
            assert took < HEALTH_TIMEOUT_S, took
            info = httpx.get(rt.url + "/cluster_info", timeout=5).json()
            reason = next(w["reason"] for ws in info["workers"].values() for w in ws
                          if w["url"] == a.addr)
            assert "health check unanswered" in reason, reason
            calls = a.stub.calls
            for _ in range(4):
                assert client.post(rt.url + C, json=BODY).status_code == 200
            assert a.stub.calls == calls  # no new request went to the stopped one
            a.stub.frozen = False
            wait_for(lambda: healthy(rt.url, a.addr), 10, 0.02, what="a back in rotation")


def test_the_last_worker_in_rotation_is_not_taken_out_for_a_slow_check() -> None:
    """``_unresponsive``: only a healthy worker whose check is overdue, with another of its
    pool in rotation, and overdue by the worker's own recent answers when they are slower."""
    config = parse_cluster_config({"generation_servers": {"urls": ["127.0.0.1:1",
                                                                   "127.0.0.1:2"]}}, "test")
    m = Membership(config, {})
    a, b = m.pools[Role.GENERATION]
    for w in (a, b):
        w.healthy, w.checking, w.last_check = True, True, 100.0
    m._unresponsive(a, 100.0 + UNRESPONSIVE_AFTER_S / 2)
    assert a.healthy  # not overdue yet
    a.check_seconds.append(UNRESPONSIVE_AFTER_S)  # a worker that is slow to answer anyway
    m._unresponsive(a, 100.0 + 2 * UNRESPONSIVE_AFTER_S)
    assert a.healthy
    m._unresponsive(a, 100.0 + UNRESPONSIVE_FACTOR * UNRESPONSIVE_AFTER_S + 0.1)
    assert not a.healthy and "unanswered" in a.reason and a.failing_since is not None
    m._unresponsive(b, 100.0 + 60.0)
    assert b.healthy  # the last of its pool in rotation: its check's timeout decides


# ---- item 3: the client's request reaches both workers as it came ------------------------------


def test_both_calls_carry_the_client_s_bytes_and_the_answer_is_relayed_unread(
        loop: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router adds ``disaggregated_params`` before the closing brace and encodes nothing
    again (the context worker checks the request, ``stream`` as sent, as the generation
    worker will: tests/test_router_live.py); the generation answer's bytes pass through."""
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", TOKEN)
    # An escape and UTF-8 in the prompt, spaces and a newline around.
    raw = '{ "model": "m",\n  "prompt": "\\u00e9t\u00e9", "stream": false, "max_tokens": 2 }\n'
    raw = raw.encode()
    with stubs(loop, "context", "generation") as (ctx, gen), \
            router(loop, disaggregated(ctx.addr, gen.addr)) as rt:
        r = httpx.post(rt.url + C, content=raw, timeout=30)
        assert r.status_code == 200 and r.content == gen.stub.answers[-1]
        head = raw.rstrip()[:-1]
        assert ctx.stub.bodies == [head + b',"disaggregated_params":{"request_type":'
                                          b'"context_only"}}']
        assert gen.stub.bodies == [head + b',"disaggregated_params":{"ctx_request_id":'
                                          b'"lease-1","first_gen_tokens":[5],'
                                          b'"request_type":"generation_only"}}']
        # A body the bytes cannot take the params into as they are is encoded instead.
        for odd in (json.dumps({"model": "m", "prompt": "x"}).encode("utf-16"),
                    b'{"model":"m","prompt":"x","disaggregated_params":null}',
                    b'{"model":"m","prompt":["x"]}'):  # (a batch of one prompt, unwrapped)
            assert httpx.post(rt.url + C, content=odd, timeout=30).status_code == 200
            sent = json.loads(ctx.stub.bodies[-1])
            assert sent == {"model": "m", "prompt": "x",
                            "disaggregated_params": {"request_type": "context_only"}}


def test_a_generation_refusal_releases_the_context_lease(loop: LoopThread,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", TOKEN)
    with stubs(loop, "context", "generation") as (ctx, gen), \
            router(loop, disaggregated(ctx.addr, gen.addr)) as rt:
        gen.stub.status = 400
        for stream in (False, True):
            r = httpx.post(rt.url + C, json={**BODY, "stream": stream}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["message"] == "refused"
        # at once, not at the lease's expiry
        wait_for(lambda: sorted(ctx.stub.releases) == ["lease-1", "lease-2"], 5,
                 what="both leases released")
        gen.stub.status = None
        assert httpx.post(rt.url + C, json=BODY, timeout=30).status_code == 200
        time.sleep(0.2)
        assert len(ctx.stub.releases) == 2  # an accepted request's lease is the worker's


# ---- item 5: bad input at the router ----------------------------------------------------------


ROUTER_BAD = {
    "surrogate prompt": (C, b'{"model":"m","prompt":"a\\ud800b"}', 400),
    "surrogate model": (C, b'{"model":"\\udfff","prompt":"ab"}', 400),
    "surrogate message": (CHAT, b'{"model":"m","messages":[{"role":"user","content":'
                          b'"\\ud800"}]}', 400),
    "deep": (C, b'{"model":"m","prompt":"ab","x":' + b"[" * 50000 + b"]" * 50000 + b"}",
             400),
    "deep object": (C, b'{"a":' * 50000 + b"1" + b"}" * 50000, 400),
    "NaN": (C, b'{"model":"m","prompt":"ab","temperature":NaN}', 400),
    "1e400": (C, b'{"model":"m","prompt":"ab","top_p":1e400}', 400),
    "broken UTF-8": (C, b'{"model":"m","prompt":"\xff"}', 400),
    "not an object": (C, b"[1, 2]", 400),
}  # (and what the workers' schema refuses: tests/test_router_live.py, real workers)


@pytest.mark.parametrize("kind", ["disaggregated", "aggregated"])
def test_bad_input_gets_a_4xx_json_answer(loop: LoopThread, kind: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", TOKEN)
    with stubs(loop, "context", "generation") as (ctx, gen):
        cfg = disaggregated(ctx.addr, gen.addr) if kind == "disaggregated" else aggregated(
            gen.addr)
        with router(loop, cfg) as rt:
            plain = json.dumps(BODY).encode()
            cases = dict(ROUTER_BAD) if kind == "disaggregated" else {}
            for name, (path, raw, status) in cases.items():
                r = httpx.post(rt.url + path, content=raw, timeout=30,
                               headers={"Content-Type": "application/json"})
                assert r.status_code == status, (name, r.status_code, r.text[:200])
                assert r.json()["error"]["type"] == "invalid_request_error", name
            # a body labelled compressed: 415 whatever the cluster (aiohttp would inflate it)
            for body in (plain, gzip.compress(plain)):
                r = httpx.post(rt.url + C, content=body, timeout=30, headers={
                    "Content-Type": "application/json", "Content-Encoding": "gzip"})
                assert r.status_code == 415, r.text
                assert r.json()["error"]["param"] == "Content-Encoding"
            assert ctx.stub.calls == 0 and gen.stub.calls == 0
            assert httpx.post(rt.url + C, json=BODY, timeout=30).status_code == 200


# ---- item 7: slow and odd HTTP -------------------------------------------------------------------


def test_slow_and_odd_http(loop: LoopThread) -> None:
    timeout_s = 1.0
    cases = {
        "short body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 100\r\n\r\n{\"a\":",
        "slow head": b"GET /health HTTP/1.1\r\nHost: x\r\n",
        "http 0.9": b"GET /health\r\n\r\n",
        "http 2.0": b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n",
        "http 9.9": b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
        "5000 headers": b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
            b"X-%d: y\r\n" % i for i in range(5000)) + b"\r\n",
        "long header": b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
    }
    with stubs(loop, "aggregated") as (w,), \
            router(loop, aggregated(w.addr), keep_alive_s=timeout_s,
                   body_timeout_s=timeout_s) as rt:
        results: dict[str, tuple[bytes, float]] = {}

        def run(name: str, data: bytes) -> None:
            results[name] = raw_exchange(rt.port, data)

        threads = [threading.Thread(target=run, args=kv) for kv in cases.items()]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        assert httpx.post(rt.url + C, json=BODY, timeout=10).status_code == 200
        assert time.monotonic() - t0 < timeout_s  # served meanwhile
        for t in threads:
            t.join(20)
        slack = 3.0
        out, dt = results["short body"]
        # answered at the body timeout, closed after lingering for the rest of the body
        assert out.startswith(b"HTTP/1.1 408 ") and dt < timeout_s + LINGER_S + slack, (out, dt)
        assert b"<still open>" not in out
        assert json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        out, dt = results["slow head"]
        assert b"<still open>" not in out and dt < timeout_s + slack, (out, dt)
        for name in ("http 0.9", "http 2.0"):
            assert b" 505 " in results[name][0].split(b"\r\n")[0], (name, results[name])
        for name in ("http 9.9", "5000 headers", "long header"):
            assert results[name][0].startswith(b"HTTP/1.0 400 "), (name, results[name])
        assert httpx.get(rt.url + "/health", timeout=10).status_code == 200


# ---- item 8: nothing grows under steady load ---------------------------------------------------


def _worker_series(url: str) -> int:
    """Metric series labelled with a worker (decisions, KV matches, per-worker gauges)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(1 for ln in text.splitlines() if not ln.startswith("#") and 'worker="' in ln)


def test_router_bookkeeping_stays_bounded_under_load_and_churn(
        loop: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady load: after a warm-up, 3000 more requests (JSON and SSE) leave the number of
    live Python objects where it was (nothing kept per request). Churn: rounds of requests,
    each to a worker that registered on a new port (as a restarted ``disagg serve --port 0
    --router-url`` does) and unregistered after; before, every worker URL ever seen kept its
    metric series for the router's lifetime. (RSS is not asserted: it moves with the
    allocator; DESIGN section 10 says what it did.)"""
    import gc

    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", TOKEN)
    cfg = {"health_check_interval_sec": 10, "max_retries": 0, "disagg_cluster": {
        "minimal_instances": {"generation_servers": 0}, "heartbeat_interval_sec": 60,
        "inactive_timeout_sec": 120}}
    with router(loop, cfg, ready=False) as rt, httpx.Client(timeout=30) as client:
        m = rt.router.membership

        async def register(addr: str) -> None:
            await m.check(m.register({"role": "generation", "url": addr}))

        async def unregister(addr: str) -> None:
            m.unregister(addr)

        def load(n: int, tag: str) -> None:
            for i in range(n):
                r = client.post(rt.url + C, json={**BODY, "stream": i % 2 == 0,
                                                  "prompt": f"request {tag}.{i}"})
                assert r.status_code == 200, r.text

        def live_objects() -> int:
            gc.collect()
            return len(gc.get_objects())

        with stubs(loop, "generation") as (w,):
            loop.run(register(w.addr))
            load(500, "warm-up")
            objects = [live_objects()]
            for k in range(3):
                load(1000, f"steady{k}")
                objects.append(live_objects())
            loop.run(unregister(w.addr))
        assert max(objects) - objects[0] < 500, objects

        series = []
        for k in range(6):
            with stubs(loop, "generation") as (w,):
                loop.run(register(w.addr))
                load(100, f"churn{k}")
                loop.run(unregister(w.addr))
            series.append(_worker_series(rt.url))
        assert series == [0] * len(series), series  # only current workers have series
        assert not m.by_url and not m._spawned and not rt.router.upstream.background



def _raw_post(port: int, body: dict[str, Any], read: int) -> None:
    """POST ``body`` to /v1/completions on a connection of its own, read ``read`` bytes of the
    answer (0: none) and close it."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        if read:
            s.recv(read)


def test_closed_connections_are_freed_at_once_not_by_the_cycle_collector(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every client connection and every worker connection that ends is freed when it ends
    (reference counting), with no cycle collection (gc off here). Before, each one's
    httptools parser held its protocol's bound methods (and a worker connection cancelled
    while connecting kept its transport): a reference cycle, so every closed connection, with
    its transport and handler task (~2 KB), waited for the collector, which the router runs
    once every 50,000 net allocations (``cli.tune_gc``). Under ``bench/soak.py``'s mix (over
    half the requests on a connection of their own, 12% disconnects) a few MiB of them piled
    up between two collections, a sawtooth in the router's RSS. On uvloop, as the router
    runs."""
    import gc

    from disagg.router.front import FrontConnection
    from disagg.router.http1 import _Conn

    uvloop = pytest.importorskip("uvloop")
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", TOKEN)
    lt = LoopThread(uvloop.new_event_loop)
    try:
        with stubs(lt, "context", "generation") as (c, g), \
                router(lt, disaggregated(c.addr, g.addr)) as rt:
            g.stub.close = True  # each generation answer ends its worker connection
            pool = rt.router.upstream.pool

            def left() -> dict[str, int]:
                """Router connection objects not freed (those the pool holds are live)."""
                n = {"FrontConnection": 0, "_Conn": -len(pool._all)}
                for o in gc.get_objects():
                    if type(o) is FrontConnection or type(o) is _Conn:
                        n[type(o).__name__] += 1
                return n

            gc.collect()
            gc.disable()
            try:
                before = left()
                for i in range(15):
                    with httpx.Client(timeout=10) as client:  # a connection per request
                        r = client.post(rt.url + C, json={**BODY, "stream": i % 2 == 0})
                        assert r.status_code == 200, r.text
                    _raw_post(rt.port, {**BODY, "stream": True}, read=1)  # leaves mid-answer
                    _raw_post(rt.port, {**BODY, "stream": True}, read=0)  # leaves at once
                with contextlib.suppress(TimeoutError):
                    wait_for(lambda: left() == before, 5, what="connections freed")
                assert left() == before
            finally:
                gc.enable()
    finally:
        lt.close()


# ---- a real context + generation pair --------------------------------------------------------


NAME = "tiny"
BAD_TRAFFIC_S = float(os.environ.get("DISAGG_BAD_TRAFFIC_S", "20"))
KV_TOKENS = 1536  # 96 blocks of 16: five 300-token leases (19 blocks each) hold 95 of them
PROMPT_IDS = [(7 * i) % 500 + 1 for i in range(300)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, model_dir: str
         ) -> Iterator[SimpleNamespace]:
    tmp = tmp_path_factory.mktemp("faults-logs")
    common = ["--served-model-name", NAME, "--log-level", "warning", "--kv-cache-tokens",
              str(KV_TOKENS), "--max-model-len", "512", "--max-num-tokens", "256",
              "--tokens-per-block", "16", "--kv-transfer-backend", "TCP"]
    env = {"DISAGG_CLUSTER_TOKEN": TOKEN}
    ws = [start_worker_proc(tmp, model_dir, "ctx", ["--role", "context", *common], env),
          start_worker_proc(tmp, model_dir, "gen", ["--role", "generation", *common], env)]
    try:
        wait_all_healthy(ws, 120)
        yield SimpleNamespace(ctx=ws[0], gen=ws[1], model_dir=model_dir)
    finally:
        stop_all(ws)


def pair_config(pair: SimpleNamespace) -> dict[str, Any]:
    return {"model": pair.model_dir, "health_check_interval_sec": 0.5, "max_retries": 1,
            "context_servers": {"urls": [pair.ctx.addr]},
            "generation_servers": {"urls": [pair.gen.addr]}}


def test_malformed_requests_hold_no_context_kv(pair: SimpleNamespace, loop: LoopThread,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the context worker accepted them (the router rewrote stream, dropped
    stream_options), the generation worker refused them, and each lease held 19 blocks until
    its expiry (30 s): the next honest request waited for it."""
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", TOKEN)
    bad = [{"stream": [True]}, {"stream": True, "stream_options": 5},
           {"stream": True, "stream_options": {"include_usage": "x"}},
           {"stream": True, "stream_options": {"include_usage": []}}, {"stream": "maybe"}]
    with router(loop, pair_config(pair)) as rt:
        for extra in bad:
            r = httpx.post(rt.url + C, timeout=30, json={
                "model": NAME, "prompt": PROMPT_IDS, "max_tokens": 8, **extra})
            assert r.status_code == 400, r.text
        assert pair.ctx.blocks_used() == 0  # at once: no lease to wait for
        t0 = time.monotonic()
        r = httpx.post(rt.url + C, timeout=60, json={
            "model": NAME, "prompt": PROMPT_IDS, "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - t0 < 10
    pair.ctx.wait_blocks(0)
    pair.gen.wait_blocks(0)


def _texts(rt_url: str) -> list[str]:
    """Greedy answers to a long prompt (two context chunks), streamed and not, and a chat."""
    out = []
    for body, path in [({"prompt": PROMPT_IDS}, C), ({"prompt": PROMPT_IDS, "stream": True}, C),
                       ({"messages": [{"role": "user", "content": "Hi there"}]}, CHAT)]:
        body = {"model": NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
        if not body.get("stream"):
            r = httpx.post(rt_url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            out.append(ch["text"] if path == C else ch["message"]["content"])
            continue
        with httpx.stream("POST", rt_url + path, json=body, timeout=60) as r:
            assert r.status_code == 200
            out.append("".join(json.loads(line[6:])["choices"][0]["text"]
                               for line in r.iter_lines()
                               if line.startswith("data: {") and '"choices":[{' in line))
    return out


def test_kv_streaming_through_the_router_answers_as_the_two_calls_do(
        pair: SimpleNamespace, loop: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real workers: with kv_streaming the router calls both at once and every answer is
    the two-call flow's; nothing stays held on either side."""
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", TOKEN)
    with router(loop, pair_config(pair)) as rt:
        two_calls = _texts(rt.url)
    with router(loop, {**pair_config(pair), "kv_streaming": True}) as rt:
        assert _texts(rt.url) == two_calls
        assert metric(rt.url, "disagg_router_kv_stream_requests_total",
                      outcome="streamed") == 3
    pair.ctx.wait_blocks(0)
    pair.gen.wait_blocks(0)


def _bad_traffic(rt_url: str, rt_port: int, pair: SimpleNamespace) -> list[Any]:
    """One round of bad requests: through the router and straight to the workers."""
    direct = [pair.ctx.url, pair.gen.url]
    post = [
        (rt_url + C, b'{"model":"tiny","prompt":"a\\ud800b","max_tokens":4}'),
        (rt_url + C, b'{"model":"\\udfff","prompt":"ab"}'),
        (rt_url + CHAT, b'{"model":"tiny","messages":[{"role":"user","content":"\\udfff"}]}'),
        (rt_url + C, b'{"model":"tiny","prompt":"ab","x":' + b"[" * 50000 + b"]" * 50000
         + b"}"),
        (rt_url + C, b'{"model":"tiny","prompt":"ab","stream":"maybe"}'),
        (rt_url + C, b'{"model":"tiny","prompt":"ab","temperature":NaN}'),
        (rt_url + C, json.dumps({"model": NAME, "prompt": PROMPT_IDS, "max_tokens": 4,
                                 "stream": True, "stream_options": 5}).encode()),
        (rt_url + C, json.dumps({"model": NAME, "prompt": "hi", "n": 6,
                                 "max_tokens": 3}).encode()),  # fan-out, served whole
        *[(u + C, b'{"model":"\\udfff","prompt":"ab"}') for u in direct],
        *[(u + C, b'{"model":"tiny","prompt":"ab","x":' + b"[" * 50000 + b"]" * 50000
           + b"}") for u in direct],
        (pair.gen.url + C, json.dumps({"model": NAME, "prompt": ["a"] * 70,
                                       "max_tokens": 2}).encode()),
    ]
    raw = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{",
           b"GET /health HTTP/9.9\r\n\r\n", b"\x00\x01garbage\r\n\r\n"]
    return [("post", u, b) for u, b in post] + [("raw", p, d) for p in (
        rt_port, pair.ctx.port) for d in raw]


@pytest.mark.slow
def test_bad_traffic_does_not_fail_an_honest_client(pair: SimpleNamespace, loop: LoopThread,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22's bar: a router whose workers get bad requests at 10/s (through the router and
    straight to them) serves an honest client with 0 failed requests. Issue 22 asked for a
    minute (``DISAGG_BAD_TRAFFIC_S=60``); the suite runs 20 s of it (each of the 19 kinds of bad
    request goes by about 10 times), to keep the whole suite inside CI's 25 minutes."""
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", TOKEN)
    duration_s, bad_rate = BAD_TRAFFIC_S, 10.0
    with router(loop, pair_config(pair), body_timeout_s=2.0) as rt:
        rounds = _bad_traffic(rt.url, rt.port, pair)
        stop = threading.Event()
        bad_statuses: list[int] = []

        def attacker() -> None:
            i = 0
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    kind, where, data = rounds[i % len(rounds)]
                    i += 1
                    if kind == "post":
                        with contextlib.suppress(httpx.HTTPError):
                            bad_statuses.append(c.post(where, content=data, headers={
                                "Content-Type": "application/json"}).status_code)
                    else:
                        with contextlib.suppress(OSError), \
                                socket.create_connection(("127.0.0.1", where), 5) as s:
                            s.sendall(data)  # and hang up at once
                    stop.wait(1.0 / bad_rate)

        failures: list[str] = []
        served = 0
        t_end = time.monotonic() + duration_s
        threads = [threading.Thread(target=attacker, daemon=True)]
        for t in threads:
            t.start()
        try:
            with httpx.Client(timeout=30) as honest:
                while time.monotonic() < t_end:
                    stream = served % 2 == 1
                    path = CHAT if served % 3 == 0 else C
                    body: dict[str, Any] = {"model": NAME, "max_tokens": 6,
                                            "ignore_eos": True, "stream": stream}
                    if path == CHAT:
                        body["messages"] = [{"role": "user", "content": f"Hello {served}"}]
                    else:
                        body["prompt"] = f"The harbour, request {served}"
                    try:
                        with honest.stream("POST", rt.url + path, json=body) as r:
                            text = r.read().decode()
                        ok = r.status_code == 200 and (
                            not stream or (text.endswith("data: [DONE]\n\n")
                                           and '"error"' not in text))
                        if not ok:
                            failures.append(f"{r.status_code} {text[-300:]}")
                    except httpx.HTTPError as e:
                        failures.append(repr(e))
                    served += 1
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not failures, (len(failures), served, failures[:5])
        assert served >= duration_s / 2, served
        assert len(bad_statuses) >= 0.5 * duration_s * bad_rate * 0.5
        assert all(s < 500 for s in bad_statuses), sorted(set(bad_statuses))
    pair.ctx.wait_blocks(0)
    pair.gen.wait_blocks(0)
