"""Fused projections (q/k/v as one GEMM, gate/up as one: ``LlamaForCausalLM.fuse_projections``)
against the separate layers, in the engine's decode step, in one process.

One engine per batch size; its layers are switched between the fused GEMMs and the separate
ones every few steps (the same weights: the separate layers are views of the fused matrices),
so both see the same machine state, in blocks off, on, on, off (the context grows a token a
step; this order gives both the same mean context); the median step time of each is reported.

    python -m bench.fused_projections [--device cpu|cuda] [--batches 1,4,16,64]
                                      [--model DIR] [--out bench/results/fused_projections.md]

Pin it on a shared machine for stable numbers: ``taskset -c 1 python -m bench.fused_projections
...``.
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

import torch

from disagg import SamplingParams
from disagg.engine import LLMEngine
from disagg.model.tiny import write_tiny_checkpoint

# The 512-hidden, 8-layer model of bench/linear_kernel.py (GQA: 8 query, 4 kv heads).
SIZES = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048)


def set_fused(model: torch.nn.Module, parts: dict[str, tuple], on: bool) -> None:
    """Fused GEMMs (``on``) or the separate layers, for every decoder layer."""
    for name, layer in model.model.layers.items():
        qkv, gate_up = parts[name]
        layer.self_attn.qkv = qkv if on else None
        layer.mlp.gate_up = gate_up if on else None


def decode_steps(model_dir: str, batch: int, device: str, steps: int, every: int = 5
                 ) -> tuple[float, float]:
    """Median decode-step seconds (separate, fused) of one engine, switching every ``every``."""
    eng = LLMEngine.from_options(model_dir, kv_cache_tokens=max(32768, batch * 1024),
                                 max_model_len=1024, max_batch_size=max(batch, 8),
                                 device=device, enforce_eager=True)
    model = eng.runner.model
    parts = {n: (layer.self_attn.qkv, layer.mlp.gate_up)
             for n, layer in model.model.layers.items()}
    vocab = model.config.vocab_size
    rng = random.Random(batch)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(256)],
                        SamplingParams(max_tokens=steps + 20, ignore_eos=True))
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                       for r in eng.scheduler.running):
        eng.step()  # the prefills
    for _ in range(5):
        eng.step()
    times: dict[bool, list[float]] = {False: [], True: []}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(steps):
        # blocks off, on, on, off, ...: each step's context is one token longer than the
        # last, and this order gives both the same mean context (plain alternation would not)
        on = (i // every) % 4 in (1, 2)
        set_fused(model, parts, on)
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        times[on].append(time.perf_counter() - t0)
    set_fused(model, parts, True)
    eng.shutdown()
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fused_projections",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: a random "
                    "512-hidden, 8-layer one)")
    ap.add_argument("--out", default=None, help="append a markdown report here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_tiny_checkpoint(os.path.join(tmp, "m"), seed=0, **SIZES)
        rows = [(b, *decode_steps(model_dir, b, args.device, args.steps)) for b in batches]

    aff = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    dev = (torch.cuda.get_device_name() if args.device == "cuda"
           else f"{platform.machine()} CPU, {os.cpu_count()} cores (this process on cores "
                f"{aff}), {args.threads} torch thread(s)")
    model = args.model or ("random " + ", ".join(f"{k}={v}" for k, v in SIZES.items()))
    lines = [f"## fused_projections ({time.strftime('%Y-%m-%d')})", "",
             f"- machine: {dev}, {platform.system()}, torch {torch.__version__}; load "
             f"average before: {load:.2f}",
             f"- model: {model}; float32 on CPU, the checkpoint's dtype on CUDA; eager steps",
             f"- command: `python -m bench.fused_projections {' '.join(sys.argv[1:])}`", "",
             "Engine decode step, prompt 256 per request; one engine per batch, its layers "
             "switched between separate and fused projections in blocks of 5 steps, "
             "off-on-on-off (median of each "
             f"over {args.steps} steps):", "",
             "| batch | separate ms | fused ms | fused speedup |", "|---|---|---|---|"]
    for b, sep, fused in rows:
        lines.append(f"| {b} | {sep * 1e3:.2f} | {fused * 1e3:.2f} | {sep / fused:.2f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
