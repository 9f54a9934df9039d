"""A private L2 network of "hosts" built from Linux network namespaces, for multi-host tests.

Picture (one test run, process id P, private subnet 10.213.X.0/24)::

    root namespace (the test process)          switch namespace "disagg-P-switch"
      dgPr  10.213.X.1/24  <-- veth -->  up0 ─┐
                                              ├── br0 (a Linux bridge: the "switch")
    host namespace "disagg-P-router"          │
      eth0  10.213.X.10/24 <-- veth -->  h0  ─┤
    host namespace "disagg-P-gen"             │
      eth0  10.213.X.11/24 <-- veth -->  h1  ─┘

- Every host is its own network namespace with its own loopback and one ``eth0`` plugged into
  the bridge; processes started with ``host.argv(cmd)`` (``ip netns exec``) see only that.
- The bridge lives in its own "switch" namespace, so the root namespace's interfaces and
  routes are never touched, except for one veth (``root_link=True``, the default) that gives
  the test process itself an address on the private /24: pytest talks HTTP to the hosts
  directly. The /24 is one of 10.213.0.0/16 that no route of the root namespace covers.
- ``cut(host)`` takes the switch side of the host's veth down (the cable is pulled: the host's
  packets go nowhere, no RST, open connections just stop), ``restore(host)`` plugs it back.
- Names carry the test process id (``disagg-<pid>-...`` namespaces, ``dg<pid>r`` for the one
  root-namespace link, at most 15 characters), so concurrent runs never collide; ``NetLab``
  first sweeps leftovers of its own prefix whose process is gone (a run that was SIGKILLed),
  and its ``close`` deletes every namespace and link it made and stops every process it started
  in them, even when the test failed.

Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2; ``require_netns()`` skips the test with
the reason otherwise. API (kept stable: other tests import it)::

    with NetLab() as lab:                      # or the ``netlab`` pytest fixture
        a = lab.add_host("router")             # Host(name, ns, addr, ...)
        proc = lab.spawn(a, ["python", "-m", "http.server", "--bind", a.addr, "8000"],
                         tmp_path / "a.log")   # reaped by lab.close()
        subprocess.run(a.argv(["ping", "-c1", b.addr]))
        lab.cut(a); lab.restore(a)
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from disagg import procs

PREFIX = "disagg-"  # namespace names: disagg-<pid>-<host>
ROOT_LINK_PREFIX = "dg"  # the root-namespace link: dg<pid>r (<= 15 characters)
SUPERNET = ipaddress.ip_network("10.213.0.0/16")  # the /24s are chosen from here
ROOT_HOST_INDEX = 1  # the test process's own address: .1
FIRST_HOST_INDEX = 10  # hosts: .10, .11, ...
CMD_TIMEOUT_S = 20.0  # one `ip` command
_LOCK_PATH = "/tmp/disagg-netns.lock"  # serialises subnet choice between concurrent runs
_HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


class NetnsError(RuntimeError):
    """An `ip` command failed (the message has its command line and stderr)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and cp.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {cp.stderr.strip() or cp.returncode}")
    return cp


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2 is not installed)"
    if os.geteuid() != 0:
        return "not root: `ip netns add` needs CAP_SYS_ADMIN"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        cp = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {e}"
    if cp.returncode != 0:
        return f"`ip netns add` not permitted: {cp.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    """Skip the calling test (with the reason) where network namespaces cannot be made."""
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> list[str]:
    """Delete namespaces and root links of this module's prefix whose process is gone (a run
    that was killed before its teardown). Returns what was deleted."""
    gone: list[str] = []
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"^{PREFIX}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(rf"^\d+: ({ROOT_LINK_PREFIX}(\d+)r)[@:]", line)
        if m and not _pid_alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)
            gone.append(m.group(1))
    return gone


_ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "anycast", "unreachable",
                "prohibit", "blackhole", "throw", "nat"}


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """Destinations of every IPv4 route of the root namespace, all tables."""
    nets = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        words = line.split()
        if words and words[0] in _ROUTE_TYPES:
            words = words[1:]  # "local 127.0.0.0/8 dev lo ...": the type comes first
        if not words or words[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(words[0], strict=False))
    return nets


def free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of ``SUPERNET`` that no root-namespace route overlaps (a default route
    does not count: a more specific connected route wins over it)."""
    routed = _routed_networks()
    for net in SUPERNET.subnets(new_prefix=24):
        if not any(net.overlaps(r) for r in routed):
            return net
    raise NetnsError(f"every /24 of {SUPERNET} is routed in the root namespace")


@dataclass(frozen=True)
class Host:
    """One "machine": a namespace ``ns`` with ``eth0`` at ``addr`` (IPv4) and ``addr6`` (an
    IPv6 ULA, reachable from the other hosts; not from the root namespace)."""

    name: str
    ns: str
    addr: str
    addr6: str
    switch_port: str  # its veth's name in the switch namespace

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this host (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def url(self, port: int, scheme: str = "http") -> str:
        return f"{scheme}://{self.addr}:{port}"


@dataclass
class NetLab:
    """A private network of hosts; a context manager (``close`` on exit, always)."""

    root_link: bool = True  # give the test process an address on the subnet
    pid: int = field(default_factory=os.getpid)
    hosts: dict[str, Host] = field(default_factory=dict)
    subnet: ipaddress.IPv4Network | None = None
    root_addr: str | None = None  # the test process's address on the subnet
    _namespaces: list[str] = field(default_factory=list)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _closed: bool = False

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}{self.pid}-switch"

    @property
    def root_link_name(self) -> str:
        return f"{ROOT_LINK_PREFIX}{self.pid}r"

    def __enter__(self) -> NetLab:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Sweep leftovers, make the switch (and the root link), pick the subnet."""
        sweep_leftovers()
        self._add_ns(self.switch_ns)
        _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch_ns, "link", "set", "br0", "up")
        # The lock makes "pick a free /24, then route it" atomic between concurrent runs: the
        # root link's connected route is what the next run's scan sees.
        with open(_LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = free_subnet()
            if self.root_link:
                self._add_root_link()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _address(self, index: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + index)

    def _add_root_link(self) -> None:
        link = self.root_link_name
        _ip("link", "add", link, "type", "veth", "peer", "name", "up0", "netns", self.switch_ns)
        _ip("-n", self.switch_ns, "link", "set", "up0", "master", "br0", "up")
        self.root_addr = self._address(ROOT_HOST_INDEX)
        assert self.subnet is not None
        _ip("addr", "add", f"{self.root_addr}/{self.subnet.prefixlen}", "dev", link)
        _ip("link", "set", link, "up")

    def add_host(self, name: str) -> Host:
        """A new host ``name`` (lowercase letters, digits, '-'): its namespace, loopback up,
        ``eth0`` on the switch with the next address."""
        if not _HOST_NAME.match(name) or name == "switch" or name in self.hosts:
            raise ValueError(f"bad or duplicate host name {name!r}")
        assert self.subnet is not None, "NetLab not open"
        index = FIRST_HOST_INDEX + len(self.hosts)  # .10, .11, ... (< .254: at most 244 hosts)
        if index > 254:
            raise NetnsError("the /24 is full")
        ns, port = f"{PREFIX}{self.pid}-{name}", f"h{len(self.hosts)}"
        self._add_ns(ns)
        _ip("-n", self.switch_ns, "link", "add", port, "type", "veth",
            "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch_ns, "link", "set", port, "master", "br0", "up")
        addr = self._address(index)
        third = self.subnet.network_address.packed[2]
        addr6 = f"fd42:213:{third:x}::{index:x}"
        _ip("-n", ns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "-6", "addr", "add", f"{addr6}/64", "dev", "eth0", "nodad")
        _ip("-n", ns, "link", "set", "eth0", "up")
        host = Host(name=name, ns=ns, addr=addr, addr6=addr6, switch_port=port)
        self.hosts[name] = host
        return host

    def spawn(self, host: Host, cmd: Sequence[str], log_path: str | Path, *,
              env: Mapping[str, str] | None = None, cwd: str | Path | None = None
              ) -> subprocess.Popen[bytes]:
        """``procs.spawn`` of ``cmd`` inside ``host``; stopped and reaped by ``close``."""
        proc = procs.spawn(host.argv(cmd), log_path, env=env, cwd=cwd, header=True,
                           die_with_parent=True)
        self._procs.append(proc)
        return proc

    def cut(self, host: Host) -> None:
        """Pull the host's cable: its switch port goes down (packets to and from it are
        dropped; nothing tells the endpoints)."""
        _ip("-n", self.switch_ns, "link", "set", host.switch_port, "down")

    def restore(self, host: Host) -> None:
        """Plug the cable back in."""
        _ip("-n", self.switch_ns, "link", "set", host.switch_port, "up")

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every process started here, delete every namespace and link made here.
        Idempotent; runs every step even when one fails."""
        if self._closed:
            return
        self._closed = True
        procs.stop_all(self._procs, grace_s=grace_s)
        for ns in reversed(self._namespaces):
            self._kill_stragglers(ns)
            _ip("netns", "del", ns, check=False)
        # Deleting the switch namespace deletes the root link's peer and so the link; this is
        # for the case where it was made but the switch was not.
        if _ip("link", "show", self.root_link_name, check=False).returncode == 0:
            _ip("link", "del", self.root_link_name, check=False)

    def _kill_stragglers(self, ns: str) -> None:
        """SIGKILL what still runs in ``ns`` (grandchildren of processes this lab started):
        a namespace with processes in it outlives ``ip netns del``."""
        cp = _ip("netns", "pids", ns, check=False)
        for word in cp.stdout.split():
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                os.kill(int(word), 9)


@pytest.fixture
def netlab() -> Iterator[NetLab]:
    """A fresh ``NetLab`` for one test (skips where namespaces are not permitted)."""
    require_netns()
    with NetLab() as lab:
        yield lab


@pytest.fixture(scope="module")
def module_netlab() -> Iterator[NetLab]:
    """One ``NetLab`` shared by a module's tests (a cluster started once)."""
    require_netns()
    with NetLab() as lab:
        yield lab
