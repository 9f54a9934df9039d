"""Which worker role serves which disaggregated request type (``disagg_requests.request_type``),
without an engine: the checks come before the engine sees the request."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from disagg.contracts import protocol as P
from disagg.contracts.roles import RequestType, Role
from disagg.server.disagg_requests import request_type


def _req(request_type: Any, **extra: Any) -> Any:
    body = {"model": "m", "prompt": "hi", "disaggregated_params": {"request_type": request_type},
            **extra}
    return P.parse_request(P.CompletionRequest, json.dumps(body).encode())


def _srv(role: Role) -> Any:
    return SimpleNamespace(role=role, transfer=None if role is Role.AGGREGATED else object())


def test_each_type_needs_its_role() -> None:
    assert request_type(_srv(Role.CONTEXT), _req("context_only"), 1) is RequestType.CONTEXT_ONLY
    assert request_type(_srv(Role.GENERATION), _req("generation_only"), 1) is (
        RequestType.GENERATION_ONLY)
    for role in Role:  # an ordinary request, however it is written
        assert request_type(_srv(role), _req("context_and_generation"), 1) is None
    with pytest.raises(P.APIError) as e:
        request_type(_srv(Role.AGGREGATED), _req("context_only"), 1)
    assert e.value.message == ("disaggregated_params.request_type: 'context_only' requests "
                               "need a context worker; this worker's role is 'aggregated'")
    with pytest.raises(P.APIError, match="^n: a generation_only request has exactly one"):
        request_type(_srv(Role.GENERATION), _req("generation_only", n=2), 1)
    # The client's request as sent (its stream checked as the generation worker will check
    # it); the context answer is whole all the same (respond).
    assert request_type(_srv(Role.CONTEXT), _req("context_only", stream=True), 1) is (
        RequestType.CONTEXT_ONLY)


@pytest.mark.parametrize("kind", ["prefill", 5, ["context_only"]])
def test_an_unknown_type_is_a_400_naming_it(kind: Any) -> None:
    with pytest.raises(P.APIError) as e:  # (a generation worker's message, as before)
        request_type(_srv(Role.AGGREGATED), _req(kind), 1)
    assert e.value.status == 400 and "need a generation worker" in e.value.message
    with pytest.raises(P.APIError) as e:
        request_type(_srv(Role.GENERATION), _req(kind), 1)
    assert e.value.status == 400 and "request_type: must be one of" in e.value.message
