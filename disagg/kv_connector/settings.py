"""Settings of a worker's KV connector (context / generation role). Torch-free: the server's
command line builds them."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.cluster_auth import PeerAllowlist
from disagg.contracts.roles import Role


@dataclass(frozen=True)
class DisaggSettings:
    """Transfer settings of a context / generation worker."""

    role: Role | str  # Role.CONTEXT or Role.GENERATION (a str enum: "context" compares equal)
    cluster_token: str
    backend: str = "TCP"  # this worker's backend (the context side serves with it)
    host: str = "127.0.0.1"  # where the transfer server listens (context role)
    # What the transfer server hands to peers (None: ``host``); never a wildcard.
    advertise_host: str | None = None
    lease_ttl_s: float = 30.0
    ucx_profile: str = "same_host"
    read_timeout_s: float = 30.0
    # KV streaming: how long a streaming read may wait for the context worker to queue and
    # prefill the request (generation side), and how long a streaming lease lives before its
    # prefill ends (context side).
    stream_wait_s: float = 600.0
    # Generation role: context workers that requests not signed by the cluster may name.
    kv_peer_allowlist: PeerAllowlist = field(default_factory=PeerAllowlist)

# How often expired leases are ended: by the engine loop on rank 0, by the transfer server's own
# sweeper on ranks 1..N-1.
SWEEP_INTERVAL_S = 0.25
