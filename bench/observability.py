"""What observability costs per request: tracing (``disagg/tracing.py``) and the timing opt-in
(``disagg/timing.py``), off vs on, for the router and for a worker (issue 42).

Router: ``disagg router`` processes pinned to one core, each in front of the same two stub
upstreams (``bench.router_overhead``'s: a context and a generation worker, so a request takes
the two calls, the case with the most spans): one without tracing, one with
``otlp_traces_endpoint`` pointing at a counting OTLP/HTTP receiver (``bench.otlp_receiver``,
a process of its own on the other core), and with ``--baseline REV`` a third one running that
revision's code (before tracing existed: what "no cost when off" is measured against) and a
fourth, the same revision again: the A/A control, whose ratio to the third is what two
processes of one code differ by here (a cost of tracing off smaller than that is not
resolved). The
variants: tracing off / on (and the baseline), each with the timing opt-in off and on
(``X-Disagg-Timing: 1``). Each round starts fresh processes (a process's own luck, its memory
layout and hash seed, spreads over the rounds) and runs every variant once, in a rotated
order (interleaved A/B: a drift of the machine spreads over all; 7 rounds rotate the 7
variants through every position): ``--latency-requests``
requests one at a time (p50 latency), then ``--concurrency`` in flight for ``--duration``
seconds: the router's CPU-seconds over that run divided by the requests answered (CPU time
from /proc schedstat of the process's threads, in nanoseconds; the exporter thread of a traced
router counts, as it runs in the router's process).

Worker: ``disagg serve`` of a tiny random llama (aggregated role, CPU), pinned to one core,
with and without tracing (and the baseline), fresh each round: ``--worker-requests`` short
requests (``max_tokens`` 4) one at a time per variant and round: p50 latency and the worker's
CPU per request.

Last, in this process, the parts of the on cost: making a request's spans, and the SDK's OTLP
encoding of a span (``span_costs``).

Every answer is checked (status 200, the stub's text / a completion); the receiver's span count
at the end must match the spans the traced requests make (none lost). The markdown result is
written to ``--out`` by this script (machine, command, revision, tables, ratios).

    python -m bench.observability [--out bench/results/observability.md] [--rounds 7]
        [--duration 3] [--latency-requests 300] [--concurrency 16] [--worker-requests 300]
        [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import baseline as B
from bench import router_overhead as ro
from disagg import procs

ROOT = Path(__file__).resolve().parent.parent
ROUTER_CORE, LOAD_CORE = 0, 1
# spans a traced request makes (disagg/tracing.py): the router's of a non-streamed two-call
# request (root + route, context_call, handover, generation_call); an aggregated worker's of a
# non-streamed request (root + admission, queue, prefill, decode, finish)
ROUTER_SPANS = 5
WORKER_SPANS = 6
WORKER_PROMPT = "The harbour was quiet and the boats rocked slowly"


@dataclass
class Variant:
    """One column: a router / worker (its port and pid) and the requests' extra header."""

    name: str
    port: int
    pid: int
    traced: bool
    timing: bool = False
    p50_ms: list[float] = field(default_factory=list)  # one a round
    cpu_us: list[float] = field(default_factory=list)  # CPU per request, one a round
    rps: list[float] = field(default_factory=list)
    requests: int = 0  # answered while traced (the spans expected)
    kind: str = ""  # its process's kind (Kind's name)


def cpu_s(pid: int) -> float:
    """CPU-seconds of a process's live threads so far (their /proc schedstat: nanoseconds,
    where /proc stat counts 10 ms ticks), else its stat."""
    total, seen = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
                seen = True
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9 if seen else ro.cpu_seconds(pid)


def request_bytes(port: int, body: dict[str, Any], timing: bool) -> bytes:
    data = json.dumps(body).encode()
    extra = b"x-disagg-timing: 1\r\n" if timing else b""
    return (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
            b"content-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
            % (port, extra, len(data), data))


async def one_at_a_time(v: Variant, raw: bytes, check: Callable[[int, bytes], None],
                        n: int) -> tuple[float, float]:
    """``n`` requests one after the other: (p50 ms, CPU-seconds of ``v``'s process each)."""
    conn = await ro.Conn.open(v.port)
    try:
        for _ in range(3):  # the connection, caches
            check(*await conn.request(raw))
        lat = []
        cpu0 = cpu_s(v.pid)
        for _ in range(n):
            t0 = time.perf_counter()
            status, body = await conn.request(raw)
            lat.append(time.perf_counter() - t0)
            check(status, body)
        cpu = (cpu_s(v.pid) - cpu0) / n
    finally:
        conn.close()
    return statistics.median(lat) * 1e3, cpu


async def saturated(v: Variant, raw: bytes, check: Callable[[int, bytes], None],
                    concurrency: int, duration: float) -> tuple[int, float]:
    """``concurrency`` requests in flight for ``duration`` s: (requests, CPU-s of ``v``)."""
    conns = [await ro.Conn.open(v.port) for _ in range(concurrency)]
    done = 0
    stop = False

    async def loop(conn: ro.Conn) -> None:
        nonlocal done
        while not stop:
            check(*await conn.request(raw))
            done += 1

    tasks = [asyncio.ensure_future(loop(c)) for c in conns]
    try:
        await asyncio.sleep(0.3)  # warm-up
        cpu0, n0 = cpu_s(v.pid), done
        await asyncio.sleep(duration)
        cpu, n = cpu_s(v.pid) - cpu0, done - n0
        stop = True
        await asyncio.wait(tasks)
        for t in tasks:
            t.result()  # a wrong answer aborts the run
        v.requests += done if v.traced else 0
    finally:
        stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            c.close()
    return n, cpu


# -- the receiver --------------------------------------------------------------------------------


class Sink:
    """``bench.otlp_receiver`` in a process of its own (a counting receiver)."""

    def __init__(self, core: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.otlp_receiver"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=str(ROOT),
            env=ro.module_env(), preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            self.close()
            raise RuntimeError(f"otlp receiver did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}/v1/traces"

    def count(self) -> tuple[int, int]:
        """(spans, export requests) received so far."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        _, spans, exports = self.proc.stdout.readline().split()
        return int(spans), int(exports)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def wait_count(sink: Sink, expected: int, timeout: float = 30.0) -> int:
    """The sink's span count once it reached ``expected`` (or after ``timeout``: what came)."""
    deadline = time.monotonic() + timeout
    while True:
        got = sink.count()[0]
        if got >= expected or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


# -- the router ----------------------------------------------------------------------------------


def router_check(status: int, body: bytes) -> None:
    ro.make_check(False)(status, body)


# (name, traced, a baseline's tree, with a timing opt-in variant)
Kind = tuple[str, bool, "Path | None", bool]
AA = "baseline, 2nd process"  # the A/A control: the baseline's code in another process


def kinds_of(args: argparse.Namespace, rev_tree: Path | None) -> list[Kind]:
    kinds: list[Kind] = [("off", False, None, True), ("on", True, None, True)]
    if rev_tree is not None:
        kinds[:0] = [(f"baseline {args.baseline}", False, rev_tree, True),
                     (AA, False, rev_tree, False)]
    return kinds


async def run_rounds(args: argparse.Namespace, what: str, kinds: list[Kind],
                     start: Callable[[Kind, int], Any], measure: Callable[[Variant], Any]
                     ) -> list[Variant]:
    """``args.rounds`` rounds; each starts a fresh process of every kind (``start``: (proc,
    port); a process's own luck, its memory layout and hash seed, spreads over the rounds),
    measures every variant (kind x timing opt-in) in a rotated order, and stops them (a traced
    process flushes its last spans at exit)."""
    loop = asyncio.get_running_loop()
    variants = [Variant(f"{name}{', timing' if timing else ''}", 0, 0, traced, timing,
                        kind=name)
                for name, traced, _, both in kinds for timing in ((False, True) if both
                                                                  else (False,))]
    for r in range(args.rounds):
        started: dict[str, subprocess.Popen[bytes]] = {}
        ports: dict[str, int] = {}
        try:
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                proc, port = await start(kind, r)
                started[kind[0]], ports[kind[0]] = proc, port
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                v.port, v.pid = ports[v.kind], started[v.kind].pid
                await measure(v)
        finally:
            for proc in started.values():
                await loop.run_in_executor(None, ro.stop, proc)
        print(f"{what} round {r + 1}/{args.rounds}: " + ", ".join(
            f"{v.name} {v.cpu_us[-1]:.0f} us" for v in variants), flush=True)
    return variants


async def bench_router(args: argparse.Namespace, sink: Sink, tmp: Path, rev_tree: Path | None
                       ) -> tuple[list[Variant], int, int]:
    loop = asyncio.get_running_loop()
    stubs = []
    for role in ("context", "generation"):
        stub = ro.Stub(role, f"stub-{role}")
        server = await loop.create_server(lambda s=stub: ro.StubProtocol(s), "127.0.0.1", 0)
        stubs.append((stub, server, server.sockets[0].getsockname()[1]))
    body = {"model": "stub", "prompt": ro.PROMPT, "max_tokens": ro.STREAM_CHUNKS,
            "temperature": 0, "stream": False}

    async def start(kind: Kind, r: int) -> tuple[subprocess.Popen[bytes], int]:
        name, traced, tree, _ = kind
        port = _free_port()
        cfg = ro.router_config(port, stubs[0][2], stubs[1][2])
        cfg["max_migrations"] = 0  # (the stub's streams carry no token ids anyway)
        env: dict[str, str] = {"OTEL_SDK_DISABLED": "true"}  # no OTEL_* of this shell
        if traced:
            cfg["otlp_traces_endpoint"] = sink.url
            env = {}
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        log = tmp / f"router-{r}-{name.replace(' ', '')}.log"
        # (off the loop: the stubs on it answer the router's health checks meanwhile)
        proc = await loop.run_in_executor(None, lambda: ro.start_router(
            cfg, ROUTER_CORE, log, extra_env=env))
        return proc, port

    async def measure(v: Variant) -> None:
        raw = request_bytes(v.port, body, v.timing)
        p50, _ = await one_at_a_time(v, raw, router_check, args.latency_requests)
        n, cpu = await saturated(v, raw, router_check, args.concurrency, args.duration)
        v.p50_ms.append(p50)
        v.cpu_us.append(cpu / n * 1e6)
        v.rps.append(n / args.duration)
        if v.traced:
            v.requests += args.latency_requests + 3

    try:
        before = sink.count()[0]
        variants = await run_rounds(args, "router", kinds_of(args, rev_tree), start, measure)
        expected = sum(v.requests for v in variants) * ROUTER_SPANS
        got = wait_count(sink, before + expected) - before
        return variants, expected, got
    finally:
        for _, server, _ in stubs:
            server.close()


# -- the worker ----------------------------------------------------------------------------------


def start_worker(model: str, traced: bool, sink: Sink, tree: Path | None, log: Path
                 ) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    cmd = [sys.executable, "-m", "disagg.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "tiny", "--max-batch-size", "8",
           "--log-level", "warning", "--device", "cpu"]
    env = ro.module_env(str(tree) if tree is not None else None)
    env.update(OMP_NUM_THREADS="1", OTEL_SDK_DISABLED="true")
    if traced:
        cmd += ["--otlp-traces-endpoint", sink.url]
        env.pop("OTEL_SDK_DISABLED")
    proc = procs.spawn(cmd, log, env=env, cwd=log.parent, cpus={ROUTER_CORE})
    try:
        procs.wait_healthy(f"http://127.0.0.1:{port}", 180, proc=proc, what="worker")
    except procs.NotHealthy as e:
        ro.stop(proc)
        raise RuntimeError(f"{e}:\n{procs.log_tail(log)}") from None
    return proc, port


def worker_check(status: int, body: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
    answer = json.loads(body)
    if answer["usage"]["completion_tokens"] != 4:
        raise RuntimeError(f"wrong answer: {body[:300]!r}")


async def bench_worker(args: argparse.Namespace, sink: Sink, tmp: Path, rev_tree: Path | None
                       ) -> tuple[list[Variant], int, int]:
    from disagg.model.tiny import write_tiny_checkpoint

    loop = asyncio.get_running_loop()
    model = write_tiny_checkpoint(str(tmp / "tiny"), "llama", seed=0)
    body = {"model": "tiny", "prompt": WORKER_PROMPT, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}

    async def start(kind: Kind, r: int) -> tuple[subprocess.Popen[bytes], int]:
        name, traced, tree, _ = kind
        log = tmp / f"worker-{r}-{name.replace(' ', '')}.log"
        return await loop.run_in_executor(None, start_worker, model, traced, sink, tree, log)

    async def measure(v: Variant) -> None:
        raw = request_bytes(v.port, body, v.timing)
        p50, cpu = await one_at_a_time(v, raw, worker_check, args.worker_requests)
        v.p50_ms.append(p50)
        v.cpu_us.append(cpu * 1e6)
        if v.traced:
            v.requests += args.worker_requests + 3

    before = sink.count()[0]
    variants = await run_rounds(args, "worker", kinds_of(args, rev_tree), start, measure)
    expected = sum(v.requests for v in variants) * WORKER_SPANS
    got = wait_count(sink, before + expected) - before
    return variants, expected, got


def _free_port() -> int:
    return int(procs.free_port())


# -- the parts of the on cost ----------------------------------------------------------------------


def span_costs(n: int = 2000) -> dict[str, float]:
    """In this process, no server: microseconds to make a router request's spans
    (``Tracer.request_spans`` of a two-call timeline: 5 spans, handed to a list instead of the
    batch processor) and to encode one span as the SDK's OTLP exporter does (its
    ``encode_spans`` + protobuf serialization, on its export thread in a server)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from disagg import timing as T
    from disagg import tracing

    tracer = tracing.Tracer("http://127.0.0.1:9/v1/traces", tracing.ROUTER_SERVICE, {})
    spans: list[Any] = []
    tracer.processor.shutdown()
    tracer.processor = type("ListProcessor", (), {"on_end": lambda self, s: spans.append(s)})()
    tl = T.Timeline(1000.0)
    for i, name in enumerate((T.ROUTE, T.CONTEXT_CALL, T.HANDOVER, T.GENERATION_CALL)):
        tl.end(name, 1000.0 + (i + 1) * 1e-3)
    attrs = tracing.router_request_attributes("/v1/completions", "success")
    best_make = best_encode = float("inf")
    for _ in range(5):  # best of 5: the least disturbed by the other processes
        spans.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            trace = tracer.begin(None)
            trace.call(T.CONTEXT_CALL, "127.0.0.1:8001")
            trace.call(T.GENERATION_CALL, "127.0.0.1:8002")
            tracer.request_spans(trace, "POST /v1/completions", tl.start, tl.ends, 1000.005,
                                 attrs, None, tracing.ROUTER_CALLS)
        best_make = min(best_make, (time.perf_counter() - t0) / n * 1e6)
        batch = spans[:512]  # the batch processor's default batch
        t0 = time.perf_counter()
        encode_spans(batch).SerializeToString()
        best_encode = min(best_encode, (time.perf_counter() - t0) / len(batch) * 1e6)
    return {"make_us_per_request": best_make, "spans_per_request": len(spans) / n,
            "encode_us_per_span": best_encode}


# -- the report ----------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def table(variants: list[Variant], ref: str, saturated_cols: bool, concurrency: int = 0
          ) -> list[str]:
    base = next(v for v in variants if v.name == ref)
    head = "| variant | p50 latency, 1 in flight (ms) | x off |"
    rule = "|---|---|---|"
    if saturated_cols:
        head += f" CPU per request, {concurrency} in flight (us) | x off | requests/s |"
        rule += "---|---|---|"
    else:
        head += " CPU per request (us) | x off |"
        rule += "---|---|"
    lines = [head, rule]
    for v in variants:
        row = (f"| {v.name} | {_med(v.p50_ms):.3f} | {_med(v.p50_ms) / _med(base.p50_ms):.3f} "
               f"| {_med(v.cpu_us):.1f} | {_med(v.cpu_us) / _med(base.cpu_us):.3f} |")
        if saturated_cols:
            row += f" {_med(v.rps):.0f} |"
        lines.append(row)
    return lines


def per_round(variants: list[Variant]) -> list[str]:
    return [f"- {v.name}: " + ", ".join(f"{x:.0f}" for x in v.cpu_us) for v in variants]


def ratios(variants: list[Variant], a: str, b: str) -> list[float]:
    """The per-round CPU-per-request ratios a / b (paired: the same round)."""
    va = next(v for v in variants if v.name == a)
    vb = next(v for v in variants if v.name == b)
    return [x / y for x, y in zip(va.cpu_us, vb.cpu_us, strict=True)]


def paired_ratio(variants: list[Variant], a: str, b: str) -> str:
    """Median over rounds of the per-round CPU ratio a / b, and its range."""
    rs = ratios(variants, a, b)
    return f"x{_med(rs):.3f} (rounds: {min(rs):.3f} .. {max(rs):.3f})"


def ratio_lines(args: argparse.Namespace, variants: list[Variant]) -> list[str]:
    lines = [f"- tracing on / off (CPU per request, paired by round): "
             f"{paired_ratio(variants, 'on', 'off')}; with the timing opt-in: "
             f"{paired_ratio(variants, 'on, timing', 'off, timing')}",
             f"- timing opt-in on / off (tracing off): "
             f"{paired_ratio(variants, 'off, timing', 'off')}"]
    if not args.baseline:
        return lines
    base = f"baseline {args.baseline}"
    off, aa = ratios(variants, "off", base), ratios(variants, AA, base)
    noise = max(abs(r - 1) for r in aa)
    verdict = ("within" if abs(_med(off) - 1) <= noise else "beyond")
    return [*lines,
            f"- **tracing off / baseline** (the cost of tracing when off): "
            f"{paired_ratio(variants, 'off', base)}; the A/A control, the baseline's own code "
            f"in a second process: {paired_ratio(variants, AA, base)}. The median off / "
            f"baseline is {abs(_med(off) - 1):.1%} from 1, {verdict} the A/A spread "
            f"({noise:.1%}): this run resolves no cost of tracing off smaller than that."]


def report(args: argparse.Namespace, router: tuple[list[Variant], int, int] | None,
           worker: tuple[list[Variant], int, int] | None, costs: dict[str, float],
           elapsed: float) -> str:
    rev = B.git("rev-parse", "--short", "HEAD")
    dirty = " (with uncommitted changes)" if B.git("status", "--porcelain", "disagg",
                                                     "bench") else ""
    lines = ["# Observability overhead: tracing and the timing opt-in, off vs on", "",
             f"Written by `python -m bench.observability {' '.join(sys.argv[1:])}` "
             f"({elapsed / 60:.1f} min) at {rev}{dirty}.", "", B.cpu_line(), "",
             "What is compared (`bench/observability.py` docstring): the same requests, "
             "interleaved in each round (the order rotated), through processes that differ "
             "only in tracing (`otlp_traces_endpoint` / `--otlp-traces-endpoint` to a counting "
             "OTLP/HTTP receiver on the other core, the SDK's batch processor at its defaults) "
             "and in the request's timing opt-in (`X-Disagg-Timing: 1`). Medians over "
             f"{args.rounds} rounds; `x off` is the ratio to the untraced process without "
             "the opt-in.", ""]
    if args.baseline:
        lines += [f"`baseline {args.baseline}` runs revision {args.baseline} "
                  f"({B.git('rev-parse', '--short', args.baseline)}), before tracing existed: "
                  "`off` against it is what tracing costs when it is off.", ""]
    if router is not None:
        variants, expected, got = router
        lines += ["## Router", "",
                  "`disagg router` on one core in front of two stub upstreams (context + "
                  "generation: two calls a non-streamed `/v1/completions`), "
                  f"{args.latency_requests} requests one at a time, then {args.concurrency} in "
                  f"flight for {args.duration:g} s (CPU per request: the router's CPU-seconds "
                  "over that run / requests answered). Fresh processes every round.", "",
                  *table(variants, "off", True, args.concurrency), "",
                  "(requests/s: what the load generator reached, on the other core with the "
                  "stubs and the receiver; the router's core was not the limit, so CPU per "
                  "request is the measure.)", "",
                  "Per-round CPU per request (us):", "", *per_round(variants), ""]
        lines += [*ratio_lines(args, variants),
                  f"- spans received: {got} of {expected} expected "
                  f"({ROUTER_SPANS} a traced request)", ""]
    if worker is not None:
        variants, expected, got = worker
        lines += ["## Worker", "",
                  "`disagg serve` (aggregated, tiny random llama, CPU) on one core, "
                  f"{args.worker_requests} non-streamed requests of 4 tokens one at a time "
                  "(CPU per request: the worker process's CPU-seconds / requests). Fresh "
                  "processes every round.", "",
                  *table(variants, "off", False), "",
                  "Per-round CPU per request (us):", "", *per_round(variants), ""]
        lines += [*ratio_lines(args, variants),
                  f"- spans received: {got} of {expected} expected "
                  f"({WORKER_SPANS} a traced request)", ""]
    lines += ["## Where the cost of tracing on goes", "",
              "Measured in the bench's own process (no server; best of 5, "
              "`span_costs`): making a two-call request's spans at the router "
              f"({costs['spans_per_request']:.0f} spans: `Tracer.request_spans`, ids, "
              f"`ReadableSpan`s) took {costs['make_us_per_request']:.1f} us; the SDK's OTLP "
              f"encoding (its `encode_spans` + protobuf serialization, done on the batch "
              f"processor's thread of the same process) {costs['encode_us_per_span']:.1f} us "
              f"a span, so {costs['encode_us_per_span'] * costs['spans_per_request']:.1f} us "
              "a request; the HTTP export of each batch comes on top. Sampling "
              "(`OTEL_TRACES_SAMPLER=traceidratio`, `OTEL_TRACES_SAMPLER_ARG=0.1`) pays this "
              "for the sampled share of the requests only.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench/results/observability.md"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--latency-requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--worker-requests", type=int, default=300)
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also run this revision's router and worker (before tracing)")
    p.add_argument("--no-router", action="store_true")
    p.add_argument("--no-worker", action="store_true")
    args = p.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        print("needs 2 cores (the measured process on one, the load on the other)",
              file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {LOAD_CORE})  # the load generator and the stubs
    t0 = time.monotonic()
    sink = Sink(LOAD_CORE)
    try:
        with tempfile.TemporaryDirectory(prefix="observability-") as td:
            tmp = Path(td)
            tree = Path(B.checkout(args.baseline, td)) if args.baseline else None
            router = None if args.no_router else asyncio.run(bench_router(args, sink, tmp,
                                                                          tree))
            worker = None if args.no_worker else asyncio.run(bench_worker(args, sink, tmp,
                                                                          tree))
    finally:
        sink.close()
    costs = span_costs()
    text = report(args, router, worker, costs, time.monotonic() - t0)
    Path(args.out).write_text(text + "\n")
    print(text)
    for part in (router, worker):
        if part is not None and part[2] < part[1]:
            print(f"spans lost: {part[2]} of {part[1]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
