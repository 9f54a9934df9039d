"""The compiled small-M linear (csrc/small_gemm.cpp) against F.linear, and its use in the model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from disagg.model.kernels import (
    SMALL_LINEAR_MAX_ROWS,
    kernels_enabled,
    small_linear_applies,
    small_linear_kernel,
)
from disagg.model.llama import Linear

KERNEL = small_linear_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the CPU kernel did not build here "
                                  "(no C++ compiler, or DISAGG_CPU_KERNELS off)")


def _close(got: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    # Both sum k float32 products in different orders: the error grows like sqrt(k) times
    # the products' size (inputs are N(0, 1) here).
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * max(1.0, k ** 0.5) * 4)


@needs_kernel
@pytest.mark.parametrize("k", [1, 7, 8, 33, 129, 512])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 33, 129])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_odd_shapes(n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for m in range(1, 41):
        x = torch.randn(m, k, generator=g)
        _close(KERNEL(x, w, b), F.linear(x, w, b), k)


@needs_kernel
def test_model_sized_shapes() -> None:
    g = torch.Generator().manual_seed(1)
    for n, k in [(512, 512), (256, 512), (1408, 512), (512, 1408), (2048, 512)]:
        w = torch.randn(n, k, generator=g) * 0.02
        for m in (1, 2, 3, 4, 5, 8, 16, 32):
            x = torch.randn(m, k, generator=g)
            _close(KERNEL(x, w, None), F.linear(x, w), k)


@needs_kernel
def test_strided_rows_and_rejected_layouts() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(33, 40, generator=g)
    big = torch.randn(6, 50, generator=g)
    x = big[:, 5:45]  # rows 50 floats apart, dense along K: accepted as it is
    assert not x.is_contiguous()
    _close(KERNEL(x, w, None), F.linear(x, w), 40)
    with pytest.raises(RuntimeError, match="unit stride along K"):
        KERNEL(torch.randn(40, 6, generator=g).t(), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        KERNEL(torch.randn(4, 40), torch.randn(40, 33).t(), None)
    with pytest.raises(RuntimeError, match="float32 only"):
        KERNEL(torch.randn(4, 40).double(), w.double(), None)
    with pytest.raises(RuntimeError, match="K=40"):
        KERNEL(torch.randn(4, 41), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        KERNEL(torch.randn(4, 40), w, torch.randn(32))


@needs_kernel
def test_threads_give_the_same_result() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1408, 512, generator=g)
    x = torch.randn(7, 512, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL(x, w, None)
        torch.set_num_threads(max(2, before))
        many = KERNEL(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)  # each output is summed by one thread, in the same order


def test_applies_only_where_the_kernel_serves() -> None:
    w = torch.randn(8, 16)
    assert small_linear_applies(torch.randn(SMALL_LINEAR_MAX_ROWS, 16), w, None)
    assert not small_linear_applies(torch.randn(SMALL_LINEAR_MAX_ROWS + 1, 16), w, None)
    assert not small_linear_applies(torch.randn(0, 16), w, None)
    assert not small_linear_applies(torch.randn(2, 3, 16), w, None)
    assert not small_linear_applies(torch.randn(2, 16).bfloat16(), w.bfloat16(), None)
    assert not small_linear_applies(torch.randn(16, 2).t(), w, None)
    assert not small_linear_applies(torch.randn(2, 16), torch.randn(16, 8).t(), None)
    assert not small_linear_applies(torch.randn(2, 16, requires_grad=True), w, None)
    with torch.no_grad():
        assert small_linear_applies(torch.randn(2, 16, requires_grad=True), w, None)


def test_linear_module_uses_the_kernel_for_few_rows() -> None:
    calls = []

    def fake(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    lin = Linear(16, 8).requires_grad_(False)
    x = torch.randn(3, 16)
    ref = F.linear(x, lin.weight, lin.bias)
    assert torch.equal(lin(x), ref) and calls == []  # no kernel given: torch
    lin.small_m_kernel = fake
    assert torch.equal(lin(x), ref) and calls == [3]
    assert torch.equal(lin(x, add_bias=False), F.linear(x, lin.weight))
    lin(torch.randn(SMALL_LINEAR_MAX_ROWS + 1, 16))
    assert calls == [3, 3]  # too many rows: torch


def test_kernels_can_be_switched_off_one_by_one(monkeypatch) -> None:
    monkeypatch.setenv("DISAGG_CPU_KERNELS", "linear")
    assert kernels_enabled() and kernels_enabled("linear")
    assert not kernels_enabled("attention")
    monkeypatch.setenv("DISAGG_CPU_KERNELS", "attention")
    assert not kernels_enabled("linear") and kernels_enabled("attention")
    monkeypatch.setenv("DISAGG_CPU_KERNELS", "0")
    assert not kernels_enabled() and not kernels_enabled("linear")
    monkeypatch.setenv("DISAGG_CPU_KERNELS", "1")
    assert kernels_enabled("linear") and kernels_enabled("attention")


def _child_env(cache: Path) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    return dict(os.environ, DISAGG_CACHE_DIR=str(cache),
                PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


LOAD_LINEAR = ("from disagg.model import kernels\n"
               "assert kernels.small_linear_kernel() is not None\n")


def test_a_built_kernel_loads_without_the_build_lock(tmp_path) -> None:
    """A build already in the cache is loaded without waiting for the build lock (held here,
    as by a worker still building another kernel)."""
    from disagg.model import kernel_build, kernels

    if kernels.small_linear_kernel() is None:
        pytest.skip("the small-M kernel cannot be built here")
    source = kernel_build.KERNEL_SOURCES["linear"].source
    built = kernel_build._build_dir(source, kernel_build._compiler())
    cache = tmp_path / "cache"
    copy = cache / "kernels" / built.name
    copy.mkdir(parents=True)
    shutil.copy(built / "disagg_small_gemm.so", copy)
    with kernel_build.build_lock(copy):
        subprocess.run([sys.executable, "-c", LOAD_LINEAR], env=_child_env(cache), check=True,
                       timeout=60)


def test_workers_starting_at_once_build_once(tmp_path) -> None:
    """Three processes needing the kernel at once in a clean cache: one builds (saying so), the
    others wait for it and load its library; no temporary file is left behind."""
    from disagg.model import kernel_build as kernels

    if kernels._compiler() is None or not kernels.kernels_enabled("linear"):
        pytest.skip("no C++ compiler, or the kernel is switched off")
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_LINEAR], env=_child_env(tmp_path),
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    assert sum(e.count("building CPU kernels (first start)") for e in errs) == 1, errs
    (build_dir,) = (tmp_path / "kernels").iterdir()
    assert sorted(f.name for f in build_dir.iterdir()) == [kernels.LOCK_NAME,
                                                           "disagg_small_gemm.so"]


def test_a_failed_build_or_no_compiler_falls_back(tmp_path, monkeypatch, caplog) -> None:
    from disagg.model import kernel_build as kernels

    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    if kernels._compiler() is not None:
        assert kernels._build("disagg_broken", broken, "test", "torch") is None
        assert "CPU test kernel unavailable" in caplog.text and "failed" in caplog.text
        (build_dir,) = (tmp_path / "cache" / "kernels").iterdir()
        assert [f.name for f in build_dir.iterdir()] == [kernels.LOCK_NAME]  # no temp file
    caplog.clear()
    monkeypatch.setattr(kernels, "COMPILERS", ("disagg-no-such-compiler",))
    assert kernels.build_kernel("linear") is None
    assert "no C++ compiler" in caplog.text


def test_status_says_which_kernels_are_active() -> None:
    from disagg.model import kernels
    from disagg.model.cpu_decoder import _library
    from disagg.model.cpu_ops import elementwise_kernel

    assert kernels.status() == {"attention": kernels.paged_decode_kernel() is not None,
                                "linear": KERNEL is not None,
                                "elementwise": elementwise_kernel() is not None,
                                "decoder": _library() is not None}
