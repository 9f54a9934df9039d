"""External OpenAI clients against the disaggregated cluster: agent SDKs and structured-output
libraries, each in its own virtualenv, each run against the router's ``/v1`` and judged by
stated criteria; every HTTP exchange is recorded, so that a failure is classified as the
model's (SmolLM2-135M is weak) or the server's.

    python -m bench.clients [--clients agents,langchain,pydantic-ai,instructor]
                            [--out bench/results/clients.md] [--requests-dir DIR]

- The cluster: SmolLM2-135M-Instruct (``disagg model fetch smollm2``'s folder, fetched when
  missing), 1 context + 1 generation worker + the router, started by ``disagg launch -c
  <yaml>`` (KV over TCP; ``tool_call_parser: hermes``; ``chat_template:`` the tool-aware
  template, ``--chat-template none`` leaves the model's own). ``--router-url`` uses a
  cluster that is already up instead.
- The clients (``bench.clients.<lib>_client``, one case per run): openai-agents (chat
  completions model and Responses model, also streamed), langchain-openai (tool loop,
  structured output), pydantic-ai (agent with a tool), instructor (``Mode.TOOLS_STRICT``).
  Each tool loop runs as written (``tool_choice`` auto: does the model call the tool?) and
  with its first call forced (``-required``: the whole loop, the tool's result sent back).
  ``--clients`` picks clients or cases (``python -m bench.clients --clients agents,
  instructor-tools-strict``). Each library lives in
  ``$DISAGG_CACHE/bench-venvs/<name>`` (created on first use with the pinned version from
  PyPI, reused while its pins are unchanged); the client runs with ``HF_HUB_OFFLINE=1``, the
  Agents SDK's tracing off, greedy (temperature 0), bounded ``max_tokens``, no SDK retries,
  a per-request timeout and a per-case time limit (its process group is killed after it).
- The evidence: every client talks to a recording proxy in this process (``/c/<case>/v1`` ->
  the router's ``/v1``) that passes bytes through, streams included, and keeps each exchange:
  method, path, status, request body, response body; the router's request counters are read
  before and after each case as a cross-check. 2xx answers are checked for the OpenAI shape
  (and against the request's strict schemas / forced tool choice, which the server promised).
- Classification (``classify``): PASS when the client's checks all hold; FAIL (server) when
  the router answered 4xx/5xx, a 2xx with a wrong shape or a broken constraint, the SDK could
  not read the answer, or an answer never came; FAIL (model) only when every exchange was a
  well-formed 2xx and the client's criteria failed on what the model wrote; FAIL (client) when
  the client never reached the server or crashed on its own; FAIL (unclassified) otherwise.
- Output: ``--out`` (Markdown) and beside it ``<stem>.jsonl`` (the run, the venvs' frozen
  packages, every exchange, every client result, the router's counter deltas);
  ``--requests-dir`` also writes each request with its status as one JSON file.

Every child (the launcher and its workers, each client) is stopped and reaped on any exit,
Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg import __version__
from disagg.env import cache_root
from disagg.procs import NotHealthy, free_ports, log_tail, spawn, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]

NAME = "smollm2"  # the served model name the clients send
DEFAULT_TEMPLATE = ROOT / "disagg" / "chat_templates" / "smollm2_tools.jinja"
CASE_TIMEOUT_S = 300.0  # one client run, start-up included
REQUEST_TIMEOUT_S = 120.0  # one HTTP request of a client
START_TIMEOUT_S = 600.0  # the cluster (a first start builds CPU kernels)
BODY_CAP = 256 * 1024  # response bytes kept per exchange
PASS, SERVER, MODEL, CLIENT, UNCLEAR = ("PASS", "FAIL (server)", "FAIL (model)",
                                        "FAIL (client)", "FAIL (unclassified)")
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}


@dataclass(frozen=True)
class Venv:
    """One client library's virtualenv: its name (folder) and the pins installed into it."""

    name: str
    pins: tuple[str, ...]
    dists: tuple[str, ...]  # whose versions the report shows


@dataclass(frozen=True)
class Case:
    """One client run: which venv and client module (``bench.clients.<module>``), the case
    argument, what it does and what passing means."""

    name: str
    venv: str
    module: str
    arg: str
    api: str
    what: str
    criteria: str
    extra: tuple[str, ...] = ()  # more arguments of the client module


VENVS = {v.name: v for v in (
    Venv("agents", ("openai-agents==0.24.0",), ("openai-agents", "openai")),
    Venv("langchain", ("langchain-openai==1.7.4",),
         ("langchain-openai", "langchain-core", "openai")),
    Venv("pydantic-ai", ("pydantic-ai-slim[openai]==2.68.0",), ("pydantic-ai-slim", "openai")),
    Venv("instructor", ("instructor==1.17.0",), ("instructor", "openai")),
)}
TOOL_CRITERIA = ("the `get_weather(city)` function ran at least once, with a `city` that "
                 "contains \"Paris\" (case-blind), and then a non-empty text answer came back, "
                 "with no exception")
CITY_CRITERIA = ("a `City(name, country)` instance came back, `name` contains \"Paris\" and "
                 "`country` contains \"France\" (case-blind), with no exception")
REQUIRED = ("--tool-choice", "required")
REQUIRED_WHAT = ("; the first turn has `tool_choice: \"required\"` and `parallel_tool_calls: "
                 "false` (one forced call), later turns auto (each library's way)")
BASE_CASES = (
    Case("agents-chat", "agents", "agents_client", "chat", "POST /v1/chat/completions",
         "`Agent` + one `@function_tool`, `OpenAIChatCompletionsModel(AsyncOpenAI(base_url))`, "
         "`Runner.run(max_turns=4)`", TOOL_CRITERIA),
    Case("agents-responses", "agents", "agents_client", "responses", "POST /v1/responses",
         "`Agent` + one `@function_tool`, `OpenAIResponsesModel(AsyncOpenAI(base_url))`, "
         "`Runner.run(max_turns=4)`", TOOL_CRITERIA),
    Case("langchain-tools", "langchain", "langchain_client", "tools",
         "POST /v1/chat/completions",
         "`ChatOpenAI(...).bind_tools([get_weather])`: invoke, run the tool call, send the "
         "`ToolMessage` back, invoke again", TOOL_CRITERIA
         + "; the second answer must be text, not another tool call"),
    Case("pydantic-ai-tools", "pydantic-ai", "pydantic_ai_client", "tools",
         "POST /v1/chat/completions",
         "`Agent(OpenAIChatModel(provider=OpenAIProvider(openai_client=AsyncOpenAI(...))))` + "
         "one `@agent.tool_plain`, `run(usage_limits=UsageLimits(request_limit=4))`",
         TOOL_CRITERIA),
)
# Each tool loop twice: as written (tool_choice auto: does the model call the tool?) and with
# the first call forced (the whole loop, tool result included, whatever the model prefers).
CASES = {c.name: c for c in (
    *(x for c in BASE_CASES for x in (c, Case(
        f"{c.name}-required", c.venv, c.module, c.arg, c.api, c.what + REQUIRED_WHAT,
        c.criteria, REQUIRED))),
    # Streamed (SSE: chat chunks, Responses events), the whole loop (first call forced).
    *(Case(f"agents-{api}-stream-required", "agents", "agents_client", f"{api}-stream",
           f"POST /v1/{path} (stream)", f"as agents-{api}, with `Runner.run_streamed` (every "
           "request `stream: true`, its events consumed)" + REQUIRED_WHAT, TOOL_CRITERIA,
           REQUIRED) for api, path in (("chat", "chat/completions"), ("responses", "responses"))),
    Case("langchain-structured", "langchain", "langchain_client", "structured",
         "POST /v1/chat/completions",
         "`ChatOpenAI(...).with_structured_output(City, include_raw=True)` (default method)",
         CITY_CRITERIA),
    Case("instructor-tools-strict", "instructor", "instructor_client", "tools-strict",
         "POST /v1/chat/completions",
         "`instructor.from_openai(OpenAI(...), mode=Mode.TOOLS_STRICT)`, "
         "`create(response_model=City, strict=True, max_retries=2)`", CITY_CRITERIA),
)}


# -- virtualenvs --------------------------------------------------------------------------------


def ensure_venv(path: Path, pins: Sequence[str]) -> Path:
    """``path``/bin/python, installing ``pins`` into a new venv unless one with exactly these
    pins is there (a marker written after a successful install)."""
    marker = path / "disagg-pins.txt"
    want = "\n".join(pins) + "\n"
    if marker.exists() and marker.read_text() == want:
        return path / "bin" / "python"
    print(f"creating {path} ({', '.join(pins)}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True,
                   timeout=300)
    subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", *pins],
                   check=True, timeout=1800)
    marker.write_text(want)
    return path / "bin" / "python"


def venv_freeze(python: Path) -> list[str]:
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--all"], capture_output=True,
                         text=True, timeout=120)
    return out.stdout.split()


# -- the recording proxy ------------------------------------------------------------------------


HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
               "upgrade", "host", "content-length", "content-encoding", "trailer",
               "proxy-authorization", "proxy-authenticate"}
CASE_PATH = re.compile(r"^/c/([A-Za-z0-9_.-]+)(/.*)?$")


def _decode(data: bytes, content_type: str | None) -> Any:
    """A body as JSON when it parses, else text."""
    text = data.decode("utf-8", errors="replace")
    if content_type and "json" not in content_type and text[:1] not in "{[":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class Recorder:
    """A pass-through HTTP proxy in front of ``upstream`` that keeps every exchange. Clients
    use ``<url>/c/<case>/v1``: the case prefix is stripped and names the exchange's case.
    Responses go back as HTTP/1.0 (closed at the end), so a stream passes through chunk by
    chunk with no re-framing."""

    def __init__(self, upstream: str, read_timeout: float) -> None:
        import httpx

        self.upstream = upstream.rstrip("/")
        self.client = httpx.Client(trust_env=False, timeout=httpx.Timeout(
            10.0, read=read_timeout, write=30.0, pool=30.0))
        self.entries: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self.server.daemon_threads = True
        self.server.recorder = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="recorder",
                                       daemon=True)

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
        self.client.close()

    def begin(self, entry: dict[str, Any]) -> None:
        with self.lock:
            entry["seq"] = len(self.entries)
            self.entries.append(entry)

    def of_case(self, case: str, settle_s: float = 5.0) -> list[dict[str, Any]]:
        """The case's exchanges, after waiting (bounded) for answers still being relayed."""
        deadline = time.monotonic() + settle_s
        while True:
            with self.lock:
                mine = [e for e in self.entries if e["case"] == case]
            if all("done" in e for e in mine) or time.monotonic() > deadline:
                return [dict(e) for e in mine]
            time.sleep(0.05)  # a relay thread finishing its last bytes; bounded above


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # the exchanges are the log

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._relay()

    do_POST = do_DELETE = do_PUT = do_PATCH = do_GET  # noqa: N815

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _relay(self) -> None:
        import httpx

        rec: Recorder = self.server.recorder  # type: ignore[attr-defined]
        m = CASE_PATH.match(self.path)
        case, path = (m.group(1), m.group(2) or "/") if m else ("?", self.path)
        body = self._body()
        entry: dict[str, Any] = {
            "kind": "exchange", "case": case, "t": round(time.time(), 3),
            "method": self.command, "path": path.split("?", 1)[0],
            "query": path.split("?", 1)[1] if "?" in path else "",
            "user_agent": self.headers.get("User-Agent"),
            "request": _decode(body, self.headers.get("Content-Type")) if body else None,
            "status": None}
        rec.begin(entry)
        t0 = time.monotonic()
        sent = False
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            req = rec.client.build_request(self.command, rec.upstream + path, headers=headers,
                                           content=body)
            resp = rec.client.send(req, stream=True)
            try:
                self.send_response(resp.status_code)
                for k, v in resp.headers.items():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                self.end_headers()
                sent = True
                kept = bytearray()
                for chunk in resp.iter_bytes():
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    kept += chunk[:max(0, BODY_CAP - len(kept))]
                ctype = resp.headers.get("content-type", "")
                entry.update(status=resp.status_code, content_type=ctype,
                             response=_decode(bytes(kept), ctype),
                             truncated=len(kept) >= BODY_CAP)
            finally:
                resp.close()
        except httpx.HTTPError as e:  # the router did not answer (whole)
            entry["proxy_error"] = f"{type(e).__name__}: {e}"
            if not sent:
                msg = json.dumps({"error": {"message": f"recording proxy: {e}",
                                            "type": "upstream_error"}}).encode()
                with contextlib.suppress(OSError):
                    self.send_response(502)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(msg)
                entry.update(status=502, content_type="application/json",
                             response=json.loads(msg))
        except OSError as e:  # the client hung up
            entry["client_gone"] = f"{type(e).__name__}: {e}"
        finally:
            entry["duration_s"] = round(time.monotonic() - t0, 3)
            entry["problems"] = exchange_problems(entry)
            entry["done"] = True


# -- checking an exchange -----------------------------------------------------------------------


def schema_errors(value: Any, schema: Any, where: str = "$",
                  defs: dict[str, Any] | None = None) -> list[str]:
    """Where ``value`` breaks ``schema`` (the JSON-schema subset strict tools and response
    formats use: type, properties, required, additionalProperties false, items, enum, const,
    anyOf, local $ref)."""
    if not isinstance(schema, dict):
        return []
    defs = defs if defs is not None else {**schema.get("$defs", {}),
                                          **schema.get("definitions", {})}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target = defs.get(ref.rsplit("/", 1)[-1])
        return schema_errors(value, target, where, defs) if target is not None else []
    if "anyOf" in schema:
        branches = [schema_errors(value, s, where, defs) for s in schema["anyOf"]]
        if all(branches):
            return [f"{where}: matches none of anyOf ({branches[0][0]})"]
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    kinds = {"string": str, "boolean": bool, "object": dict, "array": list,
             "null": type(None)}
    if types:
        ok = False
        for t in types:
            if t in ("integer", "number"):
                ok |= (isinstance(value, int if t == "integer" else (int, float))
                       and not isinstance(value, bool))
            elif t in kinds:
                ok |= isinstance(value, kinds[t])
        if not ok:
            return [f"{where}: {type(value).__name__} is not {'/'.join(types)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} not in enum"]
    if "const" in schema and value != schema["const"]:
        return [f"{where}: {value!r} is not {schema['const']!r}"]
    errors: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{where}: missing {k!r}" for k in schema.get("required", ())
                   if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{where}: unexpected {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(v, props[k], f"{where}.{k}", defs)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += schema_errors(v, schema["items"], f"{where}[{i}]", defs)
    return errors


def sse_events(text: str) -> tuple[list[Any], bool]:
    """The ``data:`` payloads of an event stream (JSON, or the raw text where it is not), and
    whether it ended with ``[DONE]``."""
    events: list[Any] = []
    done = False
    for block in re.split(r"\r?\n\r?\n", text):
        data = "\n".join(line[5:].lstrip(" ") for line in block.splitlines()
                         if line.startswith("data:"))
        if not data:
            continue
        if data == "[DONE]":
            done = True
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            events.append(data)
    return events, done


def _error_body_problems(resp: Any) -> list[str]:
    err = resp.get("error") if isinstance(resp, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return ["error answer is not OpenAI error JSON ({\"error\": {\"message\": ...}})"]
    return []


def _assemble_chat_stream(events: list[Any]) -> tuple[dict[str, Any], list[str]]:
    """The whole completion a chat stream adds up to (choice 0), and its shape problems."""
    problems: list[str] = []
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for i, ev in enumerate(events):
        if not isinstance(ev, dict) or ev.get("object") != "chat.completion.chunk":
            problems.append(f"stream event {i}: not a chat.completion.chunk")
            continue
        for ch in ev.get("choices") or []:
            delta = ch.get("delta") or {}
            if isinstance(delta.get("content"), str):
                content.append(delta["content"])
            for tc in delta.get("tool_calls") or []:
                if not isinstance(tc.get("index"), int):
                    problems.append(f"stream event {i}: tool_calls delta without an index")
                    continue
                slot = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                      "function": {"name": None,
                                                                   "arguments": ""}})
                slot["id"] = slot["id"] or tc.get("id")
                fn = tc.get("function") or {}
                slot["function"]["name"] = slot["function"]["name"] or fn.get("name")
                slot["function"]["arguments"] += fn.get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    message = {"role": "assistant", "content": "".join(content) or None,
               "tool_calls": [calls[k] for k in sorted(calls)] or None}
    return {"message": message, "finish_reason": finish, "index": 0}, problems


def _tool_schemas(request: dict[str, Any], flat: bool) -> dict[str, tuple[Any, bool]]:
    """name -> (parameters, strict) of the request's function tools (``flat``: the Responses
    API's ``{"type", "name", "parameters", "strict"}``)."""
    out = {}
    for t in request.get("tools") or []:
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            continue
        fn = t if flat else (t.get("function") or {})
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = (fn.get("parameters"), fn.get("strict") is True)
    return out


def _call_problems(where: str, name: Any, arguments: Any,
                   tools: dict[str, tuple[Any, bool]], partial: bool = False) -> list[str]:
    """A tool call's name and arguments (``partial``: cut short, only the types count)."""
    if not isinstance(name, str) or not isinstance(arguments, str):
        return [f"{where}: name and arguments must be strings"]
    if name not in tools:
        return [f"{where}: {name!r} is not one of the request's tools"]
    if partial:
        return []
    try:
        args = json.loads(arguments)
    except ValueError:
        return [f"{where}: arguments are not JSON: {arguments[:200]!r}"]
    if not isinstance(args, dict):
        return [f"{where}: arguments are not a JSON object"]
    params, strict = tools[name]
    if strict:
        return [f"{where}: strict tool's arguments break its schema: {e}"
                for e in schema_errors(args, params)][:3]
    return []


def _chat_choice_problems(i: int, ch: Any, request: dict[str, Any]) -> list[str]:
    where = f"choices[{i}]"
    if not isinstance(ch, dict) or not isinstance(ch.get("message"), dict):
        return [f"{where}: no message object"]
    msg, finish = ch["message"], ch.get("finish_reason")
    problems = []
    if msg.get("role") != "assistant":
        problems.append(f"{where}.message.role is {msg.get('role')!r}")
    if msg.get("content") is not None and not isinstance(msg["content"], str):
        problems.append(f"{where}.message.content is neither a string nor null")
    if finish not in FINISH_REASONS:
        problems.append(f"{where}.finish_reason {finish!r} is not an OpenAI value")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        return [*problems, f"{where}.message.tool_calls is not a list"]
    tools = _tool_schemas(request, flat=False)
    for j, tc in enumerate(calls):
        w = f"{where}.message.tool_calls[{j}]"
        if not isinstance(tc, dict) or not isinstance(tc.get("id"), str) or tc.get(
                "type") != "function" or not isinstance(tc.get("function"), dict):
            problems.append(f"{w}: needs id, type 'function' and a function object")
            continue
        # Cut by max_tokens: the last call's arguments may stop mid-way (as OpenAI's do).
        partial = finish == "length" and j == len(calls) - 1
        problems += _call_problems(w, tc["function"].get("name"),
                                   tc["function"].get("arguments"), tools, partial)
    if finish == "length":
        return problems  # cut short: the constraints below cannot hold yet
    choice = request.get("tool_choice")
    forced = choice == "required" or isinstance(choice, dict)
    if forced and tools and not calls:
        problems.append(f"{where}: tool_choice {choice!r} forced a call, none came back")
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object") \
            and not calls:
        problems += _json_text_problems(f"{where}.message.content", msg.get("content"),
                                        fmt, (fmt.get("json_schema") or {}).get("schema"))
    return problems


def _json_text_problems(where: str, text: Any, fmt: dict[str, Any], schema: Any) -> list[str]:
    try:
        value = json.loads(text if isinstance(text, str) else "")
    except ValueError:
        return [f"{where}: response_format {fmt.get('type')} asked for JSON, got "
                f"{str(text)[:200]!r}"]
    if fmt.get("type") == "json_object" and not isinstance(value, dict):
        return [f"{where}: json_object asked for an object"]
    return [f"{where}: breaks the response_format schema: {e}"
            for e in schema_errors(value, schema)][:3]


def _chat_problems(request: dict[str, Any], resp: Any, stream: bool) -> list[str]:
    if stream:
        events, done = sse_events(resp if isinstance(resp, str) else "")
        choice, problems = _assemble_chat_stream(events)
        if not done:
            problems.append("stream did not end with data: [DONE]")
        return problems + _chat_choice_problems(0, choice, request)
    if not isinstance(resp, dict) or resp.get("object") != "chat.completion":
        return ["answer is not a chat.completion object"]
    problems = [] if isinstance(resp.get("id"), str) else ["chat.completion without an id"]
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices:
        return [*problems, "chat.completion without choices"]
    for i, ch in enumerate(choices):
        problems += _chat_choice_problems(i, ch, request)
    return problems


def _response_object_problems(request: dict[str, Any], resp: Any) -> list[str]:
    if not isinstance(resp, dict) or resp.get("object") != "response":
        return ["answer is not a response object"]
    problems = [] if isinstance(resp.get("id"), str) else ["response without an id"]
    if resp.get("status") not in ("completed", "incomplete", "in_progress", "failed",
                                  "queued", "cancelled"):
        problems.append(f"response.status {resp.get('status')!r} is not an OpenAI value")
    output = resp.get("output")
    if not isinstance(output, list):
        return [*problems, "response.output is not a list"]
    tools = _tool_schemas(request, flat=True)
    texts = []
    cut = resp.get("status") == "incomplete"
    for i, item in enumerate(output):
        where = f"output[{i}]"
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "message":
            parts = item.get("content")
            if item.get("role") != "assistant" or not isinstance(parts, list):
                problems.append(f"{where}: a message needs role assistant and a content list")
                continue
            for j, part in enumerate(parts):
                if not isinstance(part, dict) or part.get("type") not in ("output_text",
                                                                          "refusal"):
                    problems.append(f"{where}.content[{j}]: not output_text / refusal")
                elif part["type"] == "output_text":
                    if not isinstance(part.get("text"), str):
                        problems.append(f"{where}.content[{j}].text is not a string")
                    texts.append(part.get("text"))
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str):
                problems.append(f"{where}: function_call without a call_id")
            problems += _call_problems(where, item.get("name"), item.get("arguments"), tools,
                                       cut and i == len(output) - 1)
        elif kind != "reasoning":
            problems.append(f"{where}: unexpected output item type {kind!r}")
    fmt = (request.get("text") or {}).get("format") if isinstance(request.get("text"),
                                                                  dict) else None
    if resp.get("status") == "completed" and isinstance(fmt, dict) and fmt.get("type") in (
            "json_schema", "json_object") and texts:
        problems += _json_text_problems("output_text", "".join(t or "" for t in texts), fmt,
                                        fmt.get("schema"))
    return problems


def _responses_problems(request: dict[str, Any], resp: Any, stream: bool) -> list[str]:
    if not stream:
        return _response_object_problems(request, resp)
    events, _ = sse_events(resp if isinstance(resp, str) else "")
    problems = [f"stream event {i}: no type" for i, ev in enumerate(events)
                if not isinstance(ev, dict) or not isinstance(ev.get("type"), str)]
    final = [ev for ev in events if isinstance(ev, dict) and ev.get("type") in (
        "response.completed", "response.incomplete", "response.failed")]
    if not final:
        return [*problems, "stream without response.completed / incomplete / failed"]
    return problems + _response_object_problems(request, final[-1].get("response"))


def exchange_problems(entry: dict[str, Any]) -> list[str]:
    """What is wrong with one recorded exchange on the server's side: an error answer's body
    that is not OpenAI's, or a 2xx whose shape (or promised constraint) is wrong. A 4xx/5xx
    itself is judged by ``classify``."""
    status, resp = entry.get("status"), entry.get("response")
    if status is None:
        return ["no answer"]
    if status >= 400:
        return _error_body_problems(resp)
    request = entry.get("request") if isinstance(entry.get("request"), dict) else {}
    stream = request.get("stream") is True
    if entry.get("truncated"):
        return []  # cut by the recorder: nothing to judge the end by
    path = entry.get("path", "")
    if entry.get("method") == "POST" and path.endswith("/chat/completions"):
        return _chat_problems(request, resp, stream)
    if entry.get("method") == "POST" and path.endswith("/responses"):
        return _responses_problems(request, resp, stream)
    return []


# -- classifying a case -------------------------------------------------------------------------


def describe(entry: dict[str, Any]) -> str:
    """``POST /v1/x -> 400: message`` for one exchange."""
    out = f"{entry.get('method')} {entry.get('path')} -> {entry.get('status')}"
    resp = entry.get("response")
    if entry.get("status") is not None and entry["status"] >= 400:
        err = resp.get("error") if isinstance(resp, dict) else None
        msg = err.get("message") if isinstance(err, dict) else resp
        out += f": {str(msg)[:300]}"
    return out


def classify(result: dict[str, Any] | None, exchanges: Sequence[dict[str, Any]],
             timed_out: bool, log_tail_text: str = "") -> tuple[str, str]:
    """The case's verdict and its cause, from the client's result and the exchanges (the
    rules are the module docstring's; a model failure needs every exchange a clean 2xx)."""
    refused = [e for e in exchanges if e.get("status") is not None and e["status"] >= 400]
    unanswered = [e for e in exchanges if e.get("status") is None]
    malformed = [e for e in exchanges if e.get("status") is not None and e["status"] < 400
                 and e.get("problems")]
    if result is not None and result.get("passed"):
        notes = [describe(e) for e in refused] + [
            f"{describe(e)}: {'; '.join(e['problems'])}" for e in malformed]
        return PASS, ("; ".join(notes) + " (the client passed regardless)") if notes else ""
    if refused:
        return SERVER, describe(refused[0])
    if malformed:
        e = malformed[0]
        return SERVER, f"{describe(e)} but {'; '.join(e['problems'][:3])}"
    if unanswered:
        return SERVER, (f"{describe(unanswered[0])}: no answer "
                        + ("before the case's time limit" if timed_out else "before the "
                           "client gave up (its request timeout, or the connection dropped)"))
    if result is None:
        why = "timed out" if timed_out else "wrote no result"
        return CLIENT, f"the client {why} after {len(exchanges)} exchange(s): " + (
            log_tail_text.strip().splitlines()[-1][:300] if log_tail_text.strip() else "")
    err = result.get("error")
    failed = [c for c in result.get("checks", []) if not c.get("ok")]
    if err is not None and err.get("kind") in ("server", "sdk"):
        return SERVER, f"the SDK could not use the answer: {err['type']}: {err['message'][:300]}"
    if not exchanges:
        return CLIENT, ("the client sent no request: " + (
            f"{err['type']}: {err['message'][:300]}" if err else "no exchange recorded"))
    if err is not None and err.get("kind") == "model":
        return MODEL, f"{err['type']}: {err['message'][:300]}"
    if err is not None:
        return UNCLEAR, f"{err['type']}: {err['message'][:300]}"
    if failed:
        return MODEL, "; ".join(f"{c['name']}: no ({json.dumps(c.get('detail'))[:200]})"
                                for c in failed)
    return UNCLEAR, "no checks ran"


# -- the cluster --------------------------------------------------------------------------------


def cluster_config(model: str, ports: Sequence[int], template: Path | None) -> dict[str, Any]:
    """The disagg YAML: 1 context + 1 generation worker and the router on ``ports``."""
    worker: dict[str, Any] = {"served_model_name": NAME, "max_model_len": 4096,
                              "kv_cache_tokens": 16384, "tool_call_parser": "hermes",
                              "cache_transceiver_config": {"backend": "TCP"}}
    if template is not None:
        worker["chat_template"] = str(template)
    return {"hostname": "127.0.0.1", "port": ports[2], "max_retries": 1, "model": model,
            **worker,
            "context_servers": {"num_instances": 1, "router": {"type": "round_robin"},
                                "urls": [f"127.0.0.1:{ports[0]}"]},
            "generation_servers": {"num_instances": 1, "router": {"type": "round_robin"},
                                   "urls": [f"127.0.0.1:{ports[1]}"]}}


@contextlib.contextmanager
def launched(cfg: dict[str, Any], logs: Path) -> Iterator[str]:
    """``disagg launch -c`` the config; yield the router's URL; stop the launcher (which
    stops its workers; it dies with this process too) on exit."""
    import yaml

    path = logs / "clients-cluster.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    log = logs / "launch.log"
    cmd = [sys.executable, "-m", "disagg.cli", "launch", "-c", str(path), "--log-dir",
           str(logs / "cluster"), "--timeout", str(START_TIMEOUT_S), "--stop-timeout", "20"]
    print(f"starting the cluster: {shlex.join(cmd)} (log {log}) ...", flush=True)
    proc = spawn(cmd, log, env=env, cwd=ROOT, die_with_parent=True)
    url = f"http://127.0.0.1:{cfg['port']}"
    try:
        try:
            wait_healthy(url, START_TIMEOUT_S + 30, proc=proc, interval=0.5,
                         what="the cluster's router")
        except NotHealthy as e:
            raise RuntimeError(f"{e}:\n{log_tail(log, 40)}") from None
        print(f"cluster ready: {url}", flush=True)
        yield url
    finally:
        stop(proc, grace_s=45.0)  # the launcher's own stop: 20 s grace + kill per child


def router_counts(url: str) -> dict[str, float]:
    """The router's ``disagg_router_requests_total`` as ``{'endpoint outcome': n}`` (summed
    over router processes); empty when /metrics does not answer."""
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("disagg_router_requests_total{"):
            key, _, value = line.rpartition(" ")
            labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
            k = f"{labels.get('endpoint', '?')} {labels.get('outcome', '?')}"
            out[k] = out.get(k, 0.0) + float(value)
    return out


# -- running a case -----------------------------------------------------------------------------


@dataclass
class CaseRun:
    case: Case
    rc: int | None
    wall_s: float
    timed_out: bool
    result: dict[str, Any] | None
    exchanges: list[dict[str, Any]]
    router_delta: dict[str, float]
    log_tail: str
    verdict: str = ""
    cause: str = ""
    versions: dict[str, str] = field(default_factory=dict)


def client_env(home: Path) -> dict[str, str]:
    """The client's environment: this one without OpenAI settings, offline for hubs, no
    tracing, no proxy for the local router; ``PYTHONPATH`` is the repository root alone, so
    that ``python -m bench.clients.<module>`` finds the client module (the package imports
    nothing of the project; the user's own ``PYTHONPATH`` is dropped)."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("OPENAI_", "LANGCHAIN_", "LANGSMITH_"))}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_HOME=str(home / "hf-home"),
               OPENAI_AGENTS_DISABLE_TRACING="1",
               OPENAI_API_KEY="none", LANGSMITH_TRACING="false", LANGCHAIN_TRACING_V2="false",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_case(case: Case, python: Path, rec: Recorder, router: str, work: Path,
             args: argparse.Namespace) -> CaseRun:
    """One client run, bounded by ``args.case_timeout``; its process group is killed after."""
    result_path = work / f"{case.name}.result.json"
    log = work / f"{case.name}.log"
    cmd = [str(python), "-m", f"bench.clients.{case.module}", "--case", case.arg, "--base-url",
           f"{rec.url}/c/{case.name}/v1", "--model", NAME, "--result", str(result_path),
           "--max-tokens", str(args.max_tokens), "--timeout", str(args.request_timeout),
           *case.extra]
    print(f"{case.name}: running ...", flush=True)
    before = router_counts(router)
    t0 = time.monotonic()
    proc = spawn(cmd, log, env=client_env(work), cwd=work, die_with_parent=True)
    timed_out = False
    try:
        proc.wait(timeout=args.case_timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        stop(proc, grace_s=5.0)
    wall = time.monotonic() - t0
    after = router_counts(router)
    result = None
    if result_path.exists():
        with contextlib.suppress(ValueError):
            result = json.loads(result_path.read_text())
    tail = log_tail(log, 30)
    run = CaseRun(case, proc.returncode, wall, timed_out, result, rec.of_case(case.name),
                  {k: v - before.get(k, 0.0) for k, v in after.items()
                   if v != before.get(k, 0.0)}, tail)
    run.verdict, run.cause = classify(result, run.exchanges, timed_out, tail)
    print(f"{case.name}: {run.verdict} ({wall:.1f} s){': ' + run.cause if run.cause else ''}",
          flush=True)
    return run


# -- the report ---------------------------------------------------------------------------------


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "unknown"


def machine_lines(model: str | None) -> list[str]:
    import torch

    lines = [f"- Machine: {platform.platform()}, {os.cpu_count()} CPU cores (shared: load "
             f"average {os.getloadavg()[0]:.2f} at the end), no GPU; Python "
             f"{platform.python_version()}, torch {torch.__version__}, disagg {__version__} "
             f"at commit {git_commit()}."]
    if model is not None:
        cfg = json.loads((Path(model) / "config.json").read_text())
        shape = ", ".join(f"{k} {cfg[k]}" for k in ("num_hidden_layers", "hidden_size")
                          if k in cfg)
        lines.append(f"- Model: `{model}` ({cfg.get('model_type', '?')}: {shape}), served as "
                     f"`{NAME}`, float32 on CPU.")
    return lines


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _case_row(r: CaseRun) -> str:
    http = ", ".join(f"{e.get('method')} {e.get('path')} -> {e.get('status')}"
                     for e in r.exchanges) or "none"
    lib = ", ".join(f"{k} {v}" for k, v in r.versions.items())
    return (f"| {r.case.name} | {lib} | {r.case.api} | **{r.verdict}** | {_md(http)} | "
            f"{_md(r.cause) or '-'} |")


def _request_fields(req: Any) -> str:
    if not isinstance(req, dict):
        return repr(req)[:200]
    short = {k: (v if isinstance(v, (str, int, float, bool)) or v is None
                 else f"<{type(v).__name__} of {len(v)}>") for k, v in req.items()}
    return json.dumps(short)[:600]


def report(runs: Sequence[CaseRun], args: argparse.Namespace, cluster: dict[str, Any] | None,
           model: str | None, evidence: Path) -> str:
    counts = {v: sum(r.verdict == v for r in runs) for v in (PASS, SERVER, MODEL, CLIENT,
                                                                UNCLEAR)}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    template = (cluster or {}).get("chat_template")
    lines = [
        "# External OpenAI clients against the disaggregated cluster",
        "",
        f"Written by `python -m bench.clients {shlex.join(sys.argv[1:])}`. "
        f"**Verdict: {counts[PASS]} of {len(runs)} cases pass ({summary}).**",
        "",
        *machine_lines(model),
        ("- Cluster: `disagg launch -c` of the YAML in the evidence file (1 context + 1 "
         "generation worker, the router; KV over TCP; `tool_call_parser: hermes`; "
         + (f"`chat_template: {template}`" if template else "the model's own chat template "
            "(`--chat-template none`)") + ")." if cluster is not None else
         f"- Cluster: already running at {args.router_url} (not started by this run)."),
        "- Clients: each library in its own virtualenv under "
        f"`{args.venv_dir}` (pins: "
        + "; ".join(f"{v.name}: {', '.join(v.pins)}" for v in VENVS.values()
                    if any(r.case.venv == v.name for r in runs))
        + "; every package's version is in the evidence file), `HF_HUB_OFFLINE=1`, Agents "
        "SDK tracing off, temperature 0, `max_tokens` "
        f"{args.max_tokens}, no SDK retries (`max_retries=0`), {args.request_timeout:g} s per "
        f"request, {args.case_timeout:g} s per case. api_key \"none\".",
        f"- Evidence: `{evidence.name}` (JSON lines: `run`, `venv` (pip freeze), `exchange` "
        "(every HTTP request a client sent, as the recording proxy in front of the router "
        "passed it on: method, path, status, request and response bodies, the shape "
        "problems found), `result` (the client's checks, tool calls, answer, exception), "
        "`router` (the router's `disagg_router_requests_total` deltas per case)).",
        "",
        "| case | library | API | result | HTTP exchanges | cause |",
        "|---|---|---|---|---|---|",
        *[_case_row(r) for r in runs],
        "",
        "## What each case does and what passing means",
        "",
        *[f"- **{r.case.name}**: {r.case.what}. Passes when {r.case.criteria}." for r in runs],
        "",
        "The tool is `get_weather(city)` returning the fixed text \"It is sunny and 22 "
        "degrees Celsius in <city>.\"; the prompt \"What is the weather in Paris?\" with "
        "instructions to use the tool. The extraction prompt: \"Extract the city and the "
        "country it is in from this sentence: Paris is the capital of France.\"",
        "",
        "## How a failure is classified",
        "",
        f"- **{SERVER}**: the router answered a request with 4xx/5xx; or a 2xx whose body is "
        "not the OpenAI shape (`chat.completion` / chunks ending in `[DONE]` / `response`: "
        "ids, roles, finish reasons, tool calls with string JSON-object arguments naming a "
        "requested tool) or breaks what the request made the server promise (a strict "
        "tool's or `response_format`'s JSON schema, a forced `tool_choice`); or the SDK "
        "raised a status / response-validation error; or a request got no answer.",
        f"- **{MODEL}**: every exchange was a well-formed 2xx, and the client's criteria "
        "failed on what the model wrote (no tool call, a wrong argument, a wrong value), or "
        "the library raised its own model-behaviour error (openai-agents `ModelBehaviorError`"
        " / `MaxTurnsExceeded`, pydantic-ai `UnexpectedModelBehavior` / "
        "`UsageLimitExceeded`, instructor `InstructorRetryException`, langchain "
        "`OutputParserException` / pydantic `ValidationError`).",
        f"- **{CLIENT}**: the client sent no request or wrote no result (an install or "
        f"import error, its time limit); **{UNCLEAR}**: any other exception after 2xx "
        "answers.",
        "",
    ]
    refusals = [(r, e) for r in runs for e in r.exchanges
                if e.get("status") is not None and e["status"] >= 400]
    if refusals:
        lines += ["## What the server refused", "",
                  "| case | request | status: error | the request's top-level fields |",
                  "|---|---|---|---|"]
        for r, e in refusals:
            err = e.get("response")
            err = err.get("error", err) if isinstance(err, dict) else err
            msg = err.get("message") if isinstance(err, dict) else err
            lines.append(f"| {r.case.name} | {e['method']} {e['path']} | {e['status']}: "
                         f"{_md(str(msg)[:300])} | `{_md(_request_fields(e.get('request')))}` "
                         "|")
        lines.append("")
    lines += ["## Per case", ""]
    for r in runs:
        res = r.result or {}
        lines.append(f"- **{r.case.name}** ({r.verdict}, {r.wall_s:.1f} s, exit {r.rc}"
                     f"{', timed out' if r.timed_out else ''}; router counted "
                     f"{json.dumps(r.router_delta) if r.router_delta else 'nothing'}):")
        for c in res.get("checks", []):
            lines.append(f"  - {'ok' if c['ok'] else 'FAILED'}: {c['name']} "
                         f"({_md(json.dumps(c.get('detail'))[:200])})")
        if res.get("error"):
            err = res["error"]
            lines.append(f"  - exception ({err['kind']}): `{err['type']}`: "
                         f"{_md(err['message'][:400])}")
        if r.result is None:
            last = r.log_tail.strip().splitlines()[-1][:300] if r.log_tail.strip() else ""
            lines.append(f"  - no result file; the client's output ends: `{_md(last)}`")
        for e in r.exchanges:
            if e.get("problems"):
                lines.append(f"  - {describe(e)}: {_md('; '.join(e['problems'])[:400])}")
    lines.append("")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------


def pick_cases(spec: str) -> list[Case]:
    """``--clients``: client (venv) names and/or case names, comma-separated; 'all'."""
    if spec == "all":
        return list(CASES.values())
    picked: list[Case] = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        found = [c for c in CASES.values() if name in (c.name, c.venv)]
        if not found:
            raise SystemExit(f"--clients: {name!r} is neither a client ({', '.join(VENVS)}) "
                             f"nor a case ({', '.join(CASES)})")
        picked += [c for c in found if c not in picked]
    return picked


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.clients",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="all",
                    help=f"comma-separated clients ({', '.join(VENVS)}) or cases "
                         f"({', '.join(CASES)}); default all")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "clients.md"))
    ap.add_argument("--requests-dir", default=None,
                    help="also write each request (body, status, error) as a JSON file here")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2, "
                    "`disagg model fetch smollm2`'s folder, fetched when missing)")
    ap.add_argument("--chat-template", default=str(DEFAULT_TEMPLATE),
                    help="the workers' chat_template (default: the tool-aware SmolLM2 "
                         "template); 'none': the model's own")
    ap.add_argument("--router-url", default=None,
                    help="use this running cluster's router instead of launching one")
    ap.add_argument("--venv-dir", default=os.path.join(cache_root(), "bench-venvs"))
    ap.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S)
    ap.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S)
    ap.add_argument("--max-tokens", type=int, default=128)
    return ap.parse_args(argv)


def write_requests(folder: Path, runs: Sequence[CaseRun]) -> None:
    """Each exchange's request as ``<case>-<n>-<path>-<status>.json`` (the answer too where
    it was an error or malformed), and ``index.md``: one line per file with the request's
    top-level fields."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in runs:  # an earlier run's files of these cases (their statuses may differ)
        for old in folder.glob(f"{r.case.name}-[0-9][0-9]-*.json"):
            old.unlink()
    index = ["# Requests the external clients sent", "",
             f"Written by `python -m bench.clients {shlex.join(sys.argv[1:])}` at "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')} (commit {git_commit()}).", "",
             "| file | status | the request's top-level fields (values of short scalars) |",
             "|---|---|---|"]
    for r in runs:
        for i, e in enumerate(r.exchanges):
            slug = e["path"].strip("/").replace("/", "_") or "root"
            data = {"case": r.case.name, "method": e["method"], "path": e["path"],
                    "status": e["status"], "user_agent": e.get("user_agent"),
                    "request": e.get("request")}
            if e.get("status") is None or e["status"] >= 400 or e.get("problems"):
                data["response"] = e.get("response")
                data["problems"] = e.get("problems")
            name = f"{r.case.name}-{i:02d}-{slug}-{e['status']}.json"
            (folder / name).write_text(json.dumps(data, indent=1) + "\n")
            index.append(f"| {name} | {e['status']} | "
                         f"`{_md(_request_fields(e.get('request')))}` |")
    (folder / "index.md").write_text("\n".join(index) + "\n")


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every finally: children stop


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cases = pick_cases(args.clients)
    signal.signal(signal.SIGTERM, _on_sigterm)
    template = None if args.chat_template == "none" else Path(args.chat_template).resolve()
    if template is not None and not template.is_file():
        raise SystemExit(f"--chat-template: {template}: no such file ('none' uses the "
                         "model's own template)")
    pythons: dict[str, Path] = {}
    install_errors: dict[str, str] = {}
    for name in dict.fromkeys(c.venv for c in cases):
        try:
            pythons[name] = ensure_venv(Path(args.venv_dir) / name, VENVS[name].pins)
        except (OSError, subprocess.SubprocessError) as e:  # its cases fail, the rest run
            install_errors[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: the virtualenv could not be made: {e}", flush=True)
    freezes = {name: venv_freeze(py) for name, py in pythons.items()}
    model = cfg = None
    if args.router_url is None:
        if args.model is None:
            from disagg.model.gguf import fetch_model

            args.model = fetch_model("smollm2")
        model = str(Path(args.model).resolve())
    out = Path(args.out)
    evidence = out.with_suffix(".jsonl")
    runs: list[CaseRun] = []
    # Kept after the run (the clients' and the cluster's logs), like disagg launch's logs.
    work = Path(cache_root()) / "logs" / time.strftime(f"bench-clients-%Y%m%d-%H%M%S-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    print(f"logs in {work}", flush=True)
    with contextlib.ExitStack() as stack:
        if args.router_url is None:
            assert model is not None
            cfg = cluster_config(model, free_ports(3), template)
            router = stack.enter_context(launched(cfg, work))
        else:
            router = args.router_url.rstrip("/")
        rec = stack.enter_context(Recorder(router, args.request_timeout + 30))
        for case in cases:
            if case.venv in install_errors:
                run = CaseRun(case, None, 0.0, False, None, [], {}, install_errors[case.venv],
                              CLIENT, f"no virtualenv: {install_errors[case.venv]}")
            else:
                run = run_case(case, pythons[case.venv], rec, router, work, args)
                pins = {p.split("==")[0].lower(): p.split("==")[1]
                        for p in freezes[case.venv] if "==" in p}
                run.versions = {d: pins.get(d, "?") for d in VENVS[case.venv].dists}
            runs.append(run)
    records: list[dict[str, Any]] = [
        {"kind": "run", "argv": sys.argv[1:], "model": model, "cluster": cfg,
         "router": args.router_url, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
    records += [{"kind": "venv", "name": n, "pins": VENVS[n].pins, "freeze": f}
                for n, f in freezes.items()]
    for r in runs:
        records += r.exchanges
        records.append({"kind": "result", "case": r.case.name, "verdict": r.verdict,
                        "cause": r.cause, "rc": r.rc, "wall_s": round(r.wall_s, 2),
                        "timed_out": r.timed_out, "client": r.result,
                        "log_tail": r.log_tail if r.result is None or not r.result.get(
                            "passed") else ""})
        records.append({"kind": "router", "case": r.case.name, "delta": r.router_delta})
    out.parent.mkdir(parents=True, exist_ok=True)
    evidence.write_text("".join(json.dumps(x, default=repr) + "\n" for x in records))
    text = report(runs, args, cfg, model, evidence)
    out.write_text(text)
    if args.requests_dir:
        write_requests(Path(args.requests_dir), runs)
    print(f"\nwrote {out} and {evidence}")
    return 0 if all(r.verdict == PASS for r in runs) else 1


def cli() -> None:
    """``python -m bench.clients``: ``main``, and a word when Ctrl-C or SIGTERM ended it."""
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the finally blocks stopped every child
        print(f"\ninterrupted ({e or 'Ctrl-C'}): every child stopped, no report written",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli()
