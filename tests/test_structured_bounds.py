"""JSON grammars are compact and bounded where the schema says nothing (disagg/structured/
bounds.py): the schema transformation with exact outputs (pure), what the compiled grammar
accepts and refuses (llguidance over the tiny model's tokenizer), and the tiny model (random
weights, through the offline engine) writing compact JSON that ends within the default bounds,
or within the schema's own bounds where it gives them."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.contracts import tools as T
from disagg.engine import context_only_params
from disagg.request import SamplingParams
from disagg.structured.bounds import (
    FRACTION_STEP,
    INT_LIMIT,
    bound_schema,
    key_pattern,
    string_bound,
)
from disagg.structured.spec import GrammarSpec, StructuredSpecError

L = INT_LIMIT
ANY_REF = {"$ref": "#/$defs/disagg_any"}


def _any(n: int | None) -> dict[str, Any]:
    """The shared bounded any-value definition for string bound ``n``."""
    out: dict[str, Any] = {} if n is None else {"maxLength": n}
    out.update({"minimum": -L, "maximum": L, "multipleOf": FRACTION_STEP})
    if n is None:
        out["additionalProperties"] = ANY_REF
    else:
        out.update({"patternProperties": {key_pattern(n): ANY_REF},
                    "additionalProperties": False})
    out["items"] = ANY_REF
    return out


class City(pydantic.BaseModel):  # the README's
    name: str
    population: int


# ---- the transformation (pure) ---------------------------------------------------------------


def test_string_bound_is_half_the_budget_rounded_down_to_a_power_of_two() -> None:
    assert [string_bound(n) for n in (1, 2, 3, 4, 200, 256, 1000, 4096, 8191)] == [
        1, 1, 1, 2, 64, 128, 256, 2048, 2048]


def test_the_readme_city_gets_integer_and_string_bounds() -> None:
    from openai.lib._pydantic import to_strict_json_schema

    schema = to_strict_json_schema(City)
    before = copy.deepcopy(schema)
    assert bound_schema(schema, 64) == {
        "properties": {
            "name": {"title": "Name", "type": "string", "maxLength": 64},
            "population": {"title": "Population", "type": "integer", "minimum": -L,
                           "maximum": L}},
        "required": ["name", "population"], "title": "City", "type": "object",
        "additionalProperties": False}
    assert schema == before  # a new value: the input is not changed


def test_an_object_listing_its_properties_is_closed() -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    assert bound_schema(params, 8) == {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}
    # Extra properties the schema allows stay allowed, with bounded values.
    assert bound_schema({**params, "additionalProperties": True}, 8) == {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": ANY_REF, "$defs": {"disagg_any": _any(8)}}
    # A conditional may add properties: not closed.
    cond = {**params, "if": {"required": ["city"]}, "then": {"properties": {"zip": {}}}}
    assert "additionalProperties" not in bound_schema(cond, 8)


def test_json_object_and_open_values_are_bounded_at_every_depth() -> None:
    assert bound_schema({"type": "object"}, 16) == {
        "type": "object", "patternProperties": {key_pattern(16): ANY_REF},
        "additionalProperties": False, "$defs": {"disagg_any": _any(16)}}
    assert bound_schema(True, 16) == {**ANY_REF, "$defs": {"disagg_any": _any(16)}}
    assert bound_schema({"type": "array"}, 16) == {
        "type": "array", "items": ANY_REF, "$defs": {"disagg_any": _any(16)}}
    assert bound_schema(False, 16) is False
    # A map's values keep their schema (bounded); a required key longer than the bound
    # widens the key pattern.
    m = {"type": "object", "additionalProperties": {"type": "integer"},
         "required": ["a_rather_long_key_name"]}
    assert bound_schema(m, 4) == {
        "type": "object", "required": ["a_rather_long_key_name"],
        "patternProperties": {key_pattern(22): {"type": "integer", "minimum": -L,
                                                "maximum": L}},
        "additionalProperties": False}
    # Without a string bound: strings and keys stay open, numbers are bounded.
    assert bound_schema({"type": "object"}, None) == {
        "type": "object", "additionalProperties": ANY_REF,
        "$defs": {"disagg_any": _any(None)}}


@pytest.mark.parametrize("schema,added", [
    ({"type": "integer"}, {"minimum": -L, "maximum": L}),
    ({"type": "number"}, {"minimum": -L, "maximum": L, "multipleOf": FRACTION_STEP}),
    ({"type": "integer", "minimum": 0}, {"maximum": L}),
    ({"type": "number", "exclusiveMaximum": 5}, {"minimum": -L, "multipleOf": FRACTION_STEP}),
    ({"type": "number", "multipleOf": 0.5}, {"minimum": -L, "maximum": L}),
    # draft 4: a boolean exclusiveMinimum goes with minimum
    ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, {"maximum": L}),
    # an own bound beyond the default's other side: that side stays open
    ({"type": "integer", "minimum": 10**20}, {}),
    ({"type": "integer", "maximum": -10**20}, {}),
    ({"type": "string"}, {"maxLength": 32}),
    ({"type": "string", "maxLength": 5000}, {}),
    ({"type": "string", "minLength": 100}, {"maxLength": 100}),
    ({"type": "string", "format": "email"}, {}),
    ({"type": ["string", "null"]}, {"maxLength": 32}),
    ({"enum": ["a", 1]}, {}),
    ({"const": 10**30}, {}),
    ({"type": "boolean"}, {}),
])
def test_scalar_defaults_never_override_the_schemas_own(schema: dict[str, Any],
                                                        added: dict[str, Any]) -> None:
    assert bound_schema(schema, 32) == {**schema, **added}


def test_compositions_keep_their_own_bounds() -> None:
    # A bound on the node holds for its alternatives; a type above reaches them.
    opt = {"maxLength": 5000, "anyOf": [{"type": "string"}, {"type": "null"}]}
    assert bound_schema(opt, 8) == opt
    assert bound_schema({"anyOf": [{"type": "string"}, {"type": "integer"}]}, 8) == {
        "anyOf": [{"type": "string", "maxLength": 8},
                  {"type": "integer", "minimum": -L, "maximum": L}]}
    assert bound_schema({"type": "string", "oneOf": [{"pattern": "^a"}, {"pattern": "^b"}]},
                        8) == {"type": "string", "oneOf": [{"pattern": "^a", "maxLength": 8},
                                                           {"pattern": "^b", "maxLength": 8}]}
    # allOf members see each other's bounds and get no structure.
    both = {"allOf": [{"type": "string"}, {"maxLength": 5000}]}
    assert bound_schema(both, 8) == both
    assert bound_schema({"allOf": [{"type": "integer"}, {"minimum": 0}]}, 8) == {
        "allOf": [{"type": "integer", "maximum": L}, {"minimum": 0, "maximum": L}]}
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                        {"properties": {"b": {"type": "string"}}}]}
    assert bound_schema(merged, 8) == merged  # no member closed (each would refuse the other)
    # Then / else keep theirs; not / if / contains are left alone.
    cond = {"type": "string", "if": {"minLength": 2}, "then": {"maxLength": 900}}
    assert bound_schema(cond, 8) == cond
    neg = {"type": "array", "items": {"type": "integer"}, "contains": {"type": "string"},
           "not": {"type": "array", "maxItems": 0}}
    assert bound_schema(neg, 8) == {**neg, "items": {"type": "integer", "minimum": -L,
                                                     "maximum": L}}


def test_definitions_and_refs() -> None:
    class Inner(pydantic.BaseModel):
        note: str

    class Outer(pydantic.BaseModel):
        inner: Inner
        count: int = 0

    schema = Outer.model_json_schema()
    out = bound_schema(schema, 8)
    assert out["properties"]["inner"] == {"$ref": "#/$defs/Inner"}  # the definition has them
    assert out["$defs"]["Inner"]["properties"]["note"]["maxLength"] == 8
    assert out["$defs"]["Inner"]["additionalProperties"] is False
    assert out["properties"]["count"]["maximum"] == L
    # The shared definition's name does not take one the schema uses.
    taken = {"type": "array", "$defs": {"disagg_any": {"type": "string"}}}
    got = bound_schema(taken, 8)
    assert got["items"] == {"$ref": "#/$defs/disagg_any_"}
    assert got["$defs"]["disagg_any"] == {"type": "string", "maxLength": 8}
    # A nested $id changes what "#/$defs/..." means under it: open values stay open.
    nested = {"type": "object", "properties": {"x": {"$id": "http://e/x", "type": "array"}}}
    assert bound_schema(nested, 8) == {**nested, "additionalProperties": False}


def test_x_guidance_and_annotations_pass_through() -> None:
    schema = {"x-guidance": {"whitespace_flexible": True}, "type": "string", "title": "T",
              "default": "a very long default value", "examples": ["xxxxxxxxxxxx"]}
    assert bound_schema(schema, 4) == {**schema, "maxLength": 4}


def test_the_bound_travels_with_the_params() -> None:
    """max_tokens sets a JSON spec's string bound once; a context worker's one-token copy of
    the params keeps it (its grammar is the generation worker's)."""
    spec = GrammarSpec.json_schema({"type": "string"}, "response_format")
    params = SamplingParams(max_tokens=200, structured=spec)
    assert params.structured is not None and params.structured.string_bound == 64
    ctx = context_only_params(params)
    assert ctx.max_tokens == 1 and ctx.structured == params.structured
    regex = SamplingParams(max_tokens=200, structured=GrammarSpec("regex", "a+"))
    assert regex.structured is not None and regex.structured.string_bound is None


def test_without_max_tokens_the_bound_ignores_the_workers_kv_capacity() -> None:
    """A chat request without max_tokens decodes what the context and this worker's KV cache
    leave; its grammar's bound comes from the context alone, so workers with different KV
    capacities (a context and a generation worker) compile the same grammar."""
    from disagg.contracts.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_object"}})
    small = req.to_sampling_params(10, 2048, kv_capacity_tokens=100)
    large = req.to_sampling_params(10, 2048, kv_capacity_tokens=100_000)
    assert small.max_tokens == 90 and large.max_tokens == 2038
    assert small.structured == large.structured
    assert small.structured is not None and small.structured.string_bound == 512


_KEYS = ["type", "properties", "items", "prefixItems", "anyOf", "oneOf", "allOf", "$ref",
         "$defs", "additionalProperties", "required", "minimum", "maximum", "maxLength",
         "minLength", "enum", "const", "format", "then", "not", "$id", "x"]
_TYPE_NAMES = ["string", "integer", "number", "object", "array", "boolean", "null"]
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                     st.sampled_from(_TYPE_NAMES), st.text(max_size=4))
_SCHEMAS = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=3)), inner,
                    max_size=4)), max_leaves=24)


@given(_SCHEMAS, st.one_of(st.none(), st.integers(1, 4096)))
@settings(max_examples=300, derandomize=True, database=None, deadline=None)
def test_any_input_is_rewritten_without_error_or_change(schema: Any, bound: int | None) -> None:
    """Malformed schemas included: the rewrite never raises nor touches its input (the
    compiler then judges the result, and the schema as given when it refuses it)."""
    before = copy.deepcopy(schema)
    bound_schema(schema, bound)
    assert schema == before


# ---- compiled grammars (llguidance over the tiny tokenizer) ------------------------------------


@pytest.fixture(scope="module")
def grammars(model_dir: str) -> Any:
    from tokenizers import Tokenizer

    from disagg.structured.grammar import GrammarCache

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    return GrammarCache(tok, tok.get_vocab_size(), [0])


def _accepts(grammars: Any, spec: GrammarSpec, text: str) -> bool:
    m = grammars.matcher(spec)
    tok = grammars.lltokenizer()
    return m.replay(tok.tokenize_str(text)) and bool(m.ll.is_accepting())


def _spec(schema: Any, bound: int | None = 64) -> GrammarSpec:
    return GrammarSpec("json", json.dumps(schema), "response_format", bound)


def test_compiled_json_is_compact_unless_the_schema_says_otherwise(grammars: Any) -> None:
    city = _spec(City.model_json_schema())
    assert _accepts(grammars, city, '{"name":"Oslo","population":1}')
    for spaced in ('{"name": "Oslo","population":1}', '{ "name":"Oslo","population":1}',
                   '{"name":"Oslo","population":1 }', '{"name":"Oslo",\n"population":1}'):
        assert not _accepts(grammars, city, spaced), spaced
    assert _accepts(grammars, city, '{"name":"Os lo","population":1}')  # inside a string
    # A schema's own x-guidance wins (llguidance's order: defaults, then the schema's).
    flexible = _spec({**City.model_json_schema(), "x-guidance": {"whitespace_flexible": True}})
    assert _accepts(grammars, flexible, '{ "name" : "Oslo",\n  "population": 1 }')
    assert _accepts(grammars, _spec({"type": "object"}), '{"a":[1,{"b":null}],"c":"d"}')
    assert not _accepts(grammars, _spec({"type": "object"}), '{"a": 1}')


def test_compiled_bounds_and_the_schemas_own(grammars: Any) -> None:
    n = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert _accepts(grammars, _spec(n), '{"n":-9007199254740991}')
    assert not _accepts(grammars, _spec(n), '{"n":9007199254740992}')
    own = {**n, "properties": {"n": {"type": "integer", "maximum": 10**18}}}
    assert _accepts(grammars, _spec(own), '{"n":999999999999999999}')
    x = {"type": "number"}
    assert _accepts(grammars, _spec(x), "-12.0123456789")
    assert not _accepts(grammars, _spec(x), "0.01234567891")
    assert not _accepts(grammars, _spec(x), "1e5")
    s = {"type": "string"}
    assert _accepts(grammars, _spec(s, 8), '"12345678"')
    assert not _accepts(grammars, _spec(s, 8), '"123456789"')
    assert _accepts(grammars, _spec(s, None), '"' + "x" * 500 + '"')
    assert _accepts(grammars, _spec({"type": "string", "maxLength": 20}, 8), '"' + "y" * 20 + '"')
    free = {"type": "object"}
    assert not _accepts(grammars, _spec(free, 4), '{"abcde":1}')
    assert not _accepts(grammars, _spec(free, 4), '{"a":"abcde"}')
    assert _accepts(grammars, _spec(free, 4), '{"abcd":["abcd",{"e":0.5}]}')


def test_a_bounded_form_llguidance_refuses_falls_back_to_the_schema(grammars: Any) -> None:
    # A pattern needing more characters than the default bound: bounded, it would be empty.
    digits = {"type": "string", "pattern": "^[0-9]{12}$"}
    assert _accepts(grammars, _spec(digits, 4), '"123456789012"')
    # A schema that is wrong as given is still the request's error.
    with pytest.raises(StructuredSpecError, match="^response_format: invalid json"):
        grammars.compile(_spec({"type": "string", "minLength": 3, "maxLength": 2}))


# ---- the tiny model (random weights) through the offline engine -------------------------------


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[Any]:
    from disagg import LLM

    with LLM(model_dir, max_model_len=1024, kv_cache_tokens=16384, max_batch_size=32) as llm:
        yield llm


def _outside_strings(text: str) -> str:
    """``text`` (JSON) without the contents of its strings."""
    out, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                out.append(ch)
        else:
            out.append(ch)
            in_str = ch == '"'
    return "".join(out)


def _generate(llm: Any, prompt: str, spec: GrammarSpec, max_tokens: int,
              seeds: int = 8) -> list[Any]:
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, structured=spec)
              for s in range(seeds)]
    return [o.outputs[0] for o in llm.generate([prompt] * seeds, params)]


def test_forced_and_schema_outputs_are_compact_and_complete(llm: Any) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    specs = {"tool_choice": T.forced_spec(T.resolve(tools, "required", None)),
             "json_schema": GrammarSpec.json_schema(City.model_json_schema(), "x"),
             "json_object": GrammarSpec.json_schema({"type": "object"}, "x")}
    for name, spec in specs.items():
        assert spec is not None
        for c in _generate(llm, "Oslo?", spec, 200):
            assert c.finish_reason == "stop", (name, c.text)
            json.loads(c.text)
            skeleton = _outside_strings(c.text)
            assert not any(ch.isspace() for ch in skeleton), (name, c.text)
    # the forced call's arguments parse against the tool's schema (no extra properties)
    for c in _generate(llm, "Oslo?", specs["tool_choice"], 200):
        for call in json.loads(c.text):
            assert list(call["parameters"]) == ["city"]


def test_the_tiny_model_ends_within_the_default_bounds(llm: Any) -> None:
    """Random weights rarely close a string or a number: they run to the bound, which ends
    them (with max_tokens 120 the string bound is 32 characters)."""
    schema = {"type": "object", "properties": {"s": {"type": "string"},
                                               "n": {"type": "integer"}},
              "required": ["s", "n"]}
    outs = _generate(llm, "Go", GrammarSpec.json_schema(schema, "x"), 120)
    values = [json.loads(c.text) for c in outs if c.finish_reason == "stop"]
    assert len(values) == len(outs)
    lengths = [len(v["s"]) for v in values]
    digits = [len(str(abs(v["n"]))) for v in values]
    assert max(lengths) == 32 and max(digits) == 16, (lengths, digits)
    assert all(abs(v["n"]) <= INT_LIMIT for v in values)


def test_the_schemas_own_bounds_win_on_the_tiny_model(llm: Any) -> None:
    schema = {"type": "object", "required": ["s", "n"], "properties": {
        "s": {"type": "string", "maxLength": 60},
        "n": {"type": "integer", "minimum": 0, "maximum": 10**18}}}
    outs = _generate(llm, "Go", GrammarSpec.json_schema(schema, "x"), 120)
    values = [json.loads(c.text) for c in outs if c.finish_reason == "stop"]
    assert len(values) == len(outs)
    lengths = [len(v["s"]) for v in values]
    digits = [len(str(v["n"])) for v in values]
    assert 32 < max(lengths) <= 60 and 16 < max(digits) <= 19, (lengths, digits)
