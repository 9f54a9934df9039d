"""Speculative decoding is exact beyond greedy identity (issue 39): sampled output has the
target's distribution, seeded requests draw the same tokens with speculation on and off, and
logits processing, stops, logprobs, grammars and streaming behave exactly as without it.

Engines (module fixtures, the tiny random llama): ``base`` without speculation, ``same`` with
the target itself as draft model (its drafts are the target's argmax: accepted often, rejected
often at temperature 1), ``ngram`` with prompt lookup (right on repetitive text, else wrong).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
import torch
from server_fixtures import serve_in_thread

from disagg.engine import AsyncLLM
from disagg.engine.outputs import RequestOutput
from disagg.llm import LLM
from disagg.request import SamplingParams
from disagg.server.app import ServerSettings, build_app
from disagg.structured.grammar import Matcher
from disagg.structured.spec import GrammarSpec

K = 3  # draft tokens per step
BLOCK = 16
# max_num_tokens: room for every batched request's token and drafts in one step (the CPU
# default, 512, would leave most of the 1000 requests without drafts in a step)
OPTIONS: dict[str, object] = dict(tokens_per_block=BLOCK, kv_cache_tokens=65536,
                                  max_model_len=512, max_num_tokens=8192, seed=0)
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def target(model_dir: str) -> str:
    return model_dir


@pytest.fixture(scope="module")
def base(target: str) -> Iterator[LLM]:
    with LLM(target, **OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def same(target: str) -> Iterator[LLM]:
    cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": K}
    with LLM(target, speculative_config=cfg, **OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def ngram(target: str) -> Iterator[LLM]:
    with LLM(target, speculative_config=NGRAM, **OPTIONS) as llm:
        yield llm


# ---- the sampling test ---------------------------------------------------------------------

PROMPT = [5, 6, 7]
N_SAMPLES = 1000
LENGTH = 4  # output tokens per sample: position 1 from the prefill, 2 and 3 drafted, 4 not
ALPHA = 1e-3  # the correct engine's p-value must exceed this; a wrong rule's must not


def _dist(lp: dict[int, float], params: SamplingParams) -> dict[int, float]:
    """The sampler's distribution at one position from the raw top-20 logprobs (temperature 1:
    top-k, then top-p over the renormalised rest as ``disagg.sampler`` does; the tokens past
    the top 20 keep their raw mass when neither is set, and are left out of the dict)."""
    items = sorted(lp.items(), key=lambda kv: -kv[1])
    probs = [(t, math.exp(v)) for t, v in items]
    if params.top_k > 0 or params.top_p < 1.0:
        assert params.top_k and params.top_k <= 20, "top-p needs the whole kept set"
        probs = probs[:params.top_k]
        total = sum(p for _, p in probs)
        probs = [(t, p / total) for t, p in probs]
        before, kept = 0.0, []
        for t, p in probs:
            if before < params.top_p or not kept:
                kept.append((t, p))
            before += p
        total = sum(p for _, p in kept)
        probs = [(t, p / total) for t, p in kept]
    return dict(probs)


def _target_tree(llm: LLM, params: SamplingParams, min_prob: float
                 ) -> dict[tuple[int, ...], dict[int, float]]:
    """The target's next-token distribution at every output prefix shorter than LENGTH with
    probability >= ``min_prob`` (its extensions are below it too: they fall in the pooled
    bin), from non-speculative runs with logprobs=20 over the prefixes."""
    tree: dict[tuple[int, ...], dict[int, float]] = {}
    level = {(): 1.0}
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20, ignore_eos=True)
    for _ in range(LENGTH):
        prefixes = list(level)
        outs = llm.generate([PROMPT + list(p) for p in prefixes], one)
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, out in zip(prefixes, outs, strict=True):
            dist = _dist(out.outputs[0].logprobs[0], params)
            tree[prefix] = dist
            for t, p in dist.items():
                if level[prefix] * p >= min_prob:
                    nxt[prefix + (t,)] = level[prefix] * p
        level = nxt
    return tree


def _bins(tree: dict[tuple[int, ...], dict[int, float]], min_prob: float
          ) -> dict[tuple[int, ...], float]:
    """Whole outputs with probability >= ``min_prob``: their exact probabilities (the rest
    pool into one bin of probability 1 - their sum)."""
    out: dict[tuple[int, ...], float] = {}
    for prefix, dist in tree.items():
        if len(prefix) != LENGTH - 1:
            continue
        mass = math.prod(tree[prefix[:i]][prefix[i]] for i in range(len(prefix)))
        for t, p in dist.items():
            if mass * p >= min_prob:
                out[prefix + (t,)] = mass * p
    return out


def _chi2(samples: Sequence[tuple[int, ...]], bins: dict[tuple[int, ...], float]
          ) -> tuple[float, float, float]:
    """Pearson's chi-square of ``samples`` against ``bins`` + the pooled rest: (statistic,
    p-value, total variation distance between the empirical and the exact bin masses)."""
    n = len(samples)
    counts = dict.fromkeys(bins, 0)
    rest = 0
    for s in samples:
        if s in counts:
            counts[s] += 1
        else:
            rest += 1
    cells = [(counts[b], n * p) for b, p in bins.items()]
    cells.append((rest, n * max(0.0, 1.0 - sum(bins.values()))))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = sum(1 for _, e in cells if e > 0) - 1
    pval = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
    tv = 0.5 * sum(abs(o - e) for o, e in cells) / n
    return stat, pval, tv


def _simulate(tree: dict[tuple[int, ...], dict[int, float]], rule: str, n: int
              ) -> list[tuple[int, ...]]:
    """``n`` outputs drawn (seeded) by a WRONG verification of the target-as-draft proposals
    at positions 2 and 3 (the draft is the target's argmax): ``always``: drafts accepted
    unchecked; ``resample``: a rejected draft replaced by a draw from p itself instead of p
    without the draft. A prefix the tree does not hold ends the draw (its bin is the pool)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        seq: tuple[int, ...] = ()
        while len(seq) < LENGTH and seq in tree:
            dist = tree[seq]
            toks = list(dist)
            probs = torch.tensor([dist[t] for t in toks] + [max(0.0, 1 - sum(dist.values()))])
            draw = int(torch.multinomial(probs, 1, generator=g))
            tok = toks[draw] if draw < len(toks) else -1  # -1: a token past the top 20
            if 1 <= len(seq) <= 2:  # a drafted position
                d = max(toks, key=lambda t: dist[t])
                if rule == "always":
                    tok = d
                elif tok != d:  # rejected: the buggy rule draws again from all of p
                    draw = int(torch.multinomial(probs, 1, generator=g))
                    tok = toks[draw] if draw < len(toks) else -1
            seq += (tok,)
        out.append(seq)
    return out


@pytest.mark.parametrize("top", [(0, 1.0), (4, 0.9)], ids=["full", "topk4-topp0.9"])
def test_sampled_output_has_the_targets_distribution(base: LLM, target: str,
                                                     top: tuple[int, float]) -> None:
    """N_SAMPLES unseeded requests (the engine's generator, engine seed 0) of LENGTH tokens at
    temperature 1, batched, with the target itself proposing K drafts: the empirical
    distribution of whole outputs matches the exact target distribution (enumerated from
    the non-speculative engine's logprobs over every prefix) by Pearson's chi-square over
    the outputs of probability >= 5 / N_SAMPLES plus one pooled bin: p-value > ALPHA = 1e-3
    (and total variation < 0.1). The same statistic on as many draws from two wrong
    verification rules (drafts accepted unchecked; a rejected draft redrawn from p instead of
    p without it) gives p-values < 1e-9 (their total variation is >= 0.25): the test has
    the power to see them."""
    params = SamplingParams(max_tokens=LENGTH, temperature=1.0, top_k=top[0], top_p=top[1],
                            ignore_eos=True)
    min_prob = 5.0 / N_SAMPLES
    tree = _target_tree(base, params, min_prob)
    bins = _bins(tree, min_prob)
    # A fresh engine (seed 0): its generator's draws do not depend on the tests run before.
    cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": K}
    with LLM(target, speculative_config=cfg, **OPTIONS) as llm:
        outs = llm.generate([PROMPT] * N_SAMPLES, params)
        stats = llm.engine.stats()
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    assert all(len(s) == LENGTH for s in samples)
    drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    # Drafts were checked at every sample, and both kept and refused often.
    assert drafted >= 2 * N_SAMPLES
    assert 0.2 < accepted / drafted < 0.8, (accepted, drafted)
    stat, pval, tv = _chi2(samples, bins)
    assert pval > ALPHA and tv < 0.1, (stat, pval, tv, len(bins))
    for rule in ("always", "resample"):
        wstat, wp, wtv = _chi2(_simulate(tree, rule, N_SAMPLES), bins)
        assert wp < 1e-9, (rule, wstat, wp, wtv)


# ---- exactness against the non-speculative engine -------------------------------------------


def _rep_prompt(base: LLM) -> list[int]:
    """A prompt whose greedy continuation repeats text from it: ngram drafts are often right
    (and often wrong)."""
    g = base.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0.0,
                                              ignore_eos=True))[0].outputs[0].token_ids
    return PROMPT + list(g) + PROMPT


def _same_output(a: RequestOutput, b: RequestOutput, what: str) -> None:
    """Two RequestOutputs' first completions agree: tokens, text, how and why they ended,
    and logprobs (same tokens, values within 1e-4)."""
    x, y = a.outputs[0], b.outputs[0]
    assert x.token_ids == y.token_ids, what
    assert x.text == y.text, what
    assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason), what
    assert a.error is None and b.error is None, what
    assert (x.logprobs is None) == (y.logprobs is None), what
    for i, (u, v) in enumerate(zip(x.logprobs or [], y.logprobs or [], strict=True)):
        assert list(u) == list(v), (what, i, u, v)
        assert max(abs(u[t] - v[t]) for t in u) < 1e-4, (what, i, u, v)


def _check(base: LLM, specs: Sequence[LLM], prompts: Sequence[Sequence[int]],
           params: Sequence[SamplingParams]) -> list[RequestOutput]:
    """Every (prompt, params) pair, batched, on ``base`` and each speculative engine: equal
    outputs. Returns the base's. (A draft model always proposes: its drafts must have been
    checked; ngram finds nothing to copy where e.g. a repetition penalty stops repeats.)"""
    want = base.generate(list(prompts), list(params))
    for llm in specs:
        before = llm.engine.stats().spec_num_draft_tokens
        got = llm.generate(list(prompts), list(params))
        spec = llm.engine.config.speculative
        assert spec is not None
        if spec.method == "draft_model":
            assert llm.engine.stats().spec_num_draft_tokens > before
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            _same_output(a, b, f"request {i}: {params[i]}")
    return want


def test_seeded_requests_draw_the_same_tokens(base: LLM, same: LLM, ngram: LLM) -> None:
    """temperature 0.8, top_p 0.9, a seed per request: the same tokens with speculation on
    (either proposer) and off, and logprobs=5 within 1e-4."""
    rep = _rep_prompt(base)
    prompts = [PROMPT, rep, list(range(40, 70)), rep]
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=s, logprobs=5,
                             ignore_eos=True) for s in (1, 2, 3, 4)]
    before = ngram.engine.stats()
    _check(base, [same, ngram], prompts, params)
    after = ngram.engine.stats()
    # ngram's drafts were checked, and some (not all) kept.
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)


LOGITS_CASES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=1.0),
    dict(repetition_penalty=1.8),
    dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.3),
    dict(min_p=0.3),
    dict(logit_bias={PROMPT[0]: 6.0}),
    dict(logit_bias={PROMPT[1]: 100.0}),
]


@pytest.mark.parametrize("case", LOGITS_CASES, ids=lambda c: ",".join(c))
def test_logits_processing_is_identical(base: LLM, same: LLM, ngram: LLM,
                                        case: dict[str, object]) -> None:
    """Penalties (their history includes the drafts before each checked row), min_p and a
    positive logit_bias: greedy and seeded (temperature 1) outputs with logprobs equal on
    and off."""
    rep = _rep_prompt(base)
    params = [SamplingParams(max_tokens=20, temperature=t, seed=s, logprobs=2,
                             ignore_eos=True, **case)  # type: ignore[arg-type]
              for t, s in ((0.0, None), (1.0, 5), (1.0, 6))]
    _check(base, [same, ngram], [rep, rep, PROMPT], params)


def _recorder(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[int]]]:
    """(output length, drafts) of every proposal ``llm``'s proposer makes from now on."""
    rec: list[tuple[int, list[int]]] = []
    proposer = llm.engine.proposer
    assert proposer is not None
    real = proposer.propose

    def propose(entries: Sequence[tuple[Any, Any]]) -> dict[str, list[int]]:
        out = real(entries)
        for req, sr in entries:
            d = out.get(req.request_id, [])[:sr.spec_slots]
            if d:
                rec.append((req.num_output_tokens, list(d)))
        return out

    monkeypatch.setattr(proposer, "propose", propose)
    return rec


def test_a_banned_draft_token_is_never_emitted(base: LLM, ngram: LLM,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """logit_bias -100 on a token ngram proposes and the target would accept: the draft is
    rejected, the token never appears, and the output equals the non-speculative one."""
    rep = _rep_prompt(base)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    rec = _recorder(ngram, monkeypatch)
    out = ngram.generate([rep], greedy)[0].outputs[0].token_ids
    # An accepted first draft whose token the output had not emitted before: banning it
    # leaves the output unchanged up to there, so the same draft comes again.
    hits = [(n, d[0]) for n, d in rec if out[n] == d[0] and d[0] not in out[:n]]
    assert hits, rec
    n, banned = hits[0]
    rec.clear()
    params = replace(greedy, logit_bias=((banned, -100.0),))
    want = _check(base, [ngram], [rep], [params])[0]
    assert any(d[0] == banned for m, d in rec if m == n), (n, banned, rec)
    assert banned not in want.outputs[0].token_ids
    assert want.outputs[0].token_ids[:n] == out[:n]


def test_min_tokens_holds_eos_back(base: LLM, same: LLM, ngram: LLM) -> None:
    """EOS pushed up by a bias is banned until min_tokens are out (also at drafted
    positions), then ends the request: identical on and off."""
    eos = base.engine.eos_token_ids[0]
    rep = _rep_prompt(base)
    params = [SamplingParams(max_tokens=20, min_tokens=6, temperature=t, seed=s,
                             logit_bias={eos: b}, logprobs=1)
              for t, s, b in ((0.0, None, 100.0), (1.0, 3, 4.0), (1.0, 4, 4.0))]
    want = _check(base, [same, ngram], [rep, rep, PROMPT], params)
    first = want[0].outputs[0]
    assert len(first.token_ids) == 7 and first.token_ids[-1] == eos
    assert first.finish_reason == "stop"


def _accepted_runs(llm: LLM, prompt: list[int], monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[list[int], list[int]]:
    """Greedy output of ``prompt`` and the output indices of accepted drafts that another
    accepted draft follows (a stop there cuts an accepted run short)."""
    rec = _recorder(llm, monkeypatch)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0,
                                                ignore_eos=True))[0].outputs[0].token_ids
    mids = []
    for n, d in rec:
        run = 0
        while run < len(d) and n + run < len(out) and out[n + run] == d[run]:
            run += 1
        mids += [n + j for j in range(run - 1)]
    return list(out), mids


@pytest.mark.parametrize("engine", ["same", "ngram"])
def test_stops_inside_an_accepted_draft_run(base: LLM, same: LLM, ngram: LLM, engine: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop string completed by a token inside a run of accepted drafts (the drafts after
    it are dropped), a stop token id there, include_stop_str_in_output, and max_tokens at
    every length: the output stops exactly there, as without speculation."""
    llm = same if engine == "same" else ngram
    prompt = PROMPT if engine == "same" else _rep_prompt(base)
    out, mids = _accepted_runs(llm, prompt, monkeypatch)
    tok = base.tokenizer
    # The first mid-run index whose token's text ends a string not seen earlier.
    full = tok.decode(out)
    for i in mids:
        upto = tok.decode(out[:i + 1])
        if not full.startswith(upto) or upto == tok.decode(out[:i]):
            continue
        stop = next((upto[-m:] for m in range(1, len(upto) + 1)
                     if full.find(upto[-m:]) == len(upto) - m), None)
        if stop is not None and out[i] not in out[:i]:
            break
    else:
        pytest.fail(f"no accepted draft run to stop in: {out} {mids}")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    params = [replace(greedy, stop=(stop,)),
              replace(greedy, stop=(stop,), include_stop_str_in_output=True),
              replace(greedy, stop_token_ids=(out[i],)),
              *(replace(greedy, max_tokens=m) for m in range(1, 8))]
    want = _check(base, [llm], [prompt] * len(params), params)
    cut, kept, by_id = (w.outputs[0] for w in want[:3])
    for o in (cut, kept, by_id):
        assert o.token_ids == out[:i + 1] and o.finish_reason == "stop"
    assert (cut.stop_reason, kept.stop_reason, by_id.stop_reason) == (stop, stop, out[i])
    assert cut.text == upto[:-len(stop)] and kept.text == upto
    for m, w in enumerate(want[3:], start=1):
        o = w.outputs[0]
        assert o.token_ids == out[:m] and o.finish_reason == "length"


# ---- structured outputs ---------------------------------------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
REGEX = r"[a-z]{2,5}-[0-9]{2,4}( [a-z]{1,4}){1,3}"
CHOICES = ["alpha beta", "alpha gamma", "delta"]
EXAMPLE = '{"name": "Bo", "age": 7}\n{"name": "Al", "age": 31}\n{"name": "Bo", "age": 7}\n'


def _grammars() -> list[tuple[GrammarSpec, Callable[[str], bool]]]:
    def is_person(text: str) -> bool:
        try:
            v = json.loads(text)
        except ValueError:
            return False
        return (isinstance(v, dict) and set(v) == {"name", "age"}
                and isinstance(v["name"], str) and len(v["name"]) <= 8
                and type(v["age"]) is int and 0 <= v["age"] <= 120)

    return [(GrammarSpec.json_schema(SCHEMA, "response_format"), is_person),
            (GrammarSpec("regex", REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
            (GrammarSpec("choice", json.dumps(CHOICES)), lambda t: t in CHOICES)]


@pytest.fixture
def cuts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(drafts, how many the grammar accepts) of every ``Matcher.valid_prefix`` call."""
    rec: list[tuple[int, int]] = []
    real = Matcher.valid_prefix

    def valid_prefix(self: Matcher, token_ids: Sequence[int]) -> int:
        n = real(self, token_ids)
        rec.append((len(token_ids), n))
        return n

    monkeypatch.setattr(Matcher, "valid_prefix", valid_prefix)
    return rec


def test_grammars_with_ngram_drafts(base: LLM, ngram: LLM, cuts: list[tuple[int, int]]
                                    ) -> None:
    """json_schema, regex and choice under greedy and seeded sampling, on a prompt of JSON
    the schema accepts (ngram copies drafts the grammar takes) and on an unrelated one
    (drafts it refuses, cut by ``Matcher.valid_prefix``): valid, finished by the grammar,
    identical to without speculation."""
    prompts = [base.tokenizer.encode(EXAMPLE * 2), _rep_prompt(base)]
    cases = [(spec, ok, p, t, s) for spec, ok in _grammars() for p in prompts
             for t, s in ((0.0, None), (1.0, 11))]
    params = [SamplingParams(max_tokens=48, temperature=t, seed=s, logprobs=1, structured=spec)
              for spec, _, _, t, s in cases]
    want = _check(base, [ngram], [p for _, _, p, _, _ in cases], params)
    for (spec, ok, *_), w in zip(cases, want, strict=True):
        o = w.outputs[0]
        assert ok(o.text) and o.finish_reason == "stop", (spec.kind, o.text)
    assert any(n < d for d, n in cuts), cuts  # drafts the grammar refused
    assert any(n == d > 0 for d, n in cuts), cuts  # and whole proposals it took


def test_grammars_with_the_target_as_draft(base: LLM, same: LLM, cuts: list[tuple[int, int]]
                                           ) -> None:
    """High acceptance (the draft is the target): the matcher advances over whole accepted
    runs and rolls back nothing twice. 60 requests (greedy, seeded and unseeded sampling):
    all valid, none failed with "does not match the grammar", seeded ones identical to
    without speculation."""
    specs = _grammars()
    cases = [(spec, ok, t, s) for spec, ok in specs for t, s in
             [(0.0, None)] + [(1.0, 100 + i) for i in range(9)] + [(1.0, None)] * 10]
    params = [SamplingParams(max_tokens=48, temperature=t, seed=s, structured=spec)
              for spec, _, t, s in cases]
    before = same.engine.stats()
    got = same.generate([PROMPT] * len(cases), params)
    after = same.engine.stats()
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 100
    for (spec, ok, _, _), g in zip(cases, got, strict=True):
        o = g.outputs[0]
        assert g.error is None and o.finish_reason == "stop", (spec.kind, g.error, o.text)
        assert ok(o.text), (spec.kind, o.text)
    assert cuts  # the grammar saw the drafts
    seeded = [i for i, c in enumerate(cases) if c[2] == 0.0 or c[3] is not None]
    want = base.generate([PROMPT] * len(seeded), [params[i] for i in seeded])
    for i, w in zip(seeded, want, strict=True):
        _same_output(w, got[i], f"{cases[i][0].kind} {params[i]}")


# ---- streaming and /metrics -----------------------------------------------------------------

NAME = "tiny"
SERVER_OPTIONS: dict[str, object] = dict(tokens_per_block=BLOCK, kv_cache_tokens=8192,
                                         max_model_len=512, max_num_tokens=256)


@pytest.fixture(scope="module")
def servers(target: str) -> Iterator[tuple[str, str]]:
    """Two workers in this process: (speculating with the target as draft model, not)."""
    cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": K}
    with contextlib.ExitStack() as stack:
        urls = []
        for extra in ({"speculative_config": cfg}, {}):
            engine = AsyncLLM.from_options(target, **SERVER_OPTIONS, **extra)
            app = build_app(engine, ServerSettings(model_dir=target, served_model_name=NAME))
            urls.append(stack.enter_context(serve_in_thread(app)))
        yield urls[0], urls[1]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_streams_emit_accepted_tokens_in_order(servers: tuple[str, str]) -> None:
    """Streamed chat and completions with speculation: the deltas concatenate to the
    non-streamed non-speculative text; the streamed logprobs hold one entry per token, in
    order, equal (within 1e-4) to the non-speculative ones; usage counts the same tokens."""
    spec, plain = (_client(u) for u in servers)
    body: dict[str, Any] = dict(model=NAME, max_tokens=32, temperature=0.0)
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    want = plain.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2,
                                         **body)
    text, entries, usage = "", [], None
    for chunk in spec.chat.completions.create(
            messages=messages, logprobs=True, top_logprobs=2, stream=True,
            stream_options={"include_usage": True}, **body):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            entries += ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
    ref = want.choices[0].logprobs.content
    assert text == want.choices[0].message.content and text
    assert [e.token for e in entries] == [e.token for e in ref]
    assert max(abs(e.logprob - r.logprob) for e, r in zip(entries, ref, strict=True)) < 1e-4
    assert usage is not None
    assert usage.completion_tokens == len(entries) == want.usage.completion_tokens

    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on"
    want_c = plain.completions.create(prompt=prompt, logprobs=1, **body)
    text, tokens = "", []
    for chunk in spec.completions.create(prompt=prompt, logprobs=1, stream=True, **body):
        for ch in chunk.choices:
            text += ch.text
            tokens += ch.logprobs.tokens if ch.logprobs and ch.logprobs.tokens else []
    assert text == want_c.choices[0].text
    assert tokens == want_c.choices[0].logprobs.tokens
    assert len(tokens) == want_c.usage.completion_tokens


def _metric(text: str, name: str) -> float:
    """The value of the one sample of ``name`` in a Prometheus text page."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert len(values) == 1, (name, values)
    return values[0]


def test_metrics_show_acceptance(servers: tuple[str, str]) -> None:
    """After speculative requests, the worker's /metrics counts drafts and accepted tokens
    and derives the acceptance gauges from them; the plain worker exports none."""
    spec, plain = servers
    _client(spec).completions.create(model=NAME, prompt="Once upon a time", max_tokens=16,
                                     temperature=0.0)
    page = httpx.get(spec + "/metrics", timeout=30).text
    drafts = _metric(page, "disagg_spec_decode_num_drafts_total")
    proposed = _metric(page, "disagg_spec_decode_num_draft_tokens_total")
    accepted = _metric(page, "disagg_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and proposed > 0 and 0 < accepted <= proposed
    rate = _metric(page, "disagg_spec_decode_acceptance_rate")
    assert rate == pytest.approx(accepted / proposed)
    per_fwd = _metric(page, "disagg_spec_decode_mean_tokens_per_forward")
    assert per_fwd == pytest.approx((accepted + drafts) / drafts) and per_fwd > 1
    assert "disagg_spec_decode" not in httpx.get(plain + "/metrics", timeout=30).text
