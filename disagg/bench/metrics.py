"""Per-request measurements and their aggregates: mean, median and percentiles of each
latency, request and token throughputs, and goodput under SLOs.

Definitions (times in seconds internally, milliseconds in reports):

- TTFT: request sent -> first chunk carrying generated content.
- ITL: gap between successive content-carrying chunks (a chunk holding several tokens counts
  once, as in vLLM's benchmark).
- E2EL: request sent -> end of the stream.
- TPOT = (E2EL - TTFT) / (output_tokens - 1), defined only for output_tokens > 1.
- tokens/s/user = 1 / TPOT.
- goodput = requests per second, over the benchmark duration, that met *every* given SLO. A
  request with one output token has no TPOT and meets any TPOT SLO.

Failed requests are counted (with their messages) and left out of every latency statistic and
of the token totals.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)  # mean and median are always reported


@dataclass
class RequestRecord:
    """What one request measured. Times in seconds."""

    index: int
    success: bool = False
    error: str = ""
    start: float = 0.0  # send time, seconds after the benchmark start
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0  # as the dataset built it
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, when the server sent usage
    expected_output_len: int = 0  # max_tokens asked
    output_tokens: int = 0  # usage.completion_tokens, else content chunks counted
    output_chars: int = 0
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        return compute_tpot(self.e2el, self.ttft, self.output_tokens)

    @property
    def input_tokens(self) -> int:
        # The server's count when it gave one (chat templates add tokens), else the dataset's.
        return self.server_prompt_tokens if self.server_prompt_tokens is not None \
            else self.prompt_len

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("ttft", "e2el"):
            d[f"{k}_ms"] = d.pop(k) * 1000.0
        d["itl_ms"] = [x * 1000.0 for x in d.pop("itl")]
        tpot = self.tpot
        d["tpot_ms"] = None if tpot is None else tpot * 1000.0
        d["start_s"] = d.pop("start")
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RequestRecord:
        return cls(index=d["index"], success=d["success"], error=d.get("error", ""),
                   start=d.get("start_s", 0.0), ttft=d["ttft_ms"] / 1000.0,
                   e2el=d["e2el_ms"] / 1000.0, itl=[x / 1000.0 for x in d.get("itl_ms", [])],
                   prompt_len=d.get("prompt_len", 0),
                   server_prompt_tokens=d.get("server_prompt_tokens"),
                   expected_output_len=d.get("expected_output_len", 0),
                   output_tokens=d.get("output_tokens", 0),
                   output_chars=d.get("output_chars", 0),
                   finish_reason=d.get("finish_reason"))


def compute_tpot(e2el: float, ttft: float, output_tokens: int) -> float | None:
    """(E2EL - TTFT) / (output_tokens - 1); None when fewer than two tokens came out."""
    if output_tokens <= 1:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def compute_itls(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between successive content-chunk arrival times."""
    return [b - a for a, b in zip(chunk_times[:-1], chunk_times[1:], strict=True)]


def percentile_key(p: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9'."""
    return f"p{p:g}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'90,99' -> (90.0, 99.0); each in (0, 100]."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        p = float(part)
        if not 0 < p <= 100:
            raise ValueError(f"percentile {part!r} not in (0, 100]")
        out.append(p)
    if not out:
        raise ValueError("no percentile given")
    return tuple(out)


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"{item!r}: expected NAME:MS with NAME one of "
                             f"{', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"{item!r}: the limit must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(rec: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """True if a successful request meets every SLO (limits inclusive, in ms)."""
    if not rec.success:
        return False
    tpot = rec.tpot
    values = {"ttft": rec.ttft, "e2el": rec.e2el, "tpot": 0.0 if tpot is None else tpot}
    return all(values[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def _stats(name: str, values_ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    # Linear-interpolated percentiles (numpy's default), like vLLM's benchmark.
    arr = np.asarray(values_ms, dtype=float)
    if arr.size == 0:
        arr = np.zeros(1)  # no data: report zeros rather than NaN (valid JSON)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def steady_state_output_throughput(records: Sequence[RequestRecord]
                                   ) -> tuple[float, float] | None:
    """Output tokens/s while the load was steady: (tokens/s, window length s), or None.

    The window runs from the first completion (the pipeline has filled: a request went all the
    way through) to the last send (after it, the load only drains). Tokens are counted at the
    time they arrived: the first at ``start + ttft``, then one content chunk per ITL (a chunk of
    several tokens counts ``output_tokens / chunks`` each). Unlike ``output_throughput`` (all
    tokens over first send to last byte) it is not diluted by the ramp-up of a closed loop
    whose requests all start together, nor by the final drain, so it can be compared with a
    steady-state prediction. None when the window is empty (every request sent before the
    first completed) or nothing succeeded.
    """
    ok = [r for r in records if r.success and r.output_tokens > 0]
    if not ok or not records:
        return None
    t0 = min(r.start + r.e2el for r in ok)
    t1 = max(r.start for r in records)
    if t1 <= t0:
        return None
    tokens = 0.0
    for r in ok:
        per_chunk = r.output_tokens / (1 + len(r.itl))
        t = r.start + r.ttft
        for gap in (0.0, *r.itl):
            t += gap
            if t0 <= t <= t1:
                tokens += per_chunk
    return tokens / (t1 - t0), t1 - t0


def summarize(records: Sequence[RequestRecord], duration: float,
              slos_ms: Mapping[str, float] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """Aggregate metrics of a benchmark run of ``duration`` seconds."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    duration = max(duration, 1e-9)
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "request_goodput": None,
        "goodput_slos_ms": dict(slos_ms) if slos_ms else None,
        # 1/TPOT averaged over requests: the decode speed a user sees.
        "mean_tokens_per_s_per_user": float(np.mean([1.0 / t for t in tpots if t > 0]))
        if any(t > 0 for t in tpots) else 0.0,
    }
    steady = steady_state_output_throughput(records)
    summary["steady_output_throughput"] = None if steady is None else steady[0]
    summary["steady_window_s"] = None if steady is None else steady[1]
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration
    summary.update(_stats("ttft", [r.ttft * 1000.0 for r in ok], percentiles))
    summary.update(_stats("tpot", [t * 1000.0 for t in tpots], percentiles))
    summary.update(_stats("itl", [x * 1000.0 for r in ok for x in r.itl], percentiles))
    summary.update(_stats("e2el", [r.e2el * 1000.0 for r in ok], percentiles))
    summary["errors"] = dict(Counter(r.error or "unknown error" for r in failed).most_common())
    return summary


def format_summary(summary: Mapping[str, Any], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                   title: str = "Serving Benchmark Result") -> str:
    """The end-of-run table."""
    width = 60
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value: Any) -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"{label:<44}{value!s:>16}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if summary.get("request_goodput") is not None:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    if summary.get("steady_output_throughput") is not None:
        row("Steady-state output throughput (tok/s):", summary["steady_output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    row("Mean tokens/s/user:", summary["mean_tokens_per_s_per_user"])
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for m in LATENCY_METRICS:
        lines.append(f"{' ' + names[m] + ' ':-^{width}}")
        row(f"Mean {m.upper()} (ms):", summary[f"mean_{m}_ms"])
        row(f"Median {m.upper()} (ms):", summary[f"median_{m}_ms"])
        for p in percentiles:
            row(f"P{p:g} {m.upper()} (ms):", summary[f"{percentile_key(p)}_{m}_ms"])
    if summary.get("errors"):
        lines.append(f"{' Errors ':-^{width}}")
        for msg, count in summary["errors"].items():
            lines.append(f"{count:>6} x {msg[:200]}")
    lines.append("=" * width)
    return "\n".join(lines)
