"""OpenTelemetry tracing (issue 42, item 2; ``disagg/tracing.py``): the configuration, and a
live router in front of one context and one generation worker (TCP KV), all in this process,
sending their spans to an OTLP/HTTP receiver on loopback (``bench/otlp_receiver.py``, which
decodes the protobuf exports).

What a request's trace must be (streamed and not, two calls and ``kv_streaming``):
- every span of it has the request's trace id (the client's when it sent a ``traceparent``);
- the tree: the router's server span (under the client's span, if any) -> its phases
  (route, context_call, handover, generation_call[, decode]); each worker's server span under
  the router's call span that reached it -> the worker's phases; the context worker's
  ``kv_read`` span(s) under the generation worker's ``kv_transfer``;
- each phase span lasts what the answer's ``timing`` breakdown says of that phase (same
  stamps: within ``DUR_TOL_S``), and a call span what the breakdown gives the call (its
  network share plus the worker's phases);
- one host, one clock: a worker's server span lies inside the call span that carries it, a
  ``kv_read`` inside its ``kv_transfer`` (within ``CLOCK_TOL_S``: each process turns its
  monotonic stamps into wall-clock time when it makes its spans).
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from router_fixtures import LoopThread, running_router, worker_app
from server_fixtures import serve_in_thread, wait_for

from bench.otlp_receiver import Receiver, Span
from disagg import timing as T
from disagg import tracing
from disagg.contracts.cluster import RouterConfigError, parse_cluster_config

NAME = "tiny"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
PROMPT = "The harbour was quiet and the boats rocked slowly in the evening light"
DUR_TOL_S = 5e-6  # the breakdown's 1 us rounding, the spans' ns
CLOCK_TOL_S = 1e-3
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CTX_PHASES = [T.ADMISSION, T.QUEUE, T.PREFILL, T.CONTEXT_ANSWER]
GEN_HEAD = [T.ADMISSION, T.KV_WAIT, T.KV_TRANSFER, T.KV_INSTALL]


# ---- configuration ----------------------------------------------------------------------------


def test_the_endpoint_from_the_flag_or_the_standard_variables() -> None:
    r = tracing.resolve_endpoint
    assert r(None, {}) is None  # off unless asked
    assert r("http://collector:4318", {}) == "http://collector:4318/v1/traces"
    assert r("https://c/otlp/v1/traces", {}) == "https://c/otlp/v1/traces"
    assert r(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://a:1/x"}) == "http://a:1/x"
    assert r(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1/"}) == "http://a:1/v1/traces"
    assert r(None, {"OTEL_TRACES_EXPORTER": "otlp"}) == tracing.DEFAULT_ENDPOINT
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1"}
    assert r(None, {**on, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert r(None, {**on, "OTEL_SDK_DISABLED": "true"}) is None
    assert r("http://b:2", {"OTEL_TRACES_EXPORTER": "none"}) == "http://b:2/v1/traces"  # flag
    for value, env, named in (("localhost:4318", {}, tracing.FLAG),
                              (None, {"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER"),
                              ("http://a:1", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
                              (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "a:1"},
                               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        with pytest.raises(tracing.TracingError, match=named):
            r(value, env)


def test_traceparent_parsing_and_sampling() -> None:
    tp = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    assert tracing.parse_traceparent(tp) == (int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), True)
    assert tracing.parse_traceparent(tp[:-2] + "00")[2] is False
    for bad in ("", "00-" + "0" * 32 + f"-{CLIENT_SPAN}-01", f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-x", "00-xyz", 5):
        assert tracing.parse_traceparent(bad) is None, bad
    # a later version may add fields: its first four are read
    assert tracing.parse_traceparent(f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-abc") is not None
    with pytest.raises(tracing.TracingError, match="OTEL_TRACES_SAMPLER"):
        tracing._sampling({"OTEL_TRACES_SAMPLER": "sometimes"})
    assert tracing._sampling({}) == (True, 1.0)
    assert tracing._sampling({"OTEL_TRACES_SAMPLER": "traceidratio",
                              "OTEL_TRACES_SAMPLER_ARG": "0.25"}) == (False, 0.25)


def test_without_the_extra_the_flag_names_it(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture,
                                             capsys: pytest.CaptureFixture[str],
                                             tmp_path: Any) -> None:
    from disagg.cli import main
    from disagg.router import cli as router_cli

    monkeypatch.setattr(tracing, "missing_packages", lambda: "No module named 'opentelemetry'")
    with pytest.raises(tracing.TracingError, match=r"disagg\[tracing\]"):
        tracing.configured("http://127.0.0.1:4318", tracing.FLAG, {})
    with caplog.at_level(logging.WARNING, "disagg.tracing"):  # the variables alone: a warning
        assert tracing.configured(None, environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1"}
                                  ) is None
    assert "disagg[tracing]" in caplog.text
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("generation_servers: {urls: ['127.0.0.1:9']}\n")
    with pytest.raises(RouterConfigError, match=r"--otlp-traces-endpoint: .*disagg\[tracing\]"):
        router_cli.configured(router_cli_args(cfg, "http://127.0.0.1:4318"))
    # disagg serve stops before loading anything (the checkpoint need not exist)
    capsys.readouterr()
    assert main(["serve", str(tmp_path / "no-model"), "--otlp-traces-endpoint",
                 "http://127.0.0.1:4318"]) == 2
    err = capsys.readouterr().err
    assert "--otlp-traces-endpoint" in err and "pip install 'disagg[tracing]'" in err, err


def router_cli_args(cfg: Any, endpoint: str) -> Any:
    import argparse

    from disagg.router import cli as router_cli

    p = argparse.ArgumentParser()
    router_cli.add_cli(p.add_subparsers())
    return p.parse_args(["router", "-c", str(cfg), "--otlp-traces-endpoint", endpoint])


def test_the_yaml_keys() -> None:
    base = {"generation_servers": {"urls": ["127.0.0.1:9"]}}
    cfg = parse_cluster_config({**base, "otlp_traces_endpoint": "http://c:4318"})
    assert cfg.otlp_traces_endpoint == "http://c:4318"
    assert cfg.generation_servers is not None
    assert "otlp_traces_endpoint" not in cfg.generation_servers.worker_options  # the router's
    sect = parse_cluster_config({"generation_servers": {
        "urls": ["127.0.0.1:9"], "otlp_traces_endpoint": "http://w:4318"}})
    assert sect.otlp_traces_endpoint is None
    assert sect.generation_servers.worker_options["otlp_traces_endpoint"] == "http://w:4318"
    with pytest.raises(RouterConfigError, match="otlp_traces_endpoint"):
        parse_cluster_config({**base, "otlp_traces_endpoint": "c:4318"})


def test_off_imports_nothing_of_opentelemetrys_sdk() -> None:
    code = ("import sys; import disagg.router.app, disagg.server.app, disagg.tracing; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk') "
            "or m.startswith('opentelemetry.exporter')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out


def test_a_failed_requests_span_status() -> None:
    # RequestTiming.failed: the server span once, an error for the server's failures and a
    # client gone (499), unset for a client error; nothing when the request is not traced.
    import asyncio

    from disagg.contracts import protocol as P
    from disagg.server.fanout import Choice
    from disagg.server.request_timing import CLIENT_CLOSED, RequestTiming
    from disagg.server.respond import CLIENT_GONE, error_text

    made: list[tuple[Any, ...]] = []
    tracer = SimpleNamespace(request_spans=lambda *a: made.append(a))
    srv = SimpleNamespace(tracer=tracer, role=SimpleNamespace(value="generation"))
    choice = Choice(0, "r1", 0, [1, 2, 3], None, None)  # type: ignore[arg-type]
    err502 = P.APIError(502, "the KV pull failed", type="server_error",
                        code="kv_transfer_failed")

    async def one(status: int, error: str, traced: bool = True) -> tuple[Any, ...] | None:
        made.clear()
        trace = tracing.Trace(1, None, True) if traced else None
        timer = RequestTiming(0.0, False, trace, CHAT)
        timer.failed(srv, [choice], status, error)  # type: ignore[arg-type]
        timer.failed(srv, [choice], 503, "again")  # type: ignore[arg-type]
        await asyncio.sleep(0)  # (made on the loop's next turn)
        assert len(made) <= 1
        return made[0] if made else None

    args = asyncio.run(one(502, error_text(err502)))
    assert args is not None
    _, name, start, ends, _, attributes, error = args
    assert name == "POST " + CHAT and start == 0.0 and ends == []  # no engine output yet
    assert error == "502 kv_transfer_failed: the KV pull failed"
    assert attributes["http.response.status_code"] == 502
    assert attributes["disagg.request_id"] == "r1"
    assert attributes["gen_ai.usage.input_tokens"] == 3
    gone = asyncio.run(one(CLIENT_CLOSED, CLIENT_GONE))
    assert gone is not None and gone[-1] == CLIENT_GONE
    client_error = asyncio.run(one(400, "400 invalid_request_error: too long"))
    assert client_error is not None and client_error[-1] is None
    assert client_error[-2]["http.response.status_code"] == 400
    assert asyncio.run(one(502, "x", traced=False)) is None


# ---- live: router + context + generation (TCP), spans to a receiver ----------------------------


@pytest.fixture(scope="module")
def cluster(model_dir: str, loop: LoopThread) -> Iterator[SimpleNamespace]:
    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        for var in ("OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_RESOURCE_ATTRIBUTES"):
            mp.delenv(var, raising=False)
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # ms: the batches go out at once
        receiver = stack.enter_context(Receiver())
        stack.callback(tracing.close_all, receiver.url)  # (before the receiver closes)
        ctx, gen = (stack.enter_context(serve_in_thread(worker_app(
            model_dir, role, otlp_traces_endpoint=receiver.url)))
            for role in ("context", "generation"))
        config = {"model": model_dir, "health_check_interval_sec": 0.2,
                  "otlp_traces_endpoint": receiver.url,
                  "context_servers": {"urls": [ctx.removeprefix("http://")]},
                  "generation_servers": {"urls": [gen.removeprefix("http://")]}}
        router = stack.enter_context(running_router(config, loop))
        streaming = stack.enter_context(running_router({**config, "kv_streaming": True}, loop))
        for url in (router, streaming):
            wait_for(lambda u=url: httpx.get(u + "/health").status_code == 200, 30,
                     what="router health")
        wait_for(lambda: httpx.get(streaming + "/cluster_info", timeout=5).json()["workers"][
            "context"][0].get("kv_transfer"), 30, what="kv_transfer")
        http = stack.enter_context(httpx.Client(timeout=60))
        yield SimpleNamespace(router=router, streaming=streaming, http=http, receiver=receiver,
                              ctx=ctx, gen=gen)


def _request(c: SimpleNamespace, url: str, stream: bool, traceparent: str | None = None
             ) -> dict[str, Any]:
    """The answer's timing breakdown (asked for: the spans are checked against it)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": stream, "timing": True}
    headers = {"traceparent": traceparent} if traceparent else None
    if not stream:
        r = c.http.post(url + CHAT, json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()[T.FIELD]
    with c.http.stream("POST", url + CHAT, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    return next(e[T.FIELD] for e in events if T.FIELD in e)


def _root(spans: list[Span], service: str, role: str | None = None, path: str = CHAT
          ) -> Span:
    got = [s for s in spans if s.service == service and s.kind == "server"
           and s.name == "POST " + path and (role is None or s.attributes.get("disagg.role")
                                              == role)]
    assert len(got) == 1, [(s.service, s.name, s.kind) for s in spans]
    return got[0]


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return sorted((s for s in spans if s.parent_id == parent.span_id),
                  key=lambda s: (s.start_ns, s.end_ns))


def _trace_of(receiver: Receiver, trace_id: str | None, expected: int) -> list[Span]:
    """The request's spans once ``expected`` of them arrived (``trace_id`` None: the one
    trace of a router root span not seen before)."""
    def spans() -> list[Span] | None:
        tid = trace_id
        if tid is None:
            roots = [s for s in receiver.spans if s.service == tracing.ROUTER_SERVICE
                     and s.kind == "server" and s.trace_id not in _seen]
            if not roots:
                return None
            tid = roots[-1].trace_id
        got = receiver.of_trace(tid)
        return got if len(got) >= expected else None

    got = wait_for(spans, 20, what=f"{expected} spans")
    _seen.add(got[0].trace_id)
    return got


_seen: set[str] = set()


def _inside(inner: Span, outer: Span, end_too: bool = True) -> None:
    tol = int(CLOCK_TOL_S * 1e9)
    assert inner.start_ns >= outer.start_ns - tol, (inner, outer)
    if end_too:
        assert inner.end_ns <= outer.end_ns + tol, (inner, outer)
    else:
        assert inner.start_ns <= outer.end_ns + tol, (inner, outer)


def _by_phase(timing: dict[str, Any]) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for p in timing["phases"]:
        out[p["phase"], p["at"]] = out.get((p["phase"], p["at"]), 0.0) + p["seconds"]
    return out


def _check_worker(spans: list[Span], root: Span, names: list[str], role: str,
                  secs: dict[tuple[str, str], float], in_breakdown: set[str]) -> list[Span]:
    kids = _children(spans, root)
    assert [s.name for s in kids] == names
    assert all(s.kind == "internal" and s.service == tracing.WORKER_SERVICE for s in kids)
    for s in kids:
        _inside(s, root)
        if s.name in in_breakdown:
            assert s.seconds == pytest.approx(secs[s.name, role], abs=DUR_TOL_S), s
    return kids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_disaggregated_requests_trace(cluster: SimpleNamespace, stream: bool) -> None:
    # not streamed: the client's trace is continued; streamed: the router starts one
    tp = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01" if not stream else None
    if not stream:
        assert not cluster.receiver.of_trace(CLIENT_TRACE)
    timing = _request(cluster, cluster.router, stream, tp)
    gen_names = [*GEN_HEAD, *([T.FIRST_TOKEN] if stream else []), T.DECODE, T.FINISH]
    router_names = list(T.ROUTER_PHASES if stream else T.ROUTER_PHASES[:4])
    expected = (1 + len(router_names)) + (1 + len(CTX_PHASES)) + (1 + len(gen_names)) + 1
    spans = _trace_of(cluster.receiver, CLIENT_TRACE if tp else None, expected)
    assert len({s.trace_id for s in spans}) == 1 and len({s.span_id for s in spans}) == len(
        spans)
    secs = _by_phase(timing)

    root = _root(spans, tracing.ROUTER_SERVICE)
    assert root.parent_id == (CLIENT_SPAN if tp else "") and not root.error
    assert root.attributes["url.path"] == CHAT and root.attributes["disagg.outcome"] == "success"
    phases = _children(spans, root)
    assert [s.name for s in phases] == router_names
    by = {s.name: s for s in phases}
    for name in (T.ROUTE, T.HANDOVER, *([T.DECODE] if stream else [])):
        assert by[name].kind == "internal"
        assert by[name].seconds == pytest.approx(secs[name, "router"], abs=DUR_TOL_S)
    call_ctx, call_gen = by[T.CONTEXT_CALL], by[T.GENERATION_CALL]
    assert call_ctx.kind == call_gen.kind == "client"
    assert call_ctx.attributes["server.address"] != call_gen.attributes["server.address"]
    assert sum(s.seconds for s in phases) == pytest.approx(root.seconds, abs=2e-3)
    for s in phases:
        _inside(s, root)

    # the context worker, under the router's context call
    ctx = _root(spans, tracing.WORKER_SERVICE, "context")
    assert ctx.parent_id == call_ctx.span_id
    _inside(ctx, call_ctx)
    _check_worker(spans, ctx, CTX_PHASES, "context", secs, set(CTX_PHASES))
    # its call span: what the breakdown gives that call (network + the worker's phases)
    assert call_ctx.seconds == pytest.approx(
        secs[T.CONTEXT_NETWORK, "router"] + sum(secs[p, "context"] for p in CTX_PHASES),
        abs=DUR_TOL_S * 6)

    # the generation worker, under the router's generation call
    gen = _root(spans, tracing.WORKER_SERVICE, "generation")
    assert gen.parent_id == call_gen.span_id
    _inside(gen, call_gen, end_too=not stream)  # (a stream's decode outlives the call)
    first = set(gen_names if not stream else [*GEN_HEAD, T.FIRST_TOKEN])
    kids = _check_worker(spans, gen, gen_names, "generation", secs, first)

    # the KV read the context worker served, under the generation worker's kv_transfer
    kv = next(s for s in kids if s.name == T.KV_TRANSFER)
    reads = [s for s in spans if s.name == tracing.KV_READ]
    assert len(reads) == 1 and reads[0].parent_id == kv.span_id
    read = reads[0]
    assert read.kind == "server" and read.service == tracing.WORKER_SERVICE
    assert read.attributes["disagg.kv.bytes"] > 0 and read.attributes["disagg.kv.blocks"] >= 1
    assert read.attributes["disagg.kv.streamed"] is False
    _inside(read, kv)


def test_a_kv_streaming_requests_trace(cluster: SimpleNamespace) -> None:
    timing = _request(cluster, cluster.streaming, True)
    gen_names = [*GEN_HEAD, T.FIRST_TOKEN, T.DECODE, T.FINISH]
    # router root + route, generation_call, decode + the context call beside them; both
    # workers' roots and phases; the streamed reads (one per layer group: at least one)
    expected = 4 + 1 + (1 + len(CTX_PHASES)) + (1 + len(gen_names)) + 1
    spans = _trace_of(cluster.receiver, None, expected)
    root = _root(spans, tracing.ROUTER_SERVICE)
    phases = _children(spans, root)
    assert sorted(s.name for s in phases) == sorted(
        [T.ROUTE, T.CONTEXT_CALL, T.GENERATION_CALL, T.DECODE])
    by = {s.name: s for s in phases}
    secs = _by_phase(timing)
    assert by[T.ROUTE].seconds == pytest.approx(secs[T.ROUTE, "router"], abs=DUR_TOL_S)
    # the context call runs beside the generation call (sent at once)
    assert by[T.CONTEXT_CALL].start_ns < by[T.GENERATION_CALL].end_ns
    ctx = _root(spans, tracing.WORKER_SERVICE, "context")
    gen = _root(spans, tracing.WORKER_SERVICE, "generation")
    assert ctx.parent_id == by[T.CONTEXT_CALL].span_id
    assert gen.parent_id == by[T.GENERATION_CALL].span_id
    _check_worker(spans, ctx, CTX_PHASES, "context", secs, set())
    kids = _check_worker(spans, gen, gen_names, "generation", secs,
                         {*GEN_HEAD, T.FIRST_TOKEN})
    kv = next(s for s in kids if s.name == T.KV_TRANSFER)
    reads = wait_for(lambda: [s for s in cluster.receiver.of_trace(root.trace_id)
                              if s.name == tracing.KV_READ] or None, 10, what="kv_read")
    assert all(r.parent_id == kv.span_id and r.attributes["disagg.kv.streamed"]
               for r in reads), (kv, reads)
    for r in reads:
        _inside(r, kv)


def test_an_unsampled_trace_makes_no_span_anywhere(cluster: SimpleNamespace) -> None:
    quiet = "5" * 32
    _request(cluster, cluster.router, False, f"00-{quiet}-{CLIENT_SPAN}-00")
    # Each process's spans leave in order: once a later request's are all in, the unsampled
    # one would have been too.
    loud = "6" * 32
    _request(cluster, cluster.router, False, f"00-{loud}-{CLIENT_SPAN}-01")
    _trace_of(cluster.receiver, loud, 5 + 5 + 7 + 1)
    assert cluster.receiver.of_trace(quiet) == []


def _responses(c: SimpleNamespace, url: str, tid: str, max_output_tokens: int) -> Any:
    """A Responses request to ``url`` under the client's span of trace ``tid``: its answer."""
    r = c.http.post(url + RESPONSES,
                    json={"model": NAME, "input": PROMPT,
                          "max_output_tokens": max_output_tokens, "temperature": 0},
                    headers={"traceparent": f"00-{tid}-{CLIENT_SPAN}-01"})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_responses_requests_trace(cluster: SimpleNamespace) -> None:
    # The router serves /v1/responses as its chat form: its root is the Responses request's,
    # its calls and the workers' spans those of the chat form.
    tid = "7" * 32
    assert _responses(cluster, cluster.router, tid, 6)["object"] == "response"
    gen_names = [*GEN_HEAD, T.DECODE, T.FINISH]
    expected = (1 + 4) + (1 + len(CTX_PHASES)) + (1 + len(gen_names)) + 1
    spans = _trace_of(cluster.receiver, tid, expected)
    root = _root(spans, tracing.ROUTER_SERVICE, path=RESPONSES)
    assert root.parent_id == CLIENT_SPAN and not root.error
    assert root.attributes["url.path"] == RESPONSES
    assert root.attributes["disagg.outcome"] == "success"
    phases = _children(spans, root)
    assert [s.name for s in phases] == list(T.ROUTER_PHASES[:4])
    by = {s.name: s for s in phases}
    ctx = _root(spans, tracing.WORKER_SERVICE, "context")
    gen = _root(spans, tracing.WORKER_SERVICE, "generation")
    assert ctx.parent_id == by[T.CONTEXT_CALL].span_id
    assert gen.parent_id == by[T.GENERATION_CALL].span_id
    assert [s.name for s in _children(spans, gen)] == gen_names
    kv = next(s for s in _children(spans, gen) if s.name == T.KV_TRANSFER)
    assert [s.parent_id for s in spans if s.name == tracing.KV_READ] == [kv.span_id]


def test_a_workers_own_responses_request_is_traced(cluster: SimpleNamespace) -> None:
    # A worker serving /v1/responses itself (no router) traces it as a chat request, under
    # its own path.
    tid = "8" * 32
    answer = _responses(cluster, cluster.gen, tid, 5)
    names = [T.ADMISSION, T.QUEUE, T.PREFILL, T.DECODE, T.FINISH]
    spans = _trace_of(cluster.receiver, tid, 1 + len(names))
    root = _root(spans, tracing.WORKER_SERVICE, "generation", path=RESPONSES)
    assert root.parent_id == CLIENT_SPAN and not root.error
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.usage.output_tokens"] == answer["usage"]["output_tokens"]
    _check_worker(spans, root, names, "generation", {}, set())


def test_a_client_gone_mid_stream_leaves_its_spans(cluster: SimpleNamespace) -> None:
    # The client hangs up after its first chunk: the worker's server span ends then, an
    # error (499), with the phases its engine output had stamped (prefill done, decoding).
    tid = "9" * 32
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 450, "ignore_eos": True, "stream": True}
    with cluster.http.stream("POST", cluster.gen + CHAT, json=body,
                             headers={"traceparent": f"00-{tid}-{CLIENT_SPAN}-01"}) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert json.loads(first[6:])["object"] == "chat.completion.chunk"
    spans = _trace_of(cluster.receiver, tid, 4)
    root = _root(spans, tracing.WORKER_SERVICE, "generation")
    assert root.error and root.parent_id == CLIENT_SPAN
    assert root.attributes["http.response.status_code"] == 499
    assert 1 <= root.attributes["gen_ai.usage.output_tokens"] < 450
    names = [s.name for s in _children(spans, root)]
    assert names[:4] == [T.ADMISSION, T.QUEUE, T.PREFILL, T.FIRST_TOKEN], names
