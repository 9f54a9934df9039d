"""What the router answers its client with when it does not relay a worker's answer: ``Reply``
(an error of its own, or a worker's error passed through), in OpenAI's error JSON shape; and
the JSON it writes and reads on its hot path (``dumps``, ``loads``, ``with_params``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from disagg.contracts import protocol as P
from disagg.router.client_io import Answer


def dumps(obj: Any) -> bytes:
    """Compact JSON, as the router sends it: orjson's (~5x json's speed on a context answer's
    params), json's for what orjson refuses (integers beyond 64 bits, keys that are not
    strings, lone surrogates)."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # (orjson.JSONEncodeError is one)
        return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """A worker's JSON answer: orjson's parse, json's for what orjson refuses (NaN, Infinity:
    not JSON, but Python's json writes them); ``ValueError`` when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


# ``Retry-After`` of the router's own 503s (no healthy worker): the workers' own for a full
# queue (``server.engine_errors.RETRY_AFTER_S``). Such a 503 costs the router no worker call,
# and a worker taken out after a failed request is back at its next passing health check
# (every ``health_check_interval_sec``, 2 s by default), a registering one at once: a client
# waiting a second retries about when the answer can have changed, and not much later.
RETRY_AFTER_S = 1
_MAX_RETRY_AFTER = 64  # longest value passed on from a worker (an HTTP-date is 29 characters)


def retry_after(value: str) -> dict[str, str] | None:
    """``{"Retry-After": value}`` for a worker's header that is safe to pass on (delta-seconds
    or an HTTP-date: printable ASCII), else None (dropped)."""
    if value and len(value) <= _MAX_RETRY_AFTER and value.isascii() and value.isprintable():
        return {"Retry-After": value}
    return None


PARAMS_KEY = "disaggregated_params"
# Members of a worker request that only the router sets (a client's is refused: the router
# signs some requests, and a worker trusts what a signed request names). kv_prefix: a peer's
# prefix lease (KV prefix reuse across workers, ``flow``).
ROUTER_SET = (PARAMS_KEY, "kv_prefix")
_KEY_PART = b'"disaggregated_params":'
UTF8_BOM = b"\xef\xbb\xbf"


def with_params(data: bytes, body: Mapping[str, Any], params: Mapping[str, Any],
                encoded: bytes | None = None) -> bytes:
    """The request ``data`` (the JSON object ``body``, as bytes) with ``disaggregated_params:
    params`` added. The member goes in before the object's closing brace, the client's bytes
    otherwise as they came (the request is not encoded again: that took more of the router's
    time than the rest of a disaggregated request's JSON); ``body`` is encoded instead when
    that cannot be done safely (an empty object, a body that has the key already, UTF-16/32 or
    a byte order mark). ``encoded``: ``dumps(params)`` when the caller has it already::

        data:   {"model":"m","prompt":"Hi"}   \n
                                          ^ last "}" (whitespace after it dropped)
        result: {"model":"m","prompt":"Hi","disaggregated_params":{...}}
    """
    end = data.rfind(b"}")
    # (UTF-16/32 JSON has a NUL among its first 4 bytes; json.detect_encoding's rule)
    if (end < 0 or not body or PARAMS_KEY in body or data[end + 1:].strip()
            or b"\0" in data[:4] or data.startswith(UTF8_BOM)):
        return dumps({**body, PARAMS_KEY: params})
    return b"%s,%s%s}" % (data[:end], _KEY_PART, dumps(params) if encoded is None else encoded)


def with_fields(data: bytes, body: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """``data`` (the JSON object ``body``, as bytes) with the top-level members ``fields``
    added, as ``with_params`` adds its one (``body`` encoded instead when that cannot be done
    safely, or when it has one of the keys already)."""
    end = data.rfind(b"}")
    if (end < 0 or not body or any(k in body for k in fields) or data[end + 1:].strip()
            or b"\0" in data[:4] or data.startswith(UTF8_BOM)):
        return dumps({**body, **fields})
    members = b"".join(b",%s:%s" % (dumps(k), dumps(v)) for k, v in fields.items())
    return b"%s%s}" % (data[:end], members)


class Reply(Exception):
    """Answer the client with this (an error, ours or a worker's passed through).
    ``outcome``: the request's label in ``disagg_router_requests_total``; ``headers``: more
    headers of the answer (a worker's ``Retry-After`` passed on)."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json",
                 outcome: str = "client_error", close: bool = False,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.outcome = outcome
        self.close = close  # the request body was not read: the connection cannot be reused
        self.headers = headers

    @classmethod
    def error(cls, status: int, message: str, type: str = "invalid_request_error",
              param: str | None = None, code: str | None = None,
              outcome: str | None = None, close: bool = False) -> Reply:
        """The router's own error; a 503 tells the client when to retry (``RETRY_AFTER_S``)."""
        return cls(status, dumps(P.error_body(message, type, param, code)),
                   outcome=outcome or ("client_error" if status < 500 else "upstream_error"),
                   close=close,
                   headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None)

    @classmethod
    def from_api_error(cls, e: P.APIError, close: bool = False) -> Reply:
        return cls(e.status, dumps(e.body()), close=close,
                   outcome="client_error" if e.status < 500 else "upstream_error",
                   headers=e.headers or None)

    def answer(self) -> Answer:
        return Answer(self.status, self.body, self.content_type, close=self.close,
                      headers=self.headers)

    def response(self) -> web.Response:
        resp = web.Response(status=self.status, body=self.body, content_type=self.content_type,
                            headers=self.headers)
        if self.close:
            resp.force_close()
        return resp


def parse_body(raw: bytes) -> dict[str, Any]:
    """A client's JSON object (400 when it is not one, or sets what only the router sets)."""
    try:  # the workers' parser: also refuses NaN, deep nesting, lone surrogates
        body = P.parse_json_object(raw)
    except P.APIError as e:
        raise Reply.from_api_error(e) from None
    for key in ROUTER_SET:
        if body.get(key) is not None:
            raise Reply.error(400, f"{key}: set by the router, not by clients", param=key)
    return body
