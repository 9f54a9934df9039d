"""`disagg generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import sys
import time


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text offline (default: the built-in tiny model)",
        description="Generate text with the offline engine. Without MODEL_DIR, the built-in "
        "tiny random-weight model is created in the cache folder on first use.",
    )
    p.add_argument("model_dir", nargs="?", help="Hugging Face checkpoint folder")
    p.add_argument("-p", "--prompt", action="append", help="prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--max-num-tokens", type=int, default=None)
    p.add_argument("--tokens-per-block", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="tensor parallel ranks (processes) (default 1)")
    p.add_argument("--pipeline-parallel-size", type=int, default=None, metavar="N",
                   help="pipeline parallel stages (processes) (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from disagg.config import ConfigError
    from disagg.llm import LLM
    from disagg.model.tiny import ensure_tiny_model
    from disagg.request import SamplingParams, SamplingParamsError

    model_dir = args.model_dir or ensure_tiny_model()
    prompts = args.prompt or ["The quick brown fox", "Once upon a time"]
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed,
        )
        llm = LLM(
            model_dir,
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
            tokens_per_block=args.tokens_per_block,
            kv_cache_tokens=args.kv_cache_tokens,
            dtype=args.dtype,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
        )
    except (ConfigError, SamplingParamsError) as e:
        print(f"disagg generate: error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()  # stops the ranks of a parallel run
    elapsed = time.perf_counter() - start
    n_tokens = 0
    for out in outs:
        comp = out.outputs[0]
        n_tokens += len(comp.token_ids)
        print(f"prompt: {out.prompt!r}\noutput: {comp.text!r} ({len(comp.token_ids)} tokens, "
              f"finish_reason={comp.finish_reason})\n")
    print(f"model: {model_dir}\n{n_tokens} tokens in {elapsed:.2f} s")
    return 0
