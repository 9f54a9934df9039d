"""A worker's run-time role switch: ``POST /admin/role {"role": "context" | "generation"}``.

States of one worker (``RoleSwitcher``; ``Switch.state``)::

    idle --POST (other role)--> draining --engine: old role drained--> switching --> idle
                                                                      (role flipped, re-register)

- ``draining``: from the POST on, every completion request is refused with 503
  ``role_switching`` before its body is read (so a generation_only request's lease is not
  released: the router may hand it to another worker). What the worker holds of its old role
  runs to its end: a context worker's leases are served until read, released or expired (their
  TTL), its context-only prefills finish; a generation worker's decodes and pulls finish. The
  engine thread measures that (``role_drain``, engine/llm_engine.py) every loop turn and flips
  the KV connector's role once it is all zero (``EngineClient.switch_role``); nothing is torn
  down or built then: every rank of a context / generation worker holds both halves from its
  start.
- ``switching``: the engine serves the new role; the server clears the switch, counts it and
  has its router registration (``--router-url``) register again at once with the new role.

Where the role lives: the KV connector's ``role`` (rank 0) is the one owner;
``ServerState.role`` asks it, reporting the old role until the switch is done, and everything
else (``/server_info``, the registration payload, metric labels, request checks) asks
``ServerState.role`` or the connector. ``ServerSettings.role`` is the role at start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from disagg.contracts import protocol as P
from disagg.contracts.roles import Role, RoleDrain

if TYPE_CHECKING:
    from disagg.server.state import ServerState

logger = logging.getLogger(__name__)

DRAINING = "draining"
SWITCHING = "switching"
# How long the engine thread may take to pick a switch up (a loop turn: one step).
STARTED_TIMEOUT_S = 30.0
# How long the ``switching`` state waits for the router to take the new registration.
SWITCHED_TIMEOUT_S = 10.0
# The roles a worker can switch between (an aggregated worker has no KV transfer).
SWITCHABLE = (Role.CONTEXT, Role.GENERATION)


@dataclass(frozen=True)
class Switch:
    """One role switch in progress."""

    from_role: Role
    to_role: Role
    state: str  # DRAINING or SWITCHING
    since: float  # unix seconds of the POST

    def to_dict(self, pending: RoleDrain | None) -> dict[str, Any]:
        return {"from": self.from_role.value, "to": self.to_role.value, "state": self.state,
                "since": self.since, "pending": (pending or RoleDrain()).to_dict()}


def parse_role(raw: bytes) -> Role:
    """The role a ``POST /admin/role`` body asks for (400 naming ``role`` otherwise)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise P.bad_request('role: the body must be JSON {"role": "context" | "generation"}',
                            param="role") from None
    role = body.get("role") if isinstance(body, dict) else None
    if role is None:
        raise P.bad_request('role: missing (expected {"role": "context" | "generation"})',
                            param="role")
    if role not in tuple(SWITCHABLE):
        raise P.bad_request(f"role: {role!r} is not one of {[r.value for r in SWITCHABLE]}",
                            param="role")
    return Role(role)


class RoleSwitcher:
    """The switch state of one worker (pure: no engine, no I/O; the route drives it)."""

    def __init__(self) -> None:
        self.switch: Switch | None = None
        self.switches = 0  # switches done

    def begin(self, current: Role, to: Role, now: float) -> Switch | None:
        """Start switching ``current`` -> ``to``: the new ``Switch``, or None when the worker
        already serves ``to``. 400 for an aggregated worker, 409 while a switch runs."""
        if current not in SWITCHABLE:
            raise P.bad_request(f"role: an {current.value} worker has no KV transfer and "
                                f"cannot switch role (start it as context or generation)",
                                param="role")
        if self.switch is not None:
            sw = self.switch
            raise P.APIError(409, f"a role switch {sw.from_role.value} -> {sw.to_role.value} "
                             f"is in progress ({sw.state})", type="conflict_error",
                             code="role_switch_in_progress")
        if to is current:
            return None
        self.switch = Switch(current, to, DRAINING, now)
        return self.switch

    def drained(self) -> None:
        """The engine serves the new role now."""
        assert self.switch is not None and self.switch.state == DRAINING
        self.switch = replace(self.switch, state=SWITCHING)

    def finish(self) -> None:
        assert self.switch is not None and self.switch.state == SWITCHING
        self.switch = None
        self.switches += 1

    def abandon(self) -> None:
        """The engine stopped before the switch was done (the worker is going down)."""
        self.switch = None

    def reported_role(self, current: Role) -> Role:
        """The role to report: the old one until a switch is done."""
        return self.switch.from_role if self.switch is not None else current


def answer(status: int, from_role: Role, to_role: Role, state: str,
           pending: RoleDrain | None = None) -> JSONResponse:
    body: dict[str, Any] = {"object": "role_switch", "from": from_role.value,
                            "to": to_role.value, "state": state}
    if pending is not None:
        body["pending"] = pending.to_dict()
    return JSONResponse(body, status_code=status)


class RoleRoutes:
    """``POST /admin/role`` over one ``ServerState`` (``srv``)."""

    def __init__(self, srv: ServerState) -> None:
        self.srv = srv
        # Awaited (bounded) while a switch is ``switching``: the router registration.
        self.on_switched: list[Callable[[], Awaitable[None]]] = []

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/admin/role", self.switch_role, methods=["POST"])

    async def switch_role(self, request: Request) -> JSONResponse:
        srv = self.srv
        raw = await srv.read_body(request)
        check_admin(srv, request, raw)
        to = parse_role(raw)
        current = srv.role
        if current in SWITCHABLE:
            srv.check_accepting()  # 503 while shutting down or with a dead engine
        sw = srv.roles.begin(current, to, time.time())
        if sw is None:
            return answer(200, current, current, "done")
        try:
            started, done = srv.engine.switch_role(to)
            # (the engine thread takes it within a loop turn; bounded should it die meanwhile)
            first: RoleDrain = await asyncio.wait_for(asyncio.wrap_future(started),
                                                      STARTED_TIMEOUT_S)
        except Exception as e:
            srv.roles.abandon()
            raise P.APIError(503, f"the engine cannot switch role: {e!r}",
                             code="engine_unavailable") from None
        logger.info("role switch %s -> %s: draining %s", current.value, to.value,
                    first.to_dict())
        srv.spawn(self._complete(done))
        return answer(202, sw.from_role, sw.to_role, DRAINING, first)

    async def _complete(self, done: cf.Future[RoleDrain]) -> None:
        srv = self.srv
        sw = srv.roles.switch
        assert sw is not None  # (begun by switch_role, which spawned this)
        try:
            await asyncio.wrap_future(done)
        except Exception as e:
            logger.error("role switch abandoned: %s", e)
            srv.roles.abandon()
            return
        srv.roles.drained()
        for callback in self.on_switched:
            try:
                await asyncio.wait_for(callback(), SWITCHED_TIMEOUT_S)
            except Exception:  # (the heartbeat registers again later anyway)
                logger.exception("after the role switch")
        srv.roles.finish()
        logger.info("role switch %s -> %s: done, %.2f s after the request",
                    sw.from_role.value, sw.to_role.value, time.time() - sw.since)


def check_admin(srv: ServerState, request: Request, raw: bytes) -> None:
    """A cluster signature over this request and its body (the API key is not enough: the
    role is the cluster's business): 401 without a valid one, missing, wrong or replayed, as
    on every other signed endpoint (no caller is known to be refused by its identity: a
    valid signature is allowed, so 403 has no case)."""
    srv.access.check_signed(request, raw, "/admin/role")
