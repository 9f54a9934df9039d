"""KV transfer between context and generation workers: the transport, leases and the server.

A context worker keeps a request's KV blocks under a lease after prefill; each generation rank
pulls the layers and kv heads it needs straight from the context ranks that hold them (one
coalesced read per rank pair), then confirms, and the context side frees the blocks. What to
pull and how it lands in the cache (plan, receive buffers, install) is the generation side's
business: ``disagg.kv_connector.pull``; the wire's params are ``disagg.contracts.params``;
rank layouts and pull pieces ``disagg.layout``. Here:

- ``base``: wire messages (``ReadRequest``, ``ReadResult``, ``TransferError``), header
  encoding and the ``TransportBackend`` abstraction (it imports no backend).
- ``backends``: the backend registry, ``make_backend("UCX" | "TCP")``.
- ``handshake``: the challenge-response that proves the cluster token on every connection
  without sending it (torch-free).
- ``lease``: ``LeaseTable`` (torch-free): which blocks may be read, until when.
- ``stats``: ``TransferStats`` (torch-free) for the worker's metrics.
- ``tcp`` / ``ucx``: the two backends (ucxx is imported lazily, on first use); both accept
  connections on one TCP socket bound to the configured host.
- ``payload``: zero-copy views and gathers of the KV cache for a READ; ``sender``: where a
  server's payload bytes come from and how they go out (``PayloadSource``).
- ``cuda_ipc``: same host, another process: the reader maps the server's GPU cache once (CUDA
  IPC) and gathers its READs itself, no payload on the wire (``DISAGG_KV_IPC``).
- ``progress``: ``StreamProgress``, which prompt KV of a streamed request exists (streaming
  READs wait there).
- ``admission``: ``ServerLimits`` (a server's frozen knobs) and ``Admission`` (its connection
  caps and counters).
- ``service``: ``KVTransferServer`` (context rank) and ``KVTransferClient`` (generation rank).
- ``linkcheck``: test blocks between two processes, measured and judged (``disagg doctor``,
  a worker's ``--kv-link-check``).

Importing this package does not import torch; the torch-using names load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg.transfer.admission import ServerLimits
from disagg.transfer.backends import make_backend
from disagg.transfer.base import (
    BAD_REQUEST,
    CLOSED,
    CONNECTION_FAILED,
    EXPIRED_LEASE,
    PROTOCOL_ERROR,
    TIMEOUT,
    UNAUTHORIZED,
    UNKNOWN_LEASE,
    ReadRequest,
    ReadResult,
    TransferError,
    TransportBackend,
    resolve_cluster_token,
)
from disagg.transfer.lease import Lease, LeaseError, LeaseStats, LeaseTable
from disagg.transfer.stats import TransferStats, TransferStatsSnapshot

if TYPE_CHECKING:
    from disagg.transfer.payload import payload_shape
    from disagg.transfer.service import KVTransferClient, KVTransferServer

_LAZY = {
    "KVTransferServer": "disagg.transfer.service",
    "KVTransferClient": "disagg.transfer.service",
    "payload_shape": "disagg.transfer.payload",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'disagg.transfer' has no attribute {name!r}")


__all__ = [
    "BAD_REQUEST", "CLOSED", "CONNECTION_FAILED", "EXPIRED_LEASE", "PROTOCOL_ERROR", "TIMEOUT",
    "UNAUTHORIZED", "UNKNOWN_LEASE", "KVTransferClient",
    "KVTransferServer", "Lease", "LeaseError", "LeaseStats", "LeaseTable", "ReadRequest",
    "ReadResult", "ServerLimits", "TransferError", "TransferStats", "TransferStatsSnapshot",
    "TransportBackend", "make_backend", "payload_shape", "resolve_cluster_token",
]
