"""Sampler cost of one decode step: ``Sampler.sample`` on [batch, vocab] logits.

    python -m bench.sampler [--device cpu|cuda] [--vocab 32000 128256] [--batch 16 64]
    python -m bench.sampler --penalties [--out bench/results/sampler_penalties.md]

Mixes: all greedy; all sampled (temperature 0.8, top_p 0.95, half of the rows seeded); all
sampled with top_k 50 and no top_p; half greedy, half sampled. Prints the median and p90
milliseconds per call. Works with the generator-based sampler of earlier versions too (for
before/after numbers).

``--penalties``: the cost of presence / frequency / repetition penalties, logit_bias and min_p
at batch 1/16/64, as the ratio to the same mix without them, timed alternately in one run
(every row has a 512-token prompt and 128 output tokens: its history); written to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import platform
import statistics
import time
from pathlib import Path

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
              iters: int, histories: list | None = None) -> tuple[float, float]:
    positional = "positions" in inspect.signature(sampler.sample).parameters
    if histories is not None:
        extra: list = [[128] * len(params), None, histories]
    elif positional:
        extra = [[5] * len(params)]
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


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                 logit_bias={5: 2.0, 7: -100.0})


def penalty_rows(args: argparse.Namespace) -> list[str]:
    """Markdown rows: per (vocab, batch, mix) the plain and penalized medians and their
    ratio; plain and penalized calls alternate (rounds) so that drift hits both alike."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = []
    for vocab in args.vocab:
        for batch in args.batch:
            g = torch.Generator().manual_seed(vocab + batch)
            logits = (torch.randn(batch, vocab, generator=g) * 3).to(args.device)
            hist = [(torch.randint(0, vocab, (512,), generator=g).tolist(),
                     torch.randint(0, vocab, (128,), generator=g).tolist())
                    for _ in range(batch)]
            base = mixes(batch)
            variants = {
                "greedy": (base["greedy"], [dataclasses.replace(p, **PENALTIES)
                                            for p in base["greedy"]]),
                "top_p": (base["top_p"], [dataclasses.replace(p, **PENALTIES)
                                          for p in base["top_p"]]),
                "top_p+min_p": (base["top_p"], [dataclasses.replace(p, min_p=0.05)
                                                for p in base["top_p"]]),
                "1 row penalized": (base["greedy"], [
                    dataclasses.replace(p, **PENALTIES) if i == 0 else p
                    for i, p in enumerate(base["greedy"])]),
            }
            for name, (plain, pen) in variants.items():
                a, b = [], []
                for _ in range(args.rounds):
                    a.append(time_call(sampler, logits, plain, args.iters, hist)[0])
                    b.append(time_call(sampler, logits, pen, args.iters, hist)[0])
                ma, mb = statistics.median(a), statistics.median(b)
                out.append(f"| {vocab} | {batch} | {name} | {ma:.3f} | {mb:.3f} | "
                           f"{mb / ma:.2f}x |")
                print(out[-1], flush=True)
    return out


def write_penalties(args: argparse.Namespace) -> None:
    load0 = os.getloadavg()[0]
    rows = penalty_rows(args)
    load1 = os.getloadavg()[0]
    cpu = platform.processor() or platform.machine()
    lines = [
        "# Sampler: cost of penalties, logit_bias and min_p",
        "",
        f"- machine: {args.device}, {cpu}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average (1 min) {load0:.1f} at the start and "
        f"{load1:.1f} at the end (other work shares the machine: ratios, taken from "
        "alternating rounds, are the numbers to read)"
        + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        f"- `Sampler.sample` on random [batch, vocab] logits; median of {args.iters} calls, "
        f"median of {args.rounds} alternating rounds (plain, penalized)",
        "- history per row: 512 prompt + 128 output token ids (uploaded and turned into "
        "(row, id) pairs every call, as in a decode step)",
        f"- penalized = {PENALTIES}; top_p = temperature 0.8, top_p 0.95, half seeded; "
        "'1 row penalized': one greedy row of the batch has them, the rest none",
        "",
        "| vocab | batch | mix | plain ms | with them ms | ratio |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"command: `python -m bench.sampler --penalties --device {args.device} --vocab "
        f"{' '.join(map(str, args.vocab))} --batch {' '.join(map(str, args.batch))} "
        f"--iters {args.iters} --rounds {args.rounds} --threads {args.threads}`",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.sampler",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--penalties", action="store_true",
                    help="time penalties vs none and write --out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--out", default="bench/results/sampler_penalties.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.penalties:
        write_penalties(args)
        return
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
