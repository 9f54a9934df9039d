"""KV transfer: wire messages, header encoding, the transport abstraction.

The backends (``tcp``, ``ucx``) build on this module; ``backends.make_backend`` picks one.

Wire protocol, version 1. One READ moves everything one generation rank needs from one context
rank for one request (a layer range times a kv-head range of all its blocks) as a single
payload: coalescing per rank pair, not per token or head, keeps the message count at
(context ranks x generation ranks) however many heads or layers move. The cluster token never
crosses the wire: a mutual challenge-response (``handshake.py``) opens every connection and
every request carries a proof bound to it::

    client (generation rank)                          server (context rank)
      HELLO {op, version, client_nonce}        ──────►  fresh server_nonce
                                               ◄──────  {ok, version, server_nonce, server_id,
                                                         backend, proof: H("server", ...)}
      checks the proof: a peer that cannot prove
      the token gets nothing but this HELLO
      (TransferError unauthorized)
      AUTH {op, proof[, ucx_address, ucx_tag]  ──────►  1. proof of seq 0 (else: unauthorized,
            [, ipc]}                           ◄──────     hang up)  {ok[, ucx_address]
                                                           [, ipc | ipc_declined]}
      READ {op, lease_id, block_ids,           ──────►  1. proof of the next seq (else:
            layer_slice [l0,l1), head_slice                unauthorized, hang up)
            [h0,h1), num_tokens, format,                2. lease (unknown_/expired_lease)
            dtype, nbytes[, parts], proof}              3. validation (bad_request)
                                                        4. views of the cache's runs, or a
                                                           gather into staging (sender.py)
                                               ◄──────  {ok: true, nbytes, zero_copy, device
                                                         [, staging]}
                                               ◄──────  payload: exactly nbytes raw bytes
                                                        (UCX: one message per part)
      READ {... block_ids: [], num_tokens,     ──────►  streaming (progress.py): 1. proof
            wait_s, tokens_hash[, first_token],         2. wait until tokens [0, num_tokens)
            proof}                                         exist on layers [l0, l1) (at most
                                                           wait_s; unknown_lease: never opened
                                                           or closed, bad_request: hash or
                                                           num_tokens differ, timeout), and
                                                           with first_token until the first
                                                           token was sampled
                                                        3. block_ids = the stream's first
                                                           ceil(num_tokens / B), then as READ
                                                           above from step 2 (lease, ...)
                                               ◄──────  {ok: true, ...[, first: {tokens,
                                                         logprobs}]} + payload, as above
      READ {... as above, mapped: true, proof} ──────►  mapped (same host, ``cuda_ipc.py``):
            (only where AUTH's answer had ipc)          1.-3. as READ; the lease stays pinned
                                               ◄──────  {ok: true, nbytes, mapped: true,
                                                         block_ids, device[, first]}: no payload
      the client gathers the bytes from the server's cache, mapped in its process, checks
      that the connection is still open (an aborted read closed it), then
      DONE {op, lease_id, proof}               ──────►  the read is complete: counted, unpinned
                                                        (no answer)
      RELEASE {op, lease_id, reader_id, proof} ──────►
                                               ◄──────  {ok: true, released}
      PING {op, proof}                         ──────►
                                               ◄──────  {ok: true, server_id, backend}
    an error answer is {ok: false, code, message} and is never followed by a payload.

    H(...) = HMAC-SHA256(cluster token, "disagg-kv-v1", ...) (``cluster_auth.hmac_hex``)
    server proof:  H("server", client_nonce, server_nonce, server_id, backend)
    request proof: H("request", server_nonce, client_nonce, seq, canonical JSON of the header
                   without "proof"), seq = 0 (AUTH), 1, 2, ... per connection

Fresh nonces on both sides make a proof captured on one connection useless on another; the
sequence number makes it useless on its own. Answers and payloads are not signed: the protocol
authenticates both ends, it does not encrypt or protect against an on-path attacker (keep
cluster traffic on a private network).

``wait_s`` / ``tokens_hash`` (layer-wise streaming, docs/DESIGN.md 8.2): the lease may not
exist yet when such a READ arrives (the context request is still queued) and its blocks are
not known to the reader; the server waits on its ``StreamProgress`` first. Its connection
serves nothing else meanwhile, so the client gives each streamed request its own connection.

``ipc`` (same host, ``cuda_ipc.py``): a client that can map a peer's cache offers
``{kind, host, pid, client}`` in AUTH; a server whose cache can be shared with it (a CUDA cache,
the same host identity, another process, ``DISAGG_KV_IPC`` on at both ends) answers with the
cache's handle (``ipc``), otherwise with why not (``ipc_declined``). The client maps the cache
once per server instance; a READ with ``mapped`` then moves no payload: the server validates,
pins and answers as for any READ, the client gathers the bytes itself and says DONE, and only
that (or the read's abort by ``within_lease``, which closes the connection) ends the pin.

``parts`` (UCX only; absent: one part): the byte lengths, in order, of the messages the
payload travels as, each received into its own buffer (the receiver's runs of blocks, or
pieces of one buffer cut so that the server gathers part k+1 while part k is on the wire); at
most 4096, summing to ``nbytes``. A TCP payload is one byte stream, whatever buffers either
side reads or writes it with.

Headers are length-prefixed JSON (4-byte big-endian length, then UTF-8 JSON). Until a
connection has authenticated (HELLO and AUTH) the server reads headers of at most
``PREAUTH_HEADER_MAX_BYTES`` and gives the peer ``handshake_timeout_s``; afterwards at most
``HEADER_MAX_BYTES``. Both backends carry headers on a TCP connection to the server's
``host:port``; payloads are raw bytes (bfloat16 travels as ``view(torch.uint8)``) on that
connection (TCP) or as one UCX tag message (UCX, ``ucx.py``).

GPU memory: a UCX backend whose UCX has CUDA transports (``cuda_copy``, ``cuda_ipc``) sends
payloads from and receives them into GPU memory (the server's cache or a device staging buffer;
the client's device ``out``): the READ answer's ``device`` says the server sent from GPU memory,
``staging`` (only for a GPU cache) why it went through pinned host memory instead. The wire is
the same either way: a UCX tag message does not care which memory either end uses.

Payload formats (local indices of the server's rank; kv cache layout in docs/DESIGN.md 1):
- ``"blocks"``: ``kv[block_ids][:, l0:l1, :, h0:h1]`` as a contiguous
  ``[n_blocks, nl, 2, nh, B, D]`` array.
- ``"tokens"``: token-major ``[nl, 2, nh, num_tokens, D]``: tokens ``0..num_tokens-1`` of the
  sequence through its block table, so the receiver may use another tokens_per_block.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import math
import re
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from disagg.cluster_auth import CLUSTER_TOKEN_ENV, resolve_cluster_token  # noqa: F401 (re-exported)
from disagg.tracing import valid_traceparent
from disagg.transfer.lease import EXPIRED_LEASE, UNKNOWN_LEASE

logger = logging.getLogger("disagg.transfer")

T = TypeVar("T")

HEADER_MAX_BYTES = 1 << 20  # a 1 MiB header holds ~150k block ids: far beyond any prompt
# Before authentication only HELLO and AUTH arrive (a UCX AUTH carries a worker address of a few
# hundred bytes): a peer without the token never makes the server allocate more than this.
PREAUTH_HEADER_MAX_BYTES = 8 << 10
_LEN = struct.Struct("!I")

# Error codes a server answers with (the request gets no payload); the two lease codes are the
# lease table's own (lease.py).
UNAUTHORIZED = "unauthorized"
BAD_REQUEST = "bad_request"
# Error codes raised on the client side; TIMEOUT is also a server's answer to a streaming
# READ whose KV was not ready within its wait_s.
CONNECTION_FAILED = "connection_failed"  # connect refused, peer died (also mid-transfer)
TIMEOUT = "timeout"
SERVER_CODES = frozenset({UNKNOWN_LEASE, EXPIRED_LEASE, UNAUTHORIZED, BAD_REQUEST, TIMEOUT})
CLOSED = "closed"  # the client was closed
# A GPU ``out`` over a transport that moves host memory only, from a server whose cache is not
# mapped (another host, or the mapping failed): nothing was sent.
NOT_MAPPED = "not_mapped"
PROTOCOL_ERROR = "protocol_error"  # malformed or inconsistent answer

FORMATS = ("blocks", "tokens")
# A streaming READ waits at most this long on the server (a prefill queued longer than an
# hour is a stuck cluster, not a slow one).
MAX_WAIT_S = 3600.0
_HASH_RE = re.compile(r"[0-9a-f]{8,128}")


class TransferError(Exception):
    """A KV transfer failed. ``code`` is one of the codes above; ``remote`` is True when the
    server answered with the error (so the connection is still good)."""

    def __init__(self, code: str, message: str = "", *, remote: bool = False) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.remote = remote


class ConnectionClosedError(ConnectionError):
    """The transport connection is gone (EOF, reset, peer died, closed locally)."""


class ProtocolError(Exception):
    """A peer sent something that does not follow the wire protocol."""


# ---- messages ------------------------------------------------------------------------------


def _slice_pair(value: Any, name: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"{name} must be a pair of ints [start, stop), got {value!r}")
    start, stop = value
    if not 0 <= start < stop:
        raise ValueError(f"{name} must satisfy 0 <= start < stop, got {value!r}")
    return (start, stop)


_PLAIN_INT = frozenset({int})


@dataclass(frozen=True)
class ReadRequest:
    """What a generation rank pulls from one context rank for one request.

    ``layer_slice`` / ``head_slice`` are ``[start, stop)`` in the server rank's **local** layer
    and kv-head indices. ``num_tokens`` is required by the ``"tokens"`` format (then
    ``ceil(num_tokens / B) == len(block_ids)``) and informational for ``"blocks"``.

    Streaming (``wait_s`` set): ``block_ids`` is empty, ``num_tokens`` > 0 and
    ``tokens_hash`` (``progress.token_ids_hash`` of the reader's token ids) required; the
    server waits up to ``wait_s`` for those tokens on those layers and reads the first
    ``ceil(num_tokens / B)`` blocks of the stream's table.
    """

    lease_id: str
    block_ids: tuple[int, ...]
    layer_slice: tuple[int, int]
    head_slice: tuple[int, int]
    num_tokens: int = 0
    format: str = "blocks"
    wait_s: float | None = None
    tokens_hash: str | None = None
    first_token: bool = False  # streaming: answer once the first token exists, with it
    # Tracing (disagg/tracing.py): the reader's kv_transfer span, as a W3C traceparent; the
    # server makes its span of the read under it. A malformed one is dropped, never refused.
    traceparent: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lease_id, str) or not self.lease_id:
            raise ValueError("lease_id must be a non-empty string")
        ids = tuple(self.block_ids)
        # (plain ints, checked at C speed: a READ of 8k tokens names 256 blocks; anything
        # else, an int subclass say, goes through the exact check)
        if not (set(map(type, ids)) <= _PLAIN_INT and (not ids or min(ids) >= 0)) and not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise ValueError("block_ids must be non-negative ints")
        object.__setattr__(self, "block_ids", ids)
        object.__setattr__(self, "layer_slice", _slice_pair(self.layer_slice, "layer_slice"))
        object.__setattr__(self, "head_slice", _slice_pair(self.head_slice, "head_slice"))
        if (not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool)
                or self.num_tokens < 0):
            raise ValueError("num_tokens must be a non-negative int")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.format == "tokens" and self.num_tokens == 0:
            raise ValueError("format 'tokens' needs num_tokens > 0")
        if self.first_token is not False and (self.first_token is not True
                                              or self.wait_s is None):
            raise ValueError("first_token: true only on a streaming read (wait_s)")
        if self.wait_s is None:
            if self.tokens_hash is not None:
                raise ValueError("tokens_hash goes with wait_s (a streaming read)")
            if not ids:
                raise ValueError("block_ids must be a non-empty list of non-negative ints")
            return
        self._check_streaming(ids)

    def _check_streaming(self, ids: tuple[int, ...]) -> None:
        wait = self.wait_s
        if (not isinstance(wait, (int, float)) or isinstance(wait, bool)
                or not math.isfinite(wait) or not 0 < wait <= MAX_WAIT_S):
            raise ValueError(f"wait_s must be a number in (0, {MAX_WAIT_S:g}], got {wait!r}")
        object.__setattr__(self, "wait_s", float(wait))
        if ids:
            raise ValueError("a streaming read (wait_s) carries no block_ids: the server "
                             "takes the stream's")
        if self.num_tokens == 0:
            raise ValueError("a streaming read (wait_s) needs num_tokens > 0")
        if not isinstance(self.tokens_hash, str) or not _HASH_RE.fullmatch(self.tokens_hash):
            raise ValueError(f"a streaming read (wait_s) needs tokens_hash, 8-128 lowercase "
                             f"hex digits, got {self.tokens_hash!r}")

    def to_wire(self, dtype: str, nbytes: int) -> dict[str, Any]:
        """The READ header (unsigned). ``dtype``/``nbytes`` describe the receiver's buffer: the
        server refuses (bad_request) when its payload would not match them exactly."""
        msg: dict[str, Any] = {
            "op": "READ", "lease_id": self.lease_id,
            "block_ids": list(self.block_ids), "layer_slice": list(self.layer_slice),
            "head_slice": list(self.head_slice), "num_tokens": self.num_tokens,
            "format": self.format, "dtype": dtype, "nbytes": nbytes,
        }
        if self.wait_s is not None:
            msg["wait_s"] = self.wait_s
            msg["tokens_hash"] = self.tokens_hash
        if self.first_token:
            msg["first_token"] = True
        if self.traceparent is not None:
            msg["traceparent"] = self.traceparent
        return msg

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> ReadRequest:
        """Parse a READ header; raises ``TransferError(bad_request)``."""
        try:
            return cls(
                lease_id=msg["lease_id"], block_ids=tuple(msg["block_ids"]),
                layer_slice=tuple(msg["layer_slice"]), head_slice=tuple(msg["head_slice"]),
                num_tokens=msg.get("num_tokens", 0), format=msg.get("format", "blocks"),
                wait_s=msg.get("wait_s"), tokens_hash=msg.get("tokens_hash"),
                first_token=msg.get("first_token", False),
                traceparent=valid_traceparent(msg.get("traceparent")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(BAD_REQUEST, f"malformed READ: {e}") from None


@dataclass(frozen=True)
class ReadResult:
    """What a completed read delivered into the caller's ``out`` tensor."""

    nbytes: int
    num_blocks: int
    seconds: float  # request sent -> last payload byte received (client side)
    zero_copy: bool  # the server sent straight from its cache memory (no gather)
    # GPU to GPU: the server sent from GPU memory and the payload landed in the client's GPU
    # ``out``, no host staging on either end.
    device_direct: bool = False
    # Why a payload of a GPU cache crossed pinned host memory ("" when it did not, or when no
    # GPU is involved): the first reason, server's or client's.
    staging_reason: str = ""
    # A streaming read with ``first_token``: the context worker's first token(s) and their
    # logprobs, {"tokens": [...], "logprobs": ...} (None otherwise).
    first: dict[str, Any] | None = None
    # Same host: the client gathered the bytes from the server's cache mapped into its
    # process (``cuda_ipc.py``); no payload crossed the transport.
    mapped: bool = False


# One encoder for every header (json.dumps with options builds a new one per call).
_WIRE_JSON = json.JSONEncoder(separators=(",", ":"))


def encode_header(obj: Mapping[str, Any]) -> bytes:
    return _frame(_WIRE_JSON.encode(obj).encode())


def encode_signed(canonical_json: str, proof: str) -> bytes:
    """``encode_header`` of a signed header from its canonical JSON and proof
    (``ClientSession.sign_canonical``): the proof appended to the signed text itself (the
    server parses the header and canonicalises it again: key order is free on the wire)."""
    if not canonical_json.startswith("{") or not canonical_json.endswith("}"):
        raise ValueError("a header is a JSON object")
    sep = "," if canonical_json != "{}" else ""
    return _frame(f'{canonical_json[:-1]}{sep}"proof":{_WIRE_JSON.encode(proof)}}}'.encode())


def _frame(body: bytes) -> bytes:
    if len(body) + _LEN.size > HEADER_MAX_BYTES:
        raise ProtocolError(f"header of {len(body)} bytes exceeds {HEADER_MAX_BYTES}")
    return _LEN.pack(len(body)) + body


def header_length(prefix: bytes | memoryview | np.ndarray,
                  max_bytes: int = HEADER_MAX_BYTES) -> int:
    """The body length a prefix announces; ``ProtocolError`` above ``max_bytes`` (prefix
    included), before anything is allocated for it."""
    (n,) = _LEN.unpack_from(prefix, 0)
    if n > max_bytes - _LEN.size:
        raise ProtocolError(f"header length {n} exceeds {max_bytes}")
    return n


def decode_header(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        obj = json.loads(body if isinstance(body, (bytes, bytearray)) else bytes(body))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"header is not JSON: {e}") from None
    except RecursionError:  # "[[[[..." nested deeper than the parser goes
        raise ProtocolError("header JSON is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError("header is not a JSON object")
    return obj


HEADER_PREFIX_BYTES = _LEN.size


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


# ---- event-loop thread ---------------------------------------------------------------------

_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+


async def bounded(aw: Awaitable[T], timeout_s: float) -> T:
    """``asyncio.wait_for(aw, timeout_s)`` run in the calling task where Python has
    ``asyncio.timeout`` (3.11+): ``wait_for`` there wraps ``aw`` in a task of its own, a loop
    turn to start it and one to see it end (bench/kv_read_overhead.py: each turn is a
    measurable share of a small read). Raises ``TimeoutError`` as ``wait_for`` does."""
    if _timeout is None:
        return await asyncio.wait_for(aw, timeout_s)
    async with _timeout(timeout_s):
        return await aw



class LoopThread:
    """An asyncio loop running in its own (daemon) thread: bulk I/O never touches the caller's
    loop, and the engine thread only ever submits coroutines and gets futures back."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            # Cancel what is left (connection handlers, sweeps) so nothing leaks past stop().
            tasks = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            # getaddrinfo uses the default executor: join its threads too.
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        """Thread-safe; never blocks the caller."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = 30.0) -> T:
        """Submit and wait (start/stop paths only, never from the loop's own thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run() called from its own thread")
        return self.submit(coro).result(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("loop thread %s did not stop within %.1fs", self.name, timeout_s)


# ---- transport abstraction -----------------------------------------------------------------


class Connection(ABC):
    """One ordered, bidirectional message channel to a peer. Used by one coroutine at a time
    (the server answers a connection's requests in order; a client request has a connection of
    its pool to itself).
    Every method raises ``ConnectionClosedError`` when the peer is gone."""

    @abstractmethod
    async def send_header(self, obj: Mapping[str, Any]) -> None: ...

    @abstractmethod
    async def recv_header(self, max_bytes: int = HEADER_MAX_BYTES) -> dict[str, Any]:
        """Raises ``ProtocolError`` for a malformed header or one over ``max_bytes`` (checked
        on the length prefix, before the body is read)."""

    async def send_encoded(self, data: bytes) -> None:
        """Send a header encoded already (``encode_header``, ``encode_signed``); the
        backends send the bytes as they are (this default decodes them again)."""
        await self.send_header(decode_header(data[HEADER_PREFIX_BYTES:]))

    @abstractmethod
    async def send_payload(self, data: Any) -> None:
        """Send a contiguous 1-D uint8 array as is (no copy on our side): a numpy array, or,
        where the backend's ``device_memory_support()`` says so, a CUDA uint8 tensor."""

    @abstractmethod
    async def recv_payload_into(self, out: Any) -> None:
        """Fill exactly ``out.nbytes`` bytes of a contiguous 1-D uint8 array (numpy, or a CUDA
        uint8 tensor where the backend supports device memory)."""

    # True: a payload is one byte stream, split any way on either side (TCP: ``sendmsg`` /
    # ``recvmsg_into`` over several buffers). False: a payload is a sequence of messages whose
    # sizes both sides agree on beforehand (UCX: one tag message per part, the READ's
    # ``parts``).
    stream: ClassVar[bool] = True

    async def send_payload_iov(self, views: Sequence[Any]) -> None:
        """Send the concatenation of ``views`` (contiguous 1-D uint8 arrays), no copy on our
        side. Stream connections only; message connections send parts
        (``send_payload_parts``)."""
        if not self.stream:
            raise NotImplementedError(f"{type(self).__name__} sends payloads as parts")
        for v in views:
            await self.send_payload(v)

    async def send_payload_parts(self, parts: AsyncIterator[Any], count: int) -> None:
        """Send ``count`` parts, each a contiguous 1-D uint8 array, as they come (a part may
        still be in flight while the next one is produced)."""
        sent = 0
        async for p in parts:
            await self.send_payload(p)
            sent += 1
        if sent != count:
            raise ProtocolError(f"{sent} payload parts produced, {count} announced")

    async def recv_payload_iov(self, views: Sequence[Any]) -> None:
        """Fill ``views`` in order: a stream connection reads the payload across all of them;
        a message connection takes one part per view (the sizes announced in the READ)."""
        for v in views:
            await self.recv_payload_into(v)

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    def peer_closed(self) -> bool:
        """Whether the peer has closed the connection, asked without waiting (a mapped read
        asks after its gather: a server that aborted the read closed it before the unpin)."""
        return self.closed

    @property
    @abstractmethod
    def peer_host(self) -> str:
        """The peer's IP address (the server caps connections per peer host)."""

    @abstractmethod
    async def close(self) -> None:
        """Idempotent; never raises."""

    # Transport set-up after authentication (UCX exchanges worker addresses in AUTH). The
    # defaults are TCP's: nothing to set up.

    def attach_offer(self) -> dict[str, Any]:
        """Client: fields to add to the AUTH request."""
        return {}

    async def attach_accept(self, offer: Mapping[str, Any]) -> dict[str, Any]:
        """Server, once AUTH is proven: set up from the client's offer, return fields for the
        answer. Raises ``ProtocolError`` for an unusable offer."""
        return {}

    async def attach_complete(self, answer: Mapping[str, Any]) -> None:
        """Client: finish the set-up from the server's AUTH answer (``ProtocolError``)."""
        return None


class Listener(ABC):
    @property
    @abstractmethod
    def port(self) -> int: ...

    @abstractmethod
    async def close(self) -> None: ...


ConnectionHandler = Callable[[Connection], Awaitable[None]]


class TransportBackend(ABC):
    """A byte transport for KV transfers (``tcp`` or ``ucx``).

    Rules every backend and its users (``KVTransferServer``, ``KVTransferClient``) keep:

    1. **Authenticate first, never send the token.** A connection opens with the mutual
       challenge-response of the module docstring: the client checks the server's proof
       before it sends anything but its HELLO; the server checks every request's proof
       (constant-time) before it looks at anything else, answers ``unauthorized`` and
       closes the connection otherwise. Until then a peer costs the server at most a small
       header buffer and ``handshake_timeout_s``; connections are capped per peer host, in
       total and while unauthenticated, and closed after ``idle_timeout_s`` without a
       request.
    2. **Never send data for a bad request**: a bad proof, an unknown or expired lease, a
       malformed request or one whose size/dtype does not match gets an error header and no
       payload. A lease is pinned while its payload is in flight, so its blocks cannot be
       freed (and reused) under a transfer.
    3. **Connections are opened lazily and cached per peer address** (one per peer, requests
       serialised on it); any failure on a connection (reset, EOF, timeout, protocol error)
       closes it and drops the cache entry, so a failed or restarted peer is reconnected on
       the next request. A request that fails before its answer on a *reused* connection is
       retried once on a fresh one (READ and RELEASE are idempotent): a restarted peer costs
       no request.
    4. **All bulk I/O runs off the caller's event loop**: on the loop thread the backend hands
       out (``acquire_loop``); callers only submit coroutines there and get futures back.
    5. Payloads go straight from / into caller memory (the KV cache or a staging buffer;
       the caller's preallocated ``out``): the backend never allocates per transfer.

    ``listen`` / ``connect`` and every ``Connection`` method run on the backend's loop.
    ``listen`` binds ``host`` only (never every interface unless ``host`` says so).
    """

    name: ClassVar[str]
    # Its connections' ``Connection.stream``: payload bytes are one stream (True), or one
    # message per part, the parts announced in the READ (False).
    stream_payloads: ClassVar[bool] = True

    @abstractmethod
    def acquire_loop(self, role: str) -> LoopThread:
        """The loop thread a server or client (``role``) runs its I/O on."""

    @abstractmethod
    def release_loop(self, loop_thread: LoopThread) -> None:
        """Give back a loop from ``acquire_loop`` (its owner has closed all its I/O)."""

    @abstractmethod
    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> Listener:
        """Accept connections on ``port`` (0: any free port); ``handler`` runs once per
        accepted connection, as a task on the loop."""

    @abstractmethod
    async def connect(self, host: str, port: int, timeout_s: float) -> Connection:
        """Open a connection; raises ``ConnectionClosedError`` when the peer is unreachable."""

    def device_memory_support(self) -> tuple[bool, str]:
        """``(True, how)`` when payloads may be sent from and received into CUDA memory
        (valid once a loop is acquired: UCX decides when its context starts), else
        ``(False, why not)``: a GPU cache then stages payloads in pinned host memory."""
        return False, f"the {self.name} backend moves host memory only"
