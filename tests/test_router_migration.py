"""Migration (issue 40): kill -9 of the generation worker that is serving a request; the router
moves the request to another worker and the client's answer is an uninterrupted run's.

One context and three generation workers (``disagg serve`` processes on ephemeral ports, TCP
KV transfer, and UCX where ``ucxx`` imports) and, in this process, four routers over them:
disaggregated (the two calls), aggregated (the generation workers serve requests whole),
disaggregated with ``kv_streaming``, and a pair of the context worker and one generation worker
(whose death leaves the context worker to serve the move). Each case sends one request, kills
the generation worker serving it (the one the router counts a request on) after the client got
a few chunks (streamed) or once that worker holds the request's KV (not streamed: between the
pull and the end of decoding), and starts it again on its port for the next cases. The
reference is an aggregated worker in this process (``server_fixtures.reference_server``)
answering the same request. Properties:

- the text is the reference's (greedy and seeded, with penalties and a stop string that falls
  after the kill), and so are the completions logprobs (tokens, offsets, values);
- no seam: one chunk id and time, one chat role chunk, one usage chunk with the reference's
  counts, ``[DONE]`` once, no error event, no token-id comment line (the router strips them);
- the router counts the move in ``disagg_router_migrations_total{kind}`` (``resume`` when the
  stream had begun, ``restart`` when nothing had reached the client);
- afterwards no worker holds a KV block and the context worker holds no lease.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from router_fixtures import LoopThread, metric
from server_fixtures import (
    WorkerProc,
    reference_server,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

from disagg.contracts.cluster import parse_cluster_config
from disagg.router.app import ROUTER_KEY, build_router_app, start_router
from disagg.transfer.ucx import ucx_available

UCX_OK, UCX_WHY = ucx_available()

pytestmark = pytest.mark.slow

NAME = "tiny"
TOKEN = "migration-cluster-secret"
C, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_TOKENS = 240  # long enough that the kill lands mid-answer
KILL_AFTER_CHUNKS = 4
START_TIMEOUT_S = 120.0
FLAGS = ["--served-model-name", NAME, "--log-level", "warning", "--tokens-per-block", "16",
         "--kv-cache-tokens", "4096", "--max-model-len", "512", "--max-num-tokens", "256",
         "--max-batch-size", "16"]
PROMPT = "The harbour was quiet when the boats came back in the evening, and nobody spoke."
MESSAGES = [{"role": "user", "content": "Tell me about the boats in the harbour."}]


@pytest.fixture(scope="module")
def ref_url(model_dir: str) -> Iterator[str]:
    """An aggregated worker in this process: the uninterrupted answers."""
    with reference_server(model_dir, NAME) as url:
        yield url


@pytest.fixture(scope="module", params=["TCP", "UCX"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            model_dir: str, ref_url: str) -> Iterator[SimpleNamespace]:
    backend = request.param
    if backend == "UCX" and not UCX_OK:
        pytest.skip(UCX_WHY)
    tmp = tmp_path_factory.mktemp("migration-logs")
    env = {"DISAGG_CLUSTER_TOKEN": TOKEN}
    common = [*FLAGS, "--kv-transfer-backend", backend]
    flags = {"ctx": ["--role", "context", "--kv-lease-ttl", "5", *common],
             "gen": ["--role", "generation", *common]}
    workers = {name: start_worker_proc(tmp, model_dir, name, flags[name[:3]], env)
               for name in ("ctx0", "gen0", "gen1", "gen2")}
    ns = SimpleNamespace(model_dir=model_dir, tmp=tmp, env=env, flags=flags, workers=workers,
                         routers={})
    loop = LoopThread()
    runners = []
    try:
        ns.ref_url = ref_url
        wait_all_healthy(list(workers.values()), START_TIMEOUT_S)
        gens = [workers[n].addr for n in ("gen0", "gen1", "gen2")]
        base = {"model": model_dir, "health_check_interval_sec": 0.3, "max_retries": 1}
        configs = {
            "disagg": {**base, "context_servers": {"urls": [workers["ctx0"].addr]},
                       "generation_servers": {"urls": gens}},
            "aggregated": {**base, "generation_servers": {"urls": gens}},
            "kv_streaming": {**base, "kv_streaming": True,
                             "context_servers": {"urls": [workers["ctx0"].addr]},
                             "generation_servers": {"urls": gens}},
            # one generation worker: once it is dead, the context worker serves the move
            "pair": {**base, "context_servers": {"urls": [workers["ctx0"].addr]},
                     "generation_servers": {"urls": [workers["gen0"].addr]}}}
        for kind, cfg in configs.items():
            app = build_router_app(parse_cluster_config(cfg, kind), cluster_token=TOKEN)
            runner, port = loop.run(start_router(app, "127.0.0.1", 0))
            runners.append(runner)
            ns.routers[kind] = SimpleNamespace(url=f"http://127.0.0.1:{port}",
                                               membership=app[ROUTER_KEY].membership)
        yield ns
    finally:
        for runner in runners:
            loop.run(runner.cleanup())
        stop_all(list(ns.workers.values()))
        loop.close()


# ---- one request, read as a client reads it ---------------------------------------------------


def read_stream(url: str, path: str, body: dict[str, Any],
                on_chunk: Callable[[int], None] | None = None) -> SimpleNamespace:
    """Send a streamed request; every SSE line checked as a client sees it (``on_chunk(n)``
    after the n-th chunk with text)."""
    got = SimpleNamespace(text="", ids=set(), role_chunks=0, usages=[], done=0, errors=[],
                          tokens=[], offsets=[], top=[], lps=[], finish=None)
    n = 0
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), f"not an SSE data line: {line[:200]!r}"
            if line == "data: [DONE]":
                got.done += 1
                continue
            assert not got.done, "data after [DONE]"
            chunk = json.loads(line[6:])
            if "error" in chunk:
                got.errors.append(chunk["error"])
                continue
            got.ids.add((chunk["id"], chunk["created"]))
            if chunk.get("usage"):
                got.usages.append(chunk["usage"])
            for ch in chunk["choices"]:
                if path == CHAT:
                    delta = ch["delta"]
                    got.role_chunks += "role" in delta
                    text = delta.get("content") or ""
                    for entry in (ch.get("logprobs") or {}).get("content") or []:
                        got.tokens.append(entry["token"])
                        got.lps.append(entry["logprob"])
                        got.top.append([t["token"] for t in entry["top_logprobs"]])
                else:
                    text = ch["text"]
                    lp = ch.get("logprobs")
                    if lp:
                        got.tokens += lp["tokens"]
                        got.offsets += lp["text_offset"]
                        got.lps += lp["token_logprobs"]
                        got.top += [sorted(t) for t in lp["top_logprobs"]]
                got.finish = ch.get("finish_reason") or got.finish
                if text:
                    got.text += text
                    n += 1
                    if on_chunk is not None:
                        on_chunk(n)
    return got


def whole_text(answer: dict[str, Any], path: str) -> str:
    ch = answer["choices"][0]
    return ch["message"]["content"] if path == CHAT else ch["text"]


def reference(ns: SimpleNamespace, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The aggregated reference worker's whole answer to ``body`` (not streamed)."""
    whole = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(ns.ref_url + path, json=whole, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ---- the worker's side: token ids in the stream, a resumed request ----------------------------


def sse_events(url: str, path: str, body: dict[str, Any]) -> list[tuple[list[int] | None, str]]:
    """A stream's events as a router reads them: (the token ids of its comment line, or None
    when it has none; its data)."""
    events: list[tuple[list[int] | None, str]] = []
    ids: list[int] | None = None
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": token_ids "):
                assert ids is None, "two id lines in one event"
                rest = line.removeprefix(": token_ids ")
                ids = [int(t) for t in rest.split(",")] if rest else []
            elif line.startswith("data: "):
                events.append((ids, line[6:]))
                ids = None
            else:
                assert not line, line
    return events


def texts(events: list[tuple[list[int] | None, str]], path: str) -> list[str]:
    out = []
    for _, data in events:
        if data == "[DONE]":
            continue
        for ch in json.loads(data)["choices"]:
            out.append((ch["delta"].get("content") or "") if path == CHAT else ch["text"])
    return out


RESUME_BODIES = {
    "completions-greedy-stop-logprobs": (C, {"prompt": PROMPT, "temperature": 0, "logprobs": 1,
                                             "stream_options": {"include_usage": True}}),
    "completions-seeded-penalties-min-tokens": (
        C, {"prompt": PROMPT, "temperature": 1.0, "seed": 3, "top_k": 20, "min_tokens": 30,
            "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2}),
    "chat-greedy-usage": (CHAT, {"messages": MESSAGES, "temperature": 0,
                                 "stream_options": {"include_usage": True,
                                                    "continuous_usage_stats": True}}),
    "chat-seeded-logprobs": (CHAT, {"messages": MESSAGES, "temperature": 0.9, "seed": 9,
                                    "logprobs": True, "top_logprobs": 1}),
}


@pytest.mark.parametrize("name", list(RESUME_BODIES))
def test_a_resumed_request_continues_the_answer_exactly(ref_url: str, name: str) -> None:
    """One worker, no kill: the stream of a request asking for token ids, cut after each of
    a few events as a failure would cut it, and continued by a resumed request with the ids
    and the answer's id: the events joined are the uninterrupted stream's events (greedy and
    seeded, penalties, min_tokens, a stop string held back across the cut, logprobs, usage)."""
    path, extra = RESUME_BODIES[name]
    body = {"model": NAME, "max_tokens": 40, "ignore_eos": True, "stream": True, **extra}
    plain = sse_events(ref_url, path, body)
    full_text = "".join(texts(plain, path))
    if "stop" in name:
        body["stop"] = [late_stop(full_text)]
        plain = sse_events(ref_url, path, body)
        full_text = "".join(texts(plain, path))
    asked = sse_events(ref_url, path, {**body, "disaggregated_params": {
        "request_type": "context_and_generation", "token_ids": True}})
    # the ids change nothing else, and every chunk with choices comes with its ids
    assert same(norm(asked), norm(plain))
    assert all(ids is not None for ids, d in asked if d != "[DONE]" and json.loads(d)["choices"])
    first = json.loads(asked[0][1])
    all_ids = [t for ids, _ in asked for t in ids or []]
    assert len(all_ids) == 40 or "stop" in name
    for cut in sorted({1, 2, 5, len(asked) // 2, len(asked) - 3}):
        sent = asked[:cut]
        done_ids = [t for ids, _ in sent for t in ids or []]
        resumed = sse_events(ref_url, path, {**body, "disaggregated_params": {
            "request_type": "context_and_generation", "token_ids": True,
            "resume": {"output_token_ids": done_ids, "id": first["id"],
                       "created": first["created"]}}})
        # the same events after the cut (text, logprobs and their offsets, finish, usage, id
        # and time), as the failed worker would have sent them
        assert same([d for _, d in resumed], [d for _, d in asked[cut:]]), cut
        assert "".join(texts(sent, path)) + "".join(texts(resumed, path)) == full_text
        assert [t for ids, _ in resumed for t in ids or []] == all_ids[len(done_ids):]


def norm(events: list[tuple[list[int] | None, str]]) -> list[str]:
    """The events' data with the answer's id and time blanked (two requests' differ)."""
    out = []
    for _, d in events:
        if d != "[DONE]":
            chunk = json.loads(d)
            chunk["id"], chunk["created"] = "-", 0
            d = json.dumps(chunk)
        out.append(d)
    return out


def same(a: list[str], b: list[str]) -> bool:
    """The same events, logprob values within float noise (a resumed worker computes the KV
    of the tokens before the cut in one prefill, the uninterrupted one decoded them)."""
    def load(d: str) -> Any:
        if d == "[DONE]":
            return d
        chunk = json.loads(d)
        if chunk.get("usage"):  # (prefix-cache hits depend on what ran before)
            chunk["usage"].pop("prompt_tokens_details", None)
        return chunk

    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, float) or isinstance(y, float):
            return isinstance(x, int | float) and isinstance(y, int | float) and abs(x - y) < 1e-4
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, list):
            return isinstance(y, list) and len(x) == len(y) and all(map(eq, x, y))
        return x == y

    return len(a) == len(b) and all(eq(load(x), load(y)) for x, y in zip(a, b, strict=True))


def test_a_resume_is_checked(ref_url: str) -> None:
    """Malformed or unsupported resume fields get a 400 naming the field."""
    base = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    ok = {"output_token_ids": [1, 2], "id": "cmpl-x", "created": 1}
    for extra, resume in [({}, {**ok, "output_token_ids": "12"}),
                          ({}, {**ok, "output_token_ids": [10**9]}),
                          ({}, {**ok, "output_token_ids": list(range(1, 9))}),
                          ({}, {**ok, "id": "a b"}), ({}, {**ok, "created": -1}),
                          ({"stream": False}, ok), ({"echo": True}, ok), ({"n": 2}, ok)]:
        r = httpx.post(ref_url + C, timeout=60, json={**base, **extra, "disaggregated_params": {
            "request_type": "context_and_generation", "resume": resume}})
        assert r.status_code == 400, (extra, resume, r.text)
        assert r.json()["error"]["param"].startswith("disaggregated_params.resume"), r.text


# ---- killing the worker that serves it --------------------------------------------------------


def gen_names(ns: SimpleNamespace) -> list[str]:
    return [n for n in ns.workers if n.startswith("gen")]


def serving(ns: SimpleNamespace, rt: SimpleNamespace) -> str | None:
    """The generation worker the router counts a request on (None: none yet)."""
    busy = [n for n in gen_names(ns)
            if (w := rt.membership.by_url.get(ns.workers[n].addr)) is not None
            and w.active_requests > 0]
    assert len(busy) <= 1, busy
    return busy[0] if busy else None


def kill(ns: SimpleNamespace, name: str) -> None:
    """SIGKILL ``name`` and start it again on its port (ready for a later case)."""
    old: WorkerProc = ns.workers[name]
    old.proc.kill()
    assert old.proc.wait(10) == -9
    ns.workers[name] = start_worker_proc(ns.tmp, ns.model_dir, name, ns.flags["gen"], ns.env,
                                         port=old.port)
    ns.killed.append(name)


def ready(ns: SimpleNamespace) -> None:
    """Every worker up and every router sees all of them healthy."""
    wait_all_healthy(list(ns.workers.values()), START_TIMEOUT_S)
    for rt in ns.routers.values():
        wait_for(lambda rt=rt: all(w.healthy for w in rt.membership.by_url.values()), 30,
                 0.02, what="the router sees every worker healthy")


CASES = {
    # name: (router, path, streamed, extra body)
    "completions-stream-greedy-logprobs": (
        "disagg", C, True, {"temperature": 0, "logprobs": 2,
                            "stream_options": {"include_usage": True}}),
    "completions-stream-seeded-penalties-stop": (
        "disagg", C, True, {"temperature": 1.0, "seed": 7, "top_p": 0.95,
                            "frequency_penalty": 0.4, "repetition_penalty": 1.1}),
    "chat-stream-greedy": (
        "disagg", CHAT, True, {"temperature": 0, "stream_options": {"include_usage": True}}),
    "chat-stream-seeded-logprobs-aggregated": (
        "aggregated", CHAT, True, {"temperature": 0.8, "seed": 11, "logprobs": True,
                                   "top_logprobs": 2}),
    "completions-stream-greedy-kv-streaming": (
        "kv_streaming", C, True, {"temperature": 0}),
    "chat-stream-greedy-to-the-context-worker": ("pair", CHAT, True, {"temperature": 0}),
    "completions-whole-greedy": ("disagg", C, False, {"temperature": 0}),
    "chat-whole-seeded": ("disagg", CHAT, False, {"temperature": 1.0, "seed": 5}),
}


def late_stop(text: str) -> str:
    """A 3-character piece of ``text`` that first appears in its second half."""
    for i in range(len(text) // 2, len(text) - 3):
        piece = text[i:i + 3]
        if piece.strip() and text.find(piece) >= len(text) // 2:
            return piece
    raise AssertionError(f"no late stop string in {text!r}")


@pytest.mark.parametrize("case", list(CASES))
def test_kill_9_of_the_generation_worker_mid_answer(cluster: SimpleNamespace, case: str
                                                     ) -> None:
    ns = cluster
    ns.killed = []
    kind, path, streamed, extra = CASES[case]
    rt = ns.routers[kind]
    ready(ns)
    body: dict[str, Any] = {"model": NAME, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                            **extra, **({"prompt": PROMPT} if path == C
                                        else {"messages": MESSAGES})}
    if "stop" in case:
        body["stop"] = [late_stop(whole_text(reference(ns, path, body), path))]
    ref = reference(ns, path, body)
    ref_text = whole_text(ref, path)
    if "stop" in case:
        assert ref["choices"][0]["finish_reason"] == "stop"
    moves = {k: metric(rt.url, "disagg_router_migrations_total", kind=k)
             for k in ("resume", "restart")}

    if streamed:
        def on_chunk(n: int) -> None:
            if n == KILL_AFTER_CHUNKS:
                victim = serving(ns, rt)
                assert victim is not None, "no generation worker is serving the stream"
                kill(ns, victim)

        got = read_stream(rt.url, path, {**body, "stream": True}, on_chunk)
        assert ns.killed, "the stream ended before the kill"
        assert got.errors == [] and got.done == 1, got
        assert got.text == ref_text
        assert got.finish == ref["choices"][0]["finish_reason"]
        assert len(got.ids) == 1, got.ids  # one answer: one id and time throughout
        if path == CHAT:
            assert got.role_chunks == 1
        if body.get("stream_options"):  # usage once, counted once
            keys = ("prompt_tokens", "completion_tokens", "total_tokens")
            assert [{k: u[k] for k in keys} for u in got.usages] == [
                {k: ref["usage"][k] for k in keys}], got.usages
        if body.get("logprobs"):
            lp = ref["choices"][0]["logprobs"]
            if path == CHAT:
                entries = lp["content"]
                assert got.tokens == [e["token"] for e in entries]
                assert got.top == [[t["token"] for t in e["top_logprobs"]] for e in entries]
                ref_lps = [e["logprob"] for e in entries]
            else:
                assert got.tokens == lp["tokens"] and got.offsets == lp["text_offset"]
                assert got.top == [sorted(t) for t in lp["top_logprobs"]]
                ref_lps = lp["token_logprobs"]
            assert got.lps == pytest.approx(ref_lps, abs=1e-4)
        moved = "resume"
    else:
        result: dict[str, Any] = {}

        def send() -> None:
            result["r"] = httpx.post(rt.url + path, json=body, timeout=120)

        t = threading.Thread(target=send, name="migration-client")
        t.start()
        try:
            # the generation worker holds the request's KV: pulled, decoding
            wait_for(lambda: (v := serving(ns, rt)) is not None
                     and ns.workers[v].blocks_used() > 0, 30, 0.01,
                     what="a generation worker decoding the request")
            victim = serving(ns, rt)
            assert victim is not None, "the request ended before the kill"
            kill(ns, victim)
        finally:
            t.join(120)
        assert not t.is_alive()
        r = result["r"]
        assert r.status_code == 200, r.text
        assert whole_text(r.json(), path) == ref_text
        assert r.json()["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
        moved = "restart"
    assert metric(rt.url, "disagg_router_migrations_total", kind=moved) == moves[moved] + 1

    # afterwards: nothing held anywhere (the context lease is freed by its reader or its TTL)
    t0 = time.monotonic()
    ready(ns)
    for w in ns.workers.values():
        wait_for(lambda w=w: w.blocks_used() == 0, 15, 0.05, what=f"{w.name}: no KV block")
    print(f"{case}: moved ({moved}) after killing {ns.killed}; workers back in "
          f"{time.monotonic() - t0:.1f} s")


# ---- the relay's reading of a stream ----------------------------------------------------------


def test_the_relay_takes_the_token_id_lines_out_of_the_stream() -> None:
    from disagg.router.relay import RequestState, server_error_event, take_token_ids

    st = RequestState("/v1/completions", ids_asked=True)
    first = (b': token_ids \ndata: {"id":"cmpl-1","created":5,"choices":[{"delta":'
             b'{"role":"assistant","content":""}}]}\n\n')
    assert take_token_ids(st, first) == first[first.index(b"data"):]
    assert st.token_ids == [] and st.answer_id == ("cmpl-1", 5)
    # text that looks like the line is no line: JSON data holds no raw newline
    tricky = b'data: {"choices":[{"text":"\\n: token_ids 9"}]}\n\n'
    two = (b": token_ids 1,2\n" + tricky + b": token_ids 3\ndata: {\"x\":1}\n\n")
    assert take_token_ids(st, two) == tricky + b'data: {"x":1}\n\n'
    assert st.token_ids == [1, 2, 3] and st.answer_id == ("cmpl-1", 5)
    assert take_token_ids(st, b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    # an in-band error: the worker's own failure (moves) or the client's (relayed)
    server = b'data: {"x":1}\n\ndata: {"error":{"message":"m","type":"internal_server_error"}}\n\n'
    assert server_error_event(server) == server.index(b'data: {"error"')
    client = b'data: {"error":{"message":"m","type":"invalid_request_error"}}\n\n'
    assert server_error_event(client) == -1 and server_error_event(b'data: {"x":1}\n\n') == -1
