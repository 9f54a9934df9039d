"""Streaming OpenAI-compatible client that times every chunk.

Two transports with one interface: aiohttp (preferred when installed: the lightest per chunk,
what vLLM's benchmark uses) and httpx (a declared dependency of the ``serve`` extra). Both read
raw bytes as they arrive and ``SSEDecoder`` splits them into events, so each event is stamped
with the time its bytes reached us, whatever the line lengths or network chunking.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from disagg.bench.metrics import RequestRecord, compute_itls

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Idle pooled connections are dropped after this, before a server closes them: uvicorn (vLLM,
# SGLang, trtllm-serve, our workers' default) closes idle keep-alive connections after 5 s, and
# a request sent on a connection the server is closing fails with "connection reset".
CLIENT_KEEP_ALIVE_S = 4.0


class HTTPStatusError(Exception):
    """Non-200 answer; the message holds the status and the start of the body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {_error_message(body)}")
        self.status = status


def _error_message(body: str) -> str:
    # OpenAI errors are {"error": {"message": ...}}; vLLM's older shape is {"message": ...}.
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return body.strip()[:300]
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:300]
        if isinstance(err, str):
            return err[:300]
        if "detail" in obj:
            return str(obj["detail"])[:300]
    return body.strip()[:300]


def normalize_base_url(url: str) -> str:
    """Strip a trailing slash and a trailing /v1: the endpoint paths add it."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# -------------------------------------------------------------------------------- SSE


class SSEDecoder:
    """Incremental server-sent-events parser: feed bytes, get the ``data`` of complete events.

    Handles events split across reads and several events per read; ignores comments and
    fields other than ``data``; multi-line data is joined with newlines (the SSE spec).
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buf = self._buf[nl + 1:]
            self._line(line, events)
        return events

    def flush(self) -> list[str]:
        """End of stream: a last event without its blank line still counts."""
        events: list[str] = []
        if self._buf:
            self._line(self._buf.rstrip(b"\r").decode("utf-8", errors="replace"), events)
            self._buf = b""
        self._line("", events)
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:  # a blank line ends an event
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


# -------------------------------------------------------------------------- transports


class Transport(Protocol):
    def stream(self, url: str, headers: dict[str, str],
               payload: dict[str, Any]) -> Any: ...  # async context manager -> AsyncIterator[bytes]

    async def get_json(self, url: str, headers: dict[str, str]) -> Any: ...

    async def aclose(self) -> None: ...


class AiohttpTransport:
    def __init__(self, timeout_s: float) -> None:
        import aiohttp

        # limit=0: no connection cap (aiohttp's default of 100 would silently cap concurrency).
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEP_ALIVE_S),
            trust_env=False)

    @asynccontextmanager
    async def stream(self, url: str, headers: dict[str, str],
                     payload: dict[str, Any]) -> AsyncIterator[AsyncIterator[bytes]]:
        async with self._session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, await resp.text(errors="replace"))
            yield resp.content.iter_any()

    async def get_json(self, url: str, headers: dict[str, str]) -> Any:
        async with self._session.get(url, headers=headers) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, await resp.text(errors="replace"))
            return await resp.json(content_type=None)

    async def aclose(self) -> None:
        await self._session.close()


class HttpxTransport:
    def __init__(self, timeout_s: float) -> None:
        import httpx

        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None,
                                keepalive_expiry=CLIENT_KEEP_ALIVE_S),
            trust_env=False)

    @asynccontextmanager
    async def stream(self, url: str, headers: dict[str, str],
                     payload: dict[str, Any]) -> AsyncIterator[AsyncIterator[bytes]]:
        async with self._client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                raise HTTPStatusError(resp.status_code, body)
            yield resp.aiter_raw()

    async def get_json(self, url: str, headers: dict[str, str]) -> Any:
        resp = await self._client.get(url, headers=headers)
        if resp.status_code != 200:
            raise HTTPStatusError(resp.status_code, resp.text)
        return resp.json()

    async def aclose(self) -> None:
        await self._client.aclose()


def make_transport(kind: str = "auto", timeout_s: float = 6 * 3600) -> Transport:
    """``auto`` picks aiohttp when it is installed, else httpx."""
    if kind == "auto":
        try:
            import aiohttp  # noqa: F401
            kind = "aiohttp"
        except ImportError:
            kind = "httpx"
    if kind == "aiohttp":
        return AiohttpTransport(timeout_s)
    if kind == "httpx":
        return HttpxTransport(timeout_s)
    raise ValueError(f"unknown HTTP client {kind!r} (auto, aiohttp, httpx)")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def list_models(transport: Transport, base_url: str, api_key: str | None = None) -> list[str]:
    """Model ids that ``GET /v1/models`` lists, in order."""
    obj = await transport.get_json(f"{normalize_base_url(base_url)}/v1/models",
                                   auth_headers(api_key))
    return [m["id"] for m in obj.get("data", []) if isinstance(m, dict) and "id" in m]


# ----------------------------------------------------------------------------- request


@dataclass
class RequestSpec:
    """Everything needed to send one benchmark request."""

    index: int
    url: str  # full endpoint URL
    endpoint: str  # "completions" | "chat"
    model: str
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = False
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            if not isinstance(self.prompt, str):
                raise ValueError("the chat endpoint takes text prompts only")
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)  # last: lets users override anything above
        return body


def _chunk_content(endpoint: str, choice: dict[str, Any]) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        # Reasoning models stream thinking separately; it is generated output all the same.
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "") + \
            (delta.get("reasoning") or "")
    return choice.get("text") or ""


@dataclass
class _StreamState:
    chunk_times: list[float] = field(default_factory=list)  # arrival of content chunks
    usage_completion: int | None = None
    usage_prompt: int | None = None
    chars: int = 0
    finish_reason: str | None = None
    done: bool = False  # [DONE] seen


class _StreamError(Exception):
    """An error event inside an otherwise 200 stream."""


def _handle_event(endpoint: str, st: _StreamState, data: str, now: float) -> None:
    """Apply one SSE event's data to the stream state."""
    if data.strip() == "[DONE]":
        st.done = True
        return
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise _StreamError(f"bad JSON in stream: {data[:120]!r}") from e
    if not isinstance(obj, dict):
        raise _StreamError(f"unexpected event in stream: {data[:120]!r}")
    if "error" in obj or obj.get("object") == "error":
        raise _StreamError(f"error in stream: {_error_message(data)}")
    usage = obj.get("usage")
    if isinstance(usage, dict):
        # Usage comes on the last chunk (include_usage), with some servers on every chunk:
        # the latest value is the running total.
        if usage.get("completion_tokens") is not None:
            st.usage_completion = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            st.usage_prompt = int(usage["prompt_tokens"])
    choices = obj.get("choices") or []
    text = "".join(_chunk_content(endpoint, c) for c in choices)
    if text:
        st.chars += len(text)
        st.chunk_times.append(now)  # one timestamp per chunk, however many tokens it holds
    for c in choices:
        if c.get("finish_reason"):
            st.finish_reason = c["finish_reason"]


async def send_request(transport: Transport, spec: RequestSpec, t_origin: float,
                       clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    """Send one streaming request and time it. Never raises: failures land in the record."""
    rec = RequestRecord(index=spec.index, prompt_len=spec.prompt_len,
                        expected_output_len=spec.max_tokens)
    headers = {"Content-Type": "application/json", **auth_headers(spec.api_key)}
    st = _StreamState()
    decoder = SSEDecoder()
    t0 = clock()
    rec.start = t0 - t_origin
    try:
        async with transport.stream(spec.url, headers, spec.payload()) as body:
            async for raw in body:
                now = clock()
                for data in decoder.feed(raw):
                    _handle_event(spec.endpoint, st, data, now)
                if st.done:
                    break
            else:
                for data in decoder.flush():
                    _handle_event(spec.endpoint, st, data, clock())
        end = clock()
        if not st.done and st.finish_reason is None:
            raise _StreamError("stream ended before [DONE] and without a finish_reason")
        if st.chunk_times:
            first = st.chunk_times[0]
        elif st.finish_reason is not None:
            first = end  # e.g. EOS as the only token: no text, but the request did finish
        else:
            raise _StreamError("stream ended without any generated output")
        rec.ttft = first - t0
        rec.e2el = end - t0
        rec.itl = compute_itls(st.chunk_times)
        # Prefer the server's count: a chunk may carry several tokens.
        rec.output_tokens = (st.usage_completion if st.usage_completion is not None
                             else len(st.chunk_times))
        rec.server_prompt_tokens = st.usage_prompt
        rec.output_chars = st.chars
        rec.finish_reason = st.finish_reason
        rec.success = True
    except (_StreamError, HTTPStatusError) as e:
        rec.error = str(e)
    except Exception as e:  # refused connection, timeout, reset...: counted, never dropped
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if not rec.success:
        rec.e2el = clock() - t0
    return rec
