"""The router's HTTP server (aiohttp): ``build_router_app(config) -> aiohttp.web.Application``.

Request flow (REFERENCE section 4), for ``/v1/completions`` and ``/v1/chat/completions``:

0. The body is parsed and checked with the workers' own schema (``protocol.validate_request``)
   whenever the router reads it (disaggregated, or a policy needs the prompt): a request the
   generation worker would refuse never reaches a context worker.
1. Disaggregated cluster: the context call. The request goes to a context worker (its side's
   policy) non-streamed with ``disaggregated_params: {request_type: context_only}``. A connection
   failure or a 5xx tries another context worker, up to ``max_retries`` more; a 4xx goes back
   to the client as it is. An answer with ``disaggregated_params: null`` is final (the first
   token ended the request): it is the client's answer (as a stream if it asked for one).
2. The generation call: the original request (stream as asked) with the context's params and
   ``request_type: generation_only``; a completions prompt is replaced by the context's
   ``prompt_token_ids`` (chat keeps its messages; the worker takes the ids from the params).
   The answer is relayed as it comes, whole SSE events at a time; its usage gets the context
   side's prompt and cached tokens. Before the first byte reaches the client a failure tries
   another generation worker (same lease when the worker could not be reached, a fresh prefill
   when it answered an error: it released the lease, or the KV read failed), up to
   ``max_retries`` more; after it, the stream ends with an error event and ``[DONE]``.
3. Aggregated cluster (no context workers), or requests the two calls cannot carry (several
   prompts, ``n > 1``): the request goes whole to a generation worker, with the same retries.
   Conditional disaggregation does the same when the chosen generation worker would have to
   prefill at most ``max_local_prefill_length`` uncached prompt tokens.

A client that disconnects cancels its handler (the server runs with handler cancellation):
the upstream connection is closed, so the worker aborts the request and frees its KV (a
generation worker also releases the context lease). When no generation worker took the
request (the client left in between, every generation worker failed unreached, or one refused
it with a 4xx), the router asks the context worker to free the lease at once (``POST
/kv_leases/release``).

Cluster authentication: the router signs (``cluster_auth.HttpSigner``, with the token from
``$DISAGG_CLUSTER_TOKEN``) the calls whose handling depends on it: the generation_only call (a
generation worker trusts the context addresses of a signed request and caches its pulled KV),
health / server-info checks, KV event polls, lease releases and ``/v1/models``. The
context_only call and requests sent whole carry no signature: the worker decides nothing on
it, and the hot path pays for one signature per request, not three. It verifies the
signatures of ``/cluster/register`` and ``/cluster/unregister``. Without a token it refuses to
start when it could not sign (context servers) or would let anyone register
(``disagg_cluster``, unless ``insecure_membership``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import ctypes.util
import hmac
import json
import logging
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp
from aiohttp import web

from disagg.cluster_auth import AUTH_HEADER, AuthError, HttpVerifier, cluster_token_or_none
from disagg.router.config import ClusterConfig, PolicyConfig, RouterConfigError
from disagg.router.membership import ROLES, Membership, UpstreamAuth, Worker
from disagg.router.metrics import RouterMetrics
from disagg.router.policies import Decision, RouteRequest, RoutingPolicy, make_policy
from disagg.server import protocol as P

logger = logging.getLogger("disagg.router")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
MAX_BODY_BYTES = 64 << 20  # long prompts as token id lists are large
CONNECT_TIMEOUT_S = 5.0
# Idle upstream connections are dropped before a worker closes them (bench.client explains).
UPSTREAM_KEEP_ALIVE_S = 4.0
LARGE_BODY_BYTES = 32 << 10  # requests above this are tokenized on a thread, not the loop
# HTTP limits of the router's own server, set explicitly (aiohttp's values): a request line or
# header field of at most 8190 bytes, at most 128 header fields (else 400). aiohttp closes a
# connection that sent no complete request head within KEEP_ALIVE_S of connecting or of its
# previous answer: idle keep-alive and the header timeout are one knob there. The body must
# arrive within protocol.BODY_TIMEOUT_S (408).
KEEP_ALIVE_S = 75.0  # as the workers' (server.cli.SERVER_KEEP_ALIVE_S): clients keep <= 60 s
# After answering a request whose body was not read (408, 413, 415), aiohttp reads and drops
# the rest for at most this long, so that a client still sending sees the answer; then closes.
LINGER_S = 2.0
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128
# glibc keeps memory the router freed: under a steady load RSS crept ~0.3 MiB/min while live
# Python objects and malloc's in-use bytes stayed flat (DESIGN section 10); malloc_trim hands
# it back. Once a minute, well under a millisecond on this heap.
MALLOC_TRIM_INTERVAL_S = 60.0


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Reply(Exception):
    """Answer the client with this (an error, ours or a worker's passed through)."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json",
                 outcome: str = "client_error", close: bool = False) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.outcome = outcome
        self.close = close  # the request body was not read: the connection cannot be reused

    @classmethod
    def error(cls, status: int, message: str, type: str = "invalid_request_error",
              param: str | None = None, code: str | None = None,
              outcome: str | None = None, close: bool = False) -> Reply:
        return cls(status, _dumps(error_body(message, type, param, code)),
                   outcome=outcome or ("client_error" if status < 500 else "upstream_error"),
                   close=close)

    @classmethod
    def from_api_error(cls, e: P.APIError, close: bool = False) -> Reply:
        return cls(e.status, _dumps(e.body()), close=close,
                   outcome="client_error" if e.status < 500 else "upstream_error")

    def response(self) -> web.Response:
        resp = web.Response(status=self.status, body=self.body, content_type=self.content_type)
        if self.close:
            resp.force_close()
        return resp


class _Failed(Exception):
    """One try on one worker failed before anything reached the client."""

    def __init__(self, why: str, reply: Reply | None = None, reached: bool = True,
                 kv_transfer: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.reply = reply  # the worker's own error answer, passed on if nothing else works
        self.reached = reached  # False: never connected, so it saw nothing of the request
        self.kv_transfer = kv_transfer  # the generation worker could not read the context KV


@dataclass
class _RequestState:
    endpoint: str
    outcome: str = "success"


def check_cluster_token(config: ClusterConfig, token: str | None,
                        insecure_membership: bool = False) -> None:
    """RouterConfigError when the router could not do its part of cluster authentication."""
    if token:
        return
    if config.disagg_cluster is not None and not insecure_membership:
        raise RouterConfigError(
            f"{config.source}: disagg_cluster: no cluster token, so anyone could register as "
            f"a worker and receive user traffic: set $DISAGG_CLUSTER_TOKEN to the workers' "
            f"token (or pass --insecure-membership to accept unauthenticated registrations)")
    if config.context_servers is not None:
        raise RouterConfigError(
            f"{config.source}: context_servers: no cluster token: a disaggregated router signs "
            f"its calls to the workers with it (generation workers trust only signed requests' "
            f"context addresses): set $DISAGG_CLUSTER_TOKEN to the workers' token")


# What a stale pooled connection raises when the request is sent on it (the worker closed it
# or reset it before sending any response byte).
_STALE_CONNECTION = tuple(e for e in (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                                      getattr(aiohttp, "ClientConnectionResetError", None))
                          if e is not None)


# Whether this task's latest upstream send got a pooled connection that had carried a request
# before (set by _Connector.connect, read by Router._post after a failure: the send runs in
# the caller's task, so in its context). aiohttp's trace hooks tell the same at ~25 us a
# request; this costs ~1 us.
_SENT_ON_USED: contextvars.ContextVar[bool] = contextvars.ContextVar("sent_on_used",
                                                                    default=False)


class _Connector(aiohttp.TCPConnector):
    """A TCPConnector that notes, per sending task, whether a connection was used before."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._used: weakref.WeakSet[Any] = weakref.WeakSet()  # protocols that sent a request

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        conn = await super().connect(req, traces, timeout)
        proto = conn.protocol
        try:
            _SENT_ON_USED.set(proto in self._used)
            self._used.add(proto)
        except TypeError:  # not weak-referenceable (another aiohttp): never retried
            _SENT_ON_USED.set(False)
        return conn


class Router:
    def __init__(self, config: ClusterConfig, tokenizer: Any = None, *,
                 cluster_token: str | None = None, insecure_membership: bool = False) -> None:
        self.config = config
        # The cluster secret (never sent): signs the calls to workers, verifies registrations.
        self.cluster_token = cluster_token_or_none(cluster_token)
        check_cluster_token(config, self.cluster_token, insecure_membership)
        self.verifier = HttpVerifier(self.cluster_token) if self.cluster_token else None
        if config.disagg_cluster is not None and self.verifier is None:
            logger.warning("--insecure-membership: /cluster/register accepts anyone (no "
                           "cluster token); use it only on a trusted network")
        policy_configs: dict[str, PolicyConfig] = {}
        for role in ROLES:
            group = config.group(role)
            policy_configs[role] = group.router if group else PolicyConfig(
                "round_robin", options=MappingProxyType({}))
        self.policy_configs = policy_configs
        self.policies: dict[str, RoutingPolicy] = {
            role: make_policy(p) for role, p in policy_configs.items()}
        self.need_tokens = (any(p.needs_tokens for p in self.policies.values())
                            or config.conditional_disagg is not None)
        self.tokenizer = tokenizer
        self.tokenizer_source: str | None = None
        self._tokenizer_loading = False
        if self.need_tokens and tokenizer is None:
            self._load_configured_tokenizer()
        keys: dict[str, str | None] = {}
        self.upstream_headers: dict[str, dict[str, str]] = {}
        for role in ROLES:
            group = config.group(role)
            key = group.worker_options.get("api_key") if group else None
            keys[role] = key
            headers = {"Content-Type": "application/json"}
            if key:  # the workers' own key; the client's (the router's) is not forwarded
                headers["Authorization"] = f"Bearer {key}"
            self.upstream_headers[role] = headers
        self.auth = UpstreamAuth(self.cluster_token, keys)
        self.membership = Membership(config, policy_configs, on_model_dir=self._discover,
                                     auth=self.auth)
        self.metrics = RouterMetrics(self.membership)
        self.membership.on_remove = lambda w: self.metrics.forget_worker(
            w.pool, self.policies[w.pool].name, w.url)
        self._background: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None
        # New connections only: the retry of a send whose pooled connection turned out stale.
        self.fresh_session: aiohttp.ClientSession | None = None
        self.max_retries = config.max_retries
        self.body_timeout_s = P.BODY_TIMEOUT_S  # then 408 (tests shorten it)
        self._trim_task: asyncio.Task[None] | None = None

    # -- tokenizer (only for policies that need prompt tokens) --------------------------------

    def _load_configured_tokenizer(self) -> None:
        """The tokenizer named by ``router.tokenizer`` or ``model`` (checkpoint folders)."""
        for role in ("generation", "context"):
            group = self.config.group(role)
            if group is None:
                continue
            for key, path in ((f"{role}_servers.router.tokenizer",
                               group.router.option("tokenizer")),
                              (f"{role}_servers.model", group.worker_options.get("model"))):
                if not path:
                    continue
                try:
                    self._set_tokenizer(str(path))
                except (OSError, ValueError) as e:
                    raise RouterConfigError(
                        f"{self.config.source}: {key}: cannot load the tokenizer the "
                        f"{self.policy_configs[role].type} router needs from {path!r}: {e}"
                    ) from None
                return
        # Not configured: taken from the first worker whose model_dir is readable here.
        logger.warning("no tokenizer configured (router.tokenizer or model): prompt-aware "
                       "routing waits for a worker's model_dir to be readable here")

    def _set_tokenizer(self, path: str) -> None:
        from disagg.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(path)
        self.tokenizer_source = path
        logger.info("router tokenizer: %s", path)

    def _discover(self, model_dir: str) -> None:
        if not self.need_tokens or self.tokenizer is not None or self._tokenizer_loading:
            return
        if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            return
        self._tokenizer_loading = True

        async def load() -> None:
            try:
                await asyncio.to_thread(self._set_tokenizer, model_dir)
            except (OSError, ValueError) as e:
                logger.warning("cannot load the tokenizer of %s: %s", model_dir, e)
            finally:
                self._tokenizer_loading = False

        self.membership.spawn(load())

    def route_request(self, endpoint: str, body: Mapping[str, Any]) -> RouteRequest:
        """The prompt's tokens as the workers will see them (for the policies); an empty
        request when they cannot be known here (the worker then reports any error)."""
        tok = self.tokenizer
        try:
            if endpoint == COMPLETIONS:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and all(
                        isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    return RouteRequest.from_token_ids(prompt)
                if isinstance(prompt, str) and tok is not None:
                    return RouteRequest.from_token_ids(tok.encode(prompt))
                return RouteRequest()
            messages = body.get("messages")
            if tok is None or not isinstance(messages, list):
                return RouteRequest()
            text = tok.apply_chat_template(
                [_chat_message(m) for m in messages],
                add_generation_prompt=body.get("add_generation_prompt", True) is not False)
            # As the worker does: the template writes the special tokens itself.
            return RouteRequest.from_token_ids(tok.encode(text, add_special_tokens=False))
        except Exception as e:  # malformed messages etc.: the worker answers the 400
            logger.debug("cannot tokenize the request for routing: %s", e)
            return RouteRequest()

    def prepared_route(self, path: str, body: Mapping[str, Any]) -> RouteRequest:
        """``route_request`` with the prompt already hashed for every block size in use."""
        route = self.route_request(path, body)
        if route.prompt is not None:
            for w in list(self.membership.by_url.values()):
                if w.kv is not None and w.kv.tokens_per_block:
                    route.prompt.for_block_size(w.kv.tokens_per_block)
        return route

    # -- lifecycle ----------------------------------------------------------------------------

    async def startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                        sock_read=self.config.upstream_timeout_sec)
        # One session, keep-alive connections, no pool limit (long streams must not starve
        # the others of connections).
        self.session = aiohttp.ClientSession(
            connector=_Connector(limit=0, limit_per_host=0, ttl_dns_cache=300,
                                 keepalive_timeout=UPSTREAM_KEEP_ALIVE_S),
            timeout=timeout, auto_decompress=False)
        self.fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=True),
            timeout=timeout, auto_decompress=False)
        await self.membership.start(self.session)
        trim = _malloc_trim()
        if trim is not None:
            self._trim_task = asyncio.get_running_loop().create_task(_trim_loop(trim))

    async def cleanup(self, app: web.Application) -> None:
        if self._trim_task is not None:
            self._trim_task.cancel()
        await self.membership.stop()
        for session in (self.session, self.fresh_session):
            if session is not None:
                await session.close()

    # -- helpers ------------------------------------------------------------------------------

    def check_auth(self, request: web.Request) -> None:
        key = self.config.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                  key.encode()):
            raise Reply.error(401, "invalid or missing API key (send 'Authorization: Bearer "
                              "<key>')", code="invalid_api_key")

    def pick(self, role: str, route: RouteRequest, exclude: set[str],
             avoid: set[str] | None = None) -> Decision | None:
        """The side's policy over its healthy workers minus ``exclude`` (and, when others
        remain, minus ``avoid``); None when no worker is left."""
        candidates = self.membership.candidates(role, exclude)
        if avoid:
            candidates = [w for w in candidates if w.url not in avoid] or candidates
        if not candidates:
            return None
        policy = self.policies[role]
        decision = policy.select(candidates, route)
        w = decision.worker
        self.metrics.decisions.labels(role, policy.name, w.url).inc()
        if policy.needs_kv_index and route.num_tokens:
            self.metrics.kv_prompt.labels(role).inc(route.num_tokens)
            if decision.matched_tokens:
                self.metrics.kv_matched.labels(role, w.url).inc(decision.matched_tokens)
        return decision

    def _no_worker(self, role: str, last: _Failed | None) -> Reply:
        if last is not None and last.reply is not None:
            return last.reply  # the worker's own error, passed through with its status
        if last is not None:
            return Reply.error(502, f"no {role} worker could serve the request (last: "
                               f"{last.why})", "upstream_error", code="upstream_failed")
        return Reply.error(503, f"no healthy {role} worker", "service_unavailable",
                           code="no_healthy_worker", outcome="no_worker")

    async def _post(self, w: Worker, role: str, path: str, data: bytes, signed: bool = False
                    ) -> aiohttp.ClientResponse:
        """Send (``signed``: with the cluster signature over ``data``); a failure to get
        response headers is ``_Failed``. A worker that refuses the connection is taken out of
        rotation at once; other failures count towards ``REQUEST_FAILURE_THRESHOLD``. A pooled
        keep-alive connection that the worker had already closed (reset or closed before any
        response byte: the worker never saw the request) is no failure: the send is repeated
        at once on a new connection (with a new signature: a nonce is accepted once)."""
        assert self.session is not None and self.fresh_session is not None
        url, base = w.base + path, self.upstream_headers[role]
        headers = {**base, **self.auth.signature("POST", path, data)} if signed else base
        _SENT_ON_USED.set(False)
        try:
            try:
                resp = await self.session.post(url, data=data, headers=headers)
            except aiohttp.ClientConnectorError:
                raise
            except _STALE_CONNECTION:
                if not _SENT_ON_USED.get():
                    raise
                logger.debug("%s: pooled connection was stale; sending again", w.url)
                if signed:
                    headers = {**base, **self.auth.signature("POST", path, data)}
                resp = await self.fresh_session.post(url, data=data, headers=headers)
        except aiohttp.ClientConnectorError as e:  # never connected: it saw nothing
            self.membership.mark_failed(w, f"unreachable: {e}")
            raise _Failed(f"{w.url}: {e}", reached=False) from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.membership.request_failed(w, f"failed: {type(e).__name__}: {e}")
            raise _Failed(f"{w.url}: {type(e).__name__}: {e}") from None
        w.request_failures = 0  # it answered
        return resp

    async def _error_answer(self, w: Worker, resp: aiohttp.ClientResponse) -> _Failed:
        """A worker's 5xx answer, as a retryable failure carrying it (for pass-through)."""
        try:
            body = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            body = _dumps(error_body(f"{w.url} answered {resp.status}", "upstream_error"))
        finally:
            resp.release()
        if resp.status == 503 and (b'"draining"' in body or b'"engine_unavailable"' in body):
            # what its /health says too: out until a check passes (a full queue is no reason)
            self.membership.mark_failed(w, "answered 503")
        kv = resp.status == 502 and b"kv_transfer_failed" in body
        return _Failed(f"{w.url} answered {resp.status}",
                       Reply(resp.status, body, resp.content_type or "application/json",
                             outcome="upstream_error"), kv_transfer=kv)

    # -- the generation (or whole) call -------------------------------------------------------

    async def call_and_relay(self, request: web.Request, st: _RequestState, w: Worker,
                             role: str, path: str, data: bytes, route: RouteRequest,
                             ctx_usage: Mapping[str, Any] | None = None,
                             signed: bool = False) -> web.StreamResponse:
        """One try on ``w``: relay its answer to the client. ``_Failed`` if it fails before
        the first byte reaches the client."""
        w.active_requests += 1
        w.active_tokens += route.num_tokens
        w.requests_total += 1
        t0 = time.monotonic()
        resp: aiohttp.ClientResponse | None = None
        try:
            resp = await self._post(w, role, path, data, signed)
            if resp.status >= 500:
                raise await self._error_answer(w, resp)
            if resp.content_type == "text/event-stream" and resp.status == 200:
                return await self._relay_stream(request, st, w, resp, t0, ctx_usage)
            try:
                body = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.membership.request_failed(w, f"failed mid-answer: {type(e).__name__}")
                raise _Failed(f"{w.url}: {type(e).__name__}: {e}") from None
            now = time.monotonic()
            self.metrics.gen_first_byte.observe(now - t0)
            self.metrics.gen_latency.observe(now - t0)
            if resp.status != 200:
                st.outcome = "client_error"
                return web.Response(status=resp.status, body=body,
                                    content_type=resp.content_type or "application/json")
            if ctx_usage is not None:
                answer = json.loads(body)
                _fix_usage(answer, ctx_usage)
                body = _dumps(answer)
            return web.Response(body=body, content_type="application/json")
        finally:
            w.active_requests -= 1
            w.active_tokens -= route.num_tokens
            if resp is not None:
                resp.close()  # a no-op when fully read; else drops the connection (aborts)

    async def _relay_stream(self, request: web.Request, st: _RequestState, w: Worker,
                            resp: aiohttp.ClientResponse, t0: float,
                            ctx_usage: Mapping[str, Any] | None) -> web.StreamResponse:
        out: web.StreamResponse | None = None
        pending = b""
        done = False
        try:
            async for chunk in resp.content.iter_any():
                data = pending + chunk if pending else chunk
                cut = data.rfind(b"\n\n")
                if cut < 0:  # no whole event yet
                    pending = data
                    continue
                events, pending = data[:cut + 2], data[cut + 2:]
                if ctx_usage is not None and b'"usage":{' in events:
                    events = _fix_stream_usage(events, ctx_usage)
                try:
                    if out is None:
                        self.metrics.gen_first_byte.observe(time.monotonic() - t0)
                        out = web.StreamResponse(status=200, headers=SSE_HEADERS)
                        await out.prepare(request)
                    await out.write(events)
                except ConnectionError:  # the client went away: the caller closes upstream
                    st.outcome = "disconnected"
                    return out or web.Response(status=499)
                done = events.endswith(DONE)
            if not done:
                raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            why = f"generation worker {w.url} failed mid-stream: {type(e).__name__}: {e}"
            if out is None:  # nothing sent yet: another worker may still serve it
                self.membership.request_failed(w, why)
                raise _Failed(why) from None
            logger.warning("%s", why)
            self.membership.request_failed(w, why)
            st.outcome = "stream_error"
            err = error_body(why, "upstream_error", code="upstream_failed")
            with contextlib.suppress(ConnectionError):
                await out.write(b"data: " + _dumps(err) + b"\n\n" + DONE)
        self.metrics.gen_latency.observe(time.monotonic() - t0)
        if out is None:  # an empty but complete stream
            out = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await out.prepare(request)
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out

    async def whole(self, request: web.Request, st: _RequestState, path: str, data: bytes,
                    route: RouteRequest, first: Worker | None = None) -> web.StreamResponse:
        """Send the request whole to generation workers (aggregated serving), with retries."""
        tried: set[str] = set()
        last: _Failed | None = None
        for attempt in range(self.max_retries + 1):
            if attempt == 0 and first is not None:
                w = first
            else:
                d = self.pick("generation", route, tried)
                if d is None:
                    break
                w = d.worker  # type: ignore[assignment]
            if last is not None:
                self.metrics.retries.labels("generation", _reason(last)).inc()
            tried.add(w.url)
            try:
                return await self.call_and_relay(request, st, w, "generation", path, data, route)
            except _Failed as f:
                last = f
        raise self._no_worker("generation", last)

    # -- the disaggregated flow ---------------------------------------------------------------

    async def context_call(self, path: str, data: bytes, route: RouteRequest, tried: set[str],
                           avoid: set[str], budget: list[int]) -> tuple[dict[str, Any], Worker]:
        """The context_only call with retries (``budget[0]``: context failures left)."""
        last: _Failed | None = None
        while True:
            d = self.pick("context", route, tried, avoid)
            if d is None:
                raise self._no_worker("context", last)
            w: Worker = d.worker  # type: ignore[assignment]
            w.active_requests += 1
            w.active_tokens += route.num_tokens
            w.requests_total += 1
            t0 = time.monotonic()
            resp = None
            try:
                resp = await self._post(w, "context", path, data)
                if resp.status >= 500:
                    raise await self._error_answer(w, resp)
                try:
                    body = await resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    self.membership.request_failed(w, f"failed mid-answer: "
                                                   f"{type(e).__name__}")
                    raise _Failed(f"{w.url}: {type(e).__name__}: {e}") from None
                self.metrics.ctx_latency.observe(time.monotonic() - t0)
                if resp.status != 200:
                    raise Reply(resp.status, body, resp.content_type or "application/json")
                try:
                    answer = json.loads(body)
                    if not isinstance(answer, dict) or "disaggregated_params" not in answer:
                        # (null means final; absent means this is no context worker's answer)
                        raise ValueError("no disaggregated_params")
                except ValueError as e:
                    raise _Failed(f"{w.url}: malformed context answer: {e}") from None
                return answer, w
            except _Failed as f:
                last = f
                tried.add(w.url)
                budget[0] -= 1
                if budget[0] < 0:
                    raise self._no_worker("context", last) from None
                self.metrics.retries.labels("context", _reason(f)).inc()
            finally:
                w.active_requests -= 1
                w.active_tokens -= route.num_tokens
                if resp is not None:
                    resp.close()

    async def disaggregated(self, request: web.Request, st: _RequestState, path: str,
                            body: dict[str, Any], route: RouteRequest,
                            first_gen: Worker | None) -> web.StreamResponse:
        ctx_body = dict(body)
        ctx_body["stream"] = False
        ctx_body.pop("stream_options", None)  # only valid with stream: true
        ctx_body["disaggregated_params"] = {"request_type": "context_only"}
        ctx_data = _dumps(ctx_body)
        ctx_tried: set[str] = set()
        ctx_avoid: set[str] = set()
        ctx_budget = [self.max_retries]
        gen_tried: set[str] = set()
        gen_failures = 0
        last: _Failed | None = None
        while True:
            answer, ctx_worker = await self.context_call(path, ctx_data, route, ctx_tried,
                                                         ctx_avoid, ctx_budget)
            dp = answer.pop("disaggregated_params", None)
            prompt_ids = answer.pop("prompt_token_ids", None)
            if dp is None:  # final after the first token: the context answer is the answer
                return await _final_answer(request, path, body, answer)
            gen_body = dict(body)
            gen_body["disaggregated_params"] = {**dp, "request_type": "generation_only"}
            if path == COMPLETIONS and prompt_ids is not None:
                gen_body["prompt"] = prompt_ids  # no second tokenization on the worker
            gen_data = _dumps(gen_body)
            ctx_usage = answer.get("usage") or {}
            # Whether a generation worker took the request (and so releases the lease on every
            # path); if we leave without one doing so (client gone, no generation worker
            # left), the context worker is told to free the KV now.
            taken = False
            try:
                while True:
                    if first_gen is not None and first_gen.healthy and not gen_tried:
                        w = first_gen
                    else:
                        d = self.pick("generation", route, gen_tried)
                        if d is None:
                            raise self._no_worker("generation", last)
                        w = d.worker  # type: ignore[assignment]
                    try:
                        out = await self.call_and_relay(request, st, w, "generation", path,
                                                        gen_data, route, ctx_usage, signed=True)
                        # A refusal (4xx) reads no KV: free the lease now, not at its expiry
                        # (idempotent should the worker have released it too).
                        taken = out.status < 400
                        return out
                    except _Failed as f:
                        last = f
                        gen_failures += 1
                        taken = f.reply is not None or f.kv_transfer  # it answered
                        if gen_failures > self.max_retries:
                            raise self._no_worker("generation", last) from None
                        if f.kv_transfer:
                            # The context side's fault (lease expired, worker gone): prefill
                            # again, elsewhere if possible; this generation worker is fine.
                            ctx_avoid.add(ctx_worker.url)
                            self.metrics.retries.labels("context", "kv_transfer_failed").inc()
                            break
                        gen_tried.add(w.url)
                        self.metrics.retries.labels("generation", _reason(f)).inc()
                        if f.reply is not None:
                            break  # it answered, so it released the lease: prefill again
                        # never reached, or died before answering: the lease may still be good
            finally:
                if not taken:
                    self._release_lease(ctx_worker, dp)

    def _release_lease(self, w: Worker, dp: Mapping[str, Any]) -> None:
        """Fire and forget: the context worker frees a lease no generation worker will read
        (idempotent there: a lease already confirmed or expired is left alone)."""
        lease_id = dp.get("ctx_request_id")
        if not isinstance(lease_id, str) or self.session is None:
            return
        task = asyncio.get_running_loop().create_task(self._post_release(w, lease_id))
        self._background.add(task)  # the loop only keeps weak references to tasks
        task.add_done_callback(self._background.discard)

    async def _post_release(self, w: Worker, lease_id: str) -> None:
        assert self.session is not None
        path = "/kv_leases/release"
        data = _dumps({"ctx_request_id": lease_id})
        headers = {"Content-Type": "application/json",
                   **self.auth.headers(w.pool, "POST", path, data)}
        try:
            async with self.session.post(w.base + path, headers=headers, data=data) as r:
                body = await r.read()
            if r.status == 200:
                self.metrics.lease_releases.inc()
            else:
                logger.info("lease %s on %s not released: %d %s", lease_id, w.url, r.status,
                            body[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.info("lease %s on %s not released: %r", lease_id, w.url, e)

    # -- handlers -----------------------------------------------------------------------------

    async def handle_openai(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        st = _RequestState(path)
        t0 = time.monotonic()
        try:
            self.check_auth(request)
            raw = await self.read_body(request)
            m = self.membership
            body: dict[str, Any] | None = None
            if m.disaggregated or self.need_tokens:
                body = _parse_body(raw)
                # The workers' own schema, once, before the context call: the context worker
                # gets the request with `stream` rewritten, so it alone cannot refuse what the
                # generation worker would (and would hold KV for a request nobody reads).
                try:
                    _normalize(body, P.validate_request(path, body))
                except P.APIError as e:
                    raise Reply.from_api_error(e) from None
            route = RouteRequest()
            if self.need_tokens and body is not None:
                if len(raw) > LARGE_BODY_BYTES:  # tokenizing and hashing take milliseconds:
                    route = await asyncio.to_thread(self.prepared_route, path, body)  # off-loop
                else:
                    route = self.route_request(path, body)
            if body is None or not m.disaggregated or not _splittable(path, body):
                return await self.whole(request, st, path, raw, route)
            first_gen = None
            cond = self.config.conditional_disagg
            if cond is not None and route.prompt is not None:
                d = self.pick("generation", route, set())
                if d is None:
                    raise self._no_worker("generation", None)
                first_gen = d.worker  # type: ignore[assignment]
                kv = first_gen.kv
                matched = kv.match(route.prompt) if kv is not None else 0
                if route.num_tokens - matched <= cond.max_local_prefill_length:
                    self.metrics.local_prefill.inc()
                    return await self.whole(request, st, path, raw, route, first_gen)
            return await self.disaggregated(request, st, path, body, route, first_gen)
        except Reply as r:
            st.outcome = r.outcome
            return r.response()
        except asyncio.CancelledError:
            st.outcome = "disconnected"
            raise
        except ConnectionError:  # the client went away while we wrote to it
            st.outcome = "disconnected"
            raise
        finally:
            self.metrics.requests.labels(path, st.outcome).inc()
            self.metrics.request_latency.observe(time.monotonic() - t0)

    async def read_body(self, request: web.Request) -> bytes:
        """The body, plain JSON (415 for a Content-Encoding), within ``body_timeout_s`` (408;
        a client that announced more than it sends would otherwise hold its handler), at
        most ``MAX_BODY_BYTES`` (413)."""
        try:
            P.check_content_encoding(request.headers.get("Content-Encoding"))
        except P.APIError as e:
            raise Reply.from_api_error(e, close=True) from None
        try:
            if request.content.is_eof():  # the usual case: it came with the headers
                return await request.read()
            return await asyncio.wait_for(request.read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise Reply.error(408, f"the request body did not arrive within "
                              f"{self.body_timeout_s:g} s", code="request_timeout",
                              close=True) from None
        except web.HTTPRequestEntityTooLarge:
            raise Reply.error(413, f"request body too large (at most {MAX_BODY_BYTES} bytes)",
                              code="body_too_large", close=True) from None

    async def handle_models(self, request: web.Request) -> web.Response:
        try:
            self.check_auth(request)
        except Reply as r:
            return r.response()
        assert self.session is not None
        tried: set[str] = set()
        for _ in range(self.max_retries + 1):
            d = self.pick("generation", RouteRequest(), tried)
            if d is None:
                break
            w: Worker = d.worker  # type: ignore[assignment]
            tried.add(w.url)
            try:
                async with self.session.get(
                        w.base + "/v1/models",
                        headers=self.auth.headers(w.pool, "GET", "/v1/models")) as r:
                    body = await r.read()
                    if r.status < 500:
                        return web.Response(status=r.status, body=body,
                                            content_type=r.content_type)
            except aiohttp.ClientConnectorError as e:
                self.membership.mark_failed(w, f"unreachable: {e}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.membership.request_failed(w, f"failed: {type(e).__name__}: {e}")
        return Reply.error(503, "no healthy generation worker", "service_unavailable",
                           code="no_healthy_worker").response()

    async def handle_health(self, request: web.Request) -> web.Response:
        ready, why = self.membership.ready()
        return web.json_response({"status": "ok" if ready else "unavailable", "reason": why},
                                 status=200 if ready else 503)

    def _api_key_ok(self, request: web.Request) -> bool:
        key = self.config.api_key
        if not key:
            return False
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                   key.encode())

    def _signature_error(self, request: web.Request, body: bytes) -> str | None:
        """Why ``request`` is not signed by the cluster (None: it is)."""
        if self.verifier is None:
            return "this router has no cluster token"
        try:
            self.verifier.check(request.headers.get(AUTH_HEADER), request.method,
                                request.raw_path, body)
        except AuthError as e:
            return str(e)
        return None

    async def handle_metrics(self, request: web.Request) -> web.Response:
        if (self.config.api_key and not self.config.public_metrics
                and not self._api_key_ok(request)):
            why = self._signature_error(request, b"")
            if why is not None:
                return Reply.error(401, f"/metrics: needs the API key ('Authorization: Bearer "
                                   f"<key>') or a cluster signature ({AUTH_HEADER}): {why}",
                                   "authentication_error", code="unauthorized").response()
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def handle_cluster_info(self, request: web.Request) -> web.Response:
        try:
            self.check_auth(request)
        except Reply as r:
            return r.response()
        info = self.membership.cluster_info()
        info["policies"] = {role: {"type": p.type, "use_tokens": p.use_tokens,
                                   "options": dict(p.options)}
                            for role, p in self.policy_configs.items()}
        info["conditional_disagg"] = (None if self.config.conditional_disagg is None else
                                      {"max_local_prefill_length":
                                       self.config.conditional_disagg.max_local_prefill_length})
        info["tokenizer"] = self.tokenizer_source
        return web.json_response(info)

    async def _membership_body(self, request: web.Request) -> dict[str, Any]:
        """The body of a signed /cluster/* call (open only with --insecure-membership)."""
        if self.config.disagg_cluster is None:
            raise Reply.error(404, "dynamic membership is off (no disagg_cluster in the "
                              f"router's config {self.config.source})", code="not_enabled")
        raw = await request.read()
        if self.verifier is not None:  # else: --insecure-membership (warned at start)
            why = self._signature_error(request, raw)
            if why is not None:
                raise Reply.error(401, f"{request.path}: needs a cluster signature "
                                  f"({AUTH_HEADER}): {why}", "authentication_error",
                                  code="invalid_cluster_signature")
        return _parse_body(raw)

    async def handle_register(self, request: web.Request) -> web.Response:
        try:
            payload = await self._membership_body(request)
            try:
                w = self.membership.register(payload)
            except ValueError as e:
                raise Reply.error(400, str(e), param=str(e).partition(":")[0]) from None
        except Reply as r:
            return r.response()
        dc = self.config.disagg_cluster
        assert dc is not None
        return web.json_response({"status": "registered", "url": w.url, "pool": w.pool,
                                  "heartbeat_interval_sec": dc.heartbeat_interval_sec,
                                  "inactive_timeout_sec": dc.inactive_timeout_sec})

    async def handle_unregister(self, request: web.Request) -> web.Response:
        try:
            payload = await self._membership_body(request)
            url = payload.get("url")
            if not isinstance(url, str):
                raise Reply.error(400, "url: expected 'host:port'", param="url")
        except Reply as r:
            return r.response()
        removed = self.membership.unregister(url)
        return web.json_response({"status": "unregistered" if removed else "unknown"})

    async def handle_not_found(self, request: web.Request) -> web.Response:
        return Reply.error(404, f"no route {request.method} {request.path}",
                           "not_found_error", code="not_found").response()


ROUTER_KEY = web.AppKey("router", Router)


# ---- pure helpers ---------------------------------------------------------------------------


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (musl, macOS: nothing to do)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


async def _trim_loop(trim: Any) -> None:
    while True:
        await asyncio.sleep(MALLOC_TRIM_INTERVAL_S)
        trim(0)


def _reason(f: _Failed) -> str:
    if f.kv_transfer:
        return "kv_transfer_failed"
    if f.reply is not None:
        return f"status_{f.reply.status}"
    return "unreachable" if not f.reached else "connection_failed"


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:  # the workers' parser: also refuses NaN, deep nesting, lone surrogates
        body = P.parse_json_object(raw)
    except P.APIError as e:
        raise Reply.from_api_error(e) from None
    if body.get("disaggregated_params") is not None:
        raise Reply.error(400, "disaggregated_params: set by the router, not by clients",
                          param="disaggregated_params")
    return body


def _normalize(body: dict[str, Any], req: Any) -> None:
    """``stream`` and ``include_usage`` as the workers read them (pydantic also takes "true",
    1, "false", ...), so that the router's own final answer agrees with theirs."""
    if "stream" in body and body["stream"] is not req.stream:
        body["stream"] = req.stream
    opts = body.get("stream_options")
    if isinstance(opts, dict) and "include_usage" in opts and (
            opts["include_usage"] is not req.stream_options.include_usage):
        body["stream_options"] = {**opts, "include_usage": req.stream_options.include_usage}


def _splittable(path: str, body: Mapping[str, Any]) -> bool:
    """Can the two calls carry it? One prompt and one choice (else it is served whole)."""
    if body.get("n", 1) not in (1, None):
        return False
    if path == COMPLETIONS:
        p = body.get("prompt")
        return isinstance(p, str) or (isinstance(p, list) and all(
            isinstance(t, int) for t in p))
    return True


def _chat_message(m: Any) -> Any:
    """A chat message as the worker hands it to the template (protocol.chat_messages)."""
    if not isinstance(m, dict):
        raise ValueError("message is not an object")
    msg = {k: v for k, v in m.items() if v is not None}
    content = m.get("content")
    if isinstance(content, list):
        msg["content"] = "".join(part["text"] for part in content)
    if msg.get("role") == "developer":
        msg["role"] = "system"
    return msg


def _fix_usage(obj: dict[str, Any], ctx_usage: Mapping[str, Any]) -> None:
    """Prompt tokens and cached tokens are the context side's (it did the prefill)."""
    usage = obj.get("usage")
    if not isinstance(usage, dict) or not ctx_usage:
        return
    prompt = ctx_usage.get("prompt_tokens", usage.get("prompt_tokens", 0))
    usage["prompt_tokens"] = prompt
    usage["total_tokens"] = prompt + int(usage.get("completion_tokens") or 0)
    cached = (ctx_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        usage["prompt_tokens_details"] = {**(usage.get("prompt_tokens_details") or {}),
                                          "cached_tokens": cached}


def _fix_stream_usage(events: bytes, ctx_usage: Mapping[str, Any]) -> bytes:
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            try:
                obj = json.loads(event[6:])
                _fix_usage(obj, ctx_usage)
                event = b"data: " + _dumps(obj)
            except ValueError:
                pass
        out.append(event)
    return b"\n\n".join(out)


async def _final_answer(request: web.Request, path: str, body: Mapping[str, Any],
                        answer: dict[str, Any]) -> web.StreamResponse:
    """The context worker's final answer, as a stream if the client asked for one."""
    if not body.get("stream"):
        return web.Response(body=_dumps(answer), content_type="application/json")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    chat = path == CHAT
    head = {"id": answer.get("id"), "object": "chat.completion.chunk" if chat
            else "text_completion", "created": answer.get("created"),
            "model": answer.get("model")}
    chunks: list[dict[str, Any]] = []

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        c = {**head, "choices": choices}
        if include_usage:
            c["usage"] = usage
        return c

    for ch in answer.get("choices", []):
        if chat:
            chunks.append(chunk([{"index": ch.get("index", 0), "delta": {
                "role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}]))
            text = (ch.get("message") or {}).get("content") or ""
            chunks.append(chunk([{"index": ch.get("index", 0),
                                  "delta": {"content": text} if text else {},
                                  "logprobs": ch.get("logprobs"),
                                  "finish_reason": ch.get("finish_reason"),
                                  "stop_reason": ch.get("stop_reason")}]))
        else:
            chunks.append(chunk([ch]))
    if include_usage:
        chunks.append(chunk([], answer.get("usage")))
    out = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await out.prepare(request)
    await out.write(b"".join(b"data: " + _dumps(c) + b"\n\n" for c in chunks) + DONE)
    await out.write_eof()
    return out


# ---- the app --------------------------------------------------------------------------------


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
                     cluster_token: str | None = None, insecure_membership: bool = False
                     ) -> web.Application:
    """The router as an aiohttp app (its startup connects to the workers). Run it with
    ``handler_cancellation=True`` (``start_router`` does) so that a client disconnect
    cancels the upstream requests. ``cluster_token``: default ``$DISAGG_CLUSTER_TOKEN``;
    RouterConfigError when there is none and the config needs one (``check_cluster_token``)."""
    router = Router(config, tokenizer=tokenizer, cluster_token=cluster_token,
                    insecure_membership=insecure_membership)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_guard])
    app[ROUTER_KEY] = router
    app.on_startup.append(router.startup)
    app.on_cleanup.append(router.cleanup)
    app.router.add_post(COMPLETIONS, router.handle_openai)
    app.router.add_post(CHAT, router.handle_openai)
    app.router.add_get("/v1/models", router.handle_models)
    app.router.add_get("/health", router.handle_health)
    app.router.add_get("/metrics", router.handle_metrics)
    app.router.add_get("/cluster_info", router.handle_cluster_info)
    app.router.add_post("/cluster/register", router.handle_register)
    app.router.add_post("/cluster/unregister", router.handle_unregister)
    app.router.add_route("*", "/{tail:.*}", router.handle_not_found)
    return app


async def start_router(app: web.Application, host: str, port: int, *,
                       keep_alive_s: float = KEEP_ALIVE_S) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0: a free port); returns the runner and the port.
    ``keep_alive_s``: idle keep-alive, and the time a request head has to arrive in."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=keep_alive_s, max_line_size=MAX_LINE_BYTES,
                           max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS,
                           lingering_time=LINGER_S,
                           auto_decompress=False)  # bodies are plain JSON (else 415)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    addresses = runner.addresses  # the bound sockets' names: the port the OS picked
    return runner, int(addresses[0][1]) if addresses else port
