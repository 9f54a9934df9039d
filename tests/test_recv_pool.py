"""The generation side's receive-buffer pool (disagg/kv_connector/recv_pool.py)."""

from __future__ import annotations

import pytest
import torch

from disagg.kv_connector.recv_pool import ReceivePool


def test_reuses_the_smallest_fitting_buffer() -> None:
    pool = ReceivePool(max_bytes=1 << 20)
    out, base = pool.take((4, 8), torch.float32)
    assert out.shape == (4, 8) and out.dtype == torch.float32 and out.is_contiguous()
    assert out.data_ptr() == base.data_ptr() and base.numel() == 4 * 8 * 4
    pool.give(base)
    small, small_base = pool.take((2, 8), torch.float32)  # fits in the kept buffer
    assert small_base.data_ptr() == base.data_ptr() and pool.allocations == 1
    assert small.shape == (2, 8)
    _, other = pool.take((4, 8), torch.float32)  # the only free buffer is lent out
    assert other.data_ptr() != base.data_ptr() and pool.allocations == 2


def test_keeps_at_most_max_bytes_largest_first() -> None:
    pool = ReceivePool(max_bytes=1000)
    bases = [pool.take((n,), torch.uint8)[1] for n in (600, 300, 200)]
    for b in bases:
        pool.give(b)
    assert pool.free_bytes == 900  # 600 + 300; 200 more would pass the cap
    assert ReceivePool(0).free_bytes == 0
    off = ReceivePool(0)
    off.give(off.take((8,), torch.uint8)[1])
    assert off.free_bytes == 0  # DISAGG_KV_RECV_POOL=0: a fresh buffer every read
    with pytest.raises(ValueError):
        ReceivePool(-1)


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_KV_RECV_POOL", "0")
    assert ReceivePool.from_env().max_bytes == 0
    monkeypatch.setenv("DISAGG_KV_RECV_POOL", "1")
    assert ReceivePool.from_env().max_bytes > 0
