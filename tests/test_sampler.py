"""Sampler: numerically safe for every value SamplingParams accepts, seeded draws that depend
only on (seed, output position), and a failing row that fails only its own request."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg.request import SamplingParams
from disagg.sampler import SAMPLING_EPS, Sampler, seeded_uniform

V = 37
TINY = [5e-324, 1e-320, 1e-310, 1e-45, 1e-39, 1e-38, 1e-30, 1e-6, 9.99e-6, 1e-5, 1.0001e-5]

temperatures = st.one_of(st.sampled_from([0.0, *TINY, 100.0]),
                         st.floats(min_value=0.0, max_value=100.0))
top_ps = st.one_of(st.sampled_from([1e-300, 5e-324, 1e-45, 1e-8, 0.5, 1.0]),
                   st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
top_ks = st.one_of(st.sampled_from([-1, 0, 1, 2, V - 1, V, V + 5]),
                   st.integers(min_value=-1, max_value=2 * V))
seeds = st.one_of(st.none(), st.integers(min_value=-(2**70), max_value=2**70))
SPECIAL = [float("-inf"), float("inf"), float("nan"), 3.4e38, -3.4e38, 1e30, -1e30, 0.0, 1e-40]
params_st = st.builds(SamplingParams, temperature=temperatures, top_p=top_ps, top_k=top_ks,
                      seed=seeds, logprobs=st.one_of(st.none(), st.integers(0, 20)),
                      max_tokens=st.just(16))


@st.composite
def logit_row(draw: st.DrawFn) -> torch.Tensor:
    """Random logits at some scale, a whole row of one special value, or both: with huge,
    -inf, +inf and NaN entries at chosen places."""
    fill = draw(st.sampled_from([None, None, *SPECIAL]))
    if fill is None:
        scale = draw(st.sampled_from([0.0, 1.0, 30.0, 1e20, 1e38]))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        row = (torch.randn(V, generator=g, dtype=torch.float64) * scale).float()
    else:
        row = torch.full((V,), fill)
    for i, v in draw(st.lists(st.tuples(st.integers(0, V - 1), st.sampled_from(SPECIAL)),
                              max_size=6)):
        row[i] = v
    return row


@st.composite
def rows(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingParams], list[int],
                                   list[tuple[int, ...]]]:
    n = draw(st.integers(min_value=1, max_value=6))
    logits = torch.stack([draw(logit_row()) for _ in range(n)])
    params = [draw(params_st) for _ in range(n)]
    positions = [draw(st.integers(min_value=0, max_value=10_000)) for _ in range(n)]
    ban = st.one_of(st.lists(st.integers(0, V + 10**9), max_size=6, unique=True).map(tuple),
                    st.just(tuple(range(V))))  # everything banned: still a valid id
    banned = [draw(ban) for _ in range(n)]
    return logits, params, positions, banned


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows())
def test_sampler_never_raises_and_returns_valid_ids(case) -> None:
    logits, params, positions, banned = case
    out = Sampler(torch.Generator().manual_seed(0)).sample(logits, params, positions, banned)
    assert out.errors == [None] * len(params)
    for i, (tok, p) in enumerate(zip(out.token_ids, params, strict=True)):
        assert 0 <= tok < V
        row = logits[i].nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
        allowed = row.clone()
        allowed[[t for t in banned[i] if t < V]] = float("-inf")
        if torch.isfinite(allowed).any():
            # Never a banned, NaN or -inf token while a real candidate exists.
            assert math.isfinite(float(allowed[tok])), (i, tok)
        if p.temperature < SAMPLING_EPS:
            assert tok == int(allowed.argmax())  # sub-normal temperatures are greedy
        elif 0 < p.top_k < V and torch.isfinite(allowed).any():
            # Within the top k (ties at the boundary included).
            assert allowed[tok] >= torch.topk(allowed, p.top_k).values[-1]
        if p.top_p <= 1e-8 and p.temperature >= SAMPLING_EPS and torch.isfinite(allowed).any():
            # A vanishing nucleus is the most likely token (or one tied with it).
            probs = torch.softmax((allowed - allowed.max()) / p.temperature, dim=-1)
            assert probs[tok] == probs.max()
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
        else:
            assert lp is not None and tok in lp
            assert all(math.isfinite(v) for v in lp.values())  # JSON-safe


def test_seeded_draw_depends_on_seed_and_position_only() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 500, generator=g) * 2
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    mates = [SamplingParams(temperature=1.5), SamplingParams(temperature=0),
             SamplingParams(temperature=0.7, top_k=5, seed=1)]
    alone = [Sampler().sample(logits[:1], [p], [pos]).token_ids[0] for pos in range(40)]
    s = Sampler(torch.Generator().manual_seed(123))
    batched = [s.sample(logits, [p, *mates], [pos, 3, 9, pos + 1]).token_ids[0]
               for pos in range(40)]
    assert batched == alone
    assert len(set(alone)) > 3  # positions draw differently
    # Pure function of (seed, position); distinct for neighbouring pairs.
    assert seeded_uniform(42, 3) == seeded_uniform(42, 3)
    us = {seeded_uniform(s, pos) for s in range(20) for pos in range(20)}
    assert len(us) == 400 and all(0.0 <= u < 1.0 for u in us)


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).log_softmax(-1)
    probs = logits.softmax(-1)[0]
    s = Sampler(torch.Generator().manual_seed(0))
    n = 3000
    many = logits.expand(n, -1)  # one row per output position, one call

    def draws(p: SamplingParams) -> list[int]:
        return s.sample(many, [p] * n, list(range(n))).token_ids

    plain = draws(SamplingParams(seed=7))
    for t in range(5):
        assert abs(plain.count(t) / n - float(probs[t])) < 0.03, t
    # top_p 0.7: the nucleus is {0, 1} (0.64 before token 1 < 0.7), renormalised.
    nuc = draws(SamplingParams(seed=7, top_p=0.7))
    assert set(nuc) == {0, 1}
    assert abs(nuc.count(0) / n - float(probs[0] / (probs[0] + probs[1]))) < 0.03
    # top_k 3 at a high temperature: only the three largest, never the -inf one.
    assert set(draws(SamplingParams(seed=3, top_k=3, temperature=50.0))) == {0, 1, 2}

def test_a_failing_row_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Sampler(torch.Generator().manual_seed(0))
    real = Sampler._sample_rows

    def broken(self, logits, params, positions, banned, histories):  # type: ignore[no-untyped-def]
        if any(p.seed == 13 for p in params):
            raise RuntimeError("injected")
        return real(self, logits, params, positions, banned, histories)

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=13),
              SamplingParams(temperature=1.0, seed=5)]
    want = Sampler().sample(logits[::2], params[::2], [0, 4]).token_ids
    monkeypatch.setattr(Sampler, "_sample_rows", broken)
    out = s.sample(logits, params, [0, 0, 4])
    assert out.errors[0] is None and out.errors[2] is None
    assert out.errors[1] is not None and "injected" in out.errors[1]
    assert [out.token_ids[0], out.token_ids[2]] == want


def test_top_p_floor_full_sort_matches_the_widening_search() -> None:
    """The GPU path (one full sort, no data-dependent shapes) finds the same nucleus floor as
    the CPU path (top 128, widened only for flat rows)."""
    from disagg.sampler import _top_p_floor

    g = torch.Generator().manual_seed(3)
    V = 3000
    logits = torch.randn(6, V, generator=g, dtype=torch.float64).float()
    logits[1] *= 0.01  # nearly flat: the nucleus runs past the first 128 tokens
    logits[2] = 0.0  # flat: every token tied
    logits[3, 5:] = float("-inf")  # five candidates only
    probs = torch.softmax(logits * torch.tensor([[3.0]] * 6), dim=-1)
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.999, 1e-300, 0.3], dtype=torch.float64)
    loop = _top_p_floor(probs.clone(), top_p)
    full = _top_p_floor(probs.clone(), top_p, full_sort=True)
    assert torch.equal(loop, full)


def test_one_device_to_host_read_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens, chosen logprobs and every row's top-n come back in a single ``tolist`` (seeded
    rows: no generator draw), whatever mix of greedy / sampled / logprob rows."""
    calls = []
    real = torch.Tensor.tolist

    def counting(self):  # type: ignore[no-untyped-def]
        calls.append(tuple(self.shape))
        return real(self)

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5, top_k=7, seed=2, logprobs=0),
              SamplingParams(temperature=0.5, seed=3, logprobs=5),
              SamplingParams(temperature=0, logprobs=3)]
    want = Sampler().sample(logits, params, [0, 1, 2, 3, 4], [(), (4,), (), (), (1, 2)])
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    got = Sampler().sample(logits, params, [0, 1, 2, 3, 4], [(), (4,), (), (), (1, 2)])
    assert len(calls) == 1
    assert got == want
    assert got.logprobs[1] is None and list(got.logprobs[2]) == [got.token_ids[2]]
    assert len(got.logprobs[0]) == 3 and got.token_ids[0] in got.logprobs[0]  # greedy: top 1
    assert 5 <= len(got.logprobs[3]) <= 6 and got.token_ids[3] in got.logprobs[3]


def test_greedy_batch_is_the_sanitised_argmax() -> None:
    """An all-greedy batch (no penalties, bans or logprobs) takes the argmax of the logits as
    they are on CPU; a row whose winner is NaN or +inf decides on the sanitised logits (NaN
    never wins, +inf is the largest finite value, the first of equals wins)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g)
    logits[1, 4] = float("nan")
    logits[2, [5, 9]] = float("inf")
    logits[3] = float("-inf")
    logits[4, 7] = float("nan")
    logits[4, 8] = float("inf")
    logits[5, :] = 1.0  # ties: the first
    want = logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    params = [SamplingParams(temperature=0)] * 6
    for rows in ([0], [0, 5], [0, 1], list(range(6))):  # clean batches and mixed ones
        out = Sampler().sample(logits[rows], [params[i] for i in rows], [0] * len(rows))
        assert out.token_ids == want[rows].argmax(dim=-1).tolist(), rows
    assert Sampler().sample(logits[:1], params[:1], [0]).token_ids == [
        int(logits[0].argmax())]
