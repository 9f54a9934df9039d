"""``method: draft_model``: a smaller checkpoint of the same vocabulary proposes its greedy
continuation, on its own KV cache laid out like the target's.

The draft's cache has the target's block count and block size, and the draft reads and
writes it through the target's block tables: position p of a request lives in block
``block_ids[p // B]`` of both caches. So the draft needs no block bookkeeping of its own;
what it tracks per request is how many positions of its own cache hold KV it computed for
this request's current tokens (``_Track.computed``).

Where the draft's prompt KV comes from: the draft computes it itself, the first time the
request decodes here (a "catch-up" chunk of the draft's forward, bounded per step by
``max_num_tokens``). Under disaggregation that is on the generation worker: the context
worker ships only the target's KV and its first token. The draft's prompt forward costs
about draft/target parameters of the target's prefill, paid once per request, and keeps
the context worker free of the draft model (no second model to load there, no second KV
transfer, no layout conversion for the draft's cache); ``bench/spec_decode.py`` measures it.
A request never trusts draft KV it did not compute: after a prefix-cache hit, a preemption
or a rejected draft the draft computes those positions again.

Per engine step (k = the request's draft slots, N = its tokens, draft KV valid on [0, c))::

    draft step 0:      tokens [c, N)         -> argmax: d1   (KV of [c, N) written)
    draft step j<k:    token d_j at N-1+j    -> argmax: d_{j+1}
    after the target:  valid = N + (accepted drafts, at most k-1: d_k's KV was never written)

The draft writes KV into positions up to N+k-2, inside the slots the scheduler reserved for
the target's check (positions up to N-1+k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.config import ConfigError, EngineConfig, build_engine_config
from disagg.request import Request
from disagg.runner import ModelRunner
from disagg.scheduler import ScheduledRequest, SchedulerOutput
from disagg.spec_decode.proposer import Proposer


@dataclass
class _Track:
    """One request's draft KV: positions [0, computed) assume ``drafts`` (proposed at
    ``base`` = the request's token count then) were accepted; ``preemptions``: the
    request's count when computed (a preemption freed the blocks)."""

    preemptions: int
    base: int
    computed: int
    drafts: list[int]

    def valid(self, tokens: Sequence[int]) -> int:
        """Positions whose KV still holds: those before ``base`` and each draft the target
        accepted (it equals the request's token at its position), up to ``computed``."""
        a = 0
        while (a < len(self.drafts) and self.base + a < len(tokens)
               and tokens[self.base + a] == self.drafts[a]):
            a += 1
        return min(self.base + a, self.computed)


class DraftModelProposer(Proposer):
    """Greedy proposals of a draft checkpoint (see the module docstring)."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        sched = config.scheduler
        B = config.cache.tokens_per_block
        try:
            dcfg = build_engine_config(
                spec.model, tokens_per_block=B, kv_cache_tokens=num_blocks * B,
                max_batch_size=sched.max_batch_size, max_num_tokens=sched.max_num_tokens,
                max_model_len=config.max_model_len, dtype=config.dtype, device=config.device,
                enforce_eager=True, seed=config.seed)
        except (ConfigError, OSError) as e:
            raise ConfigError(f"speculative_config.model: {e}") from None
        if dcfg.model.vocab_size != config.model.vocab_size:
            raise ConfigError(
                f"speculative_config.model: the draft's vocab_size ({dcfg.model.vocab_size}) "
                f"differs from the target's ({config.model.vocab_size}); a draft model must "
                f"share the target's tokenizer")
        if dcfg.model.max_position_embeddings < config.max_model_len:
            raise ConfigError(
                f"speculative_config.model: the draft's max_position_embeddings "
                f"({dcfg.model.max_position_embeddings}) is below this worker's max_model_len "
                f"({config.max_model_len}); set max_model_len <= it")
        self.config = dcfg
        self.runner = ModelRunner(dcfg)
        if self.runner.num_blocks < num_blocks:
            raise MemoryError(f"draft model KV cache: {self.runner.num_blocks} blocks, the "
                              f"target has {num_blocks}")
        self.max_num_tokens = sched.max_num_tokens
        self._tracks: dict[str, _Track] = {}
        # Measured for the benchmark: draft forwards run and catch-up tokens computed.
        self.num_forwards = 0
        self.num_catch_up_tokens = 0

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, entries: Sequence[tuple[Request, ScheduledRequest]]
                ) -> dict[str, list[int]]:
        budget = self.max_num_tokens
        decodes: list[ScheduledRequest] = []
        chunks: list[ScheduledRequest] = []
        live: dict[str, tuple[int, int, list[int]]] = {}  # rid -> (N, k, block ids)
        for req, sr in entries:
            rid = req.request_id
            tokens = req.prompt_token_ids + req.output_token_ids
            N = len(tokens)
            tr = self._tracks.get(rid)
            c = (tr.valid(tokens) if tr is not None and tr.preemptions == req.num_preemptions
                 else 0)
            n = min(N - c, budget)
            if n <= 0:
                continue
            budget -= n
            self.num_catch_up_tokens += n - 1  # (the last token is every step's own)
            # positions [c, c + n) into the target's table; samples only when it reaches N
            step = ScheduledRequest(rid, tokens[c:c + n], c, sr.block_ids, c + n == N)
            (decodes if n == 1 else chunks).append(step)
            self._tracks[rid] = _Track(req.num_preemptions, N, c + n, [])
            if c + n == N:
                live[rid] = (N, sr.spec_slots, sr.block_ids)
        drafts: dict[str, list[int]] = {rid: [] for rid in live}
        if not decodes and not chunks:
            return {}
        # run even when no request reaches N: the catch-up chunks' KV is recorded as computed
        last = self._greedy(decodes + chunks, len(decodes))
        if not live:
            return {}
        for j in range(1, max(k for _, k, _ in live.values()) + 1):
            for rid, tok in last.items():
                drafts[rid].append(tok)
            more = [ScheduledRequest(rid, [drafts[rid][-1]], N - 1 + j, table, True)
                    for rid, (N, k, table) in live.items() if k > j]
            if not more:
                break
            last = self._greedy(more, len(more))
        for rid, d in drafts.items():
            tr = self._tracks[rid]
            tr.drafts = d
            tr.computed = tr.base + len(d) - 1  # d_1 .. d_{k-1} have KV, d_k not
        return drafts

    def _greedy(self, scheduled: list[ScheduledRequest], num_decodes: int) -> dict[str, int]:
        """One draft forward; the argmax after each sampling entry."""
        sched = SchedulerOutput(scheduled, num_decodes,
                                sum(len(s.token_ids) for s in scheduled), [], 0, 0)
        rids, logits = self.runner.execute(sched)
        self.num_forwards += 1
        if logits is None:
            return {}
        return dict(zip(rids, logits.argmax(dim=-1).tolist(), strict=True))
