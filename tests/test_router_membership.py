"""Dynamic membership: workers register with the router (disagg_cluster), heartbeat, and are
dropped when silent or failing; ``minimal_instances`` gates ``/health``; a real
``disagg serve --router-url`` worker registers, serves through the router and unregisters on
SIGTERM. Registrations are signed with the cluster token (test_router_auth.py checks that
unsigned ones are refused)."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
from router_fixtures import DYNAMIC, LoopThread, running_router
from server_fixtures import signed, wait_for
from test_router_live import (
    NAME,
    TOKEN,
    FakeWorker,
    cluster,
    start_worker,
    stop_workers,
    wait_healthy,
)


def _register(url: str, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/cluster/register", timeout=10,
                      **signed(TOKEN, "POST", "/cluster/register", payload, to=url))


def _urls(url: str, pool: str) -> list[str]:
    return [w["url"] for w in cluster(url)["workers"][pool]]


def test_register_heartbeat_expiry_and_readiness(loop: LoopThread) -> None:
    fake = FakeWorker("generation", [])
    runner, fake_url = loop.serve(fake.app)
    addr = fake_url.removeprefix("http://")
    try:
        with running_router(DYNAMIC, loop) as url:
            r = httpx.get(url + "/health")
            assert r.status_code == 503 and "0/1 healthy generation" in r.json()["reason"]
            # malformed registrations are refused, naming the field
            r = _register(url, {"role": "decode", "url": addr})
            assert r.status_code == 400 and r.json()["error"]["param"] == "role"
            r = _register(url, {"role": "generation"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "url"
            r = _register(url, {"role": "generation", "url": addr, "tokens_per_block": 16})
            assert r.status_code == 200 and r.json()["heartbeat_interval_sec"] == 0.2
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 10,
                     what="ready with one generation worker")
            assert _urls(url, "generation") == [addr]
            info = cluster(url)["workers"]["generation"][0]
            assert info["source"] == "registered" and info["healthy"]
            # heartbeats keep it; silence drops it after inactive_timeout_sec
            for _ in range(8):
                assert _register(url, {"role": "generation", "url": addr}).status_code == 200
                time.sleep(0.2)
            assert _urls(url, "generation") == [addr]
            wait_for(lambda: not _urls(url, "generation"), 10, what="dropped when silent")
            assert httpx.get(url + "/health").status_code == 503
            # heartbeating but failing health checks: dropped as well
            _register(url, {"role": "generation", "url": addr})
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 10, what="back")
            loop.run(runner.cleanup())
            deadline = time.monotonic() + 10
            while _urls(url, "generation"):
                assert time.monotonic() < deadline, "not dropped while failing health checks"
                _register(url, {"role": "generation", "url": addr})
                time.sleep(0.1)
            # explicit unregister
            runner, fake_url = loop.serve(fake.app)
            addr = fake_url.removeprefix("http://")
            _register(url, {"role": "context", "url": addr})
            assert _urls(url, "context") == [addr]
            r = httpx.post(url + "/cluster/unregister",
                           **signed(TOKEN, "POST", "/cluster/unregister", {"url": addr},
                                    to=url))
            assert r.json()["status"] == "unregistered" and not _urls(url, "context")
    finally:
        loop.run(runner.cleanup())


def test_registration_needs_disagg_cluster(loop: LoopThread) -> None:
    static = {"generation_servers": {"urls": ["127.0.0.1:9"]}}
    with running_router(static, loop) as url:
        r = _register(url, {"role": "generation", "url": "127.0.0.1:10"})
        assert r.status_code == 404 and "disagg_cluster" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503  # its only worker is down


@contextlib.contextmanager
def _refusing_proxy() -> Iterator[tuple[str, list[int]]]:
    """An HTTP proxy that answers 502 to everything; yields its URL and a list that gets an
    item per connection it accepted."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    hits: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            hits.append(1)
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", hits
    finally:
        stop.set()
        t.join(5)
        srv.close()


def test_worker_with_router_url_registers_serves_and_unregisters(
        loop: LoopThread, tiny_llama: str, tmp_path: Path) -> None:
    """With an http_proxy in its environment (as pods often have for outbound traffic) the
    worker still calls the router directly, as the router calls it."""
    with running_router(DYNAMIC, loop) as url, _refusing_proxy() as (proxy, proxy_hits):
        proxies = {k: proxy for k in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")}
        w = start_worker(tmp_path, tiny_llama, "dyn", "aggregated", "--router-url", url,
                         "--tokens-per-block", "8",
                         env={**proxies, "NO_PROXY": "", "no_proxy": ""})
        try:
            wait_healthy([w])
            wait_for(lambda: httpx.get(url + "/health").status_code == 200, 30,
                     what="router ready after the worker registered")
            info = cluster(url)["workers"]["generation"][0]
            assert info["url"] == w.addr and info["role"] == "aggregated"
            assert info["tokens_per_block"] == 8 and info["source"] == "registered"
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60,
                                   max_retries=0)
            got = client.completions.create(model=NAME, prompt="Hello there", max_tokens=6,
                                            temperature=0, extra_body={"ignore_eos": True})
            direct = httpx.post(w.url + "/v1/completions", json={
                "model": NAME, "prompt": "Hello there", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}, timeout=60).json()
            assert got.choices[0].text == direct["choices"][0]["text"]
            w.proc.send_signal(signal.SIGTERM)  # drains: unregisters at once
            wait_for(lambda: not cluster(url)["workers"]["generation"], 20,
                     what="unregistered on SIGTERM")
            assert w.proc.wait(30) == 0
            assert httpx.get(url + "/health").status_code == 503
            assert proxy_hits == []  # registration and unregistration went direct
        finally:
            stop_workers([w])
