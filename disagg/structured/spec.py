"""A request's structured-output constraint as one frozen value (pure: no grammar engine).

Every way a client can ask for one becomes a ``GrammarSpec``: OpenAI's ``response_format``
(``json_object``, ``json_schema``), vLLM's ``structured_outputs`` extension (``json``,
``regex``, ``choice``, ``grammar``) and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields, and forced tool calls (``tools.py`` builds
their schema). The spec travels in ``SamplingParams`` and so reaches the engine unchanged on
every worker: the context and the generation worker of a disaggregated request build the same
grammar from the same request body. A JSON spec also carries the default ``maxLength`` of the
strings its schema leaves unbounded (``string_bound``), derived from the request's
``max_tokens`` when its ``SamplingParams`` is made (``bounds.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from disagg.structured.bounds import string_bound

KINDS = ("json", "regex", "choice", "grammar")


class StructuredSpecError(ValueError):
    """A malformed structured-output request; the message starts with the field's name."""


@dataclass(frozen=True)
class GrammarSpec:
    """``kind``: json | regex | choice | grammar; ``text``: the JSON schema (compact, its keys
    in the client's order: llguidance writes properties in the order the schema lists them),
    the regex, the choices as a JSON list, or the grammar (Lark, or GBNF when it uses
    ``::=``). ``field``: the request field it came from (errors name it). ``string_bound``
    (json only): the ``maxLength`` of strings the schema leaves unbounded (None: unbounded;
    ``with_budget`` sets it)."""

    kind: str
    text: str
    field: str = "structured_outputs"
    string_bound: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredSpecError(f"{self.field}: unknown kind {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: Any, field: str) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise StructuredSpecError(f"{field}: not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise StructuredSpecError(f"{field}: a JSON schema must be an object")
        return cls("json", json.dumps(schema, separators=(",", ":")), field)

    def with_budget(self, max_tokens: int) -> GrammarSpec:
        """This spec for a request allowed ``max_tokens``: a JSON spec gets its
        ``string_bound`` (``bounds.string_bound``) unless it has one already (a context-only
        copy of a request's params keeps the bound of the request's own ``max_tokens``)."""
        if self.kind != "json" or self.string_bound is not None:
            return self
        return replace(self, string_bound=string_bound(max_tokens))


def _one_of(fields: dict[str, Any], where: str) -> tuple[str, Any] | None:
    given = [(k, v) for k, v in fields.items() if v is not None and k in KINDS]
    if len(given) > 1:
        raise StructuredSpecError(
            f"{where}: give only one of {', '.join(KINDS)} (got {', '.join(k for k, _ in given)})")
    return given[0] if given else None


def _spec_of(kind: str, value: Any, field: str) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec.json_schema(value, field)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise StructuredSpecError(f"{field}: choice must be a non-empty list of strings")
        return GrammarSpec("choice", json.dumps(value), field)
    if not isinstance(value, str) or not value:
        raise StructuredSpecError(f"{field}: {kind} must be a non-empty string")
    return GrammarSpec(kind, value, field)


def from_response_format(rf: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI's ``response_format``: text (None), json_object, json_schema."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
            raise StructuredSpecError(
                "response_format: json_schema must be an object {name, schema, strict}")
        # strict or not, the output is made to match the schema (as vLLM does).
        schema = js.get("schema", {"type": "object"})
        return GrammarSpec.json_schema(schema, "response_format")
    raise StructuredSpecError(
        f"response_format: type must be text, json_object or json_schema, got {kind!r}")


def from_structured_outputs(so: dict[str, Any] | None) -> GrammarSpec | None:
    """vLLM's ``structured_outputs``: {json | regex | choice | grammar} (one of them)."""
    if so is None:
        return None
    # disable_fallback: there is one grammar engine, nothing to fall back to. vLLM's other
    # options (whitespace, additionalProperties, structural tags) are refused, not ignored.
    known = set(KINDS) | {"json_object", "disable_fallback"}
    unknown = sorted(set(so) - known)
    if unknown:
        raise StructuredSpecError(f"structured_outputs: unsupported field(s) {unknown} "
                                  f"(supported: {sorted(known)})")
    if so.get("json_object"):
        if _one_of(so, "structured_outputs") is not None:
            raise StructuredSpecError("structured_outputs: json_object excludes the others")
        return GrammarSpec.json_schema({"type": "object"}, "structured_outputs")
    one = _one_of(so, "structured_outputs")
    return None if one is None else _spec_of(one[0], one[1], "structured_outputs")


def from_guided(fields: dict[str, Any]) -> GrammarSpec | None:
    """vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar`` fields (``fields``: kind -> value)."""
    one = _one_of(fields, "guided_*")
    return None if one is None else _spec_of(one[0], one[1], f"guided_{one[0]}")


def request_spec(response_format: dict[str, Any] | None,
                 structured_outputs: dict[str, Any] | None,
                 guided: dict[str, Any]) -> GrammarSpec | None:
    """The one constraint of a request, from whichever field gave it; two is a 400."""
    specs = [s for s in (from_response_format(response_format),
                         from_structured_outputs(structured_outputs), from_guided(guided))
             if s is not None]
    if len(specs) > 1:
        raise StructuredSpecError(
            f"{specs[1].field}: only one structured-output constraint per request (also "
            f"given: {specs[0].field})")
    return specs[0] if specs else None
