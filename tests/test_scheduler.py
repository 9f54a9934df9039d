"""Scheduler: in-flight batching (decodes first, then prefills, within max_batch_size requests
and max_num_tokens tokens per step), chunked context, prefix hits, capacity policies,
preemption, stops, aborts. Every plan is checked exactly: ids, positions, tokens,
blocks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from disagg.config import CapacityPolicy, SchedulerConfig
from disagg.kv_cache.block_pool import BlockPoolStats
from disagg.kv_cache.hashing import hash_token_blocks
from disagg.kv_cache.manager import KVCacheManager
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

EOS = 2
NOEVICT = CapacityPolicy.GUARANTEED_NO_EVICT
MAXUTIL = CapacityPolicy.MAX_UTILIZATION


def make_sched(num_blocks: int = 64, block_size: int = 4, max_model_len: int | None = None,
               caching: bool = True, **config: object) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**config), kv, max_model_len=max_model_len)  # type: ignore[arg-type]


def make_req(rid: str, prompt: list[int], max_tokens: int = 16, eos: tuple[int, ...] = (EOS,),
             **params: object) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
                   eos_token_ids=eos)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, tokens this step) in plan order."""
    return [(s.request_id, len(s.token_ids)) for s in out.scheduled]


TokenFn = Callable[[str, int], int]


class Driver:
    """Runs schedule() + update_from_output() like the engine, with chosen sampled tokens."""

    def __init__(self, sched: Scheduler, token: TokenFn | None = None) -> None:
        self.sched = sched
        self.token: TokenFn = token or (lambda rid, step: 100 + step)
        self.steps = 0
        self.outs: list[SchedulerOutput] = []
        self.finished: list[list[str]] = []

    def step(self, override: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[str]]:
        self.steps += 1
        out = self.sched.schedule()
        sampled = {s.request_id: self.token(s.request_id, self.steps)
                   for s in out.scheduled if s.sample}
        sampled.update(override or {})
        done = [r.request_id for r in self.sched.update_from_output(out, sampled)]
        self.outs.append(out)
        self.finished.append(done)
        return out, done

    def run(self, max_steps: int = 200) -> None:
        while self.sched.has_unfinished():
            assert self.steps < max_steps, "scheduler did not drain"
            self.step()


# -- a worked example of in-flight batching --------------------------------------------------


def test_worked_example_of_in_flight_batching() -> None:
    """max_batch_size=4, max_num_tokens=12, five 5-token prompts, no chunking: step 1 takes
    two prompts (10 tokens; the third does not fit the 2 left), step 2 the two decodes plus two
    more prompts (2 + 10 = 12 tokens, 4 requests: full), and a request that stops frees its
    batch slot for the fifth prompt in the next step."""
    sched = make_sched(max_batch_size=4, max_num_tokens=12, enable_chunked_context=False)
    prompts = {f"r{i}": [10 * i + j for j in range(5)] for i in range(1, 6)}
    for rid, prompt in prompts.items():
        sched.add_request(make_req(rid, prompt))
    drv = Driver(sched)

    # Iteration 1: requests 1 and 2 (10 tokens); 2 left, request 3 does not fit.
    out, done = drv.step()
    assert plan(out) == [("r1", 5), ("r2", 5)]
    assert out.num_scheduled_tokens == 10 and out.num_decodes == 0
    assert out.scheduled[0] == ScheduledRequest("r1", prompts["r1"], 0, [0, 1], True)
    assert out.scheduled[1] == ScheduledRequest("r2", prompts["r2"], 0, [2, 3], True)
    assert (out.num_running, out.num_waiting) == (2, 3)
    assert done == []

    # Iteration 2: G1 of requests 1-2 (2 tokens) + contexts of 3-4 (10 tokens) = 12; the batch
    # is full at 4. Request 1 samples its stop token (EOS) here.
    out, done = drv.step(override={"r1": EOS})
    assert plan(out) == [("r1", 1), ("r2", 1), ("r3", 5), ("r4", 5)]
    assert out.num_scheduled_tokens == 12 and out.num_decodes == 2
    assert out.scheduled[0] == ScheduledRequest("r1", [101], 5, [0, 1], True)
    assert out.scheduled[2] == ScheduledRequest("r3", prompts["r3"], 0, [4, 5], True)
    assert (out.num_running, out.num_waiting) == (4, 1)
    assert done == ["r1"]
    assert sched.get_request("r1") is None  # gone from the scheduler

    # Iteration 3: request 1 left, so request 5 is admitted next to the three generations.
    out, done = drv.step()
    assert plan(out) == [("r2", 1), ("r3", 1), ("r4", 1), ("r5", 5)]
    assert out.num_scheduled_tokens == 8 and out.num_decodes == 3
    assert out.scheduled[3] == ScheduledRequest("r5", prompts["r5"], 0, [8, 9], True)
    assert (out.num_running, out.num_waiting) == (4, 0)


def test_finished_request_reports_status_and_frees_blocks() -> None:
    sched = make_sched(max_batch_size=4, max_num_tokens=12, enable_chunked_context=False)
    r1 = make_req("r1", [1, 3, 4, 5, 6])
    sched.add_request(r1)
    drv = Driver(sched)
    drv.step()
    _, done = drv.step(override={"r1": EOS})
    assert done == ["r1"]
    assert r1.status == RequestStatus.FINISHED_STOPPED
    assert r1.status.finish_reason == "stop"
    assert r1.stop_reason is None
    assert r1.output_token_ids == [101, EOS]
    assert sched.kv.block_ids("r1") == []
    assert sched.kv.stats().used == 0
    assert not sched.has_unfinished()


# -- token budget and FCFS ----------------------------------------------------------------


def test_without_chunking_a_prompt_that_does_not_fit_blocks_the_queue() -> None:
    sched = make_sched(max_num_tokens=12, enable_chunked_context=False)
    sched.add_request(make_req("a", list(range(10, 18))))  # 8 tokens
    sched.add_request(make_req("b", list(range(20, 28))))  # 8 tokens
    sched.add_request(make_req("c", [30, 31]))  # would fit after a, but b is first
    drv = Driver(sched)
    out, _ = drv.step()
    assert plan(out) == [("a", 8)]
    assert out.num_waiting == 2
    out, _ = drv.step()
    assert plan(out) == [("a", 1), ("b", 8), ("c", 2)]
    assert out.num_scheduled_tokens == 11


def test_max_batch_size_limits_requests_per_step() -> None:
    sched = make_sched(max_batch_size=2, max_num_tokens=100)
    for rid in "abc":
        sched.add_request(make_req(rid, [5, 6]))
    drv = Driver(sched)
    assert plan(drv.step()[0]) == [("a", 2), ("b", 2)]
    assert plan(drv.step()[0]) == [("a", 1), ("b", 1)]  # generation first: c still waits


# -- chunked context ----------------------------------------------------------------------


def test_chunked_context_chunks_are_block_multiples() -> None:
    # max_num_tokens (10) is smaller than the prompt (23): chunks of 8, 8, then the final 7.
    sched = make_sched(max_num_tokens=10, enable_chunked_context=True)
    prompt = list(range(100, 123))
    sched.add_request(make_req("a", prompt, max_tokens=2))
    drv = Driver(sched)
    out, _ = drv.step()
    assert out.scheduled == [ScheduledRequest("a", prompt[0:8], 0, [0, 1], False)]
    out, _ = drv.step()
    assert out.scheduled == [ScheduledRequest("a", prompt[8:16], 8, [0, 1, 2, 3], False)]
    assert out.num_decodes == 0
    out, _ = drv.step()
    assert out.scheduled == [ScheduledRequest("a", prompt[16:23], 16, [0, 1, 2, 3, 4, 5], True)]
    out, done = drv.step()
    assert out.scheduled == [ScheduledRequest("a", [103], 23, [0, 1, 2, 3, 4, 5], True)]
    assert out.num_decodes == 1
    assert done == ["a"]


def test_chunk_waits_when_less_than_a_block_of_budget_is_left() -> None:
    sched = make_sched(max_num_tokens=6, enable_chunked_context=True)
    sched.add_request(make_req("a", [1, 3, 4], max_tokens=5))
    sched.add_request(make_req("b", list(range(10, 20)), max_tokens=1))  # 10 tokens
    sched.add_request(make_req("c", [30, 31], max_tokens=1))
    drv = Driver(sched)
    # 3 tokens left < one block (4) and b is not at its final chunk: b waits, and c behind it
    # (FCFS) although c's 2 tokens would fit.
    out, _ = drv.step()
    assert plan(out) == [("a", 3)]
    # a decodes; 5 left -> b's chunk is rounded down to 4; 1 left < a block -> c waits.
    out, _ = drv.step()
    assert plan(out) == [("a", 1), ("b", 4)]
    assert out.scheduled[1].start_pos == 0 and not out.scheduled[1].sample
    out, _ = drv.step()
    assert plan(out) == [("a", 1), ("b", 4)]
    # a's decode at position 4 took block 2 first, so b's second chunk lands in block 3.
    assert out.scheduled[1].start_pos == 4 and out.scheduled[1].block_ids == [1, 3]
    # b's final 2 tokens need no rounding; 3 left: c's whole prompt is a final chunk.
    out, done = drv.step()
    assert plan(out) == [("a", 1), ("b", 2), ("c", 2)]
    assert out.scheduled[1].start_pos == 8 and out.scheduled[1].sample
    assert done == ["b", "c"]
    out, done = drv.step()
    assert plan(out) == [("a", 1)]
    assert done == ["a"]


def test_budget_below_one_block_still_progresses() -> None:
    # max_num_tokens < tokens_per_block: chunks cannot be block multiples; they use the budget.
    sched = make_sched(max_num_tokens=3, block_size=4, enable_chunked_context=True)
    sched.add_request(make_req("a", list(range(10, 17)), max_tokens=1))  # 7 tokens
    drv = Driver(sched)
    assert [(s.start_pos, len(s.token_ids)) for s in drv.step()[0].scheduled] == [(0, 3)]
    assert [(s.start_pos, len(s.token_ids)) for s in drv.step()[0].scheduled] == [(3, 3)]
    out, done = drv.step()
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [(6, 1, True)]
    assert done == ["a"]


# -- prefix caching -----------------------------------------------------------------------


def test_prefix_cache_hit_on_second_request() -> None:
    sched = make_sched(max_num_tokens=64)
    prompt = list(range(10, 20))  # 10 tokens: full blocks [0, 4), [4, 8)
    first = make_req("first", prompt, max_tokens=1)
    sched.add_request(first)
    drv = Driver(sched)
    out, done = drv.step()
    assert out.scheduled == [ScheduledRequest("first", prompt, 0, [0, 1, 2], True)]
    assert done == ["first"] and first.num_cached_tokens == 0
    assert sched.kv.stats() == BlockPoolStats(free=62, used=0, cached=2, total=64)

    same = make_req("same", prompt)
    eight = make_req("eight", prompt[:8])  # all its blocks cached, yet one token is computed
    other = make_req("other", [99] + prompt[1:])
    for r in (same, eight, other):
        sched.add_request(r)
    out, _ = drv.step()
    # Free queue after "first" finished: [3, 4, ..., 63, 2, 1, 0]; hits are shared, new blocks
    # come from the front.
    assert out.scheduled == [
        ScheduledRequest("same", prompt[8:10], 8, [0, 1, 3], True),
        ScheduledRequest("eight", prompt[4:8], 4, [0, 4], True),
        ScheduledRequest("other", other.prompt_token_ids, 0, [5, 6, 7], True),
    ]
    assert (same.num_cached_tokens, eight.num_cached_tokens, other.num_cached_tokens) == (8, 4, 0)
    assert same.num_computed_tokens == 10
    assert [sched.kv.pool.blocks[b].ref_cnt for b in (0, 1)] == [2, 1]
    assert sched.prefix_cache_queries_tokens == 10 + 10 + 8 + 10
    assert sched.prefix_cache_hit_tokens == 8 + 4


def test_prefix_caching_disabled_recomputes() -> None:
    sched = make_sched(caching=False)
    prompt = list(range(10, 20))
    sched.add_request(make_req("a", prompt, max_tokens=1))
    drv = Driver(sched)
    drv.step()
    b = make_req("b", prompt)
    sched.add_request(b)
    out, _ = drv.step()
    assert [(s.start_pos, len(s.token_ids)) for s in out.scheduled] == [(0, 10)]
    assert b.num_cached_tokens == 0


# -- capacity policies --------------------------------------------------------------------


def _pressure(policy: CapacityPolicy) -> tuple[Driver, Request, Request]:
    # 6 blocks of 4 = 24 tokens. r1 lives 8 + 16 = 24 tokens (6 blocks), r2 4 + 8 (3 blocks).
    sched = make_sched(num_blocks=6, block_size=4, max_num_tokens=64, capacity_policy=policy)
    r1 = make_req("r1", list(range(10, 18)), max_tokens=16)
    r2 = make_req("r2", [20, 21, 22, 23], max_tokens=8)
    sched.add_request(r1)
    sched.add_request(r2)
    return Driver(sched), r1, r2


def test_guaranteed_no_evict_admits_by_lifetime_reservation() -> None:
    drv, r1, r2 = _pressure(NOEVICT)
    out, _ = drv.step()
    # r2's prompt needs 1 block and 4 are free, but 4 are promised to r1 (6 - 2 held): r2 waits.
    assert plan(out) == [("r1", 8)]
    assert r2.status == RequestStatus.WAITING
    drv.run()
    plans = [plan(o) for o in drv.outs]
    assert plans[1:16] == [[("r1", 1)]] * 15  # r2 never squeezes in while r1 runs
    assert drv.finished[15] == ["r1"]
    assert plans[16] == [("r2", 4)]  # step 17: admitted once r1 is gone
    assert drv.steps == 24
    assert all(o.preempted == [] for o in drv.outs)
    assert (r1.num_preemptions, r2.num_preemptions) == (0, 0)
    assert (r1.num_output_tokens, r2.num_output_tokens) == (16, 8)
    assert r1.status == r2.status == RequestStatus.FINISHED_LENGTH
    assert drv.sched.kv.stats().used == 0


def test_max_utilization_preempts_the_newest_and_recomputes_it() -> None:
    drv, r1, r2 = _pressure(MAXUTIL)
    out, _ = drv.step()
    assert plan(out) == [("r1", 8), ("r2", 4)]  # admitted on the blocks needed now
    for _ in range(4):
        assert plan(drv.step()[0]) == [("r1", 1), ("r2", 1)]
    # Step 6: r1 takes the last free block (its 4th); r2 needs a 3rd and is the most recently
    # started, so it is preempted (by itself).
    out, _ = drv.step()
    assert out.preempted == ["r2"]
    assert plan(out) == [("r1", 1)]
    assert (out.num_running, out.num_waiting) == (1, 1)
    assert r2.status == RequestStatus.PREEMPTED and r2.num_preemptions == 1
    assert r2.num_computed_tokens == 0 and r2.num_output_tokens == 5
    assert drv.sched.kv.block_ids("r2") == []
    drv.run()
    plans = [plan(o) for o in drv.outs]
    assert plans[6:16] == [[("r1", 1)]] * 10  # r2 cannot come back while r1 holds the blocks
    assert drv.finished[15] == ["r1"]
    # Step 17: r2 recomputes prompt + 5 generated tokens (its cached blocks were evicted by
    # r1's growth), then generates its last 3 tokens.
    recompute = drv.outs[16].scheduled
    assert [(s.request_id, s.start_pos, s.sample) for s in recompute] == [("r2", 0, True)]
    assert recompute[0].token_ids == [20, 21, 22, 23] + r2.output_token_ids[:5]
    assert drv.steps == 19 and drv.finished[18] == ["r2"]
    assert (r1.num_output_tokens, r2.num_output_tokens) == (16, 8)
    assert r2.num_cached_tokens == 0  # the first admission's look-up, not the recompute's
    assert drv.sched.num_preemptions_total == 1
    assert drv.sched.kv.stats().used == 0


def test_max_utilization_preemption_exact_blocks_and_prefix_reuse() -> None:
    # 4 blocks of 2 tokens. Both requests hold 2 blocks after their prompts.
    sched = make_sched(num_blocks=4, block_size=2, capacity_policy=MAXUTIL)
    a = make_req("a", [1, 3, 4], max_tokens=4, eos=())
    b = make_req("b", [5, 6, 7], max_tokens=4, eos=())
    c = make_req("c", [8, 9, 10], max_tokens=1, eos=())  # no blocks left for it at first
    for r in (a, b, c):
        sched.add_request(r)
    drv = Driver(sched, token=lambda rid, step: (50 if rid == "a" else 60) + step)
    out, _ = drv.step()
    assert [(s.request_id, s.block_ids) for s in out.scheduled] == [("a", [0, 1]), ("b", [2, 3])]
    out, _ = drv.step()
    assert plan(out) == [("a", 1), ("b", 1)]
    # Step 3: a's position 4 needs a 3rd block; b (newest) is preempted, its blocks freed tail
    # first ([3, 2]); a takes block 3 (evicting b's cached second block).
    out, _ = drv.step()
    assert out.preempted == ["b"]
    assert out.scheduled == [ScheduledRequest("a", [52], 4, [0, 1, 3], True)]
    assert sched.kv.pool.free_queue() == [2]
    assert list(sched.waiting) == [b, c]  # the preempted request goes to the front
    # Step 4: b could reuse block 2 (its first block, still cached) but needs 2 more: waits,
    # and c waits behind it.
    out, done = drv.step()
    assert plan(out) == [("a", 1)]
    assert done == ["a"]
    # Step 5: b, at the front of the queue, comes back before c. It hits block 2 (tokens
    # [5, 6]) and recomputes positions 2..4 into blocks 3 and 1; c needs 2 blocks, 1 is free.
    out, _ = drv.step()
    assert out.scheduled == [ScheduledRequest("b", [7, 61, 62], 2, [2, 3, 1], True)]
    assert b.num_cached_tokens == 0  # recorded at its first admission, not the recompute's hit
    out, done = drv.step()
    assert out.scheduled == [ScheduledRequest("b", [65], 5, [2, 3, 1], True)]
    assert done == ["b"]
    assert b.output_token_ids == [61, 62, 65, 66]
    assert a.output_token_ids == [51, 52, 53, 54]
    out, done = drv.step()
    assert plan(out) == [("c", 3)]
    assert done == ["c"]


def test_preempting_a_request_already_planned_this_step_unschedules_it() -> None:
    # a (older) is mid-prefill while b (newer) decodes; a's final chunk needs b's block.
    sched = make_sched(num_blocks=4, block_size=2, max_num_tokens=5,
                       enable_chunked_context=True, capacity_policy=MAXUTIL)
    a = make_req("a", list(range(10, 17)), max_tokens=1)  # 7 tokens
    b = make_req("b", [9], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    drv = Driver(sched)
    out, _ = drv.step()
    assert [(s.request_id, s.start_pos, len(s.token_ids), s.block_ids) for s in out.scheduled] \
        == [("a", 0, 4, [0, 1]), ("b", 0, 1, [2])]
    # Step 2: b's decode is planned first; then a needs 2 blocks, 1 is free: b is preempted,
    # dropped from the plan (its token refunded), and a gets blocks 3 and 2.
    out, done = drv.step()
    assert out.preempted == ["b"]
    assert out.num_decodes == 0
    assert out.scheduled == [ScheduledRequest("a", [14, 15, 16], 4, [0, 1, 3, 2], True)]
    assert out.num_scheduled_tokens == 3
    assert done == ["a"]
    out, _ = drv.step()
    assert out.scheduled == [ScheduledRequest("b", [9, 101], 0, [2], True)]
    drv.run()
    assert b.num_output_tokens == 3 and b.num_preemptions == 1


def test_recomputation_is_chunked_even_without_chunked_context() -> None:
    # b is preempted holding 5 tokens > max_num_tokens=4; without chunking it could never run
    # again, so its recomputation is chunked. (No prefix caching: b recomputes from 0.)
    sched = make_sched(num_blocks=7, block_size=2, max_num_tokens=4, caching=False,
                       enable_chunked_context=False, capacity_policy=MAXUTIL)
    a = make_req("a", [1, 3, 4, 5], max_tokens=8, eos=())
    b = make_req("b", [9], max_tokens=6, eos=())
    sched.add_request(a)
    sched.add_request(b)
    drv = Driver(sched)
    drv.run()
    b_plans = [(i + 1, s.start_pos, len(s.token_ids), s.sample)
               for i, o in enumerate(drv.outs) for s in o.scheduled if s.request_id == "b"]
    assert b_plans == [
        (2, 0, 1, True), (3, 1, 1, True), (4, 2, 1, True), (5, 3, 1, True),
        # step 6: preempted with 1 + 4 tokens. Step 7: 3 tokens of budget left after a's decode,
        # rounded down to a block: a 2-token chunk although chunking is off.
        (7, 0, 2, False),
        # step 8: a takes the last free block; b (newest) needs 2 and is preempted again.
        # Step 9 (a finished): chunks of 4 and 1, then the last token.
        (9, 0, 4, False), (10, 4, 1, True), (11, 5, 1, True),
    ]
    assert [i + 1 for i, o in enumerate(drv.outs) if o.preempted == ["b"]] == [6, 8]
    assert b.num_preemptions == 2
    assert (a.num_output_tokens, b.num_output_tokens) == (8, 6)
    assert all(o.num_scheduled_tokens <= 4 for o in drv.outs)


# -- stops --------------------------------------------------------------------------------


def _run_one(req: Request, tokens: list[int], **sched_kw: object) -> Scheduler:
    sched = make_sched(**sched_kw)  # type: ignore[arg-type]
    sched.add_request(req)
    it = iter(tokens)
    drv = Driver(sched, token=lambda rid, step: next(it))
    drv.run()
    return sched


def test_stop_on_eos() -> None:
    r = make_req("r", [1, 3], max_tokens=10)
    _run_one(r, [5, 6, EOS, 7])
    assert r.output_token_ids == [5, 6, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    r = make_req("r", [1, 3], max_tokens=4, ignore_eos=True)
    _run_one(r, [EOS, EOS, 5, EOS, 9])
    assert r.output_token_ids == [EOS, EOS, 5, EOS]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.status.finish_reason == "length"


def test_stop_token_ids_set_stop_reason() -> None:
    r = make_req("r", [1, 3], max_tokens=10, stop_token_ids=[42])
    _run_one(r, [5, 42, 6])
    assert r.output_token_ids == [5, 42]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42


def test_min_tokens_suppresses_earlier_stops() -> None:
    r = make_req("r", [1, 3], max_tokens=10, min_tokens=3, stop_token_ids=[42])
    _run_one(r, [EOS, 42, EOS, 7])
    assert r.output_token_ids == [EOS, 42, EOS]  # the 3rd token may stop
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_stop_beats_length_on_the_last_token() -> None:
    r = make_req("r", [1, 3], max_tokens=2)
    _run_one(r, [5, EOS])
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_and_max_model_len() -> None:
    r = make_req("r", [1, 3], max_tokens=3)
    _run_one(r, [5, 6, 7, 8])
    assert r.output_token_ids == [5, 6, 7] and r.status == RequestStatus.FINISHED_LENGTH
    # max_model_len=7 from the constructor: a 5-token prompt stops at 7 tokens.
    r = make_req("r", [1, 3, 4, 5, 6], max_tokens=10)
    _run_one(r, [7, 8, 9, 10], max_model_len=7)
    assert r.output_token_ids == [7, 8] and r.status == RequestStatus.FINISHED_LENGTH
    # ... or from SchedulerConfig when the constructor gives none.
    sched = Scheduler(SchedulerConfig(max_model_len=6), KVCacheManager(16, 4))
    assert sched.max_model_len == 6
    r = make_req("r", [1, 3, 4, 5, 6], max_tokens=10)
    sched.add_request(r)
    Driver(sched, token=lambda rid, step: 6 + step).run()
    assert r.output_token_ids == [7] and r.status == RequestStatus.FINISHED_LENGTH


def test_finish_request_for_a_stop_string_frees_blocks() -> None:
    sched = make_sched()
    r = make_req("r", [1, 3, 4, 5, 6])
    sched.add_request(r)
    Driver(sched).step()
    assert sched.kv.stats().used == 2
    assert sched.finish_request("r", RequestStatus.FINISHED_STOPPED) is r
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv.stats().used == 0 and sched.num_running == 0
    assert not sched.has_unfinished()
    with pytest.raises(ValueError):
        sched.finish_request("r", RequestStatus.RUNNING)


def test_missing_sampled_token_is_an_error() -> None:
    sched = make_sched()
    r = make_req("r", [1, 3])
    sched.add_request(r)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, {})
    assert r.num_computed_tokens == 0  # nothing applied


# -- aborts -------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once() -> None:
    sched = make_sched(max_num_tokens=12, enable_chunked_context=False)
    a = make_req("a", list(range(10, 18)))
    b = make_req("b", list(range(20, 28)))
    sched.add_request(a)
    sched.add_request(b)
    drv = Driver(sched)
    drv.step()  # a runs (8 tokens, blocks [0, 1]); b waits
    assert sched.kv.block_ids("a") == [0, 1]
    assert sched.abort_request("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.block_ids("a") == []
    assert sched.kv.stats().used == 0 and sched.kv.num_free_blocks == 64
    assert sched.abort_request("b") is b  # a waiting request
    assert sched.abort_request("b") is None
    assert sched.abort_request("nobody") is None
    assert not sched.has_unfinished()
    assert (sched.num_running, sched.num_waiting) == (0, 0)


def test_abort_between_schedule_and_update_is_ignored_by_update() -> None:
    sched = make_sched()
    a = make_req("a", [1, 3, 4])
    b = make_req("b", [5, 6, 7])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.kv.stats().used == 1  # only b's block
    finished = sched.update_from_output(out, {"a": 9, "b": 9})
    assert finished == []
    assert a.output_token_ids == [] and b.output_token_ids == [9]
    assert plan(sched.schedule()) == [("b", 1)]


# -- requests that never fit, remote KV ---------------------------------------------------


@pytest.mark.parametrize("policy", [NOEVICT, MAXUTIL])
def test_request_larger_than_the_cache_finishes_with_error(policy: CapacityPolicy) -> None:
    sched = make_sched(num_blocks=4, block_size=4, capacity_policy=policy)  # 16 tokens
    big = make_req("big", list(range(10, 20)), max_tokens=10)  # 20 tokens
    ok = make_req("ok", [1, 3, 4], max_tokens=2)
    sched.add_request(big)
    sched.add_request(ok)
    assert big.status == RequestStatus.FINISHED_ERROR
    assert big.error is not None and "20 tokens" in big.error
    assert sched.has_unfinished()
    drv = Driver(sched)
    out, done = drv.step()
    assert plan(out) == [("ok", 3)]
    assert done == ["big"]  # reported by the next update
    drv.run()
    assert ok.status == RequestStatus.FINISHED_LENGTH
    assert drv.finished[-1] == ["ok"]


def test_other_requests_that_can_never_run_are_rejected() -> None:
    sched = make_sched(max_num_tokens=8, enable_chunked_context=False, max_model_len=20)
    empty = make_req("empty", [])
    too_long = make_req("long", list(range(21)))
    over_budget = make_req("budget", list(range(9)))
    for r in (empty, too_long, over_budget):
        sched.add_request(r)
        assert r.status == RequestStatus.FINISHED_ERROR and r.error
    assert "max_num_tokens" in (over_budget.error or "")
    assert "max_model_len" in (too_long.error or "")
    assert sched.num_waiting == 0
    assert [r.request_id for r in sched.update_from_output(sched.schedule(), {})] == [
        "empty", "long", "budget"]
    assert not sched.has_unfinished()
    sched.add_request(make_req("x", [1]))
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request(make_req("x", [1]))


def test_remote_kv_request_fetches_then_decodes() -> None:
    sched = make_sched(num_blocks=8, max_batch_size=4)
    # Prompt of 6 tokens (2 blocks of 4); the context worker sampled token 50.
    remote = make_req("remote", [1, 3, 4, 5, 6, 7], max_tokens=3)
    remote.output_token_ids = [50]
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KV
    local = make_req("local", [5, 6])
    for r in (remote, local):
        sched.add_request(r)
    drv = Driver(sched)
    out, _ = drv.step()
    # The remote request gets blocks for its prompt and no compute; the local one prefills.
    assert [(f.request_id, f.block_ids, f.num_tokens) for f in out.kv_fetches] == [
        ("remote", [0, 1], 6)]
    assert plan(out) == [("local", 2)]
    assert sched.num_fetching == 1 and sched.num_waiting == 0
    out, _ = drv.step()
    assert out.kv_fetches == [] and plan(out) == [("local", 1)]  # still pulling: not scheduled
    sched.remote_kv_ready("remote")
    assert remote.status == RequestStatus.RUNNING and remote.num_computed_tokens == 6
    out, _ = drv.step()
    # Decodes the context worker's token at position 6 (block 1, offset 2) and samples.
    rem = next(s for s in out.scheduled if s.request_id == "remote")
    assert (rem.token_ids, rem.start_pos, rem.block_ids, rem.sample) == ([50], 6, [0, 1], True)
    assert len(remote.output_token_ids) == 2
    # remote holds blocks 0-1 (positions 0..6), local block 2 (positions 0..3).
    assert sched.kv.stats().used == 3
    # The full prompt block entered the prefix cache when the KV arrived.
    assert sched.kv.pool.get_cached_block(hash_token_blocks([1, 3, 4, 5], 4)[0]) == 0
    out, finished = drv.step()
    assert "remote" in finished and remote.status == RequestStatus.FINISHED_LENGTH
    assert remote.output_token_ids[0] == 50 and len(remote.output_token_ids) == 3


def test_remote_kv_waits_fcfs_for_blocks_and_failure_frees() -> None:
    sched = make_sched(num_blocks=4, max_batch_size=4)
    first = make_req("first", [1] * 9, max_tokens=4)  # lifetime 13 tokens: 4 blocks
    sched.add_request(first)
    remote = make_req("remote", [2] * 5, max_tokens=2)
    remote.output_token_ids = [9]
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KV
    sched.add_request(remote)
    drv = Driver(sched)
    out, _ = drv.step()
    # guaranteed_no_evict: "first" reserved the whole cache; the remote request waits.
    assert plan(out) == [("first", 9)] and out.kv_fetches == []
    assert list(sched.waiting) == [remote]
    while first.status != RequestStatus.FINISHED_LENGTH:
        drv.step()
    out, _ = drv.step()
    assert [f.request_id for f in out.kv_fetches] == ["remote"]
    [fetch] = out.kv_fetches
    # The request ended while its KV was arriving: its blocks leave the pool only once the
    # transfer stopped writing into them (release_draining), never to another request before.
    assert sched.finish_request("remote", RequestStatus.FINISHED_ERROR) is remote
    assert not sched.fetching and not sched.has_unfinished()
    assert fetch.block_ids == [3, 2] and sched.draining == {"remote": [3, 2]}
    assert sched.kv.stats().used == 2
    later = make_req("later", [3] * 13, max_tokens=3)  # 16 tokens: 4 blocks, 2 free
    sched.add_request(later)
    out, _ = drv.step()
    assert plan(out) == [] and list(sched.waiting) == [later]
    assert sched.release_draining("remote") and not sched.release_draining("remote")
    assert sched.kv.stats().used == 0
    out, _ = drv.step()
    assert plan(out) == [("later", 13)]


def test_context_request_blocks_held_until_released() -> None:
    sched = make_sched(num_blocks=8)
    ctx = make_req("ctx", [1, 2, 3, 4, 5, 6], max_tokens=1)
    stop = make_req("stopped", [1, 2, 3, 9], max_tokens=1)
    for r in (ctx, stop):
        sched.add_request(r)
        sched.hold_blocks_on_finish(r.request_id)
    drv = Driver(sched, token=lambda rid, step: EOS if rid == "stopped" else 77)
    _, finished = drv.step()
    assert sorted(finished) == ["ctx", "stopped"]
    # Finished by length: blocks kept for the lease; finished by EOS: final, freed.
    assert sched.held == {"ctx": [0, 1]}
    stats = sched.kv.stats()
    assert stats.used == 2 and stats.free + stats.used + stats.cached == stats.total
    assert sched.release_held("ctx") and not sched.release_held("ctx")
    assert sched.kv.stats().used == 0


def test_decode_entries_equal_the_dataclass_built_ones() -> None:
    """ScheduledRequest.decode (the scheduler's per-step constructor, which skips the frozen
    __init__) gives the entry the dataclass would, with every field set; a decode plan made
    by schedule() is exactly that entry."""
    import dataclasses
    import pickle

    fast = ScheduledRequest.decode("r", 7, 12, [3, 4])
    want = ScheduledRequest("r", [7], 12, [3, 4], True)
    assert fast == want and repr(fast) == repr(want)
    assert set(vars(fast)) == {f.name for f in dataclasses.fields(ScheduledRequest)}
    assert pickle.loads(pickle.dumps(fast)) == want
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.start_pos = 1  # type: ignore[misc]
    assert dataclasses.replace(fast, spec_slots=2).spec_slots == 2

    s = make_sched(max_num_tokens=64)
    s.add_request(make_req("a", list(range(10, 16)), eos=()))
    out = s.schedule()
    s.update_from_output(out, {"a": 9})
    out = s.schedule()
    assert out.num_decodes == 1 and out.num_scheduled_tokens == 1
    assert out.scheduled == [ScheduledRequest("a", [9], 6, s.kv.block_ids("a"), True)]
