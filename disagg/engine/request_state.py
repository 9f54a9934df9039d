"""The engine's state of one request besides the scheduler's ``Request``, and the per-step work
done on it: first tokens that arrive from a context worker, grammar matchers, sampling inputs,
prompt logprobs."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from disagg.contracts.kv_mode import LOCAL, Dummy, KVMode, Local, PrefixPull, Pull
from disagg.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from disagg.kv_connector.errors import KVTransferError
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.sampler import SamplerOutput, prompt_logprobs
from disagg.scheduler import Scheduler, SchedulerOutput
from disagg.structured.grammar import GrammarCache, Matcher
from disagg.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestState:
    """Engine-side bookkeeping of one request besides the scheduler's Request: its mode, the
    detokenizer, logprobs and what of them was sent, its grammar matcher, and how it ended."""

    request: Request
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    prompt: str | None = None
    banned_until_min: tuple[int, ...] = field(default_factory=tuple)
    # Where its prompt KV comes from and where it goes (``contracts/kv_mode.py``).
    mode: KVMode = LOCAL
    # A context request (``mode.is_context``): the client's real params (the engine runs
    # max_tokens=1 and keeps these to decide whether the first token is final).
    ctx_params: SamplingParams | None = None
    disagg_out: dict | None = None
    kv_error: KVTransferError | None = None
    # The connector heard of the end (request_finished): once per request.
    ended: bool = False
    # prompt_logprobs: entry p scores prompt token p (filled as prefill chunks run).
    prompt_lps: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    # Structured outputs: where the output is in its grammar (None: unconstrained).
    matcher: Matcher | None = None
    # A peer's prefix this request pulls (``kv_mode.PrefixPull``); None once given back.
    prefix: PrefixPull | None = None

    @classmethod
    def new(cls, req: Request, tokenizer: Tokenizer, prompt: str | None,
            ctx_params: SamplingParams | None, mode: KVMode) -> RequestState:
        """The engine's state of a new request. A request whose prompt KV arrives from
        elsewhere (``Pull``, ``Dummy``) starts with its first token already generated and
        waits for that KV instead of computing it."""
        params = req.sampling_params
        logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        remote = mode.params if isinstance(mode, Pull) else None
        if isinstance(mode, Dummy):
            # The first "generated" token stands in for the context worker's: the last prompt
            # token (any valid id would do).
            req.output_token_ids = [req.prompt_token_ids[-1]]
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            if logprobs is not None:
                logprobs = [{}]
        if remote is not None:
            # The context worker's first token is already an output; only its KV is missing
            # (streamed: none yet, they come with the last read: ``take_first``).
            req.output_token_ids = list(remote.first_gen_tokens)
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            if logprobs is not None:
                logprobs = list(remote.first_gen_logprobs or [{} for _ in req.output_token_ids])
        resumed = mode.resumed if isinstance(mode, Local) else ()
        if resumed:
            # A migrated request: the tokens another worker streamed are its outputs (their KV
            # is recomputed with the prompt's, as after a preemption); their logprobs went out.
            req.output_token_ids = list(resumed)
            if logprobs is not None:
                logprobs = [{} for _ in resumed]
        # Before min_tokens, EOS and stop tokens are masked out so the model cannot pick them.
        banned = tuple(sorted(set(req.eos_token_ids) | set(params.stop_token_ids)))
        prompt_lps = prompt_ranks = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] * req.num_prompt_tokens
            prompt_ranks = [None] * req.num_prompt_tokens
            if remote is not None and remote.prompt_logprobs is not None:
                # (a generation_only request: the context worker scored the prompt)
                prompt_lps = list(remote.prompt_logprobs)
                prompt_ranks = list(remote.prompt_logprob_ranks or prompt_ranks)
        st = cls(
            prompt_lps=prompt_lps,
            prompt_ranks=prompt_ranks,
            request=req,
            detok=IncrementalDetokenizer(tokenizer, req.prompt_token_ids, params),
            metrics=RequestMetrics(arrival_time=req.arrival_time),
            logprobs=logprobs,
            prompt=prompt,
            banned_until_min=banned if params.min_tokens > 0 else (),
            mode=mode,
            ctx_params=ctx_params,
        )
        if resumed:
            # The detokenizer as the failed worker's was after them (held-back text, a
            # partial character): the text they made reached the client; the rest is new.
            for t in resumed:
                st.detok.update(t)
            st.sent_tokens = len(resumed)
            st.sent_logprobs = len(resumed) if logprobs is not None else 0
        return st

    def output(self, delta_text: str, finished: bool) -> RequestOutput:
        """The request's next output: what is new since the last one (``delta_text``: the
        detokenizer's new text)."""
        req = self.request
        if finished:
            self.metrics.finished_time = time.monotonic()
        tokens = list(req.output_token_ids)
        delta_tokens = tokens[self.sent_tokens :]
        self.sent_tokens = len(tokens)
        lps = self.logprobs
        all_lp = delta_lp = None
        if lps is not None:
            all_lp = list(lps)
            delta_lp = lps[self.sent_logprobs :]
            self.sent_logprobs = len(lps)
        # Positional, in field order (test_request_state_output checks it): this runs once per
        # request and step, and keyword calls of these dataclasses cost twice as much.
        comp = CompletionOutput(
            0, self.detok.text, tokens, delta_text, delta_tokens, all_lp, delta_lp,
            req.status.finish_reason if finished else None,  # finish_reason
            req.stop_reason if finished else None,  # stop_reason
        )
        return RequestOutput(
            req.request_id, req.prompt_token_ids, [comp], finished,
            req.num_cached_tokens if req.num_cached_tokens > 0 else 0,  # num_cached_tokens
            self.metrics,
            req.error if finished else None,  # error
            self.prompt,
            self.disagg_out if finished else None,  # disaggregated_params
            self.kv_error if finished else None,  # kv_transfer_error
            self.prompt_lps, self.prompt_ranks,
        )


def take_first(st: RequestState, first: Mapping[str, Any], scheduler: Scheduler
                ) -> RequestStatus | None:
    """A streamed request's first token(s), sampled by the context worker under the same
    params (the connector checked their shape): its outputs from here on, as a two-call
    request's are from the start. Returns how they end it (EOS, a stop token, max_tokens)."""
    req = st.request
    req.output_token_ids = list(first["tokens"])
    if st.logprobs is not None:
        st.logprobs = list(first.get("logprobs") or [{} for _ in req.output_token_ids])
    if st.matcher is not None and not st.matcher.replay(req.output_token_ids):
        # sampled under the same grammar: only a context worker of another model gets here
        req.error = "the context worker's first token does not match the grammar"
        return RequestStatus.FINISHED_ERROR
    return scheduler.check_stop(req)


def new_matcher(grammars: GrammarCache, req: Request, replay: bool) -> Matcher:
    """A fresh matcher for ``req``'s grammar. ``replay``: a generation-only request continues
    the context worker's first token(s), sampled under the same grammar: they are consumed
    first, so its first mask here is the one the next step would use on one worker."""
    spec = req.sampling_params.structured
    assert spec is not None
    m = grammars.matcher(spec)
    if replay and not m.replay(req.output_token_ids):
        raise ValueError(f"{spec.field}: the context worker's first token does not match the "
                         f"grammar ({m.error})")
    return m


def advance_grammars(matchers: list[Matcher | None], out: SamplerOutput) -> SamplerOutput:
    """Feed each constrained row's sampled token to its matcher; a row whose grammar refuses
    it (an engine bug, or a grammar the mask could not express) fails alone."""
    if all(m is None for m in matchers):
        return out
    errors = list(out.errors)
    for i, (m, tok) in enumerate(zip(matchers, out.token_ids, strict=True)):
        if m is not None and errors[i] is None and not m.consume(tok):
            errors[i] = m.error
    return replace(out, errors=errors)


def grammar_complete(scheduler: Scheduler, req: Request, finished: set[str]) -> None:
    """The request's grammar is complete (only EOS may follow): it ends with "stop", also
    when the token was its last one anyway (a context-only request's one token is then final:
    nothing is left for a generation worker)."""
    rid = req.request_id
    if rid in finished:
        if req.status == RequestStatus.FINISHED_LENGTH:
            req.status = RequestStatus.FINISHED_STOPPED
        return
    scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
    finished.add(rid)


def sampling_inputs(states: list[RequestState]) -> tuple[
        list[SamplingParams], list[tuple[int, ...]], list[tuple[list[int], list[int]]] | None]:
    """Per sampled row: its params, the tokens banned until ``min_tokens``, and (only when
    some row has penalties) its (prompt ids, output ids) history."""
    banned = [
        st.banned_until_min  # () unless min_tokens > 0: most rows stop at the first test
        if st.banned_until_min
        and st.request.num_output_tokens < st.request.sampling_params.min_tokens
        else ()
        for st in states
    ]
    params = [st.request.sampling_params for st in states]
    # Penalties read the token history: on a generation worker the output starts with the
    # context worker's first token, so its counts are those one worker would have.
    histories = ([(st.request.prompt_token_ids, st.request.output_token_ids)
                  for st in states] if any(p.penalized for p in params) else None)
    return params, banned, histories


def score_prompts(states: dict[str, RequestState], sched: SchedulerOutput, logits: torch.Tensor
                   ) -> None:
    """Prompt logprobs from this step's prompt-logprob rows (``logits`` [P, V], in the
    runner's order: each scheduled request's ``prompt_logit_positions``). The logits at
    position p score prompt token p + 1; a recomputation (preemption) writes the same."""
    where: list[tuple[RequestState, int]] = []
    targets: list[int] = []
    tops: list[int] = []
    for r in sched.scheduled:
        st = states[r.request_id]
        for p in r.prompt_logit_positions:
            where.append((st, p + 1))
            targets.append(st.request.prompt_token_ids[p + 1])
            tops.append(st.request.sampling_params.prompt_logprobs or 0)
    entries, ranks = prompt_logprobs(logits, targets, tops)
    for (st, p), lp, rank in zip(where, entries, ranks, strict=True):
        assert st.prompt_lps is not None and st.prompt_ranks is not None
        st.prompt_lps[p] = lp
        st.prompt_ranks[p] = rank
