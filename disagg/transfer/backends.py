"""The transport backend registry: ``make_backend("UCX" | "TCP")``.

``base`` defines the ``TransportBackend`` abstraction and knows no implementation; ``tcp`` and
``ucx`` implement it; this module is the one place that knows them all. Importing it imports
both backend modules, not ucxx (the UCX backend loads ucxx on first use).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg.transfer.base import CacheTransceiverConfig, TransportBackend
from disagg.transfer.tcp import TcpBackend
from disagg.transfer.ucx import UcxBackend


def make_backend(
    spec: str | CacheTransceiverConfig | Mapping[str, Any] | TransportBackend,
) -> TransportBackend:
    """A backend by name (``"UCX"`` / ``"TCP"``, case-insensitive), from a
    ``cache_transceiver_config`` mapping or object, or an instance passed through.
    Importing the UCX backend does not import ucxx (that happens on first use)."""
    if isinstance(spec, TransportBackend):
        return spec
    if isinstance(spec, str):
        cfg = CacheTransceiverConfig(backend=spec)
    elif isinstance(spec, CacheTransceiverConfig):
        cfg = spec
    else:
        cfg = CacheTransceiverConfig.from_dict(spec)
    if cfg.backend == "TCP":
        return TcpBackend()
    return UcxBackend(profile=cfg.ucx_profile)
