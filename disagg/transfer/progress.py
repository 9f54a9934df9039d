"""Which prompt KV of streaming requests exists yet, per context rank (layer-wise streaming).

A streaming context request publishes its KV layer by layer while its prefill runs; generation
ranks READ with ``wait_s`` (``base.py``) and the transfer server answers once the tokens they
ask for exist on the layers they ask for. ``StreamProgress`` is the meeting point: the engine
thread (writer) tells it what each step computes and when each layer's attention has written
its KV; the transfer server's loop (readers) waits on it.

Ready rule of a read of tokens ``[0, n)`` on local layers ``[l0, l1)``::

    committed >= n                                  (an earlier step wrote them on every layer)
    or (this step's end >= n and layers done in this step >= l1)

    step k:    begin_step ── layer_done(0) ── layer_done(1) ── ... ── layer_done(L-1)
    step k+1:  begin_step (commits step k: committed = its end) ── ...

On a CUDA cache ``layer_done`` is called when the layer's kernels are queued, not finished: it
records a CUDA event, and a read that became ready waits for the event of the last layer it
needs (polled from the loop, never blocking it). Writers wake a reader only when one waits, so
``layer_done`` costs an attribute test in a step without stream items.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# StreamNotReady codes; the transfer server answers them as its own codes of these names.
UNKNOWN_LEASE = "unknown_lease"  # never opened within the wait, or closed
BAD_REQUEST = "bad_request"  # num_tokens / tokens_hash / layers do not match the stream
TIMEOUT = "timeout"  # opened, not ready within the wait

# Closed ids remembered so that a read arriving after its stream ended fails at once, not
# after its whole wait (an id is never reused: the router draws them at random).
MAX_CLOSED_IDS = 4096
# How often a ready read polls the CUDA event of the last layer it needs (seconds): the
# kernels were queued just before layer_done, so the first poll usually finds them done.
EVENT_POLL_S = (0.0, 0.0002, 0.0005, 0.001, 0.002)


class StreamNotReady(Exception):
    """A streaming read cannot be answered. ``code``: unknown_lease | bad_request | timeout."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class _Stream:
    num_tokens: int
    tokens_hash: str
    block_ids: tuple[int, ...] = ()
    committed: int = 0  # tokens [0, committed) are written on every layer
    step_end: int | None = None  # in the current step: it computes tokens up to here
    # the CUDA event after which ``committed`` tokens are in memory (None: CPU, or none yet)
    committed_event: torch.cuda.Event | None = None
    # what the context worker sampled after the prefill ({"tokens": [...], "logprobs": ...}),
    # for the read that asks for it (``want_first``); None until then
    first: dict[str, Any] | None = None


@dataclass(eq=False)
class _Waiter:
    """One read waiting on the transfer server's loop."""

    stream_id: str
    num_tokens: int
    layer_end: int
    tokens_hash: str
    loop: asyncio.AbstractEventLoop
    want_first: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    seen_open: bool = False


# A waiter's check: None (wait on), or (block ids, CUDA event to wait for or None).
_Ready = tuple[tuple[int, ...], Any]


class StreamProgress:
    """One rank's view of which prompt KV of streaming requests exists (thread-safe).
    Writer: the engine thread / rank main thread. Readers: the transfer server's loop."""

    def __init__(self, num_local_layers: int, device: torch.device) -> None:
        if not isinstance(num_local_layers, int) or num_local_layers < 1:
            raise ValueError(f"num_local_layers must be an int >= 1, got {num_local_layers!r}")
        self.num_local_layers = num_local_layers
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._waiters: dict[str, set[_Waiter]] = {}
        # The current step: its stream ids (empty: layer_done is a no-op), layers done, the
        # CUDA event recorded after each of its layers.
        self._step_ids: tuple[str, ...] = ()
        self._layers_done = 0
        self._events: list[torch.cuda.Event | None] = []

    # ---- writer side ----------------------------------------------------------------------

    def open(self, stream_id: str, num_tokens: int, tokens_hash: str) -> None:
        """A streaming request exists (queued): reads may wait on it. ``num_tokens``: the
        prompt's length (what the context worker prefills), ``tokens_hash``:
        ``token_ids_hash`` of those ids."""
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        with self._lock:
            if stream_id in self._streams:
                raise ValueError(f"stream {stream_id!r} is already open")
            self._streams[stream_id] = _Stream(num_tokens, tokens_hash)
            self._closed.pop(stream_id, None)
            self._wake_locked(self._waiters.get(stream_id, ()))

    def close(self, stream_id: str) -> None:
        """The stream is gone (any reason): its waiters fail with unknown_lease."""
        with self._lock:
            if self._streams.pop(stream_id, None) is None:
                return
            self._closed[stream_id] = None
            while len(self._closed) > MAX_CLOSED_IDS:
                self._closed.popitem(last=False)
            self._wake_locked(self._waiters.get(stream_id, ()))

    def set_first(self, stream_id: str, first: dict[str, Any]) -> None:
        """The context worker sampled the request's first token(s) (``first``: JSON-able):
        the read that waits for them (``want_first``) gets them with its answer."""
        with self._lock:
            s = self._streams.get(stream_id)
            if s is not None:
                s.first = dict(first)
                self._wake_locked(self._waiters.get(stream_id, ()))

    def first_of(self, stream_id: str) -> dict[str, Any] | None:
        """What ``set_first`` published for ``stream_id`` (None: nothing yet, or closed)."""
        with self._lock:
            s = self._streams.get(stream_id)
            return None if s is None else s.first

    def begin_step(self, items: Sequence[tuple[str, Sequence[int], int, int]]) -> None:
        """Before the forward of every step while any stream is open. Commits the previous
        step (its streams' ready tokens = their end), then takes this step's items
        ``(stream_id, block_ids, start, end)``: block table = block_ids, tokens [0, start)
        ready on all layers (earlier chunks, prefix hits), [start, end) computed now."""
        with self._lock:
            last = self._last_event_locked()
            touched: list[str] = []
            for sid in self._step_ids:  # commit
                s = self._streams.get(sid)
                if s is not None and s.step_end is not None:
                    s.committed = max(s.committed, s.step_end)
                    s.committed_event = last
                    s.step_end = None
                    touched.append(sid)
            step: list[str] = []
            for sid, block_ids, start, end in items:
                s = self._streams.get(sid)
                if s is None:  # closed meanwhile: nobody may read it any more
                    continue
                s.block_ids = tuple(int(b) for b in block_ids)
                s.committed = max(s.committed, int(start))
                s.step_end = int(end)
                step.append(sid)
            self._step_ids = tuple(step)
            self._layers_done = 0
            self._events = [None] * self.num_local_layers if step else []
            for sid in (*touched, *step):
                self._wake_locked(self._waiters.get(sid, ()))

    def layer_done(self, local_layer: int) -> None:
        """Local layer ``local_layer``'s attention has written (CUDA: queued) its KV."""
        if not self._step_ids:  # no stream in this step: the common case costs this test
            return
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._lock:
            if not self._step_ids:
                return
            self._events[local_layer] = event
            self._layers_done = max(self._layers_done, local_layer + 1)
            for sid in self._step_ids:
                waiters = self._waiters.get(sid)
                s = self._streams.get(sid)
                if waiters and s is not None and s.step_end is not None:
                    end = s.step_end
                    self._wake_locked([w for w in waiters if w.layer_end <= self._layers_done
                                       and w.num_tokens <= end])

    # ---- reader side ----------------------------------------------------------------------

    async def wait_ready(self, stream_id: str, num_tokens: int, layer_slice: tuple[int, int],
                         tokens_hash: str, timeout_s: float, want_first: bool = False
                         ) -> list[int]:
        """The block ids (the stream's whole table) holding tokens [0, num_tokens) once those
        tokens exist on local layers ``layer_slice`` [l0, l1) (CUDA: their kernels have
        finished), and with ``want_first`` once ``set_first`` published the first token
        (``first_of``). Raises ``StreamNotReady``: unknown_lease (never opened within
        timeout_s, or closed), bad_request (num_tokens / hash / layers do not match),
        timeout."""
        l0, l1 = layer_slice
        if not 0 <= l0 < l1 <= self.num_local_layers:
            raise StreamNotReady(BAD_REQUEST, f"layer_slice {list(layer_slice)} outside the "
                                              f"{self.num_local_layers} local layers")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        w = _Waiter(stream_id, num_tokens, l1, tokens_hash, loop, want_first)
        with self._lock:
            self._waiters.setdefault(stream_id, set()).add(w)
        try:
            while True:
                with self._lock:
                    w.wake.clear()  # before the check: a wake after it is not lost
                    ready = self._check_locked(w)
                if ready is not None:
                    break
                left = deadline - loop.time()
                if left <= 0:
                    raise self._timed_out(w, timeout_s)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(w.wake.wait(), left)
        finally:
            with self._lock:
                waiters = self._waiters.get(stream_id)
                if waiters is not None:
                    waiters.discard(w)
                    if not waiters:
                        del self._waiters[stream_id]
        block_ids, event = ready
        if event is not None:
            await _wait_event(event, deadline, loop)
        return list(block_ids)

    def num_waiting(self, stream_id: str | None = None) -> int:
        """Reads waiting now (on ``stream_id``, or on any stream): for metrics and tests."""
        with self._lock:
            if stream_id is not None:
                return len(self._waiters.get(stream_id, ()))
            return sum(len(w) for w in self._waiters.values())

    # ---- internals ------------------------------------------------------------------------

    def _check_locked(self, w: _Waiter) -> _Ready | None:
        """Ready (block ids, event), None (not yet), or raises ``StreamNotReady``."""
        s = self._streams.get(w.stream_id)
        if s is None:
            if w.seen_open or w.stream_id in self._closed:
                raise StreamNotReady(UNKNOWN_LEASE, f"stream {w.stream_id!r} is closed")
            return None
        w.seen_open = True
        if s.num_tokens != w.num_tokens:
            raise StreamNotReady(BAD_REQUEST, f"stream {w.stream_id!r} has {s.num_tokens} "
                                              f"tokens, the read asks for {w.num_tokens}")
        if s.tokens_hash != w.tokens_hash:
            raise StreamNotReady(BAD_REQUEST, f"stream {w.stream_id!r}: token ids differ "
                                              f"(tokens_hash mismatch: another tokenizer or "
                                              f"chat template?)")
        if w.want_first and s.first is None:
            return None
        if s.committed >= w.num_tokens:
            return s.block_ids, s.committed_event
        if (s.step_end is not None and s.step_end >= w.num_tokens
                and self._layers_done >= w.layer_end):
            # the event of the last layer read (kernels run in order on the engine's stream)
            return s.block_ids, self._events[w.layer_end - 1] or self._last_event_locked()
        return None

    def _timed_out(self, w: _Waiter, timeout_s: float) -> StreamNotReady:
        if w.seen_open:
            return StreamNotReady(TIMEOUT, f"stream {w.stream_id!r}: {w.num_tokens} tokens on "
                                           f"layers < {w.layer_end} not ready within "
                                           f"{timeout_s}s")
        return StreamNotReady(UNKNOWN_LEASE, f"stream {w.stream_id!r} was not opened within "
                                             f"{timeout_s}s")

    def _last_event_locked(self) -> torch.cuda.Event | None:
        return next((e for e in reversed(self._events) if e is not None), None)

    @staticmethod
    def _wake_locked(waiters: Sequence[_Waiter] | set[_Waiter]) -> None:
        for w in waiters:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                w.loop.call_soon_threadsafe(w.wake.set)


async def _wait_event(event: torch.cuda.Event, deadline: float,
                      loop: asyncio.AbstractEventLoop) -> None:
    """Poll a CUDA event from the loop until it completed; ``StreamNotReady(timeout)`` at
    ``deadline``. Polling (not ``synchronize`` on a thread) keeps a cancel immediate."""
    i = 0
    while not event.query():
        if loop.time() >= deadline:
            raise StreamNotReady(TIMEOUT, "the GPU did not finish the layers within the wait")
        await asyncio.sleep(EVENT_POLL_S[min(i, len(EVENT_POLL_S) - 1)])
        i += 1
