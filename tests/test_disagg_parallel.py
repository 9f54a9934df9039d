"""Multi-rank context and generation workers end to end (real worker processes).

Every context layout (tp, pp) in {1, 2}^2 is paired with every generation layout in {1, 2}^2:
the generation worker's ranks pull their slices straight from the context worker's ranks,
converting the layout (and the block size, for the B=8 generation workers). Greedy outputs
must equal an aggregated tp1 pp1 worker's and no KV block may stay in use on either side.
Two context workers serve over UCX (TCP when ucxx cannot import) and two over TCP, so every
generation layout reads over both backends.

Qwen3 (per-head q/k norms, head_dim twice hidden / heads) runs the same pairs over {tp1, tp2,
pp2} x {tp1, tp2, pp2}, plain and KV-streamed, after the llama workers have stopped (one
architecture's workers at a time: ``Clusters``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import device_for_ranks, health_ok, signed, wait_for
from test_disagg_e2e import (
    CHAT,
    CHAT_PATH,
    NAME,
    PROMPTS,
    TOKEN,
    UCX_OK,
    C,
    Worker,
    _post,
    _start,
    _stop,
    _wait_healthy,
    context_call,
    disagg_text,
    generation_body,
    ref_text,
    streamed_text,
)

from disagg.contracts.params import ContextParams
from disagg.layout import WorkerLayout, plan_pulls

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
UCX_CTX = {(2, 1), (2, 2)}  # these context workers serve over UCX when it is available
GEN_BLOCK = {(1, 1): "8", (2, 1): "16", (1, 2): "16", (2, 2): "8"}


DEVICE = device_for_ranks(4)  # every worker here, the aggregated reference too


def _par(tp: int, pp: int) -> list[str]:
    return ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--device", DEVICE]


# Qwen3's pairs: the layouts the issue names (tp2 pp2 is llama's alone).
QWEN3_LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def _start_cluster(tmp: Path, model_dir: str, layouts: list[tuple[int, int]],
                   extras: bool) -> dict[str, Worker]:
    """A context and a generation worker per layout and the aggregated reference; ``extras``:
    the short-lease and the to-be-killed context workers too. Healthy, or stopped and raised."""
    ws: dict[str, Worker] = {}
    for tp, pp in layouts:
        backend = "UCX" if (tp, pp) in UCX_CTX and UCX_OK else "TCP"
        ws[f"ctx{tp}{pp}"] = _start(tmp, model_dir, f"ctx{tp}{pp}", "context", *_par(tp, pp),
                                    "--kv-transfer-backend", backend, "--tokens-per-block", "16")
        ws[f"gen{tp}{pp}"] = _start(tmp, model_dir, f"gen{tp}{pp}", "generation",
                                    *_par(tp, pp), "--kv-transfer-backend", "TCP",
                                    "--tokens-per-block", GEN_BLOCK[(tp, pp)])
    if extras:
        ws["ctx_short"] = _start(tmp, model_dir, "ctx_short", "context", *_par(1, 2),
                                 "--kv-transfer-backend", "TCP", "--tokens-per-block", "16",
                                 "--kv-lease-ttl", "0.3")
        ws["ctx_victim"] = _start(tmp, model_dir, "ctx_victim", "context", *_par(2, 1),
                                  "--kv-transfer-backend", "TCP", "--tokens-per-block", "16")
    ws["agg"] = _start(tmp, model_dir, "agg", "aggregated", "--tokens-per-block", "16",
                       "--device", DEVICE)
    try:
        _wait_healthy(list(ws.values()))
    except BaseException:
        _stop(list(ws.values()))
        raise
    return ws


class Clusters:
    """One architecture's workers at a time: ``get(arch)`` stops the other architecture's
    workers before starting its own (the 2-core machine runs one set; the llama tests come
    first in this file, so each set starts once)."""

    def __init__(self, tmp: Path, models: dict[str, Callable[[], str]]) -> None:
        self._tmp, self._models = tmp, models
        self._arch: str | None = None
        self._workers: dict[str, Worker] = {}

    def get(self, arch: str) -> dict[str, Worker]:
        if arch != self._arch:
            self.close()
            model = self._models[arch]()
            self._workers = (_start_cluster(self._tmp / arch, model, LAYOUTS, True)
                             if arch == "llama" else
                             _start_cluster(self._tmp / arch, model, QWEN3_LAYOUTS, False))
            self._arch = arch
        return self._workers

    def close(self) -> None:
        workers, self._workers, self._arch = list(self._workers.values()), {}, None
        _stop(workers)


@pytest.fixture(scope="module")
def clusters(model_dir: str, tiny_checkpoint: Callable[..., str],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clusters]:
    tmp: Path = tmp_path_factory.mktemp("par-logs")
    for arch in ("llama", "qwen3"):
        (tmp / arch).mkdir()
    cs = Clusters(tmp, {"llama": lambda: model_dir,
                        "qwen3": lambda: tiny_checkpoint("tiny", arch="qwen3", seed=1)})
    try:
        yield cs
    finally:
        cs.close()


@pytest.fixture
def cluster(clusters: Clusters) -> dict[str, Worker]:
    """The llama workers (default tiny llama, every layout of {1, 2}^2)."""
    return clusters.get("llama")


@pytest.fixture
def qwen3_cluster(clusters: Clusters) -> dict[str, Worker]:
    """The tiny Qwen3's workers over QWEN3_LAYOUTS."""
    return clusters.get("qwen3")


def _bodies() -> list[tuple[str, dict]]:
    base = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    chat = {"model": NAME, "messages": CHAT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    # Structured outputs: the generation side replays the context's first token into its
    # matcher (greedy, and seeded + streamed).
    schema = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0,
              "structured_outputs": {"json": {"type": "object", "required": ["n"],
                                              "properties": {"n": {"type": "integer"}}}}}
    seeded = {**chat, "max_tokens": 40, "temperature": 1.0, "seed": 5,
              "response_format": {"type": "json_object"}}
    return [(C, base), (CHAT_PATH, chat), (C, schema), (CHAT_PATH, seeded)]


@pytest.mark.parametrize("gen_layout", LAYOUTS, ids=lambda x: f"gen-tp{x[0]}pp{x[1]}")
@pytest.mark.parametrize("ctx_layout", LAYOUTS, ids=lambda x: f"ctx-tp{x[0]}pp{x[1]}")
def test_every_layout_pair_matches_aggregated(cluster: dict[str, Worker],
                                              ctx_layout: tuple[int, int],
                                              gen_layout: tuple[int, int]) -> None:
    ctx = cluster["ctx{}{}".format(*ctx_layout)]
    gen = cluster["gen{}{}".format(*gen_layout)]
    for path, body in _bodies():
        assert disagg_text(ctx, gen, path, body) == ref_text(cluster["agg"].url, path, body), (
            path, body)
    ctx.wait_blocks(0)  # every rank's lease confirmed: the blocks are free
    gen.wait_blocks(0)


@pytest.mark.parametrize("gen_layout", LAYOUTS, ids=lambda x: f"gen-tp{x[0]}pp{x[1]}")
@pytest.mark.parametrize("ctx_layout", LAYOUTS, ids=lambda x: f"ctx-tp{x[0]}pp{x[1]}")
def test_every_layout_pair_streamed_matches_aggregated(cluster: dict[str, Worker],
                                                       ctx_layout: tuple[int, int],
                                                       gen_layout: tuple[int, int]) -> None:
    """KV streaming: every context rank publishes its layers as it computes them, every
    generation rank pulls its slices layer group by layer group, converting the layout."""
    ctx = cluster["ctx{}{}".format(*ctx_layout)]
    gen = cluster["gen{}{}".format(*gen_layout)]
    for path, body in _bodies()[:2]:
        assert streamed_text(ctx, gen, path, body) == ref_text(cluster["agg"].url, path, body), (
            path, body)
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_every_rank_reads_its_own_slices_once(cluster: dict[str, Worker]) -> None:
    """gen tp2 pp2 pulling from ctx tp2 pp2: one coalesced read per planned rank pair, counted
    in the worker's metrics whichever rank made it."""
    ctx, gen = cluster["ctx22"], cluster["gen22"]
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    answer = context_call(ctx, C, body)
    params = ContextParams.from_dict(answer["disaggregated_params"])
    src = params.layout
    dst = WorkerLayout.from_dict(gen.info()["kv_transfer"]["layout"])
    assert (dst.tp_size, dst.pp_size, dst.tokens_per_block) == (2, 2, 8)
    planned = sum(len(plan_pulls(src, dst, r)) for r in range(len(dst.ranks)))
    assert planned == 4  # each of the 4 generation ranks reads one context rank
    before = _counter(gen.url, "disagg_kv_transfers_total")
    r = _post(gen.url, C, generation_body(C, body, answer))
    assert r.status_code == 200, r.text
    wait_for(lambda: _counter(gen.url, "disagg_kv_transfers_total") == before + planned, 15,
             0.05, what="every rank's reads counted")
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def test_multi_rank_expired_lease_fails_cleanly(cluster: dict[str, Worker]) -> None:
    ctx, gen = cluster["ctx_short"], cluster["gen21"]
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    answer = context_call(ctx, C, body)
    ctx.wait_blocks(0, timeout=10)  # expired on both ranks: the blocks are free
    r = _post(gen.url, C, generation_body(C, body, answer))
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed" and "expired_lease" in err["message"]
    gen.wait_blocks(0)


def test_multi_rank_final_first_token_frees_every_rank(cluster: dict[str, Worker]) -> None:
    ctx = cluster["ctx22"]
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
    answer = context_call(ctx, C, body)
    assert answer["disaggregated_params"] is None  # final: nothing leased
    ctx.wait_blocks(0)


def test_multi_rank_generation_abort_frees_both_sides(cluster: dict[str, Worker]) -> None:
    ctx, gen = cluster["ctx12"], cluster["gen22"]
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}
    answer = context_call(ctx, C, body)
    with httpx.stream("POST", gen.url + C, timeout=60,
                      **signed(TOKEN, "POST", C, generation_body(C, body, answer),
                               to=gen.url)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # hang up after the first event
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def _rank_pids(pid: int) -> list[int]:
    """A worker's rank 0 and the rank processes it started (its children)."""
    out = [pid]
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
            out += [int(c) for c in text.split()]
    return out


def test_multi_rank_abort_mid_pull_frees_the_blocks_without_the_context_side(
        cluster: dict[str, Worker]) -> None:
    """The context worker freezes (SIGSTOP, every rank) while the generation worker's ranks
    pull straight into their blocks; the client hangs up. The abort cancels every rank's
    reads and the blocks come free with the context side still frozen (nothing waits on
    it: rank 0 frees once each rank said its reads stopped). Thawed, the context worker frees
    its lease and serves again."""
    ctx, gen = cluster["ctx21"], cluster["gen21"]  # same layout and block size: direct reads
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    answer = context_call(ctx, C, body)
    pids = _rank_pids(ctx.proc.pid)  # rank 0, rank 1 (and a helper process of torch's)
    assert len(pids) >= 2, pids
    kw = signed(TOKEN, "POST", C, generation_body(C, body, answer), to=gen.url)
    raw = kw["content"]
    head = "".join(f"{k}: {v}\r\n" for k, v in {
        **kw["headers"], "Host": "x", "Content-Length": str(len(raw))}.items())
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", gen.port), 10) as sock:
            sock.sendall(f"POST {C} HTTP/1.1\r\n{head}\r\n".encode() + raw)
            wait_for(lambda: gen.blocks_used() > 0, 15, 0.02, what="the pull to start")
        gen.wait_blocks(0)  # freed while the context worker is still frozen
    finally:
        for p in pids:
            os.kill(p, signal.SIGCONT)
    ctx.wait_blocks(0)
    assert health_ok(ctx.url) and health_ok(gen.url)
    assert disagg_text(ctx, gen, C, body) == ref_text(cluster["agg"].url, C, body)


def test_dead_multi_rank_context_fails_request_generation_stays_healthy(
        cluster: dict[str, Worker]) -> None:
    ctx, gen = cluster["ctx_victim"], cluster["gen22"]
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    answer = context_call(ctx, C, body)
    ctx.proc.kill()  # rank 0; its other rank leaves when it finds itself orphaned
    ctx.proc.wait(10)
    r = _post(gen.url, C, generation_body(C, body, answer))
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "kv_transfer_failed"
    gen.wait_blocks(0)
    assert health_ok(gen.url)
    assert disagg_text(cluster["ctx11"], gen, C, body) == ref_text(cluster["agg"].url, C, body)


# -- Qwen3: the same pairs over {tp1, tp2, pp2} ------------------------------------------------
# Defined last: the llama workers stop before the Qwen3 ones start (``Clusters``).


@pytest.mark.parametrize("gen_layout", QWEN3_LAYOUTS, ids=lambda x: f"gen-tp{x[0]}pp{x[1]}")
@pytest.mark.parametrize("ctx_layout", QWEN3_LAYOUTS, ids=lambda x: f"ctx-tp{x[0]}pp{x[1]}")
def test_qwen3_every_layout_pair_matches_aggregated(qwen3_cluster: dict[str, Worker],
                                                    ctx_layout: tuple[int, int],
                                                    gen_layout: tuple[int, int]) -> None:
    """Plain pulls (greedy completion, SSE-streamed chat, json_schema, seeded json_object),
    then KV-streamed pulls (completion, SSE chat), from a Qwen3 context worker into a
    generation worker of another layout (and block size): the aggregated worker's text each
    time, no block left in use."""
    ws = qwen3_cluster
    ctx, gen = ws["ctx{}{}".format(*ctx_layout)], ws["gen{}{}".format(*gen_layout)]
    layout = WorkerLayout.from_dict(gen.info()["kv_transfer"]["layout"])
    assert (layout.head_dim, layout.tp_size, layout.pp_size) == (32, *gen_layout)
    for path, body in _bodies():
        assert disagg_text(ctx, gen, path, body) == ref_text(ws["agg"].url, path, body), (
            path, body)
    for path, body in _bodies()[:2]:
        assert streamed_text(ctx, gen, path, body) == ref_text(ws["agg"].url, path, body), (
            path, body)
    ctx.wait_blocks(0)
    gen.wait_blocks(0)


def test_qwen3_context_to_a_llama_shaped_generation_worker_is_a_400(
        qwen3_cluster: dict[str, Worker]) -> None:
    """The tiny llama and the tiny Qwen3 have the same layers and kv heads; only the head size
    (16 vs 32) tells their caches apart. Params whose layout says 16 (what a llama context
    worker sends) are refused by a Qwen3 generation worker with a 400 naming head_dim, and
    the refusal releases the context worker's lease (its blocks come free well before the
    lease would expire; the true params then find no lease)."""
    ws = qwen3_cluster
    ctx, gen = ws["ctx21"], ws["gen12"]
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    answer = context_call(ctx, C, body)
    good = generation_body(C, body, answer)
    dp = good["disaggregated_params"]
    assert dp["layout"]["head_dim"] == 32
    llama_shaped = {**good, "disaggregated_params": {**dp, "layout": {**dp["layout"],
                                                                       "head_dim": 16}}}
    r = _post(gen.url, C, llama_shaped)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "head_dim differs" in err["message"] and "(32)" in err["message"], err
    assert err["param"] == "disaggregated_params"
    ctx.wait_blocks(0)  # released, not expired (wait_blocks waits less than the lease)
    gen.wait_blocks(0)
    r = _post(gen.url, C, good)
    assert r.status_code == 502 and "unknown_lease" in r.text, r.text
    gen.wait_blocks(0)
