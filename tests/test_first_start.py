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
        "CPU kernels: building attention, linear, elementwise, decoder in the background "
        "(first start only) ..."]
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


def test_launcher_echoes_what_a_starting_child_is_doing(tmp_path: Path) -> None:
    """A child still starting after 2 s: its newest log line is said once (not at every
    poll), and again only when it changes."""
    from types import SimpleNamespace

    from disagg.launch import _Progress

    log = tmp_path / "ctx0.log"
    log.write_text("$ python -m disagg.cli serve ...\n"
                   "2026-11-24 11:16:22,661 INFO disagg.server: loading /m (float32 on cpu) ...\n")
    child = SimpleNamespace(spec=SimpleNamespace(name="ctx0", log_path=log))
    said: list[str] = []
    progress = _Progress(said.append)
    progress.report([child])
    assert said == []  # not within the first 2 s
    progress.next_check = 0.0
    progress.report([child])
    progress.next_check = 0.0
    progress.report([child])  # the same line: not said again
    assert said == ["  ctx0   loading /m (float32 on cpu) ..."]
    with log.open("a") as f:
        f.write("2026-11-24 11:16:24,000 WARNING disagg.model.kernel_build: waiting for another "
                "process building the CPU kernels ...\nINFO:     Started server process [1]\n")
    progress.next_check = 0.0
    progress.report([child])
    assert said[-1] == "  ctx0   waiting for another process building the CPU kernels ..."


def test_unknown_cpu_kernels_value_is_a_launch_error(tmp_path: Path) -> None:
    """An unknown DISAGG_CPU_KERNELS name stops `disagg launch` with one line naming the
    variable (exit 2) before anything starts, not a traceback, and not 'all kernels off'."""
    import os

    env = {**os.environ, "DISAGG_CPU_KERNELS": "attention,fast", "DISAGG_CACHE_DIR":
           str(tmp_path), "DISAGG_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "launch", "--model", "tiny"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("disagg launch: error: $DISAGG_CPU_KERNELS='attention,fast'"
                                  ": unknown kernel(s) ['fast']"), proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())  # nothing started
