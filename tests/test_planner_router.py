"""Role switches through a real ``disagg router`` process over 2 + 2 stub workers that implement
the worker's side of the role-switch contract (``POST /admin/role`` drains, then flips;
``/server_info`` shows it; a request of the wrong type is detected): the operator endpoint
under a concurrent load, and the planner moving a worker toward a slow side."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web
from router_fixtures import DYNAMIC, ROUTER_TOKEN, LoopThread, metric, running_router

from disagg import procs
from disagg.cluster_auth import HttpSigner, member_id_from_health, member_id_of

TYPE_ROLE = {"context_only": "context", "generation_only": "generation"}


class StubWorker:
    """A worker of ``role`` whose answers take ``ctx_delay_s`` (context_only) or
    ``gen_ms_per_token * max_tokens`` (generation_only)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.switch: dict[str, Any] | None = None
        self.switches = 0
        self.in_flight = 0
        self.ctx_delay_s = 0.005
        self.gen_ms_per_token = 1.0
        self.drain_s = 0.2  # how long a switch takes once drained
        self.served: Counter[str] = Counter()  # request type -> served
        self.wrong_type: list[str] = []  # served requests whose type did not fit: must be none
        self.refused_switching = 0  # arrived while switching (503 role_switching)
        self.url = ""
        self.router_url: str | None = None  # registered there (heartbeats, re-registers)
        self.refuse_switching = False  # refuse requests as switching (a switch just begun)

    async def register(self) -> None:
        """One registration with the current role (the worker's RouterRegistration)."""
        import aiohttp

        assert self.router_url is not None
        body = json.dumps({"role": self.role, "url": self.url}).encode()
        async with aiohttp.ClientSession() as s:
            async with s.get(self.router_url + "/health") as r:  # names the router's id
                router_id = member_id_from_health(await r.json())
            headers = {"Content-Type": "application/json",
                       **HttpSigner(ROUTER_TOKEN).headers("POST", "/cluster/register", body,
                                                          audience=router_id)}
            async with s.post(self.router_url + "/cluster/register", data=body,
                              headers=headers) as r:
                assert r.status == 200, await r.text()

    async def heartbeat(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the router may be gone at the end
                await self.register()
            await asyncio.sleep(0.2)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/admin/role", self.admin_role)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/kv_leases/release", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        switch = self.switch or ({"from": self.role, "to": "context", "state": "draining"}
                                 if self.refuse_switching else None)
        return web.json_response({"role": self.role, "role_switch": switch,
                                  "role_switches": self.switches, "worker_id": self.url,
                                  "tokens_per_block": 16})

    async def admin_role(self, request: web.Request) -> web.Response:
        role = (await request.json()).get("role")
        obj = {"object": "role_switch", "from": self.role, "to": role}
        if self.switch is not None:
            return web.json_response({"error": {"message": "busy", "code":
                                                "role_switch_in_progress"}}, status=409)
        if role == self.role:
            return web.json_response({**obj, "state": "done"})
        self.switch = {"from": self.role, "to": role, "state": "draining", "since": time.time(),
                       "pending": {"leases": 0, "requests": self.in_flight, "pulls": 0}}
        asyncio.get_running_loop().create_task(self._finish(role))
        return web.json_response({**obj, "state": "draining"}, status=202)

    async def _finish(self, role: str) -> None:
        while self.in_flight:  # drain what it serves
            await asyncio.sleep(0.01)
        await asyncio.sleep(self.drain_s)
        self.role, self.switch = role, None
        self.switches += 1
        if self.router_url is not None:
            await self.register()  # at once with the new role, as the contract says

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        rtype = (body.get("disaggregated_params") or {}).get("request_type")
        if self.switch is not None or self.refuse_switching:
            self.refused_switching += 1
            return web.json_response({"error": {"message": "switching", "code":
                                                "role_switching"}}, status=503)
        if TYPE_ROLE.get(rtype) != self.role:
            self.wrong_type.append(f"{rtype} on a {self.role} worker")
            return web.json_response({"error": {"message": "wrong type"}}, status=400)
        self.in_flight += 1
        try:
            n = int(body.get("max_tokens") or 16)
            await asyncio.sleep(self.ctx_delay_s if self.role == "context"
                                else self.gen_ms_per_token * n / 1000.0)
        finally:
            self.in_flight -= 1
        self.served[rtype] += 1
        answer: dict[str, Any] = {
            "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "stub",
            "choices": [{"index": 0, "text": "x", "logprobs": None,
                         "finish_reason": None if self.role == "context" else "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        if self.role == "context":
            answer["disaggregated_params"] = {"request_type": "context_only",
                                              "ctx_request_id": "lease-1",
                                              "first_gen_tokens": [1]}
            answer["prompt_token_ids"] = [1, 2, 3]
        return web.json_response(answer)


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, StubWorker]]:
    lt = LoopThread()
    workers = {name: StubWorker("context" if name.startswith("c") else "generation")
               for name in ("c1", "c2", "g1", "g2")}
    runners = []
    try:
        for w in workers.values():
            runner, url = lt.serve(w.app())
            runners.append(runner)
            w.url = url.removeprefix("http://")
        yield workers
    finally:
        for runner in runners:
            lt.run(runner.cleanup())
        lt.close()


PLANNER = {"ttft_slo_ms": 150, "tpot_slo_ms": 100, "interval_s": 0.3, "window_s": 3,
           "min_samples": 8, "hysteresis_s": 3, "min_per_role": 1, "headroom": 0.2,
           "switch_timeout_s": 10}


@pytest.fixture
def router(stubs: dict[str, StubWorker], tmp_path: Path, request: pytest.FixtureRequest
           ) -> Iterator[str]:
    """A ``disagg router`` process over the stubs (``--planner`` when parametrized True)."""
    cfg = {"hostname": "127.0.0.1", "port": 0, "health_check_interval_sec": 0.2,
           "context_servers": {"urls": [stubs["c1"].url, stubs["c2"].url]},
           "generation_servers": {"urls": [stubs["g1"].url, stubs["g2"].url]},
           "planner": PLANNER}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "router.log"
    cmd = [sys.executable, "-m", "disagg.cli", "router", "-c", str(path), "--port", "0"]
    if getattr(request, "param", False):
        cmd.append("--planner")
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": ROUTER_TOKEN}
    proc = procs.spawn(cmd, log, env=env)
    try:
        deadline = time.monotonic() + 30
        url = None
        while url is None:
            for line in log.read_text().splitlines():
                if line.startswith("disagg router listening on "):
                    url = line.split()[-1]
            assert proc.poll() is None, procs.log_tail(log)
            assert time.monotonic() < deadline, procs.log_tail(log)
            time.sleep(0.05)  # start-up polling, bounded by the deadline
        procs.wait_healthy(url, 30, proc=proc, what="the router")
        yield url
    finally:
        procs.stop(proc, grace_s=10)


class Load:
    """``threads`` clients sending completions through the router until stopped."""

    def __init__(self, url: str, threads: int = 6) -> None:
        self.url = url
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(threads)
        self.futures = [self.pool.submit(self._client) for _ in range(threads)]

    def _client(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                r = c.post(self.url + "/v1/completions",
                           json={"model": "stub", "prompt": "hi", "max_tokens": 4})
                self.statuses[r.status_code] += 1
                if r.status_code != 200:
                    self.errors.append(r.text[:200])

    def finish(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result(60)
        self.pool.shutdown()


def signed_post(url: str, path: str, payload: dict[str, Any], token: str = ROUTER_TOKEN,
                timeout: float = 30) -> httpx.Response:
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json",
               **HttpSigner(token).headers("POST", path, body, audience=member_id_of(url))}
    return httpx.post(url + path, content=body, headers=headers, timeout=timeout)


def pools(url: str) -> dict[str, list[str]]:
    info = httpx.get(url + "/cluster_info", timeout=10).json()
    return {role: sorted(w["url"] for w in ws) for role, ws in info["workers"].items()}


def test_admin_role_switches_under_load(stubs: dict[str, StubWorker], router: str) -> None:
    g2 = stubs["g2"]
    # refusals first: unsigned, bad role, unknown worker
    r = httpx.post(router + "/admin/role", json={"url": g2.url, "role": "context"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_cluster_signature"
    r = signed_post(router, "/admin/role", {"url": g2.url, "role": "prefill"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "role"
    for bad, param in (({"url": ["x"], "role": "context"}, "url"),
                       ({"url": g2.url, "role": "context", "timeout_s": 0}, "timeout_s"),
                       ({"url": g2.url, "role": ["context"]}, "role")):
        r = signed_post(router, "/admin/role", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = signed_post(router, "/admin/role", {"url": "127.0.0.1:9", "role": "context"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "url"
    r = signed_post(router, "/admin/role", {"url": g2.url, "role": "generation"})
    assert r.status_code == 200 and r.json()["state"] == "done"  # already: nothing to do

    load = Load(router)
    try:
        time.sleep(0.3)  # some load in flight before the switch (the test's subject)
        r = signed_post(router, "/admin/role", {"url": g2.url, "role": "context"})
        assert r.status_code == 200, r.text
        assert (r.json()["state"], r.json()["pool"], r.json()["from"]) == (
            "done", "context", "generation")
        assert g2.url in pools(router)["context"] and g2.role == "context"
        served_before = g2.served["context_only"]
        deadline = time.monotonic() + 10
        while g2.served["context_only"] <= served_before:  # it serves its new side
            assert time.monotonic() < deadline, "the switched worker got no context request"
            time.sleep(0.02)
        # a second switch while one runs: 409
        g2.drain_s = 1.0
        with ThreadPoolExecutor(1) as ex:
            back = ex.submit(signed_post, router, "/admin/role",
                             {"url": g2.url, "role": "generation"})
            deadline = time.monotonic() + 10
            while httpx.get(router + "/cluster_info", timeout=10).json()[
                    "role_switches"]["running"] is None:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = signed_post(router, "/admin/role", {"url": stubs["g1"].url, "role": "context"})
            assert r.status_code == 409 and r.json()["error"]["code"] == \
                "role_switch_in_progress"
            assert back.result(30).status_code == 200
        g2.drain_s = 0.2
        time.sleep(0.3)
    finally:
        load.finish()
    assert pools(router) == {"context": sorted([stubs["c1"].url, stubs["c2"].url]),
                             "generation": sorted([stubs["g1"].url, g2.url])}
    assert load.errors == [] and sum(load.statuses.values()) > 20, load.statuses
    for s in stubs.values():
        assert s.wrong_type == [], s.wrong_type
    # Taken out of rotation before /admin/role: no request reaches it while it switches
    # (0 in practice; a request picked just before the switch started could still land
    # there, refused with 503 role_switching and retried; a router that left it in rotation
    # until its next health check sent it 3 or more here).
    assert g2.refused_switching <= 1
    assert metric(router, "disagg_router_role_switches_total", outcome="done") == 2
    info = httpx.get(router + "/cluster_info", timeout=10).json()
    assert [s["to"] for s in info["role_switches"]["recent"]] == ["generation", "context"]
    assert info["planner"]["config"]["enabled"] is False


def test_admin_role_timeout_then_late_switch_is_adopted(stubs: dict[str, StubWorker],
                                                         router: str) -> None:
    """A switch past its deadline: 504, the worker goes where its /server_info says (still
    generation, draining: out of rotation, not failing); when it finishes late, the health
    check moves it to its new pool."""
    g1 = stubs["g1"]
    g1.drain_s = 1.5
    try:
        r = signed_post(router, "/admin/role", {"url": g1.url, "role": "context",
                                                "timeout_s": 0.3})
        assert r.status_code == 504 and r.json()["state"] == "timeout", r.text
        assert r.json()["pool"] == "generation"
        info = httpx.get(router + "/cluster_info", timeout=10).json()
        w = next(w for w in info["workers"]["generation"] if w["url"] == g1.url)
        assert not w["healthy"] and w["reason"].startswith("switching role to context")
        deadline = time.monotonic() + 10
        while g1.url not in pools(router)["context"]:
            assert time.monotonic() < deadline, pools(router)
            time.sleep(0.05)
    finally:
        g1.drain_s = 0.2
    assert metric(router, "disagg_router_role_switches_total", outcome="timeout") == 1
    r = signed_post(router, "/admin/role", {"url": g1.url, "role": "generation"})
    assert r.status_code == 200, r.text
    assert g1.url in pools(router)["generation"]


@pytest.mark.parametrize("router", [True], indirect=True, ids=["planner"])
def test_planner_moves_a_worker_to_the_slow_side(stubs: dict[str, StubWorker],
                                                  router: str) -> None:
    for name in ("c1", "c2", "g1", "g2"):
        stubs[name].ctx_delay_s = 0.3  # p90 TTFT ~300 ms > 150 ms: context is the bottleneck
    load = Load(router, threads=8)
    try:
        deadline = time.monotonic() + 25

        def decisions() -> list[dict[str, Any]]:
            info = httpx.get(router + "/cluster_info", timeout=10).json()
            return info["planner"]["decisions"]

        while not any(d["action"] == "flip" for d in decisions()):
            assert time.monotonic() < deadline, decisions()
            time.sleep(0.1)
        # then it holds: hysteresis, and at 3 + 1 the generation side is at min_per_role
        while not any(d["reason"].startswith("min_per_role") for d in decisions()):
            assert time.monotonic() < deadline, decisions()
            time.sleep(0.1)
    finally:
        load.finish()
    ds = decisions()
    flips = [d for d in ds if d["action"] == "flip"]
    assert len(flips) == 1 and (flips[0]["from_role"], flips[0]["to_role"]) == (
        "generation", "context"), ds
    assert "context is the bottleneck" in flips[0]["reason"]
    assert any(d["reason"].startswith("hysteresis") for d in ds), ds
    p = pools(router)
    assert len(p["context"]) == 3 and len(p["generation"]) == 1
    assert metric(router, "disagg_router_planner_decisions_total", action="flip",
                  from_role="generation", to_role="context") == 1
    assert metric(router, "disagg_router_planner_decisions_total", action="hold") >= 2
    assert metric(router, "disagg_router_pool_workers", role="context") == 3
    assert load.errors == [], load.errors[:3]
    for s in stubs.values():
        assert s.wrong_type == []


def test_registered_worker_switch_reregisters() -> None:
    """Dynamic membership: the switched worker re-registers with its new role at once (racing
    the router's own poll); it ends up in the new pool once, healthy, and keeps heartbeating
    there."""
    lt = LoopThread()
    workers = [StubWorker(role) for role in ("context", "generation", "generation")]
    runners, beats = [], []
    cfg = {**DYNAMIC, "disagg_cluster": {**DYNAMIC["disagg_cluster"],
                                         "inactive_timeout_sec": 5.0}}
    try:
        with running_router(cfg, lt) as url:
            for w in workers:
                runner, wurl = lt.serve(w.app())
                runners.append(runner)
                w.url, w.router_url = wurl.removeprefix("http://"), url
                beats.append(asyncio.run_coroutine_threadsafe(w.heartbeat(), lt.loop))
            deadline = time.monotonic() + 10
            while len(pools(url)["generation"]) < 2 or len(pools(url)["context"]) < 1:
                assert time.monotonic() < deadline, pools(url)
                time.sleep(0.05)
            procs.wait_healthy(url, 10)
            g2 = workers[2]
            r = signed_post(url, "/admin/role", {"url": g2.url, "role": "context"})
            assert r.status_code == 200 and r.json()["state"] == "done", r.text
            info = httpx.get(url + "/cluster_info", timeout=10).json()
            ctx = {w["url"]: w for w in info["workers"]["context"]}
            assert len(info["workers"]["context"]) == 2  # once, whoever moved it first
            assert set(ctx) == {workers[0].url, g2.url} and ctx[g2.url]["source"] == "registered"
            assert ctx[g2.url]["healthy"] and ctx[g2.url]["role"] == "context"
            assert [w["url"] for w in info["workers"]["generation"]] == [workers[1].url]
            r = httpx.post(url + "/v1/completions", timeout=10,
                           json={"model": "stub", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert all(w.wrong_type == [] for w in workers)
    finally:
        for b in beats:
            b.cancel()
        for runner in runners:
            lt.run(runner.cleanup())
        lt.close()


def test_generation_refusal_while_switching_keeps_the_lease() -> None:
    """A generation worker that refuses with 503 role_switching (a switch that began as the
    request was sent) read no KV: the next generation worker takes the same context answer,
    with no second prefill, and the refusing worker leaves rotation."""
    lt = LoopThread()
    ctx, g1, g2 = StubWorker("context"), StubWorker("generation"), StubWorker("generation")
    runners = []
    try:
        for w in (ctx, g1, g2):
            runner, wurl = lt.serve(w.app())
            runners.append(runner)
            w.url = wurl.removeprefix("http://")
        cfg = {"health_check_interval_sec": 30, "context_servers": {"urls": [ctx.url]},
               "generation_servers": {"urls": [g1.url, g2.url]}}
        with running_router(cfg, lt) as url:
            procs.wait_healthy(url, 10)
            g1.refuse_switching = True  # after the router's checks: its switch just began
            for _ in range(4):
                r = httpx.post(url + "/v1/completions", timeout=10,
                               json={"model": "stub", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
            assert g1.refused_switching == 1  # then out of rotation
            assert ctx.served["context_only"] == 4  # one prefill per request
            assert g2.served["generation_only"] == 4
    finally:
        for runner in runners:
            lt.run(runner.cleanup())
        lt.close()
