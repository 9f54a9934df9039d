"""The addresses a worker hands to peers (disagg/addresses.py): an explicit --advertise-host
wins, a specific bind is itself, a wildcard bind becomes the address of the interface that
routes to the router (else the first non-loopback one), and never a wildcard or a loopback
address for a router on another host; IPv6 literals in brackets; the CLI names a bad value;
the UCX profile ``auto`` follows the KV address."""

from __future__ import annotations

import socket

import pytest

from disagg import addresses as A
from disagg.cli import main
from disagg.contracts.options import CacheTransceiverConfig
from disagg.transfer.ucx import configure_ucx_env, context_transports, resolve_ucx_profile

REMOTE_ROUTER = "http://192.0.2.77:8000"  # TEST-NET-1: never an address of this host


def test_explicit_advertise_host_wins_and_is_checked() -> None:
    got = A.advertise_address("0.0.0.0", advertise_host="10.1.2.3", router_url=REMOTE_ROUTER)
    assert got.host == "10.1.2.3" and "--advertise-host" in got.why
    assert A.advertise_address("0.0.0.0", advertise_host="[fd00::5]").host == "fd00::5"
    assert A.advertise_address("::", advertise_host="node-7.cluster.local").host == \
        "node-7.cluster.local"
    for bad in ("0.0.0.0", "::", "[::]", "", "two words", "a/b"):
        with pytest.raises(ValueError, match="advertise_host"):
            A.advertise_address("0.0.0.0", advertise_host=bad)
    # Loopback is fine for a router on this host, an error for one elsewhere.
    assert A.advertise_address("0.0.0.0", advertise_host="127.0.0.1",
                               router_url="http://127.0.0.1:9").host == "127.0.0.1"
    with pytest.raises(A.AddressError, match="loopback address but the router .* not on loop"):
        A.advertise_address("0.0.0.0", advertise_host="127.0.0.1", router_url=REMOTE_ROUTER)


def test_specific_bind_is_itself_but_loopback_only_for_a_local_router() -> None:
    assert A.advertise_address("10.9.8.7", router_url=REMOTE_ROUTER).host == "10.9.8.7"
    assert A.advertise_address("127.0.0.1").host == "127.0.0.1"
    assert A.advertise_address("[::1]", router_url="http://[::1]:9").host == "::1"
    with pytest.raises(A.AddressError, match=r"host: '127.0.0.1' is loopback but.*--advertise-h"):
        A.advertise_address("127.0.0.1", router_url=REMOTE_ROUTER)


def test_wildcard_bind_takes_the_route_to_the_router(monkeypatch) -> None:
    seen = []

    def route(target: str, family: int | None = None) -> str | None:
        seen.append((target, family))
        return "10.213.5.12"

    monkeypatch.setattr(A, "route_source", route)
    got = A.advertise_address("0.0.0.0", router_url="http://10.213.5.10:8000")
    assert got.host == "10.213.5.12" and "route to the router 10.213.5.10" in got.why
    assert seen == [("10.213.5.10", socket.AF_INET)]  # 0.0.0.0 serves IPv4 only


def test_wildcard_bind_falls_back_to_a_non_loopback_address(monkeypatch) -> None:
    monkeypatch.setattr(A, "route_source", lambda target, family=None: None)
    monkeypatch.setattr(A, "first_non_loopback", lambda family=None: "172.16.0.4")
    assert A.advertise_address("0.0.0.0", router_url=REMOTE_ROUTER).host == "172.16.0.4"
    assert A.advertise_address("::").host == "172.16.0.4"  # no router: first non-loopback
    # Nothing but loopback: fine for a local router, an error for a remote one.
    monkeypatch.setattr(A, "first_non_loopback", lambda family=None: None)
    assert A.advertise_address("0.0.0.0", router_url="http://127.0.0.1:1").host == "127.0.0.1"
    with pytest.raises(A.AddressError, match="set --advertise-host"):
        A.advertise_address("0.0.0.0", router_url=REMOTE_ROUTER)


def test_real_lookups_on_this_host() -> None:
    # The route to a loopback router starts at loopback; this host's own addresses are local.
    assert A.route_source("127.0.0.1") == "127.0.0.1"
    assert A.on_loopback("127.0.0.1") and A.on_loopback("localhost") and A.on_loopback("::1")
    assert not A.on_loopback("192.0.2.77") and not A.on_loopback("no-such-host.invalid")
    ip = A.first_non_loopback()
    assert ip is None or (A.is_local_address(ip) and not A.is_loopback(ip))
    got = A.advertise_address("0.0.0.0", router_url="http://127.0.0.1:1").host
    assert not A.is_wildcard(got)


def test_ipv6_literals_get_brackets() -> None:
    assert A.host_port("::1", 80) == "[::1]:80"
    assert A.host_port("[fd00::5]", 80) == "[fd00::5]:80"
    assert A.host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert A.host_port("node-1", 80) == "node-1:80"


@pytest.mark.parametrize("argv, needle", [
    (["--advertise-host", "0.0.0.0"], "advertise_host: '0.0.0.0' is a wildcard"),
    (["--advertise-host", "bad host!"], "advertise_host: 'bad host!' is not an IP address"),
    (["--host", "127.0.0.1", "--router-url", REMOTE_ROUTER], "host: '127.0.0.1' is loopback"),
])
def test_cli_names_the_bad_value(tmp_path, capsys, argv, needle) -> None:
    # Checked before the model loads: a missing model folder is never reached.
    code = main(["serve", str(tmp_path / "no-model"), *argv,
                 *([] if "--router-url" in argv else ["--router-url", "http://127.0.0.1:1"])])
    assert code == 2
    assert needle in capsys.readouterr().err


def test_ucx_profile_auto_follows_the_kv_address(monkeypatch) -> None:
    assert resolve_ucx_profile("auto", "127.0.0.1")[0] == "same_host"
    assert resolve_ucx_profile(None, "::1")[0] == "same_host"
    assert resolve_ucx_profile("auto", "10.213.0.11")[0] == "cross_host"
    assert resolve_ucx_profile("same_host", "10.213.0.11") == ("same_host", "configured")
    assert CacheTransceiverConfig().ucx_profile == "auto"
    with pytest.raises(ValueError, match="ucx_profile must be one of"):
        CacheTransceiverConfig(ucx_profile="fast")
    for key in ("UCX_TLS", "UCX_RNDV_SCHEME"):
        monkeypatch.delenv(key, raising=False)
    assert configure_ucx_env("cross_host", rdma=True)["UCX_TLS"] == "rc,ud,tcp"
    monkeypatch.delenv("UCX_TLS")
    assert configure_ucx_env("cross_host", rdma=False)["UCX_TLS"] == "tcp"


def test_context_transports_parse_ucx_info() -> None:
    info = ("#      resource 0  :  md 0  dev 0  flags -- tcp/eth0\n"
            "#      resource 1  :  md 0  dev 1  flags -- tcp/lo\n"
            "#      resource 2  :  md 1  dev 2  flags -- sysv/memory\n")
    assert context_transports(info) == ["tcp/eth0", "tcp/lo", "sysv/memory"]


def test_kv_transfer_over_an_ipv6_literal() -> None:
    """A transfer server bound to ::1 hands out [::1]:port, and a client reads through it."""
    import torch
    from transfer_fixtures import expected, same_bytes

    from disagg.transfer import KVTransferClient, KVTransferServer, LeaseTable, ReadRequest
    from disagg.transfer.payload import payload_shape

    if not A.is_local_address("::1"):
        pytest.skip("no IPv6 loopback here")
    kv = torch.randn(4, 2, 2, 2, 4, 8)
    leases = LeaseTable(default_ttl_s=30.0)
    leases.create("r1", [1, 3], readers=1)
    server = KVTransferServer(kv, leases, "t" * 32, "tcp", "::1", advertise_host="::1").start()
    client = KVTransferClient("tcp", "t" * 32, timeout_s=20.0)
    try:
        assert server.address.startswith("[::1]:")
        req = ReadRequest("r1", [1, 3], (0, 2), (0, 2))
        out = torch.empty(payload_shape(tuple(kv.shape), req), dtype=kv.dtype)
        client.read(server.address, req, out).result(20)
        assert same_bytes(out, expected(kv, req))
    finally:
        client.close()
        server.stop()
