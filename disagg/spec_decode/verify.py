"""The target's check of a step's drafts: one sampler row per checked position, then the
longest run of drafts the target would have chosen itself (``disagg.spec_decode``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from disagg.request import SamplingParams
from disagg.sampler import SamplerOutput


@dataclass(frozen=True)
class Rows:
    """Sampler inputs of a step, request i taking rows [first[i], first[i] + 1 + len(d_i)):
    row j of it samples output position ``n_i + j`` as if its first j drafts were emitted."""

    params: list[SamplingParams]
    positions: list[int]
    banned: list[tuple[int, ...]]
    histories: list[tuple[list[int], list[int]]] | None


def expand_rows(params: Sequence[SamplingParams], num_outputs: Sequence[int],
                banned_until_min: Sequence[tuple[int, ...]],
                histories: Sequence[tuple[list[int], list[int]]] | None,
                drafts: Sequence[Sequence[int]]) -> Rows:
    """Per request: its params, output count n, the tokens banned while fewer than
    ``min_tokens`` are out, its (prompt, output) history (None: no row is penalized) and its
    drafts -> the rows of the step."""
    out = Rows([], [], [], [] if histories is not None else None)
    for i, (p, n, ban, d) in enumerate(zip(params, num_outputs, banned_until_min, drafts,
                                           strict=True)):
        for j in range(len(d) + 1):
            out.params.append(p)
            out.positions.append(n + j)  # a seeded row's uniform is its output position's
            out.banned.append(ban if n + j < p.min_tokens else ())
            if out.histories is not None:
                assert histories is not None
                prompt, output = histories[i]
                out.histories.append((prompt, [*output, *d[:j]] if j else output))
    return out


@dataclass
class SpecCounters:
    """Cumulative acceptance (``EngineStats``): verification rows with drafts, drafts,
    accepted drafts, and accepted drafts at each position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafts: Sequence[Sequence[int]], accepted: Sequence[Sequence[int]]
               ) -> None:
        for d, a in zip(drafts, accepted, strict=True):
            if not d:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += len(d)
            self.num_accepted_tokens += len(a)
            if len(self.accepted_per_pos) < len(d):
                self.accepted_per_pos.extend([0] * (len(d) - len(self.accepted_per_pos)))
            for j in range(len(a)):
                self.accepted_per_pos[j] += 1


def accept(out: SamplerOutput, drafts: Sequence[Sequence[int]]) -> SamplerOutput:
    """Rows -> one entry per request: drafts are accepted while the row before each drew
    it; the first row that drew something else (or the row after the last draft: the bonus
    token) gives the request's token. A failed row counts as a mismatch; the request fails
    if the row giving its token failed."""
    tokens: list[int] = []
    logprobs: list[dict[int, float] | None] = []
    errors: list[str | None] = []
    accepted: list[list[int]] = []
    accepted_lps: list[list[dict[int, float] | None]] = []
    r = 0
    for d in drafts:
        toks = out.token_ids[r:r + len(d) + 1]
        errs = out.errors[r:r + len(d) + 1]
        a = 0
        while a < len(d) and errs[a] is None and toks[a] == d[a]:
            a += 1
        tokens.append(toks[a])
        logprobs.append(out.logprobs[r + a])
        errors.append(errs[a])
        accepted.append(list(toks[:a]))
        accepted_lps.append(list(out.logprobs[r:r + a]))
        r += len(d) + 1
    if r != len(out.token_ids):
        raise ValueError(f"{len(out.token_ids)} sampled rows for {r} checked positions")
    return SamplerOutput(tokens, logprobs, errors, accepted, accepted_lps)
