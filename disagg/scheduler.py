"""In-flight batching scheduler, the way TensorRT-LLM batches (torch-free).

One call to ``schedule`` plans one model step (an iteration):

1. generation first: every RUNNING request that is decoding gets its 1 token;
2. then RUNNING requests in the middle of a chunked prefill get their next chunk;
3. then WAITING requests, first come first served, with prefix-cache hits applied;
   a request whose KV comes from another worker (WAITING_FOR_REMOTE_KV) takes its place in the
   same queue: it gets blocks for its prompt and is listed in ``kv_fetches``; the engine's KV
   connector pulls the KV and the engine calls ``remote_kv_ready``, after which the request
   decodes like any other (a peer's prefix, ``Request.remote_tokens``: blocks for those tokens,
   and after ``remote_kv_ready`` it prefills the rest; ``remote_kv_failed``: all of it);
   a request whose prefix chain goes on in the offload tiers after the pool's hits
   (WAITING_FOR_TIER_KV) gets blocks for those too and is listed in ``kv_loads``; the engine
   copies them back and calls ``tier_kv_ready``, after which it prefills the rest;
4. with speculative decoding, last, draft slots for the decodes from the tokens and free
   blocks left (``_grant_draft_slots``): the engine's proposer fills them;

within ``max_batch_size`` requests and ``max_num_tokens`` tokens per step (a decode counts one
token, a prefill chunk its length). A prompt that does not fit the tokens left waits for the
next step, unless chunked context is on: then it takes what is left, rounded down to whole KV
blocks, and goes on in the next step (which is also what lets a prompt exceed
``max_num_tokens``). Under GUARANTEED_NO_EVICT a request is admitted only when blocks for its
whole life (prompt + max_tokens) can be reserved, and nothing is ever preempted; under
MAX_UTILIZATION it is admitted on the blocks it needs now, and when blocks run out the request
started last is preempted and later recomputed.

This module is status bookkeeping only: which requests wait, run, wait for remote KV, or keep
their blocks after finishing (``held``: leased to a generation worker; ``draining``: ended
while their KV was arriving, until the transfer stopped writing); moving KV between workers is
the connector's (``disagg.kv_connector``). The engine runs the
model on the plan and calls ``update_from_output`` with the sampled tokens; that is where
``num_computed_tokens`` advances, full blocks enter the prefix cache and stops are checked.

A request's state is ``num_computed_tokens`` (KV in the cache) catching up with ``num_tokens``
(prompt + generated). It samples in the step where they become equal.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from disagg.config import CapacityPolicy, SchedulerConfig
from disagg.kv_cache.manager import KVCacheManager
from disagg.request import Request, RequestStatus, SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step: all_tokens[start_pos:start_pos+n]
    start_pos: int  # num_computed_tokens before the step (positions start here)
    block_ids: list[int]  # the full block table after allocation
    sample: bool  # True if this step reaches num_tokens (a token is sampled)
    # Positions p < prompt_logits_end of this chunk also get logits (they score prompt token
    # p + 1: prompt_logprobs); 0 for requests that do not ask.
    prompt_logits_end: int = 0
    # Speculative decoding. ``spec_slots``: draft tokens this decode may carry (the scheduler
    # reserved slots and token budget for them); ``num_spec``: the drafts it carries, the last
    # ``num_spec`` of ``token_ids`` (set by the engine, ``with_drafts``). Such an entry gets
    # logits at each of its last 1 + num_spec positions: the target's check of every draft.
    spec_slots: int = 0
    num_spec: int = 0

    @classmethod
    def decode(cls, request_id: str, token: int, start_pos: int, block_ids: list[int]
               ) -> ScheduledRequest:
        """``ScheduledRequest(request_id, [token], start_pos, block_ids, True)``, built
        without the frozen dataclass ``__init__`` (a setattr call per field): the scheduler
        makes one per decoding request and step (test_scheduler checks the two agree)."""
        self = object.__new__(cls)
        self.__dict__.update(request_id=request_id, token_ids=[token], start_pos=start_pos,
                             block_ids=block_ids, sample=True, prompt_logits_end=0,
                             spec_slots=0, num_spec=0)
        return self

    def with_drafts(self, drafts: list[int]) -> ScheduledRequest:
        """This decode carrying ``drafts`` (at most ``spec_slots``) after its last token."""
        if not 0 < len(drafts) <= self.spec_slots or len(self.token_ids) != 1:
            raise ValueError(f"{self.request_id}: {len(drafts)} drafts for a decode with "
                             f"{self.spec_slots} draft slots")
        return replace(self, token_ids=[*self.token_ids, *drafts], num_spec=len(drafts))

    @property
    def prompt_logit_positions(self) -> range:
        """Positions of this chunk whose logits score the next prompt token, in order:
        [start_pos, min(start_pos + n, prompt_logits_end))."""
        return range(self.start_pos,
                     max(self.start_pos, min(self.start_pos + len(self.token_ids),
                                             self.prompt_logits_end)))


@dataclass(frozen=True)
class KVFetch:
    """Blocks allocated for a request whose prompt KV is pulled from a context worker."""

    request_id: str
    block_ids: list[int]  # the request's block table: token p -> block_ids[p // B]
    num_tokens: int  # KV of positions [0, num_tokens) arrives (the whole prompt)


@dataclass(frozen=True)
class KVLoad:
    """Blocks allocated for prefix blocks that an offload tier holds: ``block_ids[i]`` gets
    the block cached as ``block_hashes[i]``; they follow the request's pool hits."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[int]


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes (1 token each) first, then prefill chunks
    num_decodes: int  # len of the leading decode part
    num_scheduled_tokens: int
    preempted: list[str]  # request ids preempted this step
    num_running: int  # after scheduling (for metrics)
    num_waiting: int
    kv_fetches: list[KVFetch] = field(default_factory=list)  # transfers to start now
    kv_loads: list[KVLoad] = field(default_factory=list)  # tier copies to start now


@dataclass
class _Step:
    """Book-keeping of the step being planned."""

    token_budget: int
    decodes: dict[str, ScheduledRequest] = field(default_factory=dict)
    prefills: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    fetches: list[KVFetch] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)

    @property
    def num_scheduled(self) -> int:
        return len(self.decodes) + len(self.prefills)

    def is_scheduled(self, request_id: str) -> bool:
        return request_id in self.decodes or request_id in self.prefills

    def unschedule(self, request_id: str) -> None:
        """Drop a request planned earlier in this step (it was preempted) and refund its
        tokens."""
        sr = self.decodes.pop(request_id, None)
        if sr is None:
            sr = self.prefills.pop(request_id, None)
        if sr is not None:
            self.token_budget += len(sr.token_ids) + sr.spec_slots


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 max_model_len: int | None = None, num_spec_tokens: int = 0,
                 spec_disable_batch_size: int | None = None) -> None:
        self.config = config
        # Speculative decoding: draft slots reserved per decode (0: off), none in a step of
        # spec_disable_batch_size decodes or more; see _grant_draft_slots.
        self.num_spec_tokens = num_spec_tokens
        self.spec_disable_batch_size = spec_disable_batch_size
        self.kv = kv
        self.block_size = kv.block_size
        # The engine passes the resolved limit (config or the model's max positions).
        self.max_model_len = max_model_len if max_model_len is not None else config.max_model_len
        self.no_evict = config.capacity_policy == CapacityPolicy.GUARANTEED_NO_EVICT
        # Chunk ends are aligned to block boundaries so every chunk but the last fills whole
        # blocks (they can be cached right away). A budget below one block could then never
        # make progress, so alignment is dropped when max_num_tokens < B.
        self._chunk_align = self.block_size if config.max_num_tokens >= self.block_size else 1

        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go to the front
        self.running: list[Request] = []  # in start order: the last started is the last one
        # WAITING_FOR_REMOTE_KV requests holding blocks while their KV is being pulled.
        self.fetching: dict[str, Request] = {}
        # WAITING_FOR_TIER_KV requests: their load, and whether this is their first admission
        # (a recomputation after preemption hitting its own blocks is no prompt-cache hit).
        self.loading: dict[str, tuple[Request, KVLoad, bool]] = {}
        # Prefix leases for a peer whose chain goes on in the offload tiers: the probe
        # holding the blocks, its load, and its pool hits (lease_prefix).
        self.prefix_loads: dict[str, tuple[Request, KVLoad, int]] = {}
        # Context-only requests whose blocks outlive them (leased to a generation worker):
        # marked by hold_blocks_on_finish, then block ids by request id until release_held.
        self._hold: set[str] = set()
        self.held: dict[str, list[int]] = {}
        # Fetching requests that finished (abort, error) while their transfer may still write
        # into their blocks: block ids by request id, out of the pool until release_draining
        # (the connector said the transfer stopped writing).
        self.draining: dict[str, list[int]] = {}
        # Requests finished outside update_from_output (rejected by add_request), returned by
        # its next call so the engine reports every finish in one place.
        self._finished_early: list[Request] = []

        # Counters for engine metrics.
        self.num_preemptions_total = 0
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.peer_prefix_tokens = 0  # prompt tokens whose KV was pulled from a peer's cache

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_fetching(self) -> int:
        return len(self.fetching)

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    @property
    def num_finished_unreported(self) -> int:
        """Requests refused by ``add_request`` that ``update_from_output`` has not returned."""
        return len(self._finished_early)

    def has_unfinished(self) -> bool:
        """True while a request is unfinished, or finished but not yet returned by
        ``update_from_output`` (so an engine loop keeps stepping until it has reported it)."""
        return bool(self.requests) or bool(self._finished_early)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def lifetime_tokens(self, req: Request) -> int:
        """Tokens the request may ever hold: prompt + max_tokens, capped by max_model_len."""
        total = req.max_total_tokens
        if self.max_model_len is not None:
            total = min(total, self.max_model_len)
        return total

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request: WAITING, or WAITING_FOR_REMOTE_KV (its prompt KV will be pulled
        from another worker; its output already holds the token(s) that worker sampled).

        A request that could never run (empty prompt, longer than max_model_len, larger than the
        whole KV cache, or than max_num_tokens without chunking) is finished at once with
        FINISHED_ERROR and ``req.error`` set; check ``req.is_finished()`` after the call. It is
        also returned by the next ``update_from_output``."""
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already queued")
        if req.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KV):
            raise ValueError(f"request {req.request_id!r} has status {req.status.value}; "
                             f"expected waiting")
        error = self._never_fits(req)
        if error is not None:
            req.status = RequestStatus.FINISHED_ERROR
            req.error = error
            self._finished_early.append(req)
            return
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _never_fits(self, req: Request) -> str | None:
        """Why ``req`` can never be scheduled, or None. Without this check such a request
        would wait at the head of the FCFS queue forever and block everything behind it."""
        n = req.num_prompt_tokens
        if n == 0:
            return "prompt is empty"
        if self.max_model_len is not None and n > self.max_model_len:
            return f"prompt has {n} tokens, more than max_model_len={self.max_model_len}"
        if not self.config.enable_chunked_context and n > self.config.max_num_tokens:
            return (f"prompt has {n} tokens, more than max_num_tokens="
                    f"{self.config.max_num_tokens}, and chunked context is disabled")
        need = self.kv.blocks_needed(self.lifetime_tokens(req))
        if need > self.kv.num_blocks:
            return (f"prompt + max_tokens = {self.lifetime_tokens(req)} tokens need {need} KV "
                    f"blocks, but the cache has only {self.kv.num_blocks}")
        return None

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as FINISHED_ABORTED and free its blocks at once (None if unknown)."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request from outside (a stop string, an abort, an error): frees its blocks,
        or moves them to ``draining`` when its KV was being pulled or copied back from a tier.
        Returns it, or None if it is unknown or already finished. An entry of it in a plan
        already handed out is ignored by ``update_from_output``."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        # a pull (remote KV) or a tier load may still write into its blocks
        being_written = False
        loading = self.loading.pop(request_id, None)
        if req.status == RequestStatus.RUNNING:
            _remove_identical(self.running, req)
        elif loading is not None:
            assert self.kv.tiers is not None
            self.kv.tiers.unpin(loading[1].block_hashes)
            being_written = True
        elif self.fetching.pop(request_id, None) is None:
            _remove_identical(self.waiting, req)
        else:
            being_written = True
        req.status = status  # before kv.free: a finished request's hash chain is dropped
        if being_written:  # not reusable until the writer stopped (release_draining)
            self.draining[request_id] = self.kv.detach(req)
        else:
            self.kv.free(req)
        self._hold.discard(request_id)
        return req

    def release_draining(self, request_id: str) -> bool:
        """Free the blocks of a finished fetching request: its transfer can no longer write
        into them. Returns False if nothing was draining for it."""
        blocks = self.draining.pop(request_id, None)
        if blocks is None:
            return False
        self.kv.free_blocks(blocks)
        return True

    # -- KV that crosses workers -------------------------------------------------------------

    def remote_kv_ready(self, request_id: str, cache: bool = True) -> None:
        """The prompt KV of a fetching request is in its blocks: it decodes from the next step
        (its last sampled token, from the context worker, is the one token left to compute);
        a peer's prefix (``remote_tokens``): it prefills the rest from the next step.
        ``cache=False``: the blocks' contents are not the prompt's (benchmark gen-only), or
        not vouched for (an unsigned pull), so they must never serve a prefix hit."""
        req = self.fetching.pop(request_id)
        if req.remote_tokens is None:
            req.num_computed_tokens = req.num_prompt_tokens
        else:
            req.num_computed_tokens = req.num_cached_tokens = req.remote_tokens
            self.peer_prefix_tokens += req.remote_tokens
        if cache:
            self.kv.cache_blocks(req, req.num_computed_tokens)
        else:
            self.kv.never_cache(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def remote_kv_failed(self, request_id: str) -> None:
        """A fetching request's pull of a peer's prefix failed (it ended: nothing writes its
        blocks any more): it computes the whole prompt in the blocks it holds, from the next
        step. (A whole-prompt pull that fails fails its request instead.)"""
        req = self.fetching.pop(request_id)
        if req.remote_tokens is None:
            raise ValueError(f"{request_id}: not a prefix pull")
        req.remote_tokens = None
        req.num_computed_tokens = 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def end_prefix_load(self, lease_id: str, num_loaded: int) -> list[int]:
        """The tier load of a prefix lease finished, its first ``num_loaded`` blocks in
        place: those enter the prefix cache, the rest are freed, and the hits + loaded blocks
        are held under ``lease_id`` (as ``lease_prefix`` holds pool hits); returns them
        (empty: none)."""
        probe, load, h = self.prefix_loads.pop(lease_id)
        assert self.kv.tiers is not None
        self.kv.tiers.unpin(load.block_hashes)
        keep = h + max(0, min(num_loaded, len(load.block_ids)))
        self.kv.cache_blocks(probe, keep * self.block_size)
        table = self.kv.detach(probe)
        self.kv.free_blocks(table[keep:])
        if keep:
            self.held[lease_id] = table[:keep]
        return table[:keep]

    def lease_prefix(self, lease_id: str, token_ids: list[int], from_tiers: bool = True
                     ) -> list[int] | KVLoad:
        """Hold the pool blocks that cache the leading full blocks of ``token_ids`` (at most
        ``(len - 1) // B`` of them: the asker computes at least the last token) under
        ``lease_id`` in ``held``, for a peer to pull (``release_held`` frees them); returns
        their ids, tokens ``[0, len * B)``, empty (nothing held) on no hit.

        ``from_tiers`` and the chain goes on in the offload tiers after the pool's hits:
        blocks for the hits (referenced) and for the tier blocks (new; their tier entries
        pinned) instead, and the ``KVLoad`` that copies them back is returned;
        ``end_prefix_load`` holds them once it ran."""
        if lease_id in self.held or lease_id in self.requests or lease_id in self.prefix_loads:
            raise ValueError(f"{lease_id!r} is in use")
        probe = Request(lease_id, list(token_ids), SamplingParams())
        hits, _ = self.kv.get_computed_blocks(probe)
        tier = self.kv.get_tier_blocks(probe, len(hits)) if from_tiers else []
        # with tier blocks the table becomes hits [0, h) + tier blocks [h, h + t): tokens
        # [0, (h + t) * B); else hits only (referenced: never evicted meanwhile)
        if tier and self.kv.allocate_slots(probe, len(tier) * self.block_size,
                                           hits) is not None:
            assert self.kv.tiers is not None
            self.kv.tiers.pin(tier)
            load = KVLoad(lease_id, self.kv.block_ids(lease_id)[len(hits):], tier)
            self.prefix_loads[lease_id] = (probe, load, len(hits))
            return load
        if hits:
            self.kv.allocate_slots(probe, 0, hits)
        blocks = self.kv.detach(probe)  # (also drops the probe's hashes)
        if blocks:
            self.held[lease_id] = blocks
        return blocks

    def tier_kv_ready(self, request_id: str, num_loaded: int) -> None:
        """The first ``num_loaded`` blocks of a loading request's ``KVLoad`` are in place
        (all of them, or fewer when a copy failed its check: the rest is computed). The
        request is RUNNING and prefills from after them from the next step."""
        req, load, first = self.loading.pop(request_id)
        if not 0 <= num_loaded <= len(load.block_ids):
            raise ValueError(f"{request_id}: {num_loaded} of {len(load.block_ids)} blocks loaded")
        assert self.kv.tiers is not None
        self.kv.tiers.unpin(load.block_hashes)
        tokens = num_loaded * self.block_size
        req.num_computed_tokens += tokens
        self.kv.cache_blocks(req, req.num_computed_tokens)
        if first:
            req.num_cached_tokens += tokens
            self.prefix_cache_hit_tokens += tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def hold_blocks_on_finish(self, request_id: str) -> None:
        """Keep the request's blocks when it finishes by length (a context-only request whose
        KV a generation worker will pull); they wait in ``held`` until ``release_held``. A stop
        (EOS, stop token) or an abort frees them as usual: that answer is final."""
        self._hold.add(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free the blocks held for a finished request (lease confirmed, expired or released).
        Returns False if nothing was held (released already)."""
        blocks = self.held.pop(request_id, None)
        if blocks is None:
            return False
        self.kv.free_blocks(blocks)
        return True

    # -- planning a step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        st = _Step(token_budget=self.config.max_num_tokens)
        max_batch = self.config.max_batch_size

        # 1. Generation first: 1 token per decoding request, oldest first.
        running = RequestStatus.RUNNING
        decodes = st.decodes
        kv = self.kv
        new_decode = ScheduledRequest.decode
        others = False  # a running request that is not decoding (left for step 2)
        for req in list(self.running):  # a copy: preemption removes from self.running
            if req.status != running:
                continue
            out = req.output_token_ids
            computed = req.num_computed_tokens
            # _is_decoding, inlined (the loop runs once per request per step)
            if not out or len(req.prompt_token_ids) + len(out) - computed != 1:
                others = True
                continue
            if len(decodes) >= max_batch or st.token_budget < 1:  # (no prefills planned yet)
                break
            # Fast path: the table already holds the new token's slot (no allocation, so
            # nothing to preempt); else the general allocation, which may preempt.
            rid = req.request_id
            table = kv.block_ids_if_holding(rid, computed + 1)
            if table is None and self._allocate_running(req, 1, st):
                table = kv.block_ids(rid)
            if table is not None:
                decodes[rid] = new_decode(rid, out[-1], computed, table)
                st.token_budget -= 1

        # 2. Continuing chunked prefills (and recomputation of preempted requests).
        for req in list(self.running) if others else ():
            if (req.status != RequestStatus.RUNNING or self._is_decoding(req)
                    or st.is_scheduled(req.request_id)):
                continue
            if st.num_scheduled >= max_batch or st.token_budget < 1:
                break
            n = self._chunk_size(req, req.num_computed_tokens, st.token_budget)
            if n == 0:
                continue  # less than a block of budget left: wait for the next step
            if self._allocate_running(req, n, st):
                st.prefills[req.request_id] = self._plan(req, n)
                st.token_budget -= n

        # 3. Waiting requests, FCFS. Not in a step that preempted: the blocks just freed are
        # for the running requests, and the preempted one would be re-admitted at once.
        if not st.preempted:
            self._admit_waiting(st)

        # 4. Draft slots for speculative decoding, from what is left.
        if self.num_spec_tokens:
            self._grant_draft_slots(st)

        scheduled = list(st.decodes.values()) + list(st.prefills.values())
        return SchedulerOutput(
            scheduled=scheduled,
            num_decodes=len(st.decodes),
            # a decode is one token (its draft slots are not in token_ids)
            num_scheduled_tokens=len(st.decodes) + sum(len(s.token_ids)
                                                       for s in st.prefills.values()),
            preempted=st.preempted,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_fetches=st.fetches,
            kv_loads=st.loads,
        )

    def _admit_waiting(self, st: _Step) -> None:
        if not self.waiting:
            return
        max_batch = self.config.max_batch_size
        # Blocks promised to running requests: their lifetime blocks not allocated yet.
        promised = 0
        if self.no_evict:
            promised = sum(self._unallocated_lifetime_blocks(r)
                           for r in (*self.running, *self.fetching.values(),
                                     *(r for r, _, _ in self.loading.values())))
        while self.waiting:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                # Blocks for the prompt only; no compute this step (no token budget).
                if self.no_evict:
                    need = self.kv.blocks_needed(self.lifetime_tokens(req))
                    if self.kv.num_free_blocks - promised < need:
                        break
                remote = req.num_prompt_tokens if req.remote_tokens is None else req.remote_tokens
                if self.kv.allocate_slots(req, remote) is None:
                    break
                self.waiting.popleft()
                req.num_cached_tokens = max(req.num_cached_tokens, 0)
                self.fetching[req.request_id] = req
                if self.no_evict:
                    promised += self._unallocated_lifetime_blocks(req)
                st.fetches.append(KVFetch(req.request_id, self.kv.block_ids(req.request_id),
                                          remote))
                continue
            if st.num_scheduled >= max_batch or st.token_budget < 1:
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            if req.sampling_params.prompt_logprobs is not None:
                # Its prompt logprobs need every prompt position's logits: no prefix hit.
                hits, num_hit_tokens = [], 0
            elif self.kv.tiers is not None:
                tier = self.kv.get_tier_blocks(req, len(hits))
                if tier:
                    if not self._admit_loading(req, hits, tier, st, promised):
                        break
                    if self.no_evict:
                        promised += self._unallocated_lifetime_blocks(req)
                    continue
            n = self._chunk_size(req, num_hit_tokens, st.token_budget)
            if n == 0:
                break  # does not fit this step; FCFS: everything behind it waits too
            if self.no_evict:
                # Reserve the whole lifetime: new blocks = lifetime - hits, and a hit on a block
                # at ref 0 also takes that block out of the free ones.
                need = self.kv.blocks_needed(self.lifetime_tokens(req)) - len(hits)
                if self.kv.num_free_blocks - self.kv.num_free_among(hits) - promised < need:
                    break
            if self.kv.allocate_slots(req, n, hits) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens  # the hit is computed already
            if req.num_cached_tokens < 0:
                # First admission only: a recomputation after preemption hitting its own blocks
                # is not a prompt-cache hit. (Recorded when the look-up is used, not while the
                # request waits: the cache may change in between.)
                req.num_cached_tokens = num_hit_tokens
                self.prefix_cache_queries_tokens += req.num_prompt_tokens
                self.prefix_cache_hit_tokens += num_hit_tokens
            self.running.append(req)
            if self.no_evict:
                promised += self._unallocated_lifetime_blocks(req)
            st.prefills[req.request_id] = self._plan(req, n)
            st.token_budget -= n

    def _admit_loading(self, req: Request, hits: list[int], tier: list[int], st: _Step,
                       promised: int) -> bool:
        """Admit the waiting request at the queue's head whose prefix goes on in the offload
        tiers after its pool ``hits``: blocks for the hits and the ``tier`` blocks, no compute
        this step; it waits in ``loading`` (WAITING_FOR_TIER_KV) for ``tier_kv_ready``.
        False (nothing changed) when the blocks are not there."""
        B = self.block_size
        if self.no_evict:
            need = self.kv.blocks_needed(self.lifetime_tokens(req)) - len(hits)
            if self.kv.num_free_blocks - self.kv.num_free_among(hits) - promised < need:
                return False
        # the table becomes hits [0, h) + tier blocks [h, h + t): tokens [0, (h + t) * B)
        if self.kv.allocate_slots(req, len(tier) * B, hits) is None:
            return False
        assert self.kv.tiers is not None
        self.kv.tiers.pin(tier)
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_TIER_KV
        req.num_computed_tokens = len(hits) * B
        first = req.num_cached_tokens < 0
        if first:  # (as for a pool hit; the tier's tokens count once they are in place)
            req.num_cached_tokens = len(hits) * B
            self.prefix_cache_queries_tokens += req.num_prompt_tokens
            self.prefix_cache_hit_tokens += len(hits) * B
        load = KVLoad(req.request_id, self.kv.block_ids(req.request_id)[len(hits):], tier)
        self.loading[req.request_id] = (req, load, first)
        st.loads.append(load)
        return True

    def _grant_draft_slots(self, st: _Step) -> None:
        """Give the step's decodes draft slots (oldest first) from the token budget and free
        blocks left after every decode, chunk and admission got theirs: speculation never
        delays a prompt and never preempts (a draft slot's block only comes from the free
        pool, and under GUARANTEED_NO_EVICT from the request's own lifetime reservation).
        A decode carrying k drafts has slots for positions [start, start + 1 + k)."""
        limit = self.spec_disable_batch_size
        if limit is not None and len(st.decodes) >= limit:
            return
        for rid, sr in st.decodes.items():
            if st.token_budget < 1:
                break
            k = self._spec_slots(self.requests[rid], st.token_budget)
            if k and self.kv.allocate_slots(self.requests[rid], 1 + k) is not None:
                st.decodes[rid] = replace(sr, block_ids=self.kv.block_ids(rid), spec_slots=k)
                st.token_budget -= k

    def _spec_slots(self, req: Request, budget: int) -> int:
        """Draft tokens a decoding request may carry this step: the configured number, less
        where its output would pass ``max_tokens`` or ``max_model_len`` (a step emits up to
        drafts + 1 tokens) or the ``budget`` of tokens left for drafts ends."""
        room = req.sampling_params.max_tokens - req.num_output_tokens - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - req.num_tokens - 1)
        return max(0, min(self.num_spec_tokens, room, budget))

    def _is_decoding(self, req: Request) -> bool:
        """Generation phase: the prompt is done and only the last sampled token is uncomputed."""
        return req.num_output_tokens > 0 and req.num_tokens - req.num_computed_tokens == 1

    def _chunk_size(self, req: Request, start: int, budget: int) -> int:
        """Tokens of ``req`` to compute this step from position ``start`` (0: wait)."""
        remaining = req.num_tokens - start
        if remaining <= budget:
            return remaining  # the final chunk (or the whole prompt) fits
        # A preempted request recomputes prompt + output, which may exceed max_num_tokens even
        # when its prompt did not; it is chunked, else it could never run again.
        if not (self.config.enable_chunked_context or req.num_tokens > self.config.max_num_tokens):
            return 0
        # Positions [start, end) with end rounded down to a block boundary (start is on one:
        # prefix hits are whole blocks and earlier chunks were aligned).
        a = self._chunk_align
        end = (start + budget) // a * a
        return max(0, end - start)

    def _allocate_running(self, req: Request, n: int, st: _Step) -> bool:
        """Make room for ``n`` more tokens of a running request. Under MAX_UTILIZATION, preempt
        the most recently started requests until it fits (possibly ``req`` itself: then False).
        Under GUARANTEED_NO_EVICT the lifetime reservation makes this succeed; never
        preempt."""
        while self.kv.allocate_slots(req, n) is None:
            if self.no_evict:
                return False
            victim = self.running[-1]
            self._preempt(victim, st)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, st: _Step) -> None:
        """Free all of ``req``'s blocks; it recomputes prompt + generated tokens later."""
        _remove_identical(self.running, req)
        req.status = RequestStatus.PREEMPTED
        self.kv.free(req)  # unfinished: its hash chain is kept for the recomputation
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)
        st.preempted.append(req.request_id)
        st.unschedule(req.request_id)

    def _unallocated_lifetime_blocks(self, req: Request) -> int:
        held = self.kv.num_held_blocks(req.request_id)
        return max(0, self.kv.blocks_needed(self.lifetime_tokens(req)) - held)

    def _plan(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=_token_slice(req, start, start + n),
            start_pos=start,
            block_ids=self.kv.block_ids(req.request_id),
            sample=start + n == req.num_tokens,
            prompt_logits_end=(req.num_prompt_tokens - 1
                               if req.sampling_params.prompt_logprobs is not None else 0),
        )

    # -- after the step ----------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: Mapping[str, int],
                           accepted: Mapping[str, list[int]] | None = None) -> list[Request]:
        """Apply a finished step: advance ``num_computed_tokens``, cache the blocks that became
        full, append sampled tokens, check stops. Returns the requests finished by this call
        (and those rejected by ``add_request`` since the last call); their blocks are freed.

        ``accepted[rid]``: of an entry carrying drafts, the drafts the target accepted (a
        prefix of them); they are output tokens before ``sampled[rid]``, and only their KV (and
        the decoded token's) stays computed: the rejected drafts' slots are written again
        later. Stops are checked after each token; tokens after a stop are dropped.

        Plan entries of requests finished or aborted in between are ignored."""
        live: list[tuple[ScheduledRequest, Request]] = []
        requests, running = self.requests, RequestStatus.RUNNING  # (loops run per request)
        for sr in output.scheduled:
            req = requests.get(sr.request_id)
            if (req is None or req.status != running
                    or req.num_computed_tokens != sr.start_pos):
                continue  # finished/aborted since the plan, or a stale plan
            if sr.sample and sr.request_id not in sampled:
                raise ValueError(f"request {sr.request_id!r} reached its last token this step "
                                 f"but no sampled token was given")
            live.append((sr, req))

        finished, self._finished_early = self._finished_early, []
        cache_blocks, check_stop = self.kv.cache_blocks, self.check_stop
        for sr, req in live:
            if sr.num_spec:
                status = self._append_verified(req, sr, (accepted or {}).get(sr.request_id, []),
                                               sampled[sr.request_id])
            else:
                req.num_computed_tokens += len(sr.token_ids)
                cache_blocks(req, req.num_computed_tokens)
                if not sr.sample:
                    continue
                req.output_token_ids.append(sampled[sr.request_id])
                status = check_stop(req)
            if status is not None:
                req.status = status  # before kv.free: a finished request's chain is dropped
                if req.request_id in self._hold and status == RequestStatus.FINISHED_LENGTH:
                    self.held[req.request_id] = self.kv.detach(req)
                else:
                    self.kv.free(req)
                self._hold.discard(req.request_id)
                del self.requests[req.request_id]
                finished.append(req)
        if finished:  # one pass instead of a list.remove per finished request
            self.running = [r for r in self.running if not r.is_finished()]
        return finished

    def _append_verified(self, req: Request, sr: ScheduledRequest, accepted: list[int],
                         token: int) -> RequestStatus | None:
        """A decode that carried drafts: positions [start, start + 1 + num_spec) were
        computed; the first 1 + len(accepted) of them hold real tokens (the decoded one and
        the accepted drafts), so only those stay computed. Appends accepted + [token], one
        at a time, up to the first stop."""
        a = len(accepted)
        if a > sr.num_spec or accepted != sr.token_ids[1:1 + a]:
            raise ValueError(f"request {sr.request_id!r}: accepted tokens {accepted} are not a "
                             f"prefix of its drafts {sr.token_ids[1:]}")
        status = None
        for t in (*accepted, token):
            req.output_token_ids.append(t)
            status = self.check_stop(req)
            if status is not None:
                break
        # start + 1 + a, or fewer tokens when a stop cut the accepted ones short
        req.num_computed_tokens = min(sr.start_pos + 1 + a, req.num_tokens - 1)
        self.kv.cache_blocks(req, req.num_computed_tokens)
        return status

    def check_stop(self, req: Request) -> RequestStatus | None:
        """Stop conditions after appending a token. Stops (EOS, stop tokens) win over length
        when both hold; min_tokens only suppresses stops, never the length limits."""
        sp = req.sampling_params
        out = req.output_token_ids
        token = out[-1]
        num_out = len(out)  # (req.num_output_tokens: this runs per request and step)
        if num_out >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if (self.max_model_len is not None
                and len(req.prompt_token_ids) + num_out >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    """all_token_ids[start:end] without building the whole list (decodes take 1 token)."""
    p = req.num_prompt_tokens
    # prompt holds positions [0, p), output holds [p, num_tokens)
    if end <= p:
        return req.prompt_token_ids[start:end]
    if start >= p:
        return req.output_token_ids[start - p:end - p]
    return req.prompt_token_ids[start:] + req.output_token_ids[:end - p]


def _remove_identical(items: list[Request] | deque[Request], req: Request) -> None:
    """Remove ``req`` by identity (dataclass ``==`` compares every field)."""
    for i, r in enumerate(items):
        if r is req:
            del items[i]
            return
    raise ValueError(f"request {req.request_id!r} not found")

