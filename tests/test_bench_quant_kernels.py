"""``bench/quant_kernels.py`` on tiny shapes: GGUF blocks taken apart as gguf decodes them,
how exactly each PyTorch packed format holds them (int4pack group 32 exactly, int8pack per
channel not), and the shape of the report and its JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import quant_kernels as qk

TINY = ["--random", "--layers", "2", "--hidden", "64", "--intermediate", "256", "--kv-dim",
        "32", "--vocab", "96", "--rows", "1", "3", "--threads", "1", "--reps", "2",
        "--err-rows", "4", "--bw-mib", "8"]


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    n = torch.get_num_threads()  # the benchmark sets torch's thread count
    yield
    torch.set_num_threads(n)


def weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_t(5, size=(n, k)) * 0.02).astype(np.float32)


def test_gguf_blocks_are_taken_apart_as_gguf_decodes_them() -> None:
    b8 = qk.quantize_q8_0(weights(48, 256))
    assert torch.equal(b8.d.repeat_interleave(32, 1) * b8.q.float(), b8.deq)
    b4 = qk.quantize_q4_1(weights(48, 256, 1))
    assert int(b4.q.max()) <= 15
    assert torch.equal(b4.d.repeat_interleave(32, 1) * b4.q.float()
                       + b4.m.repeat_interleave(32, 1), b4.deq)
    for quant in (qk.quantize_q4_0, qk.quantize_q4_k):
        w = weights(48, 512, 2)
        q, s, z, deq = quant(w)
        # int4pack's (q - 8) * s + z reproduces gguf's own decoding of the blocks ...
        assert torch.equal(qk.int4_weights(q, s, z), deq), quant.__name__
        # ... of a real 4-bit quantization of w (not, say, all zeros)
        err = float((deq - torch.from_numpy(w)).abs().max())
        assert 0 < err < 0.15 * float(np.abs(w).max()), quant.__name__


def test_int4pack_group_32_holds_q4_1_exactly_and_bfloat16_does_not() -> None:
    b = qk.quantize_q4_1(weights(96, 256))
    exact = qk.int4pack_path([qk.int4_params_exact(b)], torch.float32, "k", "l")
    a = qk.agreement(exact, [b.deq], [256], 4, 1)
    assert a["w_max_abs_diff"] == 0.0 and a["layer0_readback_max_abs_diff"] == 0.0
    assert a["rel_err"] < 1e-6
    bf16 = qk.int4pack_path([qk.int4_params_exact(b)], torch.bfloat16, "k", "l")
    a = qk.agreement(bf16, [b.deq], [256], 4, 1)
    assert 0 < a["w_max_abs_diff"] < 1e-2 and 0 < a["rel_err"] < 2e-2


def test_int8pack_per_channel_cannot_hold_q8_0_blocks() -> None:
    b = qk.quantize_q8_0(weights(64, 256, 3))
    q, s = qk.int8_per_channel(b.deq)
    path = qk.int8pack_path([(q, s)], torch.float32)
    a = qk.agreement(path, [b.deq], [256], 4, 1)
    half_step = float(s.max()) / 2 * (1 + 1e-5)
    assert 0 < a["w_max_abs_diff"] <= half_step  # per-32 scales do not fit one per row
    assert a["layer0_readback_max_abs_diff"] <= half_step
    assert 0 < a["rel_err"] < 0.05


def test_report_and_json_shape(tmp_path: Path) -> None:
    out = tmp_path / "qk.md"
    assert qk.main([*TINY, "--out", str(out)]) == 0
    text, res = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    assert f"`python -m bench.quant_kernels {' '.join(TINY)} --out {out}`" in text
    for head in ("## Memory bandwidth", "## One decode step's linears, 1 torch thread(s)",
                 "## Agreement with float32", "## How exactly", "## By format", "## Conclusion"):
        assert head in text, head
    keys = list(res["nbytes"])
    assert {"f32", "bf16", "int8pack_float32", "int4pack_g32_f32", "int4pack_g64_bf16"} <= set(keys)
    assert "int4pack group 128: not possible" in text  # K = 64 here
    assert any(n.startswith("torchao: ") for n in res["notes"])
    secs = res["timing"]["1"]["seconds"]
    assert list(secs) == keys
    cell = re.compile(r"^[\d.]+ \([\d.]+ GB/s, \d+%\)( \*)?$")
    for key in keys:
        assert all(secs[key][m][0] > 0 and secs[key][m][1] >= 1 for m in ("1", "3")), key
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| {res['labels'][key]} | "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4 and all(cell.match(c) for c in cells[2:]), row
    tm = res["timing"]["1"]
    assert all(x > 0 for x in tm["read_gbps"] + tm["copy_gbps"] + tm["read_gbps_during"])
    assert tm["peak_gflops"] > 0
    agree = res["agreement"]
    assert agree["Q8_0"]["f32"]["rel_err"] == 0.0
    assert agree["Q4_1"]["int4pack_g32_f32"]["w_max_abs_diff"] == 0.0
    assert agree["Q8_0"]["int8pack_float32"]["w_max_abs_diff"] > 0.0
    assert agree["Q4_1"]["int4pack_g64_bf16"]["rel_err"] > agree["Q4_1"]["bf16"]["rel_err"]
    for fmt in ("Q4_0", "Q4_K"):
        assert res["extra_formats"][fmt]["agreement"]["w_max_abs_diff"] == 0.0
    table = [ln for ln in text.split("## By format")[1].splitlines() if ln.startswith("| Q")]
    assert len(table) == 2 * len(res["rows"])  # Q8_0 and Q4_1 at each M, one thread count
    for fmt in ("Q8_0", "Q4_1"):  # a recommendation per format, naming a measured path
        line = next(ln for ln in text.split("## Conclusion")[1].splitlines()
                    if ln.startswith(f"- **{fmt}"))
        assert any(f"{res['labels'][k]}**" in line for k in keys), line
