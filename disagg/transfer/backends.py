"""The transport backend registry: ``make_backend("UCX" | "TCP")``, and ``default_backend()``
(UCX when ucxx imports, TCP otherwise).

``base`` defines the ``TransportBackend`` abstraction and knows no implementation; ``tcp`` and
``ucx`` implement it; this module is the one place that knows them all. Importing it imports
both backend modules, not ucxx (the UCX backend loads ucxx on first use).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg.contracts.options import CacheTransceiverConfig
from disagg.transfer.base import TransportBackend
from disagg.transfer.tcp import TcpBackend
from disagg.transfer.ucx import UcxBackend, resolve_ucx_profile, ucx_available


def default_backend() -> tuple[str, str]:
    """The backend of a worker that names none, and why: ``("UCX", ...)`` when ucxx imports
    (the `ucx` extra, which the `serve` extra installs), else ``("TCP", why not UCX)``. An
    explicit choice never comes here: an explicit UCX without ucxx stays an error."""
    ok, detail = ucx_available()
    if ok:
        return "UCX", f"the default: ucxx {detail} imports"
    return "TCP", (f"the fallback default: {detail}; install the `ucx` extra "
                   f"(pip install 'disagg[ucx]') for UCX")


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
    # "auto" with no address to judge by: same_host (sm,tcp also reaches other hosts, by tcp)
    return UcxBackend(profile=resolve_ucx_profile(cfg.ucx_profile, None)[0])
