"""Context -> generation end to end with real worker processes (single-rank workers).

The test plays the router: call 1 goes to a ``--role context`` worker with
``request_type: context_only``; unless that answer is final, call 2 goes to a ``--role
generation`` worker with ``request_type: generation_only`` and the context's params, signed
with the cluster token as the router signs it. Greedy outputs must equal an aggregated
worker's (served in this process), over TCP and UCX. Unsigned generation_only requests: the
worker trusts their context addresses only when allow-listed, and never caches their KV.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import (
    WorkerProc,
    health_ok,
    reference_server,
    signed,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)
from transfer_fixtures import FlippingRelay

from disagg.transfer.ucx import ucx_available

NAME = "tiny"
TOKEN = "e2e-cluster-secret"
COMMON = ["--kv-cache-tokens", "4096", "--max-model-len", "512", "--max-num-tokens", "256",
          "--max-batch-size", "32"]
PROMPTS = ["The harbour was quiet", "Memory is organised in small blocks of tokens, and "
           "every block holds sixteen of them.", "Numbers: 1, 2, 3"]
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
START_TIMEOUT = 90.0
UCX_OK, UCX_WHY = ucx_available()
C, CHAT_PATH = "/v1/completions", "/v1/chat/completions"


Worker = WorkerProc


def _start(tmp: Path, model_dir: str, name: str, role: str, *flags: str) -> Worker:
    return start_worker_proc(tmp, model_dir, name, [
        "--role", role, "--served-model-name", NAME, "--log-level", "warning", *COMMON, *flags],
        {"DISAGG_CLUSTER_TOKEN": TOKEN})


def _wait_healthy(workers: list[Worker]) -> None:
    wait_all_healthy(workers, START_TIMEOUT)


_stop = stop_all


@pytest.fixture(scope="module")
def tcp(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    """TCP context / generation workers (plus a B=8 generation worker, a short-ttl context
    worker and one the tests kill), all started at once."""
    tmp = tmp_path_factory.mktemp("tcp-logs")
    b = ["--kv-transfer-backend", "TCP"]
    ws = {
        "ctx": _start(tmp, model_dir, "ctx", "context", *b, "--tokens-per-block", "16"),
        "gen": _start(tmp, model_dir, "gen", "generation", *b, "--tokens-per-block", "16"),
        "gen8": _start(tmp, model_dir, "gen8", "generation", *b, "--tokens-per-block", "8"),
        # trusts unsigned requests that name local context workers
        "gen_allow": _start(tmp, model_dir, "gen_allow", "generation", *b,
                            "--tokens-per-block", "16", "--kv-peer-allowlist", "127.0.0.1"),
        "ctx_short": _start(tmp, model_dir, "ctx_short", "context", *b,
                            "--tokens-per-block", "16", "--kv-lease-ttl", "0.3"),
        "ctx_victim": _start(tmp, model_dir, "ctx_victim", "context", *b,
                             "--tokens-per-block", "16"),
    }
    try:
        _wait_healthy(list(ws.values()))
        yield ws
    finally:
        _stop(list(ws.values()))


@pytest.fixture(scope="module")
def ucx(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    if not UCX_OK:
        pytest.skip(UCX_WHY)
    tmp = tmp_path_factory.mktemp("ucx-logs")
    b = ["--kv-transfer-backend", "UCX"]
    ws = {"ctx": _start(tmp, model_dir, "ctx_ucx", "context", *b),
          "gen": _start(tmp, model_dir, "gen_ucx", "generation", *b)}
    try:
        _wait_healthy(list(ws.values()))
        yield ws
    finally:
        _stop(list(ws.values()))


@pytest.fixture(scope="module")
def reference(model_dir: str) -> Iterator[str]:
    """An aggregated worker in this process: the expected outputs."""
    with reference_server(model_dir, NAME) as url:
        yield url


# ---- the router's two calls -----------------------------------------------------------------


def _post(url: str, path: str, body: dict[str, Any], token: str | None = TOKEN
          ) -> httpx.Response:
    """POST as the router does: signed with the cluster token (``token=None``: unsigned)."""
    if token is None:
        return httpx.post(url + path, json=body, timeout=60)
    return httpx.post(url + path, timeout=60, **signed(token, "POST", path, body, to=url))


def _text_of(path: str, body: dict[str, Any]) -> str:
    ch = body["choices"][0]
    return ch["text"] if path == C else ch["message"]["content"]


def _stream(url: str, path: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    text, events = "", []
    with httpx.stream("POST", url + path, timeout=60,
                      **signed(TOKEN, "POST", path, body, to=url)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            for ch in ev.get("choices", []):
                text += ch.get("text", "") if path == C else ch["delta"].get("content", "")
    return text, events


def context_call(ctx: Worker, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The router's context call: the client's request as sent, answered whole."""
    r = _post(ctx.url, path, {**body, "disaggregated_params": {"request_type": "context_only"}})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"  # (whole when stream: true too)
    return r.json()


def generation_body(path: str, body: dict[str, Any], ctx_answer: dict[str, Any]
                    ) -> dict[str, Any]:
    # (The params carry the context worker's prompt_token_ids: no second tokenization.)
    return {**body, "disaggregated_params": {**ctx_answer["disaggregated_params"],
                                             "request_type": "generation_only"}}


def disagg_text(ctx: Worker, gen: Worker, path: str, body: dict[str, Any]) -> str:
    answer = context_call(ctx, path, body)
    if answer["disaggregated_params"] is None:
        return _text_of(path, answer)
    gbody = generation_body(path, body, answer)
    if body.get("stream"):
        return _stream(gen.url, path, gbody)[0]
    r = _post(gen.url, path, gbody)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(answer["prompt_token_ids"])
    # The prefill's prefix-cache hit is the context worker's, and the usage says so.
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert answer["disaggregated_params"]["cached_tokens"] == cached
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    return _text_of(path, out)


def ref_text(ref: str, path: str, body: dict[str, Any]) -> str:
    if body.get("stream"):
        return _stream(ref, path, body)[0]
    r = _post(ref, path, body)
    assert r.status_code == 200, r.text
    return _text_of(path, r.json())


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for p in PROMPTS:
        base = {"model": NAME, "prompt": p, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        out += [(C, base), (C, {**base, "stream": True})]
    chat = {"model": NAME, "messages": CHAT, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    out += [(CHAT_PATH, chat), (CHAT_PATH, {**chat, "stream": True})]
    # Seeded sampling: the generation worker continues the context worker's first draw.
    seeded = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 2.0,
              "top_p": 0.95, "seed": 11, "ignore_eos": True}
    out += [(C, seeded), (C, {**seeded, "seed": 2**33 + 5, "top_k": 40, "stream": True})]
    return out


def _check_same(ctx: Worker, gen: Worker, ref: str) -> None:
    for path, body in _bodies():
        assert disagg_text(ctx, gen, path, body) == ref_text(ref, path, body), (path, body)
    ctx.wait_blocks(0)  # every lease confirmed by the reader: nothing held
    gen.wait_blocks(0)


# ---- tests ----------------------------------------------------------------------------------


def test_tcp_outputs_match_aggregated(tcp: dict[str, Worker], reference: str) -> None:
    _check_same(tcp["ctx"], tcp["gen"], reference)
    info = tcp["ctx"].info()["kv_transfer"]
    assert info["backend"] == "TCP" and info["addresses"] and info["worker_id"]
    metrics = httpx.get(tcp["gen"].url + "/metrics").text
    assert "disagg_kv_transfer_bytes_total" in metrics
    assert "disagg_kv_transfer_seconds_bucket" in metrics
    # Every pull was installed, most into a reused receive buffer (recv_pool.py): the outputs
    # above match the aggregated worker's all the same.
    installs = re.search(r"^disagg_kv_installs_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert installs is not None and float(installs.group(1)) >= len(_bodies())
    assert "disagg_kv_install_seconds_total" in metrics
    assert "disagg_kv_pull_seconds_total" in metrics


def test_tcp_differing_block_sizes(tcp: dict[str, Worker], reference: str) -> None:
    _check_same(tcp["ctx"], tcp["gen8"], reference)


def test_ucx_outputs_match_aggregated(ucx: dict[str, Worker], reference: str) -> None:
    _check_same(ucx["ctx"], ucx["gen"], reference)
    assert ucx["ctx"].info()["kv_transfer"]["backend"] == "UCX"


def test_context_answer_schema_and_first_token(tcp: dict[str, Worker]) -> None:
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 2}
    answer = context_call(tcp["ctx"], C, body)
    dp = answer["disaggregated_params"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert len(dp["first_gen_tokens"]) == 1 and dp["first_gen_logprobs"]
    assert dp["num_tokens"] == len(answer["prompt_token_ids"]) == len(dp["prompt_token_ids"])
    assert dp["backend"] == "TCP" and dp["layout"]["tp_size"] == 1
    assert tcp["ctx"].blocks_used() == len(dp["block_ids"])
    # The stream's first token is the context's first token.
    _, events = _stream(tcp["gen"].url, C, {**generation_body(C, body, answer),
                                            "stream": True})
    first = next(e for e in events if e["choices"] and e["choices"][0]["text"])
    assert first["choices"][0]["text"] == answer["choices"][0]["text"]
    tcp["ctx"].wait_blocks(0)
    tcp["gen"].wait_blocks(0)


def test_first_token_final_is_answered_by_context(tcp: dict[str, Worker],
                                                  reference: str) -> None:
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0}
    answer = context_call(tcp["ctx"], C, body)
    assert answer["disaggregated_params"] is None
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["text"] == ref_text(reference, C, body)
    tcp["ctx"].wait_blocks(0)


def test_wrong_role_and_bad_params_are_400(tcp: dict[str, Worker]) -> None:
    body = {"model": NAME, "prompt": "x", "max_tokens": 4}
    r = _post(tcp["ctx"].url, C, {**body, "disaggregated_params": {
        "request_type": "generation_only"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params"
    r = _post(tcp["gen"].url, C, {**body, "disaggregated_params": {
        "request_type": "generation_only", "first_gen_tokens": [1]}})
    assert r.status_code == 400 and "disaggregated_params." in r.json()["error"]["message"]
    # Ordinary requests work on both roles.
    for w in (tcp["ctx"], tcp["gen"]):
        assert _post(w.url, C, body).status_code == 200


def test_refused_generation_request_releases_context_blocks(tcp: dict[str, Worker]) -> None:
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    answer = context_call(tcp["ctx"], C, body)
    assert tcp["ctx"].blocks_used() > 0
    bad = {**generation_body(C, body, answer), "temperature": -1}  # refused after parsing
    r = _post(tcp["gen"].url, C, bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    tcp["ctx"].wait_blocks(0, timeout=10)  # released now, not after the 30 s lease


def test_generation_disconnect_frees_both_sides(tcp: dict[str, Worker]) -> None:
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    answer = context_call(tcp["ctx"], C, body)
    with httpx.stream("POST", tcp["gen"].url + C, timeout=60,
                      **signed(TOKEN, "POST", C, generation_body(C, body, answer),
                               to=tcp["gen"].url)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then hang up mid-stream
    tcp["ctx"].wait_blocks(0)
    tcp["gen"].wait_blocks(0)


def test_expired_lease_fails_cleanly(tcp: dict[str, Worker]) -> None:
    ctx, gen = tcp["ctx_short"], tcp["gen"]
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    answer = context_call(ctx, C, body)
    ctx.wait_blocks(0, timeout=10)  # the 0.3 s lease expired and the sweep freed the blocks
    r = _post(gen.url, C, generation_body(C, body, answer))
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed" and "expired_lease" in err["message"]
    # Streaming: the failure still comes before any token, as an HTTP error.
    r = _post(gen.url, C, {**generation_body(C, body, answer), "stream": True})
    assert r.status_code == 502
    gen.wait_blocks(0)
    assert "disagg_kv_leases_expired_total" in httpx.get(ctx.url + "/metrics").text


def test_dead_context_worker_fails_request_generation_stays_healthy(
        tcp: dict[str, Worker], reference: str) -> None:
    ctx, gen = tcp["ctx_victim"], tcp["gen"]
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    answer = context_call(ctx, C, body)
    ctx.proc.kill()
    ctx.proc.wait(10)
    r = _post(gen.url, C, generation_body(C, body, answer))
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "kv_transfer_failed"
    gen.wait_blocks(0)
    assert health_ok(gen.url)
    # and it keeps serving disaggregated requests from a live context worker
    assert disagg_text(tcp["ctx"], gen, C, body) == ref_text(reference, C, body)


# ---- trust: signed requests, the allow-list, the prefix cache ---------------------------------


def _cached_tokens(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_unsigned_request_naming_unlisted_context_worker_is_refused(
        tcp: dict[str, Worker], reference: str) -> None:
    """Design rule 2 with a real context answer: unsigned -> 400 on a generation worker without
    an allow-list (the lease stays: releasing would mean connecting), served by one whose
    allow-list holds the context worker's host."""
    ctx = tcp["ctx"]
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    answer = context_call(ctx, C, body)
    gbody = generation_body(C, body, answer)
    r = _post(tcp["gen"].url, C, gbody, token=None)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "disaggregated_params.addresses"
    assert "disaggregated_params.addresses" in err["message"]
    assert ctx.blocks_used() > 0  # not released by the refusing worker
    r = _post(tcp["gen_allow"].url, C, gbody, token=None)
    assert r.status_code == 200, r.text
    assert _text_of(C, r.json()) == ref_text(reference, C, body)
    ctx.wait_blocks(0)
    tcp["gen_allow"].wait_blocks(0)


def test_forged_generation_request_never_changes_what_honest_requests_decode(
        tcp: dict[str, Worker], reference: str) -> None:
    """Design rule 3: an unsigned (allow-listed) generation_only request claims prompt P but
    carries the KV of prompt Q. It decodes privately; a later honest request for P on the same
    worker decodes exactly what an aggregated worker does, with nothing taken from a cache."""
    ctx, gen = tcp["ctx"], tcp["gen_allow"]
    n = 3 * 16 + 5  # three full blocks (the ones a prefix cache would reuse) and a partial one
    p = [100 + (7 * i) % 300 for i in range(n)]
    q = [50 + (11 * i) % 350 for i in range(n)]
    answer = context_call(ctx, C, {"model": NAME, "prompt": q, "max_tokens": 8,
                                   "temperature": 0})
    forged = {"model": NAME, "prompt": p, "max_tokens": 4, "temperature": 0,
              "ignore_eos": True, "disaggregated_params": {
                  **answer["disaggregated_params"], "prompt_token_ids": p,
                  "request_type": "generation_only"}}
    r = _post(gen.url, C, forged, token=None)
    assert r.status_code == 200, r.text  # served (allow-listed), with Q's KV
    ctx.wait_blocks(0)
    gen.wait_blocks(0)
    honest = {"model": NAME, "prompt": p, "max_tokens": 12, "temperature": 0,
              "ignore_eos": True}
    r = _post(gen.url, C, honest, token=None)
    assert r.status_code == 200, r.text
    assert _cached_tokens(r.json()) == 0
    assert _text_of(C, r.json()) == ref_text(reference, C, honest)


def test_signed_generation_request_fills_the_prefix_cache(tcp: dict[str, Worker],
                                                          reference: str) -> None:
    """The router's (signed) path: the pulled KV is the cluster's own, so later requests on
    the generation worker reuse it."""
    ctx, gen = tcp["ctx"], tcp["gen"]
    prompt = [200 + (13 * i) % 250 for i in range(3 * 16 + 2)]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    assert disagg_text(ctx, gen, C, body) == ref_text(reference, C, body)
    r = _post(gen.url, C, {**body, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert _cached_tokens(r.json()) == 3 * 16
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


# ---- KV streaming: both calls at once ---------------------------------------------------------

LONG = " ".join(["Blocks of tokens move between workers while the prefill runs."] * 10)


def stream_params(ctx: Worker, stream_id: str) -> dict[str, Any]:
    """The generation call's ``kv_stream`` (what the router takes from /server_info)."""
    info = ctx.info()["kv_transfer"]
    return {"ctx_request_id": stream_id,
            **{k: info[k] for k in ("worker_id", "backend", "addresses", "layout")}}


def stream_bodies(ctx: Worker, path: str, body: dict[str, Any], stream_id: str | None = None
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(context body, generation body) of one streamed request."""
    sid = stream_id or uuid.uuid4().hex
    cbody = {**body, "stream": False,
             "disaggregated_params": {"request_type": "context_only", "kv_stream_id": sid}}
    gbody = {**body, "disaggregated_params": {"request_type": "generation_only",
                                              "kv_stream": stream_params(ctx, sid)}}
    return cbody, gbody


def streamed_text(ctx: Worker, gen: Worker, path: str, body: dict[str, Any]) -> str:
    """Play the router's streaming flow: the generation call first (its reads wait for the
    context worker), the context call at the same time."""
    cbody, gbody = stream_bodies(ctx, path, body)
    with cf.ThreadPoolExecutor(2) as ex:
        if body.get("stream"):
            g = ex.submit(_stream, gen.url, path, gbody)
        else:
            g = ex.submit(_post, gen.url, path, gbody)
        c = ex.submit(_post, ctx.url, path, cbody)
        r = c.result(timeout=60)
        assert r.status_code == 200, r.text
        # params, or null when the generation worker had read everything and given the
        # lease back before the context worker's last step ended
        dp = r.json()["disaggregated_params"]
        assert dp is None or dp["kv_stream_id"] == cbody["disaggregated_params"]["kv_stream_id"]
        out = g.result(timeout=60)
    if body.get("stream"):
        return out[0]
    assert out.status_code == 200, out.text
    return _text_of(path, out.json())


def _stream_bodies() -> list[tuple[str, dict[str, Any]]]:
    base = {"model": NAME, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    chat = {**base, "messages": CHAT}
    # LONG: more than max_num_tokens (256): the context worker prefills it in two chunks.
    return [(C, {**base, "prompt": PROMPTS[1]}), (C, {**base, "prompt": LONG, "stream": True}),
            (CHAT_PATH, chat), (CHAT_PATH, {**chat, "stream": True}),
            (C, {**base, "prompt": PROMPTS[0], "response_format": {"type": "json_object"},
                 "max_tokens": 20}),
            # seeded: the generation worker goes on from the context worker's first draw
            (C, {**base, "prompt": PROMPTS[1], "temperature": 2.0, "top_p": 0.95, "seed": 11,
                 "stream": True})]


def _check_streamed(ctx: Worker, gen: Worker, ref: str) -> None:
    for path, body in _stream_bodies():
        assert streamed_text(ctx, gen, path, body) == ref_text(ref, path, body), (path, body)
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def test_tcp_streamed_kv_matches_aggregated(tcp: dict[str, Worker], reference: str) -> None:
    _check_streamed(tcp["ctx"], tcp["gen"], reference)
    _check_streamed(tcp["ctx"], tcp["gen8"], reference)  # another block size: "tokens" reads


def test_ucx_streamed_kv_matches_aggregated(ucx: dict[str, Worker], reference: str) -> None:
    _check_streamed(ucx["ctx"], ucx["gen"], reference)


def test_streamed_generation_waits_for_a_context_call_that_comes_later(
        tcp: dict[str, Worker], reference: str) -> None:
    """The generation worker's reads wait for a lease that does not exist yet."""
    ctx, gen = tcp["ctx"], tcp["gen"]
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    cbody, gbody = stream_bodies(ctx, C, body)
    with cf.ThreadPoolExecutor(1) as ex:
        g = ex.submit(_post, gen.url, C, gbody)
        wait_for(lambda: _fetching(gen), 10, 0.02, what="the generation worker pulling")
        assert _post(ctx.url, C, cbody).status_code == 200
        r = g.result(timeout=60)
    assert r.status_code == 200 and _text_of(C, r.json()) == ref_text(reference, C, body)
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def _fetching(w: Worker) -> bool:
    """A generation worker holds blocks only for requests it pulls or decodes."""
    return w.blocks_used() > 0


def test_streamed_failures_end_cleanly(tcp: dict[str, Worker]) -> None:
    ctx, gen = tcp["ctx"], tcp["gen"]
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
    bad_id = stream_bodies(ctx, C, body, stream_id="no spaces")[0]
    r = _post(ctx.url, C, bad_id)
    assert r.status_code == 400 and "kv_stream_id" in r.json()["error"]["param"]
    # Another prompt on the generation side than the context side prefilled: the hash of the
    # token ids differs, the read is refused, the request fails with 502 (never wrong KV).
    cbody, gbody = stream_bodies(ctx, C, body)
    gbody["prompt"] = PROMPTS[0]
    with cf.ThreadPoolExecutor(1) as ex:
        g = ex.submit(_post, gen.url, C, gbody)
        assert _post(ctx.url, C, cbody).status_code == 200
        r = g.result(timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def test_streamed_generation_abort_while_waiting_frees_its_blocks(
        tcp: dict[str, Worker], reference: str) -> None:
    """The client leaves while the generation worker waits for KV that is not computed yet
    (the router then cancels the context call too): the reads are cancelled and the blocks
    freed at once, and the worker goes on serving."""
    ctx, gen = tcp["ctx"], tcp["gen"]
    body = {"model": NAME, "prompt": LONG, "max_tokens": 6, "temperature": 0, "stream": True}
    _, gbody = stream_bodies(ctx, C, body)
    kw = signed(TOKEN, "POST", C, gbody, to=gen.url)
    host, port = gen.url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in kw["headers"].items())
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {C} HTTP/1.1\r\nHost: {host}\r\n{head}Content-Length: "
                     f"{len(kw['content'])}\r\n\r\n".encode() + kw["content"])
        wait_for(lambda: _fetching(gen), 10, 0.02, what="the generation worker pulling")
    gen.wait_blocks(0)
    assert health_ok(gen.url)
    assert streamed_text(ctx, gen, C, {**body, "stream": False}) == ref_text(
        reference, C, {**body, "stream": False})
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


# ---- integrity: a corrupted transfer is never served (issue 41, item 3) ----------------------


def _integrity_failures(w: Worker) -> float:
    m = re.search(r'^disagg_kv_transfer_failures_total\{[^}]*code="integrity_error"[^}]*\} (\S+)$',
                  httpx.get(w.url + "/metrics", timeout=10).text, re.M)
    return float(m.group(1)) if m else 0.0


def test_kv_corrupted_in_transit_fails_that_request_only(tcp: dict[str, Worker],
                                                         reference: str) -> None:
    """One bit of the KV payload flipped on its way (a TCP relay between the generation
    worker and the context worker's KV server): the generation worker's check fails that
    request with 502 ``kv_transfer_failed`` naming the checksum, counts it, frees its blocks,
    and serves the same request exactly from a clean transfer."""
    ctx, gen = tcp["ctx"], tcp["gen"]
    body = {"model": NAME, "prompt": " ".join([PROMPTS[1]] * 6), "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    answer = context_call(ctx, C, body)
    dp = answer["disaggregated_params"]
    relay = FlippingRelay(dp["addresses"][0], times=1)
    before = _integrity_failures(gen)
    try:
        via = {**answer, "disaggregated_params": {**dp, "addresses": [relay.address]}}
        r = _post(gen.url, C, generation_body(C, body, via))
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_transfer_failed" and "checksum" in err["message"], err
        assert relay.flipped == 1
    finally:
        relay.stop()
    assert _integrity_failures(gen) == before + 1
    gen.wait_blocks(0)
    # The router would prefill again; the lease is released as it would release it.
    r = _post(ctx.url, "/kv_leases/release", {"ctx_request_id": dp["ctx_request_id"]})
    assert r.status_code == 200, r.text
    ctx.wait_blocks(0)
    assert disagg_text(ctx, gen, C, body) == ref_text(reference, C, body)
