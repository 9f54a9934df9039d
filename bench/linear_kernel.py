"""The small-M linear kernel (``disagg/model/csrc/small_gemm.cpp``) against ``F.linear``, and
its effect on the engine's decode step, in one process.

    python -m bench.linear_kernel [--threads 1] [--out bench/results/linear_kernel.md]

1. Matmuls alone: the 512-hidden, 8-layer model's seven projections per layer, (a) one layer
   (its weights stay in cache) and (b) all 8 layers plus a 2048-vocab head, ~99 MB (streamed
   from memory, as in a real forward). Kernel and ``F.linear`` alternate per repetition; the
   median of each is reported, for M = 1..64 rows.
2. The engine's decode step (prompt 512, batch B): the same engine, its linear layers switched
   between the kernel and ``F.linear`` every few steps (``use_linear_kernel``), median step
   time of each. The attention kernel stays on in both.

Pin it for stable numbers: ``taskset -c 1 python -m bench.linear_kernel``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from disagg import SamplingParams
from disagg.engine import LLMEngine
from disagg.model.kernels import SMALL_LINEAR_MAX_ROWS, small_linear_kernel
from disagg.model.tiny import write_tiny_checkpoint

SIZES = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048)
# (out, in) of q, k, v, o, gate, up, down for SIZES
LAYER = [(512, 512), (256, 512), (256, 512), (512, 512), (1408, 512), (1408, 512), (512, 1408)]


def matmul_rows(kernel: Callable[..., torch.Tensor], weights: list[torch.Tensor],
                ms: list[int], reps: int) -> list[tuple[int, float, float]]:
    """(M, F.linear s, kernel s): medians over ``reps`` alternating repetitions."""
    out = []
    for m in ms:
        xs = [torch.randn(m, w.shape[1]) for w in weights]
        for _ in range(3):  # warm
            for w, x in zip(weights, xs, strict=True):
                F.linear(x, w)
                kernel(x, w, None)
        ta, tb = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            for w, x in zip(weights, xs, strict=True):
                F.linear(x, w)
            t1 = time.perf_counter()
            for w, x in zip(weights, xs, strict=True):
                kernel(x, w, None)
            t2 = time.perf_counter()
            ta.append(t1 - t0)
            tb.append(t2 - t1)
        out.append((m, statistics.median(ta), statistics.median(tb)))
    return out


def decode_steps(model_dir: str, batch: int, kernel: Callable[..., torch.Tensor],
                 steps: int = 60, every: int = 5) -> tuple[float, float]:
    """Median decode-step seconds (F.linear, kernel) of one engine, switching every ``every``."""
    eng = LLMEngine.from_options(model_dir, kv_cache_tokens=32768, max_model_len=1024)
    model = eng.runner.model
    rng = random.Random(batch)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(SIZES["vocab_size"]) for _ in range(512)],
                        SamplingParams(max_tokens=steps + 20, ignore_eos=True))
    eng.step()  # the prefill
    for _ in range(5):
        eng.step()
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps):
        on = (i // every) % 2 == 1
        model.use_linear_kernel(kernel if on else None)
        t0 = time.perf_counter()
        eng.step()
        times[on].append(time.perf_counter() - t0)
    eng.shutdown()
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.linear_kernel",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="append a markdown report here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = small_linear_kernel()
    if kernel is None:
        print("the small-M linear kernel could not be built here (see the warning)")
        return 1
    g = torch.Generator().manual_seed(0)
    layer = [torch.randn(n, k, generator=g) * 0.02 for n, k in LAYER]
    model_w = [torch.randn(n, k, generator=g) * 0.02 for _ in range(8) for n, k in LAYER]
    model_w.append(torch.randn(SIZES["vocab_size"], 512, generator=g) * 0.02)
    mb = sum(w.numel() for w in model_w) * 4 / 1e6
    ms = [1, 2, 4, 8, 16, 32, 64]
    cache = matmul_rows(kernel, layer, ms, 200)
    dram = matmul_rows(kernel, model_w, ms, 20)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(os.path.join(tmp, "m"), seed=0, **SIZES)
        engine = [(b, *decode_steps(model_dir, b, kernel)) for b in (1, 2, 4, 8, 16)]

    aff = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    lines = [f"## linear_kernel ({time.strftime('%Y-%m-%d')})", ""]
    lines.append(f"- machine: {platform.machine()}, {os.cpu_count()} cores (this process on "
                 f"cores {aff}), {platform.system()}, torch {torch.__version__}, "
                 f"{args.threads} torch thread(s), float32; load average before: "
                 f"{os.getloadavg()[0]:.2f}")
    lines.append(f"- command: `python -m bench.linear_kernel {' '.join(sys.argv[1:])}`; the "
                 f"kernel serves M <= {SMALL_LINEAR_MAX_ROWS} rows in the model")
    lines.append("")
    lines.append(f"| M | one layer in cache: F.linear us | kernel us | speedup | 8 layers + head "
                 f"({mb:.0f} MB): F.linear ms | kernel ms | speedup |")
    lines.append("|---|---|---|---|---|---|---|")
    for (m, a, b), (_, c, d) in zip(cache, dram, strict=True):
        lines.append(f"| {m} | {a * 1e6:.0f} | {b * 1e6:.0f} | {a / b:.2f}x | {c * 1e3:.2f} | "
                     f"{d * 1e3:.2f} | {c / d:.2f}x |")
    lines.append("")
    lines.append("Engine decode step (prompt 512; one engine, linear layers switched between "
                 "F.linear and the kernel every 5 steps; attention kernel on in both):")
    lines.append("")
    lines.append("| batch | F.linear ms | kernel ms | speedup |")
    lines.append("|---|---|---|---|")
    for b, a, k in engine:
        lines.append(f"| {b} | {a * 1e3:.1f} | {k * 1e3:.1f} | {a / k:.2f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
