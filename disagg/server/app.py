"""The OpenAI-compatible HTTP app of one worker: ``build_app(engine, settings) -> FastAPI``.

The engine (``AsyncLLM``, DESIGN section 8) steps on its own thread; handlers only iterate its
async generators, so the event loop never runs the model. Each of a request's choices (``n``,
and every prompt of a batched completions request) is one engine request; a ``_FanOut`` pumps
their outputs into one queue that the handler drains.

Access (the README's "Security model"): ``/v1/*`` needs the API key when one is set;
``/server_info`` and ``/kv_events`` a cluster signature (``cluster_auth.sign_http``) or the API
key; ``/metrics`` the API key or a signature when an API key is set (unless
``public_metrics``); ``/kv_leases/release`` a signature. A ``generation_only`` request pulls KV
only from addresses it may trust (signed by the cluster, or every host in
``kv_peer_allowlist``), and its pulled KV enters the prefix cache only when it was signed.

Failure policy: every client-caused problem is an ``APIError`` rendered as OpenAI error JSON
with its status; an unexpected exception is logged with its traceback and the client gets a
bare 500 without it. A client that goes away (mid-stream or while waiting for a non-streamed
answer) has its engine requests aborted, so their KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from disagg import __version__
from disagg.cluster_auth import AUTH_HEADER, AuthError, HttpVerifier, PeerAllowlist
from disagg.engine import EngineDeadError, QueueFullError
from disagg.kv_cache.hashing import BLOCK_HASH_SCHEME
from disagg.layout import ParallelLayout, check_compatible
from disagg.request import SamplingParams
from disagg.server import protocol as P
from disagg.server.http_guard import MAX_BODY_BYTES, HttpGuard
from disagg.server.metrics import ServerMetrics
from disagg.server.options import check_role
from disagg.transfer.params import ContextParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a client told "queue full" should wait before retrying

T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    model_dir: str
    served_model_name: str | None = None  # default: model_dir as given (as vllm serve does)
    role: str = "aggregated"
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    # The cluster secret: requests signed with it are the cluster's (router -> worker). A
    # context / generation worker uses its transfer settings' token when this is None.
    cluster_token: str | None = None
    public_metrics: bool = False  # /metrics open even when an API key is set
    owns_engine: bool = True  # the app's lifespan starts the engine and shuts it down
    # Benchmarking aid: generation_only requests without context params decode at once.
    benchmark_gen_only: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir


# ---- one request's engine requests --------------------------------------------------------


_END = object()  # a pump's generator ended


@dataclass(eq=False)
class _Choice:
    """One engine request: choice ``index`` of the HTTP response."""

    index: int
    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    final: Any = None  # the finished RequestOutput
    finished: bool = False
    num_tokens: int = 0
    t_last_token: float | None = None
    # logprobs of tokens whose text the detokenizer still holds back (stop-string prefix)
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[dict[int, float]] = field(default_factory=list)
    text_offset: int = 0
    context_only: bool = False  # prefill + first token; the answer carries the KV lease
    remote: ContextParams | None = None  # generation_only: where the prompt KV is pulled from
    cache_remote_kv: bool = False  # the pulled KV may enter the prefix cache (signed request)
    dummy_kv: bool = False  # benchmark gen-only: decode without the prompt's KV


class _FanOut:
    """Runs a request's choices in the engine and merges their outputs in arrival order."""

    def __init__(self, server: _Server, choices: list[_Choice], t_arrival: float) -> None:
        self.server = server
        self.choices = choices
        self.t0 = t_arrival  # when the HTTP request arrived (latencies count from here)
        self.queue: asyncio.Queue[tuple[_Choice, Any]] = asyncio.Queue()
        self.buffer: list[tuple[_Choice, Any]] = []
        self.pumps: list[asyncio.Task[None]] = []
        self.aborted = False

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def _pump(self, c: _Choice) -> None:
        try:
            kw: dict[str, Any] = {}
            if c.context_only or c.remote is not None or c.dummy_kv:
                # only disaggregated engines take these
                kw = {"context_only": c.context_only, "remote": c.remote}
                if c.remote is not None:
                    kw["cache_remote_kv"] = c.cache_remote_kv
                if c.dummy_kv:
                    kw["dummy_kv"] = True
            gen = self.server.engine.generate(c.request_id, c.prompt_ids, c.params,
                                              prompt=c.prompt_text, **kw)
            async for out in gen:
                self.queue.put_nowait((c, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the handler, which maps it to a status
            self.queue.put_nowait((c, e))
            return
        self.queue.put_nowait((c, _END))

    async def start(self) -> None:
        """Submit every choice; return once each has produced its first output.

        Errors the engine raises before the first output (bad input, queue full) surface
        here, before any response header is sent, so they get their own status code.
        """
        for c in self.choices:
            self.server.inflight[c.request_id] = self
            self.pumps.append(asyncio.create_task(self._pump(c)))
        waiting = set(self.choices)
        try:
            while waiting:
                c, item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise _map_engine_error(item)
                if item is _END:
                    # A choice that already finished (its outputs are buffered) ends while
                    # others still wait for capacity; or one that ended without any output.
                    self.buffer.append((c, item))
                    waiting.discard(c)
                    continue
                if item.finished and _transfer_failed(item):
                    # No token yet: a failed KV pull gets its own status, streamed or not.
                    raise _transfer_error(item.error)
                self.buffer.append((c, item))
                if c in waiting:
                    waiting.discard(c)
                    self.server.metrics.admitted(len(c.prompt_ids))
        except P.APIError:
            # Refused by the engine (queue full, bad input): nothing ran, so no "abort" count.
            self.abort(count_metrics=False)
            raise
        except BaseException:  # cancelled (client gone) while waiting for a first token
            self.abort()
            raise

    async def events(self) -> AsyncIterator[tuple[_Choice, Any]]:
        """Outputs of all choices until every one has finished (after ``start``)."""
        while not self.done:
            if self.buffer:
                c, item = self.buffer.pop(0)
            else:
                c, item = await self.queue.get()
            if item is _END:
                if not c.finished:  # ended without a final output: treat as aborted
                    self._finish(c, None, "abort")
                continue
            if isinstance(item, BaseException):
                raise _map_engine_error(item)
            self._observe(c, item)
            if item.finished and _transfer_failed(item):
                raise _transfer_error(item.error)
            if item.finished and getattr(item, "error", None):
                raise P.APIError(500, f"the request failed in the engine: {item.error}",
                                 type="internal_server_error")
            yield c, item

    async def collect(self) -> None:
        async for _ in self.events():
            pass

    def _observe(self, c: _Choice, out: Any) -> None:
        comp = out.outputs[0]
        now = time.monotonic()
        n = len(comp.delta_token_ids)
        if n:
            first = now - self.t0 if c.num_tokens == 0 else None
            gap = now - c.t_last_token if c.t_last_token is not None else None
            self.server.metrics.tokens(n, gap, first)
            c.num_tokens += n
            c.t_last_token = now
        if out.finished:
            self._finish(c, out, comp.finish_reason or "stop")

    def _finish(self, c: _Choice, out: Any, reason: str) -> None:
        c.finished = True
        c.final = out
        self.server.inflight.pop(c.request_id, None)
        queue_s = None
        m = getattr(out, "metrics", None)
        if m is not None and m.first_scheduled_time is not None:
            queue_s = max(m.first_scheduled_time - m.arrival_time, 0.0)
        self.server.metrics.finished(reason, len(c.prompt_ids), c.num_tokens,
                                     time.monotonic() - self.t0, queue_s)

    def abort(self, count_metrics: bool = True) -> None:
        """Abort every unfinished choice now (sync: safe in ``finally`` under cancellation)."""
        if self.aborted:
            return
        self.aborted = True
        for c in self.choices:
            if not c.finished:
                if count_metrics:
                    self._finish(c, None, "abort")
                else:
                    c.finished = True
                    self.server.inflight.pop(c.request_id, None)
                self.server.spawn(self.server.engine.abort(c.request_id))
        for t in self.pumps:
            t.cancel()  # closes the engine's generator too (it aborts on close as well)

    async def abort_if_unfinished(self) -> None:
        if not self.done:
            self.abort()


def _transfer_failed(out: Any) -> bool:
    # The engine types the failure (RequestOutput.kv_transfer_error); ``error`` is its text.
    return getattr(out, "kv_transfer_error", None) is not None


def _transfer_error(error: str) -> P.APIError:
    # 502: the upstream (context worker) could not deliver the KV; never answer with
    # tokens computed without it.
    return P.APIError(502, error, type="kv_transfer_error", code="kv_transfer_failed")


def _map_engine_error(e: BaseException) -> P.APIError:
    if isinstance(e, P.APIError):
        return e
    if isinstance(e, QueueFullError):
        return P.APIError(503, f"the server is overloaded: {e}; retry later",
                          type="server_overloaded", code="queue_full",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return P.APIError(503, "the engine is not running", type="service_unavailable",
                          code="engine_unavailable",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, ValueError):  # SamplingParamsError, engine validation: bad input
        return P.from_value_error(e)
    logger.error("engine request failed", exc_info=e)
    return P.APIError(500, "internal server error", type="internal_server_error")


# ---- the server state -----------------------------------------------------------------------


class _Server:
    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        check_role(settings.role)
        self.engine = engine
        self.settings = settings
        self.config = engine.config
        self.model_name = settings.model_name
        sched = self.config.scheduler
        self.metrics = ServerMetrics(engine, self.model_name, sched.max_batch_size,
                                     sched.max_num_tokens)
        self.draining = False
        self.inflight: dict[str, _FanOut] = {}  # engine request id -> its fan-out
        self._tasks: set[asyncio.Task[Any]] = set()
        self.token_text = lru_cache(maxsize=1 << 16)(self._decode_one)
        self.created = P.now()
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        transfer_settings = getattr(getattr(engine, "transfer", None), "settings", None)
        token = settings.cluster_token or getattr(transfer_settings, "cluster_token", None)
        self.verifier = HttpVerifier(token) if token else None
        self.peer_allowlist: PeerAllowlist = getattr(
            transfer_settings, "kv_peer_allowlist", None) or PeerAllowlist()
        self.body_timeout_s = P.BODY_TIMEOUT_S  # then 408 (tests shorten it)

    def _decode_one(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Fire and forget, keeping a reference (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    async def read_body(self, request: Request) -> bytes:
        """The request body: plain (415 for a Content-Encoding), at most MAX_BODY_BYTES (413),
        arrived within ``body_timeout_s`` (408; a client that announced more than it sends
        would otherwise hold its handler forever)."""
        P.check_content_encoding(request.headers.get("content-encoding"))
        close = {"Connection": "close"}  # the rest of the body is not read
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise P.APIError(413, f"request body too large: {length} bytes (at most "
                             f"{MAX_BODY_BYTES})", code="body_too_large", headers=close)

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise P.APIError(413, f"request body too large (at most {MAX_BODY_BYTES} "
                                     "bytes)", code="body_too_large", headers=close)
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            body = await asyncio.wait_for(read(), self.body_timeout_s)
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

    # -- checks -------------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                  key.encode()):
            raise P.APIError(401, "invalid or missing API key (send 'Authorization: Bearer "
                             "<key>')", code="invalid_api_key")

    # -- cluster authentication (see the module docstring for the endpoint rules) -------------

    def _api_key_ok(self, request: Request) -> bool:
        key = self.settings.api_key
        if not key:
            return False
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                   key.encode())

    def signature_error(self, request: Request, body: bytes) -> str | None:
        """Why ``request`` is not signed by the cluster (None: it is). Checked once per
        request: a signature's nonce is spent by its first check."""
        state = request.state
        if not hasattr(state, "cluster_auth_error"):
            if self.verifier is None:
                why: str | None = "this worker has no cluster token"
            else:
                try:
                    self.verifier.check(request.headers.get(AUTH_HEADER), request.method,
                                        _request_target(request), body)
                    why = None
                except AuthError as e:
                    why = str(e)
            state.cluster_auth_error = why
        return state.cluster_auth_error

    def is_signed(self, request: Request, body: bytes) -> bool:
        return self.signature_error(request, body) is None

    def check_cluster_access(self, request: Request) -> None:
        """401 unless a bodiless request (GET) is signed by the cluster or carries the API
        key."""
        if self._api_key_ok(request):
            return
        why = self.signature_error(request, b"")
        if why is None:
            return
        alt = " or the API key ('Authorization: Bearer <key>')" if self.settings.api_key else ""
        raise P.APIError(401, f"{request.url.path}: needs a cluster signature "
                         f"({AUTH_HEADER}){alt}: {why}", type="authentication_error",
                         code="unauthorized")

    def check_internal_access(self, request: Request) -> None:
        """/server_info, /kv_events: a signature or the API key; open on a worker with
        neither (it warned at start)."""
        if self.verifier is None and not self.settings.api_key:
            return
        self.check_cluster_access(request)

    def check_metrics_access(self, request: Request) -> None:
        if self.settings.public_metrics or not self.settings.api_key:
            return
        self.check_cluster_access(request)

    def trusts_addresses(self, request: Request, body: bytes, addresses: list[str]) -> bool:
        """May this worker connect to ``addresses`` for ``request`` (design rule 2): the
        request is signed by the cluster, or every host is in ``kv_peer_allowlist``."""
        return self.is_signed(request, body) or (
            bool(addresses) and self.peer_allowlist.first_denied(addresses) is None)

    def release_refused(self, request: Request, body: bytes) -> None:
        """A generation_only request refused before the engine took it (bad field, wrong
        model, queue full...): free the context worker's KV now instead of at lease expiry,
        but only toward addresses it may trust (releasing means connecting)."""
        if self.settings.role != "generation" or getattr(request.state, "lease_taken", False):
            return
        if getattr(self.engine, "transfer", None) is None:
            return
        ref = _lease_of(body)
        if ref is None or not self.trusts_addresses(request, body, list(ref.addresses)):
            return
        logger.info("request refused: releasing context lease %s", ref.ctx_request_id)
        self.engine.release_remote(ref)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.APIError(404, f"The model `{model}` does not exist (this server serves "
                             f"`{self.model_name}`).", param="model", code="model_not_found")

    def check_accepting(self) -> None:
        if self.draining:
            raise P.APIError(503, "the server is shutting down", type="service_unavailable",
                             code="draining", headers={"Retry-After": str(RETRY_AFTER_S)})
        if not self.engine.is_healthy():
            raise P.APIError(503, "the engine is not running", type="service_unavailable",
                             code="engine_unavailable",
                             headers={"Retry-After": str(RETRY_AFTER_S)})

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

    def request_type(self, req: Any, num_prompts: int) -> str | None:
        """The request's disaggregated type if it needs this role's KV plumbing, else None
        (an ordinary request). 400 when this worker's role cannot serve it."""
        kind = req.request_type
        if kind in (None, "context_and_generation"):
            return None
        need = "context" if kind == "context_only" else "generation"
        if self.settings.role != need or getattr(self.engine, "transfer", None) is None:
            raise P.bad_request(
                f"disaggregated_params.request_type: {kind!r} requests need a {need} worker; "
                f"this worker's role is {self.settings.role!r}", param="disaggregated_params")
        if req.n != 1 or num_prompts != 1:
            raise P.bad_request(f"n: a {kind} request has exactly one prompt and n = 1",
                                param="n")
        if kind == "context_only" and req.stream:
            raise P.bad_request("stream: context_only answers are not streamed", param="stream")
        return kind

    def remote_params(self, req: Any, prompt_ids: list[int] | None, signed: bool
                      ) -> ContextParams:
        """Validate a generation_only request's ContextParams (400 naming the field). A
        refusal releases the lease through ``release_refused``."""
        d = dict(req.disaggregated_params)
        try:
            params = ContextParams.from_dict(
                d, prompt_token_ids=None if "prompt_token_ids" in d else prompt_ids)
        except ValueError as e:
            raise P.bad_request(str(e), param="disaggregated_params") from None
        denied = None if signed else self.peer_allowlist.first_denied(params.addresses)
        if denied is not None:
            # Never connect where an unauthenticated client points (not even to release).
            raise P.bad_request(
                f"disaggregated_params.addresses: {denied!r} is not a trusted context worker: "
                f"the request is not signed by the cluster ({AUTH_HEADER}) and its host is not "
                f"in this worker's kv_peer_allowlist", param="disaggregated_params.addresses")
        try:
            check_compatible(params.layout, self.engine.transfer.layout)
        except ValueError as e:
            raise P.bad_request(f"disaggregated_params.{e}", param="disaggregated_params"
                                ) from None
        return params

    async def until_disconnect(self, request: Request, work: Awaitable[T]) -> T:
        """Await ``work``; if the client disconnects first, cancel it (its cleanup aborts the
        engine requests) and raise ``_ClientGone``."""
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
        raise _ClientGone()


class _ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def _request_target(request: Request) -> str:
    """The path and query exactly as the client sent them (what a cluster signature covers)."""
    scope = request.scope
    raw = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    target = raw.decode("latin-1")
    return f"{target}?{query.decode('latin-1')}" if query else target


@dataclass(frozen=True)
class _LeaseRef:
    """What releasing a context lease needs, when the rest of the params did not parse."""

    ctx_request_id: str
    backend: str
    addresses: tuple[str, ...]


def _lease_of(body: bytes) -> ContextParams | _LeaseRef | None:
    """The context lease a generation_only request body names, if it names one (the full
    params when they parse, else just the lease id, backend and addresses)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    dp = data.get("disaggregated_params") if isinstance(data, dict) else None
    if not isinstance(dp, dict) or dp.get("request_type") != "generation_only":
        return None
    with contextlib.suppress(ValueError):
        prompt = None if "prompt_token_ids" in dp else data.get("prompt")
        return ContextParams.from_dict(dp, prompt_token_ids=prompt if isinstance(
            prompt, list) else None)
    lease, backend, addresses = (dp.get("ctx_request_id"), dp.get("backend"),
                                 dp.get("addresses"))
    if not (isinstance(lease, str) and isinstance(backend, str)
            and backend.upper() in ("UCX", "TCP") and isinstance(addresses, list)
            and addresses and all(isinstance(a, str) for a in addresses)):
        return None
    return _LeaseRef(lease, backend.upper(), tuple(addresses))


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- the app --------------------------------------------------------------------------------


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The HTTP app serving ``engine`` (an ``AsyncLLM`` or anything with its interface)."""
    srv = _Server(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.loop = asyncio.get_running_loop()
        if settings.owns_engine:
            engine.start()
        try:
            yield
        finally:
            # uvicorn has already waited out its graceful-shutdown period; abort what's left.
            srv.draining = True
            srv.abort_all()
            if settings.owns_engine:
                await engine.shutdown()

    app = FastAPI(title="disagg worker", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.server = srv
    if srv.verifier is None and not settings.api_key:
        logger.warning("no API key and no cluster token: /server_info and /kv_events answer "
                       "anyone who can reach this port (set --api-key or --cluster-token)")
    app.add_middleware(HttpGuard)  # HTTP limits; a 500 that keeps the connection alive

    def error_response(e: P.APIError) -> JSONResponse:
        reason = {400: "invalid_request", 401: "unauthorized", 404: "model_not_found"}.get(
            e.status, e.code or "other")
        if e.status < 500 or e.code in ("queue_full", "draining", "engine_unavailable"):
            srv.metrics.rejected(reason)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = (e.errors() or [{}])[0]
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        return error_response(P.bad_request(f"{loc}: {err.get('msg', 'invalid request')}",
                                            param=loc.split(".")[0] or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(P.error_body(str(e.detail), kind, code=e.status_code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        # Logged with its traceback here; the client only learns that it was our fault.
        logger.exception("unhandled error serving %s", request.url.path)
        return JSONResponse(P.error_body("internal server error", "internal_server_error"),
                            status_code=500)

    # -- OpenAI endpoints ---------------------------------------------------------------------

    def releasing_refused(handler: Callable[[Request], Awaitable[Response]]
                          ) -> Callable[[Request], Awaitable[Response]]:
        """A generation_only request that fails before the engine takes it (any refusal after
        its body was read) releases its context lease: nobody else will read that KV."""

        @functools.wraps(handler)
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception:
                body = srv.body_of(request)
                if body is not None:  # (a refusal before the body was read names no lease)
                    try:
                        srv.release_refused(request, body)
                    except Exception:  # never hide the refusal itself
                        logger.exception("cannot release the context lease")
                raise

        return wrapped

    @app.post("/v1/completions")
    @releasing_refused
    async def completions(request: Request) -> Response:
        t_arrival = time.monotonic()
        srv.check_auth(request)
        req: P.CompletionRequest = P.parse_request(P.CompletionRequest,
                                                   await srv.read_body(request))
        _log_extra(req)
        srv.check_model(req.model)
        srv.check_accepting()
        rid = P.new_id("cmpl")
        prompts = req.prompts()
        kind = srv.request_type(req, len(prompts))
        if kind is not None:
            return await _disagg(request, req, prompts[0], None, kind,
                                 _CompletionFormat(srv, req, rid), t_arrival)
        choices: list[_Choice] = []
        n = req.n
        for pi, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{pi}"
            ids = srv.encode_prompt(prompt, field=where)
            params = req.to_sampling_params(len(ids), srv.max_model_len)
            text = prompt if isinstance(prompt, str) else None
            for i in range(n):
                index = pi * n + i  # OpenAI's order: choices of prompt 0, then prompt 1, ...
                sub_id = rid if len(prompts) * n == 1 else f"{rid}-{index}"
                choices.append(_Choice(index, sub_id, pi, ids, text, P.choice_params(params, i)))
        return await _respond(request, req, choices, _CompletionFormat(srv, req, rid),
                              t_arrival)

    @app.post("/v1/chat/completions")
    @releasing_refused
    async def chat_completions(request: Request) -> Response:
        t_arrival = time.monotonic()
        srv.check_auth(request)
        req: P.ChatCompletionRequest = P.parse_request(P.ChatCompletionRequest,
                                                       await srv.read_body(request))
        _log_extra(req)
        srv.check_model(req.model)
        srv.check_accepting()
        rid = P.new_id("chatcmpl")
        messages = req.chat_messages()
        kind = srv.request_type(req, 1)
        if kind == "generation_only" and "prompt_token_ids" in req.disaggregated_params:
            # The context worker's token ids are the prompt (no second tokenization).
            return await _disagg(request, req, None, None, kind, _ChatFormat(srv, req, rid),
                                 t_arrival)
        try:
            text = engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:  # ChatTemplateError: raise_exception(...) in the template
            raise P.bad_request(f"messages: the chat template rejected them: {e}",
                                param="messages") from None
        # The template writes the special tokens (bos) itself.
        ids = srv.encode_prompt(text, add_special_tokens=False, field="messages")
        if kind is not None:
            return await _disagg(request, req, ids, text, kind, _ChatFormat(srv, req, rid),
                                 t_arrival)
        params = req.to_sampling_params(len(ids), srv.max_model_len, srv.kv_capacity_tokens())
        choices = [
            _Choice(i, rid if req.n == 1 else f"{rid}-{i}", 0, ids, text,
                    P.choice_params(params, i))
            for i in range(req.n)
        ]
        return await _respond(request, req, choices, _ChatFormat(srv, req, rid), t_arrival)

    async def _disagg(request: Request, req: Any, prompt: str | list[int] | None,
                      text: str | None, kind: str, fmt: _Format, t_arrival: float) -> Response:
        """One context_only or generation_only choice. ``prompt``: text or ids to encode, or
        None when the ids come from ``disaggregated_params.prompt_token_ids``."""
        is_chat = isinstance(fmt, _ChatFormat)
        ids: list[int] | None = None
        if prompt is not None:
            if is_chat:  # chat prompts arrive encoded already
                ids = list(prompt)  # type: ignore[arg-type]
            elif kind == "context_only" or "prompt_token_ids" not in req.disaggregated_params:
                ids = srv.encode_prompt(prompt)
            if isinstance(prompt, str):
                text = prompt
        dummy = (kind == "generation_only" and srv.settings.benchmark_gen_only
                 and "ctx_request_id" not in req.disaggregated_params)
        signed = False
        remote = None
        if kind == "generation_only" and not dummy:
            signed = srv.is_signed(request, srv.body_of(request) or b"")
            remote = srv.remote_params(req, ids, signed)
        if dummy and "prompt_token_ids" in req.disaggregated_params:
            raw = req.disaggregated_params["prompt_token_ids"]
            if not (isinstance(raw, list) and raw and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in raw)):
                raise P.bad_request("disaggregated_params.prompt_token_ids: expected a non-empty "
                                    "list of token ids", param="disaggregated_params")
            ids = srv.encode_prompt(raw, field="disaggregated_params.prompt_token_ids")
        if remote is not None:
            ids = list(remote.prompt_token_ids)
        assert ids is not None
        if is_chat:
            params = req.to_sampling_params(len(ids), srv.max_model_len,
                                            srv.kv_capacity_tokens())
        else:
            params = req.to_sampling_params(len(ids), srv.max_model_len)
        if remote is not None and params.max_tokens <= len(remote.first_gen_tokens):
            raise P.bad_request("max_tokens: the context worker's answer already holds "
                                "every token asked for (it was final)", param="max_tokens")
        # Only KV the cluster vouches for may be reused by other requests (design rule 3):
        # anyone else could send KV that does not belong to prompt_token_ids.
        choice = _Choice(0, fmt.rid, 0, ids, text, params, context_only=kind == "context_only",
                         remote=remote, dummy_kv=dummy, cache_remote_kv=signed)
        request.state.lease_taken = True  # from here the engine releases it on every path
        return await _respond(request, req, [choice], fmt, t_arrival)

    async def _respond(request: Request, req: Any, choices: list[_Choice], fmt: _Format,
                       t_arrival: float) -> Response:
        rid = fmt.rid
        fan = _FanOut(srv, choices, t_arrival)
        if req.stream:
            try:
                await srv.until_disconnect(request, fan.start())
            except _ClientGone:
                return Response(status_code=499)
            return StreamingResponse(
                _stream(fan, fmt), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
                background=BackgroundTask(fan.abort_if_unfinished))

        async def run() -> None:
            try:
                await fan.start()
                await fan.collect()
            finally:
                if not fan.done:  # cancelled (disconnect, shutdown) or failed
                    fan.abort()

        try:
            await srv.until_disconnect(request, run())
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed"
        body = fmt.response(choices)
        if choices[0].context_only:
            # The router's next call: null params mean the answer is final (EOS, stop, or
            # max_tokens reached) and the context worker has freed the KV already.
            final = choices[0].final
            body["prompt_token_ids"] = list(choices[0].prompt_ids)
            body["disaggregated_params"] = getattr(final, "disaggregated_params", None)
        return JSONResponse(body, headers={"X-Request-Id": rid})

    async def _stream(fan: _FanOut, fmt: _Format) -> AsyncIterator[str]:
        try:
            for chunk in fmt.start_chunks(fan.choices):
                yield P.sse(chunk)
            async for c, out in fan.events():
                chunk = fmt.delta_chunk(c, out)
                if chunk is not None:
                    yield P.sse(chunk)
            if fmt.include_usage:
                yield P.sse(fmt.usage_chunk(fan.choices))
        except P.APIError as e:  # headers are gone: report in-band, as OpenAI does
            yield P.sse(e.body())
        finally:
            # Client gone (cancelled) or error: free the engine's blocks now. No await here:
            # under cancellation an await would be cancelled again.
            if not fan.done:
                fan.abort()
        yield P.SSE_DONE

    # -- other endpoints ----------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        srv.check_auth(request)
        return {"object": "list", "data": [{
            "id": srv.model_name, "object": "model", "created": srv.created,
            "owned_by": "disagg", "root": settings.model_dir,
            "max_model_len": srv.max_model_len,
        }]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if srv.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.is_healthy():
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        srv.check_internal_access(request)
        cfg = srv.config
        try:
            kv_blocks = engine.stats().kv_blocks_total
        except Exception:
            kv_blocks = None
        B = cfg.cache.tokens_per_block
        return {
            "role": settings.role,
            "worker_id": getattr(engine, "worker_id", None),
            "benchmark_gen_only": settings.benchmark_gen_only,
            "model": srv.model_name,
            "model_dir": settings.model_dir,
            "architecture": cfg.model.architecture,
            "version": __version__,
            "tokens_per_block": B,
            "block_hash_scheme": BLOCK_HASH_SCHEME,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "kv_cache_blocks": kv_blocks,
            "kv_cache_tokens": None if kv_blocks is None else kv_blocks * B,
            "max_batch_size": cfg.scheduler.max_batch_size,
            "max_num_tokens": cfg.scheduler.max_num_tokens,
            "max_model_len": srv.max_model_len,
            "max_queue": cfg.scheduler.max_queue,
            "enable_chunked_context": cfg.scheduler.enable_chunked_context,
            "capacity_policy": cfg.scheduler.capacity_policy.value,
            "parallel": {
                "tensor_parallel_size": cfg.parallel.tensor_parallel_size,
                "pipeline_parallel_size": cfg.parallel.pipeline_parallel_size,
                "world_size": cfg.parallel.world_size,
                # Which layers / kv heads each rank's KV cache holds (for KV transfer).
                "layouts": [lay.to_dict()
                            for lay in ParallelLayout.all_ranks(cfg.model, cfg.parallel)],
                "rank_pids": getattr(engine, "rank_pids", None),
            },
            "dtype": cfg.dtype,
            "device": cfg.device,
            # Context / generation workers: worker_id, backend, transfer address(es).
            "kv_transfer": (engine.transfer.info()
                            if getattr(engine, "transfer", None) is not None else None),
            "kv_blocks_used": _blocks_used(engine),
        }

    @app.post("/kv_leases/release")
    async def release_lease(request: Request) -> JSONResponse:
        """Cluster-internal (a router that could not hand a context answer to any generation
        worker): free that answer's KV now instead of at lease expiry. Needs a cluster
        signature."""
        rt = getattr(engine, "transfer", None)
        if rt is None or rt.role != "context":
            raise P.APIError(404, f"no KV leases on a {settings.role!r} worker",
                             type="not_found_error")
        raw = await srv.read_body(request)
        why = srv.signature_error(request, raw)
        if why is not None:
            raise P.APIError(401, f"/kv_leases/release: needs a cluster signature "
                             f"({AUTH_HEADER}): {why}", type="authentication_error",
                             code="unauthorized")
        try:
            lease_id = P.parse_json_object(raw)["ctx_request_id"]
            if not isinstance(lease_id, str):
                raise TypeError
        except (P.APIError, KeyError, TypeError):
            raise P.bad_request("ctx_request_id: expected {\"ctx_request_id\": str}",
                                param="ctx_request_id") from None
        return JSONResponse({"ctx_request_id": lease_id,
                             "released": engine.release_lease(lease_id)})

    @app.get("/kv_events")
    async def kv_events(request: Request, since: int = 0) -> dict[str, Any]:
        """The KV cache's stored / removed block hashes since event ``since`` (routers poll
        this for KV-aware routing; see disagg/kv_cache/events.py for the resync rule)."""
        srv.check_internal_access(request)  # it tells whether a guessed prompt is cached
        batch = engine.kv_events.since(since)
        return {
            "worker_id": engine.worker_id,
            "tokens_per_block": srv.config.cache.tokens_per_block,
            "block_hash_scheme": BLOCK_HASH_SCHEME,
            "next_seq": batch.next_seq,
            "events": [{"seq": seq, "type": kind, "block_hashes": hashes}
                       for seq, kind, hashes in batch.events],
            "snapshot": batch.snapshot,
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        srv.check_metrics_access(request)
        body, content_type = srv.metrics.render()
        return Response(body, media_type=content_type)

    return app


def _blocks_used(engine: Any) -> int | None:
    try:
        return int(engine.stats().kv_blocks_used)
    except Exception:
        return None


def begin_drain(app: FastAPI, grace_s: float) -> None:
    """Start draining ``app`` (see ``_Server.begin_drain``); for the process's signal handler."""
    app.state.server.begin_drain(grace_s)


def _log_extra(req: Any) -> None:
    if req.model_extra:
        logger.info("ignoring unknown request fields: %s", sorted(req.model_extra))


# ---- response formats -----------------------------------------------------------------------


class _Format:
    """Builds one endpoint's responses and stream chunks from engine outputs."""

    def __init__(self, srv: _Server, req: Any, rid: str) -> None:
        self.srv = srv
        self.req = req
        self.rid = rid
        self.created = P.now()
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        self.model = srv.model_name
        self.include_usage = req.include_usage_in_stream

    def usage(self, choices: list[_Choice]) -> dict[str, Any]:
        prompts: dict[int, list[_Choice]] = {}
        for c in choices:
            prompts.setdefault(c.prompt_index, []).append(c)
        prompt_tokens = sum(len(cs[0].prompt_ids) for cs in prompts.values())
        completion_tokens = sum(c.num_tokens for c in choices)
        # n choices are n engine requests over one prompt: report what all of them reused.
        cached = sum(min(_cached(c) for c in cs) for cs in prompts.values())
        return P.usage(prompt_tokens, completion_tokens, cached)

    def start_chunks(self, choices: list[_Choice]) -> list[dict[str, Any]]:
        return []

    def response(self, choices: list[_Choice]) -> dict[str, Any]:
        raise NotImplementedError

    def delta_chunk(self, c: _Choice, out: Any) -> dict[str, Any] | None:
        raise NotImplementedError

    def usage_chunk(self, choices: list[_Choice]) -> dict[str, Any]:
        raise NotImplementedError

    def take_logprobs(self, c: _Choice, comp: Any, flush: bool) -> tuple[list[int],
                                                                         list[dict[int, float]]]:
        """The delta's tokens and logprobs, held back while the delta has no text yet."""
        if c.params.logprobs is None or comp.delta_logprobs is None:
            return [], []
        c.pending_ids.extend(comp.delta_token_ids)
        c.pending_lps.extend(comp.delta_logprobs)
        if not (comp.delta_text or flush):
            return [], []
        ids, lps = c.pending_ids, c.pending_lps
        c.pending_ids, c.pending_lps = [], []
        return ids, lps


def _cached(c: _Choice) -> int:
    return int(getattr(c.final, "num_cached_tokens", 0) or 0) if c.final is not None else 0


def _final(c: _Choice) -> Any:
    """The choice's last CompletionOutput; an empty aborted one if the engine never sent it."""
    if c.final is not None:
        return c.final.outputs[0]
    return SimpleNamespace(text="", token_ids=[], logprobs=None, finish_reason="abort",
                           stop_reason=None)


def _finish(c: _Choice, out: Any) -> tuple[str | None, int | str | None]:
    if not out.finished:
        return None, None
    comp = out.outputs[0]
    return comp.finish_reason, comp.stop_reason


class _CompletionFormat(_Format):
    def response(self, choices: list[_Choice]) -> dict[str, Any]:
        items = []
        for c in choices:
            comp = _final(c)
            lp = None
            if c.params.logprobs is not None and comp.logprobs is not None:
                lp = P.completion_logprobs(comp.token_ids, comp.logprobs, self.srv.token_text)
            items.append(P.completion_choice(c.index, comp.text, comp.finish_reason, lp,
                                             comp.stop_reason))
        return P.completion_response(self.rid, self.created, self.model, items,
                                     self.usage(choices))

    def delta_chunk(self, c: _Choice, out: Any) -> dict[str, Any] | None:
        comp = out.outputs[0]
        finish, stop_reason = _finish(c, out)
        ids, lps = self.take_logprobs(c, comp, flush=finish is not None)
        if not comp.delta_text and finish is None:
            return None
        lp = None
        if c.params.logprobs is not None:
            lp = P.completion_logprobs(ids, lps, self.srv.token_text, c.text_offset)
            c.text_offset += sum(len(t) for t in lp["tokens"])
        choice = P.completion_choice(c.index, comp.delta_text, finish, lp, stop_reason)
        return P.completion_chunk(self.rid, self.created, self.model, [choice],
                                  with_usage_field=self.include_usage)

    def usage_chunk(self, choices: list[_Choice]) -> dict[str, Any]:
        return P.completion_chunk(self.rid, self.created, self.model, [], self.usage(choices),
                                  with_usage_field=True)


class _ChatFormat(_Format):
    @property
    def top_n(self) -> int:
        return self.req.top_logprobs or 0

    def response(self, choices: list[_Choice]) -> dict[str, Any]:
        items = []
        for c in choices:
            comp = _final(c)
            lp = None
            if self.req.logprobs and comp.logprobs is not None:
                lp = P.chat_logprobs(comp.token_ids, comp.logprobs, self.srv.token_text,
                                     self.top_n)
            items.append(P.chat_choice(c.index, comp.text, comp.finish_reason, lp,
                                       comp.stop_reason))
        return P.chat_response(self.rid, self.created, self.model, items, self.usage(choices))

    def start_chunks(self, choices: list[_Choice]) -> list[dict[str, Any]]:
        # OpenAI opens each choice with a role-only delta.
        return [P.chat_chunk(self.rid, self.created, self.model,
                             [P.chat_chunk_choice(c.index, {"role": "assistant", "content": ""})],
                             with_usage_field=self.include_usage) for c in choices]

    def delta_chunk(self, c: _Choice, out: Any) -> dict[str, Any] | None:
        comp = out.outputs[0]
        finish, stop_reason = _finish(c, out)
        ids, lps = self.take_logprobs(c, comp, flush=finish is not None)
        if not comp.delta_text and finish is None:
            return None
        lp = None
        if self.req.logprobs:
            lp = P.chat_logprobs(ids, lps, self.srv.token_text, self.top_n)
        delta = {"content": comp.delta_text} if comp.delta_text else {}
        choice = P.chat_chunk_choice(c.index, delta, finish, lp, stop_reason)
        return P.chat_chunk(self.rid, self.created, self.model, [choice],
                            with_usage_field=self.include_usage)

    def usage_chunk(self, choices: list[_Choice]) -> dict[str, Any]:
        return P.chat_chunk(self.rid, self.created, self.model, [], self.usage(choices),
                            with_usage_field=True)

