"""The planner on a real cluster (issue 21): 4 tiny-model workers starting 2 context + 2
generation behind a ``disagg router --planner``, a workload that shifts from long prompts /
short answers to short prompts / long answers. The planner must flip a generation worker to
context in the first phase and a context worker to generation in the second; no request fails
and greedy outputs stay those of an aggregated worker.

How the phases load each side (the tiny model computes little, so the engine's limits make the
work): context workers prefill at most ``--max-num-tokens 16`` tokens a step, so a 480-token
prompt takes 30 steps and queues behind the others (context calls slow, phase 1); generation
workers decode one request at a time (``--max-batch-size 1``), so 128-token answers queue
(generation calls slow per token, phase 2). Prompts are unique (no prefix-cache hits). The two
context workers start on one core and the two generation workers on the other (where the
machine has two): devices of their own, as on GPUs, so that one side's busy steps do not slow
the other's (a flipped worker keeps its core).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml
from server_fixtures import reference_server, start_worker_proc, stop_all, wait_all_healthy

from disagg import procs

TOKEN = "planner-cluster-secret"
NAME = "tiny"
WORKER_ARGS = ["--served-model-name", NAME, "--max-model-len", "512", "--max-num-tokens", "16",
               "--max-batch-size", "1", "--kv-cache-tokens", "8192", "--kv-transfer-backend",
               "TCP", "--log-level", "warning"]
# SLOs between the two phases' latencies: context call p90 ~1-2 s in phase 1, tens of ms in
# phase 2; generation wait for first bytes p90 (pull + a decode slot): 12 clients queueing on
# one generation worker in phase 2, seconds; TPOT (3-30 ms here) stays under its SLO.
PLANNER = {"enabled": True, "ttft_slo_ms": 150, "tpot_slo_ms": 60, "interval_s": 0.5,
           "window_s": 4, "min_samples": 8, "hysteresis_s": 2, "min_per_role": 1,
           "headroom": 0.2, "switch_timeout_s": 60}
PHASES = {"long prompts": (480, 8), "long answers": (4, 128)}  # (prompt tokens, max_tokens)


@pytest.fixture(scope="module")
def cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("planner-cluster")
    env = {"DISAGG_CLUSTER_TOKEN": TOKEN}
    roles = ["context", "context", "generation", "generation"]
    cores = sorted(os.sched_getaffinity(0))
    workers = [start_worker_proc(tmp, model_dir, f"w{i}", ["--role", r, *WORKER_ARGS], env,
                                 cpus={cores[i // 2]} if len(cores) >= 2 else None)
               for i, r in enumerate(roles)]
    router = None
    try:
        wait_all_healthy(workers, 120)
        port = procs.free_port()
        cfg = {"hostname": "127.0.0.1", "port": port, "health_check_interval_sec": 0.5,
               "context_servers": {"urls": [w.addr for w in workers[:2]]},
               "generation_servers": {"urls": [w.addr for w in workers[2:]]},
               "planner": PLANNER}
        (tmp / "cluster.yaml").write_text(yaml.safe_dump(cfg))
        router = procs.spawn([sys.executable, "-m", "disagg.cli", "router", "-c",
                              str(tmp / "cluster.yaml")], tmp / "router.log",
                             env={**os.environ, **env}, new_session=False)
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url, 60, proc=router, what="the router")
        yield {"url": url, "workers": workers, "log": tmp / "router.log"}
    finally:
        if router is not None:
            procs.stop(router, grace_s=10)
        stop_all(workers)


class Phase:
    """``clients`` threads sending unique greedy completions of one shape until stopped;
    every (prompt, status, text) kept."""

    def __init__(self, url: str, prompt_len: int, max_tokens: int, clients: int,
                 seed: int) -> None:
        self.url, self.prompt_len, self.max_tokens = url, prompt_len, max_tokens
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.results: list[tuple[list[int], int, str]] = []
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(clients)
        self.futures = [self.pool.submit(self._client) for _ in range(clients)]

    def _prompt(self) -> list[int]:
        with self.lock:  # token ids 3..511: no special tokens of the tiny vocabulary
            return [self.rng.randrange(3, 512) for _ in range(self.prompt_len)]

    def _client(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                p = self._prompt()
                status, text = stream_completion(c, self.url, p, self.max_tokens)
                with self.lock:
                    self.results.append((p, status, text))

    def finish(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result(180)
        self.pool.shutdown()


def stream_completion(c: httpx.Client, url: str, prompt: list[int], max_tokens: int
                      ) -> tuple[int, str]:
    """A streamed greedy completion (the planner's TPOT samples come from streams): its HTTP
    status and text (the error body when not 200, or a stream that did not end in [DONE])."""
    with c.stream("POST", url + "/v1/completions", json={
            "model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        text, done = [], False
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text.append(json.loads(line[6:])["choices"][0]["text"])
        return (200, "".join(text)) if done else (599, "stream ended without [DONE]")


def planner_flips(url: str) -> list[dict[str, Any]]:
    info = httpx.get(url + "/cluster_info", timeout=10).json()
    return info["planner"]["flips"]


def run_until_flip(url: str, phase: str, clients: int, to_role: str, seed: int,
                   timeout: float = 120.0) -> tuple[Phase, dict[str, Any]]:
    """Load ``phase`` until the planner has flipped a worker to ``to_role`` and that switch
    ended; the phase's results and the flip."""
    before = len(planner_flips(url))
    load = Phase(url, *PHASES[phase], clients=clients, seed=seed)
    try:
        deadline = time.monotonic() + timeout
        while True:
            flips = planner_flips(url)  # newest first
            new = flips[: len(flips) - before]
            done = httpx.get(url + "/cluster_info", timeout=10).json()["role_switches"]
            if new and done["running"] is None:
                break
            assert time.monotonic() < deadline, (
                f"{phase}: no flip to {to_role} in {timeout:.0f} s; planner: "
                f"{httpx.get(url + '/cluster_info', timeout=10).json()['planner']}")
            time.sleep(0.25)  # polling the router, bounded by the deadline
    finally:
        load.finish()
    return load, new[0]


def pool_sizes(url: str) -> dict[str, int]:
    info = httpx.get(url + "/cluster_info", timeout=10).json()
    return {role: len(ws) for role, ws in info["workers"].items()}


def test_planner_follows_a_shifting_workload(cluster: dict[str, Any], model_dir: str) -> None:
    url = cluster["url"]
    assert pool_sizes(url) == {"context": 2, "generation": 2}
    p1, flip1 = run_until_flip(url, "long prompts", clients=6, to_role="context", seed=1)
    assert (flip1["from_role"], flip1["to_role"]) == ("generation", "context"), flip1
    assert pool_sizes(url) == {"context": 3, "generation": 1}
    p2, flip2 = run_until_flip(url, "long answers", clients=12, to_role="generation", seed=2)
    assert (flip2["from_role"], flip2["to_role"]) == ("context", "generation"), flip2
    assert pool_sizes(url) == {"context": 2, "generation": 2}
    results = p1.results + p2.results
    failed = [(s, t[:200]) for _, s, t in results if s != 200]
    assert not failed, failed
    # Greedy outputs: those of one aggregated worker, for a sample spread over both phases
    # (including requests served while a worker switched).
    sample = results[:: max(1, len(results) // 24)]
    with reference_server(model_dir, NAME) as ref, httpx.Client(timeout=120) as c:
        for prompt, _, text in sample:
            n = PHASES["long prompts"][1] if len(prompt) > 100 else PHASES["long answers"][1]
            r = c.post(ref + "/v1/completions", json={
                "model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'disagg_router_planner_decisions_total{action="flip"' in metrics
    print(f"phase 1: {len(p1.results)} requests, phase 2: {len(p2.results)}; "
          f"flips: {flip1['reason']!r}; {flip2['reason']!r}")
