"""The network-namespace lab of tests/netns.py: hosts reach each other (IPv4 and IPv6) and the
test process reaches them, a cut link drops traffic until restored, and nothing is left behind
(namespaces, the root link, processes), also after a failure inside the ``with``."""

from __future__ import annotations

import subprocess
import sys
import time
from ipaddress import ip_address

import pytest
from netns import NetLab, _ip, require_netns, sweep_leftovers

from disagg import procs

pytestmark = pytest.mark.slow


def _connects(host_argv: list[str], addr: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(({addr!r}, {port}), timeout=1).close()"
    return subprocess.run(host_argv + [sys.executable, "-c", code], capture_output=True,
                          timeout=20).returncode == 0


def _namespaces() -> str:
    return _ip("netns", "list").stdout


def _wait_http(url: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while procs.http_status(url) != 200:
        assert time.monotonic() < deadline, f"{url} did not answer"
        time.sleep(0.05)


def test_fixture_gives_an_open_lab(netlab: NetLab) -> None:
    host = netlab.add_host("solo")
    assert netlab.subnet is not None and netlab.root_addr is not None
    assert host.ns in _namespaces() and host.argv(["true"])[:4] == ["ip", "netns", "exec",
                                                                   host.ns]


def test_hosts_talk_cut_restore_and_teardown(tmp_path) -> None:
    require_netns()
    with NetLab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        assert lab.subnet is not None
        assert {ip_address(a.addr), ip_address(b.addr)} <= set(lab.subnet.hosts())
        server = lab.spawn(b, [sys.executable, "-m", "http.server", "--bind", "::", "8000"],
                           tmp_path / "b.log", cwd=tmp_path)
        _wait_http(b.url(8000) + "/")  # from the root namespace, over the root link
        assert _connects(a.argv([]), b.addr, 8000)
        assert _connects(a.argv([]), b.addr6, 8000)
        # b's own loopback is its own: nothing listens on a's.
        assert not _connects(a.argv([]), "127.0.0.1", 8000)
        lab.cut(b)
        assert not _connects(a.argv([]), b.addr, 8000)
        lab.restore(b)
        assert _connects(a.argv([]), b.addr, 8000)
        names = [a.ns, b.ns, lab.switch_ns]
        assert all(n in _namespaces() for n in names)
    assert server.returncode is not None  # stopped and reaped
    assert not any(n in _namespaces() for n in names)
    assert _ip("link", "show", lab.root_link_name, check=False).returncode != 0


def test_teardown_after_failure_and_leftover_sweep() -> None:
    require_netns()
    with pytest.raises(RuntimeError, match="boom"), NetLab() as lab:
        lab.add_host("x")
        raise RuntimeError("boom")
    assert lab.switch_ns not in _namespaces()
    # A namespace of a run whose process is gone (pid 2**22 + 1 is above pid_max) is swept.
    stale = "disagg-4194305-switch"
    _ip("netns", "add", stale)
    try:
        assert stale in sweep_leftovers()
    finally:
        _ip("netns", "del", stale, check=False)
    assert stale not in _namespaces()
