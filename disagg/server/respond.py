"""Answering one OpenAI request once its choices are built: run them (``FanOut``), then a JSON
answer or an SSE stream.

A streamed request gets its headers only after every choice produced its first output, so a
refusal by the engine (queue full, failed KV pull) still gets its own status; later errors are
reported in-band, as OpenAI does, before ``[DONE]``. A client that goes away (mid-stream or
while waiting) has its engine requests aborted at once, which frees their KV blocks; it gets
499 (nginx's "client closed request") when no answer was started.

A two-call context answer names a lease that only the answer itself tells its reader of, so a
client gone before its answer was written whole (before or at the end of the prefill, before
or while the answer is written) has the lease ended at once (``ContextAnswer``), not at its
TTL; the engine ends it too when the request had just ended (``AsyncLLM.generate``).

Each answer's phases (``request_timing``) are recorded once it is built, and sent when the
request asked: a JSON answer's top-level ``timing``; a stream's in its usage chunk, or in a
last chunk of its own (``choices: []``) before ``[DONE]``. A traced request's spans are made
from the same stamps then (``disagg/tracing.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Receive, Scope, Send

from disagg import timing as T
from disagg.contracts import protocol as P
from disagg.contracts.kv_mode import ContextOnly
from disagg.server.fanout import Choice, FanOut
from disagg.server.formats import Format
from disagg.server.request_timing import CLIENT_CLOSED, RequestTiming
from disagg.server.state import ClientGone, ServerState

logger = logging.getLogger(__name__)

# A context answer larger than this is written in pieces (``ContextAnswer``): asyncio's
# default high-water mark of a transport's buffer.
ANSWER_PIECE_BYTES = 64 * 1024


async def respond(srv: ServerState, request: Request, choices: list[Choice], fmt: Format,
                  t_arrival: float) -> Response:
    """Run ``choices`` and answer ``request`` (streamed when the client asked for a stream).
    Its phases are recorded once the answer is built, and go in it when it asked for them
    (``request_timing``)."""
    fan = FanOut(srv, choices, t_arrival)
    timer = RequestTiming(t_arrival, fmt.timing, fmt.trace,
                          request.scope["path"] if fmt.trace is not None else "")
    if fmt.req.stream and not choices[0].mode.is_context:  # (a context answer is whole)
        try:
            await srv.until_disconnect(request, fan.start())
        except ClientGone:
            timer.failed(srv, choices, CLIENT_CLOSED, CLIENT_GONE)
            return Response(status_code=CLIENT_CLOSED)
        except P.APIError as e:
            timer.failed(srv, choices, e.status, error_text(e))
            raise
        return StreamingResponse(
            sse_events(fan, fmt, timer), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": fmt.rid},
            background=BackgroundTask(fan.abort_if_unfinished))
    try:
        await srv.until_disconnect(request, _run(fan))
    except ClientGone:
        release_unread(srv, choices)
        timer.failed(srv, choices, CLIENT_CLOSED, CLIENT_GONE)
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it
    except P.APIError as e:
        timer.failed(srv, choices, e.status, error_text(e))
        raise
    body = fmt.response(choices)
    headers = {"X-Request-Id": fmt.rid}
    if not choices[0].mode.is_context:
        _add_timing(body, timer.finish(srv, choices))
        return JSONResponse(body, headers=headers)
    # The router's next call: null params mean the answer is final (EOS, stop, or
    # max_tokens reached) and the context worker has freed the KV already.
    final = choices[0].final
    body["prompt_token_ids"] = list(choices[0].prompt_ids)
    body["disaggregated_params"] = final.disaggregated_params if final is not None else None
    _add_timing(body, timer.finish(srv, choices))
    if body["disaggregated_params"] is None:
        return JSONResponse(body, headers=headers)
    return ContextAnswer(body, headers=headers, on_unread=lambda: release_unread(srv, choices))


CLIENT_GONE = "the client went away before its answer"


def error_text(e: P.APIError) -> str:
    """An error answer as a span's status says it: ``502 kv_transfer_failed: ...``."""
    return f"{e.status} {e.code or e.type}: {e.message}"


def _add_timing(body: dict[str, Any], timing: dict[str, Any] | None) -> None:
    if timing is not None:
        body[T.FIELD] = timing


def release_unread(srv: ServerState, choices: list[Choice]) -> None:
    """End the lease of a two-call context request whose answer nobody read (a no-op for one
    that made none, or whose lease is not made yet: the engine ends that one when it ends)."""
    for c in choices:
        if isinstance(c.mode, ContextOnly) and srv.engine.release_lease(c.request_id):
            logger.info("request %s: the client left before its answer: lease released",
                        c.request_id)


class ContextAnswer(JSONResponse):
    """A context answer whose lease ends (``on_unread``) unless the answer was written whole:
    the client may be gone before it is written (seen before the first byte) or while it is.
    A large answer goes out in pieces, each after the previous one left the server's buffer
    (the server waits for a client that reads slowly), so a client gone meanwhile stops the
    write; a disconnect wakes the readers of the request's messages before its writer, so it
    is seen as soon as the write returns (the end of the answer wakes them only after). What
    the last piece leaves in the buffers when the client goes is beyond the server's sight:
    that lease ends at its TTL."""

    def __init__(self, content: Any, headers: dict[str, str],
                 on_unread: Callable[[], None]) -> None:
        super().__init__(content, headers=headers)
        self.on_unread = on_unread

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(_disconnected(receive))
        written = False
        try:
            await asyncio.sleep(0)  # a client gone already: its disconnect is there at once
            if not gone.done():
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                body = memoryview(self.body)
                for at in range(0, max(len(body), 1), ANSWER_PIECE_BYTES):
                    end = at + ANSWER_PIECE_BYTES
                    await send({"type": "http.response.body", "body": bytes(body[at:end]),
                                "more_body": end < len(body)})
                    if gone.done():
                        break
                written = not gone.done()  # (before any other task runs)
        finally:
            gone.cancel()
            if not written:
                self.on_unread()


async def _disconnected(receive: Receive) -> None:
    # The body was read: the next message can only be the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _run(fan: FanOut) -> None:
    try:
        await fan.start()
        await fan.collect()
    finally:
        if not fan.done:  # cancelled (disconnect, shutdown) or failed
            fan.abort()


TOKEN_IDS_COMMENT = ": token_ids "  # an SSE comment line: clients ignore it


def token_ids_line(ids: list[int]) -> str:
    """The SSE comment line of a chunk's token ids (``disagg_requests``: migration); it opens
    the chunk's event, so a reader that relays whole events never relays one without it."""
    return TOKEN_IDS_COMMENT + ",".join(map(str, ids)) + "\n"


async def sse_events(fan: FanOut, fmt: Format, timer: RequestTiming | None = None
                     ) -> AsyncIterator[str]:
    """The SSE events of a started fan-out, ending with ``[DONE]``; ``timer``: the request's
    timing (its first chunk stamped; its phases recorded at the end, and sent in the last
    chunk when asked)."""
    try:
        for i, chunk in enumerate(fmt.start_chunks(fan.choices)):
            if timer is not None:
                timer.sent()
            if fmt.token_ids and i == 0:
                yield token_ids_line([])  # (no token yet: the router may resume after it)
            yield fmt.sse(chunk)
        async for c, out in fan.events():
            chunk = fmt.delta_chunk(c, out)
            chunks = chunk if isinstance(chunk, list) else [chunk] if chunk else []
            if timer is not None and chunks:
                timer.sent()
            if fmt.token_ids:
                c.unreported_ids.extend(out.outputs[0].delta_token_ids)
                if chunks and c.unreported_ids:
                    # The router's (it strips the line): the ids of the text sent so far.
                    yield token_ids_line(c.unreported_ids)
                    c.unreported_ids = []
            for one in chunks:
                yield fmt.sse(one)  # a list: tool-call deltas (name first, then arguments)
        timing = timer.finish(fan.server, fan.choices) if timer is not None else None
        if fmt.include_usage:
            last = fmt.usage_chunk(fan.choices)
            if timing is not None:
                last[T.FIELD] = timing
            yield fmt.sse(last)
        elif timing is not None:
            yield fmt.sse(fmt.timing_chunk(timing))
    except P.APIError as e:  # headers are gone: report in-band, as OpenAI does
        if timer is not None:
            timer.failed(fan.server, fan.choices, e.status, error_text(e))
        yield fmt.sse_error(e.body())
    finally:
        # Client gone (cancelled) or error: free the engine's blocks now. No await here:
        # under cancellation an await would be cancelled again.
        if timer is not None and not fan.done:  # (a no-op when spans were made already)
            timer.failed(fan.server, fan.choices, CLIENT_CLOSED, CLIENT_GONE)
        if not fan.done:
            fan.abort()
    yield fmt.sse_end()
