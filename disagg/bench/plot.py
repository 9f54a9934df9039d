"""PNG plots from saved ``disagg bench serve`` results.

- ``latency_cdf.png``: empirical CDFs of TTFT, TPOT, ITL and E2EL, one line per result file.
- ``throughput_vs_speed.png``: one point per file, x = tokens/s/user (1000 / median TPOT),
  y = output tokens/s (per device with ``devices``); points of a sweep are joined in x order.
- ``plot_rate_match``: a ``disagg bench rate-match`` result: x = tokens/s/user, y = output
  tokens/s per device; every rate-matched point (labelled with its concurrency and ctx:gen
  ratio), the rate-matched Pareto frontier (co-located results: also the frontier of the
  sides measured alone), the aggregated baseline and its frontier, the
  end-to-end (verify) points joined to their predictions, and any extra series a script adds.
- ``plot_rate_match_layouts``: a layout sweep (``rate-match --ctx-layouts``): the same axes,
  each (context layout, generation layout) pair's rate-matched points, the frontier over all
  pairs (each of its points labelled with its pair), the aggregated baseline.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from disagg.bench.metrics import LATENCY_METRICS

_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def _label(path: str, result: dict[str, Any]) -> str:
    cfg = result.get("config", {})
    parts = [os.path.splitext(os.path.basename(path))[0]]
    rate = cfg.get("request_rate")
    if rate not in (None, "inf") and not (isinstance(rate, float) and math.isinf(rate)):
        parts.append(f"{float(rate):g} req/s")
    if cfg.get("max_concurrency"):
        parts.append(f"conc {cfg['max_concurrency']}")
    return ", ".join(parts)


def _metric_values(result: dict[str, Any], metric: str) -> list[float]:
    ok = [r for r in result.get("requests", []) if r.get("success")]
    if metric == "itl":
        return [x for r in ok for x in r.get("itl_ms", [])]
    key = f"{metric}_ms"
    return [r[key] for r in ok if r.get(key) is not None]


def plot_results(results: Sequence[tuple[str, dict[str, Any]]], out_dir: str,
                 devices: float = 1.0, title: str | None = None) -> list[str]:
    """Write the PNGs for ``(path, result)`` pairs into ``out_dir``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric in zip(axes.flat, LATENCY_METRICS, strict=True):
        for path, res in results:
            vals = np.sort(np.asarray(_metric_values(res, metric), dtype=float))
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post",
                        label=_label(path, res))
        ax.set_title(_TITLES[metric])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8)
    fig.suptitle(title or "Latency CDFs")
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    path = os.path.join(out_dir, "latency_cdf.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    points = []
    for p, res in results:
        s = res.get("summary", {})
        tpot = s.get("median_tpot_ms") or 0.0
        if tpot > 0:
            points.append((1000.0 / tpot, s.get("output_throughput", 0.0) / devices,
                           _label(p, res)))
    fig, ax = plt.subplots(figsize=(7, 5))
    if points:
        points.sort()
        xs, ys, labels = zip(*points, strict=True)
        ax.plot(xs, ys, "o-" if len(points) > 1 else "o")
        for x, y, lab in points:
            ax.annotate(lab, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    else:
        ax.text(0.5, 0.5, "no result has a TPOT (all outputs <= 1 token?)",
                ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("tokens/s/user (1000 / median TPOT ms)")
    ax.set_ylabel("output tokens/s" + (f" per device ({devices:g} devices)" if devices != 1
                                       else ""))
    ax.set_title(title or "Throughput vs per-user speed")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, "throughput_vs_speed.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def _xy(points: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """(tokens/s/user, tokens/s per device) of rate-match points, as two lists."""
    return ([p["tokens_per_s_per_user"] for p in points], [p["tput_per_device"] for p in points])


def _draw_rate_matched(ax: Any, result: dict[str, Any]) -> None:
    """The rate-matched points and frontier (co-located: also each side measured alone)."""
    rm = result.get("rate_matched") or []
    if rm:
        ax.scatter(*_xy(rm), s=18, color="tab:blue", alpha=0.45, label="rate-matched points")
        for p in rm:
            ax.annotate(f"c{p['concurrency']} {p['ctx_per_gen']:.2f}:1",
                        (p["tokens_per_s_per_user"], p["tput_per_device"]),
                        textcoords="offset points", xytext=(4, 3), fontsize=6, color="tab:blue")
    front = result.get("frontier") or []
    gen = result.get("generation") or {}
    colocated = bool(gen.get("colocated"))
    if front:
        ax.plot(*_xy(front), "o-", color="tab:blue", lw=2,
                label="rate-matched frontier (disaggregated"
                      + (", co-located)" if colocated else ")"))
    ctx_rate = (result.get("context") or {}).get("ctx_rate")
    if colocated and ctx_rate:  # the same curve from each side measured alone
        from disagg.bench.ratematch.model import pareto_frontier, rate_match

        cfg = result.get("config", {})
        alone = rate_match(ctx_rate, gen["points"], cfg["osl"], cfg.get("ctx_devices", 1.0),
                           cfg.get("gen_devices", 1.0))
        xy = [(p["tokens_per_s_per_user"], p["tput_per_device"]) for p in alone]
        fx, fy = zip(*(xy[i] for i in pareto_frontier(xy)), strict=True)
        ax.plot(fx, fy, "o--", color="tab:blue", lw=1, alpha=0.5, ms=4,
                label="rate-matched frontier, each side measured alone")


def _draw_aggregated(ax: Any, agg: dict[str, Any]) -> None:
    """The aggregated baseline: points within the TTFT SLO filled, the others hollow."""
    pts = sorted(agg["points"], key=lambda p: p["tokens_per_s_per_user"])
    ok = [p for p in pts if p.get("meets_ttft_slo", True)]
    miss = [p for p in pts if not p.get("meets_ttft_slo", True)]
    if ok:
        ax.scatter(*_xy(ok), color="tab:orange", s=22, label="aggregated")
    if miss:
        ax.scatter(*_xy(miss), facecolors="none", edgecolors="tab:orange", s=22,
                   label="aggregated (misses TTFT SLO)")
    af = agg.get("frontier") or []
    if af:
        ax.plot(*_xy(af), "o-", color="tab:orange", lw=2, label="aggregated frontier")


def _draw_verify(ax: Any, verify: Sequence[dict[str, Any]]) -> None:
    """End-to-end points, each joined to its prediction by a dotted line."""
    for i, v in enumerate(verify):
        pr, me = v["predicted"], v["measured"]
        ax.plot([pr["tokens_per_s_per_user"], me["tokens_per_s_per_user"]],
                [pr["tput_per_device"], me["tput_per_device"]], ":", color="tab:red", lw=1)
        ax.scatter([me["tokens_per_s_per_user"]], [me["tput_per_device"]], marker="*", s=110,
                   color="tab:red", zorder=5, label="end to end" if i == 0 else None)
        ax.annotate(f"{v['num_ctx']}ctx+{v['num_gen']}gen c{v['concurrency']}",
                    (me["tokens_per_s_per_user"], me["tput_per_device"]),
                    textcoords="offset points", xytext=(5, -10), fontsize=7, color="tab:red")


def _draw_extra(ax: Any, extra_series: Sequence[tuple[str, Sequence[tuple[float, float]]]]
                ) -> None:
    markers = "sDv^P"
    colors = ("tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")  # not the above
    for i, (label, series) in enumerate(extra_series):
        pts = sorted(series)
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker=markers[i % len(markers)], ls="--", lw=1,
                    color=colors[i % len(colors)], label=label)


def plot_rate_match(result: dict[str, Any], path: str, title: str | None = None,
                    extra_series: Sequence[tuple[str, Sequence[tuple[float, float]]]] = (),
                    ) -> str:
    """Write the rate-match PNG to ``path`` (see the module docstring); returns ``path``.

    ``extra_series``: ``(label, [(tokens/s/user, tokens/s per device), ...])`` drawn as
    markers joined in x order (e.g. end-to-end rate sweeps of a recorded benchmark).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    _draw_rate_matched(ax, result)
    if result.get("aggregated"):
        _draw_aggregated(ax, result["aggregated"])
    _draw_verify(ax, result.get("verify") or [])
    _draw_extra(ax, extra_series)
    return _save_rate_plot(fig, ax, path, title, "Rate-matched throughput",
                           result.get("config", {}), 8)


def _save_rate_plot(fig: Any, ax: Any, path: str, title: str | None, what: str,
                    cfg: dict[str, Any], legend_size: int) -> str:
    """Axes, title (the workload and SLO), legend; ``path`` written, the figure closed."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("tokens/s/user (1000 / mean TPOT ms)")
    ax.set_ylabel("output tokens/s per device")
    ax.set_title(title or f"{what} (isl {cfg.get('isl')}, osl {cfg.get('osl')}, "
                          f"TTFT p{cfg.get('ttft_percentile', 90):g} <= "
                          f"{cfg.get('ttft_slo_ms', 0):g} ms)", fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend_size, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rate_match_layouts(result: dict[str, Any], path: str, title: str | None = None) -> str:
    """Write a layout sweep's PNG to ``path`` (see the module docstring); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for pair in result.get("pairs") or []:
        if pair["rate_matched"]:
            spec = f" spec {pair['generation_spec']}" if "generation_spec" in pair else ""
            ax.plot(*_xy(pair["rate_matched"]), "o:", ms=4, lw=1, alpha=0.6,
                    label=f"ctx {pair['context_layout']} | gen {pair['generation_layout']}"
                          f"{spec}")
    front = result.get("frontier") or []
    if front:
        ax.plot(*_xy(front), "-", color="black", lw=2, label="frontier over all pairs")
        for p in front:
            spec = f" {p['generation_spec']}" if "generation_spec" in p else ""
            ax.annotate(f"{p['context_layout']}|{p['generation_layout']}{spec} "
                        f"c{p['concurrency']}",
                        (p["tokens_per_s_per_user"], p["tput_per_device"]),
                        textcoords="offset points", xytext=(4, 3), fontsize=6)
    if result.get("aggregated"):
        _draw_aggregated(ax, result["aggregated"])
    return _save_rate_plot(fig, ax, path, title, "Rate-matched throughput by layout",
                           result.get("config", {}), 7)
