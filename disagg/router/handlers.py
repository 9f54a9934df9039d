"""The router's HTTP handlers: the OpenAI endpoints (through ``flow``), ``/v1/models`` (and
``/v1/models/{id}``), CORS when ``allowed_origins`` is set (``cors``),
``/tokenize`` and ``/detokenize`` (a generation worker's answer), ``/version``, ``/health``,
``/metrics``, ``/cluster_info``, the membership calls ``/cluster/register`` and
``/cluster/unregister``, and the operator's ``POST /admin/role {"url", "role"}`` (cluster
signature; runs ``role_switch`` and answers when it ended: 200 done, 502 failed, 504 timeout;
400 a bad url / role or an aggregated worker, 404 an unknown worker, 409 code
``role_switch_in_progress`` while another switch runs).

An OpenAI request's body is parsed and checked with the workers' own schema
(``protocol.validate_request``) whenever the router reads it (disaggregated, or a policy needs
the prompt): a request the generation worker would refuse never reaches a context worker, which
would hold KV for a request nobody reads. Conditional disaggregation sends a request whole to
the chosen generation worker when it would prefill at most ``max_local_prefill_length``
uncached prompt tokens.

A client that disconnects cancels its handler (the server runs with handler cancellation):
the upstream connection is closed, so the worker aborts the request and frees its KV.

Timing (``disagg/timing.py``): every OpenAI request that succeeded has its phases observed in
``disagg_request_phase_seconds``; one whose body has ``"timing": true`` (a non-boolean is a 400
naming the field) or whose header ``X-Disagg-Timing`` says yes gets the whole request's
breakdown in its answer (``flow``, ``relay``).

Tracing (``disagg/tracing.py``; ``otlp_traces_endpoint``): with a tracer, each OpenAI request
continues the client's ``traceparent`` (or starts a trace), its calls carry theirs, and its
spans are made from its timeline once its handler ends (``Router.tracer`` None: one check).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from disagg import __version__, tracing
from disagg import timing as T
from disagg.cluster_auth import AUTH_HEADER, MEMBER_ID_FIELD, AuthError, bearer_ok
from disagg.contracts import protocol as P
from disagg.contracts.cluster import normalize_worker_url
from disagg.contracts.responses import ResponseStore
from disagg.contracts.roles import Role
from disagg.cors import Cors
from disagg.env import LAUNCH_ID
from disagg.procs import LAUNCH_ID_FIELD
from disagg.router.client_io import AiohttpStream, Answer, ClientStream
from disagg.router.cors import install as install_cors
from disagg.router.flow import Tries
from disagg.router.membership import Worker
from disagg.router.policies import RouteRequest
from disagg.router.processes import from_sibling, merge_metrics
from disagg.router.prompt_tokens import COMPLETIONS
from disagg.router.relay import RequestState
from disagg.router.replies import RETRY_AFTER_S, Reply, dumps, loads, parse_body
from disagg.router.responses import ResponsesRoutes
from disagg.router.role_switch import SwitchBusy, SwitchRefused
from disagg.router.router import Router
from disagg.router.upstream import Failed

LARGE_BODY_BYTES = 32 << 10  # requests above this are tokenized on a thread, not the loop


class Handlers:
    """The router's endpoints over one ``Router``."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.config = router.config
        # CORS (allowed_origins): aiohttp's answers (router.cors), front's own (cors.fields)
        self.cors = Cors(self.config.allowed_origins) if self.config.allowed_origins else None
        self.responses = ResponsesRoutes(self, ResponseStore(
            self.config.responses_store_size, self.config.responses_store_ttl))

    def register(self, app: web.Application) -> None:
        r = app.router
        if self.cors is not None:
            install_cors(app, self.cors)
        r.add_post(COMPLETIONS, self.openai)
        r.add_post("/v1/chat/completions", self.openai)
        r.add_get("/v1/models", self.models)
        # (a served name may hold "/": "org/model", which the SDK sends as org%2Fmodel)
        r.add_get("/v1/models/{model_id:.+}", self.model)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.tokenize)
        r.add_get("/version", self.version)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_get("/cluster_info", self.cluster_info)
        r.add_post("/cluster/register", self.register_worker)
        r.add_post("/cluster/unregister", self.unregister_worker)
        r.add_post("/admin/role", self.admin_role)
        self.responses.register(app)
        r.add_route("*", "/{tail:.*}", self.not_found)

    # -- the OpenAI endpoints -----------------------------------------------------------------

    async def openai(self, request: web.Request) -> web.StreamResponse:
        """The OpenAI endpoints as aiohttp serves them (``front`` serves the common case)."""
        out = AiohttpStream(request)
        answer = await self.serve_openai(out, request.path, request.headers.get("Authorization"),
                                         lambda: self.read_body(request),
                                         request.headers.get(T.HEADER),
                                         request.headers.get(tracing.HEADER))
        return out.to_response(answer)

    async def serve_openai(self, out: ClientStream, path: str, authorization: str | None,
                           read_body: Callable[[], Awaitable[bytes]],
                           timing_header: str | None = None,
                           traceparent: str | None = None) -> Answer:
        """One OpenAI request, whichever server carries it: ``authorization``, its header;
        ``read_body``, its body (raising ``Reply`` for a late, large or encoded one);
        ``timing_header``: its ``X-Disagg-Timing`` header; ``traceparent``: its W3C trace
        context (continued when the router traces)."""
        st = self.begin(path, traceparent)
        try:
            self.check_authorization(authorization)
            try:
                st.timing = T.header_asks(timing_header)
            except ValueError as e:
                raise Reply.error(400, str(e), param=T.HEADER) from None
            return await self.route(out, st, path, await read_body())
        except Reply as r:
            st.outcome = r.outcome
            return r.answer()
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            if not st.delivered:
                st.outcome = "disconnected"
            raise
        finally:
            self.end(st)

    def begin(self, path: str, traceparent: str | None) -> RequestState:
        """A client request to ``path`` comes in: its state, its trace begun (continuing
        ``traceparent``) when the router traces."""
        st = RequestState(path)
        tracer = self.router.tracer
        if tracer is not None:
            st.trace = tracer.begin(traceparent)
        return st

    def end(self, st: RequestState) -> None:
        """The request ended (answered, refused or abandoned): its count by outcome, its
        latency, its TTFT when its stream began, its phases when it succeeded, and its spans
        when traced."""
        end = time.monotonic()
        metrics = self.router.metrics
        metrics.child(metrics.requests, st.endpoint, st.outcome).inc()
        metrics.request_latency.observe(end - st.timeline.start)
        if st.first_byte_at is not None:  # a stream began (whatever came of it later)
            metrics.ttft.observe(st.first_byte_at - st.timeline.start)
        if st.outcome == "success":
            metrics.phases.observe_timeline(st.timeline)
        if st.trace is not None:  # (after the answer is written: not on its way)
            asyncio.get_running_loop().call_soon(_trace_request, self.router.tracer, st, end)

    async def route(self, out: ClientStream, st: RequestState, path: str, raw: bytes
                     ) -> Answer:
        """Send the request whole, or through the two calls (see ``flow``)."""
        router, flow = self.router, self.router.flow
        m = router.membership
        body, data = None, raw
        if m.disaggregated or router.need_tokens or st.timing or (
                self.config.max_migrations and b'"stream"' in raw) or b'"timing"' in raw:
            # (migration: a stream that may be resumed asks for its token ids, flow; a body
            # without that key is no stream, and an aggregated router need not parse it;
            # timing: the workers are asked for theirs)
            # The policies read the prompt: the schema's checks first. (The two calls need
            # none: the context worker checks the request as the generation worker would.)
            body, data = client_body(path, raw, check=router.need_tokens)
            asked = body.get(T.FIELD)
            why = T.field_error(asked)
            if why is not None:
                raise Reply.error(400, why, param=T.FIELD)
            st.timing = st.timing or asked is True
        route = RouteRequest()
        if router.need_tokens and body is not None:
            if len(raw) > LARGE_BODY_BYTES:  # tokenizing and hashing take milliseconds:
                route = await asyncio.to_thread(  # off the loop
                    router.tokens.prepared_route, path, body, router.block_sizes())
            else:
                route = router.route_request(path, body)
        if body is None or not m.disaggregated or not _splittable(path, body):
            return await flow.whole(out, st, path, raw, route, body=body)
        first_gen = None
        cond = self.config.conditional_disagg
        if cond is not None and route.prompt is not None:
            d = flow.pick(Role.GENERATION, route, set())
            if d is None:
                raise flow.no_worker(Role.GENERATION, None)
            first_gen = d.worker  # type: ignore[assignment]
            kv = first_gen.kv
            matched = kv.match(route.prompt) if kv is not None else 0
            if route.num_tokens - matched <= cond.max_local_prefill_length:
                router.metrics.local_prefill.inc()
                return await flow.whole(out, st, path, raw, route, first_gen, body)
        return await flow.disaggregated(out, st, path, body, data, route, first_gen)

    async def read_body(self, request: web.Request) -> bytes:
        """The body, plain JSON (415 for a Content-Encoding), within ``body_timeout_s`` (408;
        a client that announced more than it sends would otherwise hold its handler), at
        most ``MAX_BODY_BYTES`` (413)."""
        try:
            P.check_content_encoding(request.headers.get("Content-Encoding"))
        except P.APIError as e:
            raise Reply.from_api_error(e, close=True) from None
        timeout = self.router.body_timeout_s
        try:
            if request.content.is_eof():  # the usual case: it came with the headers
                return await request.read()
            return await asyncio.wait_for(request.read(), timeout)
        except asyncio.TimeoutError:
            raise late_body(timeout) from None
        except web.HTTPRequestEntityTooLarge:
            raise Reply.error(413, f"request body too large (at most {P.MAX_BODY_BYTES} bytes)",
                              code="body_too_large", close=True) from None

    async def models(self, request: web.Request) -> web.Response:
        """A generation worker's ``/v1/models`` (the next one when one fails)."""
        try:
            self.check_api_key(request)
            status, body, content_type = await self._models()
        except Reply as r:
            return r.response()
        return web.Response(status=status, body=body, content_type=content_type)

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: the model as a generation worker lists it, or 404
        ``model_not_found`` (a worker's refusal, a 401, is passed on)."""
        model_id = request.match_info["model_id"]
        try:
            self.check_api_key(request)
            status, body, content_type = await self._models()
            if status != 200:
                return web.Response(status=status, body=body, content_type=content_type)
            try:
                listed = loads(body).get("data") or []
            except (ValueError, AttributeError):
                raise Reply.error(502, "a generation worker's /v1/models is not a model list",
                                  "upstream_error", code="upstream_failed") from None
            card = next((m for m in listed if isinstance(m, dict) and m.get("id") == model_id),
                        None)
            if card is None:
                raise Reply.from_api_error(P.model_not_found(model_id))
        except Reply as r:
            return r.response()
        return web.Response(body=dumps(card), content_type="application/json")

    async def _models(self) -> tuple[int, bytes, str]:
        """A generation worker's ``/v1/models`` answer (``Reply`` 503 when none answers)."""
        try:
            tries = Tries(Role.GENERATION, self.config.max_retries, counted=False)
            return await self.router.flow.retrying(tries, RouteRequest(), self._models_of)
        except Reply:
            raise Reply.error(503, "no healthy generation worker", "service_unavailable",
                              code="no_healthy_worker") from None

    async def _models_of(self, w: Worker) -> tuple[int, bytes, str]:
        status, body, content_type = await self.router.upstream.get(w, "/v1/models")
        if status >= 500:
            raise Failed(f"{w.url} answered {status}")
        return status, body, content_type

    async def tokenize(self, request: web.Request) -> web.Response:
        """``/tokenize`` and ``/detokenize``: a generation worker's answer (every worker has
        the model's tokenizer; the next one when one fails)."""
        path = request.path
        try:
            self.check_api_key(request)
            raw = await self.read_body(request)
            tries = Tries(Role.GENERATION, self.config.max_retries, counted=False)
            status, body, content_type = await self.router.flow.retrying(
                tries, RouteRequest(), lambda w: self._post_to(w, path, raw))
        except Reply as r:
            return r.response()
        return web.Response(status=status, body=body, content_type=content_type)

    async def _post_to(self, w: Worker, path: str, raw: bytes) -> tuple[int, bytes, str]:
        upstream = self.router.upstream
        resp = await upstream.post(w, path, raw)
        try:
            if resp.status >= 500:
                raise await upstream.error_answer(w, resp)
            body = await upstream.read(w, resp)
            return resp.status, body, resp.content_type or "application/json"
        finally:
            resp.close()

    # -- the router's own endpoints -----------------------------------------------------------

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def health(self, request: web.Request) -> web.Response:
        ready, why = self.router.membership.ready()
        answer: dict[str, Any] = {"status": "ok" if ready else "unavailable", "reason": why}
        if self.router.verifier is not None:  # the audience of signatures to this router
            answer[MEMBER_ID_FIELD] = self.router.verifier.member_id
        launch_id = LAUNCH_ID.get()  # disagg launch's id of this child (procs.py)
        if launch_id:
            answer[LAUNCH_ID_FIELD] = launch_id
        return web.json_response(answer, status=200 if ready else 503,
                                 headers=None if ready else {"Retry-After": str(RETRY_AFTER_S)})

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's metrics; of every process, each sample labelled ``process``, when
        there are several (``processes``)."""
        sibling = from_sibling(request)
        if (self.config.api_key and not self.config.public_metrics and not sibling
                and not self._api_key_ok(request)):
            why = self._signature_error(request, b"")
            if why is not None:
                return Reply.error(401, f"/metrics: needs the API key ('Authorization: Bearer "
                                   f"<key>') or a cluster signature ({AUTH_HEADER}): {why}",
                                   "authentication_error", code="unauthorized").response()
        body, content_type = self.router.metrics.render()
        process = self.router.process
        if process.count > 1 and not sibling:
            texts = {i: b for i, b in (await self.router.siblings.gather("/metrics")).items()
                     if b is not None}
            texts[process.index] = body
            body = merge_metrics(texts)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def cluster_info(self, request: web.Request) -> web.Response:
        """The cluster as this process sees it; with several processes (``processes``) also
        ``process``, ``processes`` and ``per_process`` (every process's workers)."""
        sibling = from_sibling(request)
        try:
            if not sibling:
                self.check_api_key(request)
        except Reply as r:
            return r.response()
        info = self._own_cluster_info()
        process = self.router.process
        if process.count > 1 and not sibling:
            views = await self.router.siblings.gather("/cluster_info")
            per = {i: None if b is None else json.loads(b).get("workers")
                   for i, b in views.items()}
            per[process.index] = info.get("workers")
            info["process"], info["processes"] = process.index, process.count
            info["per_process"] = [{"process": i, "workers": per[i]} for i in sorted(per)]
        return web.json_response(info)

    def _own_cluster_info(self) -> dict[str, Any]:
        router = self.router
        info = router.membership.cluster_info()
        info["policies"] = {role: {"type": p.type, "use_tokens": p.use_tokens,
                                   "options": dict(p.options)}
                            for role, p in router.policy_configs.items()}
        info["conditional_disagg"] = (None if self.config.conditional_disagg is None else
                                      {"max_local_prefill_length":
                                       self.config.conditional_disagg.max_local_prefill_length})
        info["kv_streaming"] = self.config.kv_streaming
        info["tokenizer"] = router.tokens.source
        info["role_switches"] = router.switcher.public()
        info["planner"] = None if router.planner is None else router.planner.public()
        if router.planner is None and self.config.planner is not None:
            info["planner"] = {"config": self.config.planner.public(), "state": None,
                               "decisions": []}
        return info

    async def admin_role(self, request: web.Request) -> web.Response:
        """``POST /admin/role {"url", "role"[, "timeout_s"]}``: switch a worker's role."""
        try:
            w, role, timeout_s = await self._admin_role_body(request)
            switcher = self.router.switcher
            try:
                switcher.check(w, role)
            except SwitchRefused as e:
                raise Reply.error(400, str(e), param=str(e).partition(":")[0]) from None
            except SwitchBusy as e:
                raise Reply.error(409, str(e), code="role_switch_in_progress") from None
        except Reply as r:
            return r.response()
        if w.pool == role and w.role == role and w.switching is None:
            return web.json_response({"object": "role_switch", "url": w.url, "from": role,
                                      "to": role, "state": "done", "pool": w.pool})
        # Not cancelled with this handler (a client that stops waiting): a switch half done
        # would leave the worker out of every pool.
        result = await asyncio.shield(self.router.run_switch(w, role, timeout_s))
        status = {"done": 200, "timeout": 504}.get(result.outcome, 502)
        return web.json_response(result.public(), status=status)

    async def _admin_role_body(self, request: web.Request) -> tuple[Worker, str, float]:
        raw = await self.read_body(request)
        why = self._signature_error(request, raw)
        if why is not None:
            raise Reply.error(401, f"{request.path}: needs a cluster signature ({AUTH_HEADER}):"
                              f" {why}", "authentication_error", code="invalid_cluster_signature")
        body = parse_body(raw)
        try:
            url = normalize_worker_url(body.get("url"))
        except ValueError as e:
            raise Reply.error(400, f"url: {e}", param="url") from None
        role = body.get("role")
        if role not in (Role.CONTEXT, Role.GENERATION):
            raise Reply.error(400, f"role: must be context or generation, got {role!r}",
                              param="role")
        timeout_s = body.get("timeout_s", self.router.switch_timeout_s)
        if (not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool)
                or not 0 < timeout_s <= 3600):
            raise Reply.error(400, f"timeout_s: must be a number in (0, 3600], got "
                              f"{timeout_s!r}", param="timeout_s")
        w = self.router.membership.by_url.get(url)
        if w is None:
            raise Reply.error(404, f"url: {url} is not a worker of this router",
                              "not_found_error", code="unknown_worker", param="url")
        return w, str(role), float(timeout_s)

    async def register_worker(self, request: web.Request) -> web.Response:
        try:
            payload = await self._membership_body(request)
            try:
                w = self.router.membership.register(payload)
            except ValueError as e:
                raise Reply.error(400, str(e), param=str(e).partition(":")[0]) from None
        except Reply as r:
            return r.response()
        await self.router.siblings.forward(request)  # every router process (processes)
        dc = self.config.disagg_cluster
        assert dc is not None
        return web.json_response({"status": "registered", "url": w.url, "pool": w.pool,
                                  "heartbeat_interval_sec": dc.heartbeat_interval_sec,
                                  "inactive_timeout_sec": dc.inactive_timeout_sec})

    async def unregister_worker(self, request: web.Request) -> web.Response:
        try:
            payload = await self._membership_body(request)
            url = payload.get("url")
            if not isinstance(url, str):
                raise Reply.error(400, "url: expected 'host:port'", param="url")
        except Reply as r:
            return r.response()
        removed = self.router.membership.unregister(url)
        await self.router.siblings.forward(request)
        return web.json_response({"status": "unregistered" if removed else "unknown"})

    async def not_found(self, request: web.Request) -> web.Response:
        return Reply.error(404, f"no route {request.method} {request.path}",
                           "not_found_error", code="not_found").response()

    # -- access ---------------------------------------------------------------------------------

    def check_api_key(self, request: web.Request) -> None:
        """401 unless the client sent the router's API key (when it has one)."""
        self.check_authorization(request.headers.get("Authorization"))

    def check_authorization(self, authorization: str | None) -> None:
        """``check_api_key`` of an ``Authorization`` header's value."""
        if self.config.api_key and not bearer_ok(authorization or "", self.config.api_key):
            raise Reply.error(401, "invalid or missing API key (send 'Authorization: Bearer "
                              "<key>')", code="invalid_api_key")

    def _api_key_ok(self, request: web.Request) -> bool:
        return bearer_ok(request.headers.get("Authorization", ""), self.config.api_key)

    def _signature_error(self, request: web.Request, body: bytes) -> str | None:
        """Why ``request`` is not signed by the cluster (None: it is)."""
        verifier = self.router.verifier
        if verifier is None:
            return "this router has no cluster token"
        try:
            verifier.check(request.headers.get(AUTH_HEADER), request.method,
                           request.raw_path, body)
        except AuthError as e:
            return str(e)
        return None

    async def _membership_body(self, request: web.Request) -> dict[str, Any]:
        """The body of a signed /cluster/* call (open only with --insecure-membership)."""
        if self.config.disagg_cluster is None:
            raise Reply.error(404, "dynamic membership is off (no disagg_cluster in the "
                              f"router's config {self.config.source})", code="not_enabled")
        raw = await request.read()
        if self.router.verifier is not None:  # else: --insecure-membership (warned at start)
            why = self._signature_error(request, raw)
            if why is not None:
                raise Reply.error(401, f"{request.path}: needs a cluster signature "
                                  f"({AUTH_HEADER}): {why}", "authentication_error",
                                  code="invalid_cluster_signature")
        return parse_body(raw)


def _trace_request(tracer: tracing.Tracer | None, st: RequestState, end: float) -> None:
    """The request's spans (``tracing``): its root from its start to ``end``, one per phase
    of its timeline (the calls' spans carry the ids their ``traceparent`` named)."""
    assert tracer is not None and st.trace is not None
    tracer.request_spans(st.trace, f"POST {st.endpoint}", st.timeline.start, st.timeline.ends,
                         end, tracing.router_request_attributes(st.endpoint, st.outcome),
                         None if st.outcome in ("success", "client_error") else st.outcome,
                         tracing.ROUTER_CALLS)


def late_body(timeout_s: float) -> Reply:
    """The answer to a request whose body did not arrive within ``timeout_s``."""
    return Reply.error(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout", close=True)


def client_body(path: str, raw: bytes, check: bool) -> tuple[dict[str, Any], bytes]:
    """The client's JSON object and the bytes the workers get for it: ``raw`` as it came
    unless the router changed the body (a batch of one prompt unwrapped). ``check``: also
    with the workers' own schema (400), ``stream`` and ``include_usage`` normalized."""
    body = parse_body(raw)
    if check:
        try:
            _normalize(body, P.validate_request(path, body))
        except P.APIError as e:
            raise Reply.from_api_error(e) from None
    if path == COMPLETIONS and _unwrap_single_prompt(body):
        return body, dumps(body)
    return body, raw


def _normalize(body: dict[str, Any], req: Any) -> None:
    """``stream`` and ``include_usage`` as the workers read them (pydantic also takes "true",
    1, "false", ...), so that the router's own final answer agrees with theirs."""
    if "stream" in body and body["stream"] is not req.stream:
        body["stream"] = req.stream
    opts = body.get("stream_options")
    if isinstance(opts, dict) and "include_usage" in opts and (
            opts["include_usage"] is not req.stream_options.include_usage):
        body["stream_options"] = {**opts, "include_usage": req.stream_options.include_usage}


def _unwrap_single_prompt(body: dict[str, Any]) -> bool:
    """A batch of one prompt (``["text"]`` or ``[[ids]]``: lm-evaluation-harness sends its
    token ids so) as that prompt: the answer is the same (one prompt's choices are indexed
    from 0 either way), and the two calls, the policies' token view and the context worker's
    scoring can then carry it instead of a generation worker serving it whole."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or (
            isinstance(p[0], list) and p[0] and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p[0]))):
        body["prompt"] = p[0]
        return True
    return False


def _splittable(path: str, body: Mapping[str, Any]) -> bool:
    """Can the two calls carry it? One prompt and one choice (else it is served whole)."""
    if body.get("n", 1) not in (1, None):
        return False
    if path == COMPLETIONS:
        p = body.get("prompt")
        return isinstance(p, str) or (isinstance(p, list) and all(
            isinstance(t, int) for t in p))
    return True
