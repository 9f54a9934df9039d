"""Tensor / pipeline parallel overhead: tokens/s of tp1, tp2 and pp2 on one workload, and the
communication time per step as a share of the step, per rank.

The same checkpoint (tens of millions of parameters) and the same seeded workload through
``LLM`` with (tp, pp) = (1, 1), (2, 1), (1, 2). The executor times every all-reduce, send,
recv and control message on every rank (``DistributedExecutor.comm_stats``). Greedy outputs
are checked to be the same tokens as tp1.

    python -m bench.parallel [--num-requests 16] [--batch-size 8] [--out bench/results/parallel.md]
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning. On a small shared machine a spinning thread
# that waits for a descheduled sibling wastes its time slice: with 2 threads and another job on
# one of the 2 cores, tp1 ran 20x slower (and erratically) without this. Must be set before
# torch starts its thread pool; the rank processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from disagg import LLM, SamplingParams  # noqa: E402
from disagg.model.tiny import write_tiny_checkpoint  # noqa: E402

SIZES = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=2048)
# (name, tp, pp, torch threads of rank 0 for a single-rank run: None = all cores)
CONFIGS = [("tp1", 1, 1, None), ("tp1-1thread", 1, 1, 1), ("tp2", 2, 1, None),
           ("pp2", 1, 2, None)]


def workload(n: int, vocab: int, special: set[int], seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in special]
    return [([rng.choice(ids) for _ in range(rng.randint(64, 256))], rng.randint(32, 64))
            for _ in range(n)]


def run(model_dir: str, work: list[tuple[list[int], int]], tp: int, pp: int,
        batch_size: int, repeats: int, threads: int | None) -> dict[str, Any]:
    """The workload ``repeats`` times on one LLM; the fastest run (and its comm stats)."""
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_batch_size=batch_size, max_num_tokens=512, tokens_per_block=32,
              kv_cache_tokens=batch_size * (256 + 64 + 64), enable_prefix_caching=False,
              device="cpu")
    try:
        llm.generate([work[0][0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        ex = llm.engine.runner
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
        best: dict[str, Any] | None = None
        times = []
        for _ in range(repeats):
            if hasattr(ex, "reset_comm_stats"):
                ex.reset_comm_stats()
            steps0 = llm.engine.stats().steps_total
            host0, own0 = cpu_seconds(ex.rank_pids[1:])
            t0 = time.perf_counter()
            outs = llm.generate([p for p, _ in work], params)
            elapsed = time.perf_counter() - t0
            host1, own1 = cpu_seconds(ex.rank_pids[1:])
            times.append(elapsed)
            if best is None or elapsed < best["elapsed"]:
                tokens = [o.outputs[0].token_ids for o in outs]
                best = dict(elapsed=elapsed, tokens=tokens, n=sum(len(t) for t in tokens),
                            steps=llm.engine.stats().steps_total - steps0,
                            stats=ex.comm_stats() if hasattr(ex, "comm_stats") else [],
                            threads=torch.get_num_threads(),
                            # cores busy with work that is not ours (other jobs on the host)
                            other_load=max(0.0, (host1 - host0) - (own1 - own0)) / elapsed,
                            own_load=(own1 - own0) / elapsed)
        # Pure transfer times for a decode-sized and a prefill-chunk-sized activation.
        probe = ({n: ex.probe_comm(n) for n in (batch_size, 512)}
                 if hasattr(ex, "probe_comm") else {})
    finally:
        llm.shutdown()
        torch.set_num_threads(threads_before)
    assert best is not None
    best["times"] = times
    best["probe"] = probe
    return best


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(CPU seconds the whole host has been busy, CPU seconds of this process + ``pids``)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v[:8]) - v[3] - v[4]  # all but idle and iowait
    own = time.process_time()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            own += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except OSError:
            pass
    return busy / tick, own


def _first_last(per_rank: list[dict[str, float]], key: str) -> str:
    vals = [r[key] for r in per_rank if key in r]
    return f"{vals[0]:.3f} / {vals[-1]:.3f}" if vals else "-"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ms(s: float, steps: int) -> str:
    return f"{s / max(steps, 1) * 1e3:.2f}"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.parallel",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3,
                    help="measured runs per config; the fastest is reported")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    return ap.parse_args()


def measure_all(args: argparse.Namespace) -> tuple[int, dict[str, dict[str, Any]]]:
    """Every config of CONFIGS on one checkpoint and workload: (parameters, results by name)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(os.path.join(tmp, "m"), seed=0, **SIZES)
        from disagg.model.loader import load_model
        from disagg.tokenizer import load_tokenizer

        n_params = sum(p.numel() for p in load_model(model_dir).parameters())
        special = set(load_tokenizer(model_dir).all_special_ids)
        work = workload(args.num_requests, 500, special, args.seed)
        results = {name: run(model_dir, work, tp, pp, args.batch_size, args.repeats, threads)
                   for name, tp, pp, threads in CONFIGS}
    return n_params, results


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def header_lines(args: argparse.Namespace, n_params: int, base: dict[str, Any],
                 cores: int) -> list[str]:
    """Title, machine, model and workload, what the run can show, the throughput table head."""
    return [
        f"# Parallel workers: tp1 / tp2 / pp2 ({time.strftime('%Y-%m-%d')})",
        "",
        f"- machine: {cpu_model()}, {cores} cores available, {platform.system()} "
        f"{platform.machine()}, torch {torch.__version__}, device cpu, gloo backend, float32",
        f"- model: llama {SIZES}, {n_params / 1e6:.1f} M parameters",
        f"- workload: {args.num_requests} requests, prompt 64-256, output 32-64 tokens "
        f"(seed {args.seed}), {base['n']} output tokens; max batch {args.batch_size}, "
        f"max 512 tokens per step, chunked prefill",
        "- torch threads: tp1 all cores; tp1-1thread one; tp2 / pp2 cores / world_size = 1 "
        f"per rank; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
        "- *cores used*: CPU time of our processes / of everything else on the host "
        "(/proc/stat) during the reported run, per second: a shared machine shows it here",
        f"- each config: one LLM, a short warm-up, then the workload {args.repeats} times; the "
        "fastest run is reported (all run times listed)",
        "",
        "On a 2-core CPU the ranks share the same two cores that tp1 uses alone, so no "
        "speedup is possible; this run measures correctness (same tokens) and the overhead "
        "of the parallel machinery. Pipeline stages run one after another per step (no "
        "micro-batching), so pp2 cannot be faster than tp1 even with more cores; it shows "
        "what passing hidden states between stages costs.",
        "",
        "| config | output tokens | seconds (best) | all runs, s | tokens/s | vs tp1 | "
        "vs tp1-1thread | steps | ms/step | same tokens as tp1 | cores used: ours / others |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def throughput_rows(results: dict[str, dict[str, Any]], cores: int) -> list[str]:
    """One row per config against tp1 and tp1-1thread; a note when threads made tp1 slower."""
    base, one = results["tp1"], results["tp1-1thread"]
    lines = []
    for name, _, _, _ in CONFIGS:
        r = results[name]
        tps = r["n"] / r["elapsed"]
        lines.append(
            f"| {name} | {r['n']} | {r['elapsed']:.1f} | "
            f"{', '.join(f'{t:.1f}' for t in r['times'])} | {tps:.1f} | "
            f"{tps / (base['n'] / base['elapsed']):.2f}x | "
            f"{tps / (one['n'] / one['elapsed']):.2f}x | {r['steps']} | "
            f"{r['elapsed'] / r['steps'] * 1e3:.1f} | "
            f"{'yes' if r['tokens'] == base['tokens'] else 'NO'} | "
            f"{r['own_load']:.2f} / {r['other_load']:.2f} |")
    if base["elapsed"] > one["elapsed"]:
        lines += ["", f"Here tp1 with all {cores} threads was slower than with one thread "
                  f"({base['elapsed']:.1f} s vs {one['elapsed']:.1f} s, runs "
                  f"{', '.join(f'{t:.1f}' for t in base['times'])} s): intra-op threads of "
                  "one process contend on this machine, so tp1-1thread is the fairer "
                  "baseline for ranks running one thread each."]
    return lines


def comm_rows(results: dict[str, dict[str, Any]]) -> list[str]:
    """The per-rank, per-step communication table."""
    lines = [
        "",
        "Per rank, per step (host wall time, ms; averaged over the measured steps). "
        "*comm* = all-reduce + send + control; *recv* is listed apart because a blocking "
        "receive also waits for the other stage to compute (for pp2 it is mostly that wait, "
        "the pipeline bubble of sequential stages).",
        "",
        "| config | rank | step | all-reduce (calls/step) | send | recv (incl. wait) | "
        "control | comm share | recv share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _, _, _ in CONFIGS:
        for s in results[name]["stats"]:
            n = s["steps"]
            comm = s["all_reduce_s"] + s["send_s"] + s["control_s"]
            lines.append(
                f"| {name} | {s['rank']} | {ms(s['step_s'], n)} | {ms(s['all_reduce_s'], n)} "
                f"({s['all_reduce_calls'] / max(n, 1):.0f}) | {ms(s['send_s'], n)} | "
                f"{ms(s['recv_s'], n)} | {ms(s['control_s'], n)} | "
                f"{comm / s['step_s']:.1%} | {s['recv_s'] / s['step_s']:.1%} |")
    return lines


def probe_rows(results: dict[str, dict[str, Any]]) -> list[str]:
    """The pure transfer times (every rank at a barrier before each op)."""
    lines = [
        "",
        "The per-step all-reduce / recv times above include waiting for the peer (its share of "
        "the cores, its compute). The transfer alone, every rank synchronised (barrier) before "
        "each op, mean ms per op (rank 0 / last rank):",
        "",
        "| config | tensor | all-reduce | stage-to-stage send/recv |",
        "|---|---|---|---|",
    ]
    for name, _, _, _ in CONFIGS:
        for n, per_rank in results[name]["probe"].items():
            lines.append(f"| {name} | [{n}, {SIZES['hidden_size']}] float32 | "
                         f"{_first_last(per_rank, 'all_reduce_ms')} | "
                         f"{_first_last(per_rank, 'send_recv_ms')} |")
    return lines


def main() -> None:
    args = _args()
    n_params, results = measure_all(args)
    cores = available_cores()
    lines = header_lines(args, n_params, results["tp1"], cores)
    lines += throughput_rows(results, cores)
    lines += comm_rows(results)
    lines += probe_rows(results)
    lines.append("")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
