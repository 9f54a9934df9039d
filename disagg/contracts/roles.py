"""The words of the cluster protocol, defined once: worker roles and disaggregated request types.

Both are ``str`` enums: a member equals its wire value (``Role.CONTEXT == "context"``), so JSON,
YAML and command-line values compare and serialise as they are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(str, enum.Enum):
    """What a worker serves. Every role serves ordinary requests; ``context`` also prefills
    ``context_only`` requests and leases their KV, ``generation`` also decodes
    ``generation_only`` requests whose KV it pulls from a context worker."""

    AGGREGATED = "aggregated"
    CONTEXT = "context"
    GENERATION = "generation"

    def __str__(self) -> str:
        return self.value

    @property
    def disaggregated(self) -> bool:
        """True for the two roles that move KV (context, generation)."""
        return self is not Role.AGGREGATED


class RequestType(str, enum.Enum):
    """``disaggregated_params.request_type`` of a request sent to a worker."""

    CONTEXT_ONLY = "context_only"  # prefill, keep the KV under a lease, answer its params
    GENERATION_ONLY = "generation_only"  # pull the KV named in the params, then decode
    CONTEXT_AND_GENERATION = "context_and_generation"  # an ordinary request

    def __str__(self) -> str:
        return self.value

    @property
    def needs_role(self) -> Role | None:
        """The worker role this request type needs (None: any)."""
        return {RequestType.CONTEXT_ONLY: Role.CONTEXT,
                RequestType.GENERATION_ONLY: Role.GENERATION}.get(self)


ROLES = tuple(r.value for r in Role)
REQUEST_TYPES = tuple(t.value for t in RequestType)


@dataclass(frozen=True)
class RoleDrain:
    """What a worker switching away from its role still holds of it (``engine.role_drain``):
    context leases not yet read, released or expired (on any rank), requests of the old role's
    type still running, and KV pulls in flight. The switch happens when all are zero."""

    leases: int = 0
    requests: int = 0
    pulls: int = 0

    @property
    def done(self) -> bool:
        return not (self.leases or self.requests or self.pulls)

    def to_dict(self) -> dict[str, int]:
        return {"leases": self.leases, "requests": self.requests, "pulls": self.pulls}
