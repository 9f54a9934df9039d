"""The floor of an HTTP router written in Python on asyncio, for ``bench.router_overhead``'s
side-by-side table (the column *Python floor*).

Not a router: a relay that parses just enough HTTP (httptools, the parser uvicorn uses) to know
where each request and each answer ends, and forwards the bytes unchanged over keep-alive
connections to one upstream. It reads no JSON, builds no header, picks no worker, keeps no
metric, checks no key and handles no error beyond closing the connection. Every router written
in Python on asyncio does at least this per request, so its requests per CPU-second bound what
the disagg router's data plane could reach by replacing aiohttp with hand-written protocol
code, on the same loop.

    python -m bench.router_floor --port 8000 --upstream 127.0.0.1:9000 [--uvloop]
"""

from __future__ import annotations

import argparse
import asyncio

import httptools


class Front(asyncio.Protocol):
    """One client connection: a request is collected until httptools says it is complete,
    then handed to a back connection as the bytes it came in (one request at a time per
    connection: the bench's clients are closed-loop)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpRequestParser(self)
        self.parts: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_complete(self) -> None:  # httptools callback
        request, self.parts = b"".join(self.parts), []
        self.relay.forward(request, self)


class Back(asyncio.Protocol):
    """One keep-alive connection to the upstream: the answer's bytes go to the client as they
    arrive (a stream is relayed chunk by chunk); its end puts the connection back."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpResponseParser(self)
        self.front: Front | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, front: Front) -> None:
        assert self.transport is not None
        self.front = front
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        if self.front is not None and self.front.transport is not None:
            self.front.transport.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:  # httptools callback
        self.front = None
        self.relay.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.relay.idle:
            self.relay.idle.remove(self)
        if self.front is not None and self.front.transport is not None:
            self.front.transport.close()


class Relay:
    """The pool of back connections to the one upstream."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Back] = []

    def forward(self, request: bytes, front: Front) -> None:
        if self.idle:
            self.idle.pop().send(request, front)
        else:
            asyncio.ensure_future(self._connect_and_send(request, front))

    async def _connect_and_send(self, request: bytes, front: Front) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, back = await loop.create_connection(lambda: Back(self), self.host, self.port)
        except OSError:
            if front.transport is not None:
                front.transport.close()
            return
        back.send(request, front)


async def serve(port: int, upstream: str) -> None:
    host, _, up_port = upstream.rpartition(":")
    relay = Relay(host, int(up_port))
    server = await asyncio.get_running_loop().create_server(
        lambda: Front(relay), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.router_floor",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="host:port of the one upstream")
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop's event loop")
    args = ap.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.run(serve(args.port, args.upstream))
    else:
        asyncio.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
