"""disaggregated_params validation and round trip."""

from __future__ import annotations

import pytest

from disagg.contracts.params import ContextParams, DisaggParamsError
from disagg.layout import RankLayout, WorkerLayout


def sample() -> ContextParams:
    layout = WorkerLayout(1, 1, 2, 2, 8, 4, "float32", (RankLayout(0, 0, 0, (0, 2), (0, 2)),))
    return ContextParams(
        ctx_request_id="cmpl-1", first_gen_tokens=[7], prompt_token_ids=[1, 2, 3, 4, 5],
        worker_id="w1", backend="TCP", addresses=["127.0.0.1:5000"], block_ids=[3, 1],
        num_tokens=5, layout=layout, lease_expiry=1.5e9, first_gen_logprobs=[{7: -0.5}],
    )


def test_round_trip():
    p = sample()
    assert ContextParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("field,value,message", [
    ("first_gen_tokens", [], "first_gen_tokens: must not be empty"),
    ("first_gen_tokens", ["a"], "first_gen_tokens: must be a list"),
    ("backend", "rdma", "backend: must be UCX or TCP"),
    ("addresses", [], "addresses: one host:port per rank"),
    ("num_tokens", 4, "num_tokens: must equal"),
    ("block_ids", [3], "block_ids: too few blocks"),
    ("layout", {"tp_size": 1}, "layout: layout: malformed"),
    ("lease_expiry", "soon", "lease_expiry: wrong type"),
    ("first_gen_logprobs", [3], "first_gen_logprobs: malformed"),
])
def test_bad_fields_are_named(field, value, message):
    d = sample().to_dict()
    d[field] = value
    with pytest.raises(DisaggParamsError, match=message):
        ContextParams.from_dict(d)


def test_missing_field_and_prompt_from_body():
    d = sample().to_dict()
    del d["ctx_request_id"]
    with pytest.raises(DisaggParamsError, match="ctx_request_id: missing"):
        ContextParams.from_dict(d)
    d = sample().to_dict()
    del d["prompt_token_ids"]
    assert ContextParams.from_dict(d, prompt_token_ids=[1, 2, 3, 4, 5]).num_tokens == 5
    with pytest.raises(DisaggParamsError, match="must be an object"):
        ContextParams.from_dict([1])
