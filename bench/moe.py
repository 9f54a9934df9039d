"""Mixture-of-experts models on CPU: disagg's engine against transformers, and the grouped
expert layer against a per-expert loop.

1. End to end, the same random checkpoint (written by ``disagg.model.tiny``) through disagg's
   engine (``LLM.generate``) and transformers' ``generate()``, greedy, float32, one batch of
   ``--batch`` prompts of ``--prompt-len`` tokens: prefill tokens/s (``max_tokens=1``) and
   decode tokens/s (``--decode-tokens`` more tokens, timed as the difference), for a tiny
   Mixtral and for ~100 M parameter shapes (Mixtral-like: 8 large experts, top-2; Qwen3-MoE
   like: 48 small experts, top-8). Whether both produced the same greedy tokens is reported.
2. The expert layer alone (router outputs -> expert outputs) on ``T`` tokens of each ~100 M
   shape's first layer: disagg's grouped execution (``moe.MoeExperts``, with the CPU small-M
   GEMM as the runner sets it) against transformers' own experts module, both its default
   implementation and ``eager`` (its loop over the experts hit: a mask, a gather, two GEMMs
   and a scatter per expert).

The machine is shared (other processes' CPU time during the run is reported): each
comparison alternates the two systems ``--repeats`` times; end-to-end ratios are the median
of back-to-back pairs, layer times the minimum over the repeats.

    python -m bench.moe [--shapes tiny,mixtral-100m,qwen3moe-100m] [--batch 8]
                        [--prompt-len 128] [--decode-tokens 32] [--repeats 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os

# Spinning OpenMP waits make runs on a shared 2-core machine erratic (bench/results/parallel.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from bench.baseline import machine_busy_s
from disagg import LLM, SamplingParams
from disagg.model import kernels
from disagg.model.loader import load_model
from disagg.model.moe import softmax_topk
from disagg.model.tiny import write_tiny_checkpoint

# name -> write_tiny_checkpoint arguments
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="mixtral"),  # `disagg model tiny --arch mixtral`: 8 experts, top-2
    "mixtral-100m": dict(arch="mixtral", hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         vocab_size=2048, num_experts=8, num_experts_per_tok=2),
    "qwen3moe-100m": dict(arch="qwen3_moe", hidden_size=512, intermediate_size=1024,
                          num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2,
                          vocab_size=2048, num_experts=48, num_experts_per_tok=8,
                          moe_intermediate_size=256),
}
LAYER_TOKENS = (1, 8, 64, 512)


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def run_disagg(llm: LLM, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def run_hf(hf: Any, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(batch)  # equal lengths: no padding
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def end_to_end(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill and decode tokens/s of both systems, alternated ``args.repeats`` times."""
    from transformers import AutoModelForCausalLM

    batch = prompts(args.batch, args.prompt_len, args.seed)
    need = args.batch * (args.prompt_len + args.decode_tokens + 32)
    llm = LLM(model_dir, max_batch_size=args.batch, max_num_tokens=max(need, 2048),
              tokens_per_block=32, kv_cache_tokens=need, enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    run_disagg(llm, batch, 2)  # warm up kernels and allocators at the batch's shapes
    run_hf(hf, batch, 2)
    rows = []
    for _ in range(args.repeats):
        d1, _ = run_disagg(llm, batch, 1)
        dn, d_tokens = run_disagg(llm, batch, 1 + args.decode_tokens)
        h1, _ = run_hf(hf, batch, 1)
        hn, h_tokens = run_hf(hf, batch, 1 + args.decode_tokens)
        rows.append(dict(d_prefill=d1, d_decode=dn - d1, h_prefill=h1, h_decode=hn - h1))
    same = sum(a == b for a, b in zip(d_tokens, h_tokens, strict=True))
    n_params = sum(p.numel() for p in llm.engine.runner.model.parameters())
    impl = hf.get_experts_implementation().get("", "?")
    llm.shutdown()
    return dict(rows=rows, same=same, params=n_params, hf_impl=impl)


def layer_times(model_dir: str, repeats: int) -> list[dict[str, Any]]:
    """Milliseconds of the first layer's experts on ``T`` tokens (router outputs given)."""
    from transformers import AutoModelForCausalLM

    ours = load_model(model_dir)
    ours.use_linear_kernel(kernels.small_linear_kernel())  # as the CPU runner does
    moe = ours.model.layers["0"].feed_forward
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_layer = hf.model.layers[0]
    hf_experts = (hf_layer.mlp if hasattr(hf_layer, "mlp") else hf_layer.block_sparse_moe).experts
    default_impl = hf.get_experts_implementation().get("", "?")
    hidden = ours.config.hidden_size
    impls = list(dict.fromkeys([default_impl, "eager"]))  # transformers' default, its loop
    g = torch.Generator().manual_seed(0)
    out = []

    def timed(f: Any) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        y = f()
        return time.perf_counter() - t0, y

    for t in LAYER_TOKENS:
        x = torch.randn(t, hidden, generator=g)
        with torch.inference_mode():
            w, ids = softmax_topk(torch.nn.functional.linear(x, moe.gate.weight), moe.top_k,
                                  moe.renormalize)

            def ours(x=x, ids=ids, w=w) -> torch.Tensor:
                return moe.experts(x, ids, w)

            def theirs(x=x, ids=ids, w=w) -> torch.Tensor:
                return hf_experts(x, ids, w)

            ref = ours()
            best = dict.fromkeys(["disagg grouped", *(f"transformers {i}" for i in impls)],
                                 float("inf"))
            for r in range(repeats + 1):  # round 0 warms up, uncounted
                for impl in impls:
                    hf.set_experts_implementation(impl)
                    dt, y = timed(theirs)
                    torch.testing.assert_close(y, ref, atol=1e-4, rtol=0)
                    if r:
                        best[f"transformers {impl}"] = min(best[f"transformers {impl}"], dt)
                dt, _ = timed(ours)
                if r:
                    best["disagg grouped"] = min(best["disagg grouped"], dt)
            hf.set_experts_implementation(default_impl)
        out.append(dict(tokens=t, ms={k: v * 1e3 for k, v in best.items()}))
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batch", type=int, default=8, help="prompts per batch")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    return ap


def main() -> None:
    args = _parser().parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {list(SHAPES)}")
    load0, busy0, own0, wall0 = os.getloadavg(), machine_busy_s(), own_cpu_s(), time.time()
    results, layers = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in shapes:
            path = write_tiny_checkpoint(os.path.join(tmp, name), seed=0, **SHAPES[name])
            results[name] = end_to_end(path, args)
            print(f"{name}: {results[name]}", flush=True)
            if name != "tiny":
                layers[name] = layer_times(path, args.repeats)
                print(f"{name} layer: {layers[name]}", flush=True)
    wall = time.time() - wall0
    others = max(0.0, (machine_busy_s() - busy0) - (own_cpu_s() - own0))

    tok = args.batch * args.prompt_len
    dec = args.batch * args.decode_tokens
    lines = [
        "# MoE on CPU: disagg vs transformers",
        "",
        f"Written by `python -m bench.moe {' '.join(sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); every number below is the "
        "script's own measurement.",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"float32, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, CPU kernels: "
        f"{', '.join(k for k, on in kernels.status().items() if on) or 'none'}",
        f"- load: a shared machine. Load average (1, 5, 15 min) "
        f"{', '.join(f'{x:.2f}' for x in load0)} before, "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} after; other processes used "
        f"{others:.0f} CPU s of the {wall * (os.cpu_count() or 1):.0f} core-seconds of this "
        f"{wall:.0f} s run ({others / max(wall * (os.cpu_count() or 1), 1e-9):.0%}).",
        f"- workload: {args.batch} prompts x {args.prompt_len} tokens ({tok} prefill tokens), "
        f"then {args.decode_tokens} greedy tokens each ({dec} decode tokens); "
        f"{args.repeats} alternated pairs per shape, ratio = median over pairs.",
        "",
        "## End to end (tokens/s)",
        "",
        "| shape | parameters | transformers experts | phase | disagg tokens/s | "
        "transformers tokens/s | ratio (median) | same greedy tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    headline = []
    for name, r in results.items():
        for phase, n in (("prefill", tok), ("decode", dec)):
            d = [n / row[f"d_{phase}"] for row in r["rows"]]
            h = [n / row[f"h_{phase}"] for row in r["rows"]]
            ratio = statistics.median(a / b for a, b in zip(d, h, strict=True))
            lines.append(
                f"| {name} | {r['params'] / 1e6:.1f} M | {r['hf_impl']} | {phase} | "
                f"{statistics.median(d):.0f} | {statistics.median(h):.0f} | {ratio:.2f}x | "
                f"{r['same']}/{args.batch} |")
            if name != "tiny":
                headline.append(f"{name} {phase} {ratio:.2f}x")
    lines += ["", "## The expert layer alone (ms per call, minimum over the repeats)", ""]
    for name, rows in layers.items():
        cols = list(rows[0]["ms"])
        lines += [f"{name} (first layer; {SHAPES[name]['num_experts']} experts, top "
                  f"{SHAPES[name]['num_experts_per_tok']}):", "",
                  "| tokens | " + " | ".join(cols) + " | grouped vs eager loop |",
                  "|---|" + "---|" * (len(cols) + 1)]
        for row in rows:
            ms = row["ms"]
            lines.append(f"| {row['tokens']} | " + " | ".join(f"{ms[c]:.2f}" for c in cols)
                         + f" | {ms['transformers eager'] / ms['disagg grouped']:.2f}x |")
        lines.append("")
    if headline:
        lines += [
            f"**Headline: disagg / transformers tokens/s: {', '.join(headline)}**, at the cost "
            "of one host sync per MoE layer (the per-expert row counts) and a gathered copy of "
            "the routed activations (`T * top_k` rows of the hidden size, plus as many output "
            "rows) per layer; the stacked expert weights are the checkpoint's, not a second "
            f"copy. Measured on a shared machine ({others:.0f} CPU s used by other processes "
            "during the run).", ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
