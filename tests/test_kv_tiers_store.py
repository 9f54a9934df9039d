"""The byte stores of the KV offload tiers (``disagg/engine/kv_tiers.py``) on the CPU: exact
round trips, corrupted bytes refused with the target block untouched, the disk tier's pending
writes, removals, folder lock, emptying at start, and a failed write that disables it."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from disagg.config import ConfigError
from disagg.engine import kv_tiers
from disagg.engine.kv_tiers import HEADER_BYTES, DiskTier, HostTier, _runs
from disagg.transfer.integrity import payload_checksum

BLOCK_SHAPE = (2, 2, 2, 4, 8)  # layers, parts, heads, tokens per block, width
DTYPES = [torch.float32, torch.bfloat16]


def make_cache(num_blocks: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *BLOCK_SHAPE), generator=g).to(dtype)


def checksum(block: torch.Tensor) -> str:
    return payload_checksum([block])


@pytest.fixture
def disk_tiers(tmp_path: Path) -> Iterator[Callable[..., DiskTier]]:
    """``make(folder=None, dtype=float32)``: a DiskTier, closed (writer joined) at teardown."""
    made: list[DiskTier] = []

    def make(folder: Path | None = None, dtype: torch.dtype = torch.float32) -> DiskTier:
        tier = DiskTier(str(folder or tmp_path / "kv"), BLOCK_SHAPE, dtype)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
        assert not tier._writer.is_alive()


class BlockedWrites:
    """Replaces the writer's file output: each write waits until ``release`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        real = kv_tiers._write_block_file

        def blocked(path: str, header: bytes, payload: memoryview) -> None:
            self.started.set()
            assert self.release.wait(10), "the test never released the write"
            real(path, header, payload)

        monkeypatch.setattr(kv_tiers, "_write_block_file", blocked)


# ---- host tier --------------------------------------------------------------------------------

def test_runs_groups_consecutive_values() -> None:
    assert _runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (3, 4), (4, 6)]
    assert _runs([4]) == [(0, 1)]
    assert _runs([]) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_round_trip_exact(dtype: torch.dtype) -> None:
    kv = make_cache(8, dtype)
    original = kv.clone()
    tier = HostTier(BLOCK_SHAPE, dtype, num_slots=6, pin=False)
    assert tier.block_bytes == kv[0].numel() * kv.element_size()
    # slots out of order and not all consecutive: several copy runs
    slots, blocks = [4, 0, 1, 5], [1, 6, 3, 2]
    tier.store(slots, kv, blocks)
    kv.zero_()  # the device blocks are reused once store returns
    for slot, block in zip(slots, blocks, strict=True):
        target = 7 - block
        assert tier.load(slot, kv, target)
        assert torch.equal(kv[target], original[block])
        data, sums = tier.block(slot)
        assert torch.equal(data, original[block]) and sums == checksum(original[block])
    untouched = [b for b in range(8) if b not in {7 - x for x in blocks}]
    assert not kv[untouched].any()


def test_host_store_in_several_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_cache(6, torch.float32)
    tier = HostTier(BLOCK_SHAPE, torch.float32, num_slots=6, pin=False)
    monkeypatch.setattr(kv_tiers, "_GATHER_BYTES", 2 * tier.block_bytes)
    tier.store([5, 4, 3, 2, 1], kv, [0, 1, 2, 3, 4])
    for slot, block in zip([5, 4, 3, 2, 1], range(5), strict=True):
        assert torch.equal(tier.data[slot], kv[block])
        assert tier.block(slot)[1] == checksum(kv[block])


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_flipped_byte_is_refused(dtype: torch.dtype,
                                      caplog: pytest.LogCaptureFixture) -> None:
    kv = make_cache(4, dtype)
    tier = HostTier(BLOCK_SHAPE, dtype, num_slots=3, pin=False)
    tier.store([2], kv, [0])
    tier.data[2].view(-1).view(torch.uint8)[13] ^= 0x10
    before = kv.clone()
    with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers"):
        assert not tier.load(2, kv, 3)
    assert torch.equal(kv, before)
    assert "slot 2" in caplog.text


def test_host_slot_never_stored_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    kv = make_cache(2, torch.float32)
    tier = HostTier(BLOCK_SHAPE, torch.float32, num_slots=2, pin=False)
    before = kv.clone()
    with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers"):
        assert not tier.load(1, kv, 0)
    assert torch.equal(kv, before) and "slot 1" in caplog.text
    with pytest.raises(LookupError, match="slot 1"):
        tier.block(1)


def test_host_bad_arguments() -> None:
    kv = make_cache(2, torch.float32)
    tier = HostTier(BLOCK_SHAPE, torch.float32, num_slots=2, pin=False)
    with pytest.raises(ValueError, match="2 slots for 1 blocks"):
        tier.store([0, 1], kv, [0])
    with pytest.raises(ValueError, match="twice"):
        tier.store([1, 1], kv, [0, 1])
    with pytest.raises(ValueError, match="out of range"):
        tier.store([2], kv, [0])
    with pytest.raises(ValueError, match="tier holds"):
        tier.store([0], kv.to(torch.bfloat16), [0])
    with pytest.raises(ValueError, match="num_slots"):
        HostTier(BLOCK_SHAPE, torch.float32, num_slots=0, pin=False)


# ---- disk tier --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_disk_round_trip_exact(dtype: torch.dtype, disk_tiers: Callable[..., DiskTier],
                               tmp_path: Path) -> None:
    tier = disk_tiers(dtype=dtype)
    kv = make_cache(6, dtype)
    keys = [0, 1 << 63, (1 << 64) - 1]
    for key, block in zip(keys, range(3), strict=True):
        tier.write(key, kv[block].clone(), checksum(kv[block]))
    assert tier.flush()
    assert not tier.pending
    for key in keys:
        assert os.path.getsize(tmp_path / "kv" / f"{key:016x}.kv") == tier.file_bytes
    assert tier.file_bytes == HEADER_BYTES + kv[0].numel() * kv.element_size()
    for key, block in zip(keys, range(3), strict=True):
        assert tier.read_into(key, kv, block + 3)
        assert torch.equal(kv[block + 3], kv[block])


def test_disk_read_before_the_write_finished(disk_tiers: Callable[..., DiskTier],
                                             monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    writes = BlockedWrites(monkeypatch)
    tier = disk_tiers()
    kv = make_cache(2, torch.float32)
    tier.write(7, kv[0].clone(), checksum(kv[0]))
    assert writes.started.wait(10)  # the writer holds it: no file yet
    assert not (tmp_path / "kv" / f"{7:016x}.kv").exists()
    assert tier.read_into(7, kv, 1)
    assert torch.equal(kv[1], kv[0])
    writes.release.set()
    assert tier.flush()
    assert (tmp_path / "kv" / f"{7:016x}.kv").exists() and not tier.pending


def test_disk_pending_checksum_is_checked(disk_tiers: Callable[..., DiskTier],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    writes = BlockedWrites(monkeypatch)
    tier = disk_tiers()
    kv = make_cache(2, torch.float32)
    data = kv[0].clone()
    tier.write(7, data, checksum(kv[0]))
    data.view(-1)[3] += 1  # the bytes changed in memory before the write
    before = kv.clone()
    assert not tier.read_into(7, kv, 1)
    assert torch.equal(kv, before)
    writes.release.set()
    assert tier.flush()


def _flip_payload(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 21] ^= 0x01
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:-5])


def _flip_magic(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF
    path.write_bytes(bytes(raw))


def _wrong_dtype(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.index(b"float32", 0, HEADER_BYTES)
    raw[at:at + 7] = b"int32\x00\x00"
    path.write_bytes(bytes(raw))


def _flip_header_checksum(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    at = kv_tiers._HEADER.size - 1  # last hex digit of the recorded checksum
    raw[at] = ord("0") if raw[at] != ord("0") else ord("1")
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("corrupt", [_flip_payload, _truncate, _flip_magic, _wrong_dtype,
                                     _flip_header_checksum])
def test_disk_corrupt_file_is_refused(corrupt: Callable[[Path], None],
                                      disk_tiers: Callable[..., DiskTier], tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    tier = disk_tiers()
    kv = make_cache(3, torch.float32)
    tier.write(0xABC, kv[0].clone(), checksum(kv[0]))
    assert tier.flush()
    path = tmp_path / "kv" / f"{0xABC:016x}.kv"
    corrupt(path)
    before = kv.clone()
    with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers"):
        assert not tier.read_into(0xABC, kv, 2)
    assert torch.equal(kv, before)
    assert f"{0xABC:016x}" in caplog.text


def test_disk_renamed_file_is_refused(disk_tiers: Callable[..., DiskTier], tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    tier = disk_tiers()
    kv = make_cache(3, torch.float32)
    tier.write(1, kv[0].clone(), checksum(kv[0]))
    assert tier.flush()
    folder = tmp_path / "kv"
    os.replace(folder / f"{1:016x}.kv", folder / f"{2:016x}.kv")
    before = kv.clone()
    with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers"):
        assert not tier.read_into(2, kv, 2)  # the header names block 1
        assert not tier.read_into(1, kv, 2)  # no file
    assert torch.equal(kv, before)
    assert "holds block 0000000000000001" in caplog.text and "does not exist" in caplog.text


def test_disk_remove_pending_and_written(disk_tiers: Callable[..., DiskTier],
                                         monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    kv = make_cache(3, torch.float32)
    tier = disk_tiers()
    tier.write(1, kv[0].clone(), checksum(kv[0]))
    assert tier.flush()
    assert (folder / f"{1:016x}.kv").exists()
    tier.remove(1)  # written: its file goes
    assert tier.flush()
    assert not (folder / f"{1:016x}.kv").exists()
    assert not tier.read_into(1, kv, 2)

    writes = BlockedWrites(monkeypatch)
    tier.write(2, kv[0].clone(), checksum(kv[0]))  # taken by the writer, blocked
    tier.write(3, kv[1].clone(), checksum(kv[1]))  # queued behind it
    assert writes.started.wait(10)
    tier.remove(2)  # under way: deleted after its write
    tier.remove(3)  # not started: cancelled
    assert not tier.pending
    writes.release.set()
    assert tier.flush()
    assert not list(folder.glob("*.kv")) and not list(folder.glob("*.tmp"))
    before = kv.clone()
    assert not tier.read_into(2, kv, 2) and not tier.read_into(3, kv, 2)
    assert torch.equal(kv, before)


def test_disk_rewrite_after_remove_keeps_the_file(disk_tiers: Callable[..., DiskTier],
                                                  tmp_path: Path) -> None:
    kv = make_cache(3, torch.float32)
    tier = disk_tiers()
    tier.write(5, kv[0].clone(), checksum(kv[0]))
    tier.remove(5)
    tier.write(5, kv[1].clone(), checksum(kv[1]))
    assert tier.flush()
    assert tier.read_into(5, kv, 2)
    assert torch.equal(kv[2], kv[1])


def test_disk_start_empties_the_folder(disk_tiers: Callable[..., DiskTier],
                                       tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / f"{9:016x}.kv").write_bytes(b"old block")
    (folder / f"{8:016x}.kv.tmp").write_bytes(b"torn")
    (folder / "notes.txt").write_text("not ours")
    tier = disk_tiers()
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "notes.txt"]
    kv = make_cache(1, torch.float32)
    assert not tier.read_into(9, kv, 0)


def test_disk_folder_in_use_by_another_process(disk_tiers: Callable[..., DiskTier],
                                               tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir()
    ready = tmp_path / "locked"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys\n"
         f"fd = os.open({str(folder / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         f"open({str(ready)!r}, 'w').close()\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(ConfigError) as info:
            DiskTier(str(folder), BLOCK_SHAPE, torch.float32)
        msg = str(info.value)
        assert msg.startswith("kv_offload_disk_dir: ") and str(folder) in msg
        assert "another worker" in msg
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        try:
            holder.wait(10)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait(10)
    tier = disk_tiers()  # its holder is gone: the folder is free again
    kv = make_cache(2, torch.float32)
    tier.write(1, kv[0].clone(), checksum(kv[0]))
    assert tier.flush() and tier.read_into(1, kv, 1)


def test_disk_second_tier_in_one_process_is_refused(disk_tiers: Callable[..., DiskTier],
                                                    tmp_path: Path) -> None:
    disk_tiers()
    with pytest.raises(ConfigError, match="kv_offload_disk_dir: .* in use by another worker"):
        DiskTier(str(tmp_path / "kv"), BLOCK_SHAPE, torch.float32)


def test_disk_write_failure_disables(disk_tiers: Callable[..., DiskTier],
                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[str, str]] = []

    def full(path: str, header: bytes, payload: memoryview) -> None:
        with open(path, "wb") as f:
            f.write(header)
        raise OSError(errno.ENOSPC, "No space left on device")

    tier = disk_tiers()
    tier.on_disabled = lambda reason: calls.append((threading.current_thread().name, reason))
    kv = make_cache(3, torch.float32)
    tier.write(1, kv[0].clone(), checksum(kv[0]))
    assert tier.flush()  # the first write succeeds
    monkeypatch.setattr(kv_tiers, "_write_block_file", full)
    with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers"):
        tier.write(2, kv[1].clone(), checksum(kv[1]))
        tier.write(3, kv[2].clone(), checksum(kv[2]))
        assert tier.flush()
        assert tier.disabled
        tier.write(4, kv[0].clone(), checksum(kv[0]))  # a no-op now
        assert tier.flush()
    assert not tier.pending
    assert len(calls) == 1 and calls[0][0] == "kv-disk-writer"
    assert "No space left" in calls[0][1]
    disabled_logs = [r for r in caplog.records if "disabled" in r.getMessage()]
    assert len(disabled_logs) == 1 and str(tmp_path / "kv") in disabled_logs[0].getMessage()
    before = kv.clone()
    assert not tier.read_into(1, kv, 2)  # its file is fine, but the tier is off
    assert torch.equal(kv, before)
    folder = tmp_path / "kv"
    assert not list(folder.glob("*.tmp")) and not (folder / f"{4:016x}.kv").exists()
    tier.close()
    assert not tier._writer.is_alive()
    tier.close()  # idempotent


def test_disk_closed_tier_is_inert(disk_tiers: Callable[..., DiskTier]) -> None:
    tier = disk_tiers()
    kv = make_cache(2, torch.float32)
    tier.close()
    tier.write(1, kv[0].clone(), checksum(kv[0]))
    tier.remove(1)
    assert not tier.pending and not tier.read_into(1, kv, 1)
    assert not os.path.exists(os.path.join(tier.folder, f"{1:016x}.kv"))


def test_disk_bad_write_arguments(disk_tiers: Callable[..., DiskTier]) -> None:
    tier = disk_tiers()
    kv = make_cache(2, torch.float32)
    for key in (-1, 1 << 64):
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            tier.write(key, kv[0], checksum(kv[0]))
    with pytest.raises(ValueError, match="tier holds"):
        tier.write(1, kv[0].to(torch.bfloat16), checksum(kv[0]))
    with pytest.raises(ValueError, match="tier holds"):
        tier.write(1, kv[:1], checksum(kv[0]))
    with pytest.raises(ValueError, match="16 hex digits"):
        tier.write(1, kv[0], checksum(kv[0]) + "00")


def test_disk_real_full_disk(disk_tiers: Callable[..., DiskTier], tmp_path: Path) -> None:
    """A tmpfs of 64 KiB fills up: the tier disables itself (root only, else skipped)."""
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or mount is None or umount is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    small = tmp_path / "small"
    small.mkdir()
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                          capture_output=True, timeout=30)
    if done.returncode:
        pytest.skip(f"mount not permitted: {done.stderr.decode().strip()}")
    tier: DiskTier | None = None
    try:
        tier = DiskTier(str(small), BLOCK_SHAPE, torch.float32)
        reasons: list[str] = []
        tier.on_disabled = reasons.append
        kv = make_cache(1, torch.float32)
        # 64 KiB hold fewer blocks than this (tmpfs counts whole pages per file)
        for key in range(2 * (64 << 10) // tier.file_bytes + 2):
            tier.write(key, kv[0].clone(), checksum(kv[0]))
        assert tier.flush()
        assert tier.disabled and len(reasons) == 1
        assert "No space left" in reasons[0] and str(small) in reasons[0]
        assert not list(small.glob("*.tmp"))
        assert not tier.read_into(0, kv, 0)
        tier.close()
        assert not tier._writer.is_alive()
    finally:
        if tier is not None:
            tier.close()
        subprocess.run([umount, str(small)], capture_output=True, timeout=30, check=True)
