"""The engine's refusals, as the server sees them (torch-free: the server imports them)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queue``; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped because of an internal error."""
