"""The engine's one boundary to KV that crosses workers: ``KVConnector``.

An aggregated worker has no connector (``LLMEngine.connector is None``). A context or generation
worker has one, built by ``make_connector``; the engine calls the hooks below. Transports, ranks
and lease tables stay behind them; the engine hands each request's ``KVMode`` over unchanged
and decides only which blocks to hold for a lease (``add_request``'s ``lease``: the client's
``max_tokens``), when to release one, and what a role switch waits for. The shape follows
vLLM's ``KVConnectorBase_V1`` (a scheduler side and a worker side), cut down to the hooks this
engine calls.

Who calls what (every hook runs on the engine thread unless it says otherwise)::

    add_request        LLMEngine.add_request, after the scheduler queued the request
    start_step         LLMEngine.step, after scheduling, before the model runs the plan
    start_load         LLMEngine.step, for each KVFetch of the plan (blocks just allocated)
    get_finished       LLMEngine.service_transfers, once per loop turn, before step
    request_finished   once per request, when the engine builds its final output (any status)
    release_lease      AsyncLLM's engine thread (the router gave up on a context answer)
    lease_is_live      any thread (AsyncLLM.release_lease; the server: a kv_stream_id in use)
    release_remote     any thread (a generation-only request refused before it was queued)
    busy               the idle engine loop: how soon to come back without a wake-up
    drain_pending      AsyncLLM's engine thread, each loop turn while a role switch drains
    set_role           AsyncLLM's engine thread, once that drain is over
    info               any thread: the server's /server_info, registration, start-up log
    stats_snapshot     any thread: the server's /metrics scrape
    shutdown           the engine's shutdown (once; the process is ending)

Attributes the engine and the server read: ``role`` (the one owner of a context / generation
worker's role; it changes only through ``set_role``), ``worker_id``, ``layout`` (this worker's
KV layout: a generation_only request's params must be compatible with it), ``settings`` (the
cluster token and the KV peer allowlist the server's access checks use) and ``streams`` (KV
streaming's publisher: the engine hooks its progress into the model).

Rules every implementation keeps:

- Never block the engine loop: transports run on their own threads and report through
  ``get_finished``; a callback from such a thread may only enqueue and call ``wake``.
- Blocks are always freed. The scheduler owns them: a request's blocks are freed when it ends,
  except when ``add_request`` asked to hold them and it ended by length; then the engine hands
  them to ``request_finished``. If that returns None (or raises) the engine frees them at once;
  if it returns params they stay held until ``get_finished`` names the request in
  ``leases_ended`` (confirmed, released or expired), and then the engine frees them.
- A load that started is either reported by ``get_finished`` (loaded or failed) or cancelled by
  ``request_finished`` (abort, error): a late write must never land in blocks reused since. A
  request that ends while its KV is arriving (it was handed to ``start_load``) keeps its blocks
  out of the pool (the scheduler's ``draining``) until ``get_finished`` names it in
  ``loads_stopped``: the connector names every such request exactly once, once nothing can
  write into its blocks on any rank (at the next call when nothing was in flight). Cancelling
  never waits on the engine thread. (A load reported failed has ended: the engine frees that
  request's blocks at once, and naming it again is harmless.)
- A remote lease this worker was handed is given back exactly once: when its KV is in place,
  or on every path that ends the request without it.

What lives behind the hooks, the engine loop unchanged:

- KV streaming (``kv_connector/stream.py``): a ``ContextStream`` request's lease opens in
  ``add_request``; ``start_step`` hands each step's streaming chunks to the publisher, whose
  progress the model reports layer by layer (the hook the engine installs from ``streams``);
  ``request_finished`` publishes its first token. A streamed pull (``Pull`` whose
  ``params.stream``) starts in ``start_load`` and is reported by ``get_finished`` with its first
  token (``FinishedTransfers.first``).
- Transports: a ``TransportBackend`` (``disagg.transfer.backends``); a GPU-direct one moves
  device memory, and the pull lands payloads in GPU memory when the client says it can
  (``device_payloads``). Nothing above the transport depends on which.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disagg.contracts.kv_mode import KVMode
from disagg.contracts.params import ContextParams, LeaseRef
from disagg.contracts.roles import Role
from disagg.kv_connector.errors import KVTransferError
from disagg.layout import WorkerLayout
from disagg.request import Request
from disagg.scheduler import KVFetch, SchedulerOutput
from disagg.transfer.stats import TransferStatsSnapshot

if TYPE_CHECKING:
    from disagg.kv_connector.settings import DisaggSettings
    from disagg.kv_connector.stream import StreamPublisher


@dataclass(frozen=True)
class FinishedTransfers:
    """What ``get_finished`` reports since its last call."""

    # Requests whose held blocks may be freed now (their lease ended on every rank).
    leases_ended: list[str] = field(default_factory=list)
    # Requests whose prompt KV is in their blocks (every rank): they decode from the next step.
    loaded: list[str] = field(default_factory=list)
    # Requests whose pull failed: the engine fails them (their blocks are freed then).
    failed: list[tuple[str, KVTransferError]] = field(default_factory=list)
    # Streamed requests among ``loaded``: the context worker's first token(s), which came with
    # the KV ({"tokens": [ids], "logprobs": [{id: logprob}] | None}).
    first: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Requests that ended while their KV was arriving, whose transfer can no longer write
    # into their blocks on any rank: the engine frees those blocks now.
    loads_stopped: list[str] = field(default_factory=list)
    # Requests whose pull of a peer's prefix (``add_prefix``) failed, every rank's reads
    # ended and the lease given back: they compute the prefix themselves.
    prefix_failed: list[tuple[str, KVTransferError]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.leases_ended or self.loaded or self.failed or self.loads_stopped
                    or self.prefix_failed)


class KVConnector(ABC):
    """A worker's KV transfer side, driven by the engine (see the module docstring)."""

    role: Role  # Role.CONTEXT or Role.GENERATION; changes only through ``set_role``
    worker_id: str  # new on every start: peers seeing another id know the worker restarted
    layout: WorkerLayout  # this worker's KV layout (what a pulled KV must be compatible with)
    settings: DisaggSettings  # the worker's transfer settings (token, peer allowlist, ...)
    streams: StreamPublisher  # KV streaming (context side): the model reports each layer to it

    # ---- scheduler side -----------------------------------------------------------------------

    @abstractmethod
    def add_request(self, request_id: str, mode: KVMode, lease: bool) -> bool:
        """A request was queued (also one the scheduler refused at once: it still ends through
        ``request_finished``), with its mode (``contracts/kv_mode.py``: ``Pull`` names the KV to
        pull, ``ContextStream`` is leased from now on). ``lease``: a context request whose
        client asked for more than its first token, whose blocks go under a lease if it
        finishes by length. Returns True if the scheduler must hold its blocks when it finishes
        by length (see the block rule in the module docstring)."""

    @abstractmethod
    def add_prefix(self, request_id: str, params: ContextParams) -> None:
        """After ``add_request``: the request (``Local`` or ``ContextOnly``) pulls the KV of
        its first ``params.num_tokens`` prompt tokens from the peer's prefix lease ``params``
        names (``kv_mode.PrefixPull``), through ``start_load`` as a pull; once in place it is
        reported in ``loaded`` (no first token: the request computes the rest), a failure in
        ``prefix_failed`` (never ``failed``: the request computes the prefix). The lease goes
        back on every path, as a pull's. A context request's own lease (``add_request``
        answered True) is made as usual once it finishes."""

    @abstractmethod
    def lease_prefix(self, lease_id: str, token_ids: list[int], block_ids: list[int]
                     ) -> ContextParams:
        """Put ``block_ids`` (held by the scheduler under ``lease_id``: the cached blocks of
        ``token_ids``' first ``len(block_ids)`` blocks) under a lease for a peer to pull
        (``POST /kv_prefix``); the params name them (no first token). Its end comes through
        ``get_finished`` (``leases_ended``) like a context lease's. Engine thread."""

    @abstractmethod
    def request_finished(self, request: Request, held_blocks: list[int] | None,
                         logprobs: list[dict[int, float]] | None) -> ContextParams | None:
        """The request ended (``request.status`` is final); called once, before its final
        output is built. ``held_blocks``: the blocks the scheduler held for it, or None.
        Returns the params that put them under a lease (they go out with the answer), or None:
        nothing is leased and the engine frees ``held_blocks``. May raise if the lease could
        not be made: the engine then frees the blocks and fails the request. Also where a
        load in flight is cancelled (without waiting: ``loads_stopped``) and a remote lease
        is given back."""

    # ---- worker side --------------------------------------------------------------------------

    @abstractmethod
    def start_step(self, sched: SchedulerOutput) -> None:
        """The plan about to run (before the model): prepare what must exist before any of
        its outputs can leave this worker (e.g. leases on every rank)."""

    @abstractmethod
    def start_load(self, fetch: KVFetch) -> None:
        """Start pulling a request's prompt KV into ``fetch.block_ids``; returns at once. Raises
        if the pull cannot even start (the engine then fails this request only)."""

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Never blocks: leases that ended, loads that finished or failed since the last
        call. Finished loads are installed in the cache before they are reported."""

    # ---- outside the step ---------------------------------------------------------------------

    @abstractmethod
    def release_lease(self, lease_id: str) -> bool:
        """End a lease nobody will read now, instead of at its expiry; its blocks are freed
        through ``get_finished``. False if it was not live."""

    @abstractmethod
    def lease_is_live(self, lease_id: str) -> bool:
        """Whether this worker holds the lease (any thread)."""

    @abstractmethod
    def release_remote(self, params: ContextParams | LeaseRef) -> None:
        """Give back a context lease this worker was handed but will not read (any thread):
        its full params, or only what releasing needs when the rest did not parse."""

    @abstractmethod
    def busy(self) -> bool:
        """Whether something needs the engine loop back soon without a wake-up (lease expiry
        sweeps, reads in flight)."""

    @abstractmethod
    def set_role(self, role: Role) -> None:
        """Serve ``role`` from now on (a run-time role switch, once ``drain_pending`` is all
        zero; engine thread)."""

    @abstractmethod
    def drain_pending(self) -> tuple[int, int]:
        """(live leases, pulls in flight): what a role switch still waits for (engine
        thread)."""

    @abstractmethod
    def info(self) -> dict[str, object]:
        """What the worker advertises about its KV transfer (``/v1/cluster_info``)."""

    @abstractmethod
    def stats_snapshot(self) -> TransferStatsSnapshot:
        """Transfer counters of the whole worker (every rank), for metrics (any thread)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop serving and close connections (the engine's shutdown)."""
