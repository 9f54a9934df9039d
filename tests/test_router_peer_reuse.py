"""KV prefix reuse across workers, the router's side (``peer_reuse``: ``policies``, ``flow``)
over scripted stub workers (aiohttp, no model) that record every call.

Each stub answers its health checks (``kv_peer_reuse`` in ``/server_info`` as told), serves its
KV events (a snapshot of the prompt blocks it is told it caches), ``POST /kv_prefix`` (a lease,
none, or a failure, as told), ``/kv_leases/release``, and ``/v1/*`` (an answer, a 500, a
dropped connection, a 400, or an answer held until the test lets it go). The end-to-end case
with real workers is in ``test_router_live.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from aiohttp import web
from router_fixtures import ROUTER_TOKEN, LoopThread, metric, running_router
from server_fixtures import (
    WorkerProc,
    reference_server,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

from disagg.cluster_auth import AUTH_HEADER, HttpVerifier
from disagg.kv_cache.hashing import BLOCK_HASH_SCHEME, hash_token_blocks
from disagg.router import upstream

C = "/v1/completions"
B = 16  # tokens per block
PROMPT = list(range(1000, 1080))  # 80 tokens: 5 blocks
CACHED = PROMPT[:64]  # what the peer holds: 4 blocks
LEASES = "disagg_router_kv_prefix_leases_total"
DEADLINE_S = 10.0  # a held answer waits this long at most


class Stub:
    """One scripted worker (see the module docstring). Knobs: ``cached`` (token ids whose
    blocks it reports), ``peer_reuse`` (advertised), ``prefix_mode`` (lease | none | 404 |
    500 | slow | malformed), ``v1_mode`` (ok | fail | drop | refuse | hold)."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.verifier = HttpVerifier(ROUTER_TOKEN)
        self.cached: list[int] = []
        self.peer_reuse = True
        self.prefix_mode = "lease"
        self.v1_mode = "ok"
        self.prefix_calls: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.releases: list[str] = []
        self.leases = 0
        self.held: asyncio.Event | None = None
        self.notes: list[str] = []
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/kv_events", self.kv_events)
        app.router.add_post("/kv_prefix", self.kv_prefix)
        app.router.add_post("/kv_leases/release", self.release)
        app.router.add_post("/v1/{tail:.*}", self.v1)
        self.app = app
        self.addr = ""

    def reset(self) -> None:
        self.cached, self.peer_reuse = [], True
        self.prefix_mode, self.v1_mode = "lease", "ok"
        self.prefix_calls, self.calls, self.releases, self.notes = [], [], [], []
        self.held = None
        self.leases = 0

    def _signed(self, request: web.Request, raw: bytes) -> bool:
        return self.verifier.is_valid(request.headers.get(AUTH_HEADER), "POST",
                                      request.raw_path, raw)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "member_id": self.verifier.member_id})

    async def server_info(self, request: web.Request) -> web.Response:
        # (a context worker's kv_transfer: what kv_streaming needs to stream from it)
        kv = {"worker_id": f"stub-{self.name}", "backend": "TCP",
              "addresses": ["127.0.0.1:47001"], "layout": {"num_layers": 2, "rank": 0}}
        return web.json_response({"role": self.role, "tokens_per_block": B,
                                  "worker_id": f"stub-{self.name}", "model_dir": None,
                                  "kv_blocks_used": 0, "kv_peer_reuse": self.peer_reuse,
                                  "kv_transfer": kv if self.role == "context" else None})

    async def kv_events(self, request: web.Request) -> web.Response:
        since = int(request.query.get("since", "0"))
        return web.json_response({
            "worker_id": f"stub-{self.name}", "tokens_per_block": B,
            "block_hash_scheme": BLOCK_HASH_SCHEME, "next_seq": 1, "events": [],
            "snapshot": hash_token_blocks(self.cached, B) if since == 0 else None})

    async def kv_prefix(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.prefix_calls.append({"body": json.loads(raw), "signed": self._signed(request,
                                                                                  raw)})
        mode = self.prefix_mode
        if mode == "404":
            return _error(404, "no KV prefix leases", "not_found")
        if mode == "500":
            return _error(500, "boom", "internal")
        if mode == "slow":
            await asyncio.sleep(DEADLINE_S)
        if mode == "malformed":
            return web.json_response({"num_tokens": "many"})
        if mode == "none":
            return web.json_response({"num_tokens": 0, "kv_prefix": None})
        self.leases += 1
        n = len(self.cached)
        return web.json_response({"num_tokens": n, "kv_prefix": {
            "ctx_request_id": f"prefix-{self.name}-{self.leases}", "num_tokens": n,
            "prompt_token_ids": self.cached, "block_ids": [[0, 1, 2, 3]],
            "worker_id": f"stub-{self.name}"}})

    async def release(self, request: web.Request) -> web.Response:
        raw = await request.read()
        lease = json.loads(raw)["ctx_request_id"]
        if self._signed(request, raw):
            self.releases.append(lease)
        return web.json_response({"ctx_request_id": lease, "released": True})

    async def v1(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.calls.append({"body": body, "signed": self._signed(request, raw),
                           "header": AUTH_HEADER in request.headers})
        if self.v1_mode == "fail":
            return _error(500, "engine failed", "internal")
        if self.v1_mode == "refuse":
            return _error(400, "max_tokens too large", "bad", "max_tokens")
        if self.v1_mode == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if self.v1_mode == "hold":
            self.held = asyncio.Event()
            try:
                await asyncio.wait_for(self.held.wait(), DEADLINE_S)
            except asyncio.CancelledError:
                self.notes.append("cancelled")
                raise
        usage = {"prompt_tokens": len(PROMPT), "completion_tokens": 1, "total_tokens": 81}
        answer: dict[str, Any] = {
            "id": f"cmpl-{self.name}", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": f" {self.name}", "finish_reason": "length",
                         "logprobs": None}], "usage": usage}
        dp = body.get("disaggregated_params") or {}
        if dp.get("request_type") == "context_only":
            answer["prompt_token_ids"] = body["prompt"]
            answer["disaggregated_params"] = {"ctx_request_id": f"ctx-{len(self.calls)}",
                                              "first_gen_tokens": [5],
                                              "prompt_token_ids": body["prompt"]}
        return web.json_response(answer)


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "x", "param": param,
                                        "code": code}}, status=status)


@pytest.fixture(scope="module")
def stubs(loop: LoopThread) -> Iterator[dict[str, Stub]]:
    out = {"a": Stub("a", "aggregated"), "b": Stub("b", "aggregated"),
           "ctx": Stub("ctx", "context"), "gen": Stub("gen", "generation")}
    runners = []
    try:
        for s in out.values():
            runner, url = loop.serve(s.app)
            runners.append(runner)
            s.addr = url.removeprefix("http://")
        yield out
    finally:
        for runner in runners:
            loop.run(runner.cleanup())


POLICY = {"type": "kv_cache_aware", "peer_reuse": True, "peer_weight": 1.0,
          "peer_min_tokens": 16, "kv_events_poll_interval_sec": 0.05}


def _workers(url: str) -> dict[str, dict[str, Any]]:
    info = httpx.get(url + "/cluster_info", timeout=5).json()
    return {w["url"]: w for ws in info["workers"].values() for w in ws}


def _ready(url: str, peer: Stub, *others: Stub) -> None:
    """The router serves, and its index of ``peer`` holds ``peer.cached``; every worker's
    kv_peer_reuse is known."""
    wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 20,
             what="router ready")

    def known() -> bool:
        ws = _workers(url)
        kv = ws[peer.addr]["kv_index"]
        return (kv is not None and kv["synced"] and kv["blocks"] == len(peer.cached) // B
                and all(ws[s.addr]["kv_peer_reuse"] is s.peer_reuse for s in (peer, *others)))

    wait_for(known, 20, what="the router's KV index of the peer")


@pytest.fixture()
def aggregated(stubs: dict[str, Stub], loop: LoopThread) -> Iterator[SimpleNamespace]:
    """Two aggregated stubs: ``a`` caches the prompt's first 64 tokens, ``b`` nothing. With
    peer_weight 1, b's score (a's 64 tokens, pulled) equals a's: the tie goes to the first
    candidate, b (listed first), on the router's first decision."""
    a, b = stubs["a"], stubs["b"]
    for s in stubs.values():
        s.reset()
    a.cached = list(CACHED)
    cfg = {"health_check_interval_sec": 0.2, "max_retries": 1, "max_migrations": 0,
           "generation_servers": {"urls": [b.addr, a.addr], "router": POLICY}}
    with running_router(cfg, loop) as url:
        _ready(url, a, b)
        yield SimpleNamespace(url=url, a=a, b=b)


def _post(url: str, **extra: Any) -> httpx.Response:
    return httpx.post(url + C, json={"model": "m", "prompt": PROMPT, "max_tokens": 1,
                                     **extra}, timeout=30)


def test_the_chosen_worker_gets_the_peers_lease_signed(aggregated: SimpleNamespace) -> None:
    url, a, b = aggregated.url, aggregated.a, aggregated.b
    r = _post(url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " b"
    # the router asked the peer for the prompt, signed
    assert a.prefix_calls == [{"body": {"prompt_token_ids": PROMPT}, "signed": True}]
    # the chosen worker got the client's request with the lease as its kv_prefix, signed
    assert len(b.calls) == 1 and b.calls[0]["signed"]
    lease = b.calls[0]["body"].pop("kv_prefix")
    assert lease["ctx_request_id"] == "prefix-a-1" and lease["prompt_token_ids"] == CACHED
    assert b.calls[0]["body"] == {"model": "m", "prompt": PROMPT, "max_tokens": 1}
    assert a.calls == [] and a.releases == []  # b took it: b gives it back
    assert metric(url, LEASES, outcome="got") == 1
    assert metric(url, "disagg_router_kv_prefix_tokens_total") == 64
    # the next decision rotates to a, which holds the prefix itself: no peer, nothing signed
    r = _post(url)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " a"
    assert len(a.prefix_calls) == 1 and len(a.calls) == 1
    assert "kv_prefix" not in a.calls[0]["body"] and not a.calls[0]["header"]


@pytest.mark.parametrize("mode", ["fail", "drop"])
def test_a_failed_worker_releases_the_lease_and_the_retry_goes_on(
        aggregated: SimpleNamespace, mode: str) -> None:
    url, a, b = aggregated.url, aggregated.a, aggregated.b
    b.v1_mode = mode
    r = _post(url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " a"  # the retry, on the peer itself
    assert len(b.calls) == 1 and "kv_prefix" in b.calls[0]["body"]
    assert len(a.calls) == 1 and "kv_prefix" not in a.calls[0]["body"]
    wait_for(lambda: a.releases == ["prefix-a-1"], 10, what="the lease released")
    wait_for(lambda: metric(url, "disagg_router_kv_prefix_releases_total") == 1, 10,
             what="the release counted")
    assert metric(url, "disagg_router_lease_releases_total") == 0  # (context leases')


def test_a_refusal_is_the_clients_answer_and_frees_the_lease(
        aggregated: SimpleNamespace) -> None:
    url, a, b = aggregated.url, aggregated.a, aggregated.b
    b.v1_mode = "refuse"
    r = _post(url)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert a.calls == []  # a 4xx is not retried
    wait_for(lambda: a.releases == ["prefix-a-1"], 10, what="the lease released")


def test_a_client_that_leaves_frees_the_lease(aggregated: SimpleNamespace,
                                              loop: LoopThread) -> None:
    url, a, b = aggregated.url, aggregated.a, aggregated.b
    b.v1_mode = "hold"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + C, json={"model": "m", "prompt": PROMPT, "max_tokens": 1},
                   timeout=httpx.Timeout(10, read=0.5))
    wait_for(lambda: a.releases == ["prefix-a-1"], 10, what="the lease released")
    wait_for(lambda: b.notes == ["cancelled"], 10, what="the upstream call closed")
    assert b.calls[0]["body"]["kv_prefix"]["ctx_request_id"] == "prefix-a-1"


@pytest.mark.parametrize("mode,outcome", [("404", "failed"), ("500", "failed"),
                                          ("slow", "failed"), ("malformed", "failed"),
                                          ("none", "none")])
def test_a_peer_that_leases_nothing_changes_nothing_but_the_metric(
        aggregated: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, mode: str,
        outcome: str) -> None:
    url, a, b = aggregated.url, aggregated.a, aggregated.b
    monkeypatch.setattr(upstream, "PREFIX_TIMEOUT_S", 0.3)  # ("slow" answers after 10 s)
    a.prefix_mode = mode
    r = _post(url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " b"
    assert len(a.prefix_calls) == 1
    # the request went on as without peer reuse: the client's bytes, unsigned
    assert b.calls == [{"body": {"model": "m", "prompt": PROMPT, "max_tokens": 1},
                        "signed": False, "header": False}]
    assert metric(url, LEASES, outcome=outcome) == 1
    assert metric(url, LEASES, outcome="got") == 0
    assert a.releases == []


def test_a_client_cannot_send_kv_prefix(aggregated: SimpleNamespace) -> None:
    url, a, b = aggregated.url, aggregated.a, aggregated.b
    r = _post(url, kv_prefix={"ctx_request_id": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_prefix"
    assert a.prefix_calls == [] and b.calls == []


# ---- the disaggregated flow: the context call pulls from a generation worker ------------------


def _disagg_config(stubs: dict[str, Stub], **extra: Any) -> dict[str, Any]:
    return {"health_check_interval_sec": 0.2, "max_retries": 1, "max_migrations": 0,
            "context_servers": {"urls": [stubs["ctx"].addr], "router": POLICY},
            "generation_servers": {"urls": [stubs["gen"].addr]}, **extra}


@pytest.mark.parametrize("streaming", [False, True])
def test_the_context_call_pulls_the_previous_turn_from_a_generation_worker(
        stubs: dict[str, Stub], loop: LoopThread, streaming: bool) -> None:
    """The generation worker decoded the previous turn, so its cache holds the prompt's
    prefix: the context worker's call carries its lease (signed), the generation call none.
    The generation side's policy is round robin, yet the router keeps its KV index (the
    context side's peers). With kv_streaming, a decision naming a peer takes the two calls."""
    ctx, gen = stubs["ctx"], stubs["gen"]
    for s in stubs.values():
        s.reset()
    gen.cached = list(CACHED)
    with running_router(_disagg_config(stubs, kv_streaming=streaming), loop) as url:
        _ready(url, gen, ctx)
        r = _post(url)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " gen"
        assert gen.prefix_calls == [{"body": {"prompt_token_ids": PROMPT}, "signed": True}]
        assert len(ctx.calls) == 1 and ctx.calls[0]["signed"]
        body = ctx.calls[0]["body"]
        assert body["disaggregated_params"] == {"request_type": "context_only"}
        assert body["kv_prefix"]["ctx_request_id"] == "prefix-gen-1"
        assert len(gen.calls) == 1 and "kv_prefix" not in gen.calls[0]["body"]
        assert gen.calls[0]["body"]["disaggregated_params"]["request_type"] == (
            "generation_only")
        assert gen.releases == []  # the context worker took it
        if streaming:
            assert metric(url, "disagg_router_kv_stream_requests_total",
                          outcome="not_streamable") == 1


def test_a_failed_context_call_releases_the_generation_workers_lease(
        stubs: dict[str, Stub], loop: LoopThread) -> None:
    ctx, gen = stubs["ctx"], stubs["gen"]
    for s in stubs.values():
        s.reset()
    gen.cached = list(CACHED)
    ctx.v1_mode = "fail"
    with running_router(_disagg_config(stubs, max_retries=0), loop) as url:
        _ready(url, gen, ctx)
        r = _post(url)
        assert r.status_code == 500  # the context worker's own error, passed on
        wait_for(lambda: gen.releases == ["prefix-gen-1"], 10, what="the lease released")
        assert gen.calls == []


# ---- end to end: two real aggregated workers with --kv-peer-reuse ----------------------------


NAME = "tiny"
LONG = ("Disaggregated serving splits the prompt phase from the decode phase, so that each "
        "runs on hardware sized for it; the router keeps both sides busy. ") * 3


@pytest.fixture(scope="module")
def peer_workers(model_dir: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[dict[str, WorkerProc]]:
    tmp = tmp_path_factory.mktemp("peer-reuse-logs")
    args = ["--role", "aggregated", "--served-model-name", NAME, "--log-level", "warning",
            "--kv-cache-tokens", "4096", "--max-model-len", "512", "--max-num-tokens", "256",
            "--max-batch-size", "8", "--tokens-per-block", str(B), "--kv-peer-reuse",
            "--kv-transfer-backend", "TCP"]
    env = {"DISAGG_CLUSTER_TOKEN": ROUTER_TOKEN}
    ws = {name: start_worker_proc(tmp, model_dir, name, args, env) for name in ("a", "b")}
    try:
        wait_all_healthy(list(ws.values()), 120.0)
        yield ws
    finally:
        stop_all(list(ws.values()))


def _worker_metric(w: WorkerProc, name: str) -> float:
    return metric(w.url, name)


def test_a_second_turn_on_another_worker_pulls_the_first_turns_prefix(
        peer_workers: dict[str, WorkerProc], model_dir: str, loop: LoopThread) -> None:
    """Turn 1 ran on worker a; the router sends turn 2 to b (the tie between a's own prefix
    and b's pull of it, peer_weight 1, goes to b, listed first), which pulls the prefix from
    a instead of computing it: the same greedy answer as a worker that computed everything,
    and b's usage and metrics say the prefix was pulled."""
    a, b = peer_workers["a"], peer_workers["b"]
    turn1 = f"[peer reuse] {LONG} Question: what comes next?"
    first = httpx.post(a.url + C, json={"model": NAME, "prompt": turn1, "max_tokens": 8,
                                        "temperature": 0, "ignore_eos": True}, timeout=60)
    assert first.status_code == 200, first.text
    turn2 = turn1 + first.json()["choices"][0]["text"] + " And after that?"
    body = {"model": NAME, "prompt": turn2, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    with reference_server(model_dir, NAME) as ref_url:
        ref = httpx.post(ref_url + C, json=body, timeout=60).json()
    cfg = {"model": model_dir, "health_check_interval_sec": 0.2, "max_migrations": 0,
           "generation_servers": {"urls": [b.addr, a.addr], "router": POLICY}}
    pulls0 = _worker_metric(b, "disagg_kv_peer_prefix_pulls_total")
    with running_router(cfg, loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")

        def indexed() -> bool:
            ws = _workers(url)
            kv = ws[a.addr]["kv_index"]
            return (kv is not None and kv["synced"] and kv["blocks"] >= 10
                    and ws[a.addr]["kv_peer_reuse"] and ws[b.addr]["kv_peer_reuse"])

        wait_for(indexed, 30, what="the router's index of a, both advertising kv_peer_reuse")
        r = httpx.post(url + C, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        assert metric(url, "disagg_router_routing_decisions_total", worker=b.addr) == 1
        assert metric(url, LEASES, outcome="got") == 1
        leased = metric(url, "disagg_router_kv_prefix_tokens_total")
        assert leased >= 10 * B
    assert _worker_metric(b, "disagg_kv_peer_prefix_pulls_total") == pulls0 + 1
    assert _worker_metric(b, "disagg_kv_peer_prefix_tokens_total") >= leased
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= leased
    a.wait_blocks(0)  # b gave the lease back: a holds no blocks for it
