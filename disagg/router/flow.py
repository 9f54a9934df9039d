"""The router's request flow: which workers serve a request, in one call or two, with retries.

A disaggregated request takes two calls. The context call sends the client's request as it
came (``stream`` as asked: a context worker answers a context_only request whole, and checks
it as the generation worker will) to a context worker with ``disaggregated_params:
{request_type: context_only}``; the worker prefills, samples the first token, keeps the
prompt's KV under a lease and answers with the params that locate it (or with
``disaggregated_params: null`` when the first token already ended the request: that answer is
the client's). The generation call sends the request again to a generation worker with those
params and ``request_type: generation_only``: they carry the context worker's
``prompt_token_ids`` (no second tokenization) and ``cached_tokens`` (its usage reports the
context side's prefill). It pulls the KV, decodes and its answer is relayed to the client
as it comes. Neither call encodes the request again (``replies.with_params``).

Retries (``max_retries`` failures per side, one helper: ``retrying``): a connection failure or
a 5xx before the first byte reached the client tries another worker of that side. After a
generation worker failed, the lease decides what is retried: a worker that never saw the request
leaves the lease intact (same context answer, next generation worker), as does one that
refused it with 503 ``role_switching`` (it is changing roles: ``role_switch``); one that
answered another error released it (prefill again); a failed KV pull (error code
``kv_transfer_failed``) is the context side's fault (prefill again, on another context worker
if there is one; the generation worker stays in the running). A 4xx is the client's answer at
once. When no generation worker took the request, the context worker is asked to free the
lease now (``/kv_leases/release``).

A request sent whole (aggregated cluster, several prompts, ``n > 1``, or conditional
disaggregation's local prefill) takes the generation side's retries alone.

Migration (``max_migrations`` per request): a generation worker that fails after it took the
request (reached, then the connection lost before its answer or mid-stream, or an in-band server
error) does not end it. The request goes whole (``request_type: context_and_generation``) to
another generation worker (or, when none is left, to a context worker, which serves it as an
aggregated worker would): when nothing reached the client, as it came (a restart: greedy and
seeded outputs are the same); when the client's stream began, as a resumed request
(``disaggregated_params.resume``: the token ids of the events relayed, which the workers sent in
the stream because the router asked, and the answer's id and time): that worker recomputes the
prompt and those tokens and streams the rest of the same answer (``server/disagg_requests``).
Only a stream the next worker can continue exactly is resumed (``resumable``: one prompt, one
choice, no echo, no tools); another one ends with an ``upstream_failed`` error event as before.
Moves do not count against ``max_retries``; a worker that cannot be reached for one does.

Timing (``disagg/timing.py``, ``relay``): every call stamps the request's timeline (the
context answer read ends ``context_call``); when the client asked for its timing, each worker
call carries ``disaggregated_params.timing: true`` and the context answer's own ``timing`` is
kept for the breakdown (``RequestState.ctx_timing``), which the client's answer then carries.

KV prefix reuse across workers (a side's kv_cache_aware policy with ``peer_reuse``): when the
policy's decision names a peer (a worker holding a longer prefix of the prompt than the one
chosen: ``policies.KVCacheAwarePolicy``), the try asks that peer for a lease on it (signed
``POST /kv_prefix``, at most ``upstream.PREFIX_TIMEOUT_S``; any failure: the try goes on
without) and forwards the request with the lease as its top-level ``kv_prefix``, signed: the
chosen worker pulls the blocks and gives the lease back. Unless that worker answered (< 400),
the router gives the lease back itself (``/kv_leases/release`` to the peer: it failed before
answering, refused the request, or the client left); a retry on another worker asks for a
new lease if its own decision names a peer. Where: requests sent whole in an aggregated
cluster and the context call of the two calls (never a generation_only call; in a
disaggregated cluster the generation side is given no peers).

With ``kv_streaming`` the router's flow is ``stream_flow.StreamingFlow``: its ``first_try``
sends both calls at once (the generation worker streams the KV layer by layer) and, when that
fails before the client got anything, hands the request to the two calls here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from disagg import timing
from disagg.contracts.roles import RequestType, Role
from disagg.router.client_io import STREAMED, Answer, ClientStream
from disagg.router.membership import Membership, Worker
from disagg.router.metrics import RouterMetrics
from disagg.router.policies import Decision, RouteRequest, RoutingPolicy
from disagg.router.prompt_tokens import CHAT, COMPLETIONS
from disagg.router.relay import (
    Interrupted,
    Relay,
    RequestState,
    call_sent,
    counted,
    final_answer,
)
from disagg.router.replies import PARAMS_KEY, Reply, dumps, loads, with_fields, with_params
from disagg.router.upstream import (
    KV_PREFIX,
    Failed,
    PrefixError,
    PrefixLease,
    UpstreamClient,
    error_code,
)

T = TypeVar("T")
ROLE_SWITCHING = "role_switching"  # a worker's 503 code while it changes roles (role_switch)
CONTEXT_ONLY = {"request_type": RequestType.CONTEXT_ONLY.value}
CONTEXT_ONLY_JSON = dumps(CONTEXT_ONLY)
WHOLE = {"request_type": RequestType.CONTEXT_AND_GENERATION.value}
# A request sent whole that reports its stream's token ids (a resumable one: migration).
WHOLE_WITH_IDS = {"request_type": RequestType.CONTEXT_AND_GENERATION.value, "token_ids": True}
WHOLE_WITH_IDS_JSON = dumps(WHOLE_WITH_IDS)
logger = logging.getLogger("disagg.router")


@dataclass
class Tries:
    """One side's tries for one client request: which workers failed, how many failures are
    left, and the retry the next try is (its metric label, counted when that try starts)."""

    role: Role
    budget: int  # failures allowed before giving up (max_retries)
    first: Worker | None = None  # the worker to try first (conditional disaggregation's pick)
    tried: set[str] = field(default_factory=set)  # not picked again
    avoid: set[str] = field(default_factory=set)  # picked only when no other is left
    failures: int = 0
    last: Failed | None = None
    retry_reason: tuple[str, str] | None = None  # (role, reason) of the next try's retry
    counted: bool = True  # its retries count in disagg_router_retries_total (not /v1/models')
    decision: Decision | None = None  # the policy's decision for the worker of the current try

    def failed(self, w: Worker, f: Failed, exclude: bool = True) -> None:
        """Record ``f`` on ``w`` (``exclude``: never pick ``w`` again for this request)."""
        self.last = f
        self.failures += 1
        if exclude:
            self.tried.add(w.url)
        self.retry_reason = (self.role.value, f.reason)

    @property
    def exhausted(self) -> bool:
        return self.failures > self.budget


class RequestFlow:
    """Picks workers with the sides' policies and runs a request's calls with retries."""

    def __init__(self, policies: Mapping[str, RoutingPolicy], membership: Membership,
                 metrics: RouterMetrics, upstream: UpstreamClient, relay: Relay,
                 max_retries: int, max_migrations: int = 0) -> None:
        self.policies = policies
        self.membership = membership
        self.metrics = metrics
        self.upstream = upstream
        self.relay = relay
        self.max_retries = max_retries
        self.max_migrations = max_migrations

    # -- picking -------------------------------------------------------------------------------

    def pick(self, role: Role, route: RouteRequest, exclude: set[str],
             avoid: set[str] | None = None) -> Decision | None:
        """The side's policy over its healthy workers minus ``exclude`` (and, when others
        remain, minus ``avoid``); None when no worker is left."""
        candidates = self.membership.candidates(role, exclude)
        if avoid:
            candidates = [w for w in candidates if w.url not in avoid] or candidates
        if not candidates:
            return None
        policy = self.policies[role]
        peers: list[Worker] = []
        # (a generation worker of a disaggregated cluster gets generation_only requests, which
        # take no kv_prefix)
        if policy.needs_peers and route.prompt is not None and (
                role == Role.CONTEXT or not self.membership.disaggregated):
            peers = self.membership.peers()
        decision = policy.select(candidates, route, peers)
        w = decision.worker
        self.metrics.child(self.metrics.decisions, role, policy.name, w.url).inc()
        if policy.needs_kv_index and route.num_tokens:
            self.metrics.child(self.metrics.kv_prompt, role).inc(route.num_tokens)
            if decision.matched_tokens:
                self.metrics.child(self.metrics.kv_matched, role, w.url).inc(
                    decision.matched_tokens)
        return decision

    @staticmethod
    def no_worker(role: Role, last: Failed | None) -> Reply:
        """The client's answer when no worker of ``role`` served the request."""
        if last is not None and last.reply is not None:
            return last.reply  # the worker's own error, passed through with its status
        if last is not None:
            return Reply.error(502, f"no {role} worker could serve the request (last: "
                               f"{last.why})", "upstream_error", code="upstream_failed")
        return Reply.error(503, f"no healthy {role} worker", "service_unavailable",
                           code="no_healthy_worker", outcome="no_worker")

    def next_worker(self, tries: Tries, route: RouteRequest) -> Worker:
        """The worker of the side's next try (``Reply`` when none is left)."""
        w = tries.first
        if w is None or not w.healthy or tries.tried:
            d = self.pick(tries.role, route, tries.tried, tries.avoid)
            if d is None:
                raise self.no_worker(tries.role, tries.last)
            tries.decision = d
            w = d.worker  # type: ignore[assignment]
        elif tries.decision is not None and tries.decision.worker is not w:
            tries.decision = None  # (a first worker picked elsewhere: no decision of ours)
        if tries.retry_reason is not None:
            if tries.counted:
                self.metrics.retries.labels(*tries.retry_reason).inc()
            tries.retry_reason = None
        return w

    async def retrying(self, tries: Tries, route: RouteRequest,
                       call: Callable[[Worker], Awaitable[T]],
                       on_failure: Callable[[Worker, Failed], bool] | None = None) -> T:
        """The one retry loop: ``call`` on the side's workers until one does not raise ``Failed``.
        ``on_failure`` records a failure on ``tries`` itself and returns whether the caller
        must take over (the failure is raised on); by default the worker is excluded and the
        next one tried. ``Reply`` when the budget is spent or no worker is left."""
        while True:
            w = self.next_worker(tries, route)
            try:
                return await call(w)
            except Failed as f:
                if on_failure is None:
                    tries.failed(w, f)
                    stop = False
                else:
                    stop = on_failure(w, f)
                if tries.exhausted:
                    raise self.no_worker(tries.role, tries.last) from None
                if stop:
                    raise

    # -- one call: the request whole ----------------------------------------------------------

    async def whole(self, out: ClientStream, st: RequestState, path: str, data: bytes,
                    route: RouteRequest, first: Worker | None = None,
                    body: dict[str, Any] | None = None) -> Answer:
        """Send the request whole to generation workers (aggregated serving), with retries
        (``body``: ``data`` parsed, when the router parsed it: a stream may then be resumed)."""
        self.allow_moves(st, path, body)
        sent = data
        params: dict[str, Any] | None = None
        if st.timing:  # (the handler parsed the body of a request that asks for timing)
            assert body is not None
            params = {**(WHOLE_WITH_IDS if st.ids_asked else WHOLE), timing.FIELD: True}
            sent = with_params(data, body, params)
        elif st.ids_asked:
            assert body is not None
            params = WHOLE_WITH_IDS
            sent = with_params(data, body, WHOLE_WITH_IDS, WHOLE_WITH_IDS_JSON)
        tries = Tries(Role.GENERATION, self.max_retries, first)

        async def call(w: Worker) -> Answer:
            lease = None if body is None else await self.prefix_lease(tries, w, route)
            if lease is None:
                return await self.relay.call_and_relay(out, st, w, path, sent, route)
            assert body is not None
            fields = {KV_PREFIX: lease.params} if params is None else {
                PARAMS_KEY: params, KV_PREFIX: lease.params}
            answer = None
            try:
                answer = await self.relay.call_and_relay(
                    out, st, w, path, with_fields(data, body, fields), route, signed=True)
                return answer
            finally:
                self.prefix_done(lease, answer is not None and answer.status < 400)

        try:
            return await self.retrying(tries, route, call)
        except Interrupted as cut:
            return await self.migrate(out, st, path, body, data, route, cut)

    # -- KV prefix reuse across workers (module docstring) ------------------------------------

    async def prefix_lease(self, tries: Tries, w: Worker, route: RouteRequest
                           ) -> PrefixLease | None:
        """The lease of the peer that ``tries``' decision for ``w`` names, or None (no peer
        named, none leased, or the call failed: the try goes on without)."""
        d = tries.decision
        if d is None or d.peer is None or d.worker is not w or route.prompt is None:
            return None
        peer: Worker = d.peer  # type: ignore[assignment]
        metrics = self.metrics
        # ``w`` is this request's already while it waits: other requests' decisions see it.
        w.active_requests += 1
        w.active_tokens += route.num_tokens
        try:
            lease = await self.upstream.ask_prefix(peer, route.prompt.token_ids)
        except PrefixError as e:
            logger.info("no prefix lease for %s: %s", w.url, e)
            metrics.child(metrics.kv_prefix, "failed").inc()
            return None
        finally:
            w.active_requests -= 1
            w.active_tokens -= route.num_tokens
        if lease is None:
            metrics.child(metrics.kv_prefix, "none").inc()
            return None
        metrics.child(metrics.kv_prefix, "got").inc()
        metrics.kv_prefix_tokens.inc(lease.num_tokens)
        return lease

    def prefix_done(self, lease: PrefixLease, taken: bool) -> None:
        """The try that carried ``lease`` ended: the peer frees it unless the chosen worker
        took the request (which gives it back itself; a release is idempotent there)."""
        if not taken:
            self.upstream.release_lease(lease.peer, lease.lease_id,
                                        self.metrics.kv_prefix_releases)

    # -- migration --------------------------------------------------------------------------

    def allow_moves(self, st: RequestState, path: str, body: Mapping[str, Any] | None) -> None:
        """The request may move ``max_migrations`` times; its stream reports token ids when
        it could be resumed."""
        st.migrations_left = self.max_migrations
        st.ids_asked = self.max_migrations > 0 and body is not None and resumable(path, body)

    async def migrate(self, out: ClientStream, st: RequestState, path: str,
                      body: dict[str, Any] | None, data: bytes, route: RouteRequest,
                      cut: Interrupted) -> Answer:
        """Move the request after ``cut`` (module docstring): whole to another generation
        worker (a context worker when none is left), resumed after what the client got; again
        when that one fails too, while moves are left. When none can take it, the client's
        stream ends with an error event (a request whose answer had not begun gets the last
        worker's error)."""
        gen = Tries(Role.GENERATION, self.max_retries)
        # With no generation worker left, a context worker serves it whole (as an aggregated
        # one would): the client's stream goes on. (One set of failed workers for both.)
        ctx = Tries(Role.CONTEXT, self.max_retries, tried=gen.tried)
        while True:
            gen.tried.add(cut.worker.url)
            tries = gen
            if not self.membership.candidates(Role.GENERATION, gen.tried) and (
                    self.membership.candidates(Role.CONTEXT, ctx.tried)):
                tries = ctx
            tries.last = cut.failed  # (the client's error if no worker is left)
            st.migrations_left -= 1
            st.moved = True  # (the breakdown: the router's own phases from here)
            kind = "resume" if st.started else "restart"
            self.metrics.migrations.labels(kind).inc()
            logger.warning("moving the request to another worker (%s, %d token(s) relayed): "
                           "%s", kind, len(st.token_ids or ()), cut.why)
            sent = data
            if body is not None:
                params: dict[str, Any] = {
                    "request_type": RequestType.CONTEXT_AND_GENERATION.value}
                if st.ids_asked:
                    params["token_ids"] = True
                if st.timing:
                    params[timing.FIELD] = True
                if st.started:
                    assert st.answer_id is not None and st.token_ids is not None
                    params["resume"] = {"output_token_ids": st.token_ids,
                                        "id": st.answer_id[0], "created": st.answer_id[1]}
                sent = with_params(data, body, params)
            try:
                answer = await self.retrying(tries, route, lambda w, sent=sent: (
                    self.relay.call_and_relay(out, st, w, path, sent, route)))
            except Interrupted as again:
                cut = again
                continue
            except Reply as r:
                if not st.started:
                    raise
                await self.relay.end_with_error(out, st, "no worker could continue the "
                                                f"stream: {r.body[:300].decode(errors='replace')}")
                return STREAMED
            if st.started and not answer.streamed and answer.status != 499:
                # a refusal (4xx) after the stream began: the client cannot get it as such
                await self.relay.end_with_error(out, st, "the worker continuing the stream "
                                                f"refused it: {answer.status} "
                                                f"{answer.body[:300].decode(errors='replace')}")
                return STREAMED
            return answer

    # -- two calls: the disaggregated flow ----------------------------------------------------

    async def disaggregated(self, out: ClientStream, st: RequestState, path: str,
                            body: dict[str, Any], data: bytes, route: RouteRequest,
                            first_gen: Worker | None) -> Answer:
        """A disaggregated request (``body``, sent to the workers as ``data``: see
        ``replies.with_params``): ``first_try`` (a subclass's other way), else (or when it
        fell back) the two calls, with the tries that ``first_try`` recorded."""
        ctx = Tries(Role.CONTEXT, self.max_retries)
        gen = Tries(Role.GENERATION, self.max_retries, first_gen)
        self.allow_moves(st, path, body)
        try:
            answer = await self.first_try(out, st, path, body, data, route, ctx, gen)
            if answer is not None:
                return answer
            return await self.two_calls(out, st, path, body, data, route, ctx, gen)
        except Interrupted as cut:
            return await self.migrate(out, st, path, body, data, route, cut)

    async def first_try(self, out: ClientStream, st: RequestState, path: str,
                        body: dict[str, Any], data: bytes, route: RouteRequest, ctx: Tries,
                        gen: Tries) -> Answer | None:
        """A subclass's way to serve a disaggregated request before the two calls
        (``stream_flow``); None: the two calls serve it, with the failures, retries and picks
        recorded on ``ctx`` and ``gen``."""
        return None

    async def close(self) -> None:
        """Stop the flow's own background work (a subclass's; none here)."""

    async def two_calls(self, out: ClientStream, st: RequestState, path: str,
                        body: dict[str, Any], data: bytes, route: RouteRequest, ctx: Tries,
                        gen: Tries) -> Answer:
        """The context call, then the generation call with its answer (module docstring)."""
        ctx_params = {**CONTEXT_ONLY, timing.FIELD: True} if st.timing else CONTEXT_ONLY
        ctx_data = (with_params(data, body, ctx_params) if st.timing
                    else with_params(data, body, CONTEXT_ONLY, CONTEXT_ONLY_JSON))

        async def context_try(w: Worker) -> tuple[Worker, dict[str, Any]]:
            lease = await self.prefix_lease(ctx, w, route)
            if lease is None:
                return await self._context_call(st, w, path, ctx_data, route)
            taken = False
            try:
                result = await self._context_call(st, w, path, with_fields(
                    data, body, {PARAMS_KEY: ctx_params, KV_PREFIX: lease.params}), route,
                    signed=True)
                taken = True  # it answered 200: it had the lease
                return result
            finally:
                self.prefix_done(lease, taken)

        while True:
            ctx_worker, answer = await self.retrying(ctx, route, context_try)
            dp = answer.pop("disaggregated_params", None)
            answer.pop("prompt_token_ids", None)  # (also in dp: the generation worker's)
            if dp is None:  # final after the first token: the context answer is the answer
                return await final_answer(out, path, body, answer, st)
            gen_params = {**dp, "request_type": RequestType.GENERATION_ONLY.value}
            if st.ids_asked:
                gen_params["token_ids"] = True
            if st.timing:
                gen_params[timing.FIELD] = True
            gen_data = with_params(data, body, gen_params)
            lease = _Lease(ctx_worker, dp, gen_data, requested_tokens(path, body))
            try:
                return await self._generation(out, st, path, route, gen, ctx, lease)
            except Failed:
                continue  # the lease is gone: prefill again
            finally:
                if not lease.taken:
                    self.upstream.release_lease(ctx_worker, dp.get("ctx_request_id"))

    async def _context_call(self, st: RequestState, w: Worker, path: str, data: bytes,
                            route: RouteRequest, signed: bool = False
                            ) -> tuple[Worker, dict[str, Any]]:
        """One context_only try on ``w``: its answer (a 4xx is the client's answer), its own
        timing taken out of it (``st.ctx_timing``). ``signed``: it carries a kv_prefix."""
        t0 = time.monotonic()
        call_sent(st, t0)
        resp = None
        with counted(w, route):
            try:
                resp = await self.upstream.post(
                    w, path, data, signed,
                    trace=b"" if st.trace is None else st.trace.call(timing.CONTEXT_CALL, w.url))
                if resp.status >= 500:
                    raise await self.upstream.error_answer(w, resp)
                body = await self.upstream.read(w, resp)
                dt = time.monotonic() - t0
                self.metrics.ctx_latency.observe(dt)
                if resp.status == 200:
                    self.membership.load.context(dt)  # the planner's TTFT sample
                if resp.status != 200:
                    raise Reply(resp.status, body, resp.content_type or "application/json")
                try:
                    answer = loads(body)
                    if not isinstance(answer, dict) or "disaggregated_params" not in answer:
                        # (null means final; absent means this is no context worker's answer)
                        raise ValueError("no disaggregated_params")
                except ValueError as e:
                    raise Failed(f"{w.url}: malformed context answer: {e}") from None
                st.timeline.end(timing.CONTEXT_CALL, t0 + dt)
                worker_timing = answer.pop(timing.FIELD, None)
                st.ctx_timing = (timing.Breakdown.from_json(worker_timing)
                                 if worker_timing is not None else None)
                return w, answer
            finally:
                if resp is not None:
                    resp.close()

    async def _generation(self, out: ClientStream, st: RequestState, path: str,
                          route: RouteRequest, gen: Tries, ctx: Tries, lease: _Lease
                          ) -> Answer:
        """The generation tries over one context answer. ``Failed`` when the lease is gone
        and the caller must prefill again."""

        def on_failure(w: Worker, f: Failed) -> bool:
            lease.taken = f.reply is not None or f.kv_transfer  # it answered
            if f.kv_transfer:
                # The context side's fault (lease expired, worker gone): prefill again,
                # elsewhere if possible; this generation worker is fine.
                gen.failed(w, f, exclude=False)
                gen.retry_reason = None
                ctx.avoid.add(lease.ctx_worker.url)
                ctx.retry_reason = (Role.CONTEXT.value, f.reason)
                return True
            gen.failed(w, f)
            if f.reply is not None and f.reply.status == 503 and error_code(
                    f.reply.body) == ROLE_SWITCHING:
                return False  # refused before reading anything: the lease is intact
            return f.reply is not None  # it answered, so it released the lease
            # (else never reached, or died before answering: the lease may still be good)

        async def call(w: Worker) -> Answer:
            t0 = time.monotonic()
            answer = await self.relay.call_and_relay(out, st, w, path, lease.data, route,
                                                     signed=True)
            if answer.status == 200:  # the planner's TPOT sample
                self.membership.load.generation(time.monotonic() - t0, lease.max_tokens,
                                                first_byte_at=st.first_byte_at)
            # A refusal (4xx) reads no KV: free the lease now, not at its expiry
            # (idempotent should the worker have released it too).
            lease.taken = answer.status < 400
            return answer

        return await self.retrying(gen, route, call, on_failure)


@dataclass
class _Lease:
    """A context answer waiting for a generation worker to read its KV."""

    ctx_worker: Worker
    params: Mapping[str, Any]  # the context answer's disaggregated_params
    data: bytes  # the generation_only request
    max_tokens: int | None = None  # the output tokens asked for (the planner's TPOT sample)
    taken: bool = False  # a generation worker took it (and releases it on every path)


def resumable(path: str, body: Mapping[str, Any]) -> bool:
    """Can another worker continue this request's stream exactly after the tokens relayed?
    Streamed, one prompt, one choice, no echo (the prompt went out with the first chunk), no
    tools (their parser's state stays with the failed worker)."""
    if body.get("stream") is not True or body.get("n", 1) not in (1, None):
        return False
    if path == COMPLETIONS:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]  # a batch of one prompt (handlers._unwrap_single_prompt)
        return not body.get("echo") and (isinstance(p, str) or isinstance(p, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p))
    return path == CHAT and not body.get("tools")


def requested_tokens(path: str, body: Mapping[str, Any]) -> int | None:
    """The output tokens the request asks for (completions' default 16; None: unbounded)."""
    n = body.get("max_completion_tokens")
    if n is None:  # absent or null (null is absent)
        n = body.get("max_tokens")
    if n is None and path == COMPLETIONS:
        return 16
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
