"""Disaggregated (1 context + 1 generation worker) against aggregated (2 workers), same cores.

A scaled-down seed workload on this machine: prompts of ``--isl`` (512) tokens, ``--osl`` (64)
output tokens, a random Llama-shaped checkpoint of ~26 M parameters (the engine benchmark's
shape), float32, CPU. Every worker is pinned to one core (``sched_setaffinity``) with one
torch thread, so both systems use the same two cores:

- **disaggregated**: context worker on core 0, generation worker on core 1 (KV over TCP), the
  router in front;
- **aggregated**: two aggregated workers on cores 0 and 1 behind the router
  (``load_balancing``: least active requests).

Steps, in one run:

1. Rate matching (``disagg.bench.ratematch``): the context worker's highest Poisson rate with
   TTFT p90 <= ``--ttft-slo``; the generation worker (``--benchmark-gen-only``, no context
   server) at each ``--concurrency``; the rate-matched points and frontier; end to end through
   the disaggregated router at frontier concurrencies (``verify``: a closed loop for a
   generation-bound prediction, Poisson arrivals at the predicted rate for a context-bound
   one), against the prediction for 1 + 1; one aggregated worker at the same concurrencies
   (the baseline curve).
2. Open-loop (Poisson) runs of both clusters at the same request rates (fractions of the
   disaggregated cluster's predicted capacity): TTFT p99, TPOT p99, goodput (TTFT and TPOT
   SLOs), and the rate-matched prediction of each run (output tokens/s, mean TPOT).

The load generator (this process) and the router are not pinned: they share the two cores with
the workers. Their CPU time, and the CPU time of every *other* process on the machine during
each phase, are measured (``/proc``) and written into the result, so their interference is
visible rather than assumed away. The machine is shared with other work: every measurement
step waits for a quiet machine first and is redone when other processes used more than
``--max-other`` cores during it (``Guard``); the attempts are in the JSON and the report.

    python -m bench.disagg_vs_aggregated [--out bench/results/disagg-vs-aggregated-sequential.md]

``--model DIR`` measures a checkpoint folder instead of the random tiny one, e.g.
SmolLM2-135M-Instruct as ``disagg model fetch smollm2 DIR`` imports it (its results go to their
own file: ``--out bench/results/disagg-vs-aggregated-smollm2.md``; shrink ``--isl`` / ``--osl``
and the run lengths to fit a real 135 M model on 2 cores).

Each cluster runs once per rate, the two minutes apart; the machine's drift over minutes then
lands in the comparison. ``python -m bench.disagg_vs_aggregated_ab`` keeps both clusters up and
alternates them in repeated pairs: its result is the recorded comparison
(``bench/results/disagg-vs-aggregated.md``).

Writes the markdown, the PNG (``--png``) and the JSON of everything measured (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.baseline import machine_busy_s, proc_cpu_s
from disagg.bench.client import make_transport
from disagg.bench.datasets import load_bench_tokenizer, sample_random
from disagg.bench.plot import plot_rate_match
from disagg.bench.ratematch import (
    RateMatchConfig,
    RateMatcher,
    build_result,
    describe_arrivals,
    finish_verify_point,
    format_rate_match,
    predict_at_rate,
    save_result,
    verify_choices,
)
from disagg.bench.runner import BenchmarkConfig, run_benchmark
from disagg.procs import NotHealthy, free_ports, log_tail, spawn, stop_all
from disagg.procs import wait_healthy as wait_child_healthy

ROOT = Path(__file__).resolve().parent.parent
SIZES = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
             max_position_embeddings=2048)
NAME = "m"
TOKEN = "bench-disagg-vs-aggregated"


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path
    cpu: int | None  # pinned core

    def cpu_s(self) -> float:
        return proc_cpu_s(self.popen.pid)


def start_worker(model: str, name: str, role: str, cpu: int, port: int, logs: Path,
                 max_num_tokens: int, *extra: str) -> Proc:
    log = logs / f"{name}.log"
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    p = spawn(
        [sys.executable, "-m", "disagg.cli", "serve", model, "--port", str(port), "--role",
         role, "--served-model-name", NAME, "--log-level", "warning", "--kv-cache-tokens",
         "32768", "--max-model-len", "1024", "--max-num-tokens", str(max_num_tokens),
         "--kv-transfer-backend", "TCP", *extra],
        log, env=env, cwd=ROOT, new_session=False, cpus={cpu})
    return Proc(name, p, f"http://127.0.0.1:{port}", log, cpu)


def start_router(cluster: dict[str, Any], port: int, logs: Path, name: str) -> Proc:
    import yaml

    path = logs / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"hostname": "127.0.0.1", "port": port, **cluster},
                                   sort_keys=False))
    log = logs / f"{name}.log"
    # The workers' token: a disaggregated router signs its calls with it.
    p = spawn([sys.executable, "-m", "disagg.cli", "router", "-c", str(path), "--log-level",
               "warning"], log, cwd=ROOT, env={**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN},
              new_session=False)
    return Proc(name, p, f"http://127.0.0.1:{port}", log, None)


def wait_healthy(procs: list[Proc], timeout: float = 180.0) -> None:
    """All healthy within ``timeout`` (one deadline); else stop them all and raise."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            wait_child_healthy(p.url, max(0.0, deadline - time.monotonic()), proc=p.popen,
                               interval=0.2, what=p.name)
        except NotHealthy as e:
            stop(procs)
            raise RuntimeError(f"{e}:\n{log_tail(p.log)}") from None


def stop(procs: list[Proc]) -> None:
    """SIGTERM all (the last started first), up to 60 s to drain, then SIGKILL."""
    stop_all([p.popen for p in reversed(procs)], grace_s=60.0, kill_wait_s=10.0)


def kv_metrics(url: str) -> dict[str, float]:
    """The generation worker's KV transfer counters (all requests routed to it)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("disagg_kv_transfer_bytes_total", "disagg_kv_transfers_total",
                 "disagg_kv_transfer_seconds_sum"):
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(name + "{") or line.startswith(name + " "))
    return out


class CpuMeter:
    """CPU seconds of our processes, this process and everything else over one phase."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = procs
        self.t0 = time.monotonic()
        self.busy0 = machine_busy_s()
        self.self0 = sum(os.times()[:2])
        self.p0 = {p.name: p.cpu_s() for p in procs}

    def done(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        per = {p.name: p.cpu_s() - self.p0[p.name] for p in self.procs}
        client = sum(os.times()[:2]) - self.self0
        busy = machine_busy_s() - self.busy0
        other = max(0.0, busy - sum(per.values()) - client)
        return {"wall_s": wall, "cpu_s": per, "client_cpu_s": client, "other_cpu_s": other,
                "machine_busy_s": busy}


class Guard:
    """Runs each measurement step on a quiet machine, as far as it can tell: before a step,
    waits (up to ``max_wait_s``) for a 5 s window in which the whole machine uses at most
    ``max_other`` of a core (our workers are idle then); after it, computes the CPU that
    processes other than ours used during the step, and redoes the step (up to ``attempts``
    times in all) when that exceeds ``max_other`` cores. Every attempt is logged."""

    def __init__(self, log: list[dict[str, Any]], max_wait_s: float, max_other: float,
                 attempts: int) -> None:
        self.log, self.max_wait_s = log, max_wait_s
        self.max_other, self.attempts = max_other, attempts
        self.procs: list[Proc] = []

    def _own_s(self) -> float:
        return sum(p.cpu_s() for p in self.procs) + sum(os.times()[:2])

    async def _wait_quiet(self) -> float:
        t0 = time.monotonic()
        while True:
            b0 = machine_busy_s()
            await asyncio.sleep(5.0)  # a measurement window, not a wait for an event
            busy = (machine_busy_s() - b0) / 5.0
            if busy <= self.max_other or time.monotonic() - t0 >= self.max_wait_s:
                return time.monotonic() - t0

    async def run(self, name: str, step: Any) -> Any:
        for attempt in range(1, self.attempts + 1):
            waited = await self._wait_quiet() if self.max_wait_s > 0 else 0.0
            t0, b0, o0 = time.monotonic(), machine_busy_s(), self._own_s()
            out = await step()
            wall = time.monotonic() - t0
            other = max(0.0, (machine_busy_s() - b0) - (self._own_s() - o0)) / wall
            ok = other <= self.max_other
            self.log.append({"step": name, "attempt": attempt, "wall_s": wall,
                             "waited_s": waited, "other_cores": other, "kept": ok or
                             attempt == self.attempts})
            if ok or attempt == self.attempts:
                return out
            print(f"{name}: other processes used {other:.2f} cores meanwhile: redoing it",
                  flush=True)
        raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- measuring


async def open_loop(guard: Guard, label: str, url: str, tok: Any, rates: list[float],
                    args: argparse.Namespace, tr: Any) -> list[dict[str, Any]]:
    """One Poisson run per rate; the same prompts and arrivals for both systems at a rate."""
    slos = {"ttft": args.ttft_slo, "tpot": args.tpot_slo}
    warm = sample_random(tok, 2, args.isl, args.osl, seed=args.seed + 999, as_token_ids=True)
    await run_benchmark(BenchmarkConfig(base_url=url, model=NAME, ignore_eos=True,
                                        max_concurrency=1), warm, transport=tr)
    out = []
    for i, rate in enumerate(rates):
        n = max(args.min_prompts, round(rate * args.run_seconds))
        samples = sample_random(tok, n, args.isl, args.osl, seed=args.seed + 1 + i,
                                as_token_ids=True)
        # exact_rate: the sample's realized rate is the nominal one, so the prediction at
        # that rate is comparable (a plain 40 s Poisson sample is ~15% off either way).
        cfg = BenchmarkConfig(base_url=url, model=NAME, request_rate=rate, ignore_eos=True,
                              goodput_slos_ms=slos, percentiles=(50.0, 90.0, 99.0),
                              seed=args.seed + i, exact_rate=True)

        async def one(cfg: BenchmarkConfig = cfg, samples: Any = samples) -> dict[str, Any]:
            return (await run_benchmark(cfg, samples, transport=tr)).summary

        s = await guard.run(f"{label} open loop {rate:.3f} req/s", one)
        print(f"  rate {rate:.3f} x {n}: {s['output_throughput']:.1f} tok/s "
              f"({_f(s['steady_output_throughput'])} steady), TTFT p99 "
              f"{s['p99_ttft_ms']:.0f} ms, TPOT p99 {s['p99_tpot_ms']:.1f} ms, goodput "
              f"{s['request_goodput']:.3f} req/s, {s['failed']} failed", flush=True)
        out.append({"rate": rate, "num_requests": n, "summary": s})
    return out


async def interference(m: Any, ctx_url: str, gen_url: str, concs: list[int], rate: float,
                       args: argparse.Namespace, tok: Any, tr: Any) -> list[dict[str, Any]]:
    """Generation-only points with the context worker idle, then with it prefilling ordinary
    requests at ``rate`` meanwhile: how much the busy core next door slows decoding (they
    share the memory system), which the generation-only curve of the rate match cannot see."""
    out = []
    for conc in concs:
        idle = await m.concurrency_point(gen_url, conc, True, "generation, context idle")
        n = math.ceil(rate * 120)  # more than the point needs; cancelled when it ends
        samples = sample_random(tok, n, args.isl, 1, seed=args.seed + 555 + conc,
                                as_token_ids=True)
        load = asyncio.create_task(run_benchmark(BenchmarkConfig(
            base_url=ctx_url, model=NAME, request_rate=rate, ignore_eos=True, exact_rate=True),
            samples, transport=tr))
        try:
            busy = await m.concurrency_point(gen_url, conc, True, "generation, context busy")
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
        out.append({"concurrency": conc, "context_rate": rate,
                    "idle_mean_tpot_ms": idle["mean_tpot_ms"],
                    "busy_mean_tpot_ms": busy["mean_tpot_ms"]})
        print(f"  interference at concurrency {conc}: TPOT {idle['mean_tpot_ms']:.1f} ms "
              f"idle, {busy['mean_tpot_ms']:.1f} ms with the context core busy", flush=True)
    return out


# ------------------------------------------------------------------------------ report


def machine() -> list[str]:
    import numpy as np
    import torch

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open("/proc/meminfo") as f:
        kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
    return [f"CPU: {cpu}, {os.cpu_count()} cores, {kib / 2**20:.0f} GiB RAM, no GPU",
            f"{platform.system()} {platform.release()} {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}"]


def _verdict(oks: list[bool]) -> str:
    if oks and all(oks):
        return "**met**"
    if any(oks):
        return f"**partly met** ({sum(oks)} of {len(oks)})"
    return "**not met**"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "n/a" if x is None else format(x, fmt)


def cpu_line(name: str, m: dict[str, Any]) -> str:
    wall = m["wall_s"]
    parts = [f"{k} {100 * v / wall:.0f}%" for k, v in m["cpu_s"].items()]
    parts.append(f"load generator (this script) {100 * m['client_cpu_s'] / wall:.0f}%")
    parts.append(f"**other processes {100 * m['other_cpu_s'] / wall:.0f}%**")
    return (f"- {name} ({wall:.0f} s): " + ", ".join(parts)
            + " of one core (2 cores = 200%)")


def _report_header(data: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Title, machine, workload, CPU shares and the quiet-machine steps."""
    L: list[str] = []
    osl = args.osl
    L.append(f"# Disaggregated vs aggregated on the same cores ({data['date'][:10]})")
    L.append("")
    L.append(f"Produced by `python -m bench.disagg_vs_aggregated` ({data['command']}); every "
             "number below is the script's own output.")
    if data.get("report_rewritten"):
        L.append("")
        L.append(f"Report text rewritten from the saved JSON on {data['report_rewritten'][:16]} "
                 f"(`--from-json`); the measurements are those of the original run.")
    L.append("")
    L += [f"- {m}" for m in machine()]
    L.append(f"- model: {data.get('model_desc') or f'random llama {SIZES}'}, "
             f"{data['params_m']:.1f} M parameters, float32, one torch thread per worker")
    if "cpu_kernels" in data:
        L.append(f"- CPU kernels of the workers: {data['cpu_kernels']}")
    L.append(f"- workload: prompts of {args.isl} random token ids (fresh for every run: no "
             f"prefix-cache hits), {osl} output tokens (ignore_eos), streamed "
             f"`/v1/completions`")
    L.append("- disaggregated: context worker pinned to core 0, generation worker (started with "
             "`--benchmark-gen-only`, which changes nothing for routed requests) pinned to core 1, "
             "KV over TCP, router; aggregated: two workers pinned to cores 0 and 1 behind the "
             "router (`load_balancing`). Router and load generator unpinned (CPU shares below)")
    per_step = max(1, args.max_num_tokens // args.isl)
    L.append(f"- every worker: `--max-num-tokens {args.max_num_tokens}` (at most {per_step} "
             f"{args.isl}-token prompts per step"
             + ("; with more, a deep context queue is prefilled in one long step and its "
                "requests reach the generation worker together" if per_step <= 2 else
                ": a deep context queue is prefilled in long steps whose requests reach the "
                "generation worker together")
             + "), `--kv-cache-tokens 32768`")
    L.append(f"- SLOs: TTFT p{args.ttft_percentile:g} <= {args.ttft_slo:g} ms for the context "
             f"rate; goodput counts requests with TTFT <= {args.ttft_slo:g} ms and TPOT <= "
             f"{args.tpot_slo:g} ms")
    la = data["loadavg"]
    L.append(f"- load average (1 min) before / after: {la[0]:.2f} / {la[1]:.2f}")
    L.append("")
    L.append("CPU used during each phase (percent of one core, from /proc):")
    L.append("")
    for name, m in data["cpu"].items():
        L.append(cpu_line(name, m))
    L.append("")
    steps = data.get("steps", [])
    if steps:
        redone = [st for st in steps if not st["kept"]]
        kept = [st for st in steps if st["kept"]]
        L.append(f"This machine is shared with other work. Before each measurement step the "
                 f"script waits (up to {args.wait_quiet:g} s) for a quiet machine, and redoes "
                 f"a step (up to {args.attempts} tries) during which other processes used more "
                 f"than {args.max_other:g} core. Steps redone: {len(redone)}; other processes' "
                 f"CPU during the kept steps: "
                 + ", ".join(f"{st['step']} {st['other_cores']:.2f}" for st in kept)
                 + " cores"
                 + ("" if all(st["other_cores"] <= args.max_other for st in kept) else
                    " (**a step stayed disturbed after every try**)") + ".")
        L.append("")

    return L


def _report_rate_matching(rm: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Section 1: the context rate and the rate-matched points beside the aggregated ones."""
    ctx_rate = rm["context"]["ctx_rate"]
    L: list[str] = []
    L.append("## 1. Rate matching (one context worker, one generation worker)")
    L.append("")
    if ctx_rate is None:
        L.append("No context probe met the TTFT SLO; nothing to rate-match.")
    else:
        L.append(f"Context worker: **{ctx_rate:.3f} req/s** within TTFT p"
                 f"{args.ttft_percentile:g} <= {args.ttft_slo:g} ms (probes: "
                 + ", ".join(f"{p['rate']:.3g} req/s -> {p['ttft_ms']:.0f} ms, served "
                             f"{_f(p.get('served_rate'), '.3g')} req/s, "
                             f"{'pass' if p['passed'] else 'fail'}"
                             for p in rm["context"]["probes"]) + "). The rate is the highest "
                 "min(offered, served) of the passing probes: a probe above the worker's "
                 "capacity can pass a short SLO test while its queue grows, and then serves "
                 "less than it was offered.")
    L.append("")
    L.append("| concurrency | gen tok/s | tok/s/user | gen req/s | ctx:gen | tok/s per device "
             "(rate-matched) | frontier | aggregated worker tok/s | aggregated tok/s/user | "
             "aggregated TTFT p90 ms |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    agg_by = {p["concurrency"]: p for p in (rm.get("aggregated") or {}).get("points", [])}
    for p in rm["rate_matched"]:
        a = agg_by.get(p["concurrency"], {})
        L.append(f"| {p['concurrency']} | {p['gen_output_tps']:.1f} | "
                 f"{p['tokens_per_s_per_user']:.1f} | {p['gen_request_rate']:.3f} | "
                 f"{p['ctx_per_gen']:.2f}:1 | {p['tput_per_device']:.1f} | "
                 f"{'yes' if p['on_frontier'] else ''} | {_f(a.get('output_throughput'))} | "
                 f"{_f(a.get('tokens_per_s_per_user'))} | {_f(a.get('ttft_ms'), '.0f')} |")
    L.append("")
    L.append("ctx:gen = context workers per generation worker that match request rates; tok/s "
             "per device = gen tok/s / (ctx:gen + 1), each worker one device: the generation "
             "worker's output shared by itself and the context workers feeding it. "
             "tok/s/user = 1000 / mean TPOT. The aggregated columns: one aggregated worker "
             "(one core) at the same concurrency, same prompts and lengths.")
    L.append("")

    return L


def _report_verify(data: dict[str, Any], ver: list[dict[str, Any]]) -> list[str]:
    """Section 2: the end-to-end measurements against their predictions."""
    L: list[str] = []
    if ver:
        L.append("## 2. End to end at rate-matched points (1 context + 1 generation, through "
                 "the router)")
        L.append("")
        pkey = f"p{data['args']['ttft_percentile']:g}"
        L.append(f"| gen concurrency | bound | arrivals | predicted tok/s per device | measured "
                 f"(steady) | gap | whole run | predicted tok/s/user | measured | gap | "
                 f"TTFT {pkey} ms (SLO {data['args']['ttft_slo']:g}) | TPOT p99 ms |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for v in ver:
            pr, me = v["predicted"], v["measured"]
            run = me.get("run_output_throughput")
            how = describe_arrivals(me)
            L.append(f"| {v['concurrency']} | {pr['bound']} | {how} | "
                     f"{pr['tput_per_device']:.1f} | "
                     f"{me['tput_per_device']:.1f} | {pct(v['gap_tput_per_device'])} | "
                     f"{_f(None if run is None else run / v['devices'])} | "
                     f"{pr['tokens_per_s_per_user']:.1f} | {me['tokens_per_s_per_user']:.1f} | "
                     f"{pct(v['gap_tokens_per_s_per_user'])} | "
                     f"{me['ttft_ms']:.0f} | {me['p99_tpot_ms']:.1f} |")
        L.append("")
        L.append("The prediction for 1 + 1 is the slower side's request rate: min(gen req/s at "
                 "that concurrency, context req/s at the SLO) x osl / 2 devices (`ratematch."
                 "predict_cluster`). Each prediction is measured under the arrivals its binding "
                 "side was measured with. Generation bound: a closed loop of the generation "
                 "concurrency plus predicted rate x unloaded TTFT requests at the context side "
                 "(Little's law), so that the generation worker holds the rate-matched "
                 "concurrency; that count is fractional, so (unless within 0.1 of a whole "
                 "number) loops run at the whole counts below and above it and the result is "
                 "linear between them (`ratematch.interpolate_runs`). Context bound: the "
                 "context rate is a rate of Poisson arrivals "
                 "within the TTFT SLO, so the cluster gets Poisson arrivals at that rate (a "
                 "closed loop would push the context worker to whatever TTFT its in-flight "
                 "count forces); the generation worker then serves that rate below the measured "
                 "concurrency, and its predicted tok/s/user is `open_loop_tpot`'s (section 3). "
                 "Measured tok/s is the steady state, from the first completion to the last "
                 "send (`metrics.steady_state_output_throughput`); the whole-run figure (first "
                 "send to last byte) includes the ramp-up and the drain.")
        L.append("")

    return L


def _report_open_loop(data: dict[str, Any], png: str
                      ) -> tuple[list[str], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Section 3: Poisson arrivals at the same rates, both systems; also the row pairs."""
    L: list[str] = []
    L.append("## 3. Open loop (Poisson) at the same request rates")
    L.append("")
    L.append("| req/s | system | output tok/s (steady) | whole run | predicted tok/s | "
             "TTFT p99 ms | TPOT p99 ms | mean TPOT ms | predicted mean TPOT ms | TPOT gap | "
             "goodput req/s | failed |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for d, a in zip(data["disagg_open"], data["agg_open"], strict=True):
        pred = d["prediction"]
        for name, r in (("disaggregated", d), ("aggregated", a)):
            s = r["summary"]
            tpot_gap = ((s["mean_tpot_ms"] - pred["mean_tpot_ms"]) / pred["mean_tpot_ms"]
                        if name == "disaggregated" and pred["mean_tpot_ms"] else None)
            L.append(f"| {r['rate']:.3f} | {name} | {_f(s.get('steady_output_throughput'))} | "
                     f"{s['output_throughput']:.1f} | "
                     f"{pred['output_throughput']:.1f}{'' if pred['sustainable'] else ' (cap)'}"
                     f"{'' if name == 'disaggregated' else ' (1+1)'} | "
                     f"{s['p99_ttft_ms']:.0f} | {s['p99_tpot_ms']:.1f} | "
                     f"{s['mean_tpot_ms']:.1f} | "
                     f"{_f(pred['mean_tpot_ms']) if name == 'disaggregated' else ''} | "
                     f"{pct(tpot_gap) if name == 'disaggregated' else ''} | "
                     f"{s['request_goodput']:.3f} | {s['failed']} |")
        rows.append((d, a))
    L.append("")
    L.append("Predicted tok/s = rate x osl while the rate is within the 1 + 1 capacity (context "
             "rate at the SLO, generation's highest measured rate), else the capacity (cap). "
             "Predicted mean TPOT (`ratematch.open_loop_tpot`): a request shares each decode "
             "step with the others in service on the generation worker, Poisson(rate x its "
             "decode time) of them, so its TPOT is the generation-only TPOT at 1 + N users "
             "averaged over that distribution (linear between the measured concurrencies), "
             "solved for the decode time by fixed point. "
             "Arrivals are Poisson with the sample's gaps scaled so that its realized rate is "
             "the nominal one (`arrival_offsets(exact_rate=True)`). Output tok/s (steady) "
             "counts the tokens that arrived between the first completion and the last send; "
             "the whole-run figure (first send to last byte) also has the ramp-up and the "
             "drain in its denominator.")
    L.append("")
    L.append(f"![tokens/s per device against tokens/s/user]({os.path.basename(png)})")
    L.append("")

    return L, rows


def _report_targets(rows: list[tuple[dict[str, Any], dict[str, Any]]],
                    ver: list[dict[str, Any]]) -> list[str]:
    """The two targets and whether this run met them."""
    L: list[str] = []
    L.append("## Targets")
    L.append("")
    ratios = []
    for d, a in rows:
        ds, as_ = d["summary"], a["summary"]
        matched = (ds["failed"] == 0 and as_["failed"] == 0 and
                   abs(ds["output_throughput"] - as_["output_throughput"])
                   <= 0.1 * max(ds["output_throughput"], as_["output_throughput"]))
        ratios.append((d["rate"], ds["p99_tpot_ms"] / as_["p99_tpot_ms"], matched))
    matched = [(r, x) for r, x, m in ratios if m]
    L.append("1. At matched throughput, disaggregated TPOT p99 <= 1/2 of aggregated: "
             + _verdict([x <= 0.5 for _, x in matched]) + ". TPOT p99 disaggregated / "
             "aggregated at each rate: "
             + ", ".join(f"{r:.3f} req/s: {x:.2f}{'' if m else ' (throughputs differ > 10%)'}"
                         for r, x, m in ratios) + ".")
    gaps = [v["gap_tput_per_device"] for v in ver if v["gap_tput_per_device"] is not None]
    tgaps = []
    for d, _ in rows:
        pred = d["prediction"]
        if pred["sustainable"] and pred["mean_tpot_ms"]:
            tgaps.append((d["summary"]["mean_tpot_ms"] - pred["mean_tpot_ms"])
                         / pred["mean_tpot_ms"])
    ogaps = []
    for d, _ in rows:
        pred, st = d["prediction"], d["summary"].get("steady_output_throughput")
        if pred["sustainable"] and st is not None:
            ogaps.append((st - pred["output_throughput"]) / pred["output_throughput"])
    L.append("2. Rate-matched prediction within 10% of end to end: tok/s per device at the "
             "verified points " + _verdict([abs(g) <= 0.10 for g in gaps])
             + " (" + ", ".join(pct(g) for g in gaps) + "); output tok/s at the sustainable "
             "open-loop rates " + _verdict([abs(g) <= 0.10 for g in ogaps]) + " ("
             + ", ".join(pct(g) for g in ogaps) + "); mean TPOT at the sustainable "
             "open-loop rates " + _verdict([abs(g) <= 0.10 for g in tgaps]) + " ("
             + ", ".join(pct(g) for g in tgaps) + ").")
    return L


def report(data: dict[str, Any], args: argparse.Namespace, png: str) -> str:
    rm = data["rate_match"]
    ver = rm.get("verify") or []
    L = _report_header(data, args)
    L += _report_rate_matching(rm, args)
    L += _report_verify(data, ver)
    open_loop, rows = _report_open_loop(data, png)
    L += open_loop
    L += _report_targets(rows, ver)
    L.append("")
    L.append("Notes:")
    L.append("")
    for note in data["notes"]:
        L.append(f"- {note}")
    return "\n".join(L) + "\n"


def _verify_notes(data: dict[str, Any]) -> list[str]:
    """What each end-to-end point loaded the generation worker with, and its TTFT."""
    notes = []
    rm = data["rate_match"]
    ver = rm.get("verify") or []
    osl = data["args"]["osl"]
    for v in ver:
        me, pr = v["measured"], v["predicted"]
        # Little's law on the generation worker: requests/s x seconds each spends decoding.
        on_gen = me["output_throughput"] / osl * (osl - 1) * me["mean_tpot_ms"] / 1000.0
        how = describe_arrivals(me)
        if me["arrivals"] == "closed":
            how += (f" (Little's law: generation concurrency + predicted rate x unloaded "
                    f"TTFT {me['unloaded_ttft_ms']:.0f} ms = {me['in_flight']:.2f}"
                    + (")" if not me.get("runs") else
                       "; the loops' own results: " + "; ".join(
                           f"{k} in flight {r['output_throughput'] / v['devices']:.1f} tok/s "
                           f"per device, {r['tokens_per_s_per_user']:.1f} tok/s/user"
                           for k, r in zip(me["in_flight_runs"], me["runs"], strict=True))
                       + ")"))
        ttft = me["ttft_ms"]
        slo = data["args"]["ttft_slo"]
        notes.append(
            f"End to end, generation concurrency {v['concurrency']} (prediction bound: "
            f"{pr['bound']}), {how}: the generation worker held {on_gen:.1f} requests on "
            f"average (steady request rate x "
            f"decode time), each request spent {me['mean_ttft_ms']:.0f} ms (mean TTFT: "
            f"context queue, prefill, KV transfer) before it."
            f" TTFT p{data['args']['ttft_percentile']:g} {ttft:.0f} ms: "
            f"{'within' if ttft <= slo else 'past'} the SLO ({slo:g} ms).")
    return notes


def _aggregated_notes(data: dict[str, Any]) -> list[str]:
    """Why the aggregated workers' TPOT suffers: the prefills they interleave."""
    notes = []
    rm = data["rate_match"]
    agg = rm.get("aggregated") or {}
    if agg.get("points"):
        best = max(agg["points"], key=lambda p: p["output_throughput"])
        notes.append(f"One aggregated worker peaks at {best['output_throughput']:.1f} tok/s "
                     f"(concurrency {best['concurrency']}); closed-loop runs start all "
                     f"requests together, so its prefills and decodes barely interleave there. "
                     f"The open-loop runs (Poisson) are where prefills interrupt decoding.")
    agg_one = {p["concurrency"]: p for p in agg.get("points", [])}.get(1)
    if agg_one and data["agg_open"]:
        prefill = agg_one["mean_ttft_ms"]
        osl = data["args"]["osl"]
        overlaps = ", ".join(
            f"{r['rate']:.3f} req/s: "
            f"{r['rate'] / 2 * (osl - 1) * r['summary']['mean_tpot_ms'] / 1000:.1f}"
            for r in data["agg_open"])
        notes.append(
            f"What sets the TPOT p99 ratio: a {data['args']['isl']}-token prefill takes "
            f"{prefill:.0f} ms on one core (one aggregated worker's TTFT alone), adding about "
            f"{prefill / (osl - 1):.1f} ms to the TPOT of every request decoding on that "
            f"worker meanwhile; an aggregated request overlaps on average (rate / 2 x its "
            f"decode time) this many prefills: {overlaps}. The matched rates stop at the 1 + 1 "
            f"cluster's capacity ({rm['context']['ctx_rate']:.3f} req/s, the one context "
            f"core). The disaggregated generation worker has no prefills, but its TPOT grows "
            f"with its batch (generation-only: "
            + ", ".join(f"{p['mean_tpot_ms']:.1f} ms at {p['concurrency']}"
                        for p in rm["generation"]["points"][:3])
            + "), and it installs each request's pulled KV.")
    return notes


def _kv_notes(data: dict[str, Any]) -> list[str]:
    """The KV the generation worker pulled and installed, against its TPOT gap."""
    notes = []
    kv = data.get("gen_kv") or {}
    n_kv = kv.get("disagg_kv_transfers_total", 0.0)
    if n_kv:
        per_req = kv["disagg_kv_transfer_bytes_total"] / n_kv
        pull_ms = 1000 * kv["disagg_kv_transfer_seconds_sum"] / n_kv
        gaps = [(d["rate"], (d["summary"]["mean_tpot_ms"] - d["prediction"]["mean_tpot_ms"])
                 / d["prediction"]["mean_tpot_ms"]) for d in data["disagg_open"]
                if d["prediction"]["mean_tpot_ms"]]
        notes.append(
            f"The generation worker pulled the KV of {n_kv:.0f} requests, "
            f"{per_req / 2**20:.1f} MiB each (mean pull {pull_ms:.0f} ms), "
            f"and installs it into its cache on its one core: at the open-loop rates that is "
            + ", ".join(f"{r * per_req / 2**20:.1f} MiB/s at {r:.3f} req/s (TPOT gap "
                        f"{100 * g:+.0f}%)" for r, g in gaps)
            + ". Generation-only requests skip the pull, so the generation curve leaves this "
              "work out of the TPOT prediction.")
    return notes


def _machine_notes(data: dict[str, Any]) -> list[str]:
    """Interference between the cores and the other work on this shared machine."""
    notes = []
    rm = data["rate_match"]
    for p in rm.get("interference") or []:
        notes.append(
            f"Cores are not independent: generation-only at concurrency {p['concurrency']} "
            f"decodes at a mean TPOT of {p['idle_mean_tpot_ms']:.1f} ms with the context worker "
            f"idle and {p['busy_mean_tpot_ms']:.1f} ms "
            f"({100 * (p['busy_mean_tpot_ms'] / p['idle_mean_tpot_ms'] - 1):+.0f}%) while it "
            f"prefills {p['context_rate']:.3f} req/s on the other core (the two share the "
            f"memory system). The rate-matched curve measures each side alone, so the TPOT "
            f"prediction leaves this out.")
    kept = [st for st in data.get("steps", []) if st["kept"]]
    worst = max(kept, key=lambda st: st["other_cores"]) if kept else None
    if worst is not None and worst["other_cores"] > data["args"]["max_other"]:
        notes.append(f"The step '{worst['step']}' kept {worst['other_cores']:.2f} cores of "
                     f"other processes' work after every try (other work on this shared "
                     f"machine); every worker is pinned to one of the two cores, so that load "
                     f"slowed its workers directly.")
    notes.append("The per-phase CPU shares above cover whole phases, including the waits for "
                 "a quiet machine and any redone steps; the kept steps' own shares are listed "
                 "after them.")
    return notes


def explain(data: dict[str, Any]) -> list[str]:
    """Measured facts that explain the numbers (written from the data, not by hand)."""
    return (_verify_notes(data) + _aggregated_notes(data) + _kv_notes(data)
            + _machine_notes(data))


# --------------------------------------------------------------------------------- main


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.disagg_vs_aggregated",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out",
                    default=str(ROOT / "bench/results/disagg-vs-aggregated-sequential.md"))
    ap.add_argument("--png", default=None, help="default: --out with .png")
    ap.add_argument("--json", default=None, help="default: --out with .json")
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--max-num-tokens", type=int, default=1024,
                    help="every worker's tokens per iteration: two prompts per step, so a "
                         "deep queue does not turn into one long prefill step whose requests "
                         "all reach the generation worker at once")
    ap.add_argument("--ttft-slo", type=float, default=2000.0, help="ms")
    ap.add_argument("--ttft-percentile", type=float, default=90.0)
    ap.add_argument("--tpot-slo", type=float, default=100.0, help="ms, goodput only")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--rate-fracs", default="0.3,0.5,0.7,0.9",
                    help="open-loop rates as fractions of the predicted 1+1 capacity")
    ap.add_argument("--run-seconds", type=float, default=40.0,
                    help="open loop: rate * this many requests ...")
    ap.add_argument("--min-prompts", type=int, default=30, help="... and at least this many")
    ap.add_argument("--ctx-probe-seconds", type=float, default=20.0)
    ap.add_argument("--ctx-max-probes", type=int, default=7)
    ap.add_argument("--gen-rounds", type=int, default=4)
    ap.add_argument("--verify-points", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait-quiet", type=float, default=600.0, metavar="S",
                    help="before each step, wait up to S seconds for a 5 s window in which "
                         "the machine uses <= --max-other cores (0: do not wait)")
    ap.add_argument("--max-other", type=float, default=0.25, metavar="CORES",
                    help="redo a step during which other processes used more than this")
    ap.add_argument("--attempts", type=int, default=3, help="tries per step")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="checkpoint folder to serve (default: a random tiny llama, SIZES)")
    ap.add_argument("--from-json", default=None, metavar="JSON",
                    help="measure nothing: rewrite the report (and its notes) from a saved "
                         "result JSON, e.g. after the report's wording changed")
    return ap.parse_args()


def _rewrite_from_json(path: str) -> None:
    """``--from-json``: the notes and the report again from a saved result, no measuring."""
    data = json.loads(Path(path).read_text())
    data["notes"] = explain(data)
    data["report_rewritten"] = datetime.datetime.now().astimezone().isoformat(
        timespec="seconds")
    saved = argparse.Namespace(**data["args"])
    md = os.path.splitext(path)[0] + ".md"
    save_result(data, path)
    Path(md).write_text(report(data, saved, os.path.splitext(md)[0] + ".png"))
    print(f"rewrote {md} from {path}")


def _run_disaggregated(data: dict[str, Any], args: argparse.Namespace, model: str, tmp: Path,
                       tok: Any, guard: Guard, concs: tuple[int, ...], fracs: list[float]
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Phase 1, the 1 + 1 cluster: rate-match, verify, open loop, interference. Returns the
    rate-match result and the open-loop runs; CPU shares and KV counters go into ``data``."""
    ports = free_ports(3)
    mnt = args.max_num_tokens
    ctx = start_worker(model, "context worker", "context", 0, ports[0], tmp, mnt)
    gen = start_worker(model, "generation worker", "generation", 1, ports[1], tmp, mnt,
                       "--benchmark-gen-only")
    procs = [ctx, gen]
    try:
        wait_healthy(procs)
        router = start_router({
            "context_servers": {"num_instances": 1, "urls": [ctx.url[7:]],
                                "router": {"type": "load_balancing"}},
            "generation_servers": {"num_instances": 1, "urls": [gen.url[7:]],
                                   "router": {"type": "load_balancing"}}},
            ports[2], tmp, "router (disaggregated)")
        procs.append(router)
        wait_healthy([router])
        guard.procs = procs
        cfg = RateMatchConfig(context_url=ctx.url, generation_url=gen.url,
                              ttft_slo_ms=args.ttft_slo, isl=args.isl, osl=args.osl,
                              concurrencies=concs, model=NAME,
                              ttft_percentile=args.ttft_percentile,
                              ctx_probe_seconds=args.ctx_probe_seconds,
                              ctx_max_probes=args.ctx_max_probes, gen_rounds=args.gen_rounds,
                              seed=args.seed)

        async def phase1() -> tuple[dict[str, Any], list[dict[str, Any]]]:
            tr = make_transport("auto", 3600)
            try:
                m = RateMatcher(cfg, tok, tr)
                c = await guard.run("context sweep", m.sweep_context)
                g = await guard.run("generation sweep", m.sweep_generation)
                rm = build_result(cfg, NAME, c, g)
                if c["ctx_rate"] is None:
                    raise RuntimeError("no context rate met the TTFT SLO; raise --ttft-slo")
                # Verify: the 1 + 1 cluster already running (pinned) stands in for `launch`.
                choices = verify_choices(rm, 2, args.verify_points)
                measured = []
                for ch in choices:
                    assert (ch["num_ctx"], ch["num_gen"]) == (1, 1)
                    measured.append(await guard.run(
                        f"end to end, concurrency {ch['concurrency']} "
                        f"({ch['predicted']['arrivals']} arrivals)",
                        lambda ch=ch: m.run_end_to_end(router.url, ch["concurrency"],
                                                       ch["predicted"]["request_rate"],
                                                       ch["predicted"]["arrivals"])))
                rm["verify"] = [finish_verify_point(ch, me)
                                for ch, me in zip(choices, measured, strict=True)]
                cap = predict_at_rate(c["ctx_rate"], g["points"], args.osl, 1, 1,
                                      1e9)["capacity_request_rate"]
                rates = [f * cap for f in fracs]
                print(f"1+1 predicted capacity {cap:.3f} req/s; open-loop rates "
                      f"{', '.join(f'{r:.3f}' for r in rates)}", flush=True)
                runs = await open_loop(guard, "disaggregated", router.url, tok, rates, args,
                                       tr)
                for d in runs:
                    d["prediction"] = predict_at_rate(c["ctx_rate"], g["points"], args.osl,
                                                      1, 1, d["rate"])
                rm["interference"] = await guard.run(
                    "generation-only with the context core idle / busy",
                    lambda: interference(m, ctx.url, gen.url, [1, 4], rates[-1], args, tok,
                                         tr))
                return rm, runs
            finally:
                await tr.aclose()

        meter = CpuMeter(procs)
        rm, dis = asyncio.run(phase1())
        data["cpu"]["disaggregated cluster"] = meter.done()
        data["gen_kv"] = kv_metrics(gen.url)
    finally:
        stop(procs)
    return rm, dis


def _run_aggregated(data: dict[str, Any], args: argparse.Namespace, model: str, tmp: Path,
                    tok: Any, guard: Guard, concs: tuple[int, ...], rm: dict[str, Any],
                    rates: list[float]) -> list[dict[str, Any]]:
    """Phase 2, two aggregated workers: the one-worker baseline (into ``rm``) and the
    open-loop runs at the same rates (returned)."""
    mnt = args.max_num_tokens
    ports = free_ports(3)
    a0 = start_worker(model, "aggregated worker 0", "aggregated", 0, ports[0], tmp, mnt)
    a1 = start_worker(model, "aggregated worker 1", "aggregated", 1, ports[1], tmp, mnt)
    procs = [a0, a1]
    try:
        wait_healthy(procs)
        router = start_router({"generation_servers": {
            "num_instances": 2, "urls": [a0.url[7:], a1.url[7:]],
            "router": {"type": "load_balancing"}}}, ports[2], tmp, "router (aggregated)")
        procs.append(router)
        wait_healthy([router])
        guard.procs = procs
        acfg = RateMatchConfig(context_url=a0.url, generation_url=a0.url,
                               aggregated_url=a0.url, ttft_slo_ms=args.ttft_slo, isl=args.isl,
                               osl=args.osl, concurrencies=concs, model=NAME,
                               ttft_percentile=args.ttft_percentile,
                               gen_rounds=args.gen_rounds, seed=args.seed + 7)

        async def phase2() -> tuple[dict[str, Any], list[dict[str, Any]]]:
            tr = make_transport("auto", 3600)
            try:
                m = RateMatcher(acfg, tok, tr)
                base = await guard.run("aggregated baseline (one worker)", m.sweep_aggregated)
                return base, await open_loop(guard, "aggregated", router.url, tok, rates,
                                             args, tr)
            finally:
                await tr.aclose()

        meter = CpuMeter(procs)
        base, agg = asyncio.run(phase2())
        rm["aggregated"] = base
        rm["config"]["aggregated_url"] = a0.url
        data["cpu"]["aggregated cluster"] = meter.done()
    finally:
        stop(procs)
    return agg


def main() -> int:
    args = _parse_args()
    if args.from_json:
        _rewrite_from_json(args.from_json)
        return 0
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    json_path = args.json or os.path.splitext(args.out)[0] + ".json"

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the `finally`s that stop the workers

    signal.signal(signal.SIGTERM, on_sigterm)
    concs = tuple(int(x) for x in args.concurrency.split(","))
    fracs = [float(x) for x in args.rate_fracs.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="disagg-vs-agg-"))
    model, params = bench_model(args.model, tmp)
    tok = load_bench_tokenizer(model)
    load0 = os.getloadavg()[0]
    print(f"model {model} ({params / 1e6:.1f} M parameters); logs in {tmp}", flush=True)
    data: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.disagg_vs_aggregated", *sys.argv[1:]]),
        "params_m": params / 1e6, "args": vars(args), "cpu": {},
        "model_desc": describe_model(args.model),
    }

    data["steps"] = []
    guard = Guard(data["steps"], args.wait_quiet, args.max_other, args.attempts)
    # Phase 1 then phase 2: each cluster alone on the two cores.
    rm, dis = _run_disaggregated(data, args, model, tmp, tok, guard, concs, fracs)
    rates = [d["rate"] for d in dis]
    agg = _run_aggregated(data, args, model, tmp, tok, guard, concs, rm, rates)

    data["loadavg"] = [load0, os.getloadavg()[0]]
    data["cpu_kernels"] = cpu_kernels()  # after the runs: the workers built what was missing
    data["rate_match"] = rm
    data["disagg_open"] = dis
    data["agg_open"] = agg
    data["notes"] = explain(data)
    print(format_rate_match(rm))

    def series(runs: list[dict[str, Any]]) -> list[tuple[float, float]]:
        return [(1000.0 / r["summary"]["mean_tpot_ms"], r["summary"]["output_throughput"] / 2)
                for r in runs if r["summary"]["mean_tpot_ms"] > 0]

    plot_rate_match(rm, png, extra_series=[
        ("disaggregated 1+1, open loop (Poisson)", series(dis)),
        ("aggregated x2, open loop (Poisson)", series(agg))])
    save_result(data, json_path)
    text = report(data, args, png)
    Path(args.out).write_text(text)
    print(text)
    print(f"wrote {args.out}, {png}, {json_path}")
    return 0


def bench_model(model_dir: str | None, tmp: Path) -> tuple[str, int]:
    """The checkpoint folder to serve (``model_dir``, else a random tiny llama written into
    ``tmp``) and its parameter count."""
    from safetensors import safe_open

    from disagg.model.tiny import write_tiny_checkpoint

    model = model_dir or write_tiny_checkpoint(str(tmp / "model"), seed=0, **SIZES)
    params = 0
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), "pt") as f:
                params += sum(numel(f.get_slice(k).get_shape()) for k in f.keys())
    return model, params


def describe_model(model_dir: str | None) -> str | None:
    """A line for the report: the folder and its shape (None: the tiny default)."""
    if model_dir is None:
        return None
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size")
    return f"`{model_dir}` ({cfg.get('model_type', '?')}: " + ", ".join(
        f"{k} {cfg[k]}" for k in keys if k in cfg) + ")"


def cpu_kernels() -> str:
    """Which CPU kernels the workers had: enabled by ``DISAGG_CPU_KERNELS`` and built in the
    cache they load from (the workers build a missing one at start, so this is read after
    the runs)."""
    from disagg.env import CPU_KERNELS
    from disagg.model import kernel_build

    enabled = sorted(CPU_KERNELS.get())
    missing = kernel_build.missing()
    if not enabled:
        return "none (DISAGG_CPU_KERNELS off: the PyTorch path)"
    return ", ".join(f"{k} ({'NOT built: PyTorch path' if k in missing else 'active'})"
                     for k in enabled)


def numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


if __name__ == "__main__":
    sys.exit(main())
