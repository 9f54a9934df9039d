"""Child processes on this machine: start, find free ports, wait for /health, stop, reap.

``disagg launch``, ``disagg bench rate-match --verify``, the scripts under ``bench/`` and the
test fixtures all start ``disagg serve`` / ``disagg router`` children and wait for them; this
module is the one place that does it. The contract:

- ``spawn`` starts a child with stdin from /dev/null and stdout + stderr into a log file (the
  parent closes its copy at once: the child holds its own descriptor). By default the child
  gets its own session, so its process id is also its process group id: a terminal's Ctrl-C
  reaches only the parent, which stops its children in its own order, and ``kill_group``
  reaches whatever the child spawned (a worker's rank processes). ``die_with_parent`` asks
  Linux to send the child SIGTERM when the thread that started it ends (the parent crashed or
  was SIGKILLed): no orphaned workers. The child always starts with SIGINT and SIGTERM
  unblocked, so a parent may block them around ``spawn`` (no stop signal between fork and
  recording the child) without its children inheriting the mask.
- ``free_ports(n)`` gives ``n`` distinct ports that were free a moment ago (bound together,
  then released: another listener may still take one before the child binds it), drawn
  outside the kernel's ephemeral range (``ip_local_port_range``) where there is room: any
  outgoing connection, the child's own included, gets its local port from that range, so a
  port from it can be taken by a connection between this call and the child's bind;
  ``port_free`` says whether one given address can be bound now.
- ``http_status`` is one GET that never goes through a proxy from the environment (every
  child is local) and answers None instead of raising when nothing answers;
  ``wait_healthy`` polls ``/health`` until 200, raising ``NotHealthy`` when the child exits
  first or the deadline passes. Every wait here is bounded.
- Whose ``/health`` answered: a port free a moment ago can be taken by another process before
  the child binds it (the child then dies of "address in use" while the other answers). A
  child given a launch id (``with_launch_id``: ``$DISAGG_LAUNCH_ID``, fresh for every start)
  names it as ``launch_id`` in every ``/health`` answer (``disagg serve`` and ``disagg
  router`` do); ``child_health`` tells its answer from another process's. The id is no
  secret: it only says which process answered, and lets nobody call or sign anything.
- ``freeze_for_exit``: a process whose work is done (``disagg`` commands, the spawned ranks)
  skips the collector's last full passes over every object it holds.
- ``stop`` / ``stop_all``: SIGTERM (the child drains and exits), a grace period, then SIGKILL to
  the whole process group, then a wait of at most ``kill_wait_s`` (a SIGKILLed process is gone at
  once unless stuck in the kernel: such a one is left, and its exit code stays None).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import gc
import http.client
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from disagg.env import LAUNCH_ID

HEALTH_TIMEOUT_S = 2.0  # one /health request
KILL_WAIT_S = 5.0  # after SIGKILL
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
_PR_SET_PDEATHSIG = 1
# Local children only: never through an HTTP proxy from the environment.
LOCAL_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
LAUNCH_ID_ENV = LAUNCH_ID.name  # a child's launch id (module docstring)
LAUNCH_ID_FIELD = "launch_id"  # ... named in its GET /health


class NotHealthy(RuntimeError):
    """A child exited during start-up, or did not answer /health with 200 in time."""


# -- start --------------------------------------------------------------------------------------


def _preexec(die_with_parent: bool, cpus: frozenset[int] | None) -> Callable[[], None]:
    def run() -> None:  # in the child, between fork and exec: system calls only
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if die_with_parent:  # Linux only; harmless elsewhere
            with contextlib.suppress(Exception):
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if cpus is not None:  # before exec: every thread the child makes stays there
            os.sched_setaffinity(0, cpus)

    return run


def spawn(cmd: Sequence[str], log_path: str | Path | None, *,
          env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
          header: bool = False, new_session: bool = True,
          die_with_parent: bool = False, cpus: set[int] | None = None,
          append: bool = False) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with its output in ``log_path`` (created or truncated, or ``append``ed
    to: a restarted child's log keeps its earlier runs; ``header``: the command line first,
    as ``$ cmd``). ``env``: the child's whole environment (None: this one's); ``cpus``: pin
    the child to those cores; ``log_path`` None: the child writes where this process does.
    See the module docstring for the rest."""
    mode = "ab" if append else "wb"
    with (open(log_path, mode) if log_path is not None else contextlib.nullcontext()) as log:
        if header and log is not None:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
        need_preexec = die_with_parent or cpus is not None
        return subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT if log is not None else None,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env), cwd=cwd, start_new_session=new_session,
            preexec_fn=(_preexec(die_with_parent, None if cpus is None else frozenset(cpus))
                        if need_preexec else None))


# -- ports --------------------------------------------------------------------------------------


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_FROM = 20000  # below: ports that services commonly take (8000, 8080, 9090, ...)
FREE_PORT_TRIES = 256


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections, inclusive (Linux's default if unknown)."""
    try:
        lo, hi = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def listen_port_candidates() -> list[int]:
    """Ports to draw listening ports from: [LISTEN_PORTS_FROM, 65535] less the ephemeral
    range (empty when that range leaves no room)::

        20000 ........ lo-1 | lo .. ephemeral .. hi | hi+1 ........ 65535
        <- candidates ->                              <- candidates ->
    """
    lo, hi = ephemeral_range()
    return [p for p in range(LISTEN_PORTS_FROM, 65536) if not lo <= p <= hi]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports on ``host`` (held open together so that none repeats), out
    of the ephemeral range when it leaves room (module docstring), else any the kernel picks."""
    candidates = listen_port_candidates()
    socks: list[socket.socket] = []
    try:
        for _ in range(FREE_PORT_TRIES):
            if len(socks) == n or not candidates:
                break
            s = socket.socket()
            try:
                s.bind((host, candidates.pop(random.randrange(len(candidates)))))
            except OSError:  # taken (or in TIME_WAIT): try another
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def port_free(host: str, port: int) -> bool:
    """Can ``host:port`` be bound now? (A clear error beats a worker's bind traceback.)"""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return True  # the child will say what is wrong with the name
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # uvicorn sets SO_REUSEADDR too: TIME_WAIT leftovers do not count as in use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            return e.errno != errno.EADDRINUSE
    return True


# -- health -------------------------------------------------------------------------------------


def http_status(url: str, timeout: float = HEALTH_TIMEOUT_S) -> int | None:
    """HTTP status of GET ``url``, or None when nothing answers."""
    try:
        with LOCAL_HTTP.open(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):  # refused, reset, timeout
        return None


def health_ok(base_url: str) -> bool:
    return http_status(base_url + "/health") == 200


def new_launch_id() -> str:
    """A fresh launch id: 128 random bits as 32 hex digits."""
    return secrets.token_hex(16)


def with_launch_id(env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """``env`` plus a fresh launch id for one child start, and the id."""
    launch_id = new_launch_id()
    return {**env, LAUNCH_ID_ENV: launch_id}, launch_id


class ChildHealth(enum.Enum):
    """What a child's ``/health`` port says (``child_health``)."""

    OK = "ok"  # 200, naming the child's launch id
    STARTING = "starting"  # it names the id but is not ready (503: loading, no worker yet)
    OTHER = "other"  # an answer without the id: another process holds the port
    DOWN = "down"  # nothing answers


def health_answer(base_url: str, timeout: float = HEALTH_TIMEOUT_S
                  ) -> tuple[int | None, dict[str, Any] | None]:
    """GET ``base_url``/health: its status (None: nothing answers) and its JSON object
    (None: none)."""
    try:
        with LOCAL_HTTP.open(base_url + "/health", timeout=timeout) as resp:
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as e:  # 503 while starting or draining: the body still counts
        status = int(e.code)
        try:
            raw = e.read()
        except (OSError, http.client.HTTPException):
            raw = b""
    except (OSError, ValueError, http.client.HTTPException):  # refused, reset, timeout, cut
        return None, None
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    return status, body if isinstance(body, dict) else None


def child_health(base_url: str, launch_id: str | None, timeout: float = HEALTH_TIMEOUT_S
                 ) -> ChildHealth:
    """Whose answer ``base_url``/health is: the child started with ``launch_id`` (OK when
    200, else STARTING), another process's (OTHER), or nobody's (DOWN). ``launch_id`` None: any
    answer counts as the child's (one started without an id)."""
    status, body = health_answer(base_url, timeout)
    if status is None:
        return ChildHealth.DOWN
    if launch_id is not None and (body is None or body.get(LAUNCH_ID_FIELD) != launch_id):
        return ChildHealth.OTHER
    return ChildHealth.OK if status == 200 else ChildHealth.STARTING


def wait_healthy(base_url: str, timeout: float, *, proc: subprocess.Popen | None = None,
                 interval: float = 0.1, what: str = "the child",
                 launch_id: str | None = None) -> None:
    """Poll ``base_url``/health until it answers 200 (and, given the child's ``launch_id``,
    names it: another process's answer does not count). NotHealthy when ``proc`` (the child
    behind it, if given) exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    other = False
    while True:
        state = child_health(base_url, launch_id)
        if state is ChildHealth.OK:
            return
        other = other or state is ChildHealth.OTHER
        taken = f" ({base_url} answers /health as another process)" if other else ""
        if proc is not None and proc.poll() is not None:
            raise NotHealthy(f"{what} exited with code {proc.returncode}{taken}")
        if time.monotonic() > deadline:
            raise NotHealthy(f"{what} not healthy in {timeout:g} s{taken}")
        time.sleep(interval)  # start-up polling, bounded by the deadline


def log_tail(path: str | Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a child's log, for an error message."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))  # enough for the tail of any sane log
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(cannot read {path}: {e.strerror or e})"
    return "\n".join(text.splitlines()[-lines:])


# -- stop ---------------------------------------------------------------------------------------


def terminate(proc: subprocess.Popen) -> bool:
    """SIGTERM ``proc`` if it is still running; whether it was."""
    if proc.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    return True


def kill_group(proc: subprocess.Popen, kill_wait_s: float = KILL_WAIT_S) -> bool:
    """SIGKILL ``proc``'s process group (a child started in its own session: whatever it
    spawned too; otherwise ``proc`` alone) and reap it within ``kill_wait_s``; whether it was
    reaped. Called for an exited child as well: its group may outlive it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no such group: not a group leader
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    try:
        proc.wait(timeout=kill_wait_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float = 30.0,
             kill_wait_s: float = KILL_WAIT_S) -> list[int | None]:
    """SIGTERM every running one (in the order given), wait until all exit or ``grace_s``
    passes, SIGKILL each one's group and reap it. Returns the exit codes (None: not reaped,
    stuck in the kernel). Bounded: ``grace_s`` plus ``kill_wait_s`` per child at most."""
    for proc in procs:
        terminate(proc)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        kill_group(proc, kill_wait_s)
    return [proc.returncode for proc in procs]


def stop(proc: subprocess.Popen, grace_s: float = 30.0, kill_wait_s: float = KILL_WAIT_S
         ) -> int | None:
    """``stop_all`` for one child."""
    return stop_all([proc], grace_s, kill_wait_s)[0]


def freeze_for_exit() -> None:
    """Called as a process ends, its work done and its resources released: every object moves
    to the collector's permanent generation, so the interpreter's final collections skip them.
    A process that imported torch spends about 0.25 s of CPU at exit in those passes (2-core
    Xeon: a worker's SIGTERM-to-exit 0.6 s, 0.25 with this), paid by every worker and rank a
    cluster's stop or a test suite ends. Nothing waits for them: atexit hooks and
    ``weakref.finalize`` callbacks still run, logging still flushes, the operating system
    closes what is left; only ``__del__`` of objects in reference cycles may not run, which
    Python never promises at exit. Not for a process that goes on (a test calling ``main``):
    frozen objects are never collected."""
    gc.freeze()
