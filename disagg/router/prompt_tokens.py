"""The prompt's token ids as the workers will see them, for the routing policies that need them
(kv_cache_aware, conditional disaggregation).

The router tokenizes with the workers' tokenizer, named by ``router.tokenizer`` or ``model`` in
the cluster YAML, or else taken from the first worker whose ``model_dir`` is readable here. A
completions prompt of token ids is used as it is; a chat request goes through the chat template
as the worker applies it (the template writes the special tokens itself): the YAML's
``chat_template`` (the workers' ``--chat-template``, read here too) when it sets one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any

from disagg.contracts import protocol as P
from disagg.contracts.chat_prompt import render_chat
from disagg.contracts.cluster import ClusterConfig, PolicyConfig, RouterConfigError
from disagg.contracts.roles import Role
from disagg.router.policies import RouteRequest

logger = logging.getLogger("disagg.router")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class PromptTokens:
    """The router's tokenizer (None until known) and the ``RouteRequest`` of a request body."""

    def __init__(self, config: ClusterConfig, policy_configs: Mapping[str, PolicyConfig],
                 need_tokens: bool, tokenizer: Any = None) -> None:
        self.config = config
        self.policy_configs = policy_configs
        self.need_tokens = need_tokens
        self.tokenizer = tokenizer
        self.source: str | None = None  # where the tokenizer was loaded from
        self._loading = False
        self.chat_template: str | None = None  # the YAML's chat_template (its text)
        if need_tokens and tokenizer is None:
            self.chat_template = self._configured_template()
            self._load_configured()

    def _configured_template(self) -> str | None:
        """The workers' ``chat_template`` (the generation side's, else the context side's):
        the prompt the router tokenizes must be the one they render."""
        from disagg.tokenizer import read_chat_template

        for role in (Role.GENERATION, Role.CONTEXT):
            group = self.config.group(role)
            value = group.worker_options.get("chat_template") if group is not None else None
            if value is None:
                continue
            try:
                return read_chat_template(str(value), f"{role}_servers.chat_template")
            except ValueError as e:
                raise RouterConfigError(f"{self.config.source}: {e}") from None
        return None

    def _load_configured(self) -> None:
        """The tokenizer named by ``router.tokenizer`` or ``model`` (checkpoint folders)."""
        for role in (Role.GENERATION, Role.CONTEXT):
            group = self.config.group(role)
            if group is None:
                continue
            for key, path in ((f"{role}_servers.router.tokenizer",
                               group.router.option("tokenizer")),
                              (f"{role}_servers.model", group.worker_options.get("model"))):
                if not path:
                    continue
                try:
                    self._set(str(path))
                except (OSError, ValueError) as e:
                    raise RouterConfigError(
                        f"{self.config.source}: {key}: cannot load the tokenizer the "
                        f"{self.policy_configs[role].type} router needs from {path!r}: {e}"
                    ) from None
                return
        # Not configured: taken from the first worker whose model_dir is readable here.
        logger.warning("no tokenizer configured (router.tokenizer or model): prompt-aware "
                       "routing waits for a worker's model_dir to be readable here")

    def _set(self, path: str) -> None:
        from disagg.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(path, chat_template=self.chat_template)
        self.source = path
        logger.info("router tokenizer: %s", path)

    def discover(self, model_dir: str,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        """A worker's checkpoint folder: load its tokenizer (on a thread, via ``spawn``) when
        one is needed and none is known yet."""
        if not self.need_tokens or self.tokenizer is not None or self._loading:
            return
        if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            return
        self._loading = True

        async def load() -> None:
            try:
                await asyncio.to_thread(self._set, model_dir)
            except (OSError, ValueError) as e:
                logger.warning("cannot load the tokenizer of %s: %s", model_dir, e)
            finally:
                self._loading = False

        spawn(load())

    def route_request(self, endpoint: str, body: Mapping[str, Any]) -> RouteRequest:
        """The prompt's tokens as the workers will see them (for the policies); an empty
        request when they cannot be known here (the worker then reports any error)."""
        tok = self.tokenizer
        try:
            if endpoint == COMPLETIONS:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and all(
                        isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    return RouteRequest.from_token_ids(prompt)
                if isinstance(prompt, str) and tok is not None:
                    return RouteRequest.from_token_ids(tok.encode(
                        prompt, add_special_tokens=body.get("add_special_tokens") is not False))
                return RouteRequest()
            messages = body.get("messages")
            if tok is None or not isinstance(messages, list):
                return RouteRequest()
            # The worker's own rendering (protocol.plain_messages, chat_prompt.render_chat).
            plain = P.plain_messages([P.ChatMessage.model_validate(m) for m in messages])
            text = render_chat(tok, plain, **P.chat_template_args(
                body.get("add_generation_prompt", True) is not False,
                body.get("continue_final_message") is True, body.get("chat_template_kwargs")),
                tools=body.get("tools") or None)
            # As the worker does: the template writes the special tokens itself (by default).
            return RouteRequest.from_token_ids(tok.encode(
                text, add_special_tokens=body.get("add_special_tokens") is True))
        except Exception as e:  # malformed messages etc.: the worker answers the 400
            logger.debug("cannot tokenize the request for routing: %s", e)
            return RouteRequest()

    def prepared_route(self, path: str, body: Mapping[str, Any],
                       block_sizes: Iterable[int]) -> RouteRequest:
        """``route_request`` with the prompt already hashed for every block size in use."""
        route = self.route_request(path, body)
        if route.prompt is not None:
            for size in block_sizes:
                route.prompt.for_block_size(size)
        return route

