"""The GPU-direct KV path, the parts a CPU can check: the device gather's copy plan, how the UCX
backend decides whether GPU memory may go to UCX (and says why not), the counters and result
fields that report it, and that a CPU cache never reports staging. The CUDA runs themselves are
in tests/test_gpu.py and bench/gpu/check_kv.py."""

from __future__ import annotations

import pytest
import torch
from test_transfer_service import Rig
from transfer_fixtures import BACKENDS, expected, same_bytes

from disagg.transfer import ReadRequest, TransferStats
from disagg.transfer.payload import _device_gather_views, payload_shape, plan_read
from disagg.transfer.stats import merge_snapshots
from disagg.transfer.tcp import TcpBackend
from disagg.transfer.ucx import (
    DEVICE_DIRECT_ENV,
    configure_ucx_env,
    cuda_transports,
    device_direct_wanted,
)

N, L, H, B, D = 24, 4, 4, 8, 16


def _kv(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, L, 2, H, B, D, generator=g)


@pytest.mark.parametrize("req", [
    ReadRequest("x", (17, 3, 4, 9, 0, 22), (0, L), (0, H)),
    ReadRequest("x", (17, 3, 4, 9, 0, 22), (1, 3), (2, 4)),
    ReadRequest("x", (5, 6, 7), (0, L), (1, 2)),
    ReadRequest("x", (17, 3, 4, 9, 0, 22), (0, L), (0, H), num_tokens=5 * B + 3,
                format="tokens"),
    ReadRequest("x", (2, 3, 4, 8), (2, 4), (0, 1), num_tokens=4 * B, format="tokens"),
    ReadRequest("x", (11,), (0, L), (0, H), num_tokens=3, format="tokens"),
], ids=["blocks", "blocks-partial", "blocks-run", "tokens-tail", "tokens-full", "tokens-one"])
def test_device_gather_plan_writes_every_byte(req: ReadRequest) -> None:
    """The copies the GPU gather issues (one per run of consecutive ids, plus a partial last
    block) fill the payload exactly: run here on CPU tensors, same views."""
    kv = _kv(1)
    dst = torch.full(payload_shape(tuple(kv.shape), req), float("nan"))
    pairs = _device_gather_views(kv, req, dst)
    for d, s in pairs:
        d.copy_(s)
    assert same_bytes(dst, expected(kv, req))
    ids = req.block_ids
    runs = 1 + sum(1 for a, b in zip(ids, ids[1:], strict=False) if b != a + 1)
    assert len(pairs) <= runs + 1


def test_zero_copy_of_a_gpu_cache_needs_a_device_transport() -> None:
    kv = _kv()
    run = ReadRequest("x", (4, 5, 6), (0, L), (0, H))
    assert plan_read(kv, run).zero_copy is not None  # CPU cache: always
    meta = kv.to("meta")  # stands for a non-CPU cache: same shapes, no memory
    assert plan_read(meta, run).zero_copy is None
    assert plan_read(meta, run, device_ok=True).zero_copy is not None
    gather = ReadRequest("x", (4, 6), (0, L), (0, H))
    assert plan_read(meta, gather, device_ok=True).zero_copy is None


def test_ucx_env_adds_cuda_transports_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("UCX_TLS", "UCX_MM_ERROR_HANDLING", "UCX_RNDV_SCHEME"):
        monkeypatch.setenv(k, "placeholder")  # recorded, so undo restores the original
        monkeypatch.delenv(k)
    assert configure_ucx_env("same_host", cuda=True)["UCX_TLS"] == "sm,tcp,cuda_copy,cuda_ipc"
    monkeypatch.delenv("UCX_TLS")
    assert configure_ucx_env("cross_host", cuda=True)["UCX_TLS"] == "tcp,cuda_copy"
    monkeypatch.delenv("UCX_TLS")
    assert configure_ucx_env("same_host")["UCX_TLS"] == "sm,tcp"
    monkeypatch.setenv("UCX_TLS", "tcp")  # an operator's choice wins
    assert configure_ucx_env("same_host", cuda=True)["UCX_TLS"] == "tcp"


def test_device_direct_wanted_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_DIRECT_ENV, "0")
    ok, why = device_direct_wanted()
    assert not ok and DEVICE_DIRECT_ENV in why and "host staging" in why
    monkeypatch.delenv(DEVICE_DIRECT_ENV)
    ok, why = device_direct_wanted()
    assert ok == torch.cuda.is_available()
    if not ok:
        assert why == "no CUDA device in this process"


def test_cuda_transports_from_context_info() -> None:
    info = """#      resource 0  :  md 0  dev 0  flags -- tcp/eth0
#      resource 4  :  md 3  dev 2  flags -- cma/memory
#      resource 5  :  md 4  dev 3  flags -- cuda_copy/cuda
#      resource 6  :  md 5  dev 4  flags -- cuda_ipc/cuda"""
    assert cuda_transports(info) == ["cuda_copy", "cuda_ipc"]
    assert cuda_transports("#      resource 0  :  md 0  dev 0  flags -- tcp/lo") == []


def test_stats_count_device_direct_and_staging_reasons() -> None:
    a, b = TransferStats(), TransferStats()
    a.record_transfer(10, 1, 0.001, device_direct=True)
    a.record_transfer(10, 1, 0.001, staging_reason="UCX has no CUDA support")
    b.record_transfer(10, 1, 0.001, staging_reason="UCX has no CUDA support")
    b.record_transfer(10, 1, 0.001, staging_reason="the tcp backend moves host memory only")
    b.record_transfer(10, 1, 0.001)  # a CPU cache: neither
    sa = a.snapshot()
    assert (sa.device_direct_transfers, sa.host_staged_transfers) == (1, 1)
    m = merge_snapshots([sa, b.snapshot()])
    assert (m.transfers, m.device_direct_transfers, m.host_staged_transfers) == (5, 1, 3)
    assert m.staging_reasons == (("UCX has no CUDA support", 2),
                                 ("the tcp backend moves host memory only", 1))


def test_tcp_backend_never_moves_gpu_memory() -> None:
    ok, why = TcpBackend().device_memory_support()
    assert not ok and why == "the tcp backend moves host memory only"


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_cache_reports_no_device_and_no_staging(backend: str) -> None:
    """A CPU cache moves host memory on both ends: not device-direct, nothing staged, and the
    client knows (here) whether it could take GPU memory, with the reason when not."""
    r = Rig(backend)
    try:
        ok, why = r.client.device_support
        assert ok == r.client.device_payloads
        if not torch.cuda.is_available():
            assert not ok and why
        with pytest.raises(ValueError, match="CPU or CUDA tensor"):
            r.client.read(r.address, ReadRequest("x", (1,), (0, L), (0, H)),
                          torch.empty(1, L, 2, H, B, D, device="meta"))
        assert not r.server.payload.device_direct and r.server.payload.staging_reason == ""
        ids = [3, 9, 4]
        r.leases.create("req", ids, readers=1)
        req = ReadRequest("req", ids, (0, L), (1, 3))
        out = r.read(req)
        assert same_bytes(out, expected(r.kv, req))
        assert not r.last.device_direct and r.last.staging_reason == ""
        snap = r.client.stats.snapshot()
        assert (snap.device_direct_transfers, snap.host_staged_transfers) == (0, 0)
    finally:
        r.close()
