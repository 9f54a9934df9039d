"""Device check: KV transfer between two processes on one GPU, Llama-3-8B KV shape.

    python3 -m bench.gpu.check_kv --out $OUT/kv.txt

A server process holds a CUDA KV cache ``[N, 32 layers, 2, 8 kv heads, 32 tokens/block, 128]``
bf16 (4 MiB a block) and serves it with ``KVTransferServer``; a client process pulls 2k and 8k
tokens (64 / 256 blocks: 256 MiB / 1 GiB) with ``KVTransferClient``, scattered block ids (the
server gathers) and one consecutive run (the server may send straight from its cache). For each
pull: bytes identical to the client's own copy of the seeded cache (built the same way on the
same GPU), whether it went GPU to GPU (``ReadResult.device_direct``) or through pinned host
memory and why, and its time against a device-to-device copy of the same bytes measured in the
same process and run (the issue's target: >= 50% of the D2D copy rate).

Configurations, each a fresh server + client pair (spawned; UCX reads its environment when its
context starts): UCX as configured (GPU-direct expected when UCX has CUDA transports), UCX with
``DISAGG_KV_DEVICE_DIRECT=0`` (forced pinned-host staging), TCP. Every sub-check is guarded:
a failure prints its full traceback and the rest go on; the exit code is 1 if any failed (a byte
mismatch, an error, or UCX not going GPU to GPU in the first configuration). < 90 s on an H100.

Environment: run from the repository root; ucxx-cu13 / libucx-cu13 installed
(bench/gpu/fetch_wheels.sh) for the UCX rows (they fail with the import error otherwise).
Optional: UCX_TLS etc. win over the backend's profile (see disagg/transfer/ucx.py);
UCX_LOG_LEVEL=info shows UCX's choices.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import traceback
from typing import Any

# CHECK_KV_DEVICE=cpu CHECK_KV_LAYERS=2: a smoke run of the orchestration without a GPU.
DEVICE = os.environ.get("CHECK_KV_DEVICE", "cuda")
LAYERS, KV_HEADS, BLOCK, HEAD_DIM = int(os.environ.get("CHECK_KV_LAYERS", "32")), 8, 32, 128
SIZES = (2048, 8192)  # tokens pulled
NUM_BLOCKS = 8192 // BLOCK + 72  # room for the scattered and the consecutive 8k pulls
SEED = 1234
TOKEN = "check-kv-token"
DEADLINE_S = 85.0
CONFIGS = (  # (name, backend, extra environment, GPU-direct expected)
    ("ucx", "ucx", {}, True),
    ("ucx-staged", "ucx", {"DISAGG_KV_DEVICE_DIRECT": "0"}, False),
    ("tcp", "tcp", {}, False),
)


def _make_cache() -> Any:
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(SEED)
    return torch.randn(NUM_BLOCKS, LAYERS, 2, KV_HEADS, BLOCK, HEAD_DIM, generator=g,
                       device=DEVICE, dtype=torch.bfloat16)


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _cases() -> list[tuple[str, int, str, tuple[int, ...]]]:
    """(lease id, tokens, kind, block ids): scattered (a fixed permutation) and consecutive."""
    import random

    rng = random.Random(SEED)
    perm = list(range(NUM_BLOCKS))
    rng.shuffle(perm)
    out = []
    for tokens in SIZES:
        n = tokens // BLOCK
        out.append((f"scattered-{tokens}", tokens, "scattered", tuple(perm[:n])))
        out.append((f"run-{tokens}", tokens, "consecutive", tuple(range(8, 8 + n))))
    return out


def _server_main(backend: str, env: dict[str, str], events: Any, cmds: Any) -> None:
    os.environ.update(env)
    try:
        import torch

        from disagg.transfer import KVTransferServer, LeaseTable

        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        kv = _make_cache()
        _sync()
        leases = LeaseTable(default_ttl_s=600.0)
        for lease_id, _, _, ids in _cases():
            leases.create(lease_id, list(ids), readers=1)
        server = KVTransferServer(kv, leases, TOKEN, backend, sweep_interval_s=None).start()
        events.put(("ready", server.address, server.payload.device_direct,
                    server.payload.staging_reason,
                    os.environ.get("UCX_TLS", "")))
        try:
            cmds.get(timeout=120)  # "stop", or the parent is gone
        except queue.Empty:
            pass
        snap = server.stats.snapshot()
        events.put(("server_stats", snap.device_direct_transfers, snap.host_staged_transfers,
                    snap.zero_copy_transfers, snap.staging_reasons))
        server.stop()
    except BaseException:
        events.put(("error", "server", traceback.format_exc()))


def _d2d_seconds(nbytes: int, reps: int = 5) -> float:
    """Median time of a device-to-device copy of ``nbytes`` (CUDA events)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    if DEVICE != "cuda":
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _client_main(backend: str, env: dict[str, str], address_q: Any, events: Any) -> None:
    os.environ.update(env)
    try:
        import torch

        from disagg.transfer import KVTransferClient, ReadRequest
        from disagg.transfer.payload import payload_shape

        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        kv = _make_cache()  # the same seeded cache as the server's: the reference bytes
        _sync()
        address = address_q.get(timeout=60)
        client = KVTransferClient(backend, TOKEN, timeout_s=30, connect_timeout_s=20)
        try:
            on_gpu = client.device_payloads
            events.put(("client", on_gpu, client.device_support[1]))
            side = torch.cuda.Stream() if DEVICE == "cuda" else None
            reps = 5 if backend == "ucx" else 3
            for lease_id, tokens, kind, ids in _cases():
                try:
                    req = ReadRequest(lease_id, ids, (0, LAYERS), (0, KV_HEADS))
                    shape = payload_shape(tuple(kv.shape), req)
                    if on_gpu:  # as kv_connector.pull.alloc_out: under a stream nothing runs on
                        with torch.cuda.stream(side):
                            out = torch.empty(shape, dtype=kv.dtype, device="cuda")
                    else:
                        out = torch.empty(shape, dtype=kv.dtype,
                                          pin_memory=DEVICE == "cuda")
                    nbytes = out.numel() * out.element_size()
                    out.view(torch.uint8).fill_(0xA5)
                    walls, reads = [], []
                    result = None
                    for i in range(reps + 1):  # the first read warms up connection and caches
                        t0 = time.perf_counter()
                        result = client.read(address, req, out).result(60)
                        wall = time.perf_counter() - t0
                        if i:
                            walls.append(wall)
                            reads.append(result.seconds)
                    assert result is not None
                    ref = kv.index_select(0, torch.tensor(ids, device=DEVICE))
                    got = out.to(DEVICE)
                    same = torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
                    del ref, got
                    d2d = _d2d_seconds(nbytes)
                    events.put(("row", tokens, kind, nbytes, statistics.median(reads),
                                statistics.median(walls), d2d, result.device_direct,
                                result.zero_copy, result.staging_reason, same))
                    del out
                except BaseException:
                    events.put(("error", f"client {lease_id}", traceback.format_exc()))
        finally:
            client.close()
    except BaseException:
        events.put(("error", "client", traceback.format_exc()))


class Report:
    def __init__(self, path: str | None) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.path = path

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def fail(self, what: str, detail: str = "") -> None:
        self.failures.append(what)
        self.say(f"FAIL {what}")
        if detail:
            self.say(detail.rstrip())

    def write(self) -> None:
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def _reap(procs: list[Any]) -> None:
    for p in procs:
        p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _run_config(rep: Report, name: str, backend: str, env: dict[str, str], want_direct: bool,
                budget_s: float) -> None:
    ctx = mp.get_context("spawn")
    events, cmds, address_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_server_main, args=(backend, env, events, cmds), daemon=True)
    client = ctx.Process(target=_client_main, args=(backend, env, address_q, events),
                         daemon=True)
    server.start()
    client.start()
    deadline = time.monotonic() + budget_s
    rows = 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                rep.fail(f"{name}: out of time ({budget_s:.0f} s) after {rows} rows")
                return
            try:
                ev = events.get(timeout=min(left, 1.0))
            except queue.Empty:
                if not client.is_alive() and events.empty():
                    if client.exitcode:
                        rep.fail(f"{name}: client exited with {client.exitcode}")
                    break
                continue
            kind = ev[0]
            if kind == "ready":
                _, address, direct, reason, tls = ev
                rep.say(f"[{name}] server at {address}: "
                        + ("sends from GPU memory" if direct
                           else f"host staging ({reason})" if reason else "host memory")
                        + (f"; UCX_TLS={tls}" if backend == "ucx" else ""))
                address_q.put(address)
            elif kind == "client":
                _, on_gpu, how = ev
                rep.say(f"[{name}] client: " + (f"receives into GPU memory ({how})" if on_gpu
                                                else f"receives into pinned host ({how})"))
            elif kind == "row":
                (_, tokens, what, nbytes, read_s, wall_s, d2d_s, direct, zero_copy, reason,
                 same) = ev
                rows += 1
                gbps = nbytes / read_s / 1e9
                rep.say(f"[{name}] {tokens:5d} tok {what:11s} {nbytes / 2**20:6.0f} MiB  "
                        f"read {read_s * 1e3:8.2f} ms ({gbps:6.1f} GB/s; wall "
                        f"{wall_s * 1e3:8.2f} ms)  D2D copy {d2d_s * 1e3:6.2f} ms "
                        f"({nbytes / d2d_s / 1e9:6.1f} GB/s)  = {d2d_s / read_s:6.1%} of D2D  "
                        f"{'GPU-direct' if direct else 'staged'}"
                        f"{' zero-copy' if zero_copy else ''}"
                        f"{f' ({reason})' if reason else ''}  bytes "
                        f"{'identical' if same else 'DIFFER'}")
                if not same:
                    rep.fail(f"{name} {tokens} tok {what}: bytes differ")
                if DEVICE == "cuda" and direct != want_direct:
                    rep.fail(f"{name} {tokens} tok {what}: device_direct={direct}, expected "
                             f"{want_direct} ({reason or 'no reason given'})")
                if rows == 2 * len(SIZES):
                    cmds.put("stop")
            elif kind == "server_stats":
                _, direct_n, staged_n, zc_n, reasons = ev
                rep.say(f"[{name}] server stats: device_direct={direct_n} host_staged="
                        f"{staged_n} zero_copy={zc_n} staging_reasons={list(reasons)}")
                break
            elif kind == "error":
                rep.fail(f"{name}: {ev[1]} raised", ev[2])
                if ev[1] in ("server", "client"):
                    return
    finally:
        cmds.put("stop")
        _reap([client, server])


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.check_kv",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the report here")
    ap.add_argument("--only", help="comma-separated configuration names "
                                   f"({', '.join(c[0] for c in CONFIGS)})")
    args = ap.parse_args()
    rep = Report(args.out)
    t_start = time.monotonic()
    try:
        import torch

        if DEVICE == "cuda" and not torch.cuda.is_available():
            rep.fail("no CUDA device")
            rep.write()
            return 1
        gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "the CPU (smoke run)"
        rep.say(f"KV transfer check on {gpu}: Llama-3-8B KV shape "
                f"({LAYERS} layers, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, bf16, "
                f"{BLOCK} tokens/block, {LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * 2 >> 20} "
                f"MiB a block); torch {torch.__version__}")
        from disagg.transfer.ucx import ucx_available

        ok, why = ucx_available()
        rep.say(f"ucxx: {why}" if ok else f"ucxx unavailable: {why}")
        rep.say("read = request sent -> last byte in the client's buffer (median of the "
                "timed reads after one warm-up); D2D = median torch copy of the same bytes "
                "on this GPU, same run")
    except BaseException:
        rep.fail("setup", traceback.format_exc())
        rep.write()
        return 1
    only = set(args.only.split(",")) if args.only else None
    configs = [c for c in CONFIGS if only is None or c[0] in only]
    for i, (name, backend, env, want_direct) in enumerate(configs):
        left = DEADLINE_S - (time.monotonic() - t_start)
        budget = left / (len(configs) - i)
        if budget < 5:
            rep.fail(f"{name}: skipped, out of time")
            continue
        try:
            _run_config(rep, name, backend, env, want_direct, budget)
        except BaseException:
            rep.fail(f"{name}: check crashed", traceback.format_exc())
    rep.say(f"total {time.monotonic() - t_start:.1f} s; "
            + (f"{len(rep.failures)} FAILED: {rep.failures}" if rep.failures else "all passed"))
    rep.write()
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
