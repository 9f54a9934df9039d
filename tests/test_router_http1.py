"""The router's lean upstream client (``disagg.router.http1``) under the router: a worker's
answer passed through byte for byte (a JSON body, and a chunked SSE stream whose events are cut
across HTTP chunks), keep-alive connections reused, a client that goes away aborting the
worker's request, a worker's silence hitting the read timeout, and an answer that ends with
the connection."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
from aiohttp import web
from router_fixtures import LoopThread, running_router
from server_fixtures import wait_for

from disagg.router import http1

BODY = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [
    {"index": 0, "text": " \u00e9t\u00e9 \"quoted\"", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    separators=(", ", ": ")).encode()  # spaced: re-encoding JSON would change it
EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
          b"data: [DONE]\n\n"]


class Stub:
    """A generation worker: /v1/completions answers BODY, or (stream) EVENTS in HTTP chunks
    that cut events apart; ``slow`` streams one event every 20 ms until the client leaves."""

    def __init__(self) -> None:
        self.connections: set[int] = set()  # the router's connections (their peer ports)
        self.aborted = asyncio.Event()
        self.mode = "normal"
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/v1/completions", self.completions)
        self.app = app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": "aggregated", "tokens_per_block": 16,
                                  "worker_id": "s", "model_dir": None})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.connections.add(peer[1] if peer else -1)
        body = await request.json()
        if self.mode == "hang":
            await asyncio.sleep(30)
        if not body.get("stream"):
            return web.Response(body=BODY, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            if self.mode == "slow":
                for _ in range(500):
                    await out.write(EVENTS[0])
                    await asyncio.sleep(0.02)
                return out
            data = b"".join(EVENTS)
            for i in range(0, len(data), 7):  # chunks that cut events apart
                await out.write(data[i:i + 7])
        except (ConnectionError, asyncio.CancelledError):  # (served with handler cancellation)
            self.aborted.set()
            raise
        await out.write_eof()
        return out


@pytest.fixture(scope="module")
def stub_router(loop: LoopThread) -> Any:
    stub = Stub()
    runner, url = loop.serve(stub.app)
    cfg = {"hostname": "127.0.0.1", "port": 0, "health_check_interval_sec": 0.2,
           "upstream_timeout_sec": 1.0,
           "generation_servers": {"num_instances": 1, "urls": [url.removeprefix("http://")]}}
    try:
        with running_router(cfg, loop) as router_url:
            wait_for(lambda: httpx.get(router_url + "/health").status_code == 200, 20,
                     what="router ready")
            yield stub, router_url
    finally:
        loop.run(runner.cleanup())


def _raw(port: int, body: dict[str, Any]) -> bytes:
    """One request on a raw socket; the whole answer as sent (head and body, unparsed)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(data), data))
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_answers_pass_through_byte_for_byte(stub_router: Any) -> None:
    stub, url = stub_router
    stub.mode = "normal"
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 200 and r.content == BODY
    with httpx.stream("POST", url + "/v1/completions",
                      json={"model": "m", "prompt": "hi", "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.read() == b"".join(EVENTS)
    # chunked to the client too, and whole events per chunk
    raw = _raw(int(url.rsplit(":", 1)[1]), {"model": "m", "prompt": "x", "stream": True})
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    assert b"data: {\"choices\": [{\"text\": \"a\"}]}\n\n" in body


def test_keep_alive_connections_are_reused(stub_router: Any, loop: LoopThread) -> None:
    stub, url = stub_router
    stub.mode = "normal"
    stub.connections.clear()
    with httpx.Client() as c:
        for _ in range(20):  # one at a time: one connection carries them all
            assert c.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}
                          ).content == BODY
    assert len(stub.connections) == 1


def test_a_client_that_leaves_aborts_the_workers_request(stub_router: Any,
                                                         loop: LoopThread) -> None:
    stub, url = stub_router
    stub.mode = "slow"
    stub.aborted.clear()
    with httpx.stream("POST", url + "/v1/completions",
                      json={"model": "m", "prompt": "hi", "stream": True}) as r:
        next(r.iter_bytes())  # the first event arrived; then the client closes
    wait_for(stub.aborted.is_set, 10, what="the worker's stream aborted")
    stub.mode = "normal"


def test_a_silent_worker_hits_the_read_timeout(stub_router: Any) -> None:
    stub, url = stub_router
    stub.mode = "hang"
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"},
                       timeout=20)
    finally:
        stub.mode = "normal"
    assert r.status_code in (502, 503, 504), r.text
    assert r.json()["error"]["type"]


def test_pool_body_ended_by_close_and_connect_error(loop: LoopThread) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=x\r\n\r\nbye")
        await writer.drain()
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = http1.Pool(connect_timeout_s=2, read_timeout_s=2, keep_alive_s=4)
        try:
            head = http1.request_head("POST", f"127.0.0.1:{port}", "/x", {})
            resp = await pool.post("127.0.0.1", port, head, b"{}")
            assert (resp.status, resp.content_type) == (200, "text/plain")
            assert await resp.read() == b"bye"
            resp.close()
            assert pool.idle_count("127.0.0.1", port) == 0  # not reusable: not kept
            server.close()
            await server.wait_closed()
            with pytest.raises(http1.ConnectError):
                await pool.post("127.0.0.1", port, head, b"{}")
        finally:
            pool.close()

    loop.run(run())


def test_the_read_timeout_counts_from_the_last_byte(loop: LoopThread) -> None:
    """A body whose bytes keep coming (each gap under the read timeout, all of them over it)
    is read; a worker that then goes silent fails the read once the timeout passed."""
    timeout_s = 0.5

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):  # 4 x 0.25 s: twice the timeout in all
            await asyncio.sleep(timeout_s / 2)
            writer.write(b"2\r\nab\r\n")
            await writer.drain()
        await asyncio.sleep(30)  # silent (cancelled when the server closes)

    async def run() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = http1.Pool(connect_timeout_s=2, read_timeout_s=timeout_s, keep_alive_s=4)
        try:
            head = http1.request_head("POST", f"127.0.0.1:{port}", "/x", {})
            resp = await pool.post("127.0.0.1", port, head, b"{}")
            got = b""
            loop_ = asyncio.get_running_loop()
            with pytest.raises(asyncio.TimeoutError):
                async for data in resp.iter_any():
                    got += data
                    last = loop_.time()
            silent = loop_.time() - last
            assert got == b"ab" * 4
            assert timeout_s * 0.9 <= silent < timeout_s + 2.0, silent
            resp.close()
        finally:
            pool.close()
            server.close()

    loop.run(run())
