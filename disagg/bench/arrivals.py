"""Request arrival processes: Poisson at a request rate, or gamma-distributed gaps whose
burstiness sets how clumped the requests come (1 is Poisson); a fixed concurrency instead is the
runner's ``max_concurrency``, not an arrival process.

Arrival times are offsets in seconds from the benchmark start; the first request goes at 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def inter_arrival_times(n: int, rate: float, burstiness: float = 1.0,
                        seed: int = 0) -> np.ndarray:
    """``n`` gaps between successive requests at ``rate`` requests/s on average.

    Gamma-distributed with shape = ``burstiness`` and scale = 1 / (rate * burstiness): the mean
    is 1/rate whatever the burstiness, the coefficient of variation is 1/sqrt(burstiness).
    burstiness 1 is a Poisson process (exponential gaps); < 1 burstier, > 1 more regular.
    ``rate`` = inf sends everything at once (all gaps 0).
    """
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                    exact_rate: bool = False) -> list[float]:
    """Send times (s) of ``n`` requests: the first at 0, then cumulative gamma gaps.

    ``exact_rate``: scale the gaps so the last request goes at exactly ``(n - 1) / rate``, i.e.
    the sample's realized rate is ``rate``. For Poisson gaps this is a Poisson process
    conditioned on its span (the times in between are uniform order statistics). A short sample
    of a plain Poisson process realizes a rate ~1/sqrt(n) off the nominal one (13% at n = 60),
    which is too much for comparing a measured rate limit with a prediction.
    """
    if n <= 0:
        return []
    gaps = inter_arrival_times(n - 1, rate, burstiness, seed)
    offs = np.cumsum(gaps)
    if exact_rate and n > 1 and math.isfinite(rate) and offs[-1] > 0:
        offs = offs * (((n - 1) / rate) / offs[-1])
    return [0.0, *offs.tolist()]


def trace_offsets(timestamps: Sequence[float]) -> list[float]:
    """Send times (s) replaying trace timestamps (s), relative to the earliest."""
    if not timestamps:
        return []
    t0 = min(timestamps)
    return [t - t0 for t in timestamps]
