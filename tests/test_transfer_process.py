"""KV transfer between two processes: a spawned context process serving its cache, this process
pulling. Covers byte-identity across processes, a SIGKILLed server restarted on the same port
(the cached connection is invalidated and the next read reaches the new server), and a server
that dies mid-transfer (the read fails, bounded, instead of hanging)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any

import pytest
import torch
from transfer_fixtures import BACKENDS, expected, same_bytes

from disagg.transfer import KVTransferClient, ReadRequest, TransferError
from disagg.transfer.payload import payload_shape

pytestmark = pytest.mark.slow

N, L, H, B, D = 64, 4, 4, 16, 64  # 128 KiB per float32 block: a real multi-MiB payload
TOKEN = "proc-secret"
WAIT = 20.0



def make_kv(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, L, 2, H, B, D, generator=g).to(dtype)


def _context_main(backend: str, seed: int, dtype: str, port: int,
                  cmds: Any, events: Any) -> None:
    """A context rank: serve a seeded cache; leases and faults on command."""

    from disagg.transfer import KVTransferServer, LeaseTable

    torch.set_num_threads(1)
    kv = make_kv(seed, getattr(torch, dtype))
    leases = LeaseTable(
        on_release=lambda lease, reason: events.put(("released", lease.lease_id, reason)))
    try:
        server = KVTransferServer(kv, leases, TOKEN, backend, port=port).start()
    except Exception as e:
        events.put(("error", repr(e)))
        return
    events.put(("address", server.address))
    while True:
        try:
            cmd = cmds.get(timeout=60)  # the parent is gone: exit
        except queue.Empty:
            break
        if cmd[0] == "lease":
            leases.create(*cmd[1:])
        elif cmd[0] == "die_mid_transfer":
            from disagg.transfer.tcp import TcpConnection
            from disagg.transfer.ucx import UcxConnection

            async def die(self: Any, views: Any, *_count: int) -> None:
                if isinstance(self, TcpConnection):  # a part of the bytes, then gone
                    data = views[0]
                    await self._send(memoryview(data).cast("B")[: data.nbytes // 3])
                # UCX: the header went out and the client waits for the payload when the
                # process vanishes. (Sending a part first is a race: over shared memory the
                # client may pull the whole message before the exit.)
                os._exit(17)

            TcpConnection.send_payload_iov = die  # type: ignore[method-assign]
            UcxConnection.send_payload_parts = die  # type: ignore[method-assign]
        elif cmd[0] == "stop":
            break
        events.put(("ok", cmd[0]))
    server.stop()


class ContextProcess:
    def __init__(self, ctx: Any, backend: str, seed: int, dtype: str, port: int = 0) -> None:
        self.cmds, self.events = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_context_main, daemon=True,
                                args=(backend, seed, dtype, port, self.cmds, self.events))
        self.proc.start()
        kind, self.address = self.events.get(timeout=60)
        assert kind == "address", self.address  # else: the child's startup error

    def call(self, *cmd: Any) -> None:
        self.cmds.put(cmd)
        assert self.events.get(timeout=WAIT) == ("ok", cmd[0])

    def event(self) -> tuple[Any, ...]:
        return self.events.get(timeout=WAIT)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_kill_restart_and_death_mid_transfer(backend: str) -> None:
    ctx = mp.get_context("spawn")  # never fork: a UCX context must be created after any fork
    procs: list[ContextProcess] = []
    client = KVTransferClient(backend, TOKEN, timeout_s=WAIT, connect_timeout_s=5.0)
    try:
        a = ContextProcess(ctx, backend, seed=1, dtype="float32")
        procs.append(a)
        kv_a = make_kv(1, torch.float32)
        frag = [40, 3, 17, 18, 19, 63, 0, 8]
        a.call("lease", "frag", frag, 1, 60.0)
        a.call("lease", "run", list(range(10, 30)), 1, 60.0)
        cases = [
            (ReadRequest("frag", frag, (1, 4), (1, 3)), False),
            (ReadRequest("frag", frag[:6], (0, L), (0, H), num_tokens=5 * B + 7,
                         format="tokens"), False),
            (ReadRequest("run", list(range(10, 30)), (0, L), (0, H)), True),
        ]
        for req, zero_copy in cases:
            out = torch.empty(payload_shape(tuple(kv_a.shape), req))
            res = client.read(a.address, req, out).result(WAIT)
            assert res.zero_copy == zero_copy
            assert same_bytes(out, expected(kv_a, req))
        assert client.release(a.address, "frag", "gen0").result(WAIT) is True
        assert a.event() == ("released", "frag", "confirmed")

        # SIGKILL the server; a new one (another cache, bf16) takes the same port.
        a.kill()
        port = int(a.address.rsplit(":", 1)[1])
        b = ContextProcess(ctx, backend, seed=2, dtype="bfloat16", port=port)
        procs.append(b)
        assert b.address == a.address
        kv_b = make_kv(2, torch.bfloat16)
        b.call("lease", "frag", frag, 1, 60.0)
        req = ReadRequest("frag", frag, (0, 3), (2, 4))
        out = torch.empty(payload_shape(tuple(kv_b.shape), req), dtype=torch.bfloat16)
        client.read(b.address, req, out).result(WAIT)  # stale cached connection replaced
        assert same_bytes(out, expected(kv_b, req))

        # The server dies while the payload is in flight: the read fails, it does not hang.
        b.call("lease", "big", list(range(N)), 1, 60.0)
        b.call("die_mid_transfer")
        big = ReadRequest("big", list(range(N)), (0, L), (0, H))
        out = torch.empty(payload_shape(tuple(kv_b.shape), big), dtype=torch.bfloat16)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as e:
            client.read(b.address, big, out).result(WAIT)
        assert e.value.code == "connection_failed", e.value
        assert time.monotonic() - t0 < 5.0  # detected, not the 20 s timeout
        b.proc.join(10)
        assert b.proc.exitcode == 17
        snap = client.stats.snapshot()
        assert snap.transfers == 4 and snap.failed_transfers == 1
    finally:
        client.close()
        for p in procs:
            p.kill()
