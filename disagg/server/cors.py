"""CORS on a worker (``--allowed-origins``; the policy: ``disagg.cors``): an ASGI middleware
outside every other, so that each answer (errors and streams too) gets the headers and
preflights are answered before any route or API key check."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response

from disagg.cors import Cors, with_vary


class CorsMiddleware:
    """``app`` with ``cors``'s headers on the answers to allowed origins."""

    def __init__(self, app: Any, cors: Cors) -> None:
        self.app = app
        self.cors = cors

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_headers = Headers(scope=scope)
        origin = request_headers.get("origin")
        if origin is None or not self.cors.allows(origin):
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in request_headers:
            answer = Response(status_code=204, headers=self.cors.preflight_headers(
                origin, request_headers.get("access-control-request-headers")))
            await answer(scope, receive, send)
            return
        extra = self.cors.headers(origin)

        async def send_with_cors(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in extra.items():
                    headers[name] = with_vary(headers.get(name), value) if name == "Vary" \
                        else value
            await send(message)

        await self.app(scope, receive, send_with_cors)
