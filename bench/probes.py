"""What the engine benchmarks read of an engine beyond its outputs, through public names only.

``ScheduleLog`` keeps the ``SchedulerOutput`` of the engine's latest step: which requests the
step ran, how many tokens each, how many were decodes. ``LLMEngine.step()`` asks its public
``scheduler`` for the step's work through ``Scheduler.schedule()``; the log wraps that method
on the engine's own scheduler instance (the class and every other engine are untouched) and
puts the instance back as it was on ``close()``.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disagg.scheduler import SchedulerOutput


class ScheduleLog:
    """The latest ``SchedulerOutput`` of ``engine`` (an ``LLMEngine``), ``None`` before its
    first step; a context manager (``close()`` on exit)."""

    def __init__(self, engine: Any) -> None:
        self.last: SchedulerOutput | None = None
        self._scheduler = engine.scheduler
        self._own = self._scheduler.__dict__.get("schedule")  # set on the instance already
        inner = self._scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> SchedulerOutput:
            out = inner(*args, **kwargs)
            self.last = out
            return out

        self._wrapper = schedule
        self._scheduler.schedule = schedule

    def close(self) -> None:
        """Put the scheduler's ``schedule`` back as it was (unless something wrapped it
        after this log: then the log's wrapper stays, recording into an unread object)."""
        if self._scheduler.__dict__.get("schedule") is not self._wrapper:
            return
        if self._own is None:
            del self._scheduler.schedule
        else:
            self._scheduler.schedule = self._own

    def __enter__(self) -> ScheduleLog:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
