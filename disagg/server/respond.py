"""Answering one OpenAI request once its choices are built: run them (``FanOut``), then a JSON
answer or an SSE stream.

A streamed request gets its headers only after every choice produced its first output, so a
refusal by the engine (queue full, failed KV pull) still gets its own status; later errors are
reported in-band, as OpenAI does, before ``[DONE]``. A client that goes away (mid-stream or
while waiting) has its engine requests aborted at once, which frees their KV blocks; it gets
499 (nginx's "client closed request") when no answer was started.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from disagg.contracts import protocol as P
from disagg.server.fanout import Choice, FanOut
from disagg.server.formats import Format
from disagg.server.state import ClientGone, ServerState

CLIENT_CLOSED = 499


async def respond(srv: ServerState, request: Request, choices: list[Choice], fmt: Format,
                  t_arrival: float) -> Response:
    """Run ``choices`` and answer ``request`` (streamed when the client asked for a stream)."""
    fan = FanOut(srv, choices, t_arrival)
    if fmt.req.stream and not choices[0].mode.is_context:  # (a context answer is whole)
        try:
            await srv.until_disconnect(request, fan.start())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return StreamingResponse(
            sse_events(fan, fmt), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": fmt.rid},
            background=BackgroundTask(fan.abort_if_unfinished))
    try:
        await srv.until_disconnect(request, _run(fan))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it
    body = fmt.response(choices)
    if choices[0].mode.is_context:
        # The router's next call: null params mean the answer is final (EOS, stop, or
        # max_tokens reached) and the context worker has freed the KV already.
        final = choices[0].final
        body["prompt_token_ids"] = list(choices[0].prompt_ids)
        body["disaggregated_params"] = final.disaggregated_params if final is not None else None
    return JSONResponse(body, headers={"X-Request-Id": fmt.rid})


async def _run(fan: FanOut) -> None:
    try:
        await fan.start()
        await fan.collect()
    finally:
        if not fan.done:  # cancelled (disconnect, shutdown) or failed
            fan.abort()


async def sse_events(fan: FanOut, fmt: Format) -> AsyncIterator[str]:
    """The SSE events of a started fan-out, ending with ``[DONE]``."""
    try:
        for chunk in fmt.start_chunks(fan.choices):
            yield fmt.sse(chunk)
        async for c, out in fan.events():
            chunk = fmt.delta_chunk(c, out)
            for one in chunk if isinstance(chunk, list) else [chunk] if chunk else []:
                yield fmt.sse(one)  # a list: tool-call deltas (name first, then arguments)
        if fmt.include_usage:
            yield fmt.sse(fmt.usage_chunk(fan.choices))
    except P.APIError as e:  # headers are gone: report in-band, as OpenAI does
        yield fmt.sse_error(e.body())
    finally:
        # Client gone (cancelled) or error: free the engine's blocks now. No await here:
        # under cancellation an await would be cancelled again.
        if not fan.done:
            fan.abort()
    yield fmt.sse_end()
