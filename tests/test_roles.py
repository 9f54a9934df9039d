from disagg.contracts.roles import REQUEST_TYPES, ROLES, RequestType, Role


def test_roles_and_request_types_are_their_wire_values() -> None:
    assert Role("context") is Role.CONTEXT and Role.CONTEXT == "context"
    assert f"{Role.GENERATION}" == "generation" and str(RequestType.CONTEXT_ONLY) == "context_only"
    assert ROLES == ("aggregated", "context", "generation")
    assert REQUEST_TYPES == ("context_only", "generation_only", "context_and_generation")
    assert not Role.AGGREGATED.disaggregated and Role.CONTEXT.disaggregated
    assert RequestType.GENERATION_ONLY.needs_role is Role.GENERATION
    assert RequestType.CONTEXT_AND_GENERATION.needs_role is None
