"""The router's hot-path JSON (``router/replies.py``): orjson with json's fallbacks, and the
params added to a client's bytes."""

from __future__ import annotations

import json

import pytest

from disagg.router.replies import dumps, loads, with_fields, with_params


def test_dumps_is_compact_and_falls_back_where_orjson_refuses() -> None:
    assert dumps({"a": [1, "é"], "b": None}) == '{"a":[1,"é"],"b":null}'.encode()
    assert dumps({"n": 2**70}) == b'{"n":1180591620717411303424}'  # beyond 64 bits
    assert dumps({1: "x"}) == b'{"1":"x"}'  # a key that is not a string
    assert json.loads(dumps({"s": "\ud800"})) == {"s": "\ud800"}  # a lone surrogate


def test_loads_reads_what_python_s_json_writes() -> None:
    assert loads(b'{"lp":[-1.5,2]}') == {"lp": [-1.5, 2]}
    assert loads(b'{"lp":-Infinity}') == {"lp": float("-inf")}  # json.dumps writes it
    with pytest.raises(ValueError):
        loads(b"{not json")


@pytest.mark.parametrize(("raw", "spliced"), [
    (b'{"a":1}', True), (b'{ "a": 1 }\r\n', True), (b"{}", False),
    (b'{"disaggregated_params":null,"a":1}', False),
    ('{"a":"\u00e9"}'.encode("utf-16"), False), ('{"a":"\u00e9"}'.encode("utf-16-le"), False),
    ('{"a":"\u00e9"}'.encode("utf-32"), False), (b'\xef\xbb\xbf{"a":1}', False),
])
def test_with_params_adds_the_member_to_the_client_s_bytes(raw: bytes, spliced: bool) -> None:
    body = json.loads(raw)
    params = {"request_type": "context_only"}
    out = with_params(raw, body, params)
    assert json.loads(out) == {**body, "disaggregated_params": params}
    if spliced:  # the client's bytes up to the closing brace, untouched
        assert out.startswith(raw.rstrip()[:-1])
    assert with_params(raw, body, params, b'{"request_type":"x"}') == (
        out if not spliced else out.replace(b"context_only", b"x"))


@pytest.mark.parametrize(("raw", "spliced"), [
    (b'{"a":1}', True), (b'{ "a": 1 }\n', True), (b"{}", False),
    (b'{"kv_prefix":null,"a":1}', False), (b'\xef\xbb\xbf{"a":1}', False),
])
def test_with_fields_adds_each_member_to_the_client_s_bytes(raw: bytes, spliced: bool) -> None:
    """The context call with a peer's prefix lease: two members at once."""
    body = json.loads(raw.decode("utf-8-sig"))
    fields = {"disaggregated_params": {"request_type": "context_only"},
              "kv_prefix": {"ctx_request_id": "prefix-1", "num_tokens": 64}}
    out = with_fields(raw, body, fields)
    assert json.loads(out) == {**body, **fields}
    if spliced:
        assert out.startswith(raw.rstrip()[:-1])
        assert out == with_params(raw, body, fields["disaggregated_params"])[:-1] + (
            b',"kv_prefix":' + dumps(fields["kv_prefix"]) + b"}")
