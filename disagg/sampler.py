"""Token sampling: greedy, temperature, top-k, top-p, with per-request generators.

Each seeded request has its own ``torch.Generator`` so its samples do not depend on which other
requests share the batch. Logprobs are those of the model's raw distribution (before
temperature / top-k / top-p), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagg.request import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} with the top-n tokens in rank order, then the chosen token if
    # it was not among them; None for rows that did not ask for logprobs.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        # Used by unseeded requests; seeded ones bring their own.
        self.default_generator = default_generator

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_token_ids: list[tuple[int, ...]] | None = None,
    ) -> SamplerOutput:
        """Pick one token per row of ``logits`` ([S, V], float32).

        ``banned_token_ids[i]`` are masked out for row i (EOS and stop tokens before
        ``min_tokens`` are reached).
        """
        if logits.dtype != torch.float32:
            logits = logits.float()
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        if banned_token_ids and any(banned_token_ids):
            logits = logits.clone()
            for i, banned in enumerate(banned_token_ids):
                if banned:
                    logits[i, list(banned)] = float("-inf")

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == len(params):
            chosen = logits.argmax(dim=-1).tolist()
        else:
            chosen = [0] * len(params)
            if greedy_rows:
                idx = torch.tensor(greedy_rows, device=logits.device)
                for i, t in zip(greedy_rows, logits[idx].argmax(dim=-1).tolist(), strict=True):
                    chosen[i] = t
            for i, p in enumerate(params):
                if not p.greedy:
                    gen = generators[i] or self.default_generator
                    chosen[i] = _sample_row(logits[i], p, gen)

        logprobs: list[dict[int, float] | None] = [None] * len(params)
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                row = raw_logprobs[i]
                entry: dict[int, float] = {}
                if p.logprobs > 0:
                    top = torch.topk(row, p.logprobs)
                    entry = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                if chosen[i] not in entry:
                    entry[chosen[i]] = float(row[chosen[i]])
                logprobs[i] = entry
        return SamplerOutput(token_ids=chosen, logprobs=logprobs)


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Sample one token from one row of logits with temperature, top-k and top-p."""
    scaled = row / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (cum - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # Sampling on CPU with the request's generator keeps seeded runs identical across devices.
    probs = probs.to("cpu", torch.float64)
    return int(torch.multinomial(probs, 1, generator=gen).item())
