"""Engine throughput against transformers, and decode-step efficiency, in one run.

1. The same checkpoint (tens of millions of parameters) and the same seeded workload (64
   requests, prompt 32-512 tokens, output 16-256 tokens) through disagg's engine (in-flight
   batching) and through transformers ``generate()`` in static batches of the same size.
   Output tokens/s of both and the ratio.
2. The engine's decode step (schedule + inputs + paged forward + sample + bookkeeping) against
   a bare forward of the same weights on contiguous K/V tensors for the same batch: efficiency =
   bare / engine.

The machines are shared and their speed drifts by tens of percent over minutes, so the two
systems run ``--repeats`` times alternately (engine, transformers, engine, ...) and the ratio
reported is the median of the per-pair ratios, each pair measured back to back.

    python -m bench.engine_throughput [--batch-size 16] [--num-requests 64] [--repeats 3]
                                      [--model DIR] [--out FILE.md]

``--model DIR``: a checkpoint folder instead of the random tiny one, e.g. SmolLM2-135M-Instruct
as ``disagg model fetch smollm2 DIR`` imports it (30 layers, 135 M parameters: shrink the
workload with ``--num-requests`` / ``--prompt-len`` / ``--output-len`` to fit minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os

# With two OpenMP threads on a shared 2-core machine, spinning waits make runs erratic
# (measured in bench/results/parallel.md); passive waiting keeps both systems comparable.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from bench.probes import ScheduleLog
from disagg import LLM, SamplingParams
from disagg.engine import LLMEngine
from disagg.model import kernels
from disagg.model.llama import apply_rope
from disagg.model.tiny import write_tiny_checkpoint

SIZES = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=2048)


def workload(n: int, vocab: int, special: set[int], seed: int, prompt: tuple[int, int] = (32, 512),
             output: tuple[int, int] = (16, 256)) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in special]
    return [([rng.choice(ids) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN-MAX with 0 < MIN <= MAX")
    return a, b


def kv_tokens(work, batch_size: int) -> int:
    """KV room for a full batch of the workload's longest requests."""
    return batch_size * (max(len(p) for p, _ in work) + max(o for _, o in work) + 64)


def run_engine(model_dir: str, work, batch_size: int) -> tuple[float, int]:
    llm = LLM(model_dir, max_batch_size=batch_size, max_num_tokens=2048, tokens_per_block=32,
              kv_cache_tokens=kv_tokens(work, batch_size), enable_prefix_caching=False)
    # warm up kernels and allocator
    llm.generate([work[0][0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == sum(o for _, o in work)
    return elapsed, n


def run_transformers(model_dir: str, work, batch_size: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    useful = 0
    with torch.no_grad():
        model.generate(torch.tensor([work[0][0]]), max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        for i in range(0, len(work), batch_size):
            batch = work[i : i + batch_size]
            width = max(len(p) for p, _ in batch)
            # Left padding, as generate() expects for decoder-only models.
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, (p, _) in enumerate(batch):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            # A static batch runs until its longest request is done.
            model.generate(ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=max(o for _, o in batch))
            useful += sum(o for _, o in batch)
        elapsed = time.perf_counter() - t0
    return elapsed, useful


def step_split(model_dir: str, work, batch_size: int) -> dict[str, float]:
    """Where the engine's time goes on the workload: steps that carry prompt tokens vs
    decode-only steps (a second run, timed per step)."""
    engine = LLMEngine.from_options(model_dir, max_batch_size=batch_size, max_num_tokens=2048,
                                    tokens_per_block=32, enable_prefix_caching=False,
                                    kv_cache_tokens=kv_tokens(work, batch_size))
    for i, (p, o) in enumerate(work):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=o,
                                                      ignore_eos=True))
    out = dict(prefill_steps=0, prefill_s=0.0, prompt_tokens=0, decode_steps=0, decode_s=0.0)
    log = ScheduleLog(engine)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        sched = log.last
        assert sched is not None
        prompt = sum(len(r.token_ids) for r in sched.scheduled if len(r.token_ids) > 1)
        kind = "prefill" if prompt else "decode"
        out[f"{kind}_steps"] += 1
        out[f"{kind}_s"] += dt
        out["prompt_tokens"] += prompt
    return out


def decode_efficiency(model_dir: str, batch_size: int, ctx: int, steps: int) -> tuple[float, float]:
    """Median seconds per decode step: (engine step, bare contiguous forward)."""
    engine = LLMEngine.from_options(model_dir, max_batch_size=batch_size, max_num_tokens=8192,
                                    tokens_per_block=32, enable_prefix_caching=False,
                                    kv_cache_tokens=batch_size * (ctx + steps + 64))
    rng = random.Random(1)
    for i in range(batch_size):
        engine.add_request(f"r{i}", [rng.randrange(0, 500) for _ in range(ctx)],
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    engine.step()  # all prefills

    # Bare forward: same modules and weights, K/V in contiguous [batch, heads, len, dim] tensors
    # written in place, one SDPA per layer, logits + argmax for the batch.
    model = engine.runner.model
    cfg = engine.config.model
    layers = list(model.model.layers.values())
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    k_cache = [torch.randn(batch_size, hkv, ctx + steps, d) for _ in layers]
    v_cache = [torch.randn(batch_size, hkv, ctx + steps, d) for _ in layers]
    tokens = torch.randint(0, 500, (batch_size,))

    @torch.inference_mode()
    def bare_step(pos: int) -> None:
        nonlocal tokens
        x = model.model.embed_tokens(tokens)
        cos, sin = model.rotary(torch.full((batch_size,), pos), x.dtype)
        for li, layer in enumerate(layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            # the model's own projections (one fused GEMM when load_model fused them)
            q, k, v = att.qkv(h) if att.qkv is not None else (
                att.q_proj(h), att.k_proj(h), att.v_proj(h))
            q = apply_rope(q.view(batch_size, att.num_heads, d), cos, sin)
            k = apply_rope(k.view(batch_size, hkv, d), cos, sin)
            v = v.view(batch_size, hkv, d)
            k_cache[li][:, :, pos] = k
            v_cache[li][:, :, pos] = v
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), k_cache[li][:, :, : pos + 1], v_cache[li][:, :, : pos + 1],
                enable_gqa=True,
            )
            x = x + att.o_proj(o.reshape(batch_size, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        tokens = model.compute_logits(model.model.norm(x)).argmax(-1)

    # Alternate the two so both see the same machine state (the machines are noisy).
    engine_times, bare_times = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        bare_step(ctx + s)
        t2 = time.perf_counter()
        engine_times.append(t1 - t0)
        bare_times.append(t2 - t1)
    return statistics.median(engine_times), statistics.median(bare_times)


def machine_lines(load0: Sequence[float]) -> list[str]:
    """The results files' machine lines: platform, torch and its threads, the CPU kernels in
    use, the CPU model and the load average before (``load0``) and after the run."""
    return [
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device cpu, float32, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, CPU kernels "
        f"{', '.join(k for k, on in kernels.status().items() if on) or 'none (PyTorch path)'}",
        f"- CPU: {cpu_model()}; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load0)}, after "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine)",
    ]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def describe_model(model_dir: str | None) -> str:
    if model_dir is None:
        return f"random llama {SIZES}"
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings")
    return f"`{model_dir}` ({cfg.get('model_type', '?')}: " + ", ".join(
        f"{k} {cfg[k]}" for k in keys if k in cfg) + ")"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_throughput",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternate engine and transformers runs this many times")
    ap.add_argument("--decode-ctx", type=int, default=384)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=_range, default=(32, 512), metavar="MIN-MAX")
    ap.add_argument("--output-len", type=_range, default=(16, 256), metavar="MIN-MAX")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a checkpoint folder (default: a random tiny llama, SIZES)")
    ap.add_argument("--out", default=None, help="append a markdown report here (a new file "
                                                "starts with a title and the command)")
    return ap


def main() -> None:
    args = _parser().parse_args()
    load0 = os.getloadavg()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_tiny_checkpoint(os.path.join(tmp, "m"), seed=0, **SIZES)
        n_params = sum(p.numel() for p in LLM(model_dir, kv_cache_tokens=64)
                       .engine.runner.model.parameters())
        from disagg.tokenizer import load_tokenizer

        special = set(load_tokenizer(model_dir).all_special_ids)
        work = workload(args.num_requests, 500, special, args.seed, args.prompt_len,
                        args.output_len)
        pairs = []  # (engine seconds, transformers seconds), each pair back to back
        for _ in range(args.repeats):
            e_time, e_tok = run_engine(model_dir, work, args.batch_size)
            h_time, h_tok = run_transformers(model_dir, work, args.batch_size)
            pairs.append((e_time, h_time))
        split = step_split(model_dir, work, args.batch_size)
        step_engine, step_bare = decode_efficiency(model_dir, args.batch_size, args.decode_ctx,
                                                   args.decode_steps)

    assert e_tok == h_tok
    ratios = [h / e for e, h in pairs]  # same token count: tokens/s ratio = time ratio
    rows = [
        f"| {i + 1} | {e:.1f} | {e_tok / e:.1f} | {h:.1f} | {h_tok / h:.1f} | {h / e:.2f}x |"
        for i, (e, h) in enumerate(pairs)
    ]
    lines = [
        f"## engine_throughput ({time.strftime('%Y-%m-%d')})",
        "",
        *machine_lines(load0),
        f"- model: {describe_model(args.model)}, {n_params / 1e6:.1f} M parameters",
        f"- workload: {args.num_requests} requests, prompt {'-'.join(map(str, args.prompt_len))}"
        f", output {'-'.join(map(str, args.output_len))} tokens (seed {args.seed}), {e_tok} "
        f"output tokens; batch size {args.batch_size}",
        "",
        "| pair | disagg engine s | tokens/s | transformers generate s | tokens/s | ratio |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"**throughput ratio disagg / transformers (median of {len(pairs)} pairs): "
        f"{statistics.median(ratios):.2f}x** (range {min(ratios):.2f}x-{max(ratios):.2f}x)",
        "",
        f"Decode step, batch {args.batch_size}, context {args.decode_ctx}, median of "
        f"{args.decode_steps} steps: engine {step_engine * 1e3:.1f} ms, bare contiguous forward "
        f"{step_bare * 1e3:.1f} ms -> **efficiency {step_bare / step_engine:.0%}**",
        "",
        f"Where the engine's time goes (a second run, timed per step): "
        f"{split['prefill_steps']} steps carrying the {split['prompt_tokens']} prompt tokens "
        f"take {split['prefill_s']:.1f} s "
        f"({split['prefill_s'] / max(split['prompt_tokens'], 1) * 1e3:.2f} ms a prompt "
        f"token); {split['decode_steps']} decode-only steps take {split['decode_s']:.1f} s "
        f"({split['decode_s'] / max(split['decode_steps'], 1) * 1e3:.1f} ms each).",
        "",
    ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        title = "" if os.path.exists(args.out) else (
            "# Engine throughput and decode efficiency (CPU)\n\nWritten by `python -m "
            f"bench.engine_throughput {' '.join(sys.argv[1:])}`: the sections below are the "
            "script's own output.\n\n")
        with open(args.out, "a") as f:
            f.write(title + report + "\n")


if __name__ == "__main__":
    main()
