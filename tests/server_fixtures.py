"""Helpers for the server tests: a live uvicorn server in a thread, free ports, polling."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def serve_in_thread(app: Any, timeout: float = 30.0) -> Iterator[str]:
    """Run ``app`` with uvicorn (lifespan on) on an ephemeral port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def health_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
