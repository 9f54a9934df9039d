"""Host phases of a pure-decode ``engine.step()`` on CPU (issue 44, item 2), before and after.

On a GPU the step's forward is one CUDA-graph replay; everything else in the step is host
work while the device idles (``bench.gpu.profile_decode`` measured it on an H200). That host
work is the same Python on any device, so it is measured here on CPU: an engine on a tiny
checkpoint whose runner takes the padded graph path eagerly (``DecodeGraphs(capture=False)``,
as the CPU tests build it), batches of pure decodes, each phase timed per step by wrapping the
engine's methods exactly as ``bench.gpu.profile_decode`` does (its ``PhaseTimer``). After
the prefill the model's layers are replaced by a stand-in that costs next to nothing
(``--forward stub``; ``--forward model`` keeps the tiny model, whose CPU attention over the
padded tables is slow at batch 64); either way the forward (``DecodeGraphs.run`` less its
input load) is its own row and is taken out of the host totals: on a GPU it is the graph
replay.

    python -m bench.decode_host [--batches 1 64] [--ctx 1024] [--steps 40] [--rounds 3]
                                [--baseline REV] [--out bench/results/decode_host.md]

``--baseline REV``: the ``disagg`` package as of git revision ``REV`` (``git archive`` into a
temporary folder) is measured too, by this checkout's script, in child processes alternating
with this tree's (``--rounds`` of each; medians of the per-run medians). Each child also
finishes its requests and hashes every final output (tokens, text, finish reason): the report
says whether both trees produced the same outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.baseline import checkout, cpu_line, git, run_child

ROOT = Path(__file__).resolve().parents[1]
RUN = "graph run (DecodeGraphs.run: input load + forward)"
FORWARD = "model forward (run - load: eager on CPU, a graph replay on a GPU)"
# Host phases as bench.gpu.profile_decode names them, in report order.
PHASES = (
    "schedule",
    "graph input load",
    "forward launch (execute)",
    "sample (incl. waiting for the device)",
    "execute + sample",
    "scheduler update",
    "detokenize + outputs",
)
HOST_EXECUTE = "forward launch, host part (execute - model forward)"
HOST_STEP = "whole step, host part (step - model forward)"
ROWS = (*PHASES, HOST_EXECUTE, FORWARD, "whole step (wrapped)", HOST_STEP)


def _engine(batch: int, ctx: int, max_tokens: int, model_dir: str) -> Any:
    """An engine whose runner decodes through the padded static batch (the CUDA-graph input
    path), eagerly with the reference attention; shaped like ``bench.gpu.bench``'s 8B engine
    (32 tokens per block, max_model_len 8192 + 64: the block tables are as wide)."""
    import disagg.engine.llm_engine as engine_mod
    from disagg.config import build_engine_config
    from disagg.model.static_decode import paged_decode_reference
    from disagg.runner import ModelRunner

    orig = engine_mod.make_executor
    engine_mod.make_executor = lambda config, disagg=None: ModelRunner(
        config, padded_decode=paged_decode_reference)
    try:
        return engine_mod.LLMEngine(build_engine_config(
            model_dir, max_batch_size=batch, max_num_tokens=_max_num_tokens(ctx),
            tokens_per_block=32, kv_cache_tokens=batch * (ctx + max_tokens + 64),
            max_model_len=8192 + 64, enable_prefix_caching=False,
            cuda_graph_max_batch_size=batch))
    finally:
        engine_mod.make_executor = orig


def _stub_forward(model: Any, vocab: int) -> None:
    """Replace the model's layers by a stand-in costing next to nothing: the hidden state of a
    row is the embedding of a token picked from its input token and position, so greedy
    decoding still walks through varied tokens (and text) while the runner's path around the
    forward (static buffers, views, logits, sampling) stays the real one."""
    embed = model.model.embed_tokens

    def forward(input_ids: Any, positions: Any, kv_cache: Any, meta: Any,
                hidden_states: Any = None) -> Any:
        return embed((input_ids * 7 + positions * 13 + 5) % vocab)

    model.forward = forward


def _max_num_tokens(ctx: int) -> int:
    return max(2048, ctx + 64)


def _digest(outputs: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for rid in sorted(outputs):
        c = outputs[rid].outputs[0]
        h.update(json.dumps([rid, c.token_ids, c.text, c.finish_reason]).encode())
    return h.hexdigest()[:16]


def measure(batch: int, ctx: int, steps: int, model_dir: str, stub: bool) -> dict[str, Any]:
    """Median ms per phase over ``steps`` pure-decode steps of ``batch`` requests, the median
    unwrapped step, and the digest of the requests' final outputs."""
    import torch

    from bench.gpu.profile_decode import phases, start_decodes, timed_steps

    torch.set_num_threads(1)
    # enough for the prefill steps (the first requests decode while later ones prefill), the
    # warm-up and the timed steps: no request ends before the timing is over
    max_tokens = -(-batch * ctx // _max_num_tokens(ctx)) + 2 * steps + 32
    eng = _engine(batch, ctx, max_tokens, model_dir)
    try:
        start_decodes(eng, batch, ctx, max_tokens, eng.config.model.vocab_size, seed=batch)
        graphs = eng.runner.graphs
        assert graphs is not None
        if stub:
            _stub_forward(eng.runner.model, eng.config.model.vocab_size)
        timed_steps(eng, 3, "cpu")  # warm
        eager_before = graphs.eager_runs
        plain = timed_steps(eng, steps, "cpu")
        with phases(eng) as pt:
            pt.wrap(graphs, "run", RUN)
            wrapped = timed_steps(eng, steps, "cpu", pt)
        for s in pt.steps:
            s[FORWARD] = s[RUN] - s["graph input load"]
        # every timed step went through the padded graph path
        assert graphs.eager_runs - eager_before == 2 * steps, "a timed step left the graph path"
        assert eng.scheduler.num_running == batch, "a request ended during the timed steps"
        med = {k: v * 1e3 for k, v in pt.medians().items()}
        fwd = [s[FORWARD] for s in pt.steps]
        med[HOST_EXECUTE] = statistics.median(
            s["forward launch (execute)"] - s[FORWARD] for s in pt.steps) * 1e3
        med["whole step (wrapped)"] = statistics.median(wrapped) * 1e3
        med[HOST_STEP] = statistics.median(w - f for w, f in zip(wrapped, fwd, strict=True)) * 1e3
        finals: dict[str, Any] = {}
        for _ in range(10_000):
            if not eng.has_unfinished():
                break
            for o in eng.step():
                if o.finished:
                    finals[o.request_id] = o
        assert len(finals) == batch, f"{len(finals)} of {batch} requests finished"
        return {"phases": med, "plain_step_ms": statistics.median(plain) * 1e3,
                "digest": _digest(finals)}
    finally:
        eng.shutdown()


def _child(args: argparse.Namespace) -> None:
    import disagg

    out: dict[str, Any] = {"disagg": disagg.__file__}
    for b in args.batches:
        out[str(b)] = measure(b, args.ctx, args.steps, args.model_dir, args.forward == "stub")
    print("RESULT " + json.dumps(out), flush=True)


def _run_child(cwd: str, args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    return run_child(cwd, "bench.decode_host", [
        "--child", "--model-dir", model_dir, "--ctx", str(args.ctx), "--steps", str(args.steps),
        "--forward", args.forward, "--batches", *map(str, args.batches)])


def _machine() -> list[str]:
    import torch

    return [cpu_line(), f"Python {platform.python_version()}, torch {torch.__version__}, one "
                        "torch thread per child process"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_host",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per run (and per kind)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating child runs per tree")
    ap.add_argument("--forward", choices=["stub", "model"], default="stub",
                    help="decode steps through a stand-in for the model's layers (default) or "
                         "the tiny model itself (its CPU forward is slow at batch 64)")
    ap.add_argument("--baseline", help="git revision whose disagg is the 'before' column")
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode_host.md"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    if min(args.batches) < 1 or args.steps < 3 or args.rounds < 1:
        ap.error("--batches must be >= 1, --steps >= 3, --rounds >= 1")

    from disagg.model.tiny import write_tiny_checkpoint

    head = _machine()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="disagg-decode-host-") as tmp:
        model_dir = write_tiny_checkpoint(os.path.join(tmp, "tiny"), "llama",
                                          max_position_embeddings=8192 + 64)
        trees = {"after": str(ROOT)}
        if args.baseline:
            trees = {"before": checkout(args.baseline, tmp), "after": str(ROOT)}
        runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in range(args.rounds):
            for name, cwd in trees.items():
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(_run_child(cwd, args, model_dir))
    minutes = (time.time() - t0) / 60
    cols = list(trees)
    res = {name: {str(b): {k: statistics.median(run[str(b)]["phases"].get(k, 0.0)
                                                for run in rs) for k in ROWS}
                  for b in args.batches} for name, rs in runs.items()}
    plain = {name: {str(b): statistics.median(run[str(b)]["plain_step_ms"] for run in rs)
                    for b in args.batches} for name, rs in runs.items()}
    digests = {name: {run[str(b)]["digest"] for run in rs for b in args.batches}
               for name, rs in runs.items()}
    dirty = git("diff", "--name-only", "HEAD", "--", "disagg")
    cmd = " ".join(["python -m bench.decode_host", *sys.argv[1:]])
    lines = [
        f"# Host time of a pure-decode engine.step() on CPU ({time.strftime('%Y-%m-%d')})", "",
        *[f"- {m}" for m in head],
        f"- command: `{cmd}` ({minutes:.1f} min); written by the script",
        f"- after: this working tree, commit {git('rev-parse', '--short', 'HEAD')}"
        + (" with uncommitted changes to " + ", ".join(dirty.splitlines()) if dirty else "")
        + (f"; before: `git archive {args.baseline}` "
           f"({git('rev-parse', '--short', args.baseline)})" if args.baseline else ""),
        f"- engine: tiny llama checkpoint, {args.ctx}-token random prompts, greedy, ignore_eos, "
        "32 tokens per block, max_model_len 8256 (block tables 258 wide, as the 8B profile's), "
        "runner on the padded CUDA-graph input path run eagerly (`DecodeGraphs(capture=False)`, "
        "reference paged attention)",
        ("- forward: the model's layers replaced after the prefill by a stand-in (the embedding "
         "of a token picked from each row's input token and position; `--forward stub`): the "
         "runner's path around it (static buffers, logits of the tiny LM head, sampling) is "
         "the real one" if args.forward == "stub" else
         "- forward: the tiny model itself (`--forward model`)"),
        f"- per run: 3 warm-up steps, {args.steps} steps unwrapped, {args.steps} steps with the "
        "phase wrappers of `bench.gpu.profile_decode` (median per phase); "
        f"{args.rounds} runs per tree, alternating, median of the run medians",
        "- the model's CPU forward is its own row and is subtracted in the *host part* rows; "
        "nested phases are also inside their caller (as in the GPU profile)",
        "- outputs: each run finishes its requests and hashes every final output (token ids, "
        "text, finish reason): "
        + ", ".join(f"{n}: {', '.join(sorted(d))}" for n, d in digests.items())
        + (" - identical" if len({frozenset(d) for d in digests.values()}) == 1 else
           " - DIFFERENT"),
        "",
    ]
    for b in args.batches:
        key = str(b)
        hdr = "| phase (ms per step, median) | " + " | ".join(cols)
        hdr += " | after / before |" if len(cols) == 2 else " |"
        lines += [f"## Batch {b}", "", hdr, "|" + "---|" * (hdr.count("|") - 1)]
        for k in (*ROWS, "whole step, no wrappers"):
            vals = ([plain[c][key] for c in cols] if k == "whole step, no wrappers"
                    else [res[c][key][k] for c in cols])
            row = f"| {k} | " + " | ".join(f"{v:.3f}" for v in vals)
            if len(cols) == 2:
                row += f" | {vals[1] / vals[0]:.2f}x" if vals[0] else " | -"
            lines.append(row + " |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
