"""The typed error of a request whose KV could not be pulled from its context worker.

It travels on ``RequestOutput.kv_transfer_error`` (the engine's side) and in a rank's
``FetchDone`` event (ranks 1..N-1 of a generation worker); the HTTP server answers such a request
with 502 ``kv_transfer_failed`` instead of tokens computed without the KV. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVTransferError:
    """Why a generation-only request's prompt KV did not arrive.

    ``message`` is the whole text for people (it becomes ``RequestOutput.error`` and the HTTP
    error's message); ``code`` is the transfer protocol's code when a context rank answered with
    one (``expired_lease``, ``unknown_lease``, ...), None for local failures (a backend that
    could not start, a payload that could not be installed)."""

    message: str
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    @classmethod
    def because(cls, what: str, code: str | None = None) -> KVTransferError:
        """``what`` follows the words "kv transfer failed" (start it with a space or ':')."""
        return cls(f"kv transfer failed{what}", code)
