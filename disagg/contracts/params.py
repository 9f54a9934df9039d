"""`disaggregated_params`: what the context worker tells the generation worker (torch-free).

Request (router -> worker)::

    {"request_type": "context_only"}                       # prefill, keep the KV, answer params
    {"request_type": "generation_only", ...ContextParams}  # pull the KV, then decode
    {"request_type": "context_and_generation"}             # or no params: an ordinary request

Context answer (worker -> router), the fields of ``ContextParams``::

    ctx_request_id      the lease id: the generation side names it when reading and releasing
    first_gen_tokens    token(s) the context worker sampled (the first output token)
    first_gen_logprobs  their logprobs ({token id: logprob} per token) when asked, else null
    prompt_token_ids    the prompt as the context worker tokenized it
    worker_id           the context worker's id (a restarted worker has a new one)
    backend             "UCX" | "TCP": how to read
    addresses           transfer address of each context rank, by rank
    block_ids           the request's block table (the same on every rank)
    num_tokens          tokens whose KV is held: positions [0, num_tokens)
    layout              WorkerLayout.to_dict(): tp, pp, layer and kv-head ranges per rank,
                        head_dim (the cache row's width), tokens_per_block, dtype,
                        cache_kind ("mha" | "mla") and kv_parts (2 | 1); absent kind:
                        "mha" (an older peer). A generation worker whose cache differs
                        answers 400 naming the field (layout.check_compatible)
    lease_expiry        wall-clock time (seconds since the epoch) after which reads fail
    cached_tokens       prompt tokens the context worker found in its prefix cache (optional;
                        the generation worker's usage reports it: the prefill was there)

KV streaming (the router calls both workers at once; README "KV streaming")::

    context:    {"request_type": "context_only", "kv_stream_id": "<id>"}
    generation: {"request_type": "generation_only",
                 "kv_stream": {"ctx_request_id": "<id>", "worker_id", "backend", "addresses",
                               "layout"}}

The context worker prefills the prompt under lease ``<id>``, publishes each layer's KV as it
is computed and then its first token; the generation worker tokenizes the prompt itself, pulls
the KV as it appears (``ContextParams.stream``: no block ids, no first token yet) and gets the
first token with its last read.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from disagg.layout import WorkerLayout


class DisaggParamsError(ValueError):
    """Malformed disaggregated_params; the message names the field."""


@dataclass(frozen=True)
class ContextParams:
    ctx_request_id: str
    first_gen_tokens: list[int]
    prompt_token_ids: list[int]
    worker_id: str
    backend: str
    addresses: list[str]
    block_ids: list[int]
    num_tokens: int
    layout: WorkerLayout
    lease_expiry: float
    first_gen_logprobs: list[dict[int, float]] | None = None
    # prompt_logprobs the context worker computed (first entry None), for the generation
    # worker's answer; None when the request did not ask.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # with prompt_logprobs
    # KV streaming: the prompt's KV is pulled while the context worker computes it, its first
    # token with the last read (no block ids, no first token yet).
    stream: bool = False
    cached_tokens: int | None = None  # the context side's prefix-cache hit (None: unknown)
    # Tracing (disagg/tracing.py): the generation worker's own, never on the wire of the
    # answer: the W3C traceparent of its kv_transfer span, which its KV READs carry.
    traceparent: str | None = None

    @classmethod
    def from_stream(cls, d: Any, prompt_token_ids: list[int]) -> ContextParams:
        """A generation_only request's ``kv_stream`` object (module docstring), for the prompt
        as this worker tokenized it. ``DisaggParamsError`` names the field."""
        if not isinstance(d, dict):
            raise DisaggParamsError("disaggregated_params.kv_stream: must be an object")
        f = {name: _field(d, name, kind, "kv_stream.")
             for name, kind in STREAM_FIELD_TYPES.items()}
        backend, layout, addresses = _transport(f, "kv_stream.")
        if not _STREAM_ID.fullmatch(f["ctx_request_id"]):
            raise DisaggParamsError("disaggregated_params.kv_stream.ctx_request_id: 1-128 of "
                                    "A-Z a-z 0-9 _ . : -")
        ids = _int_list("prompt_token_ids", prompt_token_ids)
        return cls(ctx_request_id=f["ctx_request_id"], first_gen_tokens=[],
                   prompt_token_ids=ids, worker_id=f["worker_id"], backend=backend,
                   addresses=addresses, block_ids=[], num_tokens=len(ids),
                   layout=layout, lease_expiry=0.0, stream=True)

    def to_dict(self) -> dict[str, Any]:
        out = self._required_dict()
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [None if lp is None else {str(k): v for k, v in lp.items()}
                                      for lp in self.prompt_logprobs]
            out["prompt_logprob_ranks"] = self.prompt_logprob_ranks
        if self.stream:
            out["kv_stream_id"] = self.ctx_request_id
        if self.cached_tokens is not None:
            out["cached_tokens"] = self.cached_tokens
        return out

    def _required_dict(self) -> dict[str, Any]:
        return {
            "ctx_request_id": self.ctx_request_id,
            "first_gen_tokens": list(self.first_gen_tokens),
            "first_gen_logprobs": None if self.first_gen_logprobs is None else [
                {str(k): v for k, v in lp.items()} for lp in self.first_gen_logprobs],
            "prompt_token_ids": list(self.prompt_token_ids),
            "worker_id": self.worker_id,
            "backend": self.backend,
            "addresses": list(self.addresses),
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "layout": self.layout.to_dict(),
            "lease_expiry": self.lease_expiry,
        }

    @classmethod
    def from_dict(cls, d: Any, prompt_token_ids: list[int] | None = None,
                  prefix: bool = False) -> ContextParams:
        """Validate what a client sent; ``prompt_token_ids`` may come from the request body.
        ``DisaggParamsError`` names the field (``disaggregated_params.<field>: ...``).
        ``prefix``: a peer's prefix lease (``kv_prefix``): no first token (KV only)."""
        if not isinstance(d, dict):
            raise DisaggParamsError("disaggregated_params: must be an object")
        f = {name: _field(d, name, kind) for name, kind in FIELD_TYPES.items()}
        first = _int_list("first_gen_tokens", f["first_gen_tokens"])
        if bool(first) == prefix:
            raise DisaggParamsError("disaggregated_params.first_gen_tokens: " + (
                "must be empty in a prefix lease" if prefix else "must not be empty"))
        backend, layout, addresses = _transport(f, "")
        prompt = prompt_token_ids if prompt_token_ids is not None else d.get("prompt_token_ids")
        prompt_ids = _int_list("prompt_token_ids", prompt)
        num_tokens = f["num_tokens"]
        if num_tokens != len(prompt_ids) or num_tokens < 1:
            raise DisaggParamsError("disaggregated_params.num_tokens: must equal the number of "
                                    "prompt tokens")
        block_ids = _int_list("block_ids", f["block_ids"])
        if len(block_ids) * layout.tokens_per_block < num_tokens:
            raise DisaggParamsError("disaggregated_params.block_ids: too few blocks for "
                                    "num_tokens")
        return cls(
            ctx_request_id=f["ctx_request_id"], first_gen_tokens=first,
            prompt_token_ids=prompt_ids, worker_id=f["worker_id"], backend=backend,
            addresses=addresses, block_ids=block_ids, num_tokens=num_tokens,
            layout=layout, lease_expiry=float(f["lease_expiry"]),
            first_gen_logprobs=_logprobs(d.get("first_gen_logprobs")),
            prompt_logprobs=_prompt_logprobs(d.get("prompt_logprobs"), num_tokens),
            prompt_logprob_ranks=_ranks(d.get("prompt_logprob_ranks"), num_tokens),
            cached_tokens=_cached(d.get("cached_tokens"), num_tokens),
        )


# The required fields of the context answer and their JSON types; from_dict checks the type
# of each first, then the values and how they agree with each other.
FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "ctx_request_id": str,
    "first_gen_tokens": list,
    "worker_id": str,
    "backend": str,
    "addresses": list,
    "num_tokens": int,
    "block_ids": list,
    "layout": dict,
    "lease_expiry": (int, float),
}


STREAM_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "ctx_request_id": str,
    "worker_id": str,
    "backend": str,
    "addresses": list,
    "layout": dict,
}
# A stream id becomes the context worker's request and lease id.
_STREAM_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def valid_stream_id(value: Any) -> bool:
    return isinstance(value, str) and _STREAM_ID.fullmatch(value) is not None


@dataclass(frozen=True)
class LeaseRef:
    """What releasing a context lease needs (its id, backend and the context ranks'
    addresses): a refused generation_only request's body names it even when the rest of its
    params did not parse. A ``ContextParams`` has the same three fields."""

    ctx_request_id: str
    backend: str
    addresses: tuple[str, ...]


def _field(d: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str = ""
           ) -> Any:
    if name not in d:
        raise DisaggParamsError(f"disaggregated_params.{where}{name}: missing")
    v = d[name]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise DisaggParamsError(f"disaggregated_params.{where}{name}: wrong type")
    return v


def _transport(f: dict[str, Any], where: str) -> tuple[str, WorkerLayout, list[str]]:
    """(backend, layout, addresses) of validated fields: how to reach the context ranks."""
    backend = f["backend"].upper()
    if backend not in ("UCX", "TCP"):
        raise DisaggParamsError(f"disaggregated_params.{where}backend: must be UCX or TCP")
    try:
        layout = WorkerLayout.from_dict(f["layout"])
    except ValueError as e:
        raise DisaggParamsError(f"disaggregated_params.{where}layout: {e}") from None
    addresses = f["addresses"]
    if len(addresses) != len(layout.ranks) or not all(isinstance(a, str) for a in addresses):
        raise DisaggParamsError(f"disaggregated_params.{where}addresses: one host:port per "
                                f"rank")
    return backend, layout, list(addresses)


def _int_list(name: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise DisaggParamsError(f"disaggregated_params.{name}: must be a list of integers >= 0")
    return list(v)


def _prompt_logprobs(raw: Any, num_tokens: int) -> list[dict[int, float] | None] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != num_tokens or raw[0] is not None:
        raise DisaggParamsError("disaggregated_params.prompt_logprobs: one entry per prompt "
                                "token, the first null")
    try:
        return [None, *(_logprobs(raw[1:]) or [])]
    except DisaggParamsError:
        raise DisaggParamsError("disaggregated_params.prompt_logprobs: malformed") from None


def _cached(raw: Any, num_tokens: int) -> int | None:
    if raw is None:
        return None
    if not (isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw <= num_tokens):
        raise DisaggParamsError("disaggregated_params.cached_tokens: an integer from 0 to "
                                "num_tokens")
    return raw


def _ranks(raw: Any, num_tokens: int) -> list[int | None] | None:
    if raw is None:
        return None
    if not (isinstance(raw, list) and len(raw) == num_tokens and all(
            r is None or isinstance(r, int) and not isinstance(r, bool) and r >= 1
            for r in raw)):
        raise DisaggParamsError("disaggregated_params.prompt_logprob_ranks: one rank >= 1 "
                                "(or null) per prompt token")
    return list(raw)


def _logprobs(raw: Any) -> list[dict[int, float]] | None:
    if raw is None:
        return None
    try:
        return [{int(k): float(v) for k, v in lp.items()} for lp in raw]
    except (AttributeError, TypeError, ValueError):
        raise DisaggParamsError("disaggregated_params.first_gen_logprobs: malformed") from None


def token_ids_hash(ids: Sequence[int]) -> str:
    """SHA-256 hex of token ids, each as a little-endian int64 (the same on every host): what
    a streamed context request and its generation request name their prompt by."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()
