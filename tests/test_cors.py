"""Opt-in CORS (``--allowed-origins`` / YAML ``allowed_origins``) on a worker and on the router.

A preflight from an allowed origin is answered (without the API key) on every path; an
actual request from one gets ``Access-Control-Allow-Origin`` whichever server carries it (the
router's own fast path for POSTs to the OpenAI paths, aiohttp for the rest, streamed answers
too); a disallowed origin gets no CORS header; without the option no answer has any.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from router_fixtures import LoopThread, running_router
from server_fixtures import free_port, serve_in_thread, start_worker_proc, stop_all, wait_for

from disagg.cli import build_parser
from disagg.contracts.cluster import RouterConfigError, parse_cluster_config
from disagg.contracts.options import check_origins
from disagg.engine import AsyncLLM
from disagg.router.cli import configured
from disagg.server.app import ServerSettings, build_app

KEY = "sk-cors"
NAME = "tiny"
ALLOWED = "http://app.example:3000"
OTHER = "http://evil.example"
OPTIONS = dict(tokens_per_block=16, kv_cache_tokens=2048, max_model_len=256, max_num_tokens=128,
               max_batch_size=8)
CHAT = "/v1/chat/completions"
BODY = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# Paths a browser app calls: the OpenAI ones, the Responses API (the lead's /v1/responses),
# the rest; a preflight is answered on each (CORS must not depend on the route).
PATHS = [CHAT, "/v1/completions", "/v1/responses", "/v1/models", "/v1/models/tiny",
         "/tokenize", "/health", "/no/such/path"]
ACAO = "access-control-allow-origin"


def preflight(url: str, path: str, origin: str) -> httpx.Response:
    return httpx.options(url + path, timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def cors_headers(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


def check_allowed(url: str, key: str | None, fast_path: bool) -> None:
    """Preflights and requests of ALLOWED get the headers, OTHER's none."""
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    for path in PATHS:
        r = preflight(url, path, ALLOWED)
        assert r.status_code == 204, (path, r.status_code, r.text)
        h = cors_headers(r)
        assert h[ACAO] == ALLOWED, (path, h)
        assert "POST" in h["access-control-allow-methods"]
        assert "authorization" in h["access-control-allow-headers"].lower()
        assert "origin" in r.headers.get("vary", "").lower()
        assert not cors_headers(preflight(url, path, OTHER)), path
    # actual requests: JSON, streamed, a refusal (401 without the key), a GET
    for extra in ({}, {"stream": True}):
        r = httpx.post(url + CHAT, json={**BODY, **extra}, timeout=60,
                       headers={**auth, "Origin": ALLOWED})
        assert r.status_code == 200, r.text
        assert r.headers[ACAO] == ALLOWED and "origin" in r.headers["vary"].lower()
        if fast_path:  # the router's own HTTP server answered (aiohttp names itself)
            assert "server" not in r.headers, r.headers
        r = httpx.post(url + CHAT, json={**BODY, **extra}, timeout=60,
                       headers={**auth, "Origin": OTHER})
        assert r.status_code == 200 and not cors_headers(r)
    if key:
        r = httpx.post(url + CHAT, json=BODY, timeout=30, headers={"Origin": ALLOWED})
        assert r.status_code == 401 and r.headers[ACAO] == ALLOWED
    r = httpx.get(url + "/v1/models", timeout=30, headers={**auth, "Origin": ALLOWED})
    assert r.status_code == 200 and r.headers[ACAO] == ALLOWED
    r = httpx.get(url + "/v1/models", timeout=30, headers={**auth, "Origin": OTHER})
    assert r.status_code == 200 and not cors_headers(r)


def check_off(url: str, key: str | None) -> None:
    """No option: no CORS header on any answer, preflights included."""
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    for path in PATHS:
        assert not cors_headers(preflight(url, path, ALLOWED)), path
    for extra in ({}, {"stream": True}):
        r = httpx.post(url + CHAT, json={**BODY, **extra}, timeout=60,
                       headers={**auth, "Origin": ALLOWED})
        assert r.status_code == 200 and not cors_headers(r), r.headers
    r = httpx.get(url + "/v1/models", timeout=30, headers={**auth, "Origin": ALLOWED})
    assert r.status_code == 200 and not cors_headers(r)


@pytest.fixture
def worker(model_dir: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A worker in this process with the test's ``allowed_origins`` (``request.param``)."""
    engine = AsyncLLM.from_options(model_dir, **OPTIONS)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                           api_key=KEY, allowed_origins=request.param))
    with serve_in_thread(app) as url:
        yield url


@pytest.mark.parametrize("worker", [(ALLOWED,)], indirect=True)
def test_worker_answers_allowed_origins(worker: str) -> None:
    check_allowed(worker, KEY, fast_path=False)


@pytest.mark.parametrize("worker", [()], indirect=True)
def test_worker_without_allowed_origins_sends_no_cors_headers(worker: str) -> None:
    check_off(worker, KEY)


@pytest.mark.parametrize("worker", [("*",)], indirect=True)
def test_worker_any_origin(worker: str) -> None:
    r = preflight(worker, CHAT, OTHER)
    assert r.status_code == 204 and r.headers[ACAO] == "*" and "vary" not in r.headers
    r = httpx.post(worker + CHAT, json=BODY, timeout=60, headers={
        "Authorization": f"Bearer {KEY}", "Origin": OTHER})
    assert r.status_code == 200 and r.headers[ACAO] == "*"


@pytest.fixture(scope="module")
def upstream(model_dir: str) -> Iterator[str]:
    """The router tests' aggregated worker (no CORS of its own: the router's headers are the
    router's)."""
    engine = AsyncLLM.from_options(model_dir, **OPTIONS)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME))
    with serve_in_thread(app) as url:
        yield url.removeprefix("http://")


def _router_config(addr: str, **extra: Any) -> dict[str, Any]:
    return {"health_check_interval_sec": 0.2, "api_key": KEY,
            "generation_servers": {"urls": [addr]}, **extra}


@pytest.mark.parametrize("origins", [None, [ALLOWED]], ids=["off", "allowed"])
def test_router_cors(upstream: str, loop: LoopThread, origins: list[str] | None) -> None:
    extra = {} if origins is None else {"allowed_origins": origins}
    with running_router(_router_config(upstream, **extra), loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
        if origins is None:
            check_off(url, KEY)
        else:
            check_allowed(url, KEY, fast_path=True)


def test_router_any_origin(upstream: str, loop: LoopThread) -> None:
    with running_router(_router_config(upstream, allowed_origins=["*"]), loop) as url:
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30, what="router")
        r = preflight(url, "/v1/responses", OTHER)
        assert r.status_code == 204 and r.headers[ACAO] == "*" and "vary" not in r.headers
        r = httpx.post(url + CHAT, json=BODY, timeout=60, headers={
            "Authorization": f"Bearer {KEY}", "Origin": OTHER})
        assert r.status_code == 200 and r.headers[ACAO] == "*"


# ---- configuration --------------------------------------------------------------------------


def test_origins_are_checked() -> None:
    assert check_origins(["*", ALLOWED, ALLOWED]) == ("*", ALLOWED)
    for bad in (["http://a.example/"], ["app.example:3000"], ["http://a/x"], [5], "x"):
        with pytest.raises(ValueError, match="allowed_origins"):
            check_origins(bad)  # type: ignore[arg-type]
    gen = {"generation_servers": {"urls": ["127.0.0.1:9"]}}
    assert parse_cluster_config(gen).allowed_origins == ()
    assert parse_cluster_config({**gen, "allowed_origins": [ALLOWED]}).allowed_origins == (
        ALLOWED,)
    with pytest.raises(RouterConfigError, match=r"test: allowed_origins: 'http://a/'"):
        parse_cluster_config({**gen, "allowed_origins": ["http://a/"]}, "test")
    # a section's allowed_origins is its workers' (checked as they will)
    with pytest.raises(RouterConfigError, match=r"generation_servers.allowed_origins"):
        parse_cluster_config({"generation_servers": {"urls": ["127.0.0.1:9"],
                                                     "allowed_origins": ["nope"]}}, "test")


def test_router_flag_replaces_the_yaml(tmp_path: Any) -> None:
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(json.dumps({"allowed_origins": [OTHER],
                               "generation_servers": {"urls": ["127.0.0.1:9"]}}))

    def parse(*flags: str) -> argparse.Namespace:
        return build_parser().parse_args(["router", "-c", str(cfg), *flags])

    assert configured(parse()).allowed_origins == (OTHER,)
    assert configured(parse("--allowed-origins", f"{ALLOWED}, *")).allowed_origins == (
        ALLOWED, "*")
    assert configured(parse("--allowed-origins", "")).allowed_origins == ()
    with pytest.raises(RouterConfigError, match="--allowed-origins"):
        configured(parse("--allowed-origins", "http://a/b"))


def test_serve_refuses_a_bad_origin_before_loading(model_dir: str, tmp_path: Any) -> None:
    """``disagg serve --allowed-origins`` (and the YAML key) is checked at start-up: exit 2
    naming the option, before the model is loaded."""
    worker_yaml = tmp_path / "w.yaml"
    worker_yaml.write_text("allowed_origins: ['http://ok.example', 'http://bad.example/']\n")
    for args in (["--allowed-origins", "localhost:3000"], ["--config", str(worker_yaml)]):
        w = start_worker_proc(tmp_path, model_dir, "bad", args, {}, port=free_port())
        try:
            assert w.proc.wait(60) == 2
        finally:
            stop_all([w])
        log = w.log.read_text()
        assert "allowed_origins" in log and "is not an origin" in log, log
        assert "loading" not in log, log
