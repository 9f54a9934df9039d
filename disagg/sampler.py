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

Logprobs are those of the model's raw distribution (before temperature / top-k / top-p), as
vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


class Sampler:
    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        # The uniforms of unseeded requests (a CPU generator; None: torch's global one).
        self.default_generator = default_generator

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        banned_token_ids: Sequence[tuple[int, ...]] | None = None,
    ) -> SamplerOutput:
        """Pick one token per row of ``logits`` ([S, V]).

        ``positions[i]``: the output index of the token row i samples (its request's number of
        generated tokens so far). ``banned_token_ids[i]`` are masked out for row i (EOS and
        stop tokens before ``min_tokens`` are reached). Never raises for a row's sake: a batch
        that fails is sampled again row by row, and the rows that still fail are reported in
        ``errors``.
        """
        n = len(params)
        if logits.dtype != torch.float32:
            logits = logits.float()
        banned = list(banned_token_ids) if banned_token_ids else [()] * n
        try:
            tokens, logprobs = self._sample_rows(logits, list(params), list(positions), banned)
        except Exception:  # some row broke the batch: find it, fail only that request
            return self._row_by_row(logits, list(params), list(positions), banned)
        return SamplerOutput(tokens, logprobs, [None] * n)

    def _row_by_row(self, logits: torch.Tensor, params: list[SamplingParams],
                    positions: list[int], banned: list[tuple[int, ...]]) -> SamplerOutput:
        n = len(params)
        tokens: list[int] = [-1] * n
        logprobs: list[dict[int, float] | None] = [None] * n
        errors: list[str | None] = [None] * n
        for i in range(n):  # a seeded row draws the same token again
            try:
                t, lp = self._sample_rows(logits[i:i + 1], [params[i]], [positions[i]],
                                          [banned[i]])
                tokens[i], logprobs[i] = t[0], lp[0]
            except Exception as e:
                errors[i] = f"sampling failed: {e!r}"
        return SamplerOutput(tokens, logprobs, errors)

    # -- one batch ---------------------------------------------------------------------------

    def _uniforms(self, params: list[SamplingParams], positions: list[int],
                  device: torch.device) -> torch.Tensor:
        """One uniform per row: (seed, position) for seeded rows, else the engine's
        generator."""
        unseeded = sum(p.seed is None for p in params)
        drawn = (torch.rand(unseeded, dtype=torch.float64, generator=self.default_generator)
                 .tolist() if unseeded else [])
        it = iter(drawn)
        u = [seeded_uniform(p.seed, pos) if p.seed is not None else next(it)
             for p, pos in zip(params, positions, strict=True)]
        return torch.tensor(u, dtype=torch.float64, device=device)

    def _sample_rows(self, logits: torch.Tensor, params: list[SamplingParams],
                     positions: list[int], banned: list[tuple[int, ...]]
                     ) -> tuple[list[int], list[dict[int, float] | None]]:
        n = len(params)
        if logits.shape[0] != n or len(positions) != n or len(banned) != n:
            raise ValueError(f"{logits.shape[0]} logit rows for {n} params, "
                             f"{len(positions)} positions, {len(banned)} banned lists")
        # NaN never wins, +inf is the largest finite value: argmax and softmax stay defined.
        x = torch.nan_to_num(logits, nan=_NEG_INF, posinf=torch.finfo(torch.float32).max)
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_lp = torch.log_softmax(x[want_lp], dim=-1) if want_lp else None
        if any(banned):
            V = x.shape[1]
            for i, b in enumerate(banned):
                ids = [t for t in b if 0 <= t < V]  # a stop token id beyond the vocabulary
                if ids:  # can never be sampled anyway
                    x[i, ids] = _NEG_INF

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        if all(greedy):
            chosen = x.argmax(dim=-1).tolist()
        else:
            chosen = [0] * n
            g_rows = [i for i in range(n) if greedy[i]]
            if g_rows:
                for i, t in zip(g_rows, x[g_rows].argmax(dim=-1).tolist(), strict=True):
                    chosen[i] = t
            s_rows = [i for i in range(n) if not greedy[i]]
            s_params = [params[i] for i in s_rows]
            u = self._uniforms(s_params, [positions[i] for i in s_rows], x.device)
            for i, t in zip(s_rows, _draw(x[s_rows], s_params, u), strict=True):
                chosen[i] = t

        logprobs: list[dict[int, float] | None] = [None] * n
        if raw_lp is not None:
            raw_lp = raw_lp.nan_to_num(nan=MIN_LOGPROB, neginf=MIN_LOGPROB, posinf=0.0)
            for row, i in enumerate(want_lp):
                k = params[i].logprobs or 0
                lp = raw_lp[row]
                entry: dict[int, float] = {}
                if k > 0:
                    top = torch.topk(lp, min(k, lp.numel()))
                    entry = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                if chosen[i] not in entry:
                    entry[chosen[i]] = float(lp[chosen[i]])
                logprobs[i] = entry
        return chosen, logprobs


def _draw(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> list[int]:
    """Sample one token per row of sanitised logits ``x`` [R, V] (finite or -inf) with the
    rows' temperature, top-k and top-p, by inverse CDF at ``u`` [R] (float64) over the
    filtered distribution in vocabulary order (so ties never depend on a sort)."""
    V = x.shape[1]
    dev = x.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    # Greedy choice of each row: the answer when its filtered distribution is empty.
    fallback = x.argmax(dim=-1)
    # Shift so the largest logit is 0 before dividing: (x - max) / t is <= 0 (or -inf), it
    # cannot overflow to +inf or NaN, and exp() of the top entry is 1.
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = (x - m) / temps.unsqueeze(1)

    ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(ks):
        # Keep values >= the k-th largest (ties at the boundary stay).
        top = torch.topk(z, max(ks), dim=-1).values  # [R, kmax], descending
        kth = top.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks], device=dev))
        on = torch.tensor([[k > 0] for k in ks], device=dev)
        z = z.masked_fill(on & (z < kth), _NEG_INF)
    probs = torch.softmax(z, dim=-1)

    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        idx = torch.tensor(p_rows, device=dev)
        sub = probs[idx]
        top_p = torch.tensor([params[i].top_p for i in p_rows], dtype=torch.float64,
                             device=dev)
        floor = _top_p_floor(sub, top_p)
        probs[idx] = sub.masked_fill(sub < floor.unsqueeze(1), 0.0)
    return _inverse_cdf(probs, u, fallback).tolist()


def _top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability of the nucleus: the shortest run of the most likely
    tokens whose mass reaches ``top_p`` (always at least the top token). Tokens below it are
    dropped; tokens tied with it stay. Looks at the top 128 first and widens only for rows
    whose nucleus is larger (a flat distribution), up to a full sort."""
    R, V = probs.shape
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
