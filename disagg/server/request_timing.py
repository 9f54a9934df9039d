"""A worker's per-request timing (``disagg/timing.py`` has the phases and the arithmetic).

The server stamps what only it sees: when the HTTP request came in (the route's first line),
when a stream's first chunk went to the HTTP server, when the answer was built. The engine
stamps the rest on the request's ``RequestMetrics`` (queued, first scheduled, KV reads
submitted, the poll that found them done, first and last token). ``RequestTiming.finish``
turns them into the request's phases once its answer is built: observed in
``disagg_request_phase_seconds{phase}`` for every request that succeeded, and returned as the
answer's ``timing`` object when the request asked for it (``asked``: the body's ``timing:
true``, the router's ``disaggregated_params.timing: true``, or the header ``X-Disagg-Timing:
1``). A request with several choices is timed by its first one.

Traced (``disagg/tracing.py``: the worker has a tracer and the request's ``trace``), the same
stamps become its spans: the server span (HTTP request in -> answer built) under the caller's
``traceparent``, one child per phase; a pull's ``kv_transfer`` span has the id its KV READs
name (``disagg_requests``), so the context worker's ``kv_read`` spans sit under it. A request
that ends without its answer (refused or failed in the engine, aborted there, its client gone)
has its spans too, from the stamps its engine output had by then, the server span's status an
error (a client error's, 4xx, is left unset) and its HTTP status an attribute.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request

from disagg import timing as T
from disagg.contracts import protocol as P
from disagg.contracts.kv_mode import Dummy, KVMode, Pull
from disagg.engine.outputs import RequestMetrics
from disagg.tracing import Trace, worker_request_attributes

# nginx's "client closed request": the status of an answer its client left before it
# (``respond``).
CLIENT_CLOSED = 499
ABORTED = "aborted in the engine"  # a span's error: the request ended without its output

if TYPE_CHECKING:
    from disagg.server.fanout import Choice
    from disagg.server.state import ServerState


def timing_asked(request: Request, req: Any) -> bool:
    """Whether the request asks for its timing (module docstring); 400 naming the header
    when its value is neither yes nor no (the body's field is checked by its schema)."""
    try:
        if T.header_asks(request.headers.get(T.HEADER)):
            return True
    except ValueError as e:
        raise P.bad_request(str(e), param=T.HEADER) from None
    if getattr(req, "timing", False) is True:
        return True
    dp = getattr(req, "disaggregated_params", None)
    return isinstance(dp, dict) and dp.get(T.FIELD) is True


def worker_stamps(mode: KVMode, m: RequestMetrics, first_sent: float | None, done: float
                  ) -> tuple[list[tuple[str, float | None]], str, float | None]:
    """The request's phase ends (``timing.consecutive``), the phase that ends at the first
    token the client sees, and that token's stamp: a streamed answer's first chunk
    (``first_sent``), else the engine's first token."""
    if mode.is_context:
        return ([(T.ADMISSION, m.arrival_time), (T.QUEUE, m.first_scheduled_time),
                 (T.PREFILL, m.first_token_time), (T.CONTEXT_ANSWER, done)], T.PREFILL,
                m.first_token_time)
    if isinstance(mode, Pull | Dummy):
        head: list[tuple[str, float | None]] = [
            (T.ADMISSION, m.arrival_time), (T.KV_WAIT, m.kv_load_start_time),
            (T.KV_TRANSFER, m.kv_poll_time), (T.KV_INSTALL, m.first_token_time)]
        first = T.KV_INSTALL
    else:
        head = [(T.ADMISSION, m.arrival_time), (T.QUEUE, m.first_scheduled_time),
                (T.PREFILL, m.first_token_time)]
        first = T.PREFILL
    if first_sent is not None:
        head.append((T.FIRST_TOKEN, first_sent))
        return (head + [(T.DECODE, m.last_token_time), (T.FINISH, done)], T.FIRST_TOKEN,
                first_sent)
    return head + [(T.DECODE, m.last_token_time), (T.FINISH, done)], first, m.first_token_time


class RequestTiming:
    """One HTTP request's timing on a worker (module docstring)."""

    __slots__ = ("received", "asked", "first_sent", "trace", "name")

    def __init__(self, received: float, asked: bool, trace: Trace | None = None,
                 path: str = "") -> None:
        self.received = received
        self.asked = asked
        self.first_sent: float | None = None
        self.trace = trace  # (None: not traced)
        self.name = "POST " + path if trace is not None else ""  # its server span's

    def sent(self) -> None:
        """A stream chunk goes out now (only the first one counts)."""
        if self.first_sent is None:
            self.first_sent = time.monotonic()

    def finish(self, srv: ServerState, choices: list[Choice]) -> dict[str, Any] | None:
        """The answer is built: record the phases of its first choice in the server's
        metrics; the ``timing`` object when asked (None otherwise, or when that choice has
        no engine output: aborted)."""
        done = time.monotonic()
        final = choices[0].final if choices else None
        if final is None:
            if choices and self.trace is not None:  # ended in the engine without its final
                # output (aborted there)
                self._spans(srv, choices[0], self._ends(choices[0], done), done, 200, ABORTED)
            return None
        ends, first, first_at = worker_stamps(choices[0].mode, final.metrics, self.first_sent,
                                              done)
        b = T.worker_breakdown(srv.role.value, self.received, ends, first, first_at)
        srv.metrics.phases((p.name, p.seconds) for p in b.phases)
        self._spans(srv, choices[0], ends, done, 200, None)
        return b.to_json() if self.asked else None

    def failed(self, srv: ServerState, choices: list[Choice], status: int, error: str) -> None:
        """The request ended without its whole answer: refused or failed in the engine
        (``status``: the error's HTTP status, ``error`` what it said) or its client gone
        (499). Not in the phase metrics (those are of answers); traced, its spans are made as
        ``finish`` makes them, from what its engine output had stamped by then (nothing yet:
        the server span alone). The server span's status is an error, but for a client error
        (4xx other than 499), which OpenTelemetry's HTTP conventions leave unset."""
        if self.trace is None or srv.tracer is None or not choices:
            return
        done = time.monotonic()
        server_side = status >= 500 or status == CLIENT_CLOSED
        self._spans(srv, choices[0], self._ends(choices[0], done), done, status,
                    error if server_side else None)

    def _ends(self, c: Choice, done: float) -> list[tuple[str, float | None]]:
        """The phase ends ``c``'s latest engine output stamped (none yet: [])."""
        out = c.final or c.last
        if out is None or out.metrics is None:
            return []
        return worker_stamps(c.mode, out.metrics, self.first_sent, done)[0]

    def _spans(self, srv: ServerState, c: Choice, ends: list[tuple[str, float | None]],
               done: float, status: int, error: str | None) -> None:
        """The request's spans (traced), made once the answer left (the loop's next turn),
        and only once: a request that failed after its answer was built keeps its first."""
        trace, self.trace = self.trace, None
        if trace is None or srv.tracer is None:
            return
        asyncio.get_running_loop().call_soon(
            srv.tracer.request_spans, trace, self.name, self.received, ends, done,
            worker_request_attributes(srv.role.value, c.request_id, len(c.prompt_ids),
                                      c.num_tokens, status), error)
