"""Speculative decoding: a proposer guesses the next tokens of each decoding request, the
target model checks all of them in one forward, and every guess it would have made itself is
kept.

One engine step with speculation (``LLMEngine.step``)::

    schedule      each decode gets up to k draft slots (KV slots + token budget) from what
                  is left after decodes, chunks and admissions: never a preemption, never
                  past max_tokens / max_model_len
    propose       the proposer fills them (``Proposer.propose``): ngram prompt lookup, or
                  a draft model over its own KV cache that shares the target's block tables;
                  drafts a request's grammar refuses are cut there
    forward       a decode with drafts runs as a k+1-token chunk (paged attention over its
                  context, causal inside the chunk) beside plain decodes and prefill chunks;
                  logits at each of its k+1 positions
    verify        row j is sampled exactly as non-speculative decoding would sample output
                  position n+j had drafts 1..j been emitted (penalty history, min_tokens bans,
                  grammar mask, the seeded uniform of that position); drafts are accepted up
                  to the first row whose token differs, and that row's token follows them
    commit        the scheduler appends accepted + 1 tokens up to the first stop; only their
                  KV stays computed (the rejected drafts' slots are written again later, and a
                  block is cached only once full of computed tokens); the engine feeds them to
                  the detokenizer (stop strings) and the grammar matcher one by one

Proposals are deterministic (the draft model proposes its argmax), so the draft distribution
q is one-hot: the rejection-sampling rule (accept d with probability min(1, p(d)/q(d)), else
draw from norm(max(0, p - q))) is "accept d with probability p(d), else draw from p without
d", which is what drawing t ~ p and accepting d iff t == d does. Hence the output distribution
is the target's, greedy output is identical to non-speculative decoding, and a seeded request
(whose uniform at each output position is fixed) draws the same tokens with speculation on or
off.
"""

from disagg.config import EngineConfig
from disagg.spec_decode.draft_model import DraftModelProposer
from disagg.spec_decode.proposer import NgramProposer, Proposer

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "make_proposer"]


def make_proposer(config: EngineConfig, num_blocks: int) -> Proposer | None:
    """The proposer ``config.speculative`` asks for (None: speculation is off).
    ``num_blocks``: the target's KV blocks (a draft model's cache mirrors them)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return DraftModelProposer(config, num_blocks)
