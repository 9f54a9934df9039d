"""Rank 0 <-> rank r messages on a parallel worker's control pipe (frozen, picklable).

Rank 0 sends control messages to every other rank, in step order; a rank answers on the same
pipe only the messages that ask (``GetStats``, ``Probe``, the offload tiers' ``TierSetup``)
and reports its start-up (``Loaded``, ``Ready``) or its death (``RankFailed``). KV transfer
control messages (``disagg.kv_connector.messages.TransferMessage``) travel on the same pipe,
to the rank's ``RankTransfer``, and so do the offload tiers' (``disagg.engine.
kv_offload_messages.TierMessage``, to its ``RankOffload``); their events come back on a pipe
of their own (one per rank, both kinds).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from disagg.scheduler import SchedulerOutput

# ---- rank 0 -> rank r -------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """Run this rank's part of the plan."""

    sched: SchedulerOutput


@dataclass(frozen=True)
class GetStats:
    """Answer with this rank's ``CommStats`` (``StatsReply``)."""


@dataclass(frozen=True)
class ResetStats:
    """Start the ``CommStats`` over."""


@dataclass(frozen=True)
class Probe:
    """Time the transfers alone (``RankComm.probe``, collective); answer ``ProbeReply``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    iters: int


@dataclass(frozen=True)
class Stop:
    """Leave the loop and exit 0."""


# ---- rank r -> rank 0 -------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """The shard is loaded; this rank's KV cache could hold ``num_blocks`` blocks."""

    num_blocks: int


@dataclass(frozen=True)
class Ready:
    """Serving steps; ``transfer_address``: the rank's KV transfer server (context / generation
    worker: every rank serves one, whatever its role at start); ``kv_block_bytes``: one block
    of its KV cache (the offload tiers size a block as its slices on every rank)."""

    pid: int
    transfer_address: str | None
    kv_block_bytes: int = 0


@dataclass(frozen=True)
class RankFailed:
    """The rank failed (at start-up or in a step) and exits; its traceback."""

    traceback: str


@dataclass(frozen=True)
class StatsReply:
    stats: dict[str, Any]


@dataclass(frozen=True)
class ProbeReply:
    result: dict[str, float]


def encode(msg: object) -> bytes:
    """A control message as the bytes rank 0 writes once and sends to every rank."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
