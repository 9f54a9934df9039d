"""A request's disaggregation mode: where its prompt KV comes from and where it goes (torch-free).

One frozen sum type, ``KVMode``, built once where the worker parses the HTTP request's
``disaggregated_params`` (``server/disagg_requests.py``) and passed unchanged down the stack::

    server Choice.mode -> EngineClient.generate(mode=) -> AsyncLLM's add command
      -> LLMEngine.add_request(mode=) -> the request's engine state -> KVConnector.add_request

=================  ==========================  =================================================
variant            wire (request_type, ...)    what the worker does
=================  ==========================  =================================================
``Local``          none / context_and_gen.     an ordinary request: prefill and decode here
                   (+ ``resume``: a migrated   (prompt + the tokens already streamed, then on)
                   request)
``ContextOnly``    context_only                prefill, sample the first token, lease the KV
``ContextStream``  context_only + kv_stream_id  the same, the KV published layer by layer as it
                                               is computed, leased from the moment it is queued
``Pull``           generation_only + params    pull the prompt KV the params name, then decode
``Dummy``          generation_only, no params  (``benchmark_gen_only``) decode as if the KV
                                               were in place, without computing or pulling it
=================  ==========================  =================================================

Whether a context request's blocks are leased also depends on the client's ``max_tokens``
(one token is final: nothing is leased); that is not the mode's business and travels beside it.
``RequestType`` stays the word on the wire; the mode is what the worker made of it.

Beside the mode, also not a variant: a ``PrefixPull`` (the request's top-level ``kv_prefix``,
issue 41): the KV of the prompt's first tokens is cached on a peer worker, which leased it
(``POST /kv_prefix``); this worker pulls it instead of computing it, then computes the rest.
It goes with ``Local`` and ``ContextOnly`` requests (an ordinary request on any role, a
context worker's prefill), never with a ``Pull`` (that pulls the whole prompt already).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from disagg.contracts.params import ContextParams
from disagg.contracts.roles import Role


@dataclass(frozen=True)
class Local:
    """An ordinary request: this worker computes its prompt KV and decodes (any role).
    ``resumed``: a migrated request (``disaggregated_params.resume``, router.flow): the output
    tokens another worker already streamed to the client. The request starts with them as its
    outputs (as a preempted request does: its KV is recomputed here), so sampling, penalties,
    ``min_tokens`` and ``max_tokens`` go on at output position ``len(resumed)``."""

    resumed: tuple[int, ...] = ()
    needs_role: ClassVar[Role | None] = None
    is_context: ClassVar[bool] = False


@dataclass(frozen=True)
class ContextOnly:
    """A context worker's half of a disaggregated request: prefill and one sampled token (the
    engine runs ``max_tokens=1``); unless that token ends the request, its blocks go under a
    lease whose params the answer carries to the generation worker."""

    needs_role: ClassVar[Role | None] = Role.CONTEXT
    is_context: ClassVar[bool] = True


@dataclass(frozen=True)
class ContextStream:
    """A ``ContextOnly`` request whose KV is streamed (``kv_stream_id``): its lease, under the
    request's id, exists from the moment it is queued, and each layer's KV is published as the
    prefill computes it, then its first token. ``num_tokens``: the prompt tokens whose KV is
    published; ``tokens_hash``: ``token_ids_hash`` of their ids (a reader checks it)."""

    num_tokens: int
    tokens_hash: str
    needs_role: ClassVar[Role | None] = Role.CONTEXT
    is_context: ClassVar[bool] = True


@dataclass(frozen=True)
class Pull:
    """A generation worker's half: the prompt KV is pulled from the context worker ``params``
    names (``params.stream``: pulled while it is computed, the first token with the last read);
    the request starts with the context worker's first token and decodes once the KV is in
    place. ``trusted``: the request came signed by the cluster, so the pulled KV is the KV of
    its prompt and may serve other requests' prefix hits; otherwise it serves this request only
    (a forged request could plant blocks that later requests reuse)."""

    params: ContextParams
    trusted: bool
    needs_role: ClassVar[Role | None] = Role.GENERATION
    is_context: ClassVar[bool] = False


@dataclass(frozen=True)
class Dummy:
    """A benchmarking aid (``benchmark_gen_only``, TensorRT-LLM's gen-only benchmark): a
    generation request without context params decodes at once, as if its prompt KV were in
    place, without computing or pulling it. Its output is meaningless; its timing is that of a
    generation worker whose context side keeps up."""

    needs_role: ClassVar[Role | None] = Role.GENERATION
    is_context: ClassVar[bool] = False


KVMode = Local | ContextOnly | ContextStream | Pull | Dummy


@dataclass(frozen=True)
class PrefixPull:
    """KV of the prompt's first ``params.num_tokens`` tokens, leased by a peer worker
    (``params.prompt_token_ids`` are those tokens, a proper prefix of the prompt; the lease id
    is ``params.ctx_request_id``). The worker pulls it into the request's first blocks and
    computes the rest; when its own prefix cache holds as much it gives the lease back instead;
    a failed pull is not the request's failure: it computes the prefix itself. ``trusted`` as
    for ``Pull``: signed by the cluster, the pulled KV may serve other requests' prefix hits."""

    params: ContextParams
    trusted: bool

    @property
    def num_tokens(self) -> int:
        return self.params.num_tokens

LOCAL = Local()
