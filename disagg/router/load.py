"""The router's own latency samples per side, for the planner (``planner``'s docstring says
what each sample means): context-call latency (ms) and generation time per requested output
token (ms), with their completion times. Bounded twice: a sample older than ``keep_s`` (the
planner's ``window_s``) is dropped when a newer one is added, and at most ``MAX_SAMPLES`` are
kept per side (older ones fall off first). With ``keep_s == 0`` (no planner) nothing is kept:
the samples would only fill memory."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import TypeVar

from disagg.contracts.roles import Role

V = TypeVar("V")

MAX_SAMPLES = 20_000  # per side; at 300 req/s a 60 s window fits


class LoadWindows:
    """Samples of the two sides (``context`` / ``generation``) with their monotonic times."""

    def __init__(self, keep_s: float = 60.0) -> None:
        if keep_s < 0:
            raise ValueError(f"keep_s must be >= 0, got {keep_s}")
        self.keep_s = keep_s
        self._samples: dict[Role, deque[tuple[float, float | None]]] = {
            Role.CONTEXT: deque(maxlen=MAX_SAMPLES), Role.GENERATION: deque(maxlen=MAX_SAMPLES)}
        self._tokens: deque[tuple[float, int]] = deque(maxlen=MAX_SAMPLES)
        # Streamed generation calls: call start -> first bytes (ms): the KV pull plus any
        # wait for a decode slot, the generation side's part of the client's TTFT.
        self._waits: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def _add(self, window: deque[tuple[float, V]], t: float, value: V) -> None:
        """Append ``(t, value)`` after dropping what is older than ``t - keep_s`` (samples
        arrive in completion order, so the old ones are at the left)."""
        horizon = t - self.keep_s
        while window and window[0][0] < horizon:
            window.popleft()
        window.append((t, value))

    def context(self, latency_s: float, now: float | None = None) -> None:
        """One context call answered after ``latency_s``."""
        if self.keep_s == 0:
            return
        self._add(self._samples[Role.CONTEXT], time.monotonic() if now is None else now,
                  latency_s * 1000.0)

    def generation(self, duration_s: float, max_tokens: int | None,
                   now: float | None = None, first_byte_at: float | None = None) -> None:
        """One generation call done after ``duration_s``; ``max_tokens`` requested (None:
        unknown, the call counts towards the rate but gives no TPOT sample).

        A streamed answer (``first_byte_at``: when its first bytes came, monotonic) gives
        (end - first byte) / (max_tokens - 1): the time per token after the first, as a client
        measures TPOT, without the KV pull (which the context side's load slows) but with any
        wait for a decode slot. A whole answer: duration / max_tokens, pull included."""
        if self.keep_s == 0:
            return
        t = time.monotonic() if now is None else now
        per_token = None
        if first_byte_at is not None:
            self._add(self._waits, t, (first_byte_at - (t - duration_s)) * 1000.0)
        if first_byte_at is not None and max_tokens is not None and max_tokens > 1:
            per_token = (t - first_byte_at) * 1000.0 / (max_tokens - 1)
        elif max_tokens:
            per_token = duration_s * 1000.0 / max_tokens
        self._add(self._samples[Role.GENERATION], t, per_token)
        if max_tokens:
            self._add(self._tokens, t, max_tokens)

    @staticmethod
    def _since(items: Iterable[tuple[float, object]], since: float) -> list[object]:
        return [v for t, v in items if t >= since]

    def latencies_ms(self, side: Role | str, since: float) -> list[float]:
        """``side``'s samples newer than ``since`` (monotonic)."""
        return [v for v in self._since(self._samples[Role(side)], since) if v is not None]  # type: ignore[misc]

    def waits_ms(self, since: float) -> list[float]:
        """Streamed generation calls' waits for their first bytes (ms) newer than ``since``."""
        return self._since(self._waits, since)  # type: ignore[return-value]

    def completed(self, since: float) -> int:
        """Generation calls done since ``since``: the disaggregated requests served."""
        return sum(1 for t, _ in self._samples[Role.GENERATION] if t >= since)

    def mean_tokens(self, since: float) -> float | None:
        xs = self._since(self._tokens, since)
        return sum(xs) / len(xs) if xs else None
