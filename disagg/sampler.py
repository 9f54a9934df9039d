"""Token sampling: greedy, temperature, top-k, top-p; seeded draws that depend only on
(seed, output position).

A sampled token is ``inverse_cdf(filtered distribution, u)`` for one uniform ``u`` in [0, 1).
For a seeded request ``u = seeded_uniform(seed, position)``, where ``position`` is the index
of the token in the request's output (0 for the first generated token). So a seeded request's
tokens depend neither on its batch-mates nor on which worker draws them: a generation worker
that continues a context worker's first token (output position 1 onward) draws exactly what an
aggregated worker would. Unseeded requests take ``u`` from the engine's generator.

Numerically safe for every value ``SamplingParams`` accepts: temperatures below 1e-5 are greedy
(dividing by a sub-normal temperature overflows), ``top_p`` always keeps the most likely token,
NaN / +inf logits are sanitised, and a row whose distribution is still empty falls back to its
greedy token. A row that fails anyway fails alone (``SamplerOutput.errors``), not the batch.

Before the draw, the logits of penalized rows go through ``disagg.penalties`` (logit_bias,
repetition, frequency and presence penalties); ``min_p`` drops tokens whose probability (after
temperature and top-k) is below ``min_p`` times the top token's, before top-p.

Logprobs are those of the model's raw distribution (before penalties, temperature / top-k /
top-p), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from disagg.penalties import PenaltyPlan, TokenHistory, apply_penalties
from disagg.request import SamplingParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Reported instead of a non-finite logprob (a JSON body cannot carry -inf / NaN), as vLLM does.
MIN_LOGPROB = -9999.0
_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that draws output token ``position`` of a request seeded with
    ``seed``: a counter-based hash of the pair (no generator state), 53 random bits."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (z >> 11) * 2.0**-53


@dataclass(frozen=True)
class SamplerOutput:
    # Per row: the token, or -1 where ``errors`` has the row's failure.
    token_ids: list[int]
    # Per row: {token_id: logprob} with the top-n tokens in rank order, then the chosen token if
    # it was not among them; None for rows that did not ask for logprobs (or failed).
    logprobs: list[dict[int, float] | None]
    # Per row: None, or why sampling this row failed (only that request fails).
    errors: list[str | None]
    # Speculative decoding (``disagg.spec_decode.verify``), per request: the drafts accepted
    # before ``token_ids[i]`` and their logprob entries; None when no request had drafts.
    accepted: list[list[int]] | None = None
    accepted_logprobs: list[list[dict[int, float] | None]] | None = None


class Sampler:
    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        # The uniforms of unseeded requests (a CPU generator; None: torch's global one).
        self.default_generator = default_generator
        self._pinned = _PinnedSlots()  # sample_deferred's reads

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        banned_token_ids: Sequence[tuple[int, ...]] | None = None,
        histories: Sequence[TokenHistory] | None = None,
        forbidden: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Pick one token per row of ``logits`` ([S, V]).

        ``positions[i]``: the output index of the token row i samples (its request's number of
        generated tokens so far). ``banned_token_ids[i]`` are masked out for row i (EOS and
        stop tokens before ``min_tokens`` are reached). ``histories[i]``: row i's (prompt ids,
        output ids), read only for rows with penalties or biases (may be None when no row has
        them). ``forbidden``: bool [S, V] on the logits' device, True for tokens a row's
        grammar forbids (structured outputs; rows without one are all False); applied to the
        whole batch first. Never raises for a row's sake: a batch that fails is sampled again
        row by row, and the rows that still fail are reported in ``errors``.
        """
        n = len(params)
        if logits.dtype != torch.float32:
            logits = logits.float()
        if forbidden is not None:  # structured outputs: one masked fill for the whole batch
            logits = logits.masked_fill(forbidden, _NEG_INF)  # (an inference tensor: a copy)
        banned = list(banned_token_ids) if banned_token_ids else [()] * n
        hist = list(histories) if histories is not None else None
        try:
            tokens, logprobs = self._sample_rows(logits, list(params), list(positions), banned,
                                                 hist)
        except Exception:  # some row broke the batch: find it, fail only that request
            return self._row_by_row(logits, list(params), list(positions), banned, hist)
        return SamplerOutput(tokens, logprobs, [None] * n)

    def sample_deferred(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        banned_token_ids: Sequence[tuple[int, ...]] | None = None,
        histories: Sequence[TokenHistory] | None = None,
    ) -> Callable[[], SamplerOutput]:
        """``sample`` (no grammar masks) with the device -> host read left for later: the
        device work is queued now and its result is copied into pinned host memory behind it
        (an event marks the copy); the returned function waits for that event only, never
        for work queued after it (the next step's forward, under async scheduling), and
        unpacks. On CPU the result is read at once. A batch whose device work cannot be queued
        (a bad row) is sampled by ``sample`` now (row by row, rows failing alone)."""
        n = len(params)
        banned = list(banned_token_ids) if banned_token_ids else [()] * n
        hist = list(histories) if histories is not None else None
        x = logits if logits.dtype == torch.float32 else logits.float()
        try:
            out, plan = self._launch_rows(x, list(params), list(positions), banned, hist)
        except Exception:  # as sample(): find the row that broke the batch, now
            done = self.sample(logits, params, positions, banned_token_ids, histories)
            return lambda: done
        fetch = self._pinned.later(out)

        def finish() -> SamplerOutput:
            tokens, logprobs = _read_rows(fetch(), n, plan)
            return SamplerOutput(tokens, logprobs, [None] * n)
        return finish

    def _row_by_row(self, logits: torch.Tensor, params: list[SamplingParams],
                    positions: list[int], banned: list[tuple[int, ...]],
                    histories: list[TokenHistory] | None) -> SamplerOutput:
        n = len(params)
        tokens: list[int] = [-1] * n
        logprobs: list[dict[int, float] | None] = [None] * n
        errors: list[str | None] = [None] * n
        for i in range(n):  # a seeded row draws the same token again
            try:
                t, lp = self._sample_rows(logits[i:i + 1], [params[i]], [positions[i]],
                                          [banned[i]],
                                          histories[i:i + 1] if histories else None)
                tokens[i], logprobs[i] = t[0], lp[0]
            except Exception as e:
                errors[i] = f"sampling failed: {e!r}"
        return SamplerOutput(tokens, logprobs, errors)

    # -- one batch ---------------------------------------------------------------------------

    def _uniforms(self, params: list[SamplingParams], positions: list[int]) -> list[float]:
        """One uniform per row: (seed, position) for seeded rows, else the engine's
        generator (a CPU generator: no device work)."""
        unseeded = sum(p.seed is None for p in params)
        drawn = (torch.rand(unseeded, dtype=torch.float64, generator=self.default_generator)
                 .tolist() if unseeded else [])
        it = iter(drawn)
        return [seeded_uniform(p.seed, pos) if p.seed is not None else next(it)
                for p, pos in zip(params, positions, strict=True)]

    def _sample_rows(self, logits: torch.Tensor, params: list[SamplingParams],
                     positions: list[int], banned: list[tuple[int, ...]],
                     histories: list[TokenHistory] | None = None,
                     ) -> tuple[list[int], list[dict[int, float] | None]]:
        """The batch on the device (``_launch_rows``), read back in one ``tolist`` (the step's
        one host sync)."""
        out, plan = self._launch_rows(logits, params, positions, banned, histories)
        return _read_rows(out.tolist(), len(params), plan)

    def _launch_rows(self, logits: torch.Tensor, params: list[SamplingParams],
                     positions: list[int], banned: list[tuple[int, ...]],
                     histories: list[TokenHistory] | None
                     ) -> tuple[torch.Tensor, _RowPlan | None]:
        """Queue the batch's sampling on the device: every per-row value goes up in one copy
        (from pinned memory, non-blocking), no per-row device work, nothing read back. Returns
        the device tensor to read and how to unpack it (``_read_rows``): the chosen ids and
        no plan for an all-greedy batch without logprobs or bans (the usual decode batch: what
        the general path computes then, without its host-side bookkeeping), else
        ``_sample_on_device``'s flat tensor and its plan."""
        n = len(params)
        if logits.shape[0] != n or len(positions) != n or len(banned) != n:
            raise ValueError(f"{logits.shape[0]} logit rows for {n} params, "
                             f"{len(positions)} positions, {len(banned)} banned lists")
        pen = PenaltyPlan.of(params, histories, logits.shape[1])
        if not any(banned) and all(p.temperature < SAMPLING_EPS and p.logprobs is None
                                   for p in params):
            if pen is None and logits.device.type == "cpu":
                chosen = _greedy_cpu(logits)
                if chosen is not None:
                    return chosen, None
            x = torch.nan_to_num(logits, nan=_NEG_INF, posinf=torch.finfo(torch.float32).max)
            if pen is not None:
                x = apply_penalties(x, pen)
            return x.argmax(dim=-1), None
        plan = _RowPlan.of(params, banned, logits.shape[1])
        u = self._uniforms([params[i] for i in plan.s_rows], [positions[i] for i in plan.s_rows])
        return _sample_on_device(logits, plan, u, pen), plan


@dataclass(frozen=True)
class _RowPlan:
    """What each row of a batch asks for (host side, before any device work); row indices are
    rows of the batch unless said otherwise."""

    want_lp: list[int]  # rows that return logprobs
    s_rows: list[int]  # rows that sample (temperature >= SAMPLING_EPS)
    temps: list[float]  # per s_row
    ks: list[int]  # per s_row: top-k, 0 = off
    p_rows: list[int]  # indices into s_rows with top_p < 1
    top_p: list[float]  # per p_row
    min_p: list[float]  # per s_row; empty when no row uses min_p
    ban_rows: list[int]  # (row, token) pairs never to be chosen
    ban_cols: list[int]
    groups: dict[int, list[int]]  # top-n -> indices into want_lp (one topk per distinct n)

    @classmethod
    def of(cls, params: list[SamplingParams], banned: list[tuple[int, ...]], V: int
           ) -> _RowPlan:
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        s_rows = [i for i, p in enumerate(params) if p.temperature >= SAMPLING_EPS]
        s_params = [params[i] for i in s_rows]
        p_rows = [j for j, p in enumerate(s_params) if p.top_p < 1.0]
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for i, b in enumerate(banned):
            ids = [t for t in b if 0 <= t < V]  # a stop token id beyond the vocabulary
            ban_rows += [i] * len(ids)  # can never be sampled anyway
            ban_cols += ids
        groups: dict[int, list[int]] = {}
        for j, i in enumerate(want_lp):
            groups.setdefault(min(params[i].logprobs or 0, V), []).append(j)
        groups.pop(0, None)
        min_p = [p.min_p for p in s_params] if any(p.min_p > 0 for p in s_params) else []
        return cls(want_lp, s_rows, [p.temperature for p in s_params],
                   [p.top_k if 0 < p.top_k < V else 0 for p in s_params], p_rows,
                   [s_params[j].top_p for j in p_rows], min_p, ban_rows, ban_cols, groups)


def _sample_on_device(logits: torch.Tensor, plan: _RowPlan, u: list[float],
                      pen: PenaltyPlan | None = None) -> torch.Tensor:
    """Tokens, then (when rows want logprobs) the chosen tokens' logprobs and each logprob
    group's top-n ids and values, flattened into one float64 device tensor (read back by one
    ``tolist``)."""
    dev = logits.device
    # One float64 upload (integers below 2^53 are exact), laid out as
    #   s_rows | temps | top-k | top_p (p_rows) | p_rows | min_p | u | want_lp | ban rows
    #   | ban cols | rows of each logprob group
    parts: list[list[float] | list[int]] = [
        plan.s_rows, plan.temps, plan.ks, plan.top_p, plan.p_rows, plan.min_p, u,
        plan.want_lp, plan.ban_rows, plan.ban_cols, *plan.groups.values()]
    up = _upload([x for part in parts for x in part], dev)
    (s_idx, temps, ks_t, top_p, p_idx, min_p, u_t, lp_idx, ban_r, ban_c,
     *group_idx) = up.split([len(part) for part in parts])
    # NaN never wins, +inf is the largest finite value: argmax and softmax stay defined.
    x = torch.nan_to_num(logits, nan=_NEG_INF, posinf=torch.finfo(torch.float32).max)
    raw_lp = None
    if plan.want_lp:
        raw_lp = torch.log_softmax(x.index_select(0, lp_idx.long()), dim=-1)
        raw_lp = raw_lp.nan_to_num(nan=MIN_LOGPROB, neginf=MIN_LOGPROB, posinf=0.0)
    if pen is not None:  # after the raw logprobs: those are the model's
        x = apply_penalties(x, pen)
    if plan.ban_rows:
        # (a device fill: torch.tensor(-inf, device=cuda) would be a blocking copy)
        x.index_put_((ban_r.long(), ban_c.long()),
                     torch.full((), _NEG_INF, dtype=x.dtype, device=dev))
    chosen = x.argmax(dim=-1)
    if plan.s_rows:
        s_long = s_idx.long()
        drawn = _draw(x.index_select(0, s_long), temps.float(), ks_t.long(), max(plan.ks),
                      top_p, p_idx.long() if plan.p_rows else None, u_t,
                      min_p if plan.min_p else None)
        chosen = chosen.index_copy(0, s_long, drawn)
    down = [chosen.double()]
    if raw_lp is not None:
        lp_long = lp_idx.long()
        down.append(raw_lp.gather(1, chosen.index_select(0, lp_long).unsqueeze(1))
                    .squeeze(1).double())
        for k, gi in zip(plan.groups, group_idx, strict=True):
            top = torch.topk(raw_lp.index_select(0, gi.long()), k, dim=-1)
            down += [top.indices.flatten().double(), top.values.flatten().double()]
    return torch.cat(down)


class _PinnedSlots:
    """Reused pinned host buffers and CUDA events for deferred reads (``sample_deferred``):
    a step's tokens are copied into a slot behind an event, read later; a slot is reused
    only once its read is done (else a fresh one is made), so no step allocates pinned memory
    or an event in the steady state."""

    def __init__(self, num: int = 2) -> None:
        self._slots: list[list[Any]] = [[None, None, False] for _ in range(num)]  # buf, event, busy
        self._next = 0

    def later(self, t: torch.Tensor) -> Callable[[], list]:
        """A function returning ``t.tolist()`` that, on CUDA, waits only for a copy into
        pinned host memory queued now (an event after it), not for what the stream runs
        later."""
        if t.device.type != "cuda":
            values = t.tolist()
            return lambda: values
        nbytes = t.numel() * t.element_size()
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot[2]:  # still unread: never overwrite it
            slot = [None, None, False]
        if slot[0] is None or slot[0].numel() < nbytes:
            slot[0] = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
        if slot[1] is None:
            slot[1] = torch.cuda.Event()
        host = slot[0][:nbytes].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        slot[1].record()
        slot[2] = True

        def fetch() -> list:
            slot[1].synchronize()
            values = host.tolist()
            slot[2] = False
            return values
        return fetch


def _greedy_cpu(logits: torch.Tensor) -> torch.Tensor | None:
    """The greedy ids of float32 CPU logits ``[S, V]`` without sanitising a copy of them
    first: numpy's argmax (vectorised; torch's CPU argmax is an order of magnitude slower over
    a vocabulary), then a check that every row's winner is finite. A NaN or +inf in a row
    would have won (both argmaxes take NaN as the largest, and the first of equals), so a
    finite winner is the sanitised row's winner too; otherwise None: the caller sanitises."""
    a = logits.detach().numpy()
    idx = a.argmax(axis=-1)
    if not np.isfinite(a[np.arange(a.shape[0]), idx]).all():
        return None
    return torch.from_numpy(idx)


def _read_rows(values: list, n: int, plan: _RowPlan | None
               ) -> tuple[list[int], list[dict[int, float] | None]]:
    """What ``Sampler._launch_rows`` queued, read back: the ids of an all-greedy batch (no
    plan), else ``_unpack`` of the flat list."""
    if plan is None:
        return [int(t) for t in values], [None] * n
    return _unpack(values, n, plan)


def _unpack(flat: list[float], n: int, plan: _RowPlan
            ) -> tuple[list[int], list[dict[int, float] | None]]:
    """``_sample_on_device``'s list back into tokens and per-row logprob dicts; ``flat`` is
    laid out as
      [0, n)          tokens
      [n, n + L)      the chosen tokens' logprobs (L = len(want_lp))
      then per group of top-n k with r rows: r*k ids, then r*k values."""
    tokens = [int(t) for t in flat[:n]]
    logprobs: list[dict[int, float] | None] = [None] * n
    if not plan.want_lp:
        return tokens, logprobs
    L = len(plan.want_lp)
    chosen_lp = flat[n:n + L]
    top_of: dict[int, tuple[list[float], list[float]]] = {}
    at = n + L
    for k, rows in plan.groups.items():
        cnt = len(rows) * k
        ids, vals = flat[at:at + cnt], flat[at + cnt:at + 2 * cnt]
        at += 2 * cnt
        for r, j in enumerate(rows):
            top_of[j] = (ids[r * k:(r + 1) * k], vals[r * k:(r + 1) * k])
    for j, i in enumerate(plan.want_lp):
        entry: dict[int, float] = {}
        if j in top_of:
            ids, vals = top_of[j]
            entry = {int(t): v for t, v in zip(ids, vals, strict=True)}
        if tokens[i] not in entry:
            entry[tokens[i]] = chosen_lp[j]
        logprobs[i] = entry
    return tokens, logprobs


def _upload(values: list[float] | list[int], device: torch.device) -> torch.Tensor:
    """``values`` as a float64 tensor on ``device``: on CUDA from pinned memory, non-blocking
    (the caching host allocator keeps the block until the copy has read it)."""
    if not values:
        return torch.empty(0, dtype=torch.float64, device=device)
    host = torch.tensor(values, dtype=torch.float64)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _draw(x: torch.Tensor, temps: torch.Tensor, ks: torch.Tensor, kmax: int,
          top_p: torch.Tensor, p_idx: torch.Tensor | None, u: torch.Tensor,
          min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token per row of sanitised logits ``x`` [R, V] (finite or -inf) with the
    rows' temperature ``temps`` [R] (float32), top-k ``ks`` [R] (0: off; ``kmax`` their max)
    and top-p (``top_p`` [P] float64 for rows ``p_idx`` [P]; None: no row uses it) and min-p
    (``min_p`` [R] float64; None: no row uses it), by inverse
    CDF at ``u`` [R] (float64) over the filtered distribution in vocabulary order (so ties never
    depend on a sort). Device tensors only, no host sync."""
    # Greedy choice of each row: the answer when its filtered distribution is empty.
    fallback = x.argmax(dim=-1)
    # Shift so the largest logit is 0 before dividing: (x - max) / t is <= 0 (or -inf), it
    # cannot overflow to +inf or NaN, and exp() of the top entry is 1.
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = (x - m) / temps.unsqueeze(1)

    if kmax > 0:
        # Keep values >= the k-th largest (ties at the boundary stay).
        top = torch.topk(z, kmax, dim=-1).values  # [R, kmax], descending
        kth = top.gather(1, (ks - 1).clamp(min=0).unsqueeze(1))
        on = (ks > 0).unsqueeze(1)
        z = z.masked_fill(on & (z < kth), _NEG_INF)
    probs = torch.softmax(z, dim=-1)
    if min_p is not None:
        # The top token has probability max; keep those >= min_p * max (the top one always),
        # renormalised so that top-p below sees a distribution.
        floor = min_p.float().unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if p_idx is not None:
        sub = probs.index_select(0, p_idx)
        floor = _top_p_floor(sub, top_p, full_sort=sub.device.type != "cpu")
        probs.index_copy_(0, p_idx, sub.masked_fill(sub < floor.unsqueeze(1), 0.0))
    return _inverse_cdf(probs, u, fallback)


def _top_p_floor(probs: torch.Tensor, top_p: torch.Tensor, full_sort: bool = False
                 ) -> torch.Tensor:
    """Per row, the smallest probability of the nucleus: the shortest run of the most likely
    tokens whose mass reaches ``top_p`` (always at least the top token). Tokens below it are
    dropped; tokens tied with it stay. Looks at the top 128 first and widens only for rows
    whose nucleus is larger (a flat distribution), up to a full sort. ``full_sort``: one sort
    of every row instead (the same floor: the run's prefix sums are those of the sorted row;
    no data-dependent shapes, so no host sync on a GPU)."""
    R, V = probs.shape
    if full_sort:
        vals = torch.sort(probs, dim=-1, descending=True).values
        v64 = vals.double()
        before = torch.cumsum(v64, dim=-1) - v64
        keep = (before < top_p.unsqueeze(1)).sum(dim=-1).clamp_(min=1)
        return vals.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
    floor = torch.empty(R, dtype=probs.dtype, device=probs.device)
    rows = torch.arange(R, device=probs.device)
    k = min(V, 128)
    while rows.numel():
        sub = probs[rows]
        vals = (torch.topk(sub, k, dim=-1).values if k < V
                else torch.sort(sub, dim=-1, descending=True).values)
        v64 = vals.double()
        before = torch.cumsum(v64, dim=-1) - v64  # mass of the tokens ranked above
        # Compared in float64: top_p = 1e-300 is 0 in float32 and would keep nothing.
        keep = (before < top_p[rows].unsqueeze(1)).sum(dim=-1).clamp_(min=1)
        done = (keep < k) | (k == V)  # the run ends inside the top k
        floor[rows[done]] = vals.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)[done]
        rows = rows[~done]
        k = min(V, k * 16)
    return floor


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor,
                 chunk: int = 256) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds ``u`` times the row's mass
    (probs [R, V] >= 0, unnormalised), in float64; ``fallback`` where the mass is 0 or not
    finite. Two levels (chunk sums, then one chunk) so that no float64 cumsum runs over V."""
    R, V = probs.shape
    nc = -(-V // chunk)
    if nc * chunk != V:  # pad with zero mass: never chosen
        probs = torch.nn.functional.pad(probs, (0, nc * chunk - V))
    chunks = probs.view(R, nc, chunk)
    csum = chunks.sum(dim=-1, dtype=torch.float64)  # [R, nc]
    ccdf = torch.cumsum(csum, dim=-1)
    total = ccdf[:, -1]
    ok = torch.isfinite(total) & (total > 0)
    # target < total strictly, so the chunk found has positive mass (the cdf rises there).
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    c = torch.searchsorted(ccdf, target.unsqueeze(1), right=True).clamp_(max=nc - 1)
    rest = target.unsqueeze(1) - (ccdf.gather(1, c) - csum.gather(1, c))  # mass into chunk c
    inner = torch.cumsum(chunks[torch.arange(R, device=probs.device), c.squeeze(1)].double(),
                         dim=-1)  # [R, chunk]
    # Rounding may put ``rest`` just outside the chunk's own sum: clamp inside it, where the
    # index found still has positive mass.
    rest = torch.minimum(rest.clamp(min=0.0),
                         torch.nextafter(inner[:, -1:], torch.zeros_like(inner[:, -1:])))
    j = torch.searchsorted(inner, rest, right=True).clamp_(max=chunk - 1)
    idx = (c * chunk + j).squeeze(1)
    return torch.where(ok, idx, fallback)


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], tops: Sequence[int]
                    ) -> tuple[list[dict[int, float]], list[int]]:
    """Scoring: per row of ``logits`` [P, V] (the logits at a prompt position), the logprob of
    ``targets[i]`` (the prompt's next token) and the ``tops[i]`` most likely tokens', from the
    model's raw distribution (as the sampler's logprobs), and the target's rank (1: the most
    likely; 1 + the number of tokens more likely, as vLLM counts). One device -> host read."""
    P = logits.shape[0]
    if len(targets) != P or len(tops) != P:
        raise ValueError(f"{P} logit rows for {len(targets)} targets, {len(tops)} top counts")
    if P == 0:
        return [], []
    x = torch.nan_to_num(logits.float(), nan=_NEG_INF, posinf=torch.finfo(torch.float32).max)
    lp = torch.log_softmax(x, dim=-1).nan_to_num(nan=MIN_LOGPROB, neginf=MIN_LOGPROB,
                                                 posinf=0.0)
    tgt = torch.tensor(list(targets), dtype=torch.long).to(lp.device)
    chosen = lp.gather(1, tgt.unsqueeze(1))
    rank = (lp > chosen).sum(dim=-1) + 1
    down = [chosen.squeeze(1).double(), rank.double()]
    k = min(max(tops), lp.shape[1])
    if k > 0:  # one topk at the largest n; rows asking fewer take a prefix
        top = torch.topk(lp, k, dim=-1)
        down += [top.indices.flatten().double(), top.values.flatten().double()]
    flat = torch.cat(down).tolist()
    out = []
    for i, t in enumerate(targets):
        entry: dict[int, float] = {}
        n = min(tops[i], k)
        # flat: [0, P) target logprobs, [P, 2P) ranks, then P*k top ids, then P*k values
        if n:
            ids = flat[2 * P + i * k:2 * P + i * k + n]
            vals = flat[2 * P + P * k + i * k:2 * P + P * k + i * k + n]
            entry = {int(a): b for a, b in zip(ids, vals, strict=True)}
        entry[int(t)] = flat[i]
        out.append(entry)
    return out, [int(r) for r in flat[P:2 * P]]
