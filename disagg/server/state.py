"""A worker app's settings and its state shared by every route: ``ServerSettings``,
``ServerState`` (the engine, metrics, requests in flight, draining, request bodies, prompts).

One ``ServerState`` per app, made by ``build_app`` and handed to the route classes explicitly
(it is also ``app.state.server``, for the signal handler and tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from disagg.contracts import protocol as P
from disagg.contracts.options import WORKER_DEFAULTS, WorkerOptions, check_role
from disagg.contracts.roles import Role
from disagg.server.access import Access
from disagg.server.engine_errors import unavailable
from disagg.server.metrics import ServerMetrics
from disagg.server.role_switch import RoleSwitcher
from disagg.tracing import WORKER_SERVICE, Tracer, tracer_for

if TYPE_CHECKING:
    from disagg.engine.client import EngineClient
    from disagg.kv_connector.base import KVConnector

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    """What the app needs of a worker's options (``from_options``), resolved; the defaults are
    the options' (``WORKER_DEFAULTS``)."""

    model_dir: str
    served_model_name: str | None = None  # default: model_dir as given (as vllm serve does)
    # The role at start (a ``Role``; its wire string is accepted and converted).
    role: Role = WORKER_DEFAULTS.role
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    # The cluster secret: requests signed with it are the cluster's (router -> worker). A
    # context / generation worker uses its transfer settings' token when this is None.
    cluster_token: str | None = None
    public_metrics: bool = WORKER_DEFAULTS.public_metrics  # /metrics open even with an API key
    owns_engine: bool = True  # the app's lifespan starts the engine and shuts it down
    # Benchmarking aid: generation_only requests without context params decode at once.
    benchmark_gen_only: bool = WORKER_DEFAULTS.benchmark_gen_only
    # Reads tool calls out of tool_choice "auto" answers (server/tool_calls.py); None:
    # such requests are a 400 (forced calls need no parser).
    tool_call_parser: str | None = None
    # --chat-template: the template's text (tokenizer.read_chat_template), replacing the
    # checkpoint's; None: the checkpoint's.
    chat_template: str | None = None
    # --allowed-origins: CORS origins ("*": any) the app answers with CORS headers; () none.
    allowed_origins: tuple[str, ...] = ()
    # /v1/responses kept for previous_response_id and GET: how many (0: none), for how long.
    responses_store_size: int = WORKER_DEFAULTS.responses_store_size
    responses_store_ttl: float = WORKER_DEFAULTS.responses_store_ttl
    # Tracing (disagg/tracing.py): the OTLP/HTTP endpoint, resolved (None: off).
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        check_role(self.role)  # ValueError naming ``role``
        object.__setattr__(self, "role", Role(self.role))

    @classmethod
    def from_options(cls, options: WorkerOptions, *, api_key: str | None,
                     cluster_token: str | None, chat_template: str | None,
                     allowed_origins: tuple[str, ...],
                     otlp_traces_endpoint: str | None = None) -> ServerSettings:
        """The settings of the worker ``options`` describe (``options.model`` set); what is
        resolved when it starts is given: the API key and cluster token (the option or the
        environment), the chat template's text, the checked CORS origins, the traces'
        endpoint (the option or the OTEL_* variables)."""
        assert options.model is not None
        return cls(model_dir=options.model, served_model_name=options.served_model_name,
                   role=options.role, api_key=api_key, cluster_token=cluster_token,
                   public_metrics=options.public_metrics,
                   benchmark_gen_only=options.benchmark_gen_only,
                   tool_call_parser=options.tool_call_parser, chat_template=chat_template,
                   allowed_origins=allowed_origins,
                   responses_store_size=options.responses_store_size,
                   responses_store_ttl=options.responses_store_ttl,
                   otlp_traces_endpoint=otlp_traces_endpoint)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir


class Abortable(Protocol):
    """What runs a request's engine requests (``fanout.FanOut``), as draining sees it."""

    def abort(self, count_metrics: bool = True) -> None: ...


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class ServerState:
    """What the routes share: the engine and its config, settings, metrics, access checks and
    the engine requests in flight (each with the fan-out that runs it)."""

    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        if settings.chat_template is not None:
            # Every prompt this worker renders (chat, /tokenize) uses it; the engine only
            # detokenizes, so the tokenizer it holds is the one place to set it.
            engine.tokenizer.chat_template = settings.chat_template
        self.engine = engine
        self.settings = settings
        self.roles = RoleSwitcher()  # a run-time role switch (role_switch.py)
        self.config = engine.config
        self.model_name = settings.model_name
        sched = self.config.scheduler
        self.metrics = ServerMetrics(engine, self.model_name, sched.max_batch_size,
                                     sched.max_num_tokens)
        self.draining = False
        self.inflight: dict[str, Abortable] = {}  # engine request id -> its fan-out
        self._tasks: set[asyncio.Task[Any]] = set()
        self.token_text = lru_cache(maxsize=1 << 16)(self._decode_one)
        self.created = P.now()
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        transfer = engine.transfer
        self.access = Access(settings.api_key, settings.cluster_token, settings.public_metrics,
                             transfer.settings if transfer is not None else None)
        self.body_timeout_s = P.BODY_TIMEOUT_S  # then 408 (tests shorten it)
        # Tracing (None: off, one check a request): spans of each request from its stamps.
        endpoint = settings.otlp_traces_endpoint
        self.tracer: Tracer | None = (None if endpoint is None
                                      else tracer_for(endpoint, WORKER_SERVICE))

    def _decode_one(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def transfer(self) -> KVConnector | None:
        """The engine's KV connector (None on an aggregated worker)."""
        return self.engine.transfer

    @property
    def peer_reuse(self) -> bool:
        """Whether this worker leases cached prefixes to peers and pulls theirs
        (``kv_peer_reuse``)."""
        rt = self.transfer
        return rt is not None and rt.settings.kv_peer_reuse

    @property
    def serving_role(self) -> Role:
        """The role the engine serves: its KV connector's (the one owner of a context /
        generation worker's role, which may switch at run time), else the role at start."""
        rt = self.transfer
        return rt.role if rt is not None else self.settings.role

    @property
    def role(self) -> Role:
        """The role this worker reports and takes requests for: the old one until a role
        switch is done (``role_switch``)."""
        return self.roles.reported_role(self.serving_role)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Fire and forget, keeping a reference (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- draining ------------------------------------------------------------------------------

    def begin_drain(self, grace_s: float) -> None:
        """Stop taking requests; abort the ones still running after ``grace_s`` seconds.

        Callable from a signal handler. The late ones are aborted through the engine, so
        their streams still end properly (finish_reason "abort", then [DONE]).
        """
        if self.draining:
            return
        self.draining = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.call_later, grace_s, self.abort_inflight)

    def abort_inflight(self) -> None:
        for rid in list(self.inflight):
            logger.warning("drain period over: aborting request %s", rid)
            self.spawn(self.engine.abort(rid))

    def abort_all(self) -> None:
        for fan in {id(f): f for f in self.inflight.values()}.values():
            fan.abort()

    def check_not_switching(self) -> None:
        """503 ``role_switching`` while the worker switches role (before a request's body is
        read: a generation_only request's lease is left for the worker it is sent to next)."""
        sw = self.roles.switch
        if sw is not None:
            raise unavailable(f"the worker is switching role {sw.from_role.value} -> "
                              f"{sw.to_role.value} ({sw.state}); retry on another worker",
                              "role_switching")

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down", "draining")
        if not self.engine.is_healthy():
            raise unavailable("the engine is not running", "engine_unavailable")

    # -- the request body ----------------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        """The request body: plain (415 for a Content-Encoding), at most MAX_BODY_BYTES (413),
        arrived within ``body_timeout_s`` (408; a client that announced more than it sends
        would otherwise hold its handler forever)."""
        P.check_content_encoding(request.headers.get("content-encoding"))
        close = {"Connection": "close"}  # the rest of the body is not read
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > P.MAX_BODY_BYTES:
            raise P.APIError(413, f"request body too large: {length} bytes (at most "
                             f"{P.MAX_BODY_BYTES})", code="body_too_large", headers=close)
        try:
            body = await asyncio.wait_for(_read_at_most(request, P.MAX_BODY_BYTES, close),
                                          self.body_timeout_s)
        except asyncio.TimeoutError:
            raise P.APIError(408, f"the request body did not arrive within "
                             f"{self.body_timeout_s:g} s", code="request_timeout",
                             headers=close) from None
        except ClientDisconnect:  # nobody will read the answer
            raise P.APIError(400, "the client closed the connection before sending its body",
                             code="client_disconnected") from None
        request.state.body = body  # the stream is consumed: later readers use body_of
        return body

    @staticmethod
    def body_of(request: Request) -> bytes | None:
        """The body ``read_body`` read (None when it was not read, or refused)."""
        return getattr(request.state, "body", None)

    async def until_disconnect(self, request: Request, work: Awaitable[T]) -> T:
        """Await ``work``; if the client disconnects first, cancel it (its cleanup aborts the
        engine requests) and raise ``ClientGone``."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        if task in done:
            return task.result()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone()

    # -- the model and the prompt --------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.APIError(404, f"The model `{model}` does not exist (this server serves "
                             f"`{self.model_name}`).", param="model", code="model_not_found")

    @property
    def max_model_len(self) -> int:
        return int(self.config.max_model_len)

    def kv_capacity_tokens(self) -> int | None:
        try:
            return self.engine.stats().kv_blocks_total * self.config.cache.tokens_per_block
        except Exception:
            return None

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True,
                      field: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.engine.tokenizer.encode(prompt,
                                                    add_special_tokens=add_special_tokens))
            if not ids:
                raise P.bad_request(f"{field}: encodes to no tokens", param=field)
        else:
            vocab = self.config.model.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise P.bad_request(f"{field}: token id {bad} is out of range [0, {vocab})",
                                    param=field)
            ids = list(prompt)
        sched = self.config.scheduler
        if not sched.enable_chunked_context and len(ids) > sched.max_num_tokens:
            # (the engine would take it, then fail it: it could never be scheduled)
            raise P.bad_request(
                f"{field}: {len(ids)} tokens, more than max_num_tokens={sched.max_num_tokens}; "
                f"this worker prefills whole prompts only (enable_chunked_context is off)",
                param=field)
        return ids


async def _read_at_most(request: Request, limit: int, headers: dict[str, str]) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.APIError(413, f"request body too large (at most {limit} bytes)",
                             code="body_too_large", headers=headers)
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
