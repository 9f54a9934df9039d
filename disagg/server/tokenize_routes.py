"""``/tokenize`` and ``/detokenize``, with vLLM's request and response shapes.

``POST /tokenize`` ``{model, prompt, add_special_tokens}`` or ``{model, messages,
add_generation_prompt, continue_final_message, chat_template_kwargs, add_special_tokens}`` ->
``{count, max_model_len, tokens, token_strs}``; ``POST /detokenize`` ``{model, tokens}`` ->
``{prompt}``. Same API key and model-name checks as the OpenAI endpoints.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from disagg.contracts import protocol as P
from disagg.contracts.chat_prompt import render_chat
from disagg.server.state import ServerState


class TokenizeRoutes:
    def __init__(self, srv: ServerState) -> None:
        self.srv = srv

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def _parse(self, request: Request, model: type[Any]) -> Any:
        srv = self.srv
        srv.access.check_api_key(request)
        data = P.parse_json_object(await srv.read_body(request))
        try:
            req = model.model_validate(data)
        except P.ValidationError as e:
            raise P.from_validation_error(e) from None
        srv.check_model(req.model)
        return req

    async def tokenize(self, request: Request) -> dict[str, Any]:
        req: P.TokenizeRequest = await self._parse(request, P.TokenizeRequest)
        req.check_fields()
        tok = self.srv.engine.tokenizer
        if req.messages is not None:
            messages = P.plain_messages(req.messages, self.srv.settings.tool_call_parser)
            text = render_chat(tok, messages, **P.chat_template_args(
                req.add_generation_prompt, req.continue_final_message,
                req.chat_template_kwargs))
            special = bool(req.add_special_tokens)  # the template wrote them
        else:
            assert req.prompt is not None
            text = req.prompt
            special = req.add_special_tokens is not False
        ids = list(tok.encode(text, add_special_tokens=special))
        return {"count": len(ids), "max_model_len": self.srv.max_model_len, "tokens": ids,
                "token_strs": [self.srv.token_text(t) for t in ids]
                if req.return_token_strs else None}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req: P.DetokenizeRequest = await self._parse(request, P.DetokenizeRequest)
        vocab = self.srv.config.model.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise P.bad_request(f"tokens: token id {bad} is out of range [0, {vocab})",
                                param="tokens")
        return {"prompt": self.srv.engine.tokenizer.decode(req.tokens,
                                                          skip_special_tokens=False)}
