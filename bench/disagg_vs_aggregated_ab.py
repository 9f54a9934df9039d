"""Disaggregated vs aggregated, alternated: both clusters up at once, every comparison repeated.

``python -m bench.disagg_vs_aggregated`` measures the disaggregated cluster, stops it, then
measures the aggregated one, once per rate. On this shared machine the speed drifts by 20% and more
over minutes, and a TPOT p99 of ~40 requests rests on its slowest one, so one pair of runs
minutes apart can put a ratio on either side of a target. This script removes both effects
from the two targets of issue #7:

- **Target 1** (at matched throughput, disaggregated TPOT p99 <= 1/2 of aggregated): both
  clusters run at once on the same two cores (disaggregated: context worker on core 0,
  generation worker on core 1; aggregated: one worker on each core; a router in front of each;
  the cluster not being measured is idle). Each repeat runs every rate on both clusters back
  to back, with the same prompts and the same arrival times, the order alternating, so the
  two runs of a pair are seconds apart. ``--repeats`` repeats with fresh prompts; the report
  gives the median and the range of each figure and of the per-pair ratio.
  The rates are fractions (``--rate-fracs``) of the disaggregated 1 + 1 cluster's rate-matched
  capacity, measured first in the same run (context rate under the TTFT SLO; generation sweep).
- **Target 2** (prediction within 10% of end to end) in open loop: each disaggregated run of
  the pairs against the rate-matched prediction at its rate (``predict_at_rate``: output
  tokens/s and mean TPOT), from the context rate and generation sweep of the same run. The
  generation sweep is ``rate-match --colocated``'s: every point alone and again beside the
  context worker serving its rate (the two workers share this machine's caches and memory
  bandwidth), and the report gives both predictions, each side alone and co-located.
- **Target 2** at the generation-bound point (prediction within 10% of end to end): the
  generation-only point at concurrency 1 (the prediction's input) and the end-to-end closed
  loop that verifies it (``RateMatcher.run_end_to_end``, as ``disagg bench rate-match
  --verify`` runs it) measured back to back, ``--gen-repeats`` times: a gap that stays when
  both halves are seconds apart is the method's, not the machine's drift. Predicted from the
  point alone and co-located (``predict_cluster`` at the 1 + 1's own context load).

- The PNG (issue #7's picture): tokens/s per device against tokens/s/user, the rate-matched
  frontier (co-located and alone), one aggregated worker's closed-loop sweep (the baseline),
  the open-loop runs of both systems and the generation-bound checks.

    python -m bench.disagg_vs_aggregated_ab [--out bench/results/disagg-vs-aggregated.md]

Every step goes through the same quiet-machine guard as the main script. Writes the markdown,
the PNG beside it and the JSON of everything measured.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import disagg_vs_aggregated as dva
from disagg.bench.client import make_transport
from disagg.bench.datasets import load_bench_tokenizer, sample_random
from disagg.bench.plot import plot_rate_match
from disagg.bench.ratematch import (
    RateMatchConfig,
    RateMatcher,
    build_result,
    describe_arrivals,
    finish_verify_point,
    gap,
    predict_at_rate,
    predict_cluster,
    save_result,
)
from disagg.bench.runner import BenchmarkConfig, run_benchmark
from disagg.procs import free_ports

NAME = dva.NAME


def spread(xs: list[float]) -> dict[str, float]:
    """Median and range of a small sample."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def fmt_spread(s: dict[str, float], fmt: str = ".1f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


async def pair(guard: dva.Guard, urls: dict[str, str], order: list[str], rate: float,
               samples: Any, seed: int, args: argparse.Namespace, tr: Any
               ) -> dict[str, dict[str, Any]]:
    """One Poisson run of each system at ``rate`` in ``order``: same prompts, same arrivals."""
    slos = {"ttft": args.ttft_slo, "tpot": args.tpot_slo}
    out = {}
    for system in order:
        cfg = BenchmarkConfig(base_url=urls[system], model=NAME, request_rate=rate,
                              ignore_eos=True, goodput_slos_ms=slos,
                              percentiles=(50.0, 90.0, 99.0), seed=seed, exact_rate=True)

        async def one(cfg: BenchmarkConfig = cfg) -> dict[str, Any]:
            res = await run_benchmark(cfg, samples, transport=tr)
            # Per-request TPOTs too: the report pools them over the pairs of a rate.
            return {**res.summary, "tpots_ms": [1000.0 * r.tpot for r in res.records
                                                if r.success and r.tpot is not None]}

        s = await guard.run(f"{system} {rate:.3f} req/s", one)
        print(f"  {system:>14} {rate:.3f} req/s: TPOT p99 {s['p99_tpot_ms']:.1f} ms, mean "
              f"{s['mean_tpot_ms']:.1f} ms, TTFT p99 {s['p99_ttft_ms']:.0f} ms, goodput "
              f"{s['request_goodput']:.3f} req/s, {s['failed']} failed", flush=True)
        out[system] = s
    return out


async def _sweeps(args: argparse.Namespace, guard: dva.Guard, m: RateMatcher
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], float, list[float],
                             list[float]]:
    """The rate-match sweeps and the 1 + 1 capacity: (context, generation, aggregated,
    capacity, rate fractions, rates)."""
    ctx = await guard.run("context sweep", m.sweep_context)
    if ctx["ctx_rate"] is None:
        raise RuntimeError("no context rate met the TTFT SLO; raise --ttft-slo")
    # Alone, then beside the context worker at its rate (rate-match --colocated).
    gen = await guard.run("generation sweep",
                          lambda: m.sweep_generation(ctx["ctx_rate"]))
    agg = await guard.run("aggregated baseline (one worker)", m.sweep_aggregated)
    cap = predict_at_rate(ctx["ctx_rate"], gen["points"], args.osl, 1, 1,
                          1e9, generation=gen)["capacity_request_rate"]
    fracs = [float(x) for x in args.rate_fracs.split(",")]
    rates = [f * cap for f in fracs]
    print(f"1+1 rate-matched capacity {cap:.3f} req/s; rates "
          f"{', '.join(f'{r:.3f}' for r in rates)}", flush=True)
    return ctx, gen, agg, cap, fracs, rates


async def _warm(args: argparse.Namespace, tok: Any, urls: dict[str, str], tr: Any) -> None:
    """Warm both clusters' routes once (first requests are slow: allocator, KV pages)."""
    warm = sample_random(tok, 2, args.isl, args.osl, seed=args.seed + 999,
                         as_token_ids=True)
    for system in ("disaggregated", "aggregated"):
        await run_benchmark(BenchmarkConfig(base_url=urls[system], model=NAME,
                                            ignore_eos=True, max_concurrency=1),
                            warm, transport=tr)


async def _alternated_pairs(args: argparse.Namespace, guard: dva.Guard, tok: Any,
                            urls: dict[str, str], fracs: list[float], rates: list[float],
                            tr: Any) -> list[dict[str, Any]]:
    """Target 1: at every rate, ``--repeats`` pairs, the first system alternating."""
    pairs = []
    for rep in range(args.repeats):
        for i, (frac, rate) in enumerate(zip(fracs, rates, strict=True)):
            n = max(args.min_prompts, round(rate * args.run_seconds))
            seed = args.seed + 1000 * (rep + 1) + i
            samples = sample_random(tok, n, args.isl, args.osl, seed=seed,
                                    as_token_ids=True)
            order = (["disaggregated", "aggregated"] if (rep + i) % 2 == 0
                     else ["aggregated", "disaggregated"])
            print(f"repeat {rep + 1}/{args.repeats}, {rate:.3f} req/s x {n} "
                  f"({order[0]} first)", flush=True)
            res = await pair(guard, urls, order, rate, samples, seed, args, tr)
            pairs.append({"repeat": rep, "frac": frac, "rate": rate, "num_requests": n,
                          "order": order, **res})
    return pairs


async def _gen_only_points(guard: dva.Guard, mc: RateMatcher, ctx_rate: float, when: str,
                           rep: int) -> dict[str, dict[str, Any]]:
    """Concurrency 1 alone and beside the context worker at its rate."""
    return {
        "alone": await guard.run(
            f"generation-only concurrency 1 {when} (check {rep + 1})",
            lambda: mc.generation_point(1, label="generation-only")),
        "beside": await guard.run(
            f"generation-only concurrency 1 beside context {when} (check {rep + 1})",
            lambda: mc.generation_point(1, ctx_rate, label="generation-only"))}


def _check_predictions(args: argparse.Namespace, ctx_rate: float,
                       before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
                       e2e: dict[str, Any]) -> dict[str, Any]:
    """One generation-bound check: the mean of the generation-only points before and after,
    and the end-to-end run against its two predictions (alone; co-located)."""
    mean = {side: {"concurrency": 1, "completed": 1,
                   **{k: (before[side][k] + after[side][k]) / 2
                      for k in ("output_throughput", "mean_tpot_ms")}}
            for side in ("alone", "beside")}
    for pt in mean.values():
        pt["tokens_per_s_per_user"] = 1000.0 / pt["mean_tpot_ms"]
    v: dict[str, Any] = {"gen_only": {"before": before, "after": after, "mean": mean}}
    # Two predictions of the same end-to-end run: from the generation side measured
    # alone, and co-located (rate-match --colocated: at the 1 + 1's own context load).
    generation = {"points": [mean["alone"]], "colocated": {
        "context_load": ctx_rate, "points": [mean["beside"]]}}
    for how, gen_block in (("alone", None), ("colocated", generation)):
        pred = predict_cluster(ctx_rate, mean["alone"], [mean["alone"]], args.osl, 1,
                               1, generation=gen_block)
        choice = {"concurrency_per_gen": 1, "num_ctx": 1, "num_gen": 1,
                  "devices": pred.pop("devices"), "concurrency": 1, "predicted": pred}
        v[how] = finish_verify_point(choice, e2e)
        print(f"  gap ({how}): tok/s per device "
              f"{dva.pct(v[how]['gap_tput_per_device'])}, tok/s/user "
              f"{dva.pct(v[how]['gap_tokens_per_s_per_user'])}", flush=True)
    return v


async def _generation_bound_checks(args: argparse.Namespace, guard: dva.Guard,
                                   cfg: RateMatchConfig, tok: Any, urls: dict[str, str],
                                   ctx_rate: float, tr: Any) -> list[dict[str, Any]]:
    """Target 2: the generation-bound point, prediction and verify back to back."""
    # Its own matcher: longer loops than the sweep's (--check-rounds), same settings.
    mc = RateMatcher(replace(cfg, gen_rounds=args.check_rounds, seed=args.seed + 77), tok,
                     tr)
    gen_checks = []
    for rep in range(args.gen_repeats):
        # The generation-only points before and after the end-to-end loops: their mean is
        # the prediction's input, so a drift of the machine during the check cancels to
        # first order (both halves are in the table).
        before = await _gen_only_points(guard, mc, ctx_rate, "before", rep)
        pred = predict_cluster(ctx_rate, before["alone"], [before["alone"]], args.osl, 1, 1)
        if pred["bound"] != "generation":
            print(f"  concurrency 1 is {pred['bound']}-bound here: no generation-bound "
                  "check", flush=True)
            break
        e2e = await guard.run(
            f"end to end, generation-bound (check {rep + 1})",
            lambda pred=pred: mc.run_end_to_end(urls["disaggregated"], 1,
                                                pred["request_rate"], "closed"))
        after = await _gen_only_points(guard, mc, ctx_rate, "after", rep)
        gen_checks.append(_check_predictions(args, ctx_rate, before, after, e2e))
    return gen_checks


async def measure(args: argparse.Namespace, guard: dva.Guard, tok: Any,
                  urls: dict[str, str]) -> dict[str, Any]:
    tr = make_transport("auto", 3600)
    try:
        cfg = RateMatchConfig(context_url=urls["ctx"], generation_url=urls["gen"],
                              ttft_slo_ms=args.ttft_slo, isl=args.isl, osl=args.osl,
                              concurrencies=(1, 2, 4, 8, 16), model=NAME,
                              ttft_percentile=args.ttft_percentile,
                              ctx_probe_seconds=args.ctx_probe_seconds,
                              ctx_max_probes=args.ctx_max_probes, gen_rounds=args.gen_rounds,
                              colocated=True, aggregated_url=urls["agg0"], seed=args.seed)
        m = RateMatcher(cfg, tok, tr)
        ctx, gen, agg, cap, fracs, rates = await _sweeps(args, guard, m)
        await _warm(args, tok, urls, tr)
        pairs = await _alternated_pairs(args, guard, tok, urls, fracs, rates, tr)
        gen_checks = await _generation_bound_checks(args, guard, cfg, tok, urls,
                                                    ctx["ctx_rate"], tr)
        return {"context": ctx, "generation": gen, "aggregated": agg, "capacity": cap,
                "rates": rates, "fracs": fracs, "pairs": pairs, "gen_checks": gen_checks,
                "config": asdict(cfg)}
    finally:
        await tr.aclose()


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rate: medians and ranges over the repeats, and the per-pair TPOT p99 ratios."""
    rows = []
    for frac, rate in zip(data["fracs"], data["rates"], strict=True):
        ps = [p for p in data["pairs"] if p["frac"] == frac]
        d = [p["disaggregated"] for p in ps]
        a = [p["aggregated"] for p in ps]
        ratios = [x["p99_tpot_ms"] / y["p99_tpot_ms"] for x, y in zip(d, a, strict=True)]
        rows.append({
            "frac": frac, "rate": rate, "pairs": len(ps),
            "ratio": spread(ratios),
            "pooled": {name: float(np.percentile([t for x in ss for t in x["tpots_ms"]], 99))
                       for name, ss in (("dis", d), ("agg", a))},
            "pooled_n": sum(len(x["tpots_ms"]) for x in d),
            "ratios": ratios,
            **{f"{k}_{name}": spread([s[k] for s in ss])
               for name, ss in (("dis", d), ("agg", a))
               for k in ("p99_tpot_ms", "mean_tpot_ms", "p99_ttft_ms", "request_goodput")},
            "failed": sum(s["failed"] for s in d + a),
        })
    return rows


def open_loop_predictions(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rate: the rate-matched predictions (each side measured alone; co-located) against
    the disaggregated runs' figures."""
    osl = data["args"]["osl"]
    ctx_rate, gen = data["context"]["ctx_rate"], data["generation"]
    out = []
    for frac, rate in zip(data["fracs"], data["rates"], strict=True):
        runs = [p["disaggregated"] for p in data["pairs"] if p["frac"] == frac]
        tps = spread([s["steady_output_throughput"] or s["output_throughput"] for s in runs])
        tpot = spread([s["mean_tpot_ms"] for s in runs])
        row: dict[str, Any] = {"frac": frac, "rate": rate, "tps": tps, "tpot": tpot}
        for how, block in (("alone", None), ("colocated", gen)):
            pred = predict_at_rate(ctx_rate, gen["points"], osl, 1, 1, rate, generation=block)
            row[how] = {"tps": pred["output_throughput"], "tpot": pred["mean_tpot_ms"],
                        "gap_tps": gap(tps["median"], pred["output_throughput"]),
                        "gap_tpot": gap(tpot["median"], pred["mean_tpot_ms"])}
        out.append(row)
    return out


def plot(data: dict[str, Any], png: str) -> str:
    """tokens/s per device against tokens/s/user: the rate-matched curve (co-located, and each
    side alone), one aggregated worker's baseline, the open-loop runs of both systems (medians
    over the pairs) and the generation-bound checks against their co-located prediction."""
    cfg = RateMatchConfig(**{k: (tuple(v) if isinstance(v, list) else v)
                             for k, v in data["config"].items()})
    rm = build_result(cfg, NAME, data["context"], data["generation"], data.get("aggregated"))
    rm["verify"] = [v["colocated"] for v in data["gen_checks"]]
    series = []
    for system, devices in (("disaggregated", 2), ("aggregated", 2)):
        pts = []
        for frac in data["fracs"]:
            runs = [p[system] for p in data["pairs"] if p["frac"] == frac]
            pts.append((1000.0 / statistics.median(s["mean_tpot_ms"] for s in runs),
                        statistics.median(s["steady_output_throughput"]
                                          or s["output_throughput"] for s in runs) / devices))
        series.append((f"{system}, end to end, open loop (1 + 1 / 2 workers, median)", pts))
    return plot_rate_match(rm, png, extra_series=series, title=(
        f"1 context + 1 generation vs 2 aggregated workers, 2 CPU cores (isl {cfg.isl}, osl "
        f"{cfg.osl}, TTFT p{cfg.ttft_percentile:g} <= {cfg.ttft_slo_ms:g} ms)"))


def _report_header(data: dict[str, Any], args: argparse.Namespace,
                   rewritten: str | None) -> list[str]:
    """Title, machine, workload, SLOs, the idle cluster's CPU and the quiet-machine guard."""
    L = [f"# Disaggregated vs aggregated, alternated pairs ({data['date'][:10]})", "",
         f"Produced by `{data['command']}`; every number below is the script's own output.",
         ""]
    if rewritten:
        L += [f"Report text and PNG rewritten from the saved JSON on {rewritten} "
              "(`--from-json`); the measurements are those of the original run.", ""]
    L += [f"- {line}" for line in dva.machine()]
    L.append(f"- model: random llama {dva.SIZES}, {data['params_m']:.1f} M parameters, "
             "float32, one torch thread per worker")
    L.append(f"- workload: prompts of {args.isl} random token ids (fresh for every pair: no "
             f"prefix-cache hits), {args.osl} output tokens (ignore_eos), streamed "
             "`/v1/completions`, Poisson arrivals scaled to the exact rate")
    L.append("- both clusters up at once on the same two cores: disaggregated (context worker "
             "on core 0, generation worker on core 1, KV over TCP, router) and aggregated (one "
             "worker on each core, router with `load_balancing`); the cluster not being "
             f"measured is idle. Every worker: `--max-num-tokens {args.max_num_tokens}`, "
             "`--kv-cache-tokens 32768`")
    L.append(f"- SLOs: TTFT p{args.ttft_percentile:g} <= {args.ttft_slo:g} ms for the context "
             f"rate; goodput counts requests with TTFT <= {args.ttft_slo:g} ms and TPOT <= "
             f"{args.tpot_slo:g} ms")
    idle = data["idle_cpu"]
    L.append(f"- idle cluster's CPU while idle, measured over {idle['wall_s']:.0f} s before "
             f"the runs: {100 * idle['cores']:.1f}% of one core (all six processes)")
    steps = data["steps"]
    redone = sum(1 for s in steps if not s["kept"])
    others = [s["other_cores"] for s in steps if s["kept"]]
    L.append(f"- quiet-machine guard (as in the main script): steps redone {redone}; other "
             f"processes' CPU during the kept steps at most {max(others):.2f} cores")
    L.append("")
    return L


def _report_capacity(data: dict[str, Any], args: argparse.Namespace, png: str) -> list[str]:
    """Section 1: the 1 + 1 capacity and the generation side alone and co-located."""
    ctx = data["context"]
    L: list[str] = []
    L.append("## 1. The 1 + 1 cluster's rate-matched capacity (this run)")
    L.append("")
    L.append(f"Context worker: **{ctx['ctx_rate']:.3f} req/s** within TTFT "
             f"p{args.ttft_percentile:g} <= {args.ttft_slo:g} ms; generation-only at "
             + ", ".join(f"concurrency {p['concurrency']}: {p['request_rate']:.2f} req/s"
                         for p in data["generation"]["points"])
             + f". Capacity of 1 context + 1 generation worker: **{data['capacity']:.3f} "
             "req/s** (the slower side); the rates below are fractions of it, and 1.0 is the "
             "matched throughput itself.")
    L.append("")
    L.append("The generation side measured twice (`disagg bench rate-match --colocated`): "
             "alone, and beside the context worker serving Poisson arrivals at its rate "
             f"({ctx['ctx_rate']:.3f} req/s, ordinary `max_tokens: 1` requests), since the two "
             "workers share this machine's caches and memory bandwidth:")
    L.append("")
    L.append("| concurrency | tok/s/user alone | beside the context worker | TPOT change | "
             "gen tok/s alone | beside | context load served req/s |")
    L.append("|---|---|---|---|---|---|---|")
    beside = {q["concurrency"]: q for q in data["generation"]["colocated"]["points"]}
    for pt in data["generation"]["points"]:
        q = beside[pt["concurrency"]]
        served = q["context"]["served_rate"]
        L.append(f"| {pt['concurrency']} | {pt['tokens_per_s_per_user']:.1f} | "
                 f"{q['tokens_per_s_per_user']:.1f} | "
                 f"{dva.pct(gap(q['mean_tpot_ms'], pt['mean_tpot_ms']))} | "
                 f"{pt['output_throughput']:.1f} | {q['output_throughput']:.1f} | "
                 f"{'?' if served is None else f'{served:.2f}'} |")
    L.append("")
    L.append(f"![tokens/s per device against tokens/s/user]({os.path.basename(png)})")
    L.append("")
    L.append("The PNG: the rate-matched frontier from the co-located points (solid) and from "
             "each side alone (dashed), one aggregated worker's closed-loop sweep (the "
             "baseline, per device), the open-loop runs of section 2 for both systems "
             "(medians, per device: 2 workers each), and the generation-bound checks of "
             "section 4 (stars) joined to their co-located predictions.")
    L.append("")
    return L


def _report_pairs(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Section 2: TPOT p99 of the alternated pairs, and target 1."""
    L: list[str] = []
    L.append(f"## 2. TPOT p99, {args.repeats} alternated pairs per rate")
    L.append("")
    L.append("Median (min-max) over the pairs. Ratio: disaggregated / aggregated TPOT p99 "
             "within each pair (seconds apart, same prompts and arrival times), then its "
             "median over the pairs. Pooled: the p99 of every request's TPOT over all the "
             "pairs of a rate together (the per-pair p99 of a few dozen requests rests on "
             "its slowest one or two).")
    L.append("")
    L.append("| fraction | req/s | TPOT p99 ms disaggregated | aggregated | ratio | per pair | "
             "pooled TPOT p99 ms dis / agg (ratio) | mean TPOT ms dis / agg | TTFT p99 ms "
             "dis / agg | goodput req/s dis / agg | failed |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        L.append(
            f"| {r['frac']:g} | {r['rate']:.3f} | {fmt_spread(r['p99_tpot_ms_dis'])} | "
            f"{fmt_spread(r['p99_tpot_ms_agg'])} | **{r['ratio']['median']:.2f}** "
            f"({r['ratio']['min']:.2f}-{r['ratio']['max']:.2f}) | "
            f"{', '.join(f'{x:.2f}' for x in r['ratios'])} | "
            f"{r['pooled']['dis']:.1f} / {r['pooled']['agg']:.1f} "
            f"({r['pooled']['dis'] / r['pooled']['agg']:.2f}) | "
            f"{r['mean_tpot_ms_dis']['median']:.1f} / {r['mean_tpot_ms_agg']['median']:.1f} | "
            f"{r['p99_ttft_ms_dis']['median']:.0f} / {r['p99_ttft_ms_agg']['median']:.0f} | "
            f"{r['request_goodput_dis']['median']:.3f} / "
            f"{r['request_goodput_agg']['median']:.3f} | {r['failed']} |")
    L.append("")
    matched = [r for r in rows if r["frac"] >= 0.9]
    met = ", ".join(f"{r['frac']:g}" for r in rows if r["ratio"]["median"] <= 0.5)
    at_matched = ", ".join(f"{r['frac']:g}: {r['ratio']['median']:.2f}" for r in matched)
    all_fracs = ", ".join(f"{r['frac']:g}" for r in rows)
    L.append("Target 1 (TPOT p99 disaggregated <= 1/2 aggregated): median ratio <= 0.5 at "
             f"{met or 'none'} of the fractions {all_fracs}"
             + (f"; near the matched throughput ({at_matched})" if matched else "") + ".")
    L.append("")
    return L


def _report_open_loop(ol: list[dict[str, Any]]) -> list[str]:
    """Section 3: each open-loop run against its rate-matched prediction."""
    L: list[str] = []
    L.append("## 3. The rate-matched prediction of each open-loop run (disaggregated)")
    L.append("")
    L.append("From this run's context rate and generation sweep (`ratematch.predict_at_rate`: "
             "output tokens/s = rate x osl within the capacity; mean TPOT from "
             "`open_loop_tpot`, the generation-only TPOT averaged over the Poisson number of "
             "requests sharing the generation worker), against the disaggregated runs of "
             "section 2: median (min-max) over the pairs, gap of the median. Alone: the "
             "generation points measured alone. Co-located: the points at this rate's context "
             "load, linear between alone and beside the context worker at its rate "
             "(`ratematch.gen_points_beside`). Output tokens/s is the steady state's (first "
             "completion to last send).")
    L.append("")
    L.append("| fraction | req/s | predicted tok/s | measured | gap | mean TPOT ms measured | "
             "predicted alone | gap | predicted co-located | gap |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in ol:
        a, c = r["alone"], r["colocated"]
        L.append(f"| {r['frac']:g} | {r['rate']:.3f} | {c['tps']:.1f} | "
                 f"{fmt_spread(r['tps'])} | {dva.pct(c['gap_tps'])} | "
                 f"{fmt_spread(r['tpot'], '.2f')} | {a['tpot']:.2f} | "
                 f"{dva.pct(a['gap_tpot'])} | {c['tpot']:.2f} | {dva.pct(c['gap_tpot'])} |")
    L.append("")
    return L


def _report_checks(checks: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Section 4: the back-to-back generation-bound checks."""
    L: list[str] = []
    L.append(f"## 4. The generation-bound prediction, {len(checks)} back-to-back checks")
    L.append("")
    if checks:
        L.append("Each check measures the generation-only point at concurrency 1 (alone, and "
                 "beside the context worker at its rate), then the end-to-end closed loops "
                 "`disagg bench rate-match --verify` runs for it "
                 "(`RateMatcher.run_end_to_end`), then the generation-only points again. The "
                 "prediction for 1 + 1 (generation-bound: the generation rate x osl / 2 "
                 "devices, at its tokens/s/user) takes the mean of the before and after "
                 "points, so a drift of the machine during the check cancels to first order. "
                 "Alone: from the point measured alone. Co-located: at the 1 + 1's own context "
                 "load, the generation rate it serves (`predict_cluster` with the co-located "
                 f"points). Loops of {args.check_rounds} requests per in-flight slot.")
        L.append("")
        L.append("| check | gen-only tok/s/user alone (before / after) | beside | measured "
                 "tok/s per device | predicted alone | gap | co-located | gap | measured "
                 "tok/s/user | predicted alone | gap | co-located | gap | arrivals |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for i, v in enumerate(checks):
            a, c, g = v["alone"], v["colocated"], v["gen_only"]
            me = a["measured"]
            L.append(
                f"| {i + 1} | {g['before']['alone']['tokens_per_s_per_user']:.1f} / "
                f"{g['after']['alone']['tokens_per_s_per_user']:.1f} | "
                f"{g['before']['beside']['tokens_per_s_per_user']:.1f} / "
                f"{g['after']['beside']['tokens_per_s_per_user']:.1f} | "
                f"{me['tput_per_device']:.1f} | {a['predicted']['tput_per_device']:.1f} | "
                f"{dva.pct(a['gap_tput_per_device'])} | "
                f"{c['predicted']['tput_per_device']:.1f} | "
                f"{dva.pct(c['gap_tput_per_device'])} | {me['tokens_per_s_per_user']:.1f} | "
                f"{a['predicted']['tokens_per_s_per_user']:.1f} | "
                f"{dva.pct(a['gap_tokens_per_s_per_user'])} | "
                f"{c['predicted']['tokens_per_s_per_user']:.1f} | "
                f"{dva.pct(c['gap_tokens_per_s_per_user'])} | {describe_arrivals(me)} |")
        L.append("")
        for how, name in (("alone", "alone"), ("colocated", "co-located")):
            g1 = spread([v[how]["gap_tput_per_device"] for v in checks])
            g2 = spread([v[how]["gap_tokens_per_s_per_user"] for v in checks])
            L.append(f"Median gap, predicted {name}: tok/s per device "
                     f"{dva.pct(g1['median'])} ({dva.pct(g1['min'])} to "
                     f"{dva.pct(g1['max'])}), tok/s/user {dva.pct(g2['median'])} "
                     f"({dva.pct(g2['min'])} to {dva.pct(g2['max'])}).")
            L.append("")
    else:
        L.append("Concurrency 1 was not generation-bound in this run: no check.")
        L.append("")
    return L


def report(data: dict[str, Any], png: str, rewritten: str | None = None) -> str:
    """The markdown; ``png``: the picture's file name beside it; ``rewritten``: the date of a
    ``--from-json`` rewrite."""
    args = argparse.Namespace(**data["args"])
    rows = summarize(data)
    ol = open_loop_predictions(data)
    checks = data["gen_checks"]
    L = _report_header(data, args, rewritten)
    L += _report_capacity(data, args, png)
    L += _report_pairs(rows, args)
    L += _report_open_loop(ol)
    L += _report_checks(checks, args)
    L += targets(rows, ol, checks)
    return "\n".join(L)


def targets(rows: list[dict[str, Any]], ol: list[dict[str, Any]],
            checks: list[dict[str, Any]]) -> list[str]:
    """Issue #7's two targets, judged from the sections above."""
    def within(xs: list[float]) -> str:
        n = sum(1 for x in xs if abs(x) <= 0.10)
        return f"{n} of {len(xs)} within 10% ({', '.join(dva.pct(x) for x in xs)})"

    top = max(rows, key=lambda r: r["frac"])
    L = ["## Targets", ""]
    L.append(f"1. At matched throughput (fraction {top['frac']:g}, {top['rate']:.3f} req/s), "
             f"disaggregated TPOT p99 <= 1/2 of aggregated: median ratio "
             f"**{top['ratio']['median']:.2f}** (pairs "
             f"{', '.join(f'{x:.2f}' for x in top['ratios'])}; "
             f"pooled {top['pooled']['dis'] / top['pooled']['agg']:.2f}): "
             f"**{'met' if top['ratio']['median'] <= 0.5 else 'not met'}**. At every rate: "
             + ", ".join(f"{r['frac']:g}: {r['ratio']['median']:.2f}" for r in rows) + ".")
    L.append("2. Rate-matched prediction within 10% of end to end:")
    L.append(f"   - open-loop output tok/s: {within([r['colocated']['gap_tps'] for r in ol])}")
    for how, name in (("colocated", "co-located"), ("alone", "each side alone")):
        L.append(f"   - open-loop mean TPOT, predicted {name}: "
                 f"{within([r[how]['gap_tpot'] for r in ol])}")
        if checks:
            L.append(f"   - generation-bound checks, predicted {name}: tok/s per device "
                     f"{within([v[how]['gap_tput_per_device'] for v in checks])}; tok/s/user "
                     f"{within([v[how]['gap_tokens_per_s_per_user'] for v in checks])}")
    L.append("")
    return L


def idle_cpu(procs: list[dva.Proc], seconds: float) -> dict[str, float]:
    import time

    c0 = sum(p.cpu_s() for p in procs)
    t0 = time.monotonic()
    time.sleep(seconds)  # a measurement window, not a wait for an event
    wall = time.monotonic() - t0
    return {"wall_s": wall, "cores": (sum(p.cpu_s() for p in procs) - c0) / wall}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.disagg_vs_aggregated_ab",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(dva.ROOT / "bench/results/disagg-vs-aggregated.md"))
    ap.add_argument("--json", default=None, help="default: --out with .json")
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--max-num-tokens", type=int, default=1024)
    ap.add_argument("--ttft-slo", type=float, default=2000.0, help="ms")
    ap.add_argument("--ttft-percentile", type=float, default=90.0)
    ap.add_argument("--tpot-slo", type=float, default=100.0, help="ms, goodput only")
    ap.add_argument("--rate-fracs", default="0.3,0.5,0.7,0.9,1.0",
                    help="fractions of the 1 + 1 cluster's rate-matched capacity")
    ap.add_argument("--repeats", type=int, default=3, help="pairs per rate")
    ap.add_argument("--gen-repeats", type=int, default=6,
                    help="back-to-back checks of the generation-bound prediction")
    ap.add_argument("--check-rounds", type=int, default=16,
                    help="requests per in-flight slot in each loop of a check")
    ap.add_argument("--run-seconds", type=float, default=40.0)
    ap.add_argument("--min-prompts", type=int, default=30)
    ap.add_argument("--ctx-probe-seconds", type=float, default=20.0)
    ap.add_argument("--ctx-max-probes", type=int, default=7)
    ap.add_argument("--gen-rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait-quiet", type=float, default=600.0, metavar="S")
    ap.add_argument("--max-other", type=float, default=0.25, metavar="CORES")
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--from-json", default=None, metavar="JSON",
                    help="rewrite the markdown from a saved result JSON")
    return ap


def main() -> int:
    ap = _parser()
    args = ap.parse_args()
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        md = os.path.splitext(args.from_json)[0] + ".md"
        png = plot(data, os.path.splitext(md)[0] + ".png")
        now = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
        Path(md).write_text(report(data, png, rewritten=now))
        print(f"rewrote {md} from {args.from_json}")
        return 0
    if args.repeats < 1 or args.gen_repeats < 0:
        ap.error("--repeats must be >= 1 and --gen-repeats >= 0")
    json_path = args.json or os.path.splitext(args.out)[0] + ".json"

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the `finally` that stops the workers

    signal.signal(signal.SIGTERM, on_sigterm)
    from disagg.model.tiny import write_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="disagg-vs-agg-ab-"))
    model = write_tiny_checkpoint(str(tmp / "model"), seed=0, **dva.SIZES)
    from safetensors import safe_open

    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        params = sum(dva.numel(f.get_slice(k).get_shape()) for k in f.keys())
    tok = load_bench_tokenizer(model)
    print(f"model {model} ({params / 1e6:.1f} M parameters); logs in {tmp}", flush=True)
    data: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.disagg_vs_aggregated_ab", *sys.argv[1:]]),
        "params_m": params / 1e6, "args": vars(args), "steps": []}
    guard = dva.Guard(data["steps"], args.wait_quiet, args.max_other, args.attempts)
    mnt = args.max_num_tokens
    p = free_ports(6)
    procs = [dva.start_worker(model, "context worker", "context", 0, p[0], tmp, mnt),
             dva.start_worker(model, "generation worker", "generation", 1, p[1], tmp, mnt,
                              "--benchmark-gen-only"),
             dva.start_worker(model, "aggregated worker 0", "aggregated", 0, p[2], tmp, mnt),
             dva.start_worker(model, "aggregated worker 1", "aggregated", 1, p[3], tmp, mnt)]
    ctx, gen, a0, a1 = procs
    try:
        dva.wait_healthy(procs)
        lb = {"type": "load_balancing"}
        procs.append(dva.start_router({
            "context_servers": {"num_instances": 1, "urls": [ctx.url[7:]], "router": lb},
            "generation_servers": {"num_instances": 1, "urls": [gen.url[7:]], "router": lb}},
            p[4], tmp, "router (disaggregated)"))
        procs.append(dva.start_router({"generation_servers": {
            "num_instances": 2, "urls": [a0.url[7:], a1.url[7:]], "router": lb}},
            p[5], tmp, "router (aggregated)"))
        dva.wait_healthy(procs[4:])
        guard.procs = procs
        data["idle_cpu"] = idle_cpu(procs, 10.0)
        urls = {"ctx": ctx.url, "gen": gen.url, "agg0": a0.url,
                "disaggregated": procs[4].url, "aggregated": procs[5].url}
        data.update(asyncio.run(measure(args, guard, tok, urls)))
    finally:
        dva.stop(procs)
    save_result(data, json_path)
    png = plot(data, os.path.splitext(args.out)[0] + ".png")
    text = report(data, png)
    Path(args.out).write_text(text)
    print(text)
    print(f"wrote {args.out}, {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
