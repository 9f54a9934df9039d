"""Device check of the mixture-of-experts layer on CUDA (issue 44, item 4).

    python3 -m bench.gpu.check_moe --out $OUT/moe.txt
    python3 -m bench.gpu.check_moe --quick --out /tmp/moe.txt      # CPU: code paths only

Expert layers of real shapes (router outputs -> expert outputs, bf16, random weights): a
Qwen3-30B-A3B layer (hidden 2048, 128 experts of intermediate 768, top-8) and a
Mixtral-8x7B layer (hidden 4096, 8 experts of 14336, top-2), at several token counts. For each:

- correctness: every device path against ``grouped_experts`` computed in float32 from the
  same bf16 weights (max abs error relative to the reference's largest value);
- time (CUDA events, median of repeats): the Triton kernel the runner uses on CUDA
  (``triton_grouped_experts``), the graph-capturable ``batched_experts`` (what runs inside
  decode graphs without the kernel; timed up to ``BATCHED_TIMED_PAIRS`` pairs) and the grouped
  PyTorch path (one GEMM per active expert; its host sync reads the counts), against the
  HBM roofline of the expert weights the tokens touch (distinct experts hit x 3 x I x H x 2
  bytes at the device-to-device copy bandwidth measured here);
- the dispatch: the path ``moe.pick_experts_path`` picks for the shape (eager) and
  ``experts_forward``'s time with it (``pick / best``: that time over the fastest path's);
  up to ``GRAPH_TOKENS`` tokens also inside a CUDA graph (decode), the pick there and the
  replay times of the kernel and of batched.

Every sub-check is guarded; exit code 1 when a correctness check failed or raised.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

from disagg.model.moe import (
    batched_experts,
    experts_forward,
    grouped_experts,
    pick_experts_path,
)

SHAPES = {  # name -> (hidden, experts, intermediate, top_k)
    "qwen3-30b-a3b": (2048, 128, 768, 8),
    "mixtral-8x7b": (4096, 8, 14336, 2),
}
QUICK = {"tiny-qwen3moe": (64, 16, 32, 4), "tiny-mixtral": (64, 8, 96, 2)}
TOKENS = (1, 8, 64, 512, 4096)
QUICK_TOKENS = (1, 8, 40)
BATCHED_TIMED_PAIRS = 64  # batched gathers every pair's expert: timed on decode sizes only
GRAPH_TOKENS = 64         # decode batch sizes: timed in a CUDA graph too
LINES: list[str] = []
FAILED: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def timed(fn: Callable[[], object], dev: str, reps: int) -> float:
    fn()
    if dev != "cuda":
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return statistics.median(t)
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) / 1e3)
    return statistics.median(t)


def copy_bw(dev: str) -> float:
    n = (1 << 30) if dev == "cuda" else (64 << 20)
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), dev, 10)


def check_shape(name: str, shape: tuple[int, int, int, int], tokens: tuple[int, ...],
                dev: str, bw: float, reps: int) -> None:
    hidden, experts, inter, k = shape
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=dev)
           / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=dev) / inter ** 0.5).to(dtype)
    kernel = None
    if dev == "cuda":
        from disagg.model.triton_moe import triton_experts_kernel

        kernel = triton_experts_kernel(torch.device(dev), dtype, hidden, inter)
    say(f"\n== {name}: hidden {hidden}, {experts} experts x intermediate {inter}, top-{k}, "
        f"{dtype}; Triton kernel: {'accepted by the runner check' if kernel else 'not used'}")
    say("| tokens | experts hit | roofline | triton | batched | grouped | best / roofline "
        "| max err triton / batched / grouped | pick | pick time | pick / best "
        "| graph pick | graph triton | graph batched |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in tokens:
        try:
            say(one_size(name, t, hidden, experts, inter, k, w13, w2, kernel, g, dev, bw, reps))
        except Exception:  # noqa: BLE001
            tb = traceback.format_exc()
            print(tb, flush=True)
            FAILED.append(f"{name} T={t}: {tb.splitlines()[-1]}")
            say(f"| {t} | failed: {tb.splitlines()[-1][:150]} |")


def one_size(name: str, t: int, hidden: int, experts: int, inter: int, k: int,
             w13: torch.Tensor, w2: torch.Tensor, kernel: Callable[..., torch.Tensor] | None,
             g: torch.Generator, dev: str, bw: float, reps: int) -> str:
    """The table row of ``t`` tokens (failures of a path's check recorded in FAILED)."""
    dtype = w13.dtype
    x = torch.randn(t, hidden, generator=g, device=dev).to(dtype)
    probs = torch.softmax(torch.randn(t, experts, generator=g, device=dev), -1)
    weights, ids = torch.topk(probs, k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    ref = grouped_experts(x.float(), ids, weights.float(), w13.float(), w2.float())
    scale = 1.0 + float(ref.abs().max())
    hit = int(torch.unique(ids).numel())
    roof = hit * 3 * inter * hidden * w13.element_size() / bw
    pick = pick_experts_path(t, k, experts, hidden, inter, w13.element_size(), False,
                             kernel is not None) if dev == "cuda" else "grouped"
    paths: dict[str, Callable[[], torch.Tensor]] = {
        "grouped": lambda: grouped_experts(x, ids, weights, w13, w2)}
    gathered = t * k * 3 * inter * hidden * w13.element_size()  # batched copies each pair's
    batched_ok = gathered <= 8 << 30                          # weights: only where it runs
    if batched_ok and (t * k <= BATCHED_TIMED_PAIRS or pick == "batched"):
        paths["batched"] = lambda: batched_experts(x, ids, weights, w13, w2)
    if kernel is not None:
        paths["triton"] = lambda: kernel(x, ids, weights, w13, w2, 0)
    # The dispatch itself, as a layer calls it (the runner's kernel as ``fused``).
    paths["pick"] = lambda: experts_forward(x, ids, weights, w13, w2, 0, None, kernel)
    times: dict[str, float] = {}
    errs: dict[str, float] = {}
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    for p, fn in paths.items():
        with torch.inference_mode():
            errs[p] = float((fn().float() - ref).abs().max()) / scale
            times[p] = timed(fn, dev, reps)
        if not errs[p] <= tol:
            FAILED.append(f"{name} T={t} {p}: relative max error {errs[p]:.3g} > {tol}")
    graph = ["-", "-", "-"]
    if dev == "cuda" and t <= GRAPH_TOKENS:
        graph = graph_cells(f"{name} T={t}", (t, k, experts, hidden, inter),
                            (x, ids, weights, w13, w2), kernel,
                            batched_ok and t * k <= BATCHED_TIMED_PAIRS, ref, scale, tol, reps)
    cells = [f"{times[p] * 1e3:.3f} ms" if p in times else "-"
             for p in ("triton", "batched", "grouped")]
    err_cells = [f"{errs[p]:.2g}" if p in errs else "-" for p in ("triton", "batched", "grouped")]
    best = min(v for p, v in times.items() if p != "pick")
    return (f"| {t} | {hit} | {roof * 1e3:.3f} ms | {' | '.join(cells)} "
            f"| {roof / best:.0%} | {' / '.join(err_cells)} "
            f"| {'triton' if pick == 'kernel' else pick} | {times['pick'] * 1e3:.3f} ms "
            f"| {times['pick'] / best:.2f} | {' | '.join(graph)} |")


def graph_cells(label: str, shape: tuple[int, int, int, int, int],
                args: tuple[torch.Tensor, ...], kernel: Callable[..., torch.Tensor] | None,
                with_batched: bool, ref: torch.Tensor, scale: float, tol: float,
                reps: int) -> list[str]:
    """The pick inside a CUDA graph capture and the replay times of ``experts_forward``'s
    capture (the kernel, or batched without one) and of batched (where it is timed); each
    replay's output checked against ``ref`` like the eager paths."""
    t, k, experts, hidden, inter = shape
    x, ids, weights, w13, w2 = args
    pick = pick_experts_path(t, k, experts, hidden, inter, w13.element_size(), True,
                             kernel is not None)
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    if kernel is not None:
        fns["triton"] = lambda: experts_forward(x, ids, weights, w13, w2, 0, None, kernel)
    if with_batched:
        fns["batched"] = lambda: batched_experts(x, ids, weights, w13, w2)
    cells = {"triton": "-", "batched": "-"}
    for name, fn in fns.items():
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # compiled and warm outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            graph.replay()
            err = float((out.float() - ref).abs().max()) / scale
            if not err <= tol:
                FAILED.append(f"{label} graph {name}: relative max error {err:.3g} > {tol}")
            cells[name] = f"{timed(graph.replay, 'cuda', reps) * 1e3:.3f} ms"
            del graph, out
    return ["triton" if pick == "kernel" else pick, cells["triton"], cells["batched"]]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.check_moe")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                    help="token counts (full shapes)")
    args = ap.parse_args()
    try:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    except ValueError:
        ap.error(f"--tokens: comma-separated integers, got {args.tokens!r}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or dev != "cuda"
    say(f"check_moe on {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch "
        f"{torch.__version__}{' (quick shapes: code paths only)' if quick else ''}")
    try:
        bw = copy_bw(dev)
        say(f"device-to-device copy: {bw / 1e12:.3g} TB/s (read + write), the roofline's "
            f"bandwidth")
        for name, shape in (QUICK if quick else SHAPES).items():
            check_shape(name, shape, QUICK_TOKENS if quick else tokens, dev, bw,
                        3 if quick else args.reps)
    except Exception:  # noqa: BLE001
        tb = traceback.format_exc()
        print(tb, flush=True)
        FAILED.append(tb.splitlines()[-1])
    say("")
    say("FAILED: " + "; ".join(FAILED) if FAILED else "all correctness checks passed")
    with open(args.out, "w") as f:
        f.write("\n".join(LINES) + "\n")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
