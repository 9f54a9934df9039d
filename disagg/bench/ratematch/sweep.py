"""The measurements of a rate-match: ``RateMatcher`` runs the context probes, the generation
and aggregated concurrency points and the end-to-end runs of verify against live workers."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from disagg.bench.client import (
    ENDPOINT_PATHS,
    RequestSpec,
    Transport,
    normalize_base_url,
    send_request,
)
from disagg.bench.datasets import SampleRequest, TokenizerLike, sample_random
from disagg.bench.metrics import RequestRecord, percentile_key
from disagg.bench.ratematch.config import RateMatchConfig
from disagg.bench.ratematch.model import pareto_frontier
from disagg.bench.runner import BenchmarkConfig, BenchmarkError, run_benchmark


def served_rate(records: Sequence[RequestRecord]) -> float | None:
    """Requests/s a worker completed during a run: (completed - 1) over the span from the first
    to the last completion; None with fewer than two completions (or no span)."""
    ends = sorted(r.start + r.e2el for r in records if r.success)
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return None
    return (len(ends) - 1) / (ends[-1] - ends[0])


def context_rate(probes: Sequence[dict[str, Any]]) -> float | None:
    """The context worker's rate within the TTFT SLO: the highest ``min(offered, served)``
    over the passing probes (package docstring, 1), or None when none passed."""
    rates = [min(p["rate"], p["served_rate"]) if p.get("served_rate") else p["rate"]
             for p in probes if p["passed"]]
    return max(rates) if rates else None


def note(stream: TextIO | None, msg: str) -> None:
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
        note(self.progress, f"context: {rate:.3g} req/s x {n}: TTFT {self.pkey} {ttft:.0f} ms "
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
        note(self.progress, f"context: {'none' if ctx_rate is None else f'{ctx_rate:.3g}'} "
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
        note(self.progress, f"{label}: concurrency {concurrency} x {n}: "
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
        worker serves that load (package docstring, 2b), its figures under ``"context"``."""
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
        note(self.progress, f"context load: {len(records)} requests in {offered_s:.1f} s "
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
        """Full requests through a router, the measured side of verify (package docstring, 5).

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
        note(self.progress, f"end to end: {how} x {n}: {tput:.1f} tok/s steady "
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
