"""The cluster YAML's ``planner:`` section (``PlannerConfig``, checked on construction) and the
capacity prior it may name (``RateMatchPrior``, a saved ``disagg bench rate-match`` result).
The planner itself is the router's (``router/planner.py``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg.contracts.roles import Role


class PlannerConfigError(ValueError):
    """An invalid planner setting; the message starts with the field's name."""


@dataclass(frozen=True)
class RateMatchPrior:
    """The capacity prior from a saved ``bench rate-match`` JSON."""

    ctx_rate: float  # requests/s one context worker serves within its TTFT SLO
    gen_points: tuple[Mapping[str, Any], ...]  # the generation sweep's points
    osl: int  # the output length the generation points were measured with

    @classmethod
    def from_result(cls, result: Mapping[str, Any]) -> RateMatchPrior:
        """From a rate-match result; PlannerConfigError naming what is missing."""
        if result.get("kind") != "disagg-bench-rate-match":
            raise PlannerConfigError("rate_match_json: not a `disagg bench rate-match` result "
                                     f"(kind {result.get('kind')!r})")
        ctx_rate = (result.get("context") or {}).get("ctx_rate")
        points = (result.get("generation") or {}).get("points") or []
        osl = (result.get("config") or {}).get("osl")
        if not isinstance(ctx_rate, int | float) or ctx_rate <= 0:
            raise PlannerConfigError("rate_match_json: context.ctx_rate is missing (no probe "
                                     "passed the TTFT SLO in that run)")
        if not points or not isinstance(osl, int) or osl <= 0:
            raise PlannerConfigError("rate_match_json: generation.points or config.osl missing")
        return cls(float(ctx_rate), tuple(dict(p) for p in points), osl)

    def gen_rate_at_tpot(self, tpot_slo_ms: float) -> float:
        """Highest requests/s one generation worker served with mean TPOT within the SLO."""
        rates = [float(p["output_throughput"]) / self.osl for p in self.gen_points
                 if p.get("completed", 1) and p.get("mean_tpot_ms") is not None
                 and float(p["mean_tpot_ms"]) <= tpot_slo_ms]
        return max(rates, default=0.0)


@dataclass(frozen=True)
class PlannerConfig:
    """The YAML ``planner:`` section (validated here; ``config`` names the file)."""

    ttft_slo_ms: float
    tpot_slo_ms: float
    enabled: bool = False  # ``--planner`` or ``planner.enabled: true``
    interval_s: float = 10.0  # between decisions
    min_per_role: int = 1  # never fewer workers on a side
    hysteresis_s: float = 60.0  # no flip within this long of the previous flip's end
    window_s: float = 60.0  # samples older than this are not read
    min_samples: int = 20  # per side, in the window, before anything is decided
    percentile: float = 90.0  # of the latency samples compared with the SLOs
    headroom: float = 0.2  # the side losing a worker keeps this share of spare capacity
    switch_timeout_s: float = 120.0  # a switch not done by then is abandoned (drain deadline)
    rate_match_json: str | None = None
    prior: RateMatchPrior | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        positive = {"ttft_slo_ms": self.ttft_slo_ms, "tpot_slo_ms": self.tpot_slo_ms,
                    "interval_s": self.interval_s, "window_s": self.window_s,
                    "switch_timeout_s": self.switch_timeout_s}
        for name, value in positive.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or not (
                    value > 0 and math.isfinite(value)):
                raise PlannerConfigError(f"{name}: must be a positive number, got {value!r}")
        for name, value in (("hysteresis_s", self.hysteresis_s), ("headroom", self.headroom)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not (
                    value >= 0 and math.isfinite(value)):
                raise PlannerConfigError(f"{name}: must be a number >= 0, got {value!r}")
        for name, value, low in (("min_per_role", self.min_per_role, 1),
                                 ("min_samples", self.min_samples, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise PlannerConfigError(f"{name}: must be an integer >= {low}, got {value!r}")
        if not isinstance(self.percentile, int | float) or not 0 < self.percentile <= 100:
            raise PlannerConfigError(f"percentile: must be in (0, 100], got {self.percentile!r}")
        if self.window_s < self.interval_s:
            raise PlannerConfigError(f"window_s: {self.window_s} is shorter than interval_s "
                                     f"({self.interval_s}): samples would be missed")

    def slo_ms(self, side: str) -> float:
        return self.ttft_slo_ms if side == Role.CONTEXT else self.tpot_slo_ms

    def public(self) -> dict[str, Any]:
        """As shown in ``/cluster_info``."""
        return {"enabled": self.enabled, "ttft_slo_ms": self.ttft_slo_ms,
                "tpot_slo_ms": self.tpot_slo_ms, "interval_s": self.interval_s,
                "min_per_role": self.min_per_role, "hysteresis_s": self.hysteresis_s,
                "window_s": self.window_s, "min_samples": self.min_samples,
                "percentile": self.percentile, "headroom": self.headroom,
                "switch_timeout_s": self.switch_timeout_s,
                "rate_match_json": self.rate_match_json}
