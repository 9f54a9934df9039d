"""The router's answer to its client, whichever server carries the client's connection:
``Answer`` (what a handler answered) and ``ClientStream`` (where a streamed answer goes as it
comes).

Two servers carry the router's client connections (``front``): its own HTTP/1.1 protocol for
the common OpenAI POST, and aiohttp for every other request. The request flow (``flow``,
``relay``, ``stream_flow``) writes to a ``ClientStream`` and returns an ``Answer`` and never
knows which one it talks to; ``AiohttpStream`` is the aiohttp side, ``front.FrontConnection``
the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web


@dataclass(frozen=True, slots=True)
class Answer:
    """What the router answered one request with. ``streamed``: it was written to the request's
    ``ClientStream`` (status and headers included) and ``body`` is unused; else the server
    sends ``status``, ``content_type`` and ``body``. ``close``: the request's body was not read
    whole, so the connection cannot carry another request. ``headers``: more headers of a
    whole answer (``Retry-After`` of a 503)."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    streamed: bool = False
    close: bool = False
    headers: Mapping[str, str] | None = None


STREAMED = Answer(200, streamed=True)


class ClientStream(ABC):
    """One request's streamed answer, written as it comes.

    Rules: ``start`` at most once, before any ``write``; after ``start`` the handler's answer is
    ``STREAMED`` (or another ``Answer`` with ``streamed=True``). ``write`` waits while the
    client reads slower than the router writes (the relay then stops reading its worker), and
    raises ``ConnectionError`` once the client is gone: the caller stops and closes its worker
    connection. ``end`` once, last (``ConnectionError`` too when the client is gone).
    """

    @abstractmethod
    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        """The answer's status and headers (sent with the first ``write`` at the latest)."""

    @abstractmethod
    async def write(self, data: bytes) -> None:
        """Body bytes (a whole SSE event or several)."""

    @abstractmethod
    async def end(self) -> None:
        """The end of the body."""


class AiohttpStream(ClientStream):
    """A ``ClientStream`` over an aiohttp request (``response`` is the handler's answer)."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    def to_response(self, answer: Answer) -> web.StreamResponse:
        """aiohttp's response for ``answer``."""
        if answer.streamed and self.response is not None:
            return self.response
        resp = web.Response(status=answer.status, body=answer.body,
                            content_type=answer.content_type, headers=answer.headers)
        if answer.close:
            resp.force_close()
        return resp
