"""What every rank runs: the data-plane communicator, the per-step stage logic, and the main of
the spawned ranks (1 .. world_size-1; rank 0 is the engine's own process).

Two planes:
- control (rank 0 -> rank r, pickled ``messages``): a ``multiprocessing`` pipe per rank carries
  each step's ``SchedulerOutput`` (and stop / stats requests, KV transfer control, the KV
  offload tiers' copies and loads). A rank blocks on its pipe while the engine is idle,
  however long, and sees EOF at once if rank 0 dies. Pipes rather than a collective so that
  no collective ever waits on an idle server (a timeout would fire) and no extra gloo group
  is needed next to NCCL.
- data (torch.distributed, gloo on CPU / NCCL on CUDA): the TP all-reduce of the row-parallel
  partial sums, hidden states from stage s to stage s+1 (each TP rank to the same TP rank of
  the next stage: after the all-reduce they hold identical activations), and the sampling
  rows' logits from the last stage's TP rank 0 back to rank 0, which samples.

One step, tp=2, pp=2 (ranks as in layout.py):

    rank 0:  schedule -> pipe to 1,2,3 -> layers [0,L0) (all-reduce with 1) -> send h to 2
                                                               ... recv logits from 2 -> sample
    rank 1:  pipe recv ->                  layers [0,L0) (all-reduce with 0) -> send h to 3
    rank 2:  pipe recv -> recv h from 0 -> layers [L0,L) (all-reduce with 3) -> logits -> 0
    rank 3:  pipe recv -> recv h from 1 -> layers [L0,L) (all-reduce with 2)
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from disagg.config import EngineConfig
from disagg.engine.kv_offload_messages import TierEvent, TierMessage, TierSetup, TierSetupReply
from disagg.env import DIST_TIMEOUT_S
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
)
from disagg.procs import freeze_for_exit
from disagg.runner import ModelRunner
from disagg.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from disagg.engine.kv_offload_rank import RankOffload
    from disagg.kv_connector.rank import RankTransfer
    from disagg.kv_connector.settings import DisaggSettings

logger = logging.getLogger("disagg.parallel")


def dist_timeout_s() -> float:
    """Seconds a collective / send / recv may wait for a peer before failing (init included).

    Large enough for a long prefill of the previous pipeline stage; a dead peer is noticed
    sooner (its sockets close, and rank 0 kills the other ranks when one dies).
    """
    return DIST_TIMEOUT_S.get()


# How often a rank checks that rank 0 (its parent) is still alive.
PARENT_POLL_S = 0.5


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: the CPU for everyone, or ``cuda:{base + r}`` (base: the given index)."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


def threads_per_rank(world_size: int) -> int:
    """CPU threads for one rank: the ranks of a worker share the host's cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


@dataclass
class CommStats:
    """Host wall time one rank spent per activity (seconds), summed over steps.

    ``recv_s`` includes waiting for the peer to produce the tensor (for PP, the previous
    stage's compute), so it is a pipeline wait as much as a transfer. On CUDA the times are
    host times of asynchronous NCCL calls (not synchronised).
    """

    rank: int = 0
    steps: int = 0
    step_s: float = 0.0        # whole step on this rank (rank 0: control sends included)
    all_reduce_s: float = 0.0  # TP all-reduce of row-parallel partial sums
    all_reduce_calls: int = 0
    send_s: float = 0.0        # hidden states to the next stage / logits to rank 0
    recv_s: float = 0.0        # hidden states from the previous stage / logits on rank 0
    control_s: float = 0.0     # rank 0: pickling and piping the schedule to the other ranks


class RankComm:
    """This rank's torch.distributed process group, its TP group, and timed ops."""

    def __init__(self, layout: ParallelLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.stats = CommStats(rank=layout.rank)
        self.tp_group: Any = None

    def init(self, store: dist.Store, timeout_s: float) -> None:
        """Join the process group (every rank must call it) and build the TP groups."""
        lay = self.layout
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this "
                               "process: one parallel worker per process")
        kw: dict[str, Any] = {}
        if self.backend == "nccl":
            kw["device_id"] = self.device
        dist.init_process_group(self.backend, store=store, rank=lay.rank,
                                world_size=lay.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kw)
        if lay.tp_size > 1:
            if lay.pp_size == 1:
                self.tp_group = dist.group.WORLD
            else:
                # new_group is collective: every rank creates every stage's group, in order.
                for s in range(lay.pp_size):
                    ranks = [lay.stage_rank(s, t) for t in range(lay.tp_size)]
                    group = dist.new_group(ranks)
                    if s == lay.pp_rank:
                        self.tp_group = group

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the row-parallel partial outputs of this stage's TP ranks (in place)."""
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.tp_group)
        self.stats.all_reduce_s += time.perf_counter() - t0
        self.stats.all_reduce_calls += 1
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        t0 = time.perf_counter()
        dist.send(x.contiguous(), dst)
        self.stats.send_s += time.perf_counter() - t0

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src)
        self.stats.recv_s += time.perf_counter() - t0
        return buf

    def probe(self, shape: tuple[int, ...], dtype: torch.dtype, iters: int) -> dict[str, float]:
        """Transfer cost without compute skew: mean ms of one TP all-reduce and of one
        stage-to-stage send of a ``shape`` tensor, every rank synchronised before each op.
        Collective: every rank must call it (the executor's "probe" message)."""
        lay = self.layout
        x = torch.ones(shape, dtype=dtype, device=self.device)
        out: dict[str, float] = {"rank": lay.rank}

        def timed(op: Any) -> float:
            total = 0.0
            for _ in range(iters):
                dist.barrier()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                op()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                total += time.perf_counter() - t0
            return total / iters * 1e3

        if lay.tp_size > 1:
            out["all_reduce_ms"] = timed(lambda: dist.all_reduce(x, group=self.tp_group))
        if lay.pp_size > 1:
            # Stage s sends to stage s+1 (even stages first, then odd, so nobody waits on a
            # peer that is itself sending); the receiver's time is the transfer.
            def hop(parity: int) -> None:
                if lay.pp_rank % 2 == parity and not lay.is_last_stage:
                    dist.send(x, lay.stage_rank(lay.pp_rank + 1))
                elif lay.pp_rank % 2 != parity and not lay.is_first_stage:
                    dist.recv(x, lay.stage_rank(lay.pp_rank - 1))

            out["send_recv_ms"] = timed(lambda: (hop(0), hop(1)))
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class StageWorker:
    """One rank's part of a step: the same code on rank 0 and on the spawned ranks."""

    def __init__(self, runner: ModelRunner, comm: RankComm) -> None:
        self.runner = runner
        self.comm = comm
        self.layout = runner.layout
        lay = self.layout
        # Where the last stage's TP rank 0 sits: it computes the logits rank 0 samples from.
        self.logits_rank = lay.stage_rank(lay.pp_size - 1, 0)
        if lay.tp_size > 1:
            runner.model.tp_all_reduce = comm.tp_all_reduce

    @torch.inference_mode()
    def step(self, sched: SchedulerOutput) -> tuple[list[str], torch.Tensor | None]:
        """Run this rank's stage; rank 0 gets ``(sample request ids, logits [S, V])``."""
        t0 = time.perf_counter()
        lay = self.layout
        runner = self.runner
        model = runner.model
        inputs = runner.prepare_inputs(sched)
        num_tokens = int(inputs.positions.shape[0])
        hidden_in = None
        if not lay.is_first_stage:
            hidden_in = self.comm.recv((num_tokens, runner.config.model.hidden_size),
                                       runner.dtype, lay.stage_rank(lay.pp_rank - 1))
        hidden = model(inputs.input_ids if lay.is_first_stage else None, inputs.positions,
                       runner.kv_cache, inputs.meta, hidden_states=hidden_in)
        ids = inputs.sample_request_ids
        logits = None
        num_rows = int(inputs.logits_indices.shape[0])  # sampled + prompt-logprob rows
        if not lay.is_last_stage:
            self.comm.send(hidden, lay.stage_rank(lay.pp_rank + 1))
        elif num_rows and lay.tp_rank == 0:
            logits = model.compute_logits(hidden[inputs.logits_indices])
            if lay.rank != 0:
                self.comm.send(logits, 0)
                logits = None
        if lay.rank == 0 and num_rows and logits is None:
            logits = self.comm.recv((num_rows, runner.config.model.vocab_size), torch.float32,
                                    self.logits_rank)
        self.comm.stats.steps += 1
        self.comm.stats.step_s += time.perf_counter() - t0
        return (ids, logits) if lay.rank == 0 else ([], None)


# ---- the spawned ranks ----------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    # Rank 0 may die without closing our pipe in time (SIGKILL mid-collective with NCCL, which
    # would otherwise hang): once we are re-parented, leave.
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(3)


def rank_main(config: EngineConfig, layout: ParallelLayout, store_host: str, store_port: int,
              parent_pid: int, conn: Connection, log_level: int,
              timeout_s: float, disagg: DisaggSettings | None = None,
              events: Connection | None = None) -> None:
    """Entry point of rank ``layout.rank`` >= 1 (a ``spawn`` child of rank 0).

    Startup: load this rank's shard, tell rank 0 (``Loaded``), join the process group, agree
    on the block count, allocate the KV cache, start this rank's KV transfer part (context /
    generation workers), tell rank 0 (``Ready``). Then execute the messages rank 0 sends until
    ``Stop`` (exit 0) or until rank 0 is gone / a step fails (exit 1, the traceback sent to
    rank 0 first). Transfer control messages go to ``RankTransfer``, offload tier messages to
    ``RankOffload`` (made by ``TierSetup``); their events go back on ``events``. Ignores
    SIGINT / SIGTERM: a Ctrl-C or a group-wide SIGTERM is rank 0's to handle, and rank 0 stops
    its ranks after draining.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="disagg-parent-watch").start()
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{layout.rank} %(name)s: "
                               f"%(message)s")
    try:
        worker, transfer, emit = _start_rank(config, layout, store_host, store_port, conn,
                                             timeout_s, disagg, events)
    except BaseException:
        _report_and_exit(conn, "startup")
        return
    tiers: list[RankOffload] = []  # made by rank 0's TierSetup, if it sends one
    try:
        _serve(conn, worker, transfer, emit, tiers)
    except BaseException:
        _report_and_exit(conn, "step")
    if transfer is not None:
        transfer.shutdown()
    for t in tiers:
        t.close()
    worker.comm.close()
    freeze_for_exit()  # the process ends with this function (multiprocessing's spawn_main)


Emit = Callable[[TransferEvent | TierEvent], None]


def _start_rank(config: EngineConfig, layout: ParallelLayout, store_host: str, store_port: int,
                conn: Connection, timeout_s: float, disagg: DisaggSettings | None,
                events: Connection | None
                ) -> tuple[StageWorker, RankTransfer | None, Emit | None]:
    """Load the shard, join the group, allocate the cache, start the transfer part; report
    ``Ready``. Returns the function that sends an event to rank 0 (None: no event pipe)."""
    device = rank_device(config.device, layout.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(layout.world_size))
    comm = RankComm(layout, device)

    def agree(num_blocks: int) -> int:
        conn.send(Loaded(num_blocks))
        store = dist.TCPStore(store_host, store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        comm.init(store, timeout_s)
        return comm.min_over_ranks(num_blocks)

    runner = ModelRunner(config, layout, agree_num_blocks=agree, device=device)
    worker = StageWorker(runner, comm)
    emit: Emit | None = None
    if events is not None:
        send_lock = threading.Lock()

        def send_event(event: TransferEvent | TierEvent) -> None:
            # server, sweep, installer, tier loader and disk writer threads all report
            with send_lock:
                try:
                    events.send(event)
                except OSError:  # rank 0 is gone; the main loop will notice
                    pass

        emit = send_event

    transfer = None
    if disagg is not None:
        from disagg.kv_connector.rank import RankTransfer

        assert emit is not None
        transfer = RankTransfer(disagg, config, layout.rank, runner.kv_cache, emit,
                                model=runner.model)
    kv = runner.kv_cache
    conn.send(Ready(os.getpid(), transfer.address if transfer is not None else None,
                    kv[0].numel() * kv.element_size()))
    logger.debug("rank %d ready: layers %s, kv heads %s, %d blocks", layout.rank,
                 layout.layer_range, layout.kv_head_range, runner.num_blocks)
    return worker, transfer, emit


def _serve(conn: Connection, worker: StageWorker, transfer: RankTransfer | None,
           emit: Emit | None, tiers: list[RankOffload]) -> None:
    """Handle rank 0's messages until ``Stop``; exits the process if rank 0 is gone.
    ``tiers``: where the offload tiers' part goes once ``TierSetup`` made it."""
    comm = worker.comm
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(1)  # rank 0 is gone without saying stop
        if isinstance(msg, Step):
            worker.step(msg.sched)
        elif isinstance(msg, TransferMessage):
            if transfer is None:
                raise RuntimeError(f"{msg!r} sent to a rank without KV transfer")
            transfer.handle(msg)
        elif isinstance(msg, TierSetup):
            conn.send(_open_tiers(msg, worker, emit, tiers))
        elif isinstance(msg, TierMessage):
            if not tiers:
                raise RuntimeError(f"{msg!r} sent to a rank without offload tiers")
            tiers[0].handle(msg)
        elif isinstance(msg, GetStats):
            conn.send(StatsReply(asdict(comm.stats)))
        elif isinstance(msg, ResetStats):
            comm.stats = CommStats(rank=comm.layout.rank)
        elif isinstance(msg, Probe):
            conn.send(ProbeReply(comm.probe(msg.shape, msg.dtype, msg.iters)))
        elif isinstance(msg, Stop):
            return
        else:
            raise RuntimeError(f"unknown control message {msg!r}")


def _open_tiers(setup: TierSetup, worker: StageWorker, emit: Emit | None,
                tiers: list[RankOffload]) -> TierSetupReply:
    """Open this rank's offload tiers; a failure (a folder it cannot use) is the answer, for
    rank 0 to report, not the rank's death."""
    from disagg.engine.kv_offload_rank import RankOffload

    rank = worker.layout.rank
    if tiers or emit is None:
        return TierSetupReply(rank, "offload tiers: set up twice, or no event pipe")
    try:
        tiers.append(RankOffload(setup, rank, worker.runner.kv_cache, emit))
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the start-up
        return TierSetupReply(rank, str(e) or repr(e))
    return TierSetupReply(rank, None)


def _report_and_exit(conn: Connection, phase: str) -> None:
    tb = traceback.format_exc()
    logger.error("rank failed during %s:\n%s", phase, tb)
    try:
        conn.send(RankFailed(tb))
    except OSError:
        pass
    # os._exit: no interpreter teardown that could block on a half-done collective.
    sys.stderr.flush()
    os._exit(1)
