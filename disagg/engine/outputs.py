"""What the engine hands out: a request's outputs, their timings, and the engine's counters.

Torch-free: the server imports these (``EngineClient``'s return types) without loading the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagg.kv_connector.errors import KVTransferError


@dataclass
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first and last token, ended
    (``time.monotonic()`` seconds); a request whose prompt KV is pulled also when its reads
    were submitted (``kv_load_start_time``) and when the engine loop's poll that found them
    done began (``kv_poll_time``). The per-request phases (``disagg/timing.py``) are read
    from these."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    kv_load_start_time: float | None = None
    kv_poll_time: float | None = None


@dataclass
class CompletionOutput:
    """One choice's text and tokens so far, and what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    delta_logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """What the engine reports of one request after a step: cumulative outputs, the deltas,
    and once ``finished``, how it ended (``error``, ``kv_transfer_error``,
    ``disaggregated_params``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    prompt: str | None = None
    # Context-only answers that are not final: ContextParams.to_dict() for the router.
    disaggregated_params: dict | None = None
    # Set (with ``error``, its message) when the request failed because its prompt KV could
    # not be pulled from the context worker: the server answers 502 kv_transfer_failed.
    kv_transfer_error: KVTransferError | None = None
    # prompt_logprobs: per prompt token, {token id: logprob} (its own and the top-n); None for
    # the first token (nothing scores it). Complete from the first output on.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters at one moment (``/metrics``, ``/server_info``)."""

    num_running: int
    # Requests waiting: for admission (the queue) or, on a generation worker, for their prompt
    # KV from a context worker (admitted, holding blocks: ``num_waiting_for_kv`` of them).
    num_waiting: int
    num_preempted_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_cache_queries_tokens: int
    prefix_cache_hit_tokens: int
    last_step_batch_size: int
    last_step_num_tokens: int
    steps_total: int
    num_waiting_for_kv: int = 0
    # Speculative decoding (``disagg.spec_decode``): verification rows that carried drafts,
    # the draft tokens proposed in them, how many the target accepted, and how many of them
    # were accepted at each draft position (index 0: the first draft token).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # Offload tiers (``engine/kv_offload.py``'s ``OffloadStats``); None: no tier configured.
    kv_offload: Any = None
    # Peer prefix reuse (kv_peer_reuse): prefix leases made for peers, pulls of a peer's
    # prefix done and failed (computed instead), and the prompt tokens those pulls brought.
    peer_prefix_leases: int = 0
    peer_prefix_pulls: int = 0
    peer_prefix_failed: int = 0
    peer_prefix_tokens: int = 0
