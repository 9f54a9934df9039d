"""The rate-match arithmetic: pure functions of measured points (no I/O).

Points are the dicts the sweeps of ``disagg bench rate-match`` record
(``disagg.bench.ratematch.sweep``); that package's docstring says what each prediction
assumes. It lives outside the benchmark package so that the router's planner
(``disagg.router.planner``) uses the same model without importing the benchmark;
``disagg.bench.ratematch.model`` re-exports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any


def tput_per_device(gen_output_tps: float, osl: int, ctx_rate: float, ctx_devices: float = 1.0,
                    gen_devices: float = 1.0) -> float:
    """Output tokens/s per device of a rate-matched cluster: one generation worker's output
    tokens/s over the devices it uses plus those of the fractional number of context workers
    (``gen_request_rate / ctx_rate`` of them) that together prefill as many requests per second
    as it decodes."""
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
    """The rate-matched point of every generation point (see the package docstring, 3)."""
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
    requests/s (package docstring, 2b): the isolated points when the run measured no
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
