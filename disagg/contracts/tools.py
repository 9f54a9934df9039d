"""Tool calling, the request's side: ``tools`` and ``tool_choice`` checked (``resolve``), the
grammar that forces a call (``forced_spec``), an assistant message's earlier calls as chat
templates take them (``template_tool_calls``), and call ids (``new_call_id``,
``template_call_id``). Reading calls out of the model's text is the worker's
(``server/tool_calls.py``).

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
from dataclasses import dataclass
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


def new_call_id(parser: str | None = None) -> str:
    """A new tool call id: OpenAI's shape (``call_`` + 24 hex digits), or 9 letters and
    digits for Mistral, whose chat templates take no other (``template_call_id``)."""
    if parser == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"
