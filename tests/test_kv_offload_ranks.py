"""Rank 0's side of a multi-rank worker's offload tiers, in one process: ``KVOffload`` over
rank 0's KV cache slice drives a ``RankOffload`` over rank 1's through in-process peers (the
messages and events the executor's pipes carry, handled in order). A load counts the blocks
every rank installed; a block that fails on one rank only is recomputed and forgotten on all;
a rank whose disk writer falls behind skips writes and rank 0 forgets those blocks; sizes are
the worker's (a block is its slices on every rank)."""

from __future__ import annotations

import errno
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from disagg.config import CacheConfig, ConfigError
from disagg.engine import kv_offload, kv_tiers
from disagg.engine.kv_offload import KVOffload, LoadDone
from disagg.engine.kv_offload_messages import TierEvent, TierMessage, TierSetup, TierSetupReply
from disagg.engine.kv_offload_rank import RankOffload
from disagg.engine.kv_tiers import HEADER_BYTES
from disagg.scheduler import KVLoad

# rank 0 holds the first layer, rank 1 the second (a pp=2 split): a block is both slices
SHAPE0 = (1, 2, 2, 4, 8)
SHAPE1 = (1, 2, 2, 4, 8)
NUM_BLOCKS = 16
GIB = 1 << 30


def _bytes(shape: tuple[int, ...]) -> int:
    n = 4
    for d in shape:
        n *= d
    return n


BLOCK_BYTES = _bytes(SHAPE0) + _bytes(SHAPE1)


class InProcessPeers:
    """The executor's ``TierPeers`` for one other rank living in this process: messages are
    handled at once, in order; events queue until taken (as from the event pipe)."""

    world_size = 2

    def __init__(self, kv1: torch.Tensor) -> None:
        self.kv1 = kv1
        self.kv_block_bytes = [_bytes(SHAPE0), _bytes(SHAPE1)]
        self.rank1: RankOffload | None = None
        self.events: deque[TierEvent] = deque()
        self.sent: list[TierMessage] = []
        self._callback: Callable[[], None] = lambda: None
        self._lock = threading.Lock()

    def _emit(self, ev: TierEvent) -> None:
        with self._lock:
            self.events.append(ev)
        self._callback()

    def send_all(self, msg: TierMessage) -> None:
        self.sent.append(msg)
        assert self.rank1 is not None
        self.rank1.handle(msg)

    def ask_all(self, msg: TierMessage, kind: type, timeout_s: float) -> list[object]:
        assert isinstance(msg, TierSetup) and kind is TierSetupReply
        try:
            self.rank1 = RankOffload(msg, 1, self.kv1, self._emit)
        except Exception as e:  # noqa: BLE001 - as worker._open_tiers answers
            return [TierSetupReply(1, str(e))]
        return [TierSetupReply(1, None)]

    def take_tier_events(self) -> list[TierEvent]:
        with self._lock:
            out = list(self.events)
            self.events.clear()
        return out

    def on_tier_event(self, callback: Callable[[], None]) -> None:
        self._callback = callback


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Callable[..., tuple[KVOffload, InProcessPeers]]]:
    """``make(host_blocks, disk_blocks)``: rank 0's KVOffload and its in-process rank 1."""
    made: list[tuple[KVOffload, InProcessPeers]] = []

    def make(host_blocks: int | None, disk_blocks: int | None
             ) -> tuple[KVOffload, InProcessPeers]:
        g = torch.Generator().manual_seed(len(made))
        kv0 = torch.randn((NUM_BLOCKS, *SHAPE0), generator=g)
        kv1 = torch.randn((NUM_BLOCKS, *SHAPE1), generator=g)
        cache = CacheConfig(
            tokens_per_block=4,
            kv_offload_host_gib=host_blocks * BLOCK_BYTES / GIB if host_blocks else None,
            kv_offload_disk_dir=str(tmp_path / "tier") if disk_blocks else None,
            kv_offload_disk_gib=(disk_blocks * (BLOCK_BYTES + 2 * HEADER_BYTES) / GIB
                                 if disk_blocks else None))
        peers = InProcessPeers(kv1)
        offload = KVOffload(cache, kv0, peers=peers)
        made.append((offload, peers))
        return offload, peers

    yield make
    for offload, peers in made:
        offload.close()
        if peers.rank1 is not None:
            peers.rank1.close()


def _wait_done(offload: KVOffload, timeout: float = 10.0) -> list[LoadDone]:
    deadline = time.monotonic() + timeout
    while True:
        done = offload.poll(lambda rid: True)
        if done:
            return done
        assert time.monotonic() < deadline, "the load did not finish on every rank"
        offload.wait(0.05)


def test_sizes_are_the_workers_and_rank_1_opens_its_own_folder(pair, tmp_path) -> None:
    # what a worker of more ranks left behind when it did not stop cleanly
    worker0 = tmp_path / "tier" / "worker-0"
    for r in (1, 3):
        (worker0 / f"rank-{r}").mkdir(parents=True)
        (worker0 / f"rank-{r}" / f"{r:016x}.kv").write_bytes(b"old")
    offload, peers = pair(6, 10)
    assert list((worker0 / "rank-1").glob("*.kv")) == []  # emptied by rank 1
    assert list((worker0 / "rank-3").glob("*.kv")) == []  # by rank 0: no rank 3 here
    assert offload.index.host_capacity == 6 and offload.index.disk_capacity == 10
    assert peers.rank1 is not None and peers.rank1.stores.host is not None
    assert peers.rank1.stores.host.num_slots == 6
    assert offload.disk is not None and offload.disk.folder == str(tmp_path / "tier" / "worker-0")
    disk1 = peers.rank1.stores.disk
    assert disk1 is not None and disk1.folder == str(tmp_path / "tier" / "worker-0" / "rank-1")


def test_a_rank_that_cannot_open_its_tiers_fails_the_start(pair, tmp_path) -> None:
    (tmp_path / "tier" / "worker-0").mkdir(parents=True)
    (tmp_path / "tier" / "worker-0" / "rank-1").write_text("a file, not a folder")
    with pytest.raises(ConfigError, match=r"kv_offload_disk_dir: .*rank-1.* \(on rank 1\)"):
        pair(None, 10)
    # rank 0 released its folder: the next worker takes it again
    (tmp_path / "tier" / "worker-0" / "rank-1").unlink()
    offload, _ = pair(None, 10)
    assert offload.disk is not None and offload.disk.folder == str(tmp_path / "tier" / "worker-0")


def test_a_block_failing_on_one_rank_is_recomputed_and_forgotten_everywhere(pair) -> None:
    offload, peers = pair(8, None)
    kv0, kv1 = offload.kv_cache, peers.kv1
    hashes = [101, 102, 103, 104]
    offload.offload([(b, h) for b, h in enumerate(hashes)])  # blocks 0..3 evicted: to host
    want0, want1 = kv0[:4].clone(), kv1[:4].clone()
    kv0[:4].fill_(1.0)  # the blocks are reused: their bytes are gone from the KV cache
    kv1[:4].fill_(1.0)
    assert offload.index.host_order() == hashes
    # rank 1's copy of the third block is corrupted in its host tier, rank 0's is intact
    assert peers.rank1 is not None and peers.rank1.stores.host is not None
    peers.rank1.stores.host.data[offload.index.host_slot(103)].fill_(7.0)
    offload.index.pin(hashes)
    offload.start([KVLoad("r1", [8, 9, 10, 11], hashes)])
    assert offload.busy
    [done] = _wait_done(offload)
    offload.index.unpin(hashes)
    # rank 0 installed all four, rank 1 two: two count (the rest is computed)
    assert (done.request_id, done.num_loaded, done.bad) == ("r1", 2, 103)
    assert (done.from_host, done.from_disk) == (2, 0)
    assert torch.equal(kv0[8:10], want0[:2]) and torch.equal(kv1[8:10], want1[:2])
    assert not (kv1[10] == 7.0).all()  # the corrupted slice was not installed
    assert offload.index.lookup(103) is None and offload.index.lookup(104) == "host"
    s = offload.stats()
    assert (s.loaded_host, s.failed_loads, s.stored_host) == (2, 1, 4)
    assert not offload.busy


def test_disk_loads_count_what_every_rank_read(pair) -> None:
    offload, peers = pair(None, 8)
    kv0, kv1 = offload.kv_cache, peers.kv1
    hashes = [201, 202, 203]
    offload.offload([(b, h) for b, h in enumerate(hashes)])
    want0, want1 = kv0[:3].clone(), kv1[:3].clone()
    assert offload.disk is not None and offload.disk.flush()
    assert peers.rank1 is not None and peers.rank1.stores.disk is not None
    assert peers.rank1.stores.disk.flush()
    offload.index.pin(hashes)
    offload.start([KVLoad("r2", [12, 13, 14], hashes)])
    [done] = _wait_done(offload)
    assert (done.num_loaded, done.bad, done.from_disk) == (3, None, 3)
    assert torch.equal(kv0[12:15], want0) and torch.equal(kv1[12:15], want1)


def test_a_rank_whose_disk_writer_is_behind_skips_and_rank_0_forgets(pair, monkeypatch) -> None:
    """Rank 1's disk writes hang (its writer falls behind): past MAX_DISK_QUEUE it skips
    them and says so; rank 0 forgets those blocks and deletes its own files of them."""
    offload, peers = pair(None, 8)
    monkeypatch.setattr(kv_offload, "MAX_DISK_QUEUE", 2)
    release = threading.Event()
    real_write = kv_tiers._write_block_file

    def write(path: str, header: bytes, payload: memoryview) -> None:
        if "rank-1" in path:
            release.wait(10)
        real_write(path, header, payload)

    monkeypatch.setattr(kv_tiers, "_write_block_file", write)
    assert offload.disk is not None
    try:
        for b in range(5):  # one block a plan; rank 0's writer keeps up
            offload.offload([(b, 300 + b)])
            assert offload.disk.flush()
        offload.offload([])  # takes rank 1's events
        s = offload.stats()
        # rank 1's writer holds two blocks (one being written): the next three are skipped
        assert s.dropped_disk == 3 and s.stored_disk == 5
        kept = offload.index.disk_order()
        assert kept == [300, 301]
        assert offload.disk.flush()
        files = {p.name for p in Path(offload.disk.folder).glob("*.kv")}
        assert files == {f"{h:016x}.kv" for h in kept}
    finally:
        release.set()


def test_a_failed_disk_on_rank_1_turns_the_disk_tier_off(pair, monkeypatch) -> None:
    """Rank 1's disk is full (rank 0's is fine): the worker's disk tier is off."""
    offload, peers = pair(2, 8)
    real_write = kv_tiers._write_block_file

    def full_on_rank_1(path: str, header: bytes, payload: memoryview) -> None:
        if "rank-1" in path:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, header, payload)

    monkeypatch.setattr(kv_tiers, "_write_block_file", full_on_rank_1)
    offload.offload([(b, 400 + b) for b in range(4)])  # 2 to host, 2 demoted to disk
    assert offload.stats().disk_blocks == 2
    assert peers.rank1 is not None and peers.rank1.stores.disk is not None
    assert peers.rank1.stores.disk.flush() and peers.rank1.stores.disk.disabled
    assert offload.disk is not None and not offload.disk.disabled
    offload.offload([])  # takes rank 1's event
    s = offload.stats()
    assert not s.disk_enabled and s.disk_capacity == 0 and s.disk_blocks == 0
    assert s.host_blocks == 2
