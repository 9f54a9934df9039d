"""HTTP-level limits of a worker: what uvicorn (h11) does not bound by itself.

uvicorn has knobs for some limits (``timeout_keep_alive``, ``h11_max_incomplete_event_size``,
set explicitly by ``uvicorn_options``) but none for these, so they are added here:

- ``HttpGuard`` (ASGI middleware, innermost of Starlette's error middleware): only HTTP/1.0
  and 1.1 (h11 passes ``HTTP/9.9`` on as 1.1; anything else gets 505), at most
  ``MAX_HEADERS`` header fields and ``MAX_HEADER_BYTES`` of them (431), a request target of at
  most ``MAX_TARGET_BYTES`` (414); and an unexpected exception before the response started
  becomes a logged 500 with OpenAI error JSON *without* re-raising. (Starlette's own 500
  handler re-raises, and uvicorn then closes the keep-alive connection: a client's pool,
  such as the router's, would reuse that connection for its next, unrelated request and get
  "connection reset".)
- ``guarded_h11_protocol``: uvicorn's h11 protocol with a header timeout. uvicorn arms no
  timer while a request's head is incomplete (and none on a connection that never sends a
  byte), so a client sending its headers slowly, or an HTTP/0.9 request line, would hold the
  connection forever. A connection must deliver a complete request head within
  ``HEADER_TIMEOUT_S`` of connecting or of its first byte after the previous response; else
  it gets 408 (if it sent anything) and is closed.

The body is bounded by the handlers (``protocol.BODY_TIMEOUT_S``: 408, ``MAX_BODY_BYTES``: 413).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from disagg.contracts.protocol import error_body

logger = logging.getLogger("disagg.server")

HEADER_TIMEOUT_S = 30.0  # a request's head (request line + headers) must arrive within this
MAX_HEADERS = 128  # header fields per request (aiohttp's default, which the router uses)
MAX_HEADER_BYTES = 32 << 10  # their names and values together
MAX_TARGET_BYTES = 16 << 10  # path + query
H11_MAX_INCOMPLETE_EVENT_BYTES = 64 << 10  # h11's buffer for an unfinished request head
# Idle keep-alive connections stay open this long (uvicorn's default is 5 s). A client whose pool
# keeps idle connections longer than the server reuses one just as the server closes it and
# gets "connection reset" on a request the server never saw; common pools keep them 5-60 s
# (httpx 5, aiohttp 15, nginx 60), the router's and bench client's less (CLIENT_KEEP_ALIVE_S).
SERVER_KEEP_ALIVE_S = 75


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _error_json(status: int, message: str, type: str, code: str | None) -> bytes:
    return json.dumps(error_body(message, type, code=code), separators=(",", ":")).encode()


async def _send_error(send: Send, status: int, message: str, type: str = "invalid_request_error",
                      code: str | None = None, close: bool = True) -> None:
    body = _error_json(status, message, type, code)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:  # the request was not (or not wholly) read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def check_head(scope: Scope) -> tuple[int, str, str] | None:
    """(status, message, code) when the request head breaks a limit, else None."""
    version = scope.get("http_version")
    if version not in ("1.0", "1.1"):
        return 505, f"HTTP/{version} is not supported (HTTP/1.0 or 1.1)", "http_version"
    headers = scope.get("headers") or ()
    if len(headers) > MAX_HEADERS:
        return (431, f"too many header fields: {len(headers)} (at most {MAX_HEADERS})",
                "headers_too_large")
    size = sum(len(k) + len(v) for k, v in headers)
    if size > MAX_HEADER_BYTES:
        return (431, f"header fields too large: {size} bytes (at most {MAX_HEADER_BYTES})",
                "headers_too_large")
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    if target > MAX_TARGET_BYTES:
        return 414, f"request target too long: {target} bytes (at most {MAX_TARGET_BYTES})", \
            "uri_too_long"
    return None


class HttpGuard:
    """ASGI middleware: head limits, and unexpected errors as 500s that keep the connection."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        bad = check_head(scope)
        if bad is not None:
            status, message, code = bad
            await _send_error(send, status, message, code=code)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            if started:  # mid-response: only closing the connection can tell the client
                raise
            logger.exception("unhandled error serving %s", scope.get("path"))
            # uvicorn discards what is left of the request body: keep-alive stays safe.
            await _send_error(send, 500, "internal server error", "internal_server_error",
                              close=False)


def guarded_h11_protocol(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol plus the header timeout (see the module docstring)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_bytes = False
            super().connection_made(transport)
            self._arm_head_timer()  # also a connection that never sends anything

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()  # a new request starts: its head must come in time
            if self._head_timer is not None:
                self._head_bytes = True
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._timed_cycle:
                self._cancel_head_timer()  # the head is complete: the handler takes over

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._timed_cycle = self.cycle
            self._head_bytes = False
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not self._timed_cycle:
                return
            if self._head_bytes:
                body = _error_json(408, f"the request head did not arrive within "
                                   f"{header_timeout_s:g} s", "invalid_request_error",
                                   "request_timeout")
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_options(header_timeout_s: float = HEADER_TIMEOUT_S,
                    keep_alive_s: float | None = None) -> dict[str, Any]:
    """The worker's HTTP limits as ``uvicorn.Config`` keyword arguments (set explicitly, so a
    uvicorn upgrade or an installed httptools cannot change them)."""
    return {
        "http": guarded_h11_protocol(header_timeout_s),
        "h11_max_incomplete_event_size": H11_MAX_INCOMPLETE_EVENT_BYTES,
        "timeout_keep_alive": SERVER_KEEP_ALIVE_S if keep_alive_s is None else keep_alive_s,
    }
