"""Keep-alive contract: our clients drop idle pooled connections before the servers they talk
to close them. Otherwise a request sent on a connection the server is just closing fails with
"connection reset" although the server never saw it (seen as a rare 502 from the router)."""

from __future__ import annotations

import asyncio
import inspect

import uvicorn

from disagg.bench.client import CLIENT_KEEP_ALIVE_S, AiohttpTransport, HttpxTransport
from disagg.router.app import UPSTREAM_KEEP_ALIVE_S
from disagg.server.cli import SERVER_KEEP_ALIVE_S


def test_clients_expire_idle_connections_before_servers_close_them() -> None:
    uvicorn_default = inspect.signature(uvicorn.Config.__init__).parameters[
        "timeout_keep_alive"].default
    # The bench client talks to any uvicorn-based server (vLLM, SGLang, trtllm-serve).
    assert CLIENT_KEEP_ALIVE_S < uvicorn_default <= SERVER_KEEP_ALIVE_S
    assert UPSTREAM_KEEP_ALIVE_S < SERVER_KEEP_ALIVE_S


def test_bench_transports_use_the_short_expiry() -> None:
    async def check() -> None:
        a = AiohttpTransport(10.0)
        h = HttpxTransport(10.0)
        try:
            assert a._session.connector is not None
            assert a._session.connector._keepalive_timeout == CLIENT_KEEP_ALIVE_S
            assert h._client._transport._pool._keepalive_expiry == CLIENT_KEEP_ALIVE_S
        finally:
            await a.aclose()
            await h.aclose()

    asyncio.run(check())
