"""Several router processes on one port (``disagg router --processes N``, YAML ``processes``).

One Python process serves one core; N processes share the router's port with ``SO_REUSEPORT``
(the kernel spreads new connections over them) so the router scales with cores. The parent
process (``supervise``) only starts, watches and stops them: it binds the port first (port 0
picks one that every child then binds), starts the N children (``disagg router ...
--process-index I``), prints the listening line once every child answers on its private
socket, and on SIGTERM / SIGINT, or when a child exits, stops them all (SIGTERM, a grace
period, SIGKILL to each one's group, reaped: ``procs.stop_all``); a child dies with the parent.

Each child is a whole router: its own health checks, its own KV index fed by its own polls of
the workers' KV events, its own metrics. What must be one cluster-wide view is shared as
follows:

- worker registrations (``/cluster/register``, ``/cluster/unregister``): the child that
  receives one applies it and forwards the same signed request to every sibling over the
  private channel before answering (each verifies the signature: a nonce is accepted once per
  process); a sibling that missed one (not yet started) gets the worker's next heartbeat;
- the private channel: one Unix socket per child in a directory only this user can open
  (0700), served by the child's own app; a request that arrives on it is a sibling's and is
  neither forwarded nor gathered again;
- ``/metrics``: every process's series, each sample labelled ``process="I"`` (sum over
  ``process`` for the router's totals); ``/cluster_info``: the answering process's view with
  ``process`` and ``processes`` (index, count) and ``per_process``: every process's workers
  as that process sees them (health and KV index are per process);
- background admin work that must run once (e.g. a planner): only in the primary process
  (``ProcessInfo.primary``: index 0), which ``Router.primary`` tells.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from disagg import procs
from disagg.contracts.cluster import MAX_PROCESSES

logger = logging.getLogger("disagg.router")

SIBLING_TIMEOUT_S = 5.0  # a forwarded registration or a gathered /metrics
START_TIMEOUT_S = 120.0  # every child answers on its private socket within this
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class ProcessInfo:
    """Which of the router's processes this one is."""

    index: int = 0
    count: int = 1
    socket_dir: str | None = None  # the private channel's directory (count > 1)

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_PROCESSES or not 0 <= self.index < self.count:
            raise ValueError(f"process {self.index} of {self.count}: out of range")
        if self.count > 1 and not self.socket_dir:
            raise ValueError("several router processes need a socket directory")

    @property
    def primary(self) -> bool:
        """Process 0: the one that runs the router's once-per-cluster background work."""
        return self.index == 0

    def socket_path(self, index: int) -> str:
        assert self.socket_dir is not None
        return os.path.join(self.socket_dir, f"router-{index}.sock")

    def member_id(self) -> str | None:
        """The router's member id (``cluster_auth``), the same in all its processes: derived
        from the host and the private channel's directory (fresh for each start) when there
        are several; None (a fresh random one) when there is one."""
        if self.count == 1 or self.socket_dir is None:
            return None
        where = f"{socket.gethostname()}|{os.path.realpath(self.socket_dir)}"
        return "r" + hashlib.sha256(where.encode()).hexdigest()[:31]

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]


def from_sibling(request: web.Request) -> bool:
    """Whether ``request`` came over the private channel (a Unix socket: another router
    process of this router)."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


class Siblings:
    """The private channel to the other processes (a no-op for a single process)."""

    def __init__(self, info: ProcessInfo) -> None:
        self.info = info
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)
        for i in self.info.siblings:
            self._sessions[i] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.info.socket_path(i)),
                timeout=timeout)

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()

    async def call(self, i: int, method: str, path: str) -> tuple[int, bytes] | None:
        """``method path`` (no body) of sibling ``i``: (status, body), None when it failed."""
        if i not in self._sessions:
            return None
        return await self._call(i, method, path, {}, b"")

    async def _call(self, i: int, method: str, path: str, headers: dict[str, str],
                    body: bytes) -> tuple[int, bytes] | None:
        try:
            async with self._sessions[i].request(method, "http://router" + path,
                                                 headers=headers, data=body) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            logger.warning("router process %d: %s %s failed: %s", i, method, path, e)
            return None

    async def forward(self, request: web.Request) -> None:
        """The same request (a signed membership call) to every sibling; failures logged
        (the worker's next heartbeat reaches the sibling again)."""
        if not self._sessions or from_sibling(request):
            return
        body = await request.read()  # (aiohttp keeps the body it read)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding",
                                        "connection")}
        results = await asyncio.gather(*(self._call(i, request.method, request.raw_path,
                                                    headers, body) for i in self._sessions))
        for i, res in zip(self._sessions, results, strict=True):
            if res is not None and res[0] != 200:
                logger.warning("router process %d refused %s: %d %s", i, request.path,
                               res[0], res[1][:200])

    async def gather(self, path: str) -> dict[int, bytes | None]:
        """``GET path`` of every sibling: index -> body (None: no 200 answer)."""
        results = await asyncio.gather(*(self._call(i, "GET", path, {}, b"")
                                         for i in self._sessions))
        return {i: r[1] if r is not None and r[0] == 200 else None
                for i, r in zip(self._sessions, results, strict=True)}


# -- /metrics of every process ---------------------------------------------------------------


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(texts: dict[int, bytes]) -> bytes:
    """Every process's exposition (index -> text) as one, each sample labelled
    ``process="index"``; a family is written once with the samples of all."""
    merged: dict[str, Metric] = {}
    for index in sorted(texts):
        for fam in text_string_to_metric_families(texts[index].decode()):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "process": str(index)}, s.value,
                               s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


# -- the parent: start, watch, stop -----------------------------------------------------------


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT (not listening: no connection goes
    to it): port 0 becomes the port every child binds, and the port is held until they
    listen. OSError when the address cannot be bound."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("several router processes need SO_REUSEPORT (Linux, BSD, macOS)")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def _ready(path: str) -> bool:
    """Whether a child answers ``GET /version`` on its private socket."""
    with contextlib.suppress(OSError):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(path)
            s.sendall(b"GET /version HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/1.1 200")
    return False


def supervise(child_argv: Sequence[str], count: int, host: str, port: int) -> int:
    """Run ``count`` router processes (``child_argv`` + ``--port P --process-index I
    --processes N --process-dir D``; their output goes where this process's does) until
    SIGTERM / SIGINT or one of them exits. Exit code: 0 on a signal, else the first exited
    child's (1 if it was 0). OSError when the address cannot be bound."""
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # taken by sigtimedwait below
    held = reserve_port(host, port)
    bound = held.getsockname()[1]
    socket_dir = tempfile.mkdtemp(prefix="disagg-router-")  # 0700: this user only
    children: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(count):
            children.append(procs.spawn(
                [*child_argv, "--port", str(bound), "--process-index", str(i),
                 "--processes", str(count), "--process-dir", socket_dir],
                None, die_with_parent=True))
        info = ProcessInfo(0, count, socket_dir)
        if not _wait_ready(children, [info.socket_path(i) for i in range(count)],
                           stop_signals):
            return 1
        held.close()
        shown = f"[{host}]" if ":" in host else host
        print(f"disagg router listening on http://{shown}:{bound} ({count} processes)",
              flush=True)
        return _watch(children, stop_signals)
    finally:
        held.close()
        procs.stop_all(children, grace_s=STOP_GRACE_S)
        shutil.rmtree(socket_dir, ignore_errors=True)


def _first_exit(children: Sequence[subprocess.Popen[bytes]]) -> int | None:
    for i, c in enumerate(children):
        if c.poll() is not None:
            print(f"disagg router: process {i} exited {c.returncode}; stopping the others",
                  file=sys.stderr, flush=True)
            return c.returncode or 1
    return None


def _wait_ready(children: Sequence[subprocess.Popen[bytes]], paths: Sequence[str],
                stop_signals: Sequence[int]) -> bool:
    """Until every child answers on its socket (False: one exited, a stop signal came, or
    the deadline passed)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = list(range(len(children)))
    while waiting:
        if _first_exit(children) is not None:
            return False
        waiting = [i for i in waiting if not _ready(paths[i])]
        if not waiting:
            return True
        if time.monotonic() > deadline:
            print(f"disagg router: processes {waiting} not serving after "
                  f"{START_TIMEOUT_S:g} s", file=sys.stderr, flush=True)
            return False
        if signal.sigtimedwait(stop_signals, 0.1) is not None:
            return False
    return True


def _watch(children: Sequence[subprocess.Popen[bytes]], stop_signals: Sequence[int]) -> int:
    """Until a stop signal (0) or a child's exit (its code, 1 for 0)."""
    while True:
        code = _first_exit(children)
        if code is not None:
            return code
        if signal.sigtimedwait(stop_signals, 0.5) is not None:
            return 0


def own_path(info: ProcessInfo) -> str | None:
    """This process's private socket (None: a single process has none)."""
    return info.socket_path(info.index) if info.count > 1 else None


