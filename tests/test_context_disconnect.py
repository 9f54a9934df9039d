"""A ``context_only`` call whose client leaves at any moment frees its lease at once (issue 40,
item 6): before its prefill, during it, right after it (the lease just made, its final output
not handed to the server yet, or handed but not read), once the answer is built but not
written yet, and while it is written (to a client that reads nothing). Each moment is reached with
a hook that holds the engine thread (or the answer) there until the server saw the client
go, so the end-of-prefill race is hit every time, not by chance. The lease TTL is long: only a
release, never an expiry, can free the blocks within the test's timeout.

Also (item 9): a generation worker's requests waiting for their KV count as waiting
(``disagg_num_requests_waiting``), and ``disagg_num_requests_waiting_for_kv`` counts them
alone.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from router_fixtures import metric
from server_fixtures import Listener, serve_in_thread, signed, wait_for

from disagg.config import build_engine_config
from disagg.engine import AsyncLLM
from disagg.kv_connector.settings import DisaggSettings
from disagg.server import respond as respond_module
from disagg.server.app import ServerSettings, build_app
from disagg.server.fanout import FanOut

NAME = "tiny"
TOKEN = "context-disconnect-secret"
C = "/v1/completions"
B = 16
LEASE_TTL_S = 600.0  # never reached: a block freed within FREE_WITHIN_S was released
FREE_WITHIN_S = 10.0
WAIT = 30.0
SEND_BUFFER = 64 * 1024
SPREAD_CALLS = 40
ROUNDS = 3  # calls per moment (each a new request, its own prompt)
OPTIONS = dict(tokens_per_block=B, kv_cache_tokens=2048, max_model_len=512, max_num_tokens=256,
               max_batch_size=8)


def _body(i: int) -> dict[str, Any]:
    # 3 blocks of prompt, an answer that goes on: its blocks are leased
    return {"model": NAME, "prompt": list(range(20 + i, 20 + i + 2 * B + 5)), "max_tokens": 8,
            "temperature": 0, "ignore_eos": True,
            "disaggregated_params": {"request_type": "context_only"}}


def _worker(model_dir: str, role: str, **disagg: Any) -> tuple[AsyncLLM, Any]:
    engine = AsyncLLM(build_engine_config(model_dir, **OPTIONS), disagg=DisaggSettings(
        role=role, cluster_token=TOKEN, backend="TCP", **disagg))
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                           role=role, cluster_token=TOKEN))
    return engine, app


@pytest.fixture(scope="module")
def ctx(model_dir: str) -> Iterator[SimpleNamespace]:
    """A context worker (TCP, a 600 s lease TTL) served in this process; its connections'
    send buffers are small and fixed, so writing a large answer waits for the client."""
    engine, app = _worker(model_dir, "context", kv_lease_ttl_s=LEASE_TTL_S)
    with serve_in_thread(app, send_buffer=SEND_BUFFER) as url:
        ns = SimpleNamespace(url=url, engine=engine, srv=app.state.server,
                             leases=engine.transfer.leases)
        yield ns
        _wait_free(ns)


def _free(ns: SimpleNamespace) -> bool:
    s = ns.engine.stats()
    return len(ns.leases) == 0 and s.kv_blocks_used == 0 and s.num_running == 0


def _wait_free(ns: SimpleNamespace) -> None:
    wait_for(lambda: _free(ns), FREE_WITHIN_S, what="no lease and no KV block held")


def _open_call(url: str, path: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> socket.socket:
    """Send the request on a new connection and return it unread (the test hangs up)."""
    data = json.dumps(body).encode()
    head = {"Host": "test", "Content-Type": "application/json",
            "Content-Length": str(len(data)), **(headers or {})}
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    sock.sendall(f"POST {path} HTTP/1.1\r\n".encode() + b"".join(
        f"{k}: {v}\r\n".encode() for k, v in head.items()) + b"\r\n" + data)
    return sock


def _hang_up(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


# ---- hooks that hold a call at one moment -----------------------------------------------------


class Hold:
    """Holds the engine thread once, at one moment of the call's step, until ``go``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()
        self.armed = True

    def wait_here(self) -> bool:
        """True (after holding until ``go``) the first time only."""
        if not self.armed:
            return False
        self.armed = False
        self.reached.set()
        assert self.go.wait(WAIT), "the test never let the engine go on"
        return True


def _hold_engine(engine: AsyncLLM, moment: str, monkeypatch: pytest.MonkeyPatch) -> Hold:
    """``before``: the engine thread stops before the step that would prefill the call and
    skips that step (the abort comes first); ``during``: inside its forward; ``after``: its
    step ran (prefill done, lease made) but its outputs are not handed out yet."""
    hold = Hold()
    llm = engine.engine
    if moment == "during":
        execute = llm.runner.execute

        def held_execute(*a: Any, **kw: Any) -> Any:
            hold.wait_here()
            return execute(*a, **kw)

        monkeypatch.setattr(llm.runner, "execute", held_execute)
        return hold
    step = llm.step

    def held_step() -> Any:
        if moment == "before" and hold.wait_here():
            return []  # skipped: the next loop turn takes the abort first
        out = step()
        hold.wait_here()
        return out

    monkeypatch.setattr(llm, "step", held_step)
    return hold


def _record_leases(ns: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    made: list[str] = []
    create = ns.leases.create

    def recording(lease_id: str, *a: Any, **kw: Any) -> Any:
        made.append(lease_id)
        return create(lease_id, *a, **kw)

    monkeypatch.setattr(ns.leases, "create", recording)
    return made


def _only_inflight(ns: SimpleNamespace) -> str:
    ids = wait_for(lambda: list(ns.srv.inflight), WAIT, what="the call in flight")
    assert len(ids) == 1, ids
    return ids[0]


@pytest.mark.parametrize("moment", ["before", "during", "after"])
def test_disconnect_around_the_prefill_frees_the_lease(
        ctx: SimpleNamespace, moment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _record_leases(ctx, monkeypatch)
    for i in range(ROUNDS):
        hold = _hold_engine(ctx.engine, moment, monkeypatch)
        sock = _open_call(ctx.url, C, _body(i))
        try:
            assert hold.reached.wait(WAIT), "the engine never reached the call"
            rid = _only_inflight(ctx)
            _hang_up(sock)
            # The server saw the client go and asked the engine to abort (queued) while
            # the engine was held.
            wait_for(lambda rid=rid: rid not in ctx.srv.inflight
                     and rid not in ctx.engine._sinks, WAIT,
                     what="the server to see the disconnect")
        finally:
            hold.go.set()
            sock.close()
        _wait_free(ctx)
        if moment == "before":
            assert rid not in made  # aborted before its prefill: no lease ever
        else:
            assert rid in made  # the race was hit: leased after the client left


def test_disconnect_with_the_final_output_unread_frees_the_lease(
        ctx: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine handed the final output (the lease made) to the server, which has not read
    it yet when the client leaves: the engine saw it taken, only the server can end it."""
    reached = threading.Event()

    async def late_collect(self: FanOut) -> None:
        # Outputs go to the buffer (events() reads it first) until the final one is there
        # (for a context request the first output, taken by start(), is the final one).
        while not any(getattr(item, "finished", False) for _, item in self.buffer):
            self.buffer.append(await self.queue.get())
        reached.set()
        await asyncio.Event().wait()  # until the client leaves (cancelled)

    monkeypatch.setattr(FanOut, "collect", late_collect)
    for i in range(ROUNDS):
        reached.clear()
        sock = _open_call(ctx.url, C, _body(30 + i))
        try:
            assert reached.wait(WAIT), "the final output never reached the server"
            rid = _only_inflight(ctx)
            assert rid in ctx.leases and rid not in ctx.engine._sinks  # (generator done)
        finally:
            _hang_up(sock)
        _wait_free(ctx)


def test_disconnect_before_the_answer_is_written_frees_the_lease(
        ctx: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill ended and the lease is made; the client leaves before the answer naming
    it is written."""
    reached: list[str] = []
    answer_call = respond_module.ContextAnswer.__call__

    async def late(self: Any, scope: Any, receive: Any, send: Any) -> None:
        reached.append(json.loads(self.body)["disaggregated_params"]["ctx_request_id"])
        while (await receive())["type"] != "http.disconnect":  # until the client left
            pass
        await answer_call(self, scope, receive, send)

    monkeypatch.setattr(respond_module.ContextAnswer, "__call__", late)
    for i in range(ROUNDS):
        sock = _open_call(ctx.url, C, _body(10 + i))
        try:
            wait_for(lambda i=i: len(reached) > i, WAIT, what="the answer to be built")
            assert reached[i] in ctx.leases  # the lease the unwritten answer names
        finally:
            _hang_up(sock)
        _wait_free(ctx)


def test_disconnect_while_the_answer_is_written_frees_the_lease(
        ctx: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large answer (prompt logprobs) to a client that reads none of it: the write waits
    for the client (flow control), which leaves then."""
    paused = threading.Event()
    answer_call = respond_module.ContextAnswer.__call__

    async def watched(self: Any, scope: Any, receive: Any, send: Any) -> None:
        async def watched_send(message: Any) -> None:
            # Runs only if the send waits (for the client to read): a send that does not
            # wait returns first. (The send stays in this task: what wakes first matters.)
            returned = False
            asyncio.get_running_loop().call_soon(lambda: returned or paused.set())
            await send(message)
            returned = True

        await answer_call(self, scope, receive, watched_send)

    monkeypatch.setattr(respond_module.ContextAnswer, "__call__", watched)
    body = {**_body(0), "prompt": list(range(30, 30 + 400)), "prompt_logprobs": 20}
    with httpx.Client(base_url=ctx.url, timeout=WAIT) as client:  # (how large it is)
        r = client.post(C, json=body)
        assert r.status_code == 200 and len(r.content) > (1 << 19), len(r.content)
        assert ctx.engine.release_lease(r.json()["disaggregated_params"]["ctx_request_id"])
    _wait_free(ctx)
    paused.clear()  # (that write may have waited for a client that reads)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing, holds little
    port = int(ctx.url.rsplit(":", 1)[1])
    sock.connect(("127.0.0.1", port))
    try:
        data = json.dumps(body).encode()
        sock.sendall(f"POST {C} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        assert paused.wait(WAIT), "the answer's write never waited for the client"
        assert len(ctx.leases) == 1
    finally:
        sock.close()  # unread data: the connection is reset
    _wait_free(ctx)


def test_disconnects_spread_over_the_call_leave_no_lease(
        ctx: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's probe, without hooks: clients that hang up at moments spread over a
    context call's whole time (0 to twice its latency, so some never hang up). A lease is left
    only to an answer the server wrote whole before the client left (it cannot know that the
    client did not read it: the router ends such a lease, or its TTL)."""
    whole: set[str] = set()  # answers written whole (the server did not end their lease)
    answer_call = respond_module.ContextAnswer.__call__

    async def recording(self: Any, scope: Any, receive: Any, send: Any) -> None:
        unread, ended = self.on_unread, []
        self.on_unread = lambda: (ended.append(True), unread())
        await answer_call(self, scope, receive, send)
        if not ended:
            whole.add(json.loads(self.body)["disaggregated_params"]["ctx_request_id"])

    monkeypatch.setattr(respond_module.ContextAnswer, "__call__", recording)

    async def probe() -> tuple[list[str], int]:
        kept, hung_up = [], 0
        async with httpx.AsyncClient(base_url=ctx.url, timeout=WAIT) as client:
            # The call's latency: the fastest of three (one slowed by a busy host would
            # stretch every later deadline, so that too few clients hang up)
            latency = WAIT
            for i in range(3):
                t0 = time.monotonic()
                r = await client.post(C, json=_body(47 + i))
                latency = min(latency, time.monotonic() - t0)
                kept.append(r.json()["disaggregated_params"]["ctx_request_id"])
            for k in range(SPREAD_CALLS):
                call = client.post(C, json=_body(51 + k))
                try:
                    r = await asyncio.wait_for(call, latency * 2 * k / SPREAD_CALLS)
                except asyncio.TimeoutError:
                    hung_up += 1  # (the connection is closed)
                    continue
                assert r.status_code == 200, r.text
                kept.append(r.json()["disaggregated_params"]["ctx_request_id"])
        return kept, hung_up

    kept, hung_up = asyncio.run(probe())
    try:
        assert hung_up >= SPREAD_CALLS // 4, hung_up
        assert all(lid in ctx.leases for lid in kept)  # the answers read hold their leases
        wait_for(lambda: all(lid in whole for lid in live_leases(ctx)), FREE_WITHIN_S,
                 what="no lease but those of answers written whole")
    finally:  # (a failure here leaves no lease to the module's next tests)
        for lid in live_leases(ctx):
            ctx.engine.release_lease(lid)
    _wait_free(ctx)


def live_leases(ns: SimpleNamespace) -> list[str]:
    with ns.leases._lock:  # (the table lists no ids: a test's look inside)
        return list(ns.leases._live)


def test_an_answer_read_keeps_its_lease(ctx: SimpleNamespace,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No false alarm: an answer written whole leaves its lease to the generation worker."""
    released: list[str] = []
    release = ctx.engine.release_lease

    def recording(lease_id: str) -> bool:
        released.append(lease_id)
        return release(lease_id)

    monkeypatch.setattr(ctx.engine, "release_lease", recording)
    with httpx.Client(base_url=ctx.url, timeout=WAIT) as client:
        leases = []
        for i in range(6):
            r = client.post(C, json=_body(20 + i))
            assert r.status_code == 200, r.text
            leases.append(r.json()["disaggregated_params"]["ctx_request_id"])
        # Same connection, served after the earlier answers' handlers decided.
        assert client.get("/health").status_code == 200
    assert released == []
    assert all(lid in ctx.leases for lid in leases)
    for lid in leases:  # the generation worker's part, done here
        assert release(lid)
    _wait_free(ctx)


# ---- a generation worker's requests waiting for their KV --------------------------------------


@pytest.fixture()
def gen(model_dir: str) -> Iterator[SimpleNamespace]:
    engine, app = _worker(model_dir, "generation", read_timeout_s=WAIT)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, engine=engine, srv=app.state.server)


def test_requests_waiting_for_kv_count_as_waiting(ctx: SimpleNamespace,
                                                  gen: SimpleNamespace) -> None:
    body = {**_body(40), "max_tokens": 8}
    r = httpx.post(ctx.url + C, json=body, timeout=WAIT)
    assert r.status_code == 200, r.text
    params = r.json()["disaggregated_params"]
    stalled = Listener(hold=True)  # a "context worker" that never answers a read
    try:
        gen_body = {**body, "disaggregated_params": {
            **params, "request_type": "generation_only", "addresses": [stalled.addr]}}
        auth = signed(TOKEN, "POST", C, gen_body, to=gen.url)["headers"]
        sock = _open_call(gen.url, C, gen_body, auth)
        try:
            waiting: Callable[[], float] = lambda: metric(  # noqa: E731
                gen.url, "disagg_num_requests_waiting_for_kv")
            wait_for(lambda: waiting() == 1 and stalled.connections >= 1, WAIT,
                     what="the request to wait for its KV")
            assert metric(gen.url, "disagg_num_requests_waiting") == 1
            assert metric(gen.url, "disagg_num_requests_running") == 0
            s = gen.engine.stats()
            assert (s.num_waiting, s.num_waiting_for_kv) == (1, 1)
        finally:
            _hang_up(sock)
        wait_for(lambda: gen.engine.stats().kv_blocks_used == 0
                 and gen.engine.stats().num_waiting == 0, WAIT, what="the generation worker idle")
        assert metric(gen.url, "disagg_num_requests_waiting") == 0
    finally:
        stalled.close()
        assert ctx.engine.release_lease(params["ctx_request_id"])
        _wait_free(ctx)
