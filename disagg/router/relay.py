"""Relaying a worker's answer to the router's client: one try on one worker, its answer passed
on as it comes (whole SSE events at a time, the bytes unread: a generation worker's usage
already reports the context side's prefill, from the params it was given).

A context worker's final answer (the first token ended the request) is the client's answer:
``final_answer`` sends it, as a stream when the client asked for one.

Migration (``flow``): a generation worker that fails after it took the request raises
``Interrupted`` instead of ending the client's stream with an error, while the request may still
move (``RequestState.migrations_left``). When the flow asked for them (``token_ids``), each
event's token ids come in an SSE comment line (``: token_ids 1,2``) that the relay takes out of
the stream; they, the answer's id and time (its first chunk's) and whether a chunk carried a
finish reason are what the next worker needs to continue the same answer.

Timing (``disagg/timing.py``): the relay stamps the request's ``Timeline`` where a call is
sent (the end of ``route``, or of ``handover`` after a context answer), where a stream's first
byte or a whole answer came (``generation_call``) and where a stream ended (``decode``). When
the client asked for its timing (``RequestState.timing``), the worker's own ``timing`` object
(a whole answer's, or the stream's last chunk before ``[DONE]``) is replaced by the whole
request's breakdown (``timing.router_breakdown``): the only case where the relay reads and
rewrites what it relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg import timing as T
from disagg.contracts import protocol as P
from disagg.router import http1
from disagg.router.client_io import STREAMED, Answer, ClientStream
from disagg.router.membership import Membership, Worker
from disagg.router.metrics import RouterMetrics
from disagg.router.policies import RouteRequest
from disagg.router.prompt_tokens import CHAT
from disagg.router.replies import Reply, dumps, loads, retry_after
from disagg.router.upstream import Failed, UpstreamClient
from disagg.tracing import Trace

logger = logging.getLogger("disagg.router")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"


@dataclass
class RequestState:
    """One client request as the router's metrics see it."""

    endpoint: str
    outcome: str = "success"
    # The client has the whole answer (a stream's [DONE] written): a disconnect or a handler
    # cancellation after it (the client closing once it read [DONE] while the router still
    # waits for the worker's end of stream) is no failure.
    delivered: bool = False
    # When the first streamed bytes of the answer came (monotonic; None: not streamed): the
    # planner's TPOT sample starts there, after the KV pull and the first token.
    first_byte_at: float | None = None
    # Migration (``flow``): moves left after a generation worker's failure; the client's
    # stream began (its headers went out, maybe from a worker since failed); the token ids of
    # the events relayed (None: not asked for, or the worker sent none: a stream that began
    # cannot move then); the answer's (id, created); a chunk with a finish reason went out.
    migrations_left: int = 0
    started: bool = False
    token_ids: list[int] | None = None
    ids_asked: bool = False
    answer_id: tuple[str, int] | None = None
    finished: bool = False
    # Timing (module docstring): the router's stamps of the request (``start``: it came in);
    # the client asked for the breakdown (the workers are asked for theirs); the context
    # worker's breakdown of the context answer in use; moved to another worker (the workers'
    # own timings are then left out of the breakdown: they cover another try).
    timeline: T.Timeline = field(default_factory=T.Timeline)
    timing: bool = False
    ctx_timing: T.Breakdown | None = None
    moved: bool = False
    # Its trace when the router traces (``disagg/tracing.py``): the calls' traceparent ids.
    trace: Trace | None = None


def call_sent(st: RequestState, at: float) -> None:
    """A worker call of the request is sent ``at``: the first one ends ``route``; the first
    generation call after a context answer ends ``handover`` (retries: no new phase; their
    time is the next answer's call phase)."""
    tl = st.timeline
    last = tl.last
    if last is None:
        tl.end(T.ROUTE, at)
    elif last == T.CONTEXT_CALL:
        tl.end(T.HANDOVER, at)


def with_breakdown(st: RequestState, answer: dict[str, Any], streamed: bool) -> None:
    """Replace the worker's ``timing`` in ``answer`` (a whole answer, or a stream's chunk that
    carries it) by the whole request's breakdown (``timing.router_breakdown``)."""
    gen = None if st.moved else T.Breakdown.from_json(answer.get(T.FIELD))
    answer[T.FIELD] = T.router_breakdown(st.timeline, None if st.moved else st.ctx_timing,
                                         gen, streamed).to_json()


_TIMING_KEY = b'"timing":'


def stream_breakdown(st: RequestState, events: bytes) -> bytes:
    """``events`` with the worker's timing chunk (a ``data:`` event holding ``timing``) given
    the whole request's breakdown; the stream's ``decode`` ends here."""
    parts = events.split(b"\n\n")
    for i, part in enumerate(parts):
        if not (part.startswith(b"data: {") and _TIMING_KEY in part):
            continue
        try:
            chunk = loads(part[6:])
        except ValueError:
            continue
        if not isinstance(chunk, dict) or T.FIELD not in chunk:
            continue  # (the key's bytes inside a string are escaped: \"timing\":)
        if st.timeline.last != T.DECODE:
            st.timeline.end(T.DECODE)
        with_breakdown(st, chunk, streamed=True)
        parts[i] = b"data: " + dumps(chunk)
        return b"\n\n".join(parts)
    return events


class Interrupted(Exception):
    """The generation worker ``worker`` failed after it took the request (connection lost,
    stream cut, an in-band server error): ``flow`` moves the request to another worker."""

    def __init__(self, worker: Worker, why: str) -> None:
        super().__init__(why)
        self.worker = worker
        self.why = why

    @property
    def failed(self) -> Failed:
        """The failure, as the client's error when no worker is left to move to."""
        return Failed(self.why)


def can_move(st: RequestState) -> bool:
    """May the request move after its generation worker failed now? Moves are left, and
    either nothing reached the client or the relayed events' token ids are known (the next
    worker continues after them) and no chunk finished the answer."""
    if st.migrations_left <= 0:
        return False
    return not st.started or (st.token_ids is not None and st.answer_id is not None
                              and not st.finished)


TOKEN_IDS_LINE = b": token_ids "  # (server/respond.token_ids_line)
_NL_TOKEN_IDS_LINE = b"\n" + TOKEN_IDS_LINE
_ERROR_EVENT = b'data: {"error":'
_FINISHED = b'"finish_reason":"'


def take_token_ids(st: RequestState, events: bytes) -> bytes:
    """``events`` (whole SSE events) without their token-id comment lines, whose ids are
    added to ``st.token_ids``; the answer's id and time from its first chunk."""
    out: list[bytes] = []
    at = 0
    while True:
        # (a line's start: an event's first line; JSON data lines hold no raw newline)
        if at == 0 and events.startswith(TOKEN_IDS_LINE):
            i = 0
        else:
            i = events.find(_NL_TOKEN_IDS_LINE, max(at - 1, 0)) + 1
            if i <= 0:
                break
        end = events.index(b"\n", i)
        out.append(events[at:i])
        ids = events[i + len(TOKEN_IDS_LINE):end]
        if st.token_ids is None:
            st.token_ids = []
        if ids:
            st.token_ids.extend(int(t) for t in ids.split(b","))
        at = end + 1
    if at:
        out.append(events[at:])
        events = b"".join(out)
    if st.answer_id is None and events.startswith(b"data: {"):
        try:
            first = loads(events[6:events.index(b"\n")])
            if isinstance(first.get("id"), str) and isinstance(first.get("created"), int):
                st.answer_id = (first["id"], first["created"])
        except (ValueError, AttributeError):
            pass
    return events


def server_error_event(events: bytes) -> int:
    """Where an in-band error event of the worker's own failure begins in ``events`` (-1:
    none; a client error, ``invalid_request_error``, is relayed as it is)."""
    i = events.find(_ERROR_EVENT)
    if i < 0:
        return -1
    try:
        error = loads(events[i + 6:events.index(b"\n", i)]).get("error")
    except (ValueError, AttributeError):
        return i
    kind = error.get("type") if isinstance(error, dict) else None
    return -1 if kind == "invalid_request_error" else i


class counted:  # noqa: N801 (used as a function: ``with counted(w, route):``)
    """``w`` carries one more of the router's requests (its load, for the policies) while in
    this block. (A class: contextlib's generator-based manager cost more per request.)"""

    __slots__ = ("w", "tokens")

    def __init__(self, w: Worker, route: RouteRequest) -> None:
        self.w, self.tokens = w, route.num_tokens

    def __enter__(self) -> None:
        w = self.w
        w.active_requests += 1
        w.active_tokens += self.tokens
        w.requests_total += 1

    def __exit__(self, *exc: object) -> None:
        w = self.w
        w.active_requests -= 1
        w.active_tokens -= self.tokens


class Relay:
    """Sends one try to a worker and relays its answer to the client."""

    def __init__(self, upstream: UpstreamClient, membership: Membership,
                 metrics: RouterMetrics) -> None:
        self.upstream = upstream
        self.membership = membership
        self.metrics = metrics

    async def call_and_relay(self, out: ClientStream, st: RequestState, w: Worker,
                             path: str, data: bytes, route: RouteRequest,
                             signed: bool = False) -> Answer:
        """One try on ``w``: relay its answer to the client. ``Failed`` if it fails before
        the first byte reaches the client; ``Interrupted`` if ``w`` took the request and
        failed while it may move (``can_move``)."""
        t0 = time.monotonic()
        call_sent(st, t0)
        resp: http1.Response | None = None
        with counted(w, route):
            try:
                resp = await self.upstream.post(
                    w, path, data, signed,
                    b"" if st.trace is None else st.trace.call(T.GENERATION_CALL, w.url))
                if resp.status >= 500:
                    raise await self.upstream.error_answer(w, resp)
                if resp.content_type == "text/event-stream" and resp.status == 200:
                    return await self._relay_stream(out, st, w, resp, t0)
                return await self._relay_whole(st, w, resp, t0)
            except Failed as f:
                # Reached, then lost before any answer (no status): it died working on it.
                if f.reached and f.reply is None and can_move(st):
                    raise Interrupted(w, f.why) from None
                raise
            finally:
                if resp is not None:
                    resp.close()  # a no-op when fully read; else drops the connection (aborts)

    async def _relay_whole(self, st: RequestState, w: Worker, resp: http1.Response,
                           t0: float) -> Answer:
        body = await self.upstream.read(w, resp)
        now = time.monotonic()
        self.metrics.gen_first_byte.observe(now - t0)
        self.metrics.gen_latency.observe(now - t0)
        if resp.status != 200:
            st.outcome = "client_error"  # (a 429's Retry-After passed on as a 503's is)
            return Answer(resp.status, body, resp.content_type or "application/json",
                          headers=retry_after(resp.retry_after))
        st.timeline.end(T.GENERATION_CALL, now)
        if st.timing:
            try:
                answer = loads(body)
            except ValueError:
                answer = None
            if isinstance(answer, dict):
                with_breakdown(st, answer, streamed=False)
                body = dumps(answer)
        return Answer(200, body)

    async def _relay_stream(self, out: ClientStream, st: RequestState, w: Worker,
                            resp: http1.Response, t0: float) -> Answer:
        pending = b""
        done = False
        first = True  # this worker's first events (st.started: the client's stream began)
        try:
            async for chunk in resp.iter_any():
                data = pending + chunk if pending else chunk
                cut = data.rfind(b"\n\n")
                if cut < 0:  # no whole event yet
                    pending = data
                    continue
                events, pending = data[:cut + 2], data[cut + 2:]
                failed = False
                if st.ids_asked:
                    events = take_token_ids(st, events)
                    failed_at = server_error_event(events)
                    if failed_at >= 0 and can_move(st):  # its own failure, in-band
                        events, failed = events[:failed_at], True
                    st.finished = st.finished or _FINISHED in events
                try:
                    if first and (events or not failed):
                        first = False
                        if not st.started:
                            st.first_byte_at = time.monotonic()
                            st.timeline.end(T.GENERATION_CALL, st.first_byte_at)
                            self.metrics.gen_first_byte.observe(st.first_byte_at - t0)
                            st.started = True
                            await out.start(200, SSE_HEADERS)
                    if st.timing and _TIMING_KEY in events:  # (after the first byte's stamp)
                        events = stream_breakdown(st, events)
                    if events:
                        await out.write(events)
                except ConnectionError:  # the client went away: the caller closes upstream
                    st.outcome = "disconnected"
                    return STREAMED if st.started else Answer(499)
                if failed:
                    raise http1.UpstreamError("it reported a server error mid-stream")
                done = events.endswith(DONE)
                st.delivered = done
            if not done:
                raise http1.UpstreamError("the stream ended without [DONE]")
        except (http1.UpstreamError, asyncio.TimeoutError) as e:
            why = f"generation worker {w.url} failed mid-stream: {type(e).__name__}: {e}"
            self.membership.request_failed(w, why)
            if not st.started:  # nothing sent yet: another worker may still serve it
                raise Failed(why) from None
            if can_move(st):
                raise Interrupted(w, why) from None
            self.metrics.gen_latency.observe(time.monotonic() - t0)
            await self.end_with_error(out, st, why)
            return STREAMED
        self.metrics.gen_latency.observe(time.monotonic() - t0)
        if st.timeline.last != T.DECODE:
            st.timeline.end(T.DECODE)
        with contextlib.suppress(ConnectionError):
            if not st.started:  # an empty but complete stream
                await out.start(200, SSE_HEADERS)
            await out.end()
        return STREAMED

    async def end_with_error(self, out: ClientStream, st: RequestState, why: str) -> None:
        """End a stream the client is reading with an in-band ``upstream_failed`` error."""
        logger.warning("%s", why)
        st.outcome = "stream_error"
        err = P.error_body(why, "upstream_error", code="upstream_failed")
        with contextlib.suppress(ConnectionError):
            await out.write(b"data: " + dumps(err) + b"\n\n" + DONE)
            await out.end()


async def final_answer(out: ClientStream, path: str, body: Mapping[str, Any],
                       answer: dict[str, Any], st: RequestState | None = None) -> Answer:
    """The context worker's final answer, as a stream if the client asked for one (with the
    request's breakdown when ``st`` asked for its timing)."""
    try:  # ``stream`` and ``include_usage`` as the workers read them ("true", 1, ...)
        req = P.validate_request(path, body)  # (rare: the context worker took the body)
    except P.APIError as e:
        raise Reply.from_api_error(e) from None
    timing = None
    if st is not None and st.timing:
        timing = T.router_breakdown(st.timeline, st.ctx_timing, None, False).to_json()
    if not req.stream:
        if timing is not None:
            answer[T.FIELD] = timing
        return Answer(200, dumps(answer))
    chunks = _as_chunks(answer, path == CHAT, req.include_usage_in_stream,
                        req.continuous_usage_in_stream)
    if timing is not None:  # in the usage chunk, else in a last chunk of its own
        if req.include_usage_in_stream:
            chunks[-1][T.FIELD] = timing
        else:
            chunks.append({"id": answer.get("id"), "object": "chat.completion.chunk"
                           if path == CHAT else "text_completion",
                           "created": answer.get("created"), "model": answer.get("model"),
                           "choices": [], T.FIELD: timing})
    await out.start(200, SSE_HEADERS)
    await out.write(b"".join(b"data: " + dumps(c) + b"\n\n" for c in chunks) + DONE)
    await out.end()
    return STREAMED


def _as_chunks(answer: dict[str, Any], chat: bool, include_usage: bool,
               continuous_usage: bool = False) -> list[dict[str, Any]]:
    """A whole answer as the stream chunks a worker would have sent for it (``continuous_usage``:
    each chunk with the running usage, vLLM's ``continuous_usage_stats``: the answer is one
    choice, its first token, so the running counts are the answer's)."""
    head = {"id": answer.get("id"), "object": "chat.completion.chunk" if chat
            else "text_completion", "created": answer.get("created"),
            "model": answer.get("model")}
    chunks: list[dict[str, Any]] = []
    running = started = None
    usage = answer.get("usage")
    if continuous_usage and isinstance(usage, dict):
        running = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens",
                                             "total_tokens")}
        started = {**running, "completion_tokens": 0, "total_tokens": running["prompt_tokens"]}

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        c = {**head, "choices": choices}
        if include_usage:
            c["usage"] = usage
        return c

    for ch in answer.get("choices", []):
        if chat:
            chunks.append(chunk([{"index": ch.get("index", 0), "delta": {
                "role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}], started))
            message = ch.get("message") or {}
            text = message.get("content") or ""
            delta: dict[str, Any] = {"content": text} if text else {}
            if message.get("tool_calls"):  # (a forced call complete in its first token)
                delta["tool_calls"] = [{"index": i, **call}
                                       for i, call in enumerate(message["tool_calls"])]
            chunks.append(chunk([{"index": ch.get("index", 0),
                                  "delta": delta,
                                  "logprobs": ch.get("logprobs"),
                                  "finish_reason": ch.get("finish_reason"),
                                  "stop_reason": ch.get("stop_reason")}], running))
        else:
            chunks.append(chunk([ch], running))
    if include_usage:
        chunks.append(chunk([], answer.get("usage")))
    return chunks
