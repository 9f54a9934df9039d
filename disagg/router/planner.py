"""The planner's decision: should one worker change sides (context <-> generation)? Pure: no I/O,
no clock; ``planner_loop`` feeds it snapshots and carries out what it decides.

Signals (per side, over the last ``window_s`` seconds, measured by the router itself):

- context side: the latency of each context call (the router sends it, the context worker
  prefills and answers with the first token): the router's view of TTFT, in ms;
- generation side: the router's view of TPOT, in ms: for a streamed answer, the time from its
  first bytes to its end over the tokens after the first (``max_tokens - 1``), which leaves
  out the KV pull (slowed by the context side's load, not the generation side's) and keeps any
  wait for a decode slot; for a whole answer, the call's duration over ``max_tokens`` (pull
  included). A request that stops early makes it smaller, so the generation side is
  under-read, never over-read;
- ``rate``: disaggregated requests completed per second over the window (the arrival rate in
  a steady state); the workers of each side in rotation; the router's requests in flight.

Definitions:

- a side is **over SLO** when it has at least ``min_samples`` samples in the window and their
  ``percentile`` (p90 by default) exceeds its SLO (``ttft_slo_ms`` for context,
  ``tpot_slo_ms`` for generation); the generation side is also over SLO when the wait of its
  streamed calls for their first bytes (KV pull + a free decode slot: its own part of the
  client's TTFT) alone exceeds ``ttft_slo_ms`` at that percentile: a generation worker at its
  batch limit queues requests, which shows there and not in TPOT;
- a side has **slack** when it can lose one worker and still serve the observed rate with
  ``headroom`` to spare: ``(n - 1) * capacity_per_worker >= rate * (1 + headroom)``, and the
  loss leaves it ``min_per_role`` workers. ``capacity_per_worker`` is the side's requests/s
  per worker at its SLO: with a rate-match prior (``bench rate-match`` JSON) the context
  side's ``ctx_rate`` and, for the generation side, the highest measured request rate whose
  mean TPOT meets ``tpot_slo_ms``; without one, the live estimate ``rate_per_worker * SLO /
  observed percentile`` (latency taken as proportional to load below the SLO: crude, and it
  errs high when the side is nearly idle, which ``min_samples`` and ``headroom`` temper).
  With a prior the flipped cluster is also checked with the rate-match model
  (``predict_at_rate``): it must sustain the rate, and its predicted TPOT meet the SLO;
- the **bottleneck** is the side over SLO; a flip moves one worker from the other side to it
  when that side has slack.

Rules (conservative by construction): no flip while a switch runs; none within
``hysteresis_s`` of the last flip's end; none when either side lacks ``min_samples``; none when
both sides are over SLO (moving a worker would only move the problem); never below
``min_per_role``. When a side is over SLO and no flip is made, the decision says why
(``action: hold``); when no side is over SLO there is no decision (None).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.contracts.planner_config import PlannerConfig
from disagg.contracts.roles import Role
from disagg.ratematch_model import predict_at_rate

CONTEXT, GENERATION = Role.CONTEXT, Role.GENERATION
SIDES = (CONTEXT, GENERATION)


@dataclass(frozen=True)
class SideSnapshot:
    """One side over the window."""

    workers: int  # in rotation
    latencies_ms: tuple[float, ...]  # TTFT (context) or TPOT (generation) samples
    in_flight: int = 0  # the router's requests on the side's workers now
    # Generation only: streamed calls' waits for their first bytes (KV pull + decode slot).
    waits_ms: tuple[float, ...] = ()

    def wait_percentile_ms(self, q: float) -> float | None:
        return _nearest_rank(self.waits_ms, q)

    def percentile_ms(self, q: float) -> float | None:
        """Nearest-rank percentile of the samples (None without any)."""
        return _nearest_rank(self.latencies_ms, q)


def _nearest_rank(samples: Sequence[float], q: float) -> float | None:
    if not samples:
        return None
    xs = sorted(samples)
    # rank ceil(q/100 * n) in 1..n -> index rank - 1 in 0..n-1
    return xs[max(0, math.ceil(q / 100.0 * len(xs)) - 1)]


@dataclass(frozen=True)
class ClusterSnapshot:
    context: SideSnapshot
    generation: SideSnapshot
    rate: float  # disaggregated requests completed per second over the window
    osl: float | None = None  # mean requested output tokens (None: unknown)
    switching: bool = False  # a role switch is running
    since_last_flip_s: float | None = None  # since the last flip ended (None: never)

    def side(self, name: str) -> SideSnapshot:
        return self.context if name == CONTEXT else self.generation


@dataclass(frozen=True)
class Decision:
    action: str  # flip | hold
    reason: str
    from_role: str | None = None  # the side that loses a worker (flip)
    to_role: str | None = None  # the side that gains it
    details: Mapping[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        return {"action": self.action, "from_role": self.from_role, "to_role": self.to_role,
                "reason": self.reason, "details": dict(self.details)}


def other(side: str) -> str:
    return GENERATION if side == CONTEXT else CONTEXT


def capacity_per_worker(config: PlannerConfig, snap: ClusterSnapshot, side: str
                        ) -> float | None:
    """Requests/s one worker of ``side`` serves within its SLO (see the module docstring);
    None when the live estimate has nothing to go on."""
    if config.prior is not None:
        return (config.prior.ctx_rate if side == CONTEXT
                else config.prior.gen_rate_at_tpot(config.tpot_slo_ms))
    s = snap.side(side)
    p = s.percentile_ms(config.percentile)
    if not s.workers or not p or snap.rate <= 0:
        return None
    return snap.rate / s.workers * config.slo_ms(side) / p


def _over(config: PlannerConfig, snap: ClusterSnapshot) -> dict[str, float]:
    """The sides over SLO -> their percentile (ms): context when its calls' p > ttft_slo;
    generation when its TPOT p > tpot_slo, or when its own part of the TTFT (the wait for the
    first bytes: pull + a decode slot) alone has p > ttft_slo (requests queueing for decode
    slots show there, not in TPOT)."""
    out = {}
    for side in SIDES:
        p = snap.side(side).percentile_ms(config.percentile)
        if p is not None and p > config.slo_ms(side):
            out[side] = p
    w = snap.generation.wait_percentile_ms(config.percentile)
    if GENERATION not in out and w is not None and w > config.ttft_slo_ms:
        out[GENERATION] = w
    return out


def _prior_check(config: PlannerConfig, snap: ClusterSnapshot, donor: str) -> str | None:
    """With a prior: why the flipped cluster would not serve the rate (None: it would)."""
    prior = config.prior
    if prior is None:
        return None
    n_ctx, n_gen = snap.context.workers, snap.generation.workers
    n_ctx, n_gen = (n_ctx - 1, n_gen + 1) if donor == CONTEXT else (n_ctx + 1, n_gen - 1)
    osl = max(1, round(snap.osl)) if snap.osl else prior.osl
    pred = predict_at_rate(prior.ctx_rate, list(prior.gen_points), osl, n_ctx, n_gen,
                           snap.rate)
    if not pred["sustainable"]:
        return (f"rate-match model: {n_ctx} context + {n_gen} generation workers serve "
                f"{pred['capacity_request_rate']:.3g} req/s < {snap.rate:.3g} ({pred['bound']} "
                f"bound)")
    tpot = pred["mean_tpot_ms"]
    if tpot is not None and tpot > config.tpot_slo_ms:
        return (f"rate-match model: predicted TPOT {tpot:.3g} ms > tpot_slo_ms "
                f"{config.tpot_slo_ms:g} with {n_gen} generation workers")
    return None


def decide(config: PlannerConfig, snap: ClusterSnapshot) -> Decision | None:
    """The decision for one interval (module docstring); None when no side is over SLO."""
    for side in SIDES:
        n = len(snap.side(side).latencies_ms)
        if n < config.min_samples:
            over = _over(config, snap)
            if not over:
                return None
            return Decision("hold", f"too few samples: {n} {side} samples in the window, "
                            f"min_samples is {config.min_samples}", details={"samples": n})
    over = _over(config, snap)
    if not over:
        return None
    details: dict[str, Any] = {f"{s}_p{config.percentile:g}_ms": v for s, v in over.items()}
    wait = snap.generation.wait_percentile_ms(config.percentile)
    if wait is not None:
        details[f"generation_wait_p{config.percentile:g}_ms"] = wait
    details["rate"] = snap.rate
    if len(over) == 2:
        return Decision("hold", "both sides are over their SLO: moving a worker would only "
                        "move the bottleneck", details=details)
    (target,) = over
    donor = other(target)
    hold = _hold_reason(config, snap, donor, details)
    if hold is not None:
        return Decision("hold", hold, donor, target, details)
    tpot = snap.generation.percentile_ms(config.percentile)
    by_wait = target == GENERATION and not (tpot is not None and tpot > config.tpot_slo_ms)
    what, slo = (("wait for first bytes ", config.ttft_slo_ms) if by_wait
                 else ("", config.slo_ms(target)))
    return Decision("flip", f"{target} is the bottleneck ({what}p{config.percentile:g} "
                    f"{over[target]:.3g} ms > SLO {slo:g} ms) and {donor} has slack",
                    donor, target, details)


def _hold_reason(config: PlannerConfig, snap: ClusterSnapshot, donor: str,
                 details: dict[str, Any]) -> str | None:
    """Why one worker of ``donor`` must not move now (None: it may); fills ``details``."""
    if snap.switching:
        return "a role switch is still running"
    if snap.since_last_flip_s is not None and snap.since_last_flip_s < config.hysteresis_s:
        return (f"hysteresis: the last flip ended {snap.since_last_flip_s:.3g} s ago "
                f"(hysteresis_s {config.hysteresis_s:g})")
    n = snap.side(donor).workers
    if n - 1 < config.min_per_role:
        return f"min_per_role: {donor} has {n} worker(s), min_per_role is {config.min_per_role}"
    cap = capacity_per_worker(config, snap, donor)
    need = snap.rate * (1.0 + config.headroom)
    details[f"{donor}_capacity_per_worker"] = cap
    if cap is None:
        return f"no capacity estimate for {donor} (no completed requests in the window)"
    if (n - 1) * cap < need:
        return (f"{donor} has no slack: {n - 1} worker(s) x {cap:.3g} req/s < {snap.rate:.3g} "
                f"req/s x (1 + headroom {config.headroom:g})")
    return _prior_check(config, snap, donor)


def snapshot_side(workers: int, samples: Sequence[float], in_flight: int = 0,
                  waits: Sequence[float] = ()) -> SideSnapshot:
    """A ``SideSnapshot`` from any sequence of samples."""
    return SideSnapshot(workers, tuple(samples), in_flight, tuple(waits))
