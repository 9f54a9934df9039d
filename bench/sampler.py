"""Sampler cost of one decode step: ``Sampler.sample`` on [batch, vocab] logits.

    python bench/sampler.py [--device cpu|cuda] [--vocab 32000 128256] [--batch 16 64]

Mixes: all greedy; all sampled (temperature 0.8, top_p 0.95, half of the rows seeded); all
sampled with top_k 50 and no top_p; half greedy, half sampled. Prints the median and p90
milliseconds per call. Works with the generator-based sampler of earlier versions too (for
before/after numbers).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

from disagg.request import SamplingParams
from disagg.sampler import Sampler


def mixes(batch: int) -> dict[str, list[SamplingParams]]:
    def sampled(i: int, **kw: object) -> SamplingParams:
        return SamplingParams(temperature=0.8, seed=i if i % 2 == 0 else None, **kw)  # type: ignore[arg-type]

    return {
        "greedy": [SamplingParams(temperature=0) for _ in range(batch)],
        "top_p": [sampled(i, top_p=0.95) for i in range(batch)],
        "top_k": [sampled(i, top_k=50) for i in range(batch)],
        "half": [SamplingParams(temperature=0) if i % 2 else sampled(i, top_p=0.95)
                 for i in range(batch)],
    }


def time_call(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
              iters: int) -> tuple[float, float]:
    positional = "positions" in inspect.signature(sampler.sample).parameters
    if positional:
        extra: list = [[5] * len(params)]
    else:  # the earlier API: one generator per seeded request
        extra = [[torch.Generator().manual_seed(p.seed) if p.seed is not None else None
                  for p in params]]
    times = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        sampler.sample(logits, params, *extra)
        if logits.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times[2:])  # the first calls warm up
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    sampler = Sampler(torch.Generator().manual_seed(0))
    print(f"device {args.device}, torch threads {torch.get_num_threads()}")
    print(f"{'vocab':>7} {'batch':>5} {'mix':>7} {'median ms':>10} {'p90 ms':>8}")
    for vocab in args.vocab:
        for batch in args.batch:
            g = torch.Generator().manual_seed(vocab + batch)
            logits = (torch.randn(batch, vocab, generator=g) * 3).to(args.device)
            for name, params in mixes(batch).items():
                med, p90 = time_call(sampler, logits, params, args.iters)
                print(f"{vocab:>7} {batch:>5} {name:>7} {med:>10.2f} {p90:>8.2f}")


if __name__ == "__main__":
    main()
