"""CORS, opt-in (``allowed_origins``), one policy for the workers (``server/cors.py``, an ASGI
middleware) and the router (``router/cors.py``, aiohttp's server and the router's own).

Without allowed origins no answer carries a CORS header. A request whose ``Origin`` is allowed
gets ``Access-Control-Allow-Origin`` on its answer (the origin itself, with ``Vary: Origin``;
``*`` when any origin is allowed, ``allowed_origins: ["*"]``), whatever its path or status. A
preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) from an allowed
origin is answered 204 on every path, without the API key (browsers send none on a preflight):
it allows GET, POST, DELETE and the request headers the browser asked for (``Authorization``
too, which ``Access-Control-Allow-Headers: *`` would not cover). A request or preflight from an
origin not allowed gets no CORS header at all (the browser keeps the answer from the page; the
preflight goes on to the routes as any OPTIONS would). No credentials mode: clients send an API
key in ``Authorization``, not cookies.
"""

from __future__ import annotations

from collections.abc import Iterable

METHODS = "GET, POST, DELETE, OPTIONS"
MAX_AGE_S = 600  # how long a browser may cache a preflight's answer


class Cors:
    """The allowed origins and the headers an answer to one of them carries."""

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(origins)
        self.any = "*" in self.origins
        self._fields: dict[str, bytes] = {}  # origin -> header lines, one entry per origin

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin in self.origins)

    def headers(self, origin: str) -> dict[str, str]:
        """The CORS headers of an answer to an allowed ``origin``."""
        if self.any:
            return {"Access-Control-Allow-Origin": "*"}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def preflight_headers(self, origin: str, requested_headers: str | None) -> dict[str, str]:
        """The headers of the 204 answer to an allowed origin's preflight."""
        headers = {**self.headers(origin), "Access-Control-Allow-Methods": METHODS,
                   "Access-Control-Max-Age": str(MAX_AGE_S)}
        if requested_headers:
            headers["Access-Control-Allow-Headers"] = requested_headers
        return headers

    def fields(self, origin: str | None) -> bytes:
        """``headers`` as HTTP/1.1 header lines (b"" for an origin not allowed)."""
        if origin is None or not self.allows(origin):
            return b""
        key = "*" if self.any else origin  # (bounded: the allowed origins, or one)
        lines = self._fields.get(key)
        if lines is None:
            lines = self._fields[key] = "".join(
                f"{k}: {v}\r\n" for k, v in self.headers(origin).items()).encode("latin-1")
        return lines


def with_vary(existing: str | None, value: str) -> str:
    """A ``Vary`` header's value with ``value`` added to what the answer had."""
    return f"{existing}, {value}" if existing else value
