"""The planner at run time: every ``interval_s`` it builds a ``ClusterSnapshot`` from the
router's samples (``Membership.load``) and pools, asks ``planner.decide``, logs and counts the
decision, keeps the last ones for ``/cluster_info``, and carries out a flip with the
``RoleSwitcher`` (in the background: the next intervals see it running and hold).

The window a decision reads starts at the later of ``now - window_s`` and the end of the last
switch (the planner's or an operator's ``POST /admin/role``; ``hysteresis_s`` counts from it
too), so samples taken before a flip never justify the next one (``min_samples`` then makes it
wait for fresh ones). The worker that moves is the donor side's healthy worker with the fewest
of the router's requests in flight (the shortest drain).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from disagg.contracts.roles import Role
from disagg.router.membership import Membership, Worker
from disagg.router.planner import (
    ClusterSnapshot,
    Decision,
    PlannerConfig,
    SideSnapshot,
    decide,
)
from disagg.router.role_switch import RoleSwitcher, SwitchBusy, SwitchRefused

logger = logging.getLogger("disagg.router.planner")

HISTORY = 20  # decisions kept for /cluster_info (and, apart, the flips: holds repeat each
# interval while a side is over SLO and would push the flips out)


class PlannerLoop:
    def __init__(self, config: PlannerConfig, membership: Membership, switcher: RoleSwitcher,
                 on_decision: Callable[[Decision], None] | None = None) -> None:
        self.config = config
        self.membership = membership
        self.switcher = switcher
        self.on_decision = on_decision  # metrics
        self.decisions: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.flips: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.last_snapshot: dict[str, Any] | None = None
        self.started = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._switch_task: asyncio.Task[Any] | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._switch_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.step()
            except Exception:  # one bad interval must not end planning
                logger.exception("planner step failed")

    def snapshot(self, now: float) -> ClusterSnapshot:
        """The cluster as the next decision sees it (module docstring: the window)."""
        last = self.switcher.last_end
        since = max(now - self.config.window_s, self.started, last or 0.0)
        load = self.membership.load

        def side(role: Role) -> SideSnapshot:
            ws = self.membership.candidates(role)
            waits = load.waits_ms(since) if role is Role.GENERATION else []
            return SideSnapshot(len(ws), tuple(load.latencies_ms(role.value, since)),
                                sum(w.active_requests for w in ws), tuple(waits))

        span = max(now - since, 1e-9)
        return ClusterSnapshot(side(Role.CONTEXT), side(Role.GENERATION),
                               load.completed(since) / span, load.mean_tokens(since),
                               switching=self.switcher.running is not None,
                               since_last_flip_s=None if last is None else now - last)

    def step(self, now: float | None = None) -> Decision | None:
        """One interval: decide, record, and start a flip when decided."""
        now = time.monotonic() if now is None else now
        if not self.membership.disaggregated:
            return None  # aggregated workers are left alone
        snap = self.snapshot(now)
        self.last_snapshot = _public_snapshot(self.config, snap)
        for role in (Role.CONTEXT, Role.GENERATION):  # the workers' own word (not decided on)
            used = [w.kv_blocks_used for w in self.membership.pools[role]
                    if w.kv_blocks_used is not None]
            self.last_snapshot[role.value]["kv_blocks_used"] = sum(used) if used else None
        decision = decide(self.config, snap)
        if decision is None:
            return None
        worker = None
        if decision.action == "flip":
            worker = self._donor(Role(decision.from_role))
            if worker is None:
                decision = Decision("hold", f"no {decision.from_role} worker can switch now",
                                    decision.from_role, decision.to_role, decision.details)
        self._record(decision, worker)
        if worker is not None:
            assert decision.to_role is not None
            self._switch_task = asyncio.get_running_loop().create_task(
                self._flip(worker, decision.to_role))
        return decision

    async def _flip(self, worker: Worker, role: str) -> None:
        try:
            await self.switcher.switch(worker, role, self.config.switch_timeout_s)
        except (SwitchBusy, SwitchRefused) as e:  # an operator's switch came first
            logger.warning("planner: flip of %s not started: %s", worker.url, e)

    def _donor(self, role: Role) -> Worker | None:
        ws = [w for w in self.membership.candidates(role)
              if w.switching is None and w.role == role.value]
        return min(ws, key=lambda w: w.active_requests, default=None)

    def _record(self, d: Decision, worker: Worker | None) -> None:
        entry = {"time": time.time(), **d.public(),
                 "worker": None if worker is None else worker.url}
        self.decisions.append(entry)
        if d.action == "flip":
            self.flips.append(entry)
        log = logger.warning if d.action == "flip" else logger.info
        log("planner: %s%s: %s", d.action,
            f" {worker.url} {d.from_role} -> {d.to_role}" if worker else "", d.reason)
        if self.on_decision is not None:
            self.on_decision(d)

    def public(self) -> dict[str, Any]:
        """``/cluster_info``'s ``planner``."""
        return {"config": self.config.public(), "state": self.last_snapshot,
                "switch": self.switcher.public(),
                "decisions": list(reversed(self.decisions)),
                "flips": list(reversed(self.flips))}


def _public_snapshot(config: PlannerConfig, snap: ClusterSnapshot) -> dict[str, Any]:
    q = config.percentile

    def side(s: SideSnapshot) -> dict[str, Any]:
        return {"workers": s.workers, "samples": len(s.latencies_ms), "in_flight": s.in_flight,
                f"p{q:g}_ms": s.percentile_ms(q), f"wait_p{q:g}_ms": s.wait_percentile_ms(q)}

    return {"context": side(snap.context), "generation": side(snap.generation),
            "rate": snap.rate, "mean_max_tokens": snap.osl, "switching": snap.switching,
            "since_last_flip_s": snap.since_last_flip_s}
