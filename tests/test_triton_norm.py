"""The Triton RMSNorm (+ residual add) kernel (``disagg/model/triton_norm.py``) on CPU under the
Triton interpreter, against ``llama.rms_norm_reference``; run in a child process with
``TRITON_INTERPRET=1`` as ``test_triton_attention.py`` does (same reasons). Skipped where
triton is not installed (CI)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys

import pytest
import torch
from triton_fixtures import (
    in_interpreter,
    round_like_the_gpu,
    run_interpreter_tests,
    spawns_interpreter,
)

from disagg.model.llama import rms_norm_reference


@pytest.fixture(scope="module")
def tn():
    mp = pytest.MonkeyPatch()
    round_like_the_gpu(mp)
    yield importlib.import_module("disagg.model.triton_norm")
    mp.undo()


@spawns_interpreter
def test_kernel_in_interpreter_process() -> None:
    run_interpreter_tests(__file__)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [64, 96, 576])  # powers of two and not (masked tails)
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_is_the_reference(tn, dtype: torch.dtype, n: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(n)
    wide = (torch.randn(5, n + 8, generator=g) * 3).to(dtype)
    x = wide[:, :n]  # rows of stride n + 8: a view, as a projection's output columns are
    res = (torch.randn(5, n, generator=g) * 3).to(dtype) if with_residual else None
    w = torch.randn(n, generator=g).to(dtype)
    y, h = tn.triton_rms_norm(x, w, 1e-5, res)
    y_ref, h_ref = rms_norm_reference(x, w, 1e-5, res)
    assert y.dtype == dtype and y.shape == (5, n) and h.shape == (5, n)
    assert torch.equal(h, h_ref)  # the add rounds exactly as torch's does
    # float32: the sums' order only; half precision: a rounding flip of (h * rstd) costs an
    # ulp or two of y (bfloat16's ulp is 2^-8 relative)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}[dtype]
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)


@in_interpreter
def test_the_runner_check_takes_a_good_kernel_and_refuses_a_bad_one(
        tn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert tn.triton_norm_kernel(torch.device("cpu"), torch.float32, 96) is tn.triton_rms_norm

    def wrong(x, w, eps, residual=None):
        y, h = tn.triton_rms_norm(x, w, eps, residual)
        return y * 1.01, h

    monkeypatch.setattr(tn, "triton_rms_norm", wrong)
    with caplog.at_level(logging.WARNING, logger="disagg.model"):
        assert tn.triton_norm_kernel(torch.device("cpu"), torch.float32, 96) is None
    assert "not used" in caplog.text


@in_interpreter
def test_model_greedy_tokens_same_through_the_kernel(tn, tiny_llama) -> None:
    """The whole engine with every RMSNorm (and the residual add before the second norm of a
    layer) in the kernel, interpreted on CPU: the same greedy tokens as PyTorch."""
    from disagg import LLM, SamplingParams

    prompts = ["Hello there, how are", "a", "The quick brown fox jumps over the lazy dog"]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm = LLM(tiny_llama, max_num_tokens=16, tokens_per_block=8, kv_cache_tokens=1024)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    calls = []

    def spy(*a):
        calls.append(a[3] is not None)
        return tn.triton_rms_norm(*a)

    llm.engine.runner.model.use_norm_kernel(spy)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert True in calls and False in calls  # with and without a residual
    assert got == expected


def test_cpu_never_imports_triton(tiny_llama) -> None:
    """A CPU engine never puts a Triton kernel on its norms (PyTorch's, or the CPU
    elementwise kernel's: ``cpu_ops``) and does not import the Triton modules."""
    code = ("import sys; from disagg import LLM; llm = LLM(sys.argv[1], kv_cache_tokens=256); "
            "m = llm.engine.runner.model; "
            "assert all(n.kernel is None or n.kernel.__module__ == 'disagg.model.cpu_ops' "
            "for n in m.modules() if hasattr(n, 'add_norm')); "
            "assert 'disagg.model.triton_norm' not in sys.modules, 'imported'")
    proc = subprocess.run([sys.executable, "-c", code, tiny_llama], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
