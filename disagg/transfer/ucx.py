"""UCX backend over ``ucxx`` (``pip install disagg[ucx]``: ucxx-cu12), imported lazily.

Settings (measured in UCX-NOTES.md):

=============  =================================================
profile        environment
=============  =================================================
same_host      UCX_TLS=sm,tcp UCX_MM_ERROR_HANDLING=y (~6 GB/s)
cross_host     UCX_TLS=tcp UCX_RNDV_SCHEME=put_zcopy (~3 GB/s)
always         UCX_WARN_UNUSED_ENV_VARS=n (else UCX prints a WARN to stdout),
               UCX_TCP_CM_REUSEADDR=y (a restarted server rebinds its port at once)
=============  =================================================

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
- Once a server has closed an endpoint it accepted, ucxx keeps that listener alive: after
  ``KVTransferServer.stop()`` in a process that goes on running UCX, its port stays bound and
  connects to it go unanswered until the client's connect timeout. A restarted *process*
  rebinds the port at once (tested); a restart inside one process needs a new port.
- A payload is one tag message received into a buffer of the announced size; ucxx does not
  report the received length, so the server always sends exactly the announced bytes.
- Same-host bandwidth uses a fragmented shared-memory pipeline that needs both processes on a
  core at the same time: on an oversubscribed host it varies widely and can drop far below
  the TCP backend.
- A connect to a port where nothing listens fails only after ``connect_timeout_s`` (ucxx
  waits for the peer-info exchange), where TCP is refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from disagg.transfer.base import (
    HEADER_MAX_BYTES,
    HEADER_PREFIX_BYTES,
    Connection,
    ConnectionClosedError,
    ConnectionHandler,
    Listener,
    LoopThread,
    TransportBackend,
    decode_header,
    encode_header,
    header_length,
)

logger = logging.getLogger("disagg.transfer")

UCX_PROFILES: dict[str, dict[str, str]] = {
    "same_host": {"UCX_TLS": "sm,tcp", "UCX_MM_ERROR_HANDLING": "y"},
    "cross_host": {"UCX_TLS": "tcp", "UCX_RNDV_SCHEME": "put_zcopy"},
}
UCX_ALWAYS_ENV = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # A restarted server must take its port back while the old connections sit in TIME_WAIT.
    "UCX_TCP_CM_REUSEADDR": "y",
}
# Progress: ucxx's C++ progress thread (epoll, wakes every ms) + Python futures completed by
# its notifier thread. Not 'blocking' / 'polling': there every pending request is awaited by
# polling the event loop (`await asyncio.sleep(0)` until done), and a server always has a
# receive posted per connection, so both processes burned a full core each while idle
# (measured here: 1.0 s CPU per second per process after the first transfer; thread mode:
# ~0.01 s), and on 2 cores that halved memcpy and engine throughput. Bandwidth is the same
# (5-7 GB/s for 64-128 MiB between two processes).
PROGRESS_MODE = "thread"


def configure_ucx_env(profile: str = "same_host") -> dict[str, str]:
    """Put the profile's UCX variables in ``os.environ`` unless already set; returns what is in
    effect. Call before ucxx creates its context (``UcxBackend`` does it for you)."""
    if profile not in UCX_PROFILES:
        raise ValueError(f"ucx profile must be one of {sorted(UCX_PROFILES)}, got {profile!r}")
    applied = {}
    for k, v in {**UCX_PROFILES[profile], **UCX_ALWAYS_ENV}.items():
        os.environ.setdefault(k, v)
        applied[k] = os.environ[k]
    return applied


def ucx_available() -> tuple[bool, str]:
    """(True, version) if ucxx imports, else (False, why) — for skips and clear errors."""
    for k, v in UCX_ALWAYS_ENV.items():  # read when libucs loads, i.e. at import
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

    @classmethod
    def acquire(cls, profile: str) -> LoopThread:
        with cls._lock:
            if cls._loop is not None:
                if profile != cls._profile:
                    raise ValueError(f"UCX already runs with profile {cls._profile!r} in this "
                                     f"process; cannot also use {profile!r}")
                cls._users += 1
                return cls._loop
            configure_ucx_env(profile)  # before ucxx reads the environment
            ucxx = _import_ucxx()
            loop = LoopThread("kv-transfer-ucx")

            async def _init() -> None:
                # Inside the loop: ucxx binds its progress and future notifier to the running
                # loop (a loop created outside would be a stray one).
                ucxx.init(progress_mode=PROGRESS_MODE, enable_python_future=True)

            try:
                loop.run(_init(), timeout_s=30.0)
            except BaseException:
                loop.stop()
                with contextlib.suppress(Exception):
                    ucxx.reset()
                raise
            cls._loop, cls._profile, cls._users = loop, profile, 1
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


class UcxConnection(Connection):
    """Tag send/recv on one ucxx endpoint. A header is one message ``[len][json]`` received
    into a preallocated ``HEADER_MAX_BYTES`` buffer (UCX lets a message land in a larger
    buffer); a payload is one message of exactly the announced size."""

    def __init__(self, ep: Any, peer: str) -> None:
        self._ep = ep
        self.peer = peer
        self._closed = False
        self._hdr = np.empty(HEADER_MAX_BYTES, dtype=np.uint8)

    @property
    def closed(self) -> bool:
        return self._closed or self._ep.closed

    async def send_header(self, obj: Mapping[str, Any]) -> None:
        data = np.frombuffer(encode_header(obj), dtype=np.uint8)
        await self._io(self._ep.send(data))

    async def recv_header(self) -> dict[str, Any]:
        await self._io(self._ep.recv(self._hdr))
        n = header_length(self._hdr[:HEADER_PREFIX_BYTES])
        return decode_header(self._hdr[HEADER_PREFIX_BYTES:HEADER_PREFIX_BYTES + n].tobytes())

    async def send_payload(self, data: np.ndarray) -> None:
        await self._io(self._ep.send(data))

    async def recv_payload_into(self, out: np.ndarray) -> None:
        await self._io(self._ep.recv(out))

    async def _io(self, op: Any) -> None:
        if self.closed:
            op.close()
            raise ConnectionClosedError(f"{self.peer}: connection closed")
        try:
            await op
        except asyncio.CancelledError:
            raise
        except Exception as e:  # ucxx errors: canceled, connection reset, truncated, ...
            raise _closed_error(self.peer, e) from e

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._ep.close()
        except Exception as e:
            logger.debug("ucx endpoint close: %s", e)


class UcxListener(Listener):
    def __init__(self, listener: Any) -> None:
        self._listener = listener
        self._port = int(listener.port)

    @property
    def port(self) -> int:
        return self._port

    async def close(self) -> None:
        # Let ucxx's per-connection handler coroutines retire first (ours have closed their
        # endpoints by now); otherwise ucxx warns about a listener dying under live handlers.
        wait = getattr(self._listener, "_wait_for_active_clients", None)
        if wait is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(wait(), 2.0)
        self._listener.close()


class UcxBackend(TransportBackend):
    name: ClassVar[str] = "ucx"

    def __init__(self, profile: str = "same_host") -> None:
        if profile not in UCX_PROFILES:
            raise ValueError(f"ucx profile must be one of {sorted(UCX_PROFILES)}, "
                             f"got {profile!r}")
        self.profile = profile

    def acquire_loop(self, role: str) -> LoopThread:
        return _UcxRuntime.acquire(self.profile)

    def release_loop(self, loop_thread: LoopThread) -> None:
        _UcxRuntime.release(loop_thread)

    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> Listener:
        import ucxx

        async def on_endpoint(ep: Any) -> None:
            await handler(UcxConnection(ep, "ucx-peer"))

        # ucxx listens on every interface; `host` is only what the server advertises.
        return UcxListener(ucxx.create_listener(on_endpoint, port))

    async def connect(self, host: str, port: int, timeout_s: float) -> Connection:
        import ucxx

        loop = asyncio.get_running_loop()
        try:
            ip = (await loop.getaddrinfo(host, port, family=socket.AF_INET))[0][4][0]
            ep = await asyncio.wait_for(
                ucxx.create_endpoint(ip, port, connect_timeout=timeout_s), timeout_s + 1.0)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise _closed_error(f"{host}:{port}", e) from e
        return UcxConnection(ep, f"{host}:{port}")
