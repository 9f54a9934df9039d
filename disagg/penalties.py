"""Logits processing before sampling: ``logit_bias``, then the repetition penalty, then the
frequency and presence penalties, in vLLM's order, vectorized over the batch.

For a row with history (prompt ids P, output ids O) and logits ``x`` [V]:

    x[t] += bias[t]                                   for every (t, bias) in logit_bias
    x[t] = x[t] / r if x[t] > 0 else x[t] * r         for every t in P or O   (transformers)
    x[t] -= frequency * count_O(t) + presence * (count_O(t) > 0)             (OpenAI)

Only the rows that use one of them take part (``PenaltyPlan.rows``); the others cost nothing.
The work is proportional to the histories' lengths, not to rows x vocabulary: the ids of those
rows are concatenated on the host into one id tensor (no per-row device work), and the counts
are a scatter-add over it (``index_put_(accumulate=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.request import SamplingParams

# (prompt token ids, output token ids) of one row; only read for penalized rows.
TokenHistory = tuple[Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class PenaltyPlan:
    """What the penalized rows of a batch ask for, host side; indices are batch rows."""

    rows: list[int]  # the penalized rows
    rep: list[float]  # per penalized row (1.0: off)
    freq: list[float]
    pres: list[float]
    out_ids: list[int]  # output ids of the rows that use frequency / presence, concatenated
    out_lens: list[int]  # per penalized row (0 for rows without those penalties)
    seen_ids: list[int]  # prompt + output ids of the rows with a repetition penalty
    seen_lens: list[int]  # per penalized row (0 without a repetition penalty)
    bias_rows: list[int]  # indices into ``rows``
    bias_ids: list[int]
    bias_vals: list[float]

    @classmethod
    def of(cls, params: Sequence[SamplingParams], histories: Sequence[TokenHistory] | None,
           V: int) -> PenaltyPlan | None:
        """None when no row is penalized (the usual batch). Ids outside [0, V) are skipped
        (the engine refuses them in logit_bias; a history holds model outputs only)."""
        rows = [i for i, p in enumerate(params) if p.penalized]
        if not rows:
            return None
        if histories is None or len(histories) != len(params):
            raise ValueError("penalized rows need their token histories")
        plan = cls(rows, [], [], [], [], [], [], [], [], [], [])
        for j, i in enumerate(rows):
            p = params[i]
            prompt, out = histories[i]
            plan.rep.append(p.repetition_penalty)
            plan.freq.append(p.frequency_penalty)
            plan.pres.append(p.presence_penalty)
            counted = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            plan.out_ids.extend(out if counted else ())
            plan.out_lens.append(len(out) if counted else 0)
            seen = p.repetition_penalty != 1.0
            if seen:
                plan.seen_ids.extend(prompt)
                plan.seen_ids.extend(out)
            plan.seen_lens.append(len(prompt) + len(out) if seen else 0)
            for t, b in p.logit_bias:
                if 0 <= t < V:
                    plan.bias_rows.append(j)
                    plan.bias_ids.append(t)
                    plan.bias_vals.append(b)
        return plan


def apply_penalties(x: torch.Tensor, plan: PenaltyPlan) -> torch.Tensor:
    """``x`` [S, V] float32 (finite or -inf) with the plan's rows processed (in place when
    ``x`` is contiguous; use the returned tensor).

    Sparse: the work is over the (row, id) pairs of the histories, addressed in the flat view
    of ``x``, never a dense [R, V] count table. A rule that sets a value per distinct pair
    (repetition, presence) gathers the logits there and writes the new values back (a pair
    listed twice writes the same value twice); the frequency penalty is added once per
    occurrence (a scatter-add)."""
    dev = x.device
    parts: list[list[float] | list[int]] = [
        plan.rows, plan.rep, plan.freq, plan.pres, plan.out_lens, plan.seen_lens,
        plan.bias_rows, plan.bias_ids, plan.bias_vals]
    up = _to(torch.tensor([v for part in parts for v in part], dtype=torch.float64), dev)
    rows, rep, freq, pres, out_lens, seen_lens, b_rows, b_ids, b_vals = up.split(
        [len(p) for p in parts])
    ids = _to(torch.tensor(plan.out_ids + plan.seen_ids, dtype=torch.long), dev)
    out_ids, seen_ids = ids.split([len(plan.out_ids), len(plan.seen_ids)])
    rows_l = rows.long()
    x = x.contiguous()
    flat = x.view(-1)  # element (r, t) is flat[r * V + t]
    V = x.shape[1]
    if plan.bias_rows:
        flat.index_add_(0, rows_l[b_rows.long()] * V + b_ids.long(), b_vals.float())
    if plan.seen_ids:
        local = _local_rows(seen_lens, seen_ids)
        at = rows_l[local] * V + seen_ids
        v = flat.index_select(0, at)
        r = rep.float()[local]
        flat.index_copy_(0, at, torch.where(v > 0, v / r, v * r))
    if plan.out_ids:
        local = _local_rows(out_lens, out_ids)
        at = rows_l[local] * V + out_ids
        flat.index_copy_(0, at, flat.index_select(0, at) - pres.float()[local])
        flat.index_add_(0, at, -freq.float()[local])
    return x


def _local_rows(lens: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each id's index into the plan's rows: row j owns the ``lens[j]`` ids after those of
    rows < j."""
    return torch.repeat_interleave(torch.arange(lens.numel(), device=ids.device), lens.long(),
                                   output_size=ids.numel())


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Non-blocking from pinned memory on CUDA (no host sync), as the sampler uploads.
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
