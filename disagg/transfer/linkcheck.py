"""KV link check: test blocks through a KV transfer backend between two processes, measured and
judged (``disagg doctor``; a worker's ``--kv-link-check``).

One end serves *test blocks* (``serve_probe_blocks``): a KV cache of ``ProbeBlocks``' shape
(by default 2048 tokens of an 8B model's KV per rank: 32 layers x 2 x 8 kv heads x head_dim
128, bfloat16, 16 tokens per block: 128 blocks, 256 MiB) behind a ``KVTransferServer`` with one
lease over all of it, named after the shape (a peer asking for another shape gets
``unknown_lease``, reported as "give both ends the same block flags"). Block ``i`` holds the
value ``i % 200`` everywhere (exact in every dtype offered), so the reader can tell the right
blocks arrived.

The other end pulls them (``measure_link``), as a generation worker does, with the same
``KVTransferClient``:

- one read of all blocks with the integrity check on (``kv_integrity``'s checksum) plus a
  content check: the bytes arrived intact and are the test blocks (not timed: it also opens
  the connection);
- ``reps`` reads of all blocks, integrity off (the checksum is CPU work, not the link), each
  timed from submit to the last byte in the preallocated buffer: *bandwidth* = bytes / median
  read time (GB/s = 1e9 bytes per second), and the best read;
- on the same host: ``numpy.copyto`` of the same bytes, timed beside each read (*memcpy*, the
  physical limit here, measured in the same run);
- ``latency_reads`` small reads (one block, one layer, one kv head: 8 KiB by default), after one
  warm-up: p50 and p99 of their round trips;
- what the transport selected: UCX: the lanes (``transport/device``) of the client's endpoint
  to the server and the protocol its tag messages of each size use (``ucp_ep_print_info``,
  ``ucx.endpoint_report``), beside the UCX context's transports; TCP: a socket, from the source
  address (and its device) of this host's route to the peer.

``judge`` sets the verdict: against the expected link rate (``expected_link_gbps``) for a peer
on another host, against memcpy for one on this host: ``slow`` below ``min_share`` of it
(``MIN_SHARE``: 0.5 of a link rate; 0.2 of memcpy, since a transfer between two processes
copies each byte at least twice, into a socket or a shared segment and out of it: TCP reaches
~40% of memcpy here, UCX shared memory 60-90%), ``ok`` otherwise; ``unjudged`` for another host
with no expected rate, and against memcpy for reads under ``MEMCPY_MIN_BYTES`` (128 MiB:
per-read costs dominate smaller ones and memcpy runs partly in the CPU's cache). The report
shows the host's load average beside memcpy: busy cores slow every copy. A transfer that
fails is ``LinkCheckError``.

``run_peer_check`` runs the pulling end in a child process (``python -m disagg.doctor --peer
... --json``: ``disagg doctor`` without the other subcommands' imports; the cluster token in its
environment) and returns its report: ``disagg doctor --local`` and the
worker's start-up check (``startup_link_check``: the worker serves test blocks of its own KV
layout through its own backend and UCX context, on its KV host, and a child pulls them over its
KV address) both use it, so a pull always runs in a process of its own, as a generation
worker's does (one UCX context per process: a client in the serving process would share its
worker and measure neither side).

Importing this module does not import torch (the CLI parser reads its constants).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disagg.addresses import is_local_address, is_loopback, route_source, strip_brackets
from disagg.transfer.base import Connection, TransportBackend, parse_address
from disagg.transfer.tcp import TcpBackend
from disagg.transfer.ucx import UcxBackend, endpoint_report, parse_endpoint_report

if TYPE_CHECKING:
    import torch

    from disagg.transfer.service import KVTransferServer

logger = logging.getLogger("disagg.transfer")

# Element sizes of the dtypes test blocks may have (block i holds i % 200: exact in each).
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}
PATTERN_MOD = 200
# The minimum share of the reference below which a link is slow: of an expected link rate,
# and of memcpy on this host. Between two processes each byte is copied at least twice (into a
# socket or a shared segment and out): measured here on a quiet host (bench/results/
# kv_transfer.md, 32-128 MiB reads) TCP reaches 38-45% of memcpy and UCX shared memory 60-90%;
# UCX with its default settings ~10% (UCX-NOTES) and shared memory on an oversubscribed host
# 2-10% (its copy pipeline needs both processes on a core at once).
MIN_SHARE = {"link": 0.5, "memcpy": 0.2}
# Smaller reads are not judged against memcpy: per-read costs dominate them, and a memcpy of so
# few bytes runs partly in the CPU's cache (64 MiB copied at 10.7 GB/s here, 256 MiB at 7.2).
MEMCPY_MIN_BYTES = 128 << 20
DEFAULT_REPS = 5
DEFAULT_LATENCY_READS = 100
DEFAULT_TIMEOUT_S = 120.0
LEASE_TTL_S = 1e9  # the test lease outlives any run (nobody confirms it)
# The start-up check: this many tokens of the worker's own layout, more where they make fewer
# than MEMCPY_MIN_BYTES (a small model), fewer where they make more than STARTUP_MAX_BYTES.
STARTUP_TOKENS = 2048
STARTUP_MAX_BYTES = 256 << 20
STARTUP_MAX_BLOCKS = 16384  # block ids of one READ (its header holds ~150k)
STARTUP_REPS = 3
STARTUP_LATENCY_READS = 50


class LinkCheckError(RuntimeError):
    """The check could not move its test blocks (the message says where and why)."""


@dataclass(frozen=True)
class ProbeBlocks:
    """The shape of the test blocks: ``tokens`` of KV in blocks of ``tokens_per_block``, each
    block ``[layers, kv_parts, kv_heads, tokens_per_block, head_dim]`` of ``dtype`` (a KV
    cache's per-rank block; ``kv_parts`` 1 for an MLA latent). Defaults: an 8B model
    (Llama-3-8B: 32 layers, 8 kv heads, head_dim 128, bfloat16) at tensor parallel 1."""

    tokens: int = 2048
    layers: int = 32
    kv_parts: int = 2
    kv_heads: int = 8
    head_dim: int = 128
    tokens_per_block: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("tokens", "layers", "kv_heads", "head_dim", "tokens_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if self.kv_parts not in (1, 2):
            raise ValueError(f"kv_parts: must be 1 or 2, got {self.kv_parts!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype: must be one of {list(DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // self.tokens_per_block)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.layers, self.kv_parts, self.kv_heads,
                self.tokens_per_block, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.shape[1:]) * DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of one read of every block (every layer and kv head)."""
        return self.num_blocks * self.block_bytes

    @property
    def small_bytes(self) -> int:
        """Bytes of a small read: one block, one layer, one kv head."""
        return self.kv_parts * self.tokens_per_block * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def lease_id(self) -> str:
        n, layers, parts, heads, block, dim = self.shape
        return f"doctor-{n}x{layers}x{parts}x{heads}x{block}x{dim}-{self.dtype}"

    def describe(self) -> str:
        return (f"{self.tokens} tokens of {self.layers} layers x {self.kv_parts} x "
                f"{self.kv_heads} kv heads x head_dim {self.head_dim}, {self.dtype}, "
                f"{self.tokens_per_block} tokens per block: {self.num_blocks} blocks, "
                f"{self.nbytes / 2**20:.1f} MiB per read")

    def flags(self) -> list[str]:
        """The ``disagg doctor`` flags that give this shape."""
        return ["--tokens", str(self.tokens), "--layers", str(self.layers), "--kv-parts",
                str(self.kv_parts), "--kv-heads", str(self.kv_heads), "--head-dim",
                str(self.head_dim), "--tokens-per-block", str(self.tokens_per_block),
                "--dtype", self.dtype]

    @classmethod
    def like_cache(cls, kv_cache: torch.Tensor) -> ProbeBlocks:
        """Blocks of a KV cache's own layout (``[N, L, parts, H, B, D]``): ``STARTUP_TOKENS``
        tokens, or as many as make ``MEMCPY_MIN_BYTES`` .. ``STARTUP_MAX_BYTES`` (in at most
        ``STARTUP_MAX_BLOCKS`` blocks); a dtype not offered travels as its bytes."""
        _, layers, parts, heads, block, dim = (int(x) for x in kv_cache.shape)
        name = str(kv_cache.dtype).removeprefix("torch.")
        if name not in DTYPE_SIZES:
            name, dim = "uint8", dim * kv_cache.element_size()
        per_token = layers * parts * heads * dim * DTYPE_SIZES[name]
        tokens = min(max(STARTUP_TOKENS, -(-MEMCPY_MIN_BYTES // per_token)),
                     max(block, STARTUP_MAX_BYTES // per_token), STARTUP_MAX_BLOCKS * block)
        return cls(tokens=tokens, layers=layers, kv_parts=parts, kv_heads=heads, head_dim=dim,
                   tokens_per_block=block, dtype=name)


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def serve_probe_blocks(blocks: ProbeBlocks, backend: str | TransportBackend, token: str,
                       host: str = "127.0.0.1", port: int = 0,
                       advertise_host: str | None = None) -> KVTransferServer:
    """A started ``KVTransferServer`` over test blocks of ``blocks``' shape (host memory),
    with one lease (``blocks.lease_id``) over all of them; the caller stops it."""
    import torch

    from disagg.transfer.lease import LeaseTable
    from disagg.transfer.service import KVTransferServer

    n = blocks.num_blocks
    kv = torch.empty(blocks.shape, dtype=_torch_dtype(blocks.dtype))
    kv.copy_((torch.arange(n) % PATTERN_MOD).to(kv.dtype).view(n, 1, 1, 1, 1, 1)
             .expand(blocks.shape))
    leases = LeaseTable(default_ttl_s=LEASE_TTL_S)
    leases.create(blocks.lease_id, range(n), readers=1)
    return KVTransferServer(kv, leases, token, backend, host, port,
                            advertise_host=advertise_host, sweep_interval_s=None).start()


# ---- the pulling end --------------------------------------------------------------------------


class _Recording:
    """A backend that keeps the connections it opens (to ask what they selected)."""

    conns: list[Connection]

    async def connect(self, host: str, port: int, timeout_s: float) -> Connection:
        conn = await super().connect(host, port, timeout_s)  # type: ignore[misc]
        self.conns.append(conn)
        return conn


class _RecordingTcp(_Recording, TcpBackend):
    def __init__(self) -> None:
        super().__init__()
        self.conns = []


class _RecordingUcx(_Recording, UcxBackend):
    def __init__(self, profile: str) -> None:
        super().__init__(profile)
        self.conns = []


def recording_backend(backend: str, ucx_profile: str = "same_host") -> _Recording:
    """A ``TransportBackend`` of ``backend`` ("UCX" / "TCP") that records its connections."""
    if backend.upper() == "TCP":
        return _RecordingTcp()
    if backend.upper() == "UCX":
        return _RecordingUcx(ucx_profile)
    raise ValueError(f"backend: must be UCX or TCP, got {backend!r}")


def same_host(address: str) -> bool:
    """Whether the server at ``host:port`` is on this host (loopback, or an address of one of
    this host's interfaces); a name counts when every address it resolves to does."""
    host, _ = parse_address(address)
    if is_loopback(host):
        return True
    try:
        ips = {str(i[4][0]) for i in socket.getaddrinfo(strip_brackets(host), None,
                                                       type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(ips) and all(is_local_address(ip.split("%")[0]) for ip in ips)


def _device_of(ip: str | None) -> str | None:
    """The network device holding address ``ip`` (Linux, from ``ip -o addr``), or None."""
    if not ip:
        return None
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        words = line.split()
        if len(words) > 3 and words[3].split("/")[0] == ip:
            return words[1].split("@")[0]
    return None


def _transports(backend: _Recording, address: str) -> dict[str, Any]:
    """What the client's connections to ``address`` run on (after its reads)."""
    if isinstance(backend, UcxBackend):
        info = dict(backend.describe())
        info["context_transports"] = info.pop("transports")
        report = next((r for c in backend.conns if (r := endpoint_report(c))), None)
        info.update(parse_endpoint_report(report) if report else {"lanes": [], "tag": []})
        return info
    host, _ = parse_address(address)
    source = route_source(host)
    return {"socket": "tcp", "source": source, "device": _device_of(source)}


def transports_line(result: dict[str, Any]) -> str:
    """One line naming what the transfer ran on."""
    t = result["transports"]
    if result["backend"] == "TCP":
        dev = f" on {t['device']}" if t.get("device") else ""
        return f"tcp socket from {t.get('source') or '?'}{dev} (the TCP backend)"
    lanes = ", ".join(t.get("lanes") or []) or "not reported"
    big = (t.get("tag") or [None])[-1]
    payload = (f"; payload messages ({big['sizes']} bytes): {big['protocol']} over "
               f"{big['transport']}" if big else "")
    return (f"UCX lanes {lanes}{payload} (profile {t.get('profile')}, UCX_TLS="
            f"{t.get('ucx_tls')}; context transports "
            f"{', '.join(t.get('context_transports') or []) or '?'})")


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    k = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[k]


def _failed(address: str, e: BaseException, blocks: ProbeBlocks) -> LinkCheckError:
    code = getattr(e, "code", "")
    if code == "unknown_lease":
        return LinkCheckError(
            f"{address} serves no test blocks of this shape (lease {blocks.lease_id}): give "
            f"both ends the same block flags ({' '.join(blocks.flags())})")
    if code == "unauthorized":
        return LinkCheckError(f"{address} refused the cluster token: give both ends the same "
                              f"--cluster-token (or $DISAGG_CLUSTER_TOKEN)")
    return LinkCheckError(f"cannot read test blocks from {address}: {e}")


def measure_link(address: str, blocks: ProbeBlocks, backend: str, token: str, *,
                 ucx_profile: str = "same_host", reps: int = DEFAULT_REPS,
                 latency_reads: int = DEFAULT_LATENCY_READS,
                 timeout_s: float = DEFAULT_TIMEOUT_S, memcpy: bool | None = None
                 ) -> dict[str, Any]:
    """Pull the test blocks of the server at ``address`` (module docstring) and return the
    measurement (no verdict: ``judge``). ``memcpy`` (None: when the server is on this host):
    time memcpy of the same bytes beside each read. ``LinkCheckError`` when a read fails."""
    import numpy as np
    import torch

    from disagg.transfer.base import ReadRequest, TransferError
    from disagg.transfer.payload import payload_shape
    from disagg.transfer.service import KVTransferClient

    local = same_host(address)
    memcpy = local if memcpy is None else memcpy
    rec = recording_backend(backend, ucx_profile)
    dtype = _torch_dtype(blocks.dtype)
    big = ReadRequest(blocks.lease_id, list(range(blocks.num_blocks)), (0, blocks.layers),
                      (0, blocks.kv_heads))
    small = ReadRequest(blocks.lease_id, [0], (0, 1), (0, 1))
    out = torch.empty(payload_shape(blocks.shape, big), dtype=dtype)
    small_out = torch.empty(payload_shape(blocks.shape, small), dtype=dtype)
    clients: list[KVTransferClient] = []
    try:
        checked = KVTransferClient(rec, token, timeout_s=timeout_s, integrity=True)
        clients.append(checked)
        fast = KVTransferClient(rec, token, timeout_s=timeout_s, integrity=False)
        clients.append(fast)
        try:
            checked.read(address, big, out).result(timeout_s)
            per_block = out.view(blocks.num_blocks, -1)
            want = (torch.arange(blocks.num_blocks) % PATTERN_MOD).to(dtype)
            if not (torch.equal(per_block.amin(1), want) and torch.equal(per_block.amax(1),
                                                                         want)):
                raise LinkCheckError(f"{address}: the blocks read are not the test blocks "
                                     f"(is it a `disagg doctor --serve-kv`?)")
            fast.read(address, big, out).result(timeout_s)  # its connection, warm
            src = out.view(torch.uint8).numpy().reshape(-1)
            dst = np.empty_like(src)
            if memcpy:
                np.copyto(dst, src)  # untimed: first touch (page faults are no memcpy)
            reads, copies = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                fast.read(address, big, out).result(timeout_s)
                t1 = time.perf_counter()
                reads.append(t1 - t0)
                if memcpy:
                    np.copyto(dst, src)
                    copies.append(time.perf_counter() - t1)
            fast.read(address, small, small_out).result(timeout_s)  # warm-up
            rtts = []
            for _ in range(latency_reads):
                t0 = time.perf_counter()
                fast.read(address, small, small_out).result(timeout_s)
                rtts.append(time.perf_counter() - t0)
        except TransferError as e:
            raise _failed(address, e, blocks) from None
        except TimeoutError as e:
            raise LinkCheckError(f"a read from {address} took over {timeout_s:g} s") from e
        transports = _transports(rec, address)
    finally:
        for client in clients:
            client.close()
    rtts.sort()
    median = statistics.median(reads)
    return {
        "address": address, "same_host": local, "backend": backend.upper(),
        "transports": transports, "blocks": asdict(blocks), "bytes": blocks.nbytes,
        "reps": reps, "read_ms": [round(r * 1e3, 3) for r in reads],
        "gbps": blocks.nbytes / median / 1e9,
        "best_gbps": blocks.nbytes / min(reads) / 1e9,
        "memcpy_gbps": blocks.nbytes / statistics.median(copies) / 1e9 if copies else None,
        "data_checked": True,
        "load": {"avg1": os.getloadavg()[0], "cores": os.cpu_count()},
        "latency": {"bytes": blocks.small_bytes, "reads": latency_reads,
                    "p50_ms": _percentile(rtts, 50) * 1e3,
                    "p99_ms": _percentile(rtts, 99) * 1e3},
    }


def judge(result: dict[str, Any], expected_gbps: float | None = None,
          min_share: float | None = None) -> dict[str, Any]:
    """``result`` with ``reference`` and ``verdict`` (module docstring): the expected link
    rate when given, else memcpy when measured over at least ``MEMCPY_MIN_BYTES``, else none
    (``unjudged``, ``reference.why`` says why)."""
    kind: str | None = None
    ref: float | None = None
    why = ""
    if expected_gbps is not None:
        kind, ref = "link", float(expected_gbps)
    elif not result.get("memcpy_gbps"):
        why = ("another host and no expected link rate: give --expected-link-gbps (YAML "
               "expected_link_gbps) to judge it")
    elif result["bytes"] < MEMCPY_MIN_BYTES:
        why = (f"reads of {result['bytes'] / 2**20:.3g} MiB are too small to judge against "
               f"memcpy (under {MEMCPY_MIN_BYTES >> 20} MiB, per-read costs dominate and "
               f"memcpy runs in the CPU's cache)")
    else:
        kind, ref = "memcpy", float(result["memcpy_gbps"])
    share = (MIN_SHARE[kind] if min_share is None else min_share) if kind else None
    achieved = result["gbps"] / ref if ref else None
    verdict = ("unjudged" if achieved is None or share is None else
               "ok" if achieved >= share else "slow")
    return {**result, "reference": {"kind": kind, "gbps": ref, "min_share": share,
                                    "share": achieved, "why": why},
            "verdict": verdict}


def verdict_line(result: dict[str, Any]) -> str:
    """The verdict in one line (what a log or a terminal shows last)."""
    if result.get("verdict") == "failed":
        return f"FAILED: {result.get('error')}"
    ref = result["reference"]
    what = ("the expected link rate" if ref["kind"] == "link" else
            "memcpy on this host" if ref["kind"] == "memcpy" else None)
    if what is None:
        return f"NOT JUDGED: {ref.get('why')}"
    text = (f"{result['gbps']:.3g} GB/s is {ref['share']:.1%} of {what} ({ref['gbps']:.3g} "
            f"GB/s); the minimum is {ref['min_share']:.0%}")
    return ("OK: " if result["verdict"] == "ok" else "SLOW: ") + text


def report_lines(result: dict[str, Any]) -> list[str]:
    """A human report of a judged result."""
    if result.get("verdict") == "failed":
        return [f"KV link check of {result.get('address')}: {verdict_line(result)}"]
    b = ProbeBlocks(**result["blocks"])
    lat = result["latency"]
    where = "this host" if result["same_host"] else "another host"
    lines = [
        f"KV link to {result['address']} ({where}), backend {result['backend']}",
        f"  transport  {transports_line(result)}",
        f"  blocks     {b.describe()}; data checked (checksum and content)",
        f"  bandwidth  {result['gbps']:.3g} GB/s (median of {result['reps']} reads; best "
        f"{result['best_gbps']:.3g} GB/s)",
        f"  latency    {lat['bytes'] / 1024:.3g} KiB reads: p50 {lat['p50_ms']:.3g} ms, p99 "
        f"{lat['p99_ms']:.3g} ms ({lat['reads']} reads)",
    ]
    if result.get("memcpy_gbps"):
        lines.append(f"  memcpy     {result['memcpy_gbps']:.3g} GB/s (the same bytes on this "
                     f"host, beside each read)")
    lines.append(f"  host       load average {result['load']['avg1']:.2f} (1 min) on "
                 f"{result['load']['cores']} cores")
    if result["reference"]["kind"] == "link":
        lines.append(f"  expected   {result['reference']['gbps']:.3g} GB/s link rate")
    lines.append(f"  verdict    {verdict_line(result)}")
    return lines


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """A judged result in a few keys (a worker's ``/server_info``)."""
    if result.get("verdict") == "failed":
        return {"verdict": "failed", "error": result.get("error")}
    ref = result["reference"]
    return {"verdict": result["verdict"], "gbps": round(result["gbps"], 4),
            "reference": ref["kind"], "reference_gbps": ref["gbps"] and round(ref["gbps"], 4),
            "min_share": ref["min_share"], "mib": round(result["bytes"] / 2**20, 1),
            "p50_ms": round(result["latency"]["p50_ms"], 4),
            "p99_ms": round(result["latency"]["p99_ms"], 4),
            "transport": transports_line(result)}


# ---- a pull in a process of its own -----------------------------------------------------------


def _child_env(token: str) -> dict[str, str]:
    """This environment, the token in it (never on a command line), and this ``disagg``
    first on ``PYTHONPATH`` (the child runs the same code)."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this disagg
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": token}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_peer_check(address: str, blocks: ProbeBlocks, backend: str, token: str, *,
                   ucx_profile: str = "same_host", reps: int = DEFAULT_REPS,
                   latency_reads: int = DEFAULT_LATENCY_READS,
                   timeout_s: float = DEFAULT_TIMEOUT_S,
                   expected_gbps: float | None = None, min_share: float | None = None
                   ) -> dict[str, Any]:
    """``disagg doctor --peer address --json`` in a child process: its judged report (a
    ``failed`` one when it could not read). ``LinkCheckError`` when it gave no report."""
    cmd = [sys.executable, "-m", "disagg.doctor", "--peer", address, "--backend",
           backend.lower(), "--ucx-profile", ucx_profile, *blocks.flags(), "--reps", str(reps),
           "--latency-reads", str(latency_reads), "--timeout", f"{timeout_s:g}", "--json"]
    if expected_gbps is not None:
        cmd += ["--expected-link-gbps", f"{expected_gbps:g}"]
    if min_share is not None:
        cmd += ["--min-share", f"{min_share:g}"]
    # Start-up (imports) plus the check's own reads, each bounded by timeout_s.
    limit = 120.0 + timeout_s * (reps + 3) + 0.5 * latency_reads
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=limit,
                            env=_child_env(token), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LinkCheckError(f"the pulling process did not finish in {limit:g} s") from None
    for line in reversed(cp.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    tail = (cp.stderr or cp.stdout).strip().splitlines()[-5:]
    raise LinkCheckError(f"the pulling process exited {cp.returncode} without a report: "
                         + " | ".join(tail))


def startup_link_check(backend: TransportBackend, kv_cache: torch.Tensor, token: str,
                       host: str, advertise_host: str | None = None, *,
                       reps: int = STARTUP_REPS, latency_reads: int = STARTUP_LATENCY_READS,
                       timeout_s: float = 60.0) -> dict[str, Any]:
    """A worker's ``--kv-link-check``: test blocks of ``kv_cache``'s layout (at most
    ``STARTUP_TOKENS`` tokens, host memory) served through ``backend`` (the worker's own: its
    UCX context) on ``host`` (an ephemeral port) and pulled by a child process over the
    worker's KV address (``advertise_host``), judged against memcpy. Logs the report (an ERROR
    when slow) and returns its ``summary``; ``LinkCheckError`` when the blocks could not be
    read."""
    blocks = ProbeBlocks.like_cache(kv_cache)
    profile = getattr(backend, "profile", "same_host")
    server = serve_probe_blocks(blocks, backend, token, host, 0, advertise_host)
    try:
        result = run_peer_check(server.address, blocks, backend.name, token,
                                ucx_profile=profile, reps=reps,
                                latency_reads=latency_reads, timeout_s=timeout_s)
    finally:
        server.stop()
    if result.get("verdict") == "failed":
        raise LinkCheckError(f"KV link check (--kv-link-check): {result.get('error')}")
    lines = report_lines(result)
    if result.get("verdict") == "slow":
        logger.error("KV link check (--kv-link-check) found a SLOW KV link:\n%s",
                     "\n".join(lines))
    else:
        logger.info("KV link check (--kv-link-check):\n%s", "\n".join(lines))
    return summary(result)
