"""The router's per-request metrics (``LoopCounter``, ``LoopHistogram``) expose what
prometheus_client's Counter and Histogram would for the same increments and observations."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from disagg.router.metrics import LATENCY_BUCKETS, P, RouterMetrics

VALUES = (0.0, 0.0005, 0.001, 0.0011, 0.003, 7.5, 120.0, 200.0)


def _samples(text: str, prefixes: tuple[str, ...]) -> list[str]:
    """The text's lines of these metrics, ``_created`` timestamps blanked."""
    out = []
    for line in text.splitlines():
        name = line.split(" ")[2] if line.startswith("#") else line.split("{")[0].split(" ")[0]
        if name.startswith(prefixes):
            out.append(re.sub(r"^(\S*_created(\{[^}]*\})?) \S+$", r"\1 T", line))
    return sorted(out)


def test_loop_metrics_render_as_prometheus_client_s() -> None:
    m = RouterMetrics(SimpleNamespace(pools={}))  # type: ignore[arg-type]
    ref = CollectorRegistry()
    c = Counter(P + "requests", "Requests by endpoint and outcome.", ["endpoint", "outcome"],
                registry=ref)
    d = Counter(P + "routing_decisions", "Workers chosen, by policy.",
                ["role", "policy", "worker"], registry=ref)
    h = Histogram(P + "request_latency_seconds", "Whole request at the router.",
                  buckets=LATENCY_BUCKETS, registry=ref)
    for i, v in enumerate(VALUES):
        outcome = "success" if i % 3 else "client_error"
        m.child(m.requests, "/v1/completions", outcome).inc()
        c.labels("/v1/completions", outcome).inc()
        m.child(m.decisions, "generation", "round_robin", f"w{i % 2}").inc(2)
        d.labels("generation", "round_robin", f"w{i % 2}").inc(2)
        m.request_latency.observe(v)
        h.observe(v)
    m.forget_worker("generation", "round_robin", "w1")
    d.remove("generation", "round_robin", "w1")
    names = (P + "requests", P + "routing_decisions", P + "request_latency_seconds")
    ours = _samples(generate_latest(m.registry).decode(), names)
    theirs = _samples(generate_latest(ref).decode(), names)
    assert ours == theirs
    assert any('le="0.001"} 3.0' in s for s in ours)  # 0.0, 0.0005 and 0.001 itself
    with pytest.raises(ValueError, match="labels"):
        m.requests.labels("/v1/completions")
