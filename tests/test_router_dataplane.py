"""The router's data-plane choices: its event loop (uvloop when installed; asyncio's when told)
and the metric label children it resolves once (dropped with the worker they name)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from disagg.router.cli import event_loop_factory, event_loop_name
from disagg.router.membership import Membership
from disagg.router.metrics import RouterMetrics


def _loop_name(monkeypatch: pytest.MonkeyPatch, value: str | None) -> str:
    if value is None:
        monkeypatch.delenv("DISAGG_ROUTER_UVLOOP", raising=False)
    else:
        monkeypatch.setenv("DISAGG_ROUTER_UVLOOP", value)

    async def name() -> str:
        return event_loop_name()

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(name())


def test_uvloop_by_default_and_asyncio_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _loop_name(monkeypatch, "0") == "asyncio"
    pytest.importorskip("uvloop")
    assert _loop_name(monkeypatch, None) == "uvloop"
    assert _loop_name(monkeypatch, "1") == "uvloop"
    monkeypatch.setenv("DISAGG_ROUTER_UVLOOP", "maybe")
    with pytest.raises(ValueError, match="DISAGG_ROUTER_UVLOOP"):
        event_loop_factory()


def _membership() -> Membership:
    ms = Membership.__new__(Membership)  # no workers: the scrape-time collector reads .pools
    ms.pools = {}
    return ms


def test_metric_children_are_cached_and_dropped_with_their_worker() -> None:
    m = RouterMetrics(_membership())
    c1 = m.child(m.decisions, "generation", "round_robin", "h:1")
    assert m.child(m.decisions, "generation", "round_robin", "h:1") is c1
    c1.inc()
    m.forget_worker("generation", "round_robin", "h:1")
    # A new child after the worker left: its count starts again and is exported.
    c2 = m.child(m.decisions, "generation", "round_robin", "h:1")
    assert c2 is not c1
    c2.inc(2)
    text = generate_latest(m.registry).decode()
    assert 'worker="h:1"} 2.0' in text
