"""Requests and their sampling parameters.

A request's progress is one number: ``num_computed_tokens`` (tokens whose KV is in the cache)
catching up with ``num_tokens`` (prompt + generated so far). When they are equal after a step,
the request samples its next token. Waiting for KV that another worker computed is a state of
its own (``WAITING_FOR_REMOTE_KV``): the tokens are known, the KV arrives by transfer; so is
waiting for prefix blocks copied back from an offload tier (``WAITING_FOR_TIER_KV``).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.structured.spec import GrammarSpec


class SamplingParamsError(ValueError):
    """An out-of-range sampling parameter; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-compatible sampling parameters. ``temperature == 0`` means greedy."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the chosen one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Logits processing (see disagg/sampler.py): OpenAI's penalties on the output's token
    # counts, the transformers repetition rule on prompt + output, per-token biases, min-p.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique, sorted
    min_p: float = 0.0
    # Logprobs of every prompt token (top-n besides the prompt's own; the first is None).
    prompt_logprobs: int | None = None
    # Whether the sampler must read the token history (or add biases) for this request; set
    # once here because the engine asks every step for every row (most are not: they pay a
    # plain attribute read).
    penalized: bool = field(init=False, repr=False, compare=False, default=False)
    # Structured outputs: the grammar the output must match (None: unconstrained).
    structured: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience; store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias",
                           tuple(sorted((int(t), float(b)) for t, b in bias or ())))
        if self.structured is not None:  # a JSON grammar's default bounds scale with the budget
            object.__setattr__(self, "structured", self.structured.with_budget(self.max_tokens))

        def bad(name: str, msg: str) -> None:
            raise SamplingParamsError(f"{name}: {msg}")

        if self.n < 1:
            bad("n", "must be >= 1")
        if self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        if not (0.0 <= self.temperature <= 100.0):
            bad("temperature", "must be in [0, 100]")
        if self.top_k < -1:
            bad("top_k", "must be -1, 0 (off) or a positive number")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad("logprobs", "must be in [0, 20]")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be >= 0")
        self._check_logits_processing(bad)
        object.__setattr__(self, "penalized", (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0 or bool(self.logit_bias)))

    def _check_logits_processing(self, bad: Callable[[str, str], None]) -> None:
        # vLLM's ranges (SamplingParams._verify_args); OpenAI's for logit_bias values.
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 1e4:  # (huge values only overflow)
            bad("repetition_penalty", f"must be in (0, 1e4], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            bad("logit_bias", "a token id appears twice")
        for t, b in self.logit_bias:
            if t < 0:
                bad("logit_bias", f"key {t}: token ids are >= 0")
            if not -100.0 <= b <= 100.0:
                bad("logit_bias", f"key {t}: bias {b} is not in [-100, 100]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", "must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    WAITING_FOR_TIER_KV = "waiting_for_tier_kv"  # prefix blocks coming back from a tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # client gone / cancelled
    FINISHED_ERROR = "finished_error"  # failed (bad input found late, transfer failure, ...)

    @property
    def finished(self) -> bool:
        # _value_, not .value (a slower descriptor): checked per request per step
        return self._value_.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason string for a finished status."""
        return _FINISH_REASONS.get(self._value_)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED.value: "stop",
    RequestStatus.FINISHED_LENGTH.value: "length",
    RequestStatus.FINISHED_ABORTED.value: "abort",
    RequestStatus.FINISHED_ERROR.value: "error",
}


@dataclass
class Request:
    """Mutable state of one sequence inside the engine (owned by the scheduler)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache (-1: not yet looked up)
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    # WAITING_FOR_REMOTE_KV: the prompt positions [0, remote_tokens) whose KV is pulled (a
    # peer's prefix, the rest computed here); None: the whole prompt (a generation_only pull).
    remote_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request may ever hold in the KV cache (for no-evict reservations)."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    def is_finished(self) -> bool:
        return self.status.finished
