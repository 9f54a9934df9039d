"""Proposers of draft tokens: the abstract base and prompt lookup (``ngram``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from disagg.request import Request
from disagg.scheduler import ScheduledRequest


class Proposer(ABC):
    """Guesses the next tokens of decoding requests.

    Rules: ``propose`` gets the step's decodes that have draft slots (``sr.spec_slots`` > 0:
    the scheduler reserved KV slots for positions ``sr.start_pos + 1 .. + spec_slots`` and
    token budget for them) with their requests, and returns at most ``spec_slots`` tokens per
    request id (a request may be left out: it decodes one token). It runs on the engine's
    thread between scheduling and the target's forward; it must not change the requests or
    the target's KV cache. Proposals need not be right (the target checks them) but must be
    deterministic for the sampling rule to hold (``disagg.spec_decode``). ``forget`` is called
    once when a request ends (drop what is kept for it)."""

    @abstractmethod
    def propose(self, entries: Sequence[tuple[Request, ScheduledRequest]]
                ) -> dict[str, list[int]]:
        """Draft tokens by request id (each list at most ``sr.spec_slots`` long)."""

    def forget(self, request_id: str) -> None:  # noqa: B027 (optional hook, a no-op here)
        """The request ended."""


def ngram_lookup(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: for n from ``n_max`` down to ``n_min``, find the earliest earlier
    occurrence of the last n tokens; the (up to) k tokens that followed it are the guess.
    [] when no n-gram recurs."""
    L = len(tokens)
    if L < 2 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # windows arr[i:i+n] for i in [0, L-n-1]: each has a next token (the last suffix,
        # starting at L-n, is excluded: it is the one looked up)
        windows = sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return [int(t) for t in arr[start:start + k]]
    return []


class NgramProposer(Proposer):
    """``method: ngram``: drafts copied from earlier in the prompt or output (no model)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, entries: Sequence[tuple[Request, ScheduledRequest]]
                ) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for req, sr in entries:
            drafts = ngram_lookup(req.prompt_token_ids + req.output_token_ids, self.n_min,
                                  self.n_max, sr.spec_slots)
            if drafts:
                out[req.request_id] = drafts
        return out
