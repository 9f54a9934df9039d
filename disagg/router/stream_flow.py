"""KV streaming (``kv_streaming: true``): a disaggregated request's context and generation
calls at once, the prompt's KV streamed layer by layer between them.

The router names the stream (``uuid4().hex``) and sends concurrently, both calls signed with
the cluster token:

- to the context worker C, the request as sent (answered whole) with ``disaggregated_params:
  {request_type: context_only, kv_stream_id: ID}``: C serves it as a two-call context request
  (the prompt prefilled, the first token sampled with the client's parameters), publishing the
  KV of each layer as its forward writes it, then the first token. Its answer is read whole
  and dropped: the connection is reused;
- to the generation worker G, the client's request as sent (prompt or messages, ``stream`` as
  asked) with ``disaggregated_params: {request_type: generation_only, kv_stream:
  {ctx_request_id: ID, worker_id, backend, addresses, layout}}`` (C's ``kv_transfer`` from its
  last ``/server_info``): G pulls the KV layer group by layer group while C computes it, gets
  C's first token with its last read and decodes from there. Its answer is relayed as in the
  two calls (a stream's first bytes as soon as they come).

Streamed when the request would take the two calls (one prompt, one choice, no local prefill)
and also: no ``prompt_logprobs`` (nor completions' ``echo`` with logprobs or ``max_tokens: 0``:
G never computes the prompt's logits), C's ``kv_transfer`` is known with addresses and a
layout, and the context policy's decision names no peer to pull a prefix from (``peer_reuse``,
``flow``: the streamed context call carries no ``kv_prefix``; the two calls' does). Else the
two calls serve it (``disagg_router_kv_stream_requests_total{outcome="not_streamable"}``).

Fallback to the two calls (``flow``), only before any byte reached the client:

- C fails (connection, 5xx): G's call is closed; C counts one failure of the context side's
  retry budget and is avoided (picked again only when no other context worker is left: the
  failure may be streaming's alone);
- G fails (connection, 5xx): C's call is closed; G counts one failure and is avoided. A 502
  ``kv_transfer_failed`` is the context side's fault, as in the two calls: C is avoided, G
  stays first;
- C refuses (a 4xx), or G refuses ``disaggregated_params`` (a 4xx naming it: clients cannot set
  it, so it is a worker without streaming): no failure counted, the same workers serve the
  two calls.

Timing (``disagg/timing.py``): the request's consecutive phases are those of G's call (its
``kv_transfer`` includes C's prefill, which it waits for); C's call runs beside them and is
observed on its own (``disagg_request_phase_seconds{phase="context_call"}``); C's own phases
are on its ``/metrics``, not in the client's breakdown.

Any other answer of G's (a 4xx) is the client's. G failing after its first bytes reached the
client is a migration (``flow``): the stream goes on on another generation worker
(``outcome="failed"`` here). Once bytes reached the client nothing else is retried, and a C
that fails then is ignored: G streams its answer only after its first token, which needs all
of the prompt's KV. When G did not take the stream (it failed, refused, or the client left),
C is asked to free the stream's lease (``/kv_leases/release``, idempotent there).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg import timing as T
from disagg.contracts.roles import RequestType, Role
from disagg.router.client_io import Answer, ClientStream
from disagg.router.flow import RequestFlow, Tries, requested_tokens
from disagg.router.membership import Worker
from disagg.router.policies import RouteRequest
from disagg.router.prompt_tokens import COMPLETIONS
from disagg.router.relay import Interrupted, RequestState, counted
from disagg.router.replies import with_params
from disagg.router.upstream import Failed
from disagg.tracing import Trace

logger = logging.getLogger("disagg.router")

# disagg_router_kv_stream_requests_total{outcome}
STREAMED = "streamed"  # G's answer (or its 4xx) is the client's
FELL_BACK = "fell_back"  # the streaming try failed; the two calls took over
FAILED = "failed"  # the streaming try failed with the retry budget spent, or the client left
NOT_STREAMABLE = "not_streamable"  # the two calls at once (module docstring)
KV_STREAM_FIELDS = ("worker_id", "backend", "addresses", "layout")  # of C's kv_transfer


class _Refused(Exception):
    """C answered a 4xx: no worker failure, the two calls ask it again."""


@dataclass
class _Stream:
    """One streaming try."""

    ctx_worker: Worker
    gen_worker: Worker
    id: str  # the stream id: C's lease id, G's ctx_request_id
    ctx_answered_at: float | None = None  # C's 2xx answer came (monotonic)
    lease_possible: bool = True  # C may hold a lease (False: it refused or never connected)
    taken: bool = False  # G answered (< 400): G releases C's lease, as in the two calls


def stream_source(w: Worker) -> dict[str, Any] | None:
    """What G needs to stream ``w``'s KV (its last /server_info ``kv_transfer``); None when
    that is unknown or has no addresses (a worker without a transfer server)."""
    kt = w.kv_transfer
    if not kt:
        return None
    addresses = kt.get("addresses")
    if not isinstance(addresses, list) or not addresses or not isinstance(
            kt.get("layout"), Mapping):
        return None
    return {k: kt.get(k) for k in KV_STREAM_FIELDS}


def streamable_request(path: str, body: Mapping[str, Any]) -> bool:
    """False when the answer needs the prompt's logits (which only C computes)."""
    if body.get("prompt_logprobs") is not None:
        return False
    return not (path == COMPLETIONS and body.get("echo") and (
        body.get("logprobs") is not None or body.get("max_tokens") == 0))


def stream_bodies(body: Mapping[str, Any], data: bytes, stream_id: str,
                  source: Mapping[str, Any], token_ids: bool = False, timing: bool = False
                  ) -> tuple[bytes, bytes]:
    """The context_only and generation_only requests of one stream (module docstring;
    ``token_ids``: G reports its stream's token ids, for migration: ``flow``; ``timing``: G
    reports its timing, the client asked for the breakdown)."""
    gen: dict[str, Any] = {"request_type": RequestType.GENERATION_ONLY.value,
                           "kv_stream": {"ctx_request_id": stream_id, **source}}
    if token_ids:
        gen["token_ids"] = True
    if timing:
        gen[T.FIELD] = True
    return (with_params(data, body, {"request_type": RequestType.CONTEXT_ONLY.value,
                                     "kv_stream_id": stream_id}),
            with_params(data, body, gen))


class StreamingFlow(RequestFlow):
    """``RequestFlow`` whose disaggregated requests try the streaming way first."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        # C calls still being read after G's answer was relayed (they end at C's answer).
        self.background: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for t in list(self.background):
            t.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)

    def _count(self, outcome: str) -> None:
        self.metrics.child(self.metrics.kv_stream, outcome).inc()

    async def first_try(self, out: ClientStream, st: RequestState, path: str,
                        body: dict[str, Any], data: bytes, route: RouteRequest, ctx: Tries,
                        gen: Tries) -> Answer | None:
        if not streamable_request(path, body):
            self._count(NOT_STREAMABLE)
            return None
        ctx_w = self.next_worker(ctx, route)
        source = stream_source(ctx_w)
        peer = ctx.decision is not None and ctx.decision.peer is not None
        if source is None or peer:
            ctx.first = ctx_w  # the policy's pick stands for the two calls (counted once)
            self._count(NOT_STREAMABLE)
            return None
        s = _Stream(ctx_w, self.next_worker(gen, route), uuid.uuid4().hex)
        outcome = FAILED
        try:
            answer = await self._stream(out, st, path, body, data, route, s, source, ctx,
                                        gen)
            outcome = FELL_BACK if answer is None else STREAMED
            return answer
        finally:
            self._count(outcome)

    async def _stream(self, out: ClientStream, st: RequestState, path: str,
                      body: dict[str, Any], data: bytes, route: RouteRequest, s: _Stream,
                      source: Mapping[str, Any], ctx: Tries, gen: Tries
                      ) -> Answer | None:
        """Both calls at once: G's answer, or None to fall back (module docstring)."""
        ctx_data, gen_data = stream_bodies(body, data, s.id, source, st.ids_asked,
                                           st.timing)
        loop = asyncio.get_running_loop()
        c_task = loop.create_task(self._ctx_call(s, path, ctx_data, route, st.trace))
        g_task = loop.create_task(self._gen_call(out, st, s, path, gen_data, route,
                                                   requested_tokens(path, body)))
        for t in (c_task, g_task):
            t.add_done_callback(_retrieve)
        try:
            done, _ = await asyncio.wait((c_task, g_task), return_when=asyncio.FIRST_COMPLETED)
            if g_task not in done:
                failure = _failure(c_task)
                if failure is not None and st.first_byte_at is None:
                    self._context_failed(failure, s, ctx, gen)
                    return None
                if failure is not None:  # G is answering: it has all the KV already
                    logger.info("stream %s: context worker %s failed after the generation "
                                "worker's answer began: %s", s.id, s.ctx_worker.url, failure)
                await asyncio.wait((g_task,))
            return self._generation_ended(g_task, st, s, ctx, gen)
        finally:
            g_task.cancel()  # a no-op when done; else nothing of it reached the client
            if s.taken and not c_task.done():
                self.background.add(c_task)  # read C's answer to its end (its connection)
                c_task.add_done_callback(self.background.discard)
            else:
                c_task.cancel()  # nobody reads this stream: C aborts its prefill
            if not s.taken and s.lease_possible:
                self.upstream.release_lease(s.ctx_worker, s.id)

    async def _ctx_call(self, s: _Stream, path: str, data: bytes, route: RouteRequest,
                        trace: Trace | None = None) -> None:
        """C's call: read its answer whole and drop it (``Failed``: connection or 5xx;
        ``_Refused``: a 4xx). ``trace``: the request's (its span beside the timeline's)."""
        w = s.ctx_worker
        t0 = time.monotonic()
        resp = None
        with counted(w, route):
            try:
                resp = await self.upstream.post(
                    w, path, data, signed=True,
                    trace=b"" if trace is None else trace.call(T.CONTEXT_CALL, w.url))
                if resp.status >= 500:
                    raise await self.upstream.error_answer(w, resp)
                answer = await self.upstream.read(w, resp)
                if not 200 <= resp.status < 300:
                    s.lease_possible = False
                    raise _Refused(f"{w.url} answered {resp.status}: "
                                   f"{answer[:300].decode(errors='replace')}")
                s.ctx_answered_at = now = time.monotonic()
                self.metrics.ctx_latency.observe(now - t0)
                # beside the generation call, not one of the request's consecutive phases
                self.metrics.phases.observe(T.CONTEXT_CALL, now - t0)
                if trace is not None:
                    trace.side.append((T.CONTEXT_CALL, t0, now))
                self.membership.load.context(now - t0)  # the planner's TTFT sample
            except Failed as f:
                s.lease_possible = s.lease_possible and f.reached
                raise
            finally:
                if resp is not None:
                    resp.close()

    async def _gen_call(self, out: ClientStream, st: RequestState, s: _Stream,
                          path: str, data: bytes, route: RouteRequest,
                          max_tokens: int | None) -> Answer:
        """G's call, its answer relayed to the client (``Failed`` before the first byte)."""
        t0 = time.monotonic()
        try:
            answer = await self.relay.call_and_relay(out, st, s.gen_worker, path, data, route,
                                                     signed=True)
        except Interrupted as cut:
            if st.started:
                raise  # a migration: the stream goes on elsewhere (flow)
            # Nothing reached the client: the two calls take over, as after any failure of
            # the streaming try (which may be streaming's alone).
            raise Failed(cut.why) from None
        if answer.status == 200:
            # The planner's generation sample starts where C's prefill ended (its answer,
            # or G's first bytes if those came first), as after the context call: G's wait
            # for the KV is the context side's time.
            start = t0
            if s.ctx_answered_at is not None:
                start = max(t0, min(s.ctx_answered_at, st.first_byte_at or s.ctx_answered_at))
            self.membership.load.generation(time.monotonic() - start, max_tokens,
                                            first_byte_at=st.first_byte_at)
        return answer

    def _context_failed(self, failure: Exception, s: _Stream, ctx: Tries, gen: Tries) -> None:
        """C failed before G's answer began: the two calls take over (``Reply`` when the
        context side's budget is spent)."""
        gen.first = s.gen_worker  # its call was closed, not failed: it serves the two calls
        if isinstance(failure, _Refused):
            logger.info("stream %s: %s; falling back to the two calls", s.id, failure)
            ctx.first = s.ctx_worker
            return
        assert isinstance(failure, Failed)
        logger.info("stream %s: context worker failed: %s; falling back to the two calls",
                    s.id, failure.why)
        ctx.failed(s.ctx_worker, failure, exclude=False)
        ctx.avoid.add(s.ctx_worker.url)
        if ctx.exhausted:
            raise self.no_worker(Role.CONTEXT, ctx.last)

    def _generation_ended(self, g_task: asyncio.Task[Answer], st: RequestState,
                          s: _Stream, ctx: Tries, gen: Tries) -> Answer | None:
        """G's answer for the client, or None to fall back (``Reply`` when the budget of the
        side at fault is spent)."""
        exc = g_task.exception()
        if exc is None:
            answer = g_task.result()
            if _refuses_streaming(answer):
                logger.info("stream %s: generation worker %s refused kv_stream (%d): falling "
                            "back to the two calls", s.id, s.gen_worker.url, answer.status)
                st.outcome = "success"  # (the relay counted the refusal as the client's)
                ctx.first, gen.first = s.ctx_worker, s.gen_worker
                return None
            s.taken = answer.status < 400
            return answer
        if not isinstance(exc, Failed):
            raise exc
        logger.info("stream %s: generation worker failed: %s; falling back to the two calls",
                    s.id, exc.why)
        gen.failed(s.gen_worker, exc, exclude=False)
        if exc.kv_transfer:  # the context side's fault (as in the two calls): prefill elsewhere
            gen.retry_reason = None
            gen.first = s.gen_worker
            ctx.avoid.add(s.ctx_worker.url)
            ctx.retry_reason = (Role.CONTEXT.value, exc.reason)
        else:
            gen.avoid.add(s.gen_worker.url)
            ctx.first = s.ctx_worker
        if gen.exhausted:
            raise self.no_worker(Role.GENERATION, gen.last)
        return None


def _failure(c_task: asyncio.Task[None]) -> Exception | None:
    """How C's call ended: None (it answered), ``Failed`` or ``_Refused``; anything else (a
    bug) is raised."""
    exc = c_task.exception()
    if exc is None or isinstance(exc, Failed | _Refused):
        return exc
    raise exc


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a call's exception as seen (it is handled, or moot once the other call decided)."""
    if not task.cancelled():
        task.exception()


def _refuses_streaming(out: Answer) -> bool:
    """G's 4xx naming ``disaggregated_params``: a worker that does not stream KV (clients
    cannot set that field: the router refuses it)."""
    if out.streamed or not 400 <= out.status < 500:
        return False
    try:
        error = json.loads(out.body).get("error")
    except (ValueError, AttributeError, RecursionError):
        return False
    param = error.get("param") if isinstance(error, dict) else None
    return isinstance(param, str) and param.startswith("disaggregated_params")
