"""The engine: scheduler + model runner + sampler + detokenizer, stepped in a loop.

- ``llm_engine``: ``LLMEngine`` (synchronous: ``add_request`` / ``abort_request`` / ``step``)
  and ``role_drain``;
- ``async_llm``: ``AsyncLLM``, an ``LLMEngine`` on its own thread for asyncio callers, and the
  commands its callers send that thread;
- ``client``: ``EngineClient``, what the HTTP server may call and read on the engine;
- ``request_state``: the engine's state of one request and the per-step work on it;
- ``admission``: what a request must satisfy to be queued; ``execution``: the executor, the KV
  connector over its cache, out-of-memory isolation;
- ``outputs`` and ``errors``: what the engine hands out and how it refuses.

``outputs``, ``errors``, ``client`` and ``admission`` are torch-free, and so is importing this
package: the engines themselves load on first use (``from disagg.engine import AsyncLLM``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg.engine.admission import context_only_params
from disagg.engine.client import EngineClient
from disagg.engine.errors import EngineDeadError, QueueFullError
from disagg.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from disagg.engine.async_llm import AsyncLLM
    from disagg.engine.llm_engine import LLMEngine, role_drain

__all__ = ["AsyncLLM", "CompletionOutput", "EngineClient", "EngineDeadError", "EngineStats",
           "LLMEngine", "QueueFullError", "RequestMetrics", "RequestOutput",
           "context_only_params", "role_drain"]


def __getattr__(name: str) -> Any:
    # Lazy: the engines load torch; the server imports the outputs, errors and client alone.
    if name == "AsyncLLM":
        from disagg.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name in ("LLMEngine", "role_drain"):
        from disagg.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module 'disagg.engine' has no attribute {name!r}")
