"""The KV transfer handshake: mutual challenge-response over the cluster token (torch-free).

The token never crosses the wire (``base.py`` draws the protocol). Per connection:

- the client sends a fresh ``client_nonce``; the server answers with a fresh ``server_nonce``
  and ``proof = H("server", client_nonce, server_nonce, server_id, backend)``. The client
  checks it before it sends anything else, so a peer without the token learns nothing but a
  random nonce;
- every client request (the first is ``AUTH``) carries
  ``proof = H("request", server_nonce, client_nonce, seq, canonical(header without proof))``
  with ``seq`` = 0, 1, 2, ... on this connection: a captured request is worthless on any other
  connection (another server nonce) and on its own (the sequence number has moved on).

``H(...)`` is ``cluster_auth.hmac_hex(token, "disagg-kv-v1", ...)``; proofs are compared in
constant time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from disagg.cluster_auth import hmac_finish, hmac_hex, hmac_prefix, new_nonce, proofs_equal

PROTOCOL_VERSION = 1
_DOMAIN = "disagg-kv-v1"
NONCE_HEX_CHARS = 32
# One encoder for every signed header (json.dumps with options builds a new one per call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


class HandshakeError(Exception):
    """A handshake step failed; ``code`` is a server error code (base.py)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def canonical(header: Mapping[str, Any]) -> str:
    """The signed form of a header: sorted keys, no spaces, ASCII, without ``proof``."""
    body = {k: v for k, v in header.items() if k != "proof"}
    return _CANONICAL.encode(body)


def valid_nonce(value: object) -> bool:
    return (isinstance(value, str) and len(value) == NONCE_HEX_CHARS
            and all(c in "0123456789abcdef" for c in value))


def server_proof(token: str, client_nonce: str, server_nonce: str, server_id: str,
                 backend: str) -> str:
    return hmac_hex(token, _DOMAIN, "server", client_nonce, server_nonce, server_id, backend)


def request_proof(token: str, server_nonce: str, client_nonce: str, seq: int,
                  header: Mapping[str, Any]) -> str:
    return hmac_hex(token, _DOMAIN, "request", server_nonce, client_nonce, str(seq),
                    canonical(header))


def _request_prefix(token: str, server_nonce: str, client_nonce: str) -> Any:
    """``request_proof``'s HMAC state after the parts one connection's proofs share (fed once
    per connection; ``hmac_finish`` of it with the seq and header is ``request_proof``)."""
    return hmac_prefix(token, _DOMAIN, "request", server_nonce, client_nonce)


class ClientSession:
    """The client's side of one connection: ``hello()``, ``accept(answer)``, then ``sign``
    each request in order."""

    def __init__(self, token: str) -> None:
        self._token = token
        self.client_nonce = new_nonce()
        self.server_nonce: str | None = None
        self.server_id: str | None = None
        self.backend: str | None = None
        self._seq = 0
        self._mac: Any = None  # request_proof's state for this connection, once accepted

    def hello(self) -> dict[str, Any]:
        return {"op": "HELLO", "version": PROTOCOL_VERSION, "client_nonce": self.client_nonce}

    def accept(self, answer: Mapping[str, Any]) -> None:
        """Check the server's HELLO answer; raises ``HandshakeError`` (``unauthorized`` when
        the proof is missing or wrong)."""
        nonce, server_id, backend = (answer.get("server_nonce"), answer.get("server_id"),
                                     answer.get("backend"))
        if answer.get("version") != PROTOCOL_VERSION:
            raise HandshakeError("protocol_error",
                                 f"server speaks version {answer.get('version')!r}, this "
                                 f"client {PROTOCOL_VERSION}")
        if not valid_nonce(nonce) or not isinstance(server_id, str) or not isinstance(
                backend, str):
            raise HandshakeError("protocol_error", "malformed HELLO answer")
        expected = server_proof(self._token, self.client_nonce, nonce, server_id, backend)
        if not proofs_equal(answer.get("proof"), expected):
            raise HandshakeError("unauthorized", "the server did not prove that it holds the "
                                 "cluster token (another cluster's token, or not a disagg KV "
                                 "transfer server)")
        self.server_nonce, self.server_id, self.backend = nonce, server_id, backend
        self._mac = _request_prefix(self._token, nonce, self.client_nonce)

    def sign(self, header: Mapping[str, Any]) -> dict[str, Any]:
        """``header`` plus its proof; consumes one sequence number."""
        return {**header, "proof": self.sign_canonical(header)[1]}

    def sign_canonical(self, header: Mapping[str, Any]) -> tuple[str, str]:
        """``header``'s canonical JSON and its proof (``base.encode_signed`` makes the wire
        header of them: one JSON encoding, not two); consumes one sequence number."""
        if self._mac is None:
            raise RuntimeError("sign() before the server was accepted")
        body = canonical(header)
        proof = hmac_finish(self._mac, str(self._seq), body)
        self._seq += 1
        return body, proof


class ServerSession:
    """The server's side of one connection: ``answer_hello(msg)``, then ``verify`` each
    request in order."""

    def __init__(self, token: str, server_id: str, backend: str) -> None:
        self._token = token
        self.server_id = server_id
        self.backend = backend
        self.server_nonce = new_nonce()
        self.client_nonce: str | None = None
        self._seq = 0
        self._mac: Any = None  # request_proof's state for this connection, after HELLO

    def answer_hello(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        """The answer to a client's first header; raises ``HandshakeError``."""
        if msg.get("op") != "HELLO":
            raise HandshakeError("unauthorized", "a connection starts with HELLO (the "
                                 "cluster token is proven, never sent)")
        if msg.get("version") != PROTOCOL_VERSION:
            raise HandshakeError("bad_request", f"HELLO version {msg.get('version')!r} is "
                                 f"not supported (this server speaks {PROTOCOL_VERSION})")
        nonce = msg.get("client_nonce")
        if not valid_nonce(nonce):
            raise HandshakeError("bad_request", f"HELLO client_nonce must be "
                                 f"{NONCE_HEX_CHARS} lowercase hex digits")
        assert isinstance(nonce, str)
        self.client_nonce = nonce
        self._mac = _request_prefix(self._token, self.server_nonce, nonce)
        return {"ok": True, "version": PROTOCOL_VERSION, "server_nonce": self.server_nonce,
                "server_id": self.server_id, "backend": self.backend,
                "proof": server_proof(self._token, nonce, self.server_nonce, self.server_id,
                                      self.backend)}

    def verify(self, msg: Mapping[str, Any]) -> bool:
        """Whether ``msg`` carries the proof for the next sequence number (constant time).
        Consumes the number either way: the caller hangs up after a False."""
        if self._mac is None:
            return False
        expected = hmac_finish(self._mac, str(self._seq), canonical(msg))
        self._seq += 1
        return proofs_equal(msg.get("proof"), expected)
