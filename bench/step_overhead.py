"""Host-side cost of a pure-decode ``engine.step()``, by phase, on CPU.

The GPU engine replays a CUDA graph for the forward of a decode step; what is left of the step's
wall time is host work: scheduling, building the step's inputs, sampler bookkeeping, output
processing. That work is the same Python on any device, so it is measured here on CPU with the
model's forward replaced by a stub (embedding of the input ids: [T, hidden], no layers), so
only host work remains:

    schedule   Scheduler.schedule()
    inputs     ModelRunner.prepare_inputs (eager path) or DecodeGraphs.load (padded / graph path)
    forward    the stubbed forward + compute_logits (tiny vocabulary)
    sample     Sampler.sample (greedy: mostly host work on a tiny vocabulary)
    update     Scheduler.update_from_output
    outputs    the rest of step(): detokenization, stop checks, RequestOutput objects
    step       the whole engine.step()

    python -m bench.step_overhead [--batches 1 64] [--ctx 1024] [--steps 60]
                                  [--baseline /path/to/old/checkout] [--out FILE.md]

``--baseline DIR`` runs the same measurement in a subprocess importing ``disagg`` from ``DIR``
(e.g. a worktree of the commit before), interleaved with this tree's, and reports both and the
ratio after / before. Each measurement runs as ``python -m bench.step_overhead --child`` (this
checkout's script either way), started in a folder of its own that holds only a link
``disagg`` to the measured tree's package: ``-m`` puts the working directory first on
``sys.path``, ahead of any installed or checked-out ``disagg``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("schedule", "inputs", "forward", "sample", "update", "outputs", "step")


def _timed(obj, name: str, acc: dict[str, float], key: str) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def _engine(batch: int, ctx: int, steps: int, path: str, model_dir: str):
    """An engine sized for ``batch`` requests of ``ctx`` tokens; on the padded path its runner
    decodes through the padded (graph) inputs with the reference attention."""
    from disagg.config import build_engine_config
    from disagg.engine import LLMEngine
    from disagg.runner import ModelRunner

    try:  # where LLMEngine looks its executor factory up
        import disagg.engine.llm_engine as engine_mod
    except ImportError:  # a --baseline checkout from before the engine package
        import disagg.engine as engine_mod  # type: ignore[no-redef]
    orig_make = engine_mod.make_executor
    if path == "padded":
        try:
            from disagg.model.static_decode import paged_decode_reference
        except ImportError:  # (a --baseline checkout: it lived in cuda_graph then)
            from disagg.cuda_graph import paged_decode_reference  # type: ignore[no-redef]

        engine_mod.make_executor = lambda config, disagg=None: ModelRunner(
            config, padded_decode=paged_decode_reference)
    try:
        return LLMEngine(build_engine_config(
            model_dir, max_batch_size=max(batch, 1), max_num_tokens=max(2048, ctx + 64),
            tokens_per_block=32, kv_cache_tokens=batch * (ctx + steps + batch + 96),
            max_model_len=ctx + steps + batch + 64, enable_prefix_caching=False,
            cuda_graph_max_batch_size=max(batch, 1)))
    finally:
        engine_mod.make_executor = orig_make


def _time_phases(eng, acc: dict[str, float]) -> None:
    """Wrap schedule, update, sample and the input builders to add their time to ``acc``."""
    runner = eng.runner
    _timed(eng.scheduler, "schedule", acc, "schedule")
    _timed(eng.scheduler, "update_from_output", acc, "update")
    _timed(eng.sampler, "sample", acc, "sample")
    if runner.graphs is not None:
        _timed(runner.graphs, "load", acc, "inputs")
    _timed(runner, "prepare_inputs", acc, "inputs")


def _prefill(eng, batch: int, ctx: int, steps: int) -> None:
    """``batch`` requests of ``ctx`` random tokens, prefilled with the real model until each
    has its first output token."""
    import torch

    from disagg import SamplingParams

    model = eng.runner.model
    vocab = model.config.vocab_size if hasattr(model, "config") else 512
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + batch + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", torch.randint(3, vocab, (ctx,), generator=g).tolist(), params)
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in
                                       eng.scheduler.running):
        eng.step()


def _stub_forward(model, acc: dict[str, float]) -> None:
    """Replace the forward by the embedding of the input ids; the forward and the logits add
    their time to ``acc["forward"]``."""
    embed = model.model.embed_tokens

    def stub_forward(input_ids, positions, kv_cache, meta, hidden_states=None):
        return embed(input_ids)

    lm = model.compute_logits

    def timed_logits(h):
        t0 = time.perf_counter()
        try:
            return lm(h)
        finally:
            acc["forward"] += time.perf_counter() - t0

    model.compute_logits = timed_logits
    fwd = stub_forward

    def timed_forward(*a, **k):
        t0 = time.perf_counter()
        try:
            return fwd(*a, **k)
        finally:
            acc["forward"] += time.perf_counter() - t0

    model.forward = timed_forward


def _decode_steps(eng, acc: dict[str, float], batch: int, steps: int
                  ) -> dict[str, list[float]]:
    """Seconds per phase of each pure-decode step after 3 warm-ups."""
    per: dict[str, list[float]] = defaultdict(list)
    for s in range(steps):
        acc.clear()
        t0 = time.perf_counter()
        eng.step()
        total = time.perf_counter() - t0
        st = eng.stats()  # (outside the timed step) one token for each of the batch's requests
        assert st.last_step_batch_size == st.last_step_num_tokens == batch
        if s < 3:
            continue  # warm-up
        known = sum(acc[k] for k in ("schedule", "inputs", "forward", "sample", "update"))
        for k in PHASES[:-2]:
            per[k].append(acc[k])
        per["outputs"].append(total - known)
        per["step"].append(total)
    return per


def measure(batch: int, ctx: int, steps: int, path: str, model_dir: str) -> dict[str, float]:
    """Median µs per phase over ``steps`` pure-decode steps at ``batch`` requests."""
    import torch

    torch.set_num_threads(1)
    eng = _engine(batch, ctx, steps, path, model_dir)
    acc: dict[str, float] = defaultdict(float)
    _time_phases(eng, acc)
    # Prefill with the real model (fills the cache), then stub the forward for the decodes.
    _prefill(eng, batch, ctx, steps)
    _stub_forward(eng.runner.model, acc)
    per = _decode_steps(eng, acc, batch, steps)
    if path == "padded":
        assert eng.runner.graphs is not None and eng.runner.graphs.eager_runs > 0
    eng.shutdown()
    return {k: statistics.median(v) * 1e6 for k, v in per.items()}


def _child(args: argparse.Namespace) -> None:
    out = {}
    for path in args.paths:
        for b in args.batches:
            out[f"{path}/{b}"] = measure(b, args.ctx, args.steps, path, args.model_dir)
    print("RESULT " + json.dumps(out))


def _run_child(tree: str, start_in: str, args: argparse.Namespace, model_dir: str) -> dict:
    """One measurement of ``tree``'s ``disagg`` by this checkout's script, in a subprocess
    started in ``start_in`` (a folder holding only the link ``disagg`` -> ``tree/disagg``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "bench.step_overhead", "--child", "--model-dir", model_dir,
           "--ctx", str(args.ctx), "--steps", str(args.steps),
           "--batches", *map(str, args.batches), "--paths", *args.paths]
    res = subprocess.run(cmd, env=env, cwd=start_in, capture_output=True, text=True,
                         check=False)
    if res.returncode != 0:
        raise RuntimeError(f"child failed ({tree}):\n{res.stderr[-4000:]}")
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.step_overhead",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--paths", nargs="+", default=["eager", "padded"],
                    choices=["eager", "padded"])
    ap.add_argument("--baseline", help="checkout whose disagg is the 'before' column")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs (median)")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return

    from disagg.model.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(os.path.join(tmp, "tiny"), "llama",
                                          max_position_embeddings=4096)
        trees = {"after": str(ROOT)}
        if args.baseline:
            trees = {"before": os.path.abspath(args.baseline), "after": str(ROOT)}
        start_in = {}
        for name, tree in trees.items():
            if not os.path.isfile(os.path.join(tree, "disagg", "__init__.py")):
                ap.error(f"--baseline: {tree} has no disagg package")
            start_in[name] = os.path.join(tmp, f"start-{name}")
            os.mkdir(start_in[name])
            os.symlink(os.path.join(tree, "disagg"), os.path.join(start_in[name], "disagg"))
        runs: dict[str, list[dict]] = defaultdict(list)
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(_run_child(tree, start_in[name], args, model_dir))
    res = {name: {key: {ph: statistics.median(r[key][ph] for r in rs) for ph in PHASES}
                  for key in rs[0]} for name, rs in runs.items()}
    lines = [
        "# Host overhead of a pure-decode engine.step() (CPU, forward stubbed)",
        "",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}",
        f"- tiny llama checkpoint, context ~{args.ctx} tokens, 32 tokens per block, greedy, "
        f"median of {args.steps - 3} steps per run, median of {args.rounds} alternating runs; "
        "one torch thread",
        "- forward = embedding of the input ids + tiny LM head (the model's layers stubbed): "
        "everything else is host work that a CUDA-graph replay does not remove",
        "- eager = ModelRunner.prepare_inputs path; padded = the CUDA-graph input path "
        "(DecodeGraphs.load, run eagerly on CPU)",
        "",
    ]
    cols = list(trees)
    head = "| path | batch | phase | " + " | ".join(f"{c} µs" for c in cols)
    if len(cols) == 2:
        head += " | after / before"
    head += " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for key in res[cols[-1]]:
        path, b = key.split("/")
        for ph in PHASES:
            vals = [res[c][key][ph] for c in cols]
            row = f"| {path} | {b} | {ph} | " + " | ".join(f"{v:,.0f}" for v in vals)
            if len(cols) == 2:
                row += f" | {vals[1] / vals[0]:.2f}x" if vals[0] else " | -"
            lines.append(row + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
