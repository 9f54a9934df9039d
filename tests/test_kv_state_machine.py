"""Scheduler + KVCacheManager under every request life at once (torch-free, hypothesis).

Identical and overlapping prompts arrive in bursts (prefix hits on blocks other requests still
hold or are still filling), requests are aborted at any moment (waiting, mid-prefill, between
``schedule`` and ``update_from_output``, while their KV is being pulled), context-only requests
keep their blocks after finishing (``hold_blocks_on_finish`` / ``release_held``), requests
whose prompt KV comes from another worker wait in WAITING_FOR_REMOTE_KV until
``remote_kv_ready`` (one that ends meanwhile keeps its blocks in ``draining``, written to by
its cancelled transfer, until ``release_draining``); both capacity policies (preemption under
max_utilization).

After every rule: free + used + cached == total; each block's ref_cnt is the number of live
block tables, held and draining lists containing it; no block twice in one table; the hash
index and the blocks agree; and a fake KV store (the token written in each (block, offset)
slot) proves that what a request attends to, what a prefix hit reuses and what a lease holds is
the right content. At teardown, once everything is aborted or released, every block is free or
cached with ref 0 and nothing is remembered about any request.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from disagg.config import CapacityPolicy, SchedulerConfig
from disagg.kv_cache.hashing import hash_token_blocks
from disagg.kv_cache.manager import KVCacheManager
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.scheduler import Scheduler, SchedulerOutput

EOS = 0
VOCAB = [1, 2, 3]  # tiny: prompts collide block by block
PREFIXES = [(1, 2, 3, 1, 2, 3, 1, 2), (1, 2, 3, 3), (2, 2)]
MAX_MODEL_LEN = 24
KINDS = ["plain", "context", "remote", "remote_untrusted"]


class KVMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(list(CapacityPolicy)),
        chunked=st.booleans(),
        caching=st.booleans(),
        block_size=st.sampled_from([1, 2, 4]),
        pool_tokens=st.integers(min_value=12, max_value=40),
        max_num_tokens=st.integers(min_value=3, max_value=16),
        max_batch_size=st.integers(min_value=1, max_value=5),
    )
    def setup(self, policy: CapacityPolicy, chunked: bool, caching: bool, block_size: int,
              pool_tokens: int, max_num_tokens: int, max_batch_size: int) -> None:
        config = SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                 enable_chunked_context=chunked, capacity_policy=policy)
        self.kv = KVCacheManager(max(1, pool_tokens // block_size), block_size,
                                 enable_prefix_caching=caching)
        self.sched = Scheduler(config, self.kv, max_model_len=MAX_MODEL_LEN)
        self.B = block_size
        self.next_id = 0
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
        self.block_tokens: dict[int, tuple[int, ...]] = {}  # block hash -> the block's tokens
        self.held_content: dict[str, list[int]] = {}  # held request -> its tokens at finish
        self.untrusted: set[str] = set()  # remote requests whose KV must never be cached

    # -- rules -------------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.sampled_from(VOCAB), max_size=5),
          max_tokens=st.integers(min_value=1, max_value=6),
          copies=st.integers(min_value=1, max_value=3), kind=st.sampled_from(KINDS),
          first=st.sampled_from([EOS, *VOCAB]))
    def add(self, prefix: tuple[int, ...], suffix: list[int], max_tokens: int, copies: int,
            kind: str, first: int) -> None:
        """A burst of identical requests (same prompt, same kind)."""
        prompt = list(prefix) + suffix
        for _ in range(copies):
            rid = f"r{self.next_id}"
            self.next_id += 1
            req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens),
                          eos_token_ids=(EOS,))
            if kind.startswith("remote"):
                # The context worker's first token is an output already; the KV is pulled.
                req.output_token_ids = [first]
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                if kind == "remote_untrusted":
                    self.untrusted.add(rid)
            self.sched.add_request(req)
            if req.is_finished():
                assert req.status == RequestStatus.FINISHED_ERROR and req.error
                continue
            if kind == "context":
                self.sched.hold_blocks_on_finish(rid)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        sched = self.sched
        out = sched.schedule()
        self._check_plan(out)
        for f in out.kv_fetches:
            req = sched.requests[f.request_id]
            assert f.block_ids == self.kv.block_ids(f.request_id)
            assert len(f.block_ids) == self.kv.blocks_needed(f.num_tokens)
            assert f.num_tokens == req.num_prompt_tokens
        self._run_model(out)
        # Aborts racing the step: the plan handed out must be ignored for them.
        live = sorted(sched.requests)
        if live and data.draw(st.booleans(), label="abort_mid_step"):
            rid = data.draw(st.sampled_from(live), label="abort_mid_step_id")
            assert sched.abort_request(rid) is not None
        sampled = {sr.request_id: data.draw(st.sampled_from([EOS, *VOCAB]), label="token")
                   for sr in out.scheduled if sr.sample}
        for req in sched.update_from_output(out, sampled):
            assert req.is_finished() and req.request_id not in sched.requests
            if req.request_id in sched.held:
                assert req.status == RequestStatus.FINISHED_LENGTH
                # What the lease serves: the KV of [0, num_computed_tokens).
                self.held_content[req.request_id] = req.all_token_ids[:req.num_computed_tokens]
                held = sched.held[req.request_id]
                assert len(held) == self.kv.blocks_needed(req.num_computed_tokens)

    @precondition(lambda self: bool(self.sched.fetching))
    @rule(data=st.data())
    def remote_ready(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.fetching)))
        req = self.sched.fetching[rid]
        table = self.kv.block_ids(rid)
        for p, t in enumerate(req.prompt_token_ids):  # the transfer writes the prompt's KV
            self.slots[(table[p // self.B], p % self.B)] = t
        self.sched.remote_kv_ready(rid, cache=rid not in self.untrusted)
        assert req.status == RequestStatus.RUNNING
        assert req.num_computed_tokens == req.num_prompt_tokens

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED,
                                                  RequestStatus.FINISHED_STOPPED,
                                                  RequestStatus.FINISHED_ERROR]))
    def finish(self, data: st.DataObject, status: RequestStatus) -> None:
        """Abort / stop string / failed transfer: at any point of a request's life."""
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        table = self.kv.block_ids(rid)
        refs = Counter(table)
        before = {b: self.kv.pool.blocks[b].ref_cnt for b in refs}
        fetching = rid in self.sched.fetching
        req = self.sched.finish_request(rid, status)
        assert req is not None and req.status == status
        assert rid not in self.sched.held  # only a length finish holds
        # Its KV was arriving: the blocks stay out of the pool until the transfer stopped.
        assert (self.sched.draining.get(rid) == table) if fetching else (
            rid not in self.sched.draining)
        for b, n in refs.items():
            assert self.kv.pool.blocks[b].ref_cnt == before[b] - (0 if fetching else n)
        assert self.sched.finish_request(rid, status) is None  # idempotent

    @precondition(lambda self: bool(self.sched.draining))
    @rule(data=st.data())
    def late_write(self, data: st.DataObject) -> None:
        """A cancelled transfer still writes into a draining request's blocks: garbage that
        no live table, lease or cached block may see (integrity checks their contents)."""
        rid = data.draw(st.sampled_from(sorted(self.sched.draining)))
        for b in self.sched.draining[rid]:
            for o in range(self.B):
                self.slots[(b, o)] = -7

    @precondition(lambda self: bool(self.sched.draining))
    @rule(data=st.data())
    def transfer_stopped(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.draining)))
        table = self.sched.draining[rid]
        before = {b: self.kv.pool.blocks[b].ref_cnt for b in table}
        assert self.sched.release_draining(rid)
        assert not self.sched.release_draining(rid)
        for b in table:
            assert self.kv.pool.blocks[b].ref_cnt == before[b] - 1

    @precondition(lambda self: bool(self.sched.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.held)))
        self._check_held(rid)
        assert self.sched.release_held(rid)
        assert not self.sched.release_held(rid)  # the lease ends once
        del self.held_content[rid]

    # -- checks ------------------------------------------------------------------------------

    def _run_model(self, out: SchedulerOutput) -> None:
        """Check what each planned request attends to, then write its new tokens' KV."""
        B = self.B
        for sr in out.scheduled:
            tokens = self.sched.requests[sr.request_id].all_token_ids
            for p in range(sr.start_pos):
                assert self.slots.get((sr.block_ids[p // B], p % B)) == tokens[p], (sr, p)
            for i, t in enumerate(sr.token_ids):
                p = sr.start_pos + i
                self.slots[(sr.block_ids[p // B], p % B)] = t

    def _check_plan(self, out: SchedulerOutput) -> None:
        cfg = self.sched.config
        assert len(out.scheduled) <= cfg.max_batch_size
        assert out.num_scheduled_tokens <= cfg.max_num_tokens
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        for sr in out.scheduled:
            req = self.sched.requests[sr.request_id]
            assert req.status == RequestStatus.RUNNING
            assert sr.start_pos == req.num_computed_tokens
            assert sr.block_ids == self.kv.block_ids(sr.request_id)
            assert len(sr.block_ids) == self.kv.blocks_needed(sr.start_pos + len(sr.token_ids))
        if self.sched.no_evict:
            assert out.preempted == []

    def _check_held(self, rid: str) -> None:
        """A held (leased) block is never handed to anyone else: its KV is intact."""
        tokens = self.held_content[rid]
        table = self.sched.held[rid]
        for p, t in enumerate(tokens):
            assert self.slots.get((table[p // self.B], p % self.B)) == t, (rid, p)

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "kv"):
            return
        kv, sched = self.kv, self.sched
        pool = kv.pool
        blocks = pool.blocks
        stats = pool.stats()
        assert stats.free + stats.used + stats.cached == stats.total == len(blocks)
        assert stats.used == sum(b.ref_cnt > 0 for b in blocks)
        assert stats.cached == sum(b.ref_cnt == 0 and b.block_hash is not None for b in blocks)
        queue = pool.free_queue()
        assert len(queue) == len(set(queue)) == pool.num_free_blocks
        assert set(queue) == {b.block_id for b in blocks if b.ref_cnt == 0}

        # ref_cnt == how many live tables and held lists contain the block.
        refs: Counter[int] = Counter()
        for rid, table in kv._tables.items():
            assert len(set(table)) == len(table), (rid, table)
            refs.update(table)
        for rid, table in (*sched.held.items(), *sched.draining.items()):
            assert len(set(table)) == len(table), (rid, table)
            assert rid not in kv._tables and rid not in sched.requests
            refs.update(table)
        assert [b.ref_cnt for b in blocks] == [refs[b.block_id] for b in blocks]

        # Tables belong to live requests: running ones cover their computed tokens, fetching
        # ones their prompt, waiting / preempted ones hold nothing.
        assert set(kv._tables) <= set(sched.requests)
        for req in sched.running:
            assert req.status == RequestStatus.RUNNING
            assert len(kv.block_ids(req.request_id)) == kv.blocks_needed(req.num_computed_tokens)
        for rid, req in sched.fetching.items():
            assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
            assert len(kv.block_ids(rid)) == kv.blocks_needed(req.num_prompt_tokens)
        for req in sched.waiting:
            assert kv.num_held_blocks(req.request_id) == 0 and req.num_computed_tokens == 0
        ids = ([r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
               + list(sched.fetching))
        assert sorted(ids) == sorted(sched.requests)

        # The hash index and the blocks agree; a cached block holds its hash's tokens.
        hashed = {b.block_hash: b.block_id for b in blocks if b.block_hash is not None}
        assert len(hashed) == sum(b.block_hash is not None for b in blocks)
        for h, block_id in hashed.items():
            assert kv.pool.get_cached_block(h) == block_id
        self._learn_block_tokens()
        for h, block_id in hashed.items():
            content = tuple(self.slots.get((block_id, o)) for o in range(self.B))
            assert content == self.block_tokens[h], (block_id, content)
        # Untrusted pulled KV never serves a prefix hit (once preempted, the request
        # recomputes its prompt here: those blocks are this worker's own work).
        for rid in self.untrusted & set(kv._tables):
            if sched.requests[rid].num_preemptions == 0:
                assert all(blocks[b].block_hash is None for b in kv._tables[rid]), rid
        for rid in self.held_content:
            self._check_held(rid)

    def _learn_block_tokens(self) -> None:
        for req in self.sched.requests.values():
            tokens = req.all_token_ids
            for i, h in enumerate(hash_token_blocks(tokens, self.B)):
                self.block_tokens.setdefault(h, tuple(tokens[i * self.B:(i + 1) * self.B]))

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        sched = self.sched
        for rid in sorted(sched.requests):
            assert sched.abort_request(rid) is not None
        for rid in sorted(sched.held):
            assert sched.release_held(rid)
        for rid in sorted(sched.draining):
            assert sched.release_draining(rid)
        sched.update_from_output(sched.schedule(), {})  # reports refused requests
        assert not sched.has_unfinished()
        for b in self.kv.pool.blocks:
            assert b.ref_cnt == 0, b
        stats = self.kv.stats()
        assert stats.used == 0 and stats.free + stats.cached == stats.total
        assert self.kv._tables == {} and self.kv._hashes == {} and self.kv._num_registered == {}


KVMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_scheduler_kv_state_machine = KVMachine.TestCase
