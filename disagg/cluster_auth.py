"""Cluster authentication: members prove they hold the cluster token without ever sending it.

Every member of a cluster (router, context and generation workers) shares one secret, the
cluster token (``--cluster-token`` or ``$DISAGG_CLUSTER_TOKEN``). It never crosses the wire:
members send HMAC-SHA256 proofs keyed by it instead, so a peer that does not hold the token
learns nothing it can replay.

HTTP (router -> worker calls, worker -> router registration) carries one header::

    X-Disagg-Auth: v1;ts=<unix seconds>;nonce=<32 hex>;sig=<64 hex>
    sig = HMAC(token, "disagg-http-v1", METHOD, PATH[?QUERY], ts, nonce, sha256(body))

``HttpVerifier`` accepts it when the signature matches, ``ts`` is within ``window_s`` of its
own clock (hosts need roughly synchronised clocks, as with any signed-request scheme), and the
nonce was not seen before within the window (a captured request cannot be replayed).

The KV transfer protocol (``disagg/transfer/base.py``) uses ``hmac_hex`` for its own
challenge-response over a fresh server nonce.

``PeerAllowlist``: the context workers a generation worker may pull KV from when a request
does not come signed by the cluster (``kv_peer_allowlist`` in the worker YAML). Entries are IP
addresses, CIDR networks or host names; they match the *literal* host of an address (no DNS
lookup on the request path: an entry ``10.0.0.0/24`` allows ``10.0.0.7:9000`` but not
``ctx-0:9000``, even if ``ctx-0`` resolves into the network; list host names as names).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg.env import API_KEY, CLUSTER_TOKEN

CLUSTER_TOKEN_ENV = CLUSTER_TOKEN.name
AUTH_HEADER = "X-Disagg-Auth"
HTTP_SCHEME = "v1"
DEFAULT_WINDOW_S = 120.0
_HTTP_DOMAIN = b"disagg-http-v1"


class AuthError(Exception):
    """A cluster proof is missing, malformed, stale, replayed or wrong (the message says which;
    it never contains secrets)."""


def _token_from_env(env: str) -> str | None:
    # disagg/env.py declares the variable (empty counts as unset); ``env`` may rename it.
    return dataclasses.replace(CLUSTER_TOKEN, name=env).get()


def resolve_cluster_token(value: str | None = None, env: str = CLUSTER_TOKEN_ENV) -> str:
    """The shared cluster secret: the configured value, else ``$DISAGG_CLUSTER_TOKEN``."""
    token = value or _token_from_env(env)
    if not token:
        raise ValueError(f"no cluster token: set it in the config or in ${env}")
    return token


def cluster_token_or_none(value: str | None = None, env: str = CLUSTER_TOKEN_ENV) -> str | None:
    """Like ``resolve_cluster_token`` but None when none is configured."""
    return value or _token_from_env(env)


def api_key_or_none(value: str | None = None) -> str | None:
    """The API key clients send: the configured value, else ``$DISAGG_API_KEY`` (a key kept
    out of the YAML, e.g. a Kubernetes Secret), else None (no key required)."""
    return value or API_KEY.get()


def new_nonce() -> str:
    """128 random bits as 32 hex digits."""
    return secrets.token_hex(16)


def hmac_hex(token: str, *parts: bytes | str) -> str:
    """HMAC-SHA256 under ``token`` of ``parts``, each length-prefixed so that no two different
    part lists encode the same bytes (``("ab", "c")`` != ``("a", "bc")``)."""
    mac = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else bytes(part)
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)
    return mac.hexdigest()


def proofs_equal(given: object, expected: str) -> bool:
    """Constant-time comparison of a received proof (any JSON value) with the expected one."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


# ---- HTTP -------------------------------------------------------------------------------------


def _http_mac(token: str, method: str, path: str, ts: str, nonce: str, body: bytes) -> str:
    return hmac_hex(token, _HTTP_DOMAIN, method.upper(), path, ts, nonce,
                    hashlib.sha256(body).digest())


def sign_http(token: str, method: str, path: str, body: bytes = b"", *,
              now: float | None = None, nonce: str | None = None) -> dict[str, str]:
    """The header that authenticates one request: ``{AUTH_HEADER: value}``. ``path`` is the
    request target as the server sees it: the path plus ``?query`` when there is one."""
    ts = str(int(time.time() if now is None else now))
    nonce = nonce or new_nonce()
    sig = _http_mac(token, method, path, ts, nonce, body)
    return {AUTH_HEADER: f"{HTTP_SCHEME};ts={ts};nonce={nonce};sig={sig}"}


class HttpSigner:
    """``sign_http`` for one token with the keyed HMAC state set up once (not per call): the
    same headers, cheaper for a caller that signs on its hot path (the router)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("a non-empty cluster token is required")
        self._keyed = hmac.new(token.encode(), digestmod=hashlib.sha256)
        # (method, path) -> the keyed state with the domain, method and path in: the router
        # signs a few paths over and over (capped: paths with a query vary).
        self._prefixed: dict[tuple[str, str], Any] = {}

    def headers(self, method: str, path: str, body: bytes = b"", *,
                now: float | None = None, nonce: str | None = None) -> dict[str, str]:
        ts = str(int(time.time() if now is None else now))
        nonce = nonce or new_nonce()
        prefixed = self._prefixed.get((method, path))
        if prefixed is None:
            if len(self._prefixed) >= 64:
                self._prefixed.clear()
            prefixed = self._prefixed[method, path] = _framed(
                self._keyed.copy(), (_HTTP_DOMAIN, method.upper().encode(), path.encode()))
        mac = _framed(prefixed.copy(), (ts.encode(), nonce.encode(),
                                        hashlib.sha256(body).digest()))
        return {AUTH_HEADER: f"{HTTP_SCHEME};ts={ts};nonce={nonce};sig={mac.hexdigest()}"}


def _framed(mac: Any, parts: tuple[bytes, ...]) -> Any:
    """``mac`` updated with ``parts`` in hmac_hex's framing (every part length-prefixed)."""
    for data in parts:
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)
    return mac


def _parse_header(value: str) -> tuple[str, str, str]:
    scheme, _, rest = value.partition(";")
    if scheme.strip() != HTTP_SCHEME:
        raise AuthError(f"{AUTH_HEADER}: unknown scheme (expected {HTTP_SCHEME})")
    fields: dict[str, str] = {}
    for item in rest.split(";"):
        key, sep, val = item.strip().partition("=")
        if not sep or key in fields:
            raise AuthError(f"{AUTH_HEADER}: malformed")
        fields[key] = val
    try:
        ts, nonce, sig = fields["ts"], fields["nonce"], fields["sig"]
    except KeyError as e:
        raise AuthError(f"{AUTH_HEADER}: missing {e.args[0]}") from None
    if not ts.isdigit() or len(ts) > 12:
        raise AuthError(f"{AUTH_HEADER}: bad ts")
    if len(nonce) != 32 or not _is_hex(nonce):
        raise AuthError(f"{AUTH_HEADER}: bad nonce")
    if len(sig) != 64 or not _is_hex(sig):
        raise AuthError(f"{AUTH_HEADER}: bad sig")
    return ts, nonce, sig


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


class HttpVerifier:
    """Checks ``X-Disagg-Auth`` headers for one cluster token (see the module docstring).

    Remembers the nonces of accepted requests for ``window_s`` (at most ``max_nonces``; when
    full, requests are refused until old ones age out: a flood cannot push a nonce out early
    and open a replay). Thread-safe.
    """

    def __init__(self, token: str, window_s: float = DEFAULT_WINDOW_S,
                 max_nonces: int = 1 << 17, clock: Callable[[], float] = time.time) -> None:
        if not token:
            raise ValueError("a non-empty cluster token is required")
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self._token = token
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> expiry, oldest first
        self._lock = threading.Lock()

    def check(self, header: str | None, method: str, path: str, body: bytes = b"") -> None:
        """Raise ``AuthError`` unless ``header`` authenticates this request."""
        if not header:
            raise AuthError(f"{AUTH_HEADER}: missing (requests between cluster members are "
                            f"signed with the cluster token)")
        ts, nonce, sig = _parse_header(header)
        now = self._clock()
        if abs(now - int(ts)) > self.window_s:
            raise AuthError(f"{AUTH_HEADER}: timestamp outside the {self.window_s:.0f} s "
                            f"window (are the hosts' clocks in sync?)")
        if not hmac.compare_digest(sig, _http_mac(self._token, method, path, ts, nonce, body)):
            raise AuthError(f"{AUTH_HEADER}: wrong signature (another cluster token?)")
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthError(f"{AUTH_HEADER}: replayed request")
            if len(self._seen) >= self.max_nonces:
                raise AuthError(f"{AUTH_HEADER}: too many signed requests in the window")
            # A copy passes the timestamp check until ts + window <= now + 2 * window: keep the
            # nonce that long. Insertion order is expiry order (now only grows).
            self._seen[nonce] = now + 2 * self.window_s

    def is_valid(self, header: str | None, method: str, path: str, body: bytes = b"") -> bool:
        try:
            self.check(header, method, path, body)
        except AuthError:
            return False
        return True


def header_value(headers: Mapping[str, str]) -> str | None:
    """The auth header of a request's headers (any case-insensitive mapping)."""
    return headers.get(AUTH_HEADER)


# ---- peer allow-list --------------------------------------------------------------------------

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class PeerAllowlist:
    """Context workers a generation worker may pull KV from without a cluster signature."""

    networks: tuple[Network, ...] = ()
    hostnames: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, entries: Iterable[str] | None, field: str = "kv_peer_allowlist"
              ) -> PeerAllowlist:
        """IPs, CIDRs (``10.0.0.0/24``, ``fd00::/64``) or host names; ValueError naming the
        field and the entry otherwise."""
        nets: list[Network] = []
        names: set[str] = set()
        for i, raw in enumerate(entries or ()):
            if not isinstance(raw, str) or not raw.strip():
                raise ValueError(f"{field}[{i}]: expected a host, IP or CIDR, got {raw!r}")
            entry = raw.strip().strip("[]")
            try:
                nets.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if "/" in entry or not _is_hostname(entry):
                raise ValueError(f"{field}[{i}]: {raw!r} is not a host name, IP or CIDR")
            names.add(entry.lower().rstrip("."))
        return cls(tuple(nets), frozenset(names))

    def __bool__(self) -> bool:
        return bool(self.networks or self.hostnames)

    def allows_host(self, host: str) -> bool:
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host.lower().rstrip(".") in self.hostnames
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == n.version and ip in n for n in self.networks)

    def first_denied(self, addresses: Sequence[str]) -> str | None:
        """The first ``host:port`` whose host is not allowed (None: all are)."""
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not self.allows_host(host):
                return address
        return None

    def describe(self) -> list[str]:
        return [str(n) for n in self.networks] + sorted(self.hostnames)


def _is_hostname(name: str) -> bool:
    name = name.rstrip(".")
    if not name or len(name) > 253:
        return False
    return all(
        0 < len(label) <= 63 and label[0] != "-" and label[-1] != "-"
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        for label in name.split(".")
    )


def bearer_ok(authorization: str, key: str | None) -> bool:
    """Does an ``Authorization`` header value carry ``key`` as its bearer token (constant
    time)? False when there is no key."""
    if not key:
        return False
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                               key.encode())
