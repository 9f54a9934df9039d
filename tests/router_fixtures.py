"""Helpers for the router tests: an asyncio loop in a thread that serves in-process aiohttp
apps, the router app of a config on an ephemeral port, an in-process worker's app for it, and
Prometheus samples by label."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
from aiohttp import web

from disagg.contracts.cluster import ClusterConfig, parse_cluster_config
from disagg.router.app import build_router_app, start_router

# The cluster token of the router tests' workers (``running_router`` hands it to the router).
ROUTER_TOKEN = "router-test-secret"
# In-process workers behind a router (``worker_app``): a small cache, short prompts.
WORKER_OPTIONS = dict(tokens_per_block=16, kv_cache_tokens=2048, max_model_len=512,
                      max_num_tokens=256, max_batch_size=8)
# A dynamic cluster (workers register themselves): fast health checks, one generation worker
# needed for /health, silent workers dropped after a second.
DYNAMIC = {"health_check_interval_sec": 0.2, "disagg_cluster": {
    "minimal_instances": {"generation_servers": 1},
    "heartbeat_interval_sec": 0.2, "inactive_timeout_sec": 1.0}}


class LoopThread:
    """An asyncio loop in a daemon thread, for in-process aiohttp servers."""

    def __init__(self, new_loop: Any = asyncio.new_event_loop) -> None:
        self.loop = new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="test-router-loop")
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application) -> tuple[web.AppRunner, str]:
        runner, port = self.run(start_router(app, "127.0.0.1", 0))
        return runner, f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.loop.close()


@contextlib.contextmanager
def running_router(config: ClusterConfig | dict[str, Any], loop: LoopThread | None = None,
                   cluster_token: str | None = ROUTER_TOKEN, **kw: Any) -> Iterator[str]:
    """The router app of ``config`` served on an ephemeral port; yields its base URL. It holds
    the workers' cluster token (``cluster_token``) unless told otherwise."""
    cfg = config if isinstance(config, ClusterConfig) else parse_cluster_config(config, "test")
    own = loop is None
    lt = loop or LoopThread()
    try:
        runner, url = lt.serve(build_router_app(cfg, cluster_token=cluster_token, **kw))
        try:
            yield url
        finally:
            lt.run(runner.cleanup())
    finally:
        if own:
            lt.close()


def worker_app(model_dir: str, role: str, name: str = "tiny",
               otlp_traces_endpoint: str | None = None, kv_peer_reuse: bool = False) -> Any:
    """The HTTP app of a worker of ``role`` (context / generation over TCP, or aggregated;
    ``kv_peer_reuse``: any role over TCP) on ``WORKER_OPTIONS``, holding ``ROUTER_TOKEN``;
    serve it with ``server_fixtures.serve_in_thread``."""
    from disagg.config import build_engine_config
    from disagg.engine import AsyncLLM
    from disagg.kv_connector.settings import DisaggSettings
    from disagg.server.app import ServerSettings, build_app

    disagg = (DisaggSettings(role=role, cluster_token=ROUTER_TOKEN, backend="TCP",
                             otlp_traces_endpoint=otlp_traces_endpoint,
                             kv_peer_reuse=kv_peer_reuse)
              if role != "aggregated" or kv_peer_reuse else None)
    engine = AsyncLLM(build_engine_config(model_dir, **WORKER_OPTIONS), disagg=disagg)
    return build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=name,
                                            role=role, cluster_token=ROUTER_TOKEN,
                                            otlp_traces_endpoint=otlp_traces_endpoint))


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([-+0-9.eEinfa]+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total
