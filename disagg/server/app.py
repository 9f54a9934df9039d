"""The OpenAI-compatible HTTP app of one worker: ``build_app(engine, settings) -> FastAPI``.

The engine (``AsyncLLM``, DESIGN.md section 8) steps on its own thread; handlers only iterate its
async generators, so the event loop never runs the model. What the app may use of it is
``EngineClient`` (``disagg/engine/client.py``). The app is assembled here from
modules named for what they do:

- ``state``: ``ServerSettings`` and ``ServerState`` (the engine, metrics, requests in flight,
  draining, request bodies, prompt encoding), shared by every route;
- ``access``: who may call what (API key, cluster signatures, trusted KV peers);
- ``openai_routes``: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``;
- ``disagg_requests``: context_only / generation_only requests and their KV leases;
- ``fanout``: a request's choices as engine requests, their outputs merged;
- ``formats`` and ``respond``: the answer, whole or streamed (SSE);
- ``engine_errors``: an engine failure as the client's HTTP error;
- ``cluster_routes``: ``/health``, ``/version``, ``/server_info``, ``/kv_events``,
  ``/kv_leases/release``, ``/metrics``;
- ``role_switch``: ``POST /admin/role``, a context / generation worker's run-time role switch;
- ``tokenize_routes``: ``/tokenize``, ``/detokenize`` (vLLM's shapes); ``chat_prompt``: the
  chat template's prompt (``continue_final_message``, ``chat_template_kwargs``);
- ``http_guard``: HTTP limits below the routes; ``cors``: with ``allowed_origins``, CORS
  headers outside it (every path; preflights answered there, without the API key).

Failure policy: every client-caused problem is an ``APIError`` rendered as OpenAI error JSON
with its status; an unexpected exception is logged with its traceback and the client gets a
bare 500 without it. A client that goes away (mid-stream or while waiting for a non-streamed
answer) has its engine requests aborted, so their KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from disagg import __version__
from disagg.contracts import protocol as P
from disagg.cors import Cors
from disagg.server.cluster_routes import ClusterRoutes
from disagg.server.cors import CorsMiddleware
from disagg.server.http_guard import HttpGuard
from disagg.server.openai_routes import OpenAIRoutes
from disagg.server.role_switch import RoleRoutes
from disagg.server.state import ServerSettings, ServerState
from disagg.server.tokenize_routes import TokenizeRoutes

if TYPE_CHECKING:
    from disagg.engine.client import EngineClient

__all__ = ["ServerSettings", "begin_drain", "build_app"]

logger = logging.getLogger(__name__)

# Refusals counted by disagg_requests_rejected_total{reason}: client errors, and the 503s that
# say this worker cannot take requests now.
_REJECT_REASONS = {400: "invalid_request", 401: "unauthorized", 404: "model_not_found"}
_UNAVAILABLE_CODES = ("queue_full", "draining", "engine_unavailable", "role_switching")


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    """The HTTP app serving ``engine`` (an ``AsyncLLM``, or anything else implementing
    ``EngineClient``)."""
    srv = ServerState(engine, settings)
    app = FastAPI(title="disagg worker", version=__version__, lifespan=_lifespan(srv),
                  docs_url=None, redoc_url=None)
    app.state.server = srv
    if srv.access.wide_open:
        logger.warning("no API key and no cluster token: /server_info and /kv_events answer "
                       "anyone who can reach this port (set --api-key or --cluster-token)")
    app.add_middleware(HttpGuard)  # HTTP limits; a 500 that keeps the connection alive
    if settings.allowed_origins:  # opt-in: without it no answer has CORS headers
        # Outside HttpGuard: its answers get the headers too; preflights are answered there.
        app.add_middleware(CorsMiddleware, cors=Cors(settings.allowed_origins))
    _add_error_handlers(app, srv)
    OpenAIRoutes(srv).register(app)
    ClusterRoutes(srv).register(app)
    app.state.role_routes = RoleRoutes(srv)  # (the CLI hooks its router registration in)
    app.state.role_routes.register(app)
    TokenizeRoutes(srv).register(app)
    return app


def begin_drain(app: FastAPI, grace_s: float) -> None:
    """Start draining ``app`` (see ``ServerState.begin_drain``); for the process's signal
    handler."""
    app.state.server.begin_drain(grace_s)


def _lifespan(srv: ServerState) -> Callable[[FastAPI], Any]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.loop = asyncio.get_running_loop()
        if srv.settings.owns_engine:
            srv.engine.start()
        try:
            yield
        finally:
            # uvicorn has already waited out its graceful-shutdown period; abort what's left.
            srv.draining = True
            srv.abort_all()
            if srv.settings.owns_engine:
                await srv.engine.shutdown()

    return lifespan


def _add_error_handlers(app: FastAPI, srv: ServerState) -> None:
    """Every error as OpenAI error JSON; refusals counted in the server's metrics."""

    def error_response(e: P.APIError) -> JSONResponse:
        reason = _REJECT_REASONS.get(e.status, e.code or "other")
        if e.status < 500 or e.code in _UNAVAILABLE_CODES:
            srv.metrics.rejected(reason)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def api_error(request: Request, e: P.APIError) -> JSONResponse:
        return error_response(e)

    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = (e.errors() or [{}])[0]
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        return error_response(P.bad_request(f"{loc}: {err.get('msg', 'invalid request')}",
                                            param=loc.split(".")[0] or None))

    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(P.error_body(str(e.detail), kind, code=e.status_code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        # Logged with its traceback here; the client only learns that it was our fault.
        logger.exception("unhandled error serving %s", request.url.path)
        return JSONResponse(P.error_body("internal server error", "internal_server_error"),
                            status_code=500)

    app.add_exception_handler(P.APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)
