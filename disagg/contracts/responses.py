"""OpenAI's Responses API (``POST /v1/responses``) as a chat completions request and back.

A Responses request is served as the chat completions request it means, through the same code
(workers) and the same two calls (the router), so everything chat does (grammars, tool calls,
disaggregation, KV-aware routing) holds for it, and its greedy output equals chat's:

    request --ResponsesCall.chat_body--> chat request --(engine / router)--> chat answer
                                                                         or chat chunks
    chat answer  --ResponsesCall.response-->  Response object
    chat chunks  --EventStream.feed--------->  response.created ... response.completed

Request -> chat: ``input`` (a string, or items: messages with ``input_text`` / ``output_text``
parts, ``function_call`` items that become the assistant's ``tool_calls``,
``function_call_output`` items that become ``tool`` messages), ``instructions`` (a system
message first; not carried over by ``previous_response_id``, as OpenAI documents),
``max_output_tokens``, ``temperature``, ``top_p``, function ``tools`` with ``tool_choice``
and ``parallel_tool_calls``, ``text.format`` (json_schema / json_object) as
``response_format``, ``include: ["message.output_text.logprobs"]`` with ``top_logprobs``,
``stream``. OpenAI's fields this server cannot honour are a 400 naming them unless sent at a
neutral value (``UNSUPPORTED``); fields OpenAI does not define are ignored (clients send
vendor extras), except vLLM's sampling extensions, which pass on to chat.

``previous_response_id``: a ``ResponseStore`` (in memory, bounded by count and age) keeps each
stored response's conversation in chat form (its messages without instructions, then its
answer), so a follow-up is that conversation plus the new input. ``store: false`` keeps
nothing. Pure: no HTTP framework, no engine; the worker (``openai_routes``) and the router
(``router/handlers``) use it alike.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, StrictInt, ValidationError

from disagg.contracts import protocol as P
from disagg.contracts.options import RESPONSES_STORE_SIZE, RESPONSES_STORE_TTL_S

# OpenAI Responses fields this server does not implement -> the values that mean "not used"
# (what the request would do without the field). Any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "context_management": ([],),
    "truncation": ("disabled",),
    "max_tool_calls": (),
    "moderation": (),
    "image": (),
    "access_programs": (),
    "background_options": (),
    "prompt_cache_options": (),
}
# OpenAI fields accepted and echoed or ignored: they do not change the output of this server
# (a cache key or retention hint, an end-user id, a tier: one tier here).
IGNORED = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
           "service_tier", "metadata")
# ``include`` values: logprobs are served; reasoning content never exists here (no reasoning
# items are produced), so asking for it changes nothing.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (INCLUDE_LOGPROBS, "reasoning.encrypted_content")
# vLLM's sampling extensions that a Responses request may carry on to chat.
SAMPLING_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "stop", "logit_bias", "ignore_eos", "min_tokens")
MAX_METADATA_PAIRS = 16  # OpenAI's limits on metadata: 16 pairs, keys 64 and values 512 chars



def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None:
        return True
    if isinstance(value, dict) and not value:
        return True
    return any(value == v and type(value) is type(v) for v in neutral)


def _bad(where: str, message: str) -> P.APIError:
    return P.bad_request(f"{where}: {message}", param=where.partition(".")[0])


class ResponsesRequest(P.NullIsAbsent):
    """The fields of ``POST /v1/responses`` this server reads (others: ``UNSUPPORTED``,
    ``IGNORED``, or unknown and ignored). An explicit ``null`` is the field left out."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None

    def check(self) -> None:
        """Everything but the conversation's items: 400 naming the field."""
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and not _neutral(extra[name], neutral):
                raise _bad(name, f"not supported by this server (send "
                           f"{json.dumps(neutral[0]) if neutral else 'null'} or leave it out)")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise _bad("reasoning", "not supported: this server's models do not reason in a "
                       "separate channel (leave it out)")
        for i, item in enumerate(self.include or []):
            if item not in INCLUDABLE:
                raise _bad(f"include.{i}", f"{item!r} is not supported (supported: "
                           f"{list(INCLUDABLE)})")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise _bad("max_output_tokens", "must be >= 1")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= P.MAX_LOGPROBS:
            raise _bad("top_logprobs", f"must be in [0, {P.MAX_LOGPROBS}]")
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA_PAIRS or any(
                    len(k) > 64 or not isinstance(v, str) or len(v) > 512
                    for k, v in self.metadata.items()):
                raise _bad("metadata", "at most 16 pairs of strings (keys up to 64 characters, "
                           "values up to 512)")
        if self.stream_options is not None and not self.stream:
            raise _bad("stream_options", "only allowed when stream is true")
        text = self.text or {}
        unknown = sorted(set(text) - {"format", "verbosity"})
        if unknown:
            raise _bad(f"text.{unknown[0]}", "not supported")
        if text.get("verbosity") not in (None, "medium"):
            raise _bad("text.verbosity", "not supported (leave it out)")
        if isinstance(self.input, str) and not self.input:
            raise _bad("input", "must not be empty")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise _bad("input", "must not be empty")

    def unknown_fields(self) -> list[str]:
        """Fields neither OpenAI's Responses API nor vLLM's extensions define (ignored)."""
        known = {*UNSUPPORTED, *IGNORED, *SAMPLING_EXTRAS}
        return sorted(k for k in self.model_extra or {} if k not in known)

    @property
    def logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or [])


def parse_request(body: Mapping[str, Any]) -> ResponsesRequest:
    """A ``/v1/responses`` body, checked (400 ``APIError`` naming the field)."""
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise P.from_validation_error(e) from None
    except RecursionError:
        raise P.bad_request("malformed JSON body: nested too deeply") from None
    req.check()
    return req


# ---- request -> chat -------------------------------------------------------------------------


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A message's text: a string, or parts of ``kinds`` joined (as chat joins its parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _bad(f"{where}.{j}", f"only {' / '.join(kinds)} parts with text are "
                       f"supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages. Consecutive ``function_call`` items (and the
    assistant message before them, if any) form one assistant message with ``tool_calls``, as
    a chat client sends the turn that made them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role", f"must be user, assistant, system or developer, "
                           f"got {role!r}")
            text = _text_of(item.get("content"), f"{where}.content",
                            ("input_text", "output_text", "text", "refusal"))
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _bad(f"{where}.{key}", "must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (
                    "tool_calls" in last or i > 0 and _kind(items[i - 1]) == "message"):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}.call_id", "must be a string")
            output = _text_of(item.get("output"), f"{where}.output", ("input_text", "text"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # a reasoning model's item sent back: nothing for this model to read
        else:
            raise _bad(f"{where}.type", f"{kind!r} items are not supported (message, "
                       "function_call, function_call_output)")
    return out


def _kind(item: Any) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else None


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"tools.{i}.type", f"only function tools are supported, got "
                       f"{t.get('type') if isinstance(t, dict) else t!r}")
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools.{i}.name", "must be a string")
        fn = {"name": t["name"]}
        for key in ("description", "parameters", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none / auto / required (chat checks the value)
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", "
               "\"name\": ...}")


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema", "must be a JSON schema object")
        js = {"name": fmt.get("name") or "response", "schema": schema}
        if fmt.get("strict") is not None:
            js["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": js}
    raise _bad("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")


# ---- the store -------------------------------------------------------------------------------


@dataclass
class Stored:
    """One stored response: its object and its conversation in chat form (without the
    instructions, which a follow-up does not inherit)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    at: float


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: at most
    ``max_responses`` (the oldest dropped first), each for ``ttl_s`` seconds after it was
    stored. ``max_responses`` 0 keeps nothing. Thread-safe (the router's handlers and its
    private channel share it)."""

    def __init__(self, max_responses: int = RESPONSES_STORE_SIZE,
                 ttl_s: float = RESPONSES_STORE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_responses < 0 or ttl_s <= 0:
            raise ValueError("ResponseStore: max_responses must be >= 0 and ttl_s > 0")
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._items:
            key, first = next(iter(self._items.items()))
            if first.at > cutoff:
                break
            del self._items[key]

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        if self.max_responses == 0:
            return
        with self._lock:
            self._items[response["id"]] = Stored(response, messages, self._clock())
            self._items.move_to_end(response["id"])
            self._expire()
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._items.pop(response_id, None) is not None


def not_found(response_id: str) -> P.APIError:
    return P.APIError(404, f"Response with id '{response_id}' not found.",
                      type="invalid_request_error", param="response_id", code="not_found")


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# ---- one request -----------------------------------------------------------------------------


def new_response_id(tag: str = "") -> str:
    """``resp_`` + 32 hex digits, + ``tag`` (the router process that stores it)."""
    return f"resp_{uuid.uuid4().hex}{tag}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesCall:
    """One ``/v1/responses`` request: its chat body, and its answer made from chat's.
    ``previous``: the stored response it continues (already looked up)."""

    req: ResponsesRequest
    previous: Stored | None
    response_id: str
    created_at: int = field(default_factory=P.now)

    @classmethod
    def build(cls, req: ResponsesRequest, previous: Stored | None,
              response_id: str | None = None) -> ResponsesCall:
        """The call of a checked request (``parse_request``); ``previous``: the stored
        response its ``previous_response_id`` names, looked up by the caller (400
        ``previous_response_not_found`` when it names one that is not stored)."""
        if req.previous_response_id is not None and previous is None:
            raise P.APIError(400, f"Previous response with id '{req.previous_response_id}' "
                             "not found.", param="previous_response_id",
                             code="previous_response_not_found")
        call = cls(req, previous, response_id or new_response_id())
        call.chat_body()  # the items' and tools' shapes: 400 now, before any work
        return call

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation without the instructions: the previous response's, then the
        input."""
        prior = list(self.previous.messages) if self.previous is not None else []
        return prior + _input_messages(self.req.input)

    def chat_body(self) -> dict[str, Any]:
        """The chat completions request this request means."""
        r = self.req
        messages = self.messages
        if r.instructions is not None:
            messages = [{"role": "system", "content": r.instructions}, *messages]
        if not messages:
            raise _bad("input", "must not be empty")
        body: dict[str, Any] = {"messages": messages, "stream": r.stream}
        if r.model is not None:
            body["model"] = r.model
        if r.stream:  # the usage ends the stream's response.completed
            body["stream_options"] = {"include_usage": True}
        if r.max_output_tokens is not None:
            body["max_completion_tokens"] = r.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls"):
            if getattr(r, name) is not None:
                body[name] = getattr(r, name)
        if r.tools:
            body["tools"] = _chat_tools(r.tools)
        if r.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(r.tool_choice)
        fmt = (r.text or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise _bad("text.format", "must be an object")
            rf = _response_format(fmt)
            if rf is not None:
                body["response_format"] = rf
        if r.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = r.top_logprobs or 0
        extra = r.model_extra or {}
        for name in SAMPLING_EXTRAS:
            if extra.get(name) is not None:
                body[name] = extra[name]
        return body

    # -- the answer --------------------------------------------------------------------------

    def base(self, model: str, status: str) -> dict[str, Any]:
        """The response object without its output and usage."""
        r = self.req
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": None, "incomplete_details": None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": None, "model": model, "output": [],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "store": r.store, "temperature": r.temperature, "text": {
                "format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [], "top_logprobs": r.top_logprobs, "top_p": r.top_p,
            "truncation": "disabled", "usage": None, "user": r.user,
            "metadata": r.metadata or {},
        }

    def finished(self, model: str, text: str | None, calls: list[dict[str, Any]],
                 finish_reason: str | None, usage: Mapping[str, Any] | None,
                 logprobs: list[dict[str, Any]] | None, ids: OutputIds) -> dict[str, Any]:
        """The whole response: a message item (the text, when there is any or no call), then
        one function_call item per call; ``status`` from chat's finish_reason."""
        status, incomplete, error = "completed", None, None
        if finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif finish_reason not in ("stop", "tool_calls", None):
            status, error = "failed", {"code": "server_error",
                                       "message": f"generation ended: {finish_reason}"}
        resp = self.base(model, status)
        resp["incomplete_details"] = incomplete
        resp["error"] = error
        resp["completed_at"] = P.now() if status == "completed" else None
        output: list[dict[str, Any]] = []
        if text or not calls:
            output.append(message_item(ids.message, text or "",
                                       "incomplete" if status == "incomplete" else "completed",
                                       logprobs if self.req.logprobs else None))
        for i, c in enumerate(calls):
            output.append(call_item(ids.call(i), c, "completed"))
        resp["output"] = output
        resp["usage"] = responses_usage(usage)
        return resp

    def response(self, chat: Mapping[str, Any]) -> dict[str, Any]:
        """The response of a whole chat answer."""
        choice = (chat.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        calls = [{"call_id": c["id"], "name": c["function"]["name"],
                  "arguments": c["function"]["arguments"]}
                 for c in message.get("tool_calls") or []]
        lps = (choice.get("logprobs") or {}).get("content")
        return self.finished(str(chat.get("model")), message.get("content"), calls,
                             choice.get("finish_reason"), chat.get("usage"), lps, OutputIds())

    def conversation(self, response: Mapping[str, Any]) -> list[dict[str, Any]]:
        """This request's messages and its answer, in chat form (what a follow-up sees)."""
        text, calls = None, []
        for item in response.get("output", []):
            if item["type"] == "message":
                text = "".join(p.get("text", "") for p in item["content"])
            elif item["type"] == "function_call":
                calls.append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        answer: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            answer["tool_calls"] = calls
        return [*self.messages, answer]

    def keep(self, store: ResponseStore, response: dict[str, Any]) -> None:
        """Store ``response`` when the request asked for it (the default)."""
        if self.req.store and response.get("status") in ("completed", "incomplete"):
            store.put(response, self.conversation(response))


@dataclass
class OutputIds:
    """The ids of a response's output items, made when first needed (a stream's events name
    them before the response is whole)."""

    _message: str | None = None
    _calls: list[str] = field(default_factory=list)

    @property
    def message(self) -> str:
        if self._message is None:
            self._message = _item_id("msg")
        return self._message

    def call(self, i: int) -> str:
        while len(self._calls) <= i:
            self._calls.append(_item_id("fc"))
        return self._calls[i]


def message_item(item_id: str, text: str, status: str,
                 logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part]}


def call_item(item_id: str, call: Mapping[str, str], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["call_id"],
            "name": call["name"], "arguments": call["arguments"], "status": status}


def responses_usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0)}


# ---- the stream ------------------------------------------------------------------------------


def sse_event(event: dict[str, Any]) -> str:
    """One Responses stream event: its ``event:`` line (the type) and its ``data:`` line."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class EventStream:
    """Turns the chunks of a streamed chat answer into the Responses event sequence::

        response.created, response.in_progress               (with the first chunk)
        response.output_item.added, response.content_part.added, then per text delta
          response.output_text.delta ...                      (the message item)
        response.output_text.done, response.content_part.done, response.output_item.done
        per tool call: response.output_item.added, response.function_call_arguments.delta
          ..., response.function_call_arguments.done, response.output_item.done
        response.completed | response.incomplete | response.failed   (``finish``)

    Every event carries ``type`` and ``sequence_number`` (0, 1, ...). The last event's
    response equals the non-streamed answer's (same builder: ``ResponsesCall.finished``).
    ``on_done`` gets that response (the caller stores it)."""

    def __init__(self, call: ResponsesCall,
                 on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.call = call
        self.on_done = on_done
        self.ids = OutputIds()
        self.seq = 0
        self.model = ""
        self.started = False
        self.ended = False
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.calls: list[dict[str, str]] = []  # call_id, name, arguments
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        # Output items in the order they opened: ("message", 0) or ("call", i); an open
        # item is the last one until ``_close``.
        self.items: list[tuple[str, int]] = []
        self.open: tuple[str, int] | None = None

    def _event(self, type_: str, **fields: Any) -> str:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(event)

    def _start(self, model: str) -> list[str]:
        self.started = True
        self.model = model
        resp = self.call.base(model, "in_progress")
        return [self._event("response.created", response=resp),
                self._event("response.in_progress", response=resp)]

    def _index(self, item: tuple[str, int]) -> int:
        return self.items.index(item)

    def _close(self) -> list[str]:
        """Events that end the open item."""
        if self.open is None:
            return []
        kind, i = self.open
        self.open = None
        at = self._index((kind, i))
        if kind == "message":
            lps = self.logprobs if self.call.req.logprobs else None
            item = message_item(self.ids.message, self.text, "completed", lps)
            part = item["content"][0]
            return [self._event("response.output_text.done", item_id=self.ids.message,
                                output_index=at, content_index=0, text=self.text,
                                logprobs=self.logprobs),
                    self._event("response.content_part.done", item_id=self.ids.message,
                                output_index=at, content_index=0, part=part),
                    self._event("response.output_item.done", output_index=at, item=item)]
        call = self.calls[i]
        item = call_item(self.ids.call(i), call, "completed")
        return [self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=at, name=call["name"], arguments=call["arguments"]),
                self._event("response.output_item.done", output_index=at, item=item)]

    def _text(self, delta: str, lps: list[dict[str, Any]]) -> list[str]:
        """A text delta (with the logprobs of its tokens) of the message item, opened first.
        (The tool-call parsers put every text before the first call, so the message item is
        never reopened after a call.)"""
        out: list[str] = []
        self.logprobs += lps
        if self.open != ("message", 0):
            if ("message", 0) in self.items:
                return out  # (cannot happen: see above)
            out += self._close()
            self.items.append(("message", 0))
            self.open = ("message", 0)
            at = self._index(("message", 0))
            item = message_item(self.ids.message, "", "in_progress", None)
            item["content"] = []
            out.append(self._event("response.output_item.added", output_index=at, item=item))
            out.append(self._event("response.content_part.added", item_id=self.ids.message,
                                   output_index=at, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        self.text += delta
        if delta:
            out.append(self._event("response.output_text.delta", item_id=self.ids.message,
                                   output_index=self._index(("message", 0)), content_index=0,
                                   delta=delta, logprobs=lps))
        return out

    def _tool_call(self, tc: Mapping[str, Any]) -> list[str]:
        out: list[str] = []
        i = int(tc.get("index", 0))
        fn = tc.get("function") or {}
        if i >= len(self.calls):  # the call's head: id and name
            out += self._close()
            self.calls.append({"call_id": tc.get("id") or "", "name": fn.get("name") or "",
                               "arguments": ""})
            self.items.append(("call", i))
            self.open = ("call", i)
            item = call_item(self.ids.call(i), self.calls[i], "in_progress")
            out.append(self._event("response.output_item.added",
                                   output_index=self._index(("call", i)), item=item))
        args = fn.get("arguments") or ""
        if args:
            self.calls[i]["arguments"] += args
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=self.ids.call(i),
                                   output_index=self._index(("call", i)), delta=args))
        return out

    def feed(self, chunk: Mapping[str, Any]) -> str:
        """The events of one chat chunk (a dict parsed from its ``data:`` line)."""
        if self.ended:
            return ""
        if "error" in chunk and "choices" not in chunk:
            return self.error(chunk)
        out: list[str] = []
        if not self.started:
            out += self._start(str(chunk.get("model", "")))
        for ch in chunk.get("choices") or []:
            delta = ch.get("delta") or {}
            lps = (ch.get("logprobs") or {}).get("content") or []
            if delta.get("content"):
                out += self._text(delta["content"], lps)
            else:  # (tool-call tokens: their logprobs join the message's, as whole answers')
                self.logprobs += lps
            for tc in delta.get("tool_calls") or []:
                out += self._tool_call(tc)
            if ch.get("finish_reason") is not None:
                self.finish_reason = ch["finish_reason"]
        if chunk.get("usage"):
            self.usage = dict(chunk["usage"])
        return "".join(out)

    def finish(self) -> str:
        """The closing events, at the chat stream's end (``[DONE]``)."""
        if self.ended:
            return ""
        out: list[str] = []
        if not self.started:
            out += self._start("")
        if not self.items:  # no text and no call: an empty message, as the whole answer has
            out += self._text("", [])
        out += self._close()
        self.ended = True
        resp = self.call.finished(self.model, self.text if ("message", 0) in self.items
                                  else None, self.calls, self.finish_reason, self.usage,
                                  self.logprobs, self.ids)
        # The items in the order they were streamed (the whole answer's order: text first).
        order = {("message", 0): resp["output"][0]} if ("message", 0) in self.items else {}
        calls = [o for o in resp["output"] if o["type"] == "function_call"]
        order.update({("call", i): calls[i] for i in range(len(calls))})
        resp["output"] = [order[k] for k in self.items if k in order]
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            resp["status"], "response.failed")
        out.append(self._event(kind, response=resp))
        if self.on_done is not None:
            self.on_done(resp)
        return "".join(out)

    def error(self, body: Mapping[str, Any]) -> str:
        """An error after the stream began (the chat stream's in-band error): an ``error``
        event, then ``response.failed``."""
        if self.ended:
            return ""
        out: list[str] = []
        if not self.started:
            out += self._start(self.model)
        err = body.get("error") if isinstance(body.get("error"), dict) else {}
        message = str(err.get("message", "error"))
        code = err.get("code")
        out.append(self._event("error", code=None if code is None else str(code),
                               message=message, param=err.get("param")))
        resp = self.call.base(self.model, "failed")
        resp["error"] = {"code": "server_error", "message": message}
        out.append(self._event("response.failed", response=resp))
        self.ended = True
        return "".join(out)
