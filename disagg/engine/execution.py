"""How the engine runs steps: the model executor (one process, or rank 0 of several), the KV
connector over its cache, and a step that ran out of device memory re-run in smaller groups."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from disagg.config import EngineConfig
from disagg.kv_connector.base import KVConnector
from disagg.parallel.executor import DistributedExecutor
from disagg.runner import ModelRunner
from disagg.sampler import SamplerOutput
from disagg.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from disagg.kv_connector.settings import DisaggSettings

logger = logging.getLogger(__name__)


def release_device_cache() -> None:
    """Hand the caching allocator's unused blocks back (after an out-of-memory error)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def make_executor(config: EngineConfig, disagg: DisaggSettings | None = None
                  ) -> ModelRunner | DistributedExecutor:
    """The model executor: this process alone, or rank 0 of ``tp * pp`` rank processes.

    Both offer ``num_blocks``, ``kv_cache`` (this rank's), ``execute(sched) -> (sample request
    ids, logits [S, V])``, ``error`` (set once a rank died), ``rank_pids`` and ``shutdown()``.
    """
    if config.parallel.world_size == 1:
        return ModelRunner(config)
    return DistributedExecutor(config, disagg=disagg)


def build_connector(disagg: DisaggSettings, config: EngineConfig,
                    runner: ModelRunner | DistributedExecutor, wake: Callable[[], None]
                    ) -> KVConnector:
    """Rank 0's connector over rank 0's KV cache; the executor is its line to the other ranks
    (they built their part, ``RankTransfer``, when they started)."""
    from disagg.kv_connector.disagg_connector import make_connector
    from disagg.kv_connector.stream import install_hook

    peers = runner if isinstance(runner, DistributedExecutor) else None
    connector = make_connector(disagg, config, runner.kv_cache, wake, peers=peers)
    model = runner.runner.model if isinstance(runner, DistributedExecutor) else runner.model
    install_hook(model, connector.streams.progress)
    return connector


StepResult = tuple[list[str], SamplerOutput | None]  # (sampling request ids, their draws)


def run_isolating_oom(run_step: Callable[[SchedulerOutput], StepResult],
                      sched: SchedulerOutput
                      ) -> tuple[list[StepResult], list[tuple[str, str]]]:
    """The step ran out of device memory: run its requests again in halves, recursively,
    until each group fits; a single request that still does not fit fails alone.

        [r0 r1 r2 r3 r4 r5]  OOM
        [r0 r1 r2] ok   [r3 r4 r5] OOM
                        [r3] ok  [r4 r5] OOM
                                 [r4] OOM -> r4 fails   [r5] ok

    Re-running is safe: a group writes the same K/V into the same slots again. Groups keep
    the plan's order (decodes first), so each is a valid step on its own."""
    logger.warning("step of %d requests (%d tokens) ran out of device memory: retrying "
                   "in smaller groups", len(sched.scheduled), sched.num_scheduled_tokens)
    results: list[StepResult] = []
    failed: list[tuple[str, str]] = []

    def attempt(lo: int, hi: int) -> None:  # sched.scheduled[lo:hi]
        group = sched.scheduled[lo:hi]
        sub = replace(sched, scheduled=group,
                      num_decodes=max(0, min(hi, sched.num_decodes) - lo),
                      num_scheduled_tokens=sum(len(r.token_ids) for r in group),
                      kv_fetches=[])
        release_device_cache()
        try:
            results.append(run_step(sub))
            return
        except torch.cuda.OutOfMemoryError as e:
            if hi - lo == 1:
                r = group[0]
                failed.append((r.request_id, (
                    f"out of device memory: this request ({len(r.token_ids)} new tokens, "
                    f"{r.start_pos + len(r.token_ids)} in context) does not fit in the "
                    f"memory left on its own: {e}")))
                return
        mid = (lo + hi) // 2
        attempt(lo, mid)
        attempt(mid, hi)

    attempt(0, len(sched.scheduled))
    release_device_cache()
    return results, failed
