"""Cluster authentication: members prove they hold the cluster token without ever sending it.

Every member of a cluster (router, context and generation workers) shares one secret, the
cluster token (``--cluster-token`` or ``$DISAGG_CLUSTER_TOKEN``). It never crosses the wire:
members send HMAC-SHA256 proofs keyed by it instead, so a peer that does not hold the token
learns nothing it can replay.

HTTP (router -> worker calls, worker -> router registration, launcher -> worker) carries one
header::

    X-Disagg-Auth: v2;aud=<member id>;ts=<unix seconds>;nonce=<32 hex>;sig=<64 hex>
    sig = HMAC(token, "disagg-http-v2", aud, METHOD, PATH[?QUERY], ts, nonce, sha256(body))

``HttpVerifier`` accepts it when ``aud`` is this member's own id, the signature matches,
``ts`` is within ``window_s`` of its own clock (hosts need roughly synchronised clocks, as with
any signed-request scheme) and the nonce was not seen before (a captured request cannot be
replayed to the member it was sent to).

The audience (``aud``) is the receiver's *member id*, a random id each member (a worker
process, a router with all its processes) draws at start and publishes, unauthenticated, as
``member_id`` in ``GET /health`` (an id, not a secret: knowing it does not let anyone sign).
A request captured on its way to member A names A, so member B refuses it (401, "signed for
member A") even though B holds the same token and never saw A's nonces. Why an id and not an
address: a member cannot robustly know every name it is reached by (a Kubernetes Service name,
a pod IP, a proxy in front, ``0.0.0.0`` binds), and the ``Host`` header is chosen by whoever
sends the request (a replay would carry A's Host header to B), so neither can be checked by
the receiver; its own id it always knows. A signer reads the id from ``/health`` before its
first signed call (the router's health check does so on every round, so a restarted worker's
new id is picked up before it is back in rotation; ``member_id_of`` for one-off callers).
``v1`` headers (no audience) are refused with a message naming the upgrade.

Replay store: a copy of a request fails the timestamp check once ``now - ts > window_s``, so a
nonce needs remembering only while its ``ts`` is within the window. Nonces are kept in one set
per ``ts`` second (a replay carries the same signed ``ts``, so only that set is searched) and a
whole second is dropped when it leaves the window: O(1) per request, memory proportional to the
signed-request rate. ``max_nonces`` (default ``DEFAULT_MAX_RATE`` signed requests/s held for
the whole accepted ``ts`` span) bounds memory against a member gone wrong (only requests with a
valid signature are remembered); a full store refuses rather than forgets (forgetting would
open a replay). ``bench/auth_rate.py`` measures the sustained rate.

The KV transfer protocol (``disagg/transfer/base.py``) uses ``hmac_hex`` for its own
challenge-response over a fresh server nonce (bound to that connection, so it is not affected).

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
import json
import math
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg.env import API_KEY, CLUSTER_TOKEN

CLUSTER_TOKEN_ENV = CLUSTER_TOKEN.name
AUTH_HEADER = "X-Disagg-Auth"
HTTP_SCHEME = "v2"
DEFAULT_WINDOW_S = 60.0
# The signed-request rate per member the replay store is sized for (req/s, sustained for the
# whole window); far above what one process verifies over HTTP (bench/auth_rate.py).
DEFAULT_MAX_RATE = 10_000
MEMBER_ID_FIELD = "member_id"  # in GET /health
_HTTP_DOMAIN = b"disagg-http-v2"
_MEMBER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


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


def new_member_id() -> str:
    """A fresh member id (the audience signatures to this member name)."""
    return secrets.token_hex(16)


def valid_member_id(value: object) -> str:
    """``value`` when it is a well-formed member id, else ValueError."""
    if not isinstance(value, str) or not _MEMBER_ID.fullmatch(value):
        raise ValueError(f"{MEMBER_ID_FIELD}: expected 1-64 characters of [A-Za-z0-9._-], "
                         f"got {value!r}")
    return value


def member_id_from_health(payload: object) -> str:
    """The member id in a ``GET /health`` answer (ValueError when there is none)."""
    if not isinstance(payload, dict) or MEMBER_ID_FIELD not in payload:
        raise ValueError(f"/health answer has no {MEMBER_ID_FIELD} (a member from before "
                         f"audience-bound signatures?)")
    return valid_member_id(payload[MEMBER_ID_FIELD])


def member_id_of(base_url: str, timeout: float = 5.0) -> str:
    """The member id of the server at ``base_url`` (``http://host:port``), read from its
    ``/health`` (any status: a draining member still names itself). ValueError / OSError."""
    req = urllib.request.Request(base_url.rstrip("/") + "/health")
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a peer: no proxy
    try:
        with direct.open(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:  # 503 while draining: the body still has the id
        raw = e.read()
    try:
        payload = json.loads(raw)
    except ValueError:
        raise ValueError(f"{base_url}/health: not JSON") from None
    return member_id_from_health(payload)


def hmac_hex(token: str, *parts: bytes | str) -> str:
    """HMAC-SHA256 under ``token`` of ``parts``, each length-prefixed so that no two different
    part lists encode the same bytes (``("ab", "c")`` != ``("a", "bc")``)."""
    return hmac_prefix(token, *parts).hexdigest()


def hmac_prefix(token: str, *parts: bytes | str) -> hmac.HMAC:
    """The state of ``hmac_hex(token, *parts, ...)`` after ``parts``: a prefix that many
    proofs share is fed once, each proof then costs ``hmac_finish`` on the state (which
    copies it), with the same result as ``hmac_hex`` of all the parts."""
    mac = hmac.new(token.encode(), digestmod=hashlib.sha256)
    _feed(mac, parts)
    return mac


def hmac_finish(prefix: hmac.HMAC, *parts: bytes | str) -> str:
    """``hmac_hex`` of the prefix's parts followed by ``parts`` (``prefix`` is not changed)."""
    mac = prefix.copy()
    _feed(mac, parts)
    return mac.hexdigest()


def _feed(mac: hmac.HMAC, parts: tuple[bytes | str, ...]) -> None:
    for part in parts:
        data = part.encode() if isinstance(part, str) else bytes(part)
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)


def proofs_equal(given: object, expected: str) -> bool:
    """Constant-time comparison of a received proof (any JSON value) with the expected one."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


# ---- HTTP -------------------------------------------------------------------------------------


def _http_mac(token: str, audience: str, method: str, path: str, ts: str, nonce: str,
              body: bytes) -> str:
    return hmac_hex(token, _HTTP_DOMAIN, audience, method.upper(), path, ts, nonce,
                    hashlib.sha256(body).digest())


def sign_http(token: str, method: str, path: str, body: bytes = b"", *, audience: str,
              now: float | None = None, nonce: str | None = None) -> dict[str, str]:
    """The header that authenticates one request to the member ``audience`` (its member id,
    from its ``/health``): ``{AUTH_HEADER: value}``. ``path`` is the request target as the
    server sees it: the path plus ``?query`` when there is one."""
    valid_member_id(audience)
    ts = str(int(time.time() if now is None else now))
    nonce = nonce or new_nonce()
    sig = _http_mac(token, audience, method, path, ts, nonce, body)
    return {AUTH_HEADER: f"{HTTP_SCHEME};aud={audience};ts={ts};nonce={nonce};sig={sig}"}


class HttpSigner:
    """``sign_http`` for one token with the keyed HMAC state set up once (not per call): the
    same headers, cheaper for a caller that signs on its hot path (the router)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("a non-empty cluster token is required")
        self._keyed = hmac.new(token.encode(), digestmod=hashlib.sha256)
        # (audience, method, path) -> the keyed state with the domain, audience, method and
        # path in: the router signs a few paths to a few members over and over (capped: paths
        # with a query vary).
        self._prefixed: dict[tuple[str, str, str], Any] = {}

    def headers(self, method: str, path: str, body: bytes = b"", *, audience: str,
                now: float | None = None, nonce: str | None = None) -> dict[str, str]:
        ts = str(int(time.time() if now is None else now))
        nonce = nonce or new_nonce()
        key = (audience, method, path)
        prefixed = self._prefixed.get(key)
        if prefixed is None:
            valid_member_id(audience)
            if len(self._prefixed) >= 1024:
                self._prefixed.clear()
            prefixed = self._prefixed[key] = _framed(
                self._keyed.copy(),
                (_HTTP_DOMAIN, audience.encode(), method.upper().encode(), path.encode()))
        mac = _framed(prefixed.copy(), (ts.encode(), nonce.encode(),
                                        hashlib.sha256(body).digest()))
        return {AUTH_HEADER: f"{HTTP_SCHEME};aud={audience};ts={ts};nonce={nonce};"
                             f"sig={mac.hexdigest()}"}


def _framed(mac: Any, parts: tuple[bytes, ...]) -> Any:
    """``mac`` updated with ``parts`` in hmac_hex's framing (every part length-prefixed)."""
    for data in parts:
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)
    return mac


def _parse_header(value: str) -> tuple[str, str, str, str]:
    scheme, _, rest = value.partition(";")
    scheme = scheme.strip()
    if scheme == "v1":
        raise AuthError(f"{AUTH_HEADER}: old signature format v1 (it names no audience): the "
                        f"signer must be upgraded to {HTTP_SCHEME} (aud=<member id>)")
    if scheme != HTTP_SCHEME:
        raise AuthError(f"{AUTH_HEADER}: unknown scheme (expected {HTTP_SCHEME})")
    fields: dict[str, str] = {}
    for item in rest.split(";"):
        key, sep, val = item.strip().partition("=")
        if not sep or key in fields:
            raise AuthError(f"{AUTH_HEADER}: malformed")
        fields[key] = val
    try:
        aud, ts, nonce, sig = fields["aud"], fields["ts"], fields["nonce"], fields["sig"]
    except KeyError as e:
        raise AuthError(f"{AUTH_HEADER}: missing {e.args[0]}") from None
    if not _MEMBER_ID.fullmatch(aud):
        raise AuthError(f"{AUTH_HEADER}: bad aud")
    if not ts.isdigit() or len(ts) > 12:
        raise AuthError(f"{AUTH_HEADER}: bad ts")
    if len(nonce) != 32 or not _is_hex(nonce):
        raise AuthError(f"{AUTH_HEADER}: bad nonce")
    if len(sig) != 64 or not _is_hex(sig):
        raise AuthError(f"{AUTH_HEADER}: bad sig")
    return aud, ts, nonce, sig


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


class HttpVerifier:
    """Checks ``X-Disagg-Auth`` headers addressed to one member (``member_id``; a fresh one
    when not given) for one cluster token (see the module docstring).

    Remembers the nonces of accepted requests while their ``ts`` is within ``window_s``, in
    one set per ``ts`` second; at most ``max_nonces`` (default: ``max_rate`` per second over
    the accepted ``ts`` span, even with clocks skewed by the whole window); when full,
    requests are refused until old ones age out (a flood cannot push a nonce out early and
    open a replay). Thread-safe.
    """

    def __init__(self, token: str, window_s: float = DEFAULT_WINDOW_S,
                 max_nonces: int | None = None, clock: Callable[[], float] = time.time,
                 member_id: str | None = None, max_rate: int = DEFAULT_MAX_RATE) -> None:
        if not token:
            raise ValueError("a non-empty cluster token is required")
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self._token = token
        self.member_id = valid_member_id(member_id) if member_id else new_member_id()
        self.window_s = window_s
        # The ts seconds held at one instant: [now - window, now + window] (+1 for a sweep
        # that is up to a second late): ``max_rate`` per second for all of them never fills.
        self.max_nonces = (max_nonces if max_nonces is not None
                           else max_rate * (2 * math.ceil(window_s) + 2))
        self._clock = clock
        self._seen: dict[int, set[int]] = {}  # ts -> 64-bit nonce prefixes accepted with it
        self._count = 0
        self._sweep_at = float("-inf")
        self._lock = threading.Lock()

    def check(self, header: str | None, method: str, path: str, body: bytes = b"") -> None:
        """Raise ``AuthError`` unless ``header`` authenticates this request to this member."""
        if not header:
            raise AuthError(f"{AUTH_HEADER}: missing (requests between cluster members are "
                            f"signed with the cluster token)")
        aud, ts, nonce, sig = _parse_header(header)
        if not hmac.compare_digest(aud, self.member_id):
            raise AuthError(f"{AUTH_HEADER}: signed for member {aud}, not this one "
                            f"({self.member_id}): a request for another member is not "
                            f"accepted here")
        now = self._clock()
        t = int(ts)
        if abs(now - t) > self.window_s:
            raise AuthError(f"{AUTH_HEADER}: timestamp outside the {self.window_s:.0f} s "
                            f"window (are the hosts' clocks in sync?)")
        if not hmac.compare_digest(sig, _http_mac(self._token, aud, method, path, ts, nonce,
                                                  body)):
            raise AuthError(f"{AUTH_HEADER}: wrong signature (another cluster token?)")
        # 64 random bits suffice against chance collisions; a forger cannot pick a nonce
        # (the signature covers it).
        key = int(nonce[:16], 16)
        with self._lock:
            if now >= self._sweep_at:
                self._sweep(now)
            bucket = self._seen.get(t)
            if bucket is not None and key in bucket:
                raise AuthError(f"{AUTH_HEADER}: replayed request")
            if self._count >= self.max_nonces:
                raise AuthError(f"{AUTH_HEADER}: too many signed requests in the window "
                                f"({self.max_nonces})")
            if bucket is None:
                bucket = self._seen[t] = set()
            bucket.add(key)
            self._count += 1

    def _sweep(self, now: float) -> None:
        """Forget the seconds whose copies fail the timestamp check (``now - ts > window``);
        runs at most about once a second."""
        for t in [t for t in self._seen if now - t > self.window_s]:
            self._count -= len(self._seen.pop(t))
        self._sweep_at = now + 1.0 if self._seen else now

    @property
    def remembered(self) -> int:
        """Nonces held now."""
        return self._count

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
