"""KV transfer server (context rank) and client (generation rank) over any ``TransportBackend``.

Threads: the server and the client each do all their I/O on the backend's loop thread (TCP: one
per server / client; UCX: one per process). The engine thread calls ``client.read(...)``, which
returns a ``concurrent.futures.Future`` at once; it polls or adds a done-callback, never blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from disagg.addresses import host_port
from disagg.env import KV_IPC, KV_RUNS
from disagg.transfer.admission import Admission, ServerLimits
from disagg.transfer.backends import make_backend
from disagg.transfer.base import (
    BAD_REQUEST,
    CLOSED,
    CONNECTION_FAILED,
    NOT_MAPPED,
    PREAUTH_HEADER_MAX_BYTES,
    PROTOCOL_ERROR,
    SERVER_CODES,
    TIMEOUT,
    UNAUTHORIZED,
    Connection,
    ConnectionClosedError,
    Listener,
    LoopThread,
    ProtocolError,
    ReadRequest,
    ReadResult,
    TransferError,
    TransportBackend,
    bounded,
    encode_signed,
    parse_address,
)
from disagg.transfer.cuda_ipc import (
    CacheExporter,
    CacheSharing,
    CudaIpcSharing,
    MappedPeers,
    answered_request,
    client_offer,
)
from disagg.transfer.handshake import ClientSession, HandshakeError, ServerSession
from disagg.transfer.integrity import ALGORITHM as INTEGRITY_ALGORITHM
from disagg.transfer.integrity import INTEGRITY_ERROR, payload_checksum
from disagg.transfer.lease import Lease, LeaseError, LeaseTable
from disagg.transfer.payload import as_payload, consecutive_runs, dtype_name, slice_views
from disagg.transfer.progress import StreamNotReady, StreamProgress
from disagg.transfer.sender import READ_STALLED, PayloadSource, ReadStalled, within_lease
from disagg.transfer.stats import TransferStats

logger = logging.getLogger("disagg.transfer")

# Connections a client keeps to one server (one context rank) at most: that many requests to
# it run at once, one per connection (the wire answers a connection's requests one at a time);
# more wait, in order, for the first to come free. A rank pulls a request's KV from a context
# rank in one read, so this is how many requests' pulls from that rank overlap (one connection
# made them queue: a round trip each). A streamed request's lane keeps one (its reads queue
# in layer order). Against the server's ``max_connections_per_peer`` (64, per client host):
# 8 ranks of a generation host, 8 each.
MAX_CONNECTIONS_PER_PEER = 8
# After the server refused one more connection (its per-host cap, say), a pool with connections
# open waits for those and opens no other for this long.
REFUSED_HOLD_S = 1.0
# An idle pooled connection unused this long is closed (all but the last used): the pool
# shrinks back after a burst, so idle connections do not hold the server's slots.
POOL_IDLE_CLOSE_S = 5.0
# A READ may split its payload into at most this many parts (UCX messages).
MAX_PAYLOAD_PARTS = 4096
# How a message transport's client splits the payload of a scattered table
# (``split_parts``): about PARTS_PER_PAYLOAD parts of PART_MIN_BYTES..PART_MAX_BYTES, so that
# the server gathers part k+1 while part k is on the wire, at ~0.1 ms of ucxx overhead per
# message (measured here, quiet host, 128 MiB: one message 15 ms, 8 parts 16 ms, 64 parts
# 23 ms, 512 parts 40 ms; on a loaded host every message costs more).
PARTS_PER_PAYLOAD = 4
PART_MIN_BYTES = 4 << 20
PART_MAX_BYTES = 16 << 20
# Receiving a message transport's payload straight into several buffers (one message each)
# pays only when they average at least this much; smaller ones go to one buffer + a copy.
DIRECT_PART_MIN_BYTES = 1 << 20


def _error(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "code": code, "message": message}


def parse_parts(value: Any, nbytes: int) -> list[int]:
    """A READ's ``parts`` (byte lengths of its payload's messages, in order; absent: one
    part); raises ``TransferError(bad_request)``."""
    if value is None:
        return [nbytes]
    if (not isinstance(value, list) or not 0 < len(value) <= MAX_PAYLOAD_PARTS
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                       for n in value)):
        raise TransferError(BAD_REQUEST, f"parts must be a list of 1..{MAX_PAYLOAD_PARTS} "
                                         f"positive ints")
    if sum(value) != nbytes:
        raise TransferError(BAD_REQUEST, f"parts add up to {sum(value)} bytes, payload is "
                                         f"{nbytes}")
    return value


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """Back-to-back byte ranges ``[a, b)`` of the given sizes, from 0."""
    out, a = [], 0
    for n in sizes:
        out.append((a, a + n))
        a += n
    return out


def split_parts(sizes: list[int]) -> list[tuple[int, int, int]]:
    """How a client cuts its receive buffers into parts: ``(buffer, start, stop)`` byte
    ranges, each buffer into near-equal pieces of at most the part size (a part never spans
    two buffers)::

        buffers: |-------- 0 --------|--- 1 ---|
        parts:   [ 0:0,a )[ 0:a,end )[ 1:0,end )
    """
    total = sum(sizes)
    part = min(PART_MAX_BYTES, max(PART_MIN_BYTES, -(-total // PARTS_PER_PAYLOAD)))
    out = []
    for i, n in enumerate(sizes):
        k = max(1, -(-n // part))
        cuts = [n * j // k for j in range(k + 1)]
        out += [(i, a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    return out


async def await_stream(progress: StreamProgress | None, req: ReadRequest,
                       tokens_per_block: int) -> tuple[ReadRequest, dict[str, Any] | None]:
    """Wait until a streaming READ's tokens exist on its layers (and, ``first_token``, the
    first token was sampled); the READ it becomes (the stream's first ceil(num_tokens / B)
    block ids, no wait) and that first token. Raises ``TransferError``."""
    if progress is None:
        raise TransferError(BAD_REQUEST, "this server streams no KV (a READ with wait_s "
                                         "needs a context worker with streaming on)")
    assert req.wait_s is not None and req.tokens_hash is not None
    try:
        ids = await progress.wait_ready(req.lease_id, req.num_tokens, req.layer_slice,
                                        req.tokens_hash, req.wait_s, req.first_token)
    except StreamNotReady as e:
        # progress's codes are named as the server's own (unknown_lease, bad_request,
        # timeout): the client raises TransferError with the same code
        raise TransferError(e.code, e.message) from None
    need = -(-req.num_tokens // tokens_per_block)  # ceil(num_tokens / B)
    if len(ids) < need:
        raise TransferError(BAD_REQUEST, f"stream {req.lease_id!r} holds {len(ids)} blocks, "
                                         f"{req.num_tokens} tokens need {need}")
    first = progress.first_of(req.lease_id) if req.first_token else None
    return dataclasses.replace(req, block_ids=tuple(ids[:need]), wait_s=None, tokens_hash=None,
                               first_token=False), first


def _read_answer(nbytes: int, num_blocks: int, zero_copy: bool, first: dict[str, Any] | None,
                 device: bool, staging: str | None) -> dict[str, Any]:
    """A READ's ok answer (base.py draws it). ``staging``: a GPU cache's reason for pinned
    host memory (None for a CPU cache)."""
    answer: dict[str, Any] = {"ok": True, "nbytes": nbytes, "num_blocks": num_blocks,
                              "zero_copy": zero_copy, "device": device}
    if staging is not None and not device:
        answer["staging"] = staging
    if first is not None:
        answer["first"] = first
    return answer


def _checked_progress(progress: StreamProgress | None, kv_cache: torch.Tensor
                      ) -> StreamProgress | None:
    if progress is not None and progress.num_local_layers != kv_cache.shape[1]:
        raise ValueError(f"progress tracks {progress.num_local_layers} layers, the cache has "
                         f"{kv_cache.shape[1]}")
    return progress


class KVTransferServer:
    """Serves one rank's KV cache to generation ranks that prove they hold the cluster token
    (the handshake in base.py; the token itself never crosses the wire).

    ``kv_cache``: ``[num_blocks, num_local_layers, 2, num_local_kv_heads, tokens_per_block,
    head_dim]`` on the CPU or a CUDA device; ``payload`` (``sender.PayloadSource``) is where
    a READ's bytes come from: views of the cache, a staging buffer, or GPU memory as it is
    (a GPU cache whose transport moves GPU memory; otherwise ``payload.staging_reason`` says
    why not, logged at start, counted in ``stats``, told to the client in every READ answer).
    ``runs`` (None: ``DISAGG_KV_RUNS``, default on): a scattered block table of a CPU cache
    goes out as views of its runs, not gathered into staging first; False keeps the staged
    path (A/B benchmarks).

    ``leases`` decides what may be read; a RELEASE from a reader ``confirm``s its lease.
    Expired leases are swept every ``sweep_interval_s`` (None: the owner calls
    ``leases.expire()`` itself). ``progress``: streaming READs (``wait_s``) wait there first
    (``await_stream``).

    ``limits`` (``admission.ServerLimits``) bound what a peer without the token can cost:
    headers of at most ``PREAUTH_HEADER_MAX_BYTES`` until its handshake is done, the
    handshake's deadline, the connection caps (``admission``: extra connections are closed
    unread), and an idle authenticated connection is closed (the client reconnects
    transparently). A READ still in flight ``limits.read_grace_s`` after its lease ended (its
    reader stopped reading) is aborted and its connection closed (``sender.within_lease``),
    counted as ``read_stalled`` in ``stats``: a stalled reader holds no block past TTL +
    grace, and fails only its own read.

    ``mapped`` (None: ``DISAGG_KV_IPC``, default on): a client on this host, in another
    process, gets the handle of a GPU cache in its AUTH answer and then gathers its reads
    itself from the cache mapped into its process (``cuda_ipc.py``; ``sharing`` says how:
    CUDA IPC unless a test plugs in another); such a READ is pinned until the client's DONE.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        leases: LeaseTable,
        token: str,
        backend: str | TransportBackend = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        stats: TransferStats | None = None,
        sweep_interval_s: float | None = 1.0,
        limits: ServerLimits | None = None,
        runs: bool | None = None,
        progress: StreamProgress | None = None,
        mapped: bool | None = None,
        sharing: CacheSharing | None = None,
    ) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[2] not in (1, 2):
            # kv parts: 2 (K, V), or 1 (an MLA latent)
            raise ValueError(f"kv_cache must be [N, L, 2 or 1, H, B, D], got "
                             f"{tuple(kv_cache.shape)}")
        if kv_cache.device.type not in ("cpu", "cuda"):
            raise ValueError(f"KVTransferServer serves CPU or CUDA KV caches, not "
                             f"{kv_cache.device.type}")
        if not token:
            raise ValueError("a non-empty cluster token is required")
        self.limits = limits if limits is not None else ServerLimits()
        self.admission = Admission(self.limits)
        # Scattered block tables go out as views of their runs, not a staging copy (None:
        # DISAGG_KV_RUNS; False: the path before, for A/B runs).
        self.payload = PayloadSource(kv_cache, self.limits.max_staging_buffers,
                                     KV_RUNS.get() if runs is None else runs)
        self.leases = leases
        self.progress = _checked_progress(progress, kv_cache)
        # Same-host readers that may map the cache (None: DISAGG_KV_IPC).
        self.exports = CacheExporter(kv_cache, sharing if sharing is not None
                                     else CudaIpcSharing(),
                                     KV_IPC.get() if mapped is None else mapped)
        self.stats = stats if stats is not None else TransferStats()
        self.stats.bind_leases(leases)
        # Identity and lifecycle.
        self.backend = make_backend(backend)
        self.host = host
        self.server_id = uuid.uuid4().hex  # changes on restart: lets peers tell instances apart
        self._token = token
        self._port = port
        self._advertise = advertise_host or host
        self._sweep_interval_s = sweep_interval_s
        self._loop: LoopThread | None = None
        self._listener: Listener | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # Tracing (disagg/tracing.py; set by the worker that traces): called with a served
        # READ's traceparent, its start and end (wall-clock ns) and its attributes, for a READ
        # that carries one. None: READs are not traced.
        self.on_traced_read: Callable[[str, int, int, dict[str, Any]], None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("server not started")
        return host_port(self._advertise, self._listener.port)

    @property
    def num_connections(self) -> int:
        """Open connections, authenticated or not."""
        return len(self.admission.conns)

    def start(self) -> KVTransferServer:
        if self._loop is not None:
            raise RuntimeError("server already started")
        self.admission.closing = False
        self.payload.start()
        self._loop = self.backend.acquire_loop("server")
        try:
            self._loop.run(self._start())
        except BaseException:
            self._release_loop()
            raise
        logger.info("kv transfer server (%s) listening on %s", self.backend.name, self.address)
        self.payload.use_backend(self.backend)
        return self

    async def _start(self) -> None:
        self._listener = await self.backend.listen(self.host, self._port, self._serve)
        if self._sweep_interval_s:
            self._spawn(self._sweep())

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the listener and every connection (in-flight reads fail on the peer), stop
        the loop thread. Idempotent."""
        if self._loop is None:
            return
        try:
            self._loop.run(self._stop(), timeout_s)
        except Exception as e:
            logger.warning("kv transfer server stop: %r", e)
        finally:
            self._release_loop()

    async def _stop(self) -> None:
        self.admission.closing = True  # connections accepted from now on are closed at once
        for conn in list(self.admission.conns):
            await conn.close()
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:  # after the handlers: ucxx waits for them to retire
            await self._listener.close()

    def _release_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            self.backend.release_loop(loop)
        self.payload.stop()

    def __enter__(self) -> KVTransferServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sweep(self) -> None:
        assert self._sweep_interval_s
        while True:
            await asyncio.sleep(self._sweep_interval_s)
            self.leases.expire()

    # ---- requests -------------------------------------------------------------------------

    async def _serve(self, conn: Connection) -> None:
        """One connection: the handshake, then its requests in order until it closes."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        host = conn.peer_host
        door = self.admission
        if not door.admit(conn, host):
            await conn.close()  # unread: a refused peer costs nothing more
            if task is not None:
                self._tasks.discard(task)
            return
        pending = True
        try:
            session = ServerSession(self._token, self.server_id, self.backend.name)
            try:
                auth = await asyncio.wait_for(self._handshake(conn, session),
                                              self.limits.handshake_timeout_s)
            except asyncio.TimeoutError:
                door.handshake_timeouts += 1
                return
            if auth is None:
                return
            mapped = "ipc" in auth  # this connection's READs may be mapped ones
            door.authenticated()
            pending = False
            while True:
                try:
                    msg = await bounded(conn.recv_header(), self.limits.idle_timeout_s)
                except (asyncio.TimeoutError, ConnectionClosedError):
                    return  # idle for too long, or the peer went away
                except ProtocolError as e:
                    await self._refuse(conn, BAD_REQUEST, str(e))
                    return
                if not session.verify(msg):
                    # Authenticate first: nothing about leases or data before this check.
                    self.stats.record_failure(UNAUTHORIZED)
                    await self._refuse(conn, UNAUTHORIZED, "bad request proof")
                    return
                op = msg.get("op")
                if op == "READ":
                    await self._read(conn, msg, session if mapped else None)
                elif op == "RELEASE":
                    await conn.send_header(self._release(msg))
                elif op == "PING":
                    await conn.send_header({"ok": True, "server_id": self.server_id,
                                            "backend": self.backend.name})
                else:
                    await conn.send_header(_error(BAD_REQUEST, f"unknown op {op!r}"))
        except ConnectionClosedError:
            pass
        except Exception:  # a bug must not kill the server; the stream state is unknown
            logger.exception("kv transfer server: request failed; closing the connection")
        finally:
            door.leave(conn, host, pending)
            await conn.close()
            if task is not None:
                self._tasks.discard(task)

    async def _handshake(self, conn: Connection, session: ServerSession
                         ) -> dict[str, Any] | None:
        """HELLO, then a proven AUTH (base.py): the AUTH answer sent. None: refused (answered,
        to be closed)."""
        try:
            hello = await conn.recv_header(PREAUTH_HEADER_MAX_BYTES)
            answer = session.answer_hello(hello)
        except ProtocolError as e:
            await self._refuse(conn, BAD_REQUEST, str(e))
            return None
        except HandshakeError as e:
            if e.code == UNAUTHORIZED:
                self.stats.record_failure(UNAUTHORIZED)
            await self._refuse(conn, e.code, e.message)
            return None
        await conn.send_header(answer)
        try:
            auth = await conn.recv_header(PREAUTH_HEADER_MAX_BYTES)
        except ProtocolError as e:
            await self._refuse(conn, BAD_REQUEST, str(e))
            return None
        # The first request is AUTH, proven like every later one (sequence number 0).
        if auth.get("op") != "AUTH" or not session.verify(auth):
            self.stats.record_failure(UNAUTHORIZED)
            await self._refuse(conn, UNAUTHORIZED, "bad AUTH proof (is this the same cluster "
                                                   "token?)")
            return None
        try:
            extra = await conn.attach_accept(auth)
        except ProtocolError as e:
            await self._refuse(conn, BAD_REQUEST, str(e))
            return None
        answer = {"ok": True, **extra, **self.exports.answer(auth.get("ipc"))}
        await conn.send_header(answer)
        return answer

    @staticmethod
    async def _refuse(conn: Connection, code: str, message: str) -> None:
        """An error answer before hanging up (the caller closes)."""
        with contextlib.suppress(ConnectionClosedError):
            await conn.send_header(_error(code, message))

    def _release(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        lease_id, reader_id = msg.get("lease_id"), msg.get("reader_id")
        if not isinstance(lease_id, str) or not isinstance(reader_id, (str, int)):
            return _error(BAD_REQUEST, "RELEASE needs lease_id and reader_id")
        try:
            return {"ok": True, "released": self.leases.confirm(lease_id, str(reader_id))}
        except LeaseError as e:
            return _error(e.code, str(e))

    async def _read(self, conn: Connection, msg: Mapping[str, Any],
                    mapped: ServerSession | None = None) -> None:
        """A READ; ``mapped``: this connection was offered the mapped path (its session checks
        the DONE that ends a mapped read)."""
        t0 = arrived = time.perf_counter()
        try:
            req = ReadRequest.from_wire(msg)
            first = None
            if streamed := req.wait_s is not None:  # streaming: the lease may not exist yet
                req, first = await await_stream(self.progress, req,
                                                self.payload.tokens_per_block)
                t0 = time.perf_counter()  # the transfer's time, not the prefill's
            lease = self.leases.pin(req.lease_id)
        except (TransferError, LeaseError) as e:
            self.stats.record_failure(e.code)
            await conn.send_header(_error(e.code, str(e)))
            return
        try:
            # Bounded: a reader that stops reading would hold the lease's blocks for ever.
            await within_lease(self._send_read(conn, msg, req, lease, streamed, first, t0,
                                               mapped, arrived),
                               self.leases, req.lease_id, self.limits.read_grace_s)
        except ReadStalled as e:
            self.stats.record_failure(READ_STALLED)
            self.leases.expire()  # an expired lease ends now: the unpin below frees its blocks
            logger.warning("kv transfer server: aborted a read of lease %s (%d blocks) by %s, "
                           "still in flight %gs after the lease ended (read_grace_s); closing "
                           "that connection", req.lease_id, len(req.block_ids),
                           conn.peer_host, e.grace_s)
            # Closed before the unpin frees the blocks: a UCX reader that wakes up later may
            # still complete its receive (a rendezvous it reads from this process's memory),
            # and takes the closed connection for the failure it is (``UcxConnection``).
            await conn.close()
            raise ConnectionClosedError(str(e)) from None
        finally:
            self.leases.unpin(req.lease_id)

    async def _send_read(self, conn: Connection, msg: Mapping[str, Any], req: ReadRequest,
                         lease: Lease, streamed: bool, first: dict[str, Any] | None,
                         t0: float, mapped: ServerSession | None = None,
                         arrived: float | None = None) -> None:
        """A pinned READ: its answer (or an error answer) and its payload, or for a mapped
        READ its answer and the reader's DONE. ``arrived``: when the READ came in (a streamed
        one waited for its layers since; its traced span starts there)."""
        staging: torch.Tensor | None = None
        gathers: list[asyncio.Future[Any]] = []
        try:
            wants_map = msg.get("mapped") is True
            try:
                leased = None if streamed else lease.block_set  # streamed: the engine's table
                # (a mapped READ sends no payload: no zero-copy view of the cache to build)
                plan = self.payload.plan(req, leased, view=not wants_map)
                if msg.get("dtype") != self.payload.dtype:
                    raise TransferError(BAD_REQUEST, f"dtype {msg.get('dtype')!r} != server "
                                                     f"cache dtype {self.payload.dtype!r}")
                if msg.get("nbytes") != plan.nbytes:
                    raise TransferError(BAD_REQUEST, f"receiver buffer of {msg.get('nbytes')} "
                                                     f"bytes, payload is {plan.nbytes}")
                parts = parse_parts(msg.get("parts"), plan.nbytes)
                if wants_map and mapped is None:
                    raise TransferError(BAD_REQUEST, "a mapped READ on a connection that was "
                                                     "not offered the mapped path")
            except TransferError as e:
                self.stats.record_failure(e.code)
                await conn.send_header(_error(e.code, e.message))
                return
            if wants_map and mapped is not None:
                await self._mapped_read(conn, mapped, req, plan.nbytes, first, t0, arrived,
                                        streamed)
                return
            integrity = msg.get("integrity")
            if integrity is not None and integrity != INTEGRITY_ALGORITHM:
                self.stats.record_failure(BAD_REQUEST)
                await conn.send_header(_error(BAD_REQUEST, f"integrity must be "
                                                           f"{INTEGRITY_ALGORITHM!r}, got "
                                                           f"{integrity!r}"))
                return
            source, staging = await self.payload.source(req, plan)
            pieces = [] if conn.stream else [slice_views(source, a, b)
                                             for a, b in _ranges(parts)]
            zero_copy = staging is None and all(len(p) == 1 for p in pieces)
            answer = _read_answer(plan.nbytes, len(req.block_ids), zero_copy, first,
                                  self.payload.answer_device, self.payload.answer_staging)
            if staging is None and not zero_copy:  # parts that span runs: gathered below
                staging = self.payload.staging.acquire(plan.nbytes)
            summing: asyncio.Future[str] | None = None
            if integrity is not None:
                answer["integrity"] = integrity  # its trailer follows the payload
                # The bytes to send (the lease's pinned blocks, or the staging they were
                # gathered into: final either way), summed on another thread while they go
                # out; the reader checks what landed against it.
                summing = asyncio.get_running_loop().run_in_executor(
                    None, self.payload.checksum, source)
            await conn.send_header(answer)
            try:
                if conn.stream:
                    await conn.send_payload_iov(source)
                else:
                    await self.payload.send_parts(conn, pieces, staging, gathers)
                if summing is not None:
                    await conn.send_header({"checksum": await asyncio.shield(summing)})
            except ConnectionClosedError:
                self.stats.record_failure(CONNECTION_FAILED)
                raise
            self.stats.record_transfer(
                plan.nbytes, len(req.block_ids), time.perf_counter() - t0,
                zero_copy, device_direct=answer["device"],
                staging_reason=answer.get("staging"))
            if req.traceparent is not None and self.on_traced_read is not None:
                self._traced(req, conn, plan.nbytes, t0, arrived, streamed=streamed,
                             zero_copy=zero_copy)
        finally:
            # A gather still queued or running writes into the staging buffer: let it finish
            # before the buffer serves another read (cancelling the asyncio future would not
            # stop a copy already running on the gather thread). ``wait``: a cancel of this
            # read meanwhile leaves them running, and the buffer is then dropped, not reused.
            if gathers:
                await asyncio.wait(gathers)
                for g in gathers:
                    if not g.cancelled():
                        g.exception()  # retrieved: no "never retrieved" warning
            if staging is not None:
                self.payload.staging.release(staging)

    async def _mapped_read(self, conn: Connection, session: ServerSession, req: ReadRequest,
                           nbytes: int, first: dict[str, Any] | None, t0: float,
                           arrived: float | None = None, streamed: bool = False) -> None:
        """A pinned, validated mapped READ: the answer, then the reader gathers from our cache
        and says DONE (no answer: the next request follows on this connection); only then does
        the read end (its caller unpins). Anything but a proven DONE closes the connection
        (``ConnectionClosedError``)."""
        answer = _read_answer(nbytes, len(req.block_ids), False, first, self.payload.on_gpu,
                              None)
        answer.update(mapped=True, block_ids=list(req.block_ids))
        await conn.send_header(answer)
        try:
            done = await conn.recv_header()
        except ConnectionClosedError:
            self.stats.record_failure(CONNECTION_FAILED)
            raise
        except ProtocolError as e:
            self.stats.record_failure(BAD_REQUEST)
            await self._refuse(conn, BAD_REQUEST, str(e))
            raise ConnectionClosedError(f"malformed DONE: {e}") from None
        if not session.verify(done):
            self.stats.record_failure(UNAUTHORIZED)
            await self._refuse(conn, UNAUTHORIZED, "bad request proof")
            raise ConnectionClosedError("bad DONE proof")
        if done.get("op") != "DONE" or done.get("lease_id") != req.lease_id:
            self.stats.record_failure(BAD_REQUEST)
            await self._refuse(conn, BAD_REQUEST, f"expected DONE of lease {req.lease_id!r} "
                                                  f"after a mapped READ")
            raise ConnectionClosedError("no DONE after a mapped READ")
        self.stats.record_transfer(nbytes, len(req.block_ids), time.perf_counter() - t0,
                                   device_direct=self.payload.on_gpu, mapped=True)
        if req.traceparent is not None and self.on_traced_read is not None:
            self._traced(req, conn, nbytes, t0, arrived, streamed=streamed, mapped=True)

    def _traced(self, req: ReadRequest, conn: Connection, nbytes: int, t0: float,
                arrived: float | None, **flags: bool) -> None:
        """Hand a served, traced READ to ``on_traced_read``: from its arrival (``arrived``)
        to now, with its bytes, blocks, the transfer's own seconds (``t0``: after a streamed
        READ's wait) and how it went out; a failing hook is logged, never the READ's."""
        now, end_ns = time.perf_counter(), time.time_ns()
        start = t0 if arrived is None else arrived
        attributes: dict[str, Any] = {
            "disagg.kv.bytes": nbytes, "disagg.kv.blocks": len(req.block_ids),
            "disagg.kv.layers": f"{req.layer_slice[0]}:{req.layer_slice[1]}",
            "disagg.kv.transfer_s": now - t0,
            "disagg.kv.backend": self.backend.name, "client.address": conn.peer_host,
            **{f"disagg.kv.{k}": v for k, v in flags.items()}}
        assert req.traceparent is not None and self.on_traced_read is not None
        try:
            self.on_traced_read(req.traceparent, end_ns - int((now - start) * 1e9), end_ns,
                                attributes)
        except Exception:  # (tracing must not fail a READ that was served)
            logger.exception("kv transfer server: tracing a READ failed")


class ReadFuture(cf.Future):  # type: ignore[type-arg]
    """``KVTransferClient.read``'s future. ``quiet``: set once the transport can no longer
    write into the read's ``out`` (it finished, failed, or its cancellation has unwound)."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = threading.Event()


@dataclass(frozen=True)
class _MappedOut:
    """A read that may be mapped (``KVTransferClient._exchange_mapped``): its one ``out`` and
    the request as the caller built it (validated once, not parsed back from the wire)."""

    out: torch.Tensor
    request: ReadRequest


@dataclass
class _Link:
    """One authenticated connection of a client's pool, with its handshake state."""

    conn: Connection
    session: ClientSession
    idle_since: float = 0.0  # time.monotonic() when it last came back to the pool
    ipc: dict[str, Any] | None = None  # the server's cache handle, offered in AUTH


@dataclass
class _PeerPool:
    """The connections of one (address, lane) (loop thread only). A request takes an idle
    connection, or opens one while fewer than ``cap`` are open, or waits in order for the next
    that comes free; it has its connection to itself until it ends (the wire answers one
    request at a time per connection).

    ``slots``: connections open, being opened, or promised to a waiter (<= ``cap``); ``live``:
    open ones (idle or in use); ``waiters``: each gets a connection, or None (a slot: open
    one). ``hold_until``: after the server refused one more connection, open no other until
    then while others are open or opening (wait for those)."""

    cap: int
    idle: list[_Link] = field(default_factory=list)
    slots: int = 0
    live: int = 0
    waiters: deque[asyncio.Future[_Link | None]] = field(default_factory=deque)
    hold_until: float = 0.0
    users: int = 0  # requests queued on or using it (a streaming lane closes at 0)
    prune_timer: asyncio.TimerHandle | None = None  # closes connections idle for too long

    def hand_on(self, link: _Link | None) -> None:
        """A connection came free (``link``) or a slot did (None: one closed): to the first
        waiter still waiting, else back to ``idle`` / the slot is given up."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(link)
                return
        if link is not None:
            link.idle_since = time.monotonic()
            self.idle.append(link)  # reused last in, first out: the rest may idle out
        else:
            self.slots -= 1

    async def wait(self) -> _Link | None:
        """The next connection (or slot) handed on."""
        waiter: asyncio.Future[_Link | None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.hand_on(waiter.result())  # handed on, then cancelled: pass it along
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            raise


class KVTransferClient:
    """Pulls KV from ``KVTransferServer``s. Thread-safe: ``read`` / ``release`` / ``ping`` may
    be called from any thread and return ``concurrent.futures.Future``s at once (from an event
    loop: ``await asyncio.wrap_future(fut)``); failures are ``TransferError``s (``.code``: a
    server code, or connection_failed / timeout / closed / protocol_error). ``timeout_s``
    bounds each request, connect and queueing behind other requests to the same peer
    included; ``connect_timeout_s`` bounds opening a connection, handshake included.

    A new connection first checks that the server proves the cluster token (base.py): a
    server that cannot gets nothing but a HELLO, and the request fails with
    ``unauthorized``. Every request is then signed for that connection.

    ``runs`` (None: ``DISAGG_KV_RUNS``): over a message transport (UCX), cut the payload of a
    scattered table into parts the server pipelines (``split_parts``); the pull code also
    reads into the request's blocks only with it on.

    Connections: a pool per server address (``_PeerPool``), at most
    ``max_connections_per_peer`` open, each carrying one request at a time, each with its own
    handshake: requests to one server run side by side, and one that stalls holds up only its
    own connection. A streaming read gets a connection of its own (its lane).

    ``mapped`` (None: ``DISAGG_KV_IPC``, default on): offer in AUTH to map a server's cache
    (``cuda_ipc.py``; same host, another process, CUDA here and there); a read from a server
    that accepted it, into one ``out`` on the GPU holding that cache, is gathered here from the
    mapped cache: no payload crosses the transport (``ReadResult.mapped``). Where the mapping
    fails the read moves its bytes, counted in ``stats.mapped_fallbacks`` and logged once."""

    def __init__(
        self,
        backend: str | TransportBackend = "tcp",
        token: str = "",
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        stats: TransferStats | None = None,
        runs: bool | None = None,
        max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
        mapped: bool | None = None,
        sharing: CacheSharing | None = None,
        integrity: bool = True,
    ) -> None:
        if not token:
            raise ValueError("a non-empty cluster token is required")
        if (not isinstance(max_connections_per_peer, int)
                or isinstance(max_connections_per_peer, bool) or max_connections_per_peer < 1):
            raise ValueError(f"max_connections_per_peer must be an int >= 1, got "
                             f"{max_connections_per_peer!r}")
        self.max_connections_per_peer = max_connections_per_peer
        # Every payload read is checked against the server's checksum (``integrity``).
        self.integrity = integrity
        self.backend = make_backend(backend)
        # Over a message transport, split payloads into parts the server can pipeline
        # (None: DISAGG_KV_RUNS; False: one message a payload, the path before).
        self.runs = KV_RUNS.get() if runs is None else runs
        self.stats = stats if stats is not None else TransferStats()
        # Same-host reads from a server's cache mapped here (None: DISAGG_KV_IPC); the AUTH
        # offer is None when this process cannot map (off, no CUDA, unknown host identity).
        sharing = sharing if sharing is not None else CudaIpcSharing()
        self.mapped = KV_IPC.get() if mapped is None else mapped
        self._ipc_offer = client_offer(sharing, uuid.uuid4().hex) if self.mapped else None
        self._maps = MappedPeers(sharing, self.stats)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._token = token
        # (address, lane) -> its connections; lane "" for all requests but streaming reads
        # (their lease id). Touched on the loop thread only.
        self._peers: dict[tuple[str, str], _PeerPool] = {}
        # Reads started and not ended (loop thread only): ``close`` ends them before it drops
        # the connections, so none opens a connection after it or outlives it.
        self._reads: set[asyncio.Task[Any]] = set()
        self._closing: set[asyncio.Task[Any]] = set()  # closes of pruned idle connections
        self._closed = False
        self._loop: LoopThread | None = self.backend.acquire_loop("client")
        # Known once the loop runs (UCX decides when its context starts).
        self.device_support: tuple[bool, str] = self.backend.device_memory_support()

    # ---- public API -----------------------------------------------------------------------

    @property
    def device_payloads(self) -> bool:
        """Whether ``read`` may receive into GPU memory (the backend moves it: UCX with CUDA
        transports); ``device_support[1]`` says how, or why not."""
        return self.device_support[0]

    def accepts_segments(self, sizes: list[int]) -> bool:
        """Whether a read into several buffers of these byte sizes lands in them directly at
        no extra cost: always over a stream transport (TCP: one ``recvmsg_into`` across
        them); over a message transport (UCX: one message each) only when they are few and
        large enough to beat one buffer plus a copy (``DIRECT_PART_MIN_BYTES``)."""
        if self.backend.stream_payloads:
            return True
        return 0 < len(sizes) <= min(MAX_PAYLOAD_PARTS,
                                     max(1, sum(sizes) // DIRECT_PART_MIN_BYTES))

    def read(self, address: str, request: ReadRequest,
             out: torch.Tensor | Sequence[torch.Tensor]) -> ReadFuture:
        """Pull ``request`` from the server at ``address`` into ``out``: a preallocated,
        contiguous tensor of the payload's exact shape (see ``payload.payload_shape``) and the
        server cache's dtype, in host memory, or in GPU memory when ``device_payloads``. Or a
        list of contiguous host tensors of that dtype whose concatenation is the payload
        (e.g. the runs of the receiver's own KV blocks, ``payload.block_views``): the payload
        lands in them directly. ``out`` is untouched on an error answer; on a failure
        mid-transfer its contents are undefined. A pinned host ``out`` counts as host staging
        for a GPU cache in ``stats``.

        The returned future's ``quiet`` event is set once the transport can no longer write
        into ``out``: cancelling the future only asks (``cancel_and_wait``).

        GPU ``out``: the transport writes it outside any CUDA stream, so it must not be in use
        by queued GPU work (allocate it under a stream nothing else runs on, e.g.
        ``kv_connector.pull.alloc_out``); its bytes are in place when the future is done."""
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        if not outs or any(not t.is_contiguous() or t.device.type not in ("cpu", "cuda")
                           for t in outs):
            raise ValueError("out must be a contiguous CPU or CUDA tensor, or a non-empty "
                             "list of contiguous CPU tensors")
        if len(outs) > 1 and any(t.device.type != "cpu" or t.dtype != outs[0].dtype
                                 for t in outs):
            raise ValueError("a list out must be CPU tensors of one dtype")
        staged: str | None = None
        if outs[0].device.type == "cuda":
            # Without the transport, only a mapped server's reads land in GPU memory (else
            # the read fails with not_mapped, sending nothing).
            if not self.device_payloads and self._ipc_offer is None:
                raise ValueError(f"out is on {outs[0].device}, but this client cannot receive "
                                 f"into GPU memory ({self.device_support[1]}): pass pinned "
                                 f"host memory")
        elif outs[0].is_pinned():  # host memory standing in for a GPU cache
            staged = "" if self.device_payloads else self.device_support[1]
            staged = staged or "the caller chose host memory"
        parse_address(address)  # a malformed address is the caller's bug: raise here
        views = [as_payload(t) for t in outs]  # views: the payload lands in `out` itself
        nbytes = sum(int(v.nbytes) for v in views)
        msg = request.to_wire(dtype_name(outs[0].dtype), nbytes)
        if self.integrity:
            msg["integrity"] = INTEGRITY_ALGORITHM
        # Message transport: one message per part. A scattered table (more than one run of
        # block ids: the server gathers) is cut into parts, so the server sends part k while
        # it gathers part k+1; a consecutive one goes whole (one message per buffer). A
        # streaming read does not know the table: cut (a part inside one run costs no gather).
        streaming = request.wait_s is not None
        if not self.backend.stream_payloads and outs[0].device.type == "cpu":
            # (a pass over the ids in Python: only where a payload may be cut)
            split = self.runs and (streaming or len(consecutive_runs(request.block_ids)) > 1)
            if split or len(views) > 1:
                cuts = (split_parts([int(v.nbytes) for v in views]) if split
                        else [(i, 0, int(v.nbytes)) for i, v in enumerate(views)])
                views = [views[i][a:b] for i, a, b in cuts]
                msg["parts"] = [b - a for _, a, b in cuts]
        # A streaming read waits on the server (wait_s) before its answer, on a connection
        # of its own request (lane: the lease id), so that it holds up no other request.
        lane = request.lease_id if streaming else ""
        mapped_out = (_MappedOut(outs[0], request)
                      if len(outs) == 1 and self._ipc_offer is not None else None)
        return self._submit_read(self._read(address, msg, views, len(request.block_ids),
                                            staged, lane, mapped_out),
                                 extra_s=request.wait_s or 0.0)

    def cancel_and_wait(self, fut: ReadFuture, timeout_s: float) -> bool:
        """Cancel a read and wait until the transport has stopped writing into its ``out``
        (True), or ``timeout_s`` passed (False: ``out`` may still be written). Any thread
        but the client's loop."""
        fut.cancel()
        return fut.quiet.wait(timeout_s)

    def release(self, address: str, lease_id: str, reader_id: str | int) -> cf.Future[bool]:
        """Confirm that reader ``reader_id`` has its data; True when that released the lease."""
        parse_address(address)
        msg = {"op": "RELEASE", "lease_id": lease_id, "reader_id": str(reader_id)}
        return self._submit(self._release(address, msg))

    def ping(self, address: str) -> cf.Future[dict[str, Any]]:
        """The server's ``{ok, server_id, backend}`` (server_id changes when it restarts)."""
        parse_address(address)
        return self._submit(self._request(address, {"op": "PING"}))

    def close(self, timeout_s: float = 10.0) -> None:
        """Close every connection and stop the loop; pending requests fail. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            loop.run(self._close_all(), timeout_s)
        except Exception as e:
            logger.warning("kv transfer client close: %r", e)
        finally:
            self.backend.release_loop(loop)

    def __enter__(self) -> KVTransferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals (loop thread) ----------------------------------------------------------

    def _submit(self, coro: Any, read: bool = False) -> cf.Future[Any]:
        loop = self._loop
        if self._closed or loop is None:
            coro.close()
            fut: cf.Future[Any] = cf.Future()
            fut.set_exception(TransferError(CLOSED, "client is closed"))
            return fut
        return loop.submit(self._bounded(coro, read))

    def _submit_read(self, coro: Any, extra_s: float = 0.0) -> ReadFuture:
        """Like ``_submit``, with a ``ReadFuture`` whose ``quiet`` is set when the read's
        task has ended (or was cancelled before it started): only then has its I/O into
        the caller's memory stopped (a cancel of the future alone only asks the loop).
        ``extra_s``: added to the timeout (a streaming read's wait on the server)."""
        fut = ReadFuture()
        lt = self._loop
        if self._closed or lt is None:
            coro.close()
            fut.quiet.set()
            fut.set_exception(TransferError(CLOSED, "client is closed"))
            return fut
        loop = lt.loop

        def finished(task: asyncio.Task[Any]) -> None:
            self._reads.discard(task)
            fut.quiet.set()  # first: whoever sees the outcome sees quiet too
            with contextlib.suppress(cf.InvalidStateError):  # the caller cancelled
                if task.cancelled():
                    fut.cancel()
                elif task.exception() is not None:
                    fut.set_exception(task.exception())
                else:
                    fut.set_result(task.result())

        def cancel_task(task: asyncio.Task[Any]) -> None:
            if fut.cancelled():
                with contextlib.suppress(RuntimeError):  # the loop is closed: task is over
                    loop.call_soon_threadsafe(task.cancel)

        def start() -> None:  # on the loop
            if fut.cancelled() or self._closed:  # it never touches `out`
                coro.close()
                fut.quiet.set()
                with contextlib.suppress(cf.InvalidStateError):  # (cancelled)
                    fut.set_exception(TransferError(CLOSED, "client is closed"))
                return
            task = loop.create_task(self._bounded(coro, True, extra_s))
            self._reads.add(task)
            task.add_done_callback(finished)
            fut.add_done_callback(lambda _f: cancel_task(task))

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop is closed
            coro.close()
            fut.quiet.set()
            fut.set_exception(TransferError(CLOSED, "client is closed"))
        return fut

    async def _bounded(self, coro: Any, read: bool, extra_s: float = 0.0) -> Any:
        limit = self.timeout_s + extra_s
        try:
            return await bounded(coro, limit)
        except asyncio.TimeoutError:
            if read:  # failed transfers count reads only (as _read does)
                self.stats.record_failure(TIMEOUT)
            raise TransferError(TIMEOUT, f"no complete answer within {limit:g}s") from None
        except asyncio.CancelledError:
            if self._closed:
                raise TransferError(CLOSED, "client closed") from None
            raise

    async def _read(self, address: str, msg: dict[str, Any], views: list[Any],
                    num_blocks: int, staged: str | None, lane: str = "",
                    mapped_out: _MappedOut | None = None) -> ReadResult:
        t0 = time.perf_counter()
        try:
            resp = await self._request(address, msg, payload=views, lane=lane,
                                       mapped_out=mapped_out)
        except TransferError as e:
            self.stats.record_failure(e.code)
            raise
        dt = time.perf_counter() - t0  # a streaming read's includes its wait on the server
        answered = resp.get("num_blocks")  # a streaming read learns its table's size here
        if isinstance(answered, int) and not isinstance(answered, bool) and answered >= 0:
            num_blocks = answered
        zero_copy = bool(resp.get("zero_copy", False))
        into_device = not isinstance(views[0], np.ndarray)
        server_staging = resp.get("staging")
        reason = str(server_staging) if server_staging else (staged or "")
        nbytes = int(msg["nbytes"])
        mapped = resp.get("mapped") is True  # (_exchange_on lets it through a mapped read only)
        self.stats.record_transfer(nbytes, num_blocks, dt, zero_copy,
                                   device_direct=into_device, staging_reason=staged,
                                   mapped=mapped)
        first = resp.get("first")
        return ReadResult(nbytes, num_blocks, dt, zero_copy,
                          device_direct=into_device and resp.get("device") is True,
                          staging_reason=reason, first=first if isinstance(first, dict) else None,
                          mapped=mapped)

    async def _release(self, address: str, msg: dict[str, Any]) -> bool:
        resp = await self._request(address, msg)
        return bool(resp.get("released", False))

    async def _close_all(self) -> None:
        reads = list(self._reads)  # each ends as CLOSED (``_bounded``), its quiet set
        for task in reads:
            task.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        self._maps.clear()
        pools = list(self._peers.values())
        self._peers.clear()
        for pool in pools:  # the connections in use are closed by their requests (_put_back)
            await self._close_idle(pool)
        await asyncio.gather(*self._closing, return_exceptions=True)

    @staticmethod
    async def _close_idle(pool: _PeerPool) -> None:
        if pool.prune_timer is not None:
            pool.prune_timer.cancel()
            pool.prune_timer = None
        links, pool.idle = pool.idle, []
        pool.live -= len(links)
        pool.slots -= len(links)
        for link in links:
            await link.conn.close()

    @staticmethod
    async def _retire(pool: _PeerPool, link: _Link, keep_slot: bool = False) -> None:
        """Close a connection of ``pool`` (broken, or the client is closing). Its slot goes to
        the first waiter or is given up; ``keep_slot``: the caller opens another in it."""
        pool.live -= 1
        if not keep_slot:
            pool.hand_on(None)
            await link.conn.close()
            return
        try:
            await link.conn.close()
        except BaseException:
            pool.hand_on(None)
            raise

    async def _put_back(self, pool: _PeerPool, link: _Link) -> None:
        """A request ended and left its connection in a known state: it serves the next one."""
        if self._closed or link.conn.closed:
            await self._retire(pool, link)
            return
        pool.hand_on(link)
        if len(pool.idle) > 1 and pool.prune_timer is None:
            pool.prune_timer = asyncio.get_running_loop().call_later(
                POOL_IDLE_CLOSE_S, self._prune, pool)

    def _prune(self, pool: _PeerPool) -> None:
        """Close the pool's connections idle for ``POOL_IDLE_CLOSE_S``, but the last used
        (loop thread, a timer)."""
        pool.prune_timer = None
        if self._closed:
            return
        now = time.monotonic()
        keep, stale = pool.idle[-1:], []
        for link in pool.idle[:-1]:
            (stale if now - link.idle_since >= POOL_IDLE_CLOSE_S else keep).append(link)
        pool.idle = keep[1:] + keep[:1]  # the last used stays last
        pool.live -= len(stale)
        pool.slots -= len(stale)
        loop = asyncio.get_running_loop()
        for link in stale:
            task = loop.create_task(link.conn.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        if len(pool.idle) > 1:
            pool.prune_timer = loop.call_later(POOL_IDLE_CLOSE_S, self._prune, pool)

    async def _acquire(self, address: str, pool: _PeerPool, slot_held: bool = False
                       ) -> tuple[_Link, bool]:
        """A connection of ``pool`` for one request, and whether it served one before: an
        idle one, else a new one while fewer than the cap are open, else the first that comes
        free (in order). ``slot_held``: the caller holds a slot already (open in it). Raises
        ``TransferError`` (the connect or the handshake failed)."""
        slot = slot_held
        try:
            while True:
                while not slot and pool.idle:
                    link = pool.idle.pop()
                    if not link.conn.closed:
                        return link, True
                    pool.live -= 1  # closed while idle (a UCX endpoint that went): its slot
                    slot = True  # is this request's
                    await link.conn.close()
                if (not slot and pool.slots < pool.cap
                        and (pool.slots == 0 or time.monotonic() >= pool.hold_until)):
                    pool.slots += 1
                    slot = True
                if not slot:
                    got = await pool.wait()
                    if got is not None:
                        return got, True
                    slot = True  # one closed: its slot was handed to this request
                try:
                    conn, session, ipc = await self._open(address)
                except TransferError as e:
                    if e.code != CONNECTION_FAILED or pool.slots == 1:
                        raise  # (the slot goes to the next waiter: it tries for itself)
                    # The server takes no more of our connections (its cap per host, say)
                    # while others are open or opening: wait for one of those (only they wake
                    # this request: no retry loop) and open no other for a while.
                    logger.info("kv transfer: %s took no connection beyond %d (%s); waiting "
                                "for one of those", address, pool.slots - 1, e)
                    pool.slots -= 1
                    slot = False
                    pool.hold_until = time.monotonic() + REFUSED_HOLD_S
                    continue
                pool.live += 1
                return _Link(conn, session, ipc=ipc), False
        except BaseException:
            if slot:
                pool.hand_on(None)
            raise

    async def _open(self, address: str
                    ) -> tuple[Connection, ClientSession, dict[str, Any] | None]:
        """Connect and run the handshake (base.py): the connection, its session and the
        server's cache handle if it offered one; raises ``TransferError``."""
        host, port = parse_address(address)
        try:
            conn = await self.backend.connect(host, port, self.connect_timeout_s)
        except ConnectionClosedError as e:
            raise TransferError(CONNECTION_FAILED, str(e)) from None
        session = ClientSession(self._token)
        ok = False
        try:
            ipc = await asyncio.wait_for(self._handshake(address, conn, session),
                                         self.connect_timeout_s)
            ok = True
            return conn, session, ipc
        except asyncio.TimeoutError:
            raise TransferError(TIMEOUT, f"no handshake with {address} within "
                                f"{self.connect_timeout_s}s") from None
        except ConnectionClosedError as e:
            raise TransferError(CONNECTION_FAILED, f"handshake with {address}: {e}") from None
        except ProtocolError as e:
            raise TransferError(PROTOCOL_ERROR, f"handshake with {address}: {e}") from None
        finally:
            if not ok:
                await conn.close()

    async def _handshake(self, address: str, conn: Connection, session: ClientSession
                         ) -> dict[str, Any] | None:
        """HELLO and AUTH; the server's cache handle if it offered one (``cuda_ipc.py``)."""
        await conn.send_header(session.hello())
        answer = await conn.recv_header(PREAUTH_HEADER_MAX_BYTES)
        _raise_if_error(answer)
        try:
            session.accept(answer)  # before anything else goes to this peer
        except HandshakeError as e:
            raise TransferError(e.code, f"{address}: {e.message}") from None
        if session.backend != self.backend.name:
            raise TransferError(PROTOCOL_ERROR, f"{address} serves KV over "
                                f"{session.backend}, this client speaks {self.backend.name}")
        auth = {"op": "AUTH", **conn.attach_offer()}
        if self._ipc_offer is not None:
            auth["ipc"] = self._ipc_offer
        await conn.send_header(session.sign(auth))
        answer = await conn.recv_header()
        _raise_if_error(answer)
        await conn.attach_complete(answer)
        if "ipc_declined" in answer:
            logger.debug("kv transfer: %s reads move their bytes (no mapped cache): %s",
                         address, answer["ipc_declined"])
        ipc = answer.get("ipc")
        return ipc if isinstance(ipc, dict) else None

    async def _request(
        self, address: str, msg: dict[str, Any], payload: list[Any] | None = None,
        lane: str = "", mapped_out: _MappedOut | None = None,
    ) -> dict[str, Any]:
        """Send ``msg`` on a connection of the peer's pool (``_acquire``), read the answer and
        then, for an ok READ, the payload into ``payload`` (its views, in order; one per part
        over a message transport). ``lane`` (a streaming read's lease id) picks a pool of
        one connection of its own, closed when no request of that lane is left."""
        key = (address, lane)
        pool = self._peers.get(key)
        if pool is None:
            pool = self._peers[key] = _PeerPool(1 if lane else self.max_connections_per_peer)
        pool.users += 1
        try:
            return await self._exchange(address, pool, msg, payload, mapped_out)
        finally:
            pool.users -= 1
            if lane and pool.users == 0:
                if self._peers.get(key) is pool:
                    del self._peers[key]
                await self._close_idle(pool)

    async def _exchange(
        self, address: str, pool: _PeerPool, msg: dict[str, Any], payload: Any,
        mapped_out: _MappedOut | None = None,
    ) -> dict[str, Any]:
        link, reused = await self._acquire(address, pool)
        for attempt in range(2):
            try:
                resp = await self._exchange_on(address, link, msg, payload, mapped_out)
            except ConnectionClosedError as e:  # before the answer
                if reused and attempt == 0:
                    # A stale idle connection (the peer restarted or dropped it): the requests
                    # are idempotent, so retry once on a fresh connection, in the same slot.
                    logger.info("kv transfer: reconnecting to %s (%s)", address, e)
                    await self._retire(pool, link, keep_slot=True)
                    link, reused = await self._acquire(address, pool, slot_held=True)
                    continue
                await self._retire(pool, link)
                raise TransferError(CONNECTION_FAILED, str(e)) from None
            except TransferError as e:
                # A well-formed error answer leaves the connection usable, except
                # unauthorized: the server hangs up then.
                if e.remote and e.code != UNAUTHORIZED:
                    await self._put_back(pool, link)
                else:
                    await self._retire(pool, link)
                raise
            except BaseException:
                # A timeout or cancel mid-exchange leaves the stream in an unknown state.
                await self._retire(pool, link)
                raise
            await self._put_back(pool, link)
            return resp
        raise AssertionError("unreachable")

    async def _exchange_on(self, address: str, link: _Link, msg: dict[str, Any],
                           payload: Any, mapped_out: _MappedOut | None = None
                           ) -> dict[str, Any]:
        """One request on ``link`` (a READ with ``mapped_out``: mapped where the server offered
        it and the mapping is usable for that ``out``). Raises ``ConnectionClosedError`` when
        the connection failed before the answer (nothing of it read), else
        ``TransferError``."""
        conn, session = link.conn, link.session
        if payload is not None and mapped_out is not None:
            out = mapped_out.out
            cache = None
            if link.ipc is not None and session.server_id is not None:
                cache = await self._maps.get(address, session.server_id, link.ipc, out)
            if cache is not None:
                return await self._exchange_mapped(address, link, msg, cache, mapped_out)
            if out.device.type == "cuda" and not self.device_payloads:
                raise TransferError(NOT_MAPPED, f"out is on {out.device} and "
                                    f"{address}'s cache is not mapped here (another host, or "
                                    f"it could not be mapped: see the log and "
                                    f"mapped_fallbacks); {self.device_support[1]}")
        resp = await _ask(conn, session, msg)
        if payload is not None:
            if resp.get("nbytes") != msg["nbytes"]:
                raise TransferError(PROTOCOL_ERROR, f"server announced {resp.get('nbytes')} "
                                    f"bytes, expected {msg['nbytes']}")
            if "mapped" in resp:  # it waits for a DONE, we for a payload: neither comes
                raise TransferError(PROTOCOL_ERROR, "a mapped answer to a READ that was not")
            checked = resp.get("integrity")
            if msg.get("integrity") != checked:
                raise TransferError(PROTOCOL_ERROR, f"asked for integrity "
                                    f"{msg.get('integrity')!r}, the answer says {checked!r}")
            try:
                await conn.recv_payload_iov(payload)
                trailer = await conn.recv_header() if checked else None
            except ConnectionClosedError as e:
                raise TransferError(CONNECTION_FAILED,
                                    f"peer failed mid-transfer: {e}") from None
            except ProtocolError as e:
                raise TransferError(PROTOCOL_ERROR, str(e)) from None
            if trailer is not None:
                await _verify(address, trailer, payload)
        return resp

    async def _exchange_mapped(self, address: str, link: _Link, msg: dict[str, Any],
                               cache: torch.Tensor, mapped_out: _MappedOut) -> dict[str, Any]:
        """A mapped READ (``cuda_ipc.py``): the server validates and pins, we gather from its
        mapped ``cache`` into ``mapped_out.out`` and say DONE, which ends its pin. A server
        that aborted the read (``within_lease``) closed the connection before it unpinned: a
        connection found closed after the gather (or the DONE that cannot be sent) fails the
        read, as ``UcxConnection.recv_payload_iov`` fails a payload whose connection closed
        meanwhile (the blocks' reuse, an unpin, a free, a new prefill's writes, takes far
        longer than the close takes to arrive here)."""
        conn, session = link.conn, link.session
        wire = {k: v for k, v in msg.items() if k != "parts"}  # no payload, no parts
        wire["mapped"] = True
        resp = await _ask(conn, session, wire)
        if resp.get("nbytes") != msg["nbytes"] or resp.get("mapped") is not True:
            raise TransferError(PROTOCOL_ERROR, f"bad answer to a mapped READ: nbytes "
                                f"{resp.get('nbytes')} (expected {msg['nbytes']}), mapped "
                                f"{resp.get('mapped')!r}")
        try:
            req = answered_request(mapped_out.request, resp, cache)
        except (ValueError, TransferError) as e:
            raise TransferError(PROTOCOL_ERROR, f"bad answer to a mapped READ: {e}") from None
        try:
            await self._maps.gather(cache, req, mapped_out.out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a CUDA error: this peer's reads move bytes from now
            why = f"gather failed: {type(e).__name__}: {e}"
            self._maps.failed(address, cache, why)
            logger.exception("kv transfer: mapped read from %s failed", address)
            raise TransferError(PROTOCOL_ERROR, why) from None
        if conn.peer_closed():
            raise _aborted(address)
        try:
            done = {"op": "DONE", "lease_id": msg["lease_id"]}
            await conn.send_encoded(encode_signed(*session.sign_canonical(done)))
        except ConnectionClosedError:
            raise _aborted(address) from None
        return resp


async def _ask(conn: Connection, session: ClientSession, msg: dict[str, Any]
               ) -> dict[str, Any]:
    """Send ``msg`` signed for this connection and read the answer's header; an error answer
    raises its ``TransferError``, a connection that closed first ``ConnectionClosedError``."""
    try:
        await conn.send_encoded(encode_signed(*session.sign_canonical(msg)))
        resp = await conn.recv_header()
    except ProtocolError as e:
        raise TransferError(PROTOCOL_ERROR, str(e)) from None
    if not resp.get("ok"):
        _raise_if_error(resp)
    return resp


async def _verify(address: str, trailer: Mapping[str, Any], payload: list[Any]) -> None:
    """Raise ``INTEGRITY_ERROR`` unless the bytes that landed in ``payload`` have the
    checksum the server sent after them (computed off the loop thread: a pass over the
    payload)."""
    sent = trailer.get("checksum")
    if not isinstance(sent, str):
        raise TransferError(PROTOCOL_ERROR, "the payload's trailer has no checksum")
    got = await asyncio.get_running_loop().run_in_executor(None, payload_checksum, payload)
    if got != sent:
        raise TransferError(INTEGRITY_ERROR, f"the KV payload from {address} does not match "
                            f"its checksum ({INTEGRITY_ALGORITHM} {got} != {sent}): "
                            f"corrupted in transit or on arrival; nothing of it is used")


def _aborted(address: str) -> TransferError:
    return TransferError(CONNECTION_FAILED, f"{address} aborted the mapped read (the "
                         "connection closed before it confirmed the read): its blocks may "
                         "have been reused under the gather")


def _raise_if_error(resp: Mapping[str, Any]) -> None:
    """Raise the server's error answer as a ``TransferError`` (remote)."""
    if resp.get("ok") is True:
        return
    code = resp.get("code")
    if code not in SERVER_CODES:
        raise TransferError(PROTOCOL_ERROR, f"bad answer {resp!r}")
    raise TransferError(code, str(resp.get("message", "")), remote=True)
