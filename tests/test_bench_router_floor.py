"""``bench.router_floor`` relays answers byte for byte (non-streamed and streamed, several
connections, a new back connection when none is idle), and ``bench.router_overhead``'s report
says from the measured floors whether a Python router can reach vllm-router per CPU-second."""

from __future__ import annotations

import asyncio

import pytest

from bench import router_floor
from bench import router_overhead as ro


async def _through_the_floor() -> tuple[int, int]:
    loop = asyncio.get_running_loop()
    stub = ro.Stub("aggregated", "w0")
    upstream = await loop.create_server(lambda: ro.StubProtocol(stub), "127.0.0.1", 0)
    relay = router_floor.Relay("127.0.0.1", upstream.sockets[0].getsockname()[1])
    front = await loop.create_server(lambda: router_floor.Front(relay), "127.0.0.1", 0)
    port = front.sockets[0].getsockname()[1]
    try:
        for stream in (False, True):  # closed_loop checks every status and whole body
            r = await asyncio.wait_for(
                ro.closed_loop(port, stream, 4, requests=40, warmup_s=0.0), 30)
            assert len(r.latencies_s) >= 40  # (those in flight at the start count too)
        return stub.requests, len(relay.idle)
    finally:
        front.close()
        upstream.close()


def test_the_floor_relays_every_answer_unchanged() -> None:
    requests, idle = asyncio.run(_through_the_floor())
    assert requests >= 80  # each one reached the upstream
    assert 1 <= idle <= 8  # back connections were kept and reused, one per client at most


def _res(per_core: dict[str, float]) -> ro.SideBySide:
    run = {name: ro.RunResult([0.001] * int(v), 1.0, 1.0) for name, v in per_core.items()}
    names = list(per_core)
    return ro.SideBySide({ro.AGG: names}, {}, 1, {},
                         {(n, mode): [run[n]] for n in names for _, mode in ro.MODES})


def test_floor_lines_say_whether_any_python_router_can_reach_the_target() -> None:
    lines = ro._floor_lines(_res({"disagg": 5000, "Python floor": 8000,
                                  "Python floor (uvloop)": 12000, "vllm-router": 10000}))
    assert lines[3] == ("- non-streaming: vllm-router 10,000; Python floor 8,000 (x0.80 of "
                        "vllm-router's); Python floor (uvloop) 12,000 (x1.20 of vllm-router's);"
                        " disagg 5,000 is x0.62 of the Python floor")
    assert lines[5].startswith("- non-streaming: Python floor (uvloop) reaches vllm-router")
    lines = ro._floor_lines(_res({"disagg": 5000, "Python floor": 8000, "vllm-router": 10000}))
    assert lines[-1].startswith("- streaming: every floor is below vllm-router per CPU-second")
    assert ro._floor_lines(_res({"disagg": 5000, "vllm-router": 10000})) == []


def test_pd_cost_lines_take_the_signature_out_of_the_disaggregated_router_s_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert ro.router_sign_us(False, n=20) > 0  # the real call, on the benchmark's own body
    monkeypatch.setattr(ro, "router_sign_us", lambda stream: 10.0)
    res = _res({"disagg": 10000, ro.DISAGG_PD: 2000, ro.VLLM_PD: 4000})
    lines = ro._pd_cost_lines(res)
    assert lines[3].startswith("- non-streaming: disagg 500 us (its aggregated request: 100 us")
    assert lines[3].endswith("without it 490 us, x0.51 of vllm-router's rate")
    assert ro._pd_cost_lines(_res({"disagg": 10000})) == []


def test_latency_targets_show_the_rounds_beside_the_medians() -> None:
    names = ["disagg", "vllm-router"]
    added = {("disagg", m): [0.2, 0.1, 0.3] for _, m in ro.MODES}
    added |= {("vllm-router", m): [0.15, 0.15, 0.15] for _, m in ro.MODES}
    run = ro.RunResult([0.001] * 100, 1.0, 1.0)
    res = ro.SideBySide({ro.AGG: names}, {}, 3, added,
                        {(n, m): [run] for n in names for _, m in ro.MODES})
    assert ro._versus(res, "disagg", "vllm-router", "")[0] == (
        "- added p50, non-streaming: 0.20 ms vs 0.15 ms (rounds 0.10..0.30 vs 0.15..0.15; not "
        "above it in 1 of 3 rounds): **missed**")
