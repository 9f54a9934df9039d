"""The router's front door: its own HTTP/1.1 server for the common OpenAI request, aiohttp's for
every other.

aiohttp's server took over a third of the router's CPU time (``bench/results/router.md``'s
profile: a Request, a StreamReader, the URL dispatcher and the response writer per request),
yet nearly every request a router carries has one shape: ``POST /v1/completions`` or
``/v1/chat/completions`` over HTTP/1.1 with a Content-Length body of JSON.
``FrontConnection`` (an asyncio Protocol, httptools' parser) serves exactly that shape, and
hands its connection to aiohttp's own protocol, for good, at the first request that is not of
it, replaying the bytes it holds. So aiohttp still answers everything else as before (its 400,
413, 415, 505, 100-continue, the router's other endpoints).

A request is taken when httptools accepts its head (all of its syntax) and the head is: a
POST to one of the two paths (no query), HTTP/1.1, at most ``max_head_bytes`` long (so no line
or field is longer than aiohttp's limits) with at most ``max_headers`` fields, one
Content-Length of at most MAX_BODY_BYTES, no Transfer-Encoding, Content-Encoding, Expect or
Upgrade. The rules of aiohttp's server that the router relies on hold here too:

- one request at a time: the next request's bytes wait until the answer ended (pipelined
  requests are served in order; reading pauses once PIPELINE_BYTES wait);
- a request head must be complete within ``keep_alive_s`` of connecting or of the previous
  answer, else the connection is closed; a body must arrive within the router's body timeout,
  else 408, after which the connection lingers ``linger_s`` (reading and dropping, so that a
  client still sending sees the answer) and closes;
- CORS (``allowed_origins``, ``disagg.cors``): an answer to a request with an allowed
  ``Origin`` carries the headers aiohttp's answers get (preflights are OPTIONS: aiohttp's);
- a client that disconnects cancels its handler (and so the handler's upstream requests);
  ``Connection: close`` is honoured; an unexpected error is a logged 500 in OpenAI's error
  JSON; a streamed answer is chunked and waits for a slow reader (``ClientStream``).

``FrontSite`` is the aiohttp site that listens with it: ``AppRunner.cleanup`` stops it as any
site (the connections in hand finish their answer within the runner's shutdown timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus

import httptools
from aiohttp import web

from disagg.contracts.protocol import MAX_BODY_BYTES
from disagg.router.client_io import Answer, ClientStream
from disagg.router.handlers import Handlers, late_body
from disagg.router.prompt_tokens import CHAT, COMPLETIONS
from disagg.router.replies import Reply

logger = logging.getLogger("disagg.router")

PATHS = {COMPLETIONS.encode(): COMPLETIONS, CHAT.encode(): CHAT}
PIPELINE_BYTES = 1 << 20  # bytes of later requests buffered before reading pauses
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
# Headers whose request goes to aiohttp: it decodes, answers 100-continue, or switches.
_HAND_OFF_HEADERS = frozenset((b"transfer-encoding", b"content-encoding", b"expect",
                               b"upgrade"))


class Front:
    """What the connections of one listening socket share."""

    def __init__(self, handlers: Handlers, aiohttp_server: Callable[[], asyncio.Protocol], *,
                 keep_alive_s: float, linger_s: float, max_head_bytes: int,
                 max_headers: int) -> None:
        self.handlers = handlers
        self.cors = getattr(handlers, "cors", None)  # None: no CORS headers
        self.aiohttp_server = aiohttp_server  # a new aiohttp protocol (web.Server)
        self.keep_alive_s = keep_alive_s
        self.linger_s = linger_s
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.conns: set[FrontConnection] = set()
        self.closing = False  # shutting down: answers close their connection
        self._date_s = 0
        self._date = b""

    def date(self) -> bytes:
        """The Date header's value (formatted once a second)."""
        now = int(time.time())
        if now != self._date_s:
            self._date_s, self._date = now, formatdate(now, usegmt=True).encode()
        return self._date

    async def shutdown(self, timeout_s: float) -> None:
        """Close the idle connections; let the others finish their answer within
        ``timeout_s`` (then cancel them) and close."""
        self.closing = True
        busy = []
        for c in list(self.conns):
            if c.task is None:
                c.close()
            else:
                busy.append(c.task)
        if busy:
            _, late = await asyncio.wait(busy, timeout=timeout_s)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late, timeout=5.0)
        for c in list(self.conns):
            c.close()


# RFC 9110 token characters: what an HTTP method is made of.
_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_MAX_METHOD = 32  # bytes of a method (aiohttp's and the common ones are far shorter)


def could_start_request(buf: bytes | bytearray) -> bool:
    """Whether ``buf`` may be the start of an HTTP/1.x request: (after empty lines, which
    RFC 9112 lets a server skip) a method of token characters, then a space. False as soon as
    a byte shows it cannot be one."""
    head = bytes(buf[:_MAX_METHOD + 8]).lstrip(b"\r\n")
    sp = head.find(b" ")
    method = head[:sp] if sp >= 0 else head[:_MAX_METHOD + 1]
    if sp == 0 or len(method) > _MAX_METHOD:
        return False
    return all(b in _TCHAR for b in method)


class FrontConnection(asyncio.Protocol, ClientStream):
    """One client connection while its requests have the common shape (module docstring)."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        # received, not yet consumed: the request in hand's body, then later ones
        self.buf: bytes | bytearray = b""
        self.task: asyncio.Task[None] | None = None  # the request in hand's handler
        self.lost = False  # closed, or handed to aiohttp
        self._idle_since = 0.0
        self._keep_alive: asyncio.TimerHandle | None = None
        self._lingering = False
        self._read_paused = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None
        # the head being parsed (httptools callbacks)
        self._url = b""
        self._fields = 0
        self._lengths: list[bytes] = []
        self._auth: str | None = None
        self._timing: str | None = None  # X-Disagg-Timing (disagg/timing.py)
        self._traceparent: str | None = None  # W3C trace context (disagg/tracing.py)
        self._origin: bytes | None = None
        self._odd = False  # a header that aiohttp must handle
        self._head_done = False
        # the request in hand
        self._head_len = 0
        self._need = 0  # bytes of buf up to its body's end (0: its body was consumed)
        self._body_waiter: asyncio.Future[None] | None = None
        self._keep = True  # keep the connection after the answer
        self._cors = b""  # the answer's CORS header lines (an allowed Origin), else none
        self._stream_head: bytes | None = None  # a streamed answer's head, sent with its body
        self._streaming = False  # the request in hand's answer is a stream (started)
        self._stream_ended = False

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # as aiohttp: find dead peers
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.front.conns.add(self)
        self._idle_since = self.loop.time()
        self._keep_alive = self.loop.call_at(self._idle_since + self.front.keep_alive_s,
                                             self._check_idle)

    def data_received(self, data: bytes) -> None:
        if self._lingering or self.lost:
            return
        buf = self.buf
        if not buf:
            self.buf = data
        elif type(buf) is bytes and len(buf) < 65536:
            self.buf = buf + data
        else:  # a large body in many reads: no quadratic copying
            if type(buf) is bytes:
                self.buf = buf = bytearray(buf)
            buf += data
        if self.task is None:
            self._next()
        elif self._body_waiter is not None and len(self.buf) >= self._need:
            if not self._body_waiter.done():
                self._body_waiter.set_result(None)
        elif len(self.buf) > self._need + PIPELINE_BYTES and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        return False  # close (as aiohttp; a handler in hand is cancelled)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost:
            return
        self.lost = True
        self.front.conns.discard(self)
        self._unlink()
        if self._keep_alive is not None:
            self._keep_alive.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))
        if self.task is not None:
            self.task.cancel()  # handler cancellation: the upstream requests end with it

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- httptools callbacks (the head in ``_next``) -----------------------------------------------

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        n = name.lower()
        if n == b"content-length":
            self._lengths.append(value)
        elif n == b"authorization":
            self._auth = value.decode("latin-1")
        elif n == b"origin":
            self._origin = value
        elif n == b"x-disagg-timing":
            self._timing = value.decode("latin-1")
        elif n == b"traceparent":
            self._traceparent = value.decode("latin-1")
        elif n in _HAND_OFF_HEADERS:
            self._odd = True

    def on_headers_complete(self) -> None:
        self._head_done = True

    # -- requests ---------------------------------------------------------------------------------

    def _next(self) -> None:
        """Take the next request in ``buf`` when its head is complete (or hand the connection
        to aiohttp when it is not of the common shape)."""
        buf = self.buf
        if not buf:
            return
        if not could_start_request(buf):
            # Junk (binary, TLS to this plain port): a 400 now, not a wait for a line end
            # that may never come.
            self._cors, self._need = b"", 0
            self._answered(Reply.error(400, "not an HTTP/1.x request", close=True).answer())
            return
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > self.front.max_head_bytes or b"\n\n" in buf:
                self._hand_off()  # aiohttp's limits and answers (400, 431)
            return  # the rest of the head is to come (within keep_alive_s)
        head_len = end + 4
        path = self._parse_head(buf[:head_len]) if head_len <= self.front.max_head_bytes \
            else None
        length = self._lengths[0] if path is not None and len(self._lengths) == 1 else b""
        if (path is None or not length.isdigit() or len(length) > 12
                or int(length) > MAX_BODY_BYTES):
            self._hand_off()
            return
        self._head_len, self._need = head_len, head_len + int(length)
        self._keep = self.parser.should_keep_alive()
        cors = self.front.cors
        self._cors = (cors.fields(self._origin.decode("latin-1"))
                      if cors is not None and self._origin is not None else b"")
        self._stream_head, self._streaming, self._stream_ended = None, False, False
        self.task = self.loop.create_task(self._serve(path, self._auth, self._timing,
                                                      self._traceparent))

    def _parse_head(self, head: bytes) -> str | None:
        """The path of a request head of the common shape; None: aiohttp's."""
        self._url, self._fields, self._lengths = b"", 0, []
        self._auth, self._origin, self._odd, self._head_done = None, None, False, False
        self._timing = self._traceparent = None
        try:
            self.parser.feed_data(head)
        except httptools.HttpParserError:  # (an Upgrade too): aiohttp answers it
            return None
        p = self.parser
        if (not self._head_done or self._odd or self._fields > self.front.max_headers
                or p.get_method() != b"POST" or p.get_http_version() != "1.1"):
            return None
        return PATHS.get(self._url)

    async def _read_body(self) -> bytes:
        """The request in hand's body (``Reply`` 408 when it is late)."""
        if len(self.buf) < self._need:
            timeout_s = self.front.handlers.router.body_timeout_s
            self._body_waiter = fut = self.loop.create_future()
            try:
                await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                raise late_body(timeout_s) from None
            finally:
                self._body_waiter = None
        return self._take_body()

    def _take_body(self) -> bytes:
        buf = self.buf
        body, self.buf = bytes(buf[self._head_len:self._need]), buf[self._need:]
        if body:
            self.parser.feed_data(body)  # the parser's message ends with it
        self._need = 0
        return body

    async def _serve(self, path: str, authorization: str | None, timing: str | None,
                     traceparent: str | None) -> None:
        try:
            answer = await self.front.handlers.serve_openai(self, path, authorization,
                                                            self._read_body, timing,
                                                            traceparent)
        except (asyncio.CancelledError, ConnectionError):  # the client left, or shutdown
            self.close()
            return
        except Exception:
            logger.exception("unhandled error serving %s", path)
            if self._streaming:  # part of the answer went out: only closing can tell
                self.close()
                return
            answer = Reply.error(500, "internal server error", "internal_server_error").answer()
        if not self.lost:
            self._answered(answer)

    def _answered(self, answer: Answer) -> None:
        """Send a whole answer (a streamed one was sent); then the next request, or close."""
        transport = self.transport
        assert transport is not None
        unread = self._need > 0 and len(self.buf) < self._need  # part of its body is to come
        if self._need > 0 and not unread:
            self._take_body()  # not read by the handler (a 401): dropped
        close = answer.close or unread or not self._keep or self.front.closing
        if answer.streamed:
            if not self._stream_ended:  # the client left mid-stream
                self.close()
                return
        else:
            status = answer.status
            extra = b"" if not answer.headers else "".join(
                f"{k}: {v}\r\n" for k, v in answer.headers.items()).encode("latin-1")
            transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                            b"Date: %s\r\n%s%s%s\r\n%s" % (
                                status, REASONS.get(status, b"Unknown"),
                                answer.content_type.encode("latin-1"), len(answer.body),
                                self.front.date(), extra, self._cors,
                                b"Connection: close\r\n" if close else b"", answer.body))
        self.task = None
        if close:
            if answer.close or unread:
                self._linger()
            else:
                self.close()
            return
        self._idle_since = self.loop.time()
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        self._next()

    # -- ClientStream: the request in hand's streamed answer ---------------------------------------

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        close = not self._keep or self.front.closing
        self._streaming = True
        fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
        fields += self._cors
        self._stream_head = (b"HTTP/1.1 %d %s\r\n%sTransfer-Encoding: chunked\r\nDate: %s\r\n%s"
                             b"\r\n" % (status, REASONS.get(status, b"Unknown"), fields,
                                        self.front.date(),
                                        b"Connection: close\r\n" if close else b""))
        self._keep = not close

    async def write(self, data: bytes) -> None:
        if not data:
            return  # (an empty chunk would end the body)
        await self._send(b"%x\r\n%s\r\n" % (len(data), data))

    async def end(self) -> None:
        await self._send(b"0\r\n\r\n")
        self._stream_ended = True

    async def _send(self, data: bytes) -> None:
        if self.lost or self.transport.is_closing():  # type: ignore[union-attr]
            raise ConnectionResetError("the client closed the connection")
        if self._stream_head is not None:
            data, self._stream_head = self._stream_head + data, None
        self.transport.write(data)  # type: ignore[union-attr]
        if self._write_paused:  # the client reads slower than the router writes
            self._drain = fut = self.loop.create_future()
            try:
                await fut
            finally:
                self._drain = None

    # -- the connection's end or hand-off ---------------------------------------------------------

    def _unlink(self) -> None:
        """Drop the parser once the connection is lost or handed off: it holds this protocol's
        bound methods, a reference cycle that kept every closed connection (its transport, its
        handler task) alive until the next cycle collection, which the router runs rarely
        (``cli.tune_gc``): ~2 KB a connection, thousands of them between two collections."""
        self.parser = None  # type: ignore[assignment]  # never used once lost

    def close(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.close()

    def _check_idle(self) -> None:
        """The keep-alive timer: close a connection without a complete request head within
        ``keep_alive_s`` of its last answer (or of connecting)."""
        if self.lost or self._lingering:
            return
        now = self.loop.time()
        due = self._idle_since + self.front.keep_alive_s if self.task is None \
            else now + self.front.keep_alive_s
        if now >= due:
            self.close()
        else:
            self._keep_alive = self.loop.call_at(due, self._check_idle)

    def _linger(self) -> None:
        """After an answer to a request whose body was not read: drop what comes for
        ``linger_s`` (or until the client closes), then close."""
        self._lingering = True
        self.buf = b""
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        self.loop.call_later(self.front.linger_s, self.close)

    def _hand_off(self) -> None:
        """aiohttp's protocol takes the connection, with the bytes not yet consumed."""
        transport = self.transport
        assert transport is not None and self.task is None
        self.lost = True
        self.front.conns.discard(self)
        self._unlink()
        if self._keep_alive is not None:
            self._keep_alive.cancel()
        data, self.buf = self.buf, b""
        protocol = self.front.aiohttp_server()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self._read_paused:
            transport.resume_reading()
        if data:
            protocol.data_received(bytes(data))


class FrontSite(web.TCPSite):
    """An aiohttp TCP site whose connections start with ``FrontConnection``."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, handlers: Handlers, *,
                 keep_alive_s: float, linger_s: float, max_head_bytes: int, max_headers: int,
                 backlog: int, reuse_port: bool | None) -> None:
        super().__init__(runner, host, port, backlog=backlog, reuse_port=reuse_port)
        assert runner.server is not None
        self.front = Front(handlers, runner.server, keep_alive_s=keep_alive_s,
                           linger_s=linger_s, max_head_bytes=max_head_bytes,
                           max_headers=max_headers)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registered with the runner (as TCPSite.start)
        loop = asyncio.get_running_loop()
        front = self.front
        self._server = server = await loop.create_server(
            lambda: FrontConnection(front), self._host, self._port, backlog=self._backlog,
            reuse_port=self._reuse_port)
        if server.sockets:
            self._bound_port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()  # no new connections
        # (the runner's shutdown timeout, as aiohttp gives its own connections)
        await self.front.shutdown(getattr(self._runner, "_shutdown_timeout", 60.0))
        await super().stop()
