"""Cluster authentication primitives: signed HTTP requests, HMAC framing, the peer allow-list."""

from __future__ import annotations

import pytest

from disagg.cluster_auth import (
    AUTH_HEADER,
    AuthError,
    HttpSigner,
    HttpVerifier,
    PeerAllowlist,
    hmac_hex,
    proofs_equal,
    sign_http,
)

TOKEN = "s3cret-cluster-token"


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_signature_roundtrip_and_token_never_in_header() -> None:
    clock = Clock()
    v = HttpVerifier(TOKEN, clock=clock)
    h = sign_http(TOKEN, "POST", "/v1/completions", b'{"a":1}', now=clock.t)
    assert TOKEN not in h[AUTH_HEADER]
    v.check(h[AUTH_HEADER], "POST", "/v1/completions", b'{"a":1}')


@pytest.mark.parametrize("change", ["method", "path", "body", "token"])
def test_signature_binds_method_path_body_and_token(change: str) -> None:
    clock = Clock()
    v = HttpVerifier(TOKEN, clock=clock)
    args = {"method": "POST", "path": "/kv_events?since=3", "body": b"x"}
    token = TOKEN
    if change == "token":
        token = TOKEN + "x"
    h = sign_http(token, args["method"], args["path"], args["body"], now=clock.t)[AUTH_HEADER]
    if change == "method":
        args["method"] = "GET"
    elif change == "path":
        args["path"] = "/kv_events?since=4"
    elif change == "body":
        args["body"] = b"y"
    with pytest.raises(AuthError, match="wrong signature"):
        v.check(h, args["method"], args["path"], args["body"])


def test_replay_is_refused_and_nonces_age_out() -> None:
    clock = Clock()
    v = HttpVerifier(TOKEN, window_s=10, clock=clock)
    h = sign_http(TOKEN, "GET", "/server_info", now=clock.t)[AUTH_HEADER]
    v.check(h, "GET", "/server_info")
    with pytest.raises(AuthError, match="replayed"):
        v.check(h, "GET", "/server_info")
    clock.t += 11  # the copy is now stale anyway
    with pytest.raises(AuthError, match="window"):
        v.check(h, "GET", "/server_info")
    clock.t += 20
    fresh = sign_http(TOKEN, "GET", "/server_info", now=clock.t)[AUTH_HEADER]
    v.check(fresh, "GET", "/server_info")
    assert len(v._seen) == 1  # the old nonce was forgotten


def test_replay_just_inside_the_window_is_still_refused() -> None:
    # Signed at the far future edge of the window, replayed at the far past edge.
    clock = Clock()
    v = HttpVerifier(TOKEN, window_s=10, clock=clock)
    h = sign_http(TOKEN, "GET", "/x", now=clock.t + 10)[AUTH_HEADER]
    v.check(h, "GET", "/x")
    clock.t += 20  # ts + window == now: still fresh
    with pytest.raises(AuthError, match="replayed"):
        v.check(h, "GET", "/x")


def test_nonce_table_full_refuses_instead_of_forgetting() -> None:
    clock = Clock()
    v = HttpVerifier(TOKEN, window_s=10, max_nonces=2, clock=clock)
    for _ in range(2):
        v.check(sign_http(TOKEN, "GET", "/x", now=clock.t)[AUTH_HEADER], "GET", "/x")
    with pytest.raises(AuthError, match="too many"):
        v.check(sign_http(TOKEN, "GET", "/x", now=clock.t)[AUTH_HEADER], "GET", "/x")


@pytest.mark.parametrize("header", [
    None, "", "v2;ts=1;nonce=0;sig=0", "v1", "v1;ts=1",
    "v1;ts=x;nonce=" + "a" * 32 + ";sig=" + "b" * 64,
    "v1;ts=1000000;nonce=" + "g" * 32 + ";sig=" + "b" * 64,
    "v1;ts=1000000;nonce=" + "a" * 32 + ";sig=" + "b" * 63,
    "v1;ts=1000000;ts=1000000;nonce=" + "a" * 32 + ";sig=" + "b" * 64,
])
def test_malformed_headers_are_refused(header: str | None) -> None:
    v = HttpVerifier(TOKEN, clock=Clock())
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
    calls += [("GET", f"/kv_events?since={i}", b"") for i in range(70)]  # past the cache cap
    for method, path, body in calls * 2:  # (the second time from the cached prefix state)
        nonce = "0123456789abcdef" * 2
        assert signer.headers(method, path, body, now=clock.t, nonce=nonce) == sign_http(
            TOKEN, method, path, body, now=clock.t, nonce=nonce)
    v = HttpVerifier(TOKEN, clock=clock)
    v.check(signer.headers("GET", "/server_info", now=clock.t)[AUTH_HEADER], "GET",
            "/server_info")
    a, b = (signer.headers("GET", "/x", now=clock.t)[AUTH_HEADER] for _ in range(2))
    assert a != b  # a fresh nonce each time
    with pytest.raises(ValueError):
        HttpSigner("")
