"""`disagg bench rate-match`: the arithmetic on hand-worked values, the context-rate search on a
scripted server, and a short sweep on the tiny model with real worker processes (a context
worker and a ``--benchmark-gen-only`` generation worker) that writes JSON and a PNG."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import WorkerProc, start_worker_proc, stop_all, wait_all_healthy

from disagg.bench.metrics import RequestRecord
from disagg.bench.ratematch import (
    RateMatchConfig,
    RateMatcher,
    best_integer_cluster,
    build_result,
    closed_loop_counts,
    context_rate,
    describe_arrivals,
    finish_verify_point,
    gen_points_beside,
    gen_speed_at_rate,
    gen_tpot_at_concurrency,
    interpolate_runs,
    open_loop_tpot,
    pareto_frontier,
    predict_at_rate,
    predict_cluster,
    rate_match,
    served_rate,
    tput_per_device,
    verify_choices,
)
from disagg.cli import main as cli_main

# ------------------------------------------------------------------------------ arithmetic


def _gp(conc: int, tps: float, speed: float) -> dict[str, Any]:
    return {"concurrency": conc, "output_throughput": tps, "tokens_per_s_per_user": speed,
            "mean_tpot_ms": 1000.0 / speed, "completed": 1}


GEN = [_gp(1, 100.0, 100.0), _gp(2, 180.0, 90.0), _gp(4, 320.0, 80.0), _gp(8, 400.0, 50.0),
       _gp(16, 380.0, 24.0)]  # saturated at 8: 16 users get less in total


def test_tput_per_device_formula() -> None:
    # osl 10: gen 320 tok/s = 32 req/s; ctx 8 req/s per worker -> 4 ctx workers per gen worker.
    assert tput_per_device(320.0, 10, 8.0) == pytest.approx(320.0 / (4 + 1))
    # Devices weigh each side: 2-device ctx workers, 1-device gen worker: 320 / (2*4 + 1).
    assert tput_per_device(320.0, 10, 8.0, ctx_devices=2, gen_devices=1) == \
        pytest.approx(320.0 / 9)
    # A fast context side costs a fraction of a device: 320 / (32/64 + 2).
    assert tput_per_device(320.0, 10, 64.0, gen_devices=2) == pytest.approx(128.0)


def test_pareto_frontier() -> None:
    pts = [(1.0, 5.0), (2.0, 4.0), (1.5, 3.0), (3.0, 1.0), (2.0, 4.0), (0.5, 5.0)]
    # (1.5, 3) is beaten by (2, 4); (0.5, 5) by (1, 5); duplicates of (2, 4) both stay.
    assert pareto_frontier(pts) == [0, 1, 4, 3]
    assert pareto_frontier([]) == []


def test_rate_match_points_and_frontier() -> None:
    rm = rate_match(ctx_rate=10.0, gen_points=GEN, osl=20)
    by = {p["concurrency"]: p for p in rm}
    p4 = by[4]
    assert p4["gen_request_rate"] == pytest.approx(16.0)
    assert p4["ctx_per_gen"] == pytest.approx(1.6) and p4["gen_per_ctx"] == pytest.approx(0.625)
    assert p4["tput_per_device"] == pytest.approx(320.0 / 2.6)
    # 16 users: slower *and* (here) less throughput per device than 8 users: dominated.
    assert [c for c, p in by.items() if p["on_frontier"]] == [1, 2, 4, 8]


def test_gen_speed_at_rate_interpolates() -> None:
    osl = 20  # rates: 5, 9, 16, 20 req/s (16 users: 19, dropped: not above 20)
    assert gen_speed_at_rate(GEN, osl, 2.0) == 100.0  # below one user's rate: alone
    assert gen_speed_at_rate(GEN, osl, 7.0) == pytest.approx(95.0)  # halfway 5 -> 9
    assert gen_speed_at_rate(GEN, osl, 18.0) == pytest.approx(65.0)  # halfway 16 -> 20
    assert gen_speed_at_rate(GEN, osl, 20.5) is None  # beyond one worker


def test_predictions() -> None:
    osl = 20
    gp8 = GEN[3]  # 20 req/s per generation worker
    # Generation-bound: 2 ctx x 15 = 30 >= 20: rate 20, speed as measured.
    p = predict_cluster(15.0, gp8, GEN, osl, num_ctx=2, num_gen=1)
    assert p["bound"] == "generation" and p["request_rate"] == 20.0
    assert p["tput_per_device"] == pytest.approx(400.0 / 3)
    assert p["tokens_per_s_per_user"] == 50.0 and p["arrivals"] == "closed"
    # Context-bound: 1 ctx x 12 < 20: the gen worker serves 12 req/s under Poisson arrivals
    # (the context rate's own arrivals), at open_loop_tpot's speed.
    p = predict_cluster(12.0, gp8, GEN, osl, num_ctx=1, num_gen=1)
    assert p["bound"] == "context" and p["output_throughput"] == pytest.approx(240.0)
    assert p["arrivals"] == "poisson"
    tpot, _ = open_loop_tpot(GEN, osl, 12.0)
    assert p["tokens_per_s_per_user"] == pytest.approx(1000.0 / tpot)
    assert 50.0 < p["tokens_per_s_per_user"] < 100.0  # slower than alone, faster than 8 users
    # Best cluster within 4 devices at ctx 12 req/s: 2 ctx + 1 gen (240 of 480 tok/s -> 400/3
    # per device) beats 1+1 (120), 1+2 (80), 1+3 (60) and 3+1 (100).
    assert best_integer_cluster(12.0, gp8, osl, 4) == (2, 1)
    assert best_integer_cluster(12.0, gp8, osl, 1.5) is None
    # Open load of 7 req/s on 1 + 1: sustainable, 7 * osl tok/s, TPOT from open_loop_tpot.
    q = predict_at_rate(12.0, GEN, osl, 1, 1, 7.0)
    assert q["sustainable"] and q["output_throughput"] == 140.0
    assert q["mean_tpot_ms"] == pytest.approx(open_loop_tpot(GEN, osl, 7.0)[0])
    assert 10.0 < q["mean_tpot_ms"] < 20.0  # between 1 and 16 users' TPOT
    q = predict_at_rate(12.0, GEN, osl, 1, 1, 13.0)
    assert not q["sustainable"] and q["bound"] == "context"
    assert q["capacity_request_rate"] == 12.0 and q["output_throughput"] == 240.0


def test_open_loop_tpot_poisson_mixture() -> None:
    # TPOT linear in the batch: 10 ms alone + 2 ms per other request (measured at 1, 2, 4, 8).
    pts = [{"concurrency": c, "mean_tpot_ms": 10.0 + 2.0 * (c - 1)} for c in (1, 2, 4, 8)]
    assert gen_tpot_at_concurrency(pts, 3.0) == pytest.approx(14.0)
    assert gen_tpot_at_concurrency(pts, 0.5) == 10.0
    assert gen_tpot_at_concurrency(pts, 10.0) == pytest.approx(28.0)  # last slope extended
    # Linear: E[tpot(1 + N)] = 10 + 2 m with m = rate * osl * tpot / 1000 others in service.
    # rate 2, osl 100: tpot = 10 + 0.4 tpot -> 50/3 ms, m = 10/3.
    tpot, beyond = open_loop_tpot(pts, 100, 2.0)
    assert tpot == pytest.approx(50 / 3, rel=1e-5)
    assert beyond == pytest.approx(1 - sum(math.exp(-10 / 3) * (10 / 3) ** k / math.factorial(k)
                                           for k in range(8)), rel=1e-4)  # 1 + N > 8
    # A concave curve (a big step from 1 to 2 users): the mixture sits below the curve at
    # the mean batch (Jensen), which the rate-matched concurrency alone would overstate.
    conc = [{"concurrency": 1, "mean_tpot_ms": 10.0}, {"concurrency": 2, "mean_tpot_ms": 16.0},
            {"concurrency": 4, "mean_tpot_ms": 18.0}]
    tpot, _ = open_loop_tpot(conc, 50, 1.0)
    m = 50 * tpot / 1000
    assert 10.0 < tpot < gen_tpot_at_concurrency(conc, 1 + m)


def test_verify_choices_and_gaps() -> None:
    rm = rate_match(12.0, GEN, 20)
    result = {"context": {"ctx_rate": 12.0}, "config": {"osl": 20}, "generation":
              {"points": GEN}, "frontier": [p for p in rm if p["on_frontier"]]}
    ch = verify_choices(result, max_devices=2, num_points=2)
    # Both ends of the frontier; with 2 devices only 1 + 1 fits.
    assert [c["concurrency_per_gen"] for c in ch] == [1, 8]
    assert all((c["num_ctx"], c["num_gen"], c["devices"]) == (1, 1, 2) for c in ch)
    assert ch[1]["concurrency"] == 8 and ch[1]["predicted"]["bound"] == "context"
    v = finish_verify_point(ch[0], {"tokens_per_s_per_user": 90.0, "output_throughput": 90.0,
                                    "completed": 4, "failed": 0, "p99_tpot_ms": 12.0,
                                    "p99_ttft_ms": 30.0, "mean_ttft_ms": 20.0,
                                    "mean_tpot_ms": 11.0})
    assert v["predicted"]["tput_per_device"] == 50.0  # 1 user: 100 tok/s over 2 devices
    assert v["gap_tput_per_device"] == pytest.approx(-0.1)
    assert v["gap_tokens_per_s_per_user"] == pytest.approx(-0.1)


def _colocated(load: float, tpot_up: float, tps_down: float) -> dict[str, Any]:
    """GEN measured alone, and again beside a context worker at ``load`` req/s: every TPOT
    ``tpot_up`` times, every throughput ``tps_down`` times its isolated value."""
    col = [{**p, "mean_tpot_ms": p["mean_tpot_ms"] * tpot_up,
            "tokens_per_s_per_user": p["tokens_per_s_per_user"] / tpot_up,
            "output_throughput": p["output_throughput"] * tps_down} for p in GEN]
    return {"points": GEN, "colocated": {"context_load": load, "points": col}}


def test_colocated_points_are_linear_in_the_context_load() -> None:
    gen = _colocated(10.0, 1.25, 0.8)
    # Load 4 of 10: 40% of the way from alone to beside the full load.
    half = gen_points_beside(gen, 4.0)
    assert [p["concurrency"] for p in half] == [1, 2, 4, 8, 16]
    assert half[0]["mean_tpot_ms"] == pytest.approx(10.0 * (1 + 0.4 * 0.25))  # 11 ms
    assert half[0]["tokens_per_s_per_user"] == pytest.approx(1000 / 11.0)
    assert half[2]["output_throughput"] == pytest.approx(320.0 * (1 - 0.4 * 0.2))
    assert all(p["context_load"] == 4.0 for p in half)
    full = gen_points_beside(gen, 10.0)
    assert full[3]["output_throughput"] == pytest.approx(320.0)  # 400 x 0.8
    assert gen_points_beside(gen, 0.0)[1]["mean_tpot_ms"] == pytest.approx(1000 / 90)
    # No co-located measurement: the points as measured, whatever the load.
    assert gen_points_beside({"points": GEN, "colocated": None}, 7.0) == GEN


def test_colocated_predictions_use_the_clusters_own_context_load() -> None:
    osl = 20
    gen = _colocated(10.0, 1.25, 0.8)
    # 1 + 1 at concurrency 1, ctx 10 req/s: generation bound. Beside a context worker at
    # load L the worker serves (100 - 2 L) / 20 = 5 - 0.1 L req/s, and L is that rate:
    # r = 5 - 0.1 r -> r = 50 / 11; TPOT 10 ms x (1 + 0.25 r / 10).
    p = predict_cluster(10.0, GEN[0], GEN, osl, 1, 1, generation=gen)
    r = 50 / 11
    assert p["bound"] == "generation" and p["request_rate"] == pytest.approx(r)
    assert p["tput_per_device"] == pytest.approx(r * osl / 2)
    assert p["tokens_per_s_per_user"] == pytest.approx(1000 / (10.0 * (1 + 0.025 * r)))
    # Without the generation block: the isolated prediction (5 req/s, 100 tok/s/user).
    alone = predict_cluster(10.0, GEN[0], GEN, osl, 1, 1)
    assert alone["request_rate"] == 5.0 and alone["tokens_per_s_per_user"] == 100.0
    assert predict_cluster(10.0, GEN[0], GEN, osl, 1, 1,
                           generation={"points": GEN, "colocated": None}) == alone
    # Context bound (concurrency 8 serves 20 req/s alone, 16 beside a full context worker):
    # the context worker runs at its rate, so the points beside the full load.
    p = predict_cluster(10.0, GEN[3], GEN, osl, 1, 1, generation=gen)
    assert p["bound"] == "context" and p["request_rate"] == 10.0
    tpot, _ = open_loop_tpot(gen_points_beside(gen, 10.0), osl, 10.0)
    assert p["tokens_per_s_per_user"] == pytest.approx(1000 / tpot)
    # Open loop at 3 req/s: the context worker serves 3, the points 30% of the way.
    q = predict_at_rate(10.0, GEN, osl, 1, 1, 3.0, generation=gen)
    assert q["output_throughput"] == 60.0 and q["sustainable"]
    assert q["mean_tpot_ms"] == pytest.approx(
        open_loop_tpot(gen_points_beside(gen, 3.0), osl, 3.0)[0])
    assert q["mean_tpot_ms"] > predict_at_rate(10.0, GEN, osl, 1, 1, 3.0)["mean_tpot_ms"]
    # Rate-matched curve: each context worker at its rate, the points beside the full load;
    # verify_choices predicts each cluster at its own load.
    cfg = RateMatchConfig("http://c", "http://g", 1000.0, osl=osl, colocated=True)
    res = build_result(cfg, "m", {"ctx_rate": 10.0}, gen)
    assert [p["gen_output_tps"] for p in res["rate_matched"]] == pytest.approx(
        [0.8 * p["output_throughput"] for p in GEN])
    ends = verify_choices(res, max_devices=2, num_points=2)  # both ends of the frontier
    assert [c["concurrency_per_gen"] for c in ends] == [8, 1]
    assert ends[1]["predicted"]["request_rate"] == pytest.approx(r)
    assert ends[0]["predicted"] == {k: v for k, v in p.items() if k != "devices"}


def test_closed_loop_counts_and_interpolation() -> None:
    assert closed_loop_counts(1.51) == (1, 2)
    assert closed_loop_counts(16.81) == (16, 17)
    assert closed_loop_counts(2.05) == (2,) and closed_loop_counts(2.95) == (3,)
    assert closed_loop_counts(4.0) == (4,) and closed_loop_counts(0.4) == (1,)
    r0 = {"output_throughput": 60.0, "run_output_throughput": 58.0, "mean_tpot_ms": 10.0,
          "served_rate": 1.0, "completed": 6, "failed": 0, "num_requests": 6,
          "p99_tpot_ms": 12.0, "ttft_ms": 100.0, "meets_ttft_slo": True, "errors": {}}
    r1 = {"output_throughput": 100.0, "run_output_throughput": 96.0, "mean_tpot_ms": 14.0,
          "served_rate": 1.6, "completed": 12, "failed": 1, "num_requests": 12,
          "p99_tpot_ms": 20.0, "ttft_ms": 200.0, "meets_ttft_slo": False,
          "errors": {"HTTP 502": 1}}
    out = interpolate_runs(1.25, (1, 2), [r0, r1])
    assert out["output_throughput"] == pytest.approx(70.0)  # a quarter of the way to 2
    assert out["run_output_throughput"] == pytest.approx(67.5)
    assert out["mean_tpot_ms"] == pytest.approx(11.0)
    assert out["tokens_per_s_per_user"] == pytest.approx(1000 / 11)
    assert out["served_rate"] == pytest.approx(1.15)
    assert (out["completed"], out["failed"], out["num_requests"]) == (18, 1, 18)
    assert out["p99_tpot_ms"] == 12.0 and out["ttft_ms"] == 100.0  # the nearer run's
    assert out["meets_ttft_slo"] is False and out["errors"] == {"HTTP 502": 1}
    assert interpolate_runs(1.75, (1, 2), [r0, r1])["p99_tpot_ms"] == 20.0
    assert interpolate_runs(2.0, (2,), [r1]) == r1
    assert describe_arrivals({"arrivals": "closed", "in_flight": 1.6047,
                              "in_flight_runs": [1, 2]}) == \
        "closed loop, 1 and 2 in flight, interpolated to 1.60"
    assert describe_arrivals({"arrivals": "closed", "in_flight": 2.05,
                              "in_flight_runs": [2]}) == "closed loop, 2 in flight"
    assert describe_arrivals({"arrivals": "poisson", "request_rate": 2.2349,
                              "in_flight": None}) == "Poisson 2.235 req/s"


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="osl"):
        RateMatchConfig("a", "b", 100.0, osl=1)
    with pytest.raises(ValueError, match="concurrencies"):
        RateMatchConfig("a", "b", 100.0, concurrencies=(0, 2))
    assert RateMatchConfig("a", "b", 1.0, concurrencies=(4, 1, 4)).concurrencies == (1, 4)


# --------------------------------------------------------------------- context-rate search


class _ScriptedMatcher(RateMatcher):
    """A context side whose TTFT passes exactly up to ``limit`` req/s."""

    def __init__(self, limit: float, **kw: Any) -> None:
        super().__init__(RateMatchConfig("ctx", "gen", 100.0, **kw), tok=None, progress=None)
        self.limit = limit
        self.rates: list[float] = []

    async def warmup(self, url: str, output_len: int, gen_only: bool = False) -> list[float]:
        return [0.05]  # one warm request: 50 ms -> start at 10 req/s

    async def probe_context(self, rate: float) -> dict[str, Any]:
        self.rates.append(rate)
        return {"rate": rate, "passed": rate <= self.limit}


def test_served_rate_and_context_rate() -> None:
    def rec(start: float, e2el: float, ok: bool = True) -> RequestRecord:
        return RequestRecord(index=0, success=ok, start=start, ttft=e2el, e2el=e2el)

    # Completions at 1.0, 1.5, 3.0 (the failed one does not count): 2 more over 2 s.
    assert served_rate([rec(0.0, 1.0), rec(0.5, 1.0), rec(1.0, 2.0), rec(1.2, 0.1, False)]) \
        == pytest.approx(1.0)
    assert served_rate([rec(0.0, 1.0)]) is None
    assert served_rate([rec(0.0, 1.0), rec(0.5, 0.5)]) is None  # no span
    probes = [
        {"rate": 2.0, "passed": True, "served_rate": 2.1},  # kept up: the offered rate
        {"rate": 2.8, "passed": True, "served_rate": 2.5},  # fell behind within the SLO
        {"rate": 4.0, "passed": False, "served_rate": 2.5},
    ]
    assert context_rate(probes) == pytest.approx(2.5)
    assert context_rate(probes[:1]) == pytest.approx(2.0)
    assert context_rate([{"rate": 3.0, "passed": True}]) == 3.0  # no served rate recorded
    assert context_rate(probes[2:]) is None


@pytest.mark.parametrize("limit", [3.0, 10.0, 37.0])
def test_context_search_brackets_then_bisects(limit: float) -> None:
    m = _ScriptedMatcher(limit, ctx_max_probes=12, ctx_tolerance=0.05)
    res = asyncio.run(m.sweep_context())
    assert m.rates[0] == pytest.approx(10.0)
    lo = res["ctx_rate"]
    assert lo <= limit  # never a failing rate
    failing = [r for r in m.rates if r > limit]
    assert failing and min(failing) / lo <= 1.05  # converged to the tolerance
    assert res["bracketed"]
    assert len(m.rates) < 12


def test_context_search_budget_and_none() -> None:
    m = _ScriptedMatcher(0.001, ctx_max_probes=3, ctx_rate_start=1.0)
    res = asyncio.run(m.sweep_context())
    assert m.rates == [1.0, 0.5, 0.25] and res["ctx_rate"] is None and not res["bracketed"]
    m = _ScriptedMatcher(1e9, ctx_max_probes=3, ctx_rate_start=1.0)  # never fails
    res = asyncio.run(m.sweep_context())
    assert m.rates == [1.0, 2.0, 4.0] and res["ctx_rate"] == 4.0 and not res["bracketed"]


# ------------------------------------------------------------------- live, tiny model


NAME = "tiny"
TOKEN = "rate-match-test-secret"
COMMON = ["--kv-cache-tokens", "4096", "--max-model-len", "512", "--tokens-per-block", "16",
          "--kv-transfer-backend", "TCP", "--served-model-name", NAME, "--log-level", "warning"]


def _start(tmp: Path, model: str, name: str, *flags: str) -> WorkerProc:
    return start_worker_proc(tmp, model, name, [*COMMON, *flags],
                             {"DISAGG_CLUSTER_TOKEN": TOKEN})


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, tiny_llama: str
            ) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("ratematch")
    started = [_start(tmp, tiny_llama, "ctx", "--role", "context"),
               _start(tmp, tiny_llama, "gen", "--role", "generation", "--benchmark-gen-only")]
    try:
        wait_all_healthy(started, 90)
        yield {w.name: w.url for w in started}
    finally:
        stop_all(started)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if (line.startswith(name + " ") or line.startswith(name + "{"))]
    assert vals, f"{url}/metrics has no {name}"
    return sum(vals)


def _rate_match_cli(workers: dict[str, str], tiny_llama: str, tmp_path: Path, out: Path,
                    isl: int, osl: int, concs: tuple[int, ...], rounds: int,
                    warmups: int) -> int:
    """`disagg bench rate-match` against the live workers, with one verified frontier point."""
    return cli_main(["bench", "rate-match", "--context-url", workers["ctx"],
                     "--generation-url", workers["gen"], "--aggregated-url", workers["ctx"],
                     "--tokenizer", tiny_llama, "--isl", str(isl), "--osl", str(osl),
                     "--ttft-slo", "2000", "--concurrency", ",".join(map(str, concs)),
                     "--ctx-probe-seconds", "0.5", "--ctx-min-prompts", "6",
                     "--ctx-max-probes", "3", "--ctx-rate-start", "4", "--gen-rounds",
                     str(rounds), "--num-warmups", str(warmups), "--request-timeout", "60",
                     "--save-result", str(out), "--no-progress",
                     # End to end: a 1 + 1 cluster from `disagg launch` for one frontier point.
                     "--verify", "--verify-model", tiny_llama, "--verify-points", "1",
                     "--verify-max-devices", "2", "--verify-timeout", "120",
                     "--verify-log-dir", str(tmp_path / "logs")])


def _check_context_probes(ctx: dict[str, Any]) -> None:
    assert len(ctx["probes"]) == 3 and ctx["ctx_rate"] is not None
    assert ctx["ctx_rate"] == max(min(p["rate"], p["served_rate"])
                                  for p in ctx["probes"] if p["passed"])
    for p in ctx["probes"]:
        assert p["failed"] == 0 and p["completed"] == p["num_requests"] >= 6
        assert p["served_rate"] > 0
        assert p["passed"] == (p["ttft_ms"] <= 2000)


def _check_generation_points(gen: list[dict[str, Any]], concs: tuple[int, ...], rounds: int,
                             osl: int) -> None:
    assert [p["concurrency"] for p in gen] == list(concs)
    for p in gen:
        assert p["failed"] == 0 and p["completed"] == rounds * p["concurrency"]
        assert p["output_throughput"] > 0
        assert p["tokens_per_s_per_user"] == pytest.approx(1000 / p["mean_tpot_ms"])
        assert p["request_rate"] == pytest.approx(p["output_throughput"] / osl)


def _check_rate_matched_and_aggregated(res: dict[str, Any], concs: tuple[int, ...],
                                       osl: int) -> None:
    ctx = res["context"]
    rm = res["rate_matched"]
    assert [p["concurrency"] for p in rm] == list(concs)
    for p in rm:
        want = tput_per_device(p["gen_output_tps"], osl, ctx["ctx_rate"])
        assert p["tput_per_device"] == pytest.approx(want)
        assert p["ctx_per_gen"] == pytest.approx(p["gen_request_rate"] / ctx["ctx_rate"])
    assert res["frontier"] and all(p["on_frontier"] for p in res["frontier"])
    agg = res["aggregated"]
    assert [p["concurrency"] for p in agg["points"]] == list(concs)
    assert all(p["failed"] == 0 and p["tput_per_device"] > 0 for p in agg["points"])


def _check_verify_measured(v: dict[str, Any]) -> None:
    """The verified point's end-to-end run: arrivals, requests, throughput, gap."""
    me, pr = v["measured"], v["predicted"]
    # Each prediction is measured under the arrivals of its binding side.
    assert me["arrivals"] == pr["arrivals"] == \
        ("closed" if pr["bound"] == "generation" else "poisson")
    if me["arrivals"] == "closed":
        # Little's law: the requests at the context side come on top of the generation's ones.
        assert me["in_flight"] == pytest.approx(
            v["concurrency"] + pr["request_rate"] * me["unloaded_ttft_ms"] / 1000)
        assert me["in_flight_runs"] == list(closed_loop_counts(me["in_flight"]))
        assert me["failed"] == 0 and me["completed"] == 6 * sum(me["in_flight_runs"])
    else:
        assert me["in_flight"] is None and me["request_rate"] == pr["request_rate"]
        assert me["failed"] == 0 and me["completed"] == max(
            6, math.ceil(pr["request_rate"] * 2 * 0.5))
    assert me["meets_ttft_slo"] == (me["ttft_ms"] <= 2000)
    assert me["tput_per_device"] == pytest.approx(me["output_throughput"] / 2)
    assert me["output_throughput"] > 0 and me["run_output_throughput"] > 0
    assert v["gap_tput_per_device"] == pytest.approx(
        (me["tput_per_device"] - pr["tput_per_device"]) / pr["tput_per_device"])


def _check_verify(res: dict[str, Any], tmp_path: Path) -> None:
    """One 1 + 1 point verified end to end, its prediction from the rate-matched point."""
    ctx, gen = res["context"], res["generation"]["points"]
    (v,) = res["verify"]
    assert (v["num_ctx"], v["num_gen"], v["devices"]) == (1, 1, 2)
    fp = next(p for p in res["frontier"] if p["concurrency"] == v["concurrency_per_gen"])
    assert v["concurrency"] == v["concurrency_per_gen"]
    _check_verify_measured(v)
    pr = v["predicted"]
    # The prediction is the rate-matched point's, capped by whichever side is short for 1 + 1.
    gp = next(p for p in gen if p["concurrency"] == v["concurrency_per_gen"])
    assert pr["request_rate"] == pytest.approx(min(gp["request_rate"], ctx["ctx_rate"]))
    assert pr["tput_per_device"] <= 2 * fp["tput_per_device"] + 1e-9
    assert (tmp_path / "logs" / "verify-0" / "verify-cluster.yaml").is_file()


def _check_plots(tmp_path: Path, out: Path) -> None:
    """The PNG beside the JSON, and `bench plot` redrawing it."""
    import matplotlib.image

    img = matplotlib.image.imread(str(tmp_path / "rm.png"))
    assert img.shape[0] >= 400 and img.shape[1] >= 600
    assert not math.isclose(float(img.std()), 0.0)  # something is drawn
    # `bench plot` redraws a rate-match result.
    assert cli_main(["bench", "plot", str(out), "--out-dir", str(tmp_path / "p")]) == 0
    assert matplotlib.image.imread(str(tmp_path / "p" / "rm.png")).shape == img.shape


def test_rate_match_live_tiny_model(workers: dict[str, str], tiny_llama: str,
                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gen_tokens_before = _metric(workers["gen"], "disagg_generation_tokens_total")
    out = tmp_path / "rm.json"
    isl, osl, concs, rounds, warmups = 48, 6, (1, 3), 2, 1
    rc = _rate_match_cli(workers, tiny_llama, tmp_path, out, isl, osl, concs, rounds, warmups)
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "Rate matching" in printed.out and "end to end" in printed.out
    res = json.loads(out.read_text())
    assert res["kind"] == "disagg-bench-rate-match" and res["model"] == NAME
    _check_context_probes(res["context"])
    _check_generation_points(res["generation"]["points"], concs, rounds, osl)
    # Every generation-only request decoded exactly osl tokens on the generation worker
    # (warmups included), and none of them pulled KV from anywhere.
    sent = warmups + max(concs) + rounds * sum(concs)  # warmups: sequential, then one round
    assert _metric(workers["gen"], "disagg_generation_tokens_total") - gen_tokens_before \
        == sent * osl
    _check_rate_matched_and_aggregated(res, concs, osl)
    _check_verify(res, tmp_path)
    _check_plots(tmp_path, out)


def test_gen_only_needs_the_worker_flag(workers: dict[str, str], tiny_llama: str,
                                        tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Against a worker without --benchmark-gen-only every generation-only request fails
    and rate-match says why."""
    out = tmp_path / "x.json"
    rc = cli_main(["bench", "rate-match", "--context-url", workers["ctx"],
                   "--generation-url", workers["ctx"], "--tokenizer", tiny_llama,
                   "--isl", "16", "--osl", "4", "--ttft-slo", "5000", "--concurrency", "1",
                   "--ctx-max-probes", "1", "--ctx-min-prompts", "2", "--ctx-probe-seconds",
                   "0.1", "--num-warmups", "0", "--save-result", str(out), "--no-progress"])
    assert rc == 1 and not out.exists()
    assert "--benchmark-gen-only" in capsys.readouterr().err


def test_end_to_end_closed_and_poisson_arrivals(workers: dict[str, str], tiny_llama: str
                                                ) -> None:
    """verify's measuring step, both arrival kinds, against a worker serving full requests."""
    from disagg.bench.client import make_transport
    from disagg.tokenizer import load_tokenizer

    cfg = RateMatchConfig(workers["ctx"], workers["gen"], 1500.0, isl=40, osl=5,
                          concurrencies=(2,), model=NAME, num_warmups=1, gen_rounds=2,
                          ctx_probe_seconds=1.0, ctx_min_prompts=4, request_timeout_s=60)

    async def both() -> tuple[dict[str, Any], dict[str, Any]]:
        tr = make_transport("auto", 60)
        try:
            m = RateMatcher(cfg, load_tokenizer(tiny_llama), tr, progress=None)
            closed = await m.run_end_to_end(workers["ctx"], 2, 3.0, "closed")
            poisson = await m.run_end_to_end(workers["ctx"], 2, 5.0, "poisson")
            with pytest.raises(ValueError, match="arrivals"):
                await m.run_end_to_end(workers["ctx"], 2, 5.0, "open")
            return closed, poisson
        finally:
            await tr.aclose()

    closed, poisson = asyncio.run(both())
    # Closed: 2 on the generation side + 3 req/s x unloaded TTFT more, 6 rounds a loop.
    assert closed["arrivals"] == "closed" and closed["request_rate"] is None
    assert closed["in_flight"] == pytest.approx(2 + 3.0 * closed["unloaded_ttft_ms"] / 1000)
    counts = closed["in_flight_runs"]
    assert counts == list(closed_loop_counts(closed["in_flight"]))
    assert closed["completed"] == 6 * sum(counts) and closed["failed"] == 0
    assert len(closed.get("runs", [None])) == len(counts)
    # Poisson at 5 req/s: max(min prompts, 5 x 2 probe seconds) requests, exact rate.
    assert poisson["arrivals"] == "poisson" and poisson["in_flight"] is None
    assert poisson["request_rate"] == 5.0
    assert poisson["completed"] == 10 and poisson["failed"] == 0
    for r in (closed, poisson):
        assert r["output_throughput"] > 0 and r["tokens_per_s_per_user"] > 0
        assert r["served_rate"] > 0
        assert r["meets_ttft_slo"] == (r["ttft_ms"] <= 1500.0)


def test_colocated_generation_sweep_loads_the_context_worker(workers: dict[str, str],
                                                             tiny_llama: str) -> None:
    """``--colocated``: each generation point is measured a second time while the context
    worker serves ordinary requests at the given rate; the load stops with the point, and the
    context worker's own counters see exactly the requests the load reports."""
    from disagg.bench.client import make_transport
    from disagg.tokenizer import load_tokenizer

    cfg = RateMatchConfig(workers["ctx"], workers["gen"], 1500.0, isl=40, osl=8,
                          concurrencies=(1, 2), model=NAME, num_warmups=1, gen_rounds=3,
                          colocated=True, request_timeout_s=60)
    before = _metric(workers["ctx"], "disagg_requests_finished_total")

    async def sweep() -> dict[str, Any]:
        tr = make_transport("auto", 60)
        try:
            return await RateMatcher(cfg, load_tokenizer(tiny_llama), tr,
                                     progress=None).sweep_generation(ctx_rate=20.0)
        finally:
            await tr.aclose()

    gen = asyncio.run(sweep())
    assert [p["concurrency"] for p in gen["points"]] == [1, 2]
    assert all("context" not in p for p in gen["points"])
    col = gen["colocated"]
    assert col["context_url"] == workers["ctx"] and col["context_load"] == 20.0
    assert [p["concurrency"] for p in col["points"]] == [1, 2]
    sent = 0
    for p in col["points"]:
        assert p["failed"] == 0 and p["completed"] == 3 * p["concurrency"]
        load = p["context"]
        assert load["offered_rate"] == 20.0 and load["failed"] == 0
        assert load["completed"] >= 1 and load["mean_ttft_ms"] > 0
        # The load ran while the point did, not longer: its arrivals stop with the point.
        assert load["duration_s"] <= p["duration_s"] + 1.0
        sent += load["completed"]
    assert _metric(workers["ctx"], "disagg_requests_finished_total") - before == sent
    # Without a context rate (none met the SLO) there is nothing to load it with.
    cfg2 = RateMatchConfig(workers["ctx"], workers["gen"], 1500.0, isl=40, osl=8,
                           concurrencies=(1,), model=NAME, num_warmups=0, gen_rounds=1,
                           colocated=True, request_timeout_s=60)

    async def no_rate() -> dict[str, Any]:
        tr = make_transport("auto", 60)
        try:
            return await RateMatcher(cfg2, load_tokenizer(tiny_llama), tr,
                                     progress=None).sweep_generation(ctx_rate=None)
        finally:
            await tr.aclose()

    assert asyncio.run(no_rate())["colocated"] is None


def test_rate_match_cli_colocated(workers: dict[str, str], tiny_llama: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--colocated`` through the CLI: the rate-matched rows come from the points measured
    beside the context worker at its rate, the PNG adds the each-side-alone frontier."""
    out = tmp_path / "col.json"
    rc = cli_main(["bench", "rate-match", "--context-url", workers["ctx"],
                   "--generation-url", workers["gen"], "--tokenizer", tiny_llama,
                   "--isl", "40", "--osl", "6", "--ttft-slo", "2000", "--concurrency", "1,2",
                   "--ctx-probe-seconds", "0.5", "--ctx-min-prompts", "6",
                   "--ctx-max-probes", "2", "--ctx-rate-start", "4", "--gen-rounds", "2",
                   "--num-warmups", "1", "--request-timeout", "60", "--colocated",
                   "--save-result", str(out), "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "co-located, measured beside the context worker serving" in printed.out
    res = json.loads(out.read_text())
    assert res["config"]["colocated"] is True
    ctx_rate = res["context"]["ctx_rate"]
    col = res["generation"]["colocated"]
    assert col["context_load"] == ctx_rate
    beside = {p["concurrency"]: p for p in col["points"]}
    for p in res["rate_matched"]:
        assert p["gen_output_tps"] == pytest.approx(beside[p["concurrency"]]["output_throughput"])
        assert p["tput_per_device"] == pytest.approx(
            tput_per_device(p["gen_output_tps"], 6, ctx_rate))
    import matplotlib.image

    assert matplotlib.image.imread(str(tmp_path / "col.png")).shape[0] >= 400
