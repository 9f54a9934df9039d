"""disagg.procs: children start in their own group with their output in a log, /health waits
end when the child dies or the deadline passes, and stopping is SIGTERM, a grace period, then
SIGKILL to the whole group, bounded."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from disagg import procs

SLEEPER = "import time; print('up', flush=True); time.sleep(600)"
DEAF = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(600)")
# A child that starts a grandchild (its pid on the first line), then sleeps.
PARENT = ("import subprocess, sys, time; "
          "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
          "print(g.pid, flush=True); time.sleep(600)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _wait_line(log: Path, n: int = 1, timeout: float = 30.0) -> str:
    """The ``n``-th line of ``log`` once it is complete."""
    deadline = time.monotonic() + timeout
    while log.read_text().count("\n") < n:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)  # polling, bounded by the deadline
    return log.read_text().splitlines()[n - 1]


def test_free_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    ports = procs.free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)
    assert procs.port_free("127.0.0.1", ports[0])
    lo, hi = procs.ephemeral_range()
    if procs.listen_port_candidates():  # an outgoing connection can never take these
        assert all(procs.LISTEN_PORTS_FROM <= p and not lo <= p <= hi for p in ports), ports


def test_listen_port_candidates_leave_out_the_ephemeral_range(tmp_path: Path,
                                                               monkeypatch) -> None:
    f = tmp_path / "range"
    monkeypatch.setattr(procs, "EPHEMERAL_RANGE_FILE", f)
    f.write_text("32768\t60999\n")
    c = procs.listen_port_candidates()
    assert (c[0], c[-1], len(c)) == (20000, 65535, (32768 - 20000) + (65535 - 60999))
    assert 32767 in c and 32768 not in c and 60999 not in c and 61000 in c
    f.write_text("1024 65535\n")  # no room: free_ports falls back to the kernel's pick
    assert procs.listen_port_candidates() == []
    assert len(set(procs.free_ports(3))) == 3
    f.write_text("garbage")
    assert procs.ephemeral_range() == (32768, 60999)


def test_spawn_logs_with_header_in_its_own_group_and_stops_on_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    proc = procs.spawn([sys.executable, "-c", SLEEPER], log, header=True)
    try:
        assert _wait_line(log, 2) == "up"
        assert _wait_line(log, 1).startswith(f"$ {sys.executable} -c ")
        assert os.getpgid(proc.pid) == proc.pid  # its own session and group
        t0 = time.monotonic()
        assert procs.stop(proc, grace_s=10) == -signal.SIGTERM
        assert time.monotonic() - t0 < 10
    finally:
        procs.kill_group(proc)


def test_stop_kills_what_ignores_sigterm_and_its_group(tmp_path: Path) -> None:
    deaf = procs.spawn([sys.executable, "-c", DEAF], tmp_path / "deaf.log")
    parent = procs.spawn([sys.executable, "-c", PARENT], tmp_path / "parent.log")
    grandchild = int(_wait_line(tmp_path / "parent.log"))
    try:
        assert _wait_line(tmp_path / "deaf.log") == "up"
        t0 = time.monotonic()
        codes = procs.stop_all([deaf, parent], grace_s=1.0, kill_wait_s=5.0)
        assert codes == [-signal.SIGKILL, -signal.SIGTERM]
        assert 1.0 <= time.monotonic() - t0 < 6.0
        deadline = time.monotonic() + 10
        while _alive(grandchild):  # SIGKILLed with its group; reaped by init
            assert time.monotonic() < deadline, "the grandchild outlived the group kill"
            time.sleep(0.05)  # polling, bounded by the deadline
    finally:
        procs.kill_group(deaf)
        procs.kill_group(parent)
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_wait_healthy_ends_when_the_child_exits_or_the_deadline_passes(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{procs.free_port()}"  # nothing listens there
    dead = procs.spawn([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "d.log")
    with pytest.raises(procs.NotHealthy, match="worker exited with code 3"):
        procs.wait_healthy(url, 30, proc=dead, what="worker")
    t0 = time.monotonic()
    with pytest.raises(procs.NotHealthy, match="not healthy in 0.3 s"):
        procs.wait_healthy(url, 0.3, what="router")
    assert time.monotonic() - t0 < 5
    assert procs.http_status(url + "/health") is None and not procs.health_ok(url)
