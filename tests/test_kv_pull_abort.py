"""Aborting a generation-only request while its KV is being received straight into its own
blocks (issue 19): the abort returns at once, and the engine frees the blocks only once the
transport can no longer write into them, so the next request that gets them never sees a
late write."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from disagg.config import build_engine_config
from disagg.contracts.kv_mode import ContextOnly, Pull
from disagg.contracts.params import ContextParams
from disagg.contracts.roles import Role
from disagg.engine import LLMEngine
from disagg.kv_connector.records import KVStatus
from disagg.kv_connector.settings import DisaggSettings
from disagg.request import SamplingParams
from disagg.transfer.tcp import TcpConnection

TOKEN = "abort-secret"
WAIT = 10.0


def _engine(model: str, role: Role) -> LLMEngine:
    cfg = build_engine_config(model, tokens_per_block=8, kv_cache_tokens=512)
    return LLMEngine(cfg, DisaggSettings(role, TOKEN, backend="TCP"))


def _run(eng: LLMEngine) -> list[Any]:
    outs = []
    for _ in range(50):
        outs += eng.service_transfers()
        if not eng.has_schedulable():
            break
        outs += eng.step()
    return outs


class _Both:
    """Quiet when both events are set; the transport sets the second."""

    def __init__(self, a: threading.Event, b: threading.Event) -> None:
        self.a, self.b = a, b

    def set(self) -> None:
        self.b.set()

    def is_set(self) -> bool:
        return self.a.is_set() and self.b.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.a.wait(timeout) and self.b.wait(timeout)


def _wait_for(cond: Any, timeout_s: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.01)
    return True


def test_abort_mid_pull_frees_blocks_only_after_the_read_stopped(
        tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_checkpoint(seed=1)
    ctx, gen = _engine(model, Role.CONTEXT), _engine(model, Role.GENERATION)
    try:
        prompt = list(range(3, 60))  # 57 tokens: 8 blocks of 8
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        ctx.add_request("c", prompt, params, mode=ContextOnly())
        [out] = _run(ctx)
        remote = ContextParams.from_dict(out.disaggregated_params, prompt)

        go, stalled, sent = threading.Event(), threading.Event(), threading.Event()

        async def stall(self: TcpConnection, views: Any) -> None:
            first = views[0]
            await self._send(memoryview(first).cast("B")[: first.nbytes // 2])
            stalled.set()
            await asyncio.get_running_loop().run_in_executor(None, go.wait, WAIT)
            try:
                for v in views:
                    await self._send(memoryview(v).cast("B"))
            finally:
                sent.set()

        monkeypatch.setattr(TcpConnection, "send_payload_iov", stall)
        gen.add_request("g", prompt, params, mode=Pull(remote, trusted=False))
        gen.step()  # allocates the blocks and starts the pull
        assert stalled.wait(WAIT)
        state = gen.connector.request_state("g")  # type: ignore[attr-defined]
        assert state is not None and state.status is KVStatus.PULLING
        [read] = state.reads
        assert read.direct  # same layout: the payload lands in the request's blocks
        kv = gen.runner.kv_cache
        # The transport unwinds slowly (a UCX endpoint abort may take seconds): quiet only
        # once the real read stopped and the test opens the gate.
        gate, real = threading.Event(), read.future.quiet
        read.future.quiet = _Both(gate, real)
        out = gen.abort_request("g")  # returns without waiting for the transport
        assert out is not None and out.finished and not gate.is_set()
        stopping = gen.connector.request_state("g")  # type: ignore[attr-defined]
        assert stopping is not None and stopping.status is KVStatus.STOPPING
        used = gen.stats().kv_blocks_used
        assert used == 8  # out of the pool while they may still be written
        _run(gen)
        assert gen.stats().kv_blocks_used == used
        gate.set()
        assert _wait_for(lambda: (gen.service_transfers(),
                                  gen.stats().kv_blocks_used == 0)[1])
        assert real.is_set()  # freed, and no write can land any more
        assert gen.connector.request_state("g") is None  # type: ignore[attr-defined]
        snapshot = kv.clone()
        go.set()  # the rest of the payload goes out now, into a closed connection
        assert sent.wait(WAIT)
        assert torch.equal(kv, snapshot)
    finally:
        go.set()
        gen.shutdown()
        ctx.shutdown()
