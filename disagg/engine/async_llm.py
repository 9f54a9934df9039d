"""``AsyncLLM``: an ``LLMEngine`` stepped on its own thread (never on the HTTP event loop), for
asyncio callers: each request's incremental outputs go to the asyncio task that iterates
``generate``. The asyncio side talks to the engine thread only through commands (``_Add``,
``_Abort``, ``_ReleaseLease``, ``_SwitchRole``), taken in order at the top of each loop turn.
It implements ``EngineClient`` (``client.py``), what the server may use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disagg.config import EngineConfig, build_engine_config
from disagg.contracts.kv_mode import LOCAL, ContextOnly, KVMode, PrefixPull, Pull
from disagg.contracts.params import ContextParams, LeaseRef
from disagg.contracts.roles import Role, RoleDrain
from disagg.engine.admission import context_only_params
from disagg.engine.errors import EngineDeadError, QueueFullError
from disagg.engine.llm_engine import LLMEngine, role_drain
from disagg.engine.outputs import EngineStats, RequestOutput
from disagg.kv_cache.events import KVEventLog
from disagg.kv_connector.base import KVConnector
from disagg.parallel.executor import WorkerDiedError
from disagg.request import SamplingParams

if TYPE_CHECKING:
    from disagg.kv_connector.settings import DisaggSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    """AsyncLLM command: ``LLMEngine.add_request`` with these arguments."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    mode: KVMode
    prefix: PrefixPull | None = None


def _answer(fut: cf.Future[Any], result: Any, error: BaseException | None) -> None:
    """Resolve ``fut`` with ``result``, or fail it with ``error`` (engine thread)."""
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


@dataclass(frozen=True)
class _LeasePrefix:
    """AsyncLLM command: ``LLMEngine.lease_prefix`` (a peer asks for cached KV)."""

    token_ids: list[int]
    result: cf.Future[ContextParams | None]


@dataclass(frozen=True)
class _Abort:
    """AsyncLLM command: abort a request. ``lease_unread``: a two-call context request whose
    consumer went away without its final output; if it ended already, the lease that output
    names (under the request's id) is ended too: only that output could tell a reader of it.
    (A streaming context request's lease is not: its reader knows its id from the router.)"""

    request_id: str
    lease_unread: bool = False


@dataclass(frozen=True)
class _ReleaseLease:
    """AsyncLLM command: end a context lease now."""

    lease_id: str


@dataclass(frozen=True)
class _SwitchRole:
    """AsyncLLM command: serve ``role`` once the current role drained. ``started`` resolves
    with the first ``RoleDrain`` measured, ``done`` with the last (all zero) when switched."""

    role: Role
    started: cf.Future[RoleDrain]
    done: cf.Future[RoleDrain]


# What the asyncio side asks of the engine thread, in order.
_Command = _Add | _Abort | _ReleaseLease | _SwitchRole


class AsyncLLM:
    """Runs an LLMEngine on a background thread for asyncio callers (the HTTP server; module
    docstring). Implements ``EngineClient``."""

    def __init__(self, config: EngineConfig, disagg: DisaggSettings | None = None) -> None:
        self.config = config
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.engine = LLMEngine(config, disagg, wake=self._wake.set)
        self.tokenizer = self.engine.tokenizer
        # New on every start: a router seeing another id knows its view of our cache is stale.
        connector = self.engine.connector
        self.worker_id = connector.worker_id if connector is not None else uuid.uuid4().hex
        self.kv_events = KVEventLog()
        self._stop = threading.Event()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._sinks_lock = threading.Lock()
        self._pending_adds = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # A role switch draining (engine thread), and its last measure (read by any thread:
        # an immutable value swapped whole).
        self._switch: _SwitchRole | None = None
        self.role_drain_now: RoleDrain | None = None

    @classmethod
    def from_options(cls, model_dir: str, **options: object) -> AsyncLLM:
        return cls(build_engine_config(model_dir, **options))

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="disagg-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join, 10.0)
        await loop.run_in_executor(None, self.engine.shutdown)

    def close(self) -> None:
        """Stop the loop and release the executor and the connector now, from any thread
        (idempotent): the process's last word, also when the server never started."""
        self._stop.set()
        self._wake.set()
        self.engine.shutdown()

    def is_healthy(self) -> bool:
        return (
            self._thread is not None and self._thread.is_alive() and self._error is None
            and not self._stop.is_set() and self.engine.fatal_error is None
        )

    @property
    def fatal_error(self) -> str | None:
        """Set when the engine can never serve again (a rank died): the server should exit."""
        return self.engine.fatal_error

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the worker's ranks, rank 0 (this process) first."""
        return self.engine.runner.rank_pids

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def transfer(self) -> KVConnector | None:
        """The KV connector of a context / generation worker (None when aggregated)."""
        return self.engine.connector

    def release_remote(self, lease: ContextParams | LeaseRef) -> None:
        """Release a context lease for a generation-only request refused before it reached
        the engine (thread-safe: the client only submits to its own loop)."""
        if self.engine.connector is not None:
            self.engine.connector.release_remote(lease)

    # ---- requests -------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        mode: KVMode = LOCAL,
        prefix: PrefixPull | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request (``mode``: its disaggregation mode, ``contracts/kv_mode.py``;
        ``prefix``: a peer's prefix lease to pull) and yield its outputs until the finished
        one. Refusals (bad input, queue full, engine down) raise before the first output; a
        pulled request's lease (and a prefix lease) is released then."""
        try:
            if not self.is_healthy():
                raise EngineDeadError(f"engine is not running: {self._error!r}")
            if params.structured is not None:  # compiled off the event loop (up to ~1 s for
                # a large grammar); validate below then finds it in the cache
                await asyncio.to_thread(self.engine.grammars.compile, params.structured)
            self.engine.validate(prompt_token_ids,
                                 context_only_params(params) if mode.is_context else params)
            max_queue = self.config.scheduler.max_queue
            if max_queue is not None and (
                    self.engine.scheduler.num_waiting + self._pending_adds >= max_queue):
                raise QueueFullError(f"waiting queue is full ({max_queue} requests)")
        except BaseException:
            if isinstance(mode, Pull):  # refused: the context worker must not hold the KV
                self.release_remote(mode.params)
            if prefix is not None:
                self.release_remote(prefix.params)
            raise
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        with self._sinks_lock:
            if request_id in self._sinks:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._sinks[request_id] = (loop, sink)
            self._pending_adds += 1
        self._cmds.put(_Add(request_id, list(prompt_token_ids), params, prompt,
                            time.monotonic(), mode, prefix))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            with self._sinks_lock:
                self._sinks.pop(request_id, None)
            if not finished:  # consumer went away (client disconnect, cancel): free its blocks
                self._cmds.put(_Abort(request_id, lease_unread=isinstance(mode, ContextOnly)))
                self._wake.set()

    def release_lease(self, lease_id: str) -> bool:
        """Ask the engine thread to end a context lease now (thread-safe). True if the lease
        was live when asked."""
        connector = self.engine.connector
        if connector is None or not connector.lease_is_live(lease_id):
            return False
        self._cmds.put(_ReleaseLease(lease_id))
        self._wake.set()
        return True

    async def lease_prefix(self, token_ids: list[int]) -> ContextParams | None:
        """Lease the cached KV of ``token_ids``' leading full blocks for a peer (the engine
        thread does it between steps): its params, or None when none is cached."""
        if not self.is_healthy():
            raise EngineDeadError(f"engine is not running: {self._error!r}")
        cmd = _LeasePrefix(list(token_ids), cf.Future())
        self._cmds.put(cmd)
        self._wake.set()
        return await asyncio.wrap_future(cmd.result)

    async def abort(self, request_id: str) -> None:
        self._cmds.put(_Abort(request_id))
        self._wake.set()

    def switch_role(self, role: Role) -> tuple[cf.Future[RoleDrain], cf.Future[RoleDrain]]:
        """Thread-safe: have the engine thread switch the KV connector to ``role`` once the
        current role drained (checked every loop turn: requests finishing, leases ending and
        pulls landing all wake the loop). Returns (started, done) futures (``_SwitchRole``);
        ``done`` fails if the engine stops first or another switch is draining."""
        if self.engine.connector is None:
            raise ValueError("role: an aggregated worker cannot switch role")
        cmd = _SwitchRole(role, cf.Future(), cf.Future())
        self._cmds.put(cmd)
        self._wake.set()
        return cmd.started, cmd.done

    def _advance_switch(self) -> None:
        """Engine thread: measure the draining role switch; switch once nothing is left."""
        sw = self._switch
        if sw is None:
            return
        drain = self.role_drain_now = role_drain(self.engine)
        if not sw.started.done():
            sw.started.set_result(drain)
        if not drain.done:
            return
        assert self.engine.connector is not None
        self.engine.connector.set_role(sw.role)
        self._switch = None
        sw.done.set_result(drain)

    def _fail_switch(self, why: str) -> None:
        sw, self._switch = self._switch, None
        if sw is not None:
            for fut in (sw.started, sw.done):
                if not fut.done():
                    fut.set_exception(RuntimeError(why))

    # ---- the loop thread ------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._sinks_lock:
            target = self._sinks.get(request_id)
        if target is None:
            return
        loop, sink = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            pass

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                with self._sinks_lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(
                        cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.prompt,
                        cmd.arrival_time, mode=cmd.mode, prefix=cmd.prefix)
                except Exception as e:  # validation raced with a config change, queue full, ...
                    if isinstance(cmd.mode, Pull):
                        self.release_remote(cmd.mode.params)
                    self._deliver(cmd.request_id, e)
            elif isinstance(cmd, _Abort):
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    self._deliver(cmd.request_id, out)
                elif cmd.lease_unread and self.engine.release_lease(cmd.request_id):
                    # Its prefill ended (and leased its blocks) just before the consumer went
                    # away: the answer naming the lease is never read.
                    logger.info("request %s: its answer was not read: lease released",
                                cmd.request_id)
            elif isinstance(cmd, _LeasePrefix):
                if cmd.result.set_running_or_notify_cancel():
                    try:
                        self.engine.start_prefix_lease(cmd.token_ids,
                                                       functools.partial(_answer, cmd.result))
                    except Exception as e:
                        cmd.result.set_exception(e)
            elif isinstance(cmd, _SwitchRole):
                if not cmd.started.set_running_or_notify_cancel():
                    pass  # the server gave up waiting for this turn: not started
                elif self._switch is not None:
                    err = RuntimeError("a role switch is in progress")
                    cmd.started.set_exception(err)
                    cmd.done.set_exception(err)
                else:
                    self._switch = cmd
                    self._advance_switch()
            else:
                self.engine.release_lease(cmd.lease_id)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.engine.fatal_error is not None:
                    raise WorkerDiedError(self.engine.fatal_error)
                # Cleared before the work: a wake-up set meanwhile is not lost.
                self._wake.clear()
                self._drain_commands()
                for out in self.engine.service_transfers():
                    self._deliver(out.request_id, out)
                if self.engine.has_schedulable():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                    self.kv_events.append(self.engine.kv.take_events())
                    self._advance_switch()
                else:
                    self.kv_events.append(self.engine.kv.take_events())  # aborts, releases
                    self._advance_switch()  # leases that ended, pulls that landed
                    # Idle, or only waiting for KV pulls (their futures wake us) and lease
                    # expiries (swept every few hundred ms).
                    self._wake.wait(timeout=self.engine.idle_wait_s())
        except BaseException as e:  # a bug in the engine itself: report and stop serving
            logger.exception("engine loop died")
            self._error = e
            with self._sinks_lock:
                rids = list(self._sinks)
            for rid in rids:
                self._deliver(rid, EngineDeadError(f"engine loop died: {e!r}"))
        finally:
            self._fail_switch("the engine stopped before the role switch was done")
            # Abort whatever is left so nothing waits forever and every block is freed.
            with self._sinks_lock:
                rids = list(self._sinks)
            for rid in rids:
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._deliver(rid, out)
