"""KV that crosses workers, behind one boundary: the engine holds a ``KVConnector`` (or none).

- ``base``: the abstract ``KVConnector`` (its hooks, who calls them, the rules, the attributes
  the engine and the server read), ``FinishedTransfers``.
- ``errors``: ``KVTransferError``, the typed failure carried on a request's output.
- ``settings``: ``DisaggSettings`` of a context / generation worker.
- ``disagg_connector``: ``DisaggConnector`` (rank 0: leases on the context side, pulls on the
  generation side) and ``make_connector``.
- ``records``: rank 0's ``KVRecord`` per request and its ``KVStatus`` (the state machine).
- ``rank``: ``RankTransfer``, the part of ranks 1..N-1 of a multi-rank worker.
- ``messages``: the typed rank 0 <-> rank r control messages and events between them.
- ``pull``: ``KVPuller``, one rank's pulls (transfer clients, receive buffers, install),
  shared by both; ``pull_plan``: the pure plan of a rank's reads; ``recv_pool``: the receive
  buffers of a CPU cache; ``kvcopy``: token-major gather / scatter between cache and buffer.
- ``stream``: KV streaming's context side (``StreamPublisher``).

Kept import-light (no torch): the server's command line imports the settings from here.
"""

from disagg.kv_connector.errors import KVTransferError
from disagg.kv_connector.settings import DisaggSettings

__all__ = ["DisaggSettings", "KVTransferError"]
