"""PNG plots from saved ``disagg bench serve`` results.

- ``latency_cdf.png``: empirical CDFs of TTFT, TPOT, ITL and E2EL, one line per result file.
- ``throughput_vs_speed.png``: one point per file, x = tokens/s/user (1000 / median TPOT),
  y = output tokens/s (per device with ``devices``); points of a sweep are joined in x order.
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
