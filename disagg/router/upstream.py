"""The router's client of its workers: keep-alive connections, per-pool headers (the workers' API
key, cluster signatures), one send with the stale-connection rule, a worker's error answer as a
typed failure, and fire-and-forget lease releases.

KV prefix reuse (``peer_reuse``): ``ask_prefix`` is the signed ``POST /kv_prefix`` to a peer,
within ``PREFIX_TIMEOUT_S``; a prefix lease is given back with the same ``release_lease``.

The requests of the hot path (the OpenAI calls, ``/tokenize``) go through the lean HTTP/1.1
client (``http1``): their request heads are prepared once per worker and path, the answers
come back as bytes. Health checks, KV event polls, ``/v1/models`` and lease releases use an
aiohttp session (a few a second, where its generality costs nothing).

Failures feed the membership's health rules: a worker that refuses the connection is taken out
of rotation at once; other failures count towards ``REQUEST_FAILURE_THRESHOLD``; a 503 saying
the worker drains or its engine is down takes it out too (its /health says the same).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from disagg.contracts import protocol as P
from disagg.contracts.cluster import ClusterConfig
from disagg.contracts.roles import Role
from disagg.router import http1
from disagg.router.membership import Membership, UpstreamAuth, Worker
from disagg.router.metrics import RouterMetrics
from disagg.router.replies import Reply, dumps, loads, retry_after

logger = logging.getLogger("disagg.router")

CONNECT_TIMEOUT_S = 5.0
# Idle upstream connections are dropped before a worker closes them (bench.client explains).
UPSTREAM_KEEP_ALIVE_S = 4.0
KV_TRANSFER_FAILED = "kv_transfer_failed"  # the error code of a generation worker's failed pull
RELEASE_PATH = "/kv_leases/release"
PREFIX_PATH = "/kv_prefix"
# A peer's /kv_prefix answer is a lookup and a lease: waited for this long at most (the request
# waits for it: a peer that does not answer by then is not worth it, and the request goes on
# without).
PREFIX_TIMEOUT_S = 2.0
KV_PREFIX = "kv_prefix"  # the key of the forwarded request that carries the peer's lease


class PrefixError(Exception):
    """A peer's /kv_prefix call failed (its message says why); the request goes on without."""


@dataclass(frozen=True)
class PrefixLease:
    """A peer's lease on a prompt's first ``num_tokens`` tokens' KV (its /kv_prefix answer)."""

    peer: Worker
    num_tokens: int
    params: Mapping[str, Any]  # the answer's kv_prefix object (a ContextParams dict)

    @property
    def lease_id(self) -> str:
        return str(self.params["ctx_request_id"])


class Failed(Exception):
    """One try on one worker failed before anything reached the client."""

    def __init__(self, why: str, reply: Reply | None = None, reached: bool = True,
                 kv_transfer: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.reply = reply  # the worker's own error answer, passed on if nothing else works
        self.reached = reached  # False: never connected, so it saw nothing of the request
        self.kv_transfer = kv_transfer  # the generation worker could not read the context KV

    @property
    def reason(self) -> str:
        """Its label in ``disagg_router_retries_total``."""
        if self.kv_transfer:
            return KV_TRANSFER_FAILED
        if self.reply is not None:
            return f"status_{self.reply.status}"
        return "unreachable" if not self.reached else "connection_failed"


def error_code(body: bytes) -> str | None:
    """``error.code`` of a worker's OpenAI error JSON (None: no such field, or not JSON)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


@functools.lru_cache(maxsize=1024)
def _address(url: str) -> tuple[str, int]:
    """A worker's ``host:port`` as the socket address to connect to (IPv6 without brackets)."""
    host, _, port = url.rpartition(":")
    return host.strip("[]"), int(port)


class UpstreamClient:
    """Sends the router's requests to its workers (sessions opened by ``start``)."""

    def __init__(self, config: ClusterConfig, auth: UpstreamAuth, membership: Membership,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.auth = auth
        self.membership = membership
        self.metrics = metrics
        self.headers: dict[str, dict[str, str]] = {}  # pool -> headers of a POST to it
        for role in (Role.CONTEXT, Role.GENERATION):
            group = config.group(role)
            key = group.worker_options.get("api_key") if group else None
            headers = {"Content-Type": "application/json"}
            if key:  # the workers' own key; the client's (the router's) is not forwarded
                headers["Authorization"] = f"Bearer {key}"
            self.headers[role] = headers
        self.session: aiohttp.ClientSession | None = None  # health checks, polls, releases
        self.pool: http1.Pool | None = None  # the hot path
        self._heads: dict[tuple[str, str, str], bytes] = {}  # (worker, pool, path) -> head
        self.background: set[asyncio.Task[None]] = set()  # lease releases in flight

    async def start(self) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                        sock_read=self.config.upstream_timeout_sec)
        # Keep-alive connections, no pool limit (long streams must not starve the others).
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300,
                                           keepalive_timeout=UPSTREAM_KEEP_ALIVE_S),
            timeout=timeout, auto_decompress=False)
        self.pool = http1.Pool(connect_timeout_s=CONNECT_TIMEOUT_S,
                               read_timeout_s=self.config.upstream_timeout_sec,
                               keep_alive_s=UPSTREAM_KEEP_ALIVE_S)
        return self.session

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.session is not None:
            await self.session.close()

    async def post(self, w: Worker, path: str, data: bytes, signed: bool = False,
                   trace: bytes = b"") -> http1.Response:
        """Send (``signed``: with the cluster signature over ``data``; ``trace``: header
        lines added to the head, the call's ``traceparent``); a failure to get
        the answer's head is ``Failed``. A pooled keep-alive connection that the worker had
        already closed (reset or closed before any response byte: the worker never saw the
        request) is no failure: the send is repeated at once on a new connection (with a new
        signature: a nonce is accepted once). A worker that cannot be reached for that second
        send may have died working on the first: a failure that reached it."""
        try:
            resp = await self._send(w, path, data, signed, trace)
        except http1.ConnectError as e:  # never connected: it saw nothing
            self.membership.mark_failed(w, f"unreachable: {e}")
            raise Failed(f"{w.url}: {e}", reached=False) from None
        except (http1.UpstreamError, asyncio.TimeoutError) as e:
            self.membership.request_failed(w, f"failed: {type(e).__name__}: {e}")
            raise Failed(f"{w.url}: {type(e).__name__}: {e}") from None
        w.request_failures = 0  # it answered
        return resp

    def _head(self, w: Worker, path: str) -> bytes:
        """The request head of a POST to ``w``'s ``path`` without a signature (prepared once)."""
        key = (w.url, w.pool, path)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) > 4096:  # workers came and went: start again
                self._heads.clear()
            head = self._heads[key] = http1.request_head("POST", w.url, path,
                                                         self.headers[w.pool])
        return head

    async def _send(self, w: Worker, path: str, data: bytes, signed: bool, trace: bytes = b""
                    ) -> http1.Response:
        assert self.pool is not None
        host, port = _address(w.url)
        head = self._head(w, path)
        if trace:
            head += trace
        def sign() -> bytes:
            return head + _lines(self.auth.signature("POST", path, data, audience=w.member_id))

        try:
            return await self.pool.post(host, port, sign() if signed else head, data)
        except http1.StaleConnection as e:
            logger.debug("%s: pooled connection was stale; sending again", w.url)
            stale = e
        try:
            return await self.pool.post(host, port, sign() if signed else head, data,
                                        fresh=True)
        except http1.ConnectError as e:
            # Gone now: the connection that failed may have carried the request to a worker
            # that died working on it (not "never reached": its lease may be read already).
            self.membership.mark_failed(w, f"unreachable: {e}")
            raise http1.UpstreamError(f"{stale}; then {e}") from None

    async def read(self, w: Worker, resp: http1.Response) -> bytes:
        """The whole answer; a connection that fails mid-answer is ``Failed``."""
        try:
            return await resp.read()
        except (http1.UpstreamError, asyncio.TimeoutError) as e:
            self.membership.request_failed(w, f"failed mid-answer: {type(e).__name__}")
            raise Failed(f"{w.url}: {type(e).__name__}: {e}") from None

    async def error_answer(self, w: Worker, resp: http1.Response) -> Failed:
        """A worker's 5xx answer, as a retryable failure carrying it (for pass-through). A
        generation worker's failed KV pull is told by its error code (``kv_transfer_failed``),
        so the caller prefills again instead of blaming that worker."""
        try:
            body = await resp.read()
        except (http1.UpstreamError, asyncio.TimeoutError):
            body = dumps(P.error_body(f"{w.url} answered {resp.status}", "upstream_error"))
        finally:
            resp.release()
        code = error_code(body)
        if resp.status == 503 and code in ("draining", "engine_unavailable", "role_switching"):
            # what its /health says too: out until a check passes (a full queue is no reason)
            self.membership.mark_failed(w, "answered 503")
        kv = resp.status == 502 and code == KV_TRANSFER_FAILED
        # (its Retry-After, a full queue's, reaches the client when no other worker serves it)
        return Failed(f"{w.url} answered {resp.status}",
                      Reply(resp.status, body, resp.content_type or "application/json",
                            outcome="upstream_error", headers=retry_after(resp.retry_after)),
                      kv_transfer=kv)

    async def get(self, w: Worker, path: str) -> tuple[int, bytes, str]:
        """A signed GET on the pooled session: (status, body, content type), or ``Failed``
        when the worker could not be reached or the connection failed."""
        assert self.session is not None
        try:
            async with self.session.get(w.base + path,
                                        headers=self.auth.headers(w.pool, "GET", path,
                                                                  audience=w.member_id)) as r:
                return r.status, await r.read(), r.content_type
        except aiohttp.ClientConnectorError as e:
            self.membership.mark_failed(w, f"unreachable: {e}")
            raise Failed(f"{w.url}: {e}", reached=False) from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.membership.request_failed(w, f"failed: {type(e).__name__}: {e}")
            raise Failed(f"{w.url}: {type(e).__name__}: {e}") from None

    def idle_connections(self, w: Worker) -> int:
        """Idle keep-alive connections of the hot path to ``w``."""
        return 0 if self.pool is None else self.pool.idle_count(*_address(w.url))

    # -- prefix leases (peer_reuse) -------------------------------------------------------------

    async def ask_prefix(self, w: Worker, token_ids: Sequence[int]) -> PrefixLease | None:
        """Peer ``w``'s lease on the longest cached prefix of ``token_ids`` (signed ``POST
        /kv_prefix``): None when it holds none; ``PrefixError`` when the call fails (not
        answered within ``PREFIX_TIMEOUT_S``, an error status, a malformed answer). A 404
        says ``w`` has no kv_peer_reuse (any more): it is no peer until its next health check
        says otherwise."""
        assert self.session is not None
        data = dumps({"prompt_token_ids": list(token_ids)})
        headers = {"Content-Type": "application/json",
                   **self.auth.headers(w.pool, "POST", PREFIX_PATH, data, audience=w.member_id)}
        try:
            async with self.session.post(w.base + PREFIX_PATH, headers=headers, data=data,
                                         timeout=aiohttp.ClientTimeout(
                                             total=PREFIX_TIMEOUT_S)) as r:
                body = await r.read()
                status = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise PrefixError(f"{w.url}{PREFIX_PATH}: {type(e).__name__}: {e}") from None
        if status == 404:
            w.kv_peer_reuse = False
        if status != 200:
            raise PrefixError(f"{w.url}{PREFIX_PATH} answered {status}: "
                              f"{body[:200].decode(errors='replace')}")
        try:
            answer = loads(body)
            n = answer["num_tokens"]
            params = answer["kv_prefix"]
        except (ValueError, TypeError, KeyError) as e:
            raise PrefixError(f"{w.url}{PREFIX_PATH}: malformed answer: {e!r}") from None
        if params is None:
            return None
        lease_id = params.get("ctx_request_id") if isinstance(params, dict) else None
        number = isinstance(n, int) and not isinstance(n, bool)
        if number and 0 < n < len(token_ids) and isinstance(lease_id, str):
            return PrefixLease(w, n, params)
        if isinstance(lease_id, str):  # a lease we will not use: freed now
            self.release_lease(w, lease_id, self.metrics.kv_prefix_releases)
        if number and n == 0:
            return None  # (a lease of nothing)
        raise PrefixError(f"{w.url}{PREFIX_PATH}: malformed answer: num_tokens {n!r} (prompt "
                          f"{len(token_ids)} tokens), kv_prefix.ctx_request_id {lease_id!r}")

    # -- lease releases -------------------------------------------------------------------------

    def release_lease(self, w: Worker, lease_id: Any, counter: Any = None) -> None:
        """Fire and forget: ``w`` frees a lease nobody will read: a context answer's that no
        generation worker took, a prefix lease whose request the chosen worker did not take
        (idempotent there: a lease already confirmed or expired is left alone). ``counter``:
        the metric a release counts in (``lease_releases`` by default)."""
        if not isinstance(lease_id, str) or self.session is None:
            return
        task = asyncio.get_running_loop().create_task(self._post_release(
            w, lease_id, self.metrics.lease_releases if counter is None else counter))
        self.background.add(task)  # the loop only keeps weak references to tasks
        task.add_done_callback(self.background.discard)

    async def _post_release(self, w: Worker, lease_id: str, counter: Any) -> None:
        assert self.session is not None
        data = dumps({"ctx_request_id": lease_id})
        headers = {"Content-Type": "application/json",
                   **self.auth.headers(w.pool, "POST", RELEASE_PATH, data, audience=w.member_id)}
        try:
            async with self.session.post(w.base + RELEASE_PATH, headers=headers,
                                         data=data) as r:
                body = await r.read()
            if r.status == 200:
                counter.inc()
            else:
                logger.info("lease %s on %s not released: %d %s", lease_id, w.url, r.status,
                            body[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.info("lease %s on %s not released: %r", lease_id, w.url, e)


def _lines(headers: dict[str, str]) -> bytes:
    """Header lines, each ending with CRLF."""
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
