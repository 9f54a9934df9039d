"""Tool calls read out of the model's text (``--tool-call-parser``: ``hermes``,
``llama3_json``, ``mistral``; or the forced forms of ``contracts/tools.py``) and turned into
OpenAI ``tool_calls``: whole (``ToolCalls.message``), or as stream deltas (``stream_delta``:
each call's index, id, type and name first, then fragments of its arguments)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg.contracts.tools import ToolChoice, new_call_id

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
