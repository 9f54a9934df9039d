"""Speculative decoding's parts, each checked exactly without a model: prompt lookup
(``ngram_lookup``), the scheduler's draft slots and its bookkeeping of verified steps
(exact block ids, prefix cache, stops, the pool's integrity after each step), the
verification rows and the acceptance rule, the draft model's track of valid KV, and the
grammar's masks over drafts (the matcher ends where it started: no token consumed twice)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from disagg.config import CapacityPolicy, SchedulerConfig
from disagg.kv_cache.hashing import hash_token_blocks
from disagg.kv_cache.manager import KVCacheManager
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.sampler import SamplerOutput
from disagg.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from disagg.spec_decode.draft_model import _Track
from disagg.spec_decode.proposer import ngram_lookup
from disagg.spec_decode.verify import SpecCounters, accept, expand_rows
from disagg.structured.spec import GrammarSpec

EOS = 2
MAXUTIL = CapacityPolicy.MAX_UTILIZATION


# ---- prompt lookup ---------------------------------------------------------------------------


def test_ngram_prefers_the_longest_n() -> None:
    # suffix [3, 4]: as a 2-gram it occurs at 2 (followed by 9); its last token 4 alone occurs
    # first at 0 (followed by 7). The 2-gram wins.
    toks = [4, 7, 3, 4, 9, 8, 3, 4]
    assert ngram_lookup(toks, 1, 2, 2) == [9, 8]
    assert ngram_lookup(toks, 1, 1, 2) == [7, 3]  # n_max=1: only the 1-gram


def test_ngram_takes_the_earliest_occurrence() -> None:
    toks = [5, 6, 1, 5, 6, 2, 5, 6]
    assert ngram_lookup(toks, 2, 2, 1) == [1]
    assert ngram_lookup(toks, 2, 2, 3) == [1, 5, 6]


def test_ngram_continuation_shorter_than_k_at_the_end() -> None:
    # the only earlier [1, 2] is followed by [3, 1, 2] then the end of the sequence
    toks = [1, 2, 3, 1, 2]
    assert ngram_lookup(toks, 2, 2, 5) == [3, 1, 2]
    # overlapping occurrence: [7, 7] at 0 is followed by 7 (the suffix itself)
    assert ngram_lookup([7, 7, 7], 2, 2, 4) == [7]


def test_ngram_no_match_and_bounds() -> None:
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 4) == []
    # [9, 1, 2] recurs only as the 2-gram [1, 2]: below n_min=3 nothing is proposed
    toks = [1, 2, 8, 9, 1, 2]
    assert ngram_lookup(toks, 3, 4, 2) == []
    assert ngram_lookup(toks, 2, 4, 2) == [8, 9]
    # n_max longer than the sequence allows: capped at L - 1
    assert ngram_lookup([3, 3], 1, 10, 2) == [3]
    assert ngram_lookup([5], 1, 3, 2) == []
    assert ngram_lookup([], 1, 3, 2) == []
    assert ngram_lookup([1, 1, 1], 1, 2, 0) == []


# ---- scheduler: draft slots ------------------------------------------------------------------


def make_sched(num_blocks: int = 64, block_size: int = 4, k: int = 3,
               max_model_len: int | None = None, **config: Any) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(**config), kv, max_model_len=max_model_len,
                     num_spec_tokens=k)


def make_req(rid: str, prompt: list[int], max_tokens: int = 16, **params: Any) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(EOS,))


def check_pool(sched: Scheduler) -> None:
    """Every block's references are exactly the tables (and held/draining lists) naming it;
    the free queue is exactly the blocks at ref 0; free + used + cached == total."""
    kv = sched.kv
    refs: Counter[int] = Counter()
    for rid in sched.requests:
        refs.update(kv.block_ids(rid))
    for blocks in (*sched.held.values(), *sched.draining.values()):
        refs.update(blocks)
    pool = kv.pool
    for b in pool.blocks:
        assert b.ref_cnt == refs[b.block_id], b
    assert set(pool.free_queue()) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    stats = kv.stats()
    assert stats.used == len(refs)
    assert stats.cached == sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash)
    assert stats.free + stats.used + stats.cached == stats.total


def prefill(sched: Scheduler, token: int = 100) -> SchedulerOutput:
    """One step in which every scheduled entry that samples gets ``token``."""
    out = sched.schedule()
    sched.update_from_output(out, {s.request_id: token for s in out.scheduled if s.sample})
    check_pool(sched)
    return out


def with_drafts(out: SchedulerOutput, drafts: dict[str, list[int]]) -> SchedulerOutput:
    """The plan with drafts filled in, as the engine's _propose does."""
    scheduled = [s.with_drafts(drafts[s.request_id]) if s.request_id in drafts else s
                 for s in out.scheduled]
    return replace(out, scheduled=scheduled)


def test_a_decode_gets_k_draft_slots_allocated() -> None:
    sched = make_sched(block_size=4, k=3, max_num_tokens=64)
    sched.add_request(make_req("a", [1, 3, 4, 5, 6]))
    first = prefill(sched)
    assert first.scheduled[0].block_ids == [0, 1] and first.scheduled[0].spec_slots == 0
    out = sched.schedule()
    (sr,) = out.scheduled
    # positions 5 (the token) and 6..8 (drafts): block 2 is allocated for 8
    assert (sr.token_ids, sr.start_pos, sr.spec_slots, sr.num_spec) == ([100], 5, 3, 0)
    assert sr.block_ids == [0, 1, 2] == sched.kv.block_ids("a")
    check_pool(sched)


def test_spec_slots_are_capped_by_max_tokens_max_model_len_and_budget() -> None:
    # max_tokens: 1 output, max_tokens 3 -> room for 1 draft (a step emits drafts + 1)
    sched = make_sched(k=3)
    sched.add_request(make_req("a", [1, 3, 4, 5, 6], max_tokens=3))
    prefill(sched)
    assert sched.schedule().scheduled[0].spec_slots == 1
    # max_model_len 8: 6 tokens -> one more draft fits (8 - 6 - 1)
    sched = make_sched(k=3, max_model_len=8)
    sched.add_request(make_req("a", [1, 3, 4, 5, 6]))
    prefill(sched)
    assert sched.schedule().scheduled[0].spec_slots == 1
    # max_tokens 2 (one left): no draft at all
    sched = make_sched(k=3)
    sched.add_request(make_req("a", [1, 3, 4, 5, 6], max_tokens=2))
    prefill(sched)
    (sr,) = sched.schedule().scheduled
    assert sr.spec_slots == 0 and sr.block_ids == [0, 1]
    check_pool(sched)


def test_token_budget_counts_one_plus_k_per_decode() -> None:
    sched = make_sched(block_size=4, k=3, max_num_tokens=6, max_batch_size=8,
                       enable_chunked_context=True)
    sched.add_request(make_req("a", [1, 3, 4]))
    sched.add_request(make_req("b", [5, 6, 7]))
    prefill(sched)
    sched.add_request(make_req("c", [8, 9, 10]))
    out = sched.schedule()
    # Drafts come last: a and b decode (2 of 6), c's prompt is admitted (3), and the one
    # token left is a's draft slot (position 4: a new block, after c's).
    assert [(s.request_id, s.spec_slots) for s in out.scheduled] == [
        ("a", 1), ("b", 0), ("c", 0)]
    assert sched.kv.block_ids("a") == [0, 3] and sched.kv.block_ids("b") == [1]
    assert sched.kv.block_ids("c") == [2] and out.num_waiting == 0
    check_pool(sched)
    # the budget's last token: a decode with no room for drafts
    sched = make_sched(k=3, max_num_tokens=5, max_batch_size=8)
    for rid in "ab":
        sched.add_request(make_req(rid, [1, 3]))
    prefill(sched)
    out = sched.schedule()
    assert [(s.request_id, s.spec_slots) for s in out.scheduled] == [("a", 3), ("b", 0)]


def test_draft_slots_never_cause_a_later_decode_to_preempt() -> None:
    """5 blocks of 4; a and b hold 2 each (7 and 8 tokens), 1 free. Were a's draft slots
    granted in the decode pass, they would take the free block and b's next token (position
    8, a new block) would preempt it; granted last, b gets the block and a decodes alone."""
    plans = {}
    for k in (0, 3):
        sched = make_sched(num_blocks=5, block_size=4, k=k, capacity_policy=MAXUTIL,
                           max_num_tokens=64)
        sched.add_request(make_req("a", list(range(3, 10)), max_tokens=10))
        sched.add_request(make_req("b", list(range(20, 28)), max_tokens=2))
        steps = []
        for _ in range(3):
            out = sched.schedule()
            assert out.preempted == []
            steps.append([(r.request_id, r.spec_slots) for r in out.scheduled])
            sched.update_from_output(out, {r.request_id: 100 for r in out.scheduled
                                           if r.sample})
            check_pool(sched)
        plans[k] = steps
    assert plans[0] == [[("a", 0), ("b", 0)], [("a", 0), ("b", 0)], [("a", 0)]]
    # step 2: b's token took the free block; step 3: b is done, a's drafts get its blocks
    assert plans[3] == [[("a", 0), ("b", 0)], [("a", 0), ("b", 0)], [("a", 3)]]


def test_draft_slots_never_preempt() -> None:
    # 4 blocks of 4, both requests hold 2 (7 tokens each): the pool is full. Each decode's
    # own slot (position 7) is in its table; draft slots would need a new block: none.
    sched = make_sched(num_blocks=4, block_size=4, k=3, capacity_policy=MAXUTIL,
                       max_num_tokens=64)
    sched.add_request(make_req("a", [1, 3, 4, 5, 6, 7, 8], max_tokens=9))
    sched.add_request(make_req("b", [9, 10, 11, 12, 13, 14, 15], max_tokens=9))
    prefill(sched)
    assert sched.kv.num_free_blocks == 0
    out = sched.schedule()
    assert [(s.request_id, s.spec_slots) for s in out.scheduled] == [("a", 0), ("b", 0)]
    assert out.preempted == [] and sched.num_preemptions_total == 0
    assert sched.kv.block_ids("a") == [0, 1] and sched.kv.block_ids("b") == [2, 3]
    check_pool(sched)


def test_with_drafts_checks_its_arguments() -> None:
    sr = ScheduledRequest("a", [5], 4, [0, 1], True, spec_slots=2)
    got = sr.with_drafts([7, 8])
    assert (got.token_ids, got.num_spec, got.spec_slots) == ([5, 7, 8], 2, 2)
    for bad in ([], [7, 8, 9]):
        with pytest.raises(ValueError, match="draft slots"):
            sr.with_drafts(bad)
    with pytest.raises(ValueError, match="draft slots"):  # a prefill chunk carries none
        replace(sr, token_ids=[1, 2]).with_drafts([7])
    with pytest.raises(ValueError, match="draft slots"):  # drafts on drafts
        got.with_drafts([9])


# ---- scheduler: applying a verified step -----------------------------------------------------


def _decoding(k: int = 3, block_size: int = 4, **params: Any) -> tuple[Scheduler, Request]:
    """A request with prompt [1, 3, 4, 5, 6] that sampled 100 (5 computed, blocks [0, 1])."""
    sched = make_sched(block_size=block_size, k=k, max_num_tokens=64)
    req = make_req("a", [1, 3, 4, 5, 6], **params)
    sched.add_request(req)
    prefill(sched)
    return sched, req


def _cached(sched: Scheduler, req: Request) -> list[int]:
    """The request's blocks registered in the prefix cache, each checked against the hash of
    its tokens."""
    hashes = hash_token_blocks(req.all_token_ids, sched.block_size)
    table = sched.kv.block_ids(req.request_id)
    out = []
    for i, b in enumerate(table):
        h = sched.kv.pool.blocks[b].block_hash
        if h is not None:
            assert h == hashes[i]
            assert sched.kv.pool.get_cached_block(h) == b
            out.append(b)
    return out


def test_accepted_drafts_advance_computed_and_cache_only_computed_blocks() -> None:
    sched, req = _decoding()
    assert _cached(sched, req) == [0]
    out = with_drafts(sched.schedule(), {"a": [7, 8, 9]})
    assert out.scheduled[0].token_ids == [100, 7, 8, 9]
    # one draft accepted, then the target drew 50: positions 5, 6 hold real tokens, 7 and 8
    # rejected drafts (block 1 = positions 4..7 is not full of computed tokens)
    assert sched.update_from_output(out, {"a": 50}, {"a": [7]}) == []
    assert req.output_token_ids == [100, 7, 50]
    assert req.num_computed_tokens == 5 + 1 + 1
    assert sched.kv.block_ids("a") == [0, 1, 2]
    assert _cached(sched, req) == [0]
    check_pool(sched)
    # the next step rewrites position 7 with 50 (no drafts this time): block 1 is now full
    out = sched.schedule()
    (sr,) = out.scheduled
    assert (sr.token_ids, sr.start_pos, sr.block_ids) == ([50], 7, [0, 1, 2])
    sched.update_from_output(out, {"a": 60})
    assert req.num_computed_tokens == 8 and _cached(sched, req) == [0, 1]
    check_pool(sched)


def test_all_drafts_accepted_plus_the_bonus_token() -> None:
    sched, req = _decoding()
    out = with_drafts(sched.schedule(), {"a": [7, 8, 9]})
    sched.update_from_output(out, {"a": 50}, {"a": [7, 8, 9]})
    assert req.output_token_ids == [100, 7, 8, 9, 50]
    assert req.num_computed_tokens == 9  # positions 0..8; 50 (position 9) is next
    assert _cached(sched, req) == [0, 1]
    # the next decode starts at 9 and its drafts need positions 10..12: block 3
    (sr,) = sched.schedule().scheduled
    assert (sr.start_pos, sr.spec_slots, sr.block_ids) == (9, 3, [0, 1, 2, 3])
    check_pool(sched)


def test_no_draft_accepted() -> None:
    sched, req = _decoding()
    out = with_drafts(sched.schedule(), {"a": [7, 8]})
    sched.update_from_output(out, {"a": 50}, {})
    assert req.output_token_ids == [100, 50] and req.num_computed_tokens == 6
    check_pool(sched)


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    sched, req = _decoding()
    out = with_drafts(sched.schedule(), {"a": [7, EOS, 9]})
    done = sched.update_from_output(out, {"a": 50}, {"a": [7, EOS, 9]})
    assert done == [req] and req.status == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [100, 7, EOS]
    assert sched.kv.stats().used == 0
    check_pool(sched)
    # a stop token id: stop_reason names it
    sched, req = _decoding(stop_token_ids=[8])
    out = with_drafts(sched.schedule(), {"a": [7, 8, 9]})
    assert sched.update_from_output(out, {"a": 50}, {"a": [7, 8, 9]}) == [req]
    assert req.output_token_ids == [100, 7, 8] and req.stop_reason == 8
    check_pool(sched)
    # the bonus token stops it: everything is kept
    sched, req = _decoding()
    out = with_drafts(sched.schedule(), {"a": [7, 8]})
    assert sched.update_from_output(out, {"a": EOS}, {"a": [7, 8]}) == [req]
    assert req.output_token_ids == [100, 7, 8, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    check_pool(sched)


def test_max_tokens_reached_mid_way_drops_the_rest() -> None:
    # max_tokens 3 caps the slots at 1; with exactly that the request ends on the bonus token
    sched, req = _decoding(max_tokens=3)
    out = with_drafts(sched.schedule(), {"a": [7]})
    assert sched.update_from_output(out, {"a": 50}, {"a": [7]}) == [req]
    assert req.output_token_ids == [100, 7, 50]
    assert req.status == RequestStatus.FINISHED_LENGTH
    check_pool(sched)
    # more drafts than max_tokens leaves (slots widened by hand; block size 8 holds them)
    sched, req = _decoding(max_tokens=3, block_size=8)
    out = sched.schedule()
    out = replace(out, scheduled=[replace(out.scheduled[0], spec_slots=3).with_drafts(
        [7, 8, 9])])
    assert sched.update_from_output(out, {"a": 50}, {"a": [7, 8, 9]}) == [req]
    assert req.output_token_ids == [100, 7, 8]
    assert req.status == RequestStatus.FINISHED_LENGTH
    check_pool(sched)


def test_accepted_must_be_a_prefix_of_the_drafts() -> None:
    for bad in ([8], [7, 9], [7, 8, 9, 10]):
        sched, req = _decoding()
        out = with_drafts(sched.schedule(), {"a": [7, 8, 9]})
        with pytest.raises(ValueError, match="not a prefix"):
            sched.update_from_output(out, {"a": 50}, {"a": bad})


def test_speculating_and_plain_decodes_and_prefills_in_one_step() -> None:
    sched = make_sched(block_size=4, k=2, max_num_tokens=64, max_batch_size=8)
    sched.add_request(make_req("a", [1, 3, 4]))
    sched.add_request(make_req("b", [5, 6, 7, 8, 9]))
    prefill(sched)
    sched.add_request(make_req("c", [10, 11, 12, 13, 14, 15]))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.spec_slots) for s in out.scheduled] == [
        ("a", 1, 2), ("b", 1, 2), ("c", 6, 0)]
    out = with_drafts(out, {"a": [20, 21]})  # b carries none
    done = sched.update_from_output(out, {"a": 30, "b": 31, "c": 32}, {"a": [20]})
    assert done == []
    reqs = sched.requests
    assert reqs["a"].output_token_ids == [100, 20, 30] and reqs["a"].num_computed_tokens == 5
    assert reqs["b"].output_token_ids == [100, 31] and reqs["b"].num_computed_tokens == 6
    assert reqs["c"].output_token_ids == [32] and reqs["c"].num_computed_tokens == 6
    check_pool(sched)


# ---- verification rows and acceptance --------------------------------------------------------


def test_expand_rows_one_row_per_checked_position() -> None:
    p0 = SamplingParams(max_tokens=8, min_tokens=3)
    p1 = SamplingParams(max_tokens=8)
    rows = expand_rows([p0, p1], [1, 4], [(2,), ()],
                       [([9, 9], [5]), ([8], [6, 6, 6, 6])], [[11, 12], []])
    assert rows.params == [p0, p0, p0, p1]
    assert rows.positions == [1, 2, 3, 4]
    # min_tokens 3: output positions 1 and 2 still ban the stop tokens, 3 does not
    assert rows.banned == [(2,), (2,), (), ()]
    assert rows.histories == [([9, 9], [5]), ([9, 9], [5, 11]), ([9, 9], [5, 11, 12]),
                              ([8], [6, 6, 6, 6])]
    none = expand_rows([p1], [0], [()], None, [[3]])
    assert none.histories is None and none.positions == [0, 1]
    with pytest.raises(ValueError):
        expand_rows([p0, p1], [1], [(), ()], None, [[], []])


def _out(tokens: list[int], errors: list[str | None] | None = None) -> SamplerOutput:
    return SamplerOutput(tokens, [{t: -float(i)} for i, t in enumerate(tokens)],
                         errors or [None] * len(tokens))


def test_accept_takes_drafts_while_the_target_drew_them() -> None:
    # request 0: drafts [5, 6], rows drew [5, 6, 7]: all accepted + bonus 7
    # request 1: no drafts, row drew 9; request 2: drafts [1, 2, 3], rows [1, 4, 3, 3]
    out = accept(_out([5, 6, 7, 9, 1, 4, 3, 3]), [[5, 6], [], [1, 2, 3]])
    assert out.token_ids == [7, 9, 4]
    assert out.accepted == [[5, 6], [], [1]]
    assert out.logprobs == [{7: -2.0}, {9: -3.0}, {4: -5.0}]
    assert out.accepted_logprobs == [[{5: -0.0}, {6: -1.0}], [], [{1: -4.0}]]
    assert out.errors == [None, None, None]
    # the first draft rejected
    out = accept(_out([8, 6, 7]), [[5, 6]])
    assert (out.token_ids, out.accepted) == ([8], [[]])


def test_accept_errors() -> None:
    # a failed row counts as a mismatch; the request fails if its token's row failed
    out = accept(_out([-1, 6, 7], ["bad row", None, None]), [[5, 6]])
    assert out.errors == ["bad row"] and out.accepted == [[]]
    # a failed row after the first mismatch does not matter
    out = accept(_out([4, -1, 7], [None, "bad", None]), [[5, 6]])
    assert out.errors == [None] and out.token_ids == [4]
    with pytest.raises(ValueError, match="sampled rows"):
        accept(_out([1, 2]), [[5, 6]])
    with pytest.raises(ValueError, match="sampled rows"):
        accept(_out([1, 2, 3, 4]), [[1, 2]])


def test_spec_counters_record() -> None:
    c = SpecCounters()
    c.record([[1, 2, 3], [], [4]], [[1, 2], [], []])
    c.record([[5, 6, 7, 8]], [[5, 6, 7, 8]])
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (3, 8, 6)
    assert c.accepted_per_pos == [2, 2, 1, 1]
    with pytest.raises(ValueError):
        c.record([[1]], [])


# ---- the draft model's track -----------------------------------------------------------------


def test_track_valid_counts_kv_that_still_holds() -> None:
    # drafts [7, 8, 9] proposed at 5 tokens; their KV written up to position 8 (computed 8)
    t = _Track(preemptions=0, base=5, computed=8, drafts=[7, 8, 9])
    assert t.valid([0, 1, 2, 3, 4, 7, 8, 50]) == 7  # 7, 8 accepted; 9 rejected
    assert t.valid([0, 1, 2, 3, 4, 50]) == 5  # the first rejected
    assert t.valid([0, 1, 2, 3, 4, 7, 8, 9, 50]) == 8  # all accepted: capped by computed
    assert t.valid([0, 1, 2, 3, 4, 7]) == 6  # the request has fewer tokens than drafts
    assert t.valid([0, 1, 2, 3, 4]) == 5
    assert _Track(0, 5, 3, [7]).valid([0, 1, 2, 3, 4, 7]) == 3  # computed less than base
    assert _Track(0, 4, 4, []).valid([0, 1, 2, 3, 4, 5]) == 4


# ---- grammar masks over drafts ---------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(model_dir: str) -> Any:
    from tokenizers import Tokenizer

    from disagg.structured.grammar import GrammarCache

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    return GrammarCache(tok, tok.get_vocab_size(), [0])


SCHEMA = GrammarSpec("json", json.dumps({
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                     "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}), "response_format", 64)


def _answer(grammars: Any) -> list[int]:
    tokens = grammars.lltokenizer().tokenize_str('{"name":"ab","age":42}')
    m = grammars.matcher(SCHEMA)
    assert m.replay(tokens) and m.ll.is_accepting()
    return list(tokens)


def test_valid_prefix_cuts_at_the_first_refused_token(grammars: Any) -> None:
    ans = _answer(grammars)
    assert len(ans) >= 6
    m = grammars.matcher(SCHEMA)
    assert m.valid_prefix(ans) == len(ans)
    assert m.valid_prefix([]) == 0
    bad = grammars.lltokenizer().tokenize_str("}")
    assert m.valid_prefix([*ans[:3], *bad, *ans[3:]]) == 3
    # nothing was consumed: the whole answer still goes through
    assert m.replay(ans) and m.ll.is_accepting()


def test_forbidden_with_drafts_rows_match_single_steps(grammars: Any) -> None:
    import torch

    from disagg.structured.mask import MaskFiller

    cpu = torch.device("cpu")
    ans = _answer(grammars)
    filler = MaskFiller(grammars.vocab_size)
    for start in (0, 2):
        m = grammars.matcher(SCHEMA)
        assert m.replay(ans[:start])
        before = filler.forbidden([m], cpu)
        drafts = ans[start:start + 4]
        got = filler.forbidden_with_drafts([m, None], [drafts, [5, 6]], cpu)
        assert got is not None and got.shape == (1 + 4 + 3, grammars.vocab_size)
        for j in range(len(drafts) + 1):
            fresh = grammars.matcher(SCHEMA)
            assert fresh.replay(ans[:start + j])
            want = filler.forbidden([fresh], cpu)
            assert want is not None and torch.equal(got[j], want[0]), (start, j)
            if j < len(drafts):  # each draft is allowed by its row: it would be accepted
                assert not got[j, drafts[j]]
        assert not got[5:].any()  # the unconstrained request's rows
        # the matcher is where it started: same mask, and the next real token (the first
        # draft) is consumed once, not refused as a repeat
        assert torch.equal(filler.forbidden([m], cpu), before)
        assert m.replay(ans[start:]) and m.ll.is_accepting()


def test_forbidden_with_drafts_after_a_refused_draft(grammars: Any) -> None:
    import torch

    from disagg.structured.mask import MaskFiller

    cpu = torch.device("cpu")
    ans = _answer(grammars)
    filler = MaskFiller(grammars.vocab_size)
    m = grammars.matcher(SCHEMA)
    bad = grammars.lltokenizer().tokenize_str("}")[0]
    drafts = [ans[0], ans[1], bad, ans[2]]
    got = filler.forbidden_with_drafts([m], [drafts], cpu)
    assert got is not None and got[2, bad]  # the row that checks the refused draft bans it
    assert torch.equal(got[3], got[2]) and torch.equal(got[4], got[2])
    fresh = grammars.matcher(SCHEMA)
    assert fresh.replay(ans[:2])
    want = filler.forbidden([fresh], cpu)
    assert want is not None and torch.equal(got[2], want[0])
    assert m.replay(ans) and m.ll.is_accepting()
    assert filler.forbidden_with_drafts([None], [[1]], cpu) is None


def test_no_draft_slots_in_a_step_of_disable_by_batch_size_decodes() -> None:
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_tokens=64), kv, num_spec_tokens=3,
                      spec_disable_batch_size=2)
    sched.add_request(make_req("a", [1, 3, 4]))
    prefill(sched)
    # one decode: below the limit, it gets its slots
    out = sched.schedule()
    assert [(s.request_id, s.spec_slots) for s in out.scheduled] == [("a", 3)]
    sched.update_from_output(out, {"a": 100})
    sched.add_request(make_req("b", [5, 6, 7]))
    prefill(sched)  # a decodes one token (b's prefill is the step's other entry), b starts
    out = sched.schedule()
    assert [(s.request_id, s.spec_slots) for s in out.scheduled] == [("a", 0), ("b", 0)]
    check_pool(sched)
