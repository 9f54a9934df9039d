"""``LLMEngine``: scheduler + model runner + sampler + detokenizer, stepped synchronously
(``add_request`` / ``abort_request`` / ``step``), and ``role_drain``.

A context or generation worker's engine also holds one KV connector (``disagg.kv_connector``;
None on an aggregated worker) and calls its hooks at fixed points: when a request is added
(with its ``KVMode``), before each step runs, for each pull the plan starts, once per loop turn
(``service_transfers``), and when a request ends. Transports, ranks and lease tables stay
behind it; what the engine itself decides is which blocks to hold for a lease (the client's
``max_tokens``), when a lease or a pulled KV's lease is released, and what a role switch
waits for (``role_drain``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from disagg.config import EngineConfig, build_engine_config
from disagg.contracts.kv_mode import LOCAL, ContextOnly, Dummy, KVMode, Local, PrefixPull, Pull
from disagg.contracts.params import ContextParams
from disagg.contracts.roles import RoleDrain
from disagg.engine.admission import context_only_params, validate_request, validate_resumed
from disagg.engine.errors import QueueFullError
from disagg.engine.execution import (
    StepResult,
    build_connector,
    make_executor,
    run_isolating_oom,
)
from disagg.engine.outputs import EngineStats, RequestOutput
from disagg.engine.request_state import (
    RequestState,
    advance_grammars,
    grammar_complete,
    new_matcher,
    sampling_inputs,
    score_prompts,
    take_first,
)
from disagg.kv_cache.manager import KVCacheManager
from disagg.kv_connector.base import KVConnector
from disagg.kv_connector.errors import KVTransferError
from disagg.parallel.executor import DistributedExecutor, WorkerDiedError
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.sampler import Sampler, SamplerOutput
from disagg.scheduler import Scheduler, SchedulerOutput
from disagg.spec_decode import make_proposer
from disagg.spec_decode.verify import SpecCounters, accept, expand_rows
from disagg.structured.grammar import GrammarCache
from disagg.structured.mask import MaskFiller
from disagg.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from disagg.engine.kv_offload import KVOffload
    from disagg.kv_connector.settings import DisaggSettings

logger = logging.getLogger(__name__)

# How a prefix lease is answered (``start_prefix_lease``): (params | None, None) or (None, error).
PrefixReply = Callable[[ContextParams | None, BaseException | None], None]


class LLMEngine:
    """One worker's engine, driven by one thread: ``add_request`` / ``abort_request`` queue
    and end requests, ``step`` schedules, runs the model and samples, ``service_transfers``
    applies what the KV connector reports between steps (module docstring)."""

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
        # Offload tiers below the KV cache (kv_offload.py); None: none configured.
        self.offload: KVOffload | None = None
        if config.cache.kv_offload:
            from disagg.engine.kv_offload import KVOffload

            try:
                # a multi-rank worker: the executor drives the other ranks' tiers
                peers = self.runner if isinstance(self.runner, DistributedExecutor) else None
                self.offload = KVOffload(config.cache, self.runner.kv_cache, wake, peers=peers)
            except BaseException:
                self.runner.shutdown()
                raise
        self.kv = KVCacheManager(self.runner.num_blocks, B, config.cache.enable_prefix_caching,
                                 tiers=self.offload.index if self.offload else None)
        spec = config.speculative
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len=config.max_model_len,
                                   num_spec_tokens=spec.num_speculative_tokens if spec else 0,
                                   spec_disable_batch_size=spec.disable_by_batch_size
                                   if spec else None)
        try:  # speculative decoding (disagg.spec_decode); None: off
            self.proposer = make_proposer(config, self.runner.num_blocks)
        except BaseException:
            self.runner.shutdown()
            raise
        self.spec_counters = SpecCounters()
        self.sampler = Sampler(torch.Generator().manual_seed(config.seed))
        self.grammars = GrammarCache(self.tokenizer.backend, config.model.vocab_size,
                                     self.tokenizer.eos_token_ids)
        self._masks = MaskFiller(config.model.vocab_size)
        self.eos_token_ids = tuple(
            sorted(set(self.tokenizer.eos_token_ids) | set(config.model.eos_token_ids))
        )
        self._states: dict[str, RequestState] = {}
        self._last_sched: SchedulerOutput | None = None
        self._steps = 0
        # Async scheduling (see step()); None: on for CUDA, where the device runs ahead.
        asched = config.scheduler.async_scheduling
        self._async_scheduling = (config.device.startswith("cuda") if asched is None
                                  else asched)
        self._inflight: _InFlight | None = None
        # Peer prefix reuse (kv_peer_reuse): leases made for peers, pulls done and failed;
        # prefix leases waiting for their tier blocks (start_prefix_lease).
        self.peer_prefix_leases = self.peer_prefix_pulls = self.peer_prefix_failed = 0
        self._prefix_replies: dict[str, tuple[list[int], PrefixReply]] = {}
        self.connector: KVConnector | None = None  # None: an aggregated worker
        if disagg is not None:
            try:
                self.connector = build_connector(disagg, config, self.runner,
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
        validate_request(self.config, self.runner.num_blocks, prompt_token_ids, params)
        if params.structured is not None:  # a bad schema / regex / grammar: its own 400
            self.grammars.compile(params.structured)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        mode: KVMode = LOCAL,
        prefix: PrefixPull | None = None,
    ) -> None:
        """Queue a request. ``mode`` (``contracts/kv_mode.py``): where its prompt KV comes from
        and where it goes. A context mode prefills and samples one token only; unless that
        token ends the request (or the client asked for one token) its blocks are leased to a
        generation worker. ``Pull``: a generation-only request whose prompt KV is pulled from
        the context worker its params name (into the prefix cache only when ``trusted``).
        ``Dummy``: decode as if the prompt's KV were in place (a benchmarking aid).
        ``Local.resumed``: a migrated request, its outputs so far given (recomputed here).
        ``prefix``: a peer leased the KV of the prompt's first tokens (``PrefixPull``): pulled
        instead of computed, unless this worker's own cache holds as much (then the lease
        goes back at once). Its lease goes back on every path, a refusal's (raise) included."""
        give_back = prefix is not None and self.connector is not None
        if request_id in self._states:
            if give_back:
                self.connector.release_remote(prefix.params)  # type: ignore[union-attr]
            raise ValueError(f"request_id: {request_id!r} is already in use")
        try:
            self._add_request(request_id, prompt_token_ids, params, prompt, arrival_time, mode,
                              prefix)
        except BaseException:
            # (this request's state, if it got one: its prefix was handed over or not)
            if give_back and ((st := self._states.get(request_id)) is None or st.prefix is None):
                self.connector.release_remote(prefix.params)  # type: ignore[union-attr]
            raise

    def _add_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, prompt: str | None, arrival_time: float | None,
                     mode: KVMode, prefix: PrefixPull | None) -> None:
        if request_id in self._states:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ctx_params = params if mode.is_context else None
        if mode.is_context:
            params = context_only_params(params)
        self.validate(prompt_token_ids, params)
        if isinstance(mode, Local) and mode.resumed:
            validate_resumed(self.config, mode.resumed, params)
        max_queue = self.config.scheduler.max_queue
        if max_queue is not None and self.scheduler.num_waiting >= max_queue:
            raise QueueFullError(f"waiting queue is full ({max_queue} requests)")
        if isinstance(mode, Pull) and self.connector is None:
            raise ValueError("disaggregated_params: this worker cannot pull KV")
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
        )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        st = RequestState.new(req, self.tokenizer, prompt, ctx_params, mode)
        if params.structured is not None:
            st.matcher = new_matcher(self.grammars, req, replay=isinstance(mode, Pull) or (
                isinstance(mode, Local) and bool(mode.resumed)))
        if prefix is not None and self._use_prefix(req, mode, prefix):
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            req.remote_tokens = prefix.num_tokens
        self._states[request_id] = st
        self.scheduler.add_request(req)
        if self.connector is None:
            return
        # Only a request that may go on keeps its blocks: real max_tokens 1 is final anyway.
        lease = ctx_params is not None and ctx_params.max_tokens > 1
        if self.connector.add_request(request_id, mode, lease) and not req.is_finished():
            self.scheduler.hold_blocks_on_finish(request_id)
        if prefix is not None:
            if req.remote_tokens is None or req.is_finished():
                self.connector.release_remote(prefix.params)  # not pulled: given back now
            else:
                st.prefix = prefix
                self.connector.add_prefix(request_id, prefix.params)

    def _use_prefix(self, req: Request, mode: KVMode, prefix: PrefixPull) -> bool:
        """Whether ``req`` pulls the peer's prefix: a ``Local`` or ``ContextOnly`` request
        that scores no prompt tokens, whose prompt goes on after the prefix, and whose own
        prefix cache holds less. ValueError for a prefix that is not this prompt's."""
        if self.connector is None:
            raise ValueError("kv_prefix: this worker cannot pull KV (no kv_peer_reuse)")
        n = prefix.num_tokens
        if not 0 < n < req.num_prompt_tokens or (
                req.prompt_token_ids[:n] != list(prefix.params.prompt_token_ids)):
            raise ValueError("kv_prefix.prompt_token_ids: not a leading part of this prompt")
        if not isinstance(mode, (Local, ContextOnly)) or (
                req.sampling_params.prompt_logprobs is not None):
            return False  # (prompt logprobs need every prompt position computed here)
        _, own = self.kv.get_computed_blocks(req)
        return own < n

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
        return (len(sch.requests) > sch.num_fetching + sch.num_loading
                or sch.num_finished_unreported > 0)

    def idle_wait_s(self) -> float:
        """How long an idle loop may sleep without a wake-up: short while the connector has
        reads in flight or leases to expire."""
        if self.offload is not None and self.offload.busy:
            return 0.05
        return 0.1 if self.connector is not None and self.connector.busy() else 0.5

    def release_lease(self, lease_id: str) -> bool:
        """Engine thread: end a context lease now (the router gave up on the answer)."""
        return self.connector is not None and self.connector.release_lease(lease_id)

    def lease_prefix(self, token_ids: list[int]) -> ContextParams | None:
        """Engine thread: lease the pool blocks that cache the leading full blocks of
        ``token_ids`` for a peer to pull; their params, or None when none is cached. The
        blocks stay referenced (never evicted) until the lease ends. (``start_prefix_lease``
        also brings back what the offload tiers hold.)"""
        lease_id = self._prefix_lease_id()
        blocks = self.scheduler.lease_prefix(lease_id, token_ids, from_tiers=False)
        assert isinstance(blocks, list)
        return self._lease(lease_id, token_ids, blocks)

    def start_prefix_lease(self, token_ids: list[int], reply: PrefixReply) -> None:
        """Engine thread (``POST /kv_prefix``): ``lease_prefix``, and when the prefix chain
        goes on in this worker's offload tiers, those blocks copied back into the pool first
        (the tiers' loader; ``_poll_offload`` finishes it): ``reply(params | None, None)``
        once leased, ``reply(None, error)`` if that failed. At once when no tier block
        follows."""
        lease_id = self._prefix_lease_id()
        held = self.scheduler.lease_prefix(lease_id, token_ids,
                                           from_tiers=self.offload is not None)
        if isinstance(held, list):
            reply(self._lease(lease_id, token_ids, held), None)
            return
        assert self.offload is not None
        self._prefix_replies[lease_id] = (list(token_ids), reply)
        # as after schedule(): blocks the allocation evicted go down first (their bytes are
        # still in place), then the load may write
        self.offload.offload(self.kv.take_evicted())
        self.offload.start([held])

    def _prefix_lease_id(self) -> str:
        if self.connector is None:
            raise ValueError("kv_prefix: this worker has no KV transfer (no kv_peer_reuse)")
        return f"prefix-{uuid.uuid4().hex}"

    def _lease(self, lease_id: str, token_ids: list[int], blocks: list[int]
               ) -> ContextParams | None:
        """Lease ``blocks`` (held by the scheduler under ``lease_id``) for a peer."""
        if not blocks:
            return None
        assert self.connector is not None
        try:
            params = self.connector.lease_prefix(lease_id, token_ids, blocks)
        except BaseException:
            self.scheduler.release_held(lease_id)
            raise
        self.peer_prefix_leases += 1
        return params

    def _prefix_loaded(self, lease_id: str, num_loaded: int) -> None:
        """A peer's prefix lease's tier load finished: lease what is in the pool now."""
        token_ids, reply = self._prefix_replies.pop(lease_id)
        blocks = self.scheduler.end_prefix_load(lease_id, num_loaded)
        try:
            params = self._lease(lease_id, token_ids, blocks)
        except Exception as e:
            reply(None, e)
            return
        reply(params, None)

    def service_transfers(self) -> list[RequestOutput]:
        """Engine thread, never blocks: free blocks of ended leases, expire leases, start
        decoding requests whose pulled KV is in place, fail requests whose pull failed; and
        let requests whose prefix came back from an offload tier compute the rest."""
        if self.offload is not None:
            self._poll_offload()
        if self.connector is None:
            return []
        polled = time.monotonic()  # (a pull's kv_install starts here: timing.py)
        done = self.connector.get_finished()
        for rid in done.leases_ended:
            self.scheduler.release_held(rid)
        for rid in done.loads_stopped:
            self.scheduler.release_draining(rid)
        outputs: list[RequestOutput] = []
        for rid in done.loaded:
            st = self._states.get(rid)
            if st is not None and st.prefix is not None:  # a peer's prefix: prefill the rest
                self.scheduler.remote_kv_ready(rid, cache=st.prefix.trusted)
                self.peer_prefix_pulls += 1
                st.prefix = None
            elif st is not None:
                st.metrics.kv_poll_time = polled
                outputs.append(self._kv_in_place(st, done.first.get(rid)))
        for rid, error in done.prefix_failed:
            logger.warning("request %s: %s; it computes that prefix itself", rid, error)
            self.scheduler.remote_kv_failed(rid)
            self.peer_prefix_failed += 1
            if (st := self._states.get(rid)) is not None:
                st.prefix = None
        for rid, error in done.failed:
            logger.warning("request %s: %s", rid, error)
            outputs.extend(self._fail_requests([rid], error))
            self.scheduler.release_draining(rid)  # its reads ended: nothing writes any more
        return self._collect_finished_without_step(outputs) if outputs else outputs

    def _poll_offload(self) -> None:
        """Loads from the offload tiers that finished: their requests run (what did not
        come is computed); an aborted one's blocks are free again (nothing writes them)."""
        assert self.offload is not None
        sch = self.scheduler
        for done in self.offload.poll(lambda rid: rid in sch.loading
                                      or rid in sch.prefix_loads):
            if done.request_id in sch.loading:
                sch.tier_kv_ready(done.request_id, done.num_loaded)
            elif done.request_id in sch.prefix_loads:
                self._prefix_loaded(done.request_id, done.num_loaded)
            else:
                sch.release_draining(done.request_id)

    def _offload_plan(self, sched: SchedulerOutput) -> None:
        """Right after ``schedule()``: copy the blocks it evicted into the tiers (nothing has
        written them yet: pulls and the step start after this) and start its tier loads."""
        assert self.offload is not None
        self.offload.offload(self.kv.take_evicted())
        if sched.kv_loads:
            self.offload.start(sched.kv_loads)

    def _kv_in_place(self, st: RequestState, first: Mapping[str, Any] | None = None
                     ) -> RequestOutput:
        """A request's prompt KV is in its blocks (pulled, or dummy): it decodes from the next
        step; its first output carries the context worker's token(s) (streamed: ``first``,
        which came with the last read, so they may also end it: a stop, max_tokens)."""
        rid, now = st.request.request_id, time.monotonic()
        end = take_first(st, first, self.scheduler) if first is not None else None
        st.metrics.first_scheduled_time = st.metrics.first_scheduled_time or now
        if st.metrics.kv_poll_time is None:  # (dummy KV: nothing was polled)
            st.metrics.kv_poll_time = now
        st.metrics.first_token_time = now
        st.metrics.last_token_time = now
        delta = "".join(st.detok.update(t) for t in st.request.output_token_ids)
        if st.detok.stopped or (st.matcher is not None and st.matcher.done):
            st.request.stop_reason = st.detok.stop_reason
            end = RequestStatus.FINISHED_STOPPED
        # A streamed answer that ends here may have read blocks its context worker freed at
        # once (a stop is final there): such KV is never used, and never cached.
        cache = (isinstance(st.mode, Pull) and st.mode.trusted
                 and (first is None or end is None))
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
            st.metrics.kv_load_start_time = time.monotonic()
            if isinstance(st.mode, Dummy):
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

    def _end(self, st: RequestState) -> None:
        """The request ended: tell the connector once (a context-only answer that may go on
        gets its lease there), and free blocks the scheduler held for it unless leased."""
        if st.ended:
            return
        st.ended = True
        req = st.request
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
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

    @property
    def async_scheduling(self) -> bool:
        """Whether ``step`` launches plans of plain decodes early (DESIGN 8)."""
        return self._async_scheduling

    def set_async_scheduling(self, on: bool) -> None:
        """Switch the loop's mode between steps (benchmarks compare both in one engine); not
        while a launched plan waits to be read."""
        if self._inflight is not None:
            raise RuntimeError("a launched plan is in flight: step() first")
        self._async_scheduling = bool(on)

    def has_unfinished(self) -> bool:
        return bool(self._states)

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can no longer run steps (a rank of a parallel worker died)."""
        return self.runner.error

    def shutdown(self) -> None:
        """Release the executor (stops and reaps the other ranks of a parallel worker)."""
        self._inflight = None
        if self.connector is not None:
            self.connector.shutdown()
        if self.offload is not None:
            self.offload.close()
        self.runner.shutdown()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._inflight is not None:  # async scheduling: the plan the last call launched
            return self._complete(self._inflight)
        if self.offload is not None:
            if self.offload.busy and not self.has_schedulable():
                self.offload.wait(0.05)  # (an offline loop: only tier loads are left)
            self._poll_offload()
        sched = self.scheduler.schedule()
        if self.offload is not None:
            self._offload_plan(sched)
        if self.proposer is not None and sched.num_decodes:
            sched = self._propose(sched)
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
            sampled, accepted, sampling_failed = self._execute(sched)
        except WorkerDiedError:
            raise  # not this step's fault: the engine cannot go on (AsyncLLM stops)
        except Exception as e:  # the step failed: fail its requests, keep the loop alive
            logger.exception("engine step failed")
            outputs += self._fail_requests([r.request_id for r in sched.scheduled], repr(e))
            self.scheduler.update_from_output(sched, {})  # every plan entry is now stale
            return outputs
        return self._finish_step(sched, sampled, accepted, sampling_failed, outputs)

    def _finish_step(self, sched: SchedulerOutput, sampled: dict[str, int],
                     accepted: dict[str, list[int]], sampling_failed: list[tuple[str, str]],
                     outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Apply a step's sampled tokens (scheduler, then detokenizer and stops) and build
        its outputs; under async scheduling the next plan is launched in between, so the
        device runs it while this step's outputs are built."""
        # A request whose own sampling failed ends alone; its batch-mates go on. Finished
        # before update_from_output, which then ignores its plan entry.
        for rid, err in sampling_failed:
            logger.warning("request %s: %s", rid, err)
            outputs += self._fail_requests([rid], err)
        # Output counts of the requests that checked drafts: their new tokens are walked
        # one by one after the scheduler appended them (_walk_verified).
        verified = {r.request_id: self._states[r.request_id].request.num_output_tokens
                    for r in sched.scheduled if r.num_spec and r.request_id in sampled}
        finished = {r.request_id
                    for r in self.scheduler.update_from_output(sched, sampled, accepted)}
        if self._async_scheduling:
            outputs += self._launch_next()
        outputs += self._outputs_of_step(sampled, finished, verified)
        return self._collect_finished_without_step(outputs)

    # ---- async scheduling -----------------------------------------------------------------
    #
    # One plan in flight at most. A call of step() reads the tokens of the plan launched by
    # the call before (waiting for its sampling only, not for the plan launched after it),
    # applies them to the scheduler, schedules and launches the next plan, and only then
    # detokenizes and builds this step's outputs, while the device computes:
    #
    #   host:   read k | update k | schedule + launch k+1 | detokenize k, outputs k | read k+1
    #   device: ... k  |          (idle)                  | forward + sample k+1 ...
    #
    # Only a plan of plain decodes is launched early (every running request decodes, none
    # waits, no grammar, no drafts): their input tokens are known once step k is applied.
    # A stop string found in step k's text (or an abort) ends a request whose next token is
    # already in flight: that token is dropped (update_from_output ignores stale entries) and
    # its KV lands in a block that was freed, which nothing can read before the stream has
    # run it (every later write is queued behind it).

    def _can_launch_next(self) -> bool:
        if self.proposer is not None:
            return False
        sch = self.scheduler
        if sch.waiting or not sch.running:
            return False
        for req in sch.running:
            st = self._states.get(req.request_id)
            if (st is None or st.matcher is not None
                    or req.num_computed_tokens != req.num_tokens - 1):
                return False
        return True

    def _launch_next(self) -> list[RequestOutput]:
        """Schedule and launch the next plan now when it is all plain decodes (see above);
        returns outputs owed by the scheduling itself (KV loads that failed to start)."""
        if not self._can_launch_next():
            return []
        sched = self.scheduler.schedule()
        if self.offload is not None:
            self._offload_plan(sched)
        self._last_sched = sched
        self._steps += 1
        outputs = self._start_loads(sched) if sched.kv_fetches else []
        if not sched.scheduled:
            self.scheduler.update_from_output(sched, {})
            return outputs
        if self.connector is not None:
            self.connector.start_step(sched)
        try:
            self._inflight = self._launch(sched)
        except WorkerDiedError:
            raise
        except torch.cuda.OutOfMemoryError:  # the synchronous path isolates the request
            result = self._execute(sched)
            self._inflight = _InFlight(sched, lambda: result)
        except Exception as e:  # failed at launch: failed when read (the step's requests)
            err = e
            self._inflight = _InFlight(sched, lambda: _raise(err))
        return outputs

    def _launch(self, sched: SchedulerOutput) -> _InFlight:
        """Queue the forward and the sampling of a plain-decode plan on the device; the
        tokens are read by ``_complete`` (the next call of ``step``)."""
        rids, logits = self.runner.execute(sched)
        if not rids or logits is None:
            return _InFlight(sched, lambda: ({}, {}, []))
        states = [self._states[rid] for rid in rids]
        params, banned, histories = sampling_inputs(states)
        fetch = self.sampler.sample_deferred(
            logits, params, [st.request.num_output_tokens for st in states], banned, histories)
        return _InFlight(sched, lambda: self._merge_results([(rids, fetch())]))

    def _complete(self, inflight: _InFlight) -> list[RequestOutput]:
        self._inflight = None
        sched = inflight.sched
        try:
            sampled, accepted, sampling_failed = inflight.finish()
        except WorkerDiedError:
            raise
        except Exception as e:
            logger.exception("engine step failed")
            outputs = self._fail_requests([r.request_id for r in sched.scheduled], repr(e))
            self.scheduler.update_from_output(sched, {})
            return outputs
        return self._finish_step(sched, sampled, accepted, sampling_failed, [])

    def _propose(self, sched: SchedulerOutput) -> SchedulerOutput:
        """Fill the decodes' draft slots from the proposer (cut where a request's grammar
        refuses a draft); decodes with drafts move behind the plain ones (the runner's
        first ``num_decodes`` entries take exactly one token)."""
        assert self.proposer is not None
        decodes = sched.scheduled[:sched.num_decodes]
        entries = [(self._states[r.request_id].request, r) for r in decodes if r.spec_slots]
        if not entries:
            return sched
        drafts = self.proposer.propose(entries)
        plain, checked = [], []
        for r in decodes:
            d = drafts.get(r.request_id, [])[:r.spec_slots]
            m = self._states[r.request_id].matcher
            if d and m is not None:
                d = d[:m.valid_prefix(d)]
            (checked.append(r.with_drafts(d)) if d else plain.append(r))
        if not checked:
            return sched
        scheduled = plain + checked + sched.scheduled[sched.num_decodes:]
        return replace(sched, scheduled=scheduled, num_decodes=len(plain),
                       num_scheduled_tokens=sum(len(r.token_ids) for r in scheduled))

    def _execute(self, sched: SchedulerOutput) -> tuple[
            dict[str, int], dict[str, list[int]], list[tuple[str, str]]]:
        """Run the plan and sample: (token by request id, the drafts accepted before it by
        request id (requests that checked drafts), requests whose own sampling or memory
        failed with why)."""
        oom_failed: list[tuple[str, str]] = []
        try:
            results = [self._run_step(sched)]
        except torch.cuda.OutOfMemoryError:
            results = []  # retried below, once the error (and the frames holding the failed
            # forward's activations) is released
        if not results:
            # A request too large for the memory left fails alone: re-run in smaller groups.
            results, oom_failed = run_isolating_oom(self._run_step, sched)
        sampled, accepted, sampling_failed = self._merge_results(results)
        return sampled, accepted, sampling_failed + oom_failed

    def _merge_results(self, results: list[tuple[list[str], SamplerOutput | None]]) -> tuple[
            dict[str, int], dict[str, list[int]], list[tuple[str, str]]]:
        """Sampled tokens, accepted drafts and per-request failures of a step's results;
        logprobs go into the requests' states. Requests ended meanwhile (an abort while their
        plan was in flight) are skipped."""
        sampled: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        sampling_failed: list[tuple[str, str]] = []
        for rids, out in results:
            if out is None:
                continue
            for i, (rid, tok, lp, err) in enumerate(zip(rids, out.token_ids, out.logprobs,
                                                        out.errors, strict=True)):
                st = self._states.get(rid)
                if st is None:
                    continue
                if err is not None:
                    sampling_failed.append((rid, err))
                    continue
                sampled[rid] = tok
                if out.accepted is not None and out.accepted[i]:
                    accepted[rid] = out.accepted[i]
                    if st.logprobs is not None and out.accepted_logprobs is not None:
                        st.logprobs.extend(e or {} for e in out.accepted_logprobs[i])
                if st.logprobs is not None and lp is not None:
                    st.logprobs.append(lp)
        return sampled, accepted, sampling_failed

    def _outputs_of_step(self, sampled: dict[str, int], finished: set[str],
                         verified: Mapping[str, int]) -> list[RequestOutput]:
        """Detokenize the sampled tokens (a stop string ends a request here) and build the
        outputs; ``finished``: the requests the scheduler ended this step (updated);
        ``verified``: requests that checked drafts, with their output count before the
        step."""
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        states = self._states  # (the loop runs once per request and step)
        for rid, tok in sampled.items():
            st = states[rid]
            metrics = st.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if verified and rid in verified:
                delta = self._walk_verified(st, verified[rid], finished)
                outputs.append(self._make_output(st, delta, finished=rid in finished))
                continue
            detok = st.detok
            delta = detok.update(tok)
            if detok.stopped and rid not in finished:
                st.request.stop_reason = detok.stop_reason
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                finished.add(rid)
            elif st.matcher is not None and st.matcher.done:
                grammar_complete(self.scheduler, st.request, finished)
            if rid not in finished:
                outputs.append(st.output(delta, False))  # (_make_output of one going on)
                continue
            if not detok.stopped:
                delta += detok.flush()
            outputs.append(self._make_output(st, delta, finished=True))
        # Requests the scheduler ended without sampling (errors) still owe a final output.
        for rid in finished - set(sampled) if finished else ():
            st = self._states.get(rid)
            if st is None:  # aborted after the scheduler refused it: reported by the abort
                continue
            outputs.append(self._make_output(st, st.detok.flush(), finished=True))
        return outputs

    def _walk_verified(self, st: RequestState, before: int, finished: set[str]) -> str:
        """The tokens a draft-checking step appended (``output[before:]``), one at a time as
        single steps would have seen them: detokenizer (a stop string ends the request at its
        token), grammar matcher (a complete grammar ends it too); tokens after such an end are
        dropped. Returns the new text."""
        req, rid = st.request, st.request.request_id
        new = req.output_token_ids[before:]
        m = st.matcher
        delta = ""
        end = len(new)  # tokens kept
        for i, t in enumerate(new):
            delta += st.detok.update(t)
            if m is not None and not m.consume(t):
                req.error = m.error
                end = i + 1
                break
            if st.detok.stopped or (m is not None and m.done):
                end = i + 1
                break
        cut = end < len(new)  # the scheduler's own stop (or max_tokens) came later
        if cut:
            del req.output_token_ids[before + end:]
            req.stop_reason = None
        if st.logprobs is not None:
            del st.logprobs[len(req.output_token_ids):]
        if req.error is not None:
            if rid not in finished:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
                finished.add(rid)
            req.status = RequestStatus.FINISHED_ERROR
        elif st.detok.stopped and (cut or rid not in finished):
            req.stop_reason = st.detok.stop_reason
            if rid not in finished:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                finished.add(rid)
            req.status = RequestStatus.FINISHED_STOPPED
        elif m is not None and m.done:  # ends with "stop", whatever the scheduler said
            grammar_complete(self.scheduler, req, finished)
        if rid in finished and not st.detok.stopped:
            delta += st.detok.flush()
        return delta

    def _run_step(self, sched: SchedulerOutput) -> StepResult:
        """Execute ``sched`` and sample its rows: (sampling request ids, their draws)."""
        rids, logits = self.runner.execute(sched)
        # each sampling entry's drafts (the last num_spec of its tokens), in rids' order
        drafts = [sr.token_ids[len(sr.token_ids) - sr.num_spec:] if sr.num_spec else []
                  for sr in sched.scheduled if sr.sample]
        num_rows = len(rids) + sum(len(d) for d in drafts)
        if logits is not None and logits.shape[0] > num_rows:
            score_prompts(self._states, sched, logits[num_rows:])
            logits = logits[:num_rows]
        if not rids:
            return [], None
        states = [self._states[rid] for rid in rids]
        params, banned, histories = sampling_inputs(states)
        matchers = [st.matcher for st in states]
        if num_rows > len(rids):
            return rids, self._verify(logits, states, params, histories, drafts)
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
        return rids, advance_grammars(matchers, out)

    def _verify(self, logits: torch.Tensor, states: list[RequestState],
                params: list[SamplingParams],
                histories: list[tuple[list[int], list[int]]] | None,
                drafts: list[list[int]]) -> SamplerOutput:
        """Sample every checked position as single steps would (``spec_decode.verify``) and
        keep the drafts the target drew itself. Matchers of requests with drafts advance in
        ``_walk_verified``; the others' here."""
        rows = expand_rows(params, [st.request.num_output_tokens for st in states],
                           [st.banned_until_min for st in states], histories, drafts)
        matchers = [st.matcher for st in states]
        out = accept(self.sampler.sample(
            logits, rows.params, rows.positions, rows.banned, rows.histories,
            forbidden=self._masks.forbidden_with_drafts(matchers, drafts, logits.device)),
            drafts)
        self.spec_counters.record(drafts, out.accepted or [])
        return advance_grammars([None if d else m for m, d in zip(matchers, drafts,
                                                                    strict=True)], out)

    def _collect_finished_without_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        # The scheduler may end a request during schedule() (e.g. one that can never fit).
        reported = {o.request_id for o in outputs}
        for rid, st in list(self._states.items()):
            if rid not in reported and st.request.is_finished():
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

    def _make_output(self, st: RequestState, delta_text: str, finished: bool) -> RequestOutput:
        if finished:
            self._end(st)
        return st.output(delta_text, finished)

    # ---- introspection --------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv.stats()
        last = self._last_sched
        return EngineStats(
            num_running=self.scheduler.num_running,
            # As vLLM counts them: a request whose prompt KV is being pulled waits too.
            num_waiting=(self.scheduler.num_waiting + self.scheduler.num_fetching
                         + self.scheduler.num_loading),
            num_waiting_for_kv=self.scheduler.num_fetching,
            num_preempted_total=self.scheduler.num_preemptions_total,
            kv_blocks_used=pool.used,
            kv_blocks_total=pool.total,
            kv_blocks_cached=pool.cached,
            prefix_cache_queries_tokens=self.scheduler.prefix_cache_queries_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            last_step_batch_size=len(last.scheduled) if last else 0,
            last_step_num_tokens=last.num_scheduled_tokens if last else 0,
            steps_total=self._steps,
            spec_num_drafts=self.spec_counters.num_drafts,
            spec_num_draft_tokens=self.spec_counters.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_counters.num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_counters.accepted_per_pos),
            kv_offload=self.offload.stats() if self.offload is not None else None,
            peer_prefix_leases=self.peer_prefix_leases,
            peer_prefix_pulls=self.peer_prefix_pulls,
            peer_prefix_failed=self.peer_prefix_failed,
            peer_prefix_tokens=self.scheduler.peer_prefix_tokens,
        )


def role_drain(engine: LLMEngine) -> RoleDrain:
    """Engine thread: what a context / generation worker still holds of its current role
    (context-only requests and their leases, or generation-only requests and their pulls); a
    role switch waits until it is all zero."""
    connector = engine.connector
    if connector is None:
        raise RuntimeError("an aggregated worker has no role to drain")
    leases, pulls = connector.drain_pending()
    # the requests whose mode needs the current role (context, or pulled / dummy KV)
    requests = sum(1 for st in engine._states.values() if st.mode.needs_role == connector.role)
    return RoleDrain(leases=leases, requests=requests, pulls=pulls)


@dataclass
class _InFlight:
    """A launched plan (async scheduling): ``finish()`` waits for its sampled tokens and
    returns (sampled, accepted, failed) as ``LLMEngine._execute`` does."""

    sched: SchedulerOutput
    finish: Callable[[], tuple[dict[str, int], dict[str, list[int]], list[tuple[str, str]]]]


def _raise(e: BaseException) -> NoReturn:
    raise e
