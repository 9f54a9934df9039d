"""Per-request timing (issue 42, item 1; ``disagg/timing.py``): the timeline arithmetic, and a
live router in front of one context and one generation worker (TCP KV) and an aggregated
worker, all served in this process.

What "the phases add up" means here (the stated tolerances):
- every phase is >= 0 and the phases sum to the answer's ``total_s`` and their first
  ``ttft_phases`` to its ``ttft_s``, within ``SUM_TOL_S`` (0.5 ms: the 1 us rounding of each
  phase; any more would be a stamp out of order);
- through the router, ``ttft_s`` of a stream is the router's own measure (request in ->
  the stream's first byte) and equals the sum of its phase histograms' increments for the
  request (route + context_call + handover + generation_call) within ``SUM_TOL_S``;
- the client's own TTFT (request sent -> first event read) is no shorter than ``ttft_s`` and
  at most ``CLIENT_SLACK_S`` + 25% longer (loopback HTTP in a busy 2-core process);
- each phase histogram of the router and of every worker on the way grew by exactly one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from router_fixtures import LoopThread, running_router, worker_app
from server_fixtures import serve_in_thread, wait_for

from disagg import timing as T

NAME = "tiny"
C, CHAT = "/v1/completions", "/v1/chat/completions"
SUM_TOL_S = 5e-4
CLIENT_SLACK_S = 0.05
PROMPT = "The harbour was quiet and the boats rocked slowly in the evening light"
PHASE = T.METRIC + "_count"


# ---- the arithmetic -------------------------------------------------------------------------


def test_consecutive_phases_sum_to_their_span() -> None:
    # a stamp out of order counts as the boundary before it; a missing one drops its phase
    ends = [("a", 1.5), ("b", None), ("c", 1.25), ("d", 3.0)]
    got = T.consecutive(1.0, ends)
    assert got == [("a", 0.5), ("c", 0.0), ("d", 1.5)]
    assert sum(s for _, s in got) == pytest.approx(3.0 - 1.0)
    tl = T.Timeline(10.0)
    assert tl.last is None and tl.span() == 0.0 and tl.phases() == []
    tl.end(T.ROUTE, 10.25)
    tl.end(T.CONTEXT_CALL, 11.0)
    assert tl.last == T.CONTEXT_CALL
    assert tl.phases() == [(T.ROUTE, 0.25), (T.CONTEXT_CALL, 0.75)] and tl.span() == 1.0


def _worker_json(role: str, phases: list[tuple[str, float]], ttft_phases: int) -> dict:
    b = T.Breakdown(tuple(T.Phase(n, s, role) for n, s in phases), ttft_phases,
                    sum(s for _, s in phases[:ttft_phases]), sum(s for _, s in phases))
    return b.to_json()


def test_router_breakdown_puts_each_worker_inside_its_call() -> None:
    tl = T.Timeline(0.0)
    for name, at in ((T.ROUTE, 0.001), (T.CONTEXT_CALL, 0.101), (T.HANDOVER, 0.102),
                     (T.GENERATION_CALL, 0.152), (T.DECODE, 0.452)):
        tl.end(name, at)
    ctx = T.Breakdown.from_json(_worker_json("context", [
        (T.ADMISSION, 0.002), (T.QUEUE, 0.003), (T.PREFILL, 0.09), (T.CONTEXT_ANSWER, 0.001)],
        3))
    gen = T.Breakdown.from_json(_worker_json("generation", [
        (T.ADMISSION, 0.001), (T.KV_WAIT, 0.002), (T.KV_TRANSFER, 0.03), (T.KV_INSTALL, 0.004),
        (T.FIRST_TOKEN, 0.003), (T.DECODE, 0.29), (T.FINISH, 0.001)], 5))
    assert ctx is not None and gen is not None
    b = T.router_breakdown(tl, ctx, gen, streamed=True)
    names = [(p.name, p.at) for p in b.phases]
    assert names == [
        (T.ROUTE, "router"), (T.CONTEXT_NETWORK, "router"), (T.ADMISSION, "context"),
        (T.QUEUE, "context"), (T.PREFILL, "context"), (T.CONTEXT_ANSWER, "context"),
        (T.HANDOVER, "router"), (T.GENERATION_NETWORK, "router"), (T.ADMISSION, "generation"),
        (T.KV_WAIT, "generation"), (T.KV_TRANSFER, "generation"),
        (T.KV_INSTALL, "generation"), (T.FIRST_TOKEN, "generation"), (T.DECODE, "router")]
    secs = [p.seconds for p in b.phases]
    assert secs[1] == pytest.approx(0.1 - 0.096) and secs[7] == pytest.approx(0.05 - 0.04)
    assert b.ttft_phases == 13 and b.ttft_s == pytest.approx(0.152)
    assert sum(secs[:13]) == pytest.approx(0.152) and sum(secs) == pytest.approx(b.total_s)
    assert b.total_s == pytest.approx(0.452)
    # not streamed: the generation call ends with the answer, the worker's phases all in
    tl2 = T.Timeline(0.0)
    for name, at in ((T.ROUTE, 0.001), (T.CONTEXT_CALL, 0.101), (T.HANDOVER, 0.102),
                     (T.GENERATION_CALL, 0.452)):
        tl2.end(name, at)
    b2 = T.router_breakdown(tl2, ctx, gen, streamed=False)
    assert [p.name for p in b2.phases][-3:] == [T.FIRST_TOKEN, T.DECODE, T.FINISH]
    assert b2.ttft_phases == 7 + 1 + 5 and sum(p.seconds for p in b2.phases) == pytest.approx(
        0.452)
    # a worker that reported nothing usable: its call stays one phase of the router's
    b3 = T.router_breakdown(tl2, None, T.Breakdown.from_json({"phases": "no"}), False)
    assert [p.name for p in b3.phases] == list(T.ROUTER_PHASES[:4]) and b3.ttft_s is None
    # the context answer was final: the first token is the context worker's
    tl4 = T.Timeline(0.0)
    tl4.end(T.ROUTE, 0.001)
    tl4.end(T.CONTEXT_CALL, 0.101)
    b4 = T.router_breakdown(tl4, ctx, None, streamed=False)
    assert b4.ttft_phases == 5 and b4.ttft_s == pytest.approx(0.001 + 0.004 + 0.095)


def test_opt_in_words() -> None:
    assert T.header_asks("1") and T.header_asks(" TRUE ") and not T.header_asks("0")
    assert not T.header_asks(None) and not T.header_asks("")
    with pytest.raises(ValueError, match="X-Disagg-Timing"):
        T.header_asks("maybe")
    assert T.field_error(True) is None and T.field_error(None) is None
    assert T.field_error("yes") is not None and T.field_error(1) is not None


# ---- live: router + context + generation (TCP), and an aggregated worker ----------------------


@pytest.fixture(scope="module")
def cluster(model_dir: str, loop: LoopThread) -> Iterator[SimpleNamespace]:
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(serve_in_thread(worker_app(model_dir, "context")))
        gen = stack.enter_context(serve_in_thread(worker_app(model_dir, "generation")))
        agg = stack.enter_context(serve_in_thread(worker_app(model_dir, "aggregated")))
        config = {"model": model_dir, "health_check_interval_sec": 0.2,
                  "context_servers": {"urls": [ctx.removeprefix("http://")]},
                  "generation_servers": {"urls": [gen.removeprefix("http://")]}}
        router = stack.enter_context(running_router(config, loop))
        streaming = stack.enter_context(running_router({**config, "kv_streaming": True}, loop))
        for url in (router, streaming):
            wait_for(lambda u=url: httpx.get(u + "/health").status_code == 200, 30,
                     what="router health")
        # kv_streaming needs the context worker's KV addresses from its /server_info
        wait_for(lambda: _ctx_info(streaming).get("kv_transfer"), 30, what="kv_transfer")
        # One client (a new one per call makes an SSL context: tens of ms on the client's
        # TTFT), its connections and each path warmed up first.
        http = stack.enter_context(httpx.Client(timeout=60))
        ns = SimpleNamespace(ctx=ctx, gen=gen, agg=agg, router=router, streaming=streaming,
                             http=http)
        for url in (router, streaming, agg):
            _request(ns, url, C, True)
        yield ns


def _ctx_info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/cluster_info", timeout=5).json()["workers"]["context"][0]


def _counts(url: str, phases: tuple[str, ...]) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text  # (a fresh client: off the clock)
    return {p: _sample(text, PHASE, p) for p in phases} | {
        "sum:" + p: _sample(text, T.METRIC + "_sum", p) for p in phases}


def _router_counts(url: str, before: dict[str, float], grown: float = 1.0
                   ) -> dict[str, float]:
    """The router's phase counts once its last request's are in: the router observes them
    when its handler ends, which may be just after a stream's last byte reached the client."""
    def counts() -> dict[str, float] | None:
        c = _counts(url, T.ROUTER_PHASES)
        return c if c[T.ROUTE] - before[T.ROUTE] >= grown else None

    return wait_for(counts, 10, what="the router's phase histograms")


def _sample(text: str, name: str, phase: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'phase="{phase}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _request(c: SimpleNamespace, url: str, path: str, stream: bool,
             headers: dict[str, str] | None = None, **extra: Any
             ) -> tuple[dict[str, Any], float, float, list[dict[str, Any]]]:
    """(the answer's timing, the client's TTFT (stream: first event read; else None), its
    whole time, the stream's events)."""
    body: dict[str, Any] = {"model": NAME, "max_tokens": 6, "temperature": 0,
                            "ignore_eos": True, "stream": stream, **extra}
    if path == C:
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    t0 = time.monotonic()
    if not stream:
        r = c.http.post(url + path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json().get(T.FIELD), None, time.monotonic() - t0, [r.json()]
    events, first = [], None
    with c.http.stream("POST", url + path, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if first is None:
                first = time.monotonic() - t0
            if line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    timing = [e[T.FIELD] for e in events if T.FIELD in e]
    assert len(timing) <= 1 and all(T.FIELD not in e for e in events[:-1]), events
    return (timing[0] if timing else None), first, time.monotonic() - t0, events


def _check_sums(timing: dict[str, Any]) -> list[tuple[str, float, str]]:
    phases = [(p["phase"], p["seconds"], p["at"]) for p in timing["phases"]]
    assert all(s >= 0 for _, s, _ in phases), phases
    n = timing["ttft_phases"]
    assert sum(s for _, s, _ in phases) == pytest.approx(timing["total_s"], abs=SUM_TOL_S)
    assert sum(s for _, s, _ in phases[:n]) == pytest.approx(timing["ttft_s"], abs=SUM_TOL_S)
    return phases


def _check_client(timing: dict[str, Any], client_ttft: float | None, client_total: float
                  ) -> None:
    assert client_total + 1e-3 >= timing["total_s"]
    if client_ttft is not None:
        assert timing["ttft_s"] <= client_ttft + 1e-3, (timing, client_ttft)
        assert client_ttft - timing["ttft_s"] <= CLIENT_SLACK_S + 0.25 * client_ttft, (
            timing, client_ttft)


def _grew_by_one(before: dict[str, float], after: dict[str, float], phases: tuple[str, ...]
                 ) -> None:
    assert {p: after[p] - before[p] for p in phases} == dict.fromkeys(phases, 1.0)


CTX_PHASES = (T.ADMISSION, T.QUEUE, T.PREFILL, T.CONTEXT_ANSWER)
GEN_HEAD = (T.ADMISSION, T.KV_WAIT, T.KV_TRANSFER, T.KV_INSTALL)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_disaggregated_phases_add_up(cluster: SimpleNamespace, stream: bool) -> None:
    gen_phases = (*GEN_HEAD, T.FIRST_TOKEN, T.DECODE, T.FINISH) if stream else (
        *GEN_HEAD, T.DECODE, T.FINISH)
    router_phases = T.ROUTER_PHASES if stream else T.ROUTER_PHASES[:4]
    before = [_counts(cluster.router, T.ROUTER_PHASES), _counts(cluster.ctx, T.WORKER_PHASES),
              _counts(cluster.gen, T.WORKER_PHASES)]
    timing, client_ttft, client_total, _ = _request(cluster, cluster.router, CHAT, stream,
                                                     timing=True)
    after = [_router_counts(cluster.router, before[0]), _counts(cluster.ctx, T.WORKER_PHASES),
             _counts(cluster.gen, T.WORKER_PHASES)]
    phases = _check_sums(timing)
    _check_client(timing, client_ttft, client_total)
    expected = [(T.ROUTE, "router"), (T.CONTEXT_NETWORK, "router"),
                *((p, "context") for p in CTX_PHASES), (T.HANDOVER, "router"),
                (T.GENERATION_NETWORK, "router")]
    if stream:
        expected += [*((p, "generation") for p in (*GEN_HEAD, T.FIRST_TOKEN)),
                     (T.DECODE, "router")]
    else:
        expected += [(p, "generation") for p in gen_phases]
    assert [(n, at) for n, _, at in phases] == expected
    first = [n for n, _, _ in phases[:timing["ttft_phases"]]]
    assert first[-1] == (T.FIRST_TOKEN if stream else T.KV_INSTALL)
    secs = {(n, at): s for n, s, at in phases}
    assert secs[T.PREFILL, "context"] > 0 and secs[T.KV_TRANSFER, "generation"] > 0
    _grew_by_one(before[0], after[0], router_phases)
    _grew_by_one(before[1], after[1], CTX_PHASES)
    _grew_by_one(before[2], after[2], gen_phases)
    # the exports agree: a worker's histogram took the seconds the answer shows
    for p in GEN_HEAD:
        assert after[2]["sum:" + p] - before[2]["sum:" + p] == pytest.approx(
            secs[p, "generation"], abs=2e-6)
    if stream:  # the router's TTFT: its own phases' increments, up to the first byte
        own = sum(after[0]["sum:" + p] - before[0]["sum:" + p] for p in T.ROUTER_PHASES[:4])
        assert own == pytest.approx(timing["ttft_s"], abs=SUM_TOL_S)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_aggregated_workers_phases_add_up(cluster: SimpleNamespace, stream: bool) -> None:
    phases = (T.ADMISSION, T.QUEUE, T.PREFILL, *((T.FIRST_TOKEN,) if stream else ()),
              T.DECODE, T.FINISH)
    before = _counts(cluster.agg, T.WORKER_PHASES)
    timing, client_ttft, client_total, events = _request(
        cluster, cluster.agg, C, stream, headers={T.HEADER: "1"},
        stream_options={"include_usage": True} if stream else None)
    after = _counts(cluster.agg, T.WORKER_PHASES)
    got = _check_sums(timing)
    _check_client(timing, client_ttft, client_total)
    assert [(n, at) for n, _, at in got] == [(p, "aggregated") for p in phases]
    _grew_by_one(before, after, phases)
    assert after[T.KV_WAIT] == before[T.KV_WAIT]  # (none of another role's)
    if stream:  # with include_usage the usage chunk carries it (no chunk of its own)
        assert events[-1]["usage"] is not None and T.FIELD in events[-1]


def test_without_the_opt_in_nothing_changes_but_the_metrics(cluster: SimpleNamespace) -> None:
    before = _counts(cluster.router, T.ROUTER_PHASES)
    timing, _, _, events = _request(cluster, cluster.router, C, True)
    assert timing is None and all(T.FIELD not in e for e in events)
    timing, _, _, events = _request(cluster, cluster.router, C, False,
                                    headers={T.HEADER: "0"})
    assert timing is None and T.FIELD not in events[0]
    after = _router_counts(cluster.router, before, 2)
    assert after[T.ROUTE] - before[T.ROUTE] == 2 and after[T.DECODE] - before[T.DECODE] == 1


def test_the_header_and_a_final_context_answer(cluster: SimpleNamespace) -> None:
    # max_tokens 1: the context answer is the client's; timing asked by header only
    for stream in (False, True):
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                "stream": stream}
        r = cluster.http.post(cluster.router + C, json=body, headers={T.HEADER: "true"})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            assert T.FIELD not in chunks[0] and chunks[-1]["choices"] == []
            timing = chunks[-1][T.FIELD]
        else:
            timing = r.json()[T.FIELD]
        phases = _check_sums(timing)
        assert [(n, at) for n, _, at in phases] == [
            (T.ROUTE, "router"), (T.CONTEXT_NETWORK, "router"),
            *((p, "context") for p in CTX_PHASES)]
        assert phases[timing["ttft_phases"] - 1][0] == T.PREFILL


def test_kv_streaming_phases_add_up(cluster: SimpleNamespace) -> None:
    before = _counts(cluster.streaming, T.ROUTER_PHASES)
    timing, client_ttft, client_total, _ = _request(cluster, cluster.streaming, C, True,
                                                    timing=True)
    after = _router_counts(cluster.streaming, before)
    phases = _check_sums(timing)
    _check_client(timing, client_ttft, client_total)
    assert [n for n, _, _ in phases] == [T.ROUTE, T.GENERATION_NETWORK, *GEN_HEAD,
                                         T.FIRST_TOKEN, T.DECODE]
    # the context call ran beside the generation call: observed, not a consecutive phase
    _grew_by_one(before, after, (T.ROUTE, T.CONTEXT_CALL, T.GENERATION_CALL, T.DECODE))
    assert after[T.HANDOVER] == before[T.HANDOVER]


@pytest.mark.parametrize("where", ["worker", "router"])
def test_a_bad_timing_opt_in_is_a_400_naming_it(cluster: SimpleNamespace, where: str) -> None:
    url = cluster.agg if where == "worker" else cluster.router
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}
    r = cluster.http.post(url + C, json={**body, "timing": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timing", r.text
    r = cluster.http.post(url + C, json=body, headers={T.HEADER: "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == T.HEADER, r.text
