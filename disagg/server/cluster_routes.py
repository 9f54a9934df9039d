"""The cluster's endpoints of a worker (what routers, launchers and Prometheus call):
``/health``, ``/version``, ``/server_info``, ``/kv_events``, ``/kv_leases/release``,
``/kv_prefix``, ``/metrics``. Who may call them: ``access``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from disagg import __version__
from disagg.cluster_auth import MEMBER_ID_FIELD
from disagg.contracts import protocol as P
from disagg.contracts.options import speculative_mapping
from disagg.contracts.roles import Role
from disagg.env import LAUNCH_ID
from disagg.kv_cache.hashing import BLOCK_HASH_SCHEME
from disagg.layout import ParallelLayout
from disagg.procs import LAUNCH_ID_FIELD
from disagg.server.state import ServerState

if TYPE_CHECKING:
    from disagg.engine.client import EngineClient


# How long /kv_prefix waits for the engine thread (it answers between two steps).
LEASE_PREFIX_TIMEOUT_S = 10.0


class ClusterRoutes:
    """The cluster's endpoints over one ``ServerState``."""

    def __init__(self, srv: ServerState) -> None:
        self.srv = srv
        # The id ``disagg launch`` gave this process (procs.py): its /health says it is the
        # child the launcher started, not another process on the port.
        launch_id = LAUNCH_ID.get()
        self._launch = {LAUNCH_ID_FIELD: launch_id} if launch_id else {}

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/server_info", self.server_info, methods=["GET"])
        app.add_api_route("/kv_leases/release", self.release_lease, methods=["POST"])
        app.add_api_route("/kv_prefix", self.lease_prefix, methods=["POST"])
        app.add_api_route("/kv_events", self.kv_events, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])

    async def health(self) -> JSONResponse:
        # member_id: the audience signed calls to this worker must name (cluster_auth).
        verifier = self.srv.access.verifier
        me = {MEMBER_ID_FIELD: verifier.member_id} if verifier is not None else {}
        me.update(self._launch)
        if self.srv.draining:
            return JSONResponse({"status": "draining", **me}, status_code=503)
        if not self.srv.engine.is_healthy():
            return JSONResponse({"status": "unhealthy", **me}, status_code=503)
        return JSONResponse({"status": "ok", **me})

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def server_info(self, request: Request) -> dict[str, Any]:
        srv = self.srv
        srv.access.check_internal_access(request)
        cfg, engine, settings = srv.config, srv.engine, srv.settings
        try:
            kv_blocks = engine.stats().kv_blocks_total
        except Exception:
            kv_blocks = None
        B = cfg.cache.tokens_per_block
        return {
            "role": srv.role.value,  # the old role until a switch is done
            "role_switch": (srv.roles.switch.to_dict(engine.role_drain_now)
                            if srv.roles.switch is not None else None),
            "role_switches": srv.roles.switches,
            "worker_id": engine.worker_id,
            "benchmark_gen_only": settings.benchmark_gen_only,
            "model": srv.model_name,
            "model_dir": settings.model_dir,
            "architecture": cfg.model.architecture,
            "version": __version__,
            "tokens_per_block": B,
            "block_hash_scheme": BLOCK_HASH_SCHEME,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "kv_cache_blocks": kv_blocks,
            "kv_cache_tokens": None if kv_blocks is None else kv_blocks * B,
            "max_batch_size": cfg.scheduler.max_batch_size,
            "max_num_tokens": cfg.scheduler.max_num_tokens,
            "max_model_len": srv.max_model_len,
            "max_queue": cfg.scheduler.max_queue,
            "enable_chunked_context": cfg.scheduler.enable_chunked_context,
            "capacity_policy": cfg.scheduler.capacity_policy.value,
            "parallel": {
                "tensor_parallel_size": cfg.parallel.tensor_parallel_size,
                "pipeline_parallel_size": cfg.parallel.pipeline_parallel_size,
                "world_size": cfg.parallel.world_size,
                # Which layers / kv heads each rank's KV cache holds (for KV transfer).
                "layouts": [lay.to_dict()
                            for lay in ParallelLayout.all_ranks(cfg.model, cfg.parallel)],
                "rank_pids": engine.rank_pids,
            },
            "dtype": cfg.dtype,
            "device": cfg.device,
            # {method, num_speculative_tokens, prompt_lookup_min/max | model}; null: none.
            "speculative_config": _speculative(cfg),
            # Context / generation workers: worker_id, backend, transfer address(es).
            "kv_transfer": srv.transfer.info() if srv.transfer is not None else None,
            # Peer prefix reuse: POST /kv_prefix leases cached prefixes, kv_prefix pulls one.
            "kv_peer_reuse": srv.peer_reuse,
            "kv_blocks_used": _blocks_used(engine),
        }

    async def release_lease(self, request: Request) -> JSONResponse:
        """Cluster-internal (a router that could not hand a context answer to any generation
        worker): free that answer's KV now instead of at lease expiry. Needs a cluster
        signature."""
        srv = self.srv
        rt = srv.transfer
        # (a draining context worker: still context; prefix leases: any role)
        if rt is None or rt.role != Role.CONTEXT and not srv.peer_reuse:
            raise P.APIError(404, f"no KV leases on a {srv.role.value!r} worker",
                             type="not_found_error")
        raw = await srv.read_body(request)
        srv.access.check_signed(request, raw, "/kv_leases/release")
        try:
            lease_id = P.parse_json_object(raw)["ctx_request_id"]
            if not isinstance(lease_id, str):
                raise TypeError
        except (P.APIError, KeyError, TypeError):
            raise P.bad_request("ctx_request_id: expected {\"ctx_request_id\": str}",
                                param="ctx_request_id") from None
        return JSONResponse({"ctx_request_id": lease_id,
                             "released": srv.engine.release_lease(lease_id)})

    async def lease_prefix(self, request: Request) -> JSONResponse:
        """Cluster-internal (a router reusing this worker's cache for a request it sends to a
        peer, ``kv_peer_reuse``): lease the cached KV of the prompt's leading full blocks.
        ``{"prompt_token_ids": [...]}`` -> ``{"num_tokens": n, "kv_prefix": params | null}``
        (n = 0: none cached). Needs a cluster signature."""
        srv = self.srv
        if not srv.peer_reuse:
            raise P.APIError(404, "no KV prefix leases: this worker was not started with "
                             "--kv-peer-reuse", type="not_found_error")
        raw = await srv.read_body(request)
        srv.access.check_signed(request, raw, "/kv_prefix")
        ids = P.parse_json_object(raw).get("prompt_token_ids")
        if not (isinstance(ids, list) and ids and len(ids) <= srv.max_model_len and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise P.bad_request("prompt_token_ids: expected a non-empty list of token ids, "
                                f"at most max_model_len={srv.max_model_len}",
                                param="prompt_token_ids")
        params = await asyncio.wait_for(srv.engine.lease_prefix(ids), LEASE_PREFIX_TIMEOUT_S)
        if params is None:
            return JSONResponse({"num_tokens": 0, "kv_prefix": None})
        return JSONResponse({"num_tokens": params.num_tokens, "kv_prefix": params.to_dict()})

    async def kv_events(self, request: Request, since: int = 0) -> dict[str, Any]:
        """The KV cache's stored / removed block hashes since event ``since`` (routers poll
        this for KV-aware routing; see disagg/kv_cache/events.py for the resync rule)."""
        srv = self.srv
        srv.access.check_internal_access(request)  # it tells whether a guessed prompt is cached
        batch = srv.engine.kv_events.since(since)
        return {
            "worker_id": srv.engine.worker_id,
            "tokens_per_block": srv.config.cache.tokens_per_block,
            "block_hash_scheme": BLOCK_HASH_SCHEME,
            "next_seq": batch.next_seq,
            # "medium": the offload tier a stored event's hashes went to (absent: KV cache)
            "events": [{"seq": seq, "type": kind, "block_hashes": hashes,
                        **({"medium": m} if (m := batch.media.get(seq)) else {})}
                       for seq, kind, hashes in batch.events],
            "snapshot": batch.snapshot,
        }

    async def metrics(self, request: Request) -> Response:
        srv = self.srv
        srv.access.check_metrics_access(request)
        body, content_type = srv.metrics.render()
        return Response(body, media_type=content_type)


def _blocks_used(engine: EngineClient) -> int | None:
    try:
        return int(engine.stats().kv_blocks_used)
    except Exception:
        return None


def _speculative(cfg: Any) -> dict[str, Any] | None:
    """The engine's speculative decoding config as /server_info shows it (None: off)."""
    spec = getattr(cfg, "speculative", None)
    return None if spec is None else speculative_mapping(spec)
