"""The fixed cost of one KV read (issue 44, item 3), phase by phase, before and after.

On an H200 a mapped read (``disagg/transfer/cuda_ipc.py``) of 2k tokens gathers in ~0.2 ms but
takes ~1.0-1.3 ms: the rest is the request's round trip through Python (submit to the client's
loop, sign, the server's verify / pin / plan / answer, the gather's launch and wait, DONE, the
future back to the caller), the same on any device. It is measured here on CPU: a server
process whose cache lives in a shared-memory file and a client process that maps that file
(``ShmSharing``, a cross-process stand-in for the CUDA IPC handle, as ``LocalSharing`` in
``tests/test_transfer_mapped.py`` is an in-process one), so the mapped path runs as on a GPU
host but for the CUDA calls (the gather is a CPU copy, its event wait does not exist). The
same read over plain TCP (the payload on the socket) is the second mode. Server and client
each run on a CPU of their own (where there are two).

Each read is timed untraced (the caller's ``client.read(...).result()``: the figure that
counts; with the CPU time each process spent per read), then traced: perf_counter marks at
the code's own boundaries on both sides (wrapping ``ClientSession.sign`` / ``sign_canonical``,
``ServerSession.verify``, ``TcpConnection.send_header`` / ``send_encoded`` / ``recv_header``
/ ``recv_payload_iov``, ``MappedPeers.gather``, ``LeaseTable.unpin``,
``TransferStats.record_transfer``, and asyncio's ``call_soon_threadsafe`` / ``create_task``
in the client's process; CLOCK_MONOTONIC is one clock for both processes), each phase the
median over the reads.

    python -m bench.kv_read_overhead [--reads 2000] [--warmup 300] [--rounds 3]
                                     [--blocks 1 64 256] [--baseline REV]
                                     [--out bench/results/kv_read_overhead.md]

``--baseline REV``: the ``disagg`` package of git revision ``REV`` (``git archive`` into a
temporary folder) is measured too, by this checkout's script, in child processes alternating
with this tree's (``--rounds`` of each; medians of the per-run medians).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from bench.baseline import checkout, cpu_line, git, run_child

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-read-overhead"
# A cache of small blocks (4 KiB): the bytes of a read cost little, its fixed cost and its
# per-block-id work (a 2k-token read of the 8B shape names 64 blocks, 8k tokens 256) are what
# is left. [num_blocks, layers, K/V, kv heads, tokens per block, head dim], float32.
SHAPE = (320, 1, 2, 2, 16, 16)
MODES = ("mapped", "tcp")
# (label, (side, event, occurrence), (side, event, occurrence)); side "c" client, "s" server.
_Ev = tuple[str, str, int]
# The first row's parts.
_SUBMIT = [
    ("  of it: caller, read() -> handed to the loop", ("c", "call", 0), ("c", "handed", 0)),
    ("  of it: handed -> the loop runs it (wake-up)", ("c", "handed", 0), ("c", "task", 0)),
    ("  of it: task created -> READ signing (timeout, pool, map lookup)", ("c", "task", 0),
     ("c", "sign", 0)),
]
_HEAD = [
    ("submit -> READ signing on the client's loop (thread hop)", ("c", "call", 0),
     ("c", "sign", 0)),
    *_SUBMIT,
    ("client: sign READ", ("c", "sign", 0), ("c", "signed", 0)),
    ("client: encode + send READ", ("c", "signed", 0), ("c", "sent", 0)),
    ("wire -> server has the READ parsed", ("c", "sent", 0), ("s", "recv_READ", 0)),
    ("server: verify (inside the next row)", ("s", "verify", 0), ("s", "verified", 0)),
    ("server: READ -> answer sent (verify, pin, plan)", ("s", "recv_READ", 0), ("s", "sent", 0)),
    ("wire -> client has the answer parsed", ("s", "sent", 0), ("c", "answer", 0)),
]
_TAIL = [
    ("read recorded -> caller has the result (task end, thread hop)", ("c", "recorded", 0),
     ("c", "result", 0)),
    ("whole read, traced", ("c", "call", 0), ("c", "result", 0)),
]
PHASES: dict[str, list[tuple[str, _Ev, _Ev]]] = {
    "mapped": [
        *_HEAD,
        ("client: answer -> gather (checks, mapped cache)", ("c", "answer", 0),
         ("c", "gather", 0)),
        ("client: gather (a CPU copy here)", ("c", "gather", 0), ("c", "gathered", 0)),
        ("client: gather -> DONE sent (check, sign, send)", ("c", "gathered", 0),
         ("c", "sent", 1)),
        ("client: DONE sent -> read recorded (pool, stats)", ("c", "sent", 1),
         ("c", "recorded", 0)),
        *_TAIL,
        ("server, off the read's path: DONE received -> unpinned", ("s", "recv_DONE", 0),
         ("s", "unpinned", 0)),
    ],
    "tcp": [
        *_HEAD,
        ("client: answer -> payload received", ("c", "answer", 0), ("c", "payload_done", 0)),
        ("client: payload -> read recorded (pool, stats)", ("c", "payload_done", 0),
         ("c", "recorded", 0)),
        *_TAIL,
        ("server, off the read's path: payload sent -> unpinned", ("s", "sent", 0),
         ("s", "unpinned", 0)),
    ],
}
UNTRACED = "whole read, untraced (what a caller sees)"
# CPU time per untraced read (all threads of the process): the client's caller and loop
# threads take turns on one GIL, so their work adds up on the read's path.
CPU_CLIENT = "CPU per read, client process (untraced)"
CPU_SERVER = "CPU per read, server process (untraced)"


# ---- the mapped path's stand-in: a cache in a shared-memory file --------------------------------


def _sharing_class() -> type:
    """``ShmSharing``, built on the measured tree's ``CacheSharing`` (imported late: the child
    measures whichever ``disagg`` its working directory holds)."""
    import torch

    from disagg.transfer.cuda_ipc import CacheSharing, geometry, parse_geometry, rebuild

    class ShmSharing(CacheSharing):
        """Exports a CPU cache that lives in a file under /dev/shm; the reader maps the file
        (``torch.from_file(shared=True)``) and rebuilds the cache over it (``rebuild``, as the
        CUDA sharing does over the IPC-mapped storage)."""

        kind: ClassVar[str] = "bench-shm"
        same_process: ClassVar[bool] = True  # a file maps in any process

        def __init__(self, path: str = "") -> None:
            self.path = path

        def local_support(self) -> tuple[bool, str]:
            return True, "a CPU cache in a shared-memory file"

        def exportable(self, kv: torch.Tensor) -> str | None:
            return None if self.path else "no shared-memory file"

        def export(self, kv: torch.Tensor) -> dict[str, Any]:
            return {**geometry(kv), "path": self.path}

        def locate(self, desc: Mapping[str, Any]) -> torch.device:
            return torch.device("cpu")

        def open(self, desc: Mapping[str, Any], device: torch.device) -> torch.Tensor:
            dtype = parse_geometry(desc)[0]
            path = str(desc["path"])
            size = os.path.getsize(path) // torch.empty(0, dtype=dtype).element_size()
            storage = torch.from_file(path, shared=True, size=size, dtype=dtype)
            return rebuild(storage.untyped_storage(), desc)

    return ShmSharing


def _shared_cache(path: str, create: bool) -> Any:
    import torch

    n = 1
    for s in SHAPE:
        n *= s
    kv = torch.from_file(path, shared=True, size=n, dtype=torch.float32).view(SHAPE)
    if create:
        g = torch.Generator().manual_seed(0)
        kv.copy_(torch.randn(SHAPE, generator=g))
    return kv


# ---- tracing ------------------------------------------------------------------------------------


class Tracer:
    """perf_counter marks, appended from any thread (a list append is atomic)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.events.append((name, time.perf_counter()))

    def take(self) -> list[tuple[str, float]]:
        out, self.events = self.events, []
        return out


def _wrap_async(cls: type, name: str, before: Callable[[Any], None] | None,
                after: Callable[[Any], None] | None) -> None:
    orig = getattr(cls, name)

    async def wrapped(self: Any, *a: Any, **k: Any) -> Any:
        if before is not None:
            before(a)
        r = await orig(self, *a, **k)
        if after is not None:
            after(r)
        return r

    setattr(cls, name, wrapped)


def _wrap_sync(cls: type, name: str, tr: Tracer, start: str, end: str) -> None:
    orig = getattr(cls, name)

    def wrapped(self: Any, *a: Any, **k: Any) -> Any:
        tr.mark(start)
        try:
            return orig(self, *a, **k)
        finally:
            tr.mark(end)

    setattr(cls, name, wrapped)


def trace_client(tr: Tracer) -> None:
    """Marks in this process's client code (its only loops are the clients'): the read handed
    to the loop (``call_soon_threadsafe``) and its task (``create_task``; the first after the
    hand-over is the read's), and the read recorded in the client's stats (its end on the
    loop)."""
    from disagg.transfer.cuda_ipc import MappedPeers
    from disagg.transfer.handshake import ClientSession
    from disagg.transfer.stats import TransferStats
    from disagg.transfer.tcp import TcpConnection

    for name, mark in (("call_soon_threadsafe", "handed"), ("create_task", "task")):
        orig = getattr(asyncio.BaseEventLoop, name)

        def wrapped(self: Any, *a: Any, _orig: Any = orig, _mark: str = mark,
                    **k: Any) -> Any:
            tr.mark(_mark)
            return _orig(self, *a, **k)

        setattr(asyncio.BaseEventLoop, name, wrapped)
    _wrap_sync(TransferStats, "record_transfer", tr, "recorded", "recorded_end")
    # (a tree that signs the canonical text it then sends: sign() goes through it too)
    signs = "sign_canonical" if hasattr(ClientSession, "sign_canonical") else "sign"
    _wrap_sync(ClientSession, signs, tr, "sign", "signed")
    _wrap_async(TcpConnection, "send_header", None, lambda r: tr.mark("sent"))
    if hasattr(TcpConnection, "send_encoded"):  # (a tree that encodes while it signs)
        _wrap_async(TcpConnection, "send_encoded", None, lambda r: tr.mark("sent"))
    _wrap_async(TcpConnection, "recv_header", None, lambda r: tr.mark("answer"))
    _wrap_async(TcpConnection, "recv_payload_iov", lambda a: tr.mark("payload"),
                lambda r: tr.mark("payload_done"))
    _wrap_async(MappedPeers, "gather", lambda a: tr.mark("gather"),
                lambda r: tr.mark("gathered"))


def trace_server(tr: Tracer) -> None:
    from disagg.transfer.handshake import ServerSession
    from disagg.transfer.lease import LeaseTable
    from disagg.transfer.tcp import TcpConnection

    _wrap_async(TcpConnection, "recv_header", None,
                lambda r: tr.mark(f"recv_{r.get('op')}"))
    _wrap_sync(ServerSession, "verify", tr, "verify", "verified")
    _wrap_async(TcpConnection, "send_header", None, lambda r: tr.mark("sent"))
    orig = LeaseTable.unpin

    def unpin(self: Any, lease_id: str) -> None:
        orig(self, lease_id)
        tr.mark("unpinned")

    LeaseTable.unpin = unpin  # type: ignore[method-assign]


def split_reads(events: list[tuple[str, float]], first: str) -> list[dict[tuple[str, int], float]]:
    """Per read (a new one at each ``first``), ``(event, occurrence) -> time``."""
    reads: list[dict[tuple[str, int], float]] = []
    for name, t in events:
        if name == first:
            reads.append({})
        if not reads:
            continue
        cur = reads[-1]
        k = 0
        while (name, k) in cur:
            k += 1
        cur[(name, k)] = t
    return reads


def phase_medians(mode: str, client: list[dict[tuple[str, int], float]],
                  server: list[dict[tuple[str, int], float]]) -> dict[str, float]:
    """Median ms of each phase over the reads that have both of its marks."""
    sides = {"c": client, "s": server}
    out: dict[str, float] = {}
    for label, (sa, ea, ka), (sb, eb, kb) in PHASES[mode]:
        vals = []
        for i in range(min(len(client), len(server))):
            a, b = sides[sa][i].get((ea, ka)), sides[sb][i].get((eb, kb))
            if a is not None and b is not None:
                vals.append((b - a) * 1e3)
        if vals:
            out[label] = statistics.median(vals)
    return out


# ---- the processes ------------------------------------------------------------------------------


def _server_main(conn: Any, path: str, mapped: bool) -> None:
    """A ``KVTransferServer`` over the shared cache; commands on ``conn``."""
    import torch

    from disagg.transfer import KVTransferServer, LeaseTable

    torch.set_num_threads(1)
    _pin(1)
    kv = _shared_cache(path, create=True)
    leases = LeaseTable(default_ttl_s=3600.0)
    leases.create("bench", list(range(SHAPE[0])), readers=1)
    server = KVTransferServer(kv, leases, TOKEN, "tcp", mapped=mapped,
                              sharing=_sharing_class()(path), sweep_interval_s=None).start()
    tr = Tracer()
    conn.send(server.address)
    try:
        while True:
            cmd = conn.recv()
            if cmd == "trace":
                trace_server(tr)
                conn.send("ok")
            elif cmd == "take":
                conn.send(tr.take())
            elif cmd == "cpu":
                conn.send(time.process_time())
            else:
                break
    finally:
        server.stop()


def _pin(slot: int) -> None:
    """Server and client on CPUs of their own (where there are two): the server's wake-up
    then never preempts the client mid-send on its CPU, which would blur the phases."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[slot]})


def _timed_reads(client: Any, address: str, req: Any, out: Any, n: int,
                 tr: Tracer | None) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if tr is not None:
            tr.mark("call")
        client.read(address, req, out).result(30)
        if tr is not None:
            tr.mark("result")
        times.append(time.perf_counter() - t0)
    return times


def _child(args: argparse.Namespace) -> None:
    import torch

    import disagg
    from disagg.transfer import KVTransferClient, ReadRequest
    from disagg.transfer.payload import payload_shape

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {"disagg": disagg.__file__}
    reqs = {n: ReadRequest("bench", tuple(range(3, 3 + n)), (0, SHAPE[1]), (0, SHAPE[3]))
            for n in args.blocks}
    with tempfile.TemporaryDirectory(prefix="disagg-kvr-", dir="/dev/shm") as tmp:
        rigs = {}
        try:
            for mode in MODES:
                path = os.path.join(tmp, f"{mode}.kv")
                here, there = ctx.Pipe()
                proc = ctx.Process(target=_server_main, args=(there, path, mode == "mapped"),
                                   daemon=True)
                proc.start()
                if not here.poll(60):
                    raise RuntimeError(f"{mode} server did not start")
                address = here.recv()
                client = KVTransferClient("tcp", TOKEN, timeout_s=30, mapped=mode == "mapped",
                                          sharing=_sharing_class()())
                rigs[mode] = (proc, here, client, address, path)
            _pin(0)  # (the servers, started, pinned themselves to the other)
            tr = Tracer()
            for traced in (False, True):
                if traced:
                    trace_client(tr)
                    for _, pipe, *_rest in rigs.values():
                        pipe.send("trace")
                        pipe.recv()
                for (mode, (_, pipe, client, address, path)), (n, req) in itertools.product(
                        rigs.items(), reqs.items()):
                    out = torch.full(payload_shape(SHAPE, req), -1.0)
                    _timed_reads(client, address, req, out, args.warmup, None)
                    res = client.read(address, req, out).result(30)
                    expected = _shared_cache(path, create=False)[list(req.block_ids)]
                    if res.mapped != (mode == "mapped") or not torch.equal(out, expected):
                        raise RuntimeError(f"{mode}: mapped={res.mapped}, bytes "
                                           f"{'right' if torch.equal(out, expected) else 'WRONG'}")
                    tr.take()
                    pipe.send("take")
                    pipe.recv()
                    pipe.send("cpu")
                    cpu0 = (time.process_time(), pipe.recv())
                    times = _timed_reads(client, address, req, out, args.reads,
                                         tr if traced else None)
                    pipe.send("cpu")
                    cpu1 = (time.process_time(), pipe.recv())
                    r = result.setdefault(f"{mode}/{n}", {})
                    if not traced:
                        r[UNTRACED] = statistics.median(times) * 1e3
                        r[CPU_CLIENT] = (cpu1[0] - cpu0[0]) / args.reads * 1e3
                        r[CPU_SERVER] = (cpu1[1] - cpu0[1]) / args.reads * 1e3
                        continue
                    pipe.send("take")
                    server_events = pipe.recv()
                    r.update(phase_medians(mode, split_reads(tr.take(), "call"),
                                           split_reads(server_events, "recv_READ")))
        finally:
            for proc, pipe, client, *_ in rigs.values():
                client.close()
                pipe.send("stop")
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
    print("RESULT " + json.dumps(result), flush=True)


def _run_child(cwd: str, args: argparse.Namespace) -> dict[str, Any]:
    return run_child(cwd, "bench.kv_read_overhead", [
        "--child", "--reads", str(args.reads), "--warmup", str(args.warmup),
        "--blocks", *map(str, args.blocks)])


def _machine() -> list[str]:
    import torch

    return [cpu_line(), f"Python {platform.python_version()}, torch {torch.__version__}"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_read_overhead",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=2000, help="timed reads per mode and run")
    ap.add_argument("--warmup", type=int, default=300, help="reads before each timed series")
    ap.add_argument("--rounds", type=int, default=3, help="alternating child runs per tree")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 64, 256],
                    help="blocks per read (4 KiB each), one series each")
    ap.add_argument("--baseline", help="git revision whose disagg is the 'before' column")
    ap.add_argument("--out", default=str(ROOT / "bench/results/kv_read_overhead.md"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reads < 10 or args.warmup < 1 or args.rounds < 1:
        ap.error("--reads must be >= 10, --warmup >= 1, --rounds >= 1")
    if not all(1 <= n <= SHAPE[0] - 3 for n in args.blocks):
        ap.error(f"--blocks must be in 1..{SHAPE[0] - 3}")
    if args.child:
        _child(args)
        return

    head = _machine()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="disagg-kvr-") as tmp:
        trees = {"after": str(ROOT)}
        if args.baseline:
            trees = {"before": checkout(args.baseline, tmp), "after": str(ROOT)}
        runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in range(args.rounds):
            for name, cwd in trees.items():
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(_run_child(cwd, args))
    minutes = (time.time() - t0) / 60
    cols = list(trees)
    dirty = git("diff", "--name-only", "HEAD", "--", "disagg")
    cmd = " ".join(["python -m bench.kv_read_overhead", *sys.argv[1:]])
    block_kib = 4 * SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * SHAPE[5] / 1024
    lines = [
        f"# The fixed cost of one KV read, phase by phase ({time.strftime('%Y-%m-%d')})", "",
        *[f"- {m}" for m in head],
        f"- command: `{cmd}` ({minutes:.1f} min); written by the script",
        f"- after: this working tree, commit {git('rev-parse', '--short', 'HEAD')}"
        + (" with uncommitted changes to " + ", ".join(dirty.splitlines()) if dirty else "")
        + (f"; before: `git archive {args.baseline}` "
           f"({git('rev-parse', '--short', args.baseline)})" if args.baseline else ""),
        f"- a read: {' / '.join(map(str, args.blocks))} consecutive blocks of a float32 cache "
        f"{list(SHAPE)} ({block_kib:.0f} KiB a block), all layers and heads, `blocks` format, "
        "into a preallocated CPU `out` (a 2k-token read of the 8B shape names 64 blocks, 8k "
        "tokens 256); server "
        "and client in two processes (the server's cache in a /dev/shm file), TCP backend on "
        "loopback, one torch thread each; `mapped`: the client maps the file "
        "(`ShmSharing`, the stand-in for the CUDA IPC handle) and gathers each read itself, "
        "then says DONE; `tcp`: the mapped path off, the payload on the socket",
        f"- per run and mode: {args.warmup} warm-up reads, {args.reads} reads untraced, "
        f"{args.warmup} + {args.reads} traced (marks at the code's boundaries, the module "
        f"docstring; median per phase); {args.rounds} runs per tree, alternating, median of "
        "the run medians. Phases are consecutive along the read's path unless they say "
        "otherwise; the traced whole read is the untraced one plus the marks' own cost",
        "- on a GPU the mapped gather is a kernel plus an event wait (~0.2 ms for 2k tokens of "
        "the 8B shape on an H200) and both ends' Python is the same as here",
        "",
    ]
    for mode, n in itertools.product(MODES, args.blocks):
        key = f"{mode}/{n}"
        labels = [UNTRACED, CPU_CLIENT, CPU_SERVER] + [p[0] for p in PHASES[mode]]
        hdr = "| phase (ms, median) | " + " | ".join(cols)
        hdr += " | after / before |" if len(cols) == 2 else " |"
        lines += [f"## {mode}, {n} block{'s' if n > 1 else ''}", "", hdr,
                  "|" + "---|" * (hdr.count("|") - 1)]
        for label in labels:
            vals = []
            for c in cols:
                got = [run[key][label] for run in runs[c] if label in run[key]]
                vals.append(statistics.median(got) if got else None)
            row = f"| {label} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals)
            if len(cols) == 2:
                row += (f" | {vals[1] / vals[0]:.2f}x" if vals[0] and vals[1] is not None
                        else " | -")
            lines.append(row + " |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
