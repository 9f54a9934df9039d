"""Which KV each generation rank pulls from which context rank (pure functions, torch-free).

A worker's KV cache is split over its ranks: pipeline stage ``p`` holds a contiguous range of
layers, tensor rank ``t`` a contiguous range of kv heads (a single, replicated head when the
tensor-parallel size exceeds the number of kv heads). A generation rank needs the rectangle

    layers [gl0, gl1)  x  kv heads [gh0, gh1)

of every token of the request. Each context rank holds its own rectangle; the pull plan is the
set of non-empty intersections, one per context rank at most, so the transfer is coalesced per
rank pair:

              heads ->  0   1   2   3
    layers   ctx (tp2,pp2):  r0: L[0,2) H[0,2)   r1: L[0,2) H[2,4)
      |                      r2: L[2,4) H[0,2)   r3: L[2,4) H[2,4)
      v      gen (tp1,pp2) rank 1 needs L[2,4) H[0,4)  ->  pieces from r2 (H[0,2)), r3 (H[2,4))

Replicated heads: several context ranks may hold the same head; the plan reads each head from
exactly one of them (preferring the context rank whose tensor index matches the generation
rank's, to spread the load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Range = tuple[int, int]


def _overlap(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class RankLayout:
    """What one rank of a worker holds: global layer and kv-head ranges (half-open)."""

    rank: int
    tp_rank: int
    pp_rank: int
    layer_range: Range
    kv_head_range: Range


@dataclass(frozen=True)
class WorkerLayout:
    """The KV layout of a whole worker, as sent in ``disaggregated_params``."""

    tp_size: int
    pp_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    ranks: tuple[RankLayout, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) != self.tp_size * self.pp_size:
            raise ValueError(f"layout: {len(self.ranks)} ranks for tp={self.tp_size} "
                             f"pp={self.pp_size}")
        # Every (layer, head) cell must be held by at least one rank of each layer's stage.
        for layer in range(self.num_layers):
            holders = [r for r in self.ranks if r.layer_range[0] <= layer < r.layer_range[1]]
            heads = set()
            for r in holders:
                heads.update(range(*r.kv_head_range))
            if heads != set(range(self.num_kv_heads)):
                raise ValueError(f"layout: layer {layer} is missing kv heads "
                                 f"{sorted(set(range(self.num_kv_heads)) - heads)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp_size": self.tp_size, "pp_size": self.pp_size, "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "tokens_per_block": self.tokens_per_block, "dtype": self.dtype,
            "ranks": [{"rank": r.rank, "tp_rank": r.tp_rank, "pp_rank": r.pp_rank,
                       "layer_range": list(r.layer_range),
                       "kv_head_range": list(r.kv_head_range)} for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerLayout:
        try:
            ranks = tuple(
                RankLayout(int(r["rank"]), int(r["tp_rank"]), int(r["pp_rank"]),
                           (int(r["layer_range"][0]), int(r["layer_range"][1])),
                           (int(r["kv_head_range"][0]), int(r["kv_head_range"][1])))
                for r in d["ranks"]
            )
            return cls(int(d["tp_size"]), int(d["pp_size"]), int(d["num_layers"]),
                       int(d["num_kv_heads"]), int(d["head_dim"]), int(d["tokens_per_block"]),
                       str(d["dtype"]), ranks)
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise ValueError(f"layout: malformed ({e!r})") from None


@dataclass(frozen=True)
class TransferPiece:
    """One coalesced read: the part of ``src_rank``'s KV that ``dst_rank`` needs.

    Global ranges, and the same ranges as local indices into each side's cache tensor
    (local layer ``i`` of a rank = global layer ``layer_range[0] + i``; same for heads).
    """

    src_rank: int
    dst_rank: int
    layers: Range
    heads: Range
    src_layer_slice: Range
    src_head_slice: Range
    dst_layer_slice: Range
    dst_head_slice: Range


def check_compatible(src: WorkerLayout, dst: WorkerLayout) -> None:
    """The two workers must describe the same model KV (layers, heads, head_dim, dtype)."""
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
        if getattr(src, name) != getattr(dst, name):
            raise ValueError(f"layout: {name} differs between context ({getattr(src, name)}) "
                             f"and generation ({getattr(dst, name)}) workers")


def plan_pulls(src: WorkerLayout, dst: WorkerLayout, dst_rank: int) -> list[TransferPiece]:
    """The reads generation rank ``dst_rank`` makes, at most one per context rank."""
    check_compatible(src, dst)
    me = dst.ranks[dst_rank]
    pieces: list[TransferPiece] = []
    for stage in range(src.pp_size):
        stage_ranks = sorted((r for r in src.ranks if r.pp_rank == stage),
                             key=lambda r: r.tp_rank)
        layers = _overlap(stage_ranks[0].layer_range, me.layer_range)
        if layers is None:
            continue
        # Assign each needed head to one context rank of this stage: the one with the same
        # tensor index modulo the context tp size if it holds the head, else the first holder.
        owner: dict[int, RankLayout] = {}
        preferred = stage_ranks[me.tp_rank % len(stage_ranks)]
        for h in range(*me.kv_head_range):
            holders = [r for r in stage_ranks if r.kv_head_range[0] <= h < r.kv_head_range[1]]
            owner[h] = preferred if preferred in holders else holders[0]
        # Group the heads by owner; a rank's heads form one contiguous run.
        by_rank: dict[int, list[int]] = {}
        for h, r in owner.items():
            by_rank.setdefault(r.rank, []).append(h)
        for rank_id, heads in sorted(by_rank.items()):
            r = src.ranks[rank_id]
            hr = (min(heads), max(heads) + 1)
            assert hr[1] - hr[0] == len(heads), "a context rank's heads are contiguous"
            pieces.append(TransferPiece(
                src_rank=rank_id,
                dst_rank=dst_rank,
                layers=layers,
                heads=hr,
                src_layer_slice=(layers[0] - r.layer_range[0], layers[1] - r.layer_range[0]),
                src_head_slice=(hr[0] - r.kv_head_range[0], hr[1] - r.kv_head_range[0]),
                dst_layer_slice=(layers[0] - me.layer_range[0], layers[1] - me.layer_range[0]),
                dst_head_slice=(hr[0] - me.kv_head_range[0], hr[1] - me.kv_head_range[0]),
            ))
    return pieces


def readers_per_context_rank(src: WorkerLayout, dst: WorkerLayout) -> dict[int, int]:
    """How many generation ranks read from each context rank (the lease's reader count)."""
    counts = {r.rank: 0 for r in src.ranks}
    for d in dst.ranks:
        for p in plan_pulls(src, dst, d.rank):
            counts[p.src_rank] += 1
    return counts
