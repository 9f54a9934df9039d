"""``disagg serve`` with tensor / pipeline parallel ranks, as real processes: outputs equal
tp=1 through the OpenAI API; a killed rank makes the worker unhealthy and exit non-zero; SIGTERM
exits 0; a killed rank 0 takes its ranks with it. No process survives any of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import openai
import pytest
from parallel_fixtures import OPTS, PROMPTS, pid_alive, write_models
from server_fixtures import free_port, health_ok, wait_for

from disagg import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
SERVE_FLAGS = ["--device", "cpu", "--tokens-per-block", str(OPTS["tokens_per_block"]),
               "--kv-cache-tokens", str(OPTS["kv_cache_tokens"]),
               "--max-num-tokens", str(OPTS["max_num_tokens"]),
               "--max-batch-size", str(OPTS["max_batch_size"]), "--served-model-name", "tiny",
               "--drain-timeout", "5"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_models(str(tmp_path_factory.mktemp("parallel_server")))


@pytest.fixture(scope="module")
def reference(models: dict[str, str]) -> dict[str, list[str]]:
    """Greedy texts of tp=1, pp=1 (offline, in this process)."""
    ref = {}
    for name, path in models.items():
        with LLM(path, **OPTS) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True))
        ref[name] = [o.outputs[0].text for o in outs]
    return ref


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: IO[str]

    def info(self) -> dict:
        return httpx.get(self.url + "/server_info", timeout=10).json()

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for s in started:  # a failed test must not leave a server (or its ranks) behind
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(30)
        s.log.close()


def start(servers: list[Server], tmp_path: Path, model: str, *flags: str) -> Server:
    port = free_port()
    log = open(tmp_path / f"server{len(servers)}.log", "w+")  # a file: never blocks the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg.cli", "serve", model, "--port", str(port), *SERVE_FLAGS,
         *flags], stdout=log, stderr=subprocess.STDOUT)
    srv = Server(proc, f"http://127.0.0.1:{port}", log)
    servers.append(srv)
    wait_for(lambda: proc.poll() is not None or health_ok(srv.url), 120, 0.1, "server ready")
    assert proc.poll() is None, f"server exited early:\n{srv.log_text()}"
    return srv


def completions(srv: Server) -> list[str]:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    texts = [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
             .choices[0].text for p in PROMPTS[:-1]]
    # and one streamed
    stream = client.completions.create(model="tiny", prompt=PROMPTS[-1], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    texts.append("".join(c.choices[0].text for c in stream if c.choices))
    return texts


def test_tp2_matches_and_a_killed_rank_ends_the_worker(models, reference, servers,
                                                      tmp_path: Path) -> None:
    # One kv head, two TP ranks: the head is replicated.
    srv = start(servers, tmp_path, models["mqa"], "--tensor-parallel-size", "2")
    par = srv.info()["parallel"]
    assert (par["tensor_parallel_size"], par["pipeline_parallel_size"]) == (2, 1)
    assert [lay["kv_head_range"] for lay in par["layouts"]] == [[0, 1], [0, 1]]
    assert [lay["head_range"] for lay in par["layouts"]] == [[0, 2], [2, 4]]
    pids = par["rank_pids"]
    assert len(pids) == 2 and pids[0] == srv.proc.pid
    assert f"pid {pids[1]}" in srv.log_text()  # the rank's pid is logged too

    assert completions(srv) == reference["mqa"]

    os.kill(pids[1], signal.SIGKILL)

    def unhealthy() -> bool:
        try:
            return httpx.get(srv.url + "/health", timeout=2).status_code == 503
        except httpx.HTTPError:
            return srv.proc.poll() is not None  # already gone: also a failed health check
    wait_for(unhealthy, 20, 0.02, "/health to fail")
    assert srv.proc.wait(30) != 0
    assert not any(pid_alive(p) for p in pids)
    assert "exited with code -9" in srv.log_text()


def test_tp2_pp2_from_yaml_and_sigterm_exits_zero(models, reference, servers,
                                                 tmp_path: Path) -> None:
    cfg = tmp_path / "worker.yaml"
    cfg.write_text("tensor_parallel_size: 2\npipeline_parallel_size: 2\npp_partition: [1, 2]\n")
    srv = start(servers, tmp_path, models["llama3"], "--config", str(cfg))
    par = srv.info()["parallel"]
    assert par["world_size"] == 4
    assert [lay["layer_range"] for lay in par["layouts"]] == [[0, 1], [0, 1], [1, 3], [1, 3]]
    pids = par["rank_pids"]
    assert len(set(pids)) == 4

    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == reference["llama3"]

    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, what="ranks gone")


def test_pp2_ranks_exit_when_rank0_is_killed(models, reference, servers,
                                            tmp_path: Path) -> None:
    srv = start(servers, tmp_path, models["qwen2"], "--pipeline-parallel-size", "2")
    pids = srv.info()["parallel"]["rank_pids"]
    assert completions(srv) == reference["qwen2"]
    srv.proc.kill()
    srv.proc.wait(30)
    wait_for(lambda: not any(pid_alive(p) for p in pids[1:]), 15, what="orphaned ranks to exit")
