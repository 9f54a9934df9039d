"""The router's ``/v1/responses``: a Responses request served as its chat form through the
router's own chat flow (``handlers._route``: the two calls of a disaggregated cluster, or one
worker whole), its answer made into a Response object or the Responses event stream here
(``server/responses``: the same translation the workers use, so both answer alike).

The router keeps the stored responses (``previous_response_id``, ``GET`` / ``DELETE
/v1/responses/{id}``): the workers only ever see chat requests, so whichever of them serves
a follow-up, it gets the whole conversation. With several router processes (``processes``)
each keeps its own store and tags the ids it makes with its index (``resp_<hex>p<i>``); a
process asked about another one's id asks that one over the private channel.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from disagg import tracing
from disagg.contracts import protocol as P
from disagg.contracts import responses as R
from disagg.router.client_io import AiohttpStream, Answer, ClientStream
from disagg.router.processes import from_sibling
from disagg.router.prompt_tokens import CHAT
from disagg.router.relay import SSE_HEADERS
from disagg.router.replies import Reply, dumps, loads, parse_body

if TYPE_CHECKING:
    from disagg.router.handlers import Handlers

RESPONSES = "/v1/responses"
PRIVATE_RECORD = "/_siblings/responses/"  # + id: a stored record, over the private channel
_OWNED = re.compile(r"^resp_[0-9a-f]{32}p(\d+)$")


class EventsStream(ClientStream):
    """A ``ClientStream`` for the chat flow that writes the Responses events of the chat
    chunks it is given to the client's stream."""

    __slots__ = ("out", "events", "pending")

    def __init__(self, out: ClientStream, events: R.EventStream) -> None:
        self.out = out
        self.events = events
        self.pending = b""

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        await self.out.start(status, {**headers, **SSE_HEADERS})

    async def write(self, data: bytes) -> None:
        data = self.pending + data
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            return
        self.pending = data[cut + 2:]
        text = []
        for event in data[:cut].split(b"\n\n"):
            payload = event.partition(b"data:")[2].strip()
            if not payload:
                continue
            if payload == b"[DONE]":
                text.append(self.events.finish())
            else:
                text.append(self.events.feed(loads(payload)))
        if any(text):
            await self.out.write("".join(text).encode())

    async def end(self) -> None:
        tail = self.events.finish()  # (a stream cut short of its [DONE] still ends)
        if tail:
            await self.out.write(tail.encode())
        await self.out.end()


class ResponsesRoutes:
    """``POST /v1/responses`` and ``GET`` / ``DELETE /v1/responses/{id}`` of one router
    process (``handlers`` serves the chat flow and the access checks)."""

    def __init__(self, handlers: Handlers, store: R.ResponseStore) -> None:
        self.handlers = handlers
        self.router = handlers.router
        self.store = store
        process = self.router.process
        self.tag = f"p{process.index}" if process.count > 1 else ""

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_post(RESPONSES, self.create)
        r.add_get(RESPONSES + "/{response_id}", self.retrieve)
        r.add_delete(RESPONSES + "/{response_id}", self.delete)
        r.add_get(PRIVATE_RECORD + "{response_id}", self.record)

    # -- the store, over every process ---------------------------------------------------------

    def _owner(self, response_id: str) -> int | None:
        """The sibling process that made ``response_id`` (None: this one, or no process)."""
        m = _OWNED.match(response_id)
        if m is None or not self.tag:
            return None
        i = int(m.group(1))
        return i if i != self.router.process.index else None

    async def lookup(self, response_id: str) -> R.Stored | None:
        owner = self._owner(response_id)
        if owner is None:
            return self.store.get(response_id)
        got = await self.router.siblings.call(owner, "GET", PRIVATE_RECORD + response_id)
        if got is None or got[0] != 200:
            return None
        record = loads(got[1])
        return R.Stored(record["response"], record["messages"], time.monotonic())

    async def record(self, request: web.Request) -> web.Response:
        """A stored record (response and conversation) for a sibling process."""
        stored = self.store.get(request.match_info["response_id"])
        if not from_sibling(request) or stored is None:
            return await self.handlers.not_found(request)
        return web.Response(body=dumps({"response": stored.response,
                                        "messages": stored.messages}),
                            content_type="application/json")

    # -- the endpoints --------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        out = AiohttpStream(request)
        answer = await self.serve(out, request.headers.get("Authorization"),
                                  lambda: self.handlers.read_body(request),
                                  request.headers.get(tracing.HEADER))
        return out.to_response(answer)

    async def serve(self, out: ClientStream, authorization: str | None,
                    read_body: Callable[[], Awaitable[bytes]],
                    traceparent: str | None = None) -> Answer:
        """One Responses request: its chat form through the chat flow, answered as a
        Response (or its events); counted, timed and traced (continuing ``traceparent``) as
        a chat request is, under its own path."""
        h = self.handlers
        st = h.begin(RESPONSES, traceparent)
        try:
            h.check_authorization(authorization)
            body = parse_body(await read_body())
            call = await self._call(body)
            events = R.EventStream(call, lambda resp: call.keep(self.store, resp))
            answer = await h.route(EventsStream(out, events), st, CHAT,
                                    dumps(call.chat_body()))
            if answer.streamed or answer.status != 200:
                return answer
            resp = call.response(loads(answer.body))
            call.keep(self.store, resp)
            return Answer(200, dumps(resp))
        except Reply as r:
            st.outcome = r.outcome
            return r.answer()
        except P.APIError as e:
            st.outcome = "client_error"
            return Reply.from_api_error(e).answer()
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            if not st.delivered:
                st.outcome = "disconnected"
            raise
        finally:
            h.end(st)

    async def _call(self, body: dict[str, Any]) -> R.ResponsesCall:
        req = R.parse_request(body)
        prev = req.previous_response_id
        previous = None if prev is None else await self.lookup(prev)
        return R.ResponsesCall.build(req, previous, R.new_response_id(self.tag))

    async def retrieve(self, request: web.Request) -> web.Response:
        return await self._stored(request, delete=False)

    async def delete(self, request: web.Request) -> web.Response:
        return await self._stored(request, delete=True)

    async def _stored(self, request: web.Request, delete: bool) -> web.Response:
        response_id = request.match_info["response_id"]
        try:
            if not from_sibling(request):
                self.handlers.check_api_key(request)
            owner = self._owner(response_id)
            if owner is not None:  # another process's: its answer
                got = await self.router.siblings.call(owner, request.method, request.path)
                if got is None:
                    raise Reply.from_api_error(R.not_found(response_id))
                return web.Response(status=got[0], body=got[1],
                                    content_type="application/json")
            if delete:
                if not self.store.delete(response_id):
                    raise Reply.from_api_error(R.not_found(response_id))
                return web.json_response(R.deleted(response_id))
            stored = self.store.get(response_id)
            if stored is None:
                raise Reply.from_api_error(R.not_found(response_id))
            return web.Response(body=dumps(stored.response), content_type="application/json")
        except Reply as r:
            return r.response()
