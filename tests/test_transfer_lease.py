"""Lease table semantics (fake clock), transfer stats, wire messages and the backend factory:
no sockets, no torch."""

from __future__ import annotations

import threading

import pytest

from disagg.contracts.options import CacheTransceiverConfig
from disagg.transfer.backends import make_backend
from disagg.transfer.base import (
    ProtocolError,
    ReadRequest,
    TransferError,
    decode_header,
    encode_header,
    header_length,
    parse_address,
    resolve_cluster_token,
)
from disagg.transfer.lease import LeaseError, LeaseTable
from disagg.transfer.stats import TransferStats


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def released() -> list[tuple[str, str]]:
    return []


@pytest.fixture
def table(clock: FakeClock, released: list[tuple[str, str]]) -> LeaseTable:
    return LeaseTable(default_ttl_s=30.0, clock=clock,
                      on_release=lambda lease, reason: released.append((lease.lease_id, reason)))


def test_create_and_check(table: LeaseTable, clock: FakeClock) -> None:
    lease = table.create("a", [4, 2, 9], readers=2)
    assert lease.block_ids == (4, 2, 9) and lease.readers == 2
    assert lease.expires_at == clock.t + 30.0
    assert table.check("a") == lease and "a" in table and len(table) == 1
    assert table.stats().leased_blocks == 3 and table.stats().active_leases == 1
    with pytest.raises(ValueError, match="already exists"):
        table.create("a", [1], readers=1)
    with pytest.raises(ValueError):
        table.create("b", [1], readers=0)
    with pytest.raises(ValueError):
        table.create("b", [1], readers=1, ttl_s=0)
    assert table.create("c", [1], readers=1, ttl_s=5).expires_at == clock.t + 5


def test_unknown_lease(table: LeaseTable) -> None:
    with pytest.raises(LeaseError) as e:
        table.check("nope")
    assert e.value.code == "unknown_lease"
    with pytest.raises(LeaseError):
        table.confirm("nope", "r")
    assert table.release("nope") is False


def test_expiry_on_check_fails_and_frees(table: LeaseTable, clock: FakeClock,
                                         released: list[tuple[str, str]]) -> None:
    table.create("a", [1, 2], readers=1)
    clock.t += 29.999
    table.check("a")  # still live just before the deadline
    clock.t += 0.001  # expires_at itself is expired
    with pytest.raises(LeaseError) as e:
        table.check("a")
    assert e.value.code == "expired_lease"
    assert released == [("a", "expired")]
    # A late reader still learns it expired (not "unknown"), and nothing is freed twice.
    with pytest.raises(LeaseError) as e:
        table.pin("a")
    assert e.value.code == "expired_lease"
    assert released == [("a", "expired")]
    s = table.stats()
    assert (s.active_leases, s.leased_blocks, s.expired_total) == (0, 0, 1)
    # The id can be reused by a new lease.
    table.create("a", [3], readers=1)
    assert table.check("a").block_ids == (3,)


def test_expire_sweep(table: LeaseTable, clock: FakeClock,
                      released: list[tuple[str, str]]) -> None:
    table.create("short", [1], readers=1, ttl_s=1)
    table.create("long", [2, 3], readers=1, ttl_s=10)
    assert table.expire() == []
    clock.t += 5
    assert [lease.lease_id for lease in table.expire()] == ["short"]
    assert released == [("short", "expired")]
    assert [lease.lease_id for lease in table.expire(now=clock.t + 100)] == ["long"]
    assert table.stats().expired_total == 2 and table.stats().leased_blocks == 0


def test_confirm_all_readers(table: LeaseTable, released: list[tuple[str, str]]) -> None:
    table.create("a", [1, 2, 3], readers=2)
    assert table.confirm("a", "gen0") is False
    assert table.confirm("a", "gen0") is False  # a repeated confirm counts once
    assert released == []
    assert table.confirm("a", "gen1") is True
    assert released == [("a", "confirmed")]
    with pytest.raises(LeaseError) as e:
        table.check("a")
    assert e.value.code == "unknown_lease"
    s = table.stats()
    assert (s.confirmed_total, s.leased_blocks, s.active_leases) == (1, 0, 0)


def test_confirm_expired_raises(table: LeaseTable, clock: FakeClock,
                                released: list[tuple[str, str]]) -> None:
    table.create("a", [1], readers=1)
    clock.t += 31
    with pytest.raises(LeaseError) as e:
        table.confirm("a", "r")
    assert e.value.code == "expired_lease"
    assert released == [("a", "expired")]


def test_release_abort_path(table: LeaseTable, released: list[tuple[str, str]]) -> None:
    table.create("a", [5], readers=3)
    assert table.release("a") is True
    assert table.release("a") is False
    assert released == [("a", "released")]
    assert table.stats().released_total == 1


def test_pin_defers_the_free_until_the_read_is_done(
    table: LeaseTable, clock: FakeClock, released: list[tuple[str, str]]
) -> None:
    table.create("a", [1, 2], readers=1)
    table.pin("a")
    table.pin("a")  # two reads in flight
    assert table.release("a") is True
    assert released == []  # blocks still under a transfer
    with pytest.raises(LeaseError):
        table.check("a")  # but no new read may start
    assert table.stats().leased_blocks == 2
    table.unpin("a")
    assert released == []
    table.unpin("a")
    assert released == [("a", "released")]
    assert table.stats().leased_blocks == 0
    with pytest.raises(ValueError):
        table.unpin("a")


def test_expiry_while_pinned(table: LeaseTable, clock: FakeClock,
                             released: list[tuple[str, str]]) -> None:
    table.create("a", [1], readers=1)
    table.pin("a")
    clock.t += 100
    assert [lease.lease_id for lease in table.expire()] == ["a"]
    assert released == []
    table.unpin("a")
    assert released == [("a", "expired")]


def test_callback_error_is_contained(clock: FakeClock) -> None:
    def boom(lease: object, reason: str) -> None:
        raise RuntimeError("owner bug")

    t = LeaseTable(clock=clock, on_release=boom)
    t.create("a", [1], readers=1)
    assert t.confirm("a", "r") is True  # no exception escapes
    assert t.stats().leased_blocks == 0


def test_concurrent_confirms_release_exactly_once(released: list[tuple[str, str]]) -> None:
    t = LeaseTable(on_release=lambda lease, reason: released.append((lease.lease_id, reason)))
    n = 8
    for i in range(50):
        t.create(f"l{i}", [i], readers=n)
    wins: list[bool] = []
    lock = threading.Lock()

    def reader(r: int) -> None:
        for i in range(50):
            done = t.confirm(f"l{i}", f"r{r}")
            with lock:
                wins.append(done)

    threads = [threading.Thread(target=reader, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert sum(wins) == 50 and len(released) == 50
    assert t.stats().leased_blocks == 0


# ---- stats ---------------------------------------------------------------------------------


def test_transfer_stats(clock: FakeClock) -> None:
    s = TransferStats(buckets=(0.001, 0.01, 0.1))
    s.record_transfer(1000, 2, 0.0005)
    s.record_transfer(3000, 3, 0.01, zero_copy=True)  # on a bound: counts in that bucket
    s.record_transfer(5000, 1, 7.0)
    s.record_failure("expired_lease")
    s.record_failure("expired_lease")
    s.record_failure("unauthorized")
    leases = LeaseTable(clock=clock)
    leases.create("a", [1, 2, 3], readers=1)
    s.bind_leases(leases)
    snap = s.snapshot()
    assert (snap.transfers, snap.bytes_transferred, snap.blocks_transferred) == (3, 9000, 6)
    assert snap.zero_copy_transfers == 1
    assert snap.failed_transfers == 3
    assert snap.failures_by_code == (("expired_lease", 2), ("unauthorized", 1))
    assert snap.latency_buckets == ((0.001, 1), (0.01, 2), (0.1, 2), (float("inf"), 3))
    assert snap.latency_count == 3 and snap.latency_sum_s == pytest.approx(7.0105)
    assert snap.recent_latencies_s == (0.0005, 0.01, 7.0)
    assert snap.leased_blocks_held == 3 and snap.active_leases == 1
    clock.t += 100
    leases.expire()
    assert s.snapshot().expired_leases == 1 and s.snapshot().leased_blocks_held == 0


# ---- wire messages / factory ---------------------------------------------------------------


def test_read_request_validation_and_wire_roundtrip() -> None:
    r = ReadRequest("L", [3, 1], [0, 2], [1, 3], num_tokens=9, format="tokens")
    assert r.block_ids == (3, 1) and r.layer_slice == (0, 2) and r.head_slice == (1, 3)
    msg = decode_header(encode_header(r.to_wire("float32", 64))[4:])
    assert msg["op"] == "READ" and msg["nbytes"] == 64 and "token" not in msg
    assert ReadRequest.from_wire(msg) == r
    for bad in (
        dict(block_ids=[]), dict(block_ids=[-1]), dict(layer_slice=(2, 2)),
        dict(head_slice=(0,)), dict(format="rows"), dict(format="tokens", num_tokens=0),
        dict(lease_id=""),
    ):
        kw = dict(lease_id="L", block_ids=[1], layer_slice=(0, 1), head_slice=(0, 1))
        kw.update(bad)
        with pytest.raises(ValueError):
            ReadRequest(**kw)  # type: ignore[arg-type]
    with pytest.raises(TransferError) as e:
        ReadRequest.from_wire({"lease_id": "L"})
    assert e.value.code == "bad_request"


def test_header_limits() -> None:
    with pytest.raises(ProtocolError):
        header_length((1 << 30).to_bytes(4, "big"))
    with pytest.raises(ProtocolError):
        decode_header(b"[1, 2]")
    with pytest.raises(ProtocolError):
        decode_header(b"\xff")
    with pytest.raises(ProtocolError):
        encode_header({"x": "y" * (1 << 20)})


def test_factory_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert make_backend("TCP").name == "tcp"
    assert make_backend("tcp").name == "tcp"
    assert make_backend({"backend": "Tcp"}).name == "tcp"
    assert make_backend("UCX").name == "ucx"  # constructing it does not import ucxx
    assert CacheTransceiverConfig.from_dict({"backend": "ucx"}).backend == "UCX"
    assert CacheTransceiverConfig.from_dict(None).backend == "UCX"
    with pytest.raises(ValueError):
        make_backend("nixl")
    with pytest.raises(ValueError):
        CacheTransceiverConfig.from_dict({"backend": "TCP", "bogus": 1})
    assert parse_address("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert parse_address("[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError):
        parse_address("nohost")
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", "from-env")
    assert resolve_cluster_token(None) == "from-env"
    assert resolve_cluster_token("cfg") == "cfg"
    monkeypatch.delenv("DISAGG_CLUSTER_TOKEN")
    with pytest.raises(ValueError):
        resolve_cluster_token(None)
