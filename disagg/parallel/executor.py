"""Rank 0's side of a parallel worker: the ``ModelRunner`` interface over ``tp * pp`` ranks.

``DistributedExecutor(config)`` is what ``LLMEngine`` uses when ``world_size > 1``. The
engine's process is rank 0: it holds the scheduler (and the HTTP server) and computes its own
shard like any other rank. The other ranks are ``spawn``-ed children (``worker.rank_main``).

Failure model: a rank that dies makes the whole worker dead (``error`` is set, the other ranks
are killed, ``execute`` raises ``WorkerDiedError``); the server then reports unhealthy and
exits non-zero. Nothing is left behind: children leave when rank 0 says stop, when their pipe
to rank 0 closes, or when they find themselves re-parented (rank 0 killed); rank 0 reaps them
on shutdown, on garbage collection and at interpreter exit.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from disagg.config import ConfigError, EngineConfig
from disagg.engine.kv_offload_messages import TierEvent, TierMessage
from disagg.env import STARTUP_TIMEOUT_S
from disagg.kv_connector.messages import TransferEvent, TransferMessage
from disagg.layout import ParallelLayout
from disagg.parallel.messages import (
    GetStats,
    Loaded,
    Probe,
    ProbeReply,
    RankFailed,
    Ready,
    ResetStats,
    StatsReply,
    Step,
    Stop,
    encode,
)
from disagg.parallel.worker import (
    CommStats,
    RankComm,
    StageWorker,
    dist_timeout_s,
    rank_device,
    rank_main,
    threads_per_rank,
)
from disagg.runner import ModelRunner
from disagg.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from disagg.kv_connector.settings import DisaggSettings

logger = logging.getLogger("disagg.parallel")


def startup_timeout_s() -> float:
    """Seconds the other ranks get to load their shards and join (a crash is seen at once)."""
    return STARTUP_TIMEOUT_S.get()


# Seconds ranks get to exit after "stop" before they are killed.
STOP_GRACE_S = 5.0


class WorkerDiedError(RuntimeError):
    """A rank of a parallel worker died (or a step failed mid-way): the worker cannot go on."""


class WorkerStartupError(RuntimeError):
    """A rank failed to start (its traceback is in the message)."""


def _stop_children(procs: list[BaseProcess], conns: list[Connection], grace_s: float) -> None:
    """Ask every child to stop, wait up to ``grace_s`` in all, kill and reap the rest."""
    for c in conns:
        try:
            c.send_bytes(encode(Stop()))
        except (OSError, ValueError):  # already dead / closed
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5.0)
    for c in conns:
        c.close()


@dataclass
class _Resources:
    """What a parallel worker holds outside Python's memory: the rank processes and their
    pipes, the process group, the rendezvous store. Shared by the executor, its finalizer and
    its helper threads; neither of the latter references the executor, so dropping the last
    reference to it (``del llm`` in a notebook) releases everything."""

    procs: list[BaseProcess] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)  # index r - 1 talks to rank r
    event_conns: list[Connection] = field(default_factory=list)  # rank r's events (r - 1)
    events: deque[TransferEvent] = field(default_factory=deque)
    event_callback: Callable[[], None] | None = None
    tier_events: deque[TierEvent] = field(default_factory=deque)  # the offload tiers' own
    tier_callback: Callable[[], None] | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    store: Any = None  # the TCPStore rank 0 serves the rendezvous from
    comm: RankComm | None = None
    threads_before: int | None = None


def _release(res: _Resources, grace_s: float) -> None:
    """Stop and reap the ranks, leave the process group (so another parallel worker can start
    in this process), close the store, give the CPU threads back. Run once, by ``shutdown``,
    by the garbage collector or at interpreter exit."""
    res.stopping.set()
    _stop_children(res.procs, res.conns, grace_s)
    for c in res.event_conns:  # the ranks are gone: nothing more to read
        c.close()
    res.event_conns.clear()
    if res.comm is not None:
        res.comm.close()
    res.store = None  # the last reference: the store's server stops
    if res.threads_before is not None:
        torch.set_num_threads(res.threads_before)
        res.threads_before = None


def _watch_ranks(executor: weakref.ReferenceType[DistributedExecutor], res: _Resources) -> None:
    """Monitor thread: mark the worker dead when a rank exits on its own."""
    # Check every rank's exit status, whoever reaped it: multiprocessing also polls its
    # children (e.g. when another process starts), so a death can be reaped before this
    # thread looks; the timeout re-checks even if a sentinel wake-up was consumed.
    while not res.stopping.is_set():
        for r, p in enumerate(res.procs, start=1):
            if p.exitcode is not None:  # exitcode polls (reaps) the child
                ex = executor()
                if ex is not None and not res.stopping.is_set():  # shutdown reaps them
                    ex._fail(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}")
                return
        wait([p.sentinel for p in res.procs], timeout=0.5)


def _read_events(res: _Resources) -> None:
    """Reader thread: the ranks' events, in arrival order; the KV connector's and the offload
    tiers' each to their own queue."""
    conns = list(res.event_conns)
    while conns and not res.stopping.is_set():
        try:
            ready = wait(conns, timeout=0.5)
        except (OSError, ValueError):  # closed by shutdown
            return
        for c in ready:
            try:
                ev = c.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):  # the rank is gone: the monitor reports it
                conns.remove(c)  # type: ignore[arg-type]
                continue
            if isinstance(ev, TierEvent):
                res.tier_events.append(ev)
                cb = res.tier_callback
            else:
                res.events.append(ev)
                cb = res.event_callback
            if cb is not None:
                cb()


class DistributedExecutor:
    """Spawns ranks 1..N-1, runs rank 0's shard, and executes steps on all of them."""

    def __init__(self, config: EngineConfig, disagg: DisaggSettings | None = None) -> None:
        self.config = config
        self.layouts = ParallelLayout.all_ranks(config.model, config.parallel)
        self.layout = self.layouts[0]
        world = self.layout.world_size
        self.error: str | None = None
        self._lock = threading.Lock()
        self._res = _Resources()
        self._procs = self._res.procs
        self._conns = self._res.conns
        # KV transfer (context / generation workers): the transfer server addresses from the
        # ranks' Ready (their events arrive on _res.event_conns, and so do the offload tiers').
        self.transfer_addresses: list[str | None] = []
        self.kv_block_bytes: list[int] = []  # one KV block's bytes on each rank
        self._finalizer = weakref.finalize(self, _release, self._res, STOP_GRACE_S)
        device = rank_device(config.device, 0)
        if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
            raise ConfigError(f"tensor_parallel_size * pipeline_parallel_size = {world} ranks "
                              f"need GPUs {device.index or 0}..{(device.index or 0) + world - 1}"
                              f"; {torch.cuda.device_count()} visible")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this "
                               "process: one parallel worker per process")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._timeout_s = dist_timeout_s()
        timeout = datetime.timedelta(seconds=self._timeout_s)
        # Port 0: the OS picks a free port for the rendezvous (no fixed ports, no races).
        self._res.store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout,
                                        wait_for_workers=False)
        self.comm = self._res.comm = RankComm(self.layout, device)
        try:
            ctx = mp.get_context("spawn")
            level = logging.getLogger().getEffectiveLevel()
            for lay in self.layouts[1:]:
                parent_conn, child_conn = ctx.Pipe()
                events = disagg is not None or config.cache.kv_offload
                ev_read, ev_write = ctx.Pipe(duplex=False) if events else (None, None)
                p = ctx.Process(
                    target=rank_main, name=f"disagg-rank{lay.rank}", daemon=True,
                    args=(config, lay, "127.0.0.1", self._res.store.port, os.getpid(),
                          child_conn,
                          level, self._timeout_s, disagg, ev_write))
                p.start()
                child_conn.close()  # only the child holds its end: EOF if it dies
                if ev_read is not None and ev_write is not None:
                    ev_write.close()
                    self._res.event_conns.append(ev_read)
                self._procs.append(p)
                self._conns.append(parent_conn)
                logger.info("started rank %d (pid %d): layers %s, kv heads %s", lay.rank, p.pid,
                            lay.layer_range, lay.kv_head_range)
            if device.type == "cpu":
                self._res.threads_before = torch.get_num_threads()
                torch.set_num_threads(threads_per_rank(world))
            self.runner = ModelRunner(config, self.layout, agree_num_blocks=self._agree,
                                      device=device)
            ready = self._wait_all(Ready, time.monotonic() + startup_timeout_s())
            self.transfer_addresses = [ready[r].transfer_address for r in range(1, world)]
            kv = self.runner.kv_cache
            self.kv_block_bytes = [kv[0].numel() * kv.element_size(),
                                   *(ready[r].kv_block_bytes for r in range(1, world))]
        except BaseException:
            # The other ranks may be blocked in the rendezvous: no point asking them to stop.
            self._res.stopping.set()
            for p in self._procs:
                p.kill()
            self.shutdown()
            raise
        self.num_blocks = self.runner.num_blocks
        self.worker = StageWorker(self.runner, self.comm)
        # The threads get the shared resources and at most a weak reference to the executor.
        self._monitor = threading.Thread(target=_watch_ranks, args=(weakref.ref(self), self._res),
                                         name="disagg-rank-monitor", daemon=True)
        self._monitor.start()
        if self._res.event_conns:
            threading.Thread(target=_read_events, args=(self._res,), name="disagg-rank-events",
                             daemon=True).start()
        logger.info("parallel worker up: tp=%d pp=%d, rank pids %s, %d KV blocks per rank",
                    self.layout.tp_size, self.layout.pp_size, self.rank_pids, self.num_blocks)

    # ---- startup --------------------------------------------------------------------------

    def _agree(self, num_blocks: int) -> int:
        # Every other rank has loaded its shard before anyone blocks in the rendezvous, so a
        # rank that fails to load is reported (with its traceback) instead of timing out.
        self._wait_all(Loaded, time.monotonic() + startup_timeout_s())
        self.comm.init(self._res.store, self._timeout_s)
        return self.comm.min_over_ranks(num_blocks)

    def _wait_all(self, kind: type, deadline: float) -> dict[int, Any]:
        """Wait for a ``kind`` message from every child; raise on an error or a dead child."""
        got: dict[int, Any] = {}
        while len(got) < len(self._procs):
            pending = [r for r in range(1, len(self._procs) + 1) if r not in got]
            objs: list[Any] = [self._conns[r - 1] for r in pending]
            objs += [self._procs[r - 1].sentinel for r in pending]
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not wait(objs, remaining):
                raise WorkerStartupError(f"ranks {pending} did not report "
                                         f"{kind.__name__!r} within "
                                         f"{startup_timeout_s():.0f}s")
            for r in pending:
                conn, proc = self._conns[r - 1], self._procs[r - 1]
                if conn.poll():
                    try:
                        msg = conn.recv()
                    except EOFError:
                        msg = RankFailed("")
                    if isinstance(msg, RankFailed):
                        proc.join(5.0)
                        raise WorkerStartupError(
                            f"rank {r} (pid {proc.pid}) failed to start"
                            + (f":\n{msg.traceback}" if msg.traceback else
                               f" (exit code {proc.exitcode})"))
                    if isinstance(msg, kind):
                        got[r] = msg
                elif not proc.is_alive():
                    raise WorkerStartupError(f"rank {r} (pid {proc.pid}) exited with code "
                                             f"{proc.exitcode} while starting")
        return got

    # ---- KV transfer: control out, events in (kv_connector.disagg_connector.RankPeers) ------

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's own slice of the KV cache (its layers, its kv heads)."""
        return self.runner.kv_cache

    def send_all(self, msg: TransferMessage | TierMessage) -> None:
        """A transfer or offload tier control message to every other rank (engine thread,
        like ``execute``): in order with the steps, so rank r handles it before the next
        step."""
        if self.error is not None:
            raise WorkerDiedError(self.error)
        data = encode(msg)
        try:
            for c in self._conns:
                c.send_bytes(data)
        except OSError as e:
            self._fail(f"a rank stopped reading its control pipe: {e!r}")
            raise WorkerDiedError(self.error or repr(e)) from e

    def sync(self, timeout_s: float = 30.0) -> None:
        """Return once every other rank handled every message sent before this call (engine
        thread, between steps): a round trip of ``GetStats`` behind them on each pipe."""
        if self.error is not None:
            raise WorkerDiedError(self.error)
        for c in self._conns:
            c.send_bytes(encode(GetStats()))
        self._answers(StatsReply, timeout_s)

    def take_events(self) -> list[TransferEvent]:
        out = []
        while True:
            try:
                out.append(self._res.events.popleft())
            except IndexError:
                return out

    def on_event(self, callback: Callable[[], None]) -> None:
        self._res.event_callback = callback

    # ---- offload tiers: control out, events in (engine.kv_offload.TierPeers) ------------------

    def ask_all(self, msg: TierMessage, kind: type, timeout_s: float) -> list[Any]:
        """Send ``msg`` to every other rank and return each one's ``kind`` answer (rank
        order; engine thread, between steps)."""
        self.send_all(msg)
        return self._answers(kind, timeout_s)

    def take_tier_events(self) -> list[TierEvent]:
        out = []
        while True:
            try:
                out.append(self._res.tier_events.popleft())
            except IndexError:
                return out

    def on_tier_event(self, callback: Callable[[], None]) -> None:
        self._res.tier_callback = callback

    # ---- failure --------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        """Mark the worker dead and kill the remaining ranks (they cannot be used again, and
        killing them unblocks any collective rank 0 may be waiting in)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = reason
        logger.error("parallel worker failed: %s; stopping all ranks", reason)
        for p in self._procs:
            if p.exitcode is None:
                p.kill()

    # ---- the runner interface -------------------------------------------------------------

    @property
    def rank_pids(self) -> list[int]:
        return [os.getpid(), *(int(p.pid or 0) for p in self._procs)]

    def execute(self, sched: SchedulerOutput) -> tuple[list[str], torch.Tensor | None]:
        if self.error is not None:
            raise WorkerDiedError(self.error)
        try:
            t0 = time.perf_counter()
            msg = encode(Step(sched))
            for c in self._conns:
                c.send_bytes(msg)
            dt = time.perf_counter() - t0
            self.comm.stats.control_s += dt
            self.comm.stats.step_s += dt
            return self.worker.step(sched)
        except Exception as e:
            # Any failure mid-step leaves the ranks out of step with each other: fatal. A
            # collective usually fails because a peer died: name that rank if so (it may take
            # its sentinel a moment to fire after its sockets closed).
            wait([p.sentinel for p in self._procs], timeout=1.0)
            dead = next(((r, p) for r, p in enumerate(self._procs, start=1)
                         if p.exitcode is not None), None)
            reason = (f"rank {dead[0]} (pid {dead[1].pid}) exited with code {dead[1].exitcode}"
                      if dead else f"step failed on rank 0: {e!r}")
            self._fail(reason)
            raise WorkerDiedError(self.error or reason) from e

    def _answers(self, kind: type, timeout_s: float) -> list[Any]:
        """Each other rank's ``kind`` answer to the request just sent, rank order."""
        out = []
        for r, c in enumerate(self._conns, start=1):
            if not c.poll(timeout_s):
                raise WorkerDiedError(f"rank {r} did not answer with {kind.__name__}")
            got = c.recv()
            if not isinstance(got, kind):
                raise WorkerDiedError(f"rank {r} answered {got!r}, not {kind.__name__}")
            out.append(got)
        return out

    def comm_stats(self) -> list[dict[str, Any]]:
        """Every rank's ``CommStats`` (as dicts, rank order). Call from the engine's thread."""
        for c in self._conns:
            c.send_bytes(encode(GetStats()))
        return [asdict(self.comm.stats), *(a.stats for a in self._answers(StatsReply, 30.0))]

    def probe_comm(self, num_tokens: int, iters: int = 50) -> list[dict[str, float]]:
        """Every rank's pure transfer time (ms) of one ``[num_tokens, hidden]`` all-reduce / stage
        hop (``RankComm.probe``), rank order. Call from the engine's thread, between steps."""
        msg = Probe((num_tokens, self.config.model.hidden_size), self.runner.dtype, iters)
        for c in self._conns:
            c.send_bytes(encode(msg))
        # collective: runs alongside the other ranks' probes
        mine = self.comm.probe(msg.shape, msg.dtype, msg.iters)
        return [mine, *(a.result for a in self._answers(ProbeReply, 60.0))]

    def reset_comm_stats(self) -> None:
        self.comm.stats = CommStats(rank=0)
        for c in self._conns:
            c.send_bytes(encode(ResetStats()))

    def shutdown(self) -> None:
        """Stop and reap every rank, leave the process group, close the store. Idempotent;
        also done when the executor is garbage collected and at interpreter exit."""
        self._finalizer()
