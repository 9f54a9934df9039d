"""Addresses a worker hands to peers on other hosts: its HTTP url (registered with the router)
and its KV transfer address (handed to generation workers).

A bound address is not always one a peer can use: ``0.0.0.0`` / ``::`` (a wildcard bind: every
interface) and ``127.0.0.1`` / ``::1`` (this host only) mean nothing on another machine. The
rules (``advertise_address``):

1. ``--advertise-host`` given: that (a name or an IP literal; never a wildcard, and a loopback
   one only when the router is on this host).
2. A specific bind address (``--host 10.0.0.5``): that; a loopback bind with a router on
   another host is an error (the router could never reach it).
3. A wildcard bind: the source address of this host's route to the router (a UDP socket
   "connected" to the router: no packet is sent, the kernel picks the interface and its
   address), else the first non-loopback address of an up interface, else loopback when the
   router is on loopback (or there is no router and nothing else). Logged by the caller.

IPv6 literals are written in brackets with a port (``[fd00::5]:8000``: ``host_port``).
Standard library only: the worker's command line uses it before anything heavy is imported.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path

_LABEL = r"[A-Za-z0-9_][A-Za-z0-9_-]{0,62}"  # one DNS label (underscores: real names have them)
_HOST_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
_IF_INET6 = Path("/proc/net/if_inet6")


class AddressError(ValueError):
    """No address a peer can reach (the message says which option to set)."""


def strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARDS


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(strip_brackets(host))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Loopback: an IP literal in 127/8 or ::1, or the name ``localhost``."""
    ip = _ip(host)
    if ip is None:
        return host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost")
    return ip.is_loopback


def host_port(host: str, port: int) -> str:
    """``host:port`` with an IPv6 literal in brackets: ``[fd00::5]:8000``."""
    bare = strip_brackets(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def check_advertise_host(value: str) -> str:
    """An ``--advertise-host`` value as given (brackets dropped); ValueError naming it when a
    peer could not use it."""
    text = value.strip()
    if not text:
        raise ValueError("advertise_host: empty")
    if is_wildcard(text):
        raise ValueError(f"advertise_host: {value!r} is a wildcard (every interface), not an "
                         f"address a peer can connect to; give this host's address or name")
    bare = strip_brackets(text)
    if _ip(bare) is None and not _HOST_NAME.fullmatch(bare):
        raise ValueError(f"advertise_host: {value!r} is not an IP address or host name")
    return bare


def _resolve(host: str) -> list[str]:
    """The IP addresses of ``host`` (a literal: itself); [] when it does not resolve."""
    bare = strip_brackets(host)
    if _ip(bare) is not None:
        return [bare]
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_local_address(ip: str) -> bool:
    """Whether ``ip`` belongs to this host (loopback, or bindable: one of its interfaces')."""
    parsed = _ip(ip)
    if parsed is None:
        return False
    if parsed.is_loopback:
        return True
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(parsed), 0))
        except OSError:
            return False
    return True


def host_is_local(host: str) -> bool:
    """Whether every address ``host`` resolves to is this host's (a router on this host)."""
    ips = _resolve(host)
    return bool(ips) and all(is_local_address(ip) for ip in ips)


def route_source(target: str, family: int | None = None) -> str | None:
    """The source address this host uses to reach ``target`` (a name or literal), from a UDP
    socket connected to it (connect() on UDP sends nothing); None when there is no route."""
    for ip in _resolve(target):
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        if family is not None and fam != family:
            continue
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            try:
                s.connect((ip, 9))  # any port: only the route is looked up
            except OSError:
                continue
            src = str(s.getsockname()[0]).split("%")[0]
        if src and not is_wildcard(src):
            return src
    return None


def _ipv4_addresses() -> list[str]:
    """IPv4 addresses of this host's up interfaces (Linux: SIOCGIFADDR per interface)."""
    import fcntl
    import struct

    out: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), 0x8913, req)[16:18])[0]
                if not flags & 0x1:  # IFF_UP
                    continue
                addr = fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]  # SIOCGIFADDR
                out.append(socket.inet_ntoa(addr))
    return out


def _ipv6_addresses() -> list[str]:
    """Global IPv6 addresses (not link-local: those need a scope) from /proc/net/if_inet6."""
    out: list[str] = []
    with contextlib.suppress(OSError):
        for line in _IF_INET6.read_text().splitlines():
            hexaddr = line.split()[0]
            ip = ipaddress.IPv6Address(bytes.fromhex(hexaddr))
            if not (ip.is_loopback or ip.is_link_local):
                out.append(str(ip))
    return out


def first_non_loopback(family: int | None = None) -> str | None:
    """The first non-loopback address of this host (IPv4 first), or None."""
    cands: list[str] = []
    if family in (None, socket.AF_INET):
        with contextlib.suppress(OSError, ImportError):
            cands += _ipv4_addresses()
    if family in (None, socket.AF_INET6):
        cands += _ipv6_addresses()
    for ip in cands:
        if not is_loopback(ip) and not is_wildcard(ip):
            return ip
    return None


@dataclass(frozen=True)
class Advertised:
    """The address chosen and why (for the log line)."""

    host: str  # bare: no brackets
    why: str


def _router_host(router_url: str | None) -> str | None:
    if not router_url:
        return None
    from urllib.parse import urlsplit

    text = router_url if "://" in router_url else "http://" + router_url
    with contextlib.suppress(ValueError):
        return urlsplit(text).hostname
    return None


def advertise_address(bind_host: str, *, advertise_host: str | None = None,
                      router_url: str | None = None) -> Advertised:
    """The address peers should use for a socket bound to ``bind_host`` (rules: the module
    docstring). ``AddressError`` when none that a peer can reach exists."""
    router = _router_host(router_url)
    router_local = router is None or host_is_local(router)
    if advertise_host is not None:
        host = check_advertise_host(advertise_host)
        if is_loopback(host) and not router_local:
            raise AddressError(f"advertise_host: {advertise_host!r} is a loopback address but "
                               f"the router ({router}) is on another host")
        return Advertised(host, "--advertise-host")
    bare = strip_brackets(bind_host.strip())
    if not is_wildcard(bare):
        if is_loopback(bare) and not router_local:
            raise AddressError(f"host: {bind_host!r} is loopback, so the router at {router} "
                               f"(another host) cannot reach this worker; bind a reachable "
                               f"address, or 0.0.0.0 with --advertise-host")
        return Advertised(bare, "the bound address")
    # Wildcard: 0.0.0.0 accepts IPv4 only; :: (dual-stack on Linux) either family.
    family = socket.AF_INET if bare in ("0.0.0.0", "*", "") else None
    if router is not None:
        src = route_source(router, family)
        if src is not None and (not is_loopback(src) or router_local):
            return Advertised(src, f"the source address of the route to the router {router}")
    ip = first_non_loopback(family)
    if ip is not None:
        return Advertised(ip, "the first non-loopback address (wildcard bind)")
    if router_local:
        return Advertised("::1" if bare == "::" else "127.0.0.1",
                          "loopback: no other interface, router on this host")
    raise AddressError(f"host: {bind_host!r} is a wildcard and this host has no address the "
                       f"router {router} can reach; set --advertise-host")
