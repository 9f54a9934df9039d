"""How an engine failure becomes the client's HTTP error (status, OpenAI error type and code).

Two moments: a request the engine refuses before its first output (queue full, bad input, engine
down) gets its own status before any response header is sent; a request that fails later is
reported in-band when streamed. A generation_only request whose KV pull failed is answered 502
``kv_transfer_failed``: the router reads that code and prefills again (it is the context side's
fault, not the generation worker's).
"""

from __future__ import annotations

import logging

from disagg.contracts import protocol as P
from disagg.engine.errors import EngineDeadError, QueueFullError
from disagg.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a client told "queue full" should wait before retrying


# ---- the KV transfer failure (a generation_only request could not pull its prompt's KV) -------


def transfer_failed(out: RequestOutput) -> bool:
    """Did this finished request output fail because its KV could not be pulled? The engine
    types that failure (``RequestOutput.kv_transfer_error``); ``error`` is only its text."""
    return out.kv_transfer_error is not None


def kv_transfer_error(error: str) -> P.APIError:
    """The HTTP error of a failed KV pull: 502, the upstream (context worker) could not deliver
    the KV; never answer with tokens computed without it."""
    return P.APIError(502, error, type="kv_transfer_error", code="kv_transfer_failed")


# ---- everything else ------------------------------------------------------------------------


def unavailable(message: str, code: str) -> P.APIError:
    """503 with ``Retry-After``: this worker cannot take requests now."""
    return P.APIError(503, message, type="service_unavailable", code=code,
                      headers={"Retry-After": str(RETRY_AFTER_S)})


def map_engine_error(e: BaseException) -> P.APIError:
    """The client's error for an exception out of the engine (logged when it is a bug)."""
    if isinstance(e, P.APIError):
        return e
    if isinstance(e, QueueFullError):
        return P.APIError(503, f"the server is overloaded: {e}; retry later",
                          type="server_overloaded", code="queue_full",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return unavailable("the engine is not running", "engine_unavailable")
    if isinstance(e, ValueError):  # SamplingParamsError, engine validation: bad input
        return P.from_value_error(e)
    logger.error("engine request failed", exc_info=e)
    return P.APIError(500, "internal server error", type="internal_server_error")


def failed_in_engine(out: RequestOutput) -> P.APIError | None:
    """The error of a finished output that failed in the engine (None: it did not)."""
    if not out.finished:
        return None
    if transfer_failed(out):
        return kv_transfer_error(str(out.kv_transfer_error))
    error = out.error
    if error:
        return P.APIError(500, f"the request failed in the engine: {error}",
                          type="internal_server_error")
    return None
