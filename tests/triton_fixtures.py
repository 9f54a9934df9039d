"""Running Triton kernels on CPU under the interpreter (``TRITON_INTERPRET=1``).

The interpreter has to be chosen before triton is first imported, and a process that imported
triton for real must keep compiled kernels, so a kernel test file runs its interpreter tests
in a child pytest started with the variable (``run_interpreter_tests``) and marks them
``in_interpreter`` (they run in place only in that child). Skipped where triton is not
installed (CI)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
in_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRET),
    reason="needs triton and TRITON_INTERPRET=1 (run by the file's interpreter-process test)")
spawns_interpreter = pytest.mark.skipif(not HAS_TRITON or INTERPRET,
                                        reason="needs triton; runs the others")


def run_interpreter_tests(test_file: str) -> None:
    """Every test of ``test_file`` but this one (named ``*in_interpreter_process``), in a child
    process started with TRITON_INTERPRET=1; fails when any of them fails or none ran."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         str(Path(test_file).resolve()), "-k", "not in_interpreter_process"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail


def round_like_the_gpu(mp: pytest.MonkeyPatch) -> None:
    """triton's interpreter (3.6 to 3.9 at least) casts float32 to bfloat16 by truncating the
    mantissa; a GPU (LLVM's fptrunc) and torch round to nearest even. Cast that pair with torch
    instead (interpreter only), so a kernel is checked for the rounding it gets on a device."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as it

    orig = it.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return it.TensorHandle(t.view(torch.int16).numpy().view(np.uint16),
                                   dst_type.scalar)
        return orig(self, src, dst_type)

    mp.setattr(it.InterpreterBuilder, "cast_impl", cast_impl)
