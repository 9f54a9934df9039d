"""The router's workers: static ones from the YAML and, with ``disagg_cluster``, registered ones.

Pools: ``context`` and ``generation``. A static worker is in the pool of its section for good;
a registered worker (``POST /cluster/register`` by ``disagg serve --router-url``) joins the pool
of its role (``aggregated`` workers join the generation pool) and heartbeats by registering
again; it is dropped when no heartbeat came for ``inactive_timeout_sec``, or when its health
checks have failed for that long, or when it unregisters (on drain).

Health: every ``health_check_interval_sec`` the router GETs each worker's ``/health`` (which
names the worker's ``member_id``: the audience of every signed call to it, see ``cluster_auth``)
and ``/server_info`` (role, tokens_per_block, worker_id, model_dir, kv_transfer), signed with
the cluster token and with the pool's API key (``UpstreamAuth``); a worker out of rotation is
probed every 0.5 s (or the interval, if shorter). A worker is in rotation only while healthy.
A check that goes unanswered (a stopped or wedged worker accepts connections and says nothing)
takes the worker out after ``UNRESPONSIVE_AFTER_S`` rather than the check's timeout, unless it
is the last of its pool in rotation (``_unresponsive``).
Health comes from these checks, not from one request: a refused connection, or a 503 saying the
worker drains or its engine is down, takes it out at once (the same as a failing check would);
any other failed request only triggers a check now, and ``REQUEST_FAILURE_THRESHOLD``
consecutive failed requests take it out (a request that got an answer resets the count). The
next passing check puts it back. A worker whose role does not fit its pool (an aggregated worker
where generation_only requests are sent) stays out, with the reason shown in ``GET
/cluster_info``.

KV index (kv_cache_aware sides, generation workers under conditional disaggregation, and
every worker of both pools when a side's policy has ``peer_reuse``: a prefix may be pulled
from any worker, in a disaggregated cluster from a generation worker that decoded the
conversation's previous turn): the router polls each healthy worker's ``GET
/kv_events?since=SEQ`` every ``router.kv_events_poll_interval_sec`` (default 0.1 s) and
applies the answer to the worker's ``KVIndex`` (see ``kv_index``); the answer carries
``tokens_per_block`` and ``worker_id``, so a restart with another block size resyncs the index
before anything is matched again.

Role switches (``role_switch``): a worker being switched by the router (``switching``: the
target role), or whose ``/server_info`` shows a ``role_switch`` under way, is out of rotation
without counting as failing (a registered one is not dropped for it); ``move`` puts a worker
into the other pool (static workers too), with the KV index that pool needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg.cluster_auth import HttpSigner, member_id_from_health
from disagg.contracts.cluster import ClusterConfig, PolicyConfig, normalize_worker_url
from disagg.contracts.roles import Role
from disagg.router.kv_index import KVEventsError, KVIndex
from disagg.router.load import LoadWindows

logger = logging.getLogger("disagg.router")

ROLES = (Role.CONTEXT, Role.GENERATION)  # the pools (aggregated workers join generation)
HEALTH_TIMEOUT_S = 5.0
UNHEALTHY_RECHECK_S = 0.5  # how often a worker out of rotation is probed again
# Consecutive failed requests (reset, timeout, cut mid-answer) that take a worker out of
# rotation without waiting for its health check; one failure alone never does.
REQUEST_FAILURE_THRESHOLD = 3
# A health check still unanswered this long (or UNRESPONSIVE_FACTOR times the slowest of the
# worker's recent answers, when that is longer) takes a healthy worker out of rotation while
# another worker of its pool is in it: a stopped (SIGSTOP) or wedged process still accepts
# connections and answers nothing, and waiting for HEALTH_TIMEOUT_S sent it new requests for
# up to the interval + 5 s. A worker that is only slow answers the same check and is back at
# once; the last worker of a pool in rotation is never taken out for being slow.
UNRESPONSIVE_AFTER_S = 1.0
UNRESPONSIVE_FACTOR = 4.0
RECENT_CHECKS = 8  # answered checks kept per worker for that threshold


class UpstreamAuth:
    """How the router authenticates to its workers: each pool's API key (the workers' own,
    sent as a bearer token) and signatures with the cluster token (the token is never sent)."""

    def __init__(self, cluster_token: str | None = None,
                 api_keys: Mapping[str, str | None] | None = None) -> None:
        self.signer = HttpSigner(cluster_token) if cluster_token else None
        self._keys = {pool: {"Authorization": f"Bearer {key}"}
                      for pool, key in (api_keys or {}).items() if key}

    def signature(self, method: str, path: str, body: bytes = b"", *,
                  audience: str | None) -> dict[str, str]:
        """The signature header of one call to the member ``audience`` (its member id; none
        without a cluster token, or while the member id is unknown: the worker then answers
        401 and its next health check learns the id)."""
        if self.signer is None or audience is None:
            return {}
        return self.signer.headers(method, path, body, audience=audience)

    def headers(self, pool: str, method: str, path: str, body: bytes = b"", *,
                audience: str | None = None) -> dict[str, str]:
        """Headers of one call to a worker of ``pool``: its API key and the signature for
        ``audience`` (the worker's member id); ``path`` with its query, exactly as sent (the
        signature covers it)."""
        return {**self._keys.get(pool, {}),
                **self.signature(method, path, body, audience=audience)}


@dataclass(eq=False)
class Worker:
    url: str  # host:port
    pool: Role  # context | generation
    static: bool  # from the YAML (never dropped) or registered
    healthy: bool = False
    reason: str = "not checked yet"
    active_requests: int = 0  # the router's requests in flight on it
    active_tokens: int = 0  # their prompt tokens
    kv: KVIndex | None = None
    role: str | None = None  # as the worker reports it
    worker_id: str | None = None
    member_id: str | None = None  # from its /health: the audience of signed calls to it
    tokens_per_block: int | None = None
    model_dir: str | None = None
    kv_blocks_used: int | None = None
    last_seen: float = field(default_factory=time.monotonic)  # last heartbeat / passing check
    failing_since: float | None = None
    last_check: float = 0.0
    checking: bool = False  # a health check is in flight (started at last_check)
    # how long its latest answered checks took (UNRESPONSIVE_FACTOR's reference)
    check_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_CHECKS))
    registration: dict[str, Any] | None = None
    requests_total: int = 0
    kv_poll_errors: int = 0
    request_failures: int = 0  # consecutive failed requests (reset by any answer)
    switching: str | None = None  # the role the router is switching it to
    remote_switch: dict[str, Any] | None = None  # its /server_info role_switch (None: none)
    # Its /server_info says ``kv_peer_reuse: true``: it leases its cached prefixes to peers
    # (POST /kv_prefix) and pulls a request's ``kv_prefix`` (router.flow).
    kv_peer_reuse: bool = False
    # Its last /server_info ``kv_transfer`` (worker_id, backend, addresses, layout): where a
    # generation worker streams a context worker's KV from (``stream_flow``); kept while a
    # check fails (a worker that restarted elsewhere fails the pull, and the router falls back).
    kv_transfer: dict[str, Any] | None = None

    @property
    def base(self) -> str:
        return "http://" + self.url

    def info(self) -> dict[str, Any]:
        return {
            "url": self.url, "pool": self.pool, "role": self.role,
            "source": "static" if self.static else "registered", "healthy": self.healthy,
            "reason": None if self.healthy else self.reason,
            "active_requests": self.active_requests, "active_tokens": self.active_tokens,
            "requests_total": self.requests_total, "worker_id": self.worker_id,
            "tokens_per_block": self.tokens_per_block, "kv_blocks_used": self.kv_blocks_used,
            "switching_to": self.switching, "role_switch": self.remote_switch,
            "kv_peer_reuse": self.kv_peer_reuse,
            "kv_transfer": None if self.kv_transfer is None else {
                k: self.kv_transfer.get(k) for k in ("backend", "addresses")},
            "kv_index": None if self.kv is None else {
                "synced": self.kv.synced, "blocks": len(self.kv.blocks),
                "tokens_per_block": self.kv.tokens_per_block, "next_seq": self.kv.next_seq,
                "resyncs": self.kv.resyncs},
        }


class Membership:
    """Pools of workers, their health checks and KV index polling (started by the app)."""

    def __init__(self, config: ClusterConfig, policies: Mapping[str, PolicyConfig],
                 on_model_dir: Callable[[str], None] | None = None,
                 auth: UpstreamAuth | None = None) -> None:
        self.config = config
        self.auth = auth or UpstreamAuth()
        self.policies = policies  # role -> the side's policy config (for KV needs, poll rate)
        self.kv_roles = {role for role, p in policies.items() if p.type == "kv_cache_aware"}
        if config.conditional_disagg is not None:
            self.kv_roles.add(Role.GENERATION)
        if any(p.type == "kv_cache_aware" and p.option("peer_reuse") for p in policies.values()):
            self.kv_roles.update(ROLES)  # a peer may be any worker (the module docstring)
        self.on_model_dir = on_model_dir  # a worker's checkpoint folder (tokenizer discovery)
        # called with a worker dropped from its pool (the router forgets its metric series)
        self.on_remove: Callable[[Worker], None] | None = None
        self.pools: dict[str, list[Worker]] = {role: [] for role in ROLES}
        self.by_url: dict[str, Worker] = {}
        self.session: Any = None  # aiohttp.ClientSession, set by start()
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._health_task: asyncio.Task[None] | None = None
        self._spawned: set[asyncio.Task[Any]] = set()
        # the router's latency samples per side, read by the planner only (none kept without it)
        planner = config.planner
        self.load = LoadWindows(planner.window_s if planner is not None and planner.enabled
                                else 0.0)
        for role in ROLES:
            group = config.group(role)
            for url in group.urls if group else ():
                self._add(Worker(url, role, static=True))

    # -- pools --------------------------------------------------------------------------------

    @property
    def disaggregated(self) -> bool:
        """Requests take the context -> generation path (else whole to generation workers)."""
        return self.config.context_servers is not None or bool(self.pools[Role.CONTEXT])

    def candidates(self, pool: str, exclude: set[str] | frozenset[str] = frozenset()
                   ) -> list[Worker]:
        return [w for w in self.pools[pool] if w.healthy and w.url not in exclude]

    def peers(self) -> list[Worker]:
        """The workers a candidate may pull a cached prefix from (``peer_reuse``): healthy,
        advertising ``kv_peer_reuse``, with a usable KV index; both pools."""
        return [w for w in self.by_url.values()
                if w.healthy and w.kv_peer_reuse and w.kv is not None and w.kv.usable]

    def _add(self, w: Worker) -> None:
        self.by_url[w.url] = w
        self._add_to_pool(w)

    def _add_to_pool(self, w: Worker) -> None:
        if w.pool in self.kv_roles:
            w.kv = KVIndex()
        self.pools[w.pool].append(w)
        if self.session is not None:
            self._start_worker_tasks(w)

    def _remove(self, w: Worker, why: str) -> None:
        logger.warning("dropping worker %s (%s): %s", w.url, w.pool, why)
        self.by_url.pop(w.url, None)
        with contextlib.suppress(ValueError):
            self.pools[w.pool].remove(w)
        w.healthy = False
        w.reason = why
        for t in self._tasks.pop(w.url, []):
            t.cancel()
        if self.on_remove is not None:
            self.on_remove(w)

    def move(self, w: Worker, pool: Role) -> None:
        """Put ``w`` into ``pool`` (after a role switch), with the KV index that pool needs.
        Nothing when ``w`` is no longer ours (a registered worker that registered again with
        its new role is already a new entry of that pool)."""
        if self.by_url.get(w.url) is not w or w.pool == pool:
            return
        logger.info("worker %s moves from the %s pool to the %s pool", w.url, w.pool, pool)
        with contextlib.suppress(ValueError):
            self.pools[w.pool].remove(w)
        for t in self._tasks.pop(w.url, []):
            t.cancel()
        if self.on_remove is not None:
            self.on_remove(w)  # its series under the old pool's labels
        w.pool = pool
        w.kv = None
        w.healthy = False
        self._add_to_pool(w)

    def mark_failed(self, w: Worker, why: str) -> None:
        """Take ``w`` out of rotation now (a request could not use it); the health loop puts
        it back when it passes again."""
        if w.healthy:
            logger.warning("worker %s (%s) out of rotation: %s", w.url, w.pool, why)
        w.healthy = False
        w.reason = why
        if w.failing_since is None:
            w.failing_since = time.monotonic()
        if not w.checking:
            self.spawn(self.check(w))  # confirm soon rather than at the next round

    def request_failed(self, w: Worker, why: str) -> None:
        """A request to ``w`` failed after connecting (reset, timeout, cut): check its health
        now; ``REQUEST_FAILURE_THRESHOLD`` in a row take it out of rotation."""
        w.request_failures += 1
        if w.request_failures >= REQUEST_FAILURE_THRESHOLD:
            self.mark_failed(w, f"{w.request_failures} failed requests in a row; last: {why}")
        elif not w.checking:
            self.spawn(self.check(w))

    def ready(self) -> tuple[bool, str]:
        """Ready when enough workers of each pool are healthy: ``minimal_instances`` with
        disagg_cluster, else at least one generation worker (and one context worker in a
        disaggregated cluster)."""
        need: dict[str, int] = {Role.GENERATION: 1, Role.CONTEXT: 1 if self.disaggregated else 0}
        if self.config.disagg_cluster is not None:
            mins = self.config.disagg_cluster.minimal_instances
            need = {Role.CONTEXT: mins.get("context_servers", 0),
                    Role.GENERATION: mins.get("generation_servers", 0)}
            if not any(need.values()):
                need[Role.GENERATION] = 1  # at least something to send requests to
        missing = []
        for role in ROLES:
            have = len(self.candidates(role))
            if have < need[role]:
                missing.append(f"{have}/{need[role]} healthy {role} workers")
        return (not missing, "; ".join(missing) or "ok")

    # -- registration -------------------------------------------------------------------------

    def register(self, payload: Mapping[str, Any]) -> Worker:
        """Add or refresh a registered worker (ValueError naming the field when malformed)."""
        role = payload.get("role")
        if role not in tuple(Role):
            raise ValueError(f"role: must be context, generation or aggregated, got {role!r}")
        try:
            url = normalize_worker_url(payload.get("url"))
        except ValueError as e:
            raise ValueError(f"url: {e}") from None
        pool = Role.CONTEXT if role == Role.CONTEXT else Role.GENERATION
        w = self.by_url.get(url)
        if w is not None and w.pool != pool:
            if w.static:
                raise ValueError(f"url: {url} is a static {w.pool} worker of the config")
            self._remove(w, f"registered again as {role}")
            w = None
        if w is None:
            w = Worker(url, pool, static=False)
            logger.info("worker %s registered (%s)", url, role)
            self._add(w)
            self.spawn(self.check(w))
        elif payload.get("worker_id") and w.worker_id and payload["worker_id"] != w.worker_id:
            # Restarted under the same address: forget what we knew until it is checked.
            w.healthy, w.reason = False, "restarted; re-checking"
            if w.kv is not None:
                w.kv.reset()
            self.spawn(self.check(w))
        w.registration = dict(payload)
        w.last_seen = time.monotonic()
        return w

    def unregister(self, url: str) -> bool:
        try:
            w = self.by_url.get(normalize_worker_url(url))
        except ValueError:  # not an address: not a worker of ours either
            return False
        if w is None or w.static:
            return False
        self._remove(w, "unregistered")
        return True

    # -- background work ----------------------------------------------------------------------

    def spawn(self, coro: Any) -> None:
        if self.session is None:  # not started (unit tests): nothing to run it on
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def start(self, session: Any) -> None:
        self.session = session
        for w in list(self.by_url.values()):
            self._start_worker_tasks(w)
        self._health_task = asyncio.create_task(self._health_loop())
        # First checks now, so that a router started after its workers is ready at once.
        await asyncio.gather(*(self.check(w) for w in list(self.by_url.values())))

    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts] + list(self._spawned)
        if self._health_task is not None:
            tasks.append(self._health_task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def _start_worker_tasks(self, w: Worker) -> None:
        if w.kv is not None and w.url not in self._tasks:
            self._tasks[w.url] = [asyncio.get_running_loop().create_task(self._kv_loop(w))]

    async def _health_loop(self) -> None:
        # Healthy workers are checked every interval; unhealthy ones every tick, so that a
        # worker that comes back is in rotation again within half a second.
        # Each check runs as a task of its own: one that hangs (a stopped worker) delays no
        # other worker's, and is watched here while it is in flight (``_unresponsive``).
        interval = self.config.health_check_interval_sec
        tick = min(interval, UNHEALTHY_RECHECK_S)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for w in list(self.by_url.values()):
                if w.checking:
                    self._unresponsive(w, now)
                elif not w.healthy or now - w.last_check >= interval - tick / 2:
                    self.spawn(self.check(w))
            self._expire()

    def _unresponsive(self, w: Worker, now: float) -> None:
        """Take healthy ``w`` out of rotation when its check in flight is overdue
        (``UNRESPONSIVE_AFTER_S``) and another worker of its pool is in rotation."""
        waited = now - w.last_check
        slowest = max(w.check_seconds, default=0.0)
        if (not w.healthy or waited < max(UNRESPONSIVE_AFTER_S, UNRESPONSIVE_FACTOR * slowest)
                or not any(o.healthy for o in self.pools.get(w.pool, ()) if o is not w)):
            return
        why = f"health check unanswered for {waited:.1f} s"
        logger.warning("worker %s (%s) out of rotation: %s", w.url, w.pool, why)
        w.healthy, w.reason = False, why
        if w.failing_since is None:
            w.failing_since = now

    def _expire(self) -> None:
        dc = self.config.disagg_cluster
        if dc is None:
            return
        now = time.monotonic()
        for w in list(self.by_url.values()):
            if w.static:
                continue
            if now - w.last_seen > dc.inactive_timeout_sec:
                self._remove(w, f"no heartbeat for {now - w.last_seen:.1f} s")
            elif w.failing_since is not None and now - w.failing_since > dc.inactive_timeout_sec:
                self._remove(w, f"failing health checks for {now - w.failing_since:.1f} s: "
                             f"{w.reason}")

    def _expected_roles(self, w: Worker) -> tuple[Role, ...]:
        if w.pool == Role.CONTEXT:
            return (Role.CONTEXT,)
        if self.disaggregated:
            return (Role.GENERATION,)
        # any role serves ordinary requests
        return (Role.AGGREGATED, Role.GENERATION, Role.CONTEXT)

    async def check(self, w: Worker) -> bool:
        """One health check: /health then /server_info; updates ``w`` and returns healthy."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        why = None
        info: dict[str, Any] | None = None
        w.last_check = time.monotonic()
        w.checking = True
        try:
            # /health is open (unsigned); it names the member id signed calls must name.
            async with self.session.get(w.base + "/health", timeout=timeout,
                                        headers=self.auth.headers(w.pool, "GET", "/health")
                                        ) as r:
                if r.status != 200:
                    why = f"/health answered {r.status}"
                elif self.auth.signer is not None:
                    member_id: str | None = None
                    with contextlib.suppress(ValueError):  # also bad JSON
                        member_id = member_id_from_health(await r.json(content_type=None))
                    # None (a member that names no id: one without a cluster token, or from
                    # before audience-bound signatures): calls to it go unsigned, and one
                    # that wants a signature says so (401 on /server_info: the reason shown).
                    if member_id != w.member_id and w.member_id is not None:
                        logger.info("worker %s: member_id %s -> %s (restarted)", w.url,
                                    w.member_id, member_id)
                    w.member_id = member_id
            if why is None:
                async with self.session.get(w.base + "/server_info", timeout=timeout,
                                            headers=self.auth.headers(
                                                w.pool, "GET", "/server_info",
                                                audience=w.member_id)) as r:
                    if r.status == 401:  # say why: a missing or different cluster token
                        why = f"/server_info answered 401: {await _error_message(r)}"
                    elif r.status != 200:
                        why = f"/server_info answered {r.status}"
                    else:
                        info = await r.json()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # connection refused, timeout, bad JSON: all "not healthy"
            why = f"unreachable: {type(e).__name__}: {e}".rstrip(": ")
        finally:
            w.checking = False
        if info is not None:
            w.check_seconds.append(time.monotonic() - w.last_check)
            why = self._apply_info(w, info)
        now = time.monotonic()
        if info is None:
            w.remote_switch = None  # unreachable: its health decides, not an old answer
        switch = w.switching or (w.remote_switch or {}).get("to")
        if switch is not None:
            # Out of rotation while it switches, but not failing (never dropped for it).
            w.healthy, w.failing_since = False, None
            w.reason = f"switching role to {switch}" + (f" ({why})" if why else "")
            if w.static:
                w.last_seen = now
            return False
        if why is None:
            if not w.healthy:
                logger.info("worker %s (%s) healthy", w.url, w.pool)
            w.healthy, w.reason, w.failing_since = True, "", None
            if w.static:
                w.last_seen = now
        else:
            if w.healthy:
                logger.warning("worker %s (%s) unhealthy: %s", w.url, w.pool, why)
            w.healthy, w.reason = False, why
            if w.failing_since is None:
                w.failing_since = now
        return w.healthy

    def _apply_info(self, w: Worker, info: Mapping[str, Any]) -> str | None:
        role = info.get("role")
        worker_id = info.get("worker_id") or (info.get("kv_transfer") or {}).get("worker_id")
        if w.worker_id is not None and worker_id is not None and worker_id != w.worker_id:
            logger.info("worker %s restarted (worker_id %s -> %s)", w.url, w.worker_id,
                        worker_id)
        w.role, w.worker_id = role, worker_id
        w.kv_peer_reuse = info.get("kv_peer_reuse") is True
        kt = info.get("kv_transfer")
        w.kv_transfer = dict(kt) if isinstance(kt, Mapping) else None
        rs = info.get("role_switch")
        w.remote_switch = dict(rs) if isinstance(rs, Mapping) else None
        tpb = info.get("tokens_per_block")
        if tpb != w.tokens_per_block and w.tokens_per_block is not None:
            logger.info("worker %s: tokens_per_block %s -> %s", w.url, w.tokens_per_block, tpb)
            if w.kv is not None and w.kv.tokens_per_block != tpb:
                w.kv.reset()  # never match with the old block size; the next poll resyncs
        w.tokens_per_block = tpb
        w.kv_blocks_used = info.get("kv_blocks_used")
        model_dir = info.get("model_dir")
        if model_dir and model_dir != w.model_dir:
            w.model_dir = model_dir
            if self.on_model_dir is not None:
                self.on_model_dir(model_dir)
        if (role not in self._expected_roles(w) and role in (Role.CONTEXT, Role.GENERATION)
                and self.disaggregated and w.switching is None and not w.remote_switch
                and info.get("role_switches")):
            # It switched without us (a switch we gave up on that finished late, or one an
            # operator asked of the worker itself): serve it in the pool of its new role.
            self.move(w, Role(role))
        if role not in self._expected_roles(w):
            return (f"role is {role!r} but the {w.pool} pool needs "
                    f"{' or '.join(self._expected_roles(w))}")
        return None

    async def _kv_loop(self, w: Worker) -> None:
        import aiohttp

        policy = self.policies.get(w.pool)
        interval = float(policy.option("kv_events_poll_interval_sec") if policy else 0.1)
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        while True:
            await asyncio.sleep(interval if w.kv_poll_errors == 0 else
                                min(interval * 2 ** w.kv_poll_errors, 5.0))
            if not w.healthy or w.kv is None:
                continue
            try:
                path = f"/kv_events?since={w.kv.next_seq}"
                async with self.session.get(w.base + path, timeout=timeout,
                                            headers=self.auth.headers(
                                                w.pool, "GET", path, audience=w.member_id)
                                            ) as r:
                    if r.status != 200:
                        raise KVEventsError(f"/kv_events answered {r.status}")
                    answer = await r.json()
                w.kv.apply(answer)
                w.kv_poll_errors = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if w.kv_poll_errors == 0:
                    logger.warning("worker %s: KV events poll failed: %s", w.url, e)
                w.kv_poll_errors = min(w.kv_poll_errors + 1, 6)

    def cluster_info(self) -> dict[str, Any]:
        ready, why = self.ready()
        return {
            "ready": ready, "reason": why, "disaggregated": self.disaggregated,
            "disagg_cluster": None if self.config.disagg_cluster is None else {
                "minimal_instances": dict(self.config.disagg_cluster.minimal_instances),
                "heartbeat_interval_sec": self.config.disagg_cluster.heartbeat_interval_sec,
                "inactive_timeout_sec": self.config.disagg_cluster.inactive_timeout_sec},
            "workers": {role: [w.info() for w in self.pools[role]] for role in ROLES},
        }


async def _error_message(r: Any) -> str:
    """The message of a worker's OpenAI error answer (its text when it is not one)."""
    body = b""
    try:
        body = await r.read()
        return str(json.loads(body)["error"]["message"])[:300]
    except Exception:
        return body[:300].decode(errors="replace")
