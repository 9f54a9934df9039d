"""Per-request timing: where the time of one request went, phase by phase (torch-free).

Every process on a request's path keeps a ``Timeline`` of it: the monotonic time it took the
request in (``start``) and the end of each phase after it, in order. ``consecutive`` turns such
stamps into back-to-back durations, so that they sum exactly to the span they cover (a stamp
earlier than the one before it counts as that one: its phase took 0 s; a stamp not taken,
None, drops its phase and its time goes to the next one). The same stamps feed three exports:
the ``disagg_request_phase_seconds{phase}`` histograms of each process's ``/metrics`` (every
request that succeeded), the answer's ``timing`` object when the client asks for it (body
``"timing": true`` or header ``X-Disagg-Timing: 1``), and trace spans (one span per phase,
from the same stamps: ``disagg/tracing.py``).

A worker's phases (``server/request_timing.py`` reads the engine's ``RequestMetrics``)::

    admission       HTTP request in -> queued in the engine (body read, checked, tokenized)
    queue           queued -> first scheduled (aggregated and context requests)
    prefill         first scheduled -> first token sampled (chunked prefill, preemptions in)
    context_answer  first token -> the context answer built (lease made; context_only)
    kv_wait         queued -> the KV reads submitted (generation_only: waiting for blocks)
    kv_transfer     reads submitted -> the engine loop's poll that found every rank's reads
                    done (a multi-rank worker's ranks >= 1 install their slice inside it; a
                    streamed pull waits for the context worker's prefill inside it)
    kv_install      that poll -> the KV in place (rank 0's copy into the cache, with any
                    other pull finished in the same poll): the first token is then ready
    first_token     first token -> its stream chunk handed to the HTTP server (streamed)
    decode          -> the last token
    finish          last token -> the answer built (JSON, or the stream's last chunk)

The router's phases (``router/``): ``route`` (request in -> its first worker call sent: body
parsed, checks, the policy's pick), ``context_call`` (-> the context answer read; failed tries
included), ``handover`` (-> the generation call sent: the router's own gap between the two
workers), ``generation_call`` (-> the first byte of a streamed answer, or the whole answer)
and ``decode`` (first byte -> end of the stream). In the breakdown it answers with, each call
whose worker reported its own timing is replaced by that worker's phases and the call's time
outside them (``context_network`` / ``generation_network``: connection, request and answer
bytes, the HTTP servers); of a streamed generation call only the phases up to the worker's
first chunk (its ``decode`` is the router's).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# ---- the words -------------------------------------------------------------------------------

ADMISSION = "admission"
QUEUE = "queue"
PREFILL = "prefill"
CONTEXT_ANSWER = "context_answer"
KV_WAIT = "kv_wait"
KV_TRANSFER = "kv_transfer"
KV_INSTALL = "kv_install"
FIRST_TOKEN = "first_token"
DECODE = "decode"
FINISH = "finish"
WORKER_PHASES = (ADMISSION, QUEUE, PREFILL, CONTEXT_ANSWER, KV_WAIT, KV_TRANSFER, KV_INSTALL,
                 FIRST_TOKEN, DECODE, FINISH)

ROUTE = "route"
CONTEXT_CALL = "context_call"
HANDOVER = "handover"
GENERATION_CALL = "generation_call"
ROUTER_PHASES = (ROUTE, CONTEXT_CALL, HANDOVER, GENERATION_CALL, DECODE)
# In the router's breakdown only: a call's time outside the worker that served it.
CONTEXT_NETWORK = "context_network"
GENERATION_NETWORK = "generation_network"

ROUTER = "router"  # ``Phase.at`` of the router's phases (a worker's: its role)
FIELD = "timing"  # the request's opt-in field and the answer's object
HEADER = "X-Disagg-Timing"  # the opt-in header ("1" / "true")
METRIC = "disagg_request_phase_seconds"
# From 100 us (a handover, an install) to minutes (a long decode).
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ON, _OFF = frozenset(("1", "true", "yes", "on")), frozenset(("", "0", "false", "no", "off"))


def header_asks(value: str | None) -> bool:
    """Whether an ``X-Disagg-Timing`` header value asks for timing; ValueError when it is
    neither yes (1, true, yes, on) nor no (0, false, no, off, empty)."""
    if value is None:
        return False
    v = value.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{HEADER}: expected 1 or 0 (true / false), got {value[:40]!r}")


def field_error(value: Any) -> str | None:
    """Why a request's ``timing`` field is refused (None: a boolean, or absent / null)."""
    if value is None or isinstance(value, bool):
        return None
    return f"{FIELD}: must be a boolean (true asks for the answer's timing breakdown)"


# ---- stamps -> phases ------------------------------------------------------------------------


def consecutive(start: float, ends: Iterable[tuple[str, float | None]]
                ) -> list[tuple[str, float]]:
    """Back-to-back phase durations from each phase's end stamp, in order: phase i runs from
    the boundary before it (``start`` for the first) to ``max(its stamp, that boundary)``. A
    None stamp drops its phase (the next one starts where the last kept one ended). The
    durations are >= 0 and sum to the last boundary minus ``start``::

        start   e1        e2 (None)   e3
          |-----|--------------------|      -> [(p1, e1 - start), (p3, e3 - e1)]
    """
    out: list[tuple[str, float]] = []
    at = start
    for name, t in ends:
        if t is None:
            continue
        end = t if t > at else at
        out.append((name, end - at))
        at = end
    return out


class Timeline:
    """One request's stamps in one process: ``start`` (monotonic seconds) and the end of each
    phase after it, in order (a name may come back: a request prefilled twice)."""

    __slots__ = ("start", "ends")

    def __init__(self, start: float | None = None) -> None:
        self.start = time.monotonic() if start is None else start
        self.ends: list[tuple[str, float]] = []

    def end(self, phase: str, at: float | None = None) -> None:
        """``phase`` ended ``at`` (now when None)."""
        self.ends.append((phase, time.monotonic() if at is None else at))

    @property
    def last(self) -> str | None:
        """The phase that ended last (None: none yet)."""
        return self.ends[-1][0] if self.ends else None

    def phases(self) -> list[tuple[str, float]]:
        return consecutive(self.start, self.ends)

    def span(self) -> float:
        """From ``start`` to the last boundary (the phases' sum)."""
        return max((t for _, t in self.ends), default=self.start) - self.start


# ---- the answer's breakdown ------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One phase of a breakdown: its name, seconds and where it was measured (``router``, or a
    worker's role: ``context``, ``generation``, ``aggregated``)."""

    name: str
    seconds: float
    at: str


@dataclass(frozen=True)
class Breakdown:
    """A request's phases as one process answers them (the ``timing`` object). The first
    ``ttft_phases`` phases end at the request's first token; ``ttft_s`` and ``total_s`` are
    measured by that process itself (the phases sum to them: checked by the tests).
    ``ttft_s`` is None where the first token is not seen (a non-streamed answer whose worker
    did not report its timing)."""

    phases: tuple[Phase, ...]
    ttft_phases: int | None
    ttft_s: float | None
    total_s: float

    def to_json(self) -> dict[str, Any]:
        return {"ttft_s": _round(self.ttft_s), "total_s": _round(self.total_s),
                "ttft_phases": self.ttft_phases,
                "phases": [{"phase": p.name, "seconds": _round(p.seconds), "at": p.at}
                           for p in self.phases]}

    @classmethod
    def from_json(cls, d: Any) -> Breakdown | None:
        """A worker's ``timing`` object; None when it is not one (then the router keeps its
        own call phase)."""
        try:
            phases = tuple(Phase(p["phase"], float(p["seconds"]), p["at"])
                           for p in d["phases"])
            n, ttft, total = d.get("ttft_phases"), d.get("ttft_s"), float(d["total_s"])
        except (KeyError, TypeError, ValueError):
            return None
        ok = all(isinstance(p.name, str) and isinstance(p.at, str) and _finite(p.seconds)
                 for p in phases)
        if not ok or not _finite(total) or not (n is None or (
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= len(phases))):
            return None
        if ttft is not None and not (isinstance(ttft, int | float) and _finite(ttft)):
            return None
        return cls(phases, n, None if ttft is None else float(ttft), total)


def worker_breakdown(role: str, start: float, ends: Sequence[tuple[str, float | None]],
                     first_token: str, first_token_at: float | None) -> Breakdown:
    """A worker's breakdown of its stamps (``first_token``: the phase that ends at the first
    token the client sees, ``first_token_at`` its stamp); the span ends at the last stamp."""
    phases = consecutive(start, ends)
    names = [n for n, _ in phases]
    n = names.index(first_token) + 1 if first_token in names else None
    last = max((t for _, t in ends if t is not None), default=start)
    ttft = None if first_token_at is None else max(first_token_at - start, 0.0)
    return Breakdown(tuple(Phase(name, s, role) for name, s in phases), n, ttft,
                     max(last - start, 0.0))


def router_breakdown(tl: Timeline, ctx: Breakdown | None, gen: Breakdown | None,
                     streamed: bool) -> Breakdown:
    """The whole request's breakdown at the router: its own phases, with its last
    ``context_call`` replaced by ``ctx`` and its last ``generation_call`` by ``gen`` (each
    preceded by the call's time outside the worker; module docstring). ``streamed``: the
    generation call ended at the stream's first byte (``decode`` follows), so only ``gen``'s
    phases up to its first chunk go in."""
    own = tl.phases()
    names = [n for n, _ in own]
    last_ctx = _last(names, CONTEXT_CALL)
    last_gen = _last(names, GENERATION_CALL)
    phases: list[Phase] = []
    ttft_n: int | None = None
    for i, (name, seconds) in enumerate(own):
        worker = ctx if i == last_ctx else gen if i == last_gen else None
        if worker is not None and streamed and i == last_gen:
            if worker.ttft_phases is None or worker.ttft_s is None:
                worker = None  # (its first chunk is not marked: keep the call whole)
        if worker is None:
            phases.append(Phase(name, seconds, ROUTER))
            if i == last_gen and streamed:
                ttft_n = len(phases)
            continue
        cut = i == last_gen and streamed
        inner = worker.phases[:worker.ttft_phases] if cut else worker.phases
        span = (worker.ttft_s if cut else worker.total_s) or 0.0
        network = CONTEXT_NETWORK if name == CONTEXT_CALL else GENERATION_NETWORK
        phases.append(Phase(network, max(seconds - span, 0.0), ROUTER))
        if worker.ttft_phases is not None and (i == last_gen or last_gen is None):
            ttft_n = len(phases) + worker.ttft_phases
        phases.extend(inner)
    ttft = None if ttft_n is None else sum(p.seconds for p in phases[:ttft_n])
    if streamed and last_gen is not None:
        # measured: the stream's first byte, not the phases' sum
        ttft = sum(s for _, s in own[:last_gen + 1])
    return Breakdown(tuple(phases), ttft_n, ttft, tl.span())


def _last(names: list[str], name: str) -> int | None:
    for i in range(len(names) - 1, -1, -1):
        if names[i] == name:
            return i
    return None


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def describe(timing: Mapping[str, Any]) -> list[str]:
    """A ``timing`` object as lines for people (the demo prints them): one per phase, where it
    was measured and its milliseconds, a line where the first token came."""
    def ms(x: Any) -> str:
        return "?" if not isinstance(x, int | float) else f"{x * 1e3:.1f} ms"

    phases = timing.get("phases") or []
    n = timing.get("ttft_phases")
    lines = [f"where the time went (TTFT {ms(timing.get('ttft_s'))}, total "
             f"{ms(timing.get('total_s'))}):"]
    for i, p in enumerate(phases):
        if i == n:
            lines.append(f"  {'':<11} -- first token ({ms(timing.get('ttft_s'))}) --")
        lines.append(f"  {p.get('at', '?'):<11} {p.get('phase', '?'):<19} "
                     f"{ms(p.get('seconds')):>10}")
    return lines
