"""What the router answers its client with when it does not relay a worker's answer: ``Reply``
(an error of its own, or a worker's error passed through), in OpenAI's error JSON shape."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from disagg.router.client_io import Answer
from disagg.server import protocol as P


def dumps(obj: Any) -> bytes:
    """Compact JSON, as the router sends it."""
    return json.dumps(obj, separators=(",", ":")).encode()


class Reply(Exception):
    """Answer the client with this (an error, ours or a worker's passed through).
    ``outcome``: the request's label in ``disagg_router_requests_total``."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json",
                 outcome: str = "client_error", close: bool = False) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.outcome = outcome
        self.close = close  # the request body was not read: the connection cannot be reused

    @classmethod
    def error(cls, status: int, message: str, type: str = "invalid_request_error",
              param: str | None = None, code: str | None = None,
              outcome: str | None = None, close: bool = False) -> Reply:
        return cls(status, dumps(P.error_body(message, type, param, code)),
                   outcome=outcome or ("client_error" if status < 500 else "upstream_error"),
                   close=close)

    @classmethod
    def from_api_error(cls, e: P.APIError, close: bool = False) -> Reply:
        return cls(e.status, dumps(e.body()), close=close,
                   outcome="client_error" if e.status < 500 else "upstream_error")

    def answer(self) -> Answer:
        return Answer(self.status, self.body, self.content_type, close=self.close)

    def response(self) -> web.Response:
        resp = web.Response(status=self.status, body=self.body, content_type=self.content_type)
        if self.close:
            resp.force_close()
        return resp
