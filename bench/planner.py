"""The planner against static ctx:gen splits, on a workload that shifts (issue 21).

Four workers, each a *device* of fixed capacity: a CPU quota of ``--device-cores`` cores
(a cgroup ``cpu`` controller: cgroup v1 ``cfs_quota_us`` or v2 ``cpu.max``), one torch thread.
A quota, unlike a pinned core shared with others, behaves as a GPU does here: a worker that idles
leaves its capacity unused, and a busy one cannot borrow an idle one's. That is the premise of
rate matching, and the reason a role flip can help at all (on shared cores, moving work between
processes moves no capacity). The rest of the machine runs the router and this load generator.

The trace (fixed seed, Poisson arrivals, replayed by timestamp): phase 1 sends long prompts with
short answers (context-bound), phase 2 short prompts with long answers (generation-bound). Three
clusters answer the same trace, one after the other, behind a ``disagg router``:

1. the best static split for phase 1, 2. the best static split for phase 2 (each chosen in this
   run: every split from 1+3 to 3+1 serves that phase alone; the best goodput wins), and
3. the planner (``--planner``), starting from 2+2.

Goodput: requests per second over the whole trace that met both SLOs (TTFT and TPOT, the
planner's own), failed requests count as missed. The timeline (PNG): context workers in the
router's pools (polled from ``/cluster_info``), TTFT p90 and TPOT p90 over sliding windows of the
requests sent in them. Target (issue 21): the planner's goodput >= the better static split's and
>= 1.2x the worse one's.

    python -m bench.planner [--out bench/results/planner.md]

Writes the markdown (``--out``) and the PNG beside it (``--json PATH``: also every request's
record).
Exactness across role flips is the integration test's job (``tests/test_planner_cluster.py``);
this script measures speed only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from disagg.bench.arrivals import arrival_offsets
from disagg.bench.datasets import SampleRequest, load_bench_tokenizer, sample_random
from disagg.bench.metrics import RequestRecord, meets_slos
from disagg.bench.runner import BenchmarkConfig, run_benchmark
from disagg.procs import free_ports, log_tail, spawn, stop_all
from disagg.procs import wait_healthy as wait_child_healthy

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-planner"
NAME = "m"
# A small Llama: prefill of a long prompt and a decode step cost about the same order of
# milliseconds on a fraction of a core, so either side can be the bottleneck.
SIZES = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
             max_position_embeddings=2048)


# ----------------------------------------------------------------------------- devices


class CpuQuota:
    """A cgroup holding one worker at a fixed CPU quota (its *device*); removed by ``close``.

    cgroup v1 (a ``cpu`` hierarchy with ``cpu.cfs_quota_us``) or v2 (``cpu.max``); ``None`` from
    ``create`` when neither is writable here (the benchmark then refuses to run: without a
    quota its premise does not hold)."""

    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    @staticmethod
    def root() -> tuple[Path, bool] | None:
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
            return v1, False
        v2 = Path("/sys/fs/cgroup")
        ctrl = v2 / "cgroup.controllers"
        if ctrl.exists() and "cpu" in ctrl.read_text().split() and os.access(v2, os.W_OK):
            return v2, True
        return None

    @classmethod
    def create(cls, name: str, cores: float) -> CpuQuota:
        found = cls.root()
        if found is None:
            raise SystemExit("bench.planner: no writable cgroup cpu controller here "
                             "(root and cgroup v1 cpu or v2 cpu.max are needed)")
        root, v2 = found
        path = root / f"disagg-planner-bench-{os.getpid()}-{name}"
        path.mkdir()
        period = 100_000
        if v2:
            (root / "cgroup.subtree_control").write_text("+cpu")
            (path / "cpu.max").write_text(f"{round(cores * period)} {period}")
        else:
            (path / "cpu.cfs_period_us").write_text(str(period))
            (path / "cpu.cfs_quota_us").write_text(str(round(cores * period)))
        return cls(path, v2)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float:
        """Seconds the group waited for quota (its device was saturated)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        if self.v2:
            return int(stat.get("throttled_usec", 0)) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()  # empty once its processes are gone


# ----------------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests/s (Poisson)
    isl: int
    osl: int


def make_trace(tok: Any, phases: Sequence[Phase], seed: int) -> list[tuple[int, SampleRequest]]:
    """(phase index, request) of the whole trace, timestamps from the trace start."""
    out: list[tuple[int, SampleRequest]] = []
    t0 = 0.0
    for k, ph in enumerate(phases):
        n = max(1, round(ph.seconds * ph.rate))
        offs = arrival_offsets(n, ph.rate, seed=seed + k, exact_rate=True)
        reqs = sample_random(tok, n, ph.isl, ph.osl, seed=seed + k, as_token_ids=True)
        for off, r in zip(offs, reqs, strict=True):
            r.timestamp = t0 + off
            out.append((k, r))
        t0 += ph.seconds
    return out


# ----------------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    procs: list[Any]
    logs: list[Path]
    quotas: list[CpuQuota]
    url: str
    workers: list[str]

    def stop(self) -> None:
        stop_all(list(reversed(self.procs)), grace_s=30.0, kill_wait_s=10.0)
        for q in self.quotas:
            q.close()


def _worker_cmd(model: str, role: str, port: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "disagg.cli", "serve", model, "--port", str(port), "--role",
            role, "--served-model-name", NAME, "--log-level", "warning",
            "--kv-cache-tokens", str(args.kv_cache_tokens), "--max-model-len", "1024",
            "--max-num-tokens", str(args.max_num_tokens),
            "--max-batch-size", str(args.max_batch_size), "--kv-transfer-backend", "TCP"]


def planner_yaml(args: argparse.Namespace) -> dict[str, Any]:
    return {"enabled": True, "ttft_slo_ms": args.ttft_slo, "tpot_slo_ms": args.tpot_slo,
            "interval_s": args.interval, "window_s": args.planner_window,
            "min_samples": args.min_samples, "min_per_role": 1,
            "hysteresis_s": args.hysteresis}


def start_cluster(model: str, num_ctx: int, args: argparse.Namespace, tmp: Path,
                  label: str, planner: bool) -> Cluster:
    """``num_ctx`` context and 4 - ``num_ctx`` generation workers, each in its quota, and a
    router (static pools of the trtllm-serve YAML; ``planner``: with its ``planner:`` section)."""
    import yaml

    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    ports = free_ports(args.workers + 1)
    roles = ["context"] * num_ctx + ["generation"] * (args.workers - num_ctx)
    cl = Cluster([], [], [], f"http://127.0.0.1:{ports[-1]}", [])
    try:
        for i, (role, port) in enumerate(zip(roles, ports, strict=False)):
            q = CpuQuota.create(f"{label}-w{i}", args.device_cores)
            cl.quotas.append(q)
            log = tmp / f"{label}-w{i}.log"
            p = spawn(_worker_cmd(model, role, port, args), log, env=env, cwd=ROOT,
                      new_session=False)
            q.add(p.pid)
            cl.procs.append(p)
            cl.logs.append(log)
            cl.workers.append(f"127.0.0.1:{port}")
        cfg: dict[str, Any] = {
            "hostname": "127.0.0.1", "port": ports[-1], "model": NAME,
            "context_servers": {"num_instances": num_ctx, "urls": cl.workers[:num_ctx]},
            "generation_servers": {"num_instances": args.workers - num_ctx,
                                   "urls": cl.workers[num_ctx:]}}
        if planner:
            cfg["planner"] = planner_yaml(args)
        path = tmp / f"{label}-router.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        log = tmp / f"{label}-router.log"
        cl.procs.append(spawn([sys.executable, "-m", "disagg.cli", "router", "-c", str(path),
                               "--log-level", "info"], log, env=env, cwd=ROOT,
                              new_session=False))
        cl.logs.append(log)
        deadline = time.monotonic() + 300
        for p, lg, u in zip(cl.procs, cl.logs, [*cl.workers, cl.url[7:]], strict=True):
            try:
                wait_child_healthy("http://" + u, max(1.0, deadline - time.monotonic()),
                                   proc=p, interval=0.2, what=lg.stem)
            except Exception as e:
                raise RuntimeError(f"{e}:\n{log_tail(lg)}") from None
        return cl
    except BaseException:
        cl.stop()
        raise


# ----------------------------------------------------------------------------- running


def pool_counts(info: dict[str, Any]) -> dict[str, int]:
    """Healthy workers per pool of a router's ``/cluster_info``."""
    return {pool: sum(1 for w in ws if w.get("healthy")) for pool, ws in
            info.get("workers", {}).items()}


async def poll_timeline(url: str, stop: asyncio.Event, every_s: float,
                        out: list[dict[str, Any]]) -> None:
    """``/cluster_info`` every ``every_s`` until ``stop``: pool sizes and planner state."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=10, trust_env=False) as c:
        while not stop.is_set():
            try:
                info = (await c.get(url + "/cluster_info")).json()
                out.append({"t": time.perf_counter() - t0, "pools": pool_counts(info),
                            "planner": info.get("planner")})
            except (httpx.HTTPError, ValueError) as e:
                out.append({"t": time.perf_counter() - t0, "error": str(e)})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


async def serve_trace(url: str, trace: Sequence[tuple[int, SampleRequest]],
                      args: argparse.Namespace
                      ) -> tuple[list[RequestRecord], list[dict[str, Any]], float, float]:
    """Replay ``trace`` against ``url`` (greedy, streamed); records, timeline, wall seconds."""
    cfg = BenchmarkConfig(base_url=url, model=NAME, ignore_eos=True, seed=args.seed,
                          extra_body={"temperature": 0.0},
                          goodput_slos_ms={"ttft": args.ttft_slo, "tpot": args.tpot_slo})
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_timeline(url, stop, 0.5, timeline))
    t0 = time.perf_counter()
    t0_unix = time.time()
    try:
        res = await run_benchmark(cfg, [r for _, r in trace])
    finally:
        stop.set()
        await poller
    return res.records, timeline, time.perf_counter() - t0, t0_unix


# ----------------------------------------------------------------------------- analysis


def goodput(records: Sequence[RequestRecord], seconds: float, slos: dict[str, float]) -> float:
    """Requests/s that succeeded and met every SLO, over ``seconds``."""
    return sum(1 for r in records if r.success and meets_slos(r, slos)) / seconds


def windows(records: Sequence[RequestRecord], span_s: float, width_s: float,
            step_s: float) -> list[dict[str, Any]]:
    """TTFT p90, TPOT p90 (ms) and SLO attainment of the requests sent in each window."""
    out = []
    t = 0.0
    while t + width_s <= span_s + 1e-9:
        rs = [r for r in records if t <= r.start < t + width_s]
        ok = [r for r in rs if r.success]
        ttft = [r.ttft * 1e3 for r in ok]
        tpot = [x * 1e3 for x in (r.tpot for r in ok) if x is not None]
        out.append({"t": t + width_s / 2, "n": len(rs), "failed": len(rs) - len(ok),
                    "ttft_p90": float(np.percentile(ttft, 90)) if ttft else None,
                    "tpot_p90": float(np.percentile(tpot, 90)) if tpot else None})
        t += step_s
    return out


def flips(timeline: Sequence[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, context workers) each time the router's context pool size changed."""
    out: list[tuple[float, int]] = []
    for s in timeline:
        n = s.get("pools", {}).get("context")
        if n is not None and (not out or out[-1][1] != n):
            out.append((s["t"], n))
    return out


# ----------------------------------------------------------------------------- the runs


def rebase(trace: Sequence[tuple[int, SampleRequest]], phase: int
           ) -> list[tuple[int, SampleRequest]]:
    """The requests of one phase, their timestamps from that phase's start."""
    sel = [(k, r) for k, r in trace if k == phase]
    t0 = min(float(r.timestamp or 0.0) for _, r in sel)
    return [(k, SampleRequest(r.prompt, r.prompt_len, r.expected_output_len,
                              float(r.timestamp or 0.0) - t0)) for k, r in sel]


def run_on(model: str, num_ctx: int, args: argparse.Namespace, tmp: Path, label: str,
           traces: dict[str, Sequence[tuple[int, SampleRequest]]],
           planner: bool = False) -> dict[str, Any]:
    """Start a cluster, replay each named trace on it in turn, stop it."""
    cl = start_cluster(model, num_ctx, args, tmp, label, planner)
    out: dict[str, Any] = {"label": label, "num_ctx": num_ctx, "planner": planner, "runs": {}}
    try:
        for name, trace in traces.items():
            thr0 = [q.throttled_s() for q in cl.quotas]
            recs, timeline, wall, t0_unix = asyncio.run(serve_trace(cl.url, trace, args))
            out["runs"][name] = {
                "records": [r.to_json() for r in recs], "timeline": timeline, "wall_s": wall,
                "t0_unix": t0_unix,
                "phase": [k for k, _ in trace],
                "throttled_s": [q.throttled_s() - t for q, t in zip(cl.quotas, thr0,
                                                                    strict=True)]}
            print(f"  {label} {name}: {summarize(out['runs'][name], args)}", flush=True)
        if planner:
            with httpx.Client(timeout=10, trust_env=False) as c:
                out["cluster_info"] = c.get(cl.url + "/cluster_info").json()
                out["metrics"] = [ln for ln in c.get(cl.url + "/metrics").text.splitlines()
                                  if ln.startswith("disagg_planner")]
    finally:
        cl.stop()
    return out


def records_of(run: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_json(d) for d in run["records"]]


def span_s(args: argparse.Namespace, phases: Sequence[int]) -> float:
    return sum(p.seconds for i, p in enumerate(phases_of(args)) if i in phases)


def summarize(run: dict[str, Any], args: argparse.Namespace) -> str:
    recs = records_of(run)
    slos = {"ttft": args.ttft_slo, "tpot": args.tpot_slo}
    ph = sorted(set(run["phase"]))
    return (f"{len(recs)} requests, {sum(not r.success for r in recs)} failed, goodput "
            f"{goodput(recs, span_s(args, ph), slos):.2f} req/s")


def phases_of(args: argparse.Namespace) -> list[Phase]:
    return [Phase("long prompts, short answers", args.phase_s, args.rate1, args.isl1, args.osl1),
            Phase("short prompts, long answers", args.phase_s, args.rate2, args.isl2, args.osl2)]


def choose_static(model: str, args: argparse.Namespace, tmp: Path,
                  trace: Sequence[tuple[int, SampleRequest]]) -> dict[str, Any]:
    """Every split from 1 + (n-1) to (n-1) + 1 serves each phase alone; goodput of each."""
    slos = {"ttft": args.ttft_slo, "tpot": args.tpot_slo}
    phase_traces = {f"phase{k + 1}": rebase(trace, k) for k in range(2)}
    table: dict[int, dict[str, float]] = {}
    for num_ctx in range(1, args.workers):
        run = run_on(model, num_ctx, args, tmp, f"split{num_ctx}", phase_traces)
        table[num_ctx] = {name: goodput(records_of(r), span_s(args, [k]), slos)
                          for k, (name, r) in enumerate(run["runs"].items())}
    best = {name: max(table, key=lambda n, name=name: (table[n][name], -abs(2 * n - args.workers)))
            for name in phase_traces}
    return {"goodput": {str(n): g for n, g in table.items()}, "best": best}


def whole_trace(model: str, args: argparse.Namespace, tmp: Path,
                trace: Sequence[tuple[int, SampleRequest]], best: dict[str, int]
                ) -> list[dict[str, Any]]:
    """The whole trace on the best static split of each phase and on the planner (2 + 2),
    ``--repeats`` rounds in that order."""
    clusters = [(f"static {best['phase1']}+{args.workers - best['phase1']} (best for phase 1)",
                 best["phase1"], False)]
    if best["phase2"] != best["phase1"]:
        clusters.append((f"static {best['phase2']}+{args.workers - best['phase2']} "
                         "(best for phase 2)", best["phase2"], False))
    start = args.workers // 2
    clusters.append((f"planner (from {start}+{args.workers - start})", start, True))
    out = []
    for rnd in range(args.repeats):
        for label, num_ctx, planner in clusters:
            run = run_on(model, num_ctx, args, tmp, f"r{rnd}-{'planner' if planner else num_ctx}",
                         {"trace": trace}, planner=planner)
            run["name"], run["round"] = label, rnd
            out.append(run)
    return out


def score(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Goodput (whole trace and per phase), failures, p90s and flips of one run."""
    tr = run["runs"]["trace"]
    recs = records_of(tr)
    slos = {"ttft": args.ttft_slo, "tpot": args.tpot_slo}
    out: dict[str, Any] = {"goodput": goodput(recs, span_s(args, [0, 1]), slos),
                           "failed": sum(not r.success for r in recs), "requests": len(recs)}
    for k in range(2):
        sel = [r for r, p in zip(recs, tr["phase"], strict=True) if p == k]
        ok = [r for r in sel if r.success]
        out[f"phase{k + 1}"] = goodput(sel, span_s(args, [k]), slos)
        out[f"ttft_p90_{k + 1}"] = float(np.percentile([r.ttft * 1e3 for r in ok], 90)) \
            if ok else None
        tp = [x * 1e3 for x in (r.tpot for r in ok) if x is not None]
        out[f"tpot_p90_{k + 1}"] = float(np.percentile(tp, 90)) if tp else None
    out["flips"] = flips(tr["timeline"])
    return out


# ----------------------------------------------------------------------------- report


def machine(load0: Sequence[float], load1: Sequence[float]) -> list[str]:
    import torch

    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    return [f"- CPU: {cpu}, {os.cpu_count()} cores available, no GPU",
            f"- {platform.system()} {platform.release()} {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}",
            "- host load average (1/5/15 min) before: " + "/".join(f"{x:.2f}" for x in load0) +
            ", after: " + "/".join(f"{x:.2f}" for x in load1) +
            " (a shared host: other processes take CPU from the router and the client; the "
            "workers' quotas are caps, not guarantees)"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def report(data: dict[str, Any], args: argparse.Namespace, png: str) -> str:
    ph = phases_of(args)
    lines = [f"# Planner vs static ctx:gen splits ({data['date'][:10]})", "",
             *machine(data["load_before"], data["load_after"]),
             f"- model: random Llama checkpoint ({data['params'] / 1e6:.1f} M parameters: "
             + ", ".join(f"{k} {v}" for k, v in SIZES.items()) + "), float32",
             f"- {args.workers} workers, each a *device* = a CPU quota of {args.device_cores} "
             f"core (cgroup `cpu`), 1 torch thread, max_batch_size {args.max_batch_size}, "
             f"max_num_tokens {args.max_num_tokens}, KV over TCP; router and load generator "
             "outside the quotas",
             f"- trace (seed {args.seed}, Poisson arrivals, greedy, streamed, ignore_eos): "
             + "; then ".join(f"{p.seconds:.0f} s of {p.name} ({p.isl} prompt / {p.osl} output "
                              f"tokens, {p.rate} req/s)" for p in ph),
             f"- SLOs: TTFT <= {args.ttft_slo:.0f} ms, TPOT <= {args.tpot_slo:.0f} ms; goodput ="
             " requests meeting both per second of trace (failed requests count as missed)",
             f"- planner: `{json.dumps(planner_yaml(args))}`",
             f"- command: `python -m bench.planner {' '.join(data['argv'])}`", ""]
    lines += _report_static(data, args) + _report_whole(data, args) + _report_decisions(data)
    lines += ["", f"![timeline]({os.path.basename(png)})", ""]
    return "\n".join(lines)


def _report_static(data: dict[str, Any], args: argparse.Namespace) -> list[str]:
    st = data["static"]
    if st.get("given"):
        return ["## The static splits", "", f"Given by `--skip-static-choice` (not measured in "
                f"this run): {st['best']['phase1']}+{args.workers - st['best']['phase1']} for "
                f"phase 1, {st['best']['phase2']}+{args.workers - st['best']['phase2']} for "
                "phase 2.", ""]
    lines = ["## Choosing the static splits (each phase alone, every split)", "",
             "| context + generation | phase 1 goodput req/s | phase 2 goodput req/s |",
             "|---|---|---|"]
    for n, g in st["goodput"].items():
        lines.append(f"| {n}+{args.workers - int(n)} | {g['phase1']:.2f} | {g['phase2']:.2f} |")
    return lines + ["", f"Best for phase 1: {st['best']['phase1']}+"
                        f"{args.workers - st['best']['phase1']}; best for phase 2: "
                        f"{st['best']['phase2']}+{args.workers - st['best']['phase2']}.", ""]


def _report_whole(data: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = ["## The whole trace", "",
             "| cluster | round | goodput req/s | phase 1 | phase 2 | failed | TTFT p90 ms (1 / 2) "
             "| TPOT p90 ms (1 / 2) | context workers over time (s: count) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in data["whole"]:
        s = run["score"]
        fl = ", ".join(f"{t:.0f}: {n}" for t, n in s["flips"])
        lines.append(f"| {run['name']} | {run['round']} | **{s['goodput']:.2f}** | "
                     f"{s['phase1']:.2f} | {s['phase2']:.2f} | {s['failed']}/{s['requests']} | "
                     f"{_ms(s['ttft_p90_1'])} / {_ms(s['ttft_p90_2'])} | "
                     f"{_ms(s['tpot_p90_1'])} / {_ms(s['tpot_p90_2'])} | {fl} |")
    med = data["medians"]
    plan = med["planner"]
    statics = {k: v for k, v in med.items() if k != "planner"}
    better, worse = max(statics.values()), min(statics.values())
    lines += ["", "Targets (issue 21; medians over the rounds):", "",
              f"- planner goodput >= the better static split's: {plan:.2f} vs {better:.2f} "
              f"req/s (x{plan / better:.2f}): **{'met' if plan >= better else 'missed'}**",
              f"- planner goodput >= 1.2x the worse static split's: {plan:.2f} vs {worse:.2f} "
              f"req/s (x{plan / worse if worse else math.inf:.2f}): "
              f"**{'met' if plan >= 1.2 * worse else 'missed'}**", ""]
    return lines


def _report_decisions(data: dict[str, Any]) -> list[str]:
    runs = [r for r in data["whole"] if r["planner"]]
    if not runs:
        return []
    pl = (runs[-1].get("cluster_info") or {}).get("planner") or {}
    lines = ["## The planner's flips (last round, from the router's `/cluster_info`)", "",
             "| time in trace s | worker | from | to | reason |", "|---|---|---|---|---|"]
    t0 = runs[-1]["runs"]["trace"].get("t0_unix")
    for f in reversed(pl.get("flips", [])):
        at = f"{f['time'] - t0:.1f}" if t0 else "-"
        lines.append(f"| {at} | {f['worker']} | {f['from_role']} | {f['to_role']} | "
                     f"{f['reason']} |")
    last = (pl.get("decisions") or [None])[0]
    lines += ["", "Its last decision: " + ("none" if last is None else
                                           f"{last['action']}: {last['reason']}"), ""]
    if runs[-1].get("metrics"):
        lines += ["Its metrics at the end:", "", "```", *runs[-1]["metrics"], "```", ""]
    return lines


def plot(data: dict[str, Any], args: argparse.Namespace, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    span = span_s(args, [0, 1])
    for run in (r for r in data["whole"] if r["round"] == 0):
        tr = run["runs"]["trace"]
        tl = [s for s in tr["timeline"] if "pools" in s]
        ax[0].step([s["t"] for s in tl], [s["pools"].get("context", 0) for s in tl],
                   where="post", label=run["name"])
        w = windows(records_of(tr), span, args.window, args.window / 4)
        for i, key in ((1, "ttft_p90"), (2, "tpot_p90")):
            ax[i].plot([x["t"] for x in w], [x[key] if x[key] is not None else np.nan
                                             for x in w], label=run["name"])
    ax[0].set_ylabel("context workers")
    ax[1].set_ylabel("TTFT p90 (ms)")
    ax[2].set_ylabel("TPOT p90 (ms)")
    ax[1].axhline(args.ttft_slo, color="grey", ls=":", label="SLO")
    ax[2].axhline(args.tpot_slo, color="grey", ls=":", label="SLO")
    for a in ax:
        a.axvline(args.phase_s, color="black", lw=0.8)
        a.grid(alpha=0.3)
    ax[2].set_xlim(0, span * 1.1)  # the trace (the timeline goes on while the last answers drain)
    ax[1].set_yscale("log")
    ax[2].set_yscale("log")
    ax[2].set_xlabel(f"trace time (s); phase 2 from {args.phase_s:.0f} s; windows of "
                     f"{args.window:.0f} s by send time")
    ax[0].legend(fontsize=8)
    fig.suptitle("planner vs static splits: role counts, TTFT p90, TPOT p90")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ----------------------------------------------------------------------------- main


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.planner",
                                 description=__doc__.split("\n\n")[0])
    a = ap.add_argument
    a("--out", default="bench/results/planner.md")
    a("--json", default=None, help="also write everything measured (every request) here")
    a("--workers", type=int, default=4)
    a("--device-cores", type=float, default=0.4, help="CPU quota of each worker (cores)")
    a("--phase-s", type=float, default=60.0, help="seconds of each of the two phases")
    a("--rate1", type=float, default=8.0)
    a("--isl1", type=int, default=640)
    a("--osl1", type=int, default=4)
    a("--rate2", type=float, default=4.5)
    a("--isl2", type=int, default=32)
    a("--osl2", type=int, default=128)
    a("--ttft-slo", type=float, default=1000.0, help="ms")
    a("--tpot-slo", type=float, default=60.0, help="ms")
    a("--interval", type=float, default=1.0, help="planner interval_s")
    a("--hysteresis", type=float, default=8.0, help="planner hysteresis_s")
    a("--planner-window", type=float, default=8.0, help="planner window_s")
    a("--min-samples", type=int, default=10, help="planner min_samples")
    a("--max-batch-size", type=int, default=4)
    a("--max-num-tokens", type=int, default=256)
    a("--kv-cache-tokens", type=int, default=16384)
    a("--window", type=float, default=8.0, help="timeline window (s)")
    a("--repeats", type=int, default=1)
    a("--seed", type=int, default=0)
    a("--skip-static-choice", metavar="N1,N2", default=None,
      help="use these context-worker counts as the best static splits of phase 1 and 2 "
           "instead of measuring every split (the report says so)")
    args = ap.parse_args(argv)
    if not 2 <= args.workers <= 8:
        ap.error("--workers: 2 to 8")
    if args.device_cores <= 0 or args.phase_s <= 0:
        ap.error("--device-cores and --phase-s: must be > 0")
    return args


def medians(whole: Sequence[dict[str, Any]]) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for run in whole:
        by.setdefault("planner" if run["planner"] else run["name"], []).append(
            run["score"]["goodput"])
    return {k: float(np.median(v)) for k, v in by.items()}


def main(argv: Sequence[str] | None = None) -> int:
    from disagg.model.tiny import write_tiny_checkpoint

    args = _parse_args(argv)
    data: dict[str, Any] = {"date": datetime.datetime.now().astimezone().isoformat(),
                            "argv": list(sys.argv[1:] if argv is None else argv),
                            "load_before": list(os.getloadavg()), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="disagg-planner-bench-") as d:
        tmp = Path(d)
        model = write_tiny_checkpoint(str(tmp / "model"), seed=0, **SIZES)
        data["params"] = _params(model)
        trace = make_trace(load_bench_tokenizer(model), phases_of(args), args.seed)
        if args.skip_static_choice:
            n1, n2 = (int(x) for x in args.skip_static_choice.split(","))
            data["static"] = {"goodput": {}, "best": {"phase1": n1, "phase2": n2},
                              "given": True}
        else:
            data["static"] = choose_static(model, args, tmp, trace)
        whole = whole_trace(model, args, tmp, trace, data["static"]["best"])
    for run in whole:
        run["score"] = score(run, args)
    data["whole"] = whole
    data["medians"] = medians(whole)
    data["load_after"] = list(os.getloadavg())
    out = Path(args.out)
    png = str(out.with_suffix(".png"))
    plot(data, args, png)
    out.write_text(report(data, args, png))
    if args.json:  # every request's record: megabytes, so only on request
        Path(args.json).write_text(json.dumps(data, default=_json_default))
    print(f"wrote {out}, {png}" + (f", {args.json}" if args.json else ""))
    return 0


def _params(model: str) -> int:
    from safetensors import safe_open

    n = 0
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), "pt") as f:
                n += sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    return n


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
