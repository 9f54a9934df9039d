"""CORS on the router's aiohttp server (``allowed_origins``; the policy: ``disagg.cors``).

``install`` answers preflights in a middleware (every path: they are OPTIONS requests, which
aiohttp serves) and adds the headers in ``on_response_prepare``, before any answer's head goes
out (streamed ones too). ``front``'s own server writes ``Cors.fields`` into the heads it sends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from disagg.cors import Cors, with_vary


def install(app: web.Application, cors: Cors) -> None:
    """Preflights and the answers' CORS headers on ``app``."""

    @web.middleware
    async def preflight(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                        ) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if (request.method == "OPTIONS" and origin is not None and cors.allows(origin)
                and "Access-Control-Request-Method" in request.headers):
            return web.Response(status=204, headers=cors.preflight_headers(
                origin, request.headers.get("Access-Control-Request-Headers")))
        return await handler(request)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if (origin is None or not cors.allows(origin)
                or "Access-Control-Allow-Origin" in response.headers):
            return
        for name, value in cors.headers(origin).items():
            if name == "Vary":
                value = with_vary(response.headers.get("Vary"), value)
            response.headers[name] = value

    app.middlewares.append(preflight)
    app.on_response_prepare.append(on_prepare)
