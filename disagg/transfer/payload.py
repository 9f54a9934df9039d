"""Server side of a READ: validate it against the cache, then either a zero-copy view of the
cache memory or one gather into a reusable staging buffer.

Cache (one tensor per rank, docs/DESIGN.md 1)::

    kv: [N blocks, L local layers, P parts, H local kv heads, B tokens/block, D width]

P = 2 (K, V; D = head_dim), or 1 for an MLA latent (one head, D = kv_lora_rank +
qk_rope_head_dim); the "2" below is P.

A READ asks for blocks ``ids``, layers ``[l0, l1)``, heads ``[h0, h1)``; nl = l1-l0, nh = h1-h0::

    "blocks":  out[i]              = kv[ids[i], l0:l1, :, h0:h1]        out: [n, nl, 2, nh, B, D]
    "tokens":  out[:, :, :, p, :]  = kv[ids[p // B], l0:l1, :, h0:h1, p % B]
                                                                        out: [nl, 2, nh, T, D]
               block i covers tokens [i*B, (i+1)*B): a run of r consecutive block ids is one
               strided copy  out[..., i*B:(i+r)*B, :] <- kv[b:b+r] (blocks moved next to tokens);
               the last block may be partial (T - (n-1)*B tokens).

Zero copy: a consecutive run ``ids = b, b+1, .., b+n-1`` whose slice ``kv[b:b+n, l0:l1, :,
h0:h1]`` is contiguous (full layer and head slices, or a single block with full heads) is sent
straight from the cache; for "tokens" only a single full block (T == B) has the same bytes.
A GPU cache is sent straight from GPU memory only when the transport moves GPU memory
(``device_ok``: UCX with CUDA transports); otherwise it is gathered on the GPU and copied to
pinned host memory once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from disagg.transfer.base import BAD_REQUEST, ReadRequest, TransferError


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_byte_array(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a 1-D uint8 numpy view (no copy; bf16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def as_payload(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """What a transport sends from / receives into: a CPU tensor as a uint8 numpy view, a CUDA
    tensor as a 1-D uint8 CUDA tensor (it exposes ``__cuda_array_interface__``; bfloat16 does
    not, uint8 does). No copy either way; ``t`` must be contiguous."""
    if t.device.type == "cpu":
        return as_byte_array(t)
    return t.reshape(-1).view(torch.uint8)


def consecutive_runs(ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(dst_index, first_block_id, length)`` for each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


# At most this many views describe one payload in place (a 512-block table with partial
# layers is 512 views); beyond it a gather into one buffer is cheaper than the bookkeeping.
MAX_PAYLOAD_VIEWS = 1 << 14


def block_views(kv: torch.Tensor, ids: tuple[int, ...] | list[int], layers: tuple[int, int],
                heads: tuple[int, int]) -> list[torch.Tensor] | None:
    """Contiguous views of ``kv`` whose concatenation, in order, is the ``"blocks"`` payload
    ``kv[ids][:, l0:l1, :, h0:h1]`` (no copy), or None where it has no such form.

    Block ``ids[i]`` is payload block ``i``. A run ``ids[i:i+r] = b, b+1, .., b+r-1`` is one
    view ``kv[b:b+r, l0:l1, :, h0:h1]`` when that slice is contiguous (all layers and heads);
    otherwise each of its blocks ``kv[b+j, l0:l1, :, h0:h1]`` is one view (contiguous when the
    heads are all of them: a layer range of one block is one stretch of memory). A strict
    subset of heads splits K from V inside every layer: None (the caller gathers)."""
    (l0, l1), (h0, h1) = layers, heads
    views: list[torch.Tensor] = []
    for _, b, r in consecutive_runs(tuple(ids)):
        run = kv[b:b + r, l0:l1, :, h0:h1]
        if run.is_contiguous():
            views.append(run)
            continue
        for j in range(r):
            one = kv[b + j, l0:l1, :, h0:h1]
            if not one.is_contiguous():
                return None
            views.append(one)
        if len(views) > MAX_PAYLOAD_VIEWS:
            return None
    return views


def byte_views(views: list[torch.Tensor]) -> list[np.ndarray]:
    """Each (contiguous CPU) tensor's memory as a 1-D uint8 numpy view."""
    return [as_byte_array(v) for v in views]


def slice_views(views: list[np.ndarray], a: int, b: int) -> list[np.ndarray]:
    """The pieces of ``views`` (one byte stream, in order) that hold its bytes ``[a, b)``::

        views:  |---- v0 ----|-- v1 --|------ v2 ------|
        [a, b):        [=====+========+===)
        result:        v0[a-0:]  v1[:]  v2[:b-s2]      (s_k: where v_k starts)
    """
    out: list[np.ndarray] = []
    start = 0
    for v in views:
        end = start + v.nbytes
        if end > a and start < b:
            out.append(v[max(a, start) - start:min(b, end) - start])
        if end >= b:
            break
        start = end
    return out


def gather_views(pieces: list[np.ndarray], dst: np.ndarray) -> None:
    """Copy ``pieces`` back to back into ``dst`` (numpy: one thread, GIL released)."""
    pos = 0
    for p in pieces:
        np.copyto(dst[pos:pos + p.nbytes], p)
        pos += p.nbytes


def payload_shape(kv_shape: tuple[int, ...], req: ReadRequest) -> tuple[int, ...]:
    """The payload of ``req`` from a cache of ``kv_shape`` (its kv_parts P: 2, or 1 for an
    MLA latent): ``[n, nl, P, nh, B, D]`` ("blocks") or ``[nl, P, nh, T, D]`` ("tokens")."""
    _, _, parts, _, block, head_dim = kv_shape
    nl = req.layer_slice[1] - req.layer_slice[0]
    nh = req.head_slice[1] - req.head_slice[0]
    if req.format == "blocks":
        return (len(req.block_ids), nl, parts, nh, block, head_dim)
    return (nl, parts, nh, req.num_tokens, head_dim)


@dataclass(frozen=True)
class ReadPlan:
    shape: tuple[int, ...]
    nbytes: int
    zero_copy: torch.Tensor | None  # the contiguous cache slice to send as is, if any


def plan_read(
    kv: torch.Tensor, req: ReadRequest, leased: frozenset[int] | None = None,
    device_ok: bool = False, view: bool = True,
) -> ReadPlan:
    """Validate ``req`` against the cache (and the lease's blocks); raises
    ``TransferError(bad_request)``. ``device_ok``: the transport can send a GPU cache's memory
    as is (else a GPU cache is never zero-copy); ``view``: False: no zero-copy view (no
    payload will be sent: a mapped READ)."""
    num_blocks, num_layers, _, num_heads, block, _ = kv.shape
    (l0, l1), (h0, h1) = req.layer_slice, req.head_slice
    if l1 > num_layers:
        raise TransferError(BAD_REQUEST, f"layer_slice {req.layer_slice} beyond {num_layers} "
                                         f"local layers")
    if h1 > num_heads:
        raise TransferError(BAD_REQUEST, f"head_slice {req.head_slice} beyond {num_heads} "
                                         f"local kv heads")
    ids = req.block_ids
    if max(ids) >= num_blocks:
        raise TransferError(BAD_REQUEST, f"block id {max(ids)} >= {num_blocks}")
    if leased is not None and not leased.issuperset(ids):
        raise TransferError(BAD_REQUEST, "block ids outside the lease")
    if req.format == "tokens" and -(-req.num_tokens // block) != len(ids):
        raise TransferError(BAD_REQUEST, f"num_tokens {req.num_tokens} needs "
                                         f"{-(-req.num_tokens // block)} blocks of {block}, "
                                         f"got {len(ids)}")
    shape = payload_shape(tuple(kv.shape), req)
    nbytes = math.prod(shape) * kv.element_size()
    zero_copy = None
    single_full_block = req.format == "tokens" and len(ids) == 1 and req.num_tokens == block
    if view and (req.format == "blocks" or single_full_block):
        if len(consecutive_runs(ids)) == 1:
            v = kv[ids[0]:ids[0] + len(ids), l0:l1, :, h0:h1]
            if v.is_contiguous() and (kv.device.type == "cpu" or device_ok):
                zero_copy = v
    return ReadPlan(shape, nbytes, zero_copy)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Strided copy with numpy: one thread, GIL released. torch's ``copy_`` splits each copy
    over its OpenMP team, and when another process holds a core each of those parallel
    regions waits for a time slice: a 128-block gather took ~1 s instead of ~4 ms here."""
    np.copyto(dst.numpy(), src.numpy())


def gather_into(kv: torch.Tensor, req: ReadRequest, dst: torch.Tensor) -> None:
    """Copy the requested KV into ``dst`` (contiguous, payload shape, kv dtype): one strided
    copy per run of consecutive block ids."""
    # Same-size integer views: bytes are bytes, and numpy has no bfloat16.
    bits = _SAME_SIZE_INT[kv.element_size()]
    kv, dst = kv.view(bits), dst.view(bits)
    (l0, l1), (h0, h1) = req.layer_slice, req.head_slice
    src = kv[:, l0:l1, :, h0:h1]  # [N, nl, 2, nh, B, D], a view
    ids = req.block_ids
    if req.format == "blocks":
        for i, b, r in consecutive_runs(ids):
            _copy(dst[i:i + r], src[b:b + r])
        return
    nl, parts, nh, num_tokens, head_dim = dst.shape
    block = kv.shape[4]
    full = num_tokens // block  # blocks whose B tokens are all used
    for i, b, r in consecutive_runs(ids[:full]):
        # dst[..., i*B:(i+r)*B, :] split as [nl, 2, nh, r, B, D] <- src[b:b+r] (block dim 3rd)
        _copy(dst[:, :, :, i * block:(i + r) * block].view(nl, parts, nh, r, block, head_dim),
              src[b:b + r].permute(1, 2, 3, 0, 4, 5))
    tail = num_tokens - full * block
    if tail:
        _copy(dst[:, :, :, full * block:], src[ids[full], :, :, :, :tail])


def _device_gather_views(kv: torch.Tensor, req: ReadRequest, dst: torch.Tensor
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst view, cache view) pairs whose copies fill ``dst``: one per run of consecutive
    block ids (the same runs as ``gather_into``), so a gather is a few strided copies and
    never materialises an intermediate selection."""
    (l0, l1), (h0, h1) = req.layer_slice, req.head_slice
    src = kv[:, l0:l1, :, h0:h1]  # [N, nl, 2, nh, B, D], a view
    ids = req.block_ids
    if req.format == "blocks":
        return [(dst[i:i + r], src[b:b + r]) for i, b, r in consecutive_runs(ids)]
    nl, parts, nh, num_tokens, head_dim = dst.shape
    block = kv.shape[4]
    full = num_tokens // block
    pairs = [(dst[:, :, :, i * block:(i + r) * block].view(nl, parts, nh, r, block, head_dim),
              src[b:b + r].permute(1, 2, 3, 0, 4, 5))
             for i, b, r in consecutive_runs(ids[:full])]
    tail = num_tokens - full * block
    if tail:
        pairs.append((dst[:, :, :, full * block:], src[ids[full], :, :, :, :tail]))
    return pairs


def gather_into_from_device(kv: torch.Tensor, req: ReadRequest, dst: torch.Tensor,
                            stream: torch.cuda.Stream) -> None:
    """``gather_into`` for a cache in GPU memory, on ``stream`` (not the engine's); returns
    when ``dst`` holds the bytes. ``dst`` on the GPU (a device staging buffer, for a transport
    that sends GPU memory): the runs are copied there directly. ``dst`` in pinned host memory:
    the selection is gathered on the GPU and copied to the host once. The lease keeps the
    blocks from being rewritten meanwhile, and the prefill that wrote them finished before
    the lease existed (its sampled token was read back to the host)."""
    with torch.cuda.device(kv.device), torch.cuda.stream(stream):
        if dst.device.type == "cuda":
            # A GPU staging buffer is only ever written on `stream` (StagingPool reuses it
            # after the transport finished reading it), so no other stream is involved.
            for d, s in _device_gather_views(kv, req, dst):
                d.copy_(s, non_blocking=True)
        else:
            (l0, l1), (h0, h1) = req.layer_slice, req.head_slice
            ids = torch.tensor(req.block_ids, dtype=torch.long).to(kv.device,
                                                                  non_blocking=True)
            sel = kv[:, l0:l1, :, h0:h1].index_select(0, ids)  # [n, nl, 2, nh, B, D]
            if req.format == "tokens":
                n, nl, parts, nh, block, head_dim = sel.shape
                # [n, nl, 2, nh, B, D] -> [nl, 2, nh, n*B, D]; keep tokens [0, T)
                sel = sel.permute(1, 2, 3, 0, 4, 5).reshape(nl, parts, nh, n * block,
                                                            head_dim)
                sel = sel[:, :, :, :req.num_tokens]
            dst.copy_(sel, non_blocking=True)
    stream.synchronize()


class StagingPool:
    """Reusable byte buffers for gathers: a request borrows one and gives it back after its
    payload is sent, so steady-state reads allocate nothing. ``allocations`` counts the
    buffers ever created (for tests and metrics). ``pinned``: page-locked host memory, for
    gathers from a GPU cache (the device-to-host copy runs at full speed and asynchronously).
    ``device``: GPU memory instead (gathers for a transport that sends GPU memory)."""

    def __init__(self, max_buffers: int = 4, pinned: bool = False,
                 device: torch.device | None = None) -> None:
        self._free: list[torch.Tensor] = []
        self._max = max_buffers
        self._pinned = pinned and device is None
        self._device = device
        self.allocations = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        # (indices, not list.remove: tensors compare elementwise)
        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        if self._free:  # replace the largest too-small buffer rather than hold both
            self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].numel()))
        self.allocations += 1
        if self._device is not None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)

    def release(self, buf: torch.Tensor) -> None:
        if len(self._free) < self._max:
            self._free.append(buf)
