"""``EngineClient``: everything the HTTP server may call and read on its engine, typed.

``AsyncLLM`` implements it; so do the tests' stand-in engines. Torch-free (typing-only imports):
the server imports it without loading the engine. Nothing here is optional: a worker without a
KV connector (aggregated) has ``transfer`` None, one whose role never switched has
``role_drain_now`` None, a single-process worker has one pid in ``rank_pids``.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from disagg.config import EngineConfig
    from disagg.contracts.kv_mode import KVMode, PrefixPull
    from disagg.contracts.params import ContextParams, LeaseRef
    from disagg.contracts.roles import Role, RoleDrain
    from disagg.engine.outputs import EngineStats, RequestOutput
    from disagg.kv_cache.events import KVEventLog
    from disagg.kv_connector.base import KVConnector
    from disagg.request import SamplingParams


class EngineTokenizer(Protocol):
    """What the server uses of the engine's tokenizer (``disagg.tokenizer.Tokenizer``)."""

    # the Jinja template chat prompts are rendered with; the server may replace it at start
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


class EngineClient(Protocol):
    """The engine as the worker server sees it (an ``AsyncLLM``)."""

    config: EngineConfig
    # New on every start: a router seeing another id knows its view of the cache is stale.
    worker_id: str
    kv_events: KVEventLog  # the KV cache's stored / removed block hashes (/kv_events)
    # The last measure of a role switch's drain (None: no switch measured yet).
    role_drain_now: RoleDrain | None

    @property
    def tokenizer(self) -> EngineTokenizer:
        """The engine's tokenizer (the server sets its ``chat_template`` at start)."""

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine loop (the app's lifespan, when it owns the engine)."""

    async def shutdown(self) -> None:
        """Stop the loop, wait for it, release the executor and the connector."""

    def close(self) -> None:
        """Release the executor and the connector now, from any thread (idempotent)."""

    def is_healthy(self) -> bool:
        """The loop runs and can serve."""

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can never serve again (a rank died): the server should exit."""

    @property
    def rank_pids(self) -> list[int]:
        """The worker's rank processes, rank 0 (this process) first."""

    @property
    def transfer(self) -> KVConnector | None:
        """The KV connector of a context / generation worker; None when aggregated."""

    def stats(self) -> EngineStats:
        """The engine's counters now (may raise when the engine is not running)."""

    # ---- requests ----------------------------------------------------------------------------

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, mode: KVMode = ...,
                 prefix: PrefixPull | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until the finished one (refusals raise
        before the first: ``QueueFullError``, ``EngineDeadError``, ValueError). ``prefix``:
        a peer's prefix lease to pull (given back on every path)."""

    async def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed; its generator ends with an aborted output)."""

    # ---- KV leases and roles -----------------------------------------------------------------

    def release_lease(self, lease_id: str) -> bool:
        """End a context lease now (thread-safe); True if it was live."""

    async def lease_prefix(self, token_ids: list[int]) -> ContextParams | None:
        """Lease the cached KV of ``token_ids``' leading full blocks for a peer
        (``kv_peer_reuse``): its params, or None when none is cached."""

    def release_remote(self, lease: ContextParams | LeaseRef) -> None:
        """Give back the context lease of a generation_only request refused before the engine
        took it (thread-safe)."""

    def switch_role(self, role: Role) -> tuple[cf.Future[RoleDrain], cf.Future[RoleDrain]]:
        """Switch the KV connector to ``role`` once the current role drained: (started, done)
        futures, each resolved with a ``RoleDrain``."""
