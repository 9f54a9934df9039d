"""KV transfer bandwidth across a veth link between two network namespaces vs over loopback.

Two "hosts" (network namespaces on a private bridge, ``tests/netns.py``, imported as
``tests.netns``: run it from the repository root): a *server* process in
host A holds a KV cache behind a ``KVTransferServer`` bound to ``0.0.0.0``, with one lease over
``--mib`` MiB of blocks; a *client* process pulls that lease ``--reps`` times (after one
warm-up) into a preallocated buffer, once from host B over A's veth address (``cross``) and
once from host A itself over ``127.0.0.1`` (``loopback``): the same server, the same bytes, only
the path differs. UCX runs with the profile ``auto`` picks for that address (cross_host for the
veth address, same_host for loopback) and, to separate the link from the settings, also with
cross_host on loopback. ``numpy.copyto`` of the same bytes in the client is the physical limit
measured beside each read.

    python -m bench.multihost [--backends tcp,ucx] [--mib 64] [--reps 5] [--rounds 3]
                              [--ucx-profiles cross_host,same_host]
                              [--out bench/results/multihost.md]

Needs root (network namespaces). ``serve`` and ``pull`` are the two child roles it starts
inside the namespaces (``ip netns exec``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "multihost-bench-secret"
LEASE = "bench"
# KV cache geometry: 4 layers x 2 (k, v) x 4 kv heads x 16 tokens x head_dim 64, float32:
# 128 KiB per block, so --mib M is 8 * M blocks.
GEOMETRY = (4, 2, 4, 16, 64)
BLOCK_BYTES = 4 * 2 * 4 * 16 * 64 * 4
SERVER_LIFETIME_S = 300.0  # a server left behind by a crashed parent exits by itself
CHILD_TIMEOUT_S = 120.0


def _blocks(mib: int) -> int:
    return mib * 2**20 // BLOCK_BYTES


# ---- children --------------------------------------------------------------------------------


def serve_main(args: argparse.Namespace) -> int:
    """A KV cache behind a transfer server; prints ``READY <port>`` and waits for SIGTERM."""
    import torch

    from disagg.transfer import KVTransferServer, LeaseTable
    from disagg.transfer.backends import make_backend

    n = _blocks(args.mib)
    kv = torch.empty((n, *GEOMETRY), dtype=torch.float32)
    kv.uniform_(-1, 1)
    leases = LeaseTable(default_ttl_s=SERVER_LIFETIME_S)
    leases.create(LEASE, list(range(n)), readers=1)
    backend = make_backend({"backend": args.backend, "ucx_profile": args.profile})
    server = KVTransferServer(kv, leases, TOKEN, backend, args.host).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print(f"READY {server.address.rpartition(':')[2]}", flush=True)
        time.sleep(SERVER_LIFETIME_S)
    finally:
        server.stop()
    return 0


def pull_main(args: argparse.Namespace) -> int:
    """Pull the server's lease ``--reps`` times; prints one JSON line of timings."""
    import numpy as np
    import torch

    from disagg.transfer import KVTransferClient, ReadRequest
    from disagg.transfer.backends import make_backend
    from disagg.transfer.payload import payload_shape

    n = _blocks(args.mib)
    req = ReadRequest(LEASE, list(range(n)), (0, GEOMETRY[0]), (0, GEOMETRY[2]))
    out = torch.empty(payload_shape((n, *GEOMETRY), req), dtype=torch.float32)
    nbytes = out.numel() * out.element_size()
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    backend = make_backend({"backend": args.backend, "ucx_profile": args.profile})
    client = KVTransferClient(backend, TOKEN, timeout_s=CHILD_TIMEOUT_S)
    reads, copies = [], []
    try:
        for rep in range(1 + args.reps):  # rep 0: warm-up (connection set-up)
            t0 = time.perf_counter()
            client.read(args.address, req, out).result(CHILD_TIMEOUT_S)
            t1 = time.perf_counter()
            np.copyto(dst, src)
            t2 = time.perf_counter()
            if rep:
                reads.append(t1 - t0)
                copies.append(t2 - t1)
        ok = bool(torch.all(out[0, 0, 0, 0] != 0))  # the server's random values arrived
        transports = backend.describe()["transports"] if hasattr(backend, "describe") else []
    finally:
        client.close()
    print(json.dumps({"bytes": nbytes, "read_s": statistics.median(reads),
                      "best_s": min(reads), "copy_s": statistics.median(copies),
                      "data_ok": ok, "transports": transports}), flush=True)
    return 0


# ---- the orchestration ---------------------------------------------------------------------


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench.multihost", *args]


def _child_env() -> dict[str, str]:
    """This environment with the repository root first on ``PYTHONPATH``: the children run
    ``python -m bench.multihost`` wherever ``ip netns exec`` starts them."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _wait_ready(log: Path, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("READY "):
                return int(line.split()[1])
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"server not ready in {CHILD_TIMEOUT_S:g} s")


def _pull(host: Any, backend: str, profile: str, address: str, args: argparse.Namespace
          ) -> dict[str, Any]:
    cmd = host.argv(_python("pull", "--backend", backend, "--profile", profile, "--address",
                            address, "--mib", str(args.mib), "--reps", str(args.reps)))
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                        env=_child_env())
    if cp.returncode != 0:
        raise RuntimeError(f"pull from {address} failed ({cp.returncode}): {cp.stderr[-2000:]}")
    return json.loads(cp.stdout.strip().splitlines()[-1])


def _mtu(host: Any, dev: str) -> int | None:
    """The MTU of ``dev`` inside ``host`` (segment size: lo's is far larger than a veth's)."""
    cp = subprocess.run(["ip", "-n", host.ns, "-o", "link", "show", dev], capture_output=True,
                        text=True, timeout=20)
    words = cp.stdout.split()
    return int(words[words.index("mtu") + 1]) if "mtu" in words else None


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _row(backend: str, profile: str, path: str, results: list[dict[str, Any]]
         ) -> dict[str, Any]:
    """One table row from each round's pull: medians over rounds, the range of round medians."""
    nbytes = results[0]["bytes"]
    per_round = [_gbps(nbytes, r["read_s"]) for r in results]
    return dict(backend=backend, profile=profile, path=path, mib=nbytes / 2**20,
                gbps=statistics.median(per_round), low=min(per_round), high=max(per_round),
                best_gbps=max(_gbps(nbytes, r["best_s"]) for r in results),
                memcpy_gbps=statistics.median(_gbps(nbytes, r["copy_s"]) for r in results),
                data_ok=all(r["data_ok"] for r in results), transports=results[0]["transports"])


def measure(lab: Any, backends: list[str], args: argparse.Namespace, logs: Path
            ) -> list[dict[str, Any]]:
    """One row per (backend, profile, path): GB/s (median over rounds of each round's median
    read), the best read, memcpy."""
    from disagg import procs

    a, b = lab.add_host("bench-a"), lab.add_host("bench-b")
    args.mtus = {dev: _mtu(a, dev) for dev in ("eth0", "lo")}
    plans = [("TCP", "auto")] if "tcp" in backends else []
    if "ucx" in backends:
        plans += [("UCX", p) for p in args.ucx_profiles.split(",")]
    rows: list[dict[str, Any]] = []
    for backend, profile in plans:
        log = logs / f"serve-{backend}-{profile}.log"
        proc = lab.spawn(a, _python("serve", "--backend", backend, "--profile", profile,
                                    "--host", "0.0.0.0", "--mib", str(args.mib)),
                         log, env=_child_env())
        try:
            port = _wait_ready(log, proc)
            paths = [("veth", b, f"{a.addr}:{port}"), ("loopback", a, f"127.0.0.1:{port}")]
            if profile == "same_host":  # only what auto picks for loopback
                paths = paths[1:]
            # Rounds alternate the paths, so both see the same background load.
            got: dict[str, list[dict[str, Any]]] = {path: [] for path, _, _ in paths}
            for _ in range(args.rounds):
                for path, host, address in paths:
                    got[path].append(_pull(host, backend, profile, address, args))
            for path, results in got.items():
                rows.append(_row(backend, profile, path, results))
                print(f"{backend} {profile:>10} {path:>8}: {rows[-1]['gbps']:.2f} GB/s "
                      f"(memcpy {rows[-1]['memcpy_gbps']:.2f})", flush=True)
        finally:
            procs.stop_all([proc], grace_s=10.0)
    return rows


def machine() -> list[str]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return [f"CPU: {cpu}, {os.cpu_count()} cores (shared with other work on this machine)",
            f"kernel: {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}"]


VETH_NOTE = (
    "What a veth pair is, and is not: two virtual Ethernet devices joined back to back in the "
    "kernel, here one in each host's network namespace and plugged into a Linux bridge in a "
    "third namespace. A packet sent on one end is handed to the other end by the kernel on "
    "the same CPU: a memory copy through the full TCP/IP stack of both namespaces (routing, "
    "ARP, the bridge's forwarding, netfilter hooks, an Ethernet MTU), with no NIC, no DMA, "
    "no wire latency or loss and no bandwidth cap of its own. "
    "So these numbers show that addressing, routing and transport selection work across two "
    "interfaces in two network stacks (each process sees only its own `eth0` and its own "
    "loopback, and UCX's shared-memory transports cannot take a short cut to the other "
    "namespace's process), and what the extra stack traversal costs against loopback; they "
    "say nothing about a real NIC's bandwidth or latency (a 100 Gb/s link's line rate is 12.5 "
    "GB/s, a 25 Gb/s one's 3.1 GB/s; RDMA transports were not available here). UCX's same_host "
    "profile on loopback uses shared memory, whose fragmented pipeline needs both processes on a "
    "core at once: on an oversubscribed host it varies widely (disagg/transfer/ucx.py).")


def _ratio(rows: list[dict[str, Any]], backend: str, veth_profile: str, lo_profile: str
           ) -> str | None:
    veth = [r for r in rows if (r["backend"], r["profile"], r["path"])
            == (backend, veth_profile, "veth")]
    lo = [r for r in rows if (r["backend"], r["profile"], r["path"])
          == (backend, lo_profile, "loopback")]
    if not veth or not lo:
        return None
    return (f"- {backend} veth / loopback ({veth_profile} vs {lo_profile}): "
            f"{veth[0]['gbps']:.2f} / {lo[0]['gbps']:.2f} GB/s = "
            f"{veth[0]['gbps'] / lo[0]['gbps']:.2f}")


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = [f"# KV transfer across a veth link vs loopback ({time.strftime('%Y-%m-%d')})", "",
            *[f"- {m}" for m in machine()],
            f"- {args.mib} MiB per read (one lease of {_blocks(args.mib)} blocks of "
            f"{BLOCK_BYTES // 1024} KiB, `\"blocks\"` format); {args.rounds} rounds, each a fresh "
            f"client process per path (the paths alternate) doing one warm-up and {args.reps} "
            f"reads timed from submit to the last byte in its preallocated buffer; GB/s = "
            f"median over rounds of each round's median read; memcpy = `numpy.copyto` of the "
            f"same bytes in the client",
            f"- MTU: veth `eth0` {args.mtus.get('eth0')}, `lo` {args.mtus.get('lo')} (TCP "
            f"segments over the veth are that much smaller: more packets per byte)",
            f"- host load average (1 min) before / after: {args.load[0]:.2f} / "
            f"{os.getloadavg()[0]:.2f} (2 shared cores: other work moves these numbers)",
            "- command: `python -m bench.multihost " + " ".join(sys.argv[1:]) + "`", "",
            "| backend | UCX profile | path | MiB | GB/s (median) | rounds' range | GB/s (best) "
            "| memcpy GB/s | data checked | UCX transports (client) |",
            "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    body = [f"| {r['backend']} | {r['profile'] if r['backend'] == 'UCX' else '-'} | "
            f"{r['path']} | {r['mib']:.0f} | {r['gbps']:.2f} | {r['low']:.2f}-{r['high']:.2f} | "
            f"{r['best_gbps']:.2f} | "
            f"{r['memcpy_gbps']:.2f} | {'yes' if r['data_ok'] else 'NO'} | "
            f"{', '.join(r['transports']) or '-'} |" for r in rows]
    ratios = [x for x in (_ratio(rows, "TCP", "auto", "auto"),
                          _ratio(rows, "UCX", "cross_host", "cross_host"),
                          _ratio(rows, "UCX", "cross_host", "same_host")) if x]
    return "\n".join([*head, *body, "", "Ratios:", "", *ratios, "", VETH_NOTE, ""])


def run_main(args: argparse.Namespace) -> int:
    from disagg.transfer.ucx import ucx_available
    from tests.netns import NetLab, netns_unavailable

    why = netns_unavailable()
    if why:
        print(f"bench.multihost: network namespaces unavailable: {why}", file=sys.stderr)
        return 2
    backends = [b.strip().lower() for b in args.backends.split(",") if b.strip()]
    if "ucx" in backends and not ucx_available()[0]:
        print(f"skipping UCX: {ucx_available()[1]}", file=sys.stderr)
        backends.remove("ucx")
    args.load = os.getloadavg()
    logs = Path(args.logs or "/tmp") / f"multihost-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    with NetLab(root_link=False) as lab:
        rows = measure(lab, backends, args, logs)
    text = report(rows, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.multihost",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    p.add_argument("--backends", default="tcp,ucx")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="client processes per path")
    p.add_argument("--ucx-profiles", default="cross_host,same_host",
                   help="UCX servers to run: cross_host (pulled over veth and loopback), "
                   "same_host (over loopback: what auto picks there)")
    p.add_argument("--out", default=None, help="write the markdown report here")
    p.add_argument("--logs", default=None, help="folder for the servers' logs (default /tmp)")
    for name in ("serve", "pull"):
        s = sub.add_parser(name)
        s.add_argument("--backend", required=True, choices=("TCP", "UCX"))
        s.add_argument("--profile", default="auto")
        s.add_argument("--mib", type=int, default=64)
        if name == "serve":
            s.add_argument("--host", default="0.0.0.0")
        else:
            s.add_argument("--address", required=True)
            s.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    bad = set(getattr(args, "ucx_profiles", "").split(",")) - {"cross_host", "same_host", ""}
    if args.cmd is None and bad:
        p.error(f"--ucx-profiles: unknown {sorted(bad)}")
    if args.mib < 1 or args.reps < 1 or getattr(args, "rounds", 1) < 1:
        p.error("--mib, --reps and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.cmd == "serve":
        return serve_main(args)
    if args.cmd == "pull":
        return pull_main(args)
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
