"""``disagg bench rate-match``: size a disaggregated cluster from one context and one generation
worker (REFERENCE section 7, rate matching).

What is measured
----------------
Every request uses token-id prompts of exactly ``isl`` tokens (random ids, fresh for every run
so that prefix caching never helps) on ``/v1/completions``, streamed.

1. **Context side** (``--context-url``, one context worker, or any worker: the requests are
   ordinary ones). Requests with ``max_tokens: 1`` arrive as a Poisson process (seeded, its
   gaps scaled so the probe's realized rate is exactly ``r``: ``arrival_offsets(exact_rate)``).
   A probe at rate ``r`` passes when no request failed and the TTFT at ``--ttft-percentile``
   (default p90) is at most ``--ttft-slo``. The search doubles (or halves) the rate from a start
   until it brackets the limit, then bisects geometrically until ``hi / lo <= 1 + tolerance``
   or the probe budget is spent. A probe also records the rate the worker *served*: completed
   requests over the span from the first to the last completion. A short probe above the
   worker's capacity can still pass the SLO (its queue grows, but not yet past the SLO); its
   served rate is then the capacity, below the offered rate. ``ctx_rate`` = the highest
   ``min(offered, served)`` of the passing probes (requests/s per context worker). A probe sends
   ``max(min_prompts, rate * probe_seconds)`` requests. These are ordinary requests, so the
   context worker's cost of serving KV to generation workers (the transfer's sends) is not in
   this number; the end-to-end check (5) includes it.
2. **Generation side** (``--generation-url``, one generation worker started with
   ``--benchmark-gen-only``). For each concurrency ``c``: ``c * rounds`` generation-only requests
   (``disaggregated_params: {request_type: generation_only}``, ``ignore_eos``, ``max_tokens =
   osl``), at most ``c`` in flight. The worker takes the prompt's KV as already in place and only
   decodes. ``gen_output_tps`` = output tokens/s over the run; ``tokens_per_s_per_user`` =
   1000 / mean TPOT (ms), i.e. one over the mean time per output token;
   ``gen_request_rate`` = ``gen_output_tps / osl``.

   2b. **Co-located** (``--colocated``): context and generation workers on one machine (CPU
   cores of one host, a laptop) share its caches and memory bandwidth, so a decode step is
   slower while the neighbouring context worker prefills (10-16% on this project's 2-core
   machine with it prefilling 2 requests/s: ``bench/results/disagg-vs-aggregated.md``).
   Step 2 runs each side alone and leaves that out. With ``--colocated`` every concurrency is
   measured a second time while the context worker serves ordinary ``max_tokens: 1``
   requests as Poisson arrivals at ``ctx_rate`` (its own rate under the SLO, from 1), the load
   a context worker carries in a rate-matched cluster. A cluster whose context workers serve
   less (``load`` req/s each) gets points linear between the two measurements,
   ``isolated + (load / ctx_rate) * (colocated - isolated)`` for TPOT and output tokens/s
   (``gen_points_beside``): a context worker is busy a share of its time proportional to its
   request rate, and interferes only while busy. Every prediction below then uses the points
   at the context load of the cluster it predicts (the rate-matched curve: ``ctx_rate``;
   ``predict_cluster`` and ``predict_at_rate``: the cluster's rate per context worker, by
   fixed point, since that rate depends on the generation speed). Assumes one context worker
   beside each generation worker, as measured.
3. **Rate matching**, per concurrency: ``ctx_per_gen = gen_request_rate / ctx_rate`` context
   workers per generation worker make both sides' request rates equal, and

       tput_per_device = gen_output_tps / (ctx_devices * gen_request_rate / ctx_rate + gen_devices)

   The Pareto frontier keeps the points no other point beats on both tokens/s/user and
   tokens/s per device.
4. ``--aggregated-url``: the same workload (full requests: ``isl`` in, ``osl`` out) against one
   aggregated worker at each concurrency: the baseline. Its frontier uses only the points whose
   TTFT percentile meets the SLO (the disaggregated points meet it by construction).
5. ``--verify``: for frontier points, the integer cluster (``n_ctx`` context + ``n_gen``
   generation workers, within ``--verify-max-devices``) with the best predicted throughput per
   device is started with ``disagg launch`` on this machine and measured end to end with full
   requests through its router; the result gives the gap to the prediction for that same
   cluster (``predict_cluster``). Each prediction is checked under the arrivals its binding
   side was measured with:

   - *generation bound* (``arrivals: closed``): a closed loop that keeps ``n_gen * c``
     requests on the generation workers plus, by Little's law, ``predicted rate * unloaded
     TTFT`` more for the ones at the context side (queue, prefill, KV transfer): with only
     ``n_gen * c`` in flight the generation workers would hold fewer than ``c`` each. That
     count is fractional and a loop holds whole requests; at small counts rounding alone
     moves the load by tens of percent (1.5 -> 2 is +33%), so unless the count lies within
     0.1 of a whole number, two loops run, at the whole counts below and above it, and the
     result is linear between them (``interpolate_runs``; both runs are in the JSON).
     ``rounds * count`` requests per loop, at least 6 rounds.
   - *context bound* (``arrivals: poisson``): the cluster's rate is the context workers' rate
     under the TTFT SLO, which is a rate of Poisson arrivals; a closed loop would instead push
     the context workers to whatever TTFT its in-flight count forces (past the SLO, serving
     more than the prediction's rate, or, rounded down, less). So: Poisson arrivals at the
     predicted rate (exact-rate gaps), ``2 * probe_seconds`` of them, and the measured TTFT
     percentile against the SLO (``meets_ttft_slo``); the predicted speed is
     ``open_loop_tpot`` at each generation worker's share of the rate.

   Throughput is the steady-state one (``metrics.steady_state_output_throughput``: from the
   first completion to the last send), not diluted by ramp-up and drain.

JSON result (``kind: disagg-bench-rate-match``, ``version: 1``)
----------------------------------------------------------------
::

    {"kind", "version", "date",
     "config": {...RateMatchConfig, no api_key...},
     "model": served model name,
     "context": {"url", "devices", "ttft_slo_ms", "ttft_percentile",
                 "ctx_rate": req/s per context worker | null (no probe passed),
                 "bracketed": false when every probe passed (the limit lies higher),
                 "probes": [{"rate", "num_requests", "ttft_ms" (at the percentile), "passed",
                             "served_rate", "completed", "failed", "request_throughput",
                             "mean_ttft_ms", "p99_ttft_ms", "duration_s", "errors"}]},
     "generation": {"url", "devices",
                    "points": [{"concurrency", "num_requests", "completed", "failed",
                                "output_throughput", "tokens_per_s_per_user", "request_rate",
                                "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                                "mean_ttft_ms", "duration_s", "errors"}],
                    "colocated": null | {"context_url", "context_load" (req/s: ctx_rate),
                                         "points": [the points' fields, and "context":
                                                    {"offered_rate", "served_rate",
                                                     "completed", "failed", "mean_ttft_ms",
                                                     "duration_s"}]}},
     "rate_matched": [{"concurrency", "tokens_per_s_per_user", "gen_output_tps",
                       "gen_request_rate", "ctx_per_gen", "gen_per_ctx", "tput_per_device",
                       "on_frontier"}],
     "frontier": [the on_frontier points above, by tokens_per_s_per_user],
     "aggregated": null | {"url", "devices",
                           "points": [{"concurrency", "num_requests", "completed", "failed",
                                       "output_throughput", "tokens_per_s_per_user",
                                       "tput_per_device", "ttft_ms" (at the percentile),
                                       "meets_ttft_slo", "mean_tpot_ms", "p99_tpot_ms",
                                       "p99_ttft_ms", "duration_s", "errors"}],
                           "frontier": [...points on the baseline frontier]},
     "verify": null | [{"concurrency_per_gen", "num_ctx", "num_gen", "devices",
                        "concurrency" (on the generation workers), "predicted":
                        {"tokens_per_s_per_user", "tput_per_device", "output_throughput",
                        "request_rate", "bound", "arrivals": "closed" | "poisson"},
                        "measured": {"tokens_per_s_per_user", "tput_per_device",
                        "output_throughput" (steady state), "run_output_throughput" (whole
                        run), "arrivals", "in_flight" (closed: Little's law's count, a
                        float; Poisson: null), "in_flight_runs" (the whole counts run),
                        "runs" (the two closed loops when interpolated),
                        "request_rate" (Poisson's offered rate, else null), "served_rate",
                        "ttft_ms" (at the percentile), "meets_ttft_slo",
                        "unloaded_ttft_ms", "completed", "failed", "p99_tpot_ms",
                        "p99_ttft_ms", "mean_ttft_ms", "mean_tpot_ms"},
                        "gap_tput_per_device", "gap_tokens_per_s_per_user"}]}

Gaps are ``(measured - predicted) / predicted`` (negative: end to end below the prediction).
Throughputs are output tokens/s; rates requests/s; times ms.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numpy as np

from disagg.bench.client import (
    ENDPOINT_PATHS,
    RequestSpec,
    Transport,
    make_transport,
    normalize_base_url,
    send_request,
)
from disagg.bench.datasets import SampleRequest, TokenizerLike, sample_random
from disagg.bench.metrics import RequestRecord, percentile_key
from disagg.bench.runner import BenchmarkConfig, BenchmarkError, resolve_model, run_benchmark

RESULT_KIND = "disagg-bench-rate-match"
RESULT_VERSION = 1


@dataclass
class RateMatchConfig:
    """Everything a rate-match run needs besides the tokenizer."""

    context_url: str
    generation_url: str
    ttft_slo_ms: float
    isl: int = 1024
    osl: int = 128
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    aggregated_url: str | None = None
    agg_concurrencies: tuple[int, ...] | None = None  # None: the same as ``concurrencies``
    model: str = ""  # served model name; empty: the first of the context worker's /v1/models
    ttft_percentile: float = 90.0
    ctx_devices: float = 1.0  # devices one context worker uses (tp * pp)
    gen_devices: float = 1.0
    agg_devices: float = 1.0
    ctx_rate_start: float | None = None  # None: half the rate one warm request's TTFT allows
    ctx_max_probes: int = 8
    ctx_tolerance: float = 0.1  # bisection stops at hi / lo <= 1 + tolerance
    ctx_probe_seconds: float = 15.0
    ctx_min_prompts: int = 16
    gen_rounds: int = 4  # requests per concurrency = rounds * concurrency
    num_warmups: int = 2
    # Measure every generation point a second time beside the context worker serving its
    # SLO rate (module docstring, 2b): for workers that share one machine's memory system.
    colocated: bool = False
    seed: int = 0
    api_key: str | None = None
    http_client: str = "auto"
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        checks = [
            (self.isl >= 1, f"isl: must be >= 1, got {self.isl}"),
            (self.osl >= 2, f"osl: must be >= 2 (TPOT needs two tokens), got {self.osl}"),
            (self.ttft_slo_ms > 0, f"ttft_slo_ms: must be > 0, got {self.ttft_slo_ms}"),
            (0 < self.ttft_percentile <= 100,
             f"ttft_percentile: must be in (0, 100], got {self.ttft_percentile}"),
            (bool(self.concurrencies) and min(self.concurrencies) >= 1,
             f"concurrencies: need at least one, each >= 1, got {self.concurrencies}"),
            (self.agg_concurrencies is None or (bool(self.agg_concurrencies)
                                                and min(self.agg_concurrencies) >= 1),
             f"agg_concurrencies: each >= 1, got {self.agg_concurrencies}"),
            (min(self.ctx_devices, self.gen_devices, self.agg_devices) > 0,
             "devices: must be > 0"),
            (self.ctx_rate_start is None or self.ctx_rate_start > 0,
             f"ctx_rate_start: must be > 0, got {self.ctx_rate_start}"),
            (self.ctx_max_probes >= 1, f"ctx_max_probes: must be >= 1, got {self.ctx_max_probes}"),
            (self.ctx_tolerance > 0, f"ctx_tolerance: must be > 0, got {self.ctx_tolerance}"),
            (self.ctx_probe_seconds > 0, "ctx_probe_seconds: must be > 0"),
            (self.ctx_min_prompts >= 1, "ctx_min_prompts: must be >= 1"),
            (self.gen_rounds >= 1, f"gen_rounds: must be >= 1, got {self.gen_rounds}"),
            (self.num_warmups >= 0, "num_warmups: must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        self.concurrencies = tuple(sorted(set(self.concurrencies)))
        if self.agg_concurrencies is not None:
            self.agg_concurrencies = tuple(sorted(set(self.agg_concurrencies)))


# ------------------------------------------------------------------------ arithmetic (pure)


def tput_per_device(gen_output_tps: float, osl: int, ctx_rate: float, ctx_devices: float = 1.0,
                    gen_devices: float = 1.0) -> float:
    """REFERENCE section 7: output tokens/s of one generation worker divided by the devices of
    that worker plus the (fractional) context workers that feed it at the same request rate."""
    gen_req_rate = gen_output_tps / osl
    return gen_output_tps / (ctx_devices * gen_req_rate / ctx_rate + gen_devices)


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (>= on both x and y, > on one), by x.

    Duplicates are all kept (neither dominates the other).
    """
    keep = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 >= y) and (x2 > x or y2 > y)
                        for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            keep.append(i)
    return sorted(keep, key=lambda i: (points[i][0], -points[i][1]))


def rate_match(ctx_rate: float, gen_points: Sequence[dict[str, Any]], osl: int,
               ctx_devices: float = 1.0, gen_devices: float = 1.0) -> list[dict[str, Any]]:
    """The rate-matched point of every generation point (see the module docstring)."""
    out = []
    for p in gen_points:
        tps = float(p["output_throughput"])
        rate = tps / osl
        out.append({
            "concurrency": p["concurrency"],
            "tokens_per_s_per_user": p["tokens_per_s_per_user"],
            "gen_output_tps": tps,
            "gen_request_rate": rate,
            "ctx_per_gen": rate / ctx_rate,
            "gen_per_ctx": ctx_rate / rate if rate > 0 else None,
            "tput_per_device": tput_per_device(tps, osl, ctx_rate, ctx_devices, gen_devices),
            "on_frontier": False,
        })
    for i in pareto_frontier([(p["tokens_per_s_per_user"], p["tput_per_device"]) for p in out]):
        out[i]["on_frontier"] = True
    return out


def _gen_curve(gen_points: Sequence[dict[str, Any]], osl: int) -> list[tuple[float, float]]:
    """(request rate, tokens/s/user) of the generation points, by rate, rate increasing.

    Points whose rate does not increase with concurrency (the worker saturated) are dropped:
    more users beyond that only slow everyone down, and the curve must be a function of rate.
    """
    pts = sorted(gen_points, key=lambda p: p["concurrency"])
    curve: list[tuple[float, float]] = []
    for p in pts:
        r = float(p["output_throughput"]) / osl
        if p.get("completed", 1) and (not curve or r > curve[-1][0]):
            curve.append((r, float(p["tokens_per_s_per_user"])))
    return curve


def gen_speed_at_rate(gen_points: Sequence[dict[str, Any]], osl: int,
                      rate: float) -> float | None:
    """tokens/s/user one generation worker gives while serving ``rate`` requests/s.

    Linear interpolation in rate between the measured concurrencies (the matched concurrency);
    below the lowest measured rate, the lowest concurrency's speed (nobody decodes faster than
    alone); above the highest, None: one worker cannot sustain that rate.
    """
    curve = _gen_curve(gen_points, osl)
    if not curve or rate > curve[-1][0]:
        return None
    if rate <= curve[0][0]:
        return curve[0][1]
    for (r0, s0), (r1, s1) in zip(curve[:-1], curve[1:], strict=True):
        if r0 <= rate <= r1:
            return s0 + (s1 - s0) * (rate - r0) / (r1 - r0)
    return curve[-1][1]  # unreachable: rate lies within the curve


def gen_points_beside(generation: dict[str, Any], load: float) -> list[dict[str, Any]]:
    """The generation points of a worker whose neighbouring context worker serves ``load``
    requests/s (module docstring, 2b): the isolated points when the run measured no
    co-located ones, else TPOT and output tokens/s linear in ``load`` between the isolated
    point (load 0) and the co-located one (load ``context_load``); tokens/s/user and request
    rate follow from them."""
    points = generation["points"]
    col = generation.get("colocated")
    if not col:
        return list(points)
    f = load / float(col["context_load"])
    beside = {p["concurrency"]: p for p in col["points"] if p.get("completed")}
    out = []
    for p in points:
        q = beside.get(p["concurrency"])
        if q is None or not p.get("completed", 1):
            out.append(p)
            continue
        tpot = p["mean_tpot_ms"] + f * (q["mean_tpot_ms"] - p["mean_tpot_ms"])
        tps = p["output_throughput"] + f * (q["output_throughput"] - p["output_throughput"])
        out.append({**p, "mean_tpot_ms": tpot, "tokens_per_s_per_user": 1000.0 / tpot,
                    "output_throughput": tps,
                    **({"request_rate": p["request_rate"] * tps / p["output_throughput"]}
                       if "request_rate" in p else {}),
                    "context_load": load})
    return out


def _beside_own_load(generation: dict[str, Any], ctx_rate: float, num_ctx: int,
                     rate_of: Callable[[list[dict[str, Any]]], float]
                     ) -> list[dict[str, Any]]:
    """The generation points at the context load their cluster puts on each context worker:
    ``rate_of(points)`` is the cluster's request rate with those points, which depends on the
    generation speed, which depends on the load. Iterated from the full load ``ctx_rate`` (a
    cluster's rate never asks more of a context worker): each step changes the load by the
    interference's effect on the rate, a small fraction of the step before, so it settles
    within a few steps."""
    load = ctx_rate
    points = gen_points_beside(generation, load)
    for _ in range(100):
        new = min(ctx_rate, rate_of(points) / num_ctx)
        if abs(new - load) <= 1e-9 * ctx_rate:
            break
        load = new
        points = gen_points_beside(generation, load)
    return points


def predict_cluster(ctx_rate: float, gen_point: dict[str, Any],
                    gen_points: Sequence[dict[str, Any]], osl: int, num_ctx: int, num_gen: int,
                    ctx_devices: float = 1.0, gen_devices: float = 1.0,
                    generation: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted end-to-end result of ``num_ctx`` + ``num_gen`` workers with ``gen_point``'s
    concurrency per generation worker.

    The cluster's request rate is the slower side's: ``min(num_gen * gen_request_rate,
    num_ctx * ctx_rate)``. Generation bound: the generation workers hold ``gen_point``'s
    concurrency, as measured (``arrivals: closed``, a fixed number in flight). Context bound:
    the context workers' rate is a rate under the TTFT SLO, measured with Poisson arrivals, so
    the cluster is predicted under the same arrivals (``arrivals: poisson``): each generation
    worker serves ``rate / num_gen`` below the measured concurrency, at the speed
    ``open_loop_tpot`` gives (``gen_speed_at_rate`` when that has no answer).

    ``generation`` (the result's ``generation`` block, with co-located points): predict with
    the points beside this cluster's own context load instead of ``gen_point`` and
    ``gen_points`` (``_beside_own_load``).
    """
    if generation is not None and generation.get("colocated"):
        c = gen_point["concurrency"]

        def rate_of(points: list[dict[str, Any]]) -> float:
            gp = next(p for p in points if p["concurrency"] == c)
            return min(num_gen * float(gp["output_throughput"]) / osl, num_ctx * ctx_rate)

        gen_points = _beside_own_load(generation, ctx_rate, num_ctx, rate_of)
        gen_point = next(p for p in gen_points if p["concurrency"] == c)
    gen_rate = float(gen_point["output_throughput"]) / osl
    rate = min(num_gen * gen_rate, num_ctx * ctx_rate)
    bound = "generation" if num_gen * gen_rate <= num_ctx * ctx_rate else "context"
    speed = float(gen_point["tokens_per_s_per_user"])
    if bound == "context":
        tpot, _ = open_loop_tpot(gen_points, osl, rate / num_gen)
        speed = (1000.0 / tpot if tpot else gen_speed_at_rate(gen_points, osl, rate / num_gen)
                 or speed)
    devices = num_ctx * ctx_devices + num_gen * gen_devices
    return {"tokens_per_s_per_user": speed, "output_throughput": rate * osl,
            "tput_per_device": rate * osl / devices, "request_rate": rate, "bound": bound,
            "arrivals": "closed" if bound == "generation" else "poisson", "devices": devices}


def gen_tpot_at_concurrency(gen_points: Sequence[dict[str, Any]], c: float
                            ) -> float | None:
    """Mean TPOT (ms) of the generation worker with ``c`` requests decoding together.

    Linear in ``c`` between measured concurrencies; below the lowest, the lowest's; above the
    highest, the last segment extended (None with a single point)."""
    pts = sorted((float(p["concurrency"]), float(p["mean_tpot_ms"])) for p in gen_points
                 if p.get("completed", 1) and p.get("mean_tpot_ms"))
    if not pts:
        return None
    if c <= pts[0][0]:
        return pts[0][1]
    for (c0, t0), (c1, t1) in zip(pts[:-1], pts[1:], strict=True):
        if c <= c1:
            return t0 + (t1 - t0) * (c - c0) / (c1 - c0)
    if len(pts) == 1:
        return None
    (c0, t0), (c1, t1) = pts[-2], pts[-1]
    return t1 + (t1 - t0) * (c - c1) / (c1 - c0)


def open_loop_tpot(gen_points: Sequence[dict[str, Any]], osl: int, rate: float
                   ) -> tuple[float | None, float]:
    """Predicted mean TPOT (ms) of one generation worker under Poisson arrivals at ``rate``.

    A request decoding for ``T`` seconds shares each step with the others in service; with
    Poisson arrivals their number is Poisson(``rate * T``), so its mean TPOT is
    ``E[tpot(1 + N)]`` (``gen_tpot_at_concurrency``), and ``T = osl * TPOT``: solved by fixed
    point. Returns (TPOT ms, probability mass above the highest measured concurrency: the
    share of the prediction that extrapolates).
    """
    tpot = gen_tpot_at_concurrency(gen_points, 1.0)
    if tpot is None:
        return None, 0.0
    c_max = max(float(p["concurrency"]) for p in gen_points)
    beyond = 0.0
    for _ in range(200):
        m = rate * osl * tpot / 1000.0  # mean number of other requests in service
        k_max = int(m + 10.0 * math.sqrt(m) + 20)
        pk = math.exp(-m)  # P(N = 0); recurrence P(k) = P(k-1) * m / k
        total, mass, beyond = 0.0, 0.0, 0.0
        for k in range(k_max + 1):
            if k:
                pk *= m / k
            t = gen_tpot_at_concurrency(gen_points, 1.0 + k)
            if t is None:
                return None, 1.0
            total += pk * t
            mass += pk
            if 1 + k > c_max:
                beyond += pk
        new = total / mass
        if abs(new - tpot) <= 1e-6 * tpot:
            break
        tpot = new
    return tpot, beyond


def predict_at_rate(ctx_rate: float, gen_points: Sequence[dict[str, Any]], osl: int,
                    num_ctx: int, num_gen: int, rate: float,
                    generation: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted behaviour of a cluster under an open (Poisson) load of ``rate`` requests/s.

    ``sustainable``: both sides can serve it (context within its TTFT-SLO rate, generation
    within its highest measured rate). Then output tokens/s = ``rate * osl`` and each
    generation worker, serving ``rate / num_gen``, has the mean TPOT of ``open_loop_tpot``
    (``extrapolated``: the share of it beyond the measured concurrencies). Otherwise the
    capacity is the prediction.

    ``generation`` (with co-located points): the points beside the context load this rate
    (or the capacity) puts on each context worker replace ``gen_points``.
    """
    if generation is not None and generation.get("colocated"):

        def rate_of(points: list[dict[str, Any]]) -> float:
            curve = _gen_curve(points, osl)
            cap = min(num_gen * (curve[-1][0] if curve else 0.0), num_ctx * ctx_rate)
            return min(rate, cap)

        gen_points = _beside_own_load(generation, ctx_rate, num_ctx, rate_of)
    curve = _gen_curve(gen_points, osl)
    gen_cap = num_gen * (curve[-1][0] if curve else 0.0)
    ctx_cap = num_ctx * ctx_rate
    capacity = min(gen_cap, ctx_cap)
    tpot, beyond = open_loop_tpot(gen_points, osl, min(rate, capacity) / num_gen)
    return {
        "rate": rate, "sustainable": rate <= capacity, "capacity_request_rate": capacity,
        "bound": "generation" if gen_cap <= ctx_cap else "context",
        "output_throughput": min(rate, capacity) * osl,
        "tokens_per_s_per_user": 1000.0 / tpot if tpot else None,
        "mean_tpot_ms": tpot, "extrapolated": beyond,
    }


def served_rate(records: Sequence[RequestRecord]) -> float | None:
    """Requests/s a worker completed during a run: (completed - 1) over the span from the first
    to the last completion; None with fewer than two completions (or no span)."""
    ends = sorted(r.start + r.e2el for r in records if r.success)
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return None
    return (len(ends) - 1) / (ends[-1] - ends[0])


def context_rate(probes: Sequence[dict[str, Any]]) -> float | None:
    """The context worker's rate within the TTFT SLO: the highest ``min(offered, served)``
    over the passing probes (module docstring, 1), or None when none passed."""
    rates = [min(p["rate"], p["served_rate"]) if p.get("served_rate") else p["rate"]
             for p in probes if p["passed"]]
    return max(rates) if rates else None


def best_integer_cluster(ctx_rate: float, gen_point: dict[str, Any], osl: int,
                         max_devices: float, ctx_devices: float = 1.0,
                         gen_devices: float = 1.0) -> tuple[int, int] | None:
    """(num_ctx, num_gen) within ``max_devices`` with the best predicted throughput per device
    (ties: fewer devices), or None when not even 1 + 1 fits."""
    gen_rate = float(gen_point["output_throughput"]) / osl
    best: tuple[float, float, int, int] | None = None
    n_ctx = 1
    while n_ctx * ctx_devices + gen_devices <= max_devices + 1e-9:
        n_gen = 1
        while n_ctx * ctx_devices + n_gen * gen_devices <= max_devices + 1e-9:
            devices = n_ctx * ctx_devices + n_gen * gen_devices
            per_dev = min(n_gen * gen_rate, n_ctx * ctx_rate) * osl / devices
            key = (per_dev, -devices, n_ctx, n_gen)
            if best is None or key[:2] > best[:2]:
                best = key
            n_gen += 1
        n_ctx += 1
    return None if best is None else (best[2], best[3])


# ----------------------------------------------------------------------------- measuring


def _log(stream: TextIO | None, msg: str) -> None:
    if stream is not None:
        print(msg, file=stream, flush=True)


class _Samples:
    """Fresh random token-id prompts for every run: no run ever hits another's prefix cache."""

    def __init__(self, tok: TokenizerLike, isl: int, seed: int) -> None:
        self.tok, self.isl, self.seed, self.runs = tok, isl, seed, 0

    def take(self, n: int, output_len: int) -> list[SampleRequest]:
        self.runs += 1
        return sample_random(self.tok, n, self.isl, output_len, seed=self.seed * 100003 + self.runs,
                             as_token_ids=True)


def _summary_subset(s: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {k: s.get(k) for k in keys}


class RateMatcher:
    """Runs the measurements of one rate-match. ``progress`` gets one line per run."""

    def __init__(self, config: RateMatchConfig, tok: TokenizerLike,
                 transport: Transport | None = None, progress: TextIO | None = sys.stderr,
                 ) -> None:
        self.cfg = config
        self.samples = _Samples(tok, config.isl, config.seed)
        self.transport = transport
        self.progress = progress
        self.pkey = percentile_key(config.ttft_percentile)
        self.percentiles = tuple(sorted({config.ttft_percentile, 50.0, 90.0, 99.0}))

    def _bench_config(self, url: str, **kw: Any) -> BenchmarkConfig:
        c = self.cfg
        return BenchmarkConfig(base_url=url, endpoint="completions", model=c.model,
                               percentiles=self.percentiles, seed=c.seed, api_key=c.api_key,
                               http_client=c.http_client, request_timeout_s=c.request_timeout_s,
                               **kw)

    async def _run(self, bc: BenchmarkConfig, samples: list[SampleRequest]) -> dict[str, Any]:
        assert self.transport is not None
        res = await run_benchmark(bc, samples, transport=self.transport)
        return res.summary

    async def warmup(self, url: str, output_len: int, gen_only: bool = False,
                     concurrency: int = 1) -> list[float]:
        """``num_warmups`` requests one after another, then (``concurrency`` > 1) one round of
        ``concurrency`` at once: a worker's first large batches are slow (fresh KV cache
        pages, allocator growth). Returns the sequential requests' TTFTs (s)."""
        ttfts = []
        for _ in range(self.cfg.num_warmups):
            s = await self._run(self._bench_config(url, gen_only=gen_only, ignore_eos=True),
                                self.samples.take(1, output_len))
            if s["failed"]:
                raise BenchmarkError(f"warmup request to {url} failed: "
                                     f"{next(iter(s['errors']))}")
            ttfts.append(s["mean_ttft_ms"] / 1000.0)
        if self.cfg.num_warmups and concurrency > 1:
            await self._run(self._bench_config(url, gen_only=gen_only, ignore_eos=True,
                                               max_concurrency=concurrency),
                            self.samples.take(concurrency, output_len))
        return ttfts

    # ------------------------------------------------------------------ context side

    async def probe_context(self, rate: float) -> dict[str, Any]:
        c = self.cfg
        n = max(c.ctx_min_prompts, math.ceil(rate * c.ctx_probe_seconds))
        assert self.transport is not None
        res = await run_benchmark(self._bench_config(c.context_url, request_rate=rate,
                                                     ignore_eos=True, exact_rate=True),
                                  self.samples.take(n, 1), transport=self.transport)
        s = res.summary
        ttft = s[f"{self.pkey}_ttft_ms"]
        passed = s["failed"] == 0 and s["completed"] > 0 and ttft <= c.ttft_slo_ms
        served = served_rate(res.records)
        _log(self.progress, f"context: {rate:.3g} req/s x {n}: TTFT {self.pkey} {ttft:.0f} ms "
                            f"(SLO {c.ttft_slo_ms:g}), served "
                            f"{'?' if served is None else f'{served:.3g}'} req/s, "
                            f"{s['failed']} failed: {'pass' if passed else 'fail'}")
        return {"rate": rate, "num_requests": n, "ttft_ms": ttft, "passed": passed,
                "served_rate": served,
                **_summary_subset(s, ("completed", "failed", "request_throughput",
                                      "mean_ttft_ms", "p99_ttft_ms", "duration_s", "errors"))}

    async def sweep_context(self) -> dict[str, Any]:
        """Ladder (x2 / /2) to bracket the SLO limit, then geometric bisection."""
        c = self.cfg
        ttfts = await self.warmup(c.context_url, 1)
        start = c.ctx_rate_start
        if start is None:
            # A lone warm request's TTFT bounds a serial server's rate at 1 / TTFT; start at half.
            lone = min(ttfts) if ttfts else None
            if lone is None:
                s = await self._run(self._bench_config(c.context_url, ignore_eos=True),
                                    self.samples.take(1, 1))
                lone = s["mean_ttft_ms"] / 1000.0
            start = 0.5 / max(lone, 1e-3)
        probes: list[dict[str, Any]] = []
        lo: float | None = None  # highest passing offered rate
        hi: float | None = None  # lowest failing rate
        rate = start
        while len(probes) < c.ctx_max_probes:
            p = await self.probe_context(rate)
            probes.append(p)
            if p["passed"]:
                lo = rate if lo is None else max(lo, rate)
            else:
                hi = rate if hi is None else min(hi, rate)
            if lo is None:
                rate = rate / 2.0
            elif hi is None:
                rate = rate * 2.0
            elif hi / lo <= 1.0 + c.ctx_tolerance:
                break
            else:
                rate = math.sqrt(lo * hi)
        ctx_rate = context_rate(probes)
        _log(self.progress, f"context: {'none' if ctx_rate is None else f'{ctx_rate:.3g}'} "
                            f"req/s per worker within TTFT {self.pkey} <= {c.ttft_slo_ms:g} ms")
        return {"url": c.context_url, "devices": c.ctx_devices, "ttft_slo_ms": c.ttft_slo_ms,
                "ttft_percentile": c.ttft_percentile, "ctx_rate": ctx_rate,
                "bracketed": lo is not None and hi is not None, "probes": probes}

    # --------------------------------------------------------------- concurrency runs

    async def concurrency_point(self, url: str, concurrency: int, gen_only: bool,
                                label: str) -> dict[str, Any]:
        c = self.cfg
        n = c.gen_rounds * concurrency
        s = await self._run(self._bench_config(url, max_concurrency=concurrency,
                                               gen_only=gen_only, ignore_eos=True),
                            self.samples.take(n, c.osl))
        tpot = s["mean_tpot_ms"]
        speed = 1000.0 / tpot if tpot > 0 else 0.0
        _log(self.progress, f"{label}: concurrency {concurrency} x {n}: "
                            f"{s['output_throughput']:.1f} tok/s, {speed:.1f} tok/s/user, "
                            f"TTFT mean {s['mean_ttft_ms']:.0f} ms, {s['failed']} failed")
        return {"concurrency": concurrency, "num_requests": n,
                "output_throughput": s["output_throughput"], "tokens_per_s_per_user": speed,
                "ttft_ms": s[f"{self.pkey}_ttft_ms"],
                **_summary_subset(s, ("completed", "failed", "mean_tpot_ms", "median_tpot_ms",
                                      "p99_tpot_ms", "mean_ttft_ms", "p99_ttft_ms",
                                      "duration_s", "errors"))}

    async def generation_point(self, concurrency: int, context_load: float | None = None,
                               label: str = "generation") -> dict[str, Any]:
        """One generation-only point; ``context_load`` (req/s): measured while the context
        worker serves that load (module docstring, 2b), its figures under ``"context"``."""
        c = self.cfg
        if context_load is None:
            p = await self.concurrency_point(c.generation_url, concurrency, True, label)
        else:
            stop = asyncio.Event()
            load = asyncio.create_task(self.context_load(context_load, stop))
            try:
                p = await self.concurrency_point(
                    c.generation_url, concurrency, True,
                    f"{label} beside context {context_load:.3g} req/s")
            finally:
                stop.set()
                p_ctx = await load
            p["context"] = p_ctx
        if p["completed"] == 0:
            raise BenchmarkError(
                f"every generation-only request to {c.generation_url} failed "
                f"({next(iter(p['errors']), '?')}); was the worker started with "
                f"--role generation --benchmark-gen-only?")
        p.pop("ttft_ms")
        p["request_rate"] = p["output_throughput"] / c.osl
        return p

    async def context_load(self, rate: float, stop: asyncio.Event) -> dict[str, Any]:
        """Ordinary ``max_tokens: 1`` requests to the context worker, Poisson arrivals at
        ``rate`` (seeded), from now until ``stop`` is set; then waits for the ones in flight
        (each within the context worker's TTFT). Returns what it offered and what was served."""
        c = self.cfg
        assert self.transport is not None
        url = normalize_base_url(c.context_url) + ENDPOINT_PATHS["completions"]
        rng = np.random.default_rng(c.seed + 7919)
        tasks: list[asyncio.Task[RequestRecord]] = []
        origin = time.perf_counter()
        next_at = 0.0
        while not stop.is_set():
            s = self.samples.take(1, 1)[0]
            spec = RequestSpec(index=len(tasks), url=url, endpoint="completions",
                               model=c.model, prompt=s.prompt, prompt_len=s.prompt_len,
                               max_tokens=1, ignore_eos=True, api_key=c.api_key)
            tasks.append(asyncio.create_task(send_request(self.transport, spec, origin)))
            next_at += float(rng.exponential(1.0 / rate))
            try:  # the next arrival, or the stop, whichever comes first
                await asyncio.wait_for(stop.wait(),
                                       max(0.0, origin + next_at - time.perf_counter()))
            except TimeoutError:
                pass
        offered_s = time.perf_counter() - origin
        records = list(await asyncio.gather(*tasks))
        ok = [r for r in records if r.success]
        if len(ok) < len(records):
            first = next(r.error for r in records if not r.success)
            raise BenchmarkError(f"context load on {c.context_url}: "
                                 f"{len(records) - len(ok)} of {len(records)} requests failed "
                                 f"({first})")
        served = served_rate(records)
        _log(self.progress, f"context load: {len(records)} requests in {offered_s:.1f} s "
                            f"(offered {rate:.3g} req/s), served "
                            f"{'?' if served is None else f'{served:.3g}'} req/s")
        return {"offered_rate": rate, "served_rate": served, "completed": len(ok),
                "failed": len(records) - len(ok), "duration_s": offered_s,
                "mean_ttft_ms": (1000.0 * sum(r.ttft for r in ok) / len(ok)
                                 if ok else None)}

    async def sweep_generation(self, ctx_rate: float | None = None) -> dict[str, Any]:
        """Generation-only points at every concurrency; with ``colocated`` (and a context
        rate), each again beside the context worker serving ``ctx_rate``."""
        c = self.cfg
        await self.warmup(c.generation_url, c.osl, gen_only=True,
                          concurrency=max(c.concurrencies))
        points = [await self.generation_point(conc) for conc in c.concurrencies]
        out: dict[str, Any] = {"url": c.generation_url, "devices": c.gen_devices,
                               "points": points, "colocated": None}
        if c.colocated and ctx_rate:
            out["colocated"] = {
                "context_url": c.context_url, "context_load": ctx_rate,
                "points": [await self.generation_point(conc, ctx_rate)
                           for conc in c.concurrencies]}
        return out

    async def sweep_aggregated(self) -> dict[str, Any]:
        c = self.cfg
        assert c.aggregated_url is not None
        concs = c.agg_concurrencies or c.concurrencies
        await self.warmup(c.aggregated_url, c.osl, concurrency=max(concs))
        points = []
        for conc in concs:
            p = await self.concurrency_point(c.aggregated_url, conc, False, "aggregated")
            p["tput_per_device"] = p["output_throughput"] / c.agg_devices
            p["meets_ttft_slo"] = p["failed"] == 0 and p["ttft_ms"] <= c.ttft_slo_ms
            points.append(p)
        ok = [i for i, p in enumerate(points) if p["meets_ttft_slo"]]
        front = pareto_frontier([(points[i]["tokens_per_s_per_user"],
                                  points[i]["tput_per_device"]) for i in ok])
        return {"url": c.aggregated_url, "devices": c.agg_devices, "points": points,
                "frontier": [points[ok[i]] for i in front]}

    async def run_end_to_end(self, url: str, concurrency: int,
                             predicted_rate: float | None = None,
                             arrivals: str = "closed") -> dict[str, Any]:
        """Full requests through a router, the measured side of verify (module docstring, 5).

        ``arrivals="closed"`` (a generation-bound prediction): closed loops around the
        Little's-law count ``concurrency + predicted_rate * unloaded TTFT`` (``concurrency`` on
        the generation workers, the rest at the context side), interpolated between the two
        whole counts around it (``closed_loop_counts``). ``arrivals="poisson"`` (a
        context-bound prediction): Poisson arrivals at ``predicted_rate``, as the context rate
        was measured, with the TTFT percentile checked against the SLO."""
        c = self.cfg
        if arrivals not in ("closed", "poisson"):
            raise ValueError(f"arrivals: 'closed' or 'poisson', got {arrivals!r}")
        if arrivals == "poisson" and not predicted_rate:
            raise ValueError("arrivals='poisson' needs a predicted_rate")
        ttfts = await self.warmup(url, c.osl, concurrency=concurrency)
        if not ttfts:  # no warmups asked: one request alone gives the unloaded TTFT
            s = await self._run(self._bench_config(url, ignore_eos=True),
                                self.samples.take(1, c.osl))
            ttfts = [s["mean_ttft_ms"] / 1000.0]
        unloaded = min(ttfts)
        common = {"concurrency": concurrency, "arrivals": arrivals,
                  "unloaded_ttft_ms": unloaded * 1000.0}
        if arrivals == "poisson":
            assert predicted_rate is not None
            # Twice a context probe's length: the rate must hold, not only start.
            n = max(c.ctx_min_prompts, math.ceil(predicted_rate * 2 * c.ctx_probe_seconds))
            bc = self._bench_config(url, request_rate=predicted_rate, exact_rate=True,
                                    ignore_eos=True)
            run = await self._e2e_run(bc, n, f"Poisson {predicted_rate:.3g} req/s")
            return {**common, "in_flight": None, "request_rate": predicted_rate, **run}
        exact = concurrency + (predicted_rate * unloaded if predicted_rate else 0.0)
        counts = closed_loop_counts(exact)
        runs = []
        for k in counts:
            bc = self._bench_config(url, max_concurrency=k, ignore_eos=True)
            runs.append(await self._e2e_run(
                bc, max(c.gen_rounds, 6) * k,
                f"{k} in flight (Little's law: {concurrency} + {exact - concurrency:.2f} at "
                f"the context side, unloaded TTFT {unloaded * 1000:.0f} ms)"))
        out = {**common, "in_flight": exact, "in_flight_runs": list(counts),
               "request_rate": None, **interpolate_runs(exact, counts, runs)}
        if len(runs) > 1:
            out["runs"] = runs
        return out

    async def _e2e_run(self, bc: BenchmarkConfig, n: int, how: str) -> dict[str, Any]:
        c = self.cfg
        res = await run_benchmark(bc, self.samples.take(n, c.osl), transport=self.transport)
        s = res.summary
        tpot = s["mean_tpot_ms"]
        speed = 1000.0 / tpot if tpot > 0 else 0.0
        steady = s.get("steady_output_throughput")
        tput = steady if steady is not None else s["output_throughput"]
        ttft = s[f"{self.pkey}_ttft_ms"]
        _log(self.progress, f"end to end: {how} x {n}: {tput:.1f} tok/s steady "
                            f"({s['output_throughput']:.1f} over the run), {speed:.1f} "
                            f"tok/s/user, TTFT {self.pkey} {ttft:.0f} ms, {s['failed']} failed")
        return {"num_requests": n, "served_rate": served_rate(res.records),
                "output_throughput": tput, "run_output_throughput": s["output_throughput"],
                "tokens_per_s_per_user": speed, "ttft_ms": ttft,
                "meets_ttft_slo": s["failed"] == 0 and ttft <= c.ttft_slo_ms,
                **_summary_subset(s, ("completed", "failed", "mean_tpot_ms", "median_tpot_ms",
                                      "p99_tpot_ms", "mean_ttft_ms", "p99_ttft_ms",
                                      "duration_s", "errors"))}


def closed_loop_counts(exact: float, snap: float = 0.1) -> tuple[int, ...]:
    """Whole in-flight counts whose closed loops stand for ``exact`` (Little's law's count):
    the nearest one when ``exact`` lies within ``snap`` of it, else the two around it (at
    small counts rounding alone moves the load by tens of percent: 1.5 -> 2 is +33%)."""
    lo = max(1, math.floor(exact))
    if exact - lo <= snap:
        return (lo,)
    if math.ceil(exact) - exact <= snap:
        return (math.ceil(exact),)
    return (lo, lo + 1)


# Fields of a closed-loop run that interpolate linearly in the in-flight count.
_INTERPOLATED = ("output_throughput", "run_output_throughput", "mean_tpot_ms",
                 "served_rate")


def interpolate_runs(exact: float, counts: Sequence[int], runs: Sequence[dict[str, Any]]
                     ) -> dict[str, Any]:
    """One closed-loop result at the fractional count ``exact`` from runs at ``counts``.

    One run: itself. Two (``k`` and ``k + 1``): throughputs and mean TPOT linear between them
    at ``w = exact - k`` (throughput is concave in the count, so this leans low), tokens/s/user
    = 1000 / that TPOT; percentiles and TTFTs from the nearer run; counts of completed and
    failed requests summed, and the TTFT SLO met only if both runs met it."""
    if len(runs) == 1:
        return dict(runs[0])
    (k0, _), (r0, r1) = counts, runs
    w = exact - k0
    out = dict(r0 if w < 0.5 else r1)
    for key in _INTERPOLATED:
        a, b = r0.get(key), r1.get(key)
        out[key] = None if a is None or b is None else (1 - w) * a + w * b
    tpot = out["mean_tpot_ms"]
    out["tokens_per_s_per_user"] = 1000.0 / tpot if tpot else 0.0
    for key in ("completed", "failed", "num_requests"):
        out[key] = r0[key] + r1[key]
    out["meets_ttft_slo"] = bool(r0["meets_ttft_slo"] and r1["meets_ttft_slo"])
    out["errors"] = dict(Counter(r0.get("errors") or {}) + Counter(r1.get("errors") or {}))
    return out


def describe_arrivals(measured: dict[str, Any]) -> str:
    """How an end-to-end measurement (``run_end_to_end``'s result) loaded the cluster."""
    if measured["arrivals"] == "poisson":
        return f"Poisson {measured['request_rate']:.3f} req/s"
    counts = measured["in_flight_runs"]
    if len(counts) == 2:
        return (f"closed loop, {counts[0]} and {counts[1]} in flight, interpolated to "
                f"{measured['in_flight']:.2f}")
    return f"closed loop, {counts[0]} in flight"


def verify_choices(result: dict[str, Any], max_devices: float, num_points: int,
                   ctx_devices: float = 1.0, gen_devices: float = 1.0) -> list[dict[str, Any]]:
    """Frontier points to verify (spread evenly along it) with their best integer cluster and
    its prediction."""
    ctx_rate = result["context"]["ctx_rate"]
    osl = result["config"]["osl"]
    # The rate-matched points' own (co-located: beside a context worker at its rate).
    gen_points = gen_points_beside(result["generation"], ctx_rate)
    frontier = result["frontier"]
    if not frontier or num_points < 1:
        return []
    if len(frontier) <= num_points:
        picked = list(frontier)
    else:  # evenly spaced indices, both ends included
        idx = sorted({round(i * (len(frontier) - 1) / max(1, num_points - 1))
                      for i in range(num_points)})
        picked = [frontier[i] for i in idx]
    out = []
    by_conc = {p["concurrency"]: p for p in gen_points}
    for fp in picked:
        gp = by_conc[fp["concurrency"]]
        cluster = best_integer_cluster(ctx_rate, gp, osl, max_devices, ctx_devices, gen_devices)
        if cluster is None:
            continue
        n_ctx, n_gen = cluster
        pred = predict_cluster(ctx_rate, gp, gen_points, osl, n_ctx, n_gen, ctx_devices,
                               gen_devices, generation=result["generation"])
        out.append({"concurrency_per_gen": fp["concurrency"], "num_ctx": n_ctx,
                    "num_gen": n_gen, "devices": pred.pop("devices"),
                    "concurrency": n_gen * fp["concurrency"], "predicted": pred})
    return out


def gap(measured: float, predicted: float) -> float | None:
    """(measured - predicted) / predicted; None without a prediction."""
    return None if not predicted else (measured - predicted) / predicted


def finish_verify_point(choice: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Merge a verify choice with its end-to-end measurement and the gaps."""
    devices = choice["devices"]
    m = {"tokens_per_s_per_user": measured["tokens_per_s_per_user"],
         "tput_per_device": measured["output_throughput"] / devices,
         **{k: measured[k] for k in ("output_throughput", "completed", "failed", "p99_tpot_ms",
                                     "p99_ttft_ms", "mean_ttft_ms", "mean_tpot_ms")},
         **{k: measured.get(k) for k in ("run_output_throughput", "in_flight",
                                         "in_flight_runs", "runs",
                                         "unloaded_ttft_ms", "arrivals", "request_rate",
                                         "served_rate", "ttft_ms", "meets_ttft_slo")}}
    pred = choice["predicted"]
    return {**choice, "measured": m,
            "gap_tput_per_device": gap(m["tput_per_device"], pred["tput_per_device"]),
            "gap_tokens_per_s_per_user": gap(m["tokens_per_s_per_user"],
                                             pred["tokens_per_s_per_user"])}


# -------------------------------------------------------------------------------- driver


def _config_json(cfg: RateMatchConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d.pop("api_key", None)  # never write secrets to result files
    return d


def build_result(config: RateMatchConfig, model: str, ctx: dict[str, Any],
                 gen: dict[str, Any], agg: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON result (module docstring) from the sweeps' outputs: rate-matched points and
    frontier included (empty when no context rate met the SLO); ``verify`` left None."""
    result: dict[str, Any] = {
        "kind": RESULT_KIND, "version": RESULT_VERSION,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config": _config_json(config), "model": model, "context": ctx, "generation": gen,
        "rate_matched": [], "frontier": [], "aggregated": agg, "verify": None,
    }
    if ctx["ctx_rate"] is not None:
        # Matched exactly, every context worker serves its rate: co-located points at that
        # load (the isolated points when none were measured).
        rm = rate_match(ctx["ctx_rate"], gen_points_beside(gen, ctx["ctx_rate"]), config.osl,
                        config.ctx_devices, config.gen_devices)
        result["rate_matched"] = rm
        result["frontier"] = sorted((p for p in rm if p["on_frontier"]),
                                    key=lambda p: p["tokens_per_s_per_user"])
    return result


async def run_rate_match(
    config: RateMatchConfig, tok: TokenizerLike, *, progress: TextIO | None = sys.stderr,
    verify: Callable[[RateMatcher, list[dict[str, Any]]], Any] | None = None,
    verify_max_devices: float = 2.0, verify_points: int = 2,
) -> dict[str, Any]:
    """Measure both sides (and the baseline), rate-match, optionally verify; the JSON result.

    ``verify(matcher, choices)`` is awaited with the chosen clusters (``verify_choices``) and
    returns one measured summary per choice (``concurrency_point``'s shape); ``cli`` passes one
    that starts each cluster with ``disagg launch``.
    """
    tr = make_transport(config.http_client, config.request_timeout_s)
    try:
        bc = BenchmarkConfig(base_url=config.context_url, model=config.model,
                             api_key=config.api_key, http_client=config.http_client)
        model = await resolve_model(bc, tr)
        config = dataclasses.replace(config, model=model)
        m = RateMatcher(config, tok, tr, progress)
        ctx = await m.sweep_context()
        gen = await m.sweep_generation(ctx["ctx_rate"])
        agg = await m.sweep_aggregated() if config.aggregated_url else None
        result = build_result(config, model, ctx, gen, agg)
        if ctx["ctx_rate"] is None:
            _log(progress, "no context probe met the TTFT SLO: nothing to rate-match (lower "
                           "--isl, raise --ttft-slo, or start lower with --ctx-rate-start)")
            return result
        if verify is not None:
            choices = verify_choices(result, verify_max_devices, verify_points,
                                     config.ctx_devices, config.gen_devices)
            measured = await verify(m, choices)
            result["verify"] = [finish_verify_point(ch, ms)
                                for ch, ms in zip(choices, measured, strict=True)]
        return result
    finally:
        await tr.aclose()


def format_rate_match(result: dict[str, Any]) -> str:
    """The end-of-run tables."""
    cfg = result["config"]
    ctx = result["context"]
    lines = [f"{' Rate matching ':=^78}",
             f"model {result['model']!r}, isl {cfg['isl']}, osl {cfg['osl']}, TTFT SLO "
             f"{cfg['ttft_slo_ms']:g} ms at p{cfg['ttft_percentile']:g}"]
    rate = ctx["ctx_rate"]
    lines.append("context: " + ("no rate met the SLO" if rate is None else
                                f"{rate:.3f} req/s per worker ({ctx['devices']:g} devices)")
                 + ("" if rate is None or ctx.get("bracketed", True) else
                    " (every probe passed: the limit is higher; raise --ctx-max-probes)"))
    col = (result.get("generation") or {}).get("colocated")
    if col:
        lines.append(f"generation: co-located, measured beside the context worker serving "
                     f"{col['context_load']:.3f} req/s (the rows below)")
    lines.append(f"{'conc':>5} {'tok/s/user':>11} {'gen tok/s':>10} {'gen req/s':>10} "
                 f"{'ctx:gen':>9} {'tok/s/dev':>10} frontier")
    for p in result["rate_matched"]:
        lines.append(f"{p['concurrency']:>5} {p['tokens_per_s_per_user']:>11.2f} "
                     f"{p['gen_output_tps']:>10.1f} {p['gen_request_rate']:>10.3f} "
                     f"{p['ctx_per_gen']:>7.2f}:1 {p['tput_per_device']:>10.1f} "
                     f"{'*' if p['on_frontier'] else ''}")
    if result.get("aggregated"):
        lines.append(f"{' aggregated baseline ':-^78}")
        for p in result["aggregated"]["points"]:
            lines.append(f"{p['concurrency']:>5} {p['tokens_per_s_per_user']:>11.2f} "
                         f"{p['output_throughput']:>10.1f} tok/s  {p['tput_per_device']:>8.1f} "
                         f"tok/s/dev  TTFT {p['ttft_ms']:.0f} ms"
                         f"{'' if p['meets_ttft_slo'] else ' (misses SLO)'}")
    for v in result.get("verify") or []:
        lines.append(f"{' end to end ':-^78}")
        pr, me = v["predicted"], v["measured"]
        how = describe_arrivals(me)
        slo = ("" if me.get("meets_ttft_slo") is None else
               f", TTFT {'meets' if me['meets_ttft_slo'] else 'misses'} the SLO")
        lines.append(f"{v['num_ctx']} ctx + {v['num_gen']} gen, concurrency {v['concurrency']} "
                     f"({pr.get('bound', '?')} bound; {how}): "
                     f"tok/s/dev {me['tput_per_device']:.1f} vs predicted "
                     f"{pr['tput_per_device']:.1f} ({_pct(v['gap_tput_per_device'])}), "
                     f"tok/s/user {me['tokens_per_s_per_user']:.2f} vs "
                     f"{pr['tokens_per_s_per_user']:.2f} "
                     f"({_pct(v['gap_tokens_per_s_per_user'])}){slo}")
    lines.append("=" * 78)
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def save_result(result: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, allow_nan=False, default=_json_default)
        f.write("\n")


def _json_default(x: Any) -> Any:
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def load_rate_match(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict) or obj.get("kind") != RESULT_KIND:
        raise ValueError(f"{path}: not a `disagg bench rate-match` result")
    return obj


# ----------------------------------------------------------------- verify with disagg launch


class LaunchedCluster:
    """``disagg launch -c`` on a cluster YAML this class writes: ``num_ctx`` context and
    ``num_gen`` generation workers on free local ports and the router in front.

    ``with LaunchedCluster(...) as url:`` waits until the router's /health answers 200 (or the
    launcher exits, or ``timeout_s`` passes: RuntimeError with the launcher's output tail),
    and on exit SIGTERMs the launcher, which stops its children; it is killed after
    ``stop_timeout_s`` if it has not exited by then.
    """

    def __init__(self, model_dir: str, served_model_name: str, num_ctx: int, num_gen: int,
                 worker_options: dict[str, Any], log_dir: str, timeout_s: float = 300.0,
                 stop_timeout_s: float = 60.0, policy: str = "load_balancing") -> None:
        self.model_dir, self.name = model_dir, served_model_name
        self.num_ctx, self.num_gen = num_ctx, num_gen
        self.worker_options = dict(worker_options)
        self.log_dir, self.timeout_s, self.stop_timeout_s = log_dir, timeout_s, stop_timeout_s
        self.policy = policy
        self.proc: Any = None
        self.url = ""  # the router's base URL
        self.ctx_urls: list[str] = []  # the workers' base URLs (their /metrics, /server_info)
        self.gen_urls: list[str] = []

    def cluster_yaml(self, ports: Sequence[int]) -> dict[str, Any]:
        router, *workers = ports
        opts = {"cache_transceiver_config": {"backend": "TCP"}, **self.worker_options}
        ctx = [f"127.0.0.1:{p}" for p in workers[:self.num_ctx]]
        gen = [f"127.0.0.1:{p}" for p in workers[self.num_ctx:]]
        return {"hostname": "127.0.0.1", "port": router, "model": self.model_dir,
                "served_model_name": self.name, **opts,
                "context_servers": {"num_instances": len(ctx), "urls": ctx,
                                    "router": {"type": self.policy}},
                "generation_servers": {"num_instances": len(gen), "urls": gen,
                                       "router": {"type": self.policy}}}

    def __enter__(self) -> str:
        import httpx
        import yaml

        socks = []
        for _ in range(1 + self.num_ctx + self.num_gen):  # held together: all distinct
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, "verify-cluster.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(self.cluster_yaml(ports), f, sort_keys=False)
        self._out_path = os.path.join(self.log_dir, "launch.out")
        out = open(self._out_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.cli", "launch", "-c", path, "--log-dir",
             self.log_dir, "--timeout", str(self.timeout_s)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()  # the child holds its own descriptor
        self.url = f"http://127.0.0.1:{ports[0]}"
        self.ctx_urls = [f"http://127.0.0.1:{p}" for p in ports[1:1 + self.num_ctx]]
        self.gen_urls = [f"http://127.0.0.1:{p}" for p in ports[1 + self.num_ctx:]]
        deadline = time.monotonic() + self.timeout_s + 10
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
                       else f"not healthy in {self.timeout_s:g} s")
                self.__exit__(None, None, None)
                raise RuntimeError(f"disagg launch {why}:\n{self.output_tail()}")
            time.sleep(0.2)  # start-up polling, bounded by the deadline

    def output_tail(self, chars: int = 3000) -> str:
        try:
            with open(self._out_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except OSError as e:
            return f"(no launcher output: {e})"

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its children have PR_SET_PDEATHSIG: they get SIGTERM
                self.proc.wait(10)
        self.proc = None


def launch_verifier(model_dir: str, worker_options: dict[str, Any], log_dir: str,
                    timeout_s: float = 300.0, progress: TextIO | None = sys.stderr,
                    ) -> Callable[[RateMatcher, list[dict[str, Any]]], Any]:
    """The ``verify`` callback of ``run_rate_match``: each choice's cluster with ``disagg
    launch``, measured end to end at the choice's concurrency, then stopped."""

    async def verify(m: RateMatcher, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, ch in enumerate(choices):
            _log(progress, f"verify: launching {ch['num_ctx']} context + {ch['num_gen']} "
                           f"generation worker(s)")
            with LaunchedCluster(model_dir, m.cfg.model, ch["num_ctx"], ch["num_gen"],
                                 worker_options, os.path.join(log_dir, f"verify-{i}"),
                                 timeout_s) as url:
                out.append(await m.run_end_to_end(url, ch["concurrency"],
                                                  ch["predicted"]["request_rate"],
                                                  ch["predicted"]["arrivals"]))
        return out

    return verify
