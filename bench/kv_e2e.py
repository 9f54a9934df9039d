"""End-to-end KV read inside a context -> generation request vs the transport microbenchmark.

Per backend (TCP, UCX) and prompt length (512 / 2048 / 8192 tokens), in one run:

- *micro*: ``bench.kv_transfer``'s read of the same bytes (two bare processes, a
  ``KVTransferServer`` and a ``KVTransferClient`` per path, the client's ``out`` buffer
  preallocated and reused), through both block tables it measures (consecutive, fragmented),
  one read per rep interleaved with the requests so that both see the same host load;
- *end to end*: real worker processes, two pairs: *before* (a context and a generation worker
  started with ``DISAGG_KV_RUNS=0``: scattered tables gathered into a staging buffer, one UCX
  message, a receive buffer then an install copy) and *after* (the default: runs of blocks
  sent from the cache and received into the request's own blocks), the router's two calls per
  rep, alternating between the pairs. From the generation worker's ``/metrics`` deltas:
  *transfer* (``disagg_kv_transfer_seconds``: a read's submit -> last payload byte, the
  micro's definition), *install* (``disagg_kv_install_seconds``: copy into the request's
  blocks, ~0 when the payload landed there), *pull* (``disagg_kv_pull_seconds``: reads
  submitted -> installed, wake-up of the engine loop included). From this client: *gen first
  token* (context answer received -> the generation worker's first streamed token: HTTP,
  admission, pull, install) and *first decode step* (first -> second streamed token).

The end-to-end read is compared with the micro read of the same path and of the block-table
kind the context worker actually handed out (its answer's ``block_ids``); *mixed*
(consecutive for some requests, not for others) is compared with the consecutive read, the
stricter reference. Medians of ``--reps`` after ``--warmup``.

    python -m bench.kv_e2e [--backends TCP,UCX] [--tokens 512,2048,8192] [--reps 5]
                           [--out bench/results/kv_e2e.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench import kv_transfer
from bench.baseline import checkout
from disagg import procs
from disagg.cluster_auth import member_id_of, sign_http
from disagg.transfer import KVTransferClient, ReadRequest
from disagg.transfer.payload import payload_shape

TOKEN = "bench-secret"
MAX_LEN = 8704  # 8192 prompt tokens + the answer, a multiple of the 16-token block
METRICS = ("disagg_kv_transfer_seconds_sum", "disagg_kv_transfer_seconds_count",
           "disagg_kv_install_seconds_total", "disagg_kv_pull_seconds_total",
           "disagg_kv_installs_total")


PATHS = kv_transfer.PATHS  # ("staged", "runs"): before, after


def start(model: str, role: str, backend: str, log: str, runs: bool = True,
          package: str | None = None) -> tuple[subprocess.Popen, str]:
    """A worker; ``package``: the folder whose ``disagg`` it runs (a ``--baseline``
    checkout; it starts in ``package`` so that this checkout's ``disagg`` is not found
    first), else this checkout's."""
    port = procs.free_port()
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN, "DISAGG_KV_RUNS": str(int(runs))}
    if package is not None:
        env["PYTHONPATH"] = package
    proc = procs.spawn(
        [sys.executable, "-m", "disagg.cli", "serve", model, "--port", str(port), "--role", role,
         "--kv-transfer-backend", backend, "--served-model-name", "m", "--log-level", "warning",
         "--kv-cache-tokens", str(2 * MAX_LEN), "--max-num-tokens", "4096",
         "--max-model-len", str(MAX_LEN), "--tokens-per-block", "16",
         "--no-enable-prefix-caching"], log, env=env, cwd=package)
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(url, 180, proc=proc, interval=0.2, what=f"{role} worker")
    except procs.NotHealthy as e:
        procs.stop(proc, grace_s=0)
        raise RuntimeError(f"{e}; see {log}") from None
    return proc, url


def metrics(client: httpx.Client, url: str) -> dict[str, float]:
    text = client.get(url + "/metrics", timeout=10).text
    out = {}
    for name in METRICS:
        m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def consecutive(ids: list[int]) -> bool:
    return all(b - a == 1 for a, b in zip(ids, ids[1:], strict=False))


def one(client: httpx.Client, ctx: str, gen: str, prompt: list[int]) -> dict[str, Any]:
    """The router's two calls on kept-alive connections (a router keeps them too; a fresh
    ``httpx`` client per call adds ~20 ms of set-up); the generation worker's phases (s)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    answer = client.post(ctx + "/v1/completions", timeout=300, json={
        **body, "disaggregated_params": {"request_type": "context_only"}}).json()
    dp = answer["disaggregated_params"]
    before = metrics(client, gen)
    data = json.dumps({**body, "stream": True, "disaggregated_params": {
        **dp, "request_type": "generation_only"}}).encode()
    # Signed as the router signs it: the generation worker trusts the context's addresses.
    headers = {"Content-Type": "application/json",
               **sign_http(TOKEN, "POST", "/v1/completions", data,
                           audience=member_id_of(gen))}
    t0 = time.perf_counter()
    tokens: list[float] = []
    with client.stream("POST", gen + "/v1/completions", content=data, headers=headers,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                if ev["choices"] and ev["choices"][0]["text"]:
                    tokens.append(time.perf_counter())
    after = metrics(client, gen)
    d = {k: after[k] - before[k] for k in METRICS}
    assert d["disagg_kv_transfer_seconds_count"] >= 1 and len(tokens) >= 2, (d, tokens)
    return {"transfer": d["disagg_kv_transfer_seconds_sum"],
            "install": d["disagg_kv_install_seconds_total"],
            "pull": d["disagg_kv_pull_seconds_total"],
            "first_token": tokens[0] - t0, "decode_step": tokens[1] - tokens[0],
            # the rest of the first token's wait: HTTP, admission, engine wake-ups, streaming
            "other": tokens[0] - t0 - d["disagg_kv_pull_seconds_total"],
            "consecutive": consecutive(dp["block_ids"][:-(-len(prompt) // 16)])}


def e2e_backend(model: str, backend: str, args: argparse.Namespace, tmp: str
                ) -> tuple[dict[tuple[int, str, str], list[float]],
                           dict[tuple[int, str], list[dict[str, Any]]]]:
    """(tokens, path, table) -> micro read seconds, (tokens, path) -> request samples."""
    rng = random.Random(0)
    started: list[subprocess.Popen] = []
    client = httpx.Client()
    micro = Micro(backend.lower(), max(args.tokens))
    mic: dict[tuple[int, str, str], list[float]] = {}
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    try:
        pairs: dict[str, tuple[str, str]] = {}
        for path in pair_names(args):
            urls = []
            for role in ("context", "generation"):
                proc, url = start(model, role, backend,
                                  os.path.join(tmp, f"{role}-{backend}-{path}.log"),
                                  runs=path != "staged",
                                  package=args.baseline_dir if path == BASELINE else None)
                started.append(proc)
                urls.append(url)
            pairs[path] = (urls[0], urls[1])
        for tokens in args.tokens:
            micro.lease(tokens)
            for i in range(args.warmup + args.reps):
                for path in PATHS:
                    for table in kv_transfer.TABLES:
                        for _ in range(2):  # the micro's warm-up: its first read after a wait
                            dt = micro.read(tokens, path, table)
                        if i >= args.warmup:
                            mic.setdefault((tokens, path, table), []).append(dt)
                # Alternating, all see the same host load; in a new order each rep, so that
                # no pair always runs right after another one (UCX's shared memory and the
                # caches carry state from one request to the next).
                order = pair_names(args)
                rng.shuffle(order)
                for path in order:
                    prompt = [rng.randrange(3, 500) for _ in range(tokens)]
                    s = one(client, *pairs[path], prompt)
                    if i >= args.warmup:
                        out.setdefault((tokens, path), []).append(s)
                print(f"{backend} {tokens} rep {i}: " + ", ".join(
                    f"{p} transfer {out[(tokens, p)][-1]['transfer'] * 1e3:.1f} ms"
                    for p in pair_names(args) if (tokens, p) in out), flush=True)
    finally:
        client.close()
        micro.close()
        procs.stop_all(started, grace_s=30.0)
    return mic, out


class Micro:
    """``bench.kv_transfer``'s two bare processes (its ``context_main`` behind a
    ``KVTransferServer``, a ``KVTransferClient`` here), kept alive beside the workers so that
    its reads interleave with the requests under the same host load."""

    def __init__(self, backend: str, max_tokens: int) -> None:
        n = -(-max_tokens // 16)
        # KV of the benchmark model: 8 layers x 4 kv heads x head_dim 64, 16-token blocks.
        self.shape = (2 * n + 16, 8, 2, 4, 16, 64)
        ctx = mp.get_context("spawn")  # a UCX context must be created after any fork
        self.cmds, self.events = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=kv_transfer.context_main, daemon=True, args=(
            backend, self.shape, "float32", self.cmds, self.events))
        self.proc.start()
        kind, self.addresses = self.events.get(timeout=120)
        assert kind == "address", self.addresses
        self.clients = {path: KVTransferClient(backend, kv_transfer.TOKEN, timeout_s=120.0,
                                               runs=path == "runs") for path in PATHS}
        self.rng = random.Random(0)
        self.reads: dict[tuple[int, str], tuple[ReadRequest, torch.Tensor]] = {}

    def lease(self, tokens: int) -> None:
        """Lease the two block tables of ``tokens`` (consecutive, fragmented); the receive
        buffer is allocated once and reused, as in ``bench.kv_transfer``."""
        for table, ids in kv_transfer.tables_for(tokens, 16, self.shape[0], self.rng).items():
            self.cmds.put(("lease", f"{table}-{tokens}", ids))
            assert self.events.get(timeout=60) == ("ok",)
            req = ReadRequest(f"{table}-{tokens}", ids, (0, 8), (0, 4))
            self.reads[(tokens, table)] = (req, torch.empty(payload_shape(self.shape, req)))

    def read(self, tokens: int, path: str, table: str) -> float:
        req, out = self.reads[(tokens, table)]
        t0 = time.perf_counter()
        self.clients[path].read(self.addresses[path], req, out).result(120)
        return time.perf_counter() - t0

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.cmds.put(("stop",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def med(samples: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for s in samples) * 1e3


def rows_of(backend: str, mic: dict[tuple[int, str, str], list[float]],
            e2e: dict[tuple[int, str], list[dict[str, Any]]]) -> list[str]:
    rows = []
    order = [*PATHS, BASELINE]
    for (tokens, path), samples in sorted(e2e.items(),
                                          key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        table = ("consecutive" if all(s["consecutive"] for s in samples) else
                 "fragmented" if not any(s["consecutive"] for s in samples) else "mixed")
        micro_path = "runs" if path == BASELINE else path  # (the baseline runs the default)
        ref = statistics.median(mic[(tokens, micro_path, "fragmented" if table == "fragmented"
                                     else "consecutive")]) * 1e3
        t = med(samples, "transfer")
        rows.append(
            f"| {backend} | {tokens} | {tokens * 16 / 1024:.0f} | {PATH_NAMES[path]} | {table} "
            f"| {ref:.2f} | {t:.2f} | **{t / ref:.2f}x** | {med(samples, 'install'):.2f} "
            f"| {med(samples, 'pull'):.2f} | {med(samples, 'pull') / ref:.2f}x "
            f"| {med(samples, 'first_token'):.1f} | {med(samples, 'other'):.1f} "
            f"| {med(samples, 'decode_step'):.1f} |")
    return rows


PATH_NAMES = {"staged": "before (`DISAGG_KV_RUNS=0`)", "runs": "after (runs)"}
BASELINE = "baseline"  # a third pair: the default path, workers of another git revision


def pair_names(args: argparse.Namespace) -> list[str]:
    """The worker pairs of a run, in the order their requests alternate."""
    return [*PATHS, BASELINE] if args.baseline else list(PATHS)


def report(args: argparse.Namespace, results: list[tuple[str, dict, dict]],
           load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    lines = [f"# End-to-end KV read vs the transport ({datetime.date.today()})", ""]
    lines += [f"- {m}" for m in kv_transfer.machine()]
    lines += [
        f"- host load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load[0])}, "
        f"after: {'/'.join(f'{x:.2f}' for x in load[1])}. The 2 cores were shared with other "
        "development sessions running their own work: absolute times are noisy; the "
        "before/after pairs ran interleaved, request by request (in a new random order each "
        "rep), under the same load.",
        "- model: random checkpoint, 8 layers x 4 kv heads x head_dim 64, float32, 16 tokens "
        "per block (256 KiB per block, 16 KiB per token: 2048 tokens = 32 MiB), two pairs of "
        "a context and a generation worker process (before, after), tp1/pp1 both sides",
        f"- medians of {args.reps} requests after {args.warmup} warm-up(s) per row; micro: "
        f"one read per rep, interleaved with the requests (after one untimed read)",
        f"- command: `python -m bench.kv_e2e --backends {','.join(args.backends_run)} "
        f"--tokens {','.join(map(str, args.tokens))} --reps {args.reps}"
        + (f" --baseline {args.baseline}" if args.baseline else "")
        + f" --out {args.out}`",
        *([f"- *{PATH_NAMES[BASELINE]}*: a third pair of workers running the package as of "
           f"git revision `{args.baseline}` (`git archive`), the default path, its requests "
           "interleaved with the other two pairs' (the before of a change, side by side)"]
          if args.baseline else []), "",
        "| backend | prompt tokens | MiB | path | context block table | micro read ms "
        "| e2e transfer ms | e2e / micro | install ms | pull ms (submit -> installed) "
        "| pull / micro | gen first token ms | of which not pull ms | first decode step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, mic, e2e in results:
        lines += rows_of(backend, mic, e2e)
    lines += ["", *NOTES]
    return "\n".join(lines) + "\n"


NOTES = [
    "Columns: *micro read* is `bench.kv_transfer`'s read of the same bytes (same block-table "
    "kind), measured in this run. *e2e transfer* is the generation worker's "
    "`disagg_kv_transfer_seconds` (submit -> last byte, the micro's definition). *pull* adds the "
    "engine loop's wake-up and the install. *gen first token*: context answer received by the "
    "router -> first token streamed by the generation worker (the context's token, sent once "
    "the KV is installed: HTTP + admission + pull); *of which not pull*: that minus the pull "
    "(HTTP, admission, engine wake-ups, streaming). The generation worker's added latency "
    "is thus split into transfer, install, the rest of the pull, the rest of the first "
    "token, and the *first decode step*: first -> second streamed token.",
    "",
    "*before*: both workers of the pair started with `DISAGG_KV_RUNS=0`: the context worker "
    "gathers a scattered block table into a staging buffer and sends it as one message, the "
    "generation worker receives into a pooled buffer and then copies it into the request's "
    "blocks (the install). *after*: the default: the context worker sends the runs of its "
    "table straight from the cache (TCP: `sendmsg`; UCX: parts gathered while the previous "
    "part is on the wire), the generation worker receives straight into the runs of the "
    "request's own blocks (TCP: `recvmsg_into`; UCX: one message per run when the runs are "
    "few and large, else a buffer + install), so install is ~0. The micro reference of each "
    "row is the same path's micro read.",
    "",
    "Where a ratio above 1.3x comes from (profiled with py-spy at 2048 tokens over TCP, both "
    "workers sampled during 12 requests, not part of this script): the transfer threads of "
    "both workers spend nearly all of a read blocked in `select` (the generation side "
    "waiting for the socket to turn readable, the context side for it to turn writable); the "
    "Python work of the read (`recvmsg_into` / `sendmsg` calls, headers) is a few percent of "
    "it; the engine thread only runs the decode steps after each pull (one request at a "
    "time), so it does not contend with the read. So the remaining gap is the "
    "loopback TCP path and when each process gets a core on this shared 2-core host (the "
    "micro's two processes see the same host, at other moments), not GIL contention, "
    "staging or the install; it moves between runs with the host load (compare the rows "
    "of one size across runs). Over UCX the same profile shows every Python thread of both "
    "workers idle during a read (the loop in `select`, ucxx's notifier waiting, the engine "
    "waiting): the bytes move in ucxx's native progress thread and UCX's shared-memory "
    "transport, which needs both processes on a core at the same moment and is the most "
    "load-sensitive path here (its micro reads vary the most too, see "
    "`bench/results/kv_transfer.md`); an e2e run has six transfer processes where the micro "
    "has two.",
    "",
    "UCX and a reused block pool: a finished request's blocks return to the free queue tail "
    "first (`disagg/kv_cache/manager.py`, so its last blocks are evicted first, as in vLLM) "
    "and are handed out again in that order, so "
    "after the first requests both tables are descending ids, i.e. runs of one block. TCP "
    "moves those without a copy either way; UCX gathers them part by part on the context "
    "side, and on the generation side receives into a buffer and installs (one message per "
    "256 KiB block would cost more than the copy), which is the *install* left in UCX rows.",
]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_e2e", description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="TCP,UCX")
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--baseline", metavar="REV", default=None,
                   help="also run a pair of workers of this git revision (the default path), "
                   "interleaved with the others: the before of a change")
    args = p.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    from disagg.model.tiny import write_tiny_checkpoint
    from disagg.transfer.ucx import ucx_available

    tmp = tempfile.mkdtemp(prefix="disagg-kve2e-")
    args.baseline_dir = checkout(args.baseline, tmp) if args.baseline else None
    if args.baseline:
        PATH_NAMES[BASELINE] = f"after, disagg @ {args.baseline}"
    args.backends_run = []
    model = write_tiny_checkpoint(os.path.join(tmp, "m"), vocab_size=512, hidden_size=512,
                                  intermediate_size=1024, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=MAX_LEN, seed=0)
    load0 = os.getloadavg()
    results = []
    for backend in args.backends.upper().split(","):
        if backend == "UCX" and not ucx_available()[0]:
            print(f"skipping UCX: {ucx_available()[1]}")
            continue
        args.backends_run.append(backend)
        results.append((backend, *e2e_backend(model, backend, args, tmp)))
    text = report(args, results, (load0, os.getloadavg()))
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
