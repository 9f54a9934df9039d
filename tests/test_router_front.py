"""The router's front door (``disagg.router.front``): the common OpenAI request served by the
router's own HTTP/1.1 protocol, every other one handed, with its connection, to aiohttp's.

Every exchange here is raw bytes on one socket, read back with httptools: which server
answered is told by aiohttp's ``Server`` header (the front sends none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httptools
import httpx
import pytest
from router_fixtures import LoopThread
from server_fixtures import wait_for
from test_router_faults import BODY, aggregated, stubs

from disagg.contracts.cluster import parse_cluster_config
from disagg.router.app import ROUTER_KEY, build_router_app, start_router
from disagg.router.front import Front, FrontConnection, FrontSite

C = "/v1/completions"


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> Iterator[LoopThread]:
    """The router's loop: uvloop (its default where installed) and asyncio's (the hand-off
    to aiohttp swaps the protocol of either loop's transports)."""
    if request.param == "uvloop":
        lt = LoopThread(pytest.importorskip("uvloop").new_event_loop)
    else:
        lt = LoopThread()
    yield lt
    lt.close()


@contextlib.contextmanager
def front_router(loop: LoopThread, **extra: Any) -> Iterator[SimpleNamespace]:
    """A router in front of one stub worker; ``front``: its FrontSite's shared state."""
    with stubs(loop, "aggregated") as (w,):
        app = build_router_app(parse_cluster_config(aggregated(w.addr, **extra), "test"))
        runner, port = loop.run(start_router(app, "127.0.0.1", 0))
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 30,
                     what="router ready")
            site = next(s for s in runner.sites if isinstance(s, FrontSite))
            yield SimpleNamespace(port=port, url=url, front=site.front, stub=w.stub,
                                  router=app[ROUTER_KEY])
        finally:
            loop.run(runner.cleanup())


class Answers:
    """HTTP answers read off a socket with httptools, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[dict[str, Any]] = []
        self.cur: dict[str, Any] = {}
        self.closed = False

    def on_message_begin(self) -> None:
        self.cur = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.cur["headers"][name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.cur["status"] = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.cur["body"] += body

    def on_message_complete(self) -> None:
        self.done.append(self.cur)

    def read(self, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Until ``n`` answers are complete (or the server closed)."""
        self.sock.settimeout(timeout_s)
        while len(self.done) < n and not self.closed:
            data = self.sock.recv(65536)
            if not data:
                self.closed = True
                break
            self.parser.feed_data(data)
        return self.done

    def wait_closed(self, timeout_s: float = 10.0) -> bool:
        self.sock.settimeout(timeout_s)
        with contextlib.suppress(ConnectionResetError):
            while self.sock.recv(65536):
                pass
        return True


def post(path: str = C, body: dict[str, Any] | None = None, *extra: str) -> bytes:
    raw = json.dumps(body or BODY).encode()
    head = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json",
            f"Content-Length: {len(raw)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


def by_aiohttp(answer: dict[str, Any]) -> bool:
    return "aiohttp" in answer["headers"].get("server", "")


def test_the_common_request_stays_on_the_front_and_the_rest_goes_to_aiohttp(
        loop: LoopThread) -> None:
    """Pipelined in one send: a streamed and a whole completion (the front's), /health (the
    connection goes to aiohttp, for good), a completion (aiohttp's): four answers in order."""
    with front_router(loop) as rt, socket.create_connection(("127.0.0.1", rt.port)) as s:
        s.sendall(post(C, {**BODY, "stream": True}) + post(C))
        first = Answers(s).read(2)
        assert [a["status"] for a in first] == [200, 200]
        assert not any(by_aiohttp(a) for a in first)
        sse, whole = first
        assert sse["headers"]["content-type"] == "text/event-stream"
        assert sse["headers"]["transfer-encoding"] == "chunked"
        assert sse["body"].endswith(b"data: [DONE]\n\n")
        assert json.loads(whole["body"])["choices"][0]["text"] == " a b"
        assert rt.front.conns  # still the front's
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post(C))
        health, later = Answers(s).read(2)
        assert health["status"] == 200 and by_aiohttp(health)
        assert later["status"] == 200 and by_aiohttp(later)
        assert json.loads(later["body"])["choices"][0]["text"] == " a b"
        assert not rt.front.conns  # handed off
        assert rt.stub.calls == 3


def test_a_body_that_comes_after_its_head_is_waited_for(loop: LoopThread) -> None:
    with front_router(loop) as rt, socket.create_connection(("127.0.0.1", rt.port)) as s:
        data = post(C)
        head_len = data.index(b"\r\n\r\n") + 4
        s.sendall(data[:head_len + 3])
        wait_for(lambda: any(c.task is not None for c in rt.front.conns), 10,
                 what="the handler waits for the body")
        s.sendall(data[head_len + 3:])
        (a,) = Answers(s).read(1)
        assert a["status"] == 200 and not by_aiohttp(a)


def test_a_large_body_in_many_reads(loop: LoopThread) -> None:
    with front_router(loop) as rt, socket.create_connection(("127.0.0.1", rt.port)) as s:
        # (under the stub worker's own limit, aiohttp's 1 MiB)
        data = post(C, {**BODY, "prompt": "x" * (900 << 10)})
        for i in range(0, len(data), 4096):  # many small sends: many reads
            s.sendall(data[i:i + 4096])
        (a,) = Answers(s).read(1, timeout_s=30)
        assert a["status"] == 200 and not by_aiohttp(a)
        assert rt.stub.calls == 1


def test_an_unauthorized_request_keeps_its_connection(loop: LoopThread) -> None:
    """401 before the body is read: the body is dropped, the next request served."""
    with front_router(loop, api_key="sesame") as rt, \
            socket.create_connection(("127.0.0.1", rt.port)) as s:
        s.sendall(post(C) + post(C, None, "Authorization: Bearer sesame"))
        denied, ok = Answers(s).read(2)
        assert denied["status"] == 401 and not by_aiohttp(denied)
        assert json.loads(denied["body"])["error"]["code"] == "invalid_api_key"
        assert ok["status"] == 200 and not by_aiohttp(ok)
        assert rt.stub.calls == 1


def test_connection_close_is_honoured(loop: LoopThread) -> None:
    with front_router(loop) as rt, socket.create_connection(("127.0.0.1", rt.port)) as s:
        s.sendall(post(C, None, "Connection: close"))
        answers = Answers(s)
        (a,) = answers.read(1)
        assert a["status"] == 200 and a["headers"]["connection"] == "close"
        assert answers.wait_closed()
        assert not rt.front.conns


@pytest.mark.parametrize("case", ["expect", "chunked", "two lengths", "gzip", "query",
                                  "http 1.0"])
def test_other_shapes_of_the_same_endpoint_are_aiohttp_s(loop: LoopThread, case: str) -> None:
    """Handed to aiohttp with the bytes the front held: 100-continue, a chunked body, a bad
    head (aiohttp's 400), a compressed body (415), a query string, HTTP/1.0."""
    raw = json.dumps(BODY).encode()
    with front_router(loop) as rt, socket.create_connection(("127.0.0.1", rt.port)) as s:
        answers = Answers(s)
        if case == "expect":
            s.sendall(post(C, None, "Expect: 100-continue")[:-len(raw)])
            s.settimeout(10)
            assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue")
            s.sendall(raw)
            expected = 200
        elif case == "chunked":
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                      b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(raw), raw))
            expected = 200
        elif case == "two lengths":
            s.sendall(post(C, None, "Content-Length: 1"))
            expected = 400
        elif case == "gzip":
            s.sendall(post(C, None, "Content-Encoding: gzip"))
            expected = 415
        elif case == "query":
            s.sendall(post(C + "?x=1"))
            expected = 200
        else:
            s.sendall(post(C).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
            expected = 200
        (a,) = answers.read(1)
        assert a["status"] == expected and by_aiohttp(a), a
        assert not rt.front.conns


def test_a_client_that_leaves_mid_request_cancels_it(loop: LoopThread) -> None:
    """The handler waiting for a body is cancelled when the client closes: the request is
    counted as disconnected and the connection forgotten."""
    with front_router(loop) as rt:
        with socket.create_connection(("127.0.0.1", rt.port)) as s:
            s.sendall(post(C)[:-2])
            wait_for(lambda: any(c.task is not None for c in rt.front.conns), 10,
                     what="the handler waits for the body")
        wait_for(lambda: not rt.front.conns, 10, what="the connection forgotten")
        text = httpx.get(rt.url + "/metrics", timeout=10).text
        assert 'outcome="disconnected"' in text
        assert rt.stub.calls == 0


def test_shutdown_lets_the_answer_in_hand_finish(loop: LoopThread) -> None:
    """The runner's cleanup closes idle front connections at once and ends a busy one after
    its answer (``Connection: close``)."""
    with stubs(loop, "aggregated") as (w,):
        app = build_router_app(parse_cluster_config(aggregated(w.addr), "test"))
        runner, port = loop.run(start_router(app, "127.0.0.1", 0))
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health",
                                   timeout=5).status_code == 200, 30, what="router ready")
        front = next(s for s in runner.sites if isinstance(s, FrontSite)).front
        with socket.create_connection(("127.0.0.1", port)) as idle, \
                socket.create_connection(("127.0.0.1", port)) as busy:
            data = post(C)
            busy.sendall(data[:-1])
            wait_for(lambda: len(front.conns) == 2 and any(
                c.task is not None for c in front.conns), 10, what="both connections")
            fut = asyncio.run_coroutine_threadsafe(runner.cleanup(), loop.loop)
            assert Answers(idle).wait_closed()
            t0 = time.monotonic()
            busy.sendall(data[-1:])
            answers = Answers(busy)
            (a,) = answers.read(1)
            assert a["status"] == 200 and a["headers"]["connection"] == "close"
            assert answers.wait_closed()
            fut.result(30)
            assert time.monotonic() - t0 < 10


class _Failing:
    """Handlers whose OpenAI endpoint fails (after starting a stream, or before answering)."""

    def __init__(self, stream_first: bool) -> None:
        self.router = SimpleNamespace(body_timeout_s=5.0)
        self.stream_first = stream_first

    async def serve_openai(self, out: Any, path: str, authorization: str | None,
                           read_body: Any, timing_header: str | None = None,
                           traceparent: str | None = None) -> Any:
        await read_body()
        if self.stream_first:
            await out.start(200, {"Content-Type": "text/event-stream"})
            await out.write(b"data: 1\n\n")
        raise RuntimeError("a bug")


async def _closed(server: asyncio.Server) -> None:
    server.close()


@pytest.mark.parametrize("stream_first", [False, True])
def test_a_handler_error_is_a_500_or_a_cut_stream(loop: LoopThread, stream_first: bool,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Before any byte of the answer: a 500 in OpenAI's error JSON, the connection kept. Mid
    stream: the connection closed (a 500 cannot follow the stream's first bytes)."""
    front = Front(_Failing(stream_first), lambda: None, keep_alive_s=5.0,  # type: ignore[arg-type]
                  linger_s=1.0, max_head_bytes=8190, max_headers=128)
    server = loop.run(loop.loop.create_server(lambda: FrontConnection(front), "127.0.0.1", 0))
    try:
        port = server.sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(post(C) + post(C))
            answers = Answers(s)
            got = answers.read(2)
            if stream_first:
                assert len(got) == 0 and answers.closed  # the chunked body never ended
                assert answers.cur["status"] == 200 and answers.cur["body"] == b"data: 1\n\n"
            else:
                assert [a["status"] for a in got] == [500, 500]
                assert json.loads(got[0]["body"])["error"]["type"] == "internal_server_error"
        assert "unhandled error serving /v1/completions" in caplog.text
    finally:
        loop.run(_closed(server))  # (on its loop: Server.close is not thread-safe)


@pytest.mark.parametrize("junk", [
    bytes(range(256)),                                   # binary
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\xaa" * 64,  # a TLS ClientHello
    b"\x00" * 64,
    b"GET\t/ HTTP/1.1\r\n",                             # not a method then a space
    b"A" * 40,                                          # no method is that long
])
def test_junk_gets_a_400_at_once(loop: LoopThread, junk: bytes) -> None:
    """Bytes that cannot start an HTTP request are answered 400 (OpenAI error JSON) and the
    connection closed at once: no wait for a line end that never comes (issue 40)."""
    with front_router(loop) as rt, socket.create_connection(("127.0.0.1", rt.port)) as s:
        s.settimeout(10)
        s.sendall(junk)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n"), data
        assert b"Connection: close" in data
        body = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["message"] == "not an HTTP/1.x request"
        assert rt.stub.calls == 0


@pytest.mark.parametrize("start", [b"P", b"POST", b"\r\nPOST /v1/comp", b"M-SEARCH * HTTP/1.1"])
def test_the_start_of_a_request_is_not_junk(start: bytes) -> None:
    from disagg.router.front import could_start_request

    assert could_start_request(start)
