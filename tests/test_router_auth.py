"""Router-side cluster authentication, with scripted fake workers (no model):

- every call whose handling depends on it is signed over the exact method, path + query and
  body the router sends (the generation_only call, health and server-info checks, KV event
  polls, lease releases, /v1/models); the context_only call and requests sent whole are not;
- /cluster/register and /cluster/unregister need a signature; a router without a cluster token
  refuses to start when it would take registrations (unless --insecure-membership) or has
  context servers (it could not sign);
- the router's /metrics needs the API key (or a signature) when one is set, unless
  public_metrics.
"""

from __future__ import annotations

import json
import logging
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web
from router_fixtures import DYNAMIC, LoopThread, running_router
from router_fixtures import ROUTER_TOKEN as TOKEN
from server_fixtures import signed, wait_for

from disagg.cli import main as cli_main
from disagg.cluster_auth import AUTH_HEADER, HttpVerifier
from disagg.contracts.cluster import RouterConfigError, parse_cluster_config
from disagg.kv_cache.hashing import BLOCK_HASH_SCHEME
from disagg.router.app import build_router_app

C = "/v1/completions"


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_CLUSTER_TOKEN", raising=False)


# ---- the router signs its calls ---------------------------------------------------------------


class RecordingWorker:
    """A fake worker that records every call and whether its signature verifies.

    Context role: answers context_only calls with a lease. Generation role: answers
    generation_only and whole calls, or drops the connection when ``drop`` is set (the router
    then releases the lease on the context worker)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.verifier = HttpVerifier(TOKEN)
        self.calls: list[dict[str, Any]] = []
        self.drop = False
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.app = app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        header = request.headers.get(AUTH_HEADER)
        kind = None
        if request.path == C:
            kind = (json.loads(body).get("disaggregated_params") or {}).get("request_type")
        self.calls.append({"method": request.method, "target": request.raw_path,
                           "kind": kind, "header": header,
                           "valid": self.verifier.is_valid(header, request.method,
                                                           request.raw_path, body)})
        path = request.path
        if path == "/health":  # open; names the audience of signed calls (cluster_auth)
            return web.json_response({"status": "ok", "member_id": self.verifier.member_id})
        if path == "/server_info":
            return web.json_response({"role": self.role, "tokens_per_block": 16,
                                      "worker_id": self.role, "model_dir": None})
        if path == "/kv_events":
            return web.json_response({"worker_id": self.role, "tokens_per_block": 16,
                                      "block_hash_scheme": BLOCK_HASH_SCHEME, "next_seq": 0,
                                      "events": [], "snapshot": None})
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "tiny"}]})
        if path == "/kv_leases/release":
            return web.json_response({"ctx_request_id": "L", "released": True})
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        answer: dict[str, Any] = {"id": "x", "object": "text_completion", "created": 0,
                                  "model": "tiny", "usage": usage, "choices": [
                                      {"index": 0, "text": " a", "finish_reason": "length",
                                       "logprobs": None}]}
        if kind == "context_only":
            answer["prompt_token_ids"] = [1, 2, 3]
            answer["disaggregated_params"] = {"ctx_request_id": "L", "first_gen_tokens": [7]}
        elif self.drop:
            assert request.transport is not None
            request.transport.abort()
        return web.json_response(answer)


def _targets(w: RecordingWorker) -> set[str]:
    return {c["target"] for c in w.calls}


def test_router_signs_its_calls_to_workers(loop: LoopThread, tiny_llama: str) -> None:
    ctx, gen = RecordingWorker("context"), RecordingWorker("generation")
    runners = [loop.serve(w.app) for w in (ctx, gen)]
    try:
        # (max_migrations 0: a dropped generation call fails the request, and the lease is
        # released by a signed call, checked below)
        cfg = {"model": tiny_llama, "health_check_interval_sec": 0.2, "max_retries": 0,
               "max_migrations": 0,
               "context_servers": {"urls": [runners[0][1].removeprefix("http://")],
                                   "router": {"type": "kv_cache_aware",
                                              "kv_events_poll_interval_sec": 0.05}},
               "generation_servers": {"urls": [runners[1][1].removeprefix("http://")]}}
        with running_router(cfg, loop) as url:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
            wait_for(lambda: any(t.startswith("/kv_events?since=") for t in _targets(ctx)),
                     10, what="a KV events poll")
            body = {"model": "tiny", "prompt": "The harbour was quiet", "max_tokens": 4}
            r = httpx.post(url + C, json=body, timeout=30)
            assert r.status_code == 200, r.text
            r = httpx.post(url + C, json={**body, "n": 2}, timeout=30)  # sent whole
            assert r.status_code == 200, r.text
            assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
            gen.drop = True  # no generation worker answers: the lease is released
            r = httpx.post(url + C, json=body, timeout=30)
            assert r.status_code >= 500
            wait_for(lambda: "/kv_leases/release" in _targets(ctx), 10, what="lease release")
    finally:
        for runner, _ in runners:
            loop.run(runner.cleanup())
    kinds = {c["kind"] for w in (ctx, gen) for c in w.calls}
    assert {"context_only", "generation_only", None} <= kinds
    assert {"/health", "/server_info", C, "/kv_leases/release"} <= _targets(ctx)
    assert {"/health", "/server_info", C, "/v1/models"} <= _targets(gen)
    for w in (ctx, gen):
        for call in w.calls:
            if (call["target"] == C and call["kind"] in (None, "context_only")
                    or call["target"] == "/health"):
                # a whole (aggregated) request or a prefill: nothing depends on a signature;
                # /health is open (it is where the router learns the member id to sign for)
                assert call["header"] is None, call
            else:
                assert call["valid"], (w.role, call)


def test_router_with_context_servers_needs_a_cluster_token(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = {"context_servers": {"urls": ["127.0.0.1:9"]},
           "generation_servers": {"urls": ["127.0.0.1:10"]}}
    with pytest.raises(RouterConfigError, match="context_servers: no cluster token"):
        build_router_app(parse_cluster_config(cfg))
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["router", "-c", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "disagg router: error:" in err and "context_servers" in err
    assert "DISAGG_CLUSTER_TOKEN" in err


# ---- registration -------------------------------------------------------------------------------


def test_dynamic_membership_without_a_token_needs_insecure_membership(
        loop: LoopThread, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(RouterConfigError, match="disagg_cluster: no cluster token"):
        build_router_app(parse_cluster_config(DYNAMIC))
    path = tmp_path / "dynamic.yaml"
    path.write_text(yaml.safe_dump(DYNAMIC))
    assert cli_main(["router", "-c", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "disagg_cluster" in err and "--insecure-membership" in err
    # Explicitly insecure: open registration, with a warning.
    with caplog.at_level(logging.WARNING, logger="disagg.router"):
        with running_router(DYNAMIC, loop, cluster_token=None, insecure_membership=True) as url:
            assert "accepts anyone" in caplog.text
            r = httpx.post(url + "/cluster/register", timeout=10,
                           json={"role": "generation", "url": "127.0.0.1:10"})
            assert r.status_code == 200, r.text


def test_registration_needs_a_cluster_signature(loop: LoopThread) -> None:
    payload = {"role": "generation", "url": "127.0.0.1:10"}
    with running_router(DYNAMIC, loop) as url:
        for path in ("/cluster/register", "/cluster/unregister"):
            r = httpx.post(url + path, json=payload, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert path in r.json()["error"]["message"]
            # the token itself in a header is no proof
            r = httpx.post(url + path, json=payload, timeout=10,
                           headers={"X-Disagg-Cluster-Token": TOKEN})
            assert r.status_code == 401
            r = httpx.post(url + path, timeout=10,
                           **signed("another-cluster", "POST", path, payload, to=url))
            assert r.status_code == 401
            kw = signed(TOKEN, "POST", path, payload, to=url)
            r = httpx.post(url + path, timeout=10, headers=kw["headers"],
                           content=json.dumps({**payload, "url": "10.0.0.1:1"}).encode())
            assert r.status_code == 401  # the signature covers the body
        r = httpx.post(url + "/cluster/register", timeout=10,
                       **signed(TOKEN, "POST", "/cluster/register", payload, to=url))
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/cluster/unregister", timeout=10,
                       **signed(TOKEN, "POST", "/cluster/unregister", {"url": payload["url"]},
                                to=url))
        assert r.status_code == 200 and r.json()["status"] == "unregistered"


# ---- /metrics -----------------------------------------------------------------------------------


def test_router_metrics_need_the_api_key_or_a_signature_unless_public(
        loop: LoopThread) -> None:
    cfg = {"api_key": "k", "generation_servers": {"urls": ["127.0.0.1:9"]}}
    with running_router(cfg, loop) as url:
        r = httpx.get(url + "/metrics", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/metrics", timeout=10,
                         headers={"Authorization": "Bearer k"}).status_code == 200
        r = httpx.get(url + "/metrics", timeout=10, **signed(TOKEN, "GET", "/metrics", to=url))
        assert r.status_code == 200 and "disagg_router_" in r.text
        assert httpx.get(url + "/health", timeout=10).status_code == 503  # open (no worker)
    with running_router({**cfg, "public_metrics": True}, loop) as url:
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    with running_router({"generation_servers": cfg["generation_servers"]}, loop) as url:
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200  # no API key


def test_router_cli_flags_public_metrics_and_insecure_membership(tmp_path: Path) -> None:
    """``--insecure-membership`` lets a tokenless router with disagg_cluster start (anyone may
    register); ``--public-metrics`` opens /metrics although api_key is set."""
    path = tmp_path / "keyed.yaml"
    path.write_text(yaml.safe_dump({"api_key": "k", **DYNAMIC}))
    cmd = [sys.executable, "-m", "disagg.cli", "router", "-c", str(path), "--host", "127.0.0.1",
           "--port", "0", "--log-level", "warning", "--public-metrics", "--insecure-membership"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the router printed nothing in 60 s"
        line = proc.stdout.readline()
        assert line.startswith("disagg router listening on "), line
        url = line.split()[-1]
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        assert httpx.get(url + "/cluster_info", timeout=10).status_code == 401  # key still
        r = httpx.post(url + "/cluster/register", timeout=10,
                       json={"role": "generation", "url": "127.0.0.1:10"})
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        assert "accepts anyone" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
