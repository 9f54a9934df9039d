"""The router's HTTP server: ``build_router_app(config) -> aiohttp.web.Application``, served by
``start_router`` on a ``front.FrontSite`` (the common OpenAI request on the router's own
protocol, everything else on aiohttp's).

The router sits in front of a cluster of workers and serves the OpenAI endpoints
``/v1/completions`` and ``/v1/chat/completions``. In a disaggregated cluster a request takes two
calls: a context worker prefills it and keeps its KV under a lease, then a generation worker
pulls that KV and decodes, its answer relayed to the client; in an aggregated cluster (or for a
request the two calls cannot carry) the request goes whole to one worker. ``flow`` tells the
calls and their retries; the pieces live in modules named for what they do:

- ``router``: ``Router``, the parts assembled from the cluster config (cluster authentication);
- ``handlers``: the HTTP endpoints; ``flow``: the request flow and its one retry helper;
- ``upstream``: the client of the workers (``http1``: its lean HTTP/1.1 connections);
  ``relay``: their answers passed to the client (``client_io``: whichever server carries it);
- ``front``: the router's own HTTP/1.1 server for the common OpenAI request;
- ``processes``: several router processes on one port (``processes: N``);
- ``prompt_tokens``: the prompt's tokens for the policies; ``replies``: the router's own answers;
- ``membership``, ``policies``, ``kv_index``, ``metrics``, ``config``, ``cli``.

This module adds the HTTP limits of the router's own server and starts it (``start_router``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from aiohttp import web

from disagg.contracts.cluster import ClusterConfig
from disagg.contracts.protocol import MAX_BODY_BYTES
from disagg.router.front import FrontSite
from disagg.router.handlers import Handlers
from disagg.router.processes import ProcessInfo
from disagg.router.replies import Reply
from disagg.router.router import Router, check_cluster_token
from disagg.router.upstream import UPSTREAM_KEEP_ALIVE_S

__all__ = ["LINGER_S", "ROUTER_KEY", "UPSTREAM_KEEP_ALIVE_S", "Router", "build_router_app",
           "check_cluster_token", "start_router"]

logger = logging.getLogger("disagg.router")

# HTTP limits of the router's own server, set explicitly (aiohttp's values): a request line or
# header field of at most 8190 bytes, at most 128 header fields (else 400). aiohttp closes a
# connection that sent no complete request head within KEEP_ALIVE_S of connecting or of its
# previous answer: idle keep-alive and the header timeout are one knob there. The body must
# arrive within protocol.BODY_TIMEOUT_S (408).
KEEP_ALIVE_S = 75.0  # as the workers' (http_guard.SERVER_KEEP_ALIVE_S): clients keep <= 60 s
# After answering a request whose body was not read (408, 413, 415), aiohttp reads and drops
# the rest for at most this long, so that a client still sending sees the answer; then closes.
LINGER_S = 2.0
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128

ROUTER_KEY = web.AppKey("router", Router)
HANDLERS_KEY = web.AppKey("handlers", Handlers)


_HTTP_VERSIONS = (aiohttp.HttpVersion10, aiohttp.HttpVersion11)


@web.middleware
async def _guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """HTTP/1.0 and 1.1 only (aiohttp's parser passes 0.9 and 2.0 on: 505); an unexpected
    error is a logged 500 with OpenAI error JSON."""
    if request.version not in _HTTP_VERSIONS:
        v = request.version
        resp = Reply.error(505, f"HTTP/{v.major}.{v.minor} is not supported (HTTP/1.0 or 1.1)",
                           code="http_version", close=True).response()
        # aiohttp writes the request's version in the status line ("HTTP/2.0 505"): answer
        # as the HTTP/1.1 server this is (RFC 9110 6.2), through a copy of the request.
        as_11 = request.clone()
        as_11._version = aiohttp.HttpVersion11  # (what BaseRequest.version reads)
        if as_11.version != aiohttp.HttpVersion11:  # another aiohttp: its status line then
            return resp
        await resp.prepare(as_11)
        await resp.write_eof()
        return resp
    try:
        return await handler(request)
    except (web.HTTPException, asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        logger.exception("unhandled error serving %s", request.path)
        return Reply.error(500, "internal server error", "internal_server_error").response()


def build_router_app(config: ClusterConfig, *, tokenizer: Any = None,
                     cluster_token: str | None = None, insecure_membership: bool = False,
                     process: ProcessInfo | None = None) -> web.Application:
    """The router as an aiohttp app (its startup connects to the workers). Run it with
    ``handler_cancellation=True`` (``start_router`` does) so that a client disconnect
    cancels the upstream requests. ``cluster_token``: default ``$DISAGG_CLUSTER_TOKEN``;
    RouterConfigError when there is none and the config needs one (``check_cluster_token``).
    ``process``: which of several router processes this is (``processes``)."""
    router = Router(config, tokenizer=tokenizer, cluster_token=cluster_token,
                    insecure_membership=insecure_membership, process=process)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_guard])
    app[ROUTER_KEY] = router
    app.on_startup.append(router.startup)
    app.on_cleanup.append(router.cleanup)
    app[HANDLERS_KEY] = handlers = Handlers(router)
    handlers.register(app)
    return app


async def start_router(app: web.Application, host: str, port: int, *,
                       keep_alive_s: float = KEEP_ALIVE_S, reuse_port: bool = False,
                       private_socket: str | None = None) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0: a free port); returns the runner and the port.
    ``keep_alive_s``: idle keep-alive, and the time a request head has to arrive in.
    ``reuse_port``: bind with SO_REUSEPORT (one of several router processes);
    ``private_socket``: also serve on this Unix socket (the channel of those processes)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=keep_alive_s, max_line_size=MAX_LINE_BYTES,
                           max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS,
                           lingering_time=LINGER_S,
                           auto_decompress=False)  # bodies are plain JSON (else 415)
    await runner.setup()
    handlers = app.get(HANDLERS_KEY)
    site: web.TCPSite
    if handlers is None:  # not the router's app (tests serve their stubs so)
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_port=reuse_port or None)
    else:  # the common OpenAI request through the router's own protocol, the rest aiohttp's
        site = FrontSite(runner, host, port, handlers, keep_alive_s=keep_alive_s,
                         linger_s=LINGER_S, max_head_bytes=MAX_LINE_BYTES,
                         max_headers=MAX_HEADERS, backlog=1024, reuse_port=reuse_port or None)
    await site.start()
    if private_socket is not None:
        await web.UnixSite(runner, private_socket).start()
    addresses = runner.addresses  # the bound sockets' names: the port the OS picked
    return runner, int(addresses[0][1]) if addresses else port
