"""Same-host KV reads with no payload on any wire: a generation rank maps a context rank's GPU
KV cache into its own process once (CUDA IPC) and gathers each READ's bytes from it itself.

Why: a READ's payload over UCX is gathered, sent and received as pieces, and on one GPU that
cost 6% of a device-to-device copy of the same bytes (issue 44). On one host the whole cache is
one IPC handle away; a read then costs its gather (one or two kernels, at device copy speed)
plus one header round trip and a one-way DONE on the connection the read uses anyway::

    client (generation rank)                       server (context rank)
      AUTH {..., ipc: {kind, host, pid, client}} ─►  CacheExporter.answer: switch on, same host
                                                     identity, another process, a CUDA cache:
                                                     the cache's handle (exported once per
                                                     client instance); else why not
      ◄─ {ok, ipc: {kind, uuid, handle, ...}} or {ok, ipc_declined: why}
      first read whose ``out`` is on the peer's GPU: MappedPeers.get maps the handle there (once
      per server instance; a failure is counted and logged, and that peer's reads move bytes)
      READ {..., mapped: true}                    ─►  lease, validation, pin: as any READ
      ◄─ {ok, mapped: true, block_ids, ...}           (no payload)
      gather_mapped on a stream of its own; waited for (polled, then on a thread)
      connection still open? (an aborted read closed it before its unpin: fail, never succeed)
      DONE {lease_id}                             ─►  counted (``mapped_transfers``), unpinned;
                                                      no answer (the next request follows)

The pin holds from the READ until DONE arrives: the blocks cannot be freed under the gather. A
reader that never says DONE is a stalled reader (``sender.within_lease``): the server closes the
connection, then unpins; the reader finds the connection closed after its gather (or cannot
send its DONE) and its read fails, as a UCX receive whose connection closed meanwhile does. The
DONE has no answer: waiting for one would add a round trip to every read (two header round
trips would be a third of a 2k-token read's budget), and the blocks of an aborted read are
reused (unpinned, freed, allocated, written by a new prefill) long after its close arrived.

Host identity: ``/proc/sys/kernel/random/boot_id`` and the hostname (two containers on one
machine have different hostnames: not offered, they may not share IPC). Which GPU: the handle's
GPU UUID, looked up among this process's devices (``CUDA_VISIBLE_DEVICES`` may number them
differently); the cache is mapped only when the read's ``out`` is on that GPU (mapping it
creates a CUDA context on that device). The mapping follows ``torch.multiprocessing``'s own
(``reductions.rebuild_cuda_tensor``): ``UntypedStorage._share_cuda_`` on the server,
``_new_shared_cuda`` here, which counts the reference in the server's shared-memory counter
and waits on the export's event.

``CacheSharing`` is the seam: ``CudaIpcSharing`` is the real one; the tests plug in one that
maps CPU tensors within a process, so that everything but the CUDA calls runs on the CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from disagg.transfer.base import ReadRequest
from disagg.transfer.payload import consecutive_runs, dtype_name, payload_shape

logger = logging.getLogger("disagg.transfer")

# Up to this many runs of consecutive block ids are copied run by run (a consecutive table is
# one memcpy); a more scattered table is one index_select.
MAX_RUN_COPIES = 4
# How long the loop polls a gather's CUDA event (yielding to its other tasks) before a thread
# waits for it: a 2k-token read of the 8B shape gathers in ~0.2 ms on an H100, about what a hop
# to a thread and back costs.
SPIN_S = 0.005
MAX_EXPORTS = 1024  # a server keeps this many client instances' exports (the oldest go)
_CLIENT_ID_MAX = 64
_HOST_FILE = "/proc/sys/kernel/random/boot_id"


@functools.cache
def host_identity() -> str:
    """This machine as seen by its kernel: boot id and hostname ("" when unknown: no offer)."""
    try:
        with open(_HOST_FILE) as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{boot}/{socket.gethostname()}" if boot else ""


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


class SharingError(Exception):
    """A cache cannot be exported or mapped; the message says why (logged and counted)."""


# ---- the seam: how a cache is exported and mapped -------------------------------------------


def geometry(kv: torch.Tensor) -> dict[str, Any]:
    """``kv``'s place in its storage (elements), for the reader's rebuild."""
    return {"dtype": dtype_name(kv.dtype), "shape": list(kv.shape), "stride": list(kv.stride()),
            "offset": kv.storage_offset()}


def parse_geometry(desc: Mapping[str, Any]
                   ) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]:
    """(dtype, shape, stride, offset) of a description; raises ``SharingError``."""
    dtype = getattr(torch, str(desc.get("dtype")), None)
    shape, stride, offset = desc.get("shape"), desc.get("stride"), desc.get("offset")

    def ints(v: Any) -> bool:
        return (isinstance(v, list) and len(v) == 6
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))

    if (not isinstance(dtype, torch.dtype) or not ints(shape) or not ints(stride)
            or not isinstance(offset, int) or isinstance(offset, bool) or offset < 0
            or shape[2] not in (1, 2)):
        raise SharingError("malformed cache description (dtype, shape, stride, offset)")
    return dtype, tuple(shape), tuple(stride), offset


def rebuild(storage: torch.UntypedStorage, desc: Mapping[str, Any]) -> torch.Tensor:
    """The described tensor over ``storage`` (checked to lie inside it)."""
    dtype, shape, stride, offset = parse_geometry(desc)
    size = torch.empty(0, dtype=dtype).element_size()
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    if min(shape) == 0 or (last + 1) * size > storage.nbytes():
        raise SharingError("the described cache does not fit the shared memory")
    t = torch.empty(0, dtype=dtype, device=storage.device)
    t.set_(storage, offset, shape, stride)
    return t


class CacheSharing(ABC):
    """How a KV cache's memory is exported by its server's process and mapped by a reader's."""

    kind: ClassVar[str]
    # Whether a process may map its own export (CUDA IPC cannot: cudaIpcOpenMemHandle refuses
    # a handle of its own process; such a client reads through the transport).
    same_process: ClassVar[bool] = False

    @abstractmethod
    def local_support(self) -> tuple[bool, str]:
        """Client: whether this process can map peers' caches at all, or why not."""

    @abstractmethod
    def exportable(self, kv: torch.Tensor) -> str | None:
        """Server: why ``kv`` cannot be shared (None: it can)."""

    @abstractmethod
    def export(self, kv: torch.Tensor) -> dict[str, Any]:
        """Server: a JSON description of ``kv`` that a reader maps; raises ``SharingError``."""

    @abstractmethod
    def locate(self, desc: Mapping[str, Any]) -> torch.device:
        """Client: the local device the described cache would be mapped on (nothing is mapped
        yet); raises ``SharingError``."""

    @abstractmethod
    def open(self, desc: Mapping[str, Any], device: torch.device) -> torch.Tensor:
        """Client: the described cache, mapped on ``device``; raises ``SharingError``."""


def _gpu_uuid(index: int) -> str:
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # an older torch without .uuid: fall back to the index
        return ""


def _hex_bytes(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise SharingError(f"malformed handle: {name} is not a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise SharingError(f"malformed handle: {name} is not hex") from None


def _int(desc: Mapping[str, Any], name: str) -> int:
    v = desc.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise SharingError(f"malformed handle: {name} is not a non-negative int")
    return v


class CudaIpcSharing(CacheSharing):
    """CUDA IPC through torch's own storage sharing (the ``torch.multiprocessing`` way)."""

    kind: ClassVar[str] = "cuda_ipc"

    def local_support(self) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "no CUDA device in this process"
        return True, "CUDA IPC"

    def exportable(self, kv: torch.Tensor) -> str | None:
        if kv.device.type != "cuda":
            return f"the cache is in {kv.device.type} memory, not a GPU's"
        return None

    def export(self, kv: torch.Tensor) -> dict[str, Any]:
        why = self.exportable(kv)
        if why is not None:
            raise SharingError(why)
        try:
            with torch.cuda.device(kv.device):
                (device, handle, size_bytes, offset_bytes, ref_counter, ref_counter_offset,
                 event, event_sync) = kv.untyped_storage()._share_cuda_()
        except Exception as e:
            raise SharingError(f"cannot export the cache's memory: {_short(e)}") from e
        return {**geometry(kv), "device": int(device), "uuid": _gpu_uuid(kv.device.index or 0),
                "handle": bytes(handle).hex(), "size_bytes": int(size_bytes),
                "offset_bytes": int(offset_bytes), "ref_counter": bytes(ref_counter).hex(),
                "ref_counter_offset": int(ref_counter_offset),
                "event": None if event is None else bytes(event).hex(),
                "event_sync": bool(event_sync)}

    def locate(self, desc: Mapping[str, Any]) -> torch.device:
        if not torch.cuda.is_available():
            raise SharingError("no CUDA device in this process")
        count = torch.cuda.device_count()
        want = desc.get("uuid")
        if isinstance(want, str) and want:
            for i in range(count):
                if _gpu_uuid(i) == want:
                    return torch.device("cuda", i)
            raise SharingError(f"the peer's GPU ({want}) is not visible in this process")
        index = _int(desc, "device")  # no UUID (an older torch): the same index
        if index >= count:
            raise SharingError(f"the peer's GPU cuda:{index} is not visible in this process")
        return torch.device("cuda", index)

    def open(self, desc: Mapping[str, Any], device: torch.device) -> torch.Tensor:
        handle = _hex_bytes(desc.get("handle"), "handle")
        ref_counter = _hex_bytes(desc.get("ref_counter"), "ref_counter")
        event = desc.get("event")
        event_bytes = None if event is None else _hex_bytes(event, "event")
        args = (device.index, handle, _int(desc, "size_bytes"), _int(desc, "offset_bytes"),
                ref_counter, _int(desc, "ref_counter_offset"), event_bytes,
                bool(desc.get("event_sync")))
        parse_geometry(desc)  # a malformed description fails before anything is mapped
        try:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(*args)
        except Exception as e:  # another GPU, a container without IPC, an old driver, ...
            raise SharingError(f"cannot map the peer's cache: {_short(e)}") from e
        return rebuild(storage, desc)


# ---- server: the offer ------------------------------------------------------------------------


class CacheExporter:
    """A server's side of the mapped path: which AUTH offers get the cache's handle
    (``answer``), exported once per client instance (the loop thread only)."""

    def __init__(self, kv: torch.Tensor, sharing: CacheSharing, enabled: bool) -> None:
        self.kv = kv
        self.sharing = sharing
        self.enabled = enabled
        self._exports: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._failed: str | None = None  # an export failed: not offered again

    def refusal(self, offer: Any) -> str | None:
        """Why ``offer`` (a client's AUTH ``ipc``) gets no handle; None: it gets one."""
        if not self.enabled:
            return "the server's mapped path is off (DISAGG_KV_IPC)"
        if not isinstance(offer, Mapping):
            return "malformed ipc offer"
        kind, host, pid, client = (offer.get("kind"), offer.get("host"), offer.get("pid"),
                                   offer.get("client"))
        if (not isinstance(kind, str) or not isinstance(host, str)
                or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0
                or not isinstance(client, str) or not 0 < len(client) <= _CLIENT_ID_MAX):
            return "malformed ipc offer"
        if kind != self.sharing.kind:
            return f"the client maps {kind!r} handles, this server exports {self.sharing.kind!r}"
        mine = host_identity()
        if not mine:
            return "this server's host identity is unknown"
        if host != mine:
            return "another host"
        if pid == os.getpid() and not self.sharing.same_process:
            return "the same process (it cannot map its own handle)"
        why = self.sharing.exportable(self.kv)
        if why is not None:
            return why
        return self._failed

    def answer(self, offer: Any) -> dict[str, Any]:
        """The AUTH answer's fields for a client's ``offer`` (None: it made none)."""
        if offer is None:
            return {}
        why = self.refusal(offer)
        if why is None:
            client = offer["client"]
            desc = self._exports.get(client)
            if desc is None:
                try:
                    desc = self.sharing.export(self.kv)
                except SharingError as e:
                    self._failed = why = f"export failed: {e}"
                    logger.warning("kv transfer server: the mapped path is off: %s", why)
                else:
                    self._exports[client] = desc
                    while len(self._exports) > MAX_EXPORTS:
                        self._exports.popitem(last=False)
            if desc is not None:
                return {"ipc": {"kind": self.sharing.kind, **desc}}
        return {"ipc_declined": why}


def client_offer(sharing: CacheSharing, client_id: str) -> dict[str, Any] | None:
    """What a client offers in AUTH (None: it cannot map peers' caches: no offer)."""
    ok, _ = sharing.local_support()
    host = host_identity()
    if not ok or not host:
        return None
    return {"kind": sharing.kind, "host": host, "pid": os.getpid(), "client": client_id}


# ---- client: the gather -----------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _widened(kv: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same bytes as integers, as wide as both tensors allow (8 bytes for a bf16 row of 4k
    elements): fewer, wider elements for the index kernel; bytes are bytes."""
    if kv.dtype != out.dtype:
        raise ValueError(f"out is {out.dtype}, the cache {kv.dtype}")
    size = kv.element_size()
    for width in (8, 4, 2, 1):
        if width < size:
            break
        try:
            return kv.view(_INT_OF_SIZE[width]), out.view(_INT_OF_SIZE[width])
        except RuntimeError:  # the last dim's bytes or an offset not a multiple of width
            continue
    return kv.view(_INT_OF_SIZE[size]), out.view(_INT_OF_SIZE[size])


def _select(src: torch.Tensor, dim: int, ids: tuple[int, ...], dst: torch.Tensor) -> None:
    """``dst.narrow(dim, i, 1) <- src.narrow(dim, ids[i], 1)`` for every i: a copy per run of
    consecutive ids when they are few, else one index_select."""
    runs = consecutive_runs(ids)
    if len(runs) <= MAX_RUN_COPIES:
        for i, b, r in runs:
            dst.narrow(dim, i, r).copy_(src.narrow(dim, b, r), non_blocking=True)
        return
    index = torch.tensor(ids, dtype=torch.long, device=src.device)
    torch.index_select(src, dim, index, out=dst)


def gather_mapped(kv: torch.Tensor, req: ReadRequest, out: torch.Tensor) -> None:
    """``out`` <- the payload of ``req`` from ``kv`` (what ``payload.gather_into`` writes),
    ``out`` contiguous, of the payload's shape and ``kv``'s dtype, on ``kv``'s device. On a GPU
    the kernels are queued on the current stream (at most two: the full blocks, a partial
    last block of the ``"tokens"`` format)."""
    if out.device != kv.device:
        raise ValueError(f"out is on {out.device}, the cache on {kv.device}")
    if tuple(out.shape) != payload_shape(tuple(kv.shape), req) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {payload_shape(tuple(kv.shape), req)}, got "
                         f"{tuple(out.shape)}")
    kv_w, out_w = _widened(kv, out)
    (l0, l1), (h0, h1) = req.layer_slice, req.head_slice
    src = kv_w[:, l0:l1, :, h0:h1]  # [N, nl, P, nh, B, W], a view
    ids = req.block_ids
    if req.format == "blocks":
        _select(src, 0, ids, out_w)
        return
    nl, parts, nh, num_tokens, width = out_w.shape
    block = kv.shape[4]
    full = num_tokens // block  # blocks whose B tokens are all used
    if full:
        # out[..., i*B:(i+1)*B, :] as [nl, P, nh, full, B, W] <- block ids[i], blocks 4th
        dst = out_w[:, :, :, :full * block].view(nl, parts, nh, full, block, width)
        _select(src.permute(1, 2, 3, 0, 4, 5), 3, ids[:full], dst)
    tail = num_tokens - full * block
    if tail:
        out_w[:, :, :, full * block:].copy_(src[ids[full], :, :, :, :tail], non_blocking=True)


def answered_request(read: ReadRequest | Mapping[str, Any], resp: Mapping[str, Any],
                     cache: torch.Tensor) -> ReadRequest:
    """The read a mapped answer asks the client to gather: the READ it sent (``read``: as
    built, or its wire header), with the block ids the server answered (a streaming read
    learns them here), checked against the mapped cache before any kernel indexes it; raises
    ``ValueError``."""
    req = read if isinstance(read, ReadRequest) else ReadRequest.from_wire(read)
    ids = resp.get("block_ids")
    num_blocks, num_layers, _, num_heads, block, _ = cache.shape
    if req.wait_s is None:
        # The READ named its blocks (non-negative ints, checked when it was built): the
        # answer must name the same, and the gather indexes the READ's own.
        if not isinstance(ids, list) or tuple(ids) != req.block_ids:
            raise ValueError("the answer names other block ids than the READ")
        if max(req.block_ids) >= num_blocks:
            raise ValueError(f"block_ids must be a non-empty list of ids < {num_blocks}")
    else:
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(b, int) and not isinstance(b, bool)
                           and 0 <= b < num_blocks for b in ids)):
            raise ValueError(f"block_ids must be a non-empty list of ids < {num_blocks}")
        req = dataclasses.replace(req, block_ids=tuple(ids), wait_s=None, tokens_hash=None,
                                  first_token=False)
    if req.layer_slice[1] > num_layers or req.head_slice[1] > num_heads:
        raise ValueError("layer or head slice beyond the mapped cache")
    if req.format == "tokens" and -(-req.num_tokens // block) != len(ids):
        raise ValueError(f"{req.num_tokens} tokens need {-(-req.num_tokens // block)} blocks, "
                         f"the answer names {len(ids)}")
    return req


async def wait_event(event: Any) -> None:
    """Until a CUDA ``event`` has completed: polled on the loop for ``SPIN_S`` (yielding to its
    other tasks), then waited for on a thread. Cancelled, it still waits (the copies the event
    stands for write into the caller's buffer) and then raises."""
    deadline = time.perf_counter() + SPIN_S
    try:
        while not event.query():
            if time.perf_counter() >= deadline:
                await asyncio.get_running_loop().run_in_executor(None, event.synchronize)
                return
            await asyncio.sleep(0)
    except BaseException:
        event.synchronize()
        raise


@dataclass
class _Peer:
    """One server instance's cache, as this client maps it."""

    server_id: str
    device: torch.device | None = None
    cache: torch.Tensor | None = None
    reason: str = ""  # why it cannot be used (cache None)
    opening: asyncio.Future[None] | None = None


class MappedPeers:
    """A client's mapped caches: per server address, the current server instance's cache,
    mapped once, on the first read whose ``out`` is on that GPU; a new instance at the address
    (another ``server_id``) replaces it. Reads that cannot use it are counted in ``stats``
    (``record_mapped_fallback``) and logged once per peer and reason. Loop thread only."""

    def __init__(self, sharing: CacheSharing, stats: Any) -> None:
        self.sharing = sharing
        self.stats = stats
        self._peers: dict[str, _Peer] = {}
        self._streams: dict[torch.device, Any] = {}
        self._events: dict[torch.device, list[Any]] = {}  # completed events, reused
        self._told: set[tuple[str, str, str]] = set()

    async def get(self, address: str, server_id: str, desc: Mapping[str, Any],
                  out: torch.Tensor) -> torch.Tensor | None:
        """The cache to gather a read into ``out`` from, or None (the read moves its bytes;
        why is counted and logged)."""
        peer = self._peers.get(address)
        if peer is None or peer.server_id != server_id:
            peer = self._peers[address] = _Peer(server_id)
            try:
                peer.device = self.sharing.locate(desc)
            except SharingError as e:
                peer.reason = str(e)
        if peer.device is not None and not peer.reason and out.device != peer.device:
            if out.device.type == "cpu":  # the caller's choice (a transport without GPU
                return None               # memory): not a failure of the mapped path
            return self._fallback(address, peer, f"out is on {out.device}, the peer's cache "
                                                 f"on {peer.device}")
        if peer.cache is None and not peer.reason:
            if peer.opening is None:
                peer.opening = asyncio.ensure_future(self._open(address, peer, desc))
            await asyncio.shield(peer.opening)
        if peer.cache is None:
            return self._fallback(address, peer, peer.reason)
        if peer.cache.dtype != out.dtype:
            return self._fallback(address, peer, f"out is {out.dtype}, the peer's cache "
                                                 f"{peer.cache.dtype}")
        return peer.cache

    async def _open(self, address: str, peer: _Peer, desc: Mapping[str, Any]) -> None:
        assert peer.device is not None
        loop = asyncio.get_running_loop()
        try:  # a CUDA call that may take a while: off the loop
            peer.cache = await loop.run_in_executor(None, self.sharing.open, desc, peer.device)
        except SharingError as e:
            peer.reason = str(e)
        except Exception as e:
            peer.reason = f"cannot map the peer's cache: {_short(e)}"
        else:
            c = peer.cache
            logger.info("kv transfer: mapped the KV cache of %s (%s, %s %s, %.0f MiB) on %s",
                        address, self.sharing.kind, tuple(c.shape), dtype_name(c.dtype),
                        c.numel() * c.element_size() / 2**20, peer.device)
        finally:
            peer.opening = None

    def failed(self, address: str, cache: torch.Tensor, reason: str) -> None:
        """A gather from ``cache`` raised: that peer's reads move their bytes from now on."""
        peer = self._peers.get(address)
        if peer is not None and peer.cache is cache:
            peer.cache, peer.reason = None, reason

    def _fallback(self, address: str, peer: _Peer, reason: str) -> None:
        self.stats.record_mapped_fallback(reason)
        key = (address, peer.server_id, reason)
        if key not in self._told:
            self._told.add(key)
            logger.warning("kv transfer: %s offered its KV cache mapped (%s), but reads from it "
                           "move their bytes: %s", address, self.sharing.kind, reason)
        return None

    def clear(self) -> None:
        """Drop every mapping (the client closes)."""
        self._peers.clear()
        self._streams.clear()
        self._events.clear()

    async def gather(self, cache: torch.Tensor, req: ReadRequest, out: torch.Tensor) -> None:
        """``out`` <- ``req``'s payload from the mapped ``cache``; its bytes are in place when
        this returns, and nothing writes into ``out`` after it returned or raised."""
        if cache.device.type != "cuda":
            gather_mapped(cache, req, out)
            return
        stream = self._streams.get(cache.device)
        if stream is None:  # a stream nothing else runs on: the gather waits for no one
            stream = self._streams[cache.device] = torch.cuda.Stream(cache.device)
        with torch.cuda.device(cache.device), torch.cuda.stream(stream):
            try:
                gather_mapped(cache, req, out)
            except BaseException:
                stream.synchronize()  # a copy queued before the failure writes into out
                raise
            # an event that has completed, reused: no CUDA event created (and destroyed) per read
            free = self._events.setdefault(cache.device, [])
            done = free.pop() if free else torch.cuda.Event()
            done.record(stream)
        await wait_event(done)  # (cancelled, it waits for the event before it raises)
        free.append(done)
