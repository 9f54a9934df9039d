"""SwiGLU's ``silu(gate) * up`` in one launch (``disagg/model/triton_silu_mul.py``).

On every machine (CI): the PyTorch reference's roundings (``llama.silu_mul_reference``: SiLU
rounded to the dtype, then the product rounded), and the model's side (``GatedMLP``: every
dense SwiGLU hands gate and up, the fused GEMM's column halves, to the kernel the runner
installed; the engine gives the same bits through a kernel that computes the reference).
With triton: the kernel under the Triton interpreter, in a child process with
``TRITON_INTERPRET=1`` (``triton_fixtures``). The interpreter has no libdevice: its ``exp`` is
numpy's, not torch's, so there the kernel is held bit for bit to torch's CUDA formula
``g / (1 + exp(-g))`` with numpy's exp (``cuda_formula``), and close to torch's CPU SiLU; on a
GPU the runner's check holds it to torch's bits (``tests/test_gpu.py``).
"""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from triton_fixtures import (
    in_interpreter,
    round_like_the_gpu,
    run_interpreter_tests,
    spawns_interpreter,
)

from disagg import LLM, SamplingParams
from disagg.model.llama import MLP, GatedMLP, silu_mul_reference
from disagg.model.triton_rope import bits_differ

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def cuda_formula(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch's CUDA SiLU (``x / (1 + exp(-x))`` in float32, rounded to the dtype) times up
    (the exact product rounded once), with numpy's float32 exp: what the kernel computes
    under the interpreter."""
    g = gate.float()
    with np.errstate(over="ignore"):  # exp(89) and up: inf, as on the device
        e = torch.from_numpy(np.exp(-g.numpy()))
    s = (g / (1.0 + e)).to(gate.dtype)
    return (s.float() * up.float()).to(gate.dtype)


def _gate_up(dtype: torch.dtype, n: int, layout: str = "fused", t: int = 5,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gate/up as the MLP hands them over: the column halves of one fused GEMM output
    (``fused``, row stride 2n) or two tensors; row 0 starts with SiLU's edge values (exp
    overflowing to inf, underflowing, signed zeros)."""
    g = torch.Generator().manual_seed(seed)
    edge = torch.tensor([0.0, -0.0, 89.0, -89.0, 100.0, -100.0, 20.0, -20.0])
    if layout == "fused":
        fused = torch.randn(t, 2 * n, generator=g) * 4
        fused[0, :edge.numel()] = edge
        fused = fused.to(dtype)
        return fused[:, :n], fused[:, n:]
    gate, up = (torch.randn(t, n, generator=g) * 4 for _ in range(2))
    gate[0, :edge.numel()] = edge
    return gate.to(dtype), up.to(dtype)


# ---- the reference and the model's side (CI) --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reference_rounds_silu_then_the_product(dtype: torch.dtype) -> None:
    """What the kernel reproduces: SiLU rounded to the dtype before the multiply (two torch
    ops). One rounding at the end gives other bits, so the bit-for-bit checks see a kernel
    that skips the first."""
    gate, up = _gate_up(dtype, 512, seed=1)
    out = silu_mul_reference(gate, up)
    assert out.dtype == dtype and out.is_contiguous()
    s = torch.nn.functional.silu(gate)
    assert bits_differ(out, (s.float() * up.float()).to(dtype)) == 0
    once = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
    assert bits_differ(out, once) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3", "mixtral"])
def test_every_dense_swiglu_hands_gate_and_up_to_the_kernel(tiny_checkpoint, arch: str) -> None:
    """``use_silu_mul_kernel``: the dense MLPs (and DeepSeek's dense and shared SwiGLUs) call
    the kernel with gate and up (fused: the two column halves of one GEMM output, row stride
    2I; DeepSeek: two GEMMs); routed experts (Mixtral's every layer) keep their own path. A
    kernel that computes the reference gives the engine's tokens and logprobs to the bit."""
    path = tiny_checkpoint("swiglu", arch=arch, seed=4, num_hidden_layers=3)
    prompts = [[(5 * i + 11 * j) % 400 + 3 for j in range(n)] for i, n in enumerate((4, 13))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    def run(kernel: object) -> list[tuple[list[int], object]]:
        with LLM(path, max_num_tokens=64, tokens_per_block=8, kv_cache_tokens=1024) as llm:
            llm.engine.runner.model.use_silu_mul_kernel(kernel)  # type: ignore[arg-type]
            outs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    seen: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []

    def spy(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        fused = gate.data_ptr() + gate.shape[1] * gate.element_size() == up.data_ptr()
        seen.append((tuple(gate.shape), gate.stride(), fused))
        return silu_mul_reference(gate, up)

    want = run(None)
    assert run(spy) == want
    if arch == "mixtral":
        assert seen == []
        return
    assert seen
    if arch == "deepseek_v3":  # q_a/kv_a/gate/up apart: separate, contiguous tensors
        assert not any(f for _, _, f in seen)
    else:  # gate|up in one GEMM: views of its halves (decode rows on CPU are <= 32)
        assert all(f and stride == (2 * shape[1], 1) for shape, stride, f in seen)


def test_the_kernel_reaches_every_gated_mlp_and_only_them(tiny_checkpoint) -> None:
    from disagg.model.loader import load_model

    model = load_model(tiny_checkpoint("swiglu", arch="qwen3_moe", seed=4, num_hidden_layers=3,
                                       mlp_only_layers=(1,)))
    model.use_silu_mul_kernel(silu_mul_reference)
    gated = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert [type(m) for m in gated] == [MLP]  # layer 1's dense MLP; the others are routed
    assert gated[0].silu_mul_kernel is silu_mul_reference
    model.use_silu_mul_kernel(None)
    assert gated[0].silu_mul_kernel is None


def test_cpu_never_imports_triton_silu_mul(tiny_llama) -> None:
    """A CPU engine keeps F.silu and the multiply and never imports the kernel's module."""
    code = ("import sys; from disagg import LLM; from disagg.model.llama import GatedMLP; "
            "llm = LLM(sys.argv[1], kv_cache_tokens=256); m = llm.engine.runner.model; "
            "assert all(x.silu_mul_kernel is None for x in m.modules() "
            "if isinstance(x, GatedMLP)); "
            "assert 'disagg.model.triton_silu_mul' not in sys.modules, 'imported'")
    proc = subprocess.run([sys.executable, "-c", code, tiny_llama], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---- the kernel under the Triton interpreter ------------------------------------------------


@pytest.fixture(scope="module")
def ts():
    mp = pytest.MonkeyPatch()
    round_like_the_gpu(mp)
    yield importlib.import_module("disagg.model.triton_silu_mul")
    mp.undo()


@spawns_interpreter
def test_kernel_in_interpreter_process() -> None:
    run_interpreter_tests(__file__)


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [64, 96, 1500])  # a power of two, not, several blocks + a tail
@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_kernel_gives_the_formulas_bits(ts, dtype: torch.dtype, n: int, layout: str) -> None:
    assert ts.INTERPRETED
    gate, up = _gate_up(dtype, n, layout, seed=n)
    got = ts.triton_silu_mul(gate, up)
    assert got.is_contiguous() and got.shape == gate.shape and got.dtype == dtype
    assert bits_differ(got, cuda_formula(gate, up)) == 0
    # torch's CPU SiLU (its own exp): a last-bit flip here and there
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, silu_mul_reference(gate, up), rtol=4 * eps, atol=1e-30)


@in_interpreter
def test_inputs_the_kernel_does_not_take_go_to_the_reference(ts, monkeypatch) -> None:
    """Mixed dtypes, a non-dense last dimension, 3-D, float64: the reference computes them,
    the kernel is not launched; an empty batch launches nothing either."""
    launched: list[int] = []
    real = ts._silu_mul_kernel

    class Spy:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launched.append(1)
            return real[grid]

    monkeypatch.setattr(ts, "_silu_mul_kernel", Spy())
    gate, up = _gate_up(torch.bfloat16, 64, "separate")
    for g, u in ((gate, up.float()), (gate[:, ::2], up[:, ::2]),
                 (gate.view(5, 4, 16), up.view(5, 4, 16)), (gate.double(), up.double())):
        assert bits_differ(ts.triton_silu_mul(g, u), silu_mul_reference(g, u)) == 0
    assert ts.triton_silu_mul(gate[:0], up[:0]).shape == (0, 64)
    assert launched == []
    ts.triton_silu_mul(gate, up)
    assert launched == [1]


@in_interpreter
def test_the_runner_check_takes_the_kernel_only_at_pytorchs_bits(
        ts, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The check compares with ``silu_mul_reference`` bit for bit. Here PyTorch's CPU SiLU
    (another exp than the interpreter's) is refused; with the reference computed as the
    device computes it (``cuda_formula``) the kernel is taken, and a kernel that rounds once
    is refused."""
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="disagg.model"):
        assert ts.triton_silu_mul_kernel(cpu, torch.float32, 96) is None
    assert "not used" in caplog.text and "bits" in caplog.text
    monkeypatch.setattr(ts, "silu_mul_reference", cuda_formula)
    for dtype in DTYPES:
        for n in (96, 5):  # 5: fewer columns than the check's edge values
            assert ts.triton_silu_mul_kernel(cpu, dtype, n) is ts.triton_silu_mul
    kernel = ts.triton_silu_mul

    def rounded_once(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # SiLU kept in float32 into the product: close, but not PyTorch's bits
        return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)

    assert bits_differ(kernel(*_gate_up(torch.bfloat16, 96)), cuda_formula(
        *_gate_up(torch.bfloat16, 96))) == 0
    monkeypatch.setattr(ts, "triton_silu_mul", rounded_once)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="disagg.model"):
        assert ts.triton_silu_mul_kernel(cpu, torch.bfloat16, 96) is None
    assert "not used" in caplog.text


@in_interpreter
@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                        ("qwen3", "bfloat16")])
def test_engine_through_the_kernel_is_the_formulas_bits(ts, tiny_dirs, arch: str, dtype: str
                                                        ) -> None:
    """The engine with every dense MLP's SiLU * mul in the kernel, interpreted on CPU: the
    tokens and logprob values of the engine with ``cuda_formula`` there, to the bit."""
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(n)] for i, n in enumerate((3, 17, 8))]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    calls: list[int] = []

    def spy(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        calls.append(gate.shape[0])
        return ts.triton_silu_mul(gate, up)

    outs = []
    for kernel in (cuda_formula, spy):
        with LLM(tiny_dirs[arch], dtype=dtype, max_num_tokens=64, tokens_per_block=8,
                 kv_cache_tokens=1024) as llm:
            llm.engine.runner.model.use_silu_mul_kernel(kernel)
            outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                         for o in llm.generate(prompts, params)])
    assert calls and outs[1] == outs[0]
