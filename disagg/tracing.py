"""OpenTelemetry traces of requests, built from the per-request timing's stamps (torch-free).

One trace per client request, across the router, the context worker, the KV transfer and the
generation worker. Nothing here reads a clock on a request's path: every span is made once
the request's ``Timeline`` (``disagg/timing.py``) is complete, with explicit start and end
times taken from its stamps, and handed to the SDK's batch processor, whose own thread sends
it to an OTLP/HTTP receiver. Off (the default), a request costs one ``is None`` check in each
process, and the optional packages are never imported (``bench/results/observability.md``
measures both).

Enabled by ``--otlp-traces-endpoint URL`` (``disagg serve``, ``disagg router``; the YAML key
``otlp_traces_endpoint``), vLLM's flag name, or by the standard variables when the flag is
not given: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as it is) or
``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` appended), ``OTEL_TRACES_EXPORTER=otlp``
(the default endpoint, ``http://localhost:4318/v1/traces``); ``OTEL_TRACES_EXPORTER=none`` or
``OTEL_SDK_DISABLED=true`` keep it off. A flag URL without a path gets ``/v1/traces``. Only
OTLP over HTTP (protobuf) is sent: ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` other than
``http/protobuf`` is an error. ``OTEL_SERVICE_NAME`` names the service (default
``disagg-router`` / ``disagg-worker``), ``OTEL_RESOURCE_ATTRIBUTES`` adds to it,
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` sample (default: parentbased_always_on),
``OTEL_BSP_*`` tune the batch processor and ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` /
``_TIMEOUT`` / ``_COMPRESSION`` / ``_CERTIFICATE`` the exporter (the SDK reads those). The
packages are the ``tracing`` extra (``pip install 'disagg[tracing]'``): the flag without them
is an error naming it; the variables alone then log a warning and leave tracing off.

W3C ``traceparent``: the router continues a client's trace when one comes in (else starts
one, sampled by the sampler), and sends ``traceparent`` on both worker calls, naming the call's
span; a worker continues it. A generation worker puts its ``kv_transfer`` span's
``traceparent`` in each KV READ header it sends (``transfer/base.py``, signed with the rest),
and the context worker that serves the read makes a ``kv_read`` span under it. The tree::

    router    POST /v1/chat/completions                       (server)
                route
                context_call                                  (client)
    context       POST /v1/chat/completions                   (server)
                    admission, queue, prefill, context_answer
                handover
                generation_call                               (client)
    generation    POST /v1/chat/completions                   (server)
                    admission, kv_wait,
                    kv_transfer
    context           kv_read                                 (server: the READ it served)
                    kv_install, [first_token,] decode, finish
                decode                                        (a stream's, after its 1st byte)

Spans are named after the phases (``timing.py``); a retried call is one span (the phase covers
its tries), and a worker span of an earlier try is parented under the call's last span. A
request that fails still gets its spans (``server/request_timing.py``: the root an error). A
``/v1/responses`` request is traced as its chat form, its root named after its own path. A
``kv_streaming`` request's context call runs beside the generation call: its span is the
root's child, next to ``generation_call``. Each process stamps with its own clock (monotonic,
turned into wall-clock time when the spans are made): across hosts, a worker's spans sit
inside the router's call spans only as well as the hosts' clocks agree.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import disagg.timing as T
from disagg.contracts.options import OTLP_TRACES_PATH, check_otlp_endpoint

logger = logging.getLogger("disagg.tracing")

EXTRA = "tracing"  # pip install 'disagg[tracing]'
PACKAGES = ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")
OPTION = "otlp_traces_endpoint"  # the YAML key; the flag is --otlp-traces-endpoint
FLAG = "--otlp-traces-endpoint"
HEADER = "traceparent"
DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"
TRACES_PATH = OTLP_TRACES_PATH
ROUTER_SERVICE = "disagg-router"
WORKER_SERVICE = "disagg-worker"
KV_READ = "kv_read"  # the context side's span of a KV READ it served
SCOPE = "disagg"

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
             "parentbased_always_off", "parentbased_traceidratio")


class TracingError(ValueError):
    """Tracing cannot be set up as configured (the message names the flag or variable)."""


# ---- configuration ---------------------------------------------------------------------------


def check_endpoint(url: Any, what: str = FLAG) -> str:
    """An OTLP/HTTP traces URL as given (``http(s)://host[:port][/path]``; without a path,
    ``/v1/traces``); TracingError naming ``what`` otherwise."""
    try:
        return check_otlp_endpoint(url, what)
    except ValueError as e:
        raise TracingError(str(e)) from None


def resolve_endpoint(value: str | None, environ: Mapping[str, str] | None = None,
                     what: str = FLAG) -> str | None:
    """Where this process sends its traces (None: tracing off): ``value`` (the flag or YAML
    key) when given, else the standard variables (module docstring). TracingError naming
    the flag or the variable for a value that cannot work."""
    env = os.environ if environ is None else environ
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if value is not None:
        endpoint = check_endpoint(value, what)
    else:
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        exporters = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")
                     if e.strip()]
        if exporters == ["none"]:
            return None
        if exporters and exporters != ["otlp"]:
            raise TracingError(f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: only "
                               f"'otlp' (or 'none') is supported")
        traces, base = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
                        env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        if traces:
            endpoint = check_endpoint(traces, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        elif base:
            endpoint = check_endpoint(base.rstrip("/") + TRACES_PATH,
                                      "OTEL_EXPORTER_OTLP_ENDPOINT")
        elif exporters == ["otlp"]:
            endpoint = DEFAULT_ENDPOINT
        else:
            return None
    if protocol != "http/protobuf":
        raise TracingError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL="
                           f"{protocol!r}: traces are sent as OTLP/HTTP (http/protobuf) only; "
                           f"point {what} at the receiver's HTTP port (4318)")
    return endpoint


def missing_packages() -> str | None:
    """Why the tracing extra cannot be used (None: it can)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def configured(value: str | None, what: str = FLAG,
               environ: Mapping[str, str] | None = None) -> str | None:
    """``resolve_endpoint``, with the packages checked: TracingError naming the extra when
    ``value`` asks for tracing and they are missing; a warning (and None) when only the
    variables ask."""
    endpoint = resolve_endpoint(value, environ, what)
    if endpoint is None:
        return None
    why = missing_packages()
    if why is None:
        return endpoint
    need = (f"tracing needs the '{EXTRA}' extra: pip install 'disagg[{EXTRA}]' "
            f"({', '.join(PACKAGES)}): {why}")
    if value is not None:
        raise TracingError(f"{what}: {need}")
    logger.warning("the OTEL_* variables ask for traces, but %s; tracing stays off", need)
    return None


def _sampling(env: Mapping[str, str]) -> tuple[bool, float]:
    """(follow a parent's sampled flag, the share of new traces sampled) of the standard
    sampler variables."""
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    if name not in _SAMPLERS:
        raise TracingError(f"OTEL_TRACES_SAMPLER={name!r}: one of {', '.join(_SAMPLERS)}")
    ratio = 1.0 if name.endswith("always_on") else 0.0 if name.endswith("always_off") else None
    if ratio is None:
        arg = env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise TracingError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: a ratio in [0, 1]")
    return name.startswith("parentbased_"), ratio


# ---- one request's ids -----------------------------------------------------------------------


def parse_traceparent(value: Any) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C ``traceparent`` value; None for one that
    is malformed (ignored, as the recommendation says: a new trace starts)."""
    if not isinstance(value, str) or len(value) < 55:
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff" or (m.group(1) == "00" and len(value.strip()) != 55):
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(m.group(4), 16) & 1)


def valid_traceparent(value: Any) -> str | None:
    """``value`` when it is a well-formed ``traceparent`` (a KV READ's: else dropped)."""
    return value if parse_traceparent(value) is not None else None


def _span_id() -> int:
    while True:
        sid = random.getrandbits(64)
        if sid:
            return sid


class Trace:
    """One request's trace in one process: its trace id, the remote parent span (None: the
    trace starts here), whether it is sampled, this process's root span id and the span ids
    sent on (``traceparent``: a call's span, a pull's ``kv_transfer``), chosen when first
    asked for so that the spans made at the end carry them."""

    __slots__ = ("trace_id", "parent", "sampled", "root", "ids", "peers", "side")

    def __init__(self, trace_id: int, parent: int | None, sampled: bool) -> None:
        self.trace_id = trace_id
        self.parent = parent
        self.sampled = sampled
        self.root = _span_id()
        self.ids: dict[str, int] = {}
        self.peers: dict[str, str] = {}  # call phase -> the worker of its last try
        # Spans beside the timeline's phases: (phase, start, end) monotonic seconds
        self.side: list[tuple[str, float, float]] = []

    def span_id(self, phase: str) -> int:
        sid = self.ids.get(phase)
        if sid is None:
            sid = self.ids[phase] = _span_id()
        return sid

    def traceparent(self, phase: str) -> str:
        """The ``traceparent`` naming ``phase``'s span as the parent."""
        return (f"00-{self.trace_id:032x}-{self.span_id(phase):016x}-"
                f"{'01' if self.sampled else '00'}")

    def call(self, phase: str, worker: str) -> bytes:
        """The header line of a call (``phase``: context_call, generation_call) to
        ``worker`` (its URL, on the call's span)."""
        self.peers[phase] = worker
        return b"traceparent: " + self.traceparent(phase).encode("ascii") + b"\r\n"


# ---- spans ------------------------------------------------------------------------------------


def intervals(start: float, ends: Iterable[tuple[str, float | None]]
              ) -> list[tuple[str, float, float]]:
    """``timing.consecutive``'s phases as (name, start, end): the same boundaries."""
    out = []
    at = start
    for name, t in ends:
        if t is None:
            continue
        end = t if t > at else at
        out.append((name, at, end))
        at = end
    return out


class Tracer:
    """One process's span sink for one endpoint and service (``tracer_for``): spans made from
    a request's stamps once it ended, batched and sent by the SDK's processor thread."""

    def __init__(self, endpoint: str, service: str,
                 environ: Mapping[str, str] | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        env = os.environ if environ is None else environ
        self.endpoint = endpoint
        self.service = env.get("OTEL_SERVICE_NAME") or service
        self.parent_based, self.ratio = _sampling(env)
        self._bound = int(self.ratio * (1 << 64))  # TraceIdRatioBased: low 64 bits below
        version = _version()
        self.resource = Resource.create({"service.name": self.service,
                                         "service.version": version})
        self.scope = InstrumentationScope(SCOPE, version)
        self.processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        self._span, self._ctx = ReadableSpan, SpanContext
        self._flags = TraceFlags(TraceFlags.SAMPLED)
        self._server, self._client = SpanKind.SERVER, SpanKind.CLIENT
        self._internal = SpanKind.INTERNAL
        self._error, self._unset = StatusCode.ERROR, Status(StatusCode.UNSET)
        self._status = Status
        self.closed = False

    # -- a request's ids -------------------------------------------------------------------------

    def begin(self, traceparent: str | None) -> Trace:
        """A request's trace: continuing ``traceparent`` (the incoming header) when it is one,
        else a new trace the sampler decides on."""
        parsed = parse_traceparent(traceparent) if traceparent is not None else None
        if parsed is not None:
            trace_id, parent, sampled = parsed
            if not self.parent_based:
                sampled = self._sample(trace_id)
            return Trace(trace_id, parent, sampled)
        trace_id = random.getrandbits(128) or 1
        return Trace(trace_id, None, self._sample(trace_id))

    def _sample(self, trace_id: int) -> bool:
        return (trace_id & 0xFFFFFFFFFFFFFFFF) < self._bound

    # -- spans -------------------------------------------------------------------------------------

    def _emit(self, name: str, context: Any, parent: Any, start_ns: int, end_ns: int,
              kind: Any, attributes: Mapping[str, Any] | None, status: Any = None) -> None:
        self.processor.on_end(self._span(
            name, context, parent, self.resource, attributes, kind=kind,
            status=self._unset if status is None else status, start_time=start_ns,
            end_time=end_ns, instrumentation_scope=self.scope))

    def request_spans(self, trace: Trace, name: str, start: float,
                      ends: Sequence[tuple[str, float | None]], end: float,
                      attributes: Mapping[str, Any], error: str | None = None,
                      calls: tuple[str, ...] = ()) -> None:
        """One request's spans in this process: its root ``name`` from ``start`` to ``end``
        (monotonic seconds), under the remote parent, and a child per phase of ``ends``
        (``timing.consecutive``'s stamps); the last span of each phase that was sent on
        (``Trace.ids``) carries that id, ``calls`` are client spans; ``Trace.side`` spans
        too. ``error``: the request failed (the root's status)."""
        if not trace.sampled:
            return
        off = time.time_ns() - time.monotonic_ns()  # (this process's monotonic -> wall)
        tid, flags, ctx, emit = trace.trace_id, self._flags, self._ctx, self._emit
        root = ctx(tid, trace.root, False, flags)
        phases = intervals(start, ends)
        last = {n: i for i, (n, _, _) in enumerate(phases)}
        used: set[str] = set()
        for phase, a, b in trace.side:
            used.add(phase)
            emit(phase, ctx(tid, trace.span_id(phase), False, flags), root,
                 int(a * 1e9) + off, int(b * 1e9) + off, self._client, _peer(trace, phase))
        for i, (phase, a, b) in enumerate(phases):
            sid = trace.ids.get(phase) if last[phase] == i and phase not in used else None
            call = phase in calls
            emit(phase, ctx(tid, sid or _span_id(), False, flags), root,
                 int(a * 1e9) + off, int(b * 1e9) + off,
                 self._client if call else self._internal,
                 _peer(trace, phase) if call else None)
        parent = None if trace.parent is None else ctx(tid, trace.parent, True, flags)
        emit(name, root, parent, int(start * 1e9) + off,
             int(max(end, phases[-1][2] if phases else end) * 1e9) + off, self._server,
             attributes, None if error is None else self._status(self._error, error))

    def kv_read(self, traceparent: str, start_ns: int, end_ns: int,
                attributes: Mapping[str, Any]) -> None:
        """A KV READ this process served, under the reader's ``kv_transfer`` span (its
        ``traceparent``); times in wall-clock nanoseconds."""
        parsed = parse_traceparent(traceparent)
        if parsed is None or not parsed[2]:
            return
        tid, parent, _ = parsed
        self._emit(KV_READ, self._ctx(tid, _span_id(), False, self._flags),
                   self._ctx(tid, parent, True, self._flags), start_ns, end_ns, self._server,
                   attributes)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Send the spans made so far (True: sent within ``timeout_s``)."""
        return bool(self.processor.force_flush(int(timeout_s * 1000)))

    def close(self) -> None:
        """Flush and stop the processor's thread (spans made after this are dropped)."""
        if not self.closed:
            self.closed = True
            self.processor.shutdown()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("disagg")
    except PackageNotFoundError:  # (a source tree on sys.path)
        return "unknown"


def _peer(trace: Trace, phase: str) -> dict[str, Any] | None:
    worker = trace.peers.get(phase)
    return None if worker is None else {"server.address": worker}


_TRACERS: dict[tuple[str, str], Tracer] = {}
_LOCK = threading.Lock()


def tracer_for(endpoint: str, service: str) -> Tracer:
    """The process's tracer of ``endpoint`` and ``service`` (made once: a worker's HTTP
    server and its KV transfer server share it); flushed and stopped at exit."""
    with _LOCK:
        tracer = _TRACERS.get((endpoint, service))
        if tracer is None or tracer.closed:
            tracer = _TRACERS[(endpoint, service)] = Tracer(endpoint, service)
        return tracer


def kv_read_hook(endpoint: str | None) -> Any:
    """A KV transfer server's ``on_traced_read`` for a worker tracing to ``endpoint`` (None:
    not tracing)."""
    return None if endpoint is None else tracer_for(endpoint, WORKER_SERVICE).kv_read


def close_all(endpoint: str | None = None) -> None:
    """Flush and stop the tracers (of ``endpoint`` only, when given): at exit, and in tests."""
    with _LOCK:
        keys = [k for k in _TRACERS if endpoint is None or k[0] == endpoint]
        tracers = [_TRACERS.pop(k) for k in keys]
    for t in tracers:
        t.close()


atexit.register(close_all)


def worker_request_attributes(role: str, request_id: str, prompt_tokens: int,
                              output_tokens: int, status: int = 200) -> dict[str, Any]:
    """A worker's root span's attributes (``status``: the answer's HTTP status, 499 when
    the client went away first)."""
    return {"disagg.role": role, "disagg.request_id": request_id,
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "http.response.status_code": status}


def router_request_attributes(path: str, outcome: str) -> dict[str, Any]:
    """The router's root span's attributes."""
    return {"http.request.method": "POST", "url.path": path, "disagg.outcome": outcome}


ROUTER_CALLS = (T.CONTEXT_CALL, T.GENERATION_CALL)
