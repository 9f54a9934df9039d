"""UCX backend over ``ucxx`` (``pip install disagg[ucx]``: ucxx-cu12), imported lazily.

Headers travel on a TCP connection to the server's ``host:port`` (``tcp.tcp_listen``: bound
where configured, capped and authenticated like the TCP backend); payloads are UCX tag messages
between the two processes' UCX workers, over endpoints created from worker addresses that the
two sides exchange in AUTH (base.py), i.e. only after the client has proven the cluster token.
There is no UCX listener: ucxx 0.52 can only create one on every interface
(``UCXListener.create(worker, port, ...)`` has no address; the C++ ``ListenerBuilder::host``
is not exposed to Python).

UCX's own transport sockets (the tcp transport listens on an ephemeral port of every network
device UCX uses, in both processes) serve peers that know the worker's address, which the two
sides exchange only in AUTH; confine them with ``UCX_NET_DEVICES`` / ``UCX_TCP_PORT_RANGE``
(an operator's environment wins, see below). Both directions must be reachable between a
context and a generation worker on those ports: each side creates its endpoint to the other.

Settings (measured in UCX-NOTES.md):

=============  =================================================
profile        environment
=============  =================================================
same_host      UCX_TLS=sm,tcp UCX_MM_ERROR_HANDLING=y (~6 GB/s)
cross_host     UCX_TLS=tcp UCX_RNDV_SCHEME=put_zcopy (~3 GB/s)
auto           cross_host when the worker's advertised KV address is not
               loopback (its peers may be on other hosts), else same_host
always         UCX_WARN_UNUSED_ENV_VARS=n (else UCX prints a WARN to stdout)
with CUDA      UCX_TLS += cuda_copy,cuda_ipc (same_host) / cuda_copy (cross_host)
with RDMA      UCX_TLS += rc,ud (cross_host, where /sys/class/infiniband has a
               device: InfiniBand / RoCE; never measured here, no such NIC)
=============  =================================================

The transports UCX actually runs (``tl/device`` pairs of its context, e.g. ``tcp/eth0``) are
logged when the context starts and shown in the worker's ``/server_info``
(``kv_transfer.ucx``). Which of them one connection's endpoint selected (its lanes, and the
protocol per message size) is ``endpoint_report`` (``ucp_ep_print_info``, through ctypes:
ucxx does not expose it), read by ``disagg doctor`` (``linkcheck.py``).

GPU memory ("device-direct"): in a process that has a CUDA device, the profile's ``UCX_TLS`` also
names UCX's CUDA transports: ``cuda_ipc`` (a process maps the other's GPU memory: GPU to GPU on
one host, one device-to-device copy) and ``cuda_copy`` (moves between host and GPU memory where
no GPU path exists). ucxx accepts objects exposing ``__cuda_array_interface__`` (a torch CUDA
uint8 tensor) when its context has CUDA support, i.e. UCX reports the CUDA memory type and
``UCX_TLS`` names a ``cuda`` transport (``ucxx::Context::hasCudaSupport``), and raises
otherwise. That flag is not enough on its own: libucx wheels always carry the CUDA modules and
report the memory type even where no CUDA transport could start (no driver), so support is
also checked in the context's resource list (``cuda_copy/...``). When it holds, the server sends
from its GPU cache (or a GPU staging buffer) and the client receives into GPU memory; when it
does not (``device_memory_support()`` says why: no CUDA device in the process, UCX without
CUDA, ``UCX_TLS`` without cuda, or ``DISAGG_KV_DEVICE_DIRECT=0``), payloads of a GPU cache are
staged in pinned host memory as with TCP.

- ``UCX_MEMTYPE_CACHE``: ucxx sets it to ``n`` at import (UCX's memory-type cache hooks
  cudaMalloc and misses memory from other allocators): every buffer's type is asked from the
  driver (``cuPointerGetAttributes``, ~1 us per message).
- UCX does the CUDA work on ucxx's progress thread, which needs a current CUDA context: ucxx
  makes one there with ``cuda.core`` on device 0; the backend makes it torch's current device
  instead (no cuda-core needed, the right GPU for rank r).
- ``cuda_ipc`` maps memory allocated with ``cudaMalloc`` (torch's caching allocator); memory
  from ``expandable_segments`` (``cuMemCreate`` without a shareable handle) cannot be mapped and
  UCX then falls back to a pipeline through host memory (slower, still correct).

Progress mode: ``thread`` with Python futures, not the ``blocking`` mode UCX-NOTES measured:
see ``PROGRESS_MODE``.

Values already in the environment win (an operator may set ``UCX_NET_DEVICES`` etc.). UCX reads
them when its context is created, so they are applied before the first ``ucxx.init``.

One UCX context per process (``init`` twice raises), so every server and client of a process
shares one runtime: one worker (progressed by ucxx's thread) and one asyncio loop thread,
refcounted; the last user resets UCX, the next one starts it again. Create it only **after**
any fork (spawn rank processes): a child forked from a process with a live context cannot
connect.

Known limits (ucxx 0.52 / UCX 1.21):
- A payload is one tag message received into a buffer of the announced size; ucxx does not
  report the received length, so the server always sends exactly the announced bytes.
- Same-host bandwidth uses a fragmented shared-memory pipeline that needs both processes on a
  core at the same time: on an oversubscribed host it varies widely and can drop far below
  the TCP backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

from disagg.env import KV_DEVICE_DIRECT, UCX_TLS
from disagg.transfer.base import (
    HEADER_MAX_BYTES,
    Connection,
    ConnectionClosedError,
    ConnectionHandler,
    Listener,
    LoopThread,
    ProtocolError,
    TransportBackend,
)
from disagg.transfer.tcp import TcpConnection, tcp_connect, tcp_listen

logger = logging.getLogger("disagg.transfer")

UCX_PROFILES: dict[str, dict[str, str]] = {
    "same_host": {"UCX_TLS": "sm,tcp", "UCX_MM_ERROR_HANDLING": "y"},
    "cross_host": {"UCX_TLS": "tcp", "UCX_RNDV_SCHEME": "put_zcopy"},
}
UCX_ALWAYS_ENV = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
# The CUDA transports added to a profile's UCX_TLS in a process with a CUDA device.
UCX_CUDA_TLS: dict[str, str] = {"same_host": "cuda_copy,cuda_ipc", "cross_host": "cuda_copy"}
# RDMA transports added to cross_host's UCX_TLS where the host has an RDMA device (UCX uses the
# ones that start; naming them where absent would only cost a failed probe, but it is skipped).
UCX_RDMA_TLS = "rc,ud"
RDMA_CLASS_DIR = "/sys/class/infiniband"
# "0" (or no/false/off): never hand GPU memory to UCX; a GPU cache stages in pinned host memory.
DEVICE_DIRECT_ENV = KV_DEVICE_DIRECT.name
# Progress: ucxx's C++ progress thread (epoll, wakes every ms) + Python futures completed by
# its notifier thread. Not 'blocking' / 'polling': there every pending request is awaited by
# polling the event loop (`await asyncio.sleep(0)` until done), and a server always has a
# receive posted per connection, so both processes burned a full core each while idle
# (measured here: 1.0 s CPU per second per process after the first transfer; thread mode:
# ~0.01 s), and on 2 cores that halved memcpy and engine throughput. Bandwidth is the same
# (5-7 GB/s for 64-128 MiB between two processes).
PROGRESS_MODE = "thread"


def resolve_ucx_profile(profile: str | None, kv_host: str | None) -> tuple[str, str]:
    """A concrete profile for ``profile`` (``auto`` / None: judged by the worker's advertised
    KV address ``kv_host``) and why, for the log line."""
    from disagg.addresses import is_loopback

    if profile not in (None, "auto"):
        return profile, "configured"  # type: ignore[return-value]
    if kv_host is None:
        return "same_host", "auto: no KV address to judge by"
    if is_loopback(kv_host):
        return "same_host", f"auto: the KV address {kv_host} is loopback (peers on this host)"
    return "cross_host", f"auto: the KV address {kv_host} is not loopback (peers may be on " \
                         f"other hosts)"


def has_rdma_device(class_dir: str = RDMA_CLASS_DIR) -> bool:
    try:
        return bool(os.listdir(class_dir))
    except OSError:
        return False


def configure_ucx_env(profile: str = "same_host", cuda: bool = False,
                      rdma: bool | None = None) -> dict[str, str]:
    """Put the profile's UCX variables in ``os.environ`` unless already set; returns what is in
    effect. ``cuda``: add the profile's CUDA transports to ``UCX_TLS``; ``rdma`` (None: whether
    the host has an RDMA device): add ``rc,ud`` to cross_host's. Call before ucxx creates its
    context (``UcxBackend`` does it for you)."""
    if profile not in UCX_PROFILES:
        raise ValueError(f"ucx profile must be one of {sorted(UCX_PROFILES)}, got {profile!r}")
    env = {**UCX_PROFILES[profile], **UCX_ALWAYS_ENV}
    if profile == "cross_host" and (has_rdma_device() if rdma is None else rdma):
        env["UCX_TLS"] = f"{UCX_RDMA_TLS},{env['UCX_TLS']}"
    if cuda:
        env["UCX_TLS"] = f"{env['UCX_TLS']},{UCX_CUDA_TLS[profile]}"
    applied = {}
    for k, v in env.items():
        # UCX's own variables, read by libucx (not by us): a user's setting wins.
        applied[k] = os.environ.setdefault(k, v)
    return applied


def device_direct_wanted() -> tuple[bool, str]:
    """Whether this process should offer UCX its GPU memory: ``(True, "")``, or ``(False,
    why)``. Asked before the UCX context starts (it decides ``UCX_TLS``)."""
    if not KV_DEVICE_DIRECT.get():
        return False, f"{DEVICE_DIRECT_ENV}={KV_DEVICE_DIRECT.raw()} forces host staging"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device in this process"
    return True, ""


def context_transports(context_info: str) -> list[str]:
    """Every ``transport/device`` a UCX context runs, from its ``ucp_context_print_info`` text
    (``resource 0 : md 0 dev 0 flags -- tcp/eth0``), in UCX's order."""
    return list(dict.fromkeys(re.findall(r"resource\s+\d+\s*:.*?--\s*(\S+/\S+)",
                                         context_info)))


def cuda_transports(context_info: str) -> list[str]:
    """The CUDA transports a UCX context runs, from its ``ucp_context_print_info`` text
    (resource lines such as ``resource 5 : md 4 dev 3 flags -- cuda_copy/cuda``)."""
    return sorted(set(re.findall(r"\b(cuda_[a-z_]+)/", context_info)))


def _probe_device_support(ucxx: Any, wanted: bool, why: str) -> tuple[bool, str]:
    """After ``ucxx.init``: may payloads be CUDA memory? ``(ok, how or why not)``."""
    if not wanted:
        return False, why
    tls = UCX_TLS.get()
    try:
        ctx = ucxx.core._get_ctx().context
        flag, info = bool(ctx.cuda_support), str(ctx.info)
    except Exception as e:  # an API this ucxx lacks: stay on the host path
        return False, f"cannot query UCX's CUDA support: {type(e).__name__}: {e}"
    if not flag:
        return False, (f"UCX has no CUDA support (no CUDA memory type, or UCX_TLS={tls!r} "
                       f"names no cuda transport)")
    found = cuda_transports(info)
    if "cuda_copy" not in found:
        return False, (f"UCX started no CUDA transport (UCX_TLS={tls!r}; libucx without CUDA "
                       f"or no usable driver)")
    return True, "UCX " + ",".join(found)


def _bind_progress_thread_to_torch_device() -> None:
    """ucxx's progress thread makes a CUDA context current when it starts, with cuda.core on
    device 0 (``ucxx._cuda_context.ensure_cuda_context``, looked up at call time). Make it
    torch's current device of the calling thread instead: the rank's GPU, no cuda-core."""
    import torch
    import ucxx._cuda_context as cuda_context

    device = torch.cuda.current_device()

    def ensure_cuda_context(device_id: int = 0) -> None:
        torch.cuda.set_device(device)

    cuda_context.ensure_cuda_context = ensure_cuda_context


def ucx_available() -> tuple[bool, str]:
    """(True, version) if ucxx imports, else (False, why) — for skips and clear errors."""
    for k, v in UCX_ALWAYS_ENV.items():  # libucs reads them when it loads, i.e. at import
        os.environ.setdefault(k, v)
    try:
        import ucxx  # noqa: F401
    except Exception as e:  # ImportError, or a broken libucx (OSError)
        return False, f"ucxx cannot be imported: {type(e).__name__}: {e}"
    return True, str(getattr(ucxx, "__version__", "?"))


def _import_ucxx() -> Any:
    ok, why = ucx_available()
    if not ok:
        raise RuntimeError(f"the UCX KV-transfer backend needs ucxx (pip install "
                           f"'disagg[ucx]'): {why}")
    import ucxx

    return ucxx


class _UcxRuntime:
    """The process's single UCX context and the loop thread that progresses it."""

    _lock = threading.Lock()
    _users = 0
    _loop: LoopThread | None = None
    _profile: str | None = None
    device_support: tuple[bool, str] = (False, "UCX is not started")
    transports: tuple[str, ...] = ()  # the running context's transport/device pairs

    @classmethod
    def acquire(cls, profile: str) -> LoopThread:
        with cls._lock:
            if cls._loop is not None:
                if profile != cls._profile:
                    raise ValueError(f"UCX already runs with profile {cls._profile!r} in this "
                                     f"process; cannot also use {profile!r}")
                cls._users += 1
                return cls._loop
            wanted, why = device_direct_wanted()
            configure_ucx_env(profile, cuda=wanted)  # before ucxx reads the environment
            ucxx = _import_ucxx()
            if wanted:
                _bind_progress_thread_to_torch_device()
            loop = LoopThread("kv-transfer-ucx")

            async def _init() -> tuple[bool, str]:
                # Inside the loop: ucxx binds its progress and future notifier to the running
                # loop (a loop created outside would be a stray one).
                ucxx.init(progress_mode=PROGRESS_MODE, enable_python_future=True)
                with contextlib.suppress(Exception):  # an API this ucxx lacks: none listed
                    cls.transports = tuple(context_transports(
                        str(ucxx.core._get_ctx().context.info)))
                return _probe_device_support(ucxx, wanted, why)

            try:
                support = loop.run(_init(), timeout_s=30.0)
            except BaseException:
                loop.stop()
                with contextlib.suppress(Exception):
                    ucxx.reset()
                raise
            cls._loop, cls._profile, cls._users = loop, profile, 1
            cls.device_support = support
            logger.info("UCX started: profile %s, UCX_TLS=%s, transports %s", profile,
                        UCX_TLS.get(), ",".join(cls.transports) or "(not reported)")
            if wanted or support[0]:
                logger.info("UCX KV transfer (UCX_TLS=%s): %s", UCX_TLS.get(),
                            f"GPU memory moves directly ({support[1]})" if support[0]
                            else f"GPU payloads are staged in pinned host memory: {support[1]}")
            return loop

    @classmethod
    def release(cls, loop: LoopThread) -> None:
        with cls._lock:
            if loop is not cls._loop or cls._users <= 0:
                raise ValueError("release of a UCX loop that is not held")
            cls._users -= 1
            if cls._users:
                return
            cls._loop, cls._profile = None, None
            cls.device_support = (False, "UCX is not started")
            cls.transports = ()
            loop.stop()  # closing the loop cancels ucxx's progress tasks
            import ucxx

            try:
                ucxx.reset()
            except Exception as e:
                # Something (e.g. a caller's exception traceback) still references an endpoint:
                # that context lingers; the next acquire starts a fresh one.
                logger.warning("ucxx.reset() failed: %s", str(e).splitlines()[0])


def _closed_error(peer: str, e: BaseException) -> ConnectionClosedError:
    return ConnectionClosedError(f"{peer}: {type(e).__name__}: {e}")


_TAG_MASK = (1 << 64) - 1
_ABORT_PERIOD_NS = 2 * 10**9  # how long closing an endpoint may wait for ucxx's progress thread
MAX_WORKER_ADDRESS_BYTES = 3 << 10  # ~190 bytes with sm + tcp on one NIC; many NICs stay far below


def _worker_address_hex() -> str:
    import ucxx

    return bytes(ucxx.get_worker_address().tobytes()).hex()


async def _endpoint_to(address_hex: object) -> Any:
    """A ucxx endpoint to the worker whose packed address is ``address_hex``."""
    import ucxx

    if not isinstance(address_hex, str) or not 0 < len(address_hex) <= 2 * MAX_WORKER_ADDRESS_BYTES:
        raise ProtocolError("ucx_address must be a hex-encoded UCX worker address")
    try:
        raw = bytes.fromhex(address_hex)
    except ValueError:
        raise ProtocolError("ucx_address is not hex") from None
    try:
        address = ucxx.get_ucx_address_from_buffer(raw)
        return await ucxx.create_endpoint_from_worker_address(address)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise ProtocolError(f"cannot reach the peer's UCX worker: {type(e).__name__}: {e}") from e


class UcxConnection(Connection):
    """Headers on a TCP connection (``ctl``: the same bound, capped, authenticated door as the
    TCP backend), payloads as UCX tag messages between the two processes' workers.

    The endpoints are created from worker addresses exchanged in AUTH, i.e. only once the
    client has proven the token: an unauthenticated peer never costs a UCX endpoint or a
    posted receive. A payload travels as one tag message per part (the READ's ``parts``, one
    part when it has none); message ``n`` of a connection has tag ``(ucx_tag + n) mod 2**64``
    (``ucx_tag``: random, chosen by the client), so a message left over from a failed request
    can never match a later receive. While a payload is in flight the TCP connection is
    watched: the peer's process dying closes it, and the UCX operation is cancelled then (a
    receive into the caller's buffer never outlives the request)."""

    def __init__(self, ctl: TcpConnection) -> None:
        self._ctl = ctl
        self.peer = ctl.peer
        self._ep: Any = None
        self._tag_base: int | None = None
        self._payloads = 0  # payload messages (parts) sent / received so far here
        self._closed = False
        self._broken = False  # the endpoint was aborted: this connection is done

    @property
    def closed(self) -> bool:
        return (self._closed or self._broken or self._ctl.closed
                or (self._ep is not None and self._ep.closed))

    @property
    def peer_host(self) -> str:
        return self._ctl.peer_host

    def peer_closed(self) -> bool:
        return self.closed or self._ctl.peer_closed()

    async def send_header(self, obj: Mapping[str, Any]) -> None:
        await self._ctl.send_header(obj)

    async def send_encoded(self, data: bytes) -> None:
        await self._ctl.send_encoded(data)

    async def recv_header(self, max_bytes: int = HEADER_MAX_BYTES) -> dict[str, Any]:
        return await self._ctl.recv_header(max_bytes)

    # ---- set-up (AUTH) --------------------------------------------------------------------

    def attach_offer(self) -> dict[str, Any]:
        self._tag_base = secrets.randbits(64)
        return {"ucx_address": _worker_address_hex(), "ucx_tag": self._tag_base}

    async def attach_accept(self, offer: Mapping[str, Any]) -> dict[str, Any]:
        tag = offer.get("ucx_tag")
        if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= _TAG_MASK:
            raise ProtocolError("ucx_tag must be an int in [0, 2**64)")
        self._ep = await _endpoint_to(offer.get("ucx_address"))
        self._tag_base = tag
        return {"ucx_address": _worker_address_hex()}

    async def attach_complete(self, answer: Mapping[str, Any]) -> None:
        self._ep = await _endpoint_to(answer.get("ucx_address"))

    # ---- payloads -------------------------------------------------------------------------

    stream: ClassVar[bool] = False  # one tag message per payload part

    def _next_tags(self, count: int) -> list[int]:
        """Tags of the next ``count`` messages: ``ucx_tag + n, .., ucx_tag + n + count - 1``
        (mod 2**64), n = messages so far on this connection, the same count on both sides."""
        if self._ep is None or self._tag_base is None:
            raise ProtocolError(f"{self.peer}: no UCX endpoint (AUTH did not set one up)")
        first = self._tag_base + self._payloads
        self._payloads += count
        return [(first + j) & _TAG_MASK for j in range(count)]

    async def send_payload(self, data: Any) -> None:
        # numpy, or a CUDA uint8 tensor (ucxx reads its __cuda_array_interface__; UCX moves it
        # with cuda_ipc / cuda_copy). The caller has synchronised whatever wrote it.
        await self._io_start(lambda: [self._ep.send(data, tag=self._next_tags(1)[0],
                                                    force_tag=True)])

    async def recv_payload_into(self, out: Any) -> None:
        await self.recv_payload_iov([out])

    async def recv_payload_iov(self, views: Any) -> None:
        """One receive per view (part), all posted at once. Complete only while the server's
        TCP connection is still open: a server that aborted this read (its reader stalled
        past the lease, ``sender.within_lease``) closes it before it frees the blocks, yet a
        receive posted late may still complete, reading memory that may hold other KV by
        then (a rendezvous reads the sender's memory)."""
        def post() -> list[Any]:
            tags = self._next_tags(len(views))
            return [self._ep.recv(v, tag=t, force_tag=True) for v, t in zip(views, tags,
                                                                             strict=True)]
        if self._ctl.peer_closed():  # aborted before we posted (a reader that was stopped):
            self._abort()            # its sends were cancelled, our receives would wait
            raise ConnectionClosedError(f"{self.peer}: the server closed the connection "
                                        f"before the payload (it aborted the read)")
        await self._io_start(post)
        if self._ctl.peer_closed():
            self._abort()
            raise ConnectionClosedError(f"{self.peer}: the server closed the connection while "
                                        f"the payload arrived (it aborted the read)")

    async def send_payload_parts(self, parts: Any, count: int) -> None:
        """Post each part's send as soon as it is produced: the next part is gathered while
        this one is on the wire."""
        if self.closed:
            raise ConnectionClosedError(f"{self.peer}: connection closed")
        tags = self._next_tags(count)
        ops: list[asyncio.Future[Any]] = []
        try:
            async for p in parts:
                if len(ops) == count:
                    raise ProtocolError(f"more than the {count} payload parts announced")
                if self._ep is None:  # aborted meanwhile
                    raise ConnectionClosedError(f"{self.peer}: connection closed")
                ops.append(asyncio.ensure_future(self._ep.send(p, tag=tags[len(ops)],
                                                               force_tag=True)))
            if len(ops) != count:
                raise ProtocolError(f"{len(ops)} payload parts produced, {count} announced")
        except BaseException:
            self._abort()
            await asyncio.gather(*ops, return_exceptions=True)
            raise
        await self._io(ops)

    async def _io_start(self, post: Any) -> None:
        if self.closed:
            raise ConnectionClosedError(f"{self.peer}: connection closed")
        await self._io([asyncio.ensure_future(c) for c in post()])

    async def _io(self, ops: list[asyncio.Future[Any]]) -> None:
        """Wait for UCX operations until all complete or the peer's TCP connection closes."""
        watch = self._ctl.watch_peer_close()
        try:
            pending = set(ops)
            while pending:
                done, pending = await asyncio.wait({*pending, watch},
                                                   return_when=asyncio.FIRST_COMPLETED)
                pending.discard(watch)
                if any(o is not watch and (o.cancelled() or o.exception() is not None)
                       for o in done):
                    break  # one failed: the rest are aborted below
                if watch.done() and pending:
                    if watch.result():  # the peer's process is gone: these never complete
                        raise ConnectionClosedError(f"{self.peer}: connection closed by peer")
                    # Bytes arrived (the peer is alive): wait for the ops alone.
                    await asyncio.wait(pending)
                    pending = set()
        except BaseException:
            # Cancelled (client timeout), or the peer died: cancel the UCX requests now, so no
            # late write lands in the caller's buffers.
            self._abort()
            self._ctl.stop_watching()
            await asyncio.gather(*ops, return_exceptions=True)
            raise
        self._ctl.stop_watching()
        failed = next((o for o in ops if o.done() and (o.cancelled()
                                                       or o.exception() is not None)), None)
        if failed is None:
            return
        self._abort()  # the others would wait for a peer that gave up
        await asyncio.gather(*ops, return_exceptions=True)
        if failed.cancelled():
            raise ConnectionClosedError(f"{self.peer}: UCX operation cancelled")
        e = failed.exception()
        raise _closed_error(self.peer, e) from e  # ucxx: canceled, reset, truncated, ...

    def _abort(self) -> None:
        self._broken = True
        ep, self._ep = self._ep, None
        if ep is not None:
            try:
                ep.abort(period=_ABORT_PERIOD_NS)
            except Exception as e:
                logger.debug("ucx endpoint abort: %s", e)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._abort()
        await self._ctl.close()


class UcxBackend(TransportBackend):
    name: ClassVar[str] = "ucx"
    stream_payloads: ClassVar[bool] = False

    def __init__(self, profile: str = "same_host") -> None:
        if profile not in UCX_PROFILES:
            raise ValueError(f"ucx profile must be one of {sorted(UCX_PROFILES)}, "
                             f"got {profile!r}")
        self.profile = profile

    def acquire_loop(self, role: str) -> LoopThread:
        return _UcxRuntime.acquire(self.profile)

    def release_loop(self, loop_thread: LoopThread) -> None:
        _UcxRuntime.release(loop_thread)

    def device_memory_support(self) -> tuple[bool, str]:
        return _UcxRuntime.device_support

    def describe(self) -> dict[str, Any]:
        """The profile, the UCX_TLS in effect and the transports the context runs (empty until
        this process first starts UCX), for ``/server_info``."""
        return {"profile": self.profile, "ucx_tls": UCX_TLS.get(),
                "transports": list(_UcxRuntime.transports)}

    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> Listener:
        # No UCX listener (ucxx 0.52 binds it on every interface): the TCP door bound to
        # `host`, UCX endpoints from worker addresses once a client has authenticated.
        return await tcp_listen(host, port, handler, UcxConnection)

    async def connect(self, host: str, port: int, timeout_s: float) -> Connection:
        return UcxConnection(await tcp_connect(host, port, timeout_s))


# ---- what an endpoint selected (disagg doctor) -----------------------------------------------


def _libucp() -> Any:
    """libucp, as ucxx loaded it (its soname first: the library already in this process)."""
    import ctypes

    try:
        return ctypes.CDLL("libucp.so.0")
    except OSError:
        import libucx  # the wheel's own copy (ucxx loads it from there)

        return ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib",
                                        "libucp.so.0"))


def endpoint_report(conn: Connection) -> str | None:
    """``ucp_ep_print_info`` of a ``UcxConnection``'s endpoint: the lanes (``transport/device``)
    UCX selected for this peer and the protocol of each message size, as UCX prints it. None
    when ``conn`` has no live endpoint or the call is unavailable (never raises)."""
    import ctypes
    import ctypes.util

    ep = getattr(conn, "_ep", None) if isinstance(conn, UcxConnection) else None
    if ep is None or ep.closed:
        return None
    try:
        handle = int(ep.ucp_endpoint)
        libucp = _libucp()
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p),
                                        ctypes.POINTER(ctypes.c_size_t)]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
        libucp.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        libucp.ucp_ep_print_info.restype = None
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if not stream:
            return None
        libucp.ucp_ep_print_info(ctypes.c_void_p(handle), ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))  # flushes: buf and size are final now
        try:
            return ctypes.string_at(buf, size.value).decode(errors="replace")
        finally:
            libc.free(ctypes.cast(buf, ctypes.c_void_p))
    except Exception as e:  # a UCX without the symbol, no libc: say nothing rather than fail
        logger.debug("ucp_ep_print_info unavailable: %s", e)
        return None


_LANE = re.compile(r"lane\[\d+\]:\s+\d+:(\S+?/\S+?)\.\d+\s")
_TAG_TABLE = re.compile(r"tagged message by ucp_tag_send\* from host memory")
_ROW = re.compile(r"^#\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*$")


def parse_endpoint_report(text: str) -> dict[str, Any]:
    """From ``endpoint_report``'s text: ``lanes`` (``transport/device`` of each lane, in lane
    order) and ``tag`` (the plain tag-send protocol per message size: ``[{"sizes", "protocol",
    "transport"}]``; a payload part is one such message)."""
    lanes = list(dict.fromkeys(_LANE.findall(text)))
    rows: list[dict[str, str]] = []
    in_table = False
    for line in text.splitlines():
        if _TAG_TABLE.search(line):
            in_table, rows = True, []
            continue
        if not in_table:
            continue
        m = _ROW.match(line)
        if m:
            rows.append({"sizes": m.group(1), "protocol": m.group(2).removeprefix("(?) "),
                         "transport": m.group(3)})
        elif rows and not line.strip("# +-"):
            break  # the table's end
    return {"lanes": lanes, "tag": rows}
