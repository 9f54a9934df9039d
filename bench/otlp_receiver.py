"""A minimal OTLP/HTTP traces receiver on loopback (for the tracing test and bench).

``POST /v1/traces`` with an ``ExportTraceServiceRequest`` (protobuf, gzip or not) is answered
200 with an empty ``ExportTraceServiceResponse``; the spans are kept as ``Span`` records (the
service that sent them, ids as hex, times in ns, attributes as Python values), or only counted
(``keep=False``: the bench's sink). Anything else is a 404 / 400. The decoding needs
``opentelemetry-proto``, which the tracing extra's exporter brings.

    python -m bench.otlp_receiver [--port P]   # a counting sink; prints "listening PORT"
"""

from __future__ import annotations

import argparse
import gzip
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PATH = "/v1/traces"
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer",
         5: "consumer"}


@dataclass(frozen=True)
class Span:
    """One received span."""

    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root
    kind: str  # internal, server, client, ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool  # status ERROR

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return None if which is None else getattr(v, which)


def decode(body: bytes) -> list[Span]:
    """The spans of one export request's body."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(
                    service=str(res.get("service.name", "")), name=s.name,
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_id=s.parent_span_id.hex(), kind=KINDS.get(s.kind, str(s.kind)),
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes={a.key: _value(a.value) for a in s.attributes},
                    error=s.status.code == 2))
    return out


def count(body: bytes) -> int:
    """The number of spans in one export request's body (parsed, not turned into records)."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)


class Receiver:
    """The receiver on ``127.0.0.1:port`` (0: a free one), served on a thread until
    ``close``; ``url`` is its traces endpoint."""

    def __init__(self, port: int = 0, keep: bool = True) -> None:
        self.keep = keep
        self.spans: list[Span] = []
        self.count = 0  # spans received
        self.exports = 0  # export requests
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if self.path != PATH:
                    self._answer(404, b"")
                    return
                try:
                    if (self.headers.get("Content-Encoding") or "").lower() == "gzip":
                        body = gzip.decompress(body)
                    spans = decode(body) if receiver.keep else []
                    n = len(spans) if receiver.keep else count(body)
                except Exception as e:  # a malformed export: 400, as a collector answers
                    self._answer(400, str(e).encode())
                    return
                with receiver.lock:
                    receiver.exports += 1
                    receiver.count += n
                    receiver.spans.extend(spans)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}{PATH}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver",
                                        daemon=True)
        self._thread.start()

    def of_trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    r = Receiver(args.port, keep=False)
    print(f"listening {r.port}", flush=True)
    try:
        for line in sys.stdin:  # "count" asks how many spans came; EOF ends it
            if line.strip() == "count":
                with r.lock:
                    print(f"count {r.count} {r.exports}", flush=True)
    finally:
        r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
