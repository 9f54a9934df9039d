"""Helpers for the server tests: a live uvicorn server in a thread, free ports, polling, and
requests signed with the cluster token (as the router sends them)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from disagg import procs
from disagg.procs import free_port as free_port
from disagg.procs import health_ok as health_ok


def device_for_ranks(world_size: int) -> str:
    """The device for test workers of up to ``world_size`` ranks: CUDA when there is a GPU
    per rank (NCCL), else the CPU (gloo), so multi-rank tests also run on a one-GPU machine.
    Every worker a test compares gets the same device: float32 CPU and GPU kernels may round
    a near-tie differently."""
    import torch

    return "cuda" if torch.cuda.device_count() >= world_size else "cpu"


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02,
             what: str = "condition") -> Any:
    """Poll ``cond`` until truthy (its value is returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def serve_in_thread(app: Any, timeout: float = 30.0, send_buffer: int | None = None
                    ) -> Iterator[str]:
    """Run ``app`` with uvicorn (lifespan on) on an ephemeral port; yields its base URL.
    ``send_buffer``: SO_SNDBUF of its connections (set on the listening socket, which they
    inherit), fixed instead of grown by the kernel."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="test-uvicorn")
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout, what="server start")
        if not server.started:
            raise RuntimeError("the server failed to start (see the log)")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        assert not thread.is_alive(), "server thread did not stop"


class Listener:
    """A TCP port that accepts connections and counts them, never answering (forged KV
    addresses point here: a test asserts that nothing connected). ``hold``: keep each
    connection open until ``close()`` (the peer waits for an answer that never comes);
    otherwise close it at once."""

    def __init__(self, hold: bool = True, backlog: int = 16) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(backlog)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.hold = hold
        self._accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True, name="test-listener")
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.connections += 1
            if self.hold:
                self._accepted.append(conn)
            else:
                conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)
        for c in self._accepted:
            c.close()


def raw_exchange(port: int, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` to 127.0.0.1:``port`` and leave the socket open: what arrives until the
    server closes it (``<still open>`` appended when ``wait`` seconds pass in silence), and
    the seconds that took."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(wait)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<still open>"
        except ConnectionResetError:
            pass
    return out, time.monotonic() - t0


@contextlib.contextmanager
def reference_server(model_dir: str, name: str = "tiny") -> Iterator[str]:
    """An aggregated worker served in this process (16-token blocks, a 4096-token KV cache):
    the outputs a disaggregated request must match. Yields its base URL."""
    from disagg.engine import AsyncLLM
    from disagg.server.app import ServerSettings, build_app

    engine = AsyncLLM.from_options(model_dir, tokens_per_block=16, kv_cache_tokens=4096,
                                   max_model_len=512, max_num_tokens=256, max_batch_size=32)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=name))
    with serve_in_thread(app) as url:
        yield url


def signed(token: str, method: str, path: str, body: Any = None,
           headers: dict[str, str] | None = None, *, to: str | None = None,
           audience: str | None = None) -> dict[str, Any]:
    """httpx keyword arguments for a request signed with the cluster ``token`` (as the router
    signs its calls) for the member at base URL ``to`` (its member id read from its /health)
    or the member id ``audience``: ``path`` with its query, ``body`` a JSON value sent as
    exactly the bytes signed. ``httpx.post(url + path, **signed(TOKEN, "POST", path, body,
    to=url))``."""
    from disagg.cluster_auth import member_id_of, sign_http

    if audience is None:
        if to is None:
            raise ValueError("signed(): name the receiver (to=<base url> or audience=<id>)")
        try:
            audience = member_id_of(to)
        except ValueError:  # a worker without a cluster token names none: nothing checks
            audience = "no-member-id"
    data = b"" if body is None else json.dumps(body).encode()
    h = {**(headers or {}), **sign_http(token, method, path, data, audience=audience)}
    if body is not None:
        h["Content-Type"] = "application/json"
    return {"content": data, "headers": h} if body is not None else {"headers": h}


def signed_post(url: str, path: str, body: Any, token: str, timeout: float = 60.0
                ) -> httpx.Response:
    """POST ``body`` to ``url + path`` signed with the cluster ``token``."""
    return httpx.post(url + path, timeout=timeout, **signed(token, "POST", path, body, to=url))


# ---- a stand-in engine ---------------------------------------------------------------------------


class StoppedEngine:
    """An ``EngineClient`` (disagg/engine/client.py) whose loop never runs: unhealthy, every
    request refused, counters unreadable; an aggregated worker (no KV connector). Tests
    subclass it for what they vary. ``config``: the ``EngineConfig`` the server reads (None
    for code that never reads it, e.g. the metrics alone)."""

    transfer = None
    fatal_error = None

    def __init__(self, config: Any = None) -> None:
        from disagg.kv_cache.events import KVEventLog

        self.config = config
        self.tokenizer: Any = None
        self.worker_id = "stopped-engine"
        self.kv_events = KVEventLog()
        self.role_drain_now: Any = None
        self.rank_pids = [os.getpid()]

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def close(self) -> None:
        pass

    def is_healthy(self) -> bool:
        return False

    def stats(self) -> Any:
        raise RuntimeError("the engine is not running")

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any,
                       prompt: str | None = None, mode: Any = None, prefix: Any = None
                       ) -> AsyncIterator[Any]:
        from disagg.engine.errors import EngineDeadError

        raise EngineDeadError("the engine is not running")
        yield  # (an async generator, as AsyncLLM.generate)

    async def abort(self, request_id: str) -> None:
        pass

    def release_lease(self, lease_id: str) -> bool:
        return False

    async def lease_prefix(self, token_ids: list[int]) -> Any:
        from disagg.engine.errors import EngineDeadError

        raise EngineDeadError("the engine is not running")

    def release_remote(self, lease: Any) -> None:
        pass

    def switch_role(self, role: Any) -> Any:
        raise ValueError("role: an aggregated worker cannot switch role")


def protocol_gaps(obj: Any, protocol: type) -> list[str]:
    """What ``obj`` lacks of ``protocol`` (a ``typing.Protocol``): attributes, properties and
    methods by name, methods whose parameters differ by name, and async-ness. Empty: ``obj``
    implements it."""
    import inspect

    gaps = []
    names = {n for n in vars(protocol) if not n.startswith("_")}
    names |= set(getattr(protocol, "__annotations__", {}))
    for name in sorted(names):
        if not hasattr(obj, name):
            gaps.append(f"{name}: missing")
            continue
        want = inspect.getattr_static(protocol, name, None)
        if not inspect.isfunction(want):
            continue  # an attribute or a property: present is enough
        have = getattr(obj, name)
        want_params = list(inspect.signature(want).parameters)[1:]  # (self)
        have_params = list(inspect.signature(have).parameters)
        if want_params != have_params:
            gaps.append(f"{name}: parameters {have_params}, not {want_params}")
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(have):
            gaps.append(f"{name}: async-ness differs")
    return gaps


# ---- worker subprocesses (`disagg serve ...`) -------------------------------------------------


@dataclass
class WorkerProc:
    """A ``disagg serve`` subprocess writing to its own log file."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    port: int
    cluster_token: str | None = None  # /server_info needs its signature

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def info(self) -> dict[str, Any]:
        kw = (signed(self.cluster_token, "GET", "/server_info", to=self.url)
              if self.cluster_token else {})
        r = httpx.get(self.url + "/server_info", timeout=10, **kw)
        r.raise_for_status()
        return r.json()

    def blocks_used(self) -> int:
        return int(self.info()["kv_blocks_used"])

    def wait_blocks(self, n: int = 0, timeout: float = 15.0) -> None:
        # Well under the default 30 s lease: blocks must be freed by a release, not expiry.
        wait_for(lambda: self.blocks_used() == n, timeout, 0.05,
                 what=f"{self.name}: kv_blocks_used == {n}")


def start_worker_proc(tmp: Path, model_dir: str, name: str, args: list[str],
                      env: dict[str, str], port: int | None = None,
                      cpus: set[int] | None = None) -> WorkerProc:
    """``disagg serve MODEL --port P ARGS`` with ``env`` added to the environment, one torch
    thread, its output in ``tmp/NAME-xxxxxx.log``; ``cpus``: pinned to those cores."""
    port = port or free_port()
    log = tmp / f"{name}-{uuid.uuid4().hex[:6]}.log"
    # In the test's process group (as a plain Popen): a Ctrl-C of pytest reaches it too.
    proc = procs.spawn([sys.executable, "-m", "disagg.cli", "serve", model_dir, "--port",
                        str(port), *args], log, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                       new_session=False, cpus=cpus)
    return WorkerProc(name, f"http://127.0.0.1:{port}", proc, log, port,
                      env.get("DISAGG_CLUSTER_TOKEN"))


def wait_all_healthy(workers: list[WorkerProc], timeout: float) -> None:
    """Each worker healthy within ``timeout``; else stop them all and raise with its log."""
    for w in workers:
        try:
            procs.wait_healthy(w.url, timeout, proc=w.proc, what=w.name)
        except procs.NotHealthy as e:
            stop_all(workers)
            raise RuntimeError(f"{e}:\n{procs.log_tail(w.log, 40)}") from None


def stop_all(workers: list[WorkerProc]) -> None:
    """SIGTERM every worker (they drain), then reap; SIGKILL what does not exit."""
    procs.stop_all([w.proc for w in workers], grace_s=30.0, kill_wait_s=10.0)
