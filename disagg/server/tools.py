"""Tool calling: the request's ``tools`` and ``tool_choice`` checked, the grammar that forces a
call, and the model's text turned into OpenAI ``tool_calls`` (whole, or as stream deltas).

- ``tool_choice: "none"``: the tools reach the chat template, the text is plain content.
- ``"auto"`` (the default when tools are given): the model decides; its text is read by the
  parser the server was started with (``--tool-call-parser``: ``hermes``, ``llama3_json``,
  ``mistral``); without one the request is a 400, as in vLLM.
- ``"required"``: the output is forced (structured outputs) to a JSON array of
  ``{"name", "parameters"}`` objects, one per call, each ``parameters`` matching its tool's
  schema (one item only when ``parallel_tool_calls`` is false); finish_reason "tool_calls".
- a named function: the output is forced to that tool's arguments object; finish_reason stays
  "stop" (OpenAI's and vLLM's rule for a forced named call).
``required`` and named need no parser: the grammar makes their output parse.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg.structured.spec import GrammarSpec

PARSERS = ("hermes", "llama3_json", "mistral")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A malformed ``tools`` / ``tool_choice``; the message starts with the field's name."""


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: none | auto | required | named (then ``name`` is the forced tool)."""

    mode: str
    tools: tuple[Tool, ...] = ()
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def _tool(i: int, t: Any) -> Tool:
    where = f"tools.{i}"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise ToolError(f"{where}: only {{\"type\": \"function\", \"function\": {{...}}}} "
                        f"tools are supported")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError(f"{where}.function: must be an object with a name")
    if not _NAME.match(fn["name"]):
        raise ToolError(f"{where}.function.name: {fn['name']!r} must be 1-64 letters, digits, "
                        f"_ . or -")
    params = fn.get("parameters", _EMPTY_PARAMS)
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters: must be a JSON schema object")
    return Tool(fn["name"], params)


def resolve(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
            parallel_tool_calls: bool | None) -> ToolChoice:
    """The request's tool choice, checked (``ToolError`` names the bad field)."""
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools or []))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ToolError("tools: function names must be unique")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        return ToolChoice("auto" if parsed else "none", parsed, parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice: must be none, auto, required or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                            f"{tool_choice!r}")
        if tool_choice == "required" and not parsed:
            raise ToolError("tool_choice: 'required' needs tools")
        # "auto" over no tools: nothing to call (OpenAI clients send it with tools=[]).
        mode = "none" if tool_choice == "auto" and not parsed else tool_choice
        return ToolChoice(mode, parsed, parallel=parallel)
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice: a named choice is {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}")
    if name not in names:
        raise ToolError(f"tool_choice: {name!r} is not one of the tools ({names})")
    return ToolChoice("named", parsed, name, parallel)


def forced_spec(choice: ToolChoice) -> GrammarSpec | None:
    """The grammar of a forced call (None when the model chooses)."""
    if choice.mode == "named":
        tool = next(t for t in choice.tools if t.name == choice.name)
        return GrammarSpec.json_schema(tool.parameters, "tool_choice")
    if choice.mode != "required":
        return None
    items = [{"type": "object", "additionalProperties": False,
              "properties": {"name": {"const": t.name}, "parameters": t.parameters},
              "required": ["name", "parameters"]} for t in choice.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not choice.parallel:
        schema["maxItems"] = 1
    return GrammarSpec.json_schema(schema, "tool_choice")


def template_tool_calls(calls: list[Any], parser: str | None = None) -> list[Any]:
    """An assistant message's ``tool_calls`` for the chat template: each call's ``arguments``
    JSON text as an object (templates write ``arguments | tojson`` or iterate its items; vLLM
    does the same), and, for Mistral (``parser``), its id as ``template_call_id``'s."""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass  # not JSON: the template gets the text as sent
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            call = {**call, "id": template_call_id(call["id"], parser)}
        out.append(call)
    return out


_ALNUM = string.ascii_letters + string.digits


def template_call_id(call_id: str, parser: str | None) -> str:
    """A tool call's id as the model family's chat template takes it. Mistral's templates
    refuse any id but 9 letters and digits (``raise_exception``): an id of another shape (an
    OpenAI ``call_...`` id from a client's history) becomes 9 hex digits of its hash, the same
    in the assistant's ``tool_calls`` and in the ``tool`` message that answers it. Other
    families' ids pass as they are."""
    if parser != "mistral" or (len(call_id) == 9 and all(c in _ALNUM for c in call_id)):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


# ---- reading calls out of the model's text ---------------------------------------------------

_DEC = json.JSONDecoder()
_ARG_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class Call:
    """One call object read from the text, maybe still being written. ``args``: the JSON text
    of its arguments as written (a slice of the text, so what was streamed of it stays a
    prefix), or the string's value when the model wrote them as a JSON string; ``streamable``:
    ``args`` only grows as the text does (an object or array being written)."""

    name: str | None
    args: str
    complete: bool
    streamable: bool


def _skip(text: str, i: int, chars: str = " \t\r\n") -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _scan_call(text: str, i: int) -> tuple[Call, int]:
    """The call object opening at ``text[i] == "{"``: (the call, the index after it, or
    ``len(text)`` while it is open). Walks its top-level keys so that ``name`` and the
    arguments' span are known before the object closes."""
    name, args, streamable, j = None, None, True, i + 1
    while True:
        j = _skip(text, j, " \t\r\n,")
        if j >= len(text) or text[j] == "}":
            break
        try:
            key, j = _DEC.raw_decode(text, j)
        except ValueError:
            break
        j = _skip(text, j)
        if text[j:j + 1] != ":":
            break
        j = _skip(text, j + 1)
        try:
            value, end = _DEC.raw_decode(text, j)
        except ValueError:  # the value is being written
            if key in _ARG_KEYS and text[j:j + 1] in ("{", "["):
                args = text[j:]
            break
        if key == "name" and isinstance(value, str):
            name = value
        elif key in _ARG_KEYS:
            streamable = not isinstance(value, str)
            args = value if isinstance(value, str) else text[j:end]
        j = end
    complete = j < len(text) and text[j] == "}"
    return Call(name, args if args is not None else ("{}" if complete else ""), complete,
                streamable), (j + 1 if complete else len(text))


def _scan_calls(text: str, i: int, limit: int | None = None) -> list[Call]:
    """Consecutive call objects from ``text[i]`` (separated by blanks, ``,`` or ``;``), up to
    the first one still open; at most ``limit``."""
    calls: list[Call] = []
    while limit is None or len(calls) < limit:
        i = _skip(text, i, " \t\r\n,;")
        if text[i:i + 1] != "{":
            break
        call, i = _scan_call(text, i)
        calls.append(call)
        if not call.complete:
            break
    return calls


@dataclass(frozen=True)
class Parsed:
    content: str  # plain text for the client (before the calls)
    calls: list[Call]
    # Streaming: how much of ``content`` is safe to send now (a marker may still begin later).
    settled: int


def _held_back(text: str, marker: str) -> int:
    """Length of ``text`` that cannot be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def parse_hermes(text: str) -> Parsed:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Hermes)."""
    tag = "<tool_call>"
    start = text.find(tag)
    if start < 0:
        return Parsed(text, [], _held_back(text, tag))
    calls: list[Call] = []
    at = start
    while at >= 0:
        calls += _scan_calls(text, at + len(tag), limit=1)
        if calls and not calls[-1].complete:
            break
        at = text.find(tag, at + len(tag))
    return Parsed(text[:start], calls, start)


def parse_llama3_json(text: str) -> Parsed:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}`` (``;``-separated),
    optionally after ``<|python_tag|>``; text that does not open with ``{`` is content."""
    body = text.lstrip()
    if "<|python_tag|>".startswith(body):  # empty, or the tag may still be arriving
        return Parsed(text, [], 0)
    at = _skip(text, len(text) - len(body) + (len("<|python_tag|>") if body.startswith(
        "<|python_tag|>") else 0))
    if at >= len(text):
        return Parsed(text, [], 0)
    if text[at] != "{":
        return Parsed(text, [], len(text))
    return Parsed("", _scan_calls(text, at), 0)


def parse_mistral(text: str) -> Parsed:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker is a
    special token: also read when the detokenizer dropped it and the array opens the text)."""
    marker = "[TOOL_CALLS]"
    start = text.find(marker)
    if start >= 0:
        at = _skip(text, start + len(marker))
    elif text.lstrip().startswith('[{"name"'):
        start, at = 0, _skip(text, 0)
    else:
        return Parsed(text, [], _held_back(text, marker))
    at = at + 1 if text[at:at + 1] == "[" else at
    return Parsed(text[:start], _scan_calls(text, at), start)


def _parse_required(text: str) -> Parsed:
    """The forced array ``[{"name", "parameters"}, ...]``."""
    at = _skip(text, 0)
    if text[at:at + 1] != "[":
        return Parsed("", [], 0)
    return Parsed("", _scan_calls(text, at + 1), 0)


PARSE: dict[str, Callable[[str], Parsed]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def new_call_id(parser: str | None = None) -> str:
    """A new tool call id: OpenAI's shape (``call_`` + 24 hex digits), or 9 letters and
    digits for Mistral, whose chat templates take no other (``template_call_id``)."""
    if parser == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def call_json(call: tuple[str, str], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": call[0], "arguments": call[1]}}


@dataclass
class ToolCalls:
    """Reads one choice's output as tool calls per the request's ``ToolChoice``."""

    choice: ToolChoice
    parser: str | None  # the server's --tool-call-parser

    # Streaming state of one choice (one instance per choice).
    _text: str = ""
    _sent_content: int = 0
    _sent_args: list[int] = field(default_factory=list)  # per call sent: args chars sent
    _ids: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.choice.forced or (self.choice.mode == "auto" and self.parser is not None)

    def _parse(self, text: str) -> Parsed:
        if self.choice.mode == "named":  # the output is the arguments object
            assert self.choice.name is not None
            return Parsed("", [Call(self.choice.name, text, False, True)], 0)
        if self.choice.mode == "required":
            return _parse_required(text)
        assert self.parser is not None
        return PARSE[self.parser](text)

    @staticmethod
    def _named(p: Parsed) -> list[Call]:
        """The calls whose name is known, in order (a call's arguments may still be cut
        short: finish_reason "length" says so)."""
        out = []
        for c in p.calls:
            if c.name is None:
                break
            out.append(c)
        return out

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """The whole answer's ``message`` and finish_reason."""
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if not self.active:
            return msg, finish_reason
        p = self._parse(text)
        calls = self._named(p)
        if not calls:
            return msg, finish_reason
        msg["content"] = p.content or None
        msg["tool_calls"] = [call_json((c.name or "", c.args), new_call_id(self.parser))
                             for c in calls]
        # A forced named call ends with "stop" (OpenAI); chosen / required calls say so.
        if self.choice.mode != "named" and finish_reason == "stop":
            finish_reason = "tool_calls"
        return msg, finish_reason

    def stream_delta(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas for ``text`` (new output of this choice): content, and each tool call
        as it is written: its index, id, type and name first, then fragments of its arguments
        (an object's text as it grows; a string's value once complete)."""
        self._text += text
        if not self.active:
            return [{"content": text}] if text else []
        p = self._parse(self._text)
        calls = self._named(p)
        out: list[dict[str, Any]] = []
        settled = len(p.content) if finished or p.calls else p.settled
        if settled > self._sent_content:
            out.append({"content": p.content[self._sent_content:settled]})
            self._sent_content = settled
        for i, c in enumerate(calls):
            if i == len(self._ids):
                self._ids.append(new_call_id(self.parser))
                self._sent_args.append(0)
                out.append(self._head(i, c.name or ""))
            if (c.streamable or c.complete or finished) and len(c.args) > self._sent_args[i]:
                out.append({"tool_calls": [{"index": i, "function": {
                    "arguments": c.args[self._sent_args[i]:]}}]})
                self._sent_args[i] = len(c.args)
        if finished and not calls and len(self._text) > self._sent_content:
            out.append({"content": self._text[self._sent_content:]})  # not a call after all
            self._sent_content = len(self._text)
        return out

    def _head(self, index: int, name: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "id": self._ids[index], "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def stream_finish_reason(self, finish_reason: str | None) -> str | None:
        if finish_reason == "stop" and self._ids and self.choice.mode != "named":
            return "tool_calls"
        return finish_reason
