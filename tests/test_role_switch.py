"""Run-time role switch of a worker (``POST /admin/role``, disagg/server/role_switch.py).

Pure parts: the ``RoleSwitcher`` state machine and the body parser. Real processes (tiny model,
TCP): context worker A (registered with a router through ``--router-url``), generation worker
B, a spare generation worker G (the reader of a lease A holds while it drains; UCX where it
imports, switched to context last) and a tp 2 context worker W (gloo on the CPU). A flips
context -> generation while it holds an unread lease, B flips generation -> context while it
decodes; nothing in flight is lost, every greedy output equals an aggregated worker's, new
requests get 503 ``role_switching`` during the drain, and the router moves A to the
generation pool when it registers again.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_fixtures import DYNAMIC, ROUTER_TOKEN, LoopThread, running_router
from server_fixtures import (
    WorkerProc,
    serve_in_thread,
    signed,
    start_worker_proc,
    stop_all,
    wait_all_healthy,
    wait_for,
)

from disagg.contracts import protocol as P
from disagg.contracts.roles import Role, RoleDrain
from disagg.server.role_switch import DRAINING, SWITCHING, RoleSwitcher, Switch, parse_role
from disagg.transfer.ucx import ucx_available

UCX_OK, UCX_WHY = ucx_available()

TOKEN = ROUTER_TOKEN  # the workers and the router share it
NAME = "tiny"
C = "/v1/completions"
ROLE = "/admin/role"
BASE = ["--served-model-name", NAME, "--log-level", "warning", "--kv-cache-tokens", "4096",
        "--max-model-len", "1024", "--max-num-tokens", "256", "--max-batch-size", "8",
        "--tokens-per-block", "16"]
COMMON = [*BASE, "--kv-transfer-backend", "TCP"]
# 1000 decode steps (seconds): B still decodes while the test checks its drain.
LONG = {"model": NAME, "prompt": "The harbour was quiet", "max_tokens": 1000,
        "temperature": 0, "ignore_eos": True}
SHORT = {"model": NAME, "prompt": "Memory is organised in small blocks", "max_tokens": 12,
         "temperature": 0, "ignore_eos": True}


# ---- the state machine (pure) ---------------------------------------------------------------


def test_state_machine_exact_states() -> None:
    m = RoleSwitcher()
    assert m.switch is None and m.switches == 0
    assert m.begin(Role.CONTEXT, Role.CONTEXT, 1.0) is None  # already that role: nothing
    sw = m.begin(Role.CONTEXT, Role.GENERATION, 5.0)
    assert sw == Switch(Role.CONTEXT, Role.GENERATION, DRAINING, 5.0) and m.switch == sw
    assert m.reported_role(Role.GENERATION) is Role.CONTEXT  # old role until done
    with pytest.raises(P.APIError) as e:
        m.begin(Role.CONTEXT, Role.GENERATION, 6.0)
    assert (e.value.status, e.value.code) == (409, "role_switch_in_progress")
    with pytest.raises(P.APIError) as e:  # also toward the role it has (one switch at a time)
        m.begin(Role.CONTEXT, Role.CONTEXT, 6.0)
    assert e.value.status == 409
    m.drained()
    assert m.switch == Switch(Role.CONTEXT, Role.GENERATION, SWITCHING, 5.0)
    assert m.switch.to_dict(RoleDrain()) == {
        "from": "context", "to": "generation", "state": "switching", "since": 5.0,
        "pending": {"leases": 0, "requests": 0, "pulls": 0}}
    m.finish()
    assert m.switch is None and m.switches == 1
    assert m.reported_role(Role.GENERATION) is Role.GENERATION
    m.begin(Role.GENERATION, Role.CONTEXT, 7.0)
    m.abandon()  # the engine stopped: no switch, none counted
    assert m.switch is None and m.switches == 1
    with pytest.raises(P.APIError) as e:
        m.begin(Role.AGGREGATED, Role.CONTEXT, 8.0)
    assert (e.value.status, e.value.param) == (400, "role")
    assert RoleDrain().done and not RoleDrain(leases=1).done


@pytest.mark.parametrize("raw", [b"", b"[]", b"{}", b'{"role": null}', b'{"role": "aggregated"}',
                                 b'{"role": "prefill"}', b'{"role": 1}'])
def test_parse_role_rejects(raw: bytes) -> None:
    with pytest.raises(P.APIError) as e:
        parse_role(raw)
    assert (e.value.status, e.value.param) == (400, "role")


def test_parse_role_accepts() -> None:
    assert parse_role(b'{"role": "context"}') is Role.CONTEXT
    assert parse_role(b'{"role": "generation"}') is Role.GENERATION


# ---- real workers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def router(loop: LoopThread) -> Iterator[str]:
    with running_router(DYNAMIC, loop) as url:
        yield url


@pytest.fixture(scope="module")
def workers(model_dir: str, router: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, WorkerProc]]:
    tmp: Path = tmp_path_factory.mktemp("role-logs")
    env = {"DISAGG_CLUSTER_TOKEN": TOKEN}

    def start(name: str, role: str, *flags: str) -> WorkerProc:
        return start_worker_proc(tmp, model_dir, name, ["--role", role, *COMMON, *flags], env)

    ws = {"A": start("A", "context", "--router-url", router),
          "B": start("B", "generation"),
          "W": start("W", "context", "--tensor-parallel-size", "2", "--device", "cpu")}
    # G: the spare generation worker; over UCX where it imports (its own listener, idle until
    # it switches to context: test_ucx_generation_worker_becomes_context).
    backend = "UCX" if UCX_OK else "TCP"
    ws["G"] = start_worker_proc(tmp, model_dir, "G", ["--role", "generation", *BASE,
                                                      "--kv-transfer-backend", backend], env)
    try:
        wait_all_healthy(list(ws.values()), 120.0)
        yield ws
    finally:
        stop_all(list(ws.values()))


@pytest.fixture(scope="module")
def reference(model_dir: str) -> Iterator[str]:
    """An aggregated worker in this process (with the cluster token: its /admin/role answers
    past the signature check)."""
    from disagg.engine import AsyncLLM
    from disagg.server.app import ServerSettings, build_app

    engine = AsyncLLM.from_options(model_dir, tokens_per_block=16, kv_cache_tokens=4096,
                                   max_model_len=1024, max_num_tokens=256, max_batch_size=8)
    app = build_app(engine, ServerSettings(model_dir=model_dir, served_model_name=NAME,
                                           cluster_token=TOKEN))
    with serve_in_thread(app) as url:
        yield url


def post(url: str, path: str, body: Any, token: str | None = TOKEN) -> httpx.Response:
    if token is None:
        return httpx.post(url + path, json=body, timeout=60)
    return httpx.post(url + path, timeout=60, **signed(token, "POST", path, body, to=url))


def switch(w: WorkerProc, role: str) -> httpx.Response:
    return post(w.url, ROLE, {"role": role})


def ref_text(ref: str, body: dict[str, Any]) -> str:
    r = post(ref, C, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def context_call(ctx: WorkerProc, body: dict[str, Any]) -> dict[str, Any]:
    r = post(ctx.url, C, {**body, "disaggregated_params": {"request_type": "context_only"}})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["disaggregated_params"] is not None  # not final: its KV is leased
    return answer


def gen_body(body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    return {**body, "prompt": answer["prompt_token_ids"],
            "disaggregated_params": {**answer["disaggregated_params"],
                                     "request_type": "generation_only"}}


def gen_text(gen: WorkerProc, body: dict[str, Any], answer: dict[str, Any]) -> str:
    r = post(gen.url, C, gen_body(body, answer))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]  # (it starts with the context's first token)


def disagg_text(ctx: WorkerProc, gen: WorkerProc, body: dict[str, Any]) -> str:
    return gen_text(gen, body, context_call(ctx, body))


class Stream:
    """A streamed generation_only request in a thread: ``first`` is set once a chunk came."""

    def __init__(self, gen: WorkerProc, body: dict[str, Any]) -> None:
        self.first = threading.Event()
        self.text = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(gen, body), daemon=True)
        self.thread.start()

    def _run(self, gen: WorkerProc, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", gen.url + C, timeout=120,
                              **signed(TOKEN, "POST", C, body, to=gen.url)) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for ch in json.loads(line[6:]).get("choices", []):
                            self.text += ch.get("text", "")
                        self.first.set()
        except BaseException as e:
            self.error = e
        finally:
            self.first.set()

    def result(self) -> str:
        self.thread.join(120)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.text


def refused(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "role_switching"


def settled(w: WorkerProc, role: str, count: int) -> bool:
    info = w.info()
    return info["role"] == role and info["role_switch"] is None and (
        info["role_switches"] == count)


def in_pool(router: str, url: str, pool: str) -> bool:
    info = httpx.get(router + "/cluster_info", timeout=10).json()
    return any(w["url"] in (url, url.removeprefix("http://")) and w["pool"] == pool
               for w in info["workers"].get(pool, []))


def test_switch_with_work_in_flight(workers: dict[str, WorkerProc], router: str,
                                    reference: str) -> None:
    A, B, G = workers["A"], workers["B"], workers["G"]
    want_long, want_short = ref_text(reference, LONG), ref_text(reference, SHORT)
    wait_for(lambda: in_pool(router, A.url, "context"), 20, 0.05, what="A registered")
    long_ans, short_ans = context_call(A, LONG), context_call(A, SHORT)  # two leases on A
    stream = Stream(B, {**gen_body(LONG, long_ans), "stream": True})
    assert stream.first.wait(60) and stream.error is None, stream.error  # B decodes

    # Both switches start while A holds the unread SHORT lease and B decodes LONG.
    ra, rb = switch(A, "generation"), switch(B, "context")
    assert ra.status_code == 202 and rb.status_code == 202, (ra.text, rb.text)
    assert {k: ra.json()[k] for k in ("object", "from", "to", "state")} == {
        "object": "role_switch", "from": "context", "to": "generation", "state": "draining"}
    assert rb.json()["pending"]["requests"] == 1
    assert ra.json()["pending"]["leases"] >= 1
    # B first (its drain ends with the decode): new requests are refused, the decode runs.
    refused(post(B.url, C, gen_body(SHORT, short_ans)))  # the lease is not released by it
    refused(post(B.url, C, SHORT))
    r = switch(B, "generation")
    assert (r.status_code, r.json()["error"]["code"]) == (409, "role_switch_in_progress")
    assert B.info()["role_switch"]["pending"] == {"leases": 0, "requests": 1, "pulls": 0}
    info = A.info()
    assert info["role"] == "context" and info["role_switch"]["state"] == "draining"
    assert info["role_switch"]["to"] == "generation"
    wait_for(lambda: A.info()["role_switch"]["pending"]["leases"] == 1, 15, 0.05,
             what="A: only the unread lease left")

    # A: new requests of the old type (and plain ones) are refused while it drains.
    refused(post(A.url, C, {**SHORT, "disaggregated_params": {"request_type": "context_only"}}))
    refused(post(A.url, C, SHORT))
    assert switch(A, "context").status_code == 409

    # A's held lease is still read by a generation worker: exact tokens; then A flips.
    assert gen_text(G, SHORT, short_ans) == want_short
    wait_for(lambda: settled(A, "generation", 1), 20, 0.05, what="A switched")
    wait_for(lambda: in_pool(router, A.url, "generation"), 20, 0.05,
             what="router: A in the generation pool")
    # B's decode finishes with exactly the aggregated tokens; then B flips.
    assert stream.result() == want_long
    wait_for(lambda: settled(B, "context", 1), 20, 0.05, what="B switched")
    assert A.info()["kv_transfer"]["role"] == "generation"
    assert B.info()["kv_transfer"]["addresses"]  # B's transfer server, now advertised

    # Each serves its new role: B prefills, A pulls from B and decodes.
    assert disagg_text(B, A, SHORT) == want_short
    assert disagg_text(B, A, LONG) == want_long
    resp = switch(A, "generation")  # already that role
    assert (resp.status_code, resp.json()["state"]) == (200, "done")
    for w in (A, B, G):
        w.wait_blocks(0)


def test_multi_rank_flips_both_ways(workers: dict[str, WorkerProc], reference: str) -> None:
    W, G = workers["W"], workers["G"]
    ctx = workers["B"] if workers["B"].info()["role"] == "context" else None
    want = ref_text(reference, SHORT)
    assert disagg_text(W, G, SHORT) == want  # tp 2 context
    assert switch(W, "generation").status_code == 202
    wait_for(lambda: settled(W, "generation", 1), 20, 0.05, what="W -> generation")
    if ctx is None:  # (run alone: G serves as the context side)
        assert switch(G, "context").status_code == 202
        wait_for(lambda: settled(G, "context", 1), 20, 0.05, what="G -> context")
        ctx = G
    assert disagg_text(ctx, W, SHORT) == want  # tp 2 generation, pulling per rank
    refused_ctx = post(W.url, C, {**SHORT, "disaggregated_params": {
        "request_type": "context_only"}})
    assert refused_ctx.status_code == 400  # a generation worker now
    assert switch(W, "context").status_code == 202
    wait_for(lambda: settled(W, "context", 2), 20, 0.05, what="W -> context")
    gen = G if G.info()["role"] == "generation" else workers["A"]
    assert disagg_text(W, gen, SHORT) == want
    W.wait_blocks(0)


def test_bad_requests(workers: dict[str, WorkerProc], reference: str) -> None:
    G = workers["G"]
    for body in ({}, {"role": "prefill"}, {"role": "aggregated"}):
        r = post(G.url, ROLE, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text
    r = post(reference, ROLE, {"role": "context"})  # aggregated: no KV transfer
    assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text
    for token in (None, "not-the-token"):  # missing or wrong: 401, as everywhere else
        r = post(G.url, ROLE, {"role": "context"}, token=token)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "unauthorized", r.text
    info = G.info()
    assert info["role_switch"] is None  # none of these started a switch


def test_bad_signatures_are_401_as_everywhere(reference: str) -> None:
    """/admin/role answers a missing, wrong or replayed signature with 401, as /server_info
    does (it answered 403 to a wrong one); a valid one gets past the check (an aggregated
    worker then refuses the role: 400)."""
    body = {"role": "context"}
    good = signed(TOKEN, "POST", ROLE, body, to=reference)
    first = httpx.post(reference + ROLE, timeout=60, **good)
    assert first.status_code == 400 and first.json()["error"]["param"] == "role", first.text
    for kw in ({"json": body}, signed("not-the-token", "POST", ROLE, body, to=reference),
               good):  # unsigned, wrong token, the same signature again
        r = httpx.post(reference + ROLE, timeout=60, **kw)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("authentication_error", "unauthorized"), err
        assert err["message"].startswith("/admin/role: needs a cluster signature"), err
    r = httpx.get(reference + "/server_info", timeout=60,
                  **signed("not-the-token", "GET", "/server_info", to=reference))
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text


@pytest.mark.skipif(not UCX_OK, reason=UCX_WHY)
def test_ucx_generation_worker_becomes_context(workers: dict[str, WorkerProc],
                                               reference: str) -> None:
    """G (UCX) was started as generation: after its switch it serves leases from the UCX
    listener it started with, and a TCP worker pulls them over UCX; exact outputs."""
    G = workers["G"]
    assert G.info()["kv_transfer"]["backend"] == "UCX"
    gen = next((w for w in (workers["A"], workers["B"]) if w.info()["role"] == "generation"),
               None)
    if gen is None:  # (run alone: A is still context)
        gen = workers["A"]
        assert switch(gen, "generation").status_code == 202
        wait_for(lambda: gen.info()["role_switch"] is None, 20, 0.05, what="A -> generation")
    count = G.info()["role_switches"]
    assert switch(G, "context").status_code == 202
    wait_for(lambda: settled(G, "context", count + 1), 20, 0.05, what="G -> context")
    answer = context_call(G, SHORT)
    assert answer["disaggregated_params"]["backend"] == "UCX"
    assert gen_text(gen, SHORT, answer) == ref_text(reference, SHORT)
    G.wait_blocks(0)
    gen.wait_blocks(0)
