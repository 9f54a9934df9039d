"""Aborting a generation-only request while its KV is being received straight into its own
blocks (issue 19): the engine frees the blocks only once the transport can no longer write
into them, so the next request that gets them never sees a late write."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from disagg.config import build_engine_config
from disagg.engine import LLMEngine
from disagg.kv_connector.settings import DisaggSettings
from disagg.request import SamplingParams
from disagg.roles import Role
from disagg.transfer.params import ContextParams
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


def test_abort_mid_pull_frees_blocks_only_after_the_read_stopped(
        tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_checkpoint(seed=1)
    ctx, gen = _engine(model, Role.CONTEXT), _engine(model, Role.GENERATION)
    try:
        prompt = list(range(3, 60))  # 57 tokens: 8 blocks of 8
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        ctx.add_request("c", prompt, params, context_only=True)
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
        gen.add_request("g", prompt, params, remote=remote)
        gen.step()  # allocates the blocks and starts the pull
        assert stalled.wait(WAIT)
        [read] = gen.connector._fetches["g"].reads  # type: ignore[attr-defined]
        assert read.direct  # same layout: the payload lands in the request's blocks
        kv = gen.runner.kv_cache
        out = gen.abort_request("g")
        assert out is not None and out.finished and read.future.quiet.is_set()
        assert gen.stats().kv_blocks_used == 0  # freed, and no write can land any more
        snapshot = kv.clone()
        go.set()  # the rest of the payload goes out now, into a closed connection
        assert sent.wait(WAIT)
        assert torch.equal(kv, snapshot)
    finally:
        go.set()
        gen.shutdown()
        ctx.shutdown()
