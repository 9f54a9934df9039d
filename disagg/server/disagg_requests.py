"""The worker's side of disaggregated serving: ``context_only`` and ``generation_only`` requests.

A context worker prefills a ``context_only`` request, samples its first token and keeps the
prompt's KV under a lease; its answer carries the params a generation worker needs to pull that
KV (``disaggregated_params``) and the prompt's token ids. It takes the client's request as it
came, ``stream`` included (the answer is whole all the same), so that it refuses what the
generation worker would. A generation worker takes the original request with those params as a
``generation_only`` request, pulls the KV and decodes. Both carry exactly one prompt and one
choice.

KV streaming (``contracts/params.py``): the router sends both at once. The context worker runs
a ``kv_stream_id`` request as a context_only one, under that id (request and lease), and
publishes the KV layer by layer and then its first token; the generation worker gets
``kv_stream`` (how to reach the context ranks), tokenizes the prompt itself, pulls the KV as
it is computed, the first token with the last read, and goes on as after the two calls.

Migration (the router's ``flow``: a generation worker failed mid-answer): the router asks,
with ``disaggregated_params.token_ids: true`` on a streamed request, for each stream chunk's
token ids, in an SSE comment line of the chunk's event (``: token_ids 1,2,3``; the router
strips it); it resends the request to another worker as an ordinary one (``request_type:
context_and_generation``) with ``resume: {output_token_ids, id, created}``: the tokens it
relayed, and the id and time of the answer the client is reading. That worker runs it with
those tokens as outputs already sent (``kv_mode.Local.resumed``) and streams what follows,
without the chat role chunk, under the same id. Not signed: it only changes the sender's own
answer (as a token-id prompt would).

Lease rule: once a generation_only request's body was read, the lease it names is released on
every path. The engine does it for a request it took; a request refused before that (bad field,
wrong model, queue full...) releases it here at once instead of at lease expiry, but only toward
addresses this worker may trust (releasing means connecting).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from disagg.cluster_auth import AUTH_HEADER
from disagg.contracts import protocol as P
from disagg.contracts.kv_mode import (
    ContextOnly,
    ContextStream,
    Dummy,
    KVMode,
    Local,
    PrefixPull,
    Pull,
)
from disagg.contracts.params import ContextParams, LeaseRef, token_ids_hash, valid_stream_id
from disagg.contracts.roles import RequestType, Role
from disagg.layout import check_compatible
from disagg.request import SamplingParams
from disagg.server.fanout import Choice
from disagg.server.formats import ChatFormat, CompletionFormat, Format
from disagg.server.state import ServerState
from disagg.timing import KV_TRANSFER

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def request_type(srv: ServerState, req: Any, num_prompts: int) -> RequestType | None:
    """The request's disaggregated type if it needs this role's KV plumbing, else None
    (an ordinary request). 400 when this worker's role cannot serve it."""
    raw = req.request_type
    if raw in (None, RequestType.CONTEXT_AND_GENERATION):
        return None
    try:
        kind: RequestType | None = RequestType(raw)
    except (ValueError, TypeError):  # not checked yet (check_fields comes later)
        kind = None
    need = kind.needs_role if kind is not None else Role.GENERATION
    assert need is not None
    if srv.role is not need or srv.transfer is None:
        raise P.bad_request(
            f"disaggregated_params.request_type: {raw!r} requests need a {need} worker; "
            f"this worker's role is {srv.role.value!r}", param="disaggregated_params")
    if req.n != 1 or num_prompts != 1:
        raise P.bad_request(f"n: a {raw} request has exactly one prompt and n = 1",
                            param="n")
    if kind is None:
        req.common_checks()  # names the unknown request_type (400)
    assert kind is not None
    return kind


def remote_params(srv: ServerState, req: Any, prompt_ids: list[int] | None, signed: bool
                  ) -> ContextParams:
    """Validate a generation_only request's ContextParams (400 naming the field). A
    refusal releases the lease through ``release_refused``."""
    d = dict(req.disaggregated_params)
    try:
        if "kv_stream" in d:
            assert prompt_ids is not None
            params = ContextParams.from_stream(d["kv_stream"], prompt_ids)
        else:
            params = ContextParams.from_dict(
                d, prompt_token_ids=None if "prompt_token_ids" in d else prompt_ids)
    except ValueError as e:
        raise P.bad_request(str(e), param="disaggregated_params") from None
    denied = None if signed else srv.access.peer_allowlist.first_denied(params.addresses)
    if denied is not None:
        # Never connect where an unauthenticated client points (not even to release).
        raise P.bad_request(
            f"disaggregated_params.addresses: {denied!r} is not a trusted context worker: "
            f"the request is not signed by the cluster ({AUTH_HEADER}) and its host is not "
            f"in this worker's kv_peer_allowlist", param="disaggregated_params.addresses")
    assert srv.transfer is not None  # (request_type checked it)
    try:
        check_compatible(params.layout, srv.transfer.layout)
    except ValueError as e:
        raise P.bad_request(f"disaggregated_params.{e}", param="disaggregated_params"
                            ) from None
    return params


def disagg_choice(srv: ServerState, request: Request, fmt: Format,
                  prompt: str | list[int] | None, text: str | None, kind: RequestType) -> Choice:
    """The one choice of a context_only or generation_only request, with its ``KVMode`` (built
    here, once, from disaggregated_params). ``prompt``: text or ids to encode (a chat prompt
    arrives encoded), or None when the ids come from ``disaggregated_params.prompt_token_ids``.
    """
    req, chat = fmt.req, isinstance(fmt, ChatFormat)
    dp = req.disaggregated_params
    generation = kind is RequestType.GENERATION_ONLY
    ids: list[int] | None = None
    if prompt is not None:
        if chat:
            ids = list(prompt)  # type: ignore[arg-type]
        elif not generation or "prompt_token_ids" not in dp:
            ids = srv.encode_prompt(prompt, add_special_tokens=req.add_special_tokens)
        if isinstance(prompt, str):
            text = prompt
    dummy = generation and srv.settings.benchmark_gen_only and "ctx_request_id" not in dp
    signed = False
    remote = None
    if generation and not dummy:
        signed = srv.access.is_signed(request, srv.body_of(request) or b"")
        remote = remote_params(srv, req, ids, signed)
        ids = list(remote.prompt_token_ids)
    if dummy and "prompt_token_ids" in dp:
        ids = srv.encode_prompt(_token_ids(dp["prompt_token_ids"]),
                                field="disaggregated_params.prompt_token_ids")
    assert ids is not None
    if chat:
        params = req.to_sampling_params(len(ids), srv.max_model_len, srv.kv_capacity_tokens())
    else:
        params = req.to_sampling_params(len(ids), srv.max_model_len)
    if not generation and "kv_stream_id" in dp:
        return _stream_context_choice(srv, dp["kv_stream_id"], ids, text, params)
    if remote is not None and remote.stream and params.prompt_logprobs is not None:
        raise P.bad_request("prompt_logprobs: not with kv_stream (the context worker scores "
                            "the prompt: use the two-call flow)", param="prompt_logprobs")
    if remote is not None and params.max_tokens <= len(remote.first_gen_tokens):
        raise P.bad_request("max_tokens: the context worker's answer already holds "
                            "every token asked for (it was final)", param="max_tokens")
    request.state.lease_taken = True  # from here the engine releases it on every path
    mode: KVMode
    if remote is not None:
        # Only KV the cluster vouches for may be reused by other requests: anyone else could
        # send KV that does not belong to prompt_token_ids.
        if fmt.trace is not None and fmt.trace.sampled:  # its READs name its kv_transfer span
            remote = dataclasses.replace(remote, traceparent=fmt.trace.traceparent(KV_TRANSFER))
        mode = Pull(remote, trusted=signed)
    else:
        mode = Dummy() if dummy else ContextOnly()
    return Choice(0, fmt.rid, 0, ids, text, params, mode=mode)


def _stream_context_choice(srv: ServerState, stream_id: Any, ids: list[int], text: str | None,
                           params: SamplingParams) -> Choice:
    """A streaming context_only request (module docstring) under request and lease id
    ``stream_id``: prefill, the first token sampled with the client's params, as a two-call
    context request (the engine makes it max_tokens 1)."""
    if not valid_stream_id(stream_id):
        raise P.bad_request("disaggregated_params.kv_stream_id: 1-128 of A-Z a-z 0-9 _ . : -",
                            param="disaggregated_params.kv_stream_id")
    assert srv.transfer is not None  # (request_type checked it)
    if srv.transfer.lease_is_live(stream_id) or stream_id in srv.inflight:
        raise P.APIError(409, f"disaggregated_params.kv_stream_id: {stream_id!r} is in use",
                         param="disaggregated_params.kv_stream_id", code="conflict")
    return Choice(0, stream_id, 0, ids, text, params,
                  mode=ContextStream(len(ids), token_ids_hash(ids)))


def _token_ids(raw: Any) -> list[int]:
    if not (isinstance(raw, list) and raw and all(
            isinstance(t, int) and not isinstance(t, bool) for t in raw)):
        raise P.bad_request("disaggregated_params.prompt_token_ids: expected a non-empty "
                            "list of token ids", param="disaggregated_params")
    return raw


# ---- migration: token ids in the stream, a resumed request ---------------------------------

_RESUME_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def migration_fields(fmt: Format) -> None:
    """Read the router's migration fields (module docstring) into ``fmt``: ``token_ids``
    (each chunk's token ids in the stream) and ``resume`` (the answer's id and time, and the
    tokens already streamed: ``fmt.resumed``). 400 naming the field when malformed."""
    req = fmt.req
    dp = req.disaggregated_params
    if not isinstance(dp, dict):
        return
    fmt.token_ids = bool(req.stream) and dp.get("token_ids") is True
    if "resume" not in dp:
        return
    where = "disaggregated_params.resume"
    r = dp["resume"]
    if req.request_type not in (None, RequestType.CONTEXT_AND_GENERATION):
        raise P.bad_request(f"{where}: only with request_type context_and_generation",
                            param=where)
    if not isinstance(r, dict):
        raise P.bad_request(f"{where}: must be an object", param=where)
    ids, rid, created = r.get("output_token_ids"), r.get("id"), r.get("created")
    if not (isinstance(ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise P.bad_request(f"{where}.output_token_ids: expected a list of token ids "
                            "(empty: only the chat role chunk went out)", param=where)
    if not (isinstance(rid, str) and _RESUME_ID.fullmatch(rid)):
        raise P.bad_request(f"{where}.id: 1-128 of A-Z a-z 0-9 _ . : -", param=where)
    if not (isinstance(created, int) and not isinstance(created, bool) and created >= 0):
        raise P.bad_request(f"{where}.created: expected a time in seconds", param=where)
    # What a resumed stream cannot continue exactly: one choice, streamed, no echo (the prompt
    # went out with the first chunk), no tools (their parser's state is not carried).
    if not req.stream or req.n != 1:
        raise P.bad_request(f"{where}: only a streamed request with n = 1 is resumed",
                            param=where)
    if isinstance(fmt, CompletionFormat) and (req.echo or len(req.prompts()) != 1):
        raise P.bad_request(f"{where}: not with echo or several prompts", param=where)
    if isinstance(fmt, ChatFormat) and req.tools:
        raise P.bad_request(f"{where}: not with tools", param=where)
    fmt.rid, fmt.created, fmt.resumed = rid, created, tuple(ids)


def resume_choice(srv: ServerState, fmt: Format, choice: Choice) -> Choice:
    """``choice`` (the request's one) continuing ``fmt.resumed``: its mode says so to the
    engine, and its counts start after them (usage, completions' logprob text offsets)."""
    if fmt.resumed is None:
        return choice
    where = "disaggregated_params.resume.output_token_ids"
    vocab = srv.config.model.vocab_size
    bad = next((t for t in fmt.resumed if not 0 <= t < vocab), None)
    if bad is not None:
        raise P.bad_request(f"{where}: token id {bad} is out of range [0, {vocab})",
                            param=where)
    if len(fmt.resumed) >= choice.params.max_tokens:
        raise P.bad_request(f"{where}: {len(fmt.resumed)} tokens, but max_tokens is "
                            f"{choice.params.max_tokens}: nothing is left to generate",
                            param=where)
    choice.mode = Local(fmt.resumed)
    choice.num_tokens = len(fmt.resumed)
    if choice.params.logprobs is not None:
        choice.text_offset = sum(len(srv.token_text(t)) for t in fmt.resumed)
    return choice


# ---- a peer's prefix (kv_prefix) --------------------------------------------------------------


def apply_prefix(srv: ServerState, request: Request, fmt: Format, choices: list[Choice]
                 ) -> None:
    """A request's ``kv_prefix`` (peer prefix reuse, ``kv_mode.PrefixPull``): its one choice
    pulls that KV. Checked as a generation_only request's params are (400 naming the field;
    only a cluster-signed request, or one naming allowlisted peers, may make this worker
    connect); a request it does not fit (several choices, generation_only, prompt logprobs)
    gives the lease back at once and runs as if it had none. From here the lease is the
    engine's to give back (``prefix_taken``)."""
    raw = fmt.req.kv_prefix
    if raw is None:
        return
    rt = srv.transfer
    if rt is None or not srv.peer_reuse:
        raise P.bad_request("kv_prefix: this worker was not started with --kv-peer-reuse",
                            param="kv_prefix")
    signed = srv.access.is_signed(request, srv.body_of(request) or b"")
    try:
        params = ContextParams.from_dict(raw, prefix=True)
    except ValueError as e:
        raise P.bad_request(str(e).replace("disaggregated_params", "kv_prefix", 1),
                            param="kv_prefix") from None
    denied = None if signed else srv.access.peer_allowlist.first_denied(params.addresses)
    if denied is not None:
        raise P.bad_request(
            f"kv_prefix.addresses: {denied!r} is not a trusted peer: the request is not "
            f"signed by the cluster ({AUTH_HEADER}) and its host is not in this worker's "
            f"kv_peer_allowlist", param="kv_prefix.addresses")
    try:
        check_compatible(params.layout, rt.layout)
    except ValueError as e:
        raise P.bad_request(f"kv_prefix.{e}", param="kv_prefix") from None
    c = choices[0]
    n = params.num_tokens
    if len(choices) == 1 and not (0 < n < len(c.prompt_ids)
                                  and c.prompt_ids[:n] == params.prompt_token_ids):
        raise P.bad_request("kv_prefix.prompt_token_ids: not a leading part of this prompt",
                            param="kv_prefix")
    request.state.prefix_taken = True
    if len(choices) != 1 or not isinstance(c.mode, (Local, ContextOnly)):
        srv.engine.release_remote(params)
        return
    c.prefix = PrefixPull(params, trusted=signed)


# ---- releasing the lease of a refused generation_only request --------------------------------


def releasing_refused(srv: ServerState, handler: Handler) -> Handler:
    """``handler``, releasing the context lease of a generation_only request that fails
    before the engine takes it (any refusal after its body was read): nobody else will read
    that KV."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception:
            body = srv.body_of(request)
            if body is not None:  # (a refusal before the body was read names no lease)
                try:
                    release_refused(srv, request, body)
                except Exception:  # never hide the refusal itself
                    logger.exception("cannot release the context lease")
            raise

    return wrapped


def release_refused(srv: ServerState, request: Request, body: bytes) -> None:
    """Release the lease a refused generation_only request names (see the module docstring),
    and a refused request's peer prefix lease (``kv_prefix``)."""
    if srv.transfer is None:
        return
    if not getattr(request.state, "prefix_taken", False):
        ref = prefix_lease_of(body)
        if ref is not None and srv.access.trusts_addresses(request, body, list(ref.addresses)):
            logger.info("request refused: releasing peer prefix lease %s", ref.ctx_request_id)
            srv.engine.release_remote(ref)
    if srv.role is not Role.GENERATION or getattr(request.state, "lease_taken", False):
        return
    ref = lease_of(body)
    if ref is None or not srv.access.trusts_addresses(request, body, list(ref.addresses)):
        return
    logger.info("request refused: releasing context lease %s", ref.ctx_request_id)
    srv.engine.release_remote(ref)


def prefix_lease_of(body: bytes) -> LeaseRef | None:
    """The peer prefix lease a request body names (``kv_prefix``), if it names one."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    kp = data.get("kv_prefix") if isinstance(data, dict) else None
    return _lease_ref(kp) if isinstance(kp, dict) else None


def _lease_ref(d: dict[str, Any]) -> LeaseRef | None:
    lease, backend, addresses = d.get("ctx_request_id"), d.get("backend"), d.get("addresses")
    if not (isinstance(lease, str) and isinstance(backend, str)
            and backend.upper() in ("UCX", "TCP") and isinstance(addresses, list)
            and addresses and all(isinstance(a, str) for a in addresses)):
        return None
    return LeaseRef(lease, backend.upper(), tuple(addresses))


def lease_of(body: bytes) -> ContextParams | LeaseRef | None:
    """The context lease a generation_only request body names, if it names one (the full
    params when they parse, else just the lease id, backend and addresses)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    dp = data.get("disaggregated_params") if isinstance(data, dict) else None
    if not isinstance(dp, dict) or dp.get("request_type") != RequestType.GENERATION_ONLY:
        return None
    with contextlib.suppress(ValueError):
        prompt = None if "prompt_token_ids" in dp else data.get("prompt")
        return ContextParams.from_dict(dp, prompt_token_ids=prompt if isinstance(
            prompt, list) else None)
    return _lease_ref(dp)
