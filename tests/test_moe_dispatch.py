"""The CUDA path choice of the MoE experts (``moe.pick_experts_path``): a pure function of the
shapes, checked here on CPU, including against the device table its constants were fitted to
(``bench/results/gpu_moe_check.txt``, written by ``bench.gpu.check_moe``)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from disagg.model.moe import (
    BATCHED_MAX_BYTES,
    estimate_experts_seconds,
    expected_experts_hit,
    experts_forward,
    grouped_experts,
    pick_experts_path,
    softmax_topk,
)

TABLE = Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu_moe_check.txt"
SHAPES = [(2048, 128, 768, 8), (4096, 8, 14336, 2), (7168, 256, 2048, 8), (64, 16, 32, 4)]
TOKENS = [1, 2, 3, 8, 31, 64, 500, 4096, 16384]


def _measured() -> list[tuple[tuple[int, int, int, int], int, dict[str, float]]]:
    """``(shape (hidden, experts, inter, top_k), tokens, {path: seconds})`` per table row."""
    rows = []
    shape = None
    header: list[str] = []
    for line in TABLE.read_text().splitlines():
        m = re.match(r"== .*: hidden (\d+), (\d+) experts x intermediate (\d+), top-(\d+)", line)
        if m:
            shape = tuple(int(v) for v in m.groups())
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "tokens":
            header = cells
        elif shape and header and cells[0].isdigit() and len(cells) == len(header):
            times = {p: float(cells[header.index(p)].split()[0]) / 1e3
                     for p in ("triton", "batched", "grouped")
                     if p in header and cells[header.index(p)].endswith(" ms")}
            rows.append((shape, int(cells[0]), times))
    return rows


def test_capture_never_picks_grouped() -> None:
    """Inside a CUDA graph capture no host sync: the kernel when there is one, else batched,
    whatever the shapes (batched is the only capturable PyTorch path)."""
    for (h, e, i, k), t, size in itertools.product(SHAPES, TOKENS, (2, 4)):
        assert pick_experts_path(t, k, e, h, i, size, True, True) == "kernel"
        assert pick_experts_path(t, k, e, h, i, size, True, False) == "batched"


def test_outside_a_capture_the_cheapest_allowed_estimate() -> None:
    for (h, e, i, k), t, has_kernel in itertools.product(SHAPES, TOKENS, (True, False)):
        path = pick_experts_path(t, k, e, h, i, 2, False, has_kernel)
        est = estimate_experts_seconds(t, k, e, h, i, 2)
        gathered = t * k * 3 * i * h * 2
        allowed = {"grouped"} | ({"kernel"} if has_kernel else set()) | (
            {"batched"} if gathered <= BATCHED_MAX_BYTES else set())
        assert path in allowed
        assert est[path] == min(est[p] for p in allowed)


def test_the_picks_the_docstring_states() -> None:
    qwen, mixtral = (2048, 128, 768, 8), (4096, 8, 14336, 2)

    def pick(shape: tuple[int, int, int, int], t: int, kernel: bool = True) -> str:
        h, e, i, k = shape
        return pick_experts_path(t, k, e, h, i, 2, False, kernel)

    assert [pick(qwen, t) for t in (1, 2, 4, 8, 64, 4096)] == [
        "batched", "batched", "kernel", "kernel", "kernel", "kernel"]
    assert [pick(mixtral, t) for t in (1, 4, 8, 256, 512, 4096)] == [
        "grouped", "grouped", "kernel", "kernel", "grouped", "grouped"]
    assert [pick(qwen, t, False) for t in (1, 16, 32, 4096)] == [
        "batched", "batched", "grouped", "grouped"]
    assert {pick(mixtral, t, False) for t in TOKENS} == {"grouped"}


def test_the_rule_agrees_with_the_measured_table() -> None:
    """Every row of the device table that timed both PyTorch paths: the rule without the
    kernel picks the faster one where they differ by more than a quarter; grouped's estimate
    is within 30% of its time (the fit). The kernel's rows are not compared: its tiles
    changed after the table was measured."""
    rows = _measured()
    assert len(rows) >= 10, "the table has no rows: bench/results/gpu_moe_check.txt"
    both = 0
    for (h, e, i, k), t, times in rows:
        est = estimate_experts_seconds(t, k, e, h, i, 2)
        assert est["grouped"] == pytest.approx(times["grouped"], rel=0.3), (h, t)
        if "batched" not in times:
            continue
        fast, slow = sorted(("batched", "grouped"), key=times.__getitem__)
        if times[slow] > 1.25 * times[fast]:
            both += 1
            assert pick_experts_path(t, k, e, h, i, 2, False, False) == fast, (h, t, times)
    assert both >= 3


def test_expected_experts_hit() -> None:
    assert expected_experts_hit(1, 8, 128) == pytest.approx(8)
    assert expected_experts_hit(10_000, 2, 8) == pytest.approx(8)
    assert expected_experts_hit(5, 4, 4) == 4 and expected_experts_hit(0, 2, 8) == 0
    g = torch.Generator().manual_seed(0)
    for t, k, e in ((8, 8, 128), (8, 2, 8), (64, 8, 128)):
        hits = [torch.randperm(e, generator=g)[:k] for _ in range(200 * t)]
        trials = [len(set(torch.cat(hits[n * t:(n + 1) * t]).tolist())) for n in range(200)]
        assert expected_experts_hit(t, k, e) == pytest.approx(sum(trials) / 200, rel=0.05)


def test_cpu_keeps_the_grouped_path_or_the_given_kernel() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=g)
    w13 = torch.randn(4, 24, 16, generator=g)
    w2 = torch.randn(4, 16, 12, generator=g)
    w, ids = softmax_topk(torch.randn(5, 4, generator=g), 2, renormalize=True)
    assert torch.equal(experts_forward(x, ids, w, w13, w2), grouped_experts(x, ids, w, w13, w2))
    calls = []

    def fused(*args: object) -> torch.Tensor:
        calls.append(args[-1])
        return torch.zeros_like(x)

    assert not experts_forward(x, ids, w, w13, w2, 0, None, fused).any() and calls == [0]
