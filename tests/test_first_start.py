"""What keeps a first start short (bench/first_start.py measures it): the launcher builds the CPU
kernels in the background, and building a model does not import torch._dynamo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from disagg.model import kernel_build

ROOT = Path(__file__).resolve().parents[1]


def test_launcher_prebuilds_missing_kernels_once(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg import launch

    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU-only machine, whatever this one is
    monkeypatch.delenv("DISAGG_CPU_KERNELS", raising=False)
    if kernel_build._compiler() is None:
        pytest.skip("no C++ compiler: nothing to build")
    said: list[str] = []
    thread = launch.start_kernel_prebuild(said.append)
    assert thread is not None and said == [
        "CPU kernels: building attention, linear in the background (first start only) ..."]
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert said[1].startswith("CPU kernels: built in ") and "failed" not in said[1], said
    assert kernel_build.missing() == []
    assert launch.start_kernel_prebuild(said.append) is None  # cached: nothing to do
    monkeypatch.setenv("DISAGG_CPU_KERNELS", "0")
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path / "other"))
    assert launch.start_kernel_prebuild(said.append) is None  # switched off: nothing either
    assert len(said) == 2


def test_building_a_model_does_not_import_dynamo(tiny_checkpoint) -> None:
    """nn.Embedding's random init on the meta device imports torch._dynamo (~2 s of every
    worker start); the model is built without it."""
    model_dir = tiny_checkpoint()
    code = ("import sys; from disagg.model.loader import load_model; "
            f"load_model({str(model_dir)!r}); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
