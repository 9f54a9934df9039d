"""KV that crosses workers, behind one boundary: the engine holds a ``KVConnector`` (or none).

- ``base``: the abstract ``KVConnector`` (its hooks, who calls them, the rules), ``RequestKV``,
  ``FinishedTransfers``.
- ``errors``: ``KVTransferError``, the typed failure carried on a request's output.
- ``settings``: ``DisaggSettings`` of a context / generation worker.
- ``disagg_connector``: ``DisaggConnector`` (rank 0: leases on the context side, pulls on the
  generation side) and ``make_connector``.
- ``rank``: ``RankTransfer``, the part of ranks 1..N-1 of a multi-rank worker.
- ``messages``: the typed rank 0 <-> rank r control messages and events between them.
- ``pull``: one rank's share of a pull (plan, submit, install), shared by both.

Kept import-light (no torch): the server's command line imports the settings from here.
"""

from disagg.kv_connector.errors import KVTransferError
from disagg.kv_connector.settings import DisaggSettings

__all__ = ["DisaggSettings", "KVTransferError"]
