"""OpenAI wire format: request models, their translation to SamplingParams, responses, errors.

Everything here is pure (no engine, no HTTP framework) so that it can be unit tested alone.
Requests are validated in two layers: pydantic checks shapes and types, then
``SamplingParams.__post_init__`` checks ranges; both become an ``APIError`` (400) that names the
offending field, in OpenAI's error JSON shape.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from disagg.contracts import tools as T
from disagg.contracts.roles import REQUEST_TYPES
from disagg.request import SamplingParams, SamplingParamsError
from disagg.structured.spec import GrammarSpec, StructuredSpecError, request_spec

MAX_N = 128  # choices per request: each is an engine request, so bound the fan-out
# Choices of one request in all (prompts x n): each is an engine request with its own state
# (~5 KiB) and its share of the scheduler's per-step work, so a 64 MiB body of one-character
# prompts would be millions of them (measured: 5000 took 3 s, 20000 took 27 s and 110 MiB).
MAX_CHOICES = 2048
MAX_LOGPROBS = 20  # OpenAI's limit for both APIs


# ---- errors ---------------------------------------------------------------------------------


class APIError(Exception):
    """An error to send to the client as OpenAI error JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model_id: str) -> APIError:
    """404 for ``GET /v1/models/{id}`` of a model not served here (OpenAI's and vLLM's)."""
    return APIError(404, f"The model `{model_id}` does not exist.", param="model",
                    code="model_not_found")


def _param_of(message: str) -> str | None:
    # SamplingParamsError / engine ValueError messages start with "<field>: ".
    head, sep, _ = message.partition(":")
    return head if sep and head.isidentifier() else None


def from_value_error(e: ValueError) -> APIError:
    """A SamplingParamsError or an engine ValueError (bad input found late) -> 400."""
    msg = str(e)
    return bad_request(msg, param=_param_of(msg))


def from_validation_error(e: ValidationError) -> APIError:
    """First pydantic error -> 400 naming the field (``messages.0.role``)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = list(first.get("loc", ()))
    # A union field reports one error per member, tagged in loc (("prompt", "list[int]", 0));
    # name the accepted shapes instead of the first member's complaint.
    cut = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
    if cut is not None:
        prefix = loc[:cut]
        tags = [str(err["loc"][cut]) for err in errors
                if list(err.get("loc", ()))[:cut] == prefix and len(err["loc"]) > cut]
        path = ".".join(str(p) for p in prefix)
        shapes = ", ".join(dict.fromkeys(tags))
        return bad_request(f"{path}: invalid type or value (expected one of: {shapes})",
                           param=str(prefix[0]) if prefix else None)
    path = ".".join(str(p) for p in loc)
    msg = first.get("msg", "invalid value")
    return bad_request(f"{path}: {msg}" if path else msg, param=str(loc[0]) if loc else None)


def _is_union_tag(part: object) -> bool:
    # pydantic names union members by type: "str", "list[int]", "function-after[...]", ...
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "none") or "[" in part)


# ---- requests -------------------------------------------------------------------------------

# Request fields that vLLM honours and this server does not: a 400 naming the field unless the
# value is one of the neutral ones listed (what vLLM does with the field absent). Fields no
# server knows are ignored and logged, as vLLM does (OpenAI clients send vendor extras).
# Structured outputs and tool calling (response_format, tools, structured_outputs, guided_*)
# are checked by their own code, not here.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False, None),
    "length_penalty": (1, 1.0, None),  # beam search only
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (True, None),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (False, None),
    "return_token_ids": (False, None),
    "prompt_embeds": (None,),
    "priority": (0, None),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None, {}),
    "thinking_token_budget": (None,),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "documents": (None, []),
    "chat_template": (None,),  # vLLM honours it only with --trust-request-chat-template
    "echo": (False, None),  # chat's echo (prepend the last message); completions has its own
}


def check_unsupported(extra: dict[str, Any] | None) -> None:
    """400 naming the first field of ``UNSUPPORTED_FIELDS`` sent at a non-neutral value."""
    for name, value in (extra or {}).items():
        neutral = UNSUPPORTED_FIELDS.get(name)
        if neutral is not None and not any(value == v and type(value) is type(v)
                                           for v in neutral):
            raise bad_request(f"{name}: not supported by this server (it is a vLLM "
                              f"extension; send {json.dumps(neutral[0])} or leave it out)",
                              param=name)


class NullIsAbsent(BaseModel):
    """A request model where an explicit ``null`` is the same as leaving an optional field out
    (its default), as vLLM takes it (``{"n": null}``, ``{"stream": null}`` ...); ``null`` for a
    required field stays a 400 naming it. Top-level fields only: nested values are the
    caller's (a JSON schema, a tool's parameters)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(v is None for v in data.values()):
            return data
        required = _required_fields(cls)
        return {k: v for k, v in data.items() if v is not None or k in required}


@functools.cache
def _required_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, f in model.model_fields.items() if f.is_required())


class StreamOptions(NullIsAbsent):
    """``include_usage``: the last chunk carries the request's usage (every chunk has a
    ``usage`` field, null but that one). Defaults to true once ``stream_options`` is sent, as
    vLLM has it (OpenAI's clients always send it explicitly). ``continuous_usage_stats``
    (vLLM's; guidellm sends it): every chunk's ``usage`` holds the running counts of its
    choice; without ``include_usage`` (false) it changes nothing, as in vLLM."""

    include_usage: bool = True
    continuous_usage_stats: bool = False


class _Request(NullIsAbsent):
    """Fields shared by both endpoints: OpenAI's, plus vLLM's extensions (``top_k``, ...)."""

    # Unknown fields are ignored (clients send vendor extras); the server logs their names.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Logits processing (penalties: OpenAI's; repetition_penalty, min_p: vLLM's extensions)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM extension: logprobs of the prompt tokens
    # Disaggregated serving (router -> worker): {request_type, ...ContextParams}; see README.
    disaggregated_params: dict[str, Any] | None = None
    # Peer prefix reuse (router -> worker, signed): a peer's prefix lease to pull (``POST
    # /kv_prefix``'s answer, a ContextParams object without a first token); see README.
    kv_prefix: dict[str, Any] | None = None
    # This project's: the answer carries the request's phase breakdown (disagg/timing.py).
    timing: StrictBool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (disagg/structured/spec.py reads them; one constraint per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def request_type(self) -> str | None:
        """context_only | generation_only | context_and_generation, or None (ordinary)."""
        if self.disaggregated_params is None:
            return None
        return self.disaggregated_params.get("request_type")

    def common_checks(self) -> None:
        if self.disaggregated_params is not None and self.request_type not in REQUEST_TYPES:
            raise bad_request(
                f"disaggregated_params.request_type: must be one of {list(REQUEST_TYPES)}, got "
                f"{self.request_type!r}", param="disaggregated_params")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true",
                              param="stream_options")
        self.logit_bias_ids()
        check_unsupported(self.model_extra)
        self.grammar_spec()
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs: not available when stream is true (as in "
                              "vLLM)", param="prompt_logprobs")

    def logit_bias_ids(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with token-id keys; 400 naming a key that is not one (OpenAI sends
        ids as JSON object keys, i.e. strings). Value ranges: SamplingParams."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                tid = -1
            if tid < 0 or str(tid) != key.strip():
                raise bad_request(f"logit_bias: key {key!r} is not a token id",
                                  param="logit_bias")
            out.append((tid, bias))
        return tuple(out)

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's structured-output constraint (400 naming the field when malformed;
        a schema / regex / grammar the engine cannot compile is its 400 later)."""
        try:
            return request_spec(self.response_format, self.structured_outputs, {
                "json": self.guided_json, "regex": self.guided_regex,
                "choice": self.guided_choice, "grammar": self.guided_grammar})
        except StructuredSpecError as e:
            raise from_value_error(e) from None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_in_stream(self) -> bool:
        """Every chunk carries its choice's running usage (vLLM's ``continuous_usage_stats``)."""
        return bool(self.include_usage_in_stream and self.stream_options
                    and self.stream_options.continuous_usage_stats)

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         bound_budget: int | None = None) -> SamplingParams:
        """Base params for one choice (n is fanned out by the server, seed + i per choice);
        ``prompt_logprobs`` beside the request's own (echo: the larger). ``bound_budget``:
        the tokens a JSON grammar's default string bound is made for, when not
        ``max_tokens`` (``GrammarSpec.with_budget``)."""
        spec = self.grammar_spec()
        if spec is not None and bound_budget is not None:
            spec = spec.with_budget(bound_budget)
        kw: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=tuple([self.stop] if isinstance(self.stop, str) else (self.stop or ())),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias_ids(),
            prompt_logprobs=max((n for n in (self.prompt_logprobs, prompt_logprobs)
                                 if n is not None), default=None),
            structured=spec,
        )
        # None means "OpenAI default" (temperature 1, top_p 1, top_k off, no penalties).
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.temperature is not None:
            kw["temperature"] = self.temperature
        if self.top_p is not None:
            kw["top_p"] = self.top_p
        if self.top_k is not None:
            kw["top_k"] = self.top_k
        try:
            return SamplingParams(**kw)
        except SamplingParamsError as e:
            raise from_value_error(e) from None


class CompletionRequest(_Request):
    # A string, strings, token ids, or lists of token ids (one completion set per prompt).
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's default for the legacy completions API
    logprobs: StrictInt | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: StrictInt | None = None
    add_special_tokens: bool = True  # vLLM extension: the tokenizer's BOS etc. on text prompts

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list; raises 400 for an empty one."""
        p = self.prompt
        if isinstance(p, str):
            items: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items:
            raise bad_request("prompt: must not be empty", param="prompt")
        if len(items) * self.n > MAX_CHOICES:
            raise bad_request(
                f"{'prompt' if len(items) > MAX_CHOICES else 'n'}: {len(items)} prompts x n="
                f"{self.n} = {len(items) * self.n} choices; at most {MAX_CHOICES} per request "
                f"(send the prompts in several requests)",
                param="prompt" if len(items) > MAX_CHOICES else "n")
        for i, item in enumerate(items):
            if len(item) == 0:
                where = "prompt" if len(items) == 1 else f"prompt.{i}"
                raise bad_request(f"{where}: must not be empty", param="prompt")
        return items

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: scoring, nothing generated (the engine samples one
        token that the answer leaves out, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_max_tokens(self) -> int:
        if self.echo_only:
            return 1
        return self.max_tokens if self.max_tokens is not None else 16

    def to_sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        self.check_fields()
        max_tokens = self.engine_max_tokens
        check_context_length(num_prompt_tokens, max_tokens, max_model_len, "prompt")
        # echo with logprobs: the prompt's tokens get logprobs too (the first null).
        return self._sampling_params(max_tokens, self.logprobs,
                                     self.logprobs if self.echo else None)

    def check_fields(self) -> None:
        """Every check that needs neither the tokenizer nor the model's limits."""
        self.common_checks()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens: must be >= 1 (0 only with echo: scoring the "
                              "prompt)", param="max_tokens")
        if self.suffix:
            raise bad_request("suffix: not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of: not supported (must equal n)", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs: must be in [0, {MAX_LOGPROBS}]", param="logprobs")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ...

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM extension
    # vLLM extensions: continue the last (assistant) message instead of opening a new one;
    # extra variables for the chat template; special tokens added to the rendered prompt.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    parallel_tool_calls: bool | None = None  # tool calling (server/tools.py)

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``render_chat`` besides the messages."""
        return {**chat_template_args(self.add_generation_prompt, self.continue_final_message,
                                     self.chat_template_kwargs), "tools": self.tools or None}

    def chat_messages(self, tool_call_parser: str | None = None) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template (``plain_messages``)."""
        return plain_messages(self.messages, tool_call_parser)

    def to_sampling_params(self, num_prompt_tokens: int, max_model_len: int,
                           kv_capacity_tokens: int | None = None) -> SamplingParams:
        self.check_fields()
        max_tokens, _ = self.requested_max_tokens()
        bound_budget = None
        if max_tokens is None:
            # OpenAI's chat default: as much as the context allows (and the KV cache holds,
            # else the engine refuses the request as one that can never fit).
            check_context_length(num_prompt_tokens, 1, max_model_len, "messages")
            limit = min(max_model_len, kv_capacity_tokens or max_model_len)
            max_tokens = max(limit - num_prompt_tokens, 1)
            # A grammar's bounds from the model's context alone, not this worker's KV
            # capacity: the context and generation workers of a disaggregated request (and
            # an aggregated one) compile the same grammar.
            bound_budget = max(max_model_len - num_prompt_tokens, 1)
        else:
            check_context_length(num_prompt_tokens, max_tokens, max_model_len, "messages")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, bound_budget=bound_budget)

    def tool_choice_of(self) -> T.ToolChoice:
        """The checked tools and tool_choice (400 naming the field)."""
        try:
            return T.resolve(self.tools, self.tool_choice, self.parallel_tool_calls)
        except T.ToolError as e:  # "tools.0.function.name: ..." names param "tools"
            msg = str(e)
            raise bad_request(msg, param=msg.partition(":")[0].partition(".")[0]) from None

    def grammar_spec(self) -> GrammarSpec | None:
        """A forced tool call's grammar, or the response format's; not both."""
        spec = super().grammar_spec()
        forced = T.forced_spec(self.tool_choice_of())
        if forced is not None and spec is not None:
            raise bad_request(f"tool_choice: a forced tool call cannot be combined with "
                              f"{spec.field}", param="tool_choice")
        return forced or spec

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """max_completion_tokens, else max_tokens (None: as many as fit), and its field name;
        400 when it is < 1."""
        max_tokens = self.max_completion_tokens
        name = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, name = self.max_tokens, "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{name}: must be >= 1", param=name)
        return max_tokens, name

    def check_fields(self) -> None:
        """Every check that needs neither the tokenizer nor the model's limits."""
        self.common_checks()
        self.template_kwargs()
        self.tool_choice_of()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs: must be in [0, {MAX_LOGPROBS}]",
                                  param="top_logprobs")
            if not self.logprobs:
                raise bad_request("top_logprobs: requires logprobs to be true",
                                  param="top_logprobs")


def plain_messages(messages: Sequence[ChatMessage], tool_call_parser: str | None = None
                   ) -> list[dict[str, Any]]:
    """Messages as plain dicts in the shape chat templates expect (vLLM's): text content only
    (parts joined), a null or missing content as ``""`` (templates concatenate it: an
    assistant turn that only calls tools has none), tool calls' ``arguments`` as objects, and
    tool call ids as the model family's template takes them (``tools.template_call_id``:
    ``tool_call_parser`` names the family)."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages.{i}.role: unknown role {m.role!r}",
                              param="messages")
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages.{i}.content.{j}: only text parts are supported",
                        param="messages")
            content = "\n".join(part["text"] for part in content)  # as vLLM joins them
        msg = {k: v for k, v in m.model_dump().items() if v is not None}
        msg["content"] = "" if content is None else content
        # Llama-style templates know "system", not OpenAI's newer "developer".
        if m.role == "developer":
            msg["role"] = "system"
        if isinstance(msg.get("tool_calls"), list):  # arguments as objects, as vLLM passes them
            msg["tool_calls"] = T.template_tool_calls(msg["tool_calls"], tool_call_parser)
        if isinstance(msg.get("tool_call_id"), str):
            msg["tool_call_id"] = T.template_call_id(msg["tool_call_id"], tool_call_parser)
        out.append(msg)
    return out


# Names the chat template sees that chat_template_kwargs must not replace.
_TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "chat_template"})


def chat_template_args(add_generation_prompt: bool, continue_final_message: bool,
                       chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat options of a request (400 naming the field when they conflict)."""
    if add_generation_prompt and continue_final_message:
        raise bad_request("continue_final_message: cannot be combined with "
                          "add_generation_prompt=true (set it to false)",
                          param="continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(_TEMPLATE_RESERVED & kwargs.keys())
    if clash:
        raise bad_request(f"chat_template_kwargs: {clash[0]!r} is set by the request itself, "
                          "not through chat_template_kwargs", param="chat_template_kwargs")
    return {"add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "template_vars": kwargs}


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                         prompt_field: str) -> None:
    if max_tokens < 1:
        raise bad_request("max_tokens: must be >= 1", param="max_tokens")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{prompt_field}, {max_tokens} in the completion). Please reduce the length of the "
            f"{prompt_field} or completion.",
            param=prompt_field, code="context_length_exceeded")


def parse_request(model: type[_Request], raw: bytes) -> Any:
    """Body bytes -> request model, or a 400 ``APIError`` (malformed JSON, wrong types)."""
    data = parse_json_object(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def choice_params(base: SamplingParams, i: int) -> SamplingParams:
    """Params of choice ``i`` of ``n``: one engine request each; seeded ones get seed + i
    (as the offline ``LLM`` does) so choices differ yet stay reproducible."""
    if base.n == 1:
        return base
    seed = None if base.seed is None else base.seed + i
    return dataclasses.replace(base, n=1, seed=seed)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- responses ------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


TokenText = Callable[[int], str]  # token id -> its text (a decode of the single id)


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], token_text: TokenText,
    text_offset: int = 0,
) -> dict[str, Any]:
    """Legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.

    ``logprobs[i]`` holds the chosen token and the top-n, so top_logprobs has up to n + 1
    entries, as OpenAI documents.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, lp in zip(token_ids, logprobs, strict=False):
        s = token_text(tok)
        tokens.append(s)
        token_lps.append(_finite(lp.get(tok)))
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])
        tops.append({token_text(t): _finite(v) for t, v in ranked})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(prompt_ids: Sequence[int], prompt_lps: Sequence[dict[int, float] | None],
                  token_text: TokenText) -> dict[str, Any]:
    """The prompt's part of an echoed completion's ``logprobs`` (what lm-evaluation-harness
    scores): its first token has no logprob (``null`` in token_logprobs and top_logprobs),
    as in OpenAI's and vLLM's answers."""
    rest = completion_logprobs(prompt_ids[1:], [lp or {} for lp in prompt_lps[1:]],
                               token_text, len(token_text(prompt_ids[0])))
    return {"tokens": [token_text(prompt_ids[0]), *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def join_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Two ``completion_logprobs`` parts, the second after the first (its text offsets
    already continue the first's)."""
    return {k: [*head[k], *tail[k]] for k in head}


def prompt_logprobs_json(prompt_ids: Sequence[int],
                         prompt_lps: Sequence[dict[int, float] | None],
                         ranks: Sequence[int | None] | None, token_text: TokenText
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the token itself (its rank in the
    vocabulary) and the top-n (ranks 1..n)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for p, lp in enumerate(prompt_lps):
        if lp is None:
            out.append(None)
            continue
        entry = {}
        for i, (t, v) in enumerate(sorted(lp.items(), key=lambda kv: -kv[1])):
            rank = ranks[p] if ranks is not None and t == prompt_ids[p] else i + 1
            entry[str(t)] = {"logprob": _finite(v), "rank": rank,
                             "decoded_token": token_text(t)}
        out.append(entry)
    return out


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], token_text: TokenText,
    top_n: int,
) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for tok, lp in zip(token_ids, logprobs, strict=False):
        s = token_text(tok)
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": s,
            "logprob": _finite(lp.get(tok)),
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [
                {"token": token_text(t), "logprob": _finite(v),
                 "bytes": list(token_text(t).encode("utf-8"))}
                for t, v in ranked
            ],
        })
    return {"content": content}


def _finite(v: float | None) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999.0 is what OpenAI/vLLM send.
    if v is None or v != v or v == float("-inf"):
        return -9999.0
    return float(v)


def completion_response(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None,
                      stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def completion_chunk(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage_: dict[str, Any] | None = None,
                     with_usage_field: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                             "model": model, "choices": choices}
    if with_usage_field:  # include_usage: every chunk carries "usage", null but the last
        chunk["usage"] = usage_
    return chunk


def chat_response(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_choice(index: int, text: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None,
                stop_reason: int | str | None = None,
                message: dict[str, Any] | None = None) -> dict[str, Any]:
    # ``message``: one with tool_calls (server/tools.py) instead of the plain text.
    return {"index": index, "message": message or {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk(rid: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None = None,
               with_usage_field: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": choices}
    if with_usage_field:
        chunk["usage"] = usage_
    return chunk


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None = None,
                      logprobs: dict[str, Any] | None = None,
                      stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def sse(data: dict[str, Any] | Literal["[DONE]"]) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


# ---- request bodies: one parser and one schema check for the workers and the router ----------

MAX_JSON_DEPTH = 32  # OpenAI bodies nest 4-5 levels; deeper JSON only stresses the parsers
BODY_TIMEOUT_S = 30.0  # longest wait for a request body once its headers arrived (then 408)
MAX_BODY_BYTES = 64 << 20  # workers' and router's: long prompts as token id lists are large


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e400
        raise ValueError(f"{text[:20]} is out of range (numbers must be finite)")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body -> its JSON object, or a 400 ``APIError``: malformed JSON, not UTF-8
    (or UTF-16/32), ``NaN`` / ``Infinity``, nesting deeper than ``MAX_JSON_DEPTH``, lone
    UTF-16 surrogates (``"\\ud800"``: no tokenizer or JSON encoder takes them)."""
    try:
        text = raw.decode(json.detect_encoding(raw))
    except UnicodeDecodeError as e:
        raise bad_request(f"malformed JSON body: not valid UTF-8 ({e.reason} at byte "
                          f"{e.start})") from None
    try:
        data = _DECODER.decode(text)
    except RecursionError:
        raise bad_request(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels"
                          ) from None
    except ValueError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    # Cheap scans first: most bodies have neither surrogate escapes nor many brackets.
    surrogates = "\\ud" in text or "\\uD" in text
    if surrogates or text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        _check_json_tree(data, surrogates)
    return data


def _check_json_tree(data: Any, strings: bool) -> None:
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        obj, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} "
                              "levels", param=path.partition(".")[0] or None)
        if isinstance(obj, dict):
            items: Any = obj.items()
        elif isinstance(obj, list):
            items = enumerate(obj)
        else:
            continue
        for key, value in items:
            if strings and isinstance(key, str) and not _utf8_ok(key):
                key = key.encode("utf-8", "backslashreplace").decode()  # printable in the error
                where = f"{path}.{key}" if path else key
                raise bad_request(f"{where}: a key with a lone UTF-16 surrogate (invalid "
                                  "Unicode)", param=where.partition(".")[0])
            where = f"{path}.{key}" if path else str(key)
            if strings and isinstance(value, str) and not _utf8_ok(value):
                raise bad_request(f"{where}: contains a lone UTF-16 surrogate (invalid "
                                  "Unicode)", param=where.partition(".")[0])
            if isinstance(value, dict | list):
                stack.append((value, depth + 1, where))


def _utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_content_encoding(value: str | None) -> None:
    """Request bodies are plain JSON: a ``Content-Encoding`` (gzip, ...) is refused with 415."""
    if value and value.strip().lower() != "identity":
        raise APIError(415, f"Content-Encoding: {value!r} is not supported; send the JSON "
                       "body uncompressed", type="invalid_request_error",
                       param="Content-Encoding", code="unsupported_media_type")


REQUEST_MODELS: dict[str, type[_Request]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def validate_request(path: str, body: dict[str, Any]) -> _Request:
    """The checks a worker applies to an OpenAI request that need neither its tokenizer nor
    its model's limits (shapes and types, ranges, unsupported options), for a parsed body of
    ``path``; 400 ``APIError`` naming the field. The router runs it where it reads the
    request's fields itself (its policies' prompt, a final context answer's ``stream``).
    Returns the validated request."""
    try:
        req = REQUEST_MODELS[path].model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except RecursionError:
        raise bad_request(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels"
                          ) from None
    req.check_fields()
    if isinstance(req, CompletionRequest):
        req.prompts()
        max_tokens, logprobs = req.engine_max_tokens, req.logprobs
        if max_tokens < 1:
            raise bad_request("max_tokens: must be >= 1", param="max_tokens")
    else:
        assert isinstance(req, ChatCompletionRequest)
        req.chat_messages()
        max_tokens, _ = req.requested_max_tokens()
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # Ranges (temperature, top_p, stop, ...); without a max_tokens the worker derives one from
    # the prompt, so min_tokens is checked against it there.
    req._sampling_params(max_tokens if max_tokens is not None else max(req.min_tokens, 1),
                         logprobs)
    return req


# ---- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------


class TokenizeRequest(NullIsAbsent):
    """vLLM's ``/tokenize``: ``prompt`` (completions style) or ``messages`` (chat style,
    rendered with the chat template first)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check_fields(self) -> None:
        check_unsupported(self.model_extra)
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt: give exactly one of prompt and messages",
                              param="prompt" if self.prompt is None else "messages")
        if self.messages is not None:
            if not self.messages:
                raise bad_request("messages: must not be empty", param="messages")
            chat_template_args(self.add_generation_prompt, self.continue_final_message,
                               self.chat_template_kwargs)


class DetokenizeRequest(NullIsAbsent):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]
