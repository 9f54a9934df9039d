"""Cluster authentication primitives: signed HTTP requests bound to their audience, the replay
store, HMAC framing, the peer allow-list."""

from __future__ import annotations

import hashlib

import pytest

from disagg.cluster_auth import (
    AUTH_HEADER,
    DEFAULT_MAX_RATE,
    AuthError,
    HttpSigner,
    HttpVerifier,
    PeerAllowlist,
    hmac_hex,
    member_id_from_health,
    proofs_equal,
    sign_http,
)

TOKEN = "s3cret-cluster-token"
ME = "a" * 32  # the verifying member's id
OTHER = "b" * 32


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def verifier(clock: Clock, **kw: object) -> HttpVerifier:
    return HttpVerifier(TOKEN, clock=clock, member_id=ME, **kw)  # type: ignore[arg-type]


def sign(method: str, path: str, body: bytes = b"", *, now: float, token: str = TOKEN,
         audience: str = ME) -> str:
    return sign_http(token, method, path, body, audience=audience, now=now)[AUTH_HEADER]


def test_signature_roundtrip_and_token_never_in_header() -> None:
    clock = Clock()
    v = verifier(clock)
    h = sign("POST", "/v1/completions", b'{"a":1}', now=clock.t)
    assert TOKEN not in h and f"aud={ME}" in h
    v.check(h, "POST", "/v1/completions", b'{"a":1}')


@pytest.mark.parametrize("change", ["method", "path", "body", "token"])
def test_signature_binds_method_path_body_and_token(change: str) -> None:
    clock = Clock()
    v = verifier(clock)
    args = {"method": "POST", "path": "/kv_events?since=3", "body": b"x"}
    token = TOKEN + "x" if change == "token" else TOKEN
    h = sign(args["method"], args["path"], args["body"], now=clock.t, token=token)
    if change == "method":
        args["method"] = "GET"
    elif change == "path":
        args["path"] = "/kv_events?since=4"
    elif change == "body":
        args["body"] = b"y"
    with pytest.raises(AuthError, match="wrong signature"):
        v.check(h, args["method"], args["path"], args["body"])


def test_a_request_for_one_member_is_refused_by_another() -> None:
    """The issue's replay: a request captured on its way to member A, replayed to member B
    (same cluster token, B never saw A's nonce), is refused by B; A refuses the copy too."""
    clock = Clock()
    a = HttpVerifier(TOKEN, clock=clock)
    b = HttpVerifier(TOKEN, clock=clock)
    assert a.member_id != b.member_id  # fresh ids by default
    body = b'{"role": "generation"}'
    h = sign("POST", "/admin/role", body, now=clock.t, audience=a.member_id)
    a.check(h, "POST", "/admin/role", body)
    with pytest.raises(AuthError, match=f"signed for member {a.member_id}, not this one"):
        b.check(h, "POST", "/admin/role", body)
    with pytest.raises(AuthError, match="replayed"):
        a.check(h, "POST", "/admin/role", body)
    # Rewriting aud to B's id breaks the signature (aud is in the signed bytes).
    forged = h.replace(f"aud={a.member_id}", f"aud={b.member_id}")
    with pytest.raises(AuthError, match="wrong signature"):
        b.check(forged, "POST", "/admin/role", body)
    assert b.remembered == 0


def test_old_format_without_audience_is_refused_with_a_clear_message() -> None:
    clock = Clock()
    v = verifier(clock)
    ts, nonce = str(int(clock.t)), "0123456789abcdef" * 2
    # A correct v1 signature (the old scheme), made here the way old members made it.
    sig = hmac_hex(TOKEN, b"disagg-http-v1", "GET", "/server_info", ts, nonce,
                   hashlib.sha256(b"").digest())
    with pytest.raises(AuthError, match="old signature format v1.*upgraded"):
        v.check(f"v1;ts={ts};nonce={nonce};sig={sig}", "GET", "/server_info")


def test_replay_is_refused_and_nonces_age_out() -> None:
    clock = Clock()
    v = verifier(clock, window_s=10)
    h = sign("GET", "/server_info", now=clock.t)
    v.check(h, "GET", "/server_info")
    with pytest.raises(AuthError, match="replayed"):
        v.check(h, "GET", "/server_info")
    clock.t += 11  # the copy is now stale anyway
    with pytest.raises(AuthError, match="window"):
        v.check(h, "GET", "/server_info")
    clock.t += 20
    v.check(sign("GET", "/server_info", now=clock.t), "GET", "/server_info")
    assert v.remembered == 1  # the old nonce was forgotten


def test_replay_just_inside_the_window_is_still_refused() -> None:
    # Signed at the far future edge of the window, replayed at the far past edge.
    clock = Clock()
    v = verifier(clock, window_s=10)
    h = sign("GET", "/x", now=clock.t + 10)
    v.check(h, "GET", "/x")
    clock.t += 20  # now - ts == window: still fresh
    with pytest.raises(AuthError, match="replayed"):
        v.check(h, "GET", "/x")
    clock.t += 0.5  # past the window: stale, and its second may now be forgotten
    with pytest.raises(AuthError, match="window"):
        v.check(h, "GET", "/x")


def test_nonce_table_full_refuses_instead_of_forgetting() -> None:
    clock = Clock()
    v = verifier(clock, window_s=10, max_nonces=2)
    for _ in range(2):
        v.check(sign("GET", "/x", now=clock.t), "GET", "/x")
    with pytest.raises(AuthError, match="too many"):
        v.check(sign("GET", "/x", now=clock.t), "GET", "/x")


@pytest.mark.parametrize("skew", [0.0, -9.0, 9.0])
def test_the_stated_rate_is_never_refused(skew: float) -> None:
    """``max_rate`` signed requests per second, sustained over several windows (with the
    signer's clock skewed by nearly as much as the window allows), are all accepted, and the
    store stays bounded and flat (it does not grow with time)."""
    rate, window = 200, 10
    clock = Clock()
    v = verifier(clock, window_s=window, max_rate=rate)
    held = []
    for _second in range(5 * window):
        for _i in range(rate):
            clock.t += 1.0 / rate
            v.check(sign("GET", "/x", now=clock.t + skew), "GET", "/x")
        held.append(v.remembered)
    assert max(held) <= v.max_nonces
    steady = held[-2 * window:]
    # A nonce is held while now - ts <= window: ~ rate x (window + skew) of them.
    assert max(steady) <= rate * (window + max(skew, 0) + 2)
    assert max(steady) - min(steady) <= 2 * rate


def test_default_store_is_sized_for_the_default_rate() -> None:
    v = HttpVerifier(TOKEN)
    assert v.max_nonces >= DEFAULT_MAX_RATE * (2 * v.window_s + 1)


def test_member_id_from_health() -> None:
    assert member_id_from_health({"status": "ok", "member_id": ME}) == ME
    for bad in ({"status": "ok"}, [], {"member_id": "x y"}, {"member_id": ""}):
        with pytest.raises(ValueError, match="member_id"):
            member_id_from_health(bad)


@pytest.mark.parametrize("header", [
    None, "", "v3;aud=a;ts=1;nonce=0;sig=0", "v2", "v2;ts=1",
    "v2;ts=1000000;nonce=" + "a" * 32 + ";sig=" + "b" * 64,  # no aud
    "v2;aud=a b;ts=1000000;nonce=" + "a" * 32 + ";sig=" + "b" * 64,
    f"v2;aud={ME};ts=x;nonce=" + "a" * 32 + ";sig=" + "b" * 64,
    f"v2;aud={ME};ts=1000000;nonce=" + "g" * 32 + ";sig=" + "b" * 64,
    f"v2;aud={ME};ts=1000000;nonce=" + "a" * 32 + ";sig=" + "b" * 63,
    f"v2;aud={ME};ts=1000000;ts=1000000;nonce=" + "a" * 32 + ";sig=" + "b" * 64,
])
def test_malformed_headers_are_refused(header: str | None) -> None:
    v = verifier(Clock())
    with pytest.raises(AuthError):
        v.check(header, "GET", "/x")
    assert not v.is_valid(header, "GET", "/x")


def test_hmac_framing_is_unambiguous() -> None:
    assert hmac_hex(TOKEN, "ab", "c") != hmac_hex(TOKEN, "a", "bc")
    assert hmac_hex(TOKEN, b"ab") == hmac_hex(TOKEN, "ab")
    assert proofs_equal(hmac_hex(TOKEN, "x"), hmac_hex(TOKEN, "x"))
    assert not proofs_equal(None, hmac_hex(TOKEN, "x"))
    assert not proofs_equal(7, hmac_hex(TOKEN, "x"))


def test_allowlist_matches_literal_hosts_only() -> None:
    a = PeerAllowlist.parse(["10.0.0.0/24", "fd00::/64", "ctx-0.cluster.local", "192.168.1.5"])
    assert a.allows_host("10.0.0.7")
    assert not a.allows_host("10.0.1.7")
    assert a.allows_host("[fd00::5]") and a.allows_host("fd00::5")
    assert not a.allows_host("fd01::5")
    assert a.allows_host("CTX-0.cluster.local.")
    assert not a.allows_host("ctx-1.cluster.local")
    assert a.allows_host("::ffff:10.0.0.9")  # v4-mapped v6
    assert a.allows_host("192.168.1.5") and not a.allows_host("192.168.1.6")
    assert a.first_denied(["10.0.0.1:9000", "[fd00::1]:9000"]) is None
    assert a.first_denied(["10.0.0.1:9000", "evil.example:9000"]) == "evil.example:9000"
    assert a.first_denied(["10.0.0.1"]) == "10.0.0.1"  # no port: malformed, denied
    assert not PeerAllowlist.parse([]) and PeerAllowlist.parse(["127.0.0.1"])


@pytest.mark.parametrize("bad", ["", "  ", "10.0.0.0/33", "not a host", "a/b", "-x.com", 5])
def test_allowlist_rejects_bad_entries_naming_them(bad: object) -> None:
    with pytest.raises(ValueError, match=r"kv_peer_allowlist\[1\]"):
        PeerAllowlist.parse(["127.0.0.1", bad])  # type: ignore[list-item]


def test_http_signer_signs_exactly_like_sign_http() -> None:
    clock = Clock()
    signer = HttpSigner(TOKEN)
    calls = [("POST", "/v1/completions", b'{"a":1}'), ("get", "/x?y=1", b""),
             ("POST", "/p\u00e9", "é".encode()), ("POST", "/v1/completions", b'{"a":2}')]
    calls += [("GET", f"/kv_events?since={i}", b"") for i in range(1100)]  # past the cap
    for audience in (ME, OTHER):
        for method, path, body in calls * 2:  # (the second time from the cached state)
            nonce = "0123456789abcdef" * 2
            assert signer.headers(method, path, body, audience=audience, now=clock.t,
                                  nonce=nonce) == sign_http(
                TOKEN, method, path, body, audience=audience, now=clock.t, nonce=nonce)
    v = verifier(clock)
    v.check(signer.headers("GET", "/server_info", audience=ME, now=clock.t)[AUTH_HEADER],
            "GET", "/server_info")
    with pytest.raises(AuthError, match="signed for member"):
        v.check(signer.headers("GET", "/server_info", audience=OTHER, now=clock.t)[
            AUTH_HEADER], "GET", "/server_info")
    a, b = (signer.headers("GET", "/x", audience=ME, now=clock.t)[AUTH_HEADER]
            for _ in range(2))
    assert a != b  # a fresh nonce each time
    with pytest.raises(ValueError):
        HttpSigner("")
    with pytest.raises(ValueError, match="member_id"):
        signer.headers("GET", "/x", audience="not;an id")
