"""Bad-input fuzz of the worker and router endpoints (issue 15, "fault and fuzz tests that stay
in CI"; the shapes of issue 22).

Hypothesis generates request bodies (and their headers) for the worker's and the router's
``/v1/completions`` and ``/v1/chat/completions``, the worker's ``/kv_leases/release`` and the
router's ``/cluster/register``: wrong types for every field, ``NaN`` / ``Infinity`` / ``1e400``
literals, huge and negative numbers, invalid token ids, oversized lists, lone surrogates,
broken UTF-8, deep nesting, bodies that are no JSON object, wrong or missing
``Content-Type``, ``Content-Encoding``, unknown fields, ``n`` x prompt counts, ``stream`` /
``stream_options`` oddities, extreme sampling values (batched with honest requests: a bad
request must not fail its batch-mates) and plausible but forged ``disaggregated_params``.
Each example sends one to three bodies at once. Properties: no 5xx but 503 (overload), every
error is OpenAI error JSON, every answer within a bounded time, every 200 well formed (a
stream ends with ``[DONE]`` and carries no error event), the engines stay alive; afterwards
``/health`` is 200, no KV block is used, no lease is held and the forged addresses' listener
was never connected to.

Everything runs in this process: a context and a generation worker (tiny model, TCP KV
transfer, a small KV cache and ``max_model_len`` so that valid requests are cheap) served by
uvicorn for the router and called directly through ``httpx.ASGITransport`` by the worker fuzz;
the router (``start_router`` on loopback) in front of them. Reproducible: ``derandomize`` and
no example database. ``DISAGG_FUZZ_SCALE`` multiplies the example counts (default 1.5: about
1000 bodies per endpoint, 70 s for this file on the two cores, where 2 took 90 s: the whole
suite reached CI's 25-minute budget; 3 or more for a deeper run; the kill -9 tests are in
``test_kill_workers.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fixtures import LoopThread
from server_fixtures import Listener, serve_in_thread, wait_for

from disagg.cluster_auth import member_id_of, sign_http
from disagg.config import build_engine_config
from disagg.contracts import protocol as P
from disagg.contracts.cluster import parse_cluster_config
from disagg.engine import AsyncLLM
from disagg.kv_connector.settings import DisaggSettings
from disagg.router.app import ROUTER_KEY, build_router_app, start_router
from disagg.server.app import ServerSettings, build_app

TOKEN = "fuzz-cluster-secret"
AUDIENCE: dict[str, str] = {}  # name -> member id (the cluster fixture fills it)
NAME = "tiny"
B = 16
MAX_MODEL_LEN = 64  # a chat request without max_tokens decodes at most this many tokens
OPTIONS = dict(tokens_per_block=B, kv_cache_tokens=1024, max_num_tokens=128,
               max_model_len=MAX_MODEL_LEN, max_batch_size=32)
# The context worker prefills whole prompts only, and at most 40 tokens a step: a longer one
# (that max_model_len allows) can never run there.
CTX_MAX_NUM_TOKENS = 40
CTX_OPTIONS = {**OPTIONS, "enable_chunked_context": False, "max_num_tokens": CTX_MAX_NUM_TOKENS}
LEASE_TTL_S = 2.0  # context_only requests the fuzz sends straight to the context worker
REQUEST_TIMEOUT_S = 30.0  # no answer may take longer (a hang fails the example)
C, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
RELEASE, REGISTER = "/kv_leases/release", "/cluster/register"
SCALE = float(os.environ.get("DISAGG_FUZZ_SCALE", "1.5"))


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=max(1, int(examples * SCALE)), derandomize=True, database=None,
                    deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# ---- bodies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """Bytes written into the JSON text as they are (NaN, 1e400, broken UTF-8, deep nesting)."""

    data: bytes

    def __repr__(self) -> str:  # some are 200 kB
        return f"Raw({self.data[:40]!r}{'...' if len(self.data) > 40 else ''})"


ABSENT = object()  # the field is left out

RAW_VALUES = [Raw(b) for b in (
    b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1" + b"0" * 400, b"-0",
    b"1e-400", b"4.9e-324", b"1.7976931348623157e308", b"18446744073709551616",
    b"-9223372036854775809", b'"\\ud800"', b'"a\\udfffb"', b'"\\udbff\\udfff"', b'"\xff\xfe"',
    b'"\xed\xa0\x80"', b'"\xc3"', b'"\xf4\x90\x80\x80"', b'"\\u0000"',
    b"[" * 40 + b"]" * 40, b"[" * 3000 + b"]" * 3000, b'{"a":' * 40 + b"1" + b"}" * 40,
    b'{"a":' * 2000 + b"1" + b"}" * 2000, b"[1,2,3" + b",1" * 100_000 + b"]",
    b'"' + b"x" * 200_000 + b'"')]

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=4),
                                                              st.integers(), max_size=2),
    st.sampled_from(RAW_VALUES))
TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
VOCAB = 512  # the tiny checkpoint's (checked in the fixture)
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
SMALL_MAX_TOKENS = st.integers(1, 4)
# Accepted values at their edges, sampling included (they run in batches with honest requests).
VALID: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, 3),
    "temperature": st.one_of(st.sampled_from(
        [0, 0.0, -0.0, 1e-300, 5e-324, 1e-38, 1e-6, 1e-5, 0.7, 1, 2.0, 100.0, 1e300]),
        st.floats(0, 5)),
    "top_p": st.one_of(st.sampled_from([1e-300, 5e-324, 1e-38, 0.1, 0.999999, 1]),
                       st.floats(1e-9, 1)),
    "top_k": st.sampled_from([-1, 0, 1, 2, 50, VOCAB - 1, VOCAB, VOCAB + 1, 2 ** 31, 2 ** 63,
                              10 ** 30]),
    "seed": st.one_of(st.sampled_from([0, -1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1,
                                       2 ** 64, 10 ** 30, -(10 ** 30)]), st.integers()),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6), st.lists(st.just("e"), min_size=50,
                                                                 max_size=60)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=5),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "user": TEXT,
    "presence_penalty": st.one_of(st.none(), st.floats(-2, 2)),
    "frequency_penalty": st.one_of(st.none(), st.floats(-2, 2)),
    "repetition_penalty": st.one_of(st.none(), st.floats(0.5, 2)),
    "min_p": st.one_of(st.none(), st.floats(0, 1)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(
        st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3)),
    "stream": st.booleans(),
}
VALID_COMPLETION = {**VALID, "logprobs": st.integers(0, 20), "echo": st.just(False),
                    "best_of": st.sampled_from([None, 1]), "suffix": st.sampled_from([None, ""])}
VALID_CHAT = {**VALID, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
              "max_completion_tokens": SMALL_MAX_TOKENS,
              "response_format": st.sampled_from([None, {"type": "text"}]),
              "tool_choice": st.sampled_from([None, "none", "auto"]), "tools": st.just([]),
              "add_generation_prompt": st.booleans()}
# Values each field must refuse (or survive), beside JUNK.
BAD: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["other", "", None, 5, Raw(b'"\\udfff"')]),
    "max_tokens": st.sampled_from([0, -1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 10 ** 9, 2 ** 63,
                                   10 ** 30, 1.0, "4", True]),
    "max_completion_tokens": st.sampled_from([0, -1, 10 ** 9, 2 ** 64, "1"]),
    "n": st.sampled_from([0, -1, 129, 10 ** 9, 2 ** 63, 2.0, "2", True, None]),
    "temperature": st.sampled_from([-1, -1e-300, -0.5, "0", True, Raw(b"NaN"), Raw(b"1e400")]),
    "top_p": st.sampled_from([0, 0.0, -1, 1.0000001, 2, "1", Raw(b"NaN"), Raw(b"1e-400")]),
    "top_k": st.sampled_from([-2, -(2 ** 63), 1.5, "5", True]),
    "seed": st.sampled_from([1.5, "1", True, Raw(b"1e400")]),
    "stop": st.one_of(st.sampled_from([[""], "", [5], [None]]),
                      st.just(100_000).map(lambda k: ["a" * k]),
                      st.lists(st.just("s"), min_size=200, max_size=300)),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 2 ** 70), min_size=1, max_size=4),
                                st.sampled_from([[1.5], ["1"], [True], 5])),
    "min_tokens": st.sampled_from([-1, 7, 10 ** 9, 1.5]),
    "logprobs": st.sampled_from([-1, 21, 10 ** 9, "1", 1.5]),
    "top_logprobs": st.sampled_from([-1, 21, 10 ** 6, "1"]),
    "stream": st.sampled_from([None, "true", "false", "yes", 1, 0, 2, [], {}]),
    "stream_options": st.sampled_from([
        None, {}, {"include_usage": True}, {"include_usage": False}, {"include_usage": "x"},
        {"include_usage": None}, {"include_usage": []}, 5, "x", [],
        {"include_usage": True, "continuous_usage_stats": True}]),
    "presence_penalty": st.sampled_from([2.5, -2.01, "0"]),
    "repetition_penalty": st.sampled_from([0, -1, "1"]),
    "min_p": st.sampled_from([-0.1, 1.01]),
    "logit_bias": st.sampled_from([{"1": 101}, {"999999": 1.0}, {"x": Raw(b"NaN")}, [],
                                   {"x": 1}]),
    "best_of": st.sampled_from([0, 2, 10 ** 9]),
    "echo": st.sampled_from([True, "yes"]),
    "suffix": st.sampled_from(["x", 5]),
    "response_format": st.sampled_from([{"type": "json_object"}, "x", {"type": 5}]),
    "tools": st.sampled_from([[{"type": "function", "function": {"name": "f"}}], "x"]),
    "tool_choice": st.sampled_from(["required", {"type": "function"}, 5]),
    "add_generation_prompt": st.sampled_from([None, "no", 2]),
    "disaggregated_params": st.sampled_from([
        None, {}, 5, "x", [], {"request_type": "context_only"},
        {"request_type": "generation_only"}, {"request_type": "context_and_generation"},
        {"request_type": 5}, {"request_type": "x" * 1000}]),
}

PROMPT = st.one_of(
    TEXT, TEXT, IDS, st.lists(TEXT, min_size=1, max_size=4), st.lists(IDS, min_size=1, max_size=3))
BAD_PROMPT = st.one_of(
    st.sampled_from(["", [], [[]], [[1], []], [""], [1, "a"], [True], [1.0], [[1.5]],
                     [[[1]]], [-1], [VOCAB], [2 ** 63], [10 ** 30], {"a": 1}]),
    st.lists(st.integers(-(2 ** 70), 2 ** 70), min_size=1, max_size=4),
    st.one_of(st.integers(CTX_MAX_NUM_TOKENS - 2, MAX_MODEL_LEN + 2),
              st.integers(MAX_MODEL_LEN, 5000)).map(lambda k: [7] * k),  # (too) long
    st.integers(P.MAX_CHOICES + 1, 3 * P.MAX_CHOICES).map(lambda k: ["a"] * k),  # too many
    st.integers(200, 400).map(lambda k: [[3, 4]] * k))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
     "content": st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": TEXT}), max_size=2))},
    optional={"name": TEXT})
BAD_MESSAGE = st.one_of(
    st.sampled_from([{}, "user", 5, None, [], {"role": "robot", "content": "x"},
                     {"role": None, "content": "x"}, {"role": "user", "content": 5},
                     {"role": "user", "content": [{"type": "image_url", "image_url": {
                         "url": "http://x"}}]}, {"role": "user", "content": [{"type": "text"}]},
                     {"role": "user", "content": [5]},
                     {"role": "user", "content": "x", "tool_calls": [{"id": "1"}]},
                     {"role": "assistant", "content": None, "tool_calls": Raw(b"NaN")},
                     {"role": "user", "content": "x" * 5000}]),
    st.fixed_dictionaries({"role": JUNK, "content": JUNK}))
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=3)
BAD_MESSAGES = st.one_of(
    st.sampled_from([[], None, "hi", {}, 5]),
    st.lists(st.one_of(MESSAGE, BAD_MESSAGE), min_size=1, max_size=4).filter(
        lambda ms: any(not isinstance(m, dict) or m.get("role") not in (
            "user", "system", "assistant", "developer", "tool") for m in ms)),
    st.integers(300, 3000).map(lambda k: [{"role": "user", "content": "a"}] * k))
EXTRA_KEY = st.text(min_size=1, max_size=10).filter(
    lambda k: k not in VALID_CHAT and k not in VALID_COMPLETION and k not in BAD)


@st.composite
def openai_body(draw: st.DrawFn, path: str, forged: st.SearchStrategy[Any] | None = None
                ) -> dict[str, Any]:
    """A request body: honest, then up to three fields made bad (or strange)."""
    chat = path == CHAT
    valid = VALID_CHAT if chat else VALID_COMPLETION
    body: dict[str, Any] = {"model": draw(st.sampled_from([NAME, NAME, ABSENT]))}
    if chat:
        body["messages"] = draw(MESSAGES)
        # absent: as many tokens as fit (at most MAX_MODEL_LEN here)
        body["max_tokens"] = draw(st.one_of(*[SMALL_MAX_TOKENS] * 7, st.just(ABSENT)))
    else:
        body["prompt"] = draw(PROMPT)
        body["max_tokens"] = draw(SMALL_MAX_TOKENS)
    for name in draw(st.lists(st.sampled_from(sorted(valid)), max_size=5, unique=True)):
        body[name] = draw(valid[name])
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["field", "field", "junk", "extra", "prompt"]))
        if kind == "prompt":
            if chat:
                body["messages"] = draw(BAD_MESSAGES)
            else:
                body["prompt"] = draw(BAD_PROMPT)
        elif kind == "extra":
            body[draw(EXTRA_KEY)] = draw(JUNK)
        else:
            name = draw(st.sampled_from(sorted({*valid, *BAD, "model", "max_tokens"})))
            body[name] = draw(BAD[name] if kind == "field" and name in BAD else JUNK)
    if forged is not None and draw(st.integers(0, 3)) == 0:
        body["disaggregated_params"] = draw(forged)
    return {k: v for k, v in body.items() if v is not ABSENT}


def encode(obj: Any, ascii_only: bool = True) -> bytes:
    """JSON bytes of ``obj`` with its ``Raw`` parts written as they are."""
    raws: list[bytes] = []

    def sub(o: Any) -> Any:
        if isinstance(o, Raw):
            raws.append(o.data)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(o, dict):
            return {k: sub(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return [sub(v) for v in o]
        return o

    data = json.dumps(sub(obj), ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    for i, raw in enumerate(raws):
        data = data.replace(f'"\\u0000raw{i}\\u0000"'.encode(), raw, 1)
    return data


SHAPES = ["plain"] * 20 + ["utf-8", "utf-16", "bom", "list", "scalar", "empty", "truncated",
                           "trailing", "deep", "nul"]


@st.composite
def wire(draw: st.DrawFn, body: Any) -> tuple[bytes, dict[str, str]]:
    """``body`` as bytes on the wire (sometimes mangled) and its headers."""
    shape = draw(st.sampled_from(SHAPES))
    data = encode(body, ascii_only=shape != "utf-8")
    if shape == "utf-16":
        with contextlib.suppress(UnicodeDecodeError):  # (not when it holds broken UTF-8)
            data = data.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
    elif shape == "bom":
        data = b"\xef\xbb\xbf" + data
    elif shape == "list":
        data = b"[" + data + b"]"
    elif shape == "scalar":
        data = draw(st.sampled_from([b"1", b'"x"', b"null", b"true", b"NaN"]))
    elif shape == "empty":
        data = b""
    elif shape == "truncated":
        data = data[:draw(st.integers(0, max(len(data) - 1, 0)))]
    elif shape == "trailing":
        data += draw(st.sampled_from([b"x", b"}", b" {}", b"\x00", b"\n\n"]))
    elif shape == "deep":
        depth = draw(st.integers(30, 100_000))
        data = data[:-1] + b',"deep":' + b"[" * depth + b"]" * depth + b"}"
    elif shape == "nul":
        data = data.replace(b":", b":\x00", 1)
    headers: dict[str, str] = {}
    ctype = draw(st.sampled_from(["application/json"] * 4 + [
        None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
        "application/json; charset=utf-16", "application/json; charset=latin-1", "*/*", ""]))
    if ctype is not None:
        headers["Content-Type"] = ctype
    enc = draw(st.sampled_from([None] * 40 + ["gzip", "gzip+", "identity", "br", "deflate",
                                             "x-nonsense", "GZIP, identity"]))
    if enc == "gzip+":  # a body that really is compressed
        data, enc = gzip.compress(data), "gzip"
    if enc is not None:
        headers["Content-Encoding"] = enc
    return data, headers


# ---- the cluster under test -----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: str
            ) -> Iterator[SimpleNamespace]:
    ctx_config = build_engine_config(model_dir, **CTX_OPTIONS)
    gen_config = build_engine_config(model_dir, **OPTIONS)
    assert gen_config.model.vocab_size == VOCAB
    engines = {
        "ctx": AsyncLLM(ctx_config, disagg=DisaggSettings(
            role="context", cluster_token=TOKEN, backend="TCP", kv_lease_ttl_s=LEASE_TTL_S)),
        "gen": AsyncLLM(gen_config, disagg=DisaggSettings(
            role="generation", cluster_token=TOKEN, backend="TCP")),
    }
    roles = {"ctx": "context", "gen": "generation"}
    apps = {name: build_app(e, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                              role=roles[name], cluster_token=TOKEN))
            for name, e in engines.items()}
    loop = LoopThread()
    listener = Listener(hold=False, backlog=64)
    with contextlib.ExitStack() as stack:
        stack.callback(loop.close)
        stack.callback(listener.close)
        urls = {name: stack.enter_context(serve_in_thread(app)) for name, app in apps.items()}
        addr = {name: url.removeprefix("http://") for name, url in urls.items()}
        cfg = parse_cluster_config({
            "model": model_dir, "health_check_interval_sec": 0.5, "max_retries": 1,
            "context_servers": {"urls": [addr["ctx"]]},
            # kv_cache_aware: the router tokenizes the fuzzed prompts too
            "generation_servers": {"urls": [addr["gen"]], "router": {
                "type": "kv_cache_aware", "kv_events_poll_interval_sec": 0.2}},
            "disagg_cluster": {"minimal_instances": {"context_servers": 1,
                                                     "generation_servers": 1},
                               "heartbeat_interval_sec": 1, "inactive_timeout_sec": 2}},
            "fuzz")
        app = build_router_app(cfg, cluster_token=TOKEN)
        runner, port = loop.run(start_router(app, "127.0.0.1", 0))
        stack.callback(lambda: loop.run(runner.cleanup()))
        router_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(router_url + "/health", timeout=5).status_code == 200, 30,
                 what="router ready")
        # The member ids signed requests name (read by the strategies, drawn after this).
        AUDIENCE.update({name: member_id_of(url) for name, url in urls.items()},
                        router=member_id_of(router_url))
        # A real context answer: forged generation_only params look exactly like it.
        r = httpx.post(urls["ctx"] + C, timeout=30, json={
            "model": NAME, "prompt": list(range(40, 40 + B + 3)), "max_tokens": 4,
            "ignore_eos": True, "disaggregated_params": {"request_type": "context_only"}})
        assert r.status_code == 200 and r.json()["disaggregated_params"], r.text
        real_params = r.json()["disaggregated_params"]
        clients: dict[str, httpx.AsyncClient] = {}

        async def make_clients() -> None:
            for name, a in apps.items():
                clients[name] = httpx.AsyncClient(transport=httpx.ASGITransport(app=a),
                                                  base_url=f"http://{name}")
            clients["router"] = httpx.AsyncClient(base_url=router_url, timeout=REQUEST_TIMEOUT_S,
                                                  limits=httpx.Limits(max_connections=16))

        async def close_clients() -> None:
            for c in clients.values():
                await c.aclose()

        loop.run(make_clients())
        stack.callback(lambda: loop.run(close_clients()))
        ns = SimpleNamespace(loop=loop, engines=engines, urls=urls, addr=addr, apps=apps,
                             router_url=router_url, router=app[ROUTER_KEY], clients=clients,
                             listener=listener, real_params=real_params, stats={})
        yield ns
        # whatever the fuzz did: everything comes back
        check_idle(ns)


def check_idle(ns: SimpleNamespace) -> None:
    for url in (*ns.urls.values(), ns.router_url):
        assert httpx.get(url + "/health", timeout=10).status_code == 200, url
    ctx_rt = ns.engines["ctx"].transfer
    # context_only requests sent straight to the context worker hold leases for LEASE_TTL_S
    wait_for(lambda: len(ctx_rt.leases) == 0, LEASE_TTL_S + 10, 0.05, what="no lease held")
    for name, e in ns.engines.items():
        wait_for(lambda e=e: e.stats().kv_blocks_used == 0 and e.stats().num_running == 0
                 and e.stats().num_waiting == 0, 15, 0.05, what=f"{name}: idle, 0 KV blocks")
    assert ns.listener.connections == 0, "a forged address was connected to"


# ---- sending and checking --------------------------------------------------------------------


async def send(client: httpx.AsyncClient, path: str, data: bytes, headers: dict[str, str]
               ) -> tuple[int, str, bytes]:
    """(status, content type, body) within REQUEST_TIMEOUT_S (else the example fails)."""

    async def go() -> tuple[int, str, bytes]:
        r = await client.post(path, content=data, headers=headers)
        return r.status_code, r.headers.get("content-type", ""), r.content

    try:
        return await asyncio.wait_for(go(), REQUEST_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"no answer within {REQUEST_TIMEOUT_S} s: {path} "
                             f"{data[:300]!r}") from None


def check_answer(where: str, status: int, ctype: str, body: bytes, data: bytes,
                 stats: dict[str, int]) -> None:
    what = f"{where}: {status} {body[:400]!r}\nrequest: {data[:400]!r}"
    stats[f"{where} {status}"] = stats.get(f"{where} {status}", 0) + 1
    assert status < 500 or status == 503, what
    if status >= 400:
        err = json.loads(body)["error"]
        assert set(err) >= {"message", "type", "param", "code"}, what
        assert isinstance(err["message"], str) and err["message"], what
        assert isinstance(err["type"], str), what
        return
    assert status == 200, what
    if where.endswith(RESPONSES):
        check_response(body, ctype.startswith("text/event-stream"), what)
        return
    if ctype.startswith("text/event-stream"):
        events = [e for e in body.decode().split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", what
        for e in events[:-1]:
            assert e.startswith("data: "), what
            chunk = json.loads(e[6:])
            assert "error" not in chunk, what  # a fuzzed request must not fail mid-stream
        return
    answer = json.loads(body)
    if where.endswith(RELEASE):
        assert isinstance(answer["released"], bool), what
    elif where.endswith(REGISTER):
        assert answer["status"] == "registered", what
    else:
        assert isinstance(answer.get("choices"), list) and answer["choices"], what
        for ch in answer["choices"]:
            assert ch["finish_reason"] in ("stop", "length"), what


def check_response(body: bytes, streamed: bool, what: str) -> None:
    """A 200 of /v1/responses: a finished Response object, or events (each ``event:`` line
    naming its data's type, sequence numbers 0, 1, ...) ending with one."""
    if not streamed:
        answer = json.loads(body)
        assert answer["object"] == "response", what
        assert answer["status"] in ("completed", "incomplete"), what
        return
    events = [e for e in body.decode().split("\n\n") if e]
    seen = []
    for e in events:
        head, data = e.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and event["type"] != "error", what
        seen.append(event)
    assert [e["sequence_number"] for e in seen] == list(range(len(seen))), what
    assert seen[-1]["type"] in ("response.completed", "response.incomplete"), what


def run_batch(ns: SimpleNamespace, target: str, path: str,
              requests: list[tuple[bytes, dict[str, str]]]) -> None:
    client = ns.clients[target]

    async def all_of() -> list[tuple[int, str, bytes]]:
        return await asyncio.gather(*(send(client, path, d, h) for d, h in requests))

    answers = ns.loop.run(all_of(), timeout=REQUEST_TIMEOUT_S + 10)
    for (data, _), (status, ctype, body) in zip(requests, answers, strict=True):
        check_answer(f"{target} {path}", status, ctype, body, data, ns.stats)
    for name, e in ns.engines.items():
        assert e.is_healthy(), f"{name}'s engine died: {e.fatal_error}"


def forged_params(real: dict[str, Any], listener: str) -> st.SearchStrategy[dict[str, Any]]:
    """generation_only params shaped like a real context answer's, naming addresses this
    worker must not trust (the listener above, other hosts), some fields changed."""
    addresses = st.sampled_from([[listener], ["10.1.2.3:9"], ["localhost:1"], [listener] * 2,
                                 ["[::1]:9"], [""], [5], "x", []])
    changes = st.dictionaries(
        st.sampled_from(["ctx_request_id", "first_gen_tokens", "prompt_token_ids", "worker_id",
                         "backend", "block_ids", "num_tokens", "layout", "lease_expiry",
                         "first_gen_logprobs"]),
        st.one_of(JUNK, st.sampled_from([[0], [VOCAB + 5], [-1], [], "UCX", {}, list(range(64)),
                                         [{"1": -0.5}], [{"x": "y"}]])), max_size=2)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        d = {**real, "request_type": "generation_only", "addresses": draw(addresses)}
        d.update(draw(changes))
        return d

    return build()


# ---- the worker -------------------------------------------------------------------------------


@st.composite
def worker_batch(draw: st.DrawFn, path: str, forged: st.SearchStrategy[Any]
                 ) -> tuple[str, list[tuple[bytes, dict[str, str]]]]:
    target = draw(st.sampled_from(["gen", "gen", "ctx"]))
    reqs = [draw(wire(draw(openai_body(path, forged)))) for _ in range(draw(st.integers(1, 3)))]
    return target, reqs


@pytest.mark.slow
@pytest.mark.parametrize("path", [C, CHAT], ids=["completions", "chat"])
def test_worker_openai_endpoints(cluster: SimpleNamespace, path: str) -> None:
    forged = forged_params(cluster.real_params, cluster.listener.addr)

    @fuzz_settings(350)
    @given(batch=worker_batch(path, forged))
    def fuzz(batch: tuple[str, list[tuple[bytes, dict[str, str]]]]) -> None:
        target, reqs = batch
        run_batch(cluster, target, path, reqs)

    fuzz()
    print_stats(cluster)


@st.composite
def release_body(draw: st.DrawFn) -> tuple[bytes, dict[str, str], bool]:
    body = draw(st.one_of(
        st.fixed_dictionaries({"ctx_request_id": st.one_of(TEXT, JUNK, st.just("LIVE"))}),
        st.dictionaries(st.one_of(st.just("ctx_request_id"), st.text(max_size=8)),
                        st.one_of(JUNK, st.just("LIVE")), max_size=3),
        JUNK))
    data, headers = draw(wire(body))
    return data, headers, draw(st.sampled_from([True] * 6 + [False]))


@pytest.mark.slow
def test_worker_lease_release(cluster: SimpleNamespace) -> None:
    """Signed bodies reach the parser (unsigned ones get 401); some name a live lease."""
    ctx = cluster.clients["ctx"]

    async def new_lease() -> str:
        r = await ctx.post(C, json={"model": NAME, "prompt": list(range(50, 50 + B + 2)),
                                    "max_tokens": 3, "ignore_eos": True,
                                    "disaggregated_params": {"request_type": "context_only"}})
        assert r.status_code == 200, r.text
        return r.json()["disaggregated_params"]["ctx_request_id"]

    @fuzz_settings(300)
    @given(reqs=st.lists(release_body(), min_size=1, max_size=4), live=st.integers(0, 5))
    def fuzz(reqs: list[tuple[bytes, dict[str, str], bool]], live: int) -> None:
        lease = cluster.loop.run(new_lease()) if live == 0 else "no-such-lease"
        batch = []
        for data, headers, sign in reqs:
            data = data.replace(b'"LIVE"', json.dumps(lease).encode())
            if sign:
                headers = {**headers, **sign_http(TOKEN, "POST", RELEASE, data,
                                                  audience=AUDIENCE["ctx"])}
            batch.append((data, headers))
        run_batch(cluster, "ctx", RELEASE, batch)

    fuzz()
    # a generation worker has no leases: 404 whatever the body
    status, _, body = cluster.loop.run(send(cluster.clients["gen"], RELEASE, b"{}", {}))
    assert status == 404 and json.loads(body)["error"]
    print_stats(cluster)


# ---- the router -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", [C, CHAT], ids=["completions", "chat"])
def test_router_openai_endpoints(cluster: SimpleNamespace, path: str) -> None:
    """Through the router to the context and generation workers (disaggregated, requests it
    cannot split go whole to the generation worker); it refuses disaggregated_params."""
    forged = forged_params(cluster.real_params, cluster.listener.addr)

    @fuzz_settings(300)
    @given(reqs=st.lists(openai_body(path, forged).flatmap(wire), min_size=1, max_size=4))
    def fuzz(reqs: list[tuple[bytes, dict[str, str]]]) -> None:
        run_batch(cluster, "router", path, reqs)

    fuzz()
    print_stats(cluster)


WORKER_INFO = {"role": st.sampled_from(["context", "generation", "aggregated"]),
               "url": st.sampled_from(["127.0.0.1:1", "127.0.0.1:9", "localhost:2"]),
               "model": st.just(NAME), "tokens_per_block": st.sampled_from([16, 8]),
               "worker_id": st.text(max_size=8), "block_hash_scheme": st.just("sha256-chain-v1")}
BAD_URLS = st.sampled_from([
    "", ":", "x", "127.0.0.1", "127.0.0.1:", ":80", "127.0.0.1:0", "127.0.0.1:65536",
    "127.0.0.1:-1", "127.0.0.1:99999999999999999999", "127.0.0.1:80/x", "user@127.0.0.1:80",
    "http://127.0.0.1:1/", "127.0.0.1:1?x=1", "a b:1", "[::1]:1", "::1:1", "\x00:1",
    "h\u00e9:1", "h:1#f", "x" * 5000 + ":1", "127.0.0.1:1\r\nX: y"])


@st.composite
def register_body(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    body: Any = {k: draw(v) for k, v in WORKER_INFO.items() if draw(st.integers(0, 5)) > 0}
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from([*WORKER_INFO, "layout", "kv_transfer", "extra"]))
        body[name] = draw(BAD_URLS if name == "url" else JUNK)
    if draw(st.integers(0, 9)) == 0:
        body = draw(JUNK)
    data, headers = draw(wire(body))
    sign = draw(st.sampled_from(["signed"] * 6 + ["unsigned", "other token", "other path"]))
    if sign != "unsigned":
        token = "not-the-token" if sign == "other token" else TOKEN
        path = "/cluster/unregister" if sign == "other path" else REGISTER
        headers = {**headers, **sign_http(token, "POST", path, data,
                                          audience=AUDIENCE["router"])}
    return data, headers


@pytest.mark.slow
def test_router_cluster_register(cluster: SimpleNamespace) -> None:
    """Registrations: only signed ones are read; a malformed one is a 400 naming the field.
    The workers registered here point at closed ports: they never get traffic."""

    @fuzz_settings(300)
    @given(reqs=st.lists(register_body(), min_size=1, max_size=4))
    def fuzz(reqs: list[tuple[bytes, dict[str, str]]]) -> None:
        run_batch(cluster, "router", REGISTER, reqs)

    fuzz()
    m = cluster.router.membership
    for w in list(m.by_url.values()):
        if not w.static:
            cluster.loop.run(_unregister(m, w.url))
    # the static workers still serve
    r = httpx.post(cluster.router_url + C, timeout=30,
                   json={"model": NAME, "prompt": "The harbour", "max_tokens": 3})
    assert r.status_code == 200, r.text
    print_stats(cluster)


async def _unregister(m: Any, url: str) -> None:
    m.unregister(url)


# ---- /v1/responses ---------------------------------------------------------------------------

FUNCTION_TOOL = {"type": "function", "name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}}
INPUT_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer",
                                                    "assistant"]),
                           "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({
                               "type": st.sampled_from(["input_text", "output_text"]),
                               "text": TEXT}), min_size=1, max_size=2))},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT,
                           "name": st.just("f"), "arguments": st.sampled_from(['{"a":1}', "{}",
                                                                               "x"])}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT,
                           "output": TEXT}))
BAD_INPUT_ITEM = st.one_of(st.sampled_from([
    {}, 5, "x", {"type": "input_image"}, {"type": "function_call"},
    {"type": "function_call_output", "call_id": 5}, {"role": "tool", "content": "x"},
    {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
    {"role": "user", "content": 5}, {"type": "item_reference", "id": "x"}]),
    st.fixed_dictionaries({"type": JUNK, "role": JUNK, "content": JUNK}))
VALID_RESPONSES: dict[str, st.SearchStrategy[Any]] = {
    "instructions": TEXT, "temperature": VALID["temperature"], "top_p": VALID["top_p"],
    "seed": VALID["seed"], "stream": st.booleans(), "store": st.booleans(),
    "tools": st.sampled_from([[], [FUNCTION_TOOL]]),
    "tool_choice": st.sampled_from(["none", "required", {"type": "function", "name": "f"}]),
    "parallel_tool_calls": st.booleans(), "metadata": st.just({"k": "v"}),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "s", "schema": {
                                 "type": "object", "properties": {"a": {"type": "boolean"}},
                                 "required": ["a"], "additionalProperties": False}}}]),
    "include": st.sampled_from([[], ["message.output_text.logprobs"]]),
    "top_logprobs": st.integers(0, 20), "user": TEXT, "truncation": st.just("disabled"),
    "background": st.just(False), "service_tier": st.just("auto"),
}
BAD_RESPONSES: dict[str, st.SearchStrategy[Any]] = {
    "input": st.one_of(st.sampled_from(["", [], 5, {}, [[]]]),
                       st.lists(st.one_of(INPUT_ITEM, BAD_INPUT_ITEM), min_size=1, max_size=3)),
    "max_output_tokens": st.sampled_from([0, -1, 10 ** 9, 2 ** 64, "1", 1.5, True]),
    "previous_response_id": st.sampled_from(["resp_x", "", 5, "resp_" + "0" * 32 + "p1"]),
    "background": st.sampled_from([True, "x"]),
    "truncation": st.sampled_from(["auto", 5]),
    "reasoning": st.sampled_from([{"effort": "high"}, "x", {"summary": "auto"}]),
    "include": st.sampled_from([["x"], "x", [5]]),
    "tools": st.sampled_from([[{"type": "web_search"}], [{"type": "function"}], "x", [5]]),
    "tool_choice": st.sampled_from([{"type": "allowed_tools"}, "always", 5,
                                    {"type": "function"}]),
    "text": st.sampled_from([{"format": {"type": "grammar"}}, {"verbosity": "low"}, "x",
                             {"format": {"type": "json_schema", "schema": 5}}, {"x": 1}]),
    "stream_options": st.sampled_from([{}, {"include_obfuscation": False}, 5]),
    "metadata": st.sampled_from([{"k": 5}, "x", {str(i): "v" for i in range(17)}]),
    "top_logprobs": st.sampled_from([-1, 21, "1"]),
    "conversation": st.sampled_from(["conv_1", {"id": "x"}]),
}


@st.composite
def responses_body(draw: st.DrawFn) -> dict[str, Any]:
    """A /v1/responses body: honest (text or items), then up to three fields made bad."""
    body: dict[str, Any] = {"model": draw(st.sampled_from([NAME, NAME, ABSENT])),
                            "max_output_tokens": draw(SMALL_MAX_TOKENS),
                            "input": draw(st.one_of(TEXT, st.lists(INPUT_ITEM, min_size=1,
                                                                   max_size=3)))}
    for name in draw(st.lists(st.sampled_from(sorted(VALID_RESPONSES)), max_size=5,
                              unique=True)):
        body[name] = draw(VALID_RESPONSES[name])
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["field", "field", "junk", "extra"]))
        if kind == "extra":
            body[draw(EXTRA_KEY)] = draw(JUNK)
            continue
        name = draw(st.sampled_from(sorted({*VALID_RESPONSES, *BAD_RESPONSES, "model"})))
        bad = BAD_RESPONSES.get(name, BAD.get(name))
        body[name] = draw(bad if kind == "field" and bad is not None else JUNK)
    return {k: v for k, v in body.items() if v is not ABSENT}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["gen", "router"])
def test_responses_endpoint(cluster: SimpleNamespace, target: str) -> None:
    """``/v1/responses`` on a worker and through the router (its chat form's two calls)."""

    @fuzz_settings(120)
    @given(reqs=st.lists(responses_body().flatmap(wire), min_size=1, max_size=3))
    def fuzz(reqs: list[tuple[bytes, dict[str, str]]]) -> None:
        run_batch(cluster, target, RESPONSES, reqs)

    fuzz()
    print_stats(cluster)


def print_stats(ns: SimpleNamespace) -> None:
    print(" ".join(f"{k}:{v}" for k, v in sorted(ns.stats.items())))
    ns.stats.clear()


# ---- what the fuzz found (fast regression tests, one per defect) --------------------------------


def _post(ns: SimpleNamespace, target: str, path: str, body: Any,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, _, raw = ns.loop.run(send(ns.clients[target], path, json.dumps(body).encode(), {
        "Content-Type": "application/json", **(headers or {})}))
    return status, json.loads(raw)


def test_a_prompt_longer_than_max_num_tokens_without_chunking_is_400(
        cluster: SimpleNamespace) -> None:
    """The context worker prefills whole prompts (no chunked context) of at most
    CTX_MAX_NUM_TOKENS tokens. Before: a longer prompt that max_model_len allows was taken,
    then failed by the scheduler: a 500 "the request failed in the engine", straight or
    through the router."""
    long_ids = [7] * (CTX_MAX_NUM_TOKENS + 1)
    long_chat = [{"role": "user", "content": "a b " * 20}]  # 52 tokens with the template
    cases = [("ctx", C, {"prompt": long_ids}, "prompt"),
             ("ctx", C, {"prompt": [[1, 2], long_ids]}, "prompt.1"),
             ("ctx", CHAT, {"messages": long_chat}, "messages"),
             ("router", C, {"prompt": long_ids}, "prompt"),
             ("router", CHAT, {"messages": long_chat},
              "messages")]
    for target, path, body, param in cases:
        status, answer = _post(cluster, target, path, {"model": NAME, "max_tokens": 2, **body})
        assert status == 400, (target, path, answer)
        assert answer["error"]["param"] == param, answer
        assert "max_num_tokens" in answer["error"]["message"], answer
    # the engine refuses it too (a generation_only request's ids come from its params)
    from disagg.request import SamplingParams

    with pytest.raises(ValueError, match="max_num_tokens"):
        cluster.engines["ctx"].engine.validate(long_ids, SamplingParams(max_tokens=2))
    status, answer = _post(cluster, "ctx", C, {"model": NAME, "max_tokens": 2,
                                               "prompt": long_ids[:-1]})
    assert status == 200, answer  # at the limit: served


def test_stop_token_ids_outside_the_vocabulary_are_400(cluster: SimpleNamespace) -> None:
    """Before: accepted and never matched (the sampler ignores ids it has no logit for)."""
    for target in ("gen", "router"):
        for ids in ([VOCAB], [3, 2 ** 70]):
            status, answer = _post(cluster, target, C, {
                "model": NAME, "prompt": "hi", "max_tokens": 2, "stop_token_ids": ids})
            assert status == 400, (target, ids, answer)
            assert answer["error"]["param"] == "stop_token_ids", answer
    status, answer = _post(cluster, "gen", C, {"model": NAME, "prompt": "hi", "max_tokens": 2,
                                               "stop_token_ids": [0, VOCAB - 1]})
    assert status == 200, answer


def test_choices_per_request_are_capped() -> None:
    """prompts x n <= MAX_CHOICES (documented): each choice is an engine request, and before
    one 64 MiB body of one-character prompts meant millions of them (20000 took 27 s)."""
    ok = {"prompt": ["a"] * P.MAX_CHOICES, "max_tokens": 1}
    assert P.validate_request(C, ok)
    for body, param in (({**ok, "prompt": ["a"] * (P.MAX_CHOICES + 1)}, "prompt"),
                        ({**ok, "prompt": ["a"] * (P.MAX_CHOICES // 2 + 1), "n": 2}, "n"),
                        ({**ok, "prompt": [[1, 2]] * (P.MAX_CHOICES // 16), "n": 17}, "n")):
        with pytest.raises(P.APIError) as e:
            P.validate_request(C, body)
        assert e.value.status == 400 and e.value.param == param
        assert str(P.MAX_CHOICES) in e.value.message


def test_choices_cap_at_the_worker_and_the_router(cluster: SimpleNamespace) -> None:
    for target in ("gen", "router"):
        t0 = time.monotonic()
        status, answer = _post(cluster, target, C, {"model": NAME, "max_tokens": 1,
                                                    "prompt": ["a"] * (P.MAX_CHOICES + 1)})
        assert status == 400 and answer["error"]["param"] == "prompt", (target, answer)
        assert time.monotonic() - t0 < 5  # refused before anything ran


def test_register_refuses_addresses_that_are_no_host_port(cluster: SimpleNamespace) -> None:
    """A registration's url becomes the base of every call to the worker. Before, anything
    with a ':' was taken: a path, user info, port 0 or 99999, spaces, control characters."""
    m = cluster.router.membership
    before = set(m.by_url)
    for url in ["", ":", ":80", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1",
                "127.0.0.1:80/x", "user@127.0.0.1:80", "127.0.0.1:1?x=1", "a b:1", "\x00:1",
                "h\u00e9:1", "h:1#f", "::1:1", "[::g]:1", "127.0.0.1:1\r\nX: y",
                "https://h:1", "x" * 300 + ":1", 5, None]:
        body = {"role": "generation", "url": url}
        data = json.dumps(body).encode()
        status, _, raw = cluster.loop.run(send(cluster.clients["router"], REGISTER, data, {
            "Content-Type": "application/json",
            **sign_http(TOKEN, "POST", REGISTER, data, audience=AUDIENCE["router"])}))
        assert status == 400, (url, raw)
        assert json.loads(raw)["error"]["param"] == "url", (url, raw)
    assert set(m.by_url) == before
    for url, normal in (("127.0.0.1:1", "127.0.0.1:1"), ("http://localhost:02/", "localhost:2"),
                        ("[::1]:3", "[::1]:3"), ("worker_1.example:4", "worker_1.example:4")):
        data = json.dumps({"role": "generation", "url": url}).encode()
        status, _, raw = cluster.loop.run(send(cluster.clients["router"], REGISTER, data, {
            "Content-Type": "application/json",
            **sign_http(TOKEN, "POST", REGISTER, data, audience=AUDIENCE["router"])}))
        assert status == 200 and json.loads(raw)["url"] == normal, (url, raw)
        cluster.loop.run(_unregister(m, url))
        assert normal not in m.by_url
    assert set(m.by_url) == before


def test_the_router_answers_other_http_versions_as_http_1_1(cluster: SimpleNamespace) -> None:
    """Before: aiohttp echoed the client's version in the status line ("HTTP/2.0 505",
    "HTTP/0.9 505"); a server answers with its own (RFC 9110 section 6.2)."""
    port = int(cluster.router_url.rpartition(":")[2])
    for line in (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", b"GET /health\r\n\r\n",
                 b"POST /v1/completions HTTP/2.0\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(line)
            out = b""
            while chunk := s.recv(65536):  # closed after the answer
                out += chunk
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 505 "), out[:200]
        assert json.loads(body)["error"]["code"] == "http_version"
