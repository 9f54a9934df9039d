"""Where each rank's share of the model lives: one small frozen object per rank.

Ranks are numbered ``rank = pp_rank * tp_size + tp_rank`` (stage-major, as Megatron / vLLM):

    tp=2, pp=2:        tp_rank 0   tp_rank 1
        pp_rank 0  ->  rank 0      rank 1      layers [0, L0)
        pp_rank 1  ->  rank 2      rank 3      layers [L0, L)

A rank's KV cache block holds ``[its layers, K/V, its kv heads, tokens_per_block, head_dim]``
(DESIGN.md section 1); ``layer_range`` and ``kv_head_range`` say which global layers and kv
heads those are, which is all the KV transfer needs to convert between two layouts.

This module is torch-free (the router and the KV transfer planner import it). The rules of a
valid split (``layer_ranges``, ``kv_head_replicas``, ``check_parallel_split``) live in
``disagg.config``, which checks every ``EngineConfig`` with them; this module builds on them.
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


def tp_kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
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


def tp_head_range(num_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global query heads ``[lo, hi)`` of TP rank ``tp_rank``: an even split, never replicated."""
    n = tp_heads_per_rank(num_heads, tp_size)
    return tp_rank * n, (tp_rank + 1) * n


@dataclass(frozen=True)
class ParallelLayout:
    """One rank's share of the model and of the KV cache."""

    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    layer_range: tuple[int, int]    # global layers [start, end) of this rank's stage
    kv_head_range: tuple[int, int]  # global kv heads [lo, hi) in this rank's KV cache
    head_range: tuple[int, int]     # global query heads [lo, hi) this rank computes
    num_layers_total: int
    num_kv_heads_total: int
    num_heads_total: int
    head_dim: int

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def num_local_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]

    @property
    def num_local_kv_heads(self) -> int:
        return self.kv_head_range[1] - self.kv_head_range[0]

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
        d = asdict(self)
        d["rank"] = self.rank
        return d

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
            tp_size=tp_size,
            pp_size=pp_size,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            layer_range=layer_ranges(model.num_hidden_layers, pp_size, partition)[pp_rank],
            kv_head_range=tp_kv_head_range(model.num_key_value_heads, tp_size, tp_rank),
            head_range=tp_head_range(model.num_attention_heads, tp_size, tp_rank),
            num_layers_total=model.num_hidden_layers,
            num_kv_heads_total=model.num_key_value_heads,
            num_heads_total=model.num_attention_heads,
            head_dim=model.head_dim,
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
