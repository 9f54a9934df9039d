"""Kill -9 of a context and of a generation worker under streaming load behind the router (issue
15, "fault and fuzz tests that stay in CI").

Two context and two generation workers (``disagg serve`` processes on ephemeral ports, TCP KV
transfer) behind a router in this process (round robin, health checks every
``HEALTH_INTERVAL_S``). Client threads stream greedy completions through the router the whole
time; one worker is killed with SIGKILL while requests are in flight on it, then restarted on
its port. Properties:

- no wrong token ever: a finished stream's text equals the aggregated reference's, a stream
  cut by the kill carries only a prefix of it, then an OpenAI error event and ``[DONE]``;
- a request the kill affected gets a clean error (5xx JSON error or that error event), never
  a dropped connection or a hang; requests started after the router noticed the death succeed;
- the router takes the dead worker out of rotation within its health interval (plus a margin
  for a busy 2-core machine), sends it nothing while it is dead, and takes the restarted one
  back (it serves again);
- afterwards every worker is healthy, with no KV block used and no context lease held.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from router_fixtures import LoopThread
from server_fixtures import (
    WorkerProc,
    serve_in_thread,
    signed,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

from disagg.contracts.cluster import parse_cluster_config
from disagg.router.app import ROUTER_KEY, build_router_app, start_router

pytestmark = pytest.mark.slow

NAME = "tiny"
TOKEN = "kill-cluster-secret"
HEALTH_INTERVAL_S = 0.5
# Detection may take the interval plus one check's round trip; a loaded 2-core machine delays
# the router's loop and the kill's effect by a little more.
DETECT_MARGIN_S = 2.0
LEASE_TTL_S = 5.0  # a lease whose reader died is freed at the latest then
START_TIMEOUT = 90.0
REQUEST_TIMEOUT_S = 60.0
MAX_TOKENS = 48
CLIENTS = 4
OPTIONS = dict(tokens_per_block=16, kv_cache_tokens=4096, max_model_len=256, max_num_tokens=256,
               max_batch_size=16)
FLAGS = ["--served-model-name", NAME, "--log-level", "warning", "--kv-transfer-backend", "TCP",
         "--tokens-per-block", "16", "--kv-cache-tokens", "4096", "--max-model-len", "256",
         "--max-num-tokens", "256", "--max-batch-size", "16"]
PROMPTS = ["The harbour was quiet when the boats came back in the evening, and nobody spoke.",
           "Memory is organised in small blocks of tokens, and every block holds sixteen.",
           "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18",
           "A fox ran across the field, stopped at the fence and looked back at the farm.",
           "Short one."]
C = "/v1/completions"


@dataclass
class Outcome:
    prompt: int
    t0: float
    t1: float = 0.0
    status: int = 0
    text: str = ""
    error: dict[str, Any] | None = None  # the OpenAI error (HTTP error or stream error event)
    done: bool = False  # the stream ended with [DONE]
    problem: str | None = None  # anything that is no clean answer or clean error


@dataclass
class Load:
    """CLIENTS threads streaming completions through the router until stopped."""

    router_url: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(CLIENTS):
            t = threading.Thread(target=self._client, args=(i,), daemon=True, name=f"load{i}")
            t.start()
            self.threads.append(t)

    def _client(self, i: int) -> None:
        with httpx.Client(base_url=self.router_url, timeout=REQUEST_TIMEOUT_S) as client:
            k = i
            while not self.stop.is_set():
                out = Outcome(k % len(PROMPTS), time.monotonic())
                self._one(client, out)
                out.t1 = time.monotonic()
                self.outcomes.append(out)
                k += 1

    @staticmethod
    def _one(client: httpx.Client, out: Outcome) -> None:
        body = {"model": NAME, "prompt": PROMPTS[out.prompt], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with client.stream("POST", C, json=body) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    out.error = json.loads(r.content)["error"]
                    return
                for line in r.iter_lines():
                    if not line:
                        continue
                    if not line.startswith("data: "):
                        out.problem = f"not an SSE data line: {line[:200]!r}"
                        return
                    if line == "data: [DONE]":
                        out.done = True
                        continue
                    if out.done:
                        out.problem = "data after [DONE]"
                        return
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.error = chunk["error"]
                        continue
                    if out.error is not None:
                        out.problem = "tokens after the error event"
                        return
                    out.text += chunk["choices"][0]["text"]
        except (httpx.HTTPError, ValueError, KeyError) as e:  # dropped, hung, not JSON
            out.problem = f"{type(e).__name__}: {e}"

    def successes_since(self, t: float) -> int:
        return sum(1 for o in list(self.outcomes) if o.t0 >= t and o.done and o.error is None)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(REQUEST_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in self.threads), "a load client hung"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: str
            ) -> Iterator[SimpleNamespace]:
    from disagg.engine import AsyncLLM
    from disagg.server.app import ServerSettings, build_app

    tmp = tmp_path_factory.mktemp("kill-logs")
    env = {"DISAGG_CLUSTER_TOKEN": TOKEN}
    ctx_flags = ["--role", "context", "--kv-lease-ttl", str(LEASE_TTL_S), *FLAGS]
    gen_flags = ["--role", "generation", *FLAGS]
    workers = {name: start_worker_proc(tmp, model_dir, name, flags, env)
               for name, flags in (("ctx0", ctx_flags), ("ctx1", ctx_flags),
                                   ("gen0", gen_flags), ("gen1", gen_flags))}
    ns = SimpleNamespace(model_dir=model_dir, tmp=tmp, env=env, workers=workers,
                         flags={"ctx": ctx_flags, "gen": gen_flags})
    loop = LoopThread()
    try:
        # The expected texts, from an aggregated worker in this process (while they start).
        engine = AsyncLLM.from_options(model_dir, **OPTIONS)
        app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME))
        with serve_in_thread(app) as ref_url:
            ns.reference = []
            for prompt in PROMPTS:
                r = httpx.post(ref_url + C, timeout=60, json={
                    "model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                ns.reference.append(r.json()["choices"][0]["text"])
        loop.run(engine.shutdown())
        wait_all_healthy(list(workers.values()), START_TIMEOUT)
        cfg = parse_cluster_config({
            "model": model_dir, "health_check_interval_sec": HEALTH_INTERVAL_S,
            "max_retries": 2,
            "context_servers": {"urls": [workers["ctx0"].addr, workers["ctx1"].addr],
                                "router": {"type": "round_robin"}},
            "generation_servers": {"urls": [workers["gen0"].addr, workers["gen1"].addr],
                                   "router": {"type": "round_robin"}}}, "kill")
        router_app = build_router_app(cfg, cluster_token=TOKEN)
        runner, port = loop.run(start_router(router_app, "127.0.0.1", 0))
        try:
            ns.router_url = f"http://127.0.0.1:{port}"
            ns.membership = router_app[ROUTER_KEY].membership
            wait_for(lambda: all(w.healthy for w in ns.membership.by_url.values()), 30, 0.05,
                     what="router: all four workers healthy")
            yield ns
        finally:
            loop.run(runner.cleanup())
    finally:
        stop_all(list(ns.workers.values()))
        loop.close()


def _metric(w: WorkerProc, name: str) -> float:
    text = httpx.get(w.url + "/metrics", timeout=10, **signed(TOKEN, "GET", "/metrics",
                                                                 to=w.url)).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _kill_and_restart(ns: SimpleNamespace, victim: str) -> None:
    w_old = ns.workers[victim]
    rw = ns.membership.by_url[w_old.addr]  # the router's view of it
    load = Load(ns.router_url)
    load.start()
    try:
        t_start = time.monotonic()
        wait_for(lambda: load.successes_since(t_start) >= 2 * CLIENTS, 60, 0.02,
                 what="load running")
        # SIGKILL while requests are in flight on it (a generation worker: mid-stream)
        wait_for(lambda: rw.active_requests > 0, 30, 0.001, what=f"a request on {victim}")
        w_old.proc.kill()
        t_kill = time.monotonic()
        assert w_old.proc.wait(10) == -9
        wait_for(lambda: not rw.healthy, HEALTH_INTERVAL_S + DETECT_MARGIN_S, 0.01,
                 what=f"the router takes {victim} out of rotation")
        t_out = time.monotonic()
        sent_while_dead = rw.requests_total
        # the survivors serve everything meanwhile
        wait_for(lambda: load.successes_since(t_out) >= 2 * CLIENTS, 60, 0.02,
                 what="requests served without the dead worker")
        assert rw.requests_total == sent_while_dead, f"traffic was sent to the dead {victim}"
        assert not rw.healthy
        # restarted on the same address: back in rotation, and it serves again
        w_new = start_worker_proc(ns.tmp, ns.model_dir, victim, ns.flags[victim[:3]], ns.env,
                                  port=w_old.port)
        ns.workers[victim] = w_new
        wait_all_healthy([w_new], START_TIMEOUT)
        wait_for(lambda: rw.healthy, HEALTH_INTERVAL_S + DETECT_MARGIN_S, 0.01,
                 what=f"the router takes the restarted {victim} back")
        t_back = time.monotonic()
        wait_for(lambda: rw.requests_total >= sent_while_dead + 2 * CLIENTS, 60, 0.02,
                 what=f"the restarted {victim} serves")
        wait_for(lambda: load.successes_since(t_back) >= 2 * CLIENTS, 60, 0.02,
                 what="requests served after the restart")
    finally:
        load.close()

    problems = [o for o in load.outcomes if o.problem is not None]
    assert not problems, problems[:5]
    failed = [o for o in load.outcomes if o.error is not None or o.status != 200 or not o.done]
    for o in load.outcomes:
        ref = ns.reference[o.prompt]
        if o in failed:
            # a clean error: OpenAI error JSON (5xx from the router, or the stream's error
            # event followed by [DONE]), and whatever text came before it is the reference's
            assert o.error is not None and isinstance(o.error.get("message"), str), o
            assert o.status >= 500 or o.done, o
            assert ref.startswith(o.text), (o, ref)
            # only requests the kill could affect
            assert o.t0 < t_out and o.t1 > t_kill, (o, t_kill, t_out)
        else:
            assert o.text == ref, (o, ref)  # no wrong token
    print(f"{victim}: {len(load.outcomes)} requests, {len(failed)} clean errors, out of "
          f"rotation {t_out - t_kill:.2f} s after the kill, restarted one back "
          f"{t_back - t_out:.1f} s later")

    # afterwards: all healthy, no KV block used, no lease held
    for w in ns.workers.values():
        assert w.proc.poll() is None, f"{w.name} died:\n{w.log.read_text()[-3000:]}"
        wait_for(lambda w=w: w.blocks_used() == 0, LEASE_TTL_S + 10, 0.05,
                 what=f"{w.name}: no KV block used")
    for name in ("ctx0", "ctx1"):
        assert _metric(ns.workers[name], "disagg_kv_leases_active") == 0
    assert all(w.healthy for w in ns.membership.by_url.values())


def test_kill_9_context_worker_under_streaming_load(cluster: SimpleNamespace) -> None:
    _kill_and_restart(cluster, "ctx0")


def test_kill_9_generation_worker_under_streaming_load(cluster: SimpleNamespace) -> None:
    _kill_and_restart(cluster, "gen0")

