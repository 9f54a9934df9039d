"""A disaggregated cluster spread over "hosts": network namespaces on a private bridge
(tests/netns.py), one each for the router, two context workers, a generation worker and a
generation worker that joins late; every process runs inside its namespace bound to that
host's address (the late one binds 0.0.0.0 and must find its address itself), the workers join
through ``--router-url`` and KV moves between namespaces over UCX or TCP (one cluster per
backend, shared by the tests of this module).

Checks, per backend: greedy outputs through the router equal an aggregated worker's, and every
advertised address is the worker's own host address (never a wildcard or loopback); a worker
that joins late registers with the address of its route to the router and gets traffic;
pulling a generation host's cable mid-stream fails that request with an error within the
router's upstream timeout, and later requests go to the other generation host. The KV
bandwidth across the veth link vs loopback is ``bench/multihost.py``'s (run here small; its
committed report is bench/results/multihost.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from netns import Host, NetLab, require_netns
from router_fixtures import metric
from server_fixtures import reference_server, signed, wait_for

from disagg import procs
from disagg.addresses import is_loopback, is_wildcard
from disagg.transfer.ucx import ucx_available

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"
TOKEN = "multihost-test-secret"
PORT = 8000  # every host has its own network stack: the same port everywhere
UPSTREAM_TIMEOUT_S = 4.0  # the router's wait for a worker's next byte: bounds a cut request
START_TIMEOUT_S = 120.0
WORKER_FLAGS = ["--served-model-name", NAME, "--log-level", "info", "--kv-cache-tokens", "4096",
                "--max-model-len", "512", "--max-num-tokens", "256", "--max-batch-size", "32",
                "--tokens-per-block", "16", "--kv-lease-ttl", "5", "--drain-timeout", "2"]
PROMPTS = ["The harbour was quiet", "Memory is organised in small blocks of tokens, and every "
           "block holds sixteen of them.", "Numbers: 1, 2, 3"]


@dataclass
class Cluster:
    backend: str
    model_dir: str
    lab: NetLab
    logs: Path
    router: Host
    router_url: str
    workers: dict[str, Host] = field(default_factory=dict)  # name -> host
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def url(self, name: str) -> str:
        return self.workers[name].url(PORT)

    def start_worker(self, name: str, role: str, *, bind: str | None = None) -> None:
        host = self.lab.add_host(name)
        self.workers[name] = host
        cmd = [sys.executable, "-m", "disagg.cli", "serve", self.model_dir, "--host",
               bind or host.addr, "--port", str(PORT), "--role", role, "--router-url",
               self.router_url, "--kv-transfer-backend", self.backend, *WORKER_FLAGS]
        self.procs[name] = self.lab.spawn(host, cmd, self.logs / f"{name}.log", env=_env())

    def wait_healthy(self, *names: str) -> None:
        for name in names:
            try:
                procs.wait_healthy(self.url(name), START_TIMEOUT_S, proc=self.procs[name],
                                   what=name)
            except procs.NotHealthy as e:
                raise RuntimeError(f"{e}:\n{procs.log_tail(self.logs / f'{name}.log')}"
                                   ) from None

    def cluster_info(self) -> dict[str, Any]:
        return httpx.get(self.router_url + "/cluster_info", timeout=10).json()

    def pool_urls(self, pool: str, healthy: bool = True) -> list[str]:
        return [w["url"] for w in self.cluster_info()["workers"].get(pool, [])
                if w["healthy"] or not healthy]

    def server_info(self, name: str) -> dict[str, Any]:
        r = httpx.get(self.url(name) + "/server_info", timeout=10,
                      **signed(TOKEN, "GET", "/server_info", to=self.url(name)))
        r.raise_for_status()
        return r.json()


def _env() -> dict[str, str]:
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _router_yaml(path: Path, router: Host) -> None:
    path.write_text(yaml.safe_dump({
        "hostname": router.addr, "port": PORT, "health_check_interval_sec": 0.3,
        "upstream_timeout_sec": UPSTREAM_TIMEOUT_S,
        "generation_servers": {"router": {"type": "round_robin"}},
        "disagg_cluster": {"minimal_instances": {"context_servers": 2, "generation_servers": 1},
                           "heartbeat_interval_sec": 0.3, "inactive_timeout_sec": 2.0}}))


@pytest.fixture(scope="module", params=["TCP", "UCX"])
def cluster(request: pytest.FixtureRequest, model_dir: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    backend = request.param
    require_netns()
    if backend == "UCX" and not ucx_available()[0]:
        pytest.skip(f"needs ucxx: {ucx_available()[1]}")
    logs = tmp_path_factory.mktemp(f"multihost-{backend.lower()}")
    with NetLab() as lab:
        router = lab.add_host("router")
        c = Cluster(backend, model_dir, lab, logs, router, router.url(PORT))
        _router_yaml(logs / "cluster.yaml", router)
        c.procs["router"] = lab.spawn(router, [
            sys.executable, "-m", "disagg.cli", "router", "-c", str(logs / "cluster.yaml")],
            logs / "router.log", env=_env())
        for name, role in (("ctx0", "context"), ("ctx1", "context"), ("gen0", "generation")):
            c.start_worker(name, role)
        c.wait_healthy("ctx0", "ctx1", "gen0")
        try:
            wait_for(lambda: procs.http_status(c.router_url + "/health") == 200, 60,
                     what="router ready: 2 context + 1 generation workers registered")
        except AssertionError:
            raise AssertionError(procs.log_tail(logs / "router.log")) from None
        yield c


@pytest.fixture(scope="module")
def reference(model_dir: str) -> Iterator[str]:
    """An aggregated worker in this process: the expected outputs."""
    with reference_server(model_dir, NAME) as url:
        yield url


def _complete(url: str, prompt: str, max_tokens: int = 12) -> str:
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_outputs_through_the_router_match_aggregated(cluster: Cluster, reference: str) -> None:
    for prompt in PROMPTS:
        assert _complete(cluster.router_url, prompt) == _complete(reference, prompt)
    # Registered under their own host addresses; KV addresses likewise.
    assert sorted(cluster.pool_urls("context")) == sorted(
        f"{cluster.workers[n].addr}:{PORT}" for n in ("ctx0", "ctx1"))
    for name in ("ctx0", "ctx1"):
        kv = cluster.server_info(name)["kv_transfer"]
        (address,) = kv["addresses"]
        host = address.rpartition(":")[0]
        assert host == cluster.workers[name].addr
        assert not is_wildcard(host) and not is_loopback(host)
        if cluster.backend == "UCX":
            # auto: a non-loopback KV address means peers on other hosts
            assert kv["ucx"]["profile"] == "cross_host" and "tcp/eth0" in kv["ucx"]["transports"]
        else:
            assert kv["ucx"] is None
    gen = cluster.server_info("gen0")["kv_transfer"]
    if cluster.backend == "UCX":  # its UCX context started with its first pull
        assert gen["ucx"]["profile"] == "cross_host" and "tcp/eth0" in gen["ucx"]["transports"]
    assert metric(cluster.url("ctx0"), "disagg_requests_finished_total") + metric(
        cluster.url("ctx1"), "disagg_requests_finished_total") >= len(PROMPTS)


def test_late_worker_finds_its_address_and_gets_traffic(cluster: Cluster, reference: str
                                                       ) -> None:
    # Bound to 0.0.0.0 with no --advertise-host: it must register its eth0 address.
    cluster.start_worker("late", "generation", bind="0.0.0.0")
    late = cluster.workers["late"]
    cluster.wait_healthy("late")
    wait_for(lambda: f"{late.addr}:{PORT}" in cluster.pool_urls("generation"), 30,
             what="the late worker registered with its own address")
    assert "route to the router" in (cluster.logs / "late.log").read_text()
    expected = _complete(reference, PROMPTS[0])
    for _ in range(4):  # round robin over two generation workers
        assert _complete(cluster.router_url, PROMPTS[0]) == expected
    assert metric(cluster.url("late"), "disagg_requests_finished_total") >= 1


def _serving(cluster: Cluster, names: list[str], before: dict[str, float]) -> str | None:
    for name in names:
        if metric(cluster.url(name), "disagg_generation_tokens_total") > before[name]:
            return name
    return None


def test_cut_link_moves_the_request_and_the_router_routes_around(
        cluster: Cluster, reference: str) -> None:
    """The link of the host decoding a stream is cut: after the router's upstream timeout the
    stream goes on on the other generation host (migration: the tokens already streamed are
    recomputed there), and the client's text is an uninterrupted run's."""
    gens = ["gen0", "late"]
    wait_for(lambda: len(cluster.pool_urls("generation")) == 2, 30, what="two generation hosts")
    before = {n: metric(cluster.url(n), "disagg_generation_tokens_total") for n in gens}
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events: list[dict[str, Any]] = []
    t_cut = None
    victim = None
    with httpx.stream("POST", cluster.router_url + "/v1/completions", json=body,
                      timeout=httpx.Timeout(60, read=UPSTREAM_TIMEOUT_S + 20)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if victim is None and len(events) >= 3:
                victim = _serving(cluster, gens, before)
                assert victim is not None, "no generation worker is decoding the request"
                cluster.lab.cut(cluster.workers[victim])
                t_cut = time.monotonic()
    assert victim is not None and t_cut is not None, "the stream ended before the cut"
    elapsed = time.monotonic() - t_cut
    assert not any("error" in ev for ev in events), [ev for ev in events if "error" in ev]
    text = "".join(ch.get("text", "") for ev in events for ch in ev.get("choices", []))
    assert text == _complete(reference, PROMPTS[1], 480)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    print(f"{cluster.backend}: cut {victim} after 3 chunks; the stream went on elsewhere and "
          f"ended {elapsed:.2f} s later")
    # The router drops the silent host and sends later requests to the other one.
    victim_url = f"{cluster.workers[victim].addr}:{PORT}"
    wait_for(lambda: victim_url not in cluster.pool_urls("generation"), 30,
             what=f"{victim} taken out of rotation")
    other = next(n for n in gens if n != victim)
    served = metric(cluster.url(other), "disagg_requests_finished_total")
    for prompt in PROMPTS:
        assert _complete(cluster.router_url, prompt) == _complete(reference, prompt)
    assert metric(cluster.url(other), "disagg_requests_finished_total") >= served + len(PROMPTS)
    cluster.lab.restore(cluster.workers[victim])  # a clean drain at teardown


def test_bandwidth_bench_across_veth_and_loopback(tmp_path: Path) -> None:
    """``python -m bench.multihost`` (which wrote bench/results/multihost.md) measures both
    paths, small."""
    require_netns()
    backends = "tcp"  # UCX across namespaces: the cluster tests; its bench row costs ~8 s more
    out = tmp_path / "multihost.md"
    cp = subprocess.run([sys.executable, "-m", "bench.multihost", "--backends", backends,
                         "--ucx-profiles", "cross_host", "--mib", "4", "--reps", "1",
                         "--rounds", "1", "--out", str(out), "--logs", str(tmp_path)],
                        capture_output=True, text=True, timeout=240, env=_env(), cwd=ROOT)
    assert cp.returncode == 0, cp.stderr[-3000:]
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| TCP") or
            line.startswith("| UCX")]
    assert len(rows) == 2 * len(backends.split(","))  # veth + loopback per backend
    assert all("| yes |" in row for row in rows)  # the pulled bytes are the server's
    assert "TCP veth / loopback" in text and "is not" in text and "kernel:" in text
    if "ucx" in backends:
        assert "UCX veth / loopback (cross_host vs cross_host)" in text
