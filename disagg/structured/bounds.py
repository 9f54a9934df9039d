"""Default bounds for what a JSON schema leaves unbounded, added before it is compiled (pure).

A grammar must not let a weak model spend its whole ``max_tokens`` on one value: an integer
of 200 digits, a string that never closes, a key of an open object that never ends. The
schema is rewritten into a narrower one (every output of the rewritten schema matches the
schema as given) where it says nothing:

- integers and numbers: ``minimum`` / ``maximum`` of -/+ (2^53 - 1), the interoperable range
  of I-JSON (RFC 7493 section 2.2): at most 16 digits before the point. llguidance writes a
  range-bounded number without an exponent.
- numbers: ``multipleOf`` 1e-10, at most 10 digits after the point (more than a double holds
  for any value from 10^6 up; 1e-10 is also the finest step llguidance 1.9.1 compiles).
- strings, and the keys of an object that names none of its properties: ``maxLength`` of the
  spec's ``string_bound``: half the request's ``max_tokens`` rounded down to a power of two
  (``string_bound``). A token holds at least one character (ASCII), so one string spends at
  most half the budget and the rest of the structure has room to close; a schema that wants
  longer strings says so with ``maxLength``.
- an object that lists ``properties`` and says nothing of others gets
  ``additionalProperties: false`` (OpenAI's strict mode requires it; xgrammar's default
  strict mode assumes it): the model writes the properties the schema names.
- an open value (``true``, ``{}``, the values of a ``json_object``, the items of an array
  without ``items``) gets all of the above at every depth, through one shared definition
  (``$defs/disagg_any``).

The schema's own bounds win: a keyword is added only where neither the node nor the
``anyOf`` / ``oneOf`` / ``allOf`` nodes around it, a sibling ``allOf`` member or its
``then`` / ``else`` give it; ``enum`` / ``const`` values and ``format`` strings are left
alone; a minimum beyond 2^53 - 1 (or a maximum below its negative) leaves the other side open;
a ``minLength`` above the default raises it. Left as given: whatever is under ``not``, ``if``,
``then``, ``else``, ``contains``, ``propertyNames``, ``dependentSchemas`` (narrowing there
could widen the language or empty it) and inside ``allOf`` members (their intersection with
each other; a member only gets bounds on its own value); objects whose properties a
composition or a conditional may extend are not closed. Counts (array items, entries of a
map) stay unbounded: a list may be long.
"""

from __future__ import annotations

from typing import Any

INT_LIMIT = 2**53 - 1  # I-JSON's interoperable integers (RFC 7493 section 2.2)
FRACTION_STEP = 1e-10  # at most 10 digits after the decimal point
ANY_NAME = "disagg_any"  # the shared definition of a bounded "any JSON value"

_COMPOSITE = ("allOf", "anyOf", "oneOf", "$ref")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("additionalProperties", "additionalItems")
_SAME_VALUE = ("then", "else")  # left as given; their keywords count as the node's
# Keywords that may let an object have more properties than it lists: it is not closed.
_OPEN_OBJECT = ("unevaluatedProperties", "propertyNames", "dependentSchemas", "if", "then",
                "else")
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties",
                "unevaluatedProperties", "propertyNames", "required", "dependentRequired",
                "dependentSchemas")
_ARRAY_KEYS = ("items", "prefixItems", "additionalItems", "unevaluatedItems", "contains")
_TYPES = ("string", "integer", "number", "object", "array", "boolean", "null")


def string_bound(max_tokens: int) -> int:
    """The ``maxLength`` of a string the schema leaves unbounded, for a request allowed
    ``max_tokens``: half of it, rounded down to a power of two (so one compiled grammar serves
    a range of ``max_tokens``), at least 1."""
    return 1 << (max(max_tokens // 2, 1).bit_length() - 1)


def key_pattern(max_length: int) -> str:
    """A ``patternProperties`` pattern matching every key of at most ``max_length``
    characters."""
    return rf"^[\s\S]{{0,{max_length}}}$"


def bound_schema(schema: Any, max_length: int | None) -> Any:
    """``schema`` with the default bounds added (a new value; ``schema`` is not changed).
    ``max_length``: the default ``maxLength`` of strings and open objects' keys (None: strings
    stay unbounded)."""
    return _Bounder(schema, max_length).run()


def _types(here: dict[str, Any]) -> set[str]:
    t = here.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set(_TYPES)  # no type: every kind of value


def _number(v: Any) -> float | int | None:
    # bool is an int in Python; draft-4's boolean exclusiveMinimum is not a bound of its own
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


class _Bounder:
    def __init__(self, schema: Any, max_length: int | None) -> None:
        self.root = schema
        self.max_length = max_length
        self.any_used = False
        defs = schema.get("$defs") if isinstance(schema, dict) else None
        taken = set(defs) if isinstance(defs, dict) else set()
        self.any_name = ANY_NAME
        while self.any_name in taken:
            self.any_name += "_"
        # A nested $id changes what "#/..." means under it: no shared definition then (nor
        # where $defs is not an object: nowhere to put it).
        self.can_refer = (not _has_nested_id(schema, top=True)
                          and (defs is None or isinstance(defs, dict)))

    def run(self) -> Any:
        out = self._open(self.root)
        if self.any_used:
            # (``out`` is an object: a root ``true`` became a reference, ``false`` refers to
            # nothing)
            defs = dict(out.get("$defs") or {})
            defs[self.any_name] = self.node({}, {}, False)
            out["$defs"] = defs
        return out

    def _open(self, s: Any) -> Any:
        """A subschema of a value of its own: ``true`` becomes the bounded any value."""
        if s is True and self.can_refer:
            self.any_used = True
            return {"$ref": f"#/$defs/{self.any_name}"}
        return self.node(s, {}, False)

    def node(self, s: Any, path: dict[str, Any], in_all_of: bool) -> Any:
        """One subschema. ``path``: the keywords of the anyOf / oneOf / allOf nodes above it
        (they constrain the same value); ``in_all_of``: it is an allOf member (or one of its
        alternatives): defaults go on this value only, never inside it."""
        if not isinstance(s, dict):
            return s  # true / false (or a malformed schema, which the compiler refuses)
        out = dict(s)
        here = {**path, **{k: v for k, v in s.items() if k not in _COMPOSITE}}
        for key in _SAME_VALUE:  # declared there counts as declared here (no clamping)
            if isinstance(s.get(key), dict):
                here = {**{k: v for k, v in s[key].items() if k not in _COMPOSITE}, **here}
        if not in_all_of:
            self._children(out, s)
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                out[key] = [self.node(v, here, in_all_of) for v in s[key]]
        if isinstance(s.get("allOf"), list):
            members = s["allOf"]
            out["allOf"] = []
            for i, m in enumerate(members):
                siblings: dict[str, Any] = {}
                for j, other in enumerate(members):
                    if j != i and isinstance(other, dict):
                        siblings.update({k: v for k, v in other.items() if k not in _COMPOSITE})
                out["allOf"].append(self.node(m, {**siblings, **here}, True))
        # Alternatives, members or the definition carry the defaults; a fixed value needs none.
        if any(k in s for k in _COMPOSITE) or "enum" in here or "const" in here:
            return out
        self._scalars(out, here)
        if not in_all_of:
            self._structure(out, s, path)
        return out

    def _children(self, out: dict[str, Any], s: dict[str, Any]) -> None:
        """The subschemas of values inside this one (properties, items, definitions)."""
        for key in _SCHEMA_MAPS:
            if isinstance(s.get(key), dict):
                out[key] = {name: self._open(v) for name, v in s[key].items()}
        for key in _SCHEMA_ONE:
            if key in s:
                out[key] = self._open(s[key])
        for key in ("items", "prefixItems"):
            if isinstance(s.get(key), list):  # prefixItems, or draft 4's tuple items
                out[key] = [self._open(v) for v in s[key]]
            elif key == "items" and "items" in s:
                out[key] = self._open(s[key])

    def _scalars(self, out: dict[str, Any], here: dict[str, Any]) -> None:
        types = _types(here)
        if ("string" in types and self.max_length is not None and "maxLength" not in here
                and "format" not in here):
            min_length = _number(here.get("minLength")) or 0
            out["maxLength"] = max(self.max_length, int(min_length))
        if not types & {"integer", "number"}:
            return
        lo = next((v for v in (_number(here.get("minimum")),
                               _number(here.get("exclusiveMinimum"))) if v is not None), None)
        hi = next((v for v in (_number(here.get("maximum")),
                               _number(here.get("exclusiveMaximum"))) if v is not None), None)
        if lo is None and (hi is None or hi >= -INT_LIMIT):
            out["minimum"] = -INT_LIMIT
        if hi is None and (lo is None or lo <= INT_LIMIT):
            out["maximum"] = INT_LIMIT
        if "number" in types and "multipleOf" not in here:
            out["multipleOf"] = FRACTION_STEP

    def _structure(self, out: dict[str, Any], s: dict[str, Any], path: dict[str, Any]) -> None:
        types = _types({**path, **s})
        if "object" in types and not any(k in path for k in _OBJECT_KEYS):
            self._object(out, s)
        if ("array" in types and not any(k in path for k in _ARRAY_KEYS)
                and "items" not in s and self.can_refer):
            # no items (or none after prefixItems): the items are open values
            self.any_used = True
            out["items"] = {"$ref": f"#/$defs/{self.any_name}"}

    def _object(self, out: dict[str, Any], s: dict[str, Any]) -> None:
        if any(k in s for k in _OPEN_OBJECT):
            return
        if "properties" in s or "patternProperties" in s:
            if "properties" in s and "additionalProperties" not in s:
                out["additionalProperties"] = False
            return
        if s.get("additionalProperties", True) is False:
            return
        value = out.get("additionalProperties", True)
        if value is True:
            if not self.can_refer:
                return
            value = self._open(True)
        if self.max_length is None:
            out["additionalProperties"] = value
            return
        required = s.get("required")
        required = [k for k in required if isinstance(k, str)] if isinstance(
            required, list) else []
        longest = max((len(k) for k in required), default=0)
        out["patternProperties"] = {key_pattern(max(self.max_length, longest)): value}
        out["additionalProperties"] = False


def _has_nested_id(s: Any, top: bool) -> bool:
    if isinstance(s, dict):
        if not top and "$id" in s:
            return True
        return any(_has_nested_id(v, False) for k, v in s.items()
                   if k not in ("enum", "const", "default", "examples"))
    if isinstance(s, list):
        return any(_has_nested_id(v, False) for v in s)
    return False
