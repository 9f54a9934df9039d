"""The pull plan: which reads one rank of a generation worker makes for a request's prompt KV,
and what each brings. A pure function of the context answer's params, this worker's layout,
the rank, where its cache lives and what the client can do: no transport, no tensor, no
torch (``KVPuller.start`` turns a plan into reads in flight).

Per context rank whose layers / kv heads overlap this rank's (``plan_pulls``), one coalesced
read; streamed params cut each into layer groups (``stream_pieces``). The format follows the
block sizes: the same ``tokens_per_block`` on both sides moves whole blocks (the server may
send straight from its cache), another one the token-major format, scattered into this
rank's blocks on install::

    "blocks": payload [n_src_blocks, nl, P, nh, B_src, D]   (n_src_blocks = ceil(T / B_src))
    "tokens": payload [nl, P, nh, T, D]                      (any B on either side)

P is the layout's kv_parts (2: K, V; 1: an MLA latent, whose one cache head every context
rank of a stage holds: ``plan_pulls`` reads it from one of them, so each context block's
latent crosses to this rank once).

``into_blocks``: a "blocks" payload into a CPU cache over a client that reads into several
buffers (``runs``) may land straight in the request's blocks (payload block i is this rank's
block ``block_ids[i]``), if the client accepts those buffers' sizes; else it lands in a
receive buffer of ``shape`` and is installed once every read of the request is done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from disagg.contracts.params import ContextParams, token_ids_hash
from disagg.layout import TransferPiece, WorkerLayout, plan_pulls
from disagg.transfer.base import ReadRequest

# A streamed pull reads each context rank's layers in about this many groups: the first ones
# move while the context worker computes the later ones; the last group is the tail left after
# its prefill (more groups: a shorter tail, more requests).
STREAM_LAYER_GROUPS = 8


@dataclass(frozen=True)
class PlannedRead:
    """One read of the plan: the piece it brings, the READ sent for it, the payload's shape."""

    piece: TransferPiece
    request: ReadRequest
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PullPlan:
    """One rank's reads of one request (module docstring)."""

    reads: tuple[PlannedRead, ...]
    num_src_blocks: int  # the context blocks holding the prompt: ceil(num_tokens / B_src)
    into_blocks: bool  # "blocks" payloads may land in the request's own blocks


def plan_pull(params: ContextParams, dst: WorkerLayout, dst_rank: int, *, cache_device: str,
              runs: bool, wait_s: float) -> PullPlan:
    """Rank ``dst_rank``'s reads of the request ``params`` names. ``cache_device``: where this
    rank's KV cache lives ("cpu", "cuda"); ``runs``: the client reads into several buffers;
    ``wait_s``: how long a streamed read may wait for the context worker to compute its
    layers. Streamed, rank 0's last read from context rank 0 also asks for the first token."""
    src = params.layout
    fmt = "blocks" if src.tokens_per_block == dst.tokens_per_block else "tokens"
    # Prompt positions [0, num_tokens) live in the context table's first
    # ceil(num_tokens / B_src) blocks; a piece is layers [l0, l1) x kv heads [h0, h1) of them.
    n_src_blocks = math.ceil(params.num_tokens / src.tokens_per_block)
    # Streamed: the context worker's blocks are its own business (it fills them in).
    src_blocks = tuple(params.block_ids[:n_src_blocks])
    stream = _stream_fields(params, wait_s)
    pieces = stream_pieces(plan_pulls(src, dst, dst_rank), params.stream)
    first = (max(i for i, p in enumerate(pieces) if p.src_rank == 0)
             if params.stream and dst_rank == 0 else -1)
    reads = []
    for i, piece in enumerate(pieces):
        req = ReadRequest(lease_id=params.ctx_request_id, block_ids=src_blocks,
                          layer_slice=piece.src_layer_slice,
                          head_slice=piece.src_head_slice, num_tokens=params.num_tokens,
                          format=fmt, first_token=i == first,
                          traceparent=params.traceparent, **stream)
        nl = piece.layers[1] - piece.layers[0]
        nh = piece.heads[1] - piece.heads[0]
        p = src.kv_parts
        shape = ((n_src_blocks, nl, p, nh, src.tokens_per_block, src.head_dim)
                 if fmt == "blocks" else (nl, p, nh, params.num_tokens, src.head_dim))
        reads.append(PlannedRead(piece, req, shape))
    return PullPlan(tuple(reads), n_src_blocks,
                    into_blocks=runs and fmt == "blocks" and cache_device == "cpu")


def stream_pieces(pieces: list[TransferPiece], stream: bool) -> list[TransferPiece]:
    """Each piece as it is (not streamed), or cut into layer groups in layer order::

        piece layers [a, b) -> [a, a+g) [a+g, a+2g) ... [.., b),  g = ceil((b - a) / 8)
        local slices move with them: src [s0 + (x - a), s0 + (y - a)) for group [x, y)
    """
    if not stream:
        return pieces
    out = []
    for p in pieces:
        a, b = p.layers
        g = math.ceil((b - a) / min(b - a, STREAM_LAYER_GROUPS))
        for x in range(a, b, g):
            y = min(b, x + g)
            s0, d0 = p.src_layer_slice[0], p.dst_layer_slice[0]
            out.append(replace(p, layers=(x, y), src_layer_slice=(s0 + x - a, s0 + y - a),
                               dst_layer_slice=(d0 + x - a, d0 + y - a)))
    return out


def _stream_fields(params: ContextParams, wait_s: float) -> dict[str, Any]:
    """The READ fields of a streamed pull: wait for the KV, and name the tokens it is of."""
    if not params.stream:
        return {}
    ids = params.prompt_token_ids[:params.num_tokens]
    return {"wait_s": wait_s, "tokens_hash": token_ids_hash(ids)}
