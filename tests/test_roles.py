import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from disagg.contracts.kv_mode import LOCAL, ContextOnly, ContextStream, Dummy, Local, Pull
from disagg.contracts.roles import REQUEST_TYPES, ROLES, RequestType, Role


def test_roles_and_request_types_are_their_wire_values() -> None:
    assert Role("context") is Role.CONTEXT and Role.CONTEXT == "context"
    assert f"{Role.GENERATION}" == "generation" and str(RequestType.CONTEXT_ONLY) == "context_only"
    assert ROLES == ("aggregated", "context", "generation")
    assert REQUEST_TYPES == ("context_only", "generation_only", "context_and_generation")
    assert not Role.AGGREGATED.disaggregated and Role.CONTEXT.disaggregated
    assert RequestType.GENERATION_ONLY.needs_role is Role.GENERATION
    assert RequestType.CONTEXT_AND_GENERATION.needs_role is None


def test_each_kv_mode_needs_the_role_of_its_request_type() -> None:
    params: Any = SimpleNamespace(ctx_request_id="c")  # stands in for a ContextParams
    modes = [(LOCAL, RequestType.CONTEXT_AND_GENERATION),
             (ContextOnly(), RequestType.CONTEXT_ONLY),
             (ContextStream(7, "ab"), RequestType.CONTEXT_ONLY),
             (Pull(params, trusted=True), RequestType.GENERATION_ONLY),
             (Dummy(), RequestType.GENERATION_ONLY)]
    for mode, kind in modes:
        assert mode.needs_role is kind.needs_role, mode
        assert mode.is_context is (kind is RequestType.CONTEXT_ONLY), mode
    assert LOCAL == Local() and Pull(params, trusted=False) != Pull(params, trusted=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ContextStream(7, "ab").num_tokens = 8  # type: ignore[misc]
    with pytest.raises(TypeError):  # trust is always decided
        Pull(params)  # type: ignore[call-arg]
