"""The engine: scheduler + model runner + sampler + detokenizer, stepped in a loop.

``LLMEngine`` is synchronous: ``add_request`` / ``abort_request`` / ``step``. ``AsyncLLM`` runs
``step`` on its own thread (never on the HTTP event loop) and hands each request's incremental
outputs to the asyncio task that iterates ``generate``.

A context or generation worker's engine also holds one KV connector (``disagg.kv_connector``;
None on an aggregated worker) and calls its hooks at fixed points: when a request is added,
before each step runs, for each pull the plan starts, once per loop turn
(``service_transfers``), and when a request ends. Everything about leases, transports and
ranks stays behind it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from disagg.config import EngineConfig, build_engine_config
from disagg.contracts.roles import Role, RoleDrain
from disagg.kv_cache.events import KVEventLog
from disagg.kv_cache.manager import KVCacheManager
from disagg.kv_connector.base import KVConnector, RequestKV
from disagg.kv_connector.errors import KVTransferError
from disagg.parallel.executor import DistributedExecutor, WorkerDiedError
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.runner import ModelRunner
from disagg.sampler import Sampler, SamplerOutput, prompt_logprobs
from disagg.scheduler import Scheduler, SchedulerOutput
from disagg.structured.grammar import GrammarCache, Matcher
from disagg.structured.mask import MaskFiller
from disagg.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from disagg.contracts.params import ContextParams
    from disagg.kv_connector.settings import DisaggSettings

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queue``; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped because of an internal error."""


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    delta_logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    prompt: str | None = None
    # Context-only answers that are not final: ContextParams.to_dict() for the router.
    disaggregated_params: dict | None = None
    # Set (with ``error``, its message) when the request failed because its prompt KV could
    # not be pulled from the context worker: the server answers 502 kv_transfer_failed.
    kv_transfer_error: KVTransferError | None = None
    # prompt_logprobs: per prompt token, {token id: logprob} (its own and the top-n); None for
    # the first token (nothing scores it). Complete from the first output on.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_cache_queries_tokens: int
    prefix_cache_hit_tokens: int
    last_step_batch_size: int
    last_step_num_tokens: int
    steps_total: int


@dataclass
class _State:
    """Engine-side bookkeeping of one request besides the scheduler's Request."""

    request: Request
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    prompt: str | None = None
    banned_until_min: tuple[int, ...] = field(default_factory=tuple)
    # context_only: the client's real params (the engine runs max_tokens=1 and keeps these to
    # decide whether the first token is final).
    ctx_params: SamplingParams | None = None
    disagg_out: dict | None = None
    # Whether pulled KV may serve other requests' prefix hits (its provenance is trusted: the
    # request came signed by the cluster). Otherwise its blocks are never cached.
    cache_remote_kv: bool = False
    # benchmark gen-only: no context worker; the prompt's blocks count as computed as they are.
    dummy_kv: bool = False
    # A generation-only request (pulled or dummy KV): what a generation worker's role switch
    # waits for.
    generation_only: bool = False
    kv_error: KVTransferError | None = None
    # The connector heard of the end (request_finished): once per request.
    ended: bool = False
    # prompt_logprobs: entry p scores prompt token p (filled as prefill chunks run).
    prompt_lps: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    # Structured outputs: where the output is in its grammar (None: unconstrained).
    matcher: Matcher | None = None

    @classmethod
    def new(cls, req: Request, tokenizer: Tokenizer, prompt: str | None,
            ctx_params: SamplingParams | None, remote: ContextParams | None,
            dummy_kv: bool) -> _State:
        """The engine's state of a new request. A request whose prompt KV arrives from
        elsewhere (``remote``, ``dummy_kv``) starts with its first token already generated and
        waits for that KV instead of computing it."""
        params = req.sampling_params
        logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        if dummy_kv:
            # The first "generated" token stands in for the context worker's: the last prompt
            # token (any valid id would do).
            req.output_token_ids = [req.prompt_token_ids[-1]]
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            if logprobs is not None:
                logprobs = [{}]
        if remote is not None:
            # The context worker's first token is already an output; only its KV is missing
            # (streamed: none yet, they come with the last read: ``_take_first``).
            req.output_token_ids = list(remote.first_gen_tokens)
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            if logprobs is not None:
                logprobs = list(remote.first_gen_logprobs or [{} for _ in req.output_token_ids])
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
        return cls(
            prompt_lps=prompt_lps,
            prompt_ranks=prompt_ranks,
            request=req,
            detok=IncrementalDetokenizer(tokenizer, req.prompt_token_ids, params),
            metrics=RequestMetrics(arrival_time=req.arrival_time),
            logprobs=logprobs,
            prompt=prompt,
            banned_until_min=banned if params.min_tokens > 0 else (),
            ctx_params=ctx_params,
            dummy_kv=dummy_kv,
        )

    def output(self, delta_text: str, finished: bool) -> RequestOutput:
        """The request's next output: what is new since the last one (``delta_text``: the
        detokenizer's new text)."""
        req = self.request
        if finished:
            self.metrics.finished_time = time.monotonic()
        tokens = list(req.output_token_ids)
        delta_tokens = tokens[self.sent_tokens :]
        self.sent_tokens = len(tokens)
        delta_lp = None
        if self.logprobs is not None:
            delta_lp = self.logprobs[self.sent_logprobs :]
            self.sent_logprobs = len(self.logprobs)
        comp = CompletionOutput(
            index=0,
            text=self.detok.text,
            token_ids=tokens,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            delta_logprobs=delta_lp,
            finish_reason=req.status.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=self.metrics,
            error=req.error if finished else None,
            prompt=self.prompt,
            disaggregated_params=self.disagg_out if finished else None,
            kv_transfer_error=self.kv_error if finished else None,
            prompt_logprobs=self.prompt_lps,
            prompt_logprob_ranks=self.prompt_ranks,
        )


def _take_first(st: _State, first: Mapping[str, Any], scheduler: Scheduler
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


def _new_matcher(grammars: GrammarCache, req: Request, replay: bool) -> Matcher:
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


def _advance_grammars(matchers: list[Matcher | None], out: SamplerOutput) -> SamplerOutput:
    """Feed each constrained row's sampled token to its matcher; a row whose grammar refuses
    it (an engine bug, or a grammar the mask could not express) fails alone."""
    if all(m is None for m in matchers):
        return out
    errors = list(out.errors)
    for i, (m, tok) in enumerate(zip(matchers, out.token_ids, strict=True)):
        if m is not None and errors[i] is None and not m.consume(tok):
            errors[i] = m.error
    return SamplerOutput(out.token_ids, out.logprobs, errors)


def _grammar_complete(scheduler: Scheduler, req: Request, finished: set[str]) -> None:
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


def _sampling_inputs(states: list[_State]) -> tuple[
        list[SamplingParams], list[tuple[int, ...]], list[tuple[list[int], list[int]]] | None]:
    """Per sampled row: its params, the tokens banned until ``min_tokens``, and (only when
    some row has penalties) its (prompt ids, output ids) history."""
    banned = [
        st.banned_until_min
        if st.request.num_output_tokens < st.request.sampling_params.min_tokens
        else ()
        for st in states
    ]
    params = [st.request.sampling_params for st in states]
    # Penalties read the token history: on a generation worker the output starts with the
    # context worker's first token, so its counts are those one worker would have.
    histories = ([(st.request.prompt_token_ids, st.request.output_token_ids)
                  for st in states] if any(p.penalized for p in params) else None)
    return params, banned, histories


def _release_device_cache() -> None:
    """Hand the caching allocator's unused blocks back (after an out-of-memory error)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def context_only_params(params: SamplingParams) -> SamplingParams:
    """What a context worker runs for a context-only request: prefill + one sampled token."""
    return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def _validate(config: EngineConfig, num_blocks: int, prompt_token_ids: list[int],
              params: SamplingParams) -> None:
    """``LLMEngine.validate``: raise ValueError for a request that can never be served."""
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


def _score_prompts(states: dict[str, _State], sched: SchedulerOutput, logits: torch.Tensor
                   ) -> None:
    """Prompt logprobs from this step's prompt-logprob rows (``logits`` [P, V], in the
    runner's order: each scheduled request's ``prompt_logit_positions``). The logits at
    position p score prompt token p + 1; a recomputation (preemption) writes the same."""
    where: list[tuple[_State, int]] = []
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


def make_executor(config: EngineConfig, disagg: DisaggSettings | None = None
                  ) -> ModelRunner | DistributedExecutor:
    """The model executor: this process alone, or rank 0 of ``tp * pp`` rank processes.

    Both offer ``num_blocks``, ``kv_cache`` (this rank's), ``execute(sched) -> (sample request
    ids, logits [S, V])``, ``error`` (set once a rank died), ``rank_pids`` and ``shutdown()``.
    """
    if config.parallel.world_size == 1:
        return ModelRunner(config)
    return DistributedExecutor(config, disagg=disagg)


def _make_connector(disagg: DisaggSettings, config: EngineConfig,
                    runner: ModelRunner | DistributedExecutor, wake: Callable[[], None]
                    ) -> KVConnector:
    """Rank 0's connector over rank 0's KV cache; the executor is its line to the other ranks
    (they built their part, ``RankTransfer``, when they started)."""
    from disagg.kv_connector.disagg_connector import make_connector
    from disagg.kv_connector.stream import install_hook

    peers = runner if isinstance(runner, DistributedExecutor) else None
    connector = make_connector(disagg, config, runner.kv_cache, wake, peers=peers)
    model = runner.runner.model if isinstance(runner, DistributedExecutor) else runner.model
    install_hook(model, connector.streams.progress)  # type: ignore[attr-defined]
    return connector


_StepResult = tuple[list[str], SamplerOutput | None]  # (sampling request ids, their draws)


def _run_isolating_oom(run_step: Callable[[SchedulerOutput], _StepResult],
                       sched: SchedulerOutput
                       ) -> tuple[list[_StepResult], list[tuple[str, str]]]:
    """The step ran out of device memory: run its requests again in halves, recursively,
    until each group fits; a single request that still does not fit fails alone.

        [r0 r1 r2 r3 r4 r5]  OOM
        [r0 r1 r2] ok   [r3 r4 r5] OOM
                        [r3] ok  [r4 r5] OOM
                                 [r4] OOM -> r4 fails   [r5] ok

    Re-running is safe: a group writes the same K/V into the same slots again. Groups keep
    the plan's order (decodes first), so each is a valid step on its own."""
    logger.warning("step of %d requests (%d tokens) ran out of device memory: retrying "
                   "in smaller groups", len(sched.scheduled), sched.num_scheduled_tokens)
    results: list[_StepResult] = []
    failed: list[tuple[str, str]] = []

    def attempt(lo: int, hi: int) -> None:  # sched.scheduled[lo:hi]
        group = sched.scheduled[lo:hi]
        sub = replace(sched, scheduled=group,
                      num_decodes=max(0, min(hi, sched.num_decodes) - lo),
                      num_scheduled_tokens=sum(len(r.token_ids) for r in group),
                      kv_fetches=[])
        _release_device_cache()
        try:
            results.append(run_step(sub))
            return
        except torch.cuda.OutOfMemoryError as e:
            if hi - lo == 1:
                r = group[0]
                failed.append((r.request_id, (
                    f"out of device memory: this request ({len(r.token_ids)} new tokens, "
                    f"{r.start_pos + len(r.token_ids)} in context) does not fit in the "
                    f"memory left on its own: {e}")))
                return
        mid = (lo + hi) // 2
        attempt(lo, mid)
        attempt(mid, hi)

    attempt(0, len(sched.scheduled))
    _release_device_cache()
    return results, failed


class LLMEngine:
    def __init__(self, config: EngineConfig, disagg: DisaggSettings | None = None,
                 wake: Callable[[], None] | None = None) -> None:
        """``disagg``: a context / generation worker: the engine drives its KV connector (every
        rank starts its part). ``wake``: called from transfer threads when the connector has
        news for ``service_transfers`` (AsyncLLM's loop sleeps until then)."""
        self.config = config
        torch.manual_seed(config.seed)
        self.tokenizer: Tokenizer = load_tokenizer(config.model_dir)
        self.runner = make_executor(config, disagg)
        B = config.cache.tokens_per_block
        self.kv = KVCacheManager(self.runner.num_blocks, B, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len=config.max_model_len)
        self.sampler = Sampler(torch.Generator().manual_seed(config.seed))
        self.grammars = GrammarCache(self.tokenizer.backend, config.model.vocab_size,
                                     self.tokenizer.eos_token_ids)
        self._masks = MaskFiller(config.model.vocab_size)
        self.eos_token_ids = tuple(
            sorted(set(self.tokenizer.eos_token_ids) | set(config.model.eos_token_ids))
        )
        self._states: dict[str, _State] = {}
        self._last_sched: SchedulerOutput | None = None
        self._steps = 0
        self.connector: KVConnector | None = None  # None: an aggregated worker
        if disagg is not None:
            try:
                self.connector = _make_connector(disagg, config, self.runner,
                                                 wake or (lambda: None))
            except BaseException:
                self.runner.shutdown()
                raise

    @classmethod
    def from_options(cls, model_dir: str, **options: object) -> LLMEngine:
        return cls(build_engine_config(model_dir, **options))

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never be served (the server's 400)."""
        _validate(self.config, self.runner.num_blocks, prompt_token_ids, params)
        if params.structured is not None:  # a bad schema / regex / grammar: its own 400
            self.grammars.compile(params.structured)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        context_only: bool = False,
        remote: ContextParams | None = None,
        dummy_kv: bool = False,
        cache_remote_kv: bool = False,
        kv_stream: tuple[int, str] | None = None,
    ) -> None:
        """Queue a request. ``context_only``: prefill and sample one token only; unless that
        token ends the request its blocks are leased to a generation worker. ``remote``: a
        generation-only request whose prompt KV is pulled from the context worker named there.
        ``dummy_kv``: a benchmarking aid (TensorRT-LLM's gen-only benchmark): decode as if the
        prompt's KV were in place, without computing or pulling it. The output is meaningless;
        the timing is that of a generation worker whose context side keeps up.
        ``cache_remote_kv``: the pulled KV may enter the prefix cache (only when the caller
        trusts that it is the KV of ``prompt_token_ids``: a forged request could otherwise
        plant blocks that later requests reuse); by default it serves this request only.
        ``kv_stream``: its KV is streamed as computed (``RequestKV.stream``)."""
        if request_id in self._states:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ctx_params = params if context_only else None
        if context_only:
            params = context_only_params(params)
        self.validate(prompt_token_ids, params)
        max_queue = self.config.scheduler.max_queue
        if max_queue is not None and self.scheduler.num_waiting >= max_queue:
            raise QueueFullError(f"waiting queue is full ({max_queue} requests)")
        if dummy_kv and (remote is not None or context_only):
            raise ValueError("dummy_kv: only for a plain generation-only request")
        if remote is not None and self.connector is None:
            raise ValueError("disaggregated_params: this worker cannot pull KV")
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
        )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        st = _State.new(req, self.tokenizer, prompt, ctx_params, remote, dummy_kv)
        st.cache_remote_kv = cache_remote_kv
        st.generation_only = remote is not None or dummy_kv
        if params.structured is not None:
            st.matcher = _new_matcher(self.grammars, req, replay=remote is not None)
        self._states[request_id] = st
        self.scheduler.add_request(req)
        if self.connector is None:
            return
        # Only a request that may go on keeps its blocks: real max_tokens 1 is final anyway.
        kv = RequestKV(lease=ctx_params is not None and ctx_params.max_tokens > 1,
                       remote=remote, stream=kv_stream)
        if self.connector.add_request(request_id, kv) and not req.is_finished():
            self.scheduler.hold_blocks_on_finish(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort and free the request's blocks now; returns its final output, if it existed."""
        st = self._states.get(request_id)
        if st is None:
            return None
        self.scheduler.abort_request(request_id)
        st.request.status = RequestStatus.FINISHED_ABORTED
        del self._states[request_id]
        return self._make_output(st, "", finished=True)

    def has_schedulable(self) -> bool:
        """True when a step could make progress (requests that only wait for their KV
        transfer do not count: the loop waits for the transfer instead of spinning)."""
        sch = self.scheduler
        return len(sch.requests) > sch.num_fetching or sch.num_finished_unreported > 0

    def idle_wait_s(self) -> float:
        """How long an idle loop may sleep without a wake-up: short while the connector has
        reads in flight or leases to expire."""
        return 0.1 if self.connector is not None and self.connector.busy() else 0.5

    def release_lease(self, lease_id: str) -> bool:
        """Engine thread: end a context lease now (the router gave up on the answer)."""
        return self.connector is not None and self.connector.release_lease(lease_id)

    def service_transfers(self) -> list[RequestOutput]:
        """Engine thread, never blocks: free blocks of ended leases, expire leases, start
        decoding requests whose pulled KV is in place, fail requests whose pull failed."""
        if self.connector is None:
            return []
        done = self.connector.get_finished()
        for rid in done.leases_ended:
            self.scheduler.release_held(rid)
        for rid in done.loads_stopped:
            self.scheduler.release_draining(rid)
        outputs: list[RequestOutput] = []
        for rid in done.loaded:
            st = self._states.get(rid)
            if st is not None:
                outputs.append(self._kv_in_place(st, done.first.get(rid)))
        for rid, error in done.failed:
            logger.warning("request %s: %s", rid, error)
            outputs.extend(self._fail_requests([rid], error))
            self.scheduler.release_draining(rid)  # its reads ended: nothing writes any more
        return self._collect_finished_without_step(outputs) if outputs else outputs

    def _kv_in_place(self, st: _State, first: Mapping[str, Any] | None = None
                     ) -> RequestOutput:
        """A request's prompt KV is in its blocks (pulled, or dummy): it decodes from the next
        step; its first output carries the context worker's token(s) (streamed: ``first``,
        which came with the last read, so they may also end it: a stop, max_tokens)."""
        rid, now = st.request.request_id, time.monotonic()
        end = _take_first(st, first, self.scheduler) if first is not None else None
        st.metrics.first_scheduled_time = st.metrics.first_scheduled_time or now
        st.metrics.first_token_time = now
        st.metrics.last_token_time = now
        delta = "".join(st.detok.update(t) for t in st.request.output_token_ids)
        if st.detok.stopped or (st.matcher is not None and st.matcher.done):
            st.request.stop_reason = st.detok.stop_reason
            end = RequestStatus.FINISHED_STOPPED
        # A streamed answer that ends here may have read blocks its context worker freed at
        # once (a stop is final there): such KV is never used, and never cached.
        cache = not st.dummy_kv and st.cache_remote_kv and (first is None or end is None)
        self.scheduler.remote_kv_ready(rid, cache=cache)
        if end is not None:
            self.scheduler.finish_request(rid, end)
        return self._make_output(st, delta, finished=end is not None)

    def _start_loads(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """The plan allocated blocks for requests whose KV arrives from elsewhere: start their
        pulls (a dummy-KV request's blocks count as filled at once)."""
        failed: list[tuple[str, KVTransferError]] = []
        dummy: list[RequestOutput] = []
        for f in sched.kv_fetches:
            st = self._states[f.request_id]
            if st.dummy_kv:
                dummy.append(self._kv_in_place(st))
                continue
            assert self.connector is not None
            try:
                self.connector.start_load(f)
            except Exception as e:  # e.g. a backend that cannot start: fail this request only
                logger.exception("starting the KV pull of %s failed", f.request_id)
                failed.append((f.request_id, KVTransferError.because(f": {e!r}")))
        outs: list[RequestOutput] = []
        for rid, error in failed:
            outs.extend(self._fail_requests([rid], error))
        return self._collect_finished_without_step(dummy) + outs if dummy else outs

    def _end(self, st: _State) -> None:
        """The request ended: tell the connector once (a context-only answer that may go on
        gets its lease there), and free blocks the scheduler held for it unless leased."""
        if st.ended:
            return
        st.ended = True
        req = st.request
        if st.ctx_params is not None and st.detok.stopped and (
                req.status == RequestStatus.FINISHED_LENGTH):
            req.status = RequestStatus.FINISHED_STOPPED  # a stop string: final
            req.stop_reason = st.detok.stop_reason
        held = self.scheduler.held.get(req.request_id)
        if self.connector is None:  # nothing can be writing into its blocks
            self.scheduler.release_draining(req.request_id)
        else:
            try:
                params = self.connector.request_finished(
                    req, held, list(st.logprobs) if st.logprobs is not None else None)
            except Exception as e:
                logger.exception("leasing the blocks of %s failed", req.request_id)
                req.status = RequestStatus.FINISHED_ERROR
                req.error = f"kv lease failed: {e!r}"
                params = None
            if params is not None:
                if st.prompt_lps is not None:  # the generation worker's answer echoes them
                    params = replace(params, prompt_logprobs=st.prompt_lps,
                                     prompt_logprob_ranks=st.prompt_ranks)
                st.disagg_out = params.to_dict()
                return  # held until the lease ends (service_transfers)
        if held is not None:
            self.scheduler.release_held(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self._states)

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can no longer run steps (a rank of a parallel worker died)."""
        return self.runner.error

    def shutdown(self) -> None:
        """Release the executor (stops and reaps the other ranks of a parallel worker)."""
        if self.connector is not None:
            self.connector.shutdown()
        self.runner.shutdown()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self._last_sched = sched
        self._steps += 1
        outputs: list[RequestOutput] = self._start_loads(sched) if sched.kv_fetches else []
        if not sched.scheduled:
            # Still reported: requests the scheduler refused when they were added.
            self.scheduler.update_from_output(sched, {})
            return self._collect_finished_without_step(outputs)
        now = time.monotonic()
        for r in sched.scheduled:
            st = self._states[r.request_id]
            if st.metrics.first_scheduled_time is None:
                st.metrics.first_scheduled_time = now
        try:
            if self.connector is not None:
                self.connector.start_step(sched)
            sampled, sampling_failed = self._execute(sched)
        except WorkerDiedError:
            raise  # not this step's fault: the engine cannot go on (AsyncLLM stops)
        except Exception as e:  # the step failed: fail its requests, keep the loop alive
            logger.exception("engine step failed")
            outputs += self._fail_requests([r.request_id for r in sched.scheduled], repr(e))
            self.scheduler.update_from_output(sched, {})  # every plan entry is now stale
            return outputs

        # A request whose own sampling failed ends alone; its batch-mates go on. Finished
        # before update_from_output, which then ignores its plan entry.
        for rid, err in sampling_failed:
            logger.warning("request %s: %s", rid, err)
            outputs += self._fail_requests([rid], err)
        finished = {r.request_id for r in self.scheduler.update_from_output(sched, sampled)}
        outputs += self._outputs_of_step(sampled, finished)
        return self._collect_finished_without_step(outputs)

    def _execute(self, sched: SchedulerOutput) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """Run the plan and sample: (token by request id, requests whose own sampling or
        memory failed with why)."""
        oom_failed: list[tuple[str, str]] = []
        try:
            results = [self._run_step(sched)]
        except torch.cuda.OutOfMemoryError:
            results = []  # retried below, once the error (and the frames holding the failed
            # forward's activations) is released
        if not results:
            # A request too large for the memory left fails alone: re-run in smaller groups.
            results, oom_failed = _run_isolating_oom(self._run_step, sched)
        sampled: dict[str, int] = {}
        sampling_failed: list[tuple[str, str]] = list(oom_failed)
        for rids, out in results:
            if out is None:
                continue
            for rid, tok, lp, err in zip(rids, out.token_ids, out.logprobs, out.errors,
                                         strict=True):
                if err is not None:
                    sampling_failed.append((rid, err))
                    continue
                sampled[rid] = tok
                st = self._states[rid]
                if st.logprobs is not None and lp is not None:
                    st.logprobs.append(lp)
        return sampled, sampling_failed

    def _outputs_of_step(self, sampled: dict[str, int], finished: set[str]
                         ) -> list[RequestOutput]:
        """Detokenize the sampled tokens (a stop string ends a request here) and build the
        outputs; ``finished``: the requests the scheduler ended this step (updated)."""
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for rid, tok in sampled.items():
            st = self._states[rid]
            if st.metrics.first_token_time is None:
                st.metrics.first_token_time = now
            st.metrics.last_token_time = now
            delta = st.detok.update(tok)
            if st.detok.stopped and rid not in finished:
                st.request.stop_reason = st.detok.stop_reason
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                finished.add(rid)
            elif st.matcher is not None and st.matcher.done:
                _grammar_complete(self.scheduler, st.request, finished)
            if rid in finished and not st.detok.stopped:
                delta += st.detok.flush()
            outputs.append(self._make_output(st, delta, finished=rid in finished))
        # Requests the scheduler ended without sampling (errors) still owe a final output.
        for rid in finished - set(sampled):
            st = self._states.get(rid)
            if st is None:  # aborted after the scheduler refused it: reported by the abort
                continue
            outputs.append(self._make_output(st, st.detok.flush(), finished=True))
        return outputs

    def _run_step(self, sched: SchedulerOutput) -> tuple[list[str], SamplerOutput | None]:
        """Execute ``sched`` and sample its rows: (sampling request ids, their draws)."""
        rids, logits = self.runner.execute(sched)
        if logits is not None and logits.shape[0] > len(rids):
            _score_prompts(self._states, sched, logits[len(rids):])
            logits = logits[:len(rids)]
        if not rids:
            return [], None
        states = [self._states[rid] for rid in rids]
        params, banned, histories = _sampling_inputs(states)
        matchers = [st.matcher for st in states]
        # A seeded draw depends on (seed, output position) only: a generation worker
        # continuing a context worker's first token draws what one worker would.
        out = self.sampler.sample(
            logits,
            params,
            [st.request.num_output_tokens for st in states],
            banned,
            histories,
            forbidden=self._masks.forbidden(matchers, logits.device),
        )
        return rids, _advance_grammars(matchers, out)

    def _collect_finished_without_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        # The scheduler may end a request during schedule() (e.g. one that can never fit).
        reported = {o.request_id for o in outputs}
        for rid, st in list(self._states.items()):
            if st.request.is_finished() and rid not in reported:
                outputs.append(self._make_output(st, st.detok.flush(), finished=True))
        for o in outputs:
            if o.finished:
                self._states.pop(o.request_id, None)
        return outputs

    def _fail_requests(self, request_ids: list[str], error: str | KVTransferError
                       ) -> list[RequestOutput]:
        outputs = []
        for rid in request_ids:
            st = self._states.get(rid)
            if st is None:
                continue
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            st.request.status = RequestStatus.FINISHED_ERROR
            st.request.error = str(error)
            if isinstance(error, KVTransferError):
                st.kv_error = error
            outputs.append(self._make_output(st, "", finished=True))
        return self._collect_finished_without_step(outputs)

    def _make_output(self, st: _State, delta_text: str, finished: bool) -> RequestOutput:
        if finished:
            self._end(st)
        return st.output(delta_text, finished)

    # ---- introspection --------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv.stats()
        last = self._last_sched
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preempted_total=self.scheduler.num_preemptions_total,
            kv_blocks_used=pool.used,
            kv_blocks_total=pool.total,
            kv_blocks_cached=pool.cached,
            prefix_cache_queries_tokens=self.scheduler.prefix_cache_queries_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            last_step_batch_size=len(last.scheduled) if last else 0,
            last_step_num_tokens=last.num_scheduled_tokens if last else 0,
            steps_total=self._steps,
        )


def role_drain(engine: LLMEngine) -> RoleDrain:
    """Engine thread: what a context / generation worker still holds of its current role
    (context-only requests and their leases, or generation-only requests and their pulls); a
    role switch waits until it is all zero."""
    connector = engine.connector
    if connector is None:
        raise RuntimeError("an aggregated worker has no role to drain")
    leases, pulls = connector.drain_pending()
    states = engine._states.values()
    if connector.role == Role.CONTEXT:
        requests = sum(1 for st in states if st.ctx_params is not None)
    else:
        requests = sum(1 for st in states if st.generation_only)
    return RoleDrain(leases=leases, requests=requests, pulls=pulls)


@dataclass(frozen=True)
class _Add:
    """AsyncLLM command: ``LLMEngine.add_request`` with these arguments."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    context_only: bool
    remote: ContextParams | None
    dummy_kv: bool
    cache_remote_kv: bool
    kv_stream: tuple[int, str] | None = None


@dataclass(frozen=True)
class _Abort:
    """AsyncLLM command: abort a request (its consumer went away)."""

    request_id: str


@dataclass(frozen=True)
class _ReleaseLease:
    """AsyncLLM command: end a context lease now."""

    lease_id: str


@dataclass(frozen=True)
class _SwitchRole:
    """AsyncLLM command: serve ``role`` once the current role drained. ``started`` resolves
    with the first ``RoleDrain`` measured, ``done`` with the last (all zero) when switched."""

    role: str
    started: cf.Future
    done: cf.Future


# What the asyncio side asks of the engine thread, in order.
_Command = _Add | _Abort | _ReleaseLease | _SwitchRole


class AsyncLLM:
    """Runs an LLMEngine on a background thread for asyncio callers (the HTTP server)."""

    def __init__(self, config: EngineConfig, disagg: DisaggSettings | None = None) -> None:
        self.config = config
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.engine = LLMEngine(config, disagg, wake=self._wake.set)
        self.tokenizer = self.engine.tokenizer
        # New on every start: a router seeing another id knows its view of our cache is stale.
        connector = self.engine.connector
        self.worker_id = connector.worker_id if connector is not None else uuid.uuid4().hex
        self.kv_events = KVEventLog()
        self._stop = threading.Event()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._sinks_lock = threading.Lock()
        self._pending_adds = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # A role switch draining (engine thread), and its last measure (read by any thread:
        # an immutable value swapped whole).
        self._switch: _SwitchRole | None = None
        self.role_drain_now: RoleDrain | None = None

    @classmethod
    def from_options(cls, model_dir: str, **options: object) -> AsyncLLM:
        return cls(build_engine_config(model_dir, **options))

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="disagg-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join, 10.0)
        await loop.run_in_executor(None, self.engine.shutdown)

    def is_healthy(self) -> bool:
        return (
            self._thread is not None and self._thread.is_alive() and self._error is None
            and not self._stop.is_set() and self.engine.fatal_error is None
        )

    @property
    def fatal_error(self) -> str | None:
        """Set when the engine can never serve again (a rank died): the server should exit."""
        return self.engine.fatal_error

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the worker's ranks, rank 0 (this process) first."""
        return self.engine.runner.rank_pids

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def transfer(self) -> KVConnector | None:
        """The KV connector of a context / generation worker (None when aggregated)."""
        return self.engine.connector

    def release_remote(self, params: ContextParams) -> None:
        """Release a context lease for a generation-only request refused before it reached
        the engine (thread-safe: the client only submits to its own loop)."""
        if self.engine.connector is not None:
            self.engine.connector.release_remote(params)

    # ---- requests -------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        context_only: bool = False,
        remote: ContextParams | None = None,
        dummy_kv: bool = False,
        cache_remote_kv: bool = False,
        kv_stream: tuple[int, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        try:
            if not self.is_healthy():
                raise EngineDeadError(f"engine is not running: {self._error!r}")
            if params.structured is not None:  # compiled off the event loop (up to ~1 s for
                # a large grammar); validate below then finds it in the cache
                await asyncio.to_thread(self.engine.grammars.compile, params.structured)
            self.engine.validate(prompt_token_ids,
                                 context_only_params(params) if context_only else params)
            max_queue = self.config.scheduler.max_queue
            if max_queue is not None and (
                    self.engine.scheduler.num_waiting + self._pending_adds >= max_queue):
                raise QueueFullError(f"waiting queue is full ({max_queue} requests)")
        except BaseException:
            if remote is not None:  # refused: the context worker must not hold the KV
                self.release_remote(remote)
            raise
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        with self._sinks_lock:
            if request_id in self._sinks:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._sinks[request_id] = (loop, sink)
            self._pending_adds += 1
        self._cmds.put(_Add(request_id, list(prompt_token_ids), params, prompt,
                            time.monotonic(), context_only, remote, dummy_kv, cache_remote_kv,
                            kv_stream))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            with self._sinks_lock:
                self._sinks.pop(request_id, None)
            if not finished:  # consumer went away (client disconnect, cancel): free its blocks
                self._cmds.put(_Abort(request_id))
                self._wake.set()

    def release_lease(self, lease_id: str) -> bool:
        """Ask the engine thread to end a context lease now (thread-safe). True if the lease
        was live when asked."""
        connector = self.engine.connector
        if connector is None or not connector.lease_is_live(lease_id):
            return False
        self._cmds.put(_ReleaseLease(lease_id))
        self._wake.set()
        return True

    async def abort(self, request_id: str) -> None:
        self._cmds.put(_Abort(request_id))
        self._wake.set()

    def switch_role(self, role: str) -> tuple[cf.Future, cf.Future]:
        """Thread-safe: have the engine thread switch the KV connector to ``role`` once the
        current role drained (checked every loop turn: requests finishing, leases ending and
        pulls landing all wake the loop). Returns (started, done) futures (``_SwitchRole``);
        ``done`` fails if the engine stops first or another switch is draining."""
        if self.engine.connector is None:
            raise ValueError("role: an aggregated worker cannot switch role")
        cmd = _SwitchRole(role, cf.Future(), cf.Future())
        self._cmds.put(cmd)
        self._wake.set()
        return cmd.started, cmd.done

    def _advance_switch(self) -> None:
        """Engine thread: measure the draining role switch; switch once nothing is left."""
        sw = self._switch
        if sw is None:
            return
        drain = self.role_drain_now = role_drain(self.engine)
        if not sw.started.done():
            sw.started.set_result(drain)
        if not drain.done:
            return
        assert self.engine.connector is not None
        self.engine.connector.set_role(sw.role)
        self._switch = None
        sw.done.set_result(drain)

    def _fail_switch(self, why: str) -> None:
        sw, self._switch = self._switch, None
        if sw is not None:
            for fut in (sw.started, sw.done):
                if not fut.done():
                    fut.set_exception(RuntimeError(why))

    # ---- the loop thread ------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._sinks_lock:
            target = self._sinks.get(request_id)
        if target is None:
            return
        loop, sink = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            pass

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                with self._sinks_lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(
                        cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.prompt,
                        cmd.arrival_time, context_only=cmd.context_only, remote=cmd.remote,
                        dummy_kv=cmd.dummy_kv, cache_remote_kv=cmd.cache_remote_kv,
                        kv_stream=cmd.kv_stream)
                except Exception as e:  # validation raced with a config change, queue full, ...
                    if cmd.remote is not None:
                        self.release_remote(cmd.remote)
                    self._deliver(cmd.request_id, e)
            elif isinstance(cmd, _Abort):
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    self._deliver(cmd.request_id, out)
            elif isinstance(cmd, _SwitchRole):
                if not cmd.started.set_running_or_notify_cancel():
                    pass  # the server gave up waiting for this turn: not started
                elif self._switch is not None:
                    err = RuntimeError("a role switch is in progress")
                    cmd.started.set_exception(err)
                    cmd.done.set_exception(err)
                else:
                    self._switch = cmd
                    self._advance_switch()
            else:
                self.engine.release_lease(cmd.lease_id)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.engine.fatal_error is not None:
                    raise WorkerDiedError(self.engine.fatal_error)
                # Cleared before the work: a wake-up set meanwhile is not lost.
                self._wake.clear()
                self._drain_commands()
                for out in self.engine.service_transfers():
                    self._deliver(out.request_id, out)
                if self.engine.has_schedulable():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                    self.kv_events.append(self.engine.kv.take_events())
                    self._advance_switch()
                else:
                    self.kv_events.append(self.engine.kv.take_events())  # aborts, releases
                    self._advance_switch()  # leases that ended, pulls that landed
                    # Idle, or only waiting for KV pulls (their futures wake us) and lease
                    # expiries (swept every few hundred ms).
                    self._wake.wait(timeout=self.engine.idle_wait_s())
        except BaseException as e:  # a bug in the engine itself: report and stop serving
            logger.exception("engine loop died")
            self._error = e
            with self._sinks_lock:
                rids = list(self._sinks)
            for rid in rids:
                self._deliver(rid, EngineDeadError(f"engine loop died: {e!r}"))
        finally:
            self._fail_switch("the engine stopped before the role switch was done")
            # Abort whatever is left so nothing waits forever and every block is freed.
            with self._sinks_lock:
                rids = list(self._sinks)
            for rid in rids:
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._deliver(rid, out)
