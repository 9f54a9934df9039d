"""Where each rank's share of the model and of the KV cache lives, and which share a generation
rank pulls from which context rank. Torch-free: the router, the transfer planner and the
parallel workers all import it.

One concept, at two levels of detail:

- ``RankLayout``: the global layers and kv heads one rank holds. It is what a peer knows of a
  rank of another worker (the ranks of ``disaggregated_params.layout``).
- ``ParallelLayout``: a ``RankLayout`` plus what the rank itself needs to run its shard
  (the tp/pp sizes, its query heads, the model's totals): built by ``for_rank`` /
  ``all_ranks`` from the split rules in ``disagg.config`` (which checks every
  ``EngineConfig`` with them).
- ``WorkerLayout``: a whole worker's KV layout (sizes, cache kind, kv parts, row width, block
  size, dtype, and one ``RankLayout`` per rank), as sent to the generation worker.

Cache kinds (``ModelConfig.cache_kind``): "mha" caches K and V (kv_parts 2) per kv head,
``head_dim`` wide; "mla" (DeepSeek-V3) one latent row per token (kv_parts 1), ONE cache head
that every TP rank holds (replicated like a kv head when tp > kv heads), ``head_dim`` =
kv_lora_rank + qk_rope_head_dim wide. So a generation rank reads the latent of a block from
exactly one context rank of its stage, however many hold it.

Ranks are numbered ``rank = pp_rank * tp_size + tp_rank`` (stage-major, as Megatron / vLLM).
A rank's KV cache block is ``[its layers, K/V, its kv heads, tokens_per_block, head_dim]``;
global index ``g`` of a range ``[lo, hi)`` is local index ``g - lo`` in that rank's tensors.
The ranges of a tp=2, pp=2 worker of a model with L layers and 4 kv heads::

                     tp_rank 0                 tp_rank 1
    pp_rank 0   rank 0: L[0, L0) H[0, 2)   rank 1: L[0, L0) H[2, 4)     (L0 from layer_ranges)
    pp_rank 1   rank 2: L[L0, L) H[0, 2)   rank 3: L[L0, L) H[2, 4)

Pulling KV between two layouts (``plan_pulls``): a generation rank needs the rectangle
``layers [gl0, gl1) x kv heads [gh0, gh1)`` of every token of the request; each context rank
holds its own rectangle, and the plan is their non-empty intersections, at most one per
context rank, so the transfer is coalesced per rank pair::

              heads ->  0   1   2   3
    layers   ctx (tp2,pp2):  r0: L[0,2) H[0,2)   r1: L[0,2) H[2,4)
      |                      r2: L[2,4) H[0,2)   r3: L[2,4) H[2,4)
      v      gen (tp1,pp2) rank 1 needs L[2,4) H[0,4)  ->  pieces from r2 (H[0,2)), r3 (H[2,4))

Replicated kv heads (tp > kv heads): several context ranks hold the same head; the plan reads
each head from exactly one of them, preferring the context rank whose tensor index matches the
generation rank's, to spread the load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from disagg.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    check_parallel_split,
    kv_head_replicas,
    layer_ranges,
    tp_heads_per_rank,
)

Range = tuple[int, int]  # half-open [lo, hi) of global indices


# ---- head ranges of a tensor-parallel rank ------------------------------------------------


def tp_kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> Range:
    """Global kv heads ``[lo, hi)`` held by TP rank ``tp_rank``.

    Split (kv heads >= tp):   4 kv heads, tp 2 -> rank 0 [0, 2), rank 1 [2, 4).
    Replicated (kv < tp):     1 kv head,  tp 2 -> rank 0 [0, 1), rank 1 [0, 1);
                              2 kv heads, tp 4 -> ranks 0,1 [0, 1), ranks 2,3 [1, 2):
                              rank r holds kv head r // (tp / num_kv_heads), the one its query
                              heads read (query head h reads kv head h // (H_q / H_kv)).
    """
    reps = kv_head_replicas(num_kv_heads, tp_size)
    if reps == 1:
        n = num_kv_heads // tp_size
        return tp_rank * n, (tp_rank + 1) * n
    head = tp_rank // reps
    return head, head + 1


def tp_head_range(num_heads: int, tp_size: int, tp_rank: int) -> Range:
    """Global query heads ``[lo, hi)`` of TP rank ``tp_rank``: an even split, never replicated."""
    n = tp_heads_per_rank(num_heads, tp_size)
    return tp_rank * n, (tp_rank + 1) * n


# ---- the layouts ---------------------------------------------------------------------------

# (cache_kind, kv_parts) pairs a layout may name.
CACHE_KINDS = {("mha", 2), ("mla", 1)}


@dataclass(frozen=True)
class RankLayout:
    """What one rank of a worker holds: global layer and kv-head ranges (half-open)."""

    rank: int
    tp_rank: int
    pp_rank: int
    layer_range: Range
    kv_head_range: Range

    @property
    def num_local_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]

    @property
    def num_local_kv_heads(self) -> int:
        return self.kv_head_range[1] - self.kv_head_range[0]


@dataclass(frozen=True)
class ParallelLayout(RankLayout):
    """A rank's share of the model and of the KV cache, with what it needs to run it."""

    tp_size: int
    pp_size: int
    head_range: Range               # global query heads [lo, hi) this rank computes
    num_layers_total: int
    num_kv_heads_total: int
    num_heads_total: int
    head_dim: int                   # width of a cache row (ModelConfig.kv_cache_width)
    cache_kind: str = "mha"         # "mha" | "mla" (module docstring)
    kv_parts: int = 2               # 2 (K, V) or 1 (MLA latent)

    def __post_init__(self) -> None:
        if self.rank != self.pp_rank * self.tp_size + self.tp_rank:
            raise ValueError(f"layout: rank {self.rank} is not pp_rank * tp_size + tp_rank "
                             f"({self.pp_rank} * {self.tp_size} + {self.tp_rank})")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def kv_head_replicas(self) -> int:
        """TP ranks holding each of this rank's kv heads (>1 only when tp > kv heads)."""
        return kv_head_replicas(self.num_kv_heads_total, self.tp_size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int, tp_rank: int | None = None) -> int:
        """Global rank of ``tp_rank`` (default: this one) in stage ``pp_rank``."""
        return pp_rank * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParallelLayout:
        names = cls.__dataclass_fields__
        kw = {k: v for k, v in d.items() if k in names}
        for k in ("layer_range", "kv_head_range", "head_range"):
            kw[k] = tuple(kw[k])
        return cls(**kw)

    @classmethod
    def for_rank(cls, model: ModelConfig, tp_size: int, pp_size: int, rank: int,
                 partition: Sequence[int] | None = None) -> ParallelLayout:
        if not 0 <= rank < tp_size * pp_size:
            raise ConfigError(f"rank: {rank} not in [0, {tp_size * pp_size})")
        pp_rank, tp_rank = divmod(rank, tp_size)
        return cls(
            rank=rank,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            layer_range=layer_ranges(model.num_hidden_layers, pp_size, partition)[pp_rank],
            kv_head_range=tp_kv_head_range(model.num_key_value_heads, tp_size, tp_rank),
            tp_size=tp_size,
            pp_size=pp_size,
            head_range=tp_head_range(model.num_attention_heads, tp_size, tp_rank),
            num_layers_total=model.num_hidden_layers,
            num_kv_heads_total=model.num_key_value_heads,
            num_heads_total=model.num_attention_heads,
            head_dim=model.kv_cache_width,
            cache_kind=model.cache_kind,
            kv_parts=model.kv_parts,
        )

    @classmethod
    def all_ranks(cls, model: ModelConfig, parallel: ParallelConfig,
                  partition: Sequence[int] | None = None) -> tuple[ParallelLayout, ...]:
        """Every rank's layout, in rank order; ``ConfigError`` if the model cannot be split so.

        ``partition`` (layers per stage) defaults to ``parallel.pp_partition``.
        """
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        if partition is None:
            partition = parallel.pp_partition
        check_parallel_split(model, parallel, partition)
        return tuple(cls.for_rank(model, tp, pp, r, partition) for r in range(tp * pp))


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
    # What a cache row is (ParallelLayout's fields); a peer that sends neither is an MHA one.
    cache_kind: str = "mha"
    kv_parts: int = 2

    def __post_init__(self) -> None:
        if (self.cache_kind, self.kv_parts) not in CACHE_KINDS:
            raise ValueError(f"layout: cache_kind {self.cache_kind!r} with kv_parts "
                             f"{self.kv_parts} is not one of {sorted(CACHE_KINDS)}")
        if self.cache_kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"layout: an mla cache has 1 kv head, not {self.num_kv_heads}")
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
            "cache_kind": self.cache_kind, "kv_parts": self.kv_parts,
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
                       str(d["dtype"]), ranks, cache_kind=str(d.get("cache_kind", "mha")),
                       kv_parts=int(d.get("kv_parts", 2)))
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise ValueError(f"layout: malformed ({e!r})") from None


# ---- pull plans between two worker layouts ------------------------------------------------


def _overlap(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


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
    """The two workers must describe the same model KV (cache kind, parts, layers, heads, row
    width, dtype); ``ValueError`` names the first field that differs."""
    for name in ("cache_kind", "kv_parts", "num_layers", "num_kv_heads", "head_dim", "dtype"):
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
            # Global [layers) x [hr) minus each side's first layer / head: its local slices.
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
