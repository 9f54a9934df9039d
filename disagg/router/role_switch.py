"""One worker changes sides: the router's half of a role switch (the worker's half is its
``POST /admin/role``; ``/work/notes`` contract: 202 draining, then ``/server_info`` shows
``role_switch`` until done).

Flow (``RoleSwitcher.switch``): the worker leaves rotation first (``Worker.switching``: no new
request of either type is routed to it; those in flight finish, the worker drains them), then
the router POSTs ``/admin/role`` (signed with the cluster token), then polls ``/server_info``
with backoff (``POLL_FIRST_S`` doubling up to ``POLL_MAX_S``) until ``role_switch`` is null
and ``role`` is the target, within ``timeout_s``; then it moves the worker into the target pool
(``Membership.move``, static YAML workers included) and checks its health, which puts it back
in rotation. On a refusal, an error or the deadline: logged, counted, and the worker goes to
the pool its ``/server_info`` says it serves (its old one when that cannot be read). One switch
at a time (``SwitchBusy`` otherwise).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from disagg.contracts.roles import Role
from disagg.router.membership import Membership, Worker

logger = logging.getLogger("disagg.router")

ADMIN_ROLE_PATH = "/admin/role"
POLL_FIRST_S = 0.05
POLL_MAX_S = 1.0
CALL_TIMEOUT_S = 10.0
HISTORY = 20  # switches kept for /cluster_info


class SwitchBusy(RuntimeError):
    """Another role switch is running."""


class SwitchRefused(ValueError):
    """The switch cannot start (the message says why; an operator's 4xx)."""


@dataclass(frozen=True)
class SwitchResult:
    url: str
    from_role: str
    to_role: str
    outcome: str  # done | failed | timeout
    detail: str
    duration_s: float
    pool: str  # where the worker is now
    finished_at: float  # unix time

    def public(self) -> dict[str, Any]:
        return {"object": "role_switch", "url": self.url, "from": self.from_role,
                "to": self.to_role, "state": self.outcome, "detail": self.detail,
                "duration_s": round(self.duration_s, 3), "pool": self.pool,
                "finished_at": self.finished_at}


def pool_of(role: Any) -> Role | None:
    """The pool that serves a worker reporting ``role`` (None: not a disaggregated role)."""
    return {"context": Role.CONTEXT, "generation": Role.GENERATION}.get(role)


class RoleSwitcher:
    """Runs role switches over a membership (one at a time); keeps the last ones."""

    def __init__(self, membership: Membership,
                 on_done: Any = None) -> None:
        self.membership = membership
        self.on_done = on_done  # called with each SwitchResult (metrics)
        self.running: dict[str, Any] | None = None
        self.history: list[SwitchResult] = []
        self.last_end: float | None = None  # monotonic end of the last successful switch

    def check(self, w: Worker, role: str) -> None:
        """SwitchRefused / SwitchBusy when ``w`` cannot switch to ``role`` now."""
        if pool_of(role) is None:
            raise SwitchRefused(f"role: must be context or generation, got {role!r}")
        if not self.membership.disaggregated:
            raise SwitchRefused("url: the cluster is aggregated (no context pool to switch to)")
        if w.role == Role.AGGREGATED:
            raise SwitchRefused(f"url: {w.url} is an aggregated worker (no KV transfer: it "
                                f"cannot switch)")
        if self.running is not None:
            raise SwitchBusy(f"a role switch is running ({self.running['url']} -> "
                             f"{self.running['to']})")

    async def switch(self, w: Worker, role: str, timeout_s: float) -> SwitchResult:
        """Switch ``w`` to ``role`` (module docstring); the result says how it ended."""
        self.check(w, role)
        target = pool_of(role)
        assert target is not None
        t0 = time.monotonic()
        from_role = str(w.role or w.pool)
        self.running = {"url": w.url, "from": from_role, "to": role, "since": time.time()}
        w.switching = role
        w.healthy, w.reason = False, f"switching role to {role}"
        outcome, detail = "failed", "cancelled (router stopping)"
        pool: Role = w.pool  # where it goes unless told otherwise
        try:
            outcome, detail = await self._run(w, role, t0 + timeout_s)
            pool = target if outcome == "done" else await self._where(w)
        finally:
            w.switching = None
            self.membership.move(w, pool)
            self.running = None
            result = SwitchResult(w.url, from_role, role, outcome, detail,
                                  time.monotonic() - t0, pool, time.time())
            self.history = [*self.history[-(HISTORY - 1):], result]
            if outcome == "done":
                self.last_end = time.monotonic()
            (logger.info if outcome == "done" else logger.warning)(
                "role switch %s %s -> %s: %s (%s, %.2f s)", w.url, from_role, role, outcome,
                detail, result.duration_s)
            if self.on_done is not None:
                self.on_done(result)
        current = self.membership.by_url.get(w.url)
        if current is not None:
            await self.membership.check(current)  # back in rotation now, not next round
        return result

    async def _run(self, w: Worker, role: str, deadline: float) -> tuple[str, str]:
        """POST /admin/role, then poll until done: (outcome, detail)."""
        body = json.dumps({"role": role}).encode()
        headers = {"Content-Type": "application/json",
                   **self.membership.auth.headers(w.pool, "POST", ADMIN_ROLE_PATH, body,
                                                 audience=w.member_id)}
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        try:
            async with self.membership.session.post(w.base + ADMIN_ROLE_PATH, data=body,
                                                    headers=headers, timeout=timeout) as r:
                text = await r.read()
                if r.status not in (200, 202):
                    return "failed", f"/admin/role answered {r.status}: {_message(text)}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return "failed", f"/admin/role: {type(e).__name__}: {e}"
        delay = POLL_FIRST_S
        while True:
            info = await self._server_info(w)
            if info is not None and info.get("role") == role and not info.get("role_switch"):
                return "done", f"{w.url} serves {role}"
            now = time.monotonic()
            if now >= deadline:
                state = None if info is None else info.get("role_switch")
                return "timeout", f"not done within the deadline (last role_switch: {state})"
            await asyncio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, POLL_MAX_S)

    async def _server_info(self, w: Worker) -> dict[str, Any] | None:
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        try:
            async with self.membership.session.get(
                    w.base + "/server_info", timeout=timeout,
                    headers=self.membership.auth.headers(w.pool, "GET", "/server_info",
                                                         audience=w.member_id)) as r:
                if r.status != 200:
                    return None
                info = await r.json()
                return info if isinstance(info, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def _where(self, w: Worker) -> Role:
        """The pool a worker belongs in by its own word (its current pool when unknown)."""
        info = await self._server_info(w)
        return pool_of((info or {}).get("role")) or w.pool

    def public(self) -> dict[str, Any]:
        return {"running": self.running,
                "recent": [r.public() for r in reversed(self.history)]}


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except Exception:
        return body[:300].decode(errors="replace")
