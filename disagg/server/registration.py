"""Worker side of dynamic membership: ``disagg serve --router-url URL``.

Once the HTTP server listens, the worker ``POST``s ``URL/cluster/register`` with what the
router needs to route to it::

    {"role", "url": "host:port", "model", "model_dir", "tokens_per_block",
     "block_hash_scheme", "worker_id", "layout": [every rank's ParallelLayout.to_dict()],
     "kv_transfer": {role, worker_id, backend, addresses} | null}

and registers again every ``heartbeat_interval_sec`` (the router's answer says how often; the
router drops a worker that stays silent for its ``inactive_timeout_sec``). When the worker
starts draining (SIGTERM) it ``POST``s ``URL/cluster/unregister`` at once, so the router stops
sending it new requests while the running ones finish. With ``$DISAGG_CLUSTER_TOKEN`` (or
``--cluster-token``) set, every call is signed with it for the router's member id from its
``/health`` (``cluster_auth.sign_http``; the token itself is never sent). A router that is down
or refuses is retried every second, logged once per distinct reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from disagg.addresses import host_port
from disagg.cluster_auth import member_id_from_health, sign_http

if TYPE_CHECKING:
    from disagg.contracts.roles import Role
    from disagg.engine.client import EngineClient
    from disagg.server.state import ServerSettings

logger = logging.getLogger("disagg.server.registration")

RETRY_S = 1.0
TIMEOUT_S = 5.0


def worker_payload(engine: EngineClient, settings: ServerSettings, url: str,
                   role: Role | None = None) -> dict[str, Any]:
    """The registration body of the worker serving ``engine`` with ``settings`` in ``role``
    (default: the role at start)."""
    from disagg.kv_cache.hashing import BLOCK_HASH_SCHEME
    from disagg.layout import ParallelLayout

    cfg = engine.config
    transfer = engine.transfer
    return {
        "role": (role or settings.role).value,
        "url": url,
        "model": settings.model_name,
        "model_dir": settings.model_dir,
        "tokens_per_block": cfg.cache.tokens_per_block,
        "block_hash_scheme": BLOCK_HASH_SCHEME,
        "worker_id": engine.worker_id,
        "layout": [lay.to_dict() for lay in ParallelLayout.all_ranks(cfg.model, cfg.parallel)],
        "kv_transfer": transfer.info() if transfer is not None else None,
    }


class RouterRegistration:
    """Registers a running uvicorn server with a router and heartbeats until it stops."""

    def __init__(self, router_url: str, engine: EngineClient, settings: ServerSettings,
                 host: str, cluster_token: str | None = None) -> None:
        """``host``: the address the router should call this worker at (already chosen by
        ``addresses.advertise_address``: never a wildcard)."""
        self.router_url = router_url.rstrip("/")
        if "://" not in self.router_url:
            self.router_url = "http://" + self.router_url
        self.engine = engine
        self.settings = settings
        self.host = host
        self.cluster_token = cluster_token
        self.url: str | None = None  # host:port, once the server listens
        self.registered = False
        self._last_problem: str | None = None
        # The role the engine serves now (it may switch at run time: ``role_switch``); set
        # by the CLI to ``ServerState.serving_role``.
        self.role_of: Callable[[], Role] = lambda: settings.role
        self._client: Any = None

    async def run(self, server: Any) -> None:
        """Wait for ``server`` (a ``uvicorn.Server``) to listen, then register and heartbeat
        until it starts shutting down; then unregister."""
        import httpx

        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = host_port(self.host, port)
        # trust_env=False: the router is a cluster peer, called directly as the router calls
        # its workers (an http_proxy set for the pod's outbound traffic must not take it).
        async with httpx.AsyncClient(timeout=TIMEOUT_S, trust_env=False) as client:
            self._client = client
            try:
                while not server.should_exit:
                    interval = await self._register(client, self._payload())
                    await _sleep_unless(server, interval)
            finally:
                self._client = None
                if self.registered:
                    await self.unregister(client)

    def _payload(self) -> dict[str, Any]:
        assert self.url is not None
        return worker_payload(self.engine, self.settings, self.url, self.role_of())

    async def register_now(self) -> None:
        """Register again at once (the role switched): the router moves this worker to the
        new role's pool. Nothing when not registering (no server yet, or shutting down)."""
        if self._client is None or self.url is None:
            return
        await self._register(self._client, self._payload())

    async def _register(self, client: Any, payload: dict[str, Any]) -> float:
        import httpx

        try:
            r = await self._post(client, "/cluster/register", payload)
        except httpx.HTTPError as e:
            self._problem(f"router {self.router_url} unreachable: {type(e).__name__}: {e}")
            return RETRY_S
        if r.status_code != 200:
            try:
                why = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = r.text[:200]
            self._problem(f"router {self.router_url} refused the registration "
                          f"({r.status_code}): {why}")
            return RETRY_S
        if not self.registered or self._last_problem is not None:
            logger.info("registered with router %s as %s (%s)", self.router_url, self.url,
                        self.role_of())
        self.registered = True
        self._last_problem = None
        try:
            return max(float(r.json().get("heartbeat_interval_sec", 5.0)), 0.05)
        except (ValueError, TypeError, AttributeError):
            return 5.0

    async def unregister(self, client: Any) -> None:
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            await self._post(client, "/cluster/unregister", {"url": self.url}, timeout=2.0)
            logger.info("unregistered from router %s", self.router_url)
        self.registered = False

    async def _post(self, client: Any, path: str, payload: dict[str, Any],
                    timeout: float = TIMEOUT_S) -> Any:
        """POST ``payload`` to the router, signed over the exact bytes sent when this worker
        has a cluster token."""
        import httpx

        url = self.router_url + path
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.cluster_token:
            # The router's member id (the signature's audience), read fresh from its /health
            # each time: one GET per heartbeat, and a restarted router is never signed for
            # under its old id. /health answers 503 until a worker is healthy, naming it too.
            r = await client.get(self.router_url + "/health", timeout=timeout)
            try:
                audience = member_id_from_health(r.json())
            except ValueError as e:  # JSONDecodeError is a ValueError
                raise httpx.HTTPError(f"router {self.router_url}: {e}") from None
            target = urlsplit(url)
            signed_path = target.path + (f"?{target.query}" if target.query else "")
            headers.update(sign_http(self.cluster_token, "POST", signed_path, body,
                                     audience=audience))
        return await client.post(url, content=body, headers=headers, timeout=timeout)

    def _problem(self, why: str) -> None:
        if why != self._last_problem:
            logger.warning("%s; retrying every %.0f s", why, RETRY_S)
        self._last_problem = why


async def _sleep_unless(server: Any, seconds: float) -> None:
    """Sleep, waking early when the server starts shutting down (drain: unregister now)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not server.should_exit and loop.time() < end:
        await asyncio.sleep(min(0.1, end - loop.time()))


async def serve_registered(server: Any, registration: RouterRegistration) -> None:
    """``server.serve()`` with ``registration`` running beside it."""
    task = asyncio.create_task(registration.run(server))
    try:
        await server.serve()
    finally:
        if not task.done():
            # normally it has unregistered already (should_exit was set at drain start)
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 3.0)
        if not task.done():
            task.cancel()
