"""The fan-out of one HTTP request into engine requests, and the merge of their outputs.

Each of a request's choices (``n`` of them for every prompt of a batched completions
request) is one engine request, a ``Choice``. A ``FanOut`` runs them: one pump task
per choice puts the engine's outputs into one queue, in arrival order, which the response
(``respond``) drains. Latencies and token counts go to the server's metrics as outputs arrive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disagg.contracts import protocol as P
from disagg.contracts.kv_mode import LOCAL, KVMode, PrefixPull
from disagg.engine.outputs import RequestOutput
from disagg.request import SamplingParams
from disagg.server.engine_errors import (
    failed_in_engine,
    kv_transfer_error,
    map_engine_error,
    transfer_failed,
)

if TYPE_CHECKING:
    from disagg.server.state import ServerState

_END = object()  # a pump's generator ended


@dataclass(eq=False)
class Choice:
    """One engine request: choice ``index`` of the HTTP response."""

    index: int
    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    final: RequestOutput | None = None  # the finished output
    last: RequestOutput | None = None  # the latest output (a failed request's stamps)
    finished: bool = False
    num_tokens: int = 0
    t_last_token: float | None = None
    # logprobs of tokens whose text the detokenizer still holds back (stop-string prefix)
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[dict[int, float]] = field(default_factory=list)
    text_offset: int = 0
    # Token ids not yet reported in the stream (``Format.token_ids``): they go with the next
    # chunk sent, as held-back logprobs do.
    unreported_ids: list[int] = field(default_factory=list)
    # Its disaggregation mode (built by ``disagg_requests`` from disaggregated_params), handed
    # to the engine unchanged.
    mode: KVMode = LOCAL
    # A peer's prefix lease this choice pulls (``kv_prefix``: ``disagg_requests.prefix_of``).
    prefix: PrefixPull | None = None


class FanOut:
    """Runs a request's choices in the engine and merges their outputs in arrival order."""

    def __init__(self, server: ServerState, choices: list[Choice], t_arrival: float) -> None:
        self.server = server
        self.choices = choices
        self.t0 = t_arrival  # when the HTTP request arrived (latencies count from here)
        self.queue: asyncio.Queue[tuple[Choice, Any]] = asyncio.Queue()
        self.buffer: list[tuple[Choice, Any]] = []
        self.pumps: list[asyncio.Task[None]] = []
        self.aborted = False

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def _pump(self, c: Choice) -> None:
        try:
            extra = {} if c.prefix is None else {"prefix": c.prefix}
            gen = self.server.engine.generate(c.request_id, c.prompt_ids, c.params,
                                              prompt=c.prompt_text, mode=c.mode, **extra)
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
        try:
            await self._until_first_outputs()
        except P.APIError:
            # Refused by the engine (queue full, bad input): nothing ran, so no "abort" count.
            self.abort(count_metrics=False)
            raise
        except BaseException:  # cancelled (client gone) while waiting for a first token
            self.abort()
            raise

    async def _until_first_outputs(self) -> None:
        waiting = set(self.choices)
        while waiting:
            c, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise map_engine_error(item)
            if item is _END:
                # A choice that already finished (its outputs are buffered) ends while
                # others still wait for capacity; or one that ended without any output.
                self.buffer.append((c, item))
                waiting.discard(c)
                continue
            c.last = item
            if item.finished and transfer_failed(item):
                # No token yet: a failed KV pull gets its own status, streamed or not.
                raise kv_transfer_error(str(item.kv_transfer_error))
            self.buffer.append((c, item))
            if c in waiting:
                waiting.discard(c)
                self.server.metrics.admitted(len(c.prompt_ids))

    async def events(self) -> AsyncIterator[tuple[Choice, Any]]:
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
                raise map_engine_error(item)
            self._observe(c, item)
            error = failed_in_engine(item)
            if error is not None:
                raise error
            yield c, item

    async def collect(self) -> None:
        async for _ in self.events():
            pass

    def _observe(self, c: Choice, out: RequestOutput) -> None:
        c.last = out
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

    def _finish(self, c: Choice, out: RequestOutput | None, reason: str) -> None:
        c.finished = True
        c.final = out
        self.server.inflight.pop(c.request_id, None)
        queue_s = None
        m = out.metrics if out is not None else None
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
