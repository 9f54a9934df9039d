"""The OpenAI endpoints of a worker: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses`` (served as its chat form: ``responses``; ``GET`` / ``DELETE
/v1/responses/{id}`` read the store), ``/v1/models``.

A completions request fans out into ``n`` choices per prompt, in OpenAI's order (the choices of
prompt 0, then of prompt 1, ...); a chat request into ``n`` choices of its one templated prompt.
A context_only or generation_only request (``disaggregated_params``) is one choice built by
``disagg_requests``; both endpoints release a refused generation_only request's lease.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from disagg.contracts import protocol as P
from disagg.contracts import responses as R
from disagg.contracts.chat_prompt import render_chat
from disagg.contracts.roles import RequestType
from disagg.server.disagg_requests import (
    apply_prefix,
    disagg_choice,
    migration_fields,
    releasing_refused,
    request_type,
    resume_choice,
)
from disagg.server.fanout import Choice
from disagg.server.formats import ChatFormat, CompletionFormat, Format, ResponsesFormat
from disagg.server.request_timing import timing_asked
from disagg.server.respond import respond
from disagg.server.state import ServerState
from disagg.tracing import HEADER

logger = logging.getLogger(__name__)


class OpenAIRoutes:
    """The OpenAI endpoints over one ``ServerState``."""

    def __init__(self, srv: ServerState) -> None:
        self.srv = srv
        self.store = R.ResponseStore(srv.settings.responses_store_size,
                                     srv.settings.responses_store_ttl)

    def register(self, app: FastAPI) -> None:
        srv = self.srv
        app.add_api_route("/v1/completions", releasing_refused(srv, self.completions),
                          methods=["POST"])
        app.add_api_route("/v1/chat/completions",
                          releasing_refused(srv, self.chat_completions), methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        # (a served name may hold "/": "org/model", which the SDK sends as org%2Fmodel)
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.get_response, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete_response,
                          methods=["DELETE"])

    async def _admit(self, request: Request, fmt: type[Format]) -> Format:
        """The checks every OpenAI request passes first (API key, body, schema, model name,
        whether this worker takes requests now); the request's response format."""
        srv = self.srv
        srv.access.check_api_key(request)
        srv.check_not_switching()
        req = P.parse_request(fmt.request_model, await srv.read_body(request))
        if req.model_extra:
            logger.info("ignoring unknown request fields: %s", sorted(req.model_extra))
        srv.check_model(req.model)
        srv.check_accepting()
        out = fmt(srv, req, P.new_id(fmt.id_prefix))
        migration_fields(out)  # (the router's: token ids in the stream, a resumed answer)
        out.timing = timing_asked(request, req)
        self._trace(request, out)
        return out

    def _trace(self, request: Request, fmt: Format) -> None:
        """The request's trace (``disagg/tracing.py``), continuing its ``traceparent``, when
        this worker traces."""
        if self.srv.tracer is not None:  # (off: this check alone)
            fmt.trace = self.srv.tracer.begin(request.headers.get(HEADER))

    async def completions(self, request: Request) -> Response:
        t_arrival = time.monotonic()
        fmt = await self._admit(request, CompletionFormat)
        srv, req, rid = self.srv, fmt.req, fmt.rid
        prompts = req.prompts()
        kind = request_type(srv, req, len(prompts))
        if kind is not None:
            choice = disagg_choice(srv, request, fmt, prompts[0], None, kind)
            apply_prefix(srv, request, fmt, [choice])
            return await respond(srv, request, [choice], fmt, t_arrival)
        choices: list[Choice] = []
        n = req.n
        for pi, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{pi}"
            ids = srv.encode_prompt(prompt, add_special_tokens=req.add_special_tokens,
                                    field=where)
            params = req.to_sampling_params(len(ids), srv.max_model_len)
            text = prompt if isinstance(prompt, str) else None
            for i in range(n):
                index = pi * n + i  # OpenAI's order: choices of prompt 0, then prompt 1, ...
                sub_id = rid if len(prompts) * n == 1 else f"{rid}-{index}"
                choices.append(Choice(index, sub_id, pi, ids, text, P.choice_params(params, i)))
        resume_choice(srv, fmt, choices[0])  # (a resumed request has one choice)
        apply_prefix(srv, request, fmt, choices)
        return await respond(srv, request, choices, fmt, t_arrival)

    async def chat_completions(self, request: Request) -> Response:
        t_arrival = time.monotonic()
        fmt = await self._admit(request, ChatFormat)
        assert isinstance(fmt, ChatFormat)
        return await self._chat(request, fmt, t_arrival)

    async def _chat(self, request: Request, fmt: ChatFormat, t_arrival: float) -> Response:
        """A chat request (or a Responses request's chat form) answered in ``fmt``."""
        srv, req, rid = self.srv, fmt.req, fmt.rid
        if fmt.tool_choice.mode == "auto" and srv.settings.tool_call_parser is None:
            raise P.bad_request('tool_choice: "auto" (the default with tools) needs a server '
                                'started with --tool-call-parser (hermes, llama3_json, '
                                'mistral); "required" or a named tool work without one',
                                param="tool_choice")
        messages = req.chat_messages(srv.settings.tool_call_parser)
        kind = request_type(srv, req, 1)
        if kind is RequestType.GENERATION_ONLY and "prompt_token_ids" in req.disaggregated_params:
            # The context worker's token ids are the prompt (no second tokenization).
            choice = disagg_choice(srv, request, fmt, None, None, kind)
            apply_prefix(srv, request, fmt, [choice])
            return await respond(srv, request, [choice], fmt, t_arrival)
        text = render_chat(srv.engine.tokenizer, messages, **req.template_kwargs())
        # The template writes the special tokens (bos) itself (add_special_tokens: false).
        ids = srv.encode_prompt(text, add_special_tokens=req.add_special_tokens,
                                field="messages")
        if kind is not None:
            choice = disagg_choice(srv, request, fmt, ids, text, kind)
            apply_prefix(srv, request, fmt, [choice])
            return await respond(srv, request, [choice], fmt, t_arrival)
        params = req.to_sampling_params(len(ids), srv.max_model_len, srv.kv_capacity_tokens())
        choices = [
            Choice(i, rid if req.n == 1 else f"{rid}-{i}", 0, ids, text,
                   P.choice_params(params, i))
            for i in range(req.n)
        ]
        resume_choice(srv, fmt, choices[0])  # (a resumed request has one choice)
        apply_prefix(srv, request, fmt, choices)
        return await respond(srv, request, choices, fmt, t_arrival)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``: served as its chat form (``responses``), answered as a
        Response object or the Responses event stream."""
        t_arrival = time.monotonic()
        srv = self.srv
        srv.access.check_api_key(request)
        srv.check_not_switching()
        body = P.parse_json_object(await srv.read_body(request))
        rreq = R.parse_request(body)
        if rreq.unknown_fields():
            logger.info("ignoring unknown request fields: %s", rreq.unknown_fields())
        prev = rreq.previous_response_id
        call = R.ResponsesCall.build(rreq, None if prev is None else self.store.get(prev))
        srv.check_model(call.req.model)
        srv.check_accepting()
        try:
            req = P.ChatCompletionRequest.model_validate(call.chat_body())
        except ValidationError as e:
            raise P.from_validation_error(e) from None
        fmt = ResponsesFormat(srv, req, call.response_id, call, self.store)
        # Traced as a chat request is; a Response object has no place for the timing
        # breakdown, so it is not offered here (its phases are still recorded).
        self._trace(request, fmt)
        return await self._chat(request, fmt, t_arrival)

    async def get_response(self, request: Request, response_id: str) -> dict[str, Any]:
        self.srv.access.check_api_key(request)
        stored = self.store.get(response_id)
        if stored is None:
            raise R.not_found(response_id)
        return stored.response

    async def delete_response(self, request: Request, response_id: str) -> dict[str, Any]:
        self.srv.access.check_api_key(request)
        if not self.store.delete(response_id):
            raise R.not_found(response_id)
        return R.deleted(response_id)

    async def models(self, request: Request) -> dict[str, Any]:
        srv = self.srv
        srv.access.check_api_key(request)
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, request: Request, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``): the model as listed, or
        404 ``model_not_found``."""
        srv = self.srv
        srv.access.check_api_key(request)
        if model_id != srv.model_name:
            raise P.model_not_found(model_id)
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        srv = self.srv
        return {"id": srv.model_name, "object": "model", "created": srv.created,
                "owned_by": "disagg", "root": srv.settings.model_dir,
                "max_model_len": srv.max_model_len}
