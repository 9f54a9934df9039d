"""The compiled CPU decode kernel against the PyTorch gather path, on random paged layouts."""

from __future__ import annotations

import pytest
import torch

from disagg.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from disagg.model.kernels import kernels_enabled, paged_decode_kernel

KERNEL = paged_decode_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the CPU kernel did not build here "
                                  "(no C++ compiler, or DISAGG_CPU_KERNELS=0)")


def _decode_case(seed: int, s: int, hq: int, hkv: int, d: int, b: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``s`` decoding sequences of random lengths over a shuffled block pool."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5 * b, (s,), generator=g)
    nbs = [(int(n) + b - 1) // b for n in lens]
    n_blocks = sum(nbs) + 3
    kv = torch.randn(n_blocks, 3, 2, hkv, b, d, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables = torch.zeros(s, max(nbs), dtype=torch.long)
    at = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = torch.tensor(perm[at:at + nb])
        at += nb
    # The new token of sequence i sits at position lens[i] - 1.
    pos = lens - 1
    meta = AttentionMetadata(
        num_decodes=s, query_start_loc=list(range(s + 1)), seq_lens=lens.tolist(),
        block_tables=tables, slot_block=tables[torch.arange(s), pos // b],
        slot_offset=pos % b, decode_seq_lens=lens)
    q = torch.randn(s, hq, d, generator=g).to(dtype)
    return q, kv, meta


@needs_kernel
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("b", [8, 16, 32])
def test_kernel_equals_gather_path_float32(hq: int, hkv: int, b: int) -> None:
    q, kv, meta = _decode_case(hq * 100 + b, s=7, hq=hq, hkv=hkv, d=32, b=b,
                               dtype=torch.float32)
    k = torch.randn(7, hkv, 32)
    v = torch.randn(7, hkv, 32)
    ref_cache, ker_cache = kv.clone(), kv.clone()
    ref = paged_attention(q, k, v, ref_cache[:, 1], meta, 0.125, GatherWorkspace())
    got = paged_attention(q, k, v, ker_cache[:, 1], meta, 0.125, GatherWorkspace(KERNEL))
    assert torch.equal(ref_cache, ker_cache)  # both wrote the new K/V the same way
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_bfloat16_close_to_float32() -> None:
    q, kv, meta = _decode_case(5, s=5, hq=8, hkv=2, d=64, b=16, dtype=torch.float32)
    full = KERNEL(q, kv[:, 0], meta.block_tables, meta.decode_seq_lens, 0.125)
    half = KERNEL(q.bfloat16(), kv.bfloat16()[:, 0], meta.block_tables,
                  meta.decode_seq_lens, 0.125)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, rtol=2e-2, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 1)])
def test_kernel_float32_queries_over_a_16bit_cache(cache_dtype: torch.dtype, hq: int,
                                                   hkv: int) -> None:
    """kv_cache_dtype on CPU: float32 q, a float16 / bfloat16 cache. The kernel reads each
    value as the float32 it is exactly: the gather path on the same cache (its .to(q.dtype))
    gives the same numbers to float32 rounding order; the new K/V written alike."""
    q, kv, meta = _decode_case(hq + 7, s=6, hq=hq, hkv=hkv, d=64, b=16, dtype=torch.float32)
    kv = kv.to(cache_dtype)
    k = torch.randn(6, hkv, 64)
    v = torch.randn(6, hkv, 64)
    ref_cache, ker_cache = kv.clone(), kv.clone()
    ref = paged_attention(q, k, v, ref_cache[:, 1], meta, 0.125, GatherWorkspace())
    got = paged_attention(q, k, v, ker_cache[:, 1], meta, 0.125, GatherWorkspace(KERNEL))
    assert got.dtype == torch.float32
    assert torch.equal(ref_cache, ker_cache)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="not supported"):  # a 16-bit q over float32: no
        KERNEL(q.half(), kv.float()[:, 0], meta.block_tables, meta.decode_seq_lens, 0.125)


@needs_kernel
def test_kernel_rejects_bad_tables_and_lengths() -> None:
    q, kv, meta = _decode_case(9, s=2, hq=4, hkv=2, d=16, b=8, dtype=torch.float32)
    layer = kv[:, 0]
    bad = meta.block_tables.clone()
    bad[0, 0] = kv.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="block id out of range"):
        KERNEL(q, layer, bad, meta.decode_seq_lens, 1.0)
    too_long = meta.decode_seq_lens.clone()
    too_long[1] = meta.block_tables.shape[1] * 8 + 1
    with pytest.raises(RuntimeError, match="sequence length"):
        KERNEL(q, layer, meta.block_tables, too_long, 1.0)
    with pytest.raises(RuntimeError, match="not supported"):
        KERNEL(q.double(), layer, meta.block_tables, meta.decode_seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="not supported"):
        KERNEL(q.int(), layer.int(), meta.block_tables, meta.decode_seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        KERNEL(q.transpose(0, 1), layer, meta.block_tables, meta.decode_seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        KERNEL(q, layer, meta.block_tables.int(), meta.decode_seq_lens, 1.0)


def test_kernels_can_be_switched_off(monkeypatch) -> None:
    monkeypatch.setenv("DISAGG_CPU_KERNELS", "0")
    assert not kernels_enabled()
    monkeypatch.setenv("DISAGG_CPU_KERNELS", "1")
    assert kernels_enabled()


def _hold_build_lock(build_dir: str, ready: str) -> None:
    """Child process: take the build lock, say so, then hang until killed."""
    import time
    from pathlib import Path

    from disagg.model.kernel_build import build_lock

    with build_lock(Path(build_dir)):
        Path(ready).touch()
        time.sleep(600)


def test_build_lock_survives_a_killed_builder(tmp_path) -> None:
    """A builder killed mid-build (kill -9) must not block later builds: the flock dies with
    it."""
    import multiprocessing as mp
    import time

    from disagg.model.kernel_build import build_lock

    ctx = mp.get_context("spawn")
    ready = tmp_path / "ready"
    child = ctx.Process(target=_hold_build_lock, args=(str(tmp_path), str(ready)))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.is_alive() and time.monotonic() < deadline, "child never took the lock"
            time.sleep(0.05)
        child.kill()
        child.join(10)
        t0 = time.monotonic()
        with build_lock(tmp_path):
            pass
        assert time.monotonic() - t0 < 5
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
