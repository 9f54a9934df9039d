"""``disagg bench``: serving benchmark (``serve``), cluster sizing (``rate-match``) and plots
of saved results (``plot``).

Examples::

    disagg bench serve --base-url http://127.0.0.1:8000 --tokenizer ./tiny \\
        --random-input-len 512 --random-output-len 64 --num-prompts 200 --request-rate 4 \\
        --goodput ttft:500 tpot:50 --save-result run.json
    disagg bench rate-match --context-url http://127.0.0.1:8001 \\
        --generation-url http://127.0.0.1:8002 --tokenizer ./tiny --isl 512 --osl 64 \\
        --ttft-slo 1000 --concurrency 1,2,4,8 --save-result rm.json
    disagg bench plot run-*.json --out-dir plots/
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any

from disagg.bench.client import make_transport
from disagg.bench.datasets import (
    DatasetError,
    SampleRequest,
    TokenizerLike,
    load_bench_tokenizer,
    sample_mooncake,
    sample_random,
    sample_sharegpt,
)
from disagg.bench.metrics import format_summary, parse_goodput, parse_percentiles
from disagg.bench.runner import BenchmarkConfig, BenchmarkError, resolve_model, run_benchmark
from disagg.env import OPENAI_API_KEY

# ----------------------------------------------------------------------- argument types
# argparse reports a type error as "argument --flag: <message>", naming the flag.


def _int_at_least(low: int):  # noqa: ANN202 - argparse type factory
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return conv


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return v


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        return parse_percentiles(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _slo(text: str) -> dict[str, float]:
    try:
        return parse_goodput([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need integers >= 1, got {text!r}")
    return values


def _percentile(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < v <= 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 100], got {text}")
    return v


def _json_object(text: str) -> dict[str, Any]:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


# ------------------------------------------------------------------------------ parsers


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="serving benchmarks",
                                  description="Serving benchmarks of OpenAI-compatible endpoints.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    serve = sub.add_parser(
        "serve", help="benchmark a serving endpoint",
        description="Stream a workload to an OpenAI-compatible endpoint (disagg, vLLM, "
                    "TensorRT-LLM...) and report TTFT, TPOT, ITL, E2EL, throughput and goodput.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = serve.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server URL (with or without a trailing /v1)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions")
    g.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    g.add_argument("--api-key", default=OPENAI_API_KEY.get(),
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--extra-body", type=_json_object, default={},
                   help="JSON object merged into every request body")
    g.add_argument("--http-client", choices=("auto", "aiohttp", "httpx"), default="auto",
                   help="HTTP library (auto: aiohttp if installed)")
    g.add_argument("--request-timeout", type=_positive_float, default=6 * 3600.0,
                   help="seconds before one request is abandoned (counted as failed)")

    g = serve.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "sharegpt", "mooncake-trace"),
                   default="random")
    g.add_argument("--dataset-path", help="ShareGPT JSON or Mooncake trace JSONL file")
    g.add_argument("--tokenizer",
                   help="tokenizer folder or tokenizer.json (default: --model if a folder)")
    g.add_argument("--num-prompts", type=_int_at_least(1), default=1000)
    g.add_argument("--random-input-len", type=_int_at_least(1), default=1024)
    g.add_argument("--random-output-len", type=_int_at_least(1), default=128)
    g.add_argument("--random-range-ratio", type=_ratio, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--random-prefix-len", type=_int_at_least(0), default=0,
                   help="tokens of a random prefix shared by every prompt")
    g.add_argument("--sharegpt-output-len", type=_int_at_least(1), default=None,
                   help="override ShareGPT output lengths")
    g.add_argument("--trace-block-size", type=_int_at_least(1), default=512,
                   help="tokens per Mooncake hash id")
    g.add_argument("--trace-speedup", type=_positive_float, default=1.0,
                   help="replay Mooncake timestamps this many times faster")
    g.add_argument("--prompt-as-token-ids", action="store_true",
                   help="send prompts as token id lists (completions; exact lengths by "
                        "construction, the server must accept token-id prompts)")
    g.add_argument("--seed", type=int, default=0)

    g = serve.add_argument_group("load")
    g.add_argument("--request-rate", type=_positive_float, default=None,
                   help="requests/s (default inf: all at once; with a Mooncake trace, default "
                        "replays its timestamps)")
    g.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=_int_at_least(1), default=None,
                   help="at most this many requests in flight")
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to ignore EOS so outputs have max_tokens tokens")
    g.add_argument("--num-warmups", type=_int_at_least(0), default=0,
                   help="requests sent first and left out of the results")
    g.add_argument("--gen-only", action="store_true",
                   help="benchmarking aid: generation-only requests (adds "
                        "disaggregated_params.request_type=generation_only, implies "
                        "--ignore-eos) for a generation worker started with "
                        "--benchmark-gen-only, which decodes without a context server "
                        "(prompt KV taken as computed; contents meaningless)")

    g = serve.add_argument_group("results")
    g.add_argument("--goodput", type=_slo, nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--percentiles", type=_percentiles, default=(90.0, 99.0),
                   help="comma-separated percentiles reported besides mean and median")
    g.add_argument("--save-result", metavar="FILE", help="write the JSON result here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    serve.set_defaults(func=lambda args: serve_main(args, serve))

    add_rate_match_cli(sub)

    plot = sub.add_parser("plot", help="redraw PNGs from saved results",
                          description="Latency CDFs and throughput vs tokens/s/user from "
                                      "`disagg bench serve --save-result` files; a "
                                      "`disagg bench rate-match` result gets its curve PNG.")
    plot.add_argument("files", nargs="+", metavar="FILE")
    plot.add_argument("--out-dir", help="where to write PNGs (default: the first file's folder)")
    plot.add_argument("--devices", type=_positive_float, default=1.0,
                      help="divide throughput by this many devices")
    plot.add_argument("--title", help="figure title")
    plot.set_defaults(func=lambda args: plot_main(args, plot))


# --------------------------------------------------------------------------------- serve


def _check_serve_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Cross-flag checks; parser.error exits with status 2 and names the flag."""
    if args.dataset in ("sharegpt", "mooncake-trace"):
        if not args.dataset_path:
            parser.error(f"--dataset-path: required with --dataset {args.dataset}")
        if not os.path.isfile(args.dataset_path):
            parser.error(f"--dataset-path: no such file {args.dataset_path!r}")
    if args.prompt_as_token_ids and args.endpoint == "chat":
        parser.error("--prompt-as-token-ids: only with --endpoint completions")
    if args.tokenizer and not os.path.exists(args.tokenizer):
        parser.error(f"--tokenizer: no such folder {args.tokenizer!r}")
    if args.save_result:
        parent = os.path.dirname(os.path.abspath(args.save_result))
        if not os.path.isdir(parent):
            parser.error(f"--save-result: folder {parent!r} does not exist")


def build_samples(args: argparse.Namespace, tok: TokenizerLike) -> list[SampleRequest]:
    if args.dataset == "random":
        return sample_random(tok, args.num_prompts, args.random_input_len,
                             args.random_output_len, args.random_range_ratio,
                             args.random_prefix_len, args.seed, args.prompt_as_token_ids)
    if args.dataset == "sharegpt":
        return sample_sharegpt(args.dataset_path, tok, args.num_prompts, args.seed,
                               args.sharegpt_output_len, args.prompt_as_token_ids)
    return sample_mooncake(args.dataset_path, tok, args.num_prompts, args.seed,
                           args.trace_block_size, args.prompt_as_token_ids, args.trace_speedup)


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    w: dict[str, Any] = {"dataset": args.dataset, "num_prompts": args.num_prompts,
                         "prompt_as_token_ids": args.prompt_as_token_ids}
    if args.dataset == "random":
        w.update(input_len=args.random_input_len, output_len=args.random_output_len,
                 range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len)
    else:
        w["dataset_path"] = args.dataset_path
    if args.dataset == "mooncake-trace":
        w.update(block_size=args.trace_block_size, speedup=args.trace_speedup)
    return w


def _err(msg: str) -> None:
    print(f"disagg bench serve: error: {msg}", file=sys.stderr)


async def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    slos: dict[str, float] = {}
    for d in args.goodput:
        slos.update(d)
    config = BenchmarkConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        request_rate=args.request_rate if args.request_rate is not None else math.inf,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        # An explicit --request-rate replaces a trace's own timestamps.
        use_trace_timestamps=args.request_rate is None, ignore_eos=args.ignore_eos,
        goodput_slos_ms=slos, percentiles=args.percentiles, seed=args.seed,
        num_warmups=args.num_warmups, api_key=args.api_key, extra_body=args.extra_body,
        gen_only=args.gen_only, http_client=args.http_client,
        request_timeout_s=args.request_timeout,
        workload=_workload(args))
    transport = make_transport(config.http_client, config.request_timeout_s)
    try:
        try:
            config.model = await resolve_model(config, transport)
        except BenchmarkError as e:
            _err(str(e))
            return 1
        tok_dir = args.tokenizer or (config.model if os.path.isdir(config.model) else None)
        if tok_dir is None:
            parser.error(f"--tokenizer: needed to build {args.dataset} prompts and model "
                         f"{config.model!r} is not a local folder")
        config.workload["tokenizer"] = tok_dir
        t = time.perf_counter()
        try:
            tok = load_bench_tokenizer(tok_dir)
            samples = build_samples(args, tok)
        except (DatasetError, OSError) as e:
            _err(str(e))
            return 1
        inexact = sum(not s.exact for s in samples)
        print(f"Built {len(samples)} {args.dataset} prompts in {time.perf_counter() - t:.1f} s"
              + (f" ({inexact} not of the exact target length; their true lengths are used)"
                 if inexact else ""), file=sys.stderr)
        if len(samples) < args.num_prompts:
            print(f"note: the dataset has only {len(samples)} usable requests "
                  f"(--num-prompts {args.num_prompts})", file=sys.stderr)
        timing = ("trace timestamps" if config.use_trace_timestamps
                  and all(s.timestamp is not None for s in samples)
                  else f"rate {config.request_rate:g} req/s, burstiness {config.burstiness:g}")
        print(f"Benchmarking {config.model!r} at {config.base_url} ({config.endpoint}): "
              f"{len(samples)} requests, {timing}, max concurrency "
              f"{config.max_concurrency or 'unlimited'}", file=sys.stderr)
        try:
            result = await run_benchmark(config, samples, progress=not args.no_progress,
                                         transport=transport)
        except BenchmarkError as e:
            _err(str(e))
            return 1
    finally:
        await transport.aclose()
    print(format_summary(result.summary, config.percentiles))
    if args.save_result:
        result.save(args.save_result)
        print(f"Saved {args.save_result}", file=sys.stderr)
    if result.summary["completed"] == 0:
        _err("every request failed")
        return 1
    return 0


def serve_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_serve_args(args, parser)
    return asyncio.run(_serve(args, parser))


# ---------------------------------------------------------------------------------- plot


def plot_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from disagg.bench.plot import plot_rate_match, plot_rate_match_layouts, plot_results
    from disagg.bench.ratematch import RESULT_KIND as RATE_MATCH_KIND
    from disagg.bench.ratematch.layouts import RESULT_KIND as LAYOUTS_KIND
    from disagg.bench.runner import load_result

    results, rate_matches = [], []
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as f:
                head = json.load(f)
            if isinstance(head, dict) and head.get("kind") in (RATE_MATCH_KIND, LAYOUTS_KIND):
                rate_matches.append((path, head))  # drawn as its own curve PNG
            else:
                results.append((path, load_result(path)))
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            parser.error(f"FILE {path!r}: {e}")
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.files[0]))
    if results:
        for path in plot_results(results, out_dir, devices=args.devices, title=args.title):
            print(path)
    for path, res in rate_matches:
        stem = os.path.splitext(os.path.basename(path))[0]
        plot = plot_rate_match if res["kind"] == RATE_MATCH_KIND else plot_rate_match_layouts
        print(plot(res, os.path.join(out_dir, stem + ".png"), title=args.title))
    return 0


# ---------------------------------------------------------------------------- rate-match


def add_rate_match_cli(sub: argparse._SubParsersAction) -> None:
    rm = sub.add_parser(
        "rate-match", help="size a disaggregated cluster: ctx:gen ratio and tokens/s per device",
        description="Measure one context worker (highest request rate within a TTFT SLO) and "
                    "one generation worker (started with --benchmark-gen-only: output tokens/s "
                    "and tokens/s/user per concurrency), rate-match them (enough context "
                    "workers per generation worker that both sides serve the same request "
                    "rate) and write JSON and a PNG of tokens/s per device against "
                    "tokens/s/user. See the disagg/bench/ratematch/ package docstring for the "
                    "method and ratematch/report.py for the JSON schema.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = rm.add_argument_group("endpoints (or the layouts below)")
    g.add_argument("--context-url", help="one context worker")
    g.add_argument("--generation-url",
                   help="one generation worker started with --benchmark-gen-only")
    g.add_argument("--aggregated-url", help="one aggregated worker: the baseline curve")
    g.add_argument("--model", default="",
                   help="served model name (default: the first of the context worker's models)")
    g.add_argument("--tokenizer",
                   help="tokenizer folder or tokenizer.json (default: --model if a folder)")
    g.add_argument("--api-key", default=OPENAI_API_KEY.get(),
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--http-client", choices=("auto", "aiohttp", "httpx"), default="auto")
    g.add_argument("--request-timeout", type=_positive_float, default=3600.0,
                   help="seconds before one request is abandoned (counted as failed)")

    g = rm.add_argument_group("workload")
    g.add_argument("--isl", type=_int_at_least(1), default=1024, help="prompt tokens")
    g.add_argument("--osl", type=_int_at_least(2), default=128, help="output tokens")
    g.add_argument("--ttft-slo", type=_positive_float, required=True, metavar="MS",
                   help="context side: TTFT limit (ms) at --ttft-percentile")
    g.add_argument("--ttft-percentile", type=_percentile, default=90.0)
    g.add_argument("--concurrency", type=_int_list, default=(1, 2, 4, 8, 16),
                   metavar="N,N,...", help="generation concurrencies")
    g.add_argument("--agg-concurrency", type=_int_list, default=None, metavar="N,N,...",
                   help="aggregated concurrencies (default: --concurrency)")
    g.add_argument("--ctx-devices", type=_positive_float, default=1.0,
                   help="devices per context worker")
    g.add_argument("--gen-devices", type=_positive_float, default=1.0,
                   help="devices per generation worker")
    g.add_argument("--agg-devices", type=_positive_float, default=1.0,
                   help="devices per aggregated worker")
    g.add_argument("--seed", type=int, default=0, help="prompts and Poisson arrivals")
    g.add_argument("--num-warmups", type=_int_at_least(0), default=2,
                   help="requests sent to each worker first, left out of the results")

    g = rm.add_argument_group("search")
    g.add_argument("--ctx-rate-start", type=_positive_float, default=None, metavar="REQ/S",
                   help="first context rate probed (default: half of 1 / a warm TTFT)")
    g.add_argument("--ctx-max-probes", type=_int_at_least(1), default=8)
    g.add_argument("--ctx-tolerance", type=_positive_float, default=0.1,
                   help="stop bisecting at hi/lo <= 1 + this")
    g.add_argument("--ctx-probe-seconds", type=_positive_float, default=15.0,
                   help="a probe sends rate * this many requests ...")
    g.add_argument("--ctx-min-prompts", type=_int_at_least(1), default=16,
                   help="... and at least this many")
    g.add_argument("--gen-rounds", type=_int_at_least(1), default=4,
                   help="requests per concurrency = rounds * concurrency")
    g.add_argument("--colocated", action="store_true",
                   help="context and generation workers share one machine (CPU cores of "
                        "one host): measure each generation point again while the context "
                        "worker serves its SLO rate, and predict with the slowdown")

    g = rm.add_argument_group("verify (end to end with disagg launch on this machine)")
    g.add_argument("--verify", action="store_true",
                   help="start the chosen clusters with `disagg launch` and measure them")
    g.add_argument("--verify-model", metavar="DIR",
                   help="checkpoint folder the launched workers serve (needed by --verify)")
    g.add_argument("--verify-worker-config", metavar="YAML",
                   help="worker options of the launched workers (a `disagg serve --config` "
                        "file; default KV transfer: TCP)")
    g.add_argument("--verify-max-devices", type=_positive_float, default=2.0,
                   help="largest cluster (in devices) to launch")
    g.add_argument("--verify-points", type=_int_at_least(1), default=2,
                   help="frontier points to verify, spread along it")
    g.add_argument("--verify-timeout", type=_positive_float, default=300.0,
                   help="start-up limit of each launched cluster (s)")
    g.add_argument("--verify-log-dir", metavar="DIR",
                   help="launch logs (default: a folder beside --save-result)")

    g = rm.add_argument_group(
        "layouts (instead of the endpoints: start one worker per layout on this machine, "
        "measure each alone, rate-match every context x generation pair)")
    g.add_argument("--ctx-layouts", metavar="L,L,...",
                   help="context workers' layouts: tpN, ppN, tpN+ppM, tpN+ep (expert "
                        "parallel, MoE models), comma-separated")
    g.add_argument("--gen-layouts", metavar="L,L,...",
                   help="generation workers' layouts (default: --ctx-layouts)")
    g.add_argument("--gen-spec", metavar="S,S,...",
                   help="speculation settings of the generation workers: each generation "
                        "layout is measured once per setting (its worker started with "
                        "--speculative-config): off, ngram[:K[:N]] (K draft tokens, n-grams "
                        "of N), draft:K:DIR (a draft checkpoint), or JSON (an object or a "
                        "list); e.g. off,ngram:4 (default: the worker config's own)")
    g.add_argument("--serve-model", metavar="DIR",
                   help="checkpoint folder the started workers serve")
    g.add_argument("--serve-worker-config", metavar="YAML",
                   help="options of every started worker (a `disagg serve --config` file; "
                        "the layout's flags override its parallel sizes)")
    g.add_argument("--serve-timeout", type=_positive_float, default=300.0,
                   help="start-up limit of each worker (s)")
    g.add_argument("--serve-log-dir", metavar="DIR",
                   help="worker logs (default: a folder beside --save-result)")

    g = rm.add_argument_group("results")
    g.add_argument("--save-result", metavar="FILE", default="rate_match.json",
                   help="JSON result")
    g.add_argument("--plot", metavar="PNG",
                   help="PNG of the curves (default: --save-result with .png)")
    g.add_argument("--no-progress", action="store_true", help="no per-run lines on stderr")
    rm.set_defaults(func=lambda args: rate_match_main(args, rm))


def rate_match_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from disagg.bench.plot import plot_rate_match
    from disagg.bench.ratematch import (
        format_rate_match,
        launch_verifier,
        run_rate_match,
        save_result,
    )
    from disagg.contracts.options import load_worker_yaml, worker_yaml

    parent = os.path.dirname(os.path.abspath(args.save_result))
    if not os.path.isdir(parent):
        parser.error(f"--save-result: folder {parent!r} does not exist")
    if args.ctx_layouts or args.gen_layouts or args.gen_spec is not None:
        return _rate_match_layouts(args, parser)
    for flag, value in (("--context-url", args.context_url),
                        ("--generation-url", args.generation_url)):
        if not value:
            parser.error(f"{flag}: required (or measure layouts: --ctx-layouts, "
                         f"--serve-model)")
    tok_dir = args.tokenizer or (args.model if args.model and os.path.isdir(args.model)
                                 else None)
    if tok_dir is None:
        parser.error("--tokenizer: needed to build prompts (or give --model as a folder)")
    if not os.path.exists(tok_dir):
        parser.error(f"--tokenizer: no such folder {tok_dir!r}")
    verify = None
    if args.verify:
        if not args.verify_model or not os.path.isdir(args.verify_model):
            parser.error("--verify-model: a checkpoint folder is needed with --verify")
        opts: dict[str, Any] = {}
        if args.verify_worker_config:
            try:
                # Back to the cluster YAML's spelling: every option kept (the lease TTL as
                # kv_lease_ttl_s, the backend and the UCX profile as cache_transceiver_config).
                opts = worker_yaml(load_worker_yaml(args.verify_worker_config))
            except ValueError as e:  # ConfigError
                parser.error(f"--verify-worker-config: {e}")
        log_dir = args.verify_log_dir or os.path.splitext(
            os.path.abspath(args.save_result))[0] + "-verify-logs"
        verify = launch_verifier(os.path.abspath(args.verify_model), opts, log_dir,
                                 args.verify_timeout,
                                 progress=None if args.no_progress else sys.stderr)
    config = _rate_match_config(
        args, parser, context_url=args.context_url, generation_url=args.generation_url,
        ctx_devices=args.ctx_devices, gen_devices=args.gen_devices, colocated=args.colocated)
    try:
        tok = load_bench_tokenizer(tok_dir)
    except (DatasetError, OSError) as e:
        print(f"disagg bench rate-match: error: {e}", file=sys.stderr)
        return 1
    try:
        result = asyncio.run(run_rate_match(
            config, tok, progress=None if args.no_progress else sys.stderr, verify=verify,
            verify_max_devices=args.verify_max_devices, verify_points=args.verify_points))
    except (BenchmarkError, RuntimeError) as e:
        print(f"disagg bench rate-match: error: {e}", file=sys.stderr)
        return 1
    print(format_rate_match(result))
    save_result(result, args.save_result)
    png = args.plot or os.path.splitext(args.save_result)[0] + ".png"
    plot_rate_match(result, png)
    print(f"Saved {args.save_result} and {png}", file=sys.stderr)
    return 0 if result["context"]["ctx_rate"] is not None else 1


def _rate_match_config(args: argparse.Namespace, parser: argparse.ArgumentParser,
                       **mode: Any) -> Any:
    """The ``RateMatchConfig`` of the options both modes share, plus ``mode``'s (the
    endpoints' URLs and devices); a bad value is the parser's error naming it."""
    from disagg.bench.ratematch import RateMatchConfig

    try:
        return RateMatchConfig(
            aggregated_url=args.aggregated_url, ttft_slo_ms=args.ttft_slo, isl=args.isl,
            osl=args.osl, concurrencies=args.concurrency,
            agg_concurrencies=args.agg_concurrency, model=args.model,
            ttft_percentile=args.ttft_percentile, agg_devices=args.agg_devices,
            ctx_rate_start=args.ctx_rate_start, ctx_max_probes=args.ctx_max_probes,
            ctx_tolerance=args.ctx_tolerance, ctx_probe_seconds=args.ctx_probe_seconds,
            ctx_min_prompts=args.ctx_min_prompts, gen_rounds=args.gen_rounds,
            num_warmups=args.num_warmups, seed=args.seed, api_key=args.api_key,
            http_client=args.http_client, request_timeout_s=args.request_timeout, **mode)
    except ValueError as e:
        parser.error(str(e))


def _rate_match_layouts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``rate-match --ctx-layouts ... --serve-model DIR``: disagg/bench/ratematch/layouts.py."""
    from disagg.bench.plot import plot_rate_match_layouts
    from disagg.bench.ratematch import save_result
    from disagg.bench.ratematch.layouts import (
        ServeSpec,
        format_layouts,
        parse_gen_specs,
        parse_layouts,
        run_layout_sweep,
    )

    for flag, value in (("--context-url", args.context_url),
                        ("--generation-url", args.generation_url)):
        if value:
            parser.error(f"{flag}: not with --ctx-layouts / --gen-layouts (the sweep starts "
                         f"its own workers)")
    for flag, on in (("--colocated", args.colocated), ("--verify", args.verify)):
        if on:
            parser.error(f"{flag}: not with --ctx-layouts / --gen-layouts (a layout sweep "
                         f"measures each worker alone and verifies nothing)")
    if not args.ctx_layouts:
        parser.error("--ctx-layouts: needed with --gen-layouts"
                     + (" / --gen-spec" if args.gen_spec else ""))
    try:
        ctx_layouts = parse_layouts(args.ctx_layouts, "--ctx-layouts")
        gen_layouts = parse_layouts(args.gen_layouts or args.ctx_layouts, "--gen-layouts")
        gen_specs = (parse_gen_specs(args.gen_spec, "--gen-spec")
                     if args.gen_spec is not None else None)
    except ValueError as e:
        parser.error(str(e))
    if not args.serve_model or not os.path.isfile(os.path.join(args.serve_model,
                                                               "config.json")):
        parser.error("--serve-model: a checkpoint folder (with config.json) is needed with "
                     "--ctx-layouts")
    if args.serve_worker_config and not os.path.isfile(args.serve_worker_config):
        parser.error(f"--serve-worker-config: no such file {args.serve_worker_config!r}")
    tok_dir = args.tokenizer or args.serve_model
    log_dir = args.serve_log_dir or os.path.splitext(
        os.path.abspath(args.save_result))[0] + "-workers"
    spec = ServeSpec(os.path.abspath(args.serve_model), log_dir,
                     os.path.abspath(args.serve_worker_config)
                     if args.serve_worker_config else None, args.serve_timeout)
    # Each worker's URL and devices are the sweep's (layouts.run_layout_sweep).
    config = _rate_match_config(args, parser, context_url="", generation_url="")
    try:
        tok = load_bench_tokenizer(tok_dir)
    except (DatasetError, OSError) as e:
        print(f"disagg bench rate-match: error: {e}", file=sys.stderr)
        return 1
    try:
        result = asyncio.run(run_layout_sweep(
            config, tok, spec, ctx_layouts, gen_layouts,
            progress=None if args.no_progress else sys.stderr, gen_specs=gen_specs))
    except (BenchmarkError, RuntimeError) as e:
        print(f"disagg bench rate-match: error: {e}", file=sys.stderr)
        return 1
    print(format_layouts(result))
    save_result(result, args.save_result)
    png = args.plot or os.path.splitext(args.save_result)[0] + ".png"
    plot_rate_match_layouts(result, png)
    print(f"Saved {args.save_result} and {png} (worker logs: {log_dir})", file=sys.stderr)
    return 0 if result["frontier"] else 1
