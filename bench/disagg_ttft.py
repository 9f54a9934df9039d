"""Transfer time as a share of TTFT at 2048 prompt tokens, context -> generation workers.

Two real worker processes on this host (``disagg serve --role context`` / ``--role
generation``) over a random checkpoint whose KV matches ``bench.kv_transfer`` (8 layers x 4
kv heads x head_dim 64, float32, 16 tokens per block). Per rep, the router's two calls:

    TTFT     = context call (prefill + first token, answer with the lease)
             + generation call until its first streamed token (KV pull + 1 decode step)
    transfer = the generation worker's KV read latency (``disagg_kv_transfer_seconds_sum``
               delta on its /metrics: submit -> last payload byte)

Medians of ``--reps`` reps after 2 warm-ups, per backend. The result replaces the TTFT line of
``bench/results/kv_transfer.md`` (``--out``).

    python -m bench.disagg_ttft [--backends TCP,UCX] [--tokens 2048] [--reps 5]
                                [--out bench/results/kv_transfer.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from disagg import procs
from disagg.cluster_auth import member_id_of, sign_http

TOKEN = "bench-secret"
LINE_PREFIX = "Transfer share of TTFT at"


def start(model: str, role: str, backend: str, log: str, extra: tuple[str, ...] = ()
          ) -> tuple[subprocess.Popen, str]:
    """A worker of ``role`` on a free port (``extra``: more ``disagg serve`` flags)."""
    port = procs.free_port()
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": TOKEN}
    proc = procs.spawn(
        [sys.executable, "-m", "disagg.cli", "serve", model, "--port", str(port), "--role", role,
         "--kv-transfer-backend", backend, "--served-model-name", "m", "--log-level", "warning",
         "--kv-cache-tokens", "16384", "--max-num-tokens", "4096", "--max-model-len", "4096",
         "--tokens-per-block", "16", "--no-enable-prefix-caching", *extra], log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(url, 120, proc=proc, interval=0.2, what=f"{role} worker")
    except procs.NotHealthy as e:
        procs.stop(proc, grace_s=0)
        raise RuntimeError(f"{e}; see {log}") from None
    return proc, url


def transfer_seconds(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^disagg_kv_transfer_seconds_sum\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def one(ctx: str, gen: str, prompt: list[int]) -> tuple[float, float]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    before = transfer_seconds(gen)
    t0 = time.perf_counter()
    answer = httpx.post(ctx + "/v1/completions", timeout=120, json={
        **body, "disaggregated_params": {"request_type": "context_only"}}).json()
    dp = answer["disaggregated_params"]
    gbody = {**body, "stream": True,
             "disaggregated_params": {**dp, "request_type": "generation_only"}}
    # Signed as the router signs it: the generation worker trusts the context's addresses.
    data = json.dumps(gbody).encode()
    headers = {"Content-Type": "application/json",
               **sign_http(TOKEN, "POST", "/v1/completions", data,
                           audience=member_id_of(gen))}
    ttft = None
    with httpx.stream("POST", gen + "/v1/completions", content=data, headers=headers,
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and ttft is None:
                ev = json.loads(line[6:])
                if ev["choices"] and ev["choices"][0]["text"]:
                    ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft, transfer_seconds(gen) - before


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.disagg_ttft",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="TCP,UCX")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from disagg.model.tiny import write_tiny_checkpoint
    from disagg.transfer.ucx import ucx_available

    tmp = tempfile.mkdtemp(prefix="disagg-ttft-")
    model = write_tiny_checkpoint(os.path.join(tmp, "m"), vocab_size=512, hidden_size=512,
                                  intermediate_size=1024, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=4096, seed=0)
    rng = random.Random(0)
    results: list[dict[str, Any]] = []
    for backend in args.backends.split(","):
        if backend.upper() == "UCX" and not ucx_available()[0]:
            print(f"skipping UCX: {ucx_available()[1]}")
            continue
        started = []
        try:
            c, ctx = start(model, "context", backend, os.path.join(tmp, f"ctx-{backend}.log"))
            started.append(c)
            g, gen = start(model, "generation", backend, os.path.join(tmp, f"gen-{backend}.log"))
            started.append(g)
            samples = []
            for i in range(args.reps + 2):
                prompt = [rng.randrange(3, 500) for _ in range(args.tokens)]
                ttft, xfer = one(ctx, gen, prompt)
                if i >= 2:
                    samples.append((ttft, xfer))
        finally:
            procs.stop_all(started, grace_s=30.0)
        ttft = statistics.median(s[0] for s in samples)
        xfer = statistics.median(s[1] for s in samples)
        share = statistics.median(s[1] / s[0] for s in samples)
        results.append({"backend": backend.upper(), "ttft_ms": ttft * 1e3,
                        "transfer_ms": xfer * 1e3, "share": share})
        print(results[-1])
    parts = [f"{r['backend']} {r['share'] * 100:.1f}% (transfer {r['transfer_ms']:.1f} ms of "
             f"TTFT {r['ttft_ms']:.0f} ms)" for r in results]
    line = (f"{LINE_PREFIX} {args.tokens} prompt tokens (two worker processes, 8-layer random "
            f"model, median of {args.reps}; `python -m bench.disagg_ttft`): "
            + "; ".join(parts) + ". Target <= 5%: "
            + ("met" if results and all(r["share"] <= 0.05 for r in results) else "not met")
            + ".")
    print(line)
    if args.out:
        with open(args.out) as f:
            lines = f.read().splitlines()
        lines = [ln for ln in lines if not ln.startswith(LINE_PREFIX)]
        lines.append(line)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
