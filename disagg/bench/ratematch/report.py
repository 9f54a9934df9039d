"""The rate-match result: building the JSON, the end-of-run tables, saving.

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

import datetime
import json
from dataclasses import asdict
from typing import Any

from disagg.bench.ratematch.config import RESULT_KIND, RESULT_VERSION, RateMatchConfig
from disagg.bench.ratematch.model import gen_points_beside, rate_match


def _config_json(cfg: RateMatchConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d.pop("api_key", None)  # never write secrets to result files
    return d


def build_result(config: RateMatchConfig, model: str, ctx: dict[str, Any],
                 gen: dict[str, Any], agg: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON result (this module's docstring) from the sweeps' outputs: rate-matched
    points and frontier included (empty when no context rate met the SLO); ``verify`` left None."""
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


def describe_arrivals(measured: dict[str, Any]) -> str:
    """How an end-to-end measurement (``run_end_to_end``'s result) loaded the cluster."""
    if measured["arrivals"] == "poisson":
        return f"Poisson {measured['request_rate']:.3f} req/s"
    counts = measured["in_flight_runs"]
    if len(counts) == 2:
        return (f"closed loop, {counts[0]} and {counts[1]} in flight, interpolated to "
                f"{measured['in_flight']:.2f}")
    return f"closed loop, {counts[0]} in flight"


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
