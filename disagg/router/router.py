"""``Router``: the router's parts assembled from the cluster config, started and stopped.

Parts: the sides' routing policies (``policies``), the workers (``membership``), the prompt's
tokens for the policies that need them (``prompt_tokens``), the client of the workers
(``upstream``), the relay of their answers (``relay``), the request flow with its retries
(``flow``; ``stream_flow`` with ``kv_streaming``), the Prometheus metrics (``metrics``),
role switches (``role_switch``), with ``planner.enabled`` / ``--planner`` the planner
(``planner_loop`` over ``planner``) and, with ``otlp_traces_endpoint`` (or the ``OTEL_*``
variables), the tracer of its requests (``disagg/tracing.py``). The HTTP handlers
(``handlers``) use them.

Cluster authentication: the router signs (``cluster_auth.HttpSigner``, with the token from
``$DISAGG_CLUSTER_TOKEN``) the calls whose handling depends on it: the generation_only call (a
generation worker trusts the context addresses of a signed request and caches its pulled KV),
health / server-info checks, KV event polls, lease releases and ``/v1/models``. The
context_only call and requests sent whole carry no signature: the worker decides nothing on
it, and the hot path pays for one signature per request, not three. With ``kv_streaming``
(``stream_flow``) both calls are signed: the context call names the lease (the stream id).
It verifies the signatures of ``/cluster/register`` and ``/cluster/unregister``. Without a
token it refuses to start when it could not sign (context servers) or would let anyone register
(``disagg_cluster``, unless ``insecure_membership``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from aiohttp import web

from disagg.cluster_auth import HttpVerifier, cluster_token_or_none
from disagg.contracts import protocol as P
from disagg.contracts.cluster import ClusterConfig, PolicyConfig, RouterConfigError
from disagg.router.flow import RequestFlow
from disagg.router.membership import ROLES, Membership, UpstreamAuth, Worker
from disagg.router.metrics import RouterMetrics
from disagg.router.planner_loop import PlannerLoop
from disagg.router.policies import RouteRequest, RoutingPolicy, make_policy
from disagg.router.processes import ProcessInfo, Siblings
from disagg.router.prompt_tokens import PromptTokens
from disagg.router.relay import Relay
from disagg.router.role_switch import RoleSwitcher, SwitchResult
from disagg.router.stream_flow import StreamingFlow
from disagg.router.upstream import UpstreamClient
from disagg.tracing import ROUTER_SERVICE, Tracer, TracingError, configured, tracer_for

logger = logging.getLogger("disagg.router")

# glibc keeps memory the router freed: under a steady load RSS crept ~0.3 MiB/min while live
# Python objects and malloc's in-use bytes stayed flat (DESIGN.md section 12); malloc_trim hands
# it back. Once a minute, well under a millisecond on this heap.
MALLOC_TRIM_INTERVAL_S = 60.0


def check_cluster_token(config: ClusterConfig, token: str | None,
                        insecure_membership: bool = False) -> None:
    """RouterConfigError when the router could not do its part of cluster authentication."""
    if token:
        return
    if config.disagg_cluster is not None and not insecure_membership:
        raise RouterConfigError(
            f"{config.source}: disagg_cluster: no cluster token, so anyone could register as "
            f"a worker and receive user traffic: set $DISAGG_CLUSTER_TOKEN to the workers' "
            f"token (or pass --insecure-membership to accept unauthenticated registrations)")
    if config.context_servers is not None:
        raise RouterConfigError(
            f"{config.source}: context_servers: no cluster token: a disaggregated router signs "
            f"its calls to the workers with it (generation workers trust only signed requests' "
            f"context addresses): set $DISAGG_CLUSTER_TOKEN to the workers' token")


def _policy_configs(config: ClusterConfig) -> dict[str, PolicyConfig]:
    """Each side's policy: its section's ``router``, else round robin."""
    return {role: group.router if (group := config.group(role)) else PolicyConfig(
        "round_robin", options=MappingProxyType({})) for role in ROLES}


class Router:
    """The router's parts for one cluster config (see the module docstring)."""

    def __init__(self, config: ClusterConfig, tokenizer: Any = None, *,
                 cluster_token: str | None = None, insecure_membership: bool = False,
                 process: ProcessInfo | None = None) -> None:
        self.config = config
        # Which of the router's processes this is, and the channel to the others.
        self.process = process or ProcessInfo()
        self.siblings = Siblings(self.process)
        # The cluster secret (never sent): signs the calls to workers, verifies registrations.
        self.cluster_token = cluster_token_or_none(cluster_token)
        check_cluster_token(config, self.cluster_token, insecure_membership)
        # One member id for all the router's processes (any of them may get a registration).
        self.verifier = (HttpVerifier(self.cluster_token, member_id=self.process.member_id())
                         if self.cluster_token else None)
        if config.disagg_cluster is not None and self.verifier is None:
            logger.warning("--insecure-membership: /cluster/register accepts anyone (no "
                           "cluster token); use it only on a trusted network")
        self.policy_configs: Mapping[str, PolicyConfig] = _policy_configs(config)
        self.policies: dict[str, RoutingPolicy] = {
            role: make_policy(p) for role, p in self.policy_configs.items()}
        need_tokens = (any(p.needs_tokens for p in self.policies.values())
                       or config.conditional_disagg is not None)
        self.tokens = PromptTokens(config, self.policy_configs, need_tokens, tokenizer)
        keys = {role: group.worker_options.get("api_key") if (group := config.group(role))
                else None for role in ROLES}
        self.auth = UpstreamAuth(self.cluster_token, keys)
        self.membership = Membership(config, self.policy_configs, auth=self.auth,
                                     on_model_dir=self._discover)
        self.metrics = RouterMetrics(self.membership)
        self.membership.on_remove = lambda w: self.metrics.forget_worker(
            w.pool, self.policies[w.pool].name, w.url)
        self.upstream = UpstreamClient(config, self.auth, self.membership, self.metrics)
        self.relay = Relay(self.upstream, self.membership, self.metrics)
        flow = StreamingFlow if config.kv_streaming else RequestFlow
        self.flow = flow(self.policies, self.membership, self.metrics, self.upstream,
                         self.relay, config.max_retries, config.max_migrations)
        self.body_timeout_s = P.BODY_TIMEOUT_S  # then 408 (tests shorten it)
        self.switcher = RoleSwitcher(self.membership, on_done=self._switch_done)
        self._switch_tasks: set[asyncio.Task[SwitchResult]] = set()
        self.planner: PlannerLoop | None = None
        if config.planner is not None and config.planner.enabled:
            self.planner = PlannerLoop(config.planner, self.membership, self.switcher,
                                       on_decision=lambda d: self.metrics.planner_decisions
                                       .labels(d.action, d.from_role or "", d.to_role or "")
                                       .inc())
        self._trim_task: asyncio.Task[None] | None = None
        # Tracing (None: off, one check a request): the YAML's / --otlp-traces-endpoint's
        # endpoint, else the OTEL_* variables'.
        try:
            endpoint = configured(config.otlp_traces_endpoint,
                                  f"{config.source}: otlp_traces_endpoint")
        except TracingError as e:
            raise RouterConfigError(str(e)) from None
        self.tracer: Tracer | None = (None if endpoint is None
                                      else tracer_for(endpoint, ROUTER_SERVICE))
        if self.tracer is not None:
            logger.info("tracing: OTLP/HTTP spans to %s (service %s)", endpoint,
                        self.tracer.service)

    @property
    def primary(self) -> bool:
        """Whether this process runs the router's once-per-cluster background work (the only
        process, or process 0 of ``--processes N``)."""
        return self.process.primary

    @property
    def need_tokens(self) -> bool:
        """Does a policy (or conditional disaggregation) need the prompt's tokens?"""
        return self.tokens.need_tokens

    @property
    def switch_timeout_s(self) -> float:
        """A role switch's deadline: the planner's ``switch_timeout_s`` (120 s without one)."""
        return self.config.planner.switch_timeout_s if self.config.planner else 120.0

    def run_switch(self, w: Worker, role: str, timeout_s: float) -> asyncio.Task[SwitchResult]:
        """The switch as a task of the router's (cancelled only when the router stops)."""
        task = asyncio.get_running_loop().create_task(self.switcher.switch(w, role, timeout_s))
        self._switch_tasks.add(task)
        task.add_done_callback(self._switch_tasks.discard)
        return task

    def _switch_done(self, r: SwitchResult) -> None:
        self.metrics.role_switches.labels(r.outcome).inc()
        if r.outcome == "done":
            self.metrics.role_switch_seconds.observe(r.duration_s)

    def _discover(self, model_dir: str) -> None:
        self.tokens.discover(model_dir, self.membership.spawn)

    def route_request(self, endpoint: str, body: Mapping[str, Any]) -> RouteRequest:
        """The prompt's tokens as the workers will see them (``PromptTokens.route_request``)."""
        return self.tokens.route_request(endpoint, body)

    def block_sizes(self) -> set[int]:
        """The KV block sizes of the workers whose cache the router indexes."""
        return {w.kv.tokens_per_block for w in list(self.membership.by_url.values())
                if w.kv is not None and w.kv.tokens_per_block}

    # -- lifecycle ----------------------------------------------------------------------------

    async def startup(self, app: web.Application) -> None:
        session = await self.upstream.start()
        await self.membership.start(session)
        await self.siblings.start()
        if self.planner is not None and self.primary:  # one planner per cluster
            self.planner.start()
        trim = _malloc_trim()
        if trim is not None:
            self._trim_task = asyncio.get_running_loop().create_task(_trim_loop(trim))

    async def cleanup(self, app: web.Application) -> None:
        if self._trim_task is not None:
            self._trim_task.cancel()
        if self.planner is not None:
            await self.planner.stop()
        for t in list(self._switch_tasks):
            t.cancel()
        await asyncio.gather(*self._switch_tasks, return_exceptions=True)
        await self.membership.stop()
        await self.flow.close()
        await self.upstream.close()
        await self.siblings.close()
        if self.tracer is not None:  # the spans of the last requests (stopped at exit)
            await asyncio.to_thread(self.tracer.flush)


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (musl, macOS: nothing to do)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


async def _trim_loop(trim: Any) -> None:
    while True:
        await asyncio.sleep(MALLOC_TRIM_INTERVAL_S)
        trim(0)

