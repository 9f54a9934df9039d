"""Who may call what on a worker (the README's "Security model").

- ``/v1/*``: the API key, when one is set (``Authorization: Bearer <key>``);
- ``/server_info``, ``/kv_events``: a cluster signature (``cluster_auth.sign_http``) or the API
  key; open on a worker with neither (``build_app`` warns at start);
- ``/metrics``: the API key or a signature when an API key is set, unless ``public_metrics``;
- ``/kv_leases/release``: a signature.

A ``generation_only`` request pulls KV only from addresses it may trust: the request is signed
by the cluster, or every host is in ``kv_peer_allowlist``. Only KV pulled for a signed request
may enter the prefix cache (anyone else could send KV that does not belong to its prompt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from disagg.cluster_auth import AUTH_HEADER, AuthError, HttpVerifier, PeerAllowlist, bearer_ok
from disagg.contracts import protocol as P

if TYPE_CHECKING:
    from disagg.kv_connector.settings import DisaggSettings


def request_target(request: Request) -> str:
    """The path and query exactly as the client sent them (what a cluster signature covers)."""
    scope = request.scope
    raw = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    target = raw.decode("latin-1")
    return f"{target}?{query.decode('latin-1')}" if query else target


class Access:
    """The access checks of one worker: its API key, the cluster token's verifier and the
    hosts it may pull KV from. ``transfer_settings``: the engine's KV transfer settings (a
    context / generation worker's token and allowlist), or None."""

    def __init__(self, api_key: str | None, cluster_token: str | None, public_metrics: bool,
                 transfer_settings: DisaggSettings | None = None) -> None:
        self.api_key = api_key
        self.public_metrics = public_metrics
        token = cluster_token or (transfer_settings.cluster_token if transfer_settings else None)
        self.verifier = HttpVerifier(token) if token else None
        self.peer_allowlist: PeerAllowlist = (
            transfer_settings.kv_peer_allowlist if transfer_settings else PeerAllowlist())

    @property
    def wide_open(self) -> bool:
        """No API key and no cluster token: the internal endpoints answer anyone."""
        return self.verifier is None and not self.api_key

    def check_api_key(self, request: Request) -> None:
        """401 unless the request carries the API key (when one is set)."""
        if self.api_key and not self._api_key_ok(request):
            raise P.APIError(401, "invalid or missing API key (send 'Authorization: Bearer "
                             "<key>')", code="invalid_api_key")

    def _api_key_ok(self, request: Request) -> bool:
        return bearer_ok(request.headers.get("authorization", ""), self.api_key)

    def signature_error(self, request: Request, body: bytes) -> str | None:
        """Why ``request`` is not signed by the cluster (None: it is). Checked once per
        request: a signature's nonce is spent by its first check."""
        state = request.state
        if not hasattr(state, "cluster_auth_error"):
            if self.verifier is None:
                why: str | None = "this worker has no cluster token"
            else:
                try:
                    self.verifier.check(request.headers.get(AUTH_HEADER), request.method,
                                        request_target(request), body)
                    why = None
                except AuthError as e:
                    why = str(e)
            state.cluster_auth_error = why
        return state.cluster_auth_error

    def is_signed(self, request: Request, body: bytes) -> bool:
        return self.signature_error(request, body) is None

    def check_signed(self, request: Request, body: bytes, endpoint: str) -> None:
        """401 (naming ``endpoint``) unless ``request`` with ``body`` is signed by the
        cluster."""
        why = self.signature_error(request, body)
        if why is not None:
            raise P.APIError(401, f"{endpoint}: needs a cluster signature "
                             f"({AUTH_HEADER}): {why}", type="authentication_error",
                             code="unauthorized")

    def check_cluster_access(self, request: Request) -> None:
        """401 unless a bodiless request (GET) is signed by the cluster or carries the API
        key."""
        if self._api_key_ok(request):
            return
        why = self.signature_error(request, b"")
        if why is None:
            return
        alt = " or the API key ('Authorization: Bearer <key>')" if self.api_key else ""
        raise P.APIError(401, f"{request.url.path}: needs a cluster signature "
                         f"({AUTH_HEADER}){alt}: {why}", type="authentication_error",
                         code="unauthorized")

    def check_internal_access(self, request: Request) -> None:
        """/server_info, /kv_events: a signature or the API key; open on a worker with
        neither (it warned at start)."""
        if not self.wide_open:
            self.check_cluster_access(request)

    def check_metrics_access(self, request: Request) -> None:
        if self.public_metrics or not self.api_key:
            return
        self.check_cluster_access(request)

    def trusts_addresses(self, request: Request, body: bytes, addresses: list[str]) -> bool:
        """May this worker connect to ``addresses`` for ``request``: the request is signed by
        the cluster, or every host is in ``kv_peer_allowlist``."""
        return self.is_signed(request, body) or (
            bool(addresses) and self.peer_allowlist.first_denied(addresses) is None)
