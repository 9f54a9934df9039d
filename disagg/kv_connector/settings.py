"""Settings of a worker's KV connector (context / generation role). Torch-free: the server's
command line builds them from the worker's options (``DisaggSettings.from_options``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.cluster_auth import PeerAllowlist
from disagg.contracts.options import WORKER_DEFAULTS, WorkerOptions
from disagg.contracts.roles import Role


@dataclass(frozen=True)
class DisaggSettings:
    """Transfer settings of a context / generation worker. The defaults are the worker
    options' (``WORKER_DEFAULTS``); ``ucx_profile`` ``auto`` is resolved here against the
    address peers use (``transfer.ucx.resolve_ucx_profile``), so it is always concrete."""

    # Role.CONTEXT or Role.GENERATION ("context" / "generation": converted); AGGREGATED for
    # an aggregated worker with kv_peer_reuse (prefix leases and pulls only)
    role: Role
    cluster_token: str
    # This worker's backend, resolved (the context side serves with it): a worker that names
    # none gets UCX when ucxx imports, else TCP (server/cli.kv_transfer_backend_or_default).
    backend: str
    host: str = WORKER_DEFAULTS.host  # where the transfer server listens (context role)
    # What the transfer server hands to peers (None: ``host``); never a wildcard.
    advertise_host: str | None = None
    kv_lease_ttl_s: float = WORKER_DEFAULTS.kv_lease_ttl_s
    ucx_profile: str = WORKER_DEFAULTS.ucx_profile
    # Generation role: check each pulled payload against the context worker's checksum.
    kv_integrity: bool = True  # (the option's default, an engine option: CacheConfig's)
    # At start-up: test blocks through this worker's backend, pulled by a second process
    # (transfer/linkcheck.py: startup_link_check).
    kv_link_check: bool = WORKER_DEFAULTS.kv_link_check
    # Peer prefix reuse (POST /kv_prefix, a request's kv_prefix): any role.
    kv_peer_reuse: bool = WORKER_DEFAULTS.kv_peer_reuse
    read_timeout_s: float = 30.0
    # KV streaming: how long a streaming read may wait for the context worker to queue and
    # prefill the request (generation side), and how long a streaming lease lives before its
    # prefill ends (context side).
    stream_wait_s: float = 600.0
    # Generation role: context workers that requests not signed by the cluster may name.
    kv_peer_allowlist: PeerAllowlist = field(default_factory=PeerAllowlist)
    # Tracing (disagg/tracing.py): the OTLP/HTTP endpoint, resolved (None: off); the transfer
    # server makes a span of each READ that carries a traceparent.
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        if self.ucx_profile == "auto":
            from disagg.transfer.ucx import resolve_ucx_profile

            profile, _ = resolve_ucx_profile("auto", self.advertise_host or self.host)
            object.__setattr__(self, "ucx_profile", profile)

    @classmethod
    def from_options(cls, options: WorkerOptions, *, cluster_token: str, backend: str,
                     advertise_host: str | None = None,
                     otlp_traces_endpoint: str | None = None) -> DisaggSettings:
        """The settings of the worker ``options`` describe; what is decided when it starts
        comes resolved: the cluster token (the option or the environment), the backend (the
        option or the default), the KV address peers use, the traces' endpoint (the option
        or the OTEL_* variables). ValueError for a bad allowlist."""
        return cls(role=options.role, cluster_token=cluster_token, backend=backend,
                   host=options.kv_transfer_host or options.host,
                   advertise_host=advertise_host, kv_lease_ttl_s=options.kv_lease_ttl_s,
                   ucx_profile=options.ucx_profile,
                   kv_integrity=options.kv_integrity is not False,
                   kv_link_check=options.kv_link_check,
                   kv_peer_reuse=options.kv_peer_reuse,
                   kv_peer_allowlist=PeerAllowlist.parse(options.kv_peer_allowlist),
                   otlp_traces_endpoint=otlp_traces_endpoint)


# How often expired leases are ended: by the engine loop on rank 0, by the transfer server's own
# sweeper on ranks 1..N-1.
SWEEP_INTERVAL_S = 0.25
