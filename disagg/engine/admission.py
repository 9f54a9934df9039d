"""Admission: what a request must satisfy before the engine queues it (torch-free)."""

from __future__ import annotations

from dataclasses import replace

from disagg.config import EngineConfig
from disagg.request import SamplingParams


def context_only_params(params: SamplingParams) -> SamplingParams:
    """What a context worker runs for a context-only request: prefill + one sampled token."""
    return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def validate_request(config: EngineConfig, num_blocks: int, prompt_token_ids: list[int],
                     params: SamplingParams) -> None:
    """Raise ValueError (naming the field) for a request that can never be served by an
    engine of ``config`` with ``num_blocks`` KV blocks: the server's 400."""
    if not prompt_token_ids:
        raise ValueError("prompt: must not be empty")
    vocab = config.model.vocab_size
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad} is out of range [0, {vocab})")
    # Ids the model can never produce are a client's mistake too (another tokenizer's).
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"stop_token_ids: token id {bad} is out of range [0, {vocab})")
    bad = next((t for t, _ in params.logit_bias if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"logit_bias: key {bad} is not a token id of this model "
                         f"(range [0, {vocab}))")
    # What Scheduler._never_fits would finish with an error instead: a bad request.
    sched = config.scheduler
    if not sched.enable_chunked_context and len(prompt_token_ids) > sched.max_num_tokens:
        raise ValueError(
            f"prompt: has {len(prompt_token_ids)} tokens, more than max_num_tokens="
            f"{sched.max_num_tokens}, and this worker prefills whole prompts only "
            f"(enable_chunked_context is off)")
    total = len(prompt_token_ids) + params.max_tokens
    max_len = config.max_model_len
    if total > max_len:
        raise ValueError(
            f"max_tokens: this model's maximum context length is {max_len} tokens; the "
            f"prompt has {len(prompt_token_ids)} tokens and max_tokens is "
            f"{params.max_tokens} ({total} in all)"
        )
    capacity = num_blocks * config.cache.tokens_per_block
    if total > capacity:
        raise ValueError(
            f"max_tokens: prompt + max_tokens = {total} tokens exceeds the KV cache "
            f"capacity of {capacity} tokens"
        )


def validate_resumed(config: EngineConfig, resumed: tuple[int, ...],
                     params: SamplingParams) -> None:
    """A migrated request's output tokens so far (``Local.resumed``): ids of this model, and
    fewer than ``max_tokens`` (the request must have a token left to generate)."""
    field = "disaggregated_params.resume.output_token_ids"
    vocab = config.model.vocab_size
    bad = next((t for t in resumed if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} is out of range [0, {vocab})")
    if len(resumed) >= params.max_tokens:
        raise ValueError(f"{field}: {len(resumed)} tokens, but max_tokens is "
                         f"{params.max_tokens}: nothing is left to generate")
