"""The 2 ctx (tp 2) + 1 gen (pp 2) example config through ``disagg launch`` and the router,
driven by the official ``openai`` client: greedy outputs equal an aggregated tp1 pp1 worker's,
streaming and not, completions and chat; no KV block stays in use on any worker."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import yaml
from server_fixtures import device_for_ranks, serve_in_thread, wait_for
from test_launch import READY_RE, Launcher, _assert_all_gone, _config

pytestmark = pytest.mark.slow

WORKER_KEY = "workers-key"  # /server_info answers it (the launch's cluster token is random)
PROMPTS = ["The harbour was quiet", "Memory is organised in small blocks of tokens, and every "
           "block holds sixteen of them."]
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: str
            ) -> Iterator[SimpleNamespace]:
    from disagg.engine import AsyncLLM
    from disagg.server.app import ServerSettings, build_app

    tmp = tmp_path_factory.mktemp("router-par")
    model = model_dir
    path, _ = _config(tmp, "disagg_2ctx_tp2_1gen_pp2.yaml")
    data = yaml.safe_load(Path(path).read_text())
    data["kv_cache_tokens"] = 4096  # the example's 8192 times six ranks is more than needed
    data["device"] = device = device_for_ranks(6)  # a GPU per rank, else all on the CPU
    for section in ("context_servers", "generation_servers"):
        data[section]["api_key"] = WORKER_KEY  # the router sends it; clients send none
    Path(path).write_text(yaml.safe_dump(data))
    launcher = Launcher(["-c", path, "--model", model], tmp)
    engine = AsyncLLM.from_options(model, kv_cache_tokens=4096, device=device,
                                   tokens_per_block=data.get("tokens_per_block", 32))
    app = build_app(engine, ServerSettings(model_dir=model, served_model_name=model))
    try:
        endpoint = launcher.wait_line(READY_RE).group(1)
        with serve_in_thread(app) as ref_url:
            yield SimpleNamespace(
                launcher=launcher, endpoint=endpoint, model=model,
                client=openai.OpenAI(base_url=endpoint + "/v1", api_key="none", max_retries=0,
                                     timeout=120),
                ref=openai.OpenAI(base_url=ref_url + "/v1", api_key="none", max_retries=0,
                                  timeout=120),
                workers=[u for s in ("context_servers", "generation_servers")
                         for u in data[s]["urls"]])
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.wait(90) == 0, launcher.stdout + launcher.stderr
        _assert_all_gone(launcher, 4)  # 3 workers (their own ranks reaped by them) + router
    finally:
        launcher.kill()


def _completion(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> str:
    kw = dict(model=model, prompt=prompt, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    return client.completions.create(**kw).choices[0].text


def _chat(client: openai.OpenAI, model: str, stream: bool) -> str:
    kw = dict(model=model, messages=CHAT, max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    return client.chat.completions.create(**kw).choices[0].message.content or ""


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_outputs_equal_an_aggregated_worker(cluster: SimpleNamespace, stream: bool) -> None:
    for prompt in PROMPTS:
        got = _completion(cluster.client, cluster.model, prompt, stream)
        assert got == _completion(cluster.ref, cluster.model, prompt, stream), prompt
    assert _chat(cluster.client, cluster.model, stream) == _chat(cluster.ref, cluster.model,
                                                                 stream)


def test_every_request_went_context_then_generation_and_freed_its_blocks(
        cluster: SimpleNamespace) -> None:
    usage = cluster.client.completions.create(
        model=cluster.model, prompt=PROMPTS[1], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True}).usage
    assert usage is not None and usage.completion_tokens == 6
    metrics = httpx.get(cluster.endpoint + "/metrics", timeout=10).text
    # Every request was prefilled on a context worker (both used: load balancing, ties
    # round robin) and decoded on the generation worker; none failed.
    decisions = {(m["role"], m["worker"]): float(m["n"]) for m in re.finditer(
        r'disagg_router_routing_decisions_total\{(?=[^}]*role="(?P<role>\w+)")'
        r'(?=[^}]*worker="(?P<worker>[^"]+)")[^}]*\} (?P<n>[0-9.e+]+)', metrics)}
    ctx = [n for (role, _), n in decisions.items() if role == "context"]
    assert len(ctx) == 2 and min(ctx) >= 1, metrics
    assert sum(n for (role, _), n in decisions.items() if role == "generation") == sum(ctx)
    assert not re.search(r'disagg_router_requests_total\{[^}]*outcome="(?!success)[^"]*"'
                         r'[^}]*\} [1-9]', metrics), metrics

    def server_info(url: str) -> dict:
        return httpx.get(f"http://{url}/server_info", timeout=10,
                         headers={"Authorization": f"Bearer {WORKER_KEY}"}).json()

    def idle() -> bool:
        return all(server_info(u)["kv_blocks_used"] == 0 for u in cluster.workers)

    wait_for(idle, 20, 0.1, what="no KV block in use on any worker")
    info = server_info(cluster.workers[0])
    assert info["parallel"]["tensor_parallel_size"] == 2 and info["role"] == "context"
    gen = server_info(cluster.workers[-1])
    assert gen["parallel"]["pipeline_parallel_size"] == 2 and gen["role"] == "generation"
